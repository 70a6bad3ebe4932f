"""The C signatures of the CUDA driver calls a staged job makes, as ctypes callback types: tests
make Python functions callable at an address, standing in for `libcuda`'s, with these."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    *([ctypes.c_uint] * 7),
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.c_void_p,
)
"""`cuLaunchKernel(function, grid x y z, block x y z, shared bytes, stream, params, extra)`."""
MEMCPY = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
)
"""`cuMemcpyAsync(dst, src, bytes, stream)`."""
RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
"""`cuEventRecord(event, stream)`."""
WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
"""`cuStreamWaitEvent(stream, event, flags)`."""
SET_CONTEXT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
"""`cuCtxSetCurrent(context)`."""


def address(function: object) -> int:
    """Return the address C code calls a ctypes callback (or a library function) at."""
    return int(ctypes.cast(function, ctypes.c_void_p).value or 0)


class Bindings:
    """Stands in for `cuda.bindings.driver`: its functions that a staged job calls, each calling
    the Python function a ctypes callback of the types above would call (`launch` with the
    kernel's parameters as the pointer array C code reads), and answering `(status,)` as
    `cuda-bindings` does. `executors.driver.DriverBindings` over it makes the Python route's
    calls reach the same recorders as the compiled route's calls by address."""

    def __init__(
        self,
        *,
        record: Callable[..., int],
        wait: Callable[..., int],
        memcpy: Callable[..., int],
        launch: Callable[..., int],
        set_context: Callable[..., int] | None = None,
    ) -> None:
        self._record, self._wait, self._memcpy = record, wait, memcpy
        self._launch, self._set_context = launch, set_context

    def cuEventRecord(self, event: int, stream: int) -> tuple[int]:  # noqa: N802
        return (self._record(event, stream),)

    def cuStreamWaitEvent(self, stream: int, event: int, flags: int) -> tuple[int]:  # noqa: N802
        return (self._wait(stream, event, flags),)

    def cuMemcpyAsync(self, dst: int, src: int, nbytes: int, stream: int) -> tuple[int]:  # noqa: N802
        return (self._memcpy(dst, src, nbytes, stream),)

    def cuLaunchKernel(self, function: int, *rest: Any) -> tuple[int]:  # noqa: N802
        (*grid_and_block, shared, stream, params, extra) = rest
        pointers = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        return (self._launch(function, *grid_and_block, shared, stream, pointers, extra or None),)

    def cuCtxSetCurrent(self, context: int) -> tuple[int]:  # noqa: N802
        if self._set_context is None:
            raise AssertionError("no context call expected")
        return (self._set_context(context),)
