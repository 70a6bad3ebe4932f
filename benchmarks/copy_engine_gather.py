"""Copy-engine gather: can the GPU's copy engines (no SMs) gather KV pages instead of a kernel?

An experiment for issue 5 target 3, never part of the test suite: it needs a CUDA GPU; without
one it says so and exits 0.

The staged path gathers randomly placed pages into a contiguous GPU staging buffer with a CUDA
kernel, then makes one DMA to pinned host memory (the reverse for loads). Beside a bf16 8192^3
matmul loop that kernel costs the matmul +4-12 % and the transfers fall to 0.72-0.86 of the link,
while contiguous pinned copies alone (copy engines only) cost +2.3-2.9 %
(docs/benchmark-history.md).
DESIGN.md 5.1 measured one `cudaMemcpyBatchAsync` call of host-to-device 16 KiB pages at 11.7 GB/s
of a 55 GB/s link; unknown is whether device-to-device (D2D) batched copies are faster per piece,
so that copy engines could do the gather and scatter themselves. Measured here, in one run:

1. ceiling: one contiguous pinned copy each way (`cuMemcpyAsync`), and both ways at once;
2. D2D gather (and scatter) of all pages of a job into (from) a contiguous device staging buffer
   with ONE `cuMemcpyBatchAsync` call, with the copy flag PREFER_OVERLAP_WITH_COMPUTE, and split
   into several calls over several streams. "GPU GB/s" is CUDA-event time with the streams held
   by a sleep kernel until the host call has returned ("gate ok"), so it is the engines' speed
   without the host time; "host ms" is the host time inside the call(s); "e2e GB/s" is bytes over
   the host time from the first call to the end of the copies (no gate);
3. one `cuMemcpyAsync` per page D2D (default 256 KiB pages only, capped at a few seconds): the
   host-bound reference;
4. the copy-engine-only (CE-only) pipeline: batched D2D gather into one of two staging halves
   (128 MiB each) + one contiguous D2H copy per half, double-buffered on two streams (half h is
   always used on stream h, so stream order frees it); the load is the reverse (H2D per half,
   batched D2D scatter). One job (GPU-only, gated; end to end) and back-to-back jobs (two in
   flight, bytes over host time between job ends, as interference.py);
5. interference: a loop of bf16 8192 x 8192 x 8192 matmuls on its own stream (CUDA-event time per
   matmul) alone, then beside back-to-back CE-only pipelines (store; store with the overlap flag;
   load; both ways at once) and beside back-to-back contiguous pinned copies (the "pinned-copy"
   reference, the copy engines alone, same directions). Slowdown = with / alone - 1.

Layout: `--layers` (32) separate source buffers ("layers"), each of 2 x the job's blocks of one
page; a job moves the same random block ids in every layer (pages in job order layer by layer),
1 GiB per job. Stores read block ids from one random half of the blocks, loads write the other
half, so a store and a load in flight never touch the same page. Every copy stream is a torch
(non-blocking) stream, every copy a raw driver call through ctypes on torch's context. Ratios are
against the one-way ceiling of the direction measured in the same run (gather: D2H; scatter:
H2D), combined ones against both ways at once.

    python3 benchmarks/copy_engine_gather.py --json bench-out/copy_engine_gather.json
    python3 benchmarks/copy_engine_gather.py --quick   # 256 MiB jobs, 50 matmuls: a first try
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from transfer import own_stream

from kvferry.executors.driver import CudaDriver, check_status

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
MATMUL_N = 8192
NAN = float("nan")
WAIT_TIMEOUT_S = 60.0
"""Longest wait for one GPU event before the measurement is reported as hung."""

# cuda.h (CUDA 12.8 / 13.0)
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEMCPY_FLAG_DEFAULT = 0
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
CU_GET_PROC_ADDRESS_SUCCESS = 0
CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT = 40
SECTIONS = ("gather", "per-page", "pipeline", "interference")
CE_VARIANTS = ("store", "store-overlap", "load", "both")


class _MemLocation(ctypes.Structure):
    """CUmemLocation: {CUmemLocationType type; int id;} (two 4-byte fields)."""

    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes (v1): srcAccessOrder (enum), srcLocHint, dstLocHint, unsigned flags;
    24 bytes. The location hints apply to managed / pageable memory only; zero (INVALID) here."""

    _fields_ = (
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    )


_P = ctypes.c_void_p
_BATCH_V13 = ctypes.CFUNCTYPE(
    ctypes.c_int, _P, _P, _P, ctypes.c_size_t, _P, _P, ctypes.c_size_t, _P
)
"""CUDA 13.0 ABI (`cuMemcpyBatchAsync_v2`): dsts, srcs, sizes, count, attrs, attrsIdxs,
numAttrs, hStream."""
_BATCH_V12 = ctypes.CFUNCTYPE(
    ctypes.c_int, _P, _P, _P, ctypes.c_size_t, _P, _P, ctypes.c_size_t, _P, _P
)
"""CUDA 12.8 ABI (`cuMemcpyBatchAsync`): the same with `size_t* failIdx` before hStream."""


_RECORD = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P)
"""`cuEventRecord(event, stream)`."""
_WAIT = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, ctypes.c_uint)
"""`cuStreamWaitEvent(stream, event, flags)`."""
_MEMCPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, _P)
"""`cuMemcpyAsync(dst, src, bytes, stream)`."""


class _Driver(CudaDriver):
    """kvferry's CudaDriver, plus the three stream calls this script makes from Python; the
    executors make them from compiled code, at the addresses CudaDriver gives."""

    def __init__(self) -> None:
        super().__init__()
        self._record = _RECORD(self.record_address)
        self._wait = _WAIT(self.wait_address)
        self._memcpy = _MEMCPY(self.memcpy_address)

    def record(self, event: int, stream: int) -> None:
        """Record `event` on `stream`."""
        check_status(self._record(event, stream), "cuEventRecord")

    def wait(self, stream: int, event: int) -> None:
        """Make `stream` wait for `event`."""
        check_status(self._wait(stream, event, 0), "cuStreamWaitEvent")

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy of `nbytes` from `src` to `dst` on `stream`."""
        check_status(self._memcpy(dst, src, nbytes, stream), "cuMemcpyAsync")


def _load_driver() -> tuple[_Driver, str]:
    """Return kvferry's CudaDriver with this script's stream calls, and its name (for the
    report)."""
    return _Driver(), "kvferry.executors.driver.CudaDriver"


class _Libcuda:
    """The other driver calls: context, device attributes, and `cuMemcpyBatchAsync`."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        signatures: dict[str, list[Any]] = {
            "cuDriverGetVersion": [ctypes.POINTER(ctypes.c_int)],
            "cuCtxGetCurrent": [ctypes.POINTER(_P)],
            "cuCtxSetCurrent": [_P],
            "cuCtxGetDevice": [ctypes.POINTER(ctypes.c_int)],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_P), ctypes.c_int],
            "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
        }
        for name, argtypes in signatures.items():
            function = getattr(self.lib, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_int

    def driver_version(self) -> int:
        version = ctypes.c_int()
        check_status(self.lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        return version.value

    def ensure_context(self, ordinal: int) -> str:
        """Make sure a context is current on this thread (torch's primary one); describe it."""
        ctx = _P()
        check_status(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if ctx.value:
            return f"torch's current context 0x{ctx.value:x}"
        device = ctypes.c_int()
        check_status(self.lib.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
        check_status(
            self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device),
            "cuDevicePrimaryCtxRetain",
        )
        check_status(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        return f"no current context; made the primary context 0x{ctx.value or 0:x} current"

    def copy_engines(self) -> int:
        device, value = ctypes.c_int(), ctypes.c_int()
        check_status(self.lib.cuCtxGetDevice(ctypes.byref(device)), "cuCtxGetDevice")
        check_status(
            self.lib.cuDeviceGetAttribute(
                ctypes.byref(value), CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT, device
            ),
            "cuDeviceGetAttribute",
        )
        return value.value


class _BatchCopy:
    """`cuMemcpyBatchAsync` through ctypes, every copy with one attribute entry
    (srcAccessOrder STREAM, flags as asked); `__call__` returns the host seconds in the call."""

    WAYS = ("proc13000", "proc12080", "sym-v2", "sym")

    def __init__(self, lib: ctypes.CDLL, choice: str) -> None:
        if ctypes.sizeof(ctypes.c_size_t) != 8 or ctypes.sizeof(_MemcpyAttributes) != 24:
            raise RuntimeError("unexpected ctypes sizes (size_t must be 8 bytes, attrs 24)")
        self.tried: list[str] = []
        function: Any = None
        for way in self.WAYS if choice == "auto" else (choice,):
            function = self._resolve(lib, way)
            if function is not None:
                break
        if function is None:
            raise RuntimeError("cuMemcpyBatchAsync not found: " + "; ".join(self.tried))
        self._function = function
        self._attrs = {
            flags: _MemcpyAttributes(
                srcAccessOrder=CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                srcLocHint=_MemLocation(0, 0),
                dstLocHint=_MemLocation(0, 0),
                flags=flags,
            )
            for flags in (CU_MEMCPY_FLAG_DEFAULT, CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE)
        }
        self._index = ctypes.c_size_t(0)  # attrsIdxs = {0}: attrs[0] applies to every copy
        self._fail = ctypes.c_size_t(0)
        self.calls = 0

    def _resolve(self, lib: ctypes.CDLL, way: str) -> Any:
        """Return a callable for `way` (setting `self.api`, `self.fail_idx`), or None."""
        try:
            if way.startswith("proc"):
                version = int(way.removeprefix("proc"))
                get = lib.cuGetProcAddress_v2
                get.argtypes = [
                    ctypes.c_char_p,
                    ctypes.POINTER(_P),
                    ctypes.c_int,
                    ctypes.c_uint64,
                    ctypes.POINTER(ctypes.c_int),
                ]
                get.restype = ctypes.c_int
                pfn, status = _P(), ctypes.c_int(-1)
                rc = get(b"cuMemcpyBatchAsync", ctypes.byref(pfn), version, 0, ctypes.byref(status))
                if rc != 0 or status.value != CU_GET_PROC_ADDRESS_SUCCESS or not pfn.value:
                    self.tried.append(f"{way}: rc {rc}, symbol status {status.value}")
                    return None
                address, v13 = pfn.value, version >= 13000
                self.api = f"cuGetProcAddress_v2('cuMemcpyBatchAsync', {version})"
            else:
                name = "cuMemcpyBatchAsync_v2" if way == "sym-v2" else "cuMemcpyBatchAsync"
                address = ctypes.cast(getattr(lib, name), _P).value or 0
                v13 = way == "sym-v2"
                self.api = f"dlsym {name}"
        except (AttributeError, OSError, ValueError) as error:
            self.tried.append(f"{way}: {error}")
            return None
        self.fail_idx = not v13
        self.api += " (12.8 ABI, with failIdx)" if self.fail_idx else " (13.0 ABI, no failIdx)"
        return (_BATCH_V12 if self.fail_idx else _BATCH_V13)(address)

    def __call__(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int, flags: int
    ) -> float:
        count = len(sizes)
        if count == 0:
            return 0.0
        if not (len(dsts) == len(srcs) == count):
            raise ValueError("dsts, srcs and sizes differ in length")
        for array in (dsts, srcs, sizes):
            if array.dtype != np.uint64 or not array.flags["C_CONTIGUOUS"]:
                raise ValueError("address arrays must be contiguous uint64")
        if self.calls == 0:
            print(f"  (first call of {self.api}; a crash here means a wrong ABI)", flush=True)
        self.calls += 1
        attrs = ctypes.addressof(self._attrs[flags])
        index = ctypes.addressof(self._index)
        args: list[Any] = [dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, count]
        args += [attrs, index, 1]
        start = time.perf_counter()
        if self.fail_idx:
            self._fail.value = 2**64 - 1
            status = self._function(*args, ctypes.addressof(self._fail), stream)
        else:
            status = self._function(*args, stream)
        seconds = time.perf_counter() - start
        if status != 0:
            where = f", failIdx {self._fail.value}" if self.fail_idx else ""
            raise RuntimeError(
                f"{self.api} failed with CUDA driver error {status} ({count} copies{where})"
            )
        return seconds


@dataclass
class _Job:
    direction: str
    nbytes: int
    start: int
    end: int
    host_s: float
    call_s: float = 0.0
    others: tuple[int, ...] = ()
    """More end events (of the job's other streams): the job ends when all have."""


def _done(driver: _Driver, job: _Job) -> bool:
    return all(driver.done(e) for e in (job.end, *job.others))


def _wait(driver: _Driver, event: int, what: str) -> None:
    """Poll `event` until done; raise TimeoutError after WAIT_TIMEOUT_S."""
    deadline = time.perf_counter() + WAIT_TIMEOUT_S
    while not driver.done(event):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what} did not end within {WAIT_TIMEOUT_S:.0f} s (GPU hung?)")
        time.sleep(0.0001)


def _finish(driver: _Driver, job: _Job, what: str) -> float:
    """Wait for `job`, release its events; return its GPU-event seconds (start to last end)."""
    ends = (job.end, *job.others)
    for end in ends:
        _wait(driver, end, what)
    seconds = max(driver.elapsed(job.start, end) for end in ends)
    for event in (job.start, *ends):
        driver.destroy(event)
    return seconds


def _join(driver: _Driver, streams: list[int]) -> None:
    """Make streams[0] wait for the work queued so far on the others."""
    for stream in streams[1:]:
        event = driver.event(timing=False)
        driver.record(event, stream)
        driver.wait(streams[0], event)
        driver.destroy(event)


class _Gate:
    """Holds streams with a sleep kernel (`torch.cuda._sleep`, one thread block) so that a GPU
    timing starts only after the host has queued everything."""

    def __init__(self, torch: Any, driver: _Driver) -> None:
        self._torch, self._driver = torch, driver
        self._stream = own_stream(torch)
        self._event = driver.event(timing=False)
        raw = int(self._stream.cuda_stream)
        start, end = driver.event(timing=True), driver.event(timing=True)
        cycles = 20_000_000
        driver.record(start, raw)
        with torch.cuda.stream(self._stream):
            torch.cuda._sleep(cycles)
        driver.record(end, raw)
        _wait(driver, end, "gate calibration")
        self.cycles_per_s = cycles / max(driver.elapsed(start, end), 1e-6)
        driver.destroy(start)
        driver.destroy(end)

    def hold(self, seconds: float, streams: list[int]) -> None:
        with self._torch.cuda.stream(self._stream):
            self._torch.cuda._sleep(int(seconds * self.cycles_per_s))
        self._driver.record(self._event, int(self._stream.cuda_stream))
        for stream in streams:
            self._driver.wait(stream, self._event)


@dataclass
class _Env:
    """Everything shared by the sections."""

    torch: Any
    driver: _Driver
    batch: _BatchCopy | None
    gate: _Gate | None
    args: argparse.Namespace
    total: int
    host_store: Any
    host_load: Any
    device_out: Any
    device_in: Any
    streams: dict[str, Any]
    deadline: float
    ceiling: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def raw(self, name: str) -> int:
        return int(self.streams[name].cuda_stream)

    def over_budget(self) -> bool:
        return time.perf_counter() > self.deadline


@contextlib.contextmanager
def _reported(env: _Env, what: str) -> Iterator[None]:
    """Print and keep any error of one measurement, then go on with the next."""
    try:
        yield
    except Exception as error:  # report and go on: one measurement must not lose the run
        line = f"ERROR in {what}: {type(error).__name__}: {error}"
        print(line, flush=True)
        if env.args.verbose:
            traceback.print_exc()
        env.errors.append(line)


@dataclass
class _Pages:
    """One page size: the layer buffers, the job's random block ids and the address arrays."""

    page: int
    layers: int
    per_layer: int
    sources: list[Any]
    ids_store: np.ndarray
    ids_load: np.ndarray
    gather_srcs: np.ndarray  # the store's pages, job order (layer by layer)
    scatter_dsts: np.ndarray  # the load's pages, job order
    sizes: np.ndarray
    staging: Any  # a whole job, contiguous (section 2)
    staging_addrs: np.ndarray
    halves: dict[str, Any]  # direction -> 2 staging halves (pipeline)
    chunk_pages: int

    @property
    def count(self) -> int:
        return self.layers * self.per_layer

    @property
    def nbytes(self) -> int:
        return self.count * self.page

    @property
    def kib(self) -> int:
        return self.page // KIB


def _addresses(base: int, count: int, step: int) -> np.ndarray:
    return np.uint64(base) + np.arange(count, dtype=np.uint64) * np.uint64(step)


def _make_pages(env: _Env, page_kib: int) -> _Pages:
    torch, args = env.torch, env.args
    page, layers = page_kib * KIB, args.layers
    per_layer = env.total // (layers * page)
    if per_layer < 1:
        raise ValueError(f"{env.total} bytes is less than one page per layer")
    blocks = 2 * per_layer
    rng = np.random.default_rng(page_kib)
    order = rng.permutation(blocks)
    ids_store, ids_load = order[:per_layer], order[per_layer:]
    sources = []
    for _ in range(layers):
        source = torch.empty(blocks * page, dtype=torch.uint8, device="cuda")
        source.random_(0, 255)
        sources.append(source)
    bases = np.array([s.data_ptr() for s in sources], dtype=np.uint64)[:, None]
    step = np.uint64(page)
    count = layers * per_layer
    chunk_pages = max(1, min(args.staging_mib * MIB // page, count))
    staging = torch.empty(count * page, dtype=torch.uint8, device="cuda")
    halves = {
        d: torch.empty(2 * chunk_pages * page, dtype=torch.uint8, device="cuda")
        for d in ("store", "load")
    }
    torch.cuda.synchronize()  # the fills ran on torch's stream; the copies use others
    return _Pages(
        page=page,
        layers=layers,
        per_layer=per_layer,
        sources=sources,
        ids_store=ids_store,
        ids_load=ids_load,
        gather_srcs=(bases + ids_store.astype(np.uint64)[None, :] * step).ravel(),
        scatter_dsts=(bases + ids_load.astype(np.uint64)[None, :] * step).ravel(),
        sizes=np.full(count, page, dtype=np.uint64),
        staging=staging,
        staging_addrs=_addresses(staging.data_ptr(), count, page),
        halves=halves,
        chunk_pages=chunk_pages,
    )


def _verify(env: _Env, p: _Pages, ids: np.ndarray, contiguous: Any, what: str) -> None:
    """Compare sampled pages of `contiguous` (job order) with the layer pages at `ids`."""
    rng = np.random.default_rng(1)
    samples = {0, p.count - 1, *rng.integers(0, p.count, 14).tolist()}
    for j in sorted(samples):
        layer, i = divmod(j, p.per_layer)
        block = int(ids[i])
        paged = p.sources[layer][block * p.page : (block + 1) * p.page].cpu()
        packed = contiguous[j * p.page : (j + 1) * p.page].cpu()
        if not env.torch.equal(paged, packed):
            raise RuntimeError(
                f"{what}: page {j} (layer {layer}, block {block}) does not match after the copy"
            )


# ---------------------------------------------------------------------------- 1. ceiling


def _section_ceiling(env: _Env) -> None:
    """One contiguous pinned copy each way, and both at once; median of `--repeat`."""
    driver, total = env.driver, env.total
    d2h, h2d = env.raw("d2h"), env.raw("h2d")
    plans = {
        "store": [(env.host_store.data_ptr(), env.device_out.data_ptr(), d2h)],
        "load": [(env.device_in.data_ptr(), env.host_load.data_ptr(), h2d)],
    }
    plans["both"] = plans["store"] + plans["load"]
    for name, copies in plans.items():
        times = []
        for _ in range(env.args.repeat + 1):
            streams = [s for _, _, s in copies]
            start, end = driver.event(timing=True), driver.event(timing=True)
            driver.record(start, streams[0])
            for stream in streams[1:]:
                driver.wait(stream, start)
            for dst, src, stream in copies:
                driver.memcpy_async(dst, src, total, stream)
            _join(driver, streams)
            driver.record(end, streams[0])
            times.append(_finish(driver, _Job(name, total, start, end, 0.0), f"ceiling {name}"))
        env.ceiling[name] = len(copies) * total / statistics.median(times[1:]) / 1e9
    print(
        f"ceiling (contiguous {total / GIB:.2f} GiB pinned copy, cuMemcpyAsync): "
        f"D2H {env.ceiling['store']:.1f} GB/s, H2D {env.ceiling['load']:.1f} GB/s, "
        f"both at once {env.ceiling['both']:.1f} GB/s",
        flush=True,
    )


# ---------------------------------------------------------------------------- 2. batched D2D


@dataclass(frozen=True)
class _BatchVariant:
    """One way of section 2: `op` (gather / scatter) in `calls` batched calls spread over
    `streams` streams, copy `flags`."""

    op: str
    calls: int
    streams: int
    flags: int

    @property
    def label(self) -> str:
        label = f"{self.op} {self.calls} call{'s' if self.calls > 1 else ''}/{self.streams} str"
        return label + (" +overlap" if self.flags else "")


def _batch_once(env: _Env, p: _Pages, v: _BatchVariant, gate_s: float) -> dict[str, Any]:
    """Queue the whole job's gather (or scatter) as `v` says, gated for `gate_s` seconds when
    > 0; wait; return the times."""
    assert env.batch is not None
    driver = env.driver
    op, calls, nstreams, flags = v.op, v.calls, v.streams, v.flags
    streams = [env.raw(f"g{i}") for i in range(nstreams)]
    if op == "gather":
        dsts, srcs = p.staging_addrs, p.gather_srcs
    else:
        dsts, srcs = p.scatter_dsts, p.staging_addrs
    start, end = driver.event(timing=True), driver.event(timing=True)
    gated = gate_s > 0 and env.gate is not None
    if gated:
        assert env.gate is not None
        env.gate.hold(gate_s, streams)
    driver.record(start, streams[0])
    for stream in streams[1:]:
        driver.wait(stream, start)
    bounds = np.linspace(0, p.count, calls + 1).astype(int)
    t0 = time.perf_counter()
    call_s = 0.0
    for k in range(calls):
        a, b = int(bounds[k]), int(bounds[k + 1])
        call_s += env.batch(dsts[a:b], srcs[a:b], p.sizes[a:b], streams[k % nstreams], flags)
    gate_ok = (not driver.done(start)) if gated else None
    _join(driver, streams)
    driver.record(end, streams[0])
    gpu_s = _finish(driver, _Job(op, p.nbytes, start, end, 0.0), f"{op} {p.kib} KiB")
    return {"gpu_s": gpu_s, "call_s": call_s, "e2e_s": time.perf_counter() - t0, "ok": gate_ok}


def _measure_batch(env: _Env, p: _Pages, v: _BatchVariant) -> dict[str, Any]:
    """Warm-up (checked), `--repeat` ungated runs (host time, e2e), `--repeat` gated runs."""
    repeat, op = env.args.repeat, v.op
    _batch_once(env, p, v, 0.0)
    if op == "gather":
        _verify(env, p, p.ids_store, p.staging, "batched D2D gather")
    else:
        _verify(env, p, p.ids_load, p.staging, "batched D2D scatter")
    free = [_batch_once(env, p, v, 0.0) for _ in range(repeat)]
    call_s = statistics.median(r["call_s"] for r in free)
    gated: list[dict[str, Any]] = []
    if env.gate is not None:
        gate_s = min(1.5 * call_s + 0.01, 5.0)
        gated = [_batch_once(env, p, v, gate_s) for _ in range(repeat)]
    timed = gated or free
    gpu = p.nbytes / statistics.median(r["gpu_s"] for r in timed) / 1e9
    e2e = p.nbytes / statistics.median(r["e2e_s"] for r in free) / 1e9
    ceiling = env.ceiling["store" if op == "gather" else "load"]
    return {
        "page_kib": p.kib,
        "variant": v.label,
        "op": op,
        "calls": v.calls,
        "streams": v.streams,
        "flags": v.flags,
        "pages": p.count,
        "host_call_ms": 1e3 * call_s,
        "host_call_us_per_page": 1e6 * call_s / p.count,
        "gpu_gbps": gpu,
        "gpu_ratio": gpu / ceiling,
        "e2e_gbps": e2e,
        "e2e_ratio": e2e / ceiling,
        "gate": _gate_text(gated, "ok"),
    }


def _gate_text(gated: list[dict[str, Any]], key: str) -> str:
    """'none' (not gated), 'ok' (every host call returned before the gate opened), 'short'."""
    if not gated:
        return "none"
    return "ok" if all(r[key] for r in gated) else "short"


def _batch_variants(args: argparse.Namespace) -> list[_BatchVariant]:
    """The ways of section 2, in order."""
    out = [
        _BatchVariant("gather", 1, 1, CU_MEMCPY_FLAG_DEFAULT),
        _BatchVariant("gather", 1, 1, CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE),
    ]
    for split in (s.strip() for s in args.splits.split(",")):
        try:
            calls, streams = (int(x) for x in split.lower().split("x"))
        except ValueError:
            if split:
                print(f"   --splits: '{split}' is not CALLSxSTREAMS (e.g. 8x2); left out")
            continue
        out.append(_BatchVariant("gather", max(calls, 1), min(max(streams, 1), 4), 0))
    out.append(_BatchVariant("scatter", 1, 1, CU_MEMCPY_FLAG_DEFAULT))
    return out


def _section_gather(env: _Env, pages: list[_Pages]) -> list[dict[str, Any]]:
    print("\n2. batched D2D copies by the copy engines (cuMemcpyBatchAsync), one job per run")
    if env.batch is None:
        print("   skipped: cuMemcpyBatchAsync is not available (see above)")
        return []
    header = (
        f"{'page':>6} {'variant':<28} {'pages':>6} {'host ms':>8} {'us/page':>7} "
        f"{'GPU GB/s':>8} {'ratio':>5} {'e2e GB/s':>8} {'ratio':>5} {'gate':>5}"
    )
    print(header + "\n" + "-" * len(header), flush=True)
    rows = []
    variants = _batch_variants(env.args)
    for p in pages:
        for v in variants:
            label = v.label
            if env.over_budget():
                print(f"{p.kib:>4}Ki {label:<28} skipped: time budget", flush=True)
                continue
            with _reported(env, f"batched {label} {p.kib} KiB"):
                r = _measure_batch(env, p, v)
                rows.append(r)
                print(
                    f"{p.kib:>4}Ki {label:<28} {r['pages']:>6} {r['host_call_ms']:>8.2f} "
                    f"{r['host_call_us_per_page']:>7.2f} {r['gpu_gbps']:>8.1f} "
                    f"{r['gpu_ratio']:>5.2f} {r['e2e_gbps']:>8.1f} {r['e2e_ratio']:>5.2f} "
                    f"{r['gate']:>5}",
                    flush=True,
                )
    return rows


# ---------------------------------------------------------------------------- 3. per page


def _section_per_page(env: _Env, pages: list[_Pages]) -> list[dict[str, Any]]:
    """One cuMemcpyAsync per page D2D (gather), capped at `--per-page-cap-s` of host time."""
    print("\n3. one cuMemcpyAsync per page D2D (gather into staging), host-bound reference")
    wanted = {int(k) for k in env.args.per_page_kib.split(",") if k.strip()}
    driver, rows = env.driver, []
    stream = env.raw("g0")
    for p in pages:
        if p.kib not in wanted:
            continue
        if env.over_budget():
            print(f"{p.kib:>4}Ki skipped: time budget")
            continue
        with _reported(env, f"per-page cuMemcpyAsync {p.kib} KiB"):
            dsts, srcs = p.staging_addrs.tolist(), p.gather_srcs.tolist()
            for i in range(min(64, p.count)):  # warm-up
                driver.memcpy_async(dsts[i], srcs[i], p.page, stream)
            start, end = driver.event(timing=True), driver.event(timing=True)
            driver.record(start, stream)
            t0 = time.perf_counter()
            cap = t0 + env.args.per_page_cap_s
            done = 0
            for dst, src in zip(dsts, srcs, strict=True):
                driver.memcpy_async(dst, src, p.page, stream)
                done += 1
                if done % 64 == 0 and time.perf_counter() > cap:
                    break
            host_s = time.perf_counter() - t0
            driver.record(end, stream)
            gpu_s = _finish(driver, _Job("store", done * p.page, start, end, 0.0), "per-page")
            e2e_s = time.perf_counter() - t0
            gbps = done * p.page / gpu_s / 1e9
            r = {
                "page_kib": p.kib,
                "pages": done,
                "capped": done < p.count,
                "host_us_per_call": 1e6 * host_s / done,
                "gpu_gbps": gbps,
                "gpu_ratio": gbps / env.ceiling["store"],
                "e2e_gbps": done * p.page / e2e_s / 1e9,
            }
            rows.append(r)
            print(
                f"{p.kib:>4}Ki {done} of {p.count} pages{' (capped)' if r['capped'] else ''}: "
                f"{r['host_us_per_call']:.2f} us per call on the host, GPU-event {gbps:.1f} GB/s "
                f"(ratio {r['gpu_ratio']:.2f} to D2H), end to end {r['e2e_gbps']:.1f} GB/s",
                flush=True,
            )
    return rows


# ---------------------------------------------------------------------------- 4. pipeline


class _Source(Protocol):
    """Jobs of one kind: `submit(direction)` queues one and returns it."""

    def submit(self, direction: str) -> _Job: ...
    def streams(self, direction: str) -> list[int]: ...


class _Contiguous:
    """Contiguous pinned copies of the whole job, one stream per direction (copy engines only)."""

    def __init__(self, env: _Env) -> None:
        self._env = env
        self._copies = {
            "store": (env.host_store.data_ptr(), env.device_out.data_ptr()),
            "load": (env.device_in.data_ptr(), env.host_load.data_ptr()),
        }

    def streams(self, direction: str) -> list[int]:
        return [self._env.raw("d2h" if direction == "store" else "h2d")]

    def submit(self, direction: str) -> _Job:
        driver, (stream,) = self._env.driver, self.streams(direction)
        t0 = time.perf_counter()
        start, end = driver.event(timing=True), driver.event(timing=True)
        driver.record(start, stream)
        dst, src = self._copies[direction]
        driver.memcpy_async(dst, src, self._env.total, stream)
        driver.record(end, stream)
        return _Job(direction, self._env.total, start, end, time.perf_counter() - t0)


class _Pipeline:
    """The CE-only staged path of one page size: per chunk of `chunk_pages` pages, a batched D2D
    gather into staging half (chunk % 2) and one D2H copy of that half, on stream (chunk % 2);
    the load is the reverse (H2D into the half, batched D2D scatter). A half is only ever used on
    its own stream, so stream order frees it and back-to-back jobs need no cross-stream wait: a
    job's start event is on stream 0, it has an end event on each stream it used."""

    def __init__(self, env: _Env, p: _Pages, flags: int) -> None:
        self._env, self._p, self._flags = env, p, flags
        k = p.chunk_pages
        self._chunks = [(a, min(a + k, p.count), c % 2) for c, a in enumerate(range(0, p.count, k))]
        self._used = sorted({h for _, _, h in self._chunks})
        self._half_base: dict[str, list[int]] = {}
        self._half_addrs: dict[str, list[np.ndarray]] = {}
        for direction, halves in p.halves.items():
            bases = [halves.data_ptr(), halves.data_ptr() + k * p.page]
            self._half_base[direction] = bases
            self._half_addrs[direction] = [_addresses(b, k, p.page) for b in bases]
        self._host = {"store": env.host_store.data_ptr(), "load": env.host_load.data_ptr()}

    def streams(self, direction: str) -> list[int]:
        names = ("ps0", "ps1") if direction == "store" else ("pl0", "pl1")
        return [self._env.raw(n) for n in names]

    def submit(self, direction: str) -> _Job:
        env, p = self._env, self._p
        assert env.batch is not None
        driver, streams = env.driver, self.streams(direction)
        t0 = time.perf_counter()
        start = driver.event(timing=True)
        driver.record(start, streams[0])
        call_s = 0.0
        host, bases, addrs = self._host[direction], *self._half_base_and_addrs(direction)
        for a, b, h in self._chunks:
            n, stream = b - a, streams[h]
            if direction == "store":
                call_s += env.batch(
                    addrs[h][:n], p.gather_srcs[a:b], p.sizes[a:b], stream, self._flags
                )
                driver.memcpy_async(host + a * p.page, bases[h], n * p.page, stream)
            else:
                driver.memcpy_async(bases[h], host + a * p.page, n * p.page, stream)
                call_s += env.batch(
                    p.scatter_dsts[a:b], addrs[h][:n], p.sizes[a:b], stream, self._flags
                )
        ends = [driver.event(timing=True) for _ in self._used]
        for h, end in zip(self._used, ends, strict=True):
            driver.record(end, streams[h])
        host_s = time.perf_counter() - t0
        return _Job(direction, p.nbytes, start, ends[0], host_s, call_s, tuple(ends[1:]))

    def _half_base_and_addrs(self, direction: str) -> tuple[list[int], list[np.ndarray]]:
        return self._half_base[direction], self._half_addrs[direction]


def _drive(
    env: _Env,
    source: _Source,
    directions: tuple[str, ...],
    stop: Callable[[], bool],
    *,
    extend: bool,
    depth: int = 2,
) -> dict[str, dict[str, float]]:
    """Keep `depth` jobs per direction in flight until `stop()` (with `extend`, also until three
    of each have ended); per direction return GB/s over the host time between job ends (the first
    end is the anchor; NaN with fewer than three ends), median GPU-event GB/s per job and median
    host ms per submit."""
    driver = env.driver
    pending = [source.submit(d) for _ in range(depth) for d in directions]
    ends: dict[str, list[tuple[float, int, float, float]]] = {d: [] for d in directions}
    soft = time.perf_counter() + 30
    hard = time.perf_counter() + 120
    try:
        while not stop() or (
            extend and min(len(v) for v in ends.values()) < 3 and time.perf_counter() < soft
        ):
            if time.perf_counter() > hard:
                raise TimeoutError("back-to-back jobs: the stop condition never came (120 s)")
            for job in [j for j in pending if _done(driver, j)]:
                pending.remove(job)
                now = time.perf_counter()
                gpu_s = _finish(driver, job, "job")
                ends[job.direction].append((now, job.nbytes, gpu_s, job.host_s))
                pending.append(source.submit(job.direction))
    finally:
        for job in pending:  # drain (each waits at most WAIT_TIMEOUT_S)
            _finish(driver, job, "draining job")
    out: dict[str, dict[str, float]] = {}
    for direction, seen in ends.items():
        nbytes = sum(n for _, n, _, _ in seen[1:])
        out[direction] = {
            "jobs": max(len(seen) - 1, 0),
            "gbps": nbytes / (seen[-1][0] - seen[0][0]) / 1e9 if len(seen) >= 3 else NAN,
            "job_gbps": statistics.median(n / g for _, n, g, _ in seen) / 1e9 if seen else NAN,
            "submit_ms": statistics.median(1e3 * h for *_, h in seen) if seen else NAN,
        }
    return out


def _single_job(env: _Env, source: _Source, direction: str, gate_s: float) -> dict[str, float]:
    """One job, gated (GPU-only) when `gate_s` > 0; returns its times."""
    gated = gate_s > 0 and env.gate is not None
    if gated:
        assert env.gate is not None
        env.gate.hold(gate_s, source.streams(direction))
    t0 = time.perf_counter()
    job = source.submit(direction)
    gate_ok = (not env.driver.done(job.start)) if gated else True
    gpu_s = _finish(env.driver, job, f"{direction} job")
    return {
        "gpu_s": gpu_s,
        "e2e_s": time.perf_counter() - t0,
        "host_s": job.host_s,
        "call_s": job.call_s,
        "gate_ok": float(gate_ok),
    }


def _measure_pipeline(env: _Env, p: _Pages, direction: str) -> dict[str, Any]:
    pipeline = _Pipeline(env, p, CU_MEMCPY_FLAG_DEFAULT)
    _single_job(env, pipeline, direction, 0.0)
    if direction == "store":
        _verify(env, p, p.ids_store, env.host_store, "CE-only store pipeline")
    else:
        _verify(env, p, p.ids_load, env.host_load, "CE-only load pipeline")
    free = [_single_job(env, pipeline, direction, 0.0) for _ in range(env.args.repeat)]
    host_s = statistics.median(r["host_s"] for r in free)
    gated = []
    if env.gate is not None:
        gate_s = min(1.5 * host_s + 0.01, 5.0)
        gated = [_single_job(env, pipeline, direction, gate_s) for _ in range(env.args.repeat)]
    until = time.perf_counter() + env.args.window
    sustained = _drive(
        env, pipeline, (direction,), lambda: time.perf_counter() > until, extend=True
    )
    ceiling = env.ceiling[direction]
    gpu = p.nbytes / statistics.median(r["gpu_s"] for r in gated or free) / 1e9
    e2e = p.nbytes / statistics.median(r["e2e_s"] for r in free) / 1e9
    b2b = sustained[direction]["gbps"]
    return {
        "page_kib": p.kib,
        "direction": direction,
        "chunks": math.ceil(p.count / p.chunk_pages),
        "submit_ms": 1e3 * host_s,
        "batch_call_ms": 1e3 * statistics.median(r["call_s"] for r in free),
        "gpu_gbps": gpu,
        "gpu_ratio": gpu / ceiling,
        "gate": _gate_text(gated, "gate_ok"),
        "e2e_gbps": e2e,
        "e2e_ratio": e2e / ceiling,
        "b2b_gbps": b2b,
        "b2b_ratio": b2b / ceiling,
    }


def _section_pipeline(env: _Env, pages: list[_Pages]) -> list[dict[str, Any]]:
    print(
        f"\n4. CE-only pipeline: batched D2D gather into {env.args.staging_mib} MiB staging "
        "halves + contiguous D2H per half, two streams (load: H2D + batched D2D scatter)"
    )
    if env.batch is None:
        print("   skipped: cuMemcpyBatchAsync is not available (see above)")
        return []
    header = (
        f"{'page':>6} {'dir':<5} {'chunks':>6} {'submit ms':>9} {'in batch':>8} "
        f"{'GPU GB/s':>8} {'ratio':>5} {'gate':>5} {'e2e GB/s':>8} {'ratio':>5} "
        f"{'b2b GB/s':>8} {'ratio':>5}"
    )
    print(header + "\n" + "-" * len(header), flush=True)
    rows = []
    for p in pages:
        for direction in ("store", "load"):
            if env.over_budget():
                print(f"{p.kib:>4}Ki {direction:<5} skipped: time budget", flush=True)
                continue
            with _reported(env, f"CE-only {direction} pipeline {p.kib} KiB"):
                r = _measure_pipeline(env, p, direction)
                rows.append(r)
                print(
                    f"{p.kib:>4}Ki {direction:<5} {r['chunks']:>6} {r['submit_ms']:>9.2f} "
                    f"{r['batch_call_ms']:>8.2f} {r['gpu_gbps']:>8.1f} {r['gpu_ratio']:>5.2f} "
                    f"{r['gate']:>5} {r['e2e_gbps']:>8.1f} {r['e2e_ratio']:>5.2f} "
                    f"{r['b2b_gbps']:>8.1f} {r['b2b_ratio']:>5.2f}",
                    flush=True,
                )
    return rows


# ---------------------------------------------------------------------------- 5. interference


class _Matmul:
    """A loop of `count` bf16 N x N x N matmuls on its own stream, timed with CUDA events."""

    def __init__(self, torch: Any, count: int) -> None:
        self._torch, self._count = torch, count
        self._stream = own_stream(torch)
        with torch.cuda.stream(self._stream):
            self._a = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device="cuda")
            self._b = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device="cuda")
            self._c = torch.empty(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device="cuda")
        self._events: tuple[Any, Any] | None = None

    def start(self) -> None:
        torch = self._torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self._stream)
        with torch.cuda.stream(self._stream):
            for _ in range(self._count):
                torch.matmul(self._a, self._b, out=self._c)
        end.record(self._stream)
        self._events = (start, end)

    def done(self) -> bool:
        return self._events is None or bool(self._events[1].query())

    def seconds_per_matmul(self) -> float:
        if self._events is None:
            raise RuntimeError("the matmul loop was never started")
        start, end = self._events
        deadline = time.perf_counter() + WAIT_TIMEOUT_S
        while not end.query():
            if time.perf_counter() > deadline:
                raise TimeoutError("the matmul loop did not end in time")
            time.sleep(0.0005)
        return float(start.elapsed_time(end)) / 1000 / self._count

    def alone(self) -> float:
        self.start()
        return self.seconds_per_matmul()


def _interfere(
    env: _Env, matmul: _Matmul, source: _Source, directions: tuple[str, ...]
) -> dict[str, Any]:
    """Transfers alone, matmul alone, then both; return one row."""
    for direction in directions:  # warm-up
        _finish(env.driver, source.submit(direction), "warm-up job")
    until = time.perf_counter() + env.args.window
    alone_tx = _drive(env, source, directions, lambda: time.perf_counter() > until, extend=True)
    alone = matmul.alone()
    started = False

    def stop() -> bool:
        nonlocal started
        if not started:  # the first jobs of each direction are queued: start the loop
            matmul.start()
            started = True
        return matmul.done()

    together = _drive(env, source, directions, stop, extend=False)
    with_tx = matmul.seconds_per_matmul()
    row: dict[str, Any] = {
        "matmul_alone_ms": 1e3 * alone,
        "matmul_with_ms": 1e3 * with_tx,
        "slowdown": with_tx / alone - 1,
        "alone": alone_tx,
        "together": together,
    }
    for phase, rates in (("alone", alone_tx), ("together", together)):
        for direction in directions:
            row[f"{direction}_ratio_{phase}"] = rates[direction]["gbps"] / env.ceiling[direction]
        if len(directions) == 2:
            combined = sum(rates[d]["gbps"] for d in directions)
            row[f"combined_ratio_{phase}"] = combined / env.ceiling["both"]
    return row


def _ratio_text(row: dict[str, Any], phase: str) -> str:
    if "combined_ratio_" + phase in row:
        return (
            f"{row['combined_ratio_' + phase]:.2f} (st {row['store_ratio_' + phase]:.2f}, "
            f"ld {row['load_ratio_' + phase]:.2f})"
        )
    key = next(k for k in row if k.endswith("_ratio_" + phase))
    return f"{row[key]:.2f}"


def _interference_jobs(
    env: _Env, pages: list[_Pages]
) -> Iterator[tuple[str, int, Callable[[], _Source], tuple[str, ...]]]:
    """(variant, page KiB or 0, source factory, directions) of section 5, in order."""
    both = ("store", "load")
    for name, directions in (("store", ("store",)), ("load", ("load",)), ("both", both)):
        yield f"pinned-copy {name}", 0, lambda: _Contiguous(env), directions
    wanted = [v.strip() for v in env.args.ce_variants.split(",") if v.strip()]
    for p in pages:
        for variant in wanted:
            flags = CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE if "overlap" in variant else 0
            base = variant.removesuffix("-overlap")
            directions = both if base == "both" else (base,)

            def factory(p: _Pages = p, flags: int = flags) -> _Source:
                return _Pipeline(env, p, flags)

            yield f"CE-only {variant}", p.kib, factory, directions


def _section_interference(env: _Env, pages: list[_Pages]) -> list[dict[str, Any]]:
    args = env.args
    print(
        f"\n5. interference: {args.matmuls} bf16 {MATMUL_N}^3 matmuls alone, then beside "
        "back-to-back transfers (ratio: GB/s over the one-way ceiling; both ways: combined over "
        "the both-at-once ceiling, then store / load over their one-way ceilings)"
    )
    header = (
        f"{'variant':<26} {'page':>6} {'mm ms':>6} {'mm+x ms':>7} {'slow %':>7} "
        f"{'ratio alone':>24} {'ratio with matmul':>24} {'GB/s with':>9}"
    )
    print(header + "\n" + "-" * len(header), flush=True)
    try:
        matmul = _Matmul(env.torch, args.matmuls)
        matmul.alone()  # warm-up (cuBLAS heuristics, clocks)
    except Exception as error:
        line = f"ERROR: the matmul loop cannot run: {type(error).__name__}: {error}"
        print(line)
        env.errors.append(line)
        return []
    rows = []
    for variant, kib, factory, directions in _interference_jobs(env, pages):
        page = f"{kib}Ki" if kib else "-"
        if variant.startswith("CE-only") and env.batch is None:
            continue
        if env.over_budget():
            print(f"{variant:<26} {page:>6} skipped: time budget", flush=True)
            continue
        with _reported(env, f"interference {variant} {page}"):
            row = _interfere(env, matmul, factory(), directions)
            row.update(variant=variant, page_kib=kib, directions=list(directions))
            rows.append(row)
            print(
                f"{variant:<26} {page:>6} {row['matmul_alone_ms']:>6.3f} "
                f"{row['matmul_with_ms']:>7.3f} {100 * row['slowdown']:>+7.1f} "
                f"{_ratio_text(row, 'alone'):>24} {_ratio_text(row, 'together'):>24} "
                f"{sum(row['together'][d]['gbps'] for d in directions):>9.1f}",
                flush=True,
            )
    return rows


# ---------------------------------------------------------------------------- summary


def _summary(env: _Env, results: dict[str, Any]) -> list[str]:
    c = env.ceiling
    lines = [
        f"ceiling (contiguous pinned copy, cuMemcpyAsync): D2H {c.get('store', NAN):.1f} GB/s, "
        f"H2D {c.get('load', NAN):.1f} GB/s, both at once {c.get('both', NAN):.1f} GB/s"
    ]
    gather = results.get("gather", [])
    for r in gather:
        if r["calls"] == 1 and r["flags"] == 0:
            split = [
                g
                for g in gather
                if g["page_kib"] == r["page_kib"] and g["op"] == r["op"] and g["calls"] > 1
            ]
            best = max(split, key=lambda g: g["gpu_gbps"], default=None)
            more = (
                f"; best split {best['calls']} calls/{best['streams']} streams "
                f"{best['gpu_gbps']:.1f} GB/s ({best['gpu_ratio']:.2f})"
                if best
                else ""
            )
            lines.append(
                f"copy-engine D2D {r['op']} {r['page_kib']} KiB: {r['gpu_gbps']:.1f} GB/s "
                f"(ratio {r['gpu_ratio']:.2f} to the one-way link ceiling; gate {r['gate']}), "
                f"one call of {r['pages']} pages: {r['host_call_ms']:.1f} ms on the host, "
                f"end to end {r['e2e_gbps']:.1f} GB/s ({r['e2e_ratio']:.2f}){more}"
            )
    for r in results.get("per_page", []):
        lines.append(
            f"per-page cuMemcpyAsync D2D {r['page_kib']} KiB: {r['gpu_gbps']:.1f} GB/s "
            f"(ratio {r['gpu_ratio']:.2f}), {r['host_us_per_call']:.2f} us per call on the host"
        )
    inter = results.get("interference", [])
    reference = {tuple(r["directions"]): r for r in inter if r["variant"].startswith("pinned")}
    for r in results.get("pipeline", []):
        lines.append(
            f"CE-only {r['direction']} pipeline {r['page_kib']} KiB alone: ratio "
            f"{r['b2b_ratio']:.2f} back to back (one job: GPU-only {r['gpu_ratio']:.2f}, "
            f"end to end {r['e2e_ratio']:.2f}; {r['submit_ms']:.1f} ms to submit)"
        )
    for r in inter:
        if r["variant"].startswith("pinned"):
            continue
        ref = reference.get(tuple(r["directions"]))
        ref_text = (
            f"pinned-copy reference {100 * ref['slowdown']:+.1f} % at ratio "
            f"{_ratio_text(ref, 'together')}"
            if ref
            else "no pinned-copy reference"
        )
        lines.append(
            f"{r['variant']} pipeline {r['page_kib']} KiB: ratio {_ratio_text(r, 'together')} "
            f"during the matmul loop, matmul slowdown {100 * r['slowdown']:+.1f} % ({ref_text})"
        )
    if inter:
        alone = [r["matmul_alone_ms"] for r in inter]
        spread = (max(alone) - min(alone)) / statistics.median(alone)
        lines.append(
            f"matmul alone over the run: median {statistics.median(alone):.3f} ms, spread "
            f"{100 * spread:.1f} % (max - min over median: the noise floor of the slowdowns)"
        )
    return lines


# ---------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pages-kib", default="16,64,256")
    parser.add_argument("--layers", type=int, default=32, help="source buffers (layers)")
    parser.add_argument("--gib", type=float, default=1.0, help="bytes per job (GiB)")
    parser.add_argument("--matmuls", type=int, default=200, help="matmuls per timed loop")
    parser.add_argument("--staging-mib", type=int, default=128, help="pipeline half size")
    parser.add_argument("--splits", default="8x2", help="batched gather split as CALLSxSTREAMS")
    parser.add_argument("--per-page-kib", default="256", help="page sizes of section 3")
    parser.add_argument("--per-page-cap-s", type=float, default=3.0)
    parser.add_argument("--ce-variants", default=",".join(CE_VARIANTS))
    parser.add_argument("--sections", default=",".join(SECTIONS), help="ceiling always runs")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--window", type=float, default=0.3, help="seconds back to back")
    parser.add_argument("--batch-api", default="auto", choices=("auto", *_BatchCopy.WAYS))
    parser.add_argument("--budget-s", type=float, default=220.0, help="skip what starts later")
    parser.add_argument("--quick", action="store_true", help="0.25 GiB jobs, 50 matmuls")
    parser.add_argument("--verbose", action="store_true", help="tracebacks with the errors")
    parser.add_argument("--json", default=None)
    return parser


def _setup(torch: Any, args: argparse.Namespace, started: float) -> tuple[_Env, dict[str, Any]]:
    """Context, driver wrappers, buffers and streams; print what was found."""
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # make torch's primary context current on this thread
    info: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    driver, info["driver_wrapper"] = _load_driver()
    cuda = _Libcuda()
    info["context"] = cuda.ensure_context(torch.cuda.current_device())
    info["driver_version"] = cuda.driver_version()
    try:
        info["copy_engines"] = cuda.copy_engines()
    except RuntimeError as error:
        info["copy_engines"] = f"unknown ({error})"
    batch: _BatchCopy | None = None
    try:
        batch = _BatchCopy(cuda.lib, args.batch_api)
        info["batch_api"] = batch.api
    except Exception as error:
        info["batch_api"] = f"unavailable: {error}"
    gate: _Gate | None = None
    try:
        gate = _Gate(torch, driver)
        info["gate"] = f"torch.cuda._sleep, {gate.cycles_per_s / 1e9:.2f} G cycles/s"
    except Exception as error:
        info["gate"] = f"unavailable ({type(error).__name__}: {error}); GPU times are ungated"
    total = int(args.gib * GIB)
    streams = {n: own_stream(torch) for n in ("d2h", "h2d", "ps0", "ps1", "pl0", "pl1")}
    streams.update({f"g{i}": own_stream(torch) for i in range(4)})
    device_out = torch.empty(total, dtype=torch.uint8, device="cuda")
    device_out.random_(0, 255)
    host_load = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    host_load.copy_(device_out)  # random bytes for the loads
    env = _Env(
        torch=torch,
        driver=driver,
        batch=batch,
        gate=gate,
        args=args,
        total=total,
        host_store=torch.empty(total, dtype=torch.uint8, pin_memory=True),
        host_load=host_load,
        device_out=device_out,
        device_in=torch.empty(total, dtype=torch.uint8, device="cuda"),
        streams=streams,
        deadline=started + args.budget_s,
    )
    torch.cuda.synchronize()
    for key, value in info.items():
        print(f"{key}: {value}")
    return env, info


def _run(torch: Any, args: argparse.Namespace, started: float) -> dict[str, Any]:
    env, info = _setup(torch, args, started)
    results: dict[str, Any] = {"info": info}
    with _reported(env, "ceiling"):
        _section_ceiling(env)
    if not env.ceiling:
        print("no ceiling, so no ratios: stopping here")
        results["errors"] = env.errors
        return results
    pages: list[_Pages] = []
    for kib in (int(k) for k in args.pages_kib.split(",") if k.strip()):
        with _reported(env, f"allocating {kib} KiB pages"):
            pages.append(_make_pages(env, kib))
    sections = {s.strip() for s in args.sections.split(",")}
    if "gather" in sections:
        results["gather"] = _section_gather(env, pages)
    if "per-page" in sections:
        results["per_page"] = _section_per_page(env, pages)
    if "pipeline" in sections:
        results["pipeline"] = _section_pipeline(env, pages)
    if "interference" in sections:
        results["interference"] = _section_interference(env, pages)
    results["ceiling_gbps"] = env.ceiling
    results["summary"] = _summary(env, results)
    results["errors"] = env.errors
    print("\nsummary")
    for line in results["summary"]:
        print(line)
    if env.errors:
        print(f"{len(env.errors)} measurement(s) failed:")
        for line in env.errors:
            print("  " + line)
    return results


def main() -> int:
    """Run the experiment; print the tables and the summary; write JSON when asked."""
    started = time.perf_counter()
    args = _parser().parse_args()
    if args.quick:
        args.gib, args.matmuls, args.window = 0.25, 50, 0.15
    try:
        import torch
    except ImportError:
        print("copy_engine_gather.py needs CUDA (torch with a CUDA GPU); torch is not installed")
        return 0
    if not torch.cuda.is_available():
        print("copy_engine_gather.py needs CUDA: no CUDA GPU is visible; nothing measured")
        return 0
    try:
        results = _run(torch, args, started)
    except Exception as error:  # setup failed: say what, do not hide it behind a traceback
        traceback.print_exc()
        print(f"copy_engine_gather.py could not set up: {type(error).__name__}: {error}")
        return 1
    results["args"] = vars(args)
    results["seconds"] = time.perf_counter() - started
    print(f"total {results['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
