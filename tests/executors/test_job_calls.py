"""The job code (`queue_job`, `begin_job`, `end_job`) makes a staged job's driver calls in the
order the staged path needs: lane 0 waits for compute, the tables go up, each batch's kernel
launch and DMAs run on its lane, lane 0 waits for the previous job just before the job first
writes the tier (a store) or KV blocks (a load), and the end is recorded after both lanes.

Each test runs in three forms, which must make the same calls: the compiled route calling the
driver by address (C callbacks standing in for `libcuda`), the compiled route calling Python
callables, and the Python route, whose callables are `DriverBindings` over a stand-in for
`cuda-bindings` (so its kernel parameters are read back as the driver would read them). A
driver error stops the job and names the call."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
from _driver_types import LAUNCH, MEMCPY, RECORD, WAIT, Bindings, address

from kvferry.executors.driver import DriverBindings
from kvferry.executors.jobcode import job_code, native_available
from kvferry.executors.kernels import PIECE_BYTES, THREADS, WARPS
from kvferry.executors.staged import (
    STAGE_COPY_ARGUMENTS,
    TABLE_COPY_ARGUMENTS,
    StagedGpuExecutor,
)

STAGE_KERNEL, TABLE_KERNEL = 77, 88
LANES = (11, 12)
COMPUTE = 13
READY, PREVIOUS, START, UPLOADED, JOINED, END = 1, 2, 3, 4, 5, 6
STAGES = (1 << 20, 2 << 20)
HOST = 1 << 30
TABLES, SLOT, VALUES = 6 << 20, 7 << 20, 500
TABLE_BLOCKS = -(-VALUES // THREADS)
"""Blocks of the table copy's launch: one per `THREADS` values (fewer than `MOST` here)."""
SEGMENTS = 5 << 20
LINE_BYTES = 56
MOST = 4
# three batches: 1, 2 and 0 slice lines; 1, 0 and 2 link copies
COLUMNS: dict[str, tuple[int, ...]] = {
    "items": (3, 100, 0),
    "lines": (0, 1, 3, 3),
    "link": (0, 1, 1, 3),
    "src": (100, 200, 300),
    "dst": (1000, 2000, 3000),
    "size": (10, 20, 30),
}


class _Driver:
    """C functions of `cuLaunchKernel`'s, `cuMemcpyAsync`'s, `cuEventRecord`'s and
    `cuStreamWaitEvent`'s signatures that record each call (a launch's parameters read as the
    kernel's: `STAGE_COPY_ARGUMENTS` or `TABLE_COPY_ARGUMENTS`), failing the `fail_at`-th call."""

    def __init__(self, fail_at: int = -1, status: int = 700) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self._fail_at, self._status = fail_at, status

        def launch(function: int, *rest: Any) -> int:
            (gx, gy, gz, bx, by, bz, shared), (stream, params, extra) = rest[:7], rest[7:]
            kinds = STAGE_COPY_ARGUMENTS if function == STAGE_KERNEL else TABLE_COPY_ARGUMENTS
            values = tuple(
                ctypes.cast(params[i], ctypes.POINTER(kind)).contents.value
                for i, kind in enumerate(kinds)
            )
            assert (gy, gz, by, bz, shared, extra) == (1, 1, 1, 1, 0, None)
            return self._record(("launch", stream, gx, function, bx, *values))

        def memcpy(dst: int, src: int, nbytes: int, stream: int) -> int:
            return self._record(("copy", stream, dst, src, nbytes))

        def record(event: int, stream: int) -> int:
            return self._record(("record", event, stream))

        def wait(stream: int, event: int, flags: int) -> int:
            assert flags == 0
            return self._record(("wait", stream, event))

        # kept alive with self
        self._functions = (LAUNCH(launch), MEMCPY(memcpy), RECORD(record), WAIT(wait))
        self.launch_address, self.memcpy_address, self.record_address, self.wait_address = (
            address(function) for function in self._functions
        )
        self.bindings = DriverBindings(
            Bindings(record=record, wait=wait, memcpy=memcpy, launch=self._functions[0])
        )
        """The same functions as the Python route calls them."""

    def _record(self, call: tuple[Any, ...]) -> int:
        self.calls.append(call)
        return self._status if len(self.calls) == self._fail_at else 0

    def calls_by_address(self) -> tuple[int, int, int]:
        return (self.record_address, self.wait_address, self.memcpy_address)


def _table_launch(driver: _Driver) -> tuple[int, int, int, int]:
    return (driver.launch_address, TABLE_KERNEL, THREADS, MOST)


def _stage_launch(driver: _Driver, *, to_stage: bool) -> tuple[int, int, int, int, int, bool, int]:
    return (driver.launch_address, STAGE_KERNEL, THREADS, 3000, 4000, to_stage, PIECE_BYTES)


_NATIVE = pytest.mark.skipif(
    not native_available(), reason="the compiled module kvferry.executors._native is not built here"
)
FORMS = [
    pytest.param(("native", "addresses"), marks=_NATIVE, id="native-addresses"),
    pytest.param(("native", "bindings"), marks=_NATIVE, id="native-bindings"),
    pytest.param(("python", "bindings"), id="python-bindings"),
]
"""The route and how it reaches the driver: by address, or through `DriverBindings`."""


@pytest.fixture(params=FORMS)
def form(request: pytest.FixtureRequest) -> tuple[str, str]:
    return tuple(request.param)  # type: ignore[return-value]


def _forms(driver: _Driver, how: str, *, store: bool) -> tuple[Any, Any, Any]:
    """Return a job's driver calls, table copy and stage kernel, by address or as bindings."""
    if how == "addresses":
        return (
            driver.calls_by_address(),
            _table_launch(driver),
            _stage_launch(driver, to_stage=store),
        )
    calls = driver.bindings
    kernel = calls.stage_copy(
        STAGE_KERNEL, THREADS, refs=3000, ids=4000, to_stage=store, piece=PIECE_BYTES
    )
    return (
        (calls.record, calls.wait, calls.copy),
        calls.table_copy(TABLE_KERNEL, THREADS, MOST),
        kernel,
    )


def _job(
    calls: Any,
    table_copy: Any,
    kernel: Any,
    *,
    store: bool,
    previous: int | None = PREVIOUS,
    columns: dict[str, tuple[int, ...]] = COLUMNS,
    values: int = VALUES,
    route: str = "native",
) -> tuple[int, str] | None:
    return job_code(route).queue_job(
        calls,
        LANES,
        COMPUTE,
        (READY, previous, START, UPLOADED, JOINED, END),
        (table_copy, TABLES, SLOT, values),
        kernel,
        (STAGES, HOST, store, SEGMENTS, LINE_BYTES, MOST, WARPS, *columns.values()),
    )


def _driver_job(
    driver: _Driver, form: tuple[str, str], *, store: bool, **options: Any
) -> tuple[int, str] | None:
    route, how = form
    return _job(*_forms(driver, how, store=store), store=store, route=route, **options)


def _launch(lane: int, blocks: int, *, line: int, count: int, stage: int, store: int) -> Any:
    """The call a stage-kernel launch records: batch lines from `line`, the job's constants."""
    segments = SEGMENTS + LINE_BYTES * line
    return ("launch", lane, blocks, STAGE_KERNEL, THREADS, segments, count, 3000, 4000, stage,
            store, PIECE_BYTES)  # fmt: skip


FIRST_CALLS = [
    ("record", READY, COMPUTE),
    ("wait", LANES[0], READY),
    ("record", START, LANES[0]),
]
"""A staged job's calls before its work: lane 0 after compute."""
AFTER_PREVIOUS = ("wait", LANES[0], PREVIOUS)
"""Lane 0 waiting for the previous job's end."""
UPLOAD_CALLS = [
    ("launch", LANES[0], TABLE_BLOCKS, TABLE_KERNEL, THREADS, SLOT, TABLES, VALUES),
    ("record", UPLOADED, LANES[0]),
    ("wait", LANES[1], UPLOADED),
]
"""The tables' copy to the GPU, which the second lane waits for."""
LAST_CALLS = [
    ("record", JOINED, LANES[1]),
    ("wait", LANES[0], JOINED),
    ("record", END, LANES[0]),
]
"""A three-batch job's end: on lane 0 (its last batch's), after lane 1's work."""


def test_a_store_gathers_each_batch_then_copies_it_out_on_its_lane(form: tuple[str, str]) -> None:
    driver = _Driver()
    assert _driver_job(driver, form, store=True) is None
    # batch 0 on lane 0: 3 pieces -> 1 block; batch 1 on lane 1: 100 pieces -> 13, at most 4;
    # batch 2 has no slice line, so no launch, and copies from the first half again
    assert driver.calls == [
        *FIRST_CALLS,
        *UPLOAD_CALLS,
        _launch(LANES[0], 1, line=0, count=1, stage=STAGES[0], store=1),
        AFTER_PREVIOUS,  # before the first write of the tier
        ("copy", LANES[0], HOST + 1000, STAGES[0] + 100, 10),
        _launch(LANES[1], MOST, line=1, count=2, stage=STAGES[1], store=1),
        ("copy", LANES[0], HOST + 2000, STAGES[0] + 200, 20),
        ("copy", LANES[0], HOST + 3000, STAGES[0] + 300, 30),
        *LAST_CALLS,
    ]


def test_a_load_copies_each_batch_in_then_scatters_it_on_its_lane(form: tuple[str, str]) -> None:
    driver = _Driver()
    assert _driver_job(driver, form, store=False) is None
    assert driver.calls == [
        *FIRST_CALLS,
        *UPLOAD_CALLS,
        ("copy", LANES[0], STAGES[0] + 1000, HOST + 100, 10),
        AFTER_PREVIOUS,  # before the first write of KV blocks
        _launch(LANES[0], 1, line=0, count=1, stage=STAGES[0], store=0),
        _launch(LANES[1], MOST, line=1, count=2, stage=STAGES[1], store=0),
        ("copy", LANES[0], STAGES[0] + 2000, HOST + 200, 20),
        ("copy", LANES[0], STAGES[0] + 3000, HOST + 300, 30),
        *LAST_CALLS,
    ]


@pytest.mark.parametrize("store", [True, False])
def test_a_job_after_one_the_host_saw_finish_does_not_wait_for_it(
    form: tuple[str, str], store: bool
) -> None:
    driver, waited = _Driver(), _Driver()
    assert _driver_job(driver, form, store=store, previous=None) is None
    assert _driver_job(waited, form, store=store) is None
    assert driver.calls == [call for call in waited.calls if call != AFTER_PREVIOUS]


def test_a_job_of_one_batch_runs_and_ends_on_lane_0_alone(form: tuple[str, str]) -> None:
    driver = _Driver()
    one = {"items": (3,), "lines": (0, 1), "link": (0, 1), "src": (100,), "dst": (1000,),
           "size": (10,)}  # fmt: skip
    assert _driver_job(driver, form, store=True, columns=one) is None
    assert driver.calls == [
        *FIRST_CALLS,
        *UPLOAD_CALLS[:2],
        _launch(LANES[0], 1, line=0, count=1, stage=STAGES[0], store=1),
        AFTER_PREVIOUS,
        ("copy", LANES[0], HOST + 1000, STAGES[0] + 100, 10),
        ("record", END, LANES[0]),
    ]


def test_a_job_of_two_batches_ends_on_lane_1_after_lane_0(form: tuple[str, str]) -> None:
    driver = _Driver()
    two = {"items": (3, 3), "lines": (0, 1, 2), "link": (0, 1, 2), "src": (100, 200),
           "dst": (1000, 2000), "size": (10, 20)}  # fmt: skip
    assert _driver_job(driver, form, store=True, columns=two) is None
    assert driver.calls[-3:] == [
        ("record", JOINED, LANES[0]),
        ("wait", LANES[1], JOINED),
        ("record", END, LANES[1]),
    ]


def test_a_job_of_no_batch_uploads_and_ends_on_lane_0_after_the_previous_job(
    form: tuple[str, str],
) -> None:
    driver = _Driver()
    none = {"items": (), "lines": (0,), "link": (0,), "src": (), "dst": (), "size": ()}
    assert _driver_job(driver, form, store=False, columns=none) is None
    assert driver.calls == [
        *FIRST_CALLS,
        *UPLOAD_CALLS[:2],
        AFTER_PREVIOUS,
        ("record", END, LANES[0]),
    ]


def test_begin_and_end_alone_wait_for_the_previous_job_first_and_make_the_last_calls(
    form: tuple[str, str],
) -> None:
    driver = _Driver()
    route, how = form
    calls = _forms(driver, how, store=True)[0]
    assert job_code(route).begin_job(calls, LANES, COMPUTE, READY, PREVIOUS, START) is None
    assert job_code(route).end_job(calls, LANES, 3, JOINED, END) is None
    assert driver.calls == [*FIRST_CALLS[:2], AFTER_PREVIOUS, FIRST_CALLS[2], *LAST_CALLS]


@pytest.mark.parametrize("store", [True, False])
def test_plain_callables_receive_the_same_calls_as_the_driver(route: str, store: bool) -> None:
    driver, seen = _Driver(), []
    assert _driver_job(driver, ("python", "bindings"), store=store) is None

    def record(event: int, stream: int) -> None:
        seen.append(("record", event, stream))

    def wait(stream: int, event: int) -> None:
        seen.append(("wait", stream, event))

    def dma(dst: int, src: int, nbytes: int, stream: int) -> None:
        seen.append(("copy", stream, dst, src, nbytes))

    def copy_table(dst: int, src: int, count: int, stream: int) -> None:
        seen.append(("launch", stream, TABLE_BLOCKS, TABLE_KERNEL, THREADS, src, dst, count))

    def stage_copy(stream: int, segments: int, count: int, stage: int, blocks: int) -> None:
        line = (segments - SEGMENTS) // LINE_BYTES
        seen.append(_launch(stream, blocks, line=line, count=count, stage=stage, store=store))

    assert _job((record, wait, dma), copy_table, stage_copy, store=store, route=route) is None
    assert seen == driver.calls


@pytest.mark.parametrize(("answer", "failure"), [(None, None), (0, None), (700, "cuMemcpyAsync")])
def test_a_callable_answers_none_or_0_when_it_made_the_call_else_a_cuda_status(
    route: str, answer: int | None, failure: str | None
) -> None:
    def nothing(*_: Any) -> None:
        return None

    def dma(*_: Any) -> int | None:
        return answer

    expected = None if failure is None else (answer, failure)
    assert _job((nothing, nothing, dma), nothing, nothing, store=True, route=route) == expected


def test_the_python_route_refuses_a_driver_by_address() -> None:
    driver = _Driver()
    with pytest.raises(TypeError, match="through a callable"):
        _driver_job(driver, ("python", "addresses"), store=True)
    assert driver.calls == []


@pytest.mark.parametrize(
    ("fail_at", "call"),
    [
        (1, "cuEventRecord"),
        (2, "cuStreamWaitEvent"),
        (4, "cuLaunchKernel"),  # the table copy
        (7, "cuLaunchKernel"),  # the first gather
        (8, "cuStreamWaitEvent"),  # for the previous job
        (9, "cuMemcpyAsync"),
        (15, "cuEventRecord"),  # the end
    ],
)
def test_a_driver_error_stops_the_job_and_names_the_call(
    form: tuple[str, str], fail_at: int, call: str
) -> None:
    driver = _Driver(fail_at=fail_at, status=700)
    assert _driver_job(driver, form, store=True) == (700, call)
    assert len(driver.calls) == fail_at


def test_an_exception_from_a_callable_propagates_and_stops_the_job(route: str) -> None:
    copies = []

    def dma(dst: int, src: int, nbytes: int, stream: int) -> None:
        copies.append(dst)
        raise OSError("no link")

    def nothing(*_: Any) -> None:
        return None

    with pytest.raises(OSError, match="no link"):
        _job((nothing, nothing, dma), nothing, nothing, store=True, route=route)
    assert len(copies) == 1


def test_columns_that_disagree_in_length_are_refused_before_any_call(form: tuple[str, str]) -> None:
    driver = _Driver()
    short = {**COLUMNS, "size": (10, 20)}  # one size short
    with pytest.raises(ValueError, match="do not agree"):
        _driver_job(driver, form, store=True, columns=short)
    assert driver.calls == []


class _CompilesTwo:
    """Stands in for a staged executor of route `route` whose driver is `driver`, whose stage
    kernel is 77 and table kernel 88, on at most `MOST` blocks."""

    _copy_blocks = MOST

    def __init__(self, driver: _Driver, route: str) -> None:
        self.driver = driver
        self.route = route

    def _cuda(self) -> _Driver:
        return self.driver

    def _calls(self) -> DriverBindings:
        return self.driver.bindings

    def _function(self, source: str, name: str) -> int:
        return STAGE_KERNEL if "stage" in name else TABLE_KERNEL


def test_a_jobs_stage_kernel_hands_the_compiled_route_its_constants_in_parameter_order() -> None:
    driver = _Driver()
    stand_in: Any = _CompilesTwo(driver, "native")
    kernel = StagedGpuExecutor._stage_kernel(stand_in, refs=3000, ids=4000, to_stage=True)
    assert kernel == _stage_launch(driver, to_stage=True)


@pytest.mark.parametrize("store", [True, False])
def test_a_jobs_stage_kernel_on_the_python_route_launches_with_its_constants(store: bool) -> None:
    driver = _Driver()
    stand_in: Any = _CompilesTwo(driver, "python")
    kernel = StagedGpuExecutor._stage_kernel(stand_in, refs=3000, ids=4000, to_stage=store)
    assert kernel(LANES[1], SEGMENTS + LINE_BYTES, 2, STAGES[1], 3) == 0
    assert driver.calls == [_launch(LANES[1], 3, line=1, count=2, stage=STAGES[1], store=store)]


@pytest.mark.parametrize("kind", ["native", "python"])
def test_the_executor_hands_each_route_its_own_form_of_the_table_copy(kind: str) -> None:
    driver = _Driver()
    stand_in: Any = _CompilesTwo(driver, kind)
    table_copy = StagedGpuExecutor._table_copy(stand_in)
    if kind == "native":
        assert table_copy == _table_launch(driver)
    else:
        assert table_copy(TABLES, SLOT, VALUES, LANES[0]) == 0
        assert driver.calls == [UPLOAD_CALLS[0]]


@pytest.mark.parametrize(
    ("count", "blocks"), [(1, 1), (THREADS, 1), (THREADS + 1, 2), (100 * THREADS, MOST)]
)
def test_the_table_copy_takes_a_block_per_threads_values_at_most_copy_blocks(
    form: tuple[str, str], count: int, blocks: int
) -> None:
    driver = _Driver()
    assert _driver_job(driver, form, store=True, values=count) is None
    (launch,) = [call for call in driver.calls if call[0] == "launch" and call[3] == TABLE_KERNEL]
    assert launch == ("launch", LANES[0], blocks, TABLE_KERNEL, THREADS, SLOT, TABLES, count)
