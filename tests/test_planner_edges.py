"""Planner edge cases that no engine should hit often, but that must stay harmless."""

from __future__ import annotations

from planner_strategies import FakeTier

from kvferry.core import (
    GroupBlocks,
    GroupKind,
    GroupSpec,
    KeyStatus,
    LookupResult,
    OffloadConfig,
    OffloadKey,
    lookup,
    new_request_state,
    plan_load,
)


def test_load_of_zero_tokens_inside_a_keyless_chunk_is_an_empty_plan_and_moves_no_cursor() -> None:
    config = OffloadConfig(
        hash_block_size=1,
        blocks_per_chunk=2,
        groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=1),),
    )
    state = new_request_state(config, "r1", num_prompt_tokens=1, block_hashes=[b"a"])
    plan, after = plan_load(
        config, state, [GroupBlocks.of([5])], num_computed_tokens=1, hit_tokens=0
    )
    assert (plan.is_empty, plan.group_sizes, after.store_cursor) == (True, (0,), (0,))


def test_a_pending_key_above_the_boundary_a_lookup_settles_on_asks_no_retry() -> None:
    # The chunked-local group reads its chunks above token 16 while the boundary is higher;
    # the other groups then settle on 16, an attention-chunk start where that group needs
    # nothing. Its pending chunk (tokens 56-64) is above every token the answer needs.
    config = OffloadConfig(
        hash_block_size=2,
        blocks_per_chunk=2,
        groups=(
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=8),
            GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=8, sliding_window=14),
            GroupSpec(kind=GroupKind.MAMBA, block_size=2),
            GroupSpec(
                kind=GroupKind.CHUNKED_LOCAL_ATTENTION, block_size=4, attention_chunk_size=16
            ),
        ),
    )
    hashes = [number.to_bytes(4, "big") for number in range(1, 41)]  # hash block k: 2k tokens
    held = {  # per group, the hash blocks that end its chunks in the tier
        0: [8, 16, 24, 32, 40],
        1: [8, 24, 40],
        2: [k for k in range(2, 41, 2) if k != 24],
        3: [4, 8, 12, 16, 20, 24, 28, 32, 36, 40],
    }
    state = new_request_state(config, "r", num_prompt_tokens=80, block_hashes=hashes)
    status = {
        OffloadKey(group, k.to_bytes(4, "big")): KeyStatus.HIT
        for group, blocks in held.items()
        for k in blocks
    }
    status[OffloadKey(3, (32).to_bytes(4, "big"))] = KeyStatus.PENDING  # tokens 56-64
    tier = FakeTier(status, free_rows=None)
    found = lookup(config, state, num_tokens=80, num_computed_tokens=0, tier=tier)
    assert found == LookupResult(tokens=16)
