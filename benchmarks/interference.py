"""Interference: what back-to-back KV transfers cost a model's matmul, and the rate they keep.

Needs a CUDA GPU; without one it says so and exits 3 (`EXIT_SKIPPED`).

At each page size, each variant keeps two store jobs and two load jobs in flight (each direction
back to back; 32 layers of blocks-first pages, `--gib` GiB per job). A variant is an executor
(`torch`, `cupy`, ...) or a reference: `pinned-copy`, contiguous pinned copies both ways (the
copy engines alone, no SM), or `pinned-copy+sm-pass`, the same copies plus one elementwise pass
of every byte through the SMs in GPU memory (the least SM work a staged path, as kvferry's
executors take, does). Measured in the same run:

1. the ceilings: a contiguous pinned copy each way, and both at once (the bidirectional one);
2. per variant, the transfers alone: store + load GB/s over `--window` seconds, no matmul;
3. in each of `--rounds` rounds, a loop of bf16 8192 x 8192 x 8192 matmuls on its own stream,
   once alone and once beside each variant's transfers, in a shuffled order. A round's slowdown
   is the loop's time beside the transfers over the same round's loop alone, minus one, so
   drift between rounds cancels. Per variant: the median over the rounds with a
   distribution-free 95 % interval, and the transfers' rate while the loop ran.

Transfer GB/s is the bytes of the jobs that ended inside a window over the host time between the
first and the last of those ends, per direction, so gaps from a slow `submit()` count. The
executors get an idle stream as `compute_stream`, so their jobs do not wait for the queued
matmuls (in an engine a store waits for the step that wrote its pages, not for the whole queue).

    kvferry bench interference --rounds 8
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvferry.benchmarks.common import (
    EXIT_SKIPPED,
    add_common_options,
    bar_line,
    bar_result,
    cuda_torch,
    finish_axis,
    kib_list,
    measured_on,
    measured_on_line,
    names,
    output_paths,
    own_stream,
    positive_float,
    positive_int,
    pyplot,
    save_plot,
    write_json,
)
from kvferry.benchmarks.transfer import (
    KIB,
    VARIANTS,
    bench_kv_caches,
    bound_plan,
    catalog_rows,
    pinned_copy_gbps,
)
from kvferry.core.plan import Direction
from kvferry.executors import CopyPath, make_executor

NAME = "interference"
MATMUL_N = 8192
SLOWDOWN_BAR = 0.03
"""The matmul's median slowdown beside the transfers."""
COMBINED_BAR = 0.90
"""Store + load GB/s over both contiguous pinned copies at once."""
PINNED = "pinned-copy"
SM_PASS = "pinned-copy+sm-pass"
ZERO_COPY_PREFIX = "cupy-zero-copy-"
ALONE = "alone"
"""The arm of a round in which the matmul loop runs alone."""
DEFAULT_VARIANTS = f"{PINNED},{SM_PASS},torch,cupy"
REFERENCES: dict[str, tuple[str, str, str]] = {
    PINNED: (
        "the copy engines alone (no SM)",
        "even the copy engines alone cost the matmul more: no transfer at the link's rate "
        "stays under it on this GPU",
        "the link's traffic alone leaves room under it",
    ),
    SM_PASS: (
        "the copy engines and one pass of every byte through the SMs",
        "no staged path, kvferry's executors included, stays under it on this GPU",
        "a staged path can stay under it on this GPU",
    ),
}
"""Per reference variant: what it measures, and what it means when its slowdown's interval lies
above the slowdown bar, or below it."""


def _variant(name: str) -> tuple[str, dict[str, Any]]:
    """Return (executor name, options) for a variant; `cupy-zero-copy-G` runs on G blocks."""
    if name.startswith(ZERO_COPY_PREFIX):
        blocks = int(name.removeprefix(ZERO_COPY_PREFIX))
        return "cupy", {"copy_path": CopyPath.ZERO_COPY, "zero_copy_blocks": blocks}
    return VARIANTS[name]


class _Jobs:
    """Back-to-back jobs of one source: `submit(direction)` queues one; `ended()` returns
    `(direction, nbytes, gpu_seconds)` of the jobs that ended since the last call."""

    def submit(self, direction: Direction) -> None:
        """Queue one job of `direction`."""
        raise NotImplementedError

    def ended(self) -> list[tuple[Direction, int, float]]:
        """Return the jobs that ended since the last call."""
        raise NotImplementedError

    def close(self) -> None:
        """Wait for everything and release."""
        raise NotImplementedError

    hung = False
    """Set when a job did not end in time: `close()` would wait for ever, so it is skipped."""


class _ExecutorJobs(_Jobs):
    """Jobs of an executor: random block ids from a random half of the blocks for stores and
    the other half for loads (a store never reads what a load in flight writes), rows from
    disjoint halves of the tier, each half as a fresh kvferry Catalog allocates a job's rows."""

    def __init__(self, executor: Any, num_blocks: int, moved: int, seed: int) -> None:
        self._executor = executor
        self._moved = moved
        self._rng = np.random.default_rng(seed)
        ids = self._rng.permutation(num_blocks)
        self._pool = {
            Direction.STORE: ids[: num_blocks // 2],
            Direction.LOAD: ids[num_blocks // 2 :],
        }
        self._next = 1
        self._direction: dict[int, Direction] = {}

    def submit(self, direction: Direction) -> None:
        ids = self._rng.permutation(self._pool[direction])[: self._moved]
        base = 0 if direction is Direction.STORE else self._moved
        rows = base + catalog_rows(self._moved)
        job = self._next
        self._next += 1
        self._direction[job] = direction
        self._executor.submit(bound_plan(job, direction, ids, rows))

    def ended(self) -> list[tuple[Direction, int, float]]:
        out = []
        for result in self._executor.poll():
            if not result.success:
                raise RuntimeError(f"job {result.job_id}: {result.error}")
            out.append((self._direction.pop(result.job_id), result.nbytes, result.seconds))
        return out

    def close(self) -> None:
        self._executor.close()


class _PinnedCopyJobs(_Jobs):
    """Contiguous pinned copies of `nbytes`, one stream per direction: the copy engines alone."""

    def __init__(self, torch: Any, nbytes: int) -> None:
        self._torch = torch
        self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self._device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self._streams = {d: own_stream(torch) for d in Direction}
        self._pending: list[tuple[Direction, Any, Any]] = []
        self._nbytes = nbytes

    def submit(self, direction: Direction) -> None:
        torch = self._torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = self._streams[direction]
        dst, src = (
            (self._host, self._device)
            if direction is Direction.STORE
            else (self._device, self._host)
        )
        start.record(stream)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        end.record(stream)
        self._pending.append((direction, start, end))

    def ended(self) -> list[tuple[Direction, int, float]]:
        done: list[tuple[Direction, Any, Any]] = []
        waiting: list[tuple[Direction, Any, Any]] = []
        for pending in self._pending:
            (done if pending[2].query() else waiting).append(pending)
        self._pending = waiting
        return [(d, self._nbytes, s.elapsed_time(e) / 1000) for d, s, e in done]

    def close(self) -> None:
        self._torch.cuda.synchronize()


class _SmPassJobs(_PinnedCopyJobs):
    """The contiguous pinned copies of `_PinnedCopyJobs`, each with one pass of its bytes through
    the SMs in GPU memory on the same stream: a store first copies its pages into staging with
    an elementwise kernel, a load copies staging into its pages after the DMA.

    The least SM work a staged path can do (every byte read and written once in HBM, by a
    kernel on the whole GPU at HBM speed, with no gather addressing), so beside the matmul it
    bounds what any staged path costs: kvferry's staging kernels do the same traffic, slower.
    """

    def __init__(self, torch: Any, nbytes: int) -> None:
        super().__init__(torch, nbytes)
        words = nbytes // 4
        self._pages = {d: torch.zeros(words, dtype=torch.int32, device="cuda") for d in Direction}
        self._stage = {d: torch.zeros(words, dtype=torch.int32, device="cuda") for d in Direction}

    def submit(self, direction: Direction) -> None:
        torch = self._torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = self._streams[direction]
        pages, stage = self._pages[direction], self._stage[direction]
        host = self._host.view(torch.int32)
        start.record(stream)
        with torch.cuda.stream(stream):
            if direction is Direction.STORE:
                torch.add(pages, 0, out=stage)  # the gather's traffic
                host.copy_(stage, non_blocking=True)
            else:
                stage.copy_(host, non_blocking=True)
                torch.add(stage, 0, out=pages)  # the scatter's traffic
        end.record(stream)
        self._pending.append((direction, start, end))


class _Matmul:
    """A loop of `count` bf16 N x N x N matmuls on its own stream, timed with CUDA events, after
    `warmup` untimed ones.

    A board at its power cap sets the SM clock from the power drawn over the last fraction of a
    second: a loop of ~0.5 s that starts after a lighter load (transfers alone, an idle GPU)
    runs several per cent faster than one that starts after another matmul loop. The untimed
    matmuls bring every loop to the same state before its clock starts, so a slowdown measures
    what runs beside the loop, not what ran before it."""

    def __init__(self, torch: Any, count: int, warmup: int, *, priority: int = 0) -> None:
        self._torch = torch
        self._count = count
        self._warmup = warmup
        self._stream = own_stream(torch, priority=priority)
        with torch.cuda.stream(self._stream):
            self._a = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device="cuda")
            self._b = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device="cuda")
            self._c = torch.empty(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device="cuda")
        self._events: tuple[Any, Any] | None = None

    def start(self) -> None:
        """Queue the loop (returns at once)."""
        torch = self._torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            for _ in range(self._warmup):
                torch.matmul(self._a, self._b, out=self._c)
            start.record(self._stream)
            for _ in range(self._count):
                torch.matmul(self._a, self._b, out=self._c)
            end.record(self._stream)
        self._events = (start, end)

    def _queued(self) -> tuple[Any, Any]:
        if self._events is None:
            raise RuntimeError("the matmul loop was not started")
        return self._events

    def done(self) -> bool:
        """Return True once the queued loop has ended."""
        return bool(self._queued()[1].query())

    def seconds_per_matmul(self) -> float:
        """Wait for the loop; return its CUDA-event time per matmul."""
        start, end = self._queued()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000 / self._count

    def alone(self) -> float:
        """Run the loop with nothing beside it; return seconds per matmul."""
        self.start()
        return self.seconds_per_matmul()


class _GpuSampler:
    """Samples the SM clock, board power and active clock-limit reasons with `nvidia-smi` every
    50 ms while in use (all NaN and no reasons where `nvidia-smi` is missing)."""

    QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"

    def __init__(self, device: int) -> None:
        self._device = device
        self._process: subprocess.Popen[str] | None = None
        self.result: dict[str, Any] = {}

    def __enter__(self) -> _GpuSampler:
        try:
            self._process = subprocess.Popen(
                [
                    "nvidia-smi",
                    f"--query-gpu={self.QUERY}",
                    "--format=csv,noheader,nounits",
                    "-lms",
                    "50",
                    "-i",
                    str(self._device),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError:
            self._process = None
        return self

    def __exit__(self, *exc: object) -> None:
        clocks, powers, reasons = [], [], set()
        if self._process is not None:
            self._process.terminate()
            out, _ = self._process.communicate(timeout=10)
            for line in out.splitlines():
                parts = [p.strip() for p in line.split(",")]
                try:
                    clocks.append(float(parts[0]))
                    powers.append(float(parts[1]))
                except (ValueError, IndexError):
                    continue
                if len(parts) > 2:
                    reasons.add(parts[2])
        self.result = {
            "sm_mhz": _median(clocks),
            "power_w": _median(powers),
            "samples": len(clocks),
            "limit_reasons": sorted(reasons),
        }


def _for(seconds: float) -> Callable[[], bool]:
    """Return a stop condition that turns true `seconds` from now."""
    until = time.perf_counter() + seconds
    return lambda: time.perf_counter() > until


def _median(values: Sequence[float]) -> float:
    """Return the median of the values that are numbers (NaN when there are none)."""
    numbers = [v for v in values if not math.isnan(v)]
    return statistics.median(numbers) if numbers else float("nan")


def _warm_up(jobs: _Jobs) -> None:
    """Run one job each way to its end (first-use allocations, kernel compilation)."""
    for direction in Direction:
        jobs.submit(direction)
    seen = 0
    deadline = time.perf_counter() + 30
    while seen < 2:
        if time.perf_counter() > deadline:
            jobs.hung = True
            raise TimeoutError("a warm-up job did not end within 30 s")
        seen += len(jobs.ended())


def _drive(
    jobs: _Jobs, stop: Callable[[], bool], *, depth: int, extend: bool
) -> dict[str, dict[str, float]]:
    """Keep `depth` jobs per direction in flight until `stop()` (and, with `extend`, until three
    jobs of each direction have ended); return per direction the GB/s over the jobs that ended
    (host clock, first end excluded as the anchor; NaN with fewer than three) and the median
    GPU-event GB/s of those jobs."""
    for _ in range(depth):
        for direction in Direction:
            jobs.submit(direction)
    ends: dict[Direction, list[tuple[float, int, float]]] = {d: [] for d in Direction}

    deadline = time.perf_counter() + 30

    def more() -> bool:
        short = any(len(seen) < 3 for seen in ends.values())
        return extend and short and time.perf_counter() < deadline

    while not stop() or more():
        for direction, nbytes, seconds in jobs.ended():
            ends[direction].append((time.perf_counter(), nbytes, seconds))
            jobs.submit(direction)
    out: dict[str, dict[str, float]] = {}
    for direction, seen in ends.items():
        nan = float("nan")
        nbytes = sum(n for _, n, _ in seen[1:])
        out[direction.value] = {
            "jobs": max(len(seen) - 1, 0),
            "gbps": nbytes / (seen[-1][0] - seen[0][0]) / 1e9 if len(seen) >= 3 else nan,
            "job_gbps": statistics.median(n / s for _, n, s in seen[1:]) / 1e9
            if len(seen) >= 2
            else nan,
        }
    # drain what is still in flight
    deadline = time.perf_counter() + 30
    pending = depth * 2
    while pending and time.perf_counter() < deadline:
        pending -= len(jobs.ended())
    jobs.hung = pending > 0
    return out


def _bidirectional_ceiling(torch: Any, nbytes: int, seconds: float) -> float:
    """Return store + load GB/s of contiguous pinned copies both ways at once."""
    jobs = _PinnedCopyJobs(torch, nbytes)
    _warm_up(jobs)
    rates = _drive(jobs, _for(seconds), depth=2, extend=True)
    jobs.close()
    return rates["store"]["gbps"] + rates["load"]["gbps"]


def _matmul_beside(
    torch: Any, jobs: _Jobs, matmul: _Matmul
) -> tuple[dict[str, dict[str, float]], float, _GpuSampler]:
    """Run the matmul loop beside back-to-back jobs (two in flight per direction); return the
    jobs' rates while it ran (`_drive`), its seconds per matmul, and the GPU's samples."""
    started = False

    def stop() -> bool:
        nonlocal started
        if not started:  # the first jobs of each direction are queued: start the loop
            matmul.start()
            started = True
        return matmul.done()

    with _GpuSampler(torch.cuda.current_device()) as sampled:
        rates = _drive(jobs, stop, depth=2, extend=False)
        seconds = matmul.seconds_per_matmul()
    torch.cuda.synchronize()
    return rates, seconds, sampled


def _make_jobs(
    torch: Any, variant: str, *, kv: Any, num_blocks: int, moved: int, page_kib: int, total: int
) -> _Jobs:
    """Return the job source of one variant (an executor on an idle compute stream)."""
    if variant == PINNED:
        return _PinnedCopyJobs(torch, total)
    if variant == SM_PASS:
        return _SmPassJobs(torch, total)
    name, options = _variant(variant)
    executor = make_executor(
        name,
        kv_caches=kv,
        blocks_per_chunk=1,
        num_rows=2 * moved,
        compute_stream=own_stream(torch),  # idle: the jobs must not wait for the matmuls
        **options,
    )
    return _ExecutorJobs(executor, num_blocks, moved, seed=page_kib)


def _arm_round(
    torch: Any, jobs: _Jobs | None, matmul: _Matmul, settle: float, ceiling: dict[str, float]
) -> dict[str, Any]:
    """Run the matmul loop once beside `jobs` (None: alone); return its time per matmul, the GPU's
    clock and power, and beside jobs their rates while it ran, as ratios to the ceilings."""
    device = torch.cuda.current_device()
    if jobs is None:
        with _GpuSampler(device) as sampled:
            seconds = matmul.alone()
        return {"matmul_ms": seconds * 1e3, "gpu": sampled.result}
    _drive(jobs, _for(settle), depth=2, extend=False)
    rates, seconds, sampled = _matmul_beside(torch, jobs, matmul)
    store, load = rates["store"]["gbps"], rates["load"]["gbps"]
    return {
        "matmul_ms": seconds * 1e3,
        "combined": (store + load) / ceiling["bidirectional"],
        "store_ratio": store / ceiling["store"],
        "load_ratio": load / ceiling["load"],
        "gpu": sampled.result,
    }


def _run_page(
    torch: Any,
    args: argparse.Namespace,
    page_kib: int,
    *,
    matmul: _Matmul,
    ceiling: dict[str, float],
) -> dict[str, Any]:
    """Measure every variant at one page size: each one's transfers alone, then `args.rounds`
    rounds of the matmul loop alone and beside each, in a shuffled order. Return the raw
    numbers."""
    total = int(args.gib * (1 << 30))
    moved, num_blocks, kv = bench_kv_caches(torch, args.layers, page_kib * KIB, total)
    sources: dict[str, _Jobs] = {}
    alone: dict[str, float] = {}
    try:
        for variant in args.variants:
            jobs = _make_jobs(
                torch,
                variant,
                kv=kv,
                num_blocks=num_blocks,
                moved=moved,
                page_kib=page_kib,
                total=total,
            )
            sources[variant] = jobs
            _warm_up(jobs)
            # unmeasured: an executor's first jobs of a process run below the link for a while
            _drive(jobs, _for(args.settle), depth=2, extend=False)
            rates = _drive(jobs, _for(args.window), depth=2, extend=True)
            alone[variant] = (rates["store"]["gbps"] + rates["load"]["gbps"]) / ceiling[
                "bidirectional"
            ]
        arms = [ALONE, *sources]
        rng = np.random.default_rng([args.seed, page_kib])
        rounds: list[dict[str, dict[str, Any]]] = []
        for _ in range(args.rounds):
            order = [arms[i] for i in rng.permutation(len(arms))]
            rounds.append({
                arm: _arm_round(torch, sources.get(arm), matmul, args.settle, ceiling)
                for arm in order
            })  # fmt: skip
    finally:
        for jobs in sources.values():
            if not jobs.hung:
                jobs.close()
        del kv
        torch.cuda.empty_cache()
    return {"page_kib": page_kib, "combined_alone": alone, "rounds": rounds}


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """Return the distribution-free interval of the median of `values` (order statistics: the
    k-th smallest and k-th largest, k the largest with P(Binomial(n, 1/2) < k) <= (1 - c) / 2);
    the extremes when there are too few values for that confidence."""
    ordered = sorted(values)
    n = len(ordered)
    tail = (1 - confidence) / 2
    k, below = 0, 0.0
    while k < n // 2:
        below_next = below + math.comb(n, k) / 2**n
        if below_next > tail:
            break
        below, k = below_next, k + 1
    k = max(k, 1)
    return ordered[k - 1], ordered[n - k]


def summarize_page(page: dict[str, Any], variants: Sequence[str]) -> list[dict[str, Any]]:
    """Return, per variant, what its rounds at one page size (`_run_page`'s result) measured:
    the median slowdown and its interval, the combined rate alone and beside the matmul, each
    direction's rate beside it, the GPU's clock and power."""
    rounds: list[dict[str, dict[str, Any]]] = page["rounds"]
    out = []
    for variant in variants:
        slowdowns = [r[variant]["matmul_ms"] / r[ALONE]["matmul_ms"] - 1 for r in rounds]
        low, high = median_interval(slowdowns)
        out.append({
            "variant": variant,
            "page_kib": page["page_kib"],
            "reference": variant in REFERENCES,
            "slowdown": statistics.median(slowdowns),
            "interval": [low, high],
            "slowdown_per_round": slowdowns,
            "combined_alone": page["combined_alone"][variant],
            "combined_beside": _median([r[variant]["combined"] for r in rounds]),
            "store_ratio_beside": _median([r[variant]["store_ratio"] for r in rounds]),
            "load_ratio_beside": _median([r[variant]["load_ratio"] for r in rounds]),
            "sm_mhz": _median([r[variant]["gpu"]["sm_mhz"] for r in rounds]),
            "power_w": _median([r[variant]["gpu"]["power_w"] for r in rounds]),
        })  # fmt: skip
    return out


def _pct(value: float) -> str:
    return f"{100 * value:+.1f} %"


def _slowdown_text(arm: dict[str, Any]) -> str:
    low, high = arm["interval"]
    return f"{_pct(arm['slowdown'])} [{100 * low:+.1f}, {100 * high:+.1f}]"


def bars(arms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return the verdicts of the two bars over the executor variants (references excluded):
    both directions at once with no matmul, and the matmul's slowdown beside the transfers."""
    executors = [a for a in arms if not a["reference"]]
    if not executors:
        return []
    worst = min(executors, key=lambda a: np.nan_to_num(a["combined_alone"], nan=-1.0))
    alone_ok = all(a["combined_alone"] >= COMBINED_BAR for a in executors)
    beside_ok = all(
        a["slowdown"] <= SLOWDOWN_BAR and a["combined_beside"] >= COMBINED_BAR for a in executors
    )
    return [
        bar_result(
            alone_ok,
            f"both directions at once, no matmul: store + load >= {COMBINED_BAR:.2f} x both "
            "pinned copies at once, every executor and page size",
            f"worst {worst['combined_alone']:.2f} ({worst['variant']} {worst['page_kib']} KiB); "
            + ", ".join(
                f"{a['variant']} {a['page_kib']} KiB {a['combined_alone']:.2f}" for a in executors
            ),
        ),
        bar_result(
            beside_ok,
            f"beside a bf16 matmul loop: its median slowdown <= {100 * SLOWDOWN_BAR:.0f} % while "
            f"store + load >= {COMBINED_BAR:.2f} x both pinned copies at once, every executor "
            "and page size",
            ", ".join(
                f"{a['variant']} {a['page_kib']} KiB {_slowdown_text(a)} at "
                f"{a['combined_beside']:.2f}"
                for a in executors
            ),
        ),
    ]


def reference_lines(arms: list[dict[str, Any]]) -> list[str]:
    """Return one line per reference variant and page: what it cost the matmul, and what that
    means for the slowdown bar on this GPU."""
    lines = []
    for arm in arms:
        if not arm["reference"]:
            continue
        what, above, below = REFERENCES[arm["variant"]]
        low, high = arm["interval"]
        if low > SLOWDOWN_BAR:
            meaning = f"above {100 * SLOWDOWN_BAR:.0f} %: {above}"
        elif high < SLOWDOWN_BAR:
            meaning = f"below {100 * SLOWDOWN_BAR:.0f} %: {below}"
        else:
            meaning = f"not separable from {100 * SLOWDOWN_BAR:.0f} % with these rounds"
        lines.append(
            f"reference, {what}, {arm['page_kib']} KiB: matmul slowdown {_slowdown_text(arm)}, "
            f"store + load {arm['combined_beside']:.2f} x both pinned copies at once; {meaning}"
        )
    return lines


def table_lines(arms: list[dict[str, Any]]) -> list[str]:
    """Return the table of the arms: slowdown, its interval, the rates, the GPU's clock."""
    header = (
        f"{'variant':<20} {'page':>6} {'slowdown':>9} {'95 % interval':>16} {'alone':>6} "
        f"{'beside':>7} {'store':>6} {'load':>6} {'SM MHz':>7} {'W':>5}"
    )
    lines = [header, "-" * len(header)]
    for a in arms:
        low, high = a["interval"]
        lines.append(
            f"{a['variant']:<20} {a['page_kib']:>4}Ki {100 * a['slowdown']:>+8.1f}% "
            f"{100 * low:>+7.1f} .. {100 * high:>+5.1f}% {a['combined_alone']:>6.2f} "
            f"{a['combined_beside']:>7.2f} {a['store_ratio_beside']:>6.2f} "
            f"{a['load_ratio_beside']:>6.2f} {a['sm_mhz']:>7.0f} {a['power_w']:>5.0f}"
        )
    return lines


def plot(results: Path, png: Path, *, log: TextIO | None = None) -> Path | None:
    """Draw, per variant against page size, the matmul's median slowdown with its interval and
    the transfers' combined rate beside the matmul, with the bars, from this benchmark's JSON;
    return the PNG's path, or None (said on `log`) when matplotlib is not installed."""
    plt = pyplot(log)
    if plt is None:
        return None
    data: dict[str, Any] = json.loads(results.read_text(encoding="utf-8"))
    series: dict[str, list[dict[str, Any]]] = {}
    for arm in data.get("arms", []):
        series.setdefault(str(arm["variant"]), []).append(arm)
    figure, (slow, rate) = plt.subplots(1, 2, figsize=(11, 4.5))
    for variant, arms in series.items():
        arms.sort(key=lambda a: int(a["page_kib"]))
        pages = [int(a["page_kib"]) for a in arms]
        medians = [100 * float(a["slowdown"]) for a in arms]
        errors = [
            [m - 100 * float(a["interval"][0]) for m, a in zip(medians, arms, strict=True)],
            [100 * float(a["interval"][1]) - m for m, a in zip(medians, arms, strict=True)],
        ]
        slow.errorbar(pages, medians, yerr=errors, marker="o", capsize=3, label=variant)
        rate.plot(pages, [float(a["combined_beside"]) for a in arms], marker="o", label=variant)
    slow.axhline(100 * SLOWDOWN_BAR, color="grey", linewidth=0.8, linestyle="--")
    rate.axhline(COMBINED_BAR, color="grey", linewidth=0.8, linestyle="--")
    finish_axis(slow, xlabel="page (KiB)", ylabel="matmul slowdown, % (median, 95 % interval)")
    finish_axis(rate, xlabel="page (KiB)", ylabel="store + load beside it / both pinned copies")
    measured = data.get("measured_on", {})
    return save_plot(
        plt,
        figure,
        png,
        f"kvferry interference, {measured.get('gpu', 'GPU')}, {measured.get('date', '')}; "
        f"{data.get('args', {}).get('rounds', '?')} rounds, dashed: the bars",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"kvferry bench {NAME}",
        description=(__doc__ or "").split("\n\n")[0],
        epilog="Needs a CUDA GPU; exits 3 without one.",
    )
    parser.add_argument(
        "--variants",
        type=names,
        default=names(DEFAULT_VARIANTS),
        help=f"comma-separated, of {PINNED}, {SM_PASS}, "
        + ", ".join(v for v in VARIANTS if v != "cpu")
        + f", {ZERO_COPY_PREFIX}G (G thread blocks) (default {DEFAULT_VARIANTS})",
    )
    parser.add_argument(
        "--pages-kib", type=kib_list, default=None, help="default 16,64,256 (--quick: 16)"
    )
    parser.add_argument("--rounds", type=positive_int, default=None, help="default 8 (--quick: 2)")
    parser.add_argument("--layers", type=positive_int, default=32)
    parser.add_argument(
        "--gib", type=positive_float, default=None, help="bytes per job (default 0.5)"
    )
    parser.add_argument(
        "--matmuls", type=positive_int, default=None, help="matmuls per timed loop (default 300)"
    )
    parser.add_argument(
        "--warmup-matmuls",
        type=positive_int,
        default=None,
        help="untimed matmuls before each timed loop (default 300), so every loop starts at "
        "the clock the board's power cap settles to",
    )
    parser.add_argument(
        "--matmul-priority",
        type=int,
        default=0,
        help="the matmul stream's CUDA priority (default 0, the least urgent, as the "
        "executors' streams; -1 or less: more urgent than the staging kernels)",
    )
    parser.add_argument(
        "--window", type=positive_float, default=0.4, help="seconds of transfers alone"
    )
    parser.add_argument(
        "--settle",
        type=positive_float,
        default=0.3,
        help="seconds of unmeasured transfers before each measurement",
    )
    parser.add_argument("--seed", type=int, default=0, help="of the arms' order in each round")
    add_common_options(
        parser,
        quick="a short run: 16 KiB pages, 2 rounds, 0.25 GiB jobs, 100 + 100 matmuls a loop",
    )
    return parser


def _known(variant: str) -> bool:
    if variant.startswith(ZERO_COPY_PREFIX):
        return variant.removeprefix(ZERO_COPY_PREFIX).isdigit()
    return variant in REFERENCES or (variant in VARIANTS and variant != "cpu")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the measurement; print the table, the bars and the references; write the JSON and the
    PNG under `--out`. Return 0, or `EXIT_SKIPPED` when there is no CUDA GPU."""
    parser = _parser()
    args = parser.parse_args(argv)
    unknown = [v for v in args.variants if not _known(v)]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}")
    args.pages_kib = args.pages_kib or ([16] if args.quick else [16, 64, 256])
    args.rounds = args.rounds or (2 if args.quick else 8)
    args.gib = args.gib or (0.25 if args.quick else 0.5)
    args.matmuls = args.matmuls or (100 if args.quick else 300)
    args.warmup_matmuls = args.warmup_matmuls or (100 if args.quick else 300)
    torch = cuda_torch(NAME)
    if torch is None:
        return EXIT_SKIPPED
    info = measured_on(torch)
    print(measured_on_line(info))
    total = int(args.gib * (1 << 30))
    ceiling = pinned_copy_gbps(torch, total, 3)
    ceiling["bidirectional"] = _bidirectional_ceiling(torch, total, args.window * 2)
    matmul = _Matmul(torch, args.matmuls, args.warmup_matmuls, priority=args.matmul_priority)
    matmul.alone()  # warm-up (cuBLAS heuristics, clocks)
    print(
        f"ceilings (contiguous pinned copies, {args.gib} GiB): store {ceiling['store']:.1f} "
        f"GB/s, load {ceiling['load']:.1f} GB/s, both at once {ceiling['bidirectional']:.1f} "
        f"GB/s; {args.rounds} rounds, {args.matmuls} matmuls a loop, matmul stream priority "
        f"{args.matmul_priority}"
    )
    print(
        "slowdown: the matmul loop beside the transfers against alone, median of the rounds; "
        "alone / beside: store + load over both pinned copies at once, without and with the "
        "matmul; store / load: each beside it, over its one-way copy"
    )
    pages_out, arms = [], []
    for page_kib in args.pages_kib:
        page = _run_page(torch, args, page_kib, matmul=matmul, ceiling=ceiling)
        pages_out.append(page)
        arms += summarize_page(page, args.variants)
    for line in table_lines(arms):
        print(line)
    alone_ms = [r[ALONE]["matmul_ms"] for page in pages_out for r in page["rounds"]]
    spread = (max(alone_ms) - min(alone_ms)) / statistics.median(alone_ms)
    print(
        f"matmul alone: median {statistics.median(alone_ms):.3f} ms, spread {100 * spread:.1f} % "
        "over the run (max - min over median)"
    )
    verdicts = bars(arms)
    for verdict in verdicts:
        print(bar_line(verdict["passed"], verdict["bar"], verdict["measured"]))
    references = reference_lines(arms)
    for line in references:
        print(line)
    json_path, png_path = output_paths(args.out, NAME)
    write_json(
        json_path,
        {
            "measured_on": info,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "ceiling_gbps": ceiling,
            "pages": pages_out,
            "arms": arms,
            "bars": verdicts,
            "references": references,
        },
    )
    drawn = plot(json_path, png_path)
    print(f"wrote {json_path}" + (f" and {drawn}" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
