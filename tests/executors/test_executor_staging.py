"""Staged batches (slice tables and link copies), replayed on host memory with memmove and with the
staging kernel (its numpy specification, or its CUDA source compiled for the CPU), copy the same
bytes as direct copies."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import pytest
from _harness import (
    LAYOUT_CASES,
    NUM_BLOCKS,
    NUM_ROWS,
    POISON_HOST,
    GroupMove,
    Model,
    backend_for,
    bound_plan,
)
from _kernel_on_cpu import run_stage_copy, stage_copy_on_cpu
from hypothesis import given
from hypothesis import strategies as st

from kvferry.core.bound import BoundPlan
from kvferry.core.errors import InvalidInputError
from kvferry.core.expand import CopyList, check_bound, expand_pages
from kvferry.core.layout import TierLayout
from kvferry.core.plan import Direction, chunks_spanned
from kvferry.executors.kernels import PIECE_BYTES
from kvferry.executors.staging import (
    REF_FIELDS,
    SLICE_FIELDS,
    StageBatch,
    StagePlanner,
    segment_copies,
)

pytestmark = pytest.mark.usefixtures("route")


def _replay(copies: CopyList, src_base: int, dst_base: int) -> None:
    for s, d, n in zip(
        copies.src.tolist(), copies.dst.tolist(), copies.nbytes.tolist(), strict=True
    ):
        ctypes.memmove(dst_base + d, src_base + s, n)


def _batches(
    model: Model, bound: BoundPlan, capacity: int, piece_rows: int = 0
) -> list[StageBatch]:
    layout = model.executor.layout
    planner = StagePlanner(
        layout,
        capacity=capacity,
        piece_bytes=PIECE_BYTES,
        tier=model.executor.host_tier.tier,
        rows_per_piece=(piece_rows,) * layout.num_groups if piece_rows else (),
    )
    return list(planner.plan(bound).batches)


def _staged(model: Model, bound: BoundPlan, capacity: int, piece_rows: int = 0) -> None:
    """Run `bound` the way a GPU executor does, with a host array standing in for the staging
    and `segment_copies` for the staging kernel."""
    executor = model.executor
    stage = np.full(capacity, 0x77, dtype=np.uint8)
    stage_address, host = int(stage.ctypes.data), executor.host_tier.address
    batches = _batches(model, bound, capacity, piece_rows)
    direction = bound.plan.direction
    ids = bound.plan.gpu_block_ids
    assert sum(b.nbytes for b in batches) == check_bound(bound, executor.layout)
    for batch in batches:
        assert batch.stage_bytes <= capacity
        pages = segment_copies(batch.segments, batch.refs, ids, direction=direction)
        if direction is Direction.STORE:
            _replay(pages, 0, stage_address)
            _replay(batch.dma, stage_address, host)
        else:
            _replay(batch.dma, host, stage_address)
            _replay(pages, stage_address, 0)


def _moves(f: int, groups: int, skip: int) -> list[GroupMove]:
    moves = []
    for g in range(groups):
        rows = (3 * g + 2, 3 * g, 3 * g + 1)
        ids = tuple(range(5 * g, 5 * g + 3 * f - skip))
        moves.append(GroupMove(ids=ids, first=f * 4 + skip, rows=rows))
    return moves


@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
@pytest.mark.parametrize("rows_per_batch", [1, 2, 100])
def test_staged_store_and_load_match_direct_copies(case: str, rows_per_batch: int) -> None:
    f = 3
    groups = len(LAYOUT_CASES[case])
    direct = Model(backend_for("cpu"), LAYOUT_CASES[case], f)
    staged = Model(backend_for("cpu"), LAYOUT_CASES[case], f)
    capacity = rows_per_batch * direct.executor.layout.largest_row_bytes
    rng = np.random.default_rng(5)
    direct.fill_random(rng)
    for a, b in zip(direct.buffers, staged.buffers, strict=True):
        for x, y in zip(a, b, strict=True):
            y[:] = x
    for model in (direct, staged):
        model.executor.host_tier.array[:] = POISON_HOST
    store = [
        GroupMove(ids=tuple(range(5 * g, 5 * g + 3 * f)), first=0, rows=m.rows)
        for g, m in enumerate(_moves(f, groups, 0))
    ]
    direct.run(bound_plan(1, Direction.STORE, f, store))
    _staged(staged, bound_plan(1, Direction.STORE, f, store), capacity, piece_rows=rows_per_batch)
    np.testing.assert_array_equal(staged.executor.host_tier.array, direct.executor.host_tier.array)
    for model in (direct, staged):
        model.poison()
    load = _moves(f, groups, skip=2)
    direct.run(bound_plan(2, Direction.LOAD, f, load))
    _staged(staged, bound_plan(2, Direction.LOAD, f, load), capacity)
    for a, b in zip(direct.snapshot(), staged.snapshot(), strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)


def test_a_staging_buffer_smaller_than_a_row_is_refused() -> None:
    model = Model(backend_for("cpu"), LAYOUT_CASES["mla"], 1)
    layout = model.executor.layout
    with pytest.raises(InvalidInputError, match="staging_bytes"):
        StagePlanner(
            layout,
            capacity=layout.largest_row_bytes - 1,
            piece_bytes=PIECE_BYTES,
            tier=model.executor.host_tier.tier,
        )


@pytest.mark.parametrize("direction", list(Direction))
def test_consecutive_full_rows_cross_the_link_in_one_copy(direction: Direction) -> None:
    model = Model(backend_for("cpu"), LAYOUT_CASES["blocks_first"], 1)
    bound = bound_plan(1, direction, 1, [GroupMove(ids=(9, 2, 30, 4), first=0, rows=(5, 6, 7, 8))])
    (batch,) = _batches(model, bound, capacity=4 * model.executor.layout.largest_row_bytes)
    assert len(batch.dma) == 1
    assert batch.dma.total_bytes == 4 * model.executor.layout.largest_row_bytes


def test_a_store_of_a_partial_chunk_writes_only_its_pages() -> None:
    model = Model(backend_for("cpu"), LAYOUT_CASES["blocks_first"], 3)
    layout = model.executor.layout
    bound = bound_plan(1, Direction.STORE, 3, [GroupMove(ids=(1, 2, 3, 4), first=0, rows=(0, 1))])
    (batch,) = _batches(model, bound, capacity=2 * layout.largest_row_bytes)
    assert batch.dma.total_bytes == batch.nbytes
    assert batch.dma.total_bytes < 2 * layout.largest_row_bytes


def test_the_slice_table_names_every_page_of_the_plan_once() -> None:
    model = Model(backend_for("cpu"), LAYOUT_CASES["hybrid_three_groups"], 3)
    layout = model.executor.layout
    moves = _moves(3, len(LAYOUT_CASES["hybrid_three_groups"]), skip=1)
    bound = bound_plan(1, Direction.LOAD, 3, moves)
    gpu = np.concatenate(
        [
            segment_copies(
                b.segments, b.refs, bound.plan.gpu_block_ids, direction=Direction.LOAD
            ).dst
            for b in _batches(model, bound, capacity=layout.largest_row_bytes)
        ]
    )
    expected = expand_pages(bound, layout, model.executor.host_tier.tier).gpu_address
    assert sorted(gpu.tolist()) == sorted(expected.tolist())
    assert len(set(gpu.tolist())) == len(gpu)


def test_each_batch_counts_its_kernel_pieces() -> None:
    model = Model(backend_for("cpu"), LAYOUT_CASES["blocks_first"], 1)
    bound = bound_plan(1, Direction.STORE, 1, [GroupMove(ids=(1, 2, 3), first=0, rows=(0, 1, 2))])
    (batch,) = _batches(model, bound, capacity=3 * model.executor.layout.largest_row_bytes)
    pages = segment_copies(
        batch.segments, batch.refs, bound.plan.gpu_block_ids, direction=Direction.STORE
    )
    assert batch.items == len(pages)  # pages smaller than PIECE_BYTES are one piece each


def _batch_rows(direction: Direction) -> list[int]:
    """Rows per batch of a 16-row job through staging of 6 rows, with a ramp of one row."""
    model = Model(backend_for("cpu"), LAYOUT_CASES["blocks_first"], 1)
    layout = model.executor.layout
    move = GroupMove(ids=tuple(range(16)), first=0, rows=tuple(range(16)))
    bound = bound_plan(1, direction, 1, [move])
    planner = StagePlanner(
        layout,
        capacity=6 * layout.largest_row_bytes,
        piece_bytes=PIECE_BYTES,
        tier=model.executor.host_tier.tier,
        ramp_bytes=layout.largest_row_bytes,
    )
    return [b.stage_bytes // layout.largest_row_bytes for b in planner.plan(bound).batches]


def test_a_store_starts_with_a_small_batch_so_its_first_dma_starts_early() -> None:
    # a store gathers, then copies out: its link idles during the first gather only
    assert _batch_rows(Direction.STORE) == [1, 6, 6, 3]


def test_a_load_ends_with_a_small_batch_so_its_last_scatter_is_short() -> None:
    # a load copies in, then scatters: its link idles during the last scatter only
    assert _batch_rows(Direction.LOAD) == [6, 6, 3, 1]


@st.composite
def _staged_cases(draw: st.DrawFn) -> tuple[str, int, Direction, list[GroupMove], int, int, int]:
    """A layout case, F, a direction, one move per group, and the planner's sizes (in rows)."""
    case = draw(st.sampled_from(sorted(LAYOUT_CASES)))
    f = draw(st.integers(1, 3))
    direction = draw(st.sampled_from(list(Direction)))
    free_rows = draw(st.permutations(range(NUM_ROWS)))
    if draw(st.booleans()):  # a fresh tier: consecutive rows, so link copies merge
        free_rows = sorted(free_rows)
    moves, taken = [], 0
    for _ in LAYOUT_CASES[case]:
        n = draw(st.integers(0, 2 * f + 1))
        skip = draw(st.integers(0, f - 1)) if direction is Direction.LOAD and n else 0
        rows = chunks_spanned(n, skip, f)
        ids = draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=n, max_size=n, unique=True))
        first = 4 * f + skip if n else 0
        moves.append(
            GroupMove(ids=tuple(ids), first=first, rows=tuple(free_rows[taken : taken + rows]))
        )
        taken += rows
    capacity_rows = draw(st.integers(1, 4))
    ramp_rows = draw(st.integers(1, capacity_rows))
    piece_rows = draw(st.sampled_from([0, 1, 2, 3]))
    kernel_piece = draw(st.sampled_from([32, 48, PIECE_BYTES]))  # small ones cut pages up
    return case, f, direction, moves, capacity_rows, ramp_rows, piece_rows, kernel_piece


def _assert_no_copy_crosses_a_piece(
    regions: TierLayout, batches: Sequence[StageBatch], piece_rows: int, direction: Direction
) -> None:
    """Each group's region is pinned in pieces of `piece_rows` of its rows."""
    bases = np.asarray(regions.base, np.int64)
    for batch in batches:
        tier_side = batch.dma.dst if direction is Direction.STORE else batch.dma.src
        group = np.searchsorted(bases, tier_side, side="right") - 1
        piece = piece_rows * np.asarray(regions.pitch, np.int64)[group]
        first, last = tier_side - bases[group], tier_side + batch.dma.nbytes - 1 - bases[group]
        assert (last // piece == first // piece).all()


@pytest.mark.parametrize("kernel", ["numpy specification", "CUDA source run on the CPU"])
@given(drawn=_staged_cases())
def test_any_staged_plan_moves_exactly_the_bytes_of_direct_copies(
    kernel: str, drawn: tuple[str, int, Direction, list[GroupMove], int, int, int, int]
) -> None:
    compiled = stage_copy_on_cpu() if kernel.startswith("CUDA") else None
    if kernel.startswith("CUDA") and compiled is None:
        pytest.skip("needs g++ to compile the kernel source for the CPU")
    case, f, direction, moves, capacity_rows, ramp_rows, piece_rows, kernel_piece = drawn
    direct = Model(backend_for("cpu"), LAYOUT_CASES[case], f)
    staged = Model(backend_for("cpu"), LAYOUT_CASES[case], f)
    layout = staged.executor.layout  # its refs hold the staged model's addresses
    rng = np.random.default_rng(0)
    direct.fill_random(rng)
    for a, b in zip(direct.buffers, staged.buffers, strict=True):
        for x, y in zip(a, b, strict=True):
            y[:] = x
    tier = rng.integers(0, 256, direct.executor.host_tier.nbytes, dtype=np.uint8)
    for model in (direct, staged):
        model.executor.host_tier.array[:] = tier
    bound = bound_plan(1, direction, f, moves)
    planner = StagePlanner(
        layout,
        capacity=capacity_rows * layout.largest_row_bytes,
        piece_bytes=kernel_piece,
        tier=staged.executor.host_tier.tier,
        rows_per_piece=(piece_rows,) * layout.num_groups if piece_rows else (),
        ramp_bytes=ramp_rows * layout.largest_row_bytes,
    )
    batches = planner.plan(bound).batches
    assert sum(b.nbytes for b in batches) == check_bound(bound, layout)
    assert all(b.stage_bytes <= capacity_rows * layout.largest_row_bytes for b in batches)
    for batch in batches:  # the kernel numbers pieces slice after slice, from 0 in each batch
        pieces = []
        for first_ref, refs, *_, count, _first_item in batch.segments.tolist():
            ref = dict(zip(REF_FIELDS, batch.refs[first_ref : first_ref + refs].T, strict=True))
            per_page = -(-ref["page_bytes"] // kernel_piece)
            np.testing.assert_array_equal(ref["pieces"], per_page)
            np.testing.assert_array_equal(ref["piece_prefix"], np.cumsum(per_page) - per_page)
            pieces.append(count * int(per_page.sum()))
        first_items = batch.segments[:, SLICE_FIELDS.index("first_item")]
        np.testing.assert_array_equal(first_items, np.cumsum(pieces) - pieces)
        assert sum(pieces) == batch.items
    if piece_rows:  # no link copy crosses a registration boundary of the tier
        _assert_no_copy_crosses_a_piece(
            staged.executor.host_tier.tier, batches, piece_rows, direction
        )
    stage = np.full(capacity_rows * layout.largest_row_bytes, 0x77, dtype=np.uint8)
    stage_address, host = int(stage.ctypes.data), staged.executor.host_tier.address
    ids = bound.plan.gpu_block_ids
    store = direction is Direction.STORE

    def stage_copy(batch: StageBatch) -> None:
        if compiled is None:
            pages = segment_copies(batch.segments, batch.refs, ids, direction=direction)
            _replay(pages, *((0, stage_address) if store else (stage_address, 0)))
        else:
            run_stage_copy(
                compiled,
                segments=batch.segments,
                refs=batch.refs,
                ids=ids,
                stage=stage_address,
                to_stage=store,
                piece=kernel_piece,
                blocks=1 + len(batch.segments) % 3,
            )

    for batch in batches:
        if store:
            stage_copy(batch)
            _replay(batch.dma, stage_address, host)
        else:
            _replay(batch.dma, host, stage_address)
            stage_copy(batch)
    direct.run(bound)
    np.testing.assert_array_equal(staged.executor.host_tier.array, direct.executor.host_tier.array)
    for a, b in zip(direct.snapshot(), staged.snapshot(), strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
