"""The CUDA driver calls of the staged path.

`CudaDriver` (ctypes on `libcuda.so.1`) makes the host's own calls on events and streams
(create, query, synchronize, time, destroy) for both routes, and hands the compiled route
(`_native`) the addresses of the calls a job makes (event records, stream waits, launches,
DMAs). `DriverBindings` makes those same per-job calls for the Python route, through NVIDIA's
`cuda-bindings`, which releases the GIL while the driver works, so a submission thread's calls
run beside the caller's Python.

Through torch these calls cost 5-90 µs each (measured on an NVIDIA H200: torch's NVRTC launcher
builds its ctypes arguments on every call, ~90 µs, and torch has no call at all for an
asynchronous copy between raw addresses); straight to the driver they cost a few µs. Both GPU
executors make their lanes here too (`CudaDriver.stream`): `torch.cuda.Stream()` hands out
streams round robin from a pool of 32 per priority that the whole process shares, so a lane
from there could be a stream the engine computes on. The libraries still own the memory and the
compiled kernels.
"""

from __future__ import annotations

import ctypes
import importlib
import threading
from array import array
from typing import Any

from kvferry.core.errors import ExecutorUnavailableError


class CudaDriver:
    """Events and streams from `libcuda.so.1` (loaded once per process), and the addresses of the
    calls that compiled code makes; handles are plain integers, and calls act on the current
    context."""

    _library: ctypes.CDLL | None = None

    def __init__(self) -> None:
        if CudaDriver._library is None:
            try:
                library = ctypes.CDLL("libcuda.so.1")
            except OSError as error:
                raise ExecutorUnavailableError(
                    f"the CUDA driver is not loadable: {error}"
                ) from error
            signatures: dict[str, list[Any]] = {
                "cuEventCreate": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint],
                "cuEventQuery": [ctypes.c_void_p],
                "cuEventSynchronize": [ctypes.c_void_p],
                "cuEventElapsedTime": [
                    ctypes.POINTER(ctypes.c_float),
                    ctypes.c_void_p,
                    ctypes.c_void_p,
                ],
                "cuEventDestroy_v2": [ctypes.c_void_p],
                "cuStreamCreateWithPriority": [
                    ctypes.POINTER(ctypes.c_void_p),
                    ctypes.c_uint,
                    ctypes.c_int,
                ],
                "cuStreamSynchronize": [ctypes.c_void_p],
                "cuStreamDestroy_v2": [ctypes.c_void_p],
                "cuCtxGetCurrent": [ctypes.POINTER(ctypes.c_void_p)],
            }
            for name, argtypes in signatures.items():
                function = getattr(library, name)
                function.argtypes = argtypes
                function.restype = ctypes.c_int
            CudaDriver._library = library
        self._lib = CudaDriver._library
        self.launch_address = _address(self._lib.cuLaunchKernel)
        """The address of `cuLaunchKernel`, for compiled code to call."""
        self.memcpy_address = _address(self._lib.cuMemcpyAsync)
        """The address of `cuMemcpyAsync`."""
        self.record_address = _address(self._lib.cuEventRecord)
        """The address of `cuEventRecord`."""
        self.wait_address = _address(self._lib.cuStreamWaitEvent)
        """The address of `cuStreamWaitEvent`."""
        self.set_context_address = _address(self._lib.cuCtxSetCurrent)
        """The address of `cuCtxSetCurrent`, which a submission thread calls once."""

    def current_context(self) -> int:
        """Return the calling thread's current `CUcontext` (0 when it has none)."""
        handle = ctypes.c_void_p()
        check_status(self._lib.cuCtxGetCurrent(ctypes.byref(handle)), "cuCtxGetCurrent")
        return int(handle.value or 0)

    def event(self, *, timing: bool) -> int:
        """Return a new event on the current context (timing, or the cheaper kind without)."""
        handle = ctypes.c_void_p()
        flags = 0 if timing else _EVENT_DISABLE_TIMING
        check_status(self._lib.cuEventCreate(ctypes.byref(handle), flags), "cuEventCreate")
        return int(handle.value or 0)

    def done(self, event: int) -> bool:
        """Return True once `event`'s work has completed."""
        status = self._lib.cuEventQuery(event)
        if status == _NOT_READY:
            return False
        check_status(status, "cuEventQuery")
        return True

    def synchronize(self, event: int) -> None:
        """Block until `event`'s work has completed."""
        check_status(self._lib.cuEventSynchronize(event), "cuEventSynchronize")

    def elapsed(self, start: int, end: int) -> float:
        """Block until `end`; return the seconds from `start` to `end` (timing events)."""
        self.synchronize(end)
        milliseconds = ctypes.c_float()
        check_status(
            self._lib.cuEventElapsedTime(ctypes.byref(milliseconds), start, end),
            "cuEventElapsedTime",
        )
        return milliseconds.value / 1000.0

    def destroy(self, event: int) -> None:
        """Release `event` (work already queued on it still completes)."""
        check_status(self._lib.cuEventDestroy_v2(event), "cuEventDestroy")

    def stream(self, *, priority: int) -> int:
        """Return a new non-blocking stream on the current context, of its own (no other caller
        holds it); `priority` as CUDA counts it (lower is more urgent, clamped to the device's
        range)."""
        handle = ctypes.c_void_p()
        check_status(
            self._lib.cuStreamCreateWithPriority(
                ctypes.byref(handle), _STREAM_NON_BLOCKING, priority
            ),
            "cuStreamCreateWithPriority",
        )
        return int(handle.value or 0)

    def synchronize_stream(self, stream: int) -> None:
        """Block until every call queued on `stream` has completed."""
        check_status(self._lib.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def destroy_stream(self, stream: int) -> None:
        """Release a stream made by `stream` (work already queued on it still completes)."""
        check_status(self._lib.cuStreamDestroy_v2(stream), "cuStreamDestroy")


_EVENT_DISABLE_TIMING = 2
"""CU_EVENT_DISABLE_TIMING."""

_STREAM_NON_BLOCKING = 1
"""CU_STREAM_NON_BLOCKING: no implicit ordering with the legacy default stream."""

_NOT_READY = 600
"""CUDA_ERROR_NOT_READY: what cuEventQuery answers for work still running."""


def _address(function: Any) -> int:
    return int(ctypes.cast(function, ctypes.c_void_p).value or 0)


def check_status(status: int, call: str) -> None:
    """Raise `RuntimeError` naming `call` when the driver answered `status` other than 0."""
    if status != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {status}")


BINDINGS_HINT = (
    "pip install -e '.[torch]' (or '.[cupy13]', '.[cupy12]') in a checkout of kvferry, which"
    " installs cuda-bindings; or install kvferry with a C compiler on PATH for the compiled route"
)
"""How to get `cuda-bindings`, which the Python route's driver calls need."""


def load_bindings() -> Any:
    """Return `cuda.bindings.driver`, or raise ExecutorUnavailableError saying how to install
    it."""
    try:
        return importlib.import_module("cuda.bindings.driver")
    except ImportError as error:
        raise ExecutorUnavailableError(
            f"the Python route calls the CUDA driver through cuda-bindings: {BINDINGS_HINT}"
            f" ({error})"
        ) from error


class DriverBindings:
    """A staged job's driver calls for the Python route, through `cuda.bindings.driver` (or
    any module of its functions, for tests). Each call returns the driver's `CUresult` (an int,
    0 on success; `CUresult` is an int), as the Python route's job code expects of a callable;
    handles are integers.
    """

    def __init__(self, module: Any = None) -> None:
        self._driver = load_bindings() if module is None else module
        driver = self._driver
        self._record, self._wait = driver.cuEventRecord, driver.cuStreamWaitEvent
        self._copy, self._set_context = driver.cuMemcpyAsync, driver.cuCtxSetCurrent

    def record(self, event: int, stream: int) -> int:
        """`cuEventRecord(event, stream)`."""
        status: int = self._record(event, stream)[0]
        return status

    def wait(self, stream: int, event: int) -> int:
        """`cuStreamWaitEvent(stream, event, 0)`."""
        status: int = self._wait(stream, event, 0)[0]
        return status

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> int:
        """`cuMemcpyAsync(dst, src, nbytes, stream)`: unified addresses, either direction."""
        status: int = self._copy(dst, src, nbytes, stream)[0]
        return status

    def set_context(self, context: int) -> int:
        """`cuCtxSetCurrent(context)`, which a submission thread calls once."""
        status: int = self._set_context(context)[0]
        return status

    def stage_copy(
        self, function: int, threads: int, *, refs: int, ids: int, to_stage: bool, piece: int
    ) -> StageLaunch:
        """Return one table slot's staging-kernel launch (`StageLaunch`)."""
        return StageLaunch(self._driver, function, threads, (refs, ids, int(to_stage), piece))

    def table_copy(self, function: int, threads: int, most: int) -> TableLaunch:
        """Return a direction's table-copy launch (`TableLaunch`)."""
        return TableLaunch(self._driver, function, threads, most)


class _Parameters:
    """A kernel's parameters as `cuLaunchKernel` reads them: `count` slots of 8 bytes and an
    array of pointers to them (an int parameter is read from its slot's first 4 bytes, which on
    a little-endian host hold its value). A lock makes setting and launching one step."""

    def __init__(self, count: int) -> None:
        self.values = array("q", bytes(8 * count))
        base = self.values.buffer_info()[0]
        self.pointers = array("Q", [base + 8 * i for i in range(count)])
        self.address = self.pointers.buffer_info()[0]
        self.lock = threading.Lock()


class StageLaunch:
    """`(stream, segments, count, stage, blocks)` launches `kernels.STAGE_COPY_SOURCE` through
    `cuLaunchKernel`, its parameters in `staged.STAGE_COPY_ARGUMENTS`' order: the batch's slice
    lines and their count and staging half, with the slot's constant ref table, block ids,
    direction and piece bytes. Returns the `CUresult`."""

    def __init__(
        self, driver: Any, function: int, threads: int, constants: tuple[int, int, int, int]
    ) -> None:
        self._launch = driver.cuLaunchKernel
        self._function = function
        self._threads = threads
        self._parameters = _Parameters(7)
        values = self._parameters.values
        values[2], values[3], values[5], values[6] = constants

    def __call__(self, stream: int, segments: int, count: int, stage: int, blocks: int) -> int:
        parameters = self._parameters
        values = parameters.values
        with parameters.lock:
            values[0], values[1], values[4] = segments, count, stage
            status: int = self._launch(
                self._function, blocks, 1, 1, self._threads, 1, 1, 0, stream,
                parameters.address, 0,
            )[0]  # fmt: skip
            return status


class TableLaunch:
    """`(dst, src, count, stream)` launches `kernels.TABLE_COPY_SOURCE` through
    `cuLaunchKernel`: `count` int64 from `src` to `dst`, one block per `threads` values, at most
    `most`. Returns the `CUresult`."""

    def __init__(self, driver: Any, function: int, threads: int, most: int) -> None:
        self._launch = driver.cuLaunchKernel
        self._function = function
        self._threads = threads
        self._most = most
        self._parameters = _Parameters(3)

    def __call__(self, dst: int, src: int, count: int, stream: int) -> int:
        blocks = min(max(-(-count // self._threads), 1), self._most)
        parameters = self._parameters
        values = parameters.values
        with parameters.lock:
            values[0], values[1], values[2] = src, dst, count
            status: int = self._launch(
                self._function, blocks, 1, 1, self._threads, 1, 1, 0, stream,
                parameters.address, 0,
            )[0]  # fmt: skip
            return status
