"""The C signatures of the CUDA driver calls a staged job makes, as ctypes callback types: tests
make Python functions callable at an address, standing in for `libcuda`'s, with these."""

from __future__ import annotations

import ctypes

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
