"""The few CUDA driver calls the torch executor makes itself, through ctypes.

torch has no public call for an asynchronous copy between two raw addresses, and its NVRTC
kernel launcher (`torch.cuda._compile_kernel`) builds its ctypes argument array on every call
(about 90 µs a launch, measured on the device H200's host). Copies and staging-kernel launches
are per batch on the submit path, so they go straight to `libcuda` here: a few µs each.
"""

from __future__ import annotations

import ctypes
from typing import Any

from kvferry.core.errors import ExecutorUnavailableError
from kvferry.executors.kernels import PIECE_BYTES, THREADS


class CudaDriver:
    """`cuMemcpyAsync` and `cuLaunchKernel` from `libcuda.so.1` (loaded once per process)."""

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
            CudaDriver._library = library
        self._lib = CudaDriver._library

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy of `nbytes` from `src` to `dst` (unified addresses) on `stream`."""
        _check(self._lib.cuMemcpyAsync(dst, src, nbytes, stream), "cuMemcpyAsync")

    def launch(self, function: Any, blocks: int, params: Any, stream: int) -> None:
        """Launch `function` on `blocks` x `THREADS` threads with the kernel `params` array."""
        _check(
            self._lib.cuLaunchKernel(
                function, blocks, 1, 1, THREADS, 1, 1, 0, stream, params, None
            ),
            "cuLaunchKernel",
        )


class StageCopyLauncher:
    """Launches the staging kernel (`kernels.STAGE_COPY_SOURCE`) with argument holders made once.

    Not thread-safe: one executor launches from one thread at a time.
    """

    def __init__(self, driver: CudaDriver, function: Any) -> None:
        self._driver = driver
        self._function = function
        self._segments = ctypes.c_uint64()
        self._count = ctypes.c_int()
        self._ids = ctypes.c_uint64()
        self._stage = ctypes.c_uint64()
        self._to_stage = ctypes.c_int()
        self._piece = ctypes.c_int(PIECE_BYTES)
        holders = (
            self._segments,
            self._count,
            self._ids,
            self._stage,
            self._to_stage,
            self._piece,
        )
        self._params = (ctypes.c_void_p * len(holders))(
            *(ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders)
        )

    def __call__(
        self,
        *,
        segments: int,
        count: int,
        ids: int,
        stage: int,
        to_stage: bool,
        blocks: int,
        stream: int,
    ) -> None:
        """Launch over `count` segment lines at address `segments` (see the kernel source)."""
        self._segments.value = segments
        self._count.value = count
        self._ids.value = ids
        self._stage.value = stage
        self._to_stage.value = int(to_stage)
        self._driver.launch(self._function, blocks, self._params, stream)


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {status}")
