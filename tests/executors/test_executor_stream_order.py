"""The staged executor's streams and events order every hazard, checked on a stream-order model.

`_stream_model.StreamOrderModel` runs the torch executor on CPU tensors and logs every CUDA
operation it queues (streams as FIFO queues, waits capturing the record made before them, host
syncs and host writes), the host's writes of a job's tables into a pinned table slot, their
upload to the direction's device tables, and each kernel's reads of its tables there;
happens-before is computed from the log. Random sequences
of loads and stores, of 0, 1, 2, 3 or many batches, some finished between submits and some not,
must keep each hazard ordered.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import pytest
from _harness import LAYOUT_CASES, NUM_BLOCKS, NUM_ROWS, GroupMove, Model, TorchBackend, bound_plan
from _stream_model import (
    COMPUTE_STREAMS,
    Access,
    JobTrace,
    Kind,
    Op,
    StreamOrderModel,
    Trace,
    happens_before,
    unordered_conflicts,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.plan import Direction, chunks_spanned
from kvferry.executors import register_executor
from kvferry.executors.staged import TABLE_SLOTS

pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("route")

NAME = "stream-order-model"
CASES = ("mla", "hybrid_three_groups")
PROPERTY = settings(max_examples=60)


# --- scenarios -------------------------------------------------------------------------------


@attrs.frozen
class Submit:
    """Submit a job behind the engine's work on compute stream `stream`."""

    direction: Direction
    moves: tuple[GroupMove, ...]
    stream: int


@attrs.frozen
class Finish:
    """Wait for the in-flight job at `position` (modulo how many are in flight)."""

    position: int


@attrs.frozen
class Poll:
    """Poll: every job in flight is reported."""


Step = Submit | Finish | Poll


@attrs.frozen
class Scenario:
    case: str
    f: int
    rows_per_half: int
    steps: tuple[Step, ...]


@st.composite
def _submits(
    draw: st.DrawFn, case: str, f: int, rows_per_half: int, directions: tuple[Direction, ...]
) -> Submit:
    direction = draw(st.sampled_from(directions))
    # rows in one run (the jobs the job code's `stage_job` plans itself) or shuffled (the
    # step-by-step path)
    if draw(st.booleans()):
        free = iter(range(draw(st.integers(0, NUM_ROWS - 1)), NUM_ROWS))
    else:
        free = iter(draw(st.permutations(range(NUM_ROWS))))
    moves = []
    for _ in LAYOUT_CASES[case]:
        # 0, 1, 2 or 3 batches for a single group, or many
        batches = draw(st.sampled_from([0, 1, 2, 3, 5, 8]))
        n = draw(
            st.integers(max(0, (batches - 1) * rows_per_half * f), batches * rows_per_half * f)
        )
        skip = draw(st.integers(0, f - 1)) if direction is Direction.LOAD and n else 0
        count = chunks_spanned(n, skip, f)
        rows = [row for row, _ in zip(free, range(count), strict=False)]
        if len(rows) < count:  # the tier is full: this group moves nothing
            n, skip, rows = 0, 0, []
        ids = draw(st.permutations(range(NUM_BLOCKS)))[:n]
        moves.append(GroupMove(ids=tuple(ids), first=skip, rows=tuple(rows)))
    return Submit(direction, tuple(moves), draw(st.sampled_from(COMPUTE_STREAMS)))


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    case = draw(st.sampled_from(CASES))
    f = draw(st.integers(1, 2))
    rows_per_half = draw(st.integers(1, 3))
    # mostly submits, at times of one direction only or with no wait before the close: a
    # direction often has more jobs in flight than it has table slots
    directions = draw(st.sampled_from([tuple(Direction), (Direction.STORE,), (Direction.LOAD,)]))
    submit = _submits(case, f, rows_per_half, directions)
    waits = st.one_of(st.builds(Finish, st.integers(0, 7)), st.just(Poll()))
    step = draw(st.sampled_from([submit, st.one_of(submit, submit, submit, waits)]))
    steps = draw(st.lists(step, min_size=1, max_size=3 * TABLE_SLOTS))
    return Scenario(case, f, rows_per_half, tuple(steps))


@functools.cache
def _row_bytes(case: str, f: int) -> int:
    return _model(case, f, staging_bytes=1).executor.layout.largest_row_bytes


def _model(case: str, f: int, staging_bytes: int, *, submit_thread: bool = False) -> Model:
    register_executor(NAME, "_stream_model:StreamOrderModel")
    return Model(
        TorchBackend(NAME, device="cpu"),
        LAYOUT_CASES[case],
        f,
        staging_bytes=staging_bytes,
        submit_thread=submit_thread,
    )


def run(
    scenario: Scenario, *, min_table_values: int | None = None, submit_thread: bool = False
) -> StreamOrderModel:
    """Play `scenario` on a fresh model (its table buffers at least `min_table_values` int64,
    when given; its staged jobs' calls made by a submission thread when `submit_thread`),
    close it, and return the model with its log."""
    staging = 2 * scenario.rows_per_half * _row_bytes(scenario.case, scenario.f)
    executor = _model(scenario.case, scenario.f, staging, submit_thread=submit_thread).executor
    assert isinstance(executor, StreamOrderModel)
    if min_table_values is not None:
        executor.min_table_values = min_table_values
    in_flight: list[int] = []
    results = []
    for job_id, step in enumerate(scenario.steps):
        if isinstance(step, Submit):
            bound = bound_plan(job_id, step.direction, scenario.f, step.moves)
            in_flight.append(executor.submit_behind_compute(bound, step.stream))
        elif isinstance(step, Finish) and in_flight:
            results += executor.wait([in_flight.pop(step.position % len(in_flight))])
        elif isinstance(step, Poll):
            results += executor.poll()
            in_flight.clear()
    results += executor.close()
    assert all(r.success for r in results), results
    assert len(results) == len(executor.jobs)
    return executor


# --- the invariants, each a list of violations -------------------------------------------------


def staging_races(model: StreamOrderModel) -> list[tuple[Op, Op]]:
    """Two ops touching one staging half, at least one writing, that nothing orders."""
    return unordered_conflicts(model.trace.ops, "stage")


TABLE_MEMORY = ("pinned", "tables")
"""Where a job's tables lie: its pinned table slot, then (uploaded) its direction's device
tables, which its kernels read."""


def kernels_reading_tables_not_written_for_them(
    model: StreamOrderModel,
) -> list[tuple[Op | None, Op]]:
    """A kernel reading no tables, or tables elsewhere than in device tables; or a read of
    tables (a kernel's, or an upload's of its slot) whose last write before it does not cover
    it, is not ordered before it, or is neither a slot's ref table nor written for the reader's
    own job (the host's write of a slot, the job's upload to the device)."""
    tables = set(TABLE_MEMORY)
    writes = [
        op
        for op in model.trace.ops
        if any(a.write and a.resource[0] in tables for a in op.accesses)
    ]
    found: list[tuple[Op | None, Op]] = []
    for op in model.trace.ops:
        reads = [a for a in op.accesses if a.resource[0] in tables and not a.write]
        if op.kind is Kind.KERNEL and (not reads or any(a.resource[0] != "tables" for a in reads)):
            found.append((None, op))
        for read in reads:
            before = [w for w in writes if w.index < op.index]
            last = [w for w in before if any(read.conflicts(a) for a in w.accesses)]
            write = last[-1] if last else None
            if not (
                write is not None
                and happens_before(write, op)
                and (write.label == "ref table" or write.job == op.job)
                and any(
                    a.resource == read.resource and a.lo <= read.lo and read.hi <= a.hi
                    for a in write.accesses
                )
            ):
                found.append((write, op))
    return found


def table_slots_rewritten_while_read(model: StreamOrderModel) -> list[tuple[Op, Op]]:
    """A host write of a table slot not ordered after an earlier op that reads it (an upload;
    a kernel, were one to read the slot)."""
    return [
        (a, b)
        for a, b in unordered_conflicts(model.trace.ops, "pinned")
        if a.kind in (Kind.KERNEL, Kind.UPLOAD) and b.kind is Kind.HOST
    ]


def device_tables_overwritten_while_read(model: StreamOrderModel) -> list[tuple[Op, Op]]:
    """An upload to device tables not ordered after an earlier kernel that reads them."""
    return [
        (a, b)
        for a, b in unordered_conflicts(model.trace.ops, "tables")
        if a.kind is Kind.KERNEL and b.kind is Kind.UPLOAD
    ]


def ops_outside_their_job(model: StreamOrderModel) -> list[tuple[Op, Op]]:
    """A job's op not after its start record, or not before its end record."""
    found = []
    for job in model.jobs.values():
        found += [(job.start, op) for op in job.work if not happens_before(job.start, op)]
        found += [(op, job.end) for op in job.work if not happens_before(op, job.end)]
    return found


def ops_before_queued_compute(model: StreamOrderModel) -> list[tuple[Op, Op]]:
    """A job's op not after the engine's work queued on the compute stream before its submit."""
    return [
        (job.compute, op)
        for job in model.jobs.values()
        for op in job.work
        if not happens_before(job.compute, op)
    ]


def writes_before_the_previous_job_of_their_direction(
    model: StreamOrderModel,
) -> list[tuple[Op, Op]]:
    """An op of a job that writes what the previous job of its direction may also write (a
    store's DMA to the tier, a load's scatter into KV blocks), or the job's end record, not
    after the end of that previous job."""
    found = []
    for direction in Direction:
        jobs = [job for job in model.jobs.values() if job.direction is direction]
        for previous, job in itertools.pairwise(jobs):
            writes = [op for op in job.work if _writes_shared_memory(op)] + [job.end]
            found += [(previous.end, op) for op in writes if not happens_before(previous.end, op)]
    return found


def _writes_shared_memory(op: Op) -> bool:
    """Whether `op` writes the tier (a store's DMA) or KV blocks (a load's scatter)."""
    if op.kind is Kind.KERNEL:
        return op.label == "scatter"
    return any(access.write and access.resource == ("tier",) for access in op.accesses)


def timing_waits_on_other_records(model: StreamOrderModel) -> list[tuple[Op | None, Op]]:
    """A host wait on a job's timing events that captured a record other than the job's."""
    return [
        (start, end)
        for job in model.jobs.values()
        for start, end in job.timed
        if end is not job.end or start not in (None, job.start)
    ]


Invariant = Callable[[StreamOrderModel], Sequence[tuple[Op | None, Op]]]


def _holds(invariant: Invariant, model: StreamOrderModel) -> None:
    violations = invariant(model)
    assert not violations, f"{invariant.__doc__}: {violations[:3]} ({len(violations)})"


# --- the model's own semantics -------------------------------------------------------------------


def _stage(stream: int, trace: Trace, *, write: bool, waits_for: Op | None = None) -> Op:
    half = Access(("stage", Direction.STORE, 0), 0, 64, write)
    return trace.queue(Kind.KERNEL, stream, accesses=[half], waits_for=waits_for)


def test_the_model_flags_two_lanes_touching_one_half_without_a_wait() -> None:
    trace = Trace()
    _stage(100, trace, write=True)
    _stage(101, trace, write=False)
    assert len(unordered_conflicts(trace.ops, "stage")) == 1


def test_the_model_orders_a_lane_after_the_record_it_waited_on() -> None:
    trace = Trace()
    gather = _stage(100, trace, write=True)
    record = trace.queue(Kind.RECORD, 100)
    _stage(101, trace, write=False, waits_for=record)
    assert unordered_conflicts(trace.ops, "stage") == []
    assert happens_before(gather, trace.ops[-1])


def test_a_wait_captures_the_record_made_before_it_not_a_later_one() -> None:
    model = _model("mla", 1, staging_bytes=1).executor
    assert isinstance(model, StreamOrderModel)
    event = model._new_event()
    first = model.trace.queue(Kind.COMPUTE, 1)
    model._record(event, 1)
    model._wait(100, event)
    later = model.trace.queue(Kind.COMPUTE, 1)
    model._record(event, 1)  # re-recorded after the wait: the wait still sees the first record
    waiter = model.trace.queue(Kind.KERNEL, 100)
    assert happens_before(first, waiter)
    assert not happens_before(later, waiter)


def test_a_host_sync_orders_everything_queued_after_it() -> None:
    trace = Trace()
    gather = _stage(100, trace, write=True)
    trace.host_synchronizes(100)
    assert happens_before(gather, _stage(101, trace, write=True))


def _slot(trace: Trace, stream: int | None, *, write: bool) -> Op:
    tables = Access(("pinned", 0), 0, 64, write)
    return trace.queue(Kind.HOST if write else Kind.KERNEL, stream, accesses=[tables])


def test_a_host_write_happens_before_everything_queued_after_it() -> None:
    trace = Trace()
    write = _slot(trace, None, write=True)
    assert happens_before(write, _slot(trace, 100, write=False))
    assert unordered_conflicts(trace.ops, "pinned") == []


def test_the_model_flags_a_host_write_over_a_read_the_host_did_not_wait_for() -> None:
    trace = Trace()
    read = _slot(trace, 100, write=False)
    trace.host_synchronizes(101)  # another stream: no wait for the read
    write = _slot(trace, None, write=True)
    assert unordered_conflicts(trace.ops, "pinned") == [(read, write)]


def test_a_host_wait_on_a_record_after_a_read_orders_the_rewrite() -> None:
    trace = Trace()
    read = _slot(trace, 100, write=False)
    trace.host_waits_for(trace.queue(Kind.RECORD, 100))
    write = _slot(trace, None, write=True)
    assert happens_before(read, write)
    assert unordered_conflicts(trace.ops, "pinned") == []


# --- the protocol, on random job sequences ------------------------------------------------------


@PROPERTY
@given(scenarios())
def test_no_two_ops_race_on_a_staging_half(scenario: Scenario) -> None:
    _holds(staging_races, run(scenario))


@PROPERTY
@given(scenarios())
def test_kernels_read_their_jobs_tables_after_the_host_wrote_them(scenario: Scenario) -> None:
    _holds(kernels_reading_tables_not_written_for_them, run(scenario))


@PROPERTY
@given(scenarios())
def test_the_host_rewrites_a_table_slot_only_after_the_kernels_that_read_it(
    scenario: Scenario,
) -> None:
    _holds(table_slots_rewritten_while_read, run(scenario))


@PROPERTY
@given(scenarios())
def test_an_upload_overwrites_the_device_tables_only_after_the_kernels_that_read_them(
    scenario: Scenario,
) -> None:
    _holds(device_tables_overwritten_while_read, run(scenario))


@PROPERTY
@given(scenarios())
def test_every_op_of_a_job_lies_between_its_start_and_end_records(scenario: Scenario) -> None:
    _holds(ops_outside_their_job, run(scenario))


@PROPERTY
@given(scenarios())
def test_a_job_runs_after_the_compute_queued_before_its_submit(scenario: Scenario) -> None:
    _holds(ops_before_queued_compute, run(scenario))


@PROPERTY
@given(scenarios())
def test_jobs_of_one_direction_write_and_end_in_submission_order(scenario: Scenario) -> None:
    _holds(writes_before_the_previous_job_of_their_direction, run(scenario))


@PROPERTY
@given(scenarios())
def test_finishing_a_job_waits_on_its_own_timing_records(scenario: Scenario) -> None:
    model = run(scenario)
    _holds(timing_waits_on_other_records, model)
    assert model.trace.misuse == []


INVARIANTS: tuple[Invariant, ...] = (
    staging_races,
    kernels_reading_tables_not_written_for_them,
    table_slots_rewritten_while_read,
    device_tables_overwritten_while_read,
    ops_outside_their_job,
    ops_before_queued_compute,
    writes_before_the_previous_job_of_their_direction,
    timing_waits_on_other_records,
)


@PROPERTY
@given(scenarios())
def test_every_invariant_holds_when_a_submission_thread_makes_the_calls(
    scenario: Scenario,
) -> None:
    model = run(scenario, submit_thread=True)
    assert model._submitter is None  # closed with the executor
    for invariant in INVARIANTS:
        _holds(invariant, model)
    assert model.trace.misuse == []


# --- targeted cases -----------------------------------------------------------------------------


def _store(rows: range) -> Submit:
    ids = tuple(range(rows.start, rows.stop))
    return Submit(Direction.STORE, (GroupMove(ids=ids, first=0, rows=tuple(rows)),), 1)


def test_timing_events_reused_after_a_finish_capture_the_new_jobs_records() -> None:
    # job 0 finishes, job 1 takes its events and is still in flight when job 2 is submitted
    steps = (_store(range(0, 2)), Finish(0), _store(range(2, 5)), _store(range(5, 6)))
    model = run(Scenario("mla", 1, 1, (*steps, Finish(0), Finish(0))))
    first, reused, fresh = (model.jobs[i] for i in (0, 2, 3))
    events = {op.label.split("(")[1] for op in (first.start, first.end)}
    assert {op.label.split("(")[1] for op in (reused.start, reused.end)} == events
    assert not events & {op.label.split("(")[1] for op in (fresh.start, fresh.end)}
    _holds(timing_waits_on_other_records, model)
    _holds(writes_before_the_previous_job_of_their_direction, model)


@pytest.mark.parametrize("finished", [True, False])
def test_a_job_waits_for_the_previous_one_of_its_direction_unless_the_host_saw_it_end(
    finished: bool,
) -> None:
    # a finished job's events went back to the pool: later jobs may record them again
    steps = (_store(range(0, 2)), *((Finish(0),) if finished else ()), _store(range(2, 4)))
    model = run(Scenario("mla", 1, 1, steps))
    first, second = model.jobs.values()
    previous_end = first.end.label.removeprefix("end (").removesuffix(")")
    waits = [op for op in model.trace.ops if op.kind is Kind.WAIT and op.job == second.job_id]
    assert [op.label for op in waits if op.label == previous_end] == (
        [] if finished else [previous_end]
    )
    _holds(writes_before_the_previous_job_of_their_direction, model)


@pytest.mark.parametrize("batches", [0, 1, 2, 3])
def test_a_direction_has_table_slots_jobs_in_flight_and_the_next_waits_for_the_first(
    batches: int,
) -> None:
    # TABLE_SLOTS + 1 stores, none finished before the last is submitted, then a load
    stores = tuple(_store(range(k, k + batches)) for k in range(TABLE_SLOTS + 1))
    load = Submit(Direction.LOAD, (GroupMove(ids=(0,), first=0, rows=(0,)),), 2)
    model = run(Scenario("mla", 1, 1, (*stores, load)))
    jobs = [model.jobs[i] for i in range(TABLE_SLOTS + 1)]
    writes = [job.tables for job in jobs]
    slots = [write.accesses[0].resource for write in writes]
    reads = [[op for op in job.work if op.kind is Kind.KERNEL] for job in jobs]
    assert all(len(kernels) == batches for kernels in reads)
    # each job in flight has a slot of its own, and writing it waited for no earlier job
    assert len(set(slots[:TABLE_SLOTS])) == TABLE_SLOTS
    for k, write in enumerate(writes[:TABLE_SLOTS]):
        assert not any(happens_before(op, write) for job in jobs[:k] for op in job.work), k
    # the next job takes the first one's slot once its kernels have run, and the load its own
    assert slots[TABLE_SLOTS] == slots[0]
    assert all(happens_before(op, writes[TABLE_SLOTS]) for op in reads[0])
    assert model.jobs[TABLE_SLOTS + 1].tables.accesses[0].resource not in slots
    _holds(table_slots_rewritten_while_read, model)
    _holds(kernels_reading_tables_not_written_for_them, model)


def _half(op: Op) -> tuple[object, ...]:
    (half,) = [a.resource for a in op.accesses if a.resource[0] == "stage"]
    return half


def _batch_ops(job: JobTrace) -> list[list[Op]]:
    """Return the ops of each of the job's batches (its kernel and DMAs, on one half)."""
    runs: list[list[Op]] = []
    for op in job.work:
        if op.kind is Kind.UPLOAD:
            continue
        if runs and _half(runs[-1][0]) == _half(op):
            runs[-1].append(op)
        else:
            runs.append([op])
    return runs


@pytest.mark.parametrize("batches", [1, 2, 3, 6])
def test_consecutive_batches_of_a_job_run_on_two_lanes_and_may_overlap(batches: int) -> None:
    model = run(Scenario("mla", 1, 1, (_store(range(batches)),)))
    job = model.jobs[0]
    assert job.batches == batches
    runs = _batch_ops(job)
    assert len(runs) == batches
    for k, (batch, following) in enumerate(itertools.pairwise(runs)):
        assert {op.stream for op in batch} != {op.stream for op in following}, k
        assert not happens_before(batch[-1], following[0]), k


def _job(direction: Direction, rows: range) -> Submit:
    ids = tuple(range(rows.start, rows.stop))
    return Submit(direction, (GroupMove(ids=ids, first=0, rows=tuple(rows)),), 2)


@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("batches", [1, 2, 3])
def test_a_job_uploads_its_tables_on_its_first_lane_and_its_kernels_read_that_copy(
    direction: Direction, batches: int
) -> None:
    # two jobs in flight, each reading the device tables of its own table slot
    jobs = (_job(direction, range(batches)), _job(direction, range(batches, 2 * batches)))
    model = run(Scenario("mla", 1, 1, jobs))
    first, second = model.jobs[0], model.jobs[1]
    copies = []
    for job in (first, second):
        upload = job.upload
        assert upload is not None and upload.stream == job.start.stream
        assert happens_before(job.tables, upload)
        (copy,) = [a for a in upload.accesses if a.write]
        kernels = [op for op in job.work if op.kind is Kind.KERNEL]
        assert len(kernels) == batches
        assert len({op.stream for op in kernels}) == min(batches, 2)
        for kernel in kernels:  # on either lane, after the upload, reading the copy
            assert happens_before(upload, kernel)
            reads = [a for a in kernel.accesses if a.resource[0] in TABLE_MEMORY]
            assert reads and all(
                a.resource == copy.resource and copy.lo <= a.lo and a.hi <= copy.hi for a in reads
            )
        copies.append(copy.resource)
    assert copies[0] != copies[1]
    _holds(kernels_reading_tables_not_written_for_them, model)
    _holds(device_tables_overwritten_while_read, model)


def test_each_direction_has_device_tables_of_its_own() -> None:
    # a store and a load in flight together: neither's upload touches the other's tables
    model = run(
        Scenario("mla", 1, 1, (_job(Direction.STORE, range(2)), _job(Direction.LOAD, range(2, 4))))
    )
    store, load = model.jobs[0], model.jobs[1]
    assert store.upload is not None and load.upload is not None
    (store_copy,) = [a.resource for a in store.upload.accesses if a.write]
    (load_copy,) = [a.resource for a in load.upload.accesses if a.write]
    assert store_copy != load_copy
    _holds(device_tables_overwritten_while_read, model)


def test_a_job_whose_tables_outgrow_their_buffers_still_moves_its_bytes() -> None:
    # one block, then six (a grown slot and grown device tables), stored and loaded back
    model = _model("mla", 1, staging_bytes=2 * _row_bytes("mla", 1))
    executor = model.executor
    assert isinstance(executor, StreamOrderModel)
    executor.min_table_values = executor._planner.ref_table.size + 4
    model.fill_random(np.random.default_rng(3))
    before = model.snapshot()
    jobs = [(Direction.STORE, range(1)), (Direction.STORE, range(1, 7))]
    jobs += [(Direction.LOAD, range(1)), (Direction.LOAD, range(1, 7))]
    for job_id, (direction, blocks) in enumerate(jobs):
        if job_id == 2:
            model.poison()
        bound = bound_plan(job_id, direction, 1, _job(direction, blocks).moves)
        executor.submit_behind_compute(bound, COMPUTE_STREAMS[0])
        (result,) = executor.wait([job_id])
        assert result.success, result.error
    for direction in Direction:  # the six-block job's slot grew, its device tables with it
        capacities = sorted(slot.capacity for slot in executor._tables[direction])
        assert capacities[0] < capacities[-1] and capacities.count(capacities[-1]) == 1
    after = model.snapshot()
    page = len(before[0][0]) // NUM_BLOCKS  # blocks-first: block i is page i
    for x, y in zip(before[0], after[0], strict=True):
        np.testing.assert_array_equal(x[: 7 * page], y[: 7 * page])


@pytest.mark.parametrize("batches", [1, 2, 3])
def test_a_job_starts_on_the_lane_after_the_previous_jobs_last_batch(batches: int) -> None:
    model = run(Scenario("mla", 1, 1, (_store(range(batches)), _store(range(batches, 6)))))
    first, second = model.jobs[0], model.jobs[1]
    last_lane = _batch_ops(first)[-1][0].stream
    assert second.start.stream != last_lane
    assert _batch_ops(second)[0][0].stream != last_lane


@pytest.mark.parametrize("direction", list(Direction))
def test_the_next_job_prepares_its_first_batch_while_the_previous_ones_last_batch_runs(
    direction: Direction,
) -> None:
    # two three-batch jobs in flight: the second's upload and its first copy into staging (a
    # store's gather, a load's DMA) need not wait for the first job's last batch, on the other
    # lane; its first write of the tier or of KV blocks does, through the first job's end
    model = run(Scenario("mla", 1, 1, (_job(direction, range(3)), _job(direction, range(3, 6)))))
    first, second = model.jobs[0], model.jobs[1]
    last_batch = _batch_ops(first)[-1]
    prepared = [second.upload, _batch_ops(second)[0][0]]
    for op in prepared:
        assert op is not None and not _writes_shared_memory(op)
        assert not any(happens_before(earlier, op) for earlier in last_batch), op
    first_write = next(op for op in second.work if _writes_shared_memory(op))
    assert happens_before(first.end, first_write)
    _holds(writes_before_the_previous_job_of_their_direction, model)
    _holds(staging_races, model)
