"""Hypothesis strategies for the planner's property tests: random hybrid configurations,
requests, CPU tiers, and the block tables an engine would hand the planner.

Test code only: it builds inputs and a fake tier; the one planner call it makes (a lookup, to
know how many tokens a load accepts) mirrors what an engine does before it allocates blocks.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import attrs
import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from kvferry.core import (
    GroupBlocks,
    GroupKind,
    GroupSpec,
    KeyStatus,
    OffloadConfig,
    OffloadKey,
    RequestState,
    lookup,
    new_request_state,
)
from kvferry.core.kinds import KIND_RULES

HIT, MISS, PENDING = KeyStatus.HIT, KeyStatus.MISS, KeyStatus.PENDING

NULL_BLOCK_ID = 0
"""The id an engine gives its shared null block (real blocks get ids >= 1 here)."""

Mix = tuple[tuple[KeyStatus, int], ...]
"""How often each status is drawn, in 256ths; the first one is what examples shrink to."""

# Lookups need mostly hits to find anything, stores mostly misses to have something to write;
# every mix keeps every status possible.
LOOKUP_MIXES: tuple[Mix, ...] = (  # dense tiers let several groups agree; sparse ones break runs
    ((HIT, 236), (MISS, 12), (PENDING, 8)),
    ((HIT, 200), (MISS, 36), (PENDING, 20)),
    ((HIT, 128), (MISS, 96), (PENDING, 32)),
)
LOAD_MIX: Mix = ((HIT, 232), (MISS, 16), (PENDING, 8))
STORE_MIX: Mix = ((MISS, 152), (HIT, 52), (PENDING, 52))


def ceil_div(a: int, b: int) -> int:
    """Return `ceil(a / b)` for integers (b > 0)."""
    return -(-a // b)


class FakeTier:
    """A fixed CPU tier: a status per key (MISS when absent) and a number of free rows."""

    def __init__(self, status: Mapping[OffloadKey, KeyStatus], free_rows: int | None) -> None:
        self.status = dict(status)
        self.free_rows = free_rows

    def statuses(self, keys: Sequence[OffloadKey]) -> list[KeyStatus]:
        """Return the status of each key, in order."""
        return [self.status.get(key, MISS) for key in keys]

    def can_reserve(self, keys: Sequence[OffloadKey]) -> bool:
        """Return True when the keys the tier lacks fit in its free rows (all or nothing)."""
        missing = {key for key in keys if self.status.get(key, MISS) is MISS}
        return self.free_rows is None or len(missing) <= self.free_rows

    def has_pending(self, keys: Iterable[OffloadKey]) -> bool:
        """Return True when any of `keys` is pending."""
        return any(self.status.get(key, MISS) is PENDING for key in keys)

    def settled(self) -> FakeTier:
        """Return the tier after every pending key became readable."""
        return FakeTier(
            {key: HIT if s is PENDING else s for key, s in self.status.items()}, self.free_rows
        )

    def __repr__(self) -> str:
        named = {str(key): s.name for key, s in sorted(self.status.items())}
        return f"FakeTier({named}, free_rows={self.free_rows})"

    def copy_reordered(self) -> FakeTier:
        """Return an equal tier whose dictionary was filled in the opposite order."""
        return FakeTier(dict(reversed(list(self.status.items()))), self.free_rows)


@dataclass(frozen=True)
class LookupCase:
    """A request as lookup sees it: the state, its length, its GPU prefix, the tier."""

    config: OffloadConfig
    state: RequestState
    num_tokens: int
    num_computed_tokens: int
    tier: FakeTier


@dataclass(frozen=True)
class LoadCase:
    """A lookup case after the engine accepted the lookup's answer and allocated blocks."""

    lookup: LookupCase
    hit_tokens: int
    """The tokens the lookup found (always > 0: an engine asks for no load of nothing)."""
    num_scheduled_tokens: int
    """Tokens this step computes past the hit; blocks are allocated for them too."""
    blocks: tuple[GroupBlocks, ...]


@dataclass(frozen=True)
class StoreCase:
    """One step of a running request, as store planning sees it."""

    config: OffloadConfig
    state: RequestState
    blocks: tuple[GroupBlocks, ...]
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_tokens: int
    tier: FakeTier

    @property
    def done(self) -> int:
        """Return the tokens whose KV exists after this step, capped at the request's tokens
        (at its prompt when decoded tokens are not stored)."""
        limit = self.num_tokens
        if not self.config.store_decoded_tokens:
            limit = min(limit, self.state.num_prompt_tokens)
        return min(self.num_computed_tokens + self.num_scheduled_tokens, limit)


_KINDS = tuple(GroupKind)
PARAMETER_SPANS: dict[str, int] = {
    "sliding_window": 3,
    "extra_retained_tokens": 1,
    "attention_chunk_size": 3,
}
"""Per kind parameter, how many chunks (plus a token or two) its drawn values span: from 1
(0 for an optional one) up to that, on and off the chunk grid."""
_CONFIG_BYTES = 2 + 3 * 4


def _config(data: bytes) -> OffloadConfig:
    """Build a configuration from `_CONFIG_BYTES` bytes (few draws, uniform kinds and group
    counts; zero bytes shrink towards one full-attention group with the smallest blocks and
    parameters)."""
    hash_block_size = 1 + data[0] % 2
    blocks_per_chunk = 1 + data[0] // 2 % 4
    store_decoded_tokens = not data[0] // 8 % 2
    specs = []
    for g in range(1 + data[1] % 4):
        shape, required, optional = data[2 + 3 * g : 5 + 3 * g]
        kind, multiple = _KINDS[shape % len(_KINDS)], 1 + shape // len(_KINDS) % 4
        block_size = hash_block_size * multiple
        chunk = blocks_per_chunk * block_size
        rule = KIND_RULES[kind]
        parameters = {
            name: 1 + required * (PARAMETER_SPANS[name] * chunk + 1) // 255
            for name in rule.parameters
        }
        parameters |= {  # half the draws leave an optional parameter at 0
            name: max(0, optional - 128) * (PARAMETER_SPANS[name] * chunk + 1) // 127
            for name in rule.optional_parameters
        }
        specs.append(GroupSpec(kind=kind, block_size=block_size, **parameters))
    return OffloadConfig(
        hash_block_size=hash_block_size,
        blocks_per_chunk=blocks_per_chunk,
        groups=tuple(specs),
        store_decoded_tokens=store_decoded_tokens,
    )


_CONFIGS = st.binary(min_size=_CONFIG_BYTES, max_size=_CONFIG_BYTES).map(_config)


def configs() -> st.SearchStrategy[OffloadConfig]:
    """Return 1-4 groups of mixed kinds; block sizes are multiples of a random hash block size.

    Block sizes within one configuration differ by at most 4x, so the finest group of a request
    has a bounded number of keys (the tests stay fast) while chunk grids still disagree.
    """
    return _CONFIGS


# Draws with fixed bounds: hypothesis mutates examples by replaying their choices, and a draw
# whose bounds depend on earlier draws then often stops fitting (the example is thrown away).
MAX_KEYS = 80
"""Keys of one request at most: 4 groups, 5 chunks of the coarsest, block sizes within 4x."""
_UNIT = st.binary(min_size=2, max_size=2)
_BITS = st.integers(0, 1)
_SEEDS = st.integers(0, 2**16)
_CURSOR_BYTES = st.binary(min_size=4, max_size=4)
_TIER_BYTES = st.binary(min_size=MAX_KEYS, max_size=MAX_KEYS)
_FREE_ROWS = st.one_of(st.none(), st.integers(0, 6))
_LOOKUP_MIX = st.sampled_from(LOOKUP_MIXES)


def _between(
    draw: st.DrawFn, low: int, high: int, *, skew: bool = False, from_high: bool = False
) -> int:
    """Return an integer in `[low, high]`, both reachable.

    Hypothesis draws small values (and zero bytes) often, and shrinks towards them: the result
    leans and shrinks towards `low`, or towards `high` with `from_high`. `skew` leans harder.
    """
    unit = int.from_bytes(draw(_UNIT), "big")
    offset = (unit * unit // 65535 if skew else unit) * (high - low) // 65535
    return high - offset if from_high else low + offset


def chunk_sizes(config: OffloadConfig) -> list[int]:
    """Return `C_g` for every group."""
    return [config.chunk_tokens(g) for g in range(config.num_groups)]


def hashes_for(config: OffloadConfig, num_tokens: int) -> tuple[bytes, ...]:
    """Return distinct stand-in chained hashes, one per full hash block of `num_tokens`."""
    return tuple((i + 1).to_bytes(4, "big") for i in range(num_tokens // config.hash_block_size))


def _cursors(draw: st.DrawFn, config: OffloadConfig, state: RequestState, nc: int) -> RequestState:
    """Return `state` with store cursors an engine run could have left at `nc` computed tokens:
    at most `ceil(nc / C_g)` (a load moves them there), possibly behind (no room earlier, or
    chunks left out of the tier); low cursors are likelier (they leave more to store)."""
    data = draw(_CURSOR_BYTES)
    cursors = tuple(
        min(len(keys), ceil_div(nc, config.chunk_tokens(g))) * byte * byte // (255 * 255)
        for g, (keys, byte) in enumerate(zip(state.keys, data, strict=False))
    )
    return attrs.evolve(state, store_cursor=cursors)


def _tier(draw: st.DrawFn, state: RequestState, mix: Mix, free_rows: int | None) -> FakeTier:
    """Return a tier with a status per key of the request, drawn from `mix` (one byte a key:
    one draw for the whole tier keeps generation fast)."""
    bounds: list[tuple[int, KeyStatus]] = []
    total = 0
    for kind, share in mix:
        total += share
        bounds.append((total, kind))
    assert total == 256
    all_keys = [key for keys in state.keys for key in keys]
    data = draw(_TIER_BYTES)
    assert len(all_keys) <= len(data)
    status: dict[OffloadKey, KeyStatus] = {}
    for key, byte in zip(all_keys, data, strict=False):
        drawn = next(s for bound, s in bounds if byte < bound)
        if drawn is not MISS:
            status[key] = drawn
    return FakeTier(status, free_rows)


@st.composite
def lookup_cases(
    draw: st.DrawFn, *, mix: Mix | None = None, gainful: bool = False, aligned: bool = False
) -> LookupCase:
    """Return a request of random length, GPU prefix and tier contents (from `mix`, or
    from one of LOOKUP_MIXES).

    `num_computed_tokens` is any value in `[0, num_tokens]`, unless `gainful`: then it leaves
    more than a chunk of every group to gain, so that a lookup can find something, and with
    `aligned` it is also a multiple of every group's block size (what an engine's GPU prefix
    cache reports); without `aligned` it may end inside a block (an engine that keeps a
    request's partly filled blocks, or whose groups' block sizes differ).
    """
    config = draw(configs())
    largest = max(chunk_sizes(config))
    if gainful:
        num_tokens = _between(draw, largest + 1, 5 * largest, from_high=True)
        unit = math.lcm(*(spec.block_size for spec in config.groups)) if aligned else 1
        # Long GPU prefixes likelier: windows then reach below them (blocks the load skips).
        nc = unit * _between(draw, 0, (num_tokens - largest - 1) // unit, from_high=True)
    else:  # any prefix, short ones likelier (a long one leaves nothing to gain)
        num_tokens = _between(draw, 0, 5 * largest, from_high=True)
        nc = _between(draw, 0, num_tokens, skew=True)
    state = new_request_state(
        config,
        "req-0",
        num_prompt_tokens=num_tokens,
        block_hashes=hashes_for(config, num_tokens),
        store_loaded=draw(st.booleans()),
    )
    state = _cursors(draw, config, state, nc)
    tier = _tier(draw, state, draw(_LOOKUP_MIX) if mix is None else mix, free_rows=None)
    return LookupCase(config, state, num_tokens, nc, tier)


def _shuffled_ids(draw: st.DrawFn, count: int) -> list[int]:
    ids = list(range(NULL_BLOCK_ID + 1, NULL_BLOCK_ID + 1 + count))
    random.Random(draw(_SEEDS)).shuffle(ids)
    return ids


def null_blocks(
    config: OffloadConfig, group: int, computed: int, free_lag: int, num_blocks: int
) -> int:
    """Return how many leading blocks of `group` an engine makes null at `computed` tokens:
    those wholly below the first token the group still needs (`GroupSpec.first_needed_token`),
    none for full attention; an engine that frees a token late (`free_lag` 1) keeps one more
    token, so sometimes one more block."""
    first = config.groups[group].first_needed_token(computed)
    return min(max(0, first - free_lag) // config.groups[group].block_size, num_blocks)


def engine_blocks(
    config: OffloadConfig,
    *,
    num_computed_tokens: int,
    null_at: int,
    alloc_tokens: Sequence[int],
    free_lag: int,
    own_window: bool,
    ids: Sequence[int],
) -> tuple[GroupBlocks, ...]:
    """Return per-group block tables as an engine builds them.

    Group `g` has `ceil(alloc_tokens[g] / T_g)` blocks: a null prefix (what the group no longer
    needs at `null_at` computed tokens), then the blocks wholly below `num_computed_tokens`,
    then fresh blocks (a block the computed prefix ends inside is fresh too: the request's own,
    partly computed). Below the computed prefix, full-attention blocks are GPU prefix-cache
    hits; those of a windowed group are too, unless `own_window`: then they are real blocks the
    request computed itself (it was preempted and resumed, say), neither cached nor to be
    filled.
    Real blocks take distinct ids from `ids`; null blocks share id 0.
    """
    out = []
    pool = iter(ids)
    for g, spec in enumerate(config.groups):
        count = ceil_div(alloc_tokens[g], spec.block_size)
        nulls = null_blocks(config, g, null_at, free_lag, count)
        cached_end = max(nulls, min(count, num_computed_tokens // spec.block_size))
        if own_window and spec.rule.windowed:
            cached_end = nulls
        block_ids = [NULL_BLOCK_ID if i < nulls else next(pool) for i in range(count)]
        out.append(GroupBlocks.of(block_ids, null=range(nulls), cached=range(nulls, cached_end)))
    return tuple(out)


@st.composite
def load_cases(draw: st.DrawFn) -> LoadCase:
    """Return a request after its lookup: the engine allocated blocks for the accepted hit.

    Only lookups that found tokens make a case. The GPU prefix is a multiple of every block
    size in half the cases and ends anywhere in the others (then the block holding it is the
    request's own, partly computed); blocks are allocated for the hit plus some of the tokens
    still to compute, with nulls below each window at the new boundary (as an engine does when
    it counts loaded tokens as computed).
    """
    case = draw(lookup_cases(mix=LOAD_MIX, gainful=True, aligned=draw(st.booleans())))
    found = lookup(
        case.config,
        case.state,
        num_tokens=case.num_tokens,
        num_computed_tokens=case.num_computed_tokens,
        tier=case.tier,
    )
    # An engine plans a load only for a hit; with nothing to load it asks for no load plan.
    assume(found.tokens > 0)
    hit = found.tokens
    boundary = case.num_computed_tokens + hit
    # This step also computes some tokens (at least one: the engine always recomputes the
    # last prompt token; fewer than all under a chunked-prefill budget).
    scheduled = _between(draw, 1, max(1, case.num_tokens - boundary))
    alloc = boundary + scheduled
    blocks = engine_blocks(
        case.config,
        num_computed_tokens=case.num_computed_tokens,
        null_at=boundary,
        alloc_tokens=[alloc] * case.config.num_groups,
        free_lag=draw(_BITS),
        own_window=draw(st.booleans()),
        ids=_shuffled_ids(draw, sum(ceil_div(alloc, t.block_size) for t in case.config.groups)),
    )
    return LoadCase(case, hit, scheduled, blocks)


@st.composite
def store_cases(draw: st.DrawFn) -> StoreCase:
    """Return one step of a running request: prompt, decoded tokens, computed and scheduled
    tokens, cursors an earlier step may have left, block tables and a tier with limited room.

    Blocks cover the computed and scheduled tokens, and every chunk below a store cursor (an
    engine may allocate ahead; `store_after_load` gives the tightest allocation, after a
    real load).
    """
    config = draw(configs())
    num_tokens = _between(draw, 0, 5 * max(chunk_sizes(config)), from_high=True)
    prompt = num_tokens - _between(draw, 0, num_tokens)
    nc = _between(draw, 0, num_tokens)
    # From one token (decoding) to the rest of the prompt and past it (clamped to num_tokens).
    scheduled = _between(draw, 1, num_tokens - nc + 2, from_high=True)
    state = new_request_state(
        config,
        "req-0",
        num_prompt_tokens=prompt,
        block_hashes=hashes_for(config, num_tokens),
    )
    state = _cursors(draw, config, state, nc)
    extra = draw(_BITS)
    alloc, len_blocks = [], []
    for g, spec in enumerate(config.groups):
        tokens = (ceil_div(nc + scheduled, spec.block_size) + extra) * spec.block_size
        tokens = max(tokens, state.store_cursor[g] * config.chunk_tokens(g))
        alloc.append(tokens)
        len_blocks.append(ceil_div(tokens, spec.block_size))
    blocks = engine_blocks(
        config,
        num_computed_tokens=nc,
        null_at=nc,
        alloc_tokens=alloc,
        free_lag=draw(_BITS),
        own_window=draw(st.booleans()),
        ids=_shuffled_ids(draw, sum(len_blocks)),
    )
    free_rows = draw(_FREE_ROWS)
    tier = _tier(draw, state, STORE_MIX, free_rows)
    return StoreCase(config, state, blocks, nc, scheduled, num_tokens, tier)


def copy_blocks(blocks: Sequence[GroupBlocks]) -> tuple[GroupBlocks, ...]:
    """Return equal block tables built from fresh, writable arrays."""
    return tuple(
        GroupBlocks(
            ids=np.array(b.ids, copy=True),
            is_null=np.array(b.is_null, copy=True),
            is_cached=np.array(b.is_cached, copy=True),
        )
        for b in blocks
    )


def store_after_load(case: LoadCase, state_after_load: RequestState, tier: FakeTier) -> StoreCase:
    """Return the store step that ends the engine step of a load: the request resumes at the
    hit's boundary, computes the scheduled tokens, with the very blocks the load was given."""
    look = case.lookup
    return StoreCase(
        look.config,
        state_after_load,
        case.blocks,
        look.num_computed_tokens + case.hit_tokens,
        case.num_scheduled_tokens,
        look.num_tokens,
        tier,
    )


@dataclass(frozen=True)
class SharedPrefixCase:
    """An earlier request that stored its chunks in one step, and a later request sharing
    its tokens: the later one's lookup, against the tier the earlier one's store filled."""

    later: LookupCase
    """The later request; its `tier` holds every complete chunk of the earlier request."""
    earlier: StoreCase
    """The earlier request's one step: all its tokens computed at once into fresh blocks,
    with an empty tier of unbounded room."""


@st.composite
def shared_prefix_cases(draw: st.DrawFn) -> SharedPrefixCase:
    """Return two requests of one token chain: the earlier one `shared` tokens long, stored
    in one prefill step; the later one of any length, with any GPU prefix. The later case's
    tier holds every complete chunk of every group of the earlier request."""
    config = draw(configs())
    largest = max(chunk_sizes(config))
    shared = _between(draw, 0, 5 * largest, from_high=True)
    num_tokens = _between(draw, 0, 5 * largest, from_high=True)
    hashes = hashes_for(config, max(shared, num_tokens))
    before = hashes[: shared // config.hash_block_size]
    earlier_state = new_request_state(
        config, "req-0", num_prompt_tokens=shared, block_hashes=before
    )
    blocks = engine_blocks(
        config,
        num_computed_tokens=0,
        null_at=0,
        alloc_tokens=[shared] * config.num_groups,
        free_lag=0,
        own_window=False,
        ids=_shuffled_ids(draw, sum(ceil_div(shared, s.block_size) for s in config.groups)),
    )
    earlier = StoreCase(config, earlier_state, blocks, 0, shared, shared, FakeTier({}, None))
    later_state = new_request_state(
        config,
        "req-1",
        num_prompt_tokens=num_tokens,
        block_hashes=hashes[: num_tokens // config.hash_block_size],
    )
    everything = FakeTier({key: HIT for keys in earlier_state.keys for key in keys}, None)
    nc = _between(draw, 0, num_tokens, skew=True)
    return SharedPrefixCase(LookupCase(config, later_state, num_tokens, nc, everything), earlier)
