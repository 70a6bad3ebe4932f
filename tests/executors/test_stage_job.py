"""The one-call plan-and-queue of a staged job (the job code's `stage_job`, through
`StagedGpuExecutor._queue_compiled`), on each route, makes the driver calls, and writes the table
slot, that its step-by-step specification (`_queue_planned`: the stage planner, the slot write,
`queue_job`) makes and writes for the same job, from the same state; it covers exactly the common
job (rows one consecutive run, every moved group filling its rows, a store's chunks whole and its
pages unpadded, tables that fit the slot) and, for any other, writes and queues nothing."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
from _harness import LAYOUT_CASES, NUM_BLOCKS, NUM_ROWS, GroupMove, Model, TorchBackend, bound_plan
from _torch_on_cpu import TorchOnCpuExecutor
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.bound import BoundPlan
from kvferry.core.plan import Direction, chunks_spanned
from kvferry.executors import register_executor
from kvferry.executors.base import CopyPath
from kvferry.executors.jobcode import default_route
from kvferry.executors.kernels import PIECE_BYTES
from kvferry.executors.staged import GpuJob, StagedGpuExecutor
from kvferry.executors.staging import StagePlanner

pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("route")

NAME = "recording-staged"
COMPUTE = 5
"""The raw compute stream both paths are given."""


class RecordingExecutor(TorchOnCpuExecutor):
    """The torch executor on CPU whose every driver call, table copy and staging-kernel launch
    is only listed in `calls` (nothing is copied), its streams numbered apart."""

    name = NAME

    def __init__(self, **options: Any) -> None:
        self.calls: list[tuple[Any, ...]] = []
        super().__init__(**options)

    def _stream_handle(self, stream: Any) -> int:
        return id(stream)  # lanes told apart in the calls

    def _record(self, event: Any, stream: int) -> None:
        self.calls.append(("record", id(event), stream))

    def _wait(self, stream: int, event: Any) -> None:
        self.calls.append(("wait", stream, id(event)))

    def _memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.calls.append(("copy", dst, src, nbytes, stream))

    def _copy_table(self, dst: int, src: int, count: int, stream: int) -> None:
        self.calls.append(("table", dst, src, count, stream))

    def _stage_copy(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("kernel", args, tuple(sorted(kwargs.items()))))


def _executor(case: str, f: int, rows_per_half: int) -> RecordingExecutor:
    """Return the recording executor of the layout `case` on this run's route (made once)."""
    return _made(case, f, rows_per_half, default_route())


@functools.cache
def _made(case: str, f: int, rows_per_half: int, route: str) -> RecordingExecutor:
    register_executor(NAME, "test_stage_job:RecordingExecutor")
    backend = TorchBackend(NAME, device="cpu")
    row_bytes = Model(backend, LAYOUT_CASES[case], f, route=route).executor
    staging = 2 * rows_per_half * row_bytes.layout.largest_row_bytes
    model = Model(  # the calls on this thread, for the test to read at once
        backend, LAYOUT_CASES[case], f, staging_bytes=staging, route=route, submit_thread=False
    )
    assert isinstance(model.executor, RecordingExecutor)
    return model.executor


def covered(executor: StagedGpuExecutor, bound: BoundPlan) -> bool:
    """Whether `stage_job` should plan `bound` itself, by the rule its docstring states (a
    store's plan starts every group at a chunk's first slot: `TransferPlan` checks that)."""
    plan, layout = bound.plan, executor.layout
    f = layout.blocks_per_chunk
    rows, key = bound.cpu_rows, 0
    for n, first in zip(plan.group_sizes, plan.block_indices, strict=True):
        if not n:
            continue
        keys = (n + first % f + f - 1) // f
        own = rows[key : key + keys]
        key += keys
        if len(own) > 1 and not bool((np.diff(own) == 1).all()):
            return False  # each group's rows must be one run (in its own region)
        if plan.direction is Direction.STORE and n % f:
            return False
    return True


@st.composite
def jobs(draw: st.DrawFn) -> tuple[str, int, int, BoundPlan]:
    """A layout case, blocks per chunk, staging rows per half and a job on them: rows mostly one
    consecutive run (at times shuffled), groups of any size and skip (a store's mostly whole)."""
    case = draw(st.sampled_from(sorted(LAYOUT_CASES)))
    f = draw(st.integers(1, 3))
    direction = draw(st.sampled_from(Direction))
    whole = direction is Direction.STORE and draw(st.booleans())
    moves, spans = [], []
    for _ in LAYOUT_CASES[case]:
        if whole:
            n, skip = f * draw(st.integers(0, 4)), 0
        elif direction is Direction.STORE:  # a store starts at a chunk's first slot
            n, skip = draw(st.integers(0, 10)), 0
        else:
            n, skip = draw(st.integers(0, 10)), draw(st.integers(0, f - 1))
        spans.append((n, skip, chunks_spanned(n, skip, f)))
    total = sum(count for _, _, count in spans)
    if total > NUM_ROWS:
        spans = [(0, 0, 0) for _ in spans]
        total = 0
    start = draw(st.integers(0, NUM_ROWS - total))
    rows = list(range(start, start + total))
    if draw(st.integers(0, 3)) == 0:
        rows = draw(st.permutations(rows))
    ids = iter(draw(st.permutations(range(NUM_BLOCKS))))
    for n, skip, count in spans:
        moves.append(
            GroupMove(ids=tuple(next(ids) for _ in range(n)), first=skip, rows=tuple(rows[:count]))
        )
        rows = rows[count:]
    job_id = draw(st.integers(0, 1000))
    return case, f, draw(st.integers(1, 3)), bound_plan(job_id, direction, f, moves)


def _both_paths(
    executor: RecordingExecutor, bound: BoundPlan, *, first: int, after_previous: bool
) -> tuple[int, list[Any], Any, int, list[Any], Any]:
    """Queue `bound` by `_queue_compiled`, then by `_queue_planned` from the same slot state;
    return each one's batches, calls and slot contents after the ref table."""
    direction = bound.plan.direction
    k, slot = executor._free_slot(direction)
    refs = executor._planner.ref_table.size
    slot.view[refs:] = -1
    job = GpuJob(start=object(), end=object(), keep=[], path=CopyPath.STAGED)
    previous = object() if after_previous else None
    executor.calls.clear()
    compiled = executor._queue_compiled(bound, slot, job, previous, first=first, compute=COMPUTE)
    compiled_calls, compiled_view = list(executor.calls), slot.view[refs:].copy()
    slot.view[refs:] = -1
    executor.calls.clear()
    planned_slot, planned = executor._queue_planned(
        bound, k, job, previous, first=first, compute=COMPUTE
    )
    planned_calls = list(executor.calls)
    planned_view = planned_slot.view[refs:].copy()
    executor._tables[direction][k] = slot  # the next example starts from the same slots
    return compiled, compiled_calls, compiled_view, planned, planned_calls, planned_view


def _with_tier_pieces(executor: RecordingExecutor, piece_rows: int) -> None:
    """Plan as if the tier were registered in pieces of `piece_rows` rows (0: one piece)."""
    layout = executor.layout
    executor._planner = StagePlanner(
        layout,
        capacity=executor._half_bytes,
        piece_bytes=PIECE_BYTES,
        tier=executor.host_tier.tier,
        rows_per_piece=(piece_rows,) * layout.num_groups if piece_rows else (),
        code=executor._code,
    )
    executor._constants.clear()


@settings(max_examples=300, deadline=None)
@given(jobs(), st.integers(0, 1), st.booleans(), st.integers(0, 3))
def test_a_covered_job_makes_the_planned_paths_calls_and_tables_and_another_nothing(
    job: tuple[str, int, int, BoundPlan], first: int, after_previous: bool, piece_rows: int
) -> None:
    case, f, rows_per_half, bound = job
    executor = _executor(case, f, rows_per_half)
    _with_tier_pieces(executor, piece_rows)
    compiled, c_calls, c_view, planned, p_calls, p_view = _both_paths(
        executor, bound, first=first, after_previous=after_previous
    )
    assert p_calls, "the planned path queues a job's calls"
    if covered(executor, bound):
        assert (compiled, c_calls) == (planned, p_calls)
        assert np.array_equal(c_view, p_view)
    else:
        assert (compiled, c_calls) == (-1, [])
        assert (c_view == -1).all()


def _one_group_job(
    direction: Direction, n: int, rows: list[int], *, f: int = 2, skip: int = 0
) -> BoundPlan:
    """A job of `n` blocks of the first group, `skip` slots into a chunk of `f`, on `rows`."""
    move = GroupMove(ids=tuple(range(n)), first=skip, rows=tuple(rows))
    return bound_plan(7, direction, f, [move])


def test_a_load_on_a_run_of_rows_is_planned_by_the_compiled_call() -> None:
    executor = _executor("mla", 2, 2)
    _with_tier_pieces(executor, 0)
    bound = _one_group_job(Direction.LOAD, 7, [3, 4, 5, 6], skip=1)
    compiled, c_calls, _, planned, p_calls, _ = _both_paths(
        executor, bound, first=1, after_previous=True
    )
    assert compiled == planned == 2
    assert c_calls == p_calls


@pytest.mark.parametrize(
    ("direction", "n", "rows", "skip"),
    [
        (Direction.LOAD, 4, [3, 5], 0),  # rows not one run
        (Direction.STORE, 3, [3, 4], 0),  # a store's partial last chunk
    ],
)
def test_the_compiled_call_declines_what_it_does_not_cover(
    direction: Direction, n: int, rows: list[int], skip: int
) -> None:
    executor = _executor("mla", 2, 2)
    _with_tier_pieces(executor, 0)
    bound = _one_group_job(direction, n, rows, skip=skip)
    compiled, c_calls, c_view, planned, p_calls, _ = _both_paths(
        executor, bound, first=0, after_previous=False
    )
    assert (compiled, c_calls) == (-1, [])
    assert (c_view == -1).all()
    assert planned >= 1 and p_calls


def test_a_store_of_padded_pages_is_covered_since_rows_hold_no_padding() -> None:
    executor = _executor("mamba_padded", 1, 2)
    bound = _one_group_job(Direction.STORE, 2, [0, 1], f=1)
    assert covered(executor, bound)
    compiled, c_calls, _, planned, p_calls, _ = _both_paths(
        executor, bound, first=0, after_previous=False
    )
    assert compiled == planned >= 1
    assert c_calls == p_calls


def test_tables_that_do_not_fit_the_slot_are_declined() -> None:
    executor = _executor("mla", 1, 1)
    bound = _one_group_job(Direction.LOAD, 4, [0, 1, 2, 3], f=1)
    direction = bound.plan.direction
    _, slot = executor._free_slot(direction)
    small = executor._planner.ref_table.size + 4  # the ids, but not the slice table
    job = GpuJob(start=object(), end=object(), keep=[], path=CopyPath.STAGED)
    view = slot.view[:small]
    cramped = (view, slot.address, slot.tables_address, slot.kernel)
    executor.calls.clear()
    original = slot.job_tables
    try:
        object.__setattr__(slot, "job_tables", cramped)
        assert executor._queue_compiled(bound, slot, job, None, first=0, compute=COMPUTE) == -1
    finally:
        object.__setattr__(slot, "job_tables", original)
    assert executor.calls == []
