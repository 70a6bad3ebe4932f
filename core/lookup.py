"""Lookup: how many tokens past the GPU prefix every KV-cache group can take from the CPU tier.

Pure: the tier is consulted only through a read-only KeyStatusView; nothing is reserved here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import attrs

from kvferry.core.checks import check_count
from kvferry.core.config import GroupSpec, OffloadConfig
from kvferry.core.errors import InvalidInputError
from kvferry.core.keys import HashStatusView, KeyChain, KeyStatus, KeyStatusView, OffloadKey
from kvferry.core.kinds import KindRule, Scan
from kvferry.core.state import RequestState


@attrs.frozen(kw_only=True)
class LookupResult:
    """The answer of a lookup: a number of tokens to load, or *retry later*."""

    tokens: int = 0
    """Tokens past `num_computed_tokens` that the CPU tier can supply (0: nothing worth it)."""
    retry: bool = False
    """True when a key the answer needs is still being written or loaded: ask again later."""

    def __attrs_post_init__(self) -> None:
        if self.tokens < 0 or (self.retry and self.tokens):
            raise InvalidInputError(
                field="tokens",
                expected="tokens >= 0, and 0 when retry is set",
                got=(self.tokens, self.retry),
            )


NOTHING = LookupResult()
RETRY = LookupResult(retry=True)


class _GroupStatuses:
    """Statuses of one group's keys, fetched lazily from the view as one growing interval."""

    def __init__(self, view: KeyStatusView, keys: Sequence[OffloadKey]) -> None:
        self._view = view
        self._keys = keys
        self._lo = self._hi = 0
        self._values: list[KeyStatus] = []
        self._ask = self._ask_by_hash if _by_hash(view, keys) else self._ask_by_key

    def _ask_by_key(self, lo: int, hi: int) -> Sequence[KeyStatus]:
        return self._view.statuses(self._keys[lo:hi])

    def _ask_by_hash(self, lo: int, hi: int) -> Sequence[KeyStatus]:
        chain = cast(KeyChain, self._keys)
        view = cast(HashStatusView, self._view)
        width = max(chain.hash_width, 0)  # the chain's hashes all have it (-1: they differ)
        return view.hash_statuses(chain.group, chain.hash_slice(lo, hi), width=width)

    def fetch(self, lo: int, hi: int) -> None:
        """Make the statuses of chunks `[lo, hi)` available, asking the view once per gap."""
        if lo >= hi:
            return
        if not self._values:
            self._lo, self._hi = lo, lo
        if lo < self._lo:
            self._values[:0] = self._ask(lo, self._lo)
            self._lo = lo
        if hi > self._hi:
            self._values.extend(self._ask(self._hi, hi))
            self._hi = hi

    def __getitem__(self, chunk: int) -> KeyStatus:
        return self._values[chunk - self._lo]

    def first_miss(self, lo: int, hi: int) -> int:
        """Return the first fetched chunk in `[lo, hi)` that is a miss, or `hi` if none is."""
        if self._all_hits(lo, hi):
            return hi
        try:
            return self._values.index(KeyStatus.MISS, lo - self._lo, hi - self._lo) + self._lo
        except ValueError:
            return hi

    def any_pending(self, lo: int, hi: int) -> bool:
        """Return True when a fetched chunk in `[lo, hi)` is pending."""
        lo, hi = max(lo, self._lo), min(hi, self._hi)
        if lo >= hi:  # none fetched there (an offset below `_lo` would index from the end)
            return False
        if self._all_hits(lo, hi):
            return False
        return KeyStatus.PENDING in self._values[lo - self._lo : hi - self._lo]

    def _all_hits(self, lo: int, hi: int) -> bool:
        """Return True when every fetched status in `[lo, hi)` is HIT: a count by identity,
        several times faster than comparing each status with MISS or PENDING (and the common
        answer for a long prompt); no copy when the range is everything fetched."""
        whole = lo <= self._lo and hi >= self._hi
        values = self._values if whole else self._values[lo - self._lo : hi - self._lo]
        return values.count(KeyStatus.HIT) == len(values)


def _by_hash(view: KeyStatusView, keys: Sequence[OffloadKey]) -> bool:
    """Return True when the view can be asked by hash for `keys` (a request's key chain)."""
    return isinstance(keys, KeyChain) and len(keys) > 0 and isinstance(view, HashStatusView)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@attrs.frozen(kw_only=True)
class _Group:
    """The per-group facts a lookup needs, computed once."""

    index: int
    spec: GroupSpec
    rule: KindRule
    chunk: int
    window_tokens: int
    """The most tokens before a boundary the group needs (`KindRule.window_tokens`); 0 for
    full attention."""
    window_chunks: int
    start: int
    num_keys: int

    def needed_chunks(self, boundary: int) -> tuple[int, int]:
        """Return the chunk range `[lo, hi)` this group must read to resume at `boundary`
        (snapped down to its chunk grid first when it resumes only there): the chunks holding
        its needed tokens, less those wholly below the GPU prefix's chunk."""
        if self.rule.boundary_on_grid:
            boundary -= boundary % self.chunk
        end = _ceil_div(boundary, self.chunk)
        first_token = self.spec.first_needed_token(boundary)
        if first_token >= boundary:
            return end, end
        return max(self.start, first_token // self.chunk), end


def _scan_prefix(group: _Group, statuses: _GroupStatuses, boundary: int) -> int:
    """Return the boundary after a prefix scan: chunks count from `start` up to the first miss."""
    end = _ceil_div(boundary, group.chunk)
    statuses.fetch(group.start, end)
    return min(boundary, statuses.first_miss(group.start, end) * group.chunk)


def _scan_window(group: _Group, statuses: _GroupStatuses, boundary: int) -> int:
    """Return the largest boundary `<= boundary` at which the group's window is complete.

    Candidates are `boundary` itself (it needs the chunks overlapping its window, which can be
    `W + 1` when it is off this group's grid) and then grid boundaries `k * C` for decreasing
    `k`, which need chunks `[k - W, k)`; chunks below `start` are on the GPU already.
    """
    top_lo, end = group.needed_chunks(boundary)
    if group.rule.boundary_on_grid:
        boundary = end * group.chunk  # e.g. a Mamba state exists only at its own chunk ends
    if top_lo >= end:
        return boundary  # the group needs no chunk from the tier here
    start, w = group.start, group.window_chunks
    fetched = end
    run_top = end
    for chunk in range(end - 1, start - 1, -1):
        if chunk < fetched:  # fetch from the right in doubling spans: most answers are near
            fetched = max(start, chunk + 1 - 2 * max(end - chunk, w + 1))
            statuses.fetch(fetched, end)
        if statuses[chunk] is KeyStatus.MISS:
            run_top = chunk
            continue
        if run_top == end and chunk <= top_lo:
            return boundary
        candidate = min(run_top, end - 1)
        if chunk <= max(start, candidate - w):
            return candidate * group.chunk
    return start * group.chunk


def _scan_attention_chunk(group: _Group, statuses: _GroupStatuses, boundary: int) -> int:
    """Return the largest boundary `<= boundary` at which the group has every chunk holding
    the boundary's attention chunk so far: up to the first chunk missing from that chunk's
    start (a prefix scan from there), or else that start itself, which needs nothing."""
    lo, end = group.needed_chunks(boundary)
    if lo >= end:
        return boundary
    statuses.fetch(lo, end)
    miss = statuses.first_miss(lo, end)
    if miss == end:
        return boundary
    return max(group.spec.first_needed_token(boundary), miss * group.chunk)


def lookup(
    config: OffloadConfig,
    state: RequestState,
    *,
    num_tokens: int,
    num_computed_tokens: int,
    tier: KeyStatusView,
) -> LookupResult:
    """Return how many tokens past `num_computed_tokens` can be loaded for every group.

    The answer is the largest boundary `b` at which every group can resume: each group needs
    the chunks holding the tokens its kind needs to compute token `b` (`KIND_RULES`), from the
    chunk the GPU prefix ends inside on; none passes the end of a group's last complete chunk.
    The boundary starts at `num_tokens`, less one when a group needs only some earlier tokens
    (the engine recomputes the last prompt token, so the hit must be valid exactly there).
    Groups scanned as a prefix go first (their answer stays valid below it); the others are
    examined again, widest first, until the boundary stops moving. A group examined where less
    than one of its chunks remains to gain makes the answer 0. Pending keys count as hits while
    the boundary is found; the answer is *retry* when that boundary needs a pending key.
    """
    state.check_matches(config)
    check_count(num_tokens, request=state.request_id, field="num_tokens")
    check_count(num_computed_tokens, request=state.request_id, field="num_computed_tokens")
    if not 0 <= num_computed_tokens <= num_tokens:
        raise InvalidInputError(
            request=state.request_id,
            field="num_computed_tokens",
            expected=f"an integer in [0, num_tokens={num_tokens}]",
            got=num_computed_tokens,
        )
    groups = []
    for g, spec in enumerate(config.groups):
        rule = spec.rule
        groups.append(
            _Group(
                index=g,
                spec=spec,
                rule=rule,
                chunk=config.chunk_tokens(g),
                window_tokens=0 if rule.window_tokens is None else rule.window_tokens(spec),
                window_chunks=config.window_chunks(g),
                start=num_computed_tokens // config.chunk_tokens(g),
                num_keys=len(state.keys[g]),
            )
        )
    statuses = [_GroupStatuses(tier, keys) for keys in state.keys]
    scans = {
        Scan.PREFIX: _scan_prefix,
        Scan.WINDOW: _scan_window,
        Scan.ATTENTION_CHUNK: _scan_attention_chunk,
    }
    prefix = [g for g in groups if g.rule.scan is Scan.PREFIX]
    # Widest windows first: they are the likeliest to shrink the boundary for the others.
    others = sorted(
        (g for g in groups if g.rule.scan is not Scan.PREFIX),
        key=lambda g: (-g.window_tokens, g.rule.boundary_on_grid, g.index),
    )

    boundary = num_tokens - (1 if config.has_windowed_group else 0)

    def examine(group: _Group, scan: Callable[[_Group, _GroupStatuses, int], int]) -> int | None:
        clamped = min(boundary, group.num_keys * group.chunk)
        if clamped - num_computed_tokens < group.chunk:
            return None
        found = scan(group, statuses[group.index], clamped)
        if found - num_computed_tokens < group.chunk:
            return None
        return found

    for group in prefix:
        found = examine(group, _scan_prefix)
        if found is None:
            return NOTHING
        boundary = found
    valid_at: dict[int, int] = {}
    while any(valid_at.get(g.index) != boundary for g in others):
        for group in others:
            if valid_at.get(group.index) == boundary:
                continue
            found = examine(group, scans[group.rule.scan])
            if found is None:
                return NOTHING
            boundary = found
            valid_at[group.index] = boundary

    for group in groups:
        if statuses[group.index].any_pending(*group.needed_chunks(boundary)):
            return RETRY
    return LookupResult(tokens=boundary - num_computed_tokens)
