"""Planner functions refuse inputs that would make a wrong copy, naming request and group."""

from __future__ import annotations

import pytest

from kvferry.core import (
    GroupBlocks,
    GroupKind,
    GroupSpec,
    InvalidInputError,
    OffloadConfig,
    RequestState,
    lookup,
    new_request_state,
    plan_load,
    plan_store,
)
from kvferry.core.scenario import ScenarioTier, counting_hashes

CONFIG = OffloadConfig(
    hash_block_size=16,
    blocks_per_chunk=1,
    groups=(
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
        GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=32),
    ),
)
EMPTY_TIER = ScenarioTier(ready=frozenset(), pending=frozenset(), free_rows=None)


def _state(num_tokens: int = 128) -> RequestState:
    return new_request_state(
        CONFIG, "r7", num_prompt_tokens=num_tokens, block_hashes=counting_hashes(num_tokens // 16)
    )


def test_load_into_a_null_block_after_the_first_destination_is_refused() -> None:
    blocks = [
        GroupBlocks.of(range(1, 9)),
        GroupBlocks.of([0, 0, 0, 0, 0, 0, 12, 0], null=[0, 1, 2, 3, 4, 5, 7]),
    ]
    with pytest.raises(
        InvalidInputError, match=r"request 'r7', group 1, field 'blocks\[7\]'.*null"
    ):
        plan_load(CONFIG, _state(), blocks, num_computed_tokens=0, hit_tokens=128)


def test_load_into_a_gpu_cached_block_after_the_first_destination_is_refused() -> None:
    blocks = [GroupBlocks.of(range(1, 9), cached=[5]), GroupBlocks.of(range(11, 19))]
    with pytest.raises(InvalidInputError, match=r"group 0, field 'blocks\[5\]'.*GPU-cached"):
        plan_load(CONFIG, _state(), blocks, num_computed_tokens=0, hit_tokens=96)


def test_load_of_more_tokens_than_the_request_has_chunks_for_is_refused() -> None:
    blocks = [GroupBlocks.of(range(1, 12)), GroupBlocks.of(range(11, 22))]
    with pytest.raises(InvalidInputError, match=r"group 0, field 'hit_tokens'"):
        plan_load(CONFIG, _state(), blocks, num_computed_tokens=0, hit_tokens=160)


def test_load_with_too_few_blocks_is_refused() -> None:
    blocks = [GroupBlocks.of(range(1, 4)), GroupBlocks.of(range(11, 19))]
    with pytest.raises(InvalidInputError, match=r"group 0, field 'blocks': expected at least 4"):
        plan_load(CONFIG, _state(), blocks, num_computed_tokens=0, hit_tokens=64)


def test_load_with_a_missing_group_block_list_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="one block list per group"):
        plan_load(
            CONFIG, _state(), [GroupBlocks.of(range(8))], num_computed_tokens=0, hit_tokens=16
        )


def test_store_with_too_few_blocks_for_the_complete_chunks_is_refused() -> None:
    blocks = [GroupBlocks.of(range(1, 3)), GroupBlocks.of(range(11, 19))]
    with pytest.raises(InvalidInputError, match=r"group 0, field 'blocks'"):
        plan_store(
            CONFIG,
            _state(),
            blocks,
            num_computed_tokens=0,
            num_scheduled_tokens=128,
            num_tokens=128,
            tier=EMPTY_TIER,
        )


def test_lookup_with_more_computed_than_total_tokens_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="num_computed_tokens"):
        lookup(CONFIG, _state(), num_tokens=128, num_computed_tokens=129, tier=EMPTY_TIER)
