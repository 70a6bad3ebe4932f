"""The compiled batch loop (`_native.queue_batches`) queues each batch's kernel launch and DMAs on
its lane, in the order the staged path needs, whether it calls the driver itself (through
function addresses, here C callbacks standing in for `libcuda`) or Python callables (the CPU
test doubles); a driver error stops it and names the call."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from kvferry.executors import _native
from kvferry.executors.kernels import PIECE_BYTES, THREADS, WARPS
from kvferry.executors.staged import _STAGE_COPY_ARGUMENTS, StagedGpuExecutor

_LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    *([ctypes.c_uint] * 7),
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.c_void_p,
)
_MEMCPY = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
)

LANES = (11, 12)
STAGES = (1 << 20, 2 << 20)
HOST = 1 << 30
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
    """C functions of `cuLaunchKernel`'s and `cuMemcpyAsync`'s signatures that record each call
    (a launch's parameters read as `_STAGE_COPY_ARGUMENTS`), failing the `fail_at`-th call."""

    def __init__(self, fail_at: int = -1, status: int = 700) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self._fail_at, self._status = fail_at, status

        def launch(function: int, *rest: Any) -> int:
            (gx, gy, gz, bx, by, bz, shared), (stream, params, extra) = rest[:7], rest[7:]
            values = tuple(
                ctypes.cast(params[i], ctypes.POINTER(kind)).contents.value
                for i, kind in enumerate(_STAGE_COPY_ARGUMENTS)
            )
            assert (gy, gz, by, bz, shared, extra) == (1, 1, 1, 1, 0, None)
            return self._record(("launch", stream, gx, function, bx, *values))

        def memcpy(dst: int, src: int, nbytes: int, stream: int) -> int:
            return self._record(("copy", stream, dst, src, nbytes))

        self._launch, self._memcpy = _LAUNCH(launch), _MEMCPY(memcpy)  # kept alive with self
        self.launch_address = ctypes.cast(self._launch, ctypes.c_void_p).value or 0
        self.memcpy_address = ctypes.cast(self._memcpy, ctypes.c_void_p).value or 0

    def _record(self, call: tuple[Any, ...]) -> int:
        self.calls.append(call)
        return self._status if len(self.calls) == self._fail_at else 0


def _queue(kernel: Any, dma: Any, *, store: bool) -> tuple[int, str] | None:
    return _native.queue_batches(
        kernel,
        dma,
        LANES,
        STAGES,
        HOST,
        store,
        SEGMENTS,
        LINE_BYTES,
        MOST,
        WARPS,
        *COLUMNS.values(),
    )


def _native_kernel(driver: _Driver, *, to_stage: bool) -> tuple[int, int, int, int, int, bool, int]:
    return (driver.launch_address, 77, THREADS, 3000, 4000, to_stage, PIECE_BYTES)


def _launch(lane: int, blocks: int, *, line: int, count: int, stage: int, store: int) -> Any:
    """The call a launch records: batch lines from `line`, the stand-in job's constants."""
    segments = SEGMENTS + LINE_BYTES * line
    return (
        "launch",
        lane,
        blocks,
        77,
        THREADS,
        segments,
        count,
        3000,
        4000,
        stage,
        store,
        PIECE_BYTES,
    )


def test_a_store_gathers_each_batch_then_copies_it_out_on_its_lane() -> None:
    driver = _Driver()
    assert _queue(_native_kernel(driver, to_stage=True), driver.memcpy_address, store=True) is None
    # batch 0 on lane 0: 3 pieces -> 1 block; batch 1 on lane 1: 100 pieces -> 13, at most 4;
    # batch 2 has no slice line, so no launch, and copies from the first half again
    assert driver.calls == [
        _launch(LANES[0], 1, line=0, count=1, stage=STAGES[0], store=1),
        ("copy", LANES[0], HOST + 1000, STAGES[0] + 100, 10),
        _launch(LANES[1], MOST, line=1, count=2, stage=STAGES[1], store=1),
        ("copy", LANES[0], HOST + 2000, STAGES[0] + 200, 20),
        ("copy", LANES[0], HOST + 3000, STAGES[0] + 300, 30),
    ]


def test_a_load_copies_each_batch_in_then_scatters_it_on_its_lane() -> None:
    driver = _Driver()
    assert (
        _queue(_native_kernel(driver, to_stage=False), driver.memcpy_address, store=False) is None
    )
    assert driver.calls == [
        ("copy", LANES[0], STAGES[0] + 1000, HOST + 100, 10),
        _launch(LANES[0], 1, line=0, count=1, stage=STAGES[0], store=0),
        _launch(LANES[1], MOST, line=1, count=2, stage=STAGES[1], store=0),
        ("copy", LANES[0], STAGES[0] + 2000, HOST + 200, 20),
        ("copy", LANES[0], STAGES[0] + 3000, HOST + 300, 30),
    ]


@pytest.mark.parametrize("store", [True, False])
def test_callables_receive_the_same_calls_as_the_driver(store: bool) -> None:
    driver, seen = _Driver(), []
    assert (
        _queue(_native_kernel(driver, to_stage=store), driver.memcpy_address, store=store) is None
    )

    def stage_copy(stream: int, segments: int, count: int, stage: int, blocks: int) -> None:
        line = (segments - SEGMENTS) // LINE_BYTES
        seen.append(_launch(stream, blocks, line=line, count=count, stage=stage, store=store))

    def dma(dst: int, src: int, nbytes: int, stream: int) -> None:
        seen.append(("copy", stream, dst, src, nbytes))

    assert _queue(stage_copy, dma, store=store) is None
    assert seen == driver.calls


@pytest.mark.parametrize(("fail_at", "call"), [(1, "cuLaunchKernel"), (2, "cuMemcpyAsync")])
def test_a_driver_error_stops_the_loop_and_names_the_call(fail_at: int, call: str) -> None:
    driver = _Driver(fail_at=fail_at, status=700)
    failed = _queue(_native_kernel(driver, to_stage=True), driver.memcpy_address, store=True)
    assert failed == (700, call)
    assert len(driver.calls) == fail_at


def test_an_exception_from_a_callable_propagates_and_stops_the_loop() -> None:
    copies = []

    def dma(dst: int, src: int, nbytes: int, stream: int) -> None:
        copies.append(dst)
        raise OSError("no link")

    with pytest.raises(OSError, match="no link"):
        _queue(lambda *_: None, dma, store=True)
    assert len(copies) == 1


def test_columns_that_disagree_in_length_are_refused_before_any_call() -> None:
    driver = _Driver()
    with pytest.raises(ValueError, match="do not agree"):
        _native.queue_batches(
            _native_kernel(driver, to_stage=True),
            driver.memcpy_address,
            LANES,
            STAGES,
            HOST,
            True,
            SEGMENTS,
            LINE_BYTES,
            MOST,
            WARPS,
            *[*COLUMNS.values()][:-1],
            (10, 20),  # one size short
        )
    assert driver.calls == []


class _Launcher:
    function = 77


class _CompilesOne:
    """Stands in for a staged executor whose driver is `driver` and whose only kernel is 77."""

    def __init__(self, driver: _Driver) -> None:
        self.driver = driver

    def _cuda(self) -> _Driver:
        return self.driver

    def _launcher(self, *_: Any) -> _Launcher:
        return _Launcher()


def test_a_jobs_stage_kernel_hands_the_loop_its_constants_in_the_kernels_parameter_order() -> None:
    driver = _Driver()
    stand_in: Any = _CompilesOne(driver)
    kernel = StagedGpuExecutor._stage_kernel(stand_in, refs=3000, ids=4000, to_stage=True)
    assert kernel == _native_kernel(driver, to_stage=True)
    assert _queue(kernel, driver.memcpy_address, store=True) is None
    assert driver.calls[0] == _launch(LANES[0], 1, line=0, count=1, stage=STAGES[0], store=1)
