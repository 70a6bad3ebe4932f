"""CPU rows per group: what a byte budget holds when each group's chunk takes its own bytes,
against rows sized for the largest group (one row id space shared by every group)."""

from __future__ import annotations

import numpy as np

from kvferry.adapters.demo_pages import DemoKVCache
from kvferry.adapters.demo_profiles import PROFILES, ProfileName
from kvferry.benchmarks.engine_layouts import engine_model, group_block_bytes, kv_caches
from kvferry.core.catalog import rows_for_budget
from kvferry.core.layout import GroupLayout, KVLayout, PageRef
from kvferry.executors.tensors import build_layout

BUDGET = 1 << 30


def _largest_row_positions(pitches: tuple[int, ...], budget: int) -> int:
    """Chunk positions (one chunk of every group) that rows sized for the largest group held:
    `budget // max(pitches)` rows shared by the groups, one row per chunk of any group."""
    return budget // max(pitches) // len(pitches)


def _jamba_layout() -> KVLayout:
    model = engine_model("jamba", 2)  # full size; two blocks keep the buffers small
    buffers = [np.zeros(n, np.uint8) for n in model.buffer_bytes]
    return build_layout(kv_caches(model, buffers, lambda b, v: b, neutral=True), 1, on_gpu=False)[0]


def test_each_group_s_row_holds_its_chunk_s_data_bytes_only() -> None:
    model = engine_model("jamba", 2)
    pitches = _jamba_layout().row_pitches
    assert pitches == tuple(group_block_bytes(model, g) for g in range(len(model.groups)))
    assert pitches[1] < pitches[0]  # a Mamba chunk is its state, not the padded page


def test_the_jamba_layout_holds_more_chunks_of_every_group_than_largest_group_rows() -> None:
    pitches = _jamba_layout().row_pitches
    rows = rows_for_budget(BUDGET, pitches)
    old = _largest_row_positions(pitches, BUDGET)
    assert rows == (BUDGET // sum(pitches),) * 3
    # every group holds len(groups) * largest / sum(pitches) times the chunks it held
    assert rows[0] >= old * len(pitches) * max(pitches) // sum(pitches)
    assert sum(r * p for r, p in zip(rows, pitches, strict=True)) <= BUDGET


def test_the_demo_mamba_hybrid_holds_at_least_the_chunks_largest_group_rows_held() -> None:
    profile = PROFILES[ProfileName.JAMBA]
    cache = DemoKVCache(profile)
    layout = build_layout(cache.kv_tensors, 1, on_gpu=False)[0]
    rows = rows_for_budget(profile.cpu_tier_bytes, layout.row_pitches)
    assert min(rows) >= _largest_row_positions(layout.row_pitches, profile.cpu_tier_bytes)


def test_a_mamba_state_far_below_the_page_gives_its_group_5x_the_chunks_in_the_same_bytes() -> None:
    # vLLM's hybrid layout: per layer one 64 KiB page, shared by the attention group (K and V
    # side by side) and two Mamba groups whose 7,881-byte states sit in padded pages
    def group(page_bytes: int) -> GroupLayout:
        return GroupLayout(
            refs=[
                PageRef(address=i << 24, num_blocks=16, page_stride=64 << 10, page_bytes=page_bytes)
                for i in range(12)
            ]
        )

    layout = KVLayout(blocks_per_chunk=1, groups=[group(64 << 10), group(7881), group(7881)])
    pitches = layout.row_pitches
    assert pitches == (786_432, 94_572, 94_572)
    for g in (1, 2):  # the bytes one largest-group row took now hold this many Mamba chunks
        assert pitches[0] // pitches[g] >= 5
    rows = rows_for_budget(BUDGET, pitches)
    assert rows[1] >= 2 * _largest_row_positions(pitches, BUDGET)
