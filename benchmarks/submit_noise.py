"""How steady `submit()`'s host time is on this machine, and whether it is waiting or working.

A benchmark, never part of the test suite: it needs a CUDA GPU, torch and the executor's own
library; without a GPU it says so and exits 0.

Per executor and page size it submits 2048-block x 32-layer loads (target 4's job: random block
ids, catalog rows; one `wait()` after each) and prints, over the submits after two warm-ups, the
10th, 50th and 90th percentiles of the wall clock and of the thread's CPU time inside
`submit()`, the thread's voluntary and involuntary context switches inside it, and the share of
the machine's CPU time the hypervisor reported as stolen meanwhile. It does so in a fresh
process, then again after a short sweep of stores and loads at other page sizes.

To tell the host's own state from the code's, every other load is not timed: right after the
`wait()` before it, a fixed *reference* piece of host work like `submit()`'s own Python (a
short Python loop and a few numpy calls on 2048 integers) is timed, and then timed again at
once. The first shows what work costs right after a `wait()` on that host, the second what it
costs with its code and data in the CPU caches. `--reference-only` times the reference with no
GPU, warm and after a 64 MiB sweep has pushed it out of the caches, so a development machine's
figures can be set beside the device's.

    python3 benchmarks/submit_noise.py --variants torch,cupy
    python3 benchmarks/submit_noise.py --reference-only
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from typing import Any

import numpy as np
from transfer import VARIANTS, _bound, _measure, bench_kv_caches, catalog_rows, cuda_torch

from kvferry.core.plan import Direction
from kvferry.executors import make_executor

BLOCKS = 2048


def _steal() -> tuple[int, int]:
    """Return (steal, total) jiffies of the machine so far (`/proc/stat`'s first line)."""
    with open("/proc/stat", encoding="ascii") as stat:
        fields = [int(x) for x in stat.readline().split()[1:9]]
    return fields[7], sum(fields)


def _percentiles(values: list[float], scale: float = 1e6, digits: int = 0) -> str:
    """Return the 10th, 50th and 90th percentiles of `values` times `scale`, joined by '/'."""
    ordered = sorted(values)
    picks = (ordered[min(len(ordered) - 1, int(p * len(ordered)))] for p in (0.1, 0.5, 0.9))
    return "/".join(f"{v * scale:.{digits}f}" for v in picks)


_REFERENCE_VALUES = np.arange(BLOCKS, dtype=np.int64)
_SWEEP = np.ones(64 << 17)
"""64 MiB: sweeping it evicts the reference's code and data from the CPU caches."""


def _reference() -> float:
    """Run the fixed reference work once; return the thread's CPU seconds it took."""
    start = time.thread_time()
    values = _REFERENCE_VALUES
    total = 0
    for step in range(200):
        total += step
    int(values.max())
    np.ascontiguousarray(values, np.int64)
    bool((values[1:] > values[:-1]).all())
    return time.thread_time() - start


def noise(torch: Any, variant: str, page: int, jobs: int) -> str:
    """Return one line: over `jobs` timed loads, each submitted right after a `wait()`, the
    percentiles of the wall clock and CPU time inside `submit()`, context switches and steal;
    over as many loads between them, the reference work's CPU time right after a `wait()`
    and again at once."""
    name, options = VARIANTS[variant]
    moved, num_blocks, kv = bench_kv_caches(torch, 32, page, BLOCKS * 32 * page)
    executor = make_executor(name, kv_caches=kv, blocks_per_chunk=1, num_rows=moved, **options)
    rng = np.random.default_rng(1)
    rows = catalog_rows(moved)
    wall: list[float] = []
    cpu: list[float] = []
    after_wait: list[float] = []
    again: list[float] = []
    voluntary = involuntary = 0
    steal_before = _steal()
    try:
        for job in range(2 * jobs + 2):
            bound = _bound(job, Direction.LOAD, rng.choice(num_blocks, moved, False), rows)
            if job % 2:  # the host's state right after a wait(), then warm
                after_wait.append(_reference())
                again.append(_reference())
                executor.submit(bound)
                executor.wait([job])
                continue
            usage = resource.getrusage(resource.RUSAGE_THREAD)
            cpu_start, start = time.thread_time(), time.perf_counter()
            executor.submit(bound)
            end, cpu_end = time.perf_counter(), time.thread_time()
            after = resource.getrusage(resource.RUSAGE_THREAD)
            executor.wait([job])
            if job >= 2:
                wall.append(end - start)
                cpu.append(cpu_end - cpu_start)
                voluntary += after.ru_nvcsw - usage.ru_nvcsw
                involuntary += after.ru_nivcsw - usage.ru_nivcsw
    finally:
        executor.close()
        del kv
        torch.cuda.empty_cache()
    steal_after = _steal()
    steal = (steal_after[0] - steal_before[0]) / max(1, steal_after[1] - steal_before[1])
    return (
        f"{variant} {page >> 10:>2} KiB wall p10/50/90 {_percentiles(wall)}  cpu "
        f"{_percentiles(cpu)} us  ctxsw vol {voluntary} invol {involuntary}  steal {steal:.1%}  "
        f"reference after wait() {_percentiles(after_wait[1:], digits=1)}, "
        f"again {_percentiles(again[1:], digits=1)} us"
    )


def _sweep(torch: Any, variants: list[str]) -> None:
    """Store and load 1 GiB jobs at a few page sizes, as `transfer.py` does before target 4b."""
    rng = np.random.default_rng(0)
    for page_kib in (4, 64, 2048):
        moved, num_blocks, kv = bench_kv_caches(torch, 32, page_kib << 10, 1 << 30)
        for variant in variants:
            name, options = VARIANTS[variant]
            executor = make_executor(
                name, kv_caches=kv, blocks_per_chunk=1, num_rows=moved, **options
            )
            try:
                for direction in Direction:
                    ids = [rng.choice(num_blocks, moved, False) for _ in range(4)]
                    bounds = [_bound(j, direction, ids[j], catalog_rows(moved)) for j in range(4)]
                    _measure(executor, bounds)
            finally:
                executor.close()
        del kv
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="torch,cupy")
    parser.add_argument("--pages-kib", default="4,16")
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument(
        "--reference-only", action="store_true", help="time the reference work alone (no GPU)"
    )
    args = parser.parse_args(argv)
    if args.reference_only:
        warm, cold = [], []
        for _ in range(300):
            _SWEEP.sum()
            cold.append(_reference())
            warm.append(_reference())
        print(
            f"reference after a cache sweep p10/50/90 {_percentiles(cold[20:], digits=1)}, "
            f"again {_percentiles(warm[20:], digits=1)} us"
        )
        return 0
    torch = cuda_torch("submit_noise.py")
    if torch is None:
        return 0
    variants = args.variants.split(",")
    pages = [int(p) << 10 for p in args.pages_kib.split(",")]
    for phase in ("fresh", "after sweep"):
        if phase != "fresh":
            _sweep(torch, variants)
        for variant in variants:
            for page in pages:
                print(phase, noise(torch, variant, page, args.jobs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
