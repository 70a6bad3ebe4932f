"""The host cost of each CUDA driver call a staged job makes, one call at a time, in a hot loop.

A benchmark, never part of the test suite: it needs a CUDA GPU, torch and CuPy; without a GPU
it says so and exits 0.

Per call: `--calls` calls back to back (4 KiB copies between pinned host and device memory, a
launch of an empty kernel with the staging kernel's seven parameters on 128 blocks, an event
record, a stream wait), timed on the host, `--repeat` times with a synchronize between; the
tenth percentile and the median per call. A ctypes call into libc is the floor of any call made
this way from Python. The typed copies (`cuMemcpyHtoDAsync_v2`, `cuMemcpyDtoHAsync_v2`) are
measured beside `cuMemcpyAsync`, which the staged path uses for both directions.

It also measures what a CUDA graph of a staged job's shape would cost instead: a graph of a
nine-batch load (the table upload's launch, then per batch a DMA into a staging half and the
scatter launch after it, batch k's DMA after batch k - 2's scatter), instantiated once, then per
job `cuGraphExecMemcpyNodeSetParams` (a DMA's new host address), `cuGraphExecKernelNodeSetParams`
and `cuGraphLaunch` of the whole graph. The last lines put the per-call medians together into a
job's driver time both ways: the 27 calls the staged path makes for nine batches, against a
graph launch with its nine DMA updates (kernels that read their arguments from the job's
uploaded table need no update) and the job's event calls. Last, it makes a whole job's calls
both ways right after the host waited for ~20 ms of GPU work, as target 4b's submit runs (three
ways of waiting), and again at once after that, the ways alternating (`--jobs` times each):
thread CPU time and wall clock, p10/50/90. `--profile` times each call of such a job instead;
`--pauses` times host work and the job after pauses with and without the GPU (`--pinned`: also
pinned to one CPU).

    python3 benchmarks/driver_calls.py
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from host_steps import spin
from transfer import cuda_torch, own_stream

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


def _calls(
    torch: Any, cupy: Any, calls: int, marks: list[tuple[str, float]] | None = None
) -> tuple[dict[str, Callable[[int], None]], dict[str, Callable[[int], int]]]:
    """Return a whole nine-batch load made both ways (`_whole_jobs`, with `marks`), and each
    measured call, as a function of its index (so copies do not overlap)."""
    lib = ctypes.CDLL("libcuda.so.1")
    nbytes = calls * 4 * KIB
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = ctypes.c_void_p(own_stream(torch).cuda_stream)
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
    graph = _build_graph(
        lib,
        empty,
        params,
        device=device.data_ptr(),
        host=host.data_ptr(),
        pages=calls,
        page=page,
    )
    jobs = _whole_jobs(
        torch,
        lib,
        empty,
        params,
        graph=graph,
        device=device.data_ptr(),
        host=host.data_ptr(),
        marks=marks,
    )
    return jobs, {
        "cuMemcpyAsync H2D 4 KiB": copy("cuMemcpyAsync", True),
        "cuMemcpyHtoDAsync_v2 4 KiB": copy("cuMemcpyHtoDAsync_v2", True),
        "cuMemcpyAsync D2H 4 KiB": copy("cuMemcpyAsync", False),
        "cuMemcpyDtoHAsync_v2 4 KiB": copy("cuMemcpyDtoHAsync_v2", False),
        "cuLaunchKernel, 128 blocks": launch,
        "cuEventRecord": lambda i: int(lib.cuEventRecord(event, stream)),
        "cuStreamWaitEvent": lambda i: int(lib.cuStreamWaitEvent(stream, event, 0)),
        "ctypes call into libc (floor)": lambda i: 0 * int(libc.abs(i)),
        GRAPH_COPY: graph.set_copy,
        GRAPH_KERNEL: graph.set_kernel,
        GRAPH_LAUNCH: lambda i: graph.launch(stream),
    }


BATCHES = 9
"""Batches of the graph: a 2048-block x 32-layer load of 16 KiB pages through 2 x 128 MiB."""


def _memcpy_side(side: str, reserved: str) -> list[tuple[str, Any]]:
    """Return the fields of one side (`src` or `dst`) of CUDA_MEMCPY3D, in cuda.h's order."""
    return [
        *[(f"{side}{n}", ctypes.c_size_t) for n in ("XInBytes", "Y", "Z", "LOD")],
        (f"{side}MemoryType", ctypes.c_int),
        (f"{side}Host", ctypes.c_void_p),
        (f"{side}Device", ctypes.c_uint64),
        (f"{side}Array", ctypes.c_void_p),
        (reserved, ctypes.c_void_p),
        (f"{side}Pitch", ctypes.c_size_t),
        (f"{side}Height", ctypes.c_size_t),
    ]


class _Memcpy3D(ctypes.Structure):
    """CUDA_MEMCPY3D (cuda.h, CUDA 12 and 13)."""

    _fields_ = [
        *_memcpy_side("src", "reserved0"),
        *_memcpy_side("dst", "reserved1"),
        *[(n, ctypes.c_size_t) for n in ("WidthInBytes", "Height", "Depth")],
    ]


class _KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h)."""

    _fields_ = [
        ("func", ctypes.c_void_p),
        *[(f"{n}", ctypes.c_uint) for n in ("gridDimX", "gridDimY", "gridDimZ")],
        *[(f"{n}", ctypes.c_uint) for n in ("blockDimX", "blockDimY", "blockDimZ")],
        ("sharedMemBytes", ctypes.c_uint),
        ("kernelParams", ctypes.c_void_p),
        ("extra", ctypes.c_void_p),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
    ]


def _build_graph(
    lib: Any,
    kernel: Any,
    params: Any,
    *,
    device: int,
    host: int,
    pages: int,
    page: int,
) -> _Graph:
    """Build and instantiate the nine-batch load graph (module docstring) on 4 KiB DMAs and the
    empty kernel; return it."""
    check = _checked
    # a 4 KiB DMA per batch into one of two staging pages, from one of `pages` host pages
    context = ctypes.c_void_p()
    check(lib.cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
    graph = ctypes.c_void_p()
    check(lib.cuGraphCreate(ctypes.byref(graph), 0), "cuGraphCreate")
    arguments = ctypes.cast(params, ctypes.c_void_p)
    launch = _KernelNodeParams(kernel.value, 128, 1, 1, 256, 1, 1, 0, arguments, None, None, None)

    def add_kernel(after: list[ctypes.c_void_p]) -> ctypes.c_void_p:
        node = ctypes.c_void_p()
        deps = (ctypes.c_void_p * len(after))(*[d.value for d in after])
        status = lib.cuGraphAddKernelNode_v2(
            ctypes.byref(node), graph, deps, len(after), ctypes.byref(launch)
        )
        check(status, "cuGraphAddKernelNode_v2")
        return node

    def dma(i: int, half: int) -> _Memcpy3D:
        copy = _Memcpy3D()
        copy.srcMemoryType, copy.srcHost = 1, host + (i % pages) * page  # CU_MEMORYTYPE_HOST
        copy.dstMemoryType, copy.dstDevice = 2, device + half * page  # CU_MEMORYTYPE_DEVICE
        copy.WidthInBytes, copy.Height, copy.Depth = page, 1, 1
        return copy

    upload = add_kernel([])
    copies: list[ctypes.c_void_p] = []
    scatters: list[ctypes.c_void_p] = []
    for k in range(BATCHES):
        node = ctypes.c_void_p()
        after = [upload] if k < 2 else [scatters[k - 2]]
        deps = (ctypes.c_void_p * len(after))(*[d.value for d in after])
        status = lib.cuGraphAddMemcpyNode(
            ctypes.byref(node), graph, deps, len(after), ctypes.byref(dma(k, k % 2)), context
        )
        check(status, "cuGraphAddMemcpyNode")
        copies.append(node)
        scatters.append(add_kernel([node]))
    executable = ctypes.c_void_p()
    check(
        lib.cuGraphInstantiateWithFlags(ctypes.byref(executable), graph, ctypes.c_uint64(0)),
        "cuGraphInstantiateWithFlags",
    )
    lib.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    updates = [dma(i, i % 2) for i in range(pages)]
    _KEEP.extend((graph, executable, launch, copies, scatters, updates))

    return _Graph(
        lib,
        executable,
        context,
        copies=copies,
        scatters=scatters,
        updates=updates,
        launch=launch,
    )


class _Graph:
    """The nine-batch graph, instantiated: its per-job calls."""

    def __init__(
        self,
        lib: Any,
        executable: Any,
        context: Any,
        *,
        copies: list[ctypes.c_void_p],
        scatters: list[ctypes.c_void_p],
        updates: list[_Memcpy3D],
        launch: _KernelNodeParams,
    ) -> None:
        self._lib, self._executable, self._context = lib, executable, context
        self._copies, self._scatters, self._updates, self._launch = (
            copies,
            scatters,
            updates,
            launch,
        )

    def set_copy(self, i: int) -> int:
        """Give batch `i % BATCHES`'s DMA the `i`-th host page; return the driver's status."""
        node = self._copies[i % BATCHES]
        update = ctypes.byref(self._updates[i % len(self._updates)])
        return int(
            self._lib.cuGraphExecMemcpyNodeSetParams(self._executable, node, update, self._context)
        )

    def set_kernel(self, i: int) -> int:
        """Set batch `i % BATCHES`'s launch again; return the driver's status."""
        node = self._scatters[i % BATCHES]
        launch = ctypes.byref(self._launch)
        return int(self._lib.cuGraphExecKernelNodeSetParams_v2(self._executable, node, launch))

    def launch(self, stream: Any) -> int:
        """Launch the graph on `stream`; return the driver's status."""
        return int(self._lib.cuGraphLaunch(self._executable, stream))


def _whole_jobs(
    torch: Any,
    lib: Any,
    kernel: Any,
    params: Any,
    *,
    graph: _Graph,
    device: int,
    host: int,
    marks: list[tuple[str, float]] | None,
) -> dict[str, Callable[[int], None]]:
    """Return the `i`-th nine-batch load's driver calls, made call by call as `_native.queue`
    makes them (28 calls on a compute stream and two lanes) and through the graph (the job's
    event calls, nine DMA updates, ten kernel updates, the launch). With `marks`, each call
    appends its name and the clock when it returned."""
    compute, lane0, lane1 = (ctypes.c_void_p(own_stream(torch).cuda_stream) for _ in range(3))
    events = {}
    for name, flags in (("ready", 2), ("uploaded", 2), ("joined", 2), ("previous", 2)):
        events[name] = ctypes.c_void_p()
        _checked(lib.cuEventCreate(ctypes.byref(events[name]), flags), "cuEventCreate")
    for name in ("start", "end"):  # timing events, as a job's
        events[name] = ctypes.c_void_p()
        _checked(lib.cuEventCreate(ctypes.byref(events[name]), 0), "cuEventCreate")
    _checked(lib.cuEventRecord(events["previous"], compute), "cuEventRecord")
    _KEEP.append((compute, lane0, lane1, events))
    record, wait, copy = lib.cuEventRecord, lib.cuStreamWaitEvent, lib.cuMemcpyAsync
    launch, page = lib.cuLaunchKernel, 4 * KIB

    def run(status: int, name: str) -> None:
        _checked(status, name)
        if marks is not None:
            marks.append((name, time.perf_counter()))

    def call_by_call(i: int) -> None:
        run(record(events["ready"], compute), "record ready")
        run(wait(lane0, events["ready"], 0), "wait ready")
        run(record(events["start"], lane0), "record start")
        run(launch(kernel, 128, 1, 1, 256, 1, 1, 0, lane0, params, None), "launch table copy")
        run(record(events["uploaded"], lane0), "record uploaded")
        run(wait(lane1, events["uploaded"], 0), "wait uploaded")
        for k in range(BATCHES):
            lane = (lane0, lane1)[k % 2]
            run(copy(device + (k % 2) * page, host + k * page, page, lane), f"DMA {k}")
            if k == 0:
                run(wait(lane, events["previous"], 0), "wait previous")
            run(launch(kernel, 128, 1, 1, 256, 1, 1, 0, lane, params, None), f"launch {k}")
        run(record(events["joined"], lane1), "record joined")
        run(wait(lane0, events["joined"], 0), "wait joined")
        run(record(events["end"], lane0), "record end")

    def through_the_graph(i: int) -> None:
        run(record(events["ready"], compute), "record ready")
        run(wait(lane0, events["ready"], 0), "wait ready")
        run(wait(lane0, events["previous"], 0), "wait previous")
        run(record(events["start"], lane0), "record start")
        for k in range(BATCHES):
            run(graph.set_copy(i * BATCHES + k), f"DMA update {k}")
        for k in range(BATCHES + 1):  # the scatters and the table copy
            run(graph.set_kernel(k), f"kernel update {k}")
        run(graph.launch(lane0), "graph launch")
        run(record(events["end"], lane0), "record end")

    return {"call by call (28 calls)": call_by_call, "as a graph": through_the_graph}


def after_wait(torch: Any, jobs: dict[str, Callable[[int], None]], repeat: int) -> list[str]:
    """Return, for each way of making a nine-batch load's calls (`jobs`), the p10 / median /
    p90 microseconds of thread CPU time and wall clock it took right after the host waited for
    ~20 ms of GPU work, for each way of waiting (`WAITS`), and made again at once after that;
    the ways alternating, `repeat` times each."""
    seconds: dict[str, list[tuple[float, float]]] = {}
    for i in range(repeat):
        for wait_name, wait in WAITS.items():
            for name, job in jobs.items():
                for when in ("after a wait", "again at once"):
                    if when == "after a wait":
                        torch.cuda._sleep(40_000_000)  # ~20 ms of one spinning thread on the GPU
                        wait(torch)
                    wall, cpu = time.perf_counter(), time.thread_time()
                    job(i)
                    measured = (time.thread_time() - cpu, time.perf_counter() - wall)
                    seconds.setdefault(f"{name}, {when} ({wait_name})", []).append(measured)
                torch.cuda.synchronize()
    lines = []
    for name, pairs in seconds.items():
        cpu_sorted, wall_sorted = (sorted(p[j] for p in pairs) for j in (0, 1))
        n = len(pairs)
        picks = [n // 10, n // 2, (9 * n) // 10]
        lines.append(
            f"nine-batch load, {name}: cpu "
            + "/".join(f"{1e6 * cpu_sorted[k]:.0f}" for k in picks)
            + " us, wall "
            + "/".join(f"{1e6 * wall_sorted[k]:.0f}" for k in picks)
            + " us (p10/50/90)"
        )
    return lines


PROFILE_WHENS = (
    "after a wait",
    "after a wait, a stream query first",
    "after a wait, fixed host work first",
    "again at once",
)
"""What `call_profile` does between the wait and the job: nothing; one cheap driver call on the
job's compute stream (does the first call pay for the wait?); a fixed piece of Python with no
driver call (is the host itself slower after a wait?); and, with no wait, the job again."""


def _fixed_host_work() -> int:
    return sum(i * i for i in range(300))


def call_profile(
    torch: Any,
    lib: Any,
    jobs: dict[str, Callable[[int], None]],
    marks: list[tuple[str, float]],
    repeat: int,
) -> list[str]:
    """Return, for each way of making a nine-batch load's calls, the median microseconds of each
    call (wall clock between returns) right after a wait for ~20 ms of GPU work (an event
    synchronize, as the executors wait), in each of `PROFILE_WHENS`, `repeat` times each, the
    ways alternating; a ctypes call into libc first, and the job's thread CPU time and wall
    clock in all."""
    took: dict[tuple[str, str, str], list[float]] = {}
    order: dict[tuple[str, str], list[str]] = {}
    libc = ctypes.CDLL("libc.so.6")
    query = lib.cuStreamQuery
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    for i in range(repeat):
        for name, job in jobs.items():
            for when in PROFILE_WHENS:
                if when != "again at once":
                    _synchronize_on_gpu_work(torch)
                marks.clear()
                wall, cpu = time.perf_counter(), time.thread_time()
                before = wall
                libc.abs(i)  # the same path into C, no driver
                marks.append(("ctypes into libc", time.perf_counter()))
                if when == "after a wait, a stream query first":
                    query(stream)
                    marks.append(("cuStreamQuery", time.perf_counter()))
                elif when == "after a wait, fixed host work first":
                    _fixed_host_work()
                    marks.append(("fixed host work", time.perf_counter()))
                job(i)
                cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
                took.setdefault((name, when, "whole job, cpu"), []).append(cpu)
                took.setdefault((name, when, "whole job, wall"), []).append(wall)
                order[name, when] = [call for call, _ in marks]
                for call, at in marks:
                    took.setdefault((name, when, call), []).append(at - before)
                    before = at
            torch.cuda.synchronize()
    lines = [f"median us per call, {repeat} jobs each; columns: " + " | ".join(PROFILE_WHENS)]
    for name in jobs:
        lines.append(f"{name}:")
        calls = list(dict.fromkeys(c for w in PROFILE_WHENS for c in order[name, w]))
        for call in [*calls, "whole job, cpu", "whole job, wall"]:
            cells = [
                f"{1e6 * statistics.median(took[name, w, call]):7.1f}"
                if (name, w, call) in took
                else "      -"
                for w in PROFILE_WHENS
            ]
            lines.append(f"  {call:<20} " + " ".join(cells))
    return lines


def _event_synchronize(torch: Any) -> None:
    event = torch.cuda.Event()
    event.record()
    event.synchronize()


def _event_poll(torch: Any) -> None:
    event = torch.cuda.Event()
    event.record()
    while not event.query():
        pass


WAITS: dict[str, Callable[[Any], None]] = {
    "device synchronize": lambda torch: torch.cuda.synchronize(),
    "event synchronize, as the executors wait": _event_synchronize,
    "polling the event from Python": _event_poll,
}
"""The ways `after_wait` waits for the GPU before a job."""


def _spinning(seconds: float) -> Callable[[Any], None]:
    return lambda torch: spin(seconds)


def _synchronize_on_gpu_work(torch: Any) -> None:
    torch.cuda._sleep(40_000_000)  # ~20 ms of one spinning thread on the GPU
    _event_synchronize(torch)


def _poll_on_gpu_work(torch: Any) -> None:
    torch.cuda._sleep(40_000_000)
    _event_poll(torch)


PAUSES: dict[str, Callable[[Any], None]] = {
    "event synchronize on ~20 ms of GPU work": _synchronize_on_gpu_work,
    "polling that event from Python": _poll_on_gpu_work,
    "asleep 20 ms (time.sleep), no CUDA call": lambda torch: time.sleep(0.02),
    **{f"spinning {ms:g} ms in Python, no CUDA call": _spinning(ms / 1e3) for ms in (20, 4, 1)},
    "no pause: again at once": lambda torch: None,
}
"""What `pauses` does before each measurement: wait for the GPU as the executors do, or poll it,
or pause the thread without the GPU, asleep or busy, as long or shorter; or nothing."""


def pauses(torch: Any, job: Callable[[int], None], repeat: int, *, pinned: bool) -> list[str]:
    """Return, for each of `PAUSES`, the median microseconds a ctypes call into libc and a fixed
    piece of Python took right after it, the p10/50/90 thread CPU microseconds of a nine-batch
    load's 28 calls made next, and how often the thread came back on another CPU than it left;
    `repeat` times each, the pauses alternating. With `pinned`, the process runs on one CPU."""
    libc = ctypes.CDLL("libc.so.6")
    allowed = os.sched_getaffinity(0)
    if pinned:
        os.sched_setaffinity(0, {libc.sched_getcpu()})
    took: dict[str, list[tuple[float, float, float, bool]]] = {}
    try:
        for i in range(repeat):
            for name, pause in PAUSES.items():
                left = libc.sched_getcpu()
                pause(torch)
                start = time.perf_counter()
                libc.abs(i)
                called = time.perf_counter()
                _fixed_host_work()
                worked, cpu = time.perf_counter(), time.thread_time()
                job(i)
                cpu = time.thread_time() - cpu
                moved = libc.sched_getcpu() != left
                took.setdefault(name, []).append((called - start, worked - called, cpu, moved))
            torch.cuda.synchronize()
    finally:
        os.sched_setaffinity(0, allowed)
    lines = [f"{'pinned to one CPU' if pinned else 'not pinned'}, {repeat} each (us):"]
    for name, rows in took.items():
        libc_us, work_us = (1e6 * statistics.median(r[j] for r in rows) for j in (0, 1))
        job_us = sorted(1e6 * r[2] for r in rows)
        n = len(job_us)
        lines.append(
            f"  {name:<42} libc {libc_us:5.1f}  host work {work_us:5.1f}  job cpu "
            f"{job_us[n // 10]:.0f}/{job_us[n // 2]:.0f}/{job_us[(9 * n) // 10]:.0f} "
            f"(p10/50/90)  on another CPU after it {sum(r[3] for r in rows)}/{n}"
        )
    return lines


GRAPH_COPY = "cuGraphExecMemcpyNodeSetParams"
GRAPH_KERNEL = "cuGraphExecKernelNodeSetParams"
GRAPH_LAUNCH = f"cuGraphLaunch, {2 * BATCHES + 1} nodes"


def _checked(status: int, call: str) -> None:
    if status:
        raise RuntimeError(f"{call} failed: CUDA driver error {status}")


def job_estimates(median_us: dict[str, float]) -> list[str]:
    """Return the lines that put the per-call medians together into a nine-batch job's driver
    time, made call by call as the staged path does and as one graph launch."""
    copy, launch = median_us["cuMemcpyAsync H2D 4 KiB"], median_us["cuLaunchKernel, 128 blocks"]
    record, wait = median_us["cuEventRecord"], median_us["cuStreamWaitEvent"]
    # the staged path: per batch a DMA and a launch; per job the upload launch, 5 records and
    # 4 waits (begin, upload, the wait for the previous job, finish)
    direct = BATCHES * (copy + launch) + launch + 5 * record + 4 * wait
    # a graph: per batch one DMA update; per job the launch, 3 records and 2 waits (the
    # compute stream's event and the previous job's, start and end)
    graph = BATCHES * median_us[GRAPH_COPY] + median_us[GRAPH_LAUNCH] + 3 * record + 2 * wait
    with_kernels = graph + BATCHES * median_us[GRAPH_KERNEL]
    return [
        f"nine-batch load job, driver time from these medians: call by call (the staged path's "
        f"{2 * BATCHES + 10} calls) {direct:.0f} us",
        f"  as a graph: 9 DMA updates + launch + 5 event calls {graph:.0f} us; "
        f"with 9 kernel updates too {with_kernels:.0f} us",
    ]


_KEEP: list[Any] = []
"""Buffers and the kernel the measured calls use."""


def main() -> int:
    """Print the p10 and median host microseconds per call of each driver call."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--jobs", type=int, default=20, help="whole jobs each way, after a wait")
    parser.add_argument(
        "--profile", action="store_true", help="only time each call of a whole job after a wait"
    )
    parser.add_argument(
        "--pauses",
        action="store_true",
        help="only time host work and a whole job after each of several pauses",
    )
    parser.add_argument("--pinned", action="store_true", help="with --pauses: pinned, then not")
    args = parser.parse_args()
    torch = cuda_torch("driver_calls.py")
    if torch is None:
        return 0
    import cupy

    marks: list[tuple[str, float]] | None = [] if args.profile else None
    jobs, calls = _calls(torch, cupy, args.calls, marks)
    if args.pauses:
        flags = ctypes.c_uint()
        _checked(ctypes.CDLL("libcuda.so.1").cuCtxGetFlags(ctypes.byref(flags)), "cuCtxGetFlags")
        print(f"context flags {flags.value:#x} (scheduling: 0 auto, 1 spin, 2 yield, 4 blocking)")
        for pinned in (False, True) if args.pinned else (False,):
            for line in pauses(torch, jobs["call by call (28 calls)"], args.jobs, pinned=pinned):
                print(line)
        return 0
    if marks is not None:
        lib = ctypes.CDLL("libcuda.so.1")
        for line in call_profile(torch, lib, jobs, marks, args.jobs):
            print(line)
        return 0
    print(f"{args.calls} calls back to back, {args.repeat} runs; microseconds per call")
    medians = {}
    for name, call in calls.items():
        runs = _per_call(call, args.calls, args.repeat, torch.cuda.synchronize)
        p10, median = runs[len(runs) // 10], runs[len(runs) // 2]
        medians[name] = median * 1e6
        print(f"{name:<32} p10 {p10 * 1e6:6.2f}  median {median * 1e6:6.2f}")
    for line in job_estimates(medians) + after_wait(torch, jobs, args.jobs):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
