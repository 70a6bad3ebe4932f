"""Which boundaries a lookup can answer, and so which chunks of a windowed group are worth
storing: those that lie in the window of some such boundary.

A lookup's answer, when the tier holds every chunk of a prefix the request shares, is the
smallest of a few limits, each the end of some group's last chunk inside a prefix (or, for a
group whose attention restarts, such a restart), after groups that resume only on their own
grid (Mamba) and groups whose attention restarts have moved it down to where they can resume.
So it lies on some group's grid. A limit on group `g`'s grid at `v` can be the smallest only
when every group that needs chunks at every boundary ends a chunk in `[v, v + C_g)` too (else
its own limit would lie below `v`). The prompt's last token, where a lookup also stops, is on
a grid too unless the prompt is a multiple of every chunk size; that one boundary is left out
on purpose (the request then resumes one chunk lower), as vLLM's offloading connector does.

Everything repeats every `lcm` of the chunk sizes and restart periods, so the answer is a set of
residues, computed once per configuration. Pure arithmetic on the configuration.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvferry.core.config import GroupSpec

MAX_PERIOD = 1 << 16
"""Configurations whose grids repeat only after more tokens than this keep every chunk."""

KeptChunks = tuple[int, frozenset[int]] | None
"""Per group: `(period, residues)`, a chunk `j` being kept when `j % period` is a residue;
None when every chunk is kept."""


def _restart(spec: GroupSpec) -> int | None:
    restarts = spec.rule.restarts
    return None if restarts is None else restarts(spec)


def _reads_at_every_boundary(spec: GroupSpec) -> bool:
    """Return True when the group needs some chunk at every boundary past the start."""
    window = spec.rule.window_tokens
    return _restart(spec) is None and (window is None or window(spec) >= 1)


def reachable_boundaries(
    specs: Sequence[GroupSpec], chunks: Sequence[int]
) -> tuple[int, set[int]] | None:
    """Return `(period, boundaries)`: every boundary a lookup can answer (see the module) is
    `b` with `b % period` in `boundaries` (0 standing for `period`); None beyond MAX_PERIOD."""
    steps = [*chunks, *(r for r in map(_restart, specs) if r is not None)]
    period = math.lcm(*steps)
    if period > MAX_PERIOD:
        return None
    reading = [c for spec, c in zip(specs, chunks, strict=True) if _reads_at_every_boundary(spec)]
    found: set[int] = set()
    for spec, chunk in zip(specs, chunks, strict=True):
        restart = _restart(spec)
        for step in (chunk,) if restart is None else (chunk, restart):
            for v in range(step, period + 1, step):
                if all(-(-v // c) * c < v + chunk for c in reading):
                    found.add(v)
    # What groups that resume only on their grid, or at their restarts, make of those limits.
    snaps = [c for spec, c in zip(specs, chunks, strict=True) if spec.rule.boundary_on_grid]
    snaps += [r for r in map(_restart, specs) if r is not None]
    todo = list(found)
    while todo:
        v = todo.pop()
        for step in snaps:
            lower = v - v % step
            if lower and lower not in found:
                found.add(lower)
                todo.append(lower)
    # An answer lies on the grid of every group that resumes only there.
    grid = math.lcm(
        *(c for spec, c in zip(specs, chunks, strict=True) if spec.rule.boundary_on_grid)
    )
    return period, {v % period for v in found if v % grid == 0}


def kept_chunks(specs: Sequence[GroupSpec], chunks: Sequence[int]) -> tuple[KeptChunks, ...]:
    """Return, per group, which of its chunks lie in the window of a boundary a lookup can
    answer (`KeptChunks`); every chunk of a full-attention group is kept."""
    windowed = [spec.rule.windowed for spec in specs]
    if not any(windowed):
        return tuple(None for _ in specs)
    reach = reachable_boundaries(specs, chunks)
    if reach is None:
        return tuple(None for _ in specs)
    period, boundaries = reach
    out: list[KeptChunks] = []
    for spec, chunk, is_windowed in zip(specs, chunks, windowed, strict=True):
        window = spec.rule.window_tokens
        if not is_windowed or window is None:
            out.append(None)
            continue
        # Look at one period of chunks far enough from the start that no window is cut short,
        # and at every boundary whose window can reach into it.
        per = period // chunk
        base = (window(spec) // period + 1) * period
        span = -(-(window(spec) + chunk) // period) + 1
        kept: set[int] = set()
        for residue in boundaries:
            for turn in range(span + 1):
                b = base + (residue or period) + turn * period
                if spec.rule.boundary_on_grid and b % chunk:
                    continue
                first = spec.first_needed_token(b)
                for j in range(first // chunk, -(-b // chunk)) if first < b else ():
                    if base // chunk <= j < base // chunk + per:
                        kept.add(j % per)
        out.append(None if len(kept) == per else (per, frozenset(kept)))
    return tuple(out)
