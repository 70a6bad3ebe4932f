"""With `submit_thread`, a staged executor's own thread makes its common jobs' driver calls (the
route's `Submitter`, on either route): the same calls, in the same order, as the submitting thread
would make; nothing asks a job's events before the thread has made its calls; and every job still
moves its bytes exactly."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _driver_types import LAUNCH, MEMCPY, RECORD, SET_CONTEXT, WAIT, Bindings, address
from _harness import (
    LAYOUT_CASES,
    NUM_BLOCKS,
    POISON_HOST,
    GroupMove,
    Model,
    TorchBackend,
    backend_for,
    bound_plan,
    expected_gpu,
    expected_host,
)
from _torch_on_cpu import TorchOnCpuExecutor
from test_stage_job import covered

from kvferry.core.plan import Direction
from kvferry.executors import register_executor
from kvferry.executors.base import CopyPath
from kvferry.executors.driver import DriverBindings
from kvferry.executors.jobcode import JobCode, job_code, native_available
from kvferry.executors.staged import TABLE_SLOTS, StagedGpuExecutor

pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("route")

EXECUTORS = [
    "torch-on-cpu",
    pytest.param("torch", marks=pytest.mark.gpu),
    pytest.param("cupy", marks=pytest.mark.gpu),
]


def _model(name: str, case: str, f: int, **options: Any) -> Model:
    if name == "cupy":
        pytest.importorskip("cupy")
    return Model(backend_for(name), LAYOUT_CASES[case], f, submit_thread=True, **options)


def _consecutive_moves(
    f: int, rng: np.random.Generator, chunks: int, groups: int
) -> list[GroupMove]:
    """`chunks` whole chunks per group at random GPU blocks, on rows 0, 1, 2, ... in group order:
    the common job, which the submission thread makes."""
    rows = itertools.count()
    return [
        GroupMove(
            ids=tuple(int(i) for i in rng.choice(NUM_BLOCKS, size=chunks * f, replace=False)),
            first=0,
            rows=tuple(next(rows) for _ in range(chunks)),
        )
        for _ in range(groups)
    ]


@pytest.mark.parametrize("name", EXECUTORS)
@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
@pytest.mark.parametrize("f", [1, 3])
def test_store_then_load_round_trips_every_byte_with_the_submission_thread(
    name: str, case: str, f: int
) -> None:
    model = _model(name, case, f)
    executor = model.executor
    groups = len(LAYOUT_CASES[case])
    rng = np.random.default_rng(f)
    try:
        model.fill_random(rng)
        executor.host_tier.array[:] = POISON_HOST
        source, host_before = model.snapshot(), executor.host_tier.array.copy()
        store = _consecutive_moves(f, rng, 2, groups)
        stored = bound_plan(1, Direction.STORE, f, store, executor.layout.fingerprint)
        model.run(stored)
        host_after = executor.host_tier.array.copy()
        np.testing.assert_array_equal(host_after, expected_host(model, host_before, source, store))

        model.poison()
        poisoned = model.snapshot()
        load = [
            GroupMove(ids=move.ids[::-1], first=0, rows=move.rows) for move in store
        ]  # other blocks' order: every page lands elsewhere
        loaded = bound_plan(2, Direction.LOAD, f, load, executor.layout.fingerprint)
        model.run(loaded)
        expected = expected_gpu(model, poisoned, host_after, load)
        for g, group in enumerate(model.snapshot()):
            for t, data in enumerate(group):
                np.testing.assert_array_equal(data, expected[g][t], err_msg=f"group {g} tensor {t}")
        assert isinstance(executor, StagedGpuExecutor)
        thread_jobs = executor._submitter.pushed if executor._submitter else 0
        assert thread_jobs == covered(executor, stored) + covered(executor, loaded)
    finally:
        executor.close()


@pytest.mark.parametrize("name", EXECUTORS)
def test_jobs_of_one_direction_submitted_back_to_back_land_in_submission_order(name: str) -> None:
    # eight stores of other blocks into the same rows, then eight loads of other rows into the
    # same blocks, none waited for before the last: more jobs than table slots, all on the thread
    model = _model(name, "blocks_first", 1)
    executor = model.executor
    rng = np.random.default_rng(7)
    rows = tuple(range(4, 8))
    fingerprint = executor.layout.fingerprint
    try:
        model.fill_random(rng)
        source, host = model.snapshot(), executor.host_tier.array.copy()
        sources = [rng.choice(NUM_BLOCKS, size=len(rows), replace=False) for _ in range(8)]
        for job, ids in enumerate(sources):
            move = GroupMove(ids=tuple(int(i) for i in ids), first=0, rows=rows)
            executor.submit(bound_plan(job, Direction.STORE, 1, [move], fingerprint))
            host = expected_host(model, host, source, [move])  # each store over the last
        assert all(r.success for r in executor.wait(range(8)))
        np.testing.assert_array_equal(executor.host_tier.array, host)

        gpu = model.snapshot()
        targets = tuple(int(i) for i in rng.choice(NUM_BLOCKS, size=4, replace=False))
        for job in range(8, 16):
            move = GroupMove(ids=targets, first=0, rows=tuple(range(job - 8, job - 4)))
            executor.submit(bound_plan(job, Direction.LOAD, 1, [move], fingerprint))
            gpu = expected_gpu(model, gpu, host, [move])  # each load over the last
        assert all(r.success for r in executor.wait(range(8, 16)))
        for g, group in enumerate(model.snapshot()):
            for t, data in enumerate(group):
                np.testing.assert_array_equal(data, gpu[g][t], err_msg=f"group {g} tensor {t}")
        assert isinstance(executor, StagedGpuExecutor) and executor._submitter is not None
        assert executor._submitter.pushed == 16
    finally:
        executor.close()


# --- the calls, through the driver (ctypes callbacks or a cuda-bindings stand-in) --------------

STAGE_FUNCTION, TABLE_FUNCTION, CONTEXT = 0xF00, 0x7AB, 0xC0
COMPUTE = 5
"""The raw compute stream of every job."""


class _Addresses:
    """Stands in for `CudaDriver` where the compiled route reads the driver's addresses: here
    ctypes callbacks."""

    def __init__(self, callbacks: tuple[Any, ...]) -> None:
        record, wait, memcpy, launch, set_context = (address(c) for c in callbacks)
        self.record_address, self.wait_address, self.memcpy_address = record, wait, memcpy
        self.launch_address, self.set_context_address = launch, set_context

    def current_context(self) -> int:
        return CONTEXT


class DriverRecorder(TorchOnCpuExecutor):
    """The torch executor on CPU whose staged jobs call the driver as on a GPU, by the
    executor's own route-dependent code: by address (the compiled route) or through
    `DriverBindings` (the Python route), both reaching the same recorders. Each call is only
    listed in `calls` with the thread that made it (nothing is copied); events are integers and
    streams are told apart. `fail_copies` makes that many DMAs fail with status 1, and `gate`,
    when cleared, holds every DMA until it is set."""

    name = "driver-recorder"

    def __init__(self, **options: Any) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.threads: list[int] = []
        self.contexts: list[tuple[int, int, int]] = []
        self.fail_copies = 0
        self.gate = threading.Event()
        self.gate.set()
        self._events = itertools.count(1000)
        self._streams: dict[int, int] = {}
        self._callbacks = (
            RECORD(self._on_record),
            WAIT(self._on_wait),
            MEMCPY(self._on_copy),
            LAUNCH(self._on_launch),
            SET_CONTEXT(self._on_set_context),
        )
        self._bindings_stand_in = DriverBindings(
            Bindings(
                record=self._on_record,
                wait=self._on_wait,
                memcpy=self._on_copy,
                launch=self._on_launch,
                set_context=self._on_set_context,
            )
        )
        super().__init__(**options)

    def _log(self, *call: Any) -> int:
        self.calls.append(call)
        self.threads.append(threading.get_ident())
        return 0

    def _on_record(self, event: int | None, stream: int | None) -> int:
        return self._log("record", event or 0, stream or 0)

    def _on_wait(self, stream: int | None, event: int | None, flags: int) -> int:
        return self._log("wait", stream or 0, event or 0)

    def _on_copy(self, dst: int, src: int, nbytes: int, stream: int | None) -> int:
        self.gate.wait()
        if self.fail_copies:
            self.fail_copies -= 1
            return 1
        return self._log("copy", self._where(dst), self._where(src), nbytes, stream or 0)

    def _where(self, at: int) -> tuple[Any, ...]:
        """Return the address `at` as (buffer, offset): the tier, or a staging half by direction."""
        tier = self.host_tier.address
        if tier <= at < tier + self.host_tier.nbytes:
            return ("tier", at - tier)
        for direction, (_, halves) in self._staging.items():
            for half, base in enumerate(halves):
                if base <= at < base + self._half_bytes:
                    return ("stage", direction.value, half, at - base)
        raise AssertionError(f"a copy at {at:#x}, in no buffer")

    def _on_launch(self, function: int | None, grid: int, *args: Any) -> int:
        stream = args[6]
        return self._log("launch", function or 0, grid, stream or 0)

    def _on_set_context(self, context: int | None) -> int:
        self.contexts.append((context or 0, threading.get_ident(), len(self.calls)))
        return 0

    def _stream_handle(self, stream: Any) -> int:
        return self._streams.setdefault(id(stream), 100 + len(self._streams))

    def _compute_stream_now(self) -> int:
        return COMPUTE

    def _new_event(self, *, timing: bool = False) -> Any:
        return next(self._events)

    def _cuda(self) -> Any:
        return _Addresses(self._callbacks)

    def _calls(self) -> DriverBindings:
        return self._bindings_stand_in

    def _function(self, source: str, name: str) -> int:
        return STAGE_FUNCTION if "stage" in name else TABLE_FUNCTION

    # the staged executor's own forms of the driver calls, not the CPU doubles' callables
    _driver_calls = StagedGpuExecutor._driver_calls
    _stage_kernel = StagedGpuExecutor._stage_kernel
    _table_copy = StagedGpuExecutor._table_copy
    _thread_context = StagedGpuExecutor._thread_context


def _recorder(*, submit_thread: bool, rows_per_half: int = 2) -> DriverRecorder:
    register_executor(DriverRecorder.name, "test_submit_thread:DriverRecorder")
    probe = Model(TorchBackend(DriverRecorder.name, device="cpu"), LAYOUT_CASES["mla"], 1)
    row_bytes = probe.executor.layout.largest_row_bytes
    probe.executor.close()
    model = Model(
        TorchBackend(DriverRecorder.name, device="cpu"),
        LAYOUT_CASES["mla"],
        1,
        staging_bytes=2 * rows_per_half * row_bytes,
        submit_thread=submit_thread,
    )
    assert isinstance(model.executor, DriverRecorder)
    return model.executor


def _job(job_id: int, direction: Direction, rows: range) -> Any:
    move = GroupMove(ids=tuple(range(len(rows))), first=0, rows=tuple(rows))
    return bound_plan(job_id, direction, 1, [move])


def _jobs() -> Iterator[Any]:
    """Stores and loads of 0 to 5 batches (two rows a batch), two in flight at times."""
    for job_id, (direction, rows) in enumerate(
        [
            (Direction.STORE, range(0, 1)),
            (Direction.LOAD, range(0, 3)),
            (Direction.STORE, range(3, 13)),
            (Direction.STORE, range(0, 0)),
            (Direction.LOAD, range(2, 8)),
            (Direction.STORE, range(13, 16)),
        ],
        start=1,
    ):
        yield _job(job_id, direction, rows)


def _run_all(executor: DriverRecorder) -> None:
    in_flight: list[int] = []
    for bound in _jobs():
        in_flight.append(executor.submit(bound))
        if len(in_flight) == 2:
            assert all(r.success for r in executor.wait(in_flight)), in_flight
            in_flight.clear()
    assert all(r.success for r in executor.close())


def _is_ready_record(call: tuple[Any, ...]) -> bool:
    return call[0] == "record" and call[2] == COMPUTE  # the one call on the compute stream


def _canonical(executor: DriverRecorder, *, here: bool) -> list[tuple[Any, ...]]:
    """Return the calls made on this thread (`here`) or on another, with every event recorded on
    the compute stream named "ready" and every other event numbered by its first use among
    them (the two kinds of run create their events in other orders)."""
    ready = {call[1] for call in executor.calls if _is_ready_record(call)}
    names: dict[int, int] = {}

    def name(event: int) -> int | str:
        return "ready" if event in ready else names.setdefault(event, len(names))

    me, calls = threading.get_ident(), []
    for call, thread in zip(executor.calls, executor.threads, strict=True):
        if (thread == me) != here:
            continue
        if call[0] == "record":
            calls.append(("record", name(call[1]), call[2]))
        elif call[0] == "wait":
            calls.append(("wait", call[1], name(call[2])))
        else:
            calls.append(call)
    return calls


def test_the_thread_makes_the_calls_the_submitting_thread_would_make_in_the_same_order() -> None:
    alone, threaded = _recorder(submit_thread=False), _recorder(submit_thread=True)
    _run_all(alone)
    _run_all(threaded)
    expected = [c for c in _canonical(alone, here=True) if not _is_ready_record(c)]
    assert _canonical(threaded, here=False) == expected
    assert len(expected) > 6 * 4


def test_only_each_jobs_ready_record_is_made_on_the_submitting_thread() -> None:
    alone, threaded = _recorder(submit_thread=False), _recorder(submit_thread=True)
    _run_all(alone)
    _run_all(threaded)
    expected = [c for c in _canonical(alone, here=True) if _is_ready_record(c)]
    assert _canonical(threaded, here=True) == expected
    assert len(expected) == 6  # one per job
    assert len(set(threaded.threads) - {threading.get_ident()}) == 1


def test_each_job_waits_on_its_own_ready_record_even_when_the_thread_lags() -> None:
    # with the direction's one `ready` event, the second record would move the first job's wait
    executor = _recorder(submit_thread=True)
    executor.gate.clear()
    executor.submit(_job(1, Direction.STORE, range(0, 3)))
    executor.submit(_job(2, Direction.STORE, range(3, 6)))
    executor.gate.set()
    assert all(r.success for r in executor.close())
    recorded = [call[1] for call in executor.calls if _is_ready_record(call)]
    waited = [call[2] for call in executor.calls if call[0] == "wait" and call[2] in recorded]
    assert len(set(recorded)) == 2
    assert waited == recorded


def test_the_thread_makes_the_context_current_once_before_its_first_call() -> None:
    executor = _recorder(submit_thread=True)
    _run_all(executor)
    ((context, thread, calls_before),) = executor.contexts
    assert context == CONTEXT
    assert thread != threading.get_ident()
    assert set(executor.threads[calls_before:]) >= {thread}
    assert thread not in executor.threads[:calls_before]


def _release_later(gate: threading.Event) -> threading.Timer:
    timer = threading.Timer(0.2, gate.set)
    timer.start()
    return timer


def test_poll_reports_a_job_only_once_the_thread_has_made_its_calls() -> None:
    executor = _recorder(submit_thread=True)
    executor.gate.clear()
    executor.submit(_job(1, Direction.STORE, range(0, 3)))
    timer = _release_later(executor.gate)  # should poll wait for the thread, it ends the wait
    assert executor.poll() == []  # its end event is not recorded yet: CUDA would call it done
    timer.join()
    (result,) = executor.wait([1])
    assert result.success
    executor.close()


def test_a_call_that_fails_on_the_thread_fails_its_job_and_not_the_next() -> None:
    executor = _recorder(submit_thread=True)
    executor.fail_copies = 1
    executor.submit(_job(1, Direction.STORE, range(0, 3)))
    executor.submit(_job(2, Direction.STORE, range(3, 6)))
    failed, succeeded = executor.wait([1, 2])
    assert not failed.success
    assert failed.error == "RuntimeError: cuMemcpyAsync failed with CUDA driver error 1"
    assert succeeded.success
    executor.close()


def test_a_table_slot_is_written_again_only_once_the_thread_made_its_last_jobs_calls() -> None:
    executor = _recorder(submit_thread=True)
    executor.gate.clear()
    for job_id in range(1, TABLE_SLOTS + 1):
        executor.submit(_job(job_id, Direction.STORE, range(job_id, job_id + 1)))
    submitter = executor._submitter
    assert submitter is not None and not submitter.finished(1)
    timer = _release_later(executor.gate)
    executor.submit(_job(TABLE_SLOTS + 1, Direction.STORE, range(0, 1)))  # the first job's slot
    assert submitter.finished(1)
    timer.join()
    assert all(r.success for r in executor.close())


def test_a_job_the_compiled_call_declines_is_queued_after_the_threads_jobs() -> None:
    executor = _recorder(submit_thread=True)
    executor.gate.clear()
    executor.submit(_job(1, Direction.STORE, range(0, 3)))
    timer = _release_later(executor.gate)
    scattered = GroupMove(ids=(0, 1), first=0, rows=(7, 4))  # rows not one run: the Python path
    executor.submit(bound_plan(2, Direction.STORE, 1, [scattered]))
    timer.join()
    assert all(r.success for r in executor.close())
    # job 1's `ready` here, its other calls on the thread, then all of job 2's calls here
    here = [thread == threading.get_ident() for thread in executor.threads]
    made = here.count(False)
    assert made > 0 and here == [True] + [False] * made + [True] * (len(here) - 1 - made)


def test_a_job_on_another_path_begins_after_the_threads_jobs() -> None:
    # the zero-copy path's first and last calls (`_begin`, `_end`), on the submitting thread
    executor = _recorder(submit_thread=True)
    executor.gate.clear()
    executor.submit(_job(1, Direction.STORE, range(0, 3)))
    timer = _release_later(executor.gate)
    job = executor._begin(Direction.STORE, CopyPath.ZERO_COPY)
    executor._end(Direction.STORE, job, 1)
    timer.join()
    here = [thread == threading.get_ident() for thread in executor.threads]
    made = here.count(False)
    assert made > 0 and here == [True] + [False] * made + [True] * (len(here) - 1 - made)
    executor.close()


def test_a_new_submitter_has_handed_nothing_over_and_drains_at_once(jobs: JobCode) -> None:
    submitter = jobs.Submitter()
    assert submitter.pushed == 0 and submitter.finished(0)
    submitter.drain()
    assert submitter.failure(1) is None
    submitter.close()
    submitter.close()  # closing again does nothing


@pytest.mark.skipif(
    not native_available(), reason="the compiled module kvferry.executors._native is not built here"
)
def test_a_compiled_submitter_is_started_once() -> None:
    submitter: Any = job_code("native").Submitter()
    with pytest.raises(RuntimeError, match="initialised once"):
        submitter.__init__()  # type: ignore[misc]
    submitter.close()
    with pytest.raises(RuntimeError, match="initialised once"):
        submitter.__init__()  # type: ignore[misc]
