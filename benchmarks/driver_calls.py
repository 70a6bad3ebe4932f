"""The host cost of each CUDA driver call a staged job makes, one call at a time, in a hot loop.

A benchmark, never part of the test suite: it needs a CUDA GPU, torch and CuPy; without a GPU
it says so and exits 0.

Per call: `--calls` calls back to back (4 KiB copies between pinned host and device memory, a
launch of an empty kernel with the staging kernel's seven parameters on 128 blocks, an event
record, a stream wait), timed on the host, `--repeat` times with a synchronize between; the
tenth percentile and the median per call. A ctypes call into libc is the floor of any call made
this way from Python. The typed copies (`cuMemcpyHtoDAsync_v2`, `cuMemcpyDtoHAsync_v2`) are
measured beside `cuMemcpyAsync`, which the staged path uses for both directions.

    python3 benchmarks/driver_calls.py
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from collections.abc import Callable
from typing import Any

from transfer import cuda_torch

KIB = 1024
_EMPTY_KERNEL = r"""
extern "C" __global__ void kvferry_empty(unsigned long long a, int b, unsigned long long c,
                                          unsigned long long d, unsigned long long e, int f,
                                          int g) {}
"""


def _per_call(
    call: Callable[[int], int], calls: int, repeat: int, sync: Callable[[], None]
) -> list[float]:
    """Return the sorted seconds per call of `repeat` runs of `calls` calls."""
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        for i in range(calls):
            status = call(i)
            if status:
                raise RuntimeError(f"CUDA driver error {status}")
        runs.append((time.perf_counter() - start) / calls)
        sync()
    return sorted(runs)


def _calls(torch: Any, cupy: Any, calls: int) -> dict[str, Callable[[int], int]]:
    """Return each measured call, as a function of its index (so copies do not overlap)."""
    lib = ctypes.CDLL("libcuda.so.1")
    nbytes = calls * 4 * KIB
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = ctypes.c_void_p(torch.cuda.Stream().cuda_stream)
    for name in ("cuMemcpyAsync", "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2"):
        function = getattr(lib, name)
        function.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    lib.cuLaunchKernel.argtypes = [
        ctypes.c_void_p,
        *([ctypes.c_uint] * 7),
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    event = ctypes.c_void_p()
    lib.cuEventCreate(ctypes.byref(event), 2)  # no timing
    kernel = cupy.RawKernel(_EMPTY_KERNEL, "kvferry_empty")
    kernel.compile()
    empty = ctypes.c_void_p(kernel.kernel.ptr)
    values = [ctypes.c_uint64(1), ctypes.c_int(2), ctypes.c_uint64(3), ctypes.c_uint64(4)]
    values += [ctypes.c_uint64(5), ctypes.c_int(6), ctypes.c_int(7)]
    params = (ctypes.c_void_p * len(values))(
        *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values]
    )
    libc = ctypes.CDLL("libc.so.6")
    page = 4 * KIB

    def copy(name: str, to_device: bool) -> Callable[[int], int]:
        function = getattr(lib, name)

        def call(i: int) -> int:
            on_device, on_host = device.data_ptr() + i * page, host.data_ptr() + i * page
            dst, src = (on_device, on_host) if to_device else (on_host, on_device)
            return int(function(dst, src, page, stream))

        return call

    def launch(i: int) -> int:
        return int(lib.cuLaunchKernel(empty, 128, 1, 1, 256, 1, 1, 0, stream, params, None))

    _KEEP.extend((device, host, kernel))  # alive while the calls run
    return {
        "cuMemcpyAsync H2D 4 KiB": copy("cuMemcpyAsync", True),
        "cuMemcpyHtoDAsync_v2 4 KiB": copy("cuMemcpyHtoDAsync_v2", True),
        "cuMemcpyAsync D2H 4 KiB": copy("cuMemcpyAsync", False),
        "cuMemcpyDtoHAsync_v2 4 KiB": copy("cuMemcpyDtoHAsync_v2", False),
        "cuLaunchKernel, 128 blocks": launch,
        "cuEventRecord": lambda i: int(lib.cuEventRecord(event, stream)),
        "cuStreamWaitEvent": lambda i: int(lib.cuStreamWaitEvent(stream, event, 0)),
        "ctypes call into libc (floor)": lambda i: 0 * int(libc.abs(i)),
    }


_KEEP: list[Any] = []
"""Buffers and the kernel the measured calls use."""


def main() -> int:
    """Print the p10 and median host microseconds per call of each driver call."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    torch = cuda_torch("driver_calls.py")
    if torch is None:
        return 0
    import cupy

    calls = _calls(torch, cupy, args.calls)
    print(f"{args.calls} calls back to back, {args.repeat} runs; microseconds per call")
    for name, call in calls.items():
        runs = _per_call(call, args.calls, args.repeat, torch.cuda.synchronize)
        p10, median = runs[len(runs) // 10], runs[len(runs) // 2]
        print(f"{name:<30} p10 {p10 * 1e6:5.2f}  median {median * 1e6:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
