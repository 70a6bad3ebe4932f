"""The CUDA driver calls of the staged path: events through ctypes, and the addresses of the
calls that compiled code makes.

A staged job's calls (its event records and stream waits, the table upload, a kernel launch and
a DMA or so per batch) are made by compiled code (`_native.queue_job`) through the addresses
here; the host's own calls on events (create, query, synchronize, time, destroy) go through
ctypes. Through torch these calls cost 5-90 µs each on the device H200's host (torch's NVRTC
launcher builds its ctypes arguments on every call, ~90 µs; torch has no call at all for an
asynchronous copy between raw addresses); straight to `libcuda` they cost a few µs. Both GPU
executors use these, and make their lanes here too (`stream`): `torch.cuda.Stream()` hands out
streams round robin from a pool of 32 per priority that the whole process shares, so a lane
from there could be a stream the engine computes on. The libraries still own the memory and the
compiled kernels.
"""

from __future__ import annotations

import ctypes
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
