"""Property tests of the planner: invariants over random hybrid requests.

Each test states one property; the lookup oracle is a brute force over boundaries, written from
the documented rule (docs/semantics.md), not from the scanning algorithm in core/lookup.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
from hypothesis import Phase, assume, given
from hypothesis import strategies as st
from planner_strategies import (
    HIT,
    PENDING,
    FakeTier,
    LoadCase,
    LookupCase,
    SharedPrefixCase,
    StoreCase,
    ceil_div,
    copy_blocks,
    load_cases,
    lookup_cases,
    shared_prefix_cases,
    store_after_load,
    store_cases,
)

from kvferry.core import (
    Direction,
    GroupBlocks,
    GroupKind,
    KeyStatus,
    LookupResult,
    OffloadConfig,
    OffloadKey,
    RequestState,
    StoreDecision,
    StoreOutcome,
    TransferPlan,
    lookup,
    plan_from_json,
    plan_load,
    plan_store,
    plan_to_json,
)
from kvferry.core.codec import config_from_dict, config_to_dict

# Known failures (xfail) stop at the first counterexample instead of shrinking it: they still
# run every example until one fails, but do not spend the suite's time on a minimal example.
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)

# --------------------------------------------------------------------------------------------
# Running the planner on a case


def run_lookup(case: LookupCase, tier: FakeTier | None = None) -> LookupResult:
    return lookup(
        case.config,
        case.state,
        num_tokens=case.num_tokens,
        num_computed_tokens=case.num_computed_tokens,
        tier=case.tier if tier is None else tier,
    )


def run_load(case: LoadCase) -> tuple[TransferPlan, RequestState]:
    return plan_load(
        case.lookup.config,
        case.lookup.state,
        case.blocks,
        num_computed_tokens=case.lookup.num_computed_tokens,
        hit_tokens=case.hit_tokens,
    )


def run_store(case: StoreCase) -> StoreDecision:
    return plan_store(
        case.config,
        case.state,
        case.blocks,
        num_computed_tokens=case.num_computed_tokens,
        num_scheduled_tokens=case.num_scheduled_tokens,
        num_tokens=case.num_tokens,
        tier=case.tier,
    )


def store_plan(case: StoreCase) -> TransferPlan | None:
    return run_store(case).plan


def planned_chunks(state_keys: Sequence[OffloadKey], plan: TransferPlan, group: int) -> list[int]:
    """Return the chunk index of each key the plan moves for `group` (keys are distinct)."""
    index = {key: j for j, key in enumerate(state_keys)}
    return [index[key] for key in plan.keys_of(group)]


def spanned_keys(
    state_keys: Sequence[OffloadKey], plan: TransferPlan, group: int
) -> tuple[OffloadKey, ...]:
    """Return the keys of the chunks that `block_indices[g]`/`group_sizes[g]` touch."""
    size, first, f = plan.group_sizes[group], plan.block_indices[group], plan.blocks_per_chunk
    if not size:
        return ()
    return tuple(state_keys[first // f : (first + size - 1) // f + 1])


def ids_flagged(blocks: GroupBlocks, flags: np.ndarray) -> set[int]:
    return {int(i) for i in blocks.ids[flags]}


# --------------------------------------------------------------------------------------------
# The lookup oracle (the rule: the highest boundary where every group has what it needs)


def needed_tokens(config: OffloadConfig, group: int, boundary: int) -> range:
    """Return the tokens `group` must hold to compute from token `boundary` on (the documented
    rule, written here independently of core): every earlier token for full attention, the
    `w - 1` before it for a sliding window of `w` (and the `e` extra retained tokens below
    those), the state after token `boundary - 1` (held with that token's block) for Mamba, the
    earlier tokens of its attention chunk for chunked local attention."""
    spec = config.groups[group]
    if spec.kind is GroupKind.SLIDING_WINDOW:
        assert spec.sliding_window is not None
        reach = spec.sliding_window - 1 + spec.extra_retained_tokens
        return range(max(0, boundary - reach), boundary)
    if spec.kind is GroupKind.MAMBA:
        return range(max(0, boundary - 1), boundary)
    if spec.kind is GroupKind.CHUNKED_LOCAL_ATTENTION:
        assert spec.attention_chunk_size is not None
        return range(boundary - boundary % spec.attention_chunk_size, boundary)
    return range(boundary)


def needed_chunks(
    config: OffloadConfig, group: int, num_computed: int, boundary: int
) -> range | None:
    """Return the chunks `group` must read from the tier to resume at `boundary`, or None when
    it cannot resume there at all.

    The chunks holding the tokens `needed_tokens` names, except those wholly below the GPU
    prefix's chunk (the GPU holds them); the chunk the prefix ends inside is read, since its
    block is loaded whole. Mamba resumes only at its own chunk ends, where a state exists.
    """
    if boundary <= num_computed:
        return range(0)  # nothing to load: the GPU already holds the prefix
    chunk = config.chunk_tokens(group)
    if config.groups[group].kind is GroupKind.MAMBA and boundary % chunk:
        return None
    tokens = needed_tokens(config, group, boundary)
    if not tokens:
        return range(0)
    return range(max(tokens.start, num_computed) // chunk, ceil_div(boundary, chunk))


def needed_keys(case: LookupCase, boundary: int) -> list[OffloadKey] | None:
    """Return every key some group needs at `boundary` (None: some group cannot resume there,
    or the boundary lies past a group's last complete chunk: no lookup answer passes it, even
    for a group that needs no chunk there)."""
    keys: list[OffloadKey] = []
    for g in range(case.config.num_groups):
        chunks = needed_chunks(case.config, g, case.num_computed_tokens, boundary)
        if chunks is None or boundary > len(case.state.keys[g]) * case.config.chunk_tokens(g):
            return None
        keys.extend(case.state.keys[g][j] for j in chunks)
    return keys


def is_valid_boundary(
    case: LookupCase, boundary: int, readable: Iterable[KeyStatus] = (HIT,)
) -> bool:
    """Return True when every group can resume at `boundary` from keys in `readable` states."""
    keys = needed_keys(case, boundary)
    ok = set(readable)
    return keys is not None and all(s in ok for s in case.tier.statuses(keys))


def highest_boundary(case: LookupCase) -> int:
    """Return the largest boundary, in `[num_computed, top]`, valid for every group on hits
    alone; `top` is `num_tokens`, less one when any windowed group exists."""
    top = case.num_tokens - (1 if case.config.has_windowed_group else 0)
    for boundary in range(top, case.num_computed_tokens, -1):
        if is_valid_boundary(case, boundary):
            return boundary
    return case.num_computed_tokens


def chunk_sizes(config: OffloadConfig) -> list[int]:
    return [config.chunk_tokens(g) for g in range(config.num_groups)]


# --------------------------------------------------------------------------------------------
# Determinism and plan shape


@given(load_cases(), store_cases())
def test_same_input_gives_same_plan(load: LoadCase, store: StoreCase) -> None:
    # Rebuild every input from scratch (fresh arrays, a tier filled in another order): a plan
    # must depend on values only, never on identity or dictionary order.
    look = load.lookup
    look_again = LookupCase(
        config_from_dict(config_to_dict(look.config)),
        look.state,
        look.num_tokens,
        look.num_computed_tokens,
        look.tier.copy_reordered(),
    )
    assert run_lookup(look) == run_lookup(look_again)

    load_again = LoadCase(
        look_again, load.hit_tokens, load.num_scheduled_tokens, copy_blocks(load.blocks)
    )
    (plan, state), (plan_again, state_again) = run_load(load), run_load(load_again)
    assert plan == plan_again
    assert state == state_again
    assert plan_to_json(plan) == plan_to_json(plan_again)

    store_again = StoreCase(
        config_from_dict(config_to_dict(store.config)),
        store.state,
        copy_blocks(store.blocks),
        store.num_computed_tokens,
        store.num_scheduled_tokens,
        store.num_tokens,
        store.tier.copy_reordered(),
    )
    decision, decision_again = run_store(store), run_store(store_again)
    assert decision == decision_again
    if decision.plan is not None and decision_again.plan is not None:
        assert plan_to_json(decision.plan) == plan_to_json(decision_again.plan)


@given(load_cases(), store_cases())
def test_group_sizes_add_up_to_the_gpu_block_ids(load: LoadCase, store: StoreCase) -> None:
    for plan in (run_load(load)[0], store_plan(store)):
        if plan is not None:
            assert sum(plan.group_sizes) == len(plan.gpu_block_ids)
            assert len(plan.group_sizes) == len(plan.block_indices) == plan.num_groups


@given(load_cases())
def test_load_keys_are_the_chunks_its_blocks_touch(case: LoadCase) -> None:
    plan, _ = run_load(case)
    for g, keys in enumerate(case.lookup.state.keys):
        assert plan.keys_of(g) == spanned_keys(keys, plan, g)


@given(store_cases())
def test_store_copies_exactly_the_blocks_of_its_keys(case: StoreCase) -> None:
    # The store form of "keys are exactly the chunks the blocks touch": a store skips chunks the
    # tier has, so its chunks can have gaps (docs/semantics.md, Store); the ids are explicit:
    # group g's GPU ids are the F blocks of each stored chunk, in key order, and
    # block_indices[g] is the first stored chunk's first block.
    plan = store_plan(case)
    if plan is None:
        return
    f = case.config.blocks_per_chunk
    for g, blocks in enumerate(case.blocks):
        chunks = planned_chunks(case.state.keys[g], plan, g)
        expected = [int(i) for j in chunks for i in blocks.ids[j * f : (j + 1) * f]]
        assert plan.gpu_ids_of(g).tolist() == expected
        assert plan.block_indices[g] == (chunks[0] * f if chunks else 0)


@given(load_cases(), store_cases())
def test_no_plan_moves_a_null_block(load: LoadCase, store: StoreCase) -> None:
    cases = [(run_load(load)[0], load.blocks), (store_plan(store), store.blocks)]
    for plan, blocks in cases:
        if plan is None:
            continue
        for g, group_blocks in enumerate(blocks):
            moved = set(plan.gpu_ids_of(g).tolist())
            assert not moved & ids_flagged(group_blocks, group_blocks.is_null)


@given(load_cases())
def test_load_never_writes_a_gpu_cached_block(case: LoadCase) -> None:
    plan, _ = run_load(case)
    for g, blocks in enumerate(case.blocks):
        assert not set(plan.gpu_ids_of(g).tolist()) & ids_flagged(blocks, blocks.is_cached)


# --------------------------------------------------------------------------------------------
# Lookup


@given(lookup_cases())
def test_lookup_boundary_is_valid_for_every_group(case: LookupCase) -> None:
    found = run_lookup(case)
    if found.retry or not found.tokens:
        return
    boundary = case.num_computed_tokens + found.tokens
    top = case.num_tokens - (1 if case.config.has_windowed_group else 0)
    assert boundary <= top
    needed = needed_keys(case, boundary)
    assert needed is not None, f"a group cannot resume at {boundary}"
    assert case.tier.statuses(needed) == [HIT] * len(needed)


@given(lookup_cases())
def test_lookup_finds_the_highest_valid_boundary(case: LookupCase) -> None:
    # What the lookup guarantees. Each group's scan returns the highest boundary, no higher
    # than the current one, that is valid for that group (a full-attention prefix is valid at
    # every boundary below it; a window valid off its grid is valid at the next grid point too).
    # Shrinking from the top with these monotone steps until nothing moves therefore stops at
    # the highest boundary valid for all groups: the answer, when not 0, is the global maximum.
    # The answer may still be 0 while some lower boundary is valid: a group that is examined
    # where fewer than one of *its* chunks remains to gain ends the lookup. So a 0 only proves
    # that no valid boundary gains a whole chunk of every group. A full-attention group is not
    # re-examined after a window shrank the boundary, so a non-zero answer gains at least one
    # chunk of every *windowed* group only.
    found = run_lookup(case)
    if found.retry:
        return
    best = highest_boundary(case)
    gain = best - case.num_computed_tokens
    if found.tokens:
        assert found.tokens == gain
        for g, spec in enumerate(case.config.groups):
            if spec.rule.windowed:
                assert found.tokens >= case.config.chunk_tokens(g)
    else:
        assert gain < max(chunk_sizes(case.config))


@given(lookup_cases())
def test_lookup_retries_only_when_a_key_is_pending(case: LookupCase) -> None:
    if run_lookup(case).retry:
        assert any(case.tier.has_pending(keys) for keys in case.state.keys)


@given(lookup_cases())
def test_lookup_never_retries_once_pending_keys_are_hits(case: LookupCase) -> None:
    assert not run_lookup(case, case.tier.settled()).retry


@given(lookup_cases())
def test_lookup_retries_exactly_when_its_answer_needs_a_pending_key(case: LookupCase) -> None:
    # docs/semantics.md: pending keys count as hits while the boundary is searched, and the
    # request waits only when the boundary found needs one. That boundary is what the lookup
    # answers once every pending key is readable; so: retry if and only if that answer needs a
    # key that is pending now (never waiting for nothing, never loading less instead of waiting).
    settled = run_lookup(case, case.tier.settled())
    needed = needed_keys(case, case.num_computed_tokens + settled.tokens) or []
    waits_for_pending = settled.tokens > 0 and PENDING in case.tier.statuses(needed)
    assert run_lookup(case).retry == waits_for_pending


# --------------------------------------------------------------------------------------------
# Load after a lookup hit


@given(load_cases())
def test_load_fills_exactly_the_fresh_blocks_of_the_hit(case: LoadCase) -> None:
    # Fresh blocks from the one holding the GPU prefix's end, or the group's first needed token
    # when that lies higher: an engine that frees a window's blocks a token late keeps one more
    # real block below the window, which holds nothing the request needs.
    plan, _ = run_load(case)
    assert plan.direction is Direction.LOAD
    config, nc = case.lookup.config, case.lookup.num_computed_tokens
    cached = nc + case.hit_tokens
    for g, blocks in enumerate(case.blocks):
        size = config.groups[g].block_size
        n_gpu = ceil_div(cached, size)
        needed = needed_tokens(config, g, cached)
        low = max(nc, needed.start) // size if needed else n_gpu
        fresh = [i for i in range(low, n_gpu) if not blocks.is_null[i] and not blocks.is_cached[i]]
        first = fresh[0] if fresh else 0
        assert fresh == list(range(first, n_gpu)) or not fresh  # the engine's table shape
        assert plan.group_sizes[g] == len(fresh)
        assert plan.block_indices[g] == first
        assert plan.gpu_ids_of(g).tolist() == [int(blocks.ids[i]) for i in fresh]


@given(load_cases())
def test_load_leaves_no_needed_token_unfilled(case: LoadCase) -> None:
    # Every token below the hit that a group needs is on the GPU already (below the computed
    # prefix: in a cached block or the request's own) or in a block the plan fills; the block
    # a GPU prefix ends inside holds tokens on both sides, so the plan fills it whole.
    plan, _ = run_load(case)
    config, nc = case.lookup.config, case.lookup.num_computed_tokens
    boundary = nc + case.hit_tokens
    for g, blocks in enumerate(case.blocks):
        size = config.groups[g].block_size
        filled = set(range(plan.block_indices[g], plan.block_indices[g] + plan.group_sizes[g]))
        for token in needed_tokens(config, g, boundary):
            index = token // size
            if token >= nc and not blocks.is_cached[index]:
                assert index in filled, f"group {g}: token {token} (block {index}) is not filled"


@given(load_cases())
def test_load_reads_only_keys_the_lookup_saw_as_hits(case: LoadCase) -> None:
    plan, _ = run_load(case)
    assert case.lookup.tier.statuses(plan.keys) == [HIT] * len(plan.keys)


@given(load_cases())
def test_load_moves_store_cursors_past_the_hit(case: LoadCase) -> None:
    _, state = run_load(case)
    before = case.lookup.state
    cached = case.lookup.num_computed_tokens + case.hit_tokens
    for g, old in enumerate(before.store_cursor):
        past_hit = ceil_div(cached, case.lookup.config.chunk_tokens(g))
        expected = old if before.store_loaded else max(old, past_hit)
        assert state.store_cursor[g] == expected


@given(load_cases())
def test_load_never_moves_a_store_cursor_backwards(case: LoadCase) -> None:
    _, state = run_load(case)
    for old, new in zip(case.lookup.state.store_cursor, state.store_cursor, strict=True):
        assert new >= old


# --------------------------------------------------------------------------------------------
# Store


@given(store_cases())
def test_store_plans_only_complete_chunks(case: StoreCase) -> None:
    plan = store_plan(case)
    if plan is None:
        return
    assert plan.direction is Direction.STORE
    for g, keys in enumerate(case.state.keys):
        for j in planned_chunks(keys, plan, g):
            assert (j + 1) * case.config.chunk_tokens(g) <= case.done


@given(store_cases())
def test_store_never_plans_a_chunk_with_a_null_block(case: StoreCase) -> None:
    plan = store_plan(case)
    if plan is None:
        return
    f = case.config.blocks_per_chunk
    for g, keys in enumerate(case.state.keys):
        for j in planned_chunks(keys, plan, g):
            assert not case.blocks[g].is_null[j * f : (j + 1) * f].any()


@given(store_cases())
def test_store_never_plans_a_key_the_tier_has(case: StoreCase) -> None:
    plan = store_plan(case)
    if plan is not None:
        assert all(s is KeyStatus.MISS for s in case.tier.statuses(plan.keys))


@given(store_cases())
def test_store_plans_every_new_complete_real_chunk(case: StoreCase) -> None:
    # The other side of the three above: every complete chunk from the cursor on, with real
    # blocks, missing from the tier and worth storing (of a windowed group: in the window of a
    # boundary a lookup can answer), is stored when there is room.
    decision = run_store(case)
    f = case.config.blocks_per_chunk
    wanted = []
    for g, keys in enumerate(case.state.keys):
        end = min(case.done // case.config.chunk_tokens(g), len(keys))
        for j in range(case.state.store_cursor[g], end):
            real = not case.blocks[g].is_null[j * f : (j + 1) * f].any()
            useful = case.config.keeps_chunk(g, j)
            if real and useful and case.tier.statuses([keys[j]]) == [KeyStatus.MISS]:
                wanted.append(keys[j])
    if not wanted:
        assert decision.outcome is StoreOutcome.NOTHING
    elif not case.tier.can_reserve(wanted):
        assert decision.outcome is StoreOutcome.NO_ROOM
    else:
        assert decision.outcome is StoreOutcome.STORE
        assert decision.plan is not None
        assert list(decision.plan.keys) == wanted


@given(store_cases())
def test_store_without_room_leaves_the_state_unchanged(case: StoreCase) -> None:
    decision = run_store(case)
    if decision.outcome is StoreOutcome.NO_ROOM:
        assert decision.plan is None
        assert decision.state == case.state


@given(store_cases())
def test_store_moves_each_cursor_to_the_last_complete_chunk_unless_no_room(
    case: StoreCase,
) -> None:
    decision = run_store(case)
    if decision.outcome is StoreOutcome.NO_ROOM:
        return
    for g, (keys, old) in enumerate(zip(case.state.keys, case.state.store_cursor, strict=True)):
        complete = min(case.done // case.config.chunk_tokens(g), len(keys))
        assert decision.state.store_cursor[g] == max(old, complete)


@given(store_cases())
def test_store_never_moves_a_cursor_backwards(case: StoreCase) -> None:
    decision = run_store(case)
    for old, new in zip(case.state.store_cursor, decision.state.store_cursor, strict=True):
        assert new >= old


@given(shared_prefix_cases())
def test_a_stored_request_serves_every_lookup_every_chunk_of_it_would(
    case: SharedPrefixCase,
) -> None:
    # The store passes over windowed chunks no lookup can load (docs/semantics.md, "Which
    # windowed chunks are stored"); a later request sharing the tokens then finds what it would
    # find with every chunk in the tier. Left out on purpose: a prompt whose length is a
    # multiple of every chunk size resumes at its last token, off every grid.
    config, later = case.later.config, case.later
    unit = math.lcm(*chunk_sizes(config))
    assume(not config.has_windowed_group or later.num_tokens % unit)
    stored = run_store(case.earlier).plan
    kept = FakeTier({key: HIT for key in (stored.keys if stored else ())}, None)
    assert run_lookup(later, kept) == run_lookup(later)


@given(load_cases())
def test_store_after_a_load_accepts_the_blocks_the_engine_allocated(case: LoadCase) -> None:
    # The engine step that loads also computes `num_scheduled_tokens` and then stores: same
    # blocks, the state the load returned, the request resumed at the hit's boundary.
    _, state = run_load(case)
    run_store(store_after_load(case, state, case.lookup.tier))


# --------------------------------------------------------------------------------------------
# JSON


@st.composite
def transfer_plans(draw: st.DrawFn) -> TransferPlan:
    """Return any valid plan: random F, groups, skips, hashes (any bytes) and request id."""
    f = draw(st.integers(1, 4))
    direction = draw(st.sampled_from(Direction))
    sizes: list[int] = []
    firsts: list[int] = []
    keys: list[OffloadKey] = []
    for g in range(draw(st.integers(1, 4))):
        size = draw(st.integers(0, 6))
        first = draw(st.integers(0, 20)) if size else 0
        if direction is Direction.STORE:
            first -= first % f
        sizes.append(size)
        firsts.append(first)
        count = ceil_div(size + first % f, f) if size else 0
        hashes = draw(st.lists(st.binary(max_size=8), min_size=count, max_size=count))
        keys.extend(OffloadKey(g, h) for h in hashes)
    ids = draw(
        st.lists(st.integers(0, 2**40), min_size=sum(sizes), max_size=sum(sizes), unique=True)
    )
    return TransferPlan(
        request_id=draw(st.text(max_size=12)),
        direction=direction,
        blocks_per_chunk=f,
        keys=keys,
        gpu_block_ids=ids,
        group_sizes=sizes,
        block_indices=firsts,
    )


@given(transfer_plans())
def test_plan_json_round_trip_is_the_identity(plan: TransferPlan) -> None:
    text = plan_to_json(plan)
    again = plan_from_json(text)
    assert again == plan
    assert plan_to_json(again) == text
    assert plan_to_json(plan) == text
