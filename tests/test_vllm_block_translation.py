"""Translating vLLM's block tables: a load reads only the blocks its destinations can be in,
and gets the same plan as from the whole table."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from kvferry.adapters.vllm import (
    blocks_from_vllm,
    group_blocks_from_ids,
    group_blocks_from_vllm,
    load_block_ranges,
)
from kvferry.core import GroupKind, GroupSpec, OffloadConfig, new_request_state, plan_load

CONFIG = OffloadConfig(
    hash_block_size=16,
    blocks_per_chunk=1,
    groups=(
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
        GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=64),
        GroupSpec(kind=GroupKind.MAMBA, block_size=16),
    ),
)


def block(block_id: int, *, null: bool = False, hashed: bool = False) -> SimpleNamespace:
    return SimpleNamespace(block_id=block_id, is_null=null, block_hash=b"h" if hashed else None)


def engine_table(num_blocks: int, first_kept: int, base: int) -> list[SimpleNamespace]:
    """vLLM's table of one group after allocation: null blocks below `first_kept`."""
    return [block(0, null=True) if i < first_kept else block(base + i) for i in range(num_blocks)]


def test_only_the_range_is_read_and_the_blocks_below_it_are_null() -> None:
    blocks = [block(5), block(6, hashed=True), block(7), block(0, null=True), block(9)]
    got = group_blocks_from_vllm(blocks, start=1, stop=4)
    assert got.ids.tolist() == [0, 6, 7, 0]
    assert got.is_null.tolist() == [True, False, False, True]
    assert got.is_cached.tolist() == [False, True, False, False]


def test_the_whole_table_is_read_without_a_range() -> None:
    blocks = [block(5), block(6, hashed=True), block(0, null=True)]
    got = group_blocks_from_vllm(blocks)
    assert got.ids.tolist() == [5, 6, 0]
    assert got.is_null.tolist() == [False, False, True]
    assert got.is_cached.tolist() == [False, True, False]


def test_load_ranges_start_at_each_groups_first_needed_block() -> None:
    ranges = load_block_ranges(CONFIG, num_computed_tokens=32, hit_tokens=288)
    # 320 tokens: 20 blocks; full attention from the GPU prefix's block (2), the 64-token
    # window from token 257 (block 16), Mamba its last block (19)
    assert ranges == ((2, 20), (16, 20), (19, 20))


def test_a_load_from_the_ranges_is_the_load_from_the_whole_table() -> None:
    hashes = [i.to_bytes(4, "big") for i in range(40)]
    state = new_request_state(CONFIG, "r", num_prompt_tokens=640, block_hashes=hashes)
    hit = 608
    tables = [
        engine_table(40, 0, 100),
        engine_table(40, (hit - 63) // 16, 200),
        engine_table(40, (hit - 1) // 16, 300),
    ]
    whole = blocks_from_vllm(tables)
    ranged = blocks_from_vllm(
        tables, ranges=load_block_ranges(CONFIG, num_computed_tokens=0, hit_tokens=hit)
    )
    plan_whole, _ = plan_load(CONFIG, state, whole, num_computed_tokens=0, hit_tokens=hit)
    plan_ranged, _ = plan_load(CONFIG, state, ranged, num_computed_tokens=0, hit_tokens=hit)
    assert plan_ranged == plan_whole


def test_id_lists_null_the_blocks_the_engine_has_skipped_in_one_pass() -> None:
    (full, window, mamba) = group_blocks_from_ids(
        CONFIG, [[1, 2, 3, 4, 5], [6, 0, 8, 9, 10], [11, 12, 13, 14, 15]], num_computed_tokens=80
    )
    assert np.flatnonzero(full.is_null).tolist() == []
    assert np.flatnonzero(window.is_null).tolist() == [0, 1]  # id 0, and the block below token 17
    assert np.flatnonzero(mamba.is_null).tolist() == [0, 1, 2, 3]
