"""How much of the GPU the staged path's kernels need at the link's rate (issue 5, target 3).

A benchmark, never part of the test suite: it needs a CUDA GPU, torch and kvferry; without a GPU
it says so and exits 0.

The staged path moves every byte through HBM twice on the GPU side (a store's gather reads a page
and writes staging, a load's scatter the reverse) before or after the copy engines move it. This
script measures, in one run:

* the kernels' own GPU time per GiB: 1 GiB store and load jobs of the torch executor with their
  DMAs left out (so a job's CUDA-event time is its gather or scatter kernels, and the small
  table copy), per page size, median of 5 after a warm-up;
* the bidirectional ceiling (two contiguous pinned copies at once, as `interference.py`);
* what the bf16 8192^3 matmul kernel of `interference.py` takes of each SM (its launch shape,
  registers and shared memory, from the torch profiler), and the SM count.

It prints the *kernel share*: the fraction of time the kernels hold the GPU when each direction
runs at half the bidirectional ceiling. When the matmul kernel holds every SM (as many blocks as
it can keep resident, no registers or shared memory left for another block), the staging kernels
run only between matmul kernels, so a matmul loop beside the transfers slows by about that share
on top of what the copy engines' traffic costs it (`interference.py`'s `pinned-copy` row).

    python3 benchmarks/kernel_share.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import numpy as np
from interference import MATMUL_N, _bidirectional_ceiling
from transfer import (
    KIB,
    VARIANTS,
    _bound,
    bench_kv_caches,
    catalog_rows,
    cuda_torch,
    write_json,
)

from kvferry.core.plan import Direction
from kvferry.executors import make_executor
from kvferry.executors.staged import StagedGpuExecutor

GIB = 1 << 30
PAGES_KIB = (16, 64, 256)
REPEAT = 5
PROFILED_ARGS = (
    "grid",
    "block",
    "registers per thread",
    "shared memory",
    "blocks per SM",
    "warps per SM",
    "est. achieved occupancy %",
)
"""The kernel launch facts the torch profiler (Kineto) records, printed for the matmul."""


def kernel_seconds_per_gib(torch: Any, page: int, direction: Direction) -> float:
    """Return the median CUDA-event seconds per GiB of the torch executor's staging kernels for
    1 GiB jobs of `page`-byte pages, 32 layers, random block ids (the job's DMAs left out)."""
    name, options = VARIANTS["torch"]
    moved, num_blocks, kv = bench_kv_caches(torch, 32, page, GIB)
    executor = make_executor(name, kv_caches=kv, blocks_per_chunk=1, num_rows=moved, **options)
    if not isinstance(executor, StagedGpuExecutor):
        raise TypeError(f"the torch variant made a {type(executor).__name__}, not a staged one")
    record, wait, _ = executor._driver_calls()
    # the kernels alone: no byte crosses the link
    setattr(executor, "_driver_calls", lambda: (record, wait, lambda *_: None))  # noqa: B010
    rng = np.random.default_rng(2)
    times = []
    try:
        for job in range(REPEAT + 1):
            bound = _bound(
                job, direction, rng.choice(num_blocks, moved, False), catalog_rows(moved)
            )
            executor.submit(bound)
            (result,) = executor.wait([job])
            if not result.success:
                raise RuntimeError(result.error)
            times.append(result.seconds / (result.nbytes / GIB))
    finally:
        executor.close()
        del kv
        torch.cuda.empty_cache()
    return statistics.median(times[1:])


def matmul_kernel_shape(torch: Any) -> dict[str, Any]:
    """Return the launch facts of the longest GPU kernel of a bf16 N^3 matmul (profiled)."""
    a = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device="cuda")
    torch.matmul(a, b)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(3):
            torch.matmul(a, b)
        torch.cuda.synchronize()
    kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    longest = max(kernels, key=lambda e: e.device_time_total)
    facts: dict[str, Any] = {"name": longest.name[:80]}
    # Kineto's per-kernel arguments are only in the exported trace
    path = "/tmp/kvferry_matmul_trace.json"
    profiler.export_chrome_trace(path)
    with open(path, encoding="utf-8") as handle:
        trace = json.load(handle)
    for event in trace.get("traceEvents", []):
        if event.get("cat") == "kernel" and event.get("name", "")[:80] == facts["name"]:
            args = event.get("args", {})
            facts.update({key: args[key] for key in PROFILED_ARGS if key in args})
            break
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch = cuda_torch("kernel_share.py")
    if torch is None:
        return 0
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shape = matmul_kernel_shape(torch)
    print(f"GPU: {torch.cuda.get_device_name()}, {sms} SMs")
    print("matmul kernel: " + ", ".join(f"{k} {v}" for k, v in shape.items()))
    bidir = _bidirectional_ceiling(torch, GIB // 2, 0.4)
    per_direction = bidir / 2
    print(f"bidirectional ceiling {bidir:.1f} GB/s ({per_direction:.1f} each way)")
    print("page   gather ms/GiB  scatter ms/GiB  HBM GB/s (gather, scatter)  kernel share")
    rows = []
    for page_kib in PAGES_KIB:
        gather = kernel_seconds_per_gib(torch, page_kib * KIB, Direction.STORE)
        scatter = kernel_seconds_per_gib(torch, page_kib * KIB, Direction.LOAD)
        # two bytes of HBM traffic per byte moved; GiB/s of each direction at the ceiling
        share = (gather + scatter) * per_direction * 1e9 / GIB
        rows.append({
            "page_kib": page_kib,
            "gather_seconds_per_gib": gather,
            "scatter_seconds_per_gib": scatter,
            "share": share,
        })  # fmt: skip
        hbm = [2 * GIB / t / 1e9 for t in (gather, scatter)]
        print(
            f"{page_kib:>4}Ki  {gather * 1e3:13.3f}  {scatter * 1e3:14.3f}  "
            f"{hbm[0]:12.0f} {hbm[1]:12.0f}  {share * 100:11.1f} %"
        )
    low, high = min(r["share"] for r in rows), max(r["share"] for r in rows)
    print(
        f"staging kernels at the bidirectional ceiling hold the GPU {low * 100:.1f}-"
        f"{high * 100:.1f} % of the time (pages {PAGES_KIB[0]}-{PAGES_KIB[-1]} KiB); target 3 "
        "allows a matmul beside the transfers 3 % in all"
    )
    if args.json:
        write_json(
            args.json,
            {"sms": sms, "matmul_kernel": shape, "bidirectional_gbps": bidir, "rows": rows},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
