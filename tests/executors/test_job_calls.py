"""The compiled job code (`_native.queue_job`, `begin_job`, `end_job`) makes a staged job's driver
calls in the order the staged path needs: lane 0 waits for compute, the tables go up, each
batch's kernel launch and DMAs run on its lane, lane 0 waits for the previous job just before
the job first writes the tier (a store) or KV blocks (a load), and the end is recorded after both
lanes. It makes the same calls whether it calls the driver itself (through function
addresses, here C callbacks standing in for `libcuda`) or Python callables (the CPU test
doubles); a driver error stops it and names the call."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
from _driver_types import LAUNCH, MEMCPY, RECORD, WAIT, address

from kvferry.executors import _native
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

    def _record(self, call: tuple[Any, ...]) -> int:
        self.calls.append(call)
        return self._status if len(self.calls) == self._fail_at else 0

    def calls_by_address(self) -> tuple[int, int, int]:
        return (self.record_address, self.wait_address, self.memcpy_address)


def _table_launch(driver: _Driver) -> tuple[int, int, int, int]:
    return (driver.launch_address, TABLE_KERNEL, THREADS, MOST)


def _stage_launch(driver: _Driver, *, to_stage: bool) -> tuple[int, int, int, int, int, bool, int]:
    return (driver.launch_address, STAGE_KERNEL, THREADS, 3000, 4000, to_stage, PIECE_BYTES)


def _job(
    calls: Any,
    table_copy: Any,
    kernel: Any,
    *,
    store: bool,
    previous: int | None = PREVIOUS,
    columns: dict[str, tuple[int, ...]] = COLUMNS,
    values: int = VALUES,
) -> tuple[int, str] | None:
    return _native.queue_job(
        calls,
        LANES,
        COMPUTE,
        (READY, previous, START, UPLOADED, JOINED, END),
        (table_copy, TABLES, SLOT, values),
        kernel,
        (STAGES, HOST, store, SEGMENTS, LINE_BYTES, MOST, WARPS, *columns.values()),
    )


def _native_job(driver: _Driver, *, store: bool, **options: Any) -> tuple[int, str] | None:
    return _job(
        driver.calls_by_address(),
        _table_launch(driver),
        _stage_launch(driver, to_stage=store),
        store=store,
        **options,
    )


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


def test_a_store_gathers_each_batch_then_copies_it_out_on_its_lane() -> None:
    driver = _Driver()
    assert _native_job(driver, store=True) is None
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


def test_a_load_copies_each_batch_in_then_scatters_it_on_its_lane() -> None:
    driver = _Driver()
    assert _native_job(driver, store=False) is None
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
def test_a_job_after_one_the_host_saw_finish_does_not_wait_for_it(store: bool) -> None:
    driver, waited = _Driver(), _Driver()
    assert _native_job(driver, store=store, previous=None) is None
    assert _native_job(waited, store=store) is None
    assert driver.calls == [call for call in waited.calls if call != AFTER_PREVIOUS]


def test_a_job_of_one_batch_runs_and_ends_on_lane_0_alone() -> None:
    driver = _Driver()
    one = {"items": (3,), "lines": (0, 1), "link": (0, 1), "src": (100,), "dst": (1000,),
           "size": (10,)}  # fmt: skip
    assert _native_job(driver, store=True, columns=one) is None
    assert driver.calls == [
        *FIRST_CALLS,
        *UPLOAD_CALLS[:2],
        _launch(LANES[0], 1, line=0, count=1, stage=STAGES[0], store=1),
        AFTER_PREVIOUS,
        ("copy", LANES[0], HOST + 1000, STAGES[0] + 100, 10),
        ("record", END, LANES[0]),
    ]


def test_a_job_of_two_batches_ends_on_lane_1_after_lane_0() -> None:
    driver = _Driver()
    two = {"items": (3, 3), "lines": (0, 1, 2), "link": (0, 1, 2), "src": (100, 200),
           "dst": (1000, 2000), "size": (10, 20)}  # fmt: skip
    assert _native_job(driver, store=True, columns=two) is None
    assert driver.calls[-3:] == [
        ("record", JOINED, LANES[0]),
        ("wait", LANES[1], JOINED),
        ("record", END, LANES[1]),
    ]


def test_a_job_of_no_batch_uploads_and_ends_on_lane_0_after_the_previous_job() -> None:
    driver = _Driver()
    none = {"items": (), "lines": (0,), "link": (0,), "src": (), "dst": (), "size": ()}
    assert _native_job(driver, store=False, columns=none) is None
    assert driver.calls == [
        *FIRST_CALLS,
        *UPLOAD_CALLS[:2],
        AFTER_PREVIOUS,
        ("record", END, LANES[0]),
    ]


def test_begin_and_end_alone_wait_for_the_previous_job_first_and_make_the_last_calls() -> None:
    driver = _Driver()
    calls = driver.calls_by_address()
    assert _native.begin_job(calls, LANES, COMPUTE, READY, PREVIOUS, START) is None
    assert _native.end_job(calls, LANES, 3, JOINED, END) is None
    assert driver.calls == [*FIRST_CALLS[:2], AFTER_PREVIOUS, FIRST_CALLS[2], *LAST_CALLS]


@pytest.mark.parametrize("store", [True, False])
def test_callables_receive_the_same_calls_as_the_driver(store: bool) -> None:
    driver, seen = _Driver(), []
    assert _native_job(driver, store=store) is None

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

    assert _job((record, wait, dma), copy_table, stage_copy, store=store) is None
    assert seen == driver.calls


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
def test_a_driver_error_stops_the_job_and_names_the_call(fail_at: int, call: str) -> None:
    driver = _Driver(fail_at=fail_at, status=700)
    assert _native_job(driver, store=True) == (700, call)
    assert len(driver.calls) == fail_at


def test_an_exception_from_a_callable_propagates_and_stops_the_job() -> None:
    copies = []

    def dma(dst: int, src: int, nbytes: int, stream: int) -> None:
        copies.append(dst)
        raise OSError("no link")

    def nothing(*_: Any) -> None:
        return None

    with pytest.raises(OSError, match="no link"):
        _job((nothing, nothing, dma), nothing, nothing, store=True)
    assert len(copies) == 1


def test_columns_that_disagree_in_length_are_refused_before_any_call() -> None:
    driver = _Driver()
    short = {**COLUMNS, "size": (10, 20)}  # one size short
    with pytest.raises(ValueError, match="do not agree"):
        _native_job(driver, store=True, columns=short)
    assert driver.calls == []


class _CompilesTwo:
    """Stands in for a staged executor whose driver is `driver`, whose stage kernel is 77 and
    table kernel 88, on at most `MOST` blocks."""

    _copy_blocks = MOST

    def __init__(self, driver: _Driver) -> None:
        self.driver = driver

    def _cuda(self) -> _Driver:
        return self.driver

    def _function(self, source: str, name: str) -> int:
        return STAGE_KERNEL if "stage" in name else TABLE_KERNEL


def test_a_jobs_stage_kernel_hands_the_job_its_constants_in_the_kernels_parameter_order() -> None:
    driver = _Driver()
    stand_in: Any = _CompilesTwo(driver)
    kernel = StagedGpuExecutor._stage_kernel(stand_in, refs=3000, ids=4000, to_stage=True)
    assert kernel == _stage_launch(driver, to_stage=True)


@pytest.mark.parametrize(
    ("count", "blocks"), [(1, 1), (THREADS, 1), (THREADS + 1, 2), (100 * THREADS, MOST)]
)
def test_the_table_copy_takes_a_block_per_threads_values_at_most_copy_blocks(
    count: int, blocks: int
) -> None:
    driver = _Driver()
    stand_in: Any = _CompilesTwo(driver)
    assert StagedGpuExecutor._table_copy(stand_in) == _table_launch(driver)
    assert _native_job(driver, store=True, values=count) is None
    (launch,) = [call for call in driver.calls if call[0] == "launch" and call[3] == TABLE_KERNEL]
    assert launch == ("launch", LANES[0], blocks, TABLE_KERNEL, THREADS, SLOT, TABLES, count)
