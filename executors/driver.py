"""The CUDA driver calls of the staged path, through ctypes, and the addresses of the two that
compiled code makes.

A staged job makes a handful of calls for itself (records and waits on events, the table
upload) and two or so per batch (one kernel launch, the DMAs); the per-batch ones are made by
the compiled batch loop (`_native.queue_batches`) through `launch_address` and
`memcpy_address`. Through torch these calls cost 5-90 µs each on the device H200's host
(torch's NVRTC launcher builds its ctypes arguments on every call, ~90 µs; torch has no call at
all for an asynchronous copy between raw addresses); straight to `libcuda` they cost a few µs.
Both GPU executors use these; the libraries still own the streams, the memory and the compiled
kernels.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from kvferry.core.errors import ExecutorUnavailableError
from kvferry.executors.kernels import THREADS


class CudaDriver:
    """Copies, launches and events from `libcuda.so.1` (loaded once per process); handles are
    plain integers, and calls act on the current context."""

    _library: ctypes.CDLL | None = None

    def __init__(self) -> None:
        if CudaDriver._library is None:
            try:
                library = ctypes.CDLL("libcuda.so.1")
            except OSError as error:
                raise ExecutorUnavailableError(
                    f"the CUDA driver is not loadable: {error}"
                ) from error
            library.cuMemcpyAsync.argtypes = [
                ctypes.c_uint64,
                ctypes.c_uint64,
                ctypes.c_size_t,
                ctypes.c_void_p,
            ]
            library.cuMemcpyAsync.restype = ctypes.c_int
            library.cuLaunchKernel.argtypes = [
                ctypes.c_void_p,
                *([ctypes.c_uint] * 6),
                ctypes.c_uint,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
            ]
            library.cuLaunchKernel.restype = ctypes.c_int
            signatures: dict[str, list[Any]] = {
                "cuEventCreate": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint],
                "cuEventRecord": [ctypes.c_void_p, ctypes.c_void_p],
                "cuStreamWaitEvent": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint],
                "cuEventQuery": [ctypes.c_void_p],
                "cuEventSynchronize": [ctypes.c_void_p],
                "cuEventElapsedTime": [
                    ctypes.POINTER(ctypes.c_float),
                    ctypes.c_void_p,
                    ctypes.c_void_p,
                ],
                "cuEventDestroy_v2": [ctypes.c_void_p],
            }
            for name, argtypes in signatures.items():
                function = getattr(library, name)
                function.argtypes = argtypes
                function.restype = ctypes.c_int
            CudaDriver._library = library
        self._lib = CudaDriver._library

    @property
    def library(self) -> ctypes.CDLL:
        """Return `libcuda`, its functions' argument types set."""
        return self._lib

    @property
    def launch_address(self) -> int:
        """Return the address of `cuLaunchKernel`, for compiled code to call."""
        return _address(self._lib.cuLaunchKernel)

    @property
    def memcpy_address(self) -> int:
        """Return the address of `cuMemcpyAsync`, for compiled code to call."""
        return _address(self._lib.cuMemcpyAsync)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy of `nbytes` from `src` to `dst` (unified addresses) on `stream`."""
        status = self._lib.cuMemcpyAsync(dst, src, nbytes, stream)
        if status:  # no call on success: benchmarks make one of these per page
            check_status(status, "cuMemcpyAsync")

    def event(self, *, timing: bool) -> int:
        """Return a new event on the current context (timing, or the cheaper kind without)."""
        handle = ctypes.c_void_p()
        flags = 0 if timing else _EVENT_DISABLE_TIMING
        check_status(self._lib.cuEventCreate(ctypes.byref(handle), flags), "cuEventCreate")
        return int(handle.value or 0)

    def record(self, event: int, stream: int) -> None:
        """Record `event` on `stream`."""
        status = self._lib.cuEventRecord(event, stream)
        if status:  # a job makes several of these: no call on success
            check_status(status, "cuEventRecord")

    def wait(self, stream: int, event: int) -> None:
        """Make `stream` wait for the work `event` last captured."""
        status = self._lib.cuStreamWaitEvent(stream, event, 0)
        if status:
            check_status(status, "cuStreamWaitEvent")

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


class KernelLauncher:
    """Launches one compiled kernel, on `THREADS`-thread blocks, with its argument holders made
    once: a launch sets their values and makes one driver call.

    Not thread-safe: one executor launches from one thread at a time.
    """

    def __init__(
        self, driver: CudaDriver, function: Any, arguments: Sequence[type[ctypes._SimpleCData[Any]]]
    ) -> None:
        """`arguments`: the ctypes type of each kernel parameter, in order."""
        self._launch = driver.library.cuLaunchKernel
        # a CUfunction as an int (CuPy) or already a c_void_p (torch)
        self._function = ctypes.c_void_p(getattr(function, "value", function))
        self._holders = tuple(kind() for kind in arguments)
        # the launch's constant arguments, converted once
        self._one, self._threads, self._no_bytes = (ctypes.c_uint(n) for n in (1, THREADS, 0))
        self._params = (ctypes.c_void_p * len(self._holders))(
            *(ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in self._holders)
        )

    @property
    def function(self) -> int:
        """Return the kernel's `CUfunction` as an integer."""
        return int(self._function.value or 0)

    def __call__(self, *values: int, blocks: int, stream: int) -> None:
        """Launch on `blocks` thread blocks on raw stream `stream`, the parameters set to
        `values`."""
        if len(values) != len(self._holders):
            raise TypeError(f"the kernel takes {len(self._holders)} values, not {len(values)}")
        for holder, value in zip(self._holders, values, strict=False):  # checked just above
            holder.value = value
        one = self._one
        status = self._launch(
            self._function,
            blocks,
            one,
            one,
            self._threads,
            one,
            one,
            self._no_bytes,
            stream,
            self._params,
            None,
        )
        if status:
            check_status(status, "cuLaunchKernel")


_EVENT_DISABLE_TIMING = 2
"""CU_EVENT_DISABLE_TIMING."""

_NOT_READY = 600
"""CUDA_ERROR_NOT_READY: what cuEventQuery answers for work still running."""


def _address(function: Any) -> int:
    return int(ctypes.cast(function, ctypes.c_void_p).value or 0)


def check_status(status: int, call: str) -> None:
    """Raise `RuntimeError` naming `call` when the driver answered `status` other than 0."""
    if status != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {status}")
