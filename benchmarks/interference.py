"""Interference: how much back-to-back KV transfers slow a bf16 matmul loop, and vice versa.

A benchmark, never part of the test suite: it needs a CUDA GPU; without one it says so and exits 0.

For each page size and variant (a contiguous pinned copy as the copy-engine-only reference, the
torch executor, the CuPy executor staged, the CuPy executor zero-copy on a few thread-block
counts) it keeps two store jobs and two load jobs in flight (so each direction runs back to back)
and measures, all in the same run:

* matmul alone: a loop of bf16 8192 x 8192 x 8192 matmuls on its own stream, timed with CUDA
  events after `--warmup-matmuls` untimed ones (so the board's power cap has settled the clock
  the same way for every loop: see `_Matmul`), measured right before each variant (adjacent,
  so clock drift cancels);
* transfers alone: store and load GB/s over a fixed host-time window, no matmul (after one
  warm-up job each way and `--settle` seconds of unmeasured transfers);
* both together: the same matmul loop while the transfers run; slowdown = with / alone - 1,
  and the transfers' GB/s during the loop.

Transfer GB/s is bytes of the jobs that ended inside the window over the host time between the
first and the last of those ends, per direction (so gaps from a slow `submit()` count);
"combined" is store + load against the bidirectional ceiling (both contiguous pinned copies at
once), "ratio" per direction against the one-way ceiling (`transfer.py`'s). The executors are
given an idle stream as `compute_stream`, so their jobs do not wait for the queued matmuls (in an
engine a store waits for the step that wrote its pages, not for the whole queue).

    python3 benchmarks/interference.py --json bench-out/interference.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from transfer import (
    KIB,
    VARIANTS,
    _bound,
    _ceiling,
    bench_kv_caches,
    catalog_rows,
    cuda_torch,
    own_stream,
    write_json,
)

from kvferry.core.plan import Direction
from kvferry.executors import CopyPath, make_executor

MATMUL_N = 8192
SLOWDOWN_TARGET = 0.03
COMBINED_TARGET = 0.90
DEFAULT_VARIANTS = (
    "pinned-copy,torch,cupy,cupy-zero-copy-4,cupy-zero-copy-8,cupy-zero-copy-16,cupy-zero-copy-32"
)
PINNED = "pinned-copy"
SM_PASS = "pinned-copy+sm-pass"
"""The copy engines' transfer plus one pass of its bytes through the SMs (`_SmPassJobs`)."""
REFERENCES = (PINNED, SM_PASS)
"""Variants that are references, not executors."""
ZERO_COPY_PREFIX = "cupy-zero-copy-"


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
        self._executor.submit(_bound(job, direction, ids, rows))

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


class _Matmul:
    """A loop of `count` bf16 N x N x N matmuls on its own stream, timed with CUDA events, after
    `warmup` untimed ones.

    The board runs the loop at its power cap, where the SM clock follows the power drawn over
    the last fraction of a second: a loop of ~0.5 s that starts after a lighter load (transfers
    alone, an idle GPU) runs several per cent faster than one that starts after another matmul
    loop. The untimed matmuls bring every loop to the same state before its clock starts, so a
    slowdown measures what runs beside the loop, not what ran before it."""

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

    def done(self) -> bool:
        """Return True once the queued loop has ended."""
        assert self._events is not None
        return bool(self._events[1].query())

    def seconds_per_matmul(self) -> float:
        """Wait for the loop; return its CUDA-event time per matmul."""
        assert self._events is not None
        start, end = self._events
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000 / self._count

    def alone(self) -> float:
        """Run the loop with nothing beside it; return seconds per matmul."""
        self.start()
        return self.seconds_per_matmul()


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
        nan = float("nan")
        self.result = {
            "sm_mhz": statistics.median(clocks) if clocks else nan,
            "power_w": statistics.median(powers) if powers else nan,
            "samples": len(clocks),
            "limit_reasons": sorted(reasons),
        }


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
    until = time.perf_counter() + seconds
    _warm_up(jobs)
    rates = _drive(jobs, lambda: time.perf_counter() > until, depth=2, extend=True)
    jobs.close()
    return rates["store"]["gbps"] + rates["load"]["gbps"]


def matmul_beside(
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


def _measure_variant(
    torch: Any,
    jobs: _Jobs,
    *,
    matmul: _Matmul,
    window: float,
    settle: float,
    ceiling: dict[str, float],
    bidir: float,
) -> dict[str, Any]:
    """Matmul alone, transfers alone, then both; return the numbers of one table row."""
    _warm_up(jobs)
    # unmeasured: the first staged variant of a process ran below the link for about its first
    # window (0.74-0.86 of it, whichever executor came first), the others did not
    until = time.perf_counter() + settle
    _drive(jobs, lambda: time.perf_counter() > until, depth=2, extend=False)
    until = time.perf_counter() + window
    alone_transfer = _drive(jobs, lambda: time.perf_counter() > until, depth=2, extend=True)
    device = torch.cuda.current_device()
    with _GpuSampler(device) as sampled_alone:
        alone = matmul.alone()
    together, with_transfers, sampled_with = matmul_beside(torch, jobs, matmul)

    def combined(rates: dict[str, dict[str, float]]) -> float:
        return (rates["store"]["gbps"] + rates["load"]["gbps"]) / bidir

    return {
        "matmul_alone_ms": alone * 1e3,
        "matmul_with_ms": with_transfers * 1e3,
        "slowdown": with_transfers / alone - 1,
        "alone": alone_transfer,
        "together": together,
        "combined_ratio_alone": combined(alone_transfer),
        "combined_ratio_together": combined(together),
        "store_ratio_together": together["store"]["gbps"] / ceiling["store"],
        "load_ratio_together": together["load"]["gbps"] / ceiling["load"],
        "gpu_alone": sampled_alone.result,
        "gpu_with": sampled_with.result,
    }


def _target_lines(rows: list[dict[str, Any]], pages: list[int]) -> list[str]:
    """Return the summary lines for targets 2 and 3 (of the pages measured here)."""
    parts2 = []
    executors = [r for r in rows if r["variant"] not in REFERENCES]
    # target 2: for each executor (torch; cupy on any path) and page, combined >= 0.90
    verdicts = []
    for executor in ("torch", "cupy"):
        for page in pages:
            best = max(
                (
                    r
                    for r in executors
                    if r["page_kib"] == page and _variant(r["variant"])[0] == executor
                ),
                key=lambda r: r["combined_ratio_alone"],
                default=None,
            )
            if best is None:
                continue
            verdicts.append(best["combined_ratio_alone"] >= COMBINED_TARGET)
            part = f"{executor} {page} KiB {best['combined_ratio_alone']:.2f}"
            if executor == "cupy":
                part += f" ({best['variant']})"
            parts2.append(part)
    summary2 = (
        "target 2 (both directions at once, no matmul; combined >= "
        f"{COMBINED_TARGET:.2f} x bidirectional ceiling, pages {pages} KiB only): "
        + "; ".join(parts2)
        + (" -> PASS" if verdicts and all(verdicts) else " -> FAIL")
    )
    # target 3: per page, some executor variant keeps slowdown <= 3 % with combined >= 0.90
    parts, ok = [], True
    for page in pages:
        here = [r for r in executors if r["page_kib"] == page]
        if not here:
            continue
        passing = [
            r
            for r in here
            if r["slowdown"] <= SLOWDOWN_TARGET and r["combined_ratio_together"] >= COMBINED_TARGET
        ]
        if passing:
            r = min(passing, key=lambda r: r["slowdown"])
            parts.append(
                f"{page} KiB PASS by {r['variant']} "
                f"(+{100 * r['slowdown']:.1f} %, {r['combined_ratio_together']:.2f})"
            )
            continue
        ok = False
        fast = max(here, key=lambda r: np.nan_to_num(r["combined_ratio_together"], nan=-1.0))
        light = min(here, key=lambda r: r["slowdown"])
        parts.append(
            f"{page} KiB none (highest transfer: {fast['variant']} "
            f"{fast['combined_ratio_together']:.2f} at +{100 * fast['slowdown']:.1f} %; "
            f"least slowdown: {light['variant']} +{100 * light['slowdown']:.1f} % at "
            f"{light['combined_ratio_together']:.2f})"
        )
    summary3 = (
        f"target 3 (matmul slowdown <= {100 * SLOWDOWN_TARGET:.0f} % while combined transfer "
        f">= {COMBINED_TARGET:.2f} x bidirectional ceiling): "
        + "; ".join(parts)
        + (" -> PASS" if parts and ok else " -> FAIL")
    )
    return [summary2, summary3]


def add_job_and_matmul_options(parser: argparse.ArgumentParser) -> None:
    """Add the options of the jobs and of the matmul loop (shared with interference_rounds)."""
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--gib", type=float, default=0.5, help="bytes per job")
    parser.add_argument("--matmuls", type=int, default=300, help="matmuls per timed loop")
    parser.add_argument(
        "--warmup-matmuls",
        type=int,
        default=300,
        help="untimed matmuls before each timed loop (see _Matmul)",
    )
    parser.add_argument(
        "--matmul-priority",
        type=int,
        default=0,
        help="the matmul stream's CUDA priority (default 0, the least urgent, as the "
        "executors' streams; -1 or less: more urgent than the staging kernels, so a waiting "
        "matmul block is scheduled before a waiting staging block)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--pages-kib", default="16,64,256")
    add_job_and_matmul_options(parser)
    parser.add_argument("--window", type=float, default=0.4, help="seconds of transfers alone")
    parser.add_argument(
        "--settle",
        type=float,
        default=0.4,
        help="seconds of transfers, unmeasured, before them (after one warm-up job each way)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None, help="also draw a PNG (needs matplotlib)")
    return parser


def _make_jobs(
    torch: Any, variant: str, *, kv: Any, num_blocks: int, moved: int, page_kib: int, total: int
) -> _Jobs:
    """Return the job source of one variant (its executor on an idle compute stream)."""
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


def _run_page(
    torch: Any, args: argparse.Namespace, page_kib: int, **common: Any
) -> list[dict[str, Any]]:
    """Measure every variant at one page size; print and return one row each. `common` holds
    the matmul loop, the ceilings and the bytes per job."""
    total = common["total"]
    rows = []
    page = page_kib * KIB
    moved, num_blocks, kv = bench_kv_caches(torch, args.layers, page, total)
    for variant in args.variants.split(","):
        jobs: _Jobs | None = None
        try:
            jobs = _make_jobs(
                torch,
                variant,
                kv=kv,
                num_blocks=num_blocks,
                moved=moved,
                page_kib=page_kib,
                total=total,
            )
            row = _measure_variant(
                torch,
                jobs,
                matmul=common["matmul"],
                window=args.window,
                settle=args.settle,
                ceiling=common["ceiling"],
                bidir=common["bidir"],
            )
        except Exception as error:  # report and go on: one variant must not lose the run
            print(f"{variant:<18} {page_kib:>4}Ki ERROR {type(error).__name__}: {error}")
            continue
        finally:
            if jobs is not None and not jobs.hung:
                jobs.close()
        row.update(variant=variant, page_kib=page_kib, layers=args.layers, job_bytes=total)
        rows.append(row)
        together = row["together"]
        print(
            f"{variant:<18} {page_kib:>4}Ki {row['matmul_alone_ms']:>6.3f} "
            f"{row['matmul_with_ms']:>7.3f} {100 * row['slowdown']:>+7.1f} "
            f"{row['combined_ratio_alone']:>10.2f} {row['combined_ratio_together']:>9.2f} "
            f"{together['store']['gbps']:>8.1f} ({row['store_ratio_together']:.2f}) "
            f"{together['load']['gbps']:>7.1f} ({row['load_ratio_together']:.2f})",
            flush=True,
        )
    del kv
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    """Run the sweep; print the table and the target lines; write JSON when asked."""
    args = _parser().parse_args()
    torch = cuda_torch("interference.py")
    if torch is None:
        return 0
    total = int(args.gib * (1 << 30))
    ceiling = _ceiling(torch, total, 3)
    bidir = _bidirectional_ceiling(torch, total, args.window * 2)
    matmul = _Matmul(torch, args.matmuls, args.warmup_matmuls, priority=args.matmul_priority)
    matmul.alone()  # warm-up (cuBLAS heuristics, clocks)
    device = torch.cuda.get_device_name()
    print(f"device: {device}")
    print(
        f"ceilings (contiguous pinned copy, {args.gib} GiB): store D2H {ceiling['store']:.1f} "
        f"GB/s, load H2D {ceiling['load']:.1f} GB/s, both at once {bidir:.1f} GB/s"
    )
    header = (
        f"{'variant':<18} {'page':>6} {'mm ms':>6} {'mm+x ms':>7} {'slow %':>7} "
        f"{'comb alone':>10} {'comb with':>9} {'store GB/s (r)':>15} {'load GB/s (r)':>14}"
    )
    print(header)
    print("-" * len(header))
    rows: list[dict[str, Any]] = []
    pages = [int(p) for p in args.pages_kib.split(",")]
    for page_kib in pages:
        rows += _run_page(
            torch, args, page_kib, total=total, matmul=matmul, ceiling=ceiling, bidir=bidir
        )
    print("GPU during the matmul loop (nvidia-smi every 50 ms, medians): alone -> with transfers")
    for row in rows:
        alone, with_ = row["gpu_alone"], row["gpu_with"]
        print(
            f"{row['variant']:<18} {row['page_kib']:>4}Ki SM {alone['sm_mhz']:>6.0f} -> "
            f"{with_['sm_mhz']:>6.0f} MHz, power {alone['power_w']:>5.0f} -> "
            f"{with_['power_w']:>5.0f} W, limit reasons with: {' '.join(with_['limit_reasons'])}"
        )
    alone_ms = [r["matmul_alone_ms"] for r in rows]
    spread = (max(alone_ms) - min(alone_ms)) / statistics.median(alone_ms)
    print(
        f"matmul alone over the run: median {statistics.median(alone_ms):.3f} ms, "
        f"spread {100 * spread:.1f} % (max - min over median; the noise floor of 'slow %')"
    )
    lines = _target_lines(rows, pages)
    for line in lines:
        print(line)
    if args.json:
        write_json(
            args.json,
            {
                "device": device,
                "args": vars(args),
                "ceiling_gbps": {**ceiling, "bidirectional": bidir},
                "results": rows,
                "summary": lines,
            },
        )
    if args.png and args.json:
        from kvferry.adapters.bench import plot_interference

        plot_interference(Path(args.json), Path(args.png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
