"""Core values reject bad input at construction, with errors that say where and what."""

from __future__ import annotations

import numpy as np
import pytest

from kvferry.core import (
    Direction,
    GroupBlocks,
    GroupKind,
    GroupSpec,
    InvalidInputError,
    OffloadConfig,
    OffloadKey,
    PlanInvariantError,
    TransferPlan,
    extend_keys,
    new_request_state,
)
from kvferry.core.bound import BoundPlan
from kvferry.core.codec import blocks_from_list, blocks_to_list, plan_from_json, plan_to_json

FULL = GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16)


def _config(*groups: GroupSpec, f: int = 1) -> OffloadConfig:
    return OffloadConfig(hash_block_size=16, blocks_per_chunk=f, groups=groups or (FULL,))


def _plan(**overrides: object) -> TransferPlan:
    fields: dict[str, object] = {
        "request_id": "r1",
        "direction": Direction.LOAD,
        "blocks_per_chunk": 2,
        "keys": (OffloadKey(0, b"\x01"), OffloadKey(0, b"\x02")),
        "gpu_block_ids": [7, 8, 9],
        "group_sizes": (3,),
        "block_indices": (1,),
    }
    fields.update(overrides)
    return TransferPlan(**fields)  # type: ignore[arg-type]


def test_sliding_window_group_without_window_is_rejected() -> None:
    with pytest.raises(InvalidInputError, match="sliding_window"):
        GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16)


def test_full_attention_group_with_window_is_rejected() -> None:
    with pytest.raises(InvalidInputError, match="None for a full_attention group"):
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16, sliding_window=64)


def test_block_size_not_multiple_of_hash_block_size_names_the_group() -> None:
    odd = GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=24)
    with pytest.raises(InvalidInputError, match=r"group 1, field 'block_size'.*multiple of"):
        OffloadConfig(hash_block_size=16, blocks_per_chunk=1, groups=(FULL, odd))


def test_blocks_per_chunk_below_one_is_rejected() -> None:
    with pytest.raises(InvalidInputError, match="blocks_per_chunk"):
        _config(f=0)


def test_config_without_groups_is_rejected() -> None:
    with pytest.raises(InvalidInputError, match="at least one group"):
        OffloadConfig(hash_block_size=16, blocks_per_chunk=1, groups=())


def test_window_chunks_rounds_the_window_up_to_whole_chunks() -> None:
    window = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=40)
    config = _config(FULL, window, f=2)  # chunks of 32 tokens
    assert config.window_chunks(1) == 2


def test_mamba_needs_one_chunk() -> None:
    config = _config(GroupSpec(kind=GroupKind.MAMBA, block_size=16))
    assert config.window_chunks(0) == 1


def test_group_blocks_with_negative_id_names_the_index() -> None:
    with pytest.raises(InvalidInputError, match=r"ids\[1\]"):
        GroupBlocks.of([3, -1])


def test_group_blocks_flags_must_match_ids() -> None:
    with pytest.raises(InvalidInputError, match="is_null"):
        GroupBlocks(ids=[1, 2], is_null=[False], is_cached=[False, False])


def test_group_blocks_arrays_are_read_only_copies() -> None:
    ids = np.array([1, 2, 3])
    blocks = GroupBlocks.of(ids)
    ids[0] = 99
    assert blocks.ids.tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="read-only"):
        blocks.ids[0] = 5


def test_group_blocks_of_engine_tables_equal_the_checked_blocks() -> None:
    first, second = GroupBlocks.of_engine_tables([[4, 0, 7, 0], [0, 3]], null_id=0)
    assert first == GroupBlocks.of([4, 0, 7, 0], null=[1, 3])
    assert second == GroupBlocks.of([0, 3], null=[0])
    with pytest.raises(ValueError, match="read-only"):
        first.is_null[0] = True


def test_group_blocks_of_engine_table_tails_are_null_before_them() -> None:
    first, second, third = GroupBlocks.of_engine_tables(
        [[7, 9, 5], [], [6]], null_id=9, starts=[2, 1, 0]
    )
    assert first == GroupBlocks.of([9, 9, 7, 9, 5], null=[0, 1, 3])
    assert second == GroupBlocks.of([9], null=[0])
    assert third == GroupBlocks.of([6])
    assert not first.ids.flags.writeable


def test_group_blocks_of_no_engine_table_are_none() -> None:
    assert GroupBlocks.of_engine_tables([], null_id=0) == ()


def test_group_blocks_readable_form_round_trips() -> None:
    entries = [None, None, "c5", 6, 7]
    assert blocks_to_list(blocks_from_list(entries)) == entries


def test_plan_with_wrong_key_count_for_skip_is_rejected() -> None:
    # 3 blocks after a skip of 1 slot with F=2 span 2 chunks, not 1.
    with pytest.raises(PlanInvariantError, match=r"group 0, field 'keys'.*2 keys"):
        _plan(keys=(OffloadKey(0, b"\x01"),))


def test_plan_group_sizes_must_add_up_to_the_ids() -> None:
    with pytest.raises(PlanInvariantError, match="group_sizes"):
        _plan(group_sizes=(2,))


def test_load_plan_with_duplicate_destination_is_rejected() -> None:
    with pytest.raises(PlanInvariantError, match="distinct destination"):
        _plan(gpu_block_ids=[7, 7, 9])


def test_store_plan_must_start_on_a_chunk_boundary() -> None:
    with pytest.raises(PlanInvariantError, match="stores move whole chunks"):
        _plan(direction=Direction.STORE)


def test_plan_keys_out_of_group_order_are_rejected() -> None:
    with pytest.raises(PlanInvariantError, match="group by group"):
        _plan(
            keys=(OffloadKey(1, b"\x01"), OffloadKey(0, b"\x02")),
            group_sizes=(1, 1),
            block_indices=(0, 0),
            gpu_block_ids=[1, 2],
            blocks_per_chunk=1,
        )


def test_plan_json_round_trip_is_identity() -> None:
    plan = _plan()
    assert plan_from_json(plan_to_json(plan)) == plan


def test_plan_json_with_other_schema_version_is_rejected() -> None:
    text = plan_to_json(_plan()).replace('"schema_version": 1', '"schema_version": 99')
    with pytest.raises(InvalidInputError, match="schema_version"):
        plan_from_json(text)


def test_bound_plan_needs_one_row_per_key() -> None:
    with pytest.raises(PlanInvariantError, match="one row per key"):
        BoundPlan(job_id=1, plan=_plan(), cpu_rows=[4])


def test_keys_are_hashes_of_each_chunks_last_hash_block() -> None:
    config = _config(f=2)  # a chunk spans 2 hash blocks
    hashes = [bytes([i]) for i in range(5)]
    state = new_request_state(config, "r1", num_prompt_tokens=80, block_hashes=hashes)
    assert state.keys == ((OffloadKey(0, b"\x01"), OffloadKey(0, b"\x03")),)


def test_extend_keys_adds_only_newly_completed_chunks() -> None:
    config = _config(f=2)
    hashes = [bytes([i]) for i in range(6)]
    state = new_request_state(config, "r1", num_prompt_tokens=48, block_hashes=hashes[:3])
    assert extend_keys(config, state, hashes).keys[0][-1] == OffloadKey(0, b"\x05")


def test_extend_keys_rejects_a_hash_list_that_changed_its_past() -> None:
    config = _config()
    state = new_request_state(config, "r1", num_prompt_tokens=32, block_hashes=[b"a", b"b"])
    with pytest.raises(InvalidInputError, match=r"request 'r1', group 0, field 'block_hashes'"):
        extend_keys(config, state, [b"a", b"X", b"c"])


def test_state_for_another_config_is_rejected_with_the_group_count() -> None:
    state = new_request_state(_config(), "r1", num_prompt_tokens=0)
    two = _config(FULL, FULL)
    with pytest.raises(InvalidInputError, match="2 groups in the config"):
        extend_keys(two, state, [])
