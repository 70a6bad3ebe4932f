"""The kinds of KV-cache group and their rules: one row per kind, the only place that says how
a kind differs from another.

Lookup, load and store, the vLLM adapter, the demo engine and the tests ask `KIND_RULES`
instead of testing the kind, so a new kind is a new row (and its tests). Pure values only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from kvferry.core.config import GroupSpec


class GroupKind(enum.Enum):
    """How a KV-cache group's layers use earlier tokens; `KIND_RULES` holds what each means."""

    FULL_ATTENTION = "full_attention"
    """Every earlier token (MLA included)."""
    SLIDING_WINDOW = "sliding_window"
    """Only the tokens of the last `sliding_window` positions (and, when an engine retains
    them, `extra_retained_tokens` more below)."""
    MAMBA = "mamba"
    """Only the recurrent state after the previous token."""
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    """Only the earlier tokens of its own attention chunk (`attention_chunk_size` tokens,
    aligned to the start of the request), as Llama 4's local layers."""


class Scan(enum.Enum):
    """How a lookup finds the largest boundary, at or below a candidate, valid for one group."""

    PREFIX = "prefix"
    """Valid up to the first chunk the tier lacks: one scan from the GPU prefix upwards, and
    valid at every lower boundary too, so never examined again."""
    WINDOW = "window"
    """Valid where the run of chunks ending at the boundary is complete: a scan from the right,
    examined again whenever another group moves the boundary down."""
    ATTENTION_CHUNK = "attention_chunk"
    """Valid where every chunk from the start of the boundary's attention chunk is present,
    and always at such a start (nothing is needed there): a prefix scan from that start,
    examined again whenever another group moves the boundary down."""


@attrs.frozen(kw_only=True)
class KindRule:
    """What one `GroupKind` means for planning."""

    parameters: tuple[str, ...]
    """The `GroupSpec` fields this kind requires (integers >= 1)."""
    optional_parameters: tuple[str, ...] = ()
    """The `GroupSpec` fields this kind may set (integers >= 0, default 0); every field of
    neither list keeps its default."""
    first_needed_token: Callable[[GroupSpec, int], int]
    """`(spec, t) -> first`: to compute token `t` (and on), the group needs tokens
    `[first, t)` and nothing below `first`. An engine frees (nulls) the blocks wholly below
    `first` once `t` tokens are computed, so it is also where null blocks end."""
    window_tokens: Callable[[GroupSpec], int] | None
    """`spec -> tokens`: the most tokens before `t` the group ever needs; None when it needs
    every earlier token. For a kind scanned as a window it is exactly what it needs wherever
    `t` is far enough from the start (`first_needed_token` is then `t - window_tokens`)."""
    scan: Scan
    """How a lookup finds this group's largest valid boundary."""
    boundary_on_grid: bool
    """The group resumes only at its own chunk ends (what it holds exists only there)."""
    recurrent_state: bool
    """A block holds one state of the whole prefix rather than the KV of its own tokens."""
    restarts: Callable[[GroupSpec], int] | None = None
    """`spec -> tokens`: the group needs no earlier token at every multiple of this (its
    attention restarts there); None when it never does."""

    @property
    def windowed(self) -> bool:
        """Return True when the group needs only some earlier tokens (null blocks below them
        are expected): its boundary must be exactly where the engine resumes."""
        return self.window_tokens is not None


def _every_earlier_token(spec: GroupSpec, t: int) -> int:
    return 0


def _window_tokens(spec: GroupSpec) -> int:
    # Token t attends to itself and the w - 1 tokens before it; an engine that retains extra
    # tokens below the window (several draft modules re-prefill them) keeps their blocks too.
    return (spec.sliding_window or 1) - 1 + spec.extra_retained_tokens


def _window_start(spec: GroupSpec, t: int) -> int:
    return max(0, t - _window_tokens(spec))


def _state_tokens(spec: GroupSpec) -> int:
    return 1


def _state_start(spec: GroupSpec, t: int) -> int:
    # The state after token t - 1 lives in that token's block.
    return max(0, t - 1)


def _attention_chunk_tokens(spec: GroupSpec) -> int:
    return (spec.attention_chunk_size or 1) - 1


def _attention_chunk_size(spec: GroupSpec) -> int:
    return spec.attention_chunk_size or 1


def _attention_chunk_start(spec: GroupSpec, t: int) -> int:
    return t - t % _attention_chunk_size(spec)


KIND_RULES: dict[GroupKind, KindRule] = {
    GroupKind.FULL_ATTENTION: KindRule(
        parameters=(),
        first_needed_token=_every_earlier_token,
        window_tokens=None,
        scan=Scan.PREFIX,
        boundary_on_grid=False,
        recurrent_state=False,
    ),
    GroupKind.SLIDING_WINDOW: KindRule(
        parameters=("sliding_window",),
        optional_parameters=("extra_retained_tokens",),
        first_needed_token=_window_start,
        window_tokens=_window_tokens,
        scan=Scan.WINDOW,
        boundary_on_grid=False,
        recurrent_state=False,
    ),
    GroupKind.MAMBA: KindRule(
        parameters=(),
        first_needed_token=_state_start,
        window_tokens=_state_tokens,
        scan=Scan.WINDOW,
        boundary_on_grid=True,
        recurrent_state=True,
    ),
    GroupKind.CHUNKED_LOCAL_ATTENTION: KindRule(
        parameters=("attention_chunk_size",),
        first_needed_token=_attention_chunk_start,
        window_tokens=_attention_chunk_tokens,
        scan=Scan.ATTENTION_CHUNK,
        boundary_on_grid=False,
        recurrent_state=False,
        restarts=_attention_chunk_size,
    ),
}
"""The rules table: one row per kind; `tests/test_kinds.py` checks every row against its
documented meaning."""

PARAMETER_DEFAULTS: dict[str, int | None] = {
    "sliding_window": None,
    "extra_retained_tokens": 0,
    "attention_chunk_size": None,
}
"""Every kind parameter a `GroupSpec` has, with the value it keeps when its kind does not use
it."""
