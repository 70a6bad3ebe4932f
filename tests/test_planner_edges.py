"""Planner edge cases that no engine should hit often, but that must stay harmless."""

from __future__ import annotations

from kvferry.core import (
    GroupBlocks,
    GroupKind,
    GroupSpec,
    OffloadConfig,
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
