"""Copy expansion: the skip rule, exact consumption, merging, and agreement with a naive oracle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.core.bound import BoundPlan
from kvferry.core.errors import InvalidInputError, PlanInvariantError
from kvferry.core.expand import PageCopies, copy_list, expand_pages, merge_copies, split_copies
from kvferry.core.keys import OffloadKey
from kvferry.core.layout import GroupLayout, KVLayout, PageRef, TierLayout
from kvferry.core.plan import Direction, TransferPlan, chunks_spanned


def _bound(
    direction: Direction, f: int, groups: list[tuple[list[int], int, list[int]]], job: int = 1
) -> BoundPlan:
    keys, ids, sizes, firsts, rows = [], [], [], [], []
    for g, (group_ids, first, group_rows) in enumerate(groups):
        keys += [OffloadKey(g, bytes([g, i])) for i in range(len(group_rows))]
        ids += group_ids
        sizes.append(len(group_ids))
        firsts.append(first)
        rows += group_rows
    plan = TransferPlan(
        request_id="r",
        direction=direction,
        blocks_per_chunk=f,
        keys=keys,
        gpu_block_ids=ids,
        group_sizes=sizes,
        block_indices=firsts,
    )
    return BoundPlan(job_id=job, plan=plan, cpu_rows=rows)


def _one_ref_layout(f: int, stride: int = 10, size: int = 10, blocks: int = 200) -> KVLayout:
    ref = PageRef(address=1000, num_blocks=blocks, page_stride=stride, page_bytes=size)
    return KVLayout(blocks_per_chunk=f, groups=[GroupLayout(refs=[ref])])


def _pages(bound: BoundPlan, layout: KVLayout, rows: int = 16) -> PageCopies:
    """Expand `bound` against `layout` and a tier of `rows` rows per group."""
    return expand_pages(bound, layout, layout.tier(rows))


def test_a_load_inside_a_chunk_pairs_slots_and_blocks_after_the_skip() -> None:
    # gpu_prefix_hit_inside_chunk of docs/semantics.md: F=3, blocks 102-108 from rows 10-12
    bound = _bound(Direction.LOAD, 3, [(list(range(102, 109)), 2, [10, 11, 12])])
    pages = _pages(bound, _one_ref_layout(3))
    slots = [f"{o // 30}.{o // 10 % 3}" for o in pages.cpu_offset.tolist()]
    blocks = ((pages.gpu_address - 1000) // 10).tolist()
    assert list(zip(slots, blocks, strict=True)) == [
        ("10.2", 102), ("11.0", 103), ("11.1", 104), ("11.2", 105),
        ("12.0", 106), ("12.1", 107), ("12.2", 108),
    ]  # fmt: skip


def test_copies_contiguous_on_both_sides_merge_into_one() -> None:
    bound = _bound(Direction.LOAD, 3, [(list(range(102, 109)), 2, [10, 11, 12])])
    copies = copy_list(_pages(bound, _one_ref_layout(3)), host_address=0)
    assert (copies.src.tolist(), copies.dst.tolist(), copies.nbytes.tolist()) == (
        [320],
        [2020],
        [70],
    )


def test_a_store_copies_gpu_to_cpu() -> None:
    bound = _bound(Direction.STORE, 1, [([5], 0, [2])])
    copies = copy_list(_pages(bound, _one_ref_layout(1)), host_address=50_000)
    assert (copies.src.tolist(), copies.dst.tolist()) == ([1050], [50_020])


def test_merging_stops_at_a_break() -> None:
    merged = merge_copies(
        np.array([0, 10, 20]),
        np.array([100, 110, 120]),
        np.array([10, 10, 10]),
        breaks=np.array([False, False, True]),
    )
    assert (merged.src.tolist(), merged.nbytes.tolist()) == ([0, 20], [20, 10])


def test_padded_pages_copy_only_their_bytes_and_do_not_merge() -> None:
    bound = _bound(Direction.STORE, 2, [([4, 5], 0, [0])])
    copies = copy_list(_pages(bound, _one_ref_layout(2, stride=16, size=10)), 0)
    assert copies.nbytes.tolist() == [10, 10]


def test_a_plan_with_more_groups_than_the_layout_is_refused() -> None:
    bound = _bound(Direction.LOAD, 1, [([1], 0, [0]), ([2], 0, [1])])
    with pytest.raises(PlanInvariantError, match="group_sizes"):
        _pages(bound, _one_ref_layout(1))


def test_a_plan_for_another_f_is_refused() -> None:
    bound = _bound(Direction.LOAD, 2, [([1, 2], 0, [0])])
    with pytest.raises(PlanInvariantError, match="blocks_per_chunk"):
        _pages(bound, _one_ref_layout(3))


def test_a_block_id_past_the_tensor_is_refused_naming_the_group() -> None:
    bound = _bound(Direction.LOAD, 1, [([200], 0, [0])])
    with pytest.raises(PlanInvariantError, match=r"group 0.*gpu_block_ids"):
        _pages(bound, _one_ref_layout(1))


def test_a_row_past_the_tier_is_refused_naming_the_group() -> None:
    bound = _bound(Direction.LOAD, 1, [([1], 0, [7])])
    with pytest.raises(PlanInvariantError, match=r"group 0.*cpu_rows"):
        _pages(bound, _one_ref_layout(1), rows=7)


def test_a_store_writing_one_row_twice_is_refused() -> None:
    bound = _bound(Direction.STORE, 1, [([1, 2], 0, [3, 3])])
    with pytest.raises(PlanInvariantError, match="distinct rows"):
        _pages(bound, _one_ref_layout(1))


def _two_group_layout(f: int) -> KVLayout:
    big = PageRef(address=1000, num_blocks=200, page_stride=40, page_bytes=40)
    small = PageRef(address=1 << 20, num_blocks=200, page_stride=64, page_bytes=6)
    return KVLayout(blocks_per_chunk=f, groups=[GroupLayout(refs=[big]), GroupLayout(refs=[small])])


def test_each_group_s_rows_lie_at_its_own_pitch_in_its_own_region() -> None:
    layout = _two_group_layout(2)
    bound = _bound(Direction.STORE, 2, [([1, 2], 0, [3]), ([4, 5, 6, 7], 0, [3, 4])])
    pages = _pages(bound, layout, rows=5)
    assert layout.row_pitches == (80, 12)
    region = 5 * 80  # group 1's rows start after group 0's five
    assert pages.cpu_offset.tolist() == [
        240,
        280,
        region + 36,
        region + 42,
        region + 48,
        region + 54,
    ]


def test_consecutive_rows_of_a_small_group_merge_into_one_copy() -> None:
    layout = _two_group_layout(1)
    small = PageRef(address=1 << 20, num_blocks=200, page_stride=6, page_bytes=6)
    layout = KVLayout(blocks_per_chunk=1, groups=[layout.groups[0], GroupLayout(refs=[small])])
    bound = _bound(Direction.LOAD, 1, [([], 0, []), (list(range(10, 20)), 0, list(range(10)))])
    copies = copy_list(_pages(bound, layout, rows=10), host_address=0)
    assert (copies.src.tolist(), copies.nbytes.tolist()) == ([10 * 40], [60])


def test_a_store_may_use_one_row_number_in_two_groups() -> None:
    bound = _bound(Direction.STORE, 1, [([1], 0, [3]), ([2], 0, [3])])
    pages = _pages(bound, _two_group_layout(1), rows=4)
    assert pages.cpu_offset.tolist() == [120, 4 * 40 + 18]


def test_a_tier_of_other_pitches_is_refused() -> None:
    bound = _bound(Direction.LOAD, 1, [([1], 0, [0])])
    with pytest.raises(InvalidInputError, match="tier"):
        expand_pages(bound, _one_ref_layout(1), _one_ref_layout(2).tier(4))


def _naive(bound: BoundPlan, layout: KVLayout, tier: TierLayout) -> list[tuple[int, int, int]]:
    """(gpu address, cpu offset, bytes) per page and ref, by plain loops, in CPU-row order."""
    plan, f = bound.plan, layout.blocks_per_chunk
    out = []
    ids = plan.gpu_block_ids.tolist()
    rows = bound.cpu_rows.tolist()
    for g, (n, first) in enumerate(zip(plan.group_sizes, plan.block_indices, strict=True)):
        group_ids, ids = ids[:n], ids[n:]
        count = chunks_spanned(n, first % f, f)
        group_rows, rows = rows[:count], rows[count:]
        offsets = layout.groups[g].row_offsets(f)
        for j, row in enumerate(group_rows):
            for r, ref in enumerate(layout.groups[g].refs):
                for slot in range(f):
                    k = j * f + slot - first % f
                    if 0 <= k < n:
                        out.append((
                            ref.address + group_ids[k] * ref.page_stride,
                            tier.row_offset(g, row) + offsets[r] + slot * ref.page_bytes,
                            ref.page_bytes,
                        ))  # fmt: skip
    return out


TIER_ROWS = 20
"""Rows per group of the drawn plans' tier (a group spans at most 17)."""


@st.composite
def _plans(draw: st.DrawFn) -> tuple[BoundPlan, KVLayout]:
    f = draw(st.integers(1, 4))
    num_groups = draw(st.integers(1, 3))
    groups, layout_groups = [], []
    for g in range(num_groups):
        refs = [
            PageRef(
                address=(g * 8 + r) << 20,
                num_blocks=64,
                page_stride=stride,
                page_bytes=draw(st.integers(1, stride)),
            )
            for r, stride in enumerate(draw(st.lists(st.integers(1, 64), min_size=1, max_size=3)))
        ]
        layout_groups.append(GroupLayout(refs=refs))
        n = draw(st.integers(0, 12))
        first = draw(st.integers(0, 5)) if n else 0
        ids = draw(st.permutations(range(64)))[:n]
        count = chunks_spanned(n, first % f, f)
        rows = draw(st.permutations(range(TIER_ROWS)))[:count]  # each group its own row ids
        groups.append((list(ids), first, list(rows)))
    bound = _bound(Direction.LOAD, f, groups)
    return bound, KVLayout(blocks_per_chunk=f, groups=layout_groups)


@given(_plans())
def test_expansion_matches_a_naive_loop_over_pages(case: tuple[BoundPlan, KVLayout]) -> None:
    bound, layout = case
    tier = layout.tier(TIER_ROWS)
    pages = expand_pages(bound, layout, tier)
    got = list(
        zip(
            pages.gpu_address.tolist(),
            pages.cpu_offset.tolist(),
            pages.nbytes.tolist(),
            strict=True,
        )
    )
    assert got == _naive(bound, layout, tier)


@given(_plans())
def test_merged_copies_cover_the_same_bytes(case: tuple[BoundPlan, KVLayout]) -> None:
    bound, layout = case
    pages = _pages(bound, layout, rows=TIER_ROWS)
    merged = copy_list(pages, host_address=1 << 40)

    def byte_pairs(src: np.ndarray, dst: np.ndarray, n: np.ndarray) -> set[tuple[int, int]]:
        return {(s + i, d + i) for s, d, m in zip(src, dst, n, strict=True) for i in range(m)}

    unmerged = byte_pairs(pages.cpu_offset + (1 << 40), pages.gpu_address, pages.nbytes)
    assert byte_pairs(merged.src, merged.dst, merged.nbytes) == unmerged


def test_splitting_cuts_long_copies_into_pieces_and_keeps_short_ones() -> None:
    copies = merge_copies(np.array([0, 1000]), np.array([5000, 9000]), np.array([40, 16]))
    split = split_copies(copies, 16)
    assert split.src.tolist() == [0, 16, 32, 1000]
    assert split.dst.tolist() == [5000, 5016, 5032, 9000]
    assert split.nbytes.tolist() == [16, 16, 8, 16]
