"""Where `submit()` spends its host time, step by step, for the 2048-block load of target 4.

A benchmark, never part of the test suite: it needs a CUDA GPU, torch and the executor's own
library; without a GPU it says so and exits 0.

Per executor and page size it submits 2048-block x 32-layer loads (random block ids, catalog
rows; one `wait()` after each, as `transfer.py` measures target 4, or back to back in bursts
with `--bursts`), with each step of the staged path timed on the host: checking the plan,
taking a free table slot, taking the job's events, asking for the compute stream, and the
compiled call that plans the job, writes its tables and makes its driver calls (its event
records and waits, the table upload, every kernel launch and every DMA: `_native.stage_job`);
for a job that call does not cover, the planner, the slot write and the job's driver calls
(`_native.queue_job`) instead. Medians over the jobs after two warm-ups; the steps do not add
up to the whole (the loop around them, and the timing itself, about 1 µs a step). With
`--sweep-mib`, a line per size also sweeps that many MiB of host memory before each submit,
which pushes the submit's code and data out of the CPU caches: how much of its cost is the
caches' state. With `--spin-ms`, a line per pause also spins the thread in Python that long
before each submit, touching no memory: how much of it is time spent elsewhere alone. With
`--driver real,none`, each line comes again with every driver call of the job code a Python
function that does nothing: what the submit would still cost its caller if another thread
made the driver calls (an upper bound: those 28 Python calls cost more than nothing).

    python3 benchmarks/submit_breakdown.py --variants torch,cupy --bursts 1,4
    python3 benchmarks/submit_breakdown.py --variants torch --sweep-mib 0,64
    python3 benchmarks/submit_breakdown.py --pages-kib 16 --bursts 4 --spin-ms 0,1,4,20
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
from host_steps import spin
from transfer import KIB, VARIANTS, _bound, bench_kv_caches, catalog_rows, cuda_torch

from kvferry.core.plan import Direction
from kvferry.executors import _native, make_executor
from kvferry.executors.staged import StagedGpuExecutor

BLOCKS = 2048
STEPS = ("_checked_bytes", "_free_slot", "_new_job", "_compute_stream_now", "_write_tables")
"""The staged executor's steps timed on the instance (plus the planner and the compiled
calls)."""
COMPILED = {"stage_job": "stage_job (plan + tables + driver calls)", "queue_job": "job calls"}
"""The compiled calls timed, by their name in `_native` and in the output."""


def _timed(spent: dict[str, float], name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """Return `function` adding its host seconds to `spent[name]` on every call."""

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start

    return timed


def _nothing(*args: object) -> None:
    return None


def _without_driver(executor: Any) -> None:
    """Make `executor`'s job code call `_nothing` instead of the driver (before its first job,
    which reads them)."""
    executor._driver_calls = lambda: (_nothing, _nothing, _nothing)
    executor._stage_kernel = lambda **kwargs: _nothing
    executor._table_copy = lambda: _nothing


def breakdown(
    torch: Any,
    variant: str,
    page: int,
    jobs: int,
    *,
    burst: int = 1,
    sweep_mib: int = 0,
    spin_ms: float = 0.0,
    driver: bool = True,
) -> dict[str, float]:
    """Return the median seconds of `submit()` ("submit") and of each step, over `jobs` loads.

    `burst` 1 submits each load right after `wait()` on the previous one, as `transfer.py`
    measures target 4; a larger `burst` submits that many back to back and then waits for them
    all, and samples only the 2nd and later of each burst: submits while the GPU is busy with
    the ones before, as an engine's scheduler would make them. `sweep_mib` MiB of host memory
    are read before each submit (none when 0), and then the thread spins in Python for
    `spin_ms` (none when 0), touching no memory. Without `driver`, every call the compiled job
    code would make to the driver goes to a Python function that does nothing: the submit
    then costs what it would cost the caller if another thread made those calls, and a little
    more (nothing reaches the GPU, and `wait()` reports each job failed).
    """
    sweep = np.ones(sweep_mib << 17) if sweep_mib else None
    spent: dict[str, float] = defaultdict(float)
    compiled = {name: getattr(_native, name) for name in COMPILED}
    for name, function in compiled.items():
        setattr(_native, name, _timed(spent, COMPILED[name], function))
    name, options = VARIANTS[variant]
    moved, num_blocks, kv = bench_kv_caches(torch, 32, page, BLOCKS * 32 * page)
    executor = make_executor(name, kv_caches=kv, blocks_per_chunk=1, num_rows=moved, **options)
    if not isinstance(executor, StagedGpuExecutor):
        raise SystemExit(f"{variant}: the breakdown times the staged path's steps only")
    if not driver:
        _without_driver(executor)
    try:
        for step in STEPS:
            setattr(executor, step, _timed(spent, step.strip("_"), getattr(executor, step)))
        planner = executor._planner
        setattr(planner, "plan", _timed(spent, "plan", planner.plan))  # noqa: B010 (a method)
        rng = np.random.default_rng(1)
        samples: list[dict[str, float]] = []
        rows = catalog_rows(moved)
        job = 0
        while len(samples) < jobs:
            first = job
            for _ in range(burst):
                bound = _bound(job, Direction.LOAD, rng.choice(num_blocks, moved, False), rows)
                if sweep is not None:
                    sweep.sum()
                if spin_ms:
                    spin(spin_ms / 1e3)
                spent.clear()
                start = time.perf_counter()
                executor.submit(bound)
                submit = time.perf_counter() - start
                if job >= 2 and (burst == 1 or job > first):  # two warm-ups
                    samples.append({"submit": submit, **spent})
                job += 1
            executor.wait(range(first, job))
    finally:
        for name, function in compiled.items():
            setattr(_native, name, function)
        executor.close()
        del kv
        torch.cuda.empty_cache()
    keys = ["submit", *(step.strip("_") for step in STEPS), *COMPILED.values(), "plan"]
    return {key: statistics.median(s.get(key, 0.0) for s in samples) for key in keys}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="torch,cupy")
    parser.add_argument("--pages-kib", default="4,16")
    parser.add_argument("--jobs", type=int, default=15)
    parser.add_argument(
        "--bursts",
        default="1",
        help="loads submitted back to back before waiting, one line each (1: after each wait)",
    )
    parser.add_argument(
        "--sweep-mib",
        default="0",
        help="MiB of host memory read before each submit, one line each (0: none)",
    )
    parser.add_argument(
        "--driver",
        default="real",
        help="real, none (each driver call a Python no-op), or both: real,none",
    )
    parser.add_argument(
        "--spin-ms",
        default="0",
        help="ms the thread spins in Python before each submit, one line each (0: none)",
    )
    args = parser.parse_args(argv)
    torch = cuda_torch("submit_breakdown.py")
    if torch is None:
        return 0
    print(f"{BLOCKS}-block x 32-layer loads, median us per submit and per step")
    cases = [
        (int(b), int(m), float(ms), d == "real")
        for d in args.driver.split(",")
        for b in args.bursts.split(",")
        for m in args.sweep_mib.split(",")
        for ms in args.spin_ms.split(",")
    ]
    for burst, sweep_mib, spin_ms, driver in cases:
        pattern = "after wait()" if burst == 1 else f"back to back, bursts of {burst}"
        if sweep_mib:
            pattern += f" and a {sweep_mib} MiB sweep"
        if spin_ms:
            pattern += f", then {spin_ms:g} ms spinning"
        if not driver:
            pattern += ", driver calls as Python no-ops"
        for variant in args.variants.split(","):
            for page_kib in (int(p) for p in args.pages_kib.split(",")):
                times = breakdown(
                    torch,
                    variant,
                    page_kib * KIB,
                    args.jobs,
                    burst=burst,
                    sweep_mib=sweep_mib,
                    spin_ms=spin_ms,
                    driver=driver,
                )
                steps = ", ".join(f"{k} {v * 1e6:.0f}" for k, v in times.items() if k != "submit")
                print(
                    f"{variant} {page_kib} KiB, {pattern}: submit {times['submit'] * 1e6:.0f} | "
                    f"{steps}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
