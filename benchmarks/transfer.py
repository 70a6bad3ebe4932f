"""Transfer: GB/s per executor, direction and page size, against a contiguous pinned copy.

Needs a CUDA GPU; without one it says so and exits 3 (`EXIT_SKIPPED`).

Per page size and executor it stores and loads jobs of `--gib` GiB (32 layers of blocks-first
pages, one block per chunk): random GPU block ids, and CPU rows as a fresh kvferry `Catalog`
gives one job (`--rows random`: a fragmented tier, one link copy per row). GB/s is bytes over
the host time from `submit()` to the end of `wait()` (planning, uploads and every queued call
included), the median of `--repeat` jobs after a warm-up, against a contiguous pinned copy of
the same size measured in the same run. The time inside `submit()` is the calling thread's CPU
time (`time.thread_time`); the wall clock is printed beside it.

    kvferry bench transfer --variants torch,cupy

`--model llama,gpt-oss,jamba,mla,cross-layer,synthetic` measures instead the KV caches of a
model laid out as vLLM's allocator lays them out (`kvferry.benchmarks.engine_layouts`): per
group (page kind) and direction, jobs of `--gib` GiB of that group's blocks, each checked byte
for byte on a sample of blocks after a store and load, and one PASS/FAIL line per bar.

`--gpus N` runs the same transfer on N GPUs at once, one worker process per GPU
(`kvferry.adapters.workers`: the scheduler side sends each bound plan to every rank as message
bytes and waits for all of them), and prints the aggregate GB/s against N x the single-GPU
ceiling (rank 0's contiguous pinned copy, measured alone in the same run). With fewer GPUs than
N it still runs N processes, ranks sharing GPUs round-robin, and says SHARED on every line: such
a number is not a multi-GPU measurement. `--gpus N --variants cpu` runs the plumbing on host
memory (the "ceiling" is then a host memcpy), for machines without a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import attrs
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
    positive_float,
    positive_int,
    pyplot,
    save_plot,
    write_json,
)
from kvferry.benchmarks.engine_layouts import (
    MODELS,
    EngineView,
    Model,
    data_regions,
    engine_model,
    group_block_bytes,
    kv_caches,
)
from kvferry.core.bound import BoundPlan
from kvferry.core.catalog import Catalog, CatalogConfig
from kvferry.core.keys import OffloadKey
from kvferry.core.layout import TensorLayout
from kvferry.core.plan import Direction, TransferPlan
from kvferry.executors import CopyPath, KVTensor, make_executor

# `kvferry.adapters.workers` is imported by the `--gpus` path only.

NAME = "transfer"
KIB = 1024
RATIO_BAR = 0.92
"""Each direction's GB/s over the contiguous pinned copy's, at every page size."""
SUBMIT_SHARE_BAR = 0.05
"""The CPU time inside `submit()` over the job's time."""
SUBMIT_2048_BAR_US = 200
"""The CPU time inside `submit()` of a 2048-block x 32-layer load, in µs."""
SUBMIT_2048_REPEAT = 15
"""At least this many 2048-block loads per median: each is short, so more samples cost little,
and a median of three moved by 100 µs or more between runs on an H200's host."""
DEFAULT_PAGES = "4,8,16,28,32,64,256,2048"
QUICK_PAGES = "16,256"
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "torch": ("torch", {}),
    "cupy": ("cupy", {"copy_path": CopyPath.STAGED}),
    "cupy-zero-copy": ("cupy", {"copy_path": CopyPath.ZERO_COPY}),
    "torch-thread": ("torch", {"submit_thread": True}),
    "cupy-thread": ("cupy", {"copy_path": CopyPath.STAGED, "submit_thread": True}),
    "cpu": ("cpu", {}),
}
"""Variant name -> (executor name, executor options). `-thread`: with the submission thread;
`cpu` is for `--gpus` dry runs only."""


def bench_kv_caches(
    torch: Any, layers: int, page: int, total: int, device: str = "cuda"
) -> tuple[int, int, list[list[KVTensor]]]:
    """Return (blocks moved per job, blocks per tensor, the KV caches): `layers` blocks-first
    tensors of random bytes with `page`-byte pages, twice as many blocks as a job of `total`
    bytes moves (so random block ids leave gaps)."""
    moved = -(-total // (layers * page))
    num_blocks = 2 * moved
    tensors = [
        torch.empty((num_blocks, 2, page // 2), dtype=torch.uint8, device=device)
        for _ in range(layers)
    ]
    for tensor in tensors:
        tensor.random_(0, 255)
    return (
        moved,
        num_blocks,
        [[KVTensor(tensor=t, layout=TensorLayout.BLOCKS_FIRST) for t in tensors]],
    )


def pinned_copy_gbps(torch: Any, nbytes: int, repeat: int) -> dict[str, float]:
    """Return GB/s of one contiguous pinned copy of `nbytes`, each way ("store": GPU to CPU,
    "load": CPU to GPU), the median of `repeat` timed with CUDA events after one untimed."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.random_(0, 255)
    out = {}
    for name, dst, src in (("store", host, device), ("load", device, host)):
        times = []
        for _ in range(repeat + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        out[name] = nbytes / statistics.median(times[1:]) / 1e9
    return out


def bound_plan(job: int, direction: Direction, ids: np.ndarray, rows: np.ndarray) -> BoundPlan:
    """Return job `job`: one group, one block per chunk, the GPU blocks `ids` to or from the CPU
    rows `rows`."""
    plan = TransferPlan(
        request_id=f"bench{job}",
        direction=direction,
        blocks_per_chunk=1,
        keys=[OffloadKey(0, int(i).to_bytes(8, "little")) for i in range(len(ids))],
        gpu_block_ids=ids,
        group_sizes=[len(ids)],
        block_indices=[0],
    )
    return BoundPlan(job_id=job, plan=plan, cpu_rows=rows)


def catalog_rows(moved: int) -> np.ndarray:
    """Return the CPU rows a fresh kvferry `Catalog` gives a job of `moved` chunks: what a
    prefix stored by one job (and loaded back by one) occupies in a tier that is not yet full."""
    keys = [OffloadKey(0, i.to_bytes(8, "little")) for i in range(moved)]
    reservation = Catalog(CatalogConfig(capacity_rows=moved)).reserve(keys)
    if reservation is None:
        raise RuntimeError("a fresh catalog had no room")
    return np.asarray(reservation.rows, dtype=np.int64)


class Measured(NamedTuple):
    """Medians over a run of jobs, in seconds, the first job (a warm-up) left out."""

    total: float
    """From `submit()` to the end of `wait()`."""
    submit: float
    """Inside `submit()`, on the wall clock."""
    gpu: float
    """The job's GPU events (its first to its last queued operation)."""
    submit_cpu: float
    """Inside `submit()`, the calling thread's CPU time (`time.thread_time`): the wall clock's
    share without the time the thread was not running."""


def _measure(executor: Any, bounds: list[BoundPlan]) -> Measured:
    """Return the medians of `bounds` submitted one by one, each waited for before the next."""
    totals, submits, gpu, cpu = [], [], [], []
    for bound in bounds:
        cpu_start = time.thread_time()
        start = time.perf_counter()
        executor.submit(bound)
        submitted = time.perf_counter()
        cpu.append(time.thread_time() - cpu_start)
        (result,) = executor.wait([bound.job_id])
        end = time.perf_counter()
        if not result.success:
            raise RuntimeError(result.error)
        totals.append(end - start)
        submits.append(submitted - start)
        gpu.append(result.seconds)
    return Measured(*(statistics.median(column[1:]) for column in (totals, submits, gpu, cpu)))


# -- --gpus N: the same transfer on N GPUs at once, one worker process per GPU -----------------


def _start_at(when: float | None) -> None:
    """Sleep until the wall-clock time `when` (ranks start a concurrent copy together)."""
    if when is not None:
        time.sleep(max(when - time.time(), 0.0))


def _pinned_copy_window(
    torch: Any, direction: str, nbytes: int, repeat: int, start_at: float | None
) -> dict[str, float]:
    """Copy `nbytes` contiguously `repeat` times one way on this process's GPU, from
    `start_at` on; return the wall-clock window (for aggregates across processes) and the
    median CUDA-event time."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.random_(0, 255)
    dst, src = (host, device) if direction == "store" else (device, host)
    dst.copy_(src, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    times = []
    _start_at(start_at)
    dst.copy_(src, non_blocking=True)  # after the idle wait, one more untimed copy
    torch.cuda.synchronize()
    start_wall = time.time()
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    end_wall = time.time()
    del host, device
    torch.cuda.empty_cache()
    return {"start": start_wall, "end": end_wall, "median": statistics.median(times)}


def _memcpy_window(
    direction: str, nbytes: int, repeat: int, start_at: float | None
) -> dict[str, float]:
    """The `cpu` variant's stand-in for the pinned copy: a host memcpy, timed the same way."""
    del direction
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    _start_at(start_at)
    np.copyto(dst, src)  # after the idle wait, one more untimed copy
    start_wall = time.time()
    for _ in range(repeat):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return {"start": start_wall, "end": time.time(), "median": statistics.median(times)}


@attrs.frozen(kw_only=True)
class BenchShard:
    """One rank of the `--gpus` benchmark: `layers` blocks-first tensors of `num_blocks` pages
    on GPU `rank % device count` (host arrays for the `cpu` variant), an executor over them with
    `num_rows` rows, and a `ceiling` command (a contiguous copy, or nothing for payload None)."""

    variant: str
    page_bytes: int
    layers: int
    num_blocks: int
    num_rows: int
    staging_bytes: int | None = None

    def __call__(self, rank: int, world_size: int) -> Any:
        """Build rank `rank`'s shard (runs inside its worker process)."""
        from kvferry.adapters.workers import WorkerShard

        name, options = VARIANTS[self.variant]
        if self.staging_bytes is not None and name != "cpu":
            options = {**options, "staging_bytes": self.staging_bytes}
        shape = (self.num_blocks, 2, self.page_bytes // 2)
        torch: Any = None
        if name == "cpu":
            tensors: list[Any] = [
                np.random.default_rng([rank, layer]).integers(0, 255, shape, dtype=np.uint8)
                for layer in range(self.layers)
            ]
        else:
            import torch

            torch.cuda.set_device(rank % torch.cuda.device_count())
            tensors = [
                torch.empty(shape, dtype=torch.uint8, device="cuda") for _ in range(self.layers)
            ]
            for tensor in tensors:
                tensor.random_(0, 255)
        kv = [[KVTensor(tensor=t, layout=TensorLayout.BLOCKS_FIRST) for t in tensors]]
        executor = make_executor(
            name, kv_caches=kv, blocks_per_chunk=1, num_rows=self.num_rows, **options
        )

        def ceiling(payload: dict[str, Any] | None) -> dict[str, float] | None:
            if payload is None:
                return None
            if torch is None:
                return _memcpy_window(**payload)
            return _pinned_copy_window(torch, **payload)

        return WorkerShard(executor=executor, handlers={"ceiling": ceiling})


def _gpu_note(gpus: int, devices: list[str]) -> str:
    distinct = sorted(set(devices))
    where = ", ".join(f"rank {r}: {d}" for r, d in enumerate(devices))
    if len(distinct) < gpus:
        return (
            f"SHARED: {gpus} processes on {len(distinct)} device(s) ({where}); fewer GPUs than "
            f"--gpus {gpus}, so ranks share them: this is not a {gpus}-GPU measurement"
        )
    return f"{gpus} processes on {gpus} GPUs ({where})"


def _ceilings(pool: Any, gpus: int, nbytes: int, repeat: int) -> dict[str, dict[str, float]]:
    """Return, per direction, rank 0's ceiling alone and every rank's at once (aggregate), both
    as bytes over the wall-clock window of `repeat` back-to-back copies."""
    out: dict[str, dict[str, float]] = {}
    for direction in ("store", "load"):
        payload: dict[str, Any] = {"direction": direction, "nbytes": nbytes, "repeat": repeat}
        (alone, *_) = pool.call_each(
            "ceiling", [{**payload, "start_at": None}] + [None] * (gpus - 1)
        )
        # every rank allocates and warms up, then all start at the same wall-clock second
        together = pool.call("ceiling", {**payload, "start_at": time.time() + 2.0})
        window = max(w["end"] for w in together) - min(w["start"] for w in together)
        out[direction] = {
            "single": repeat * nbytes / (alone["end"] - alone["start"]) / 1e9,
            "together": gpus * repeat * nbytes / window / 1e9,
        }
    return out


def run_multi_gpu(args: argparse.Namespace, torch: Any) -> dict[str, Any]:
    """The `--gpus N` benchmark: one worker process per rank, the same bound plans broadcast to
    every rank; aggregate GB/s = N x bytes per rank / (host time from the broadcast to the
    last rank's end), against N x the single-GPU ceiling measured in the same run. Return the
    results as the JSON holds them."""
    from kvferry.adapters.workers import WorkerPool

    gpus = args.gpus
    total = int(args.gib * (1 << 30))
    rng = np.random.default_rng(0)
    ceiling: dict[str, dict[str, float]] | None = None
    note = ""
    rows_out: list[dict[str, Any]] = []
    for page_kib in args.pages_kib:
        page = page_kib * KIB
        moved = -(-total // (args.layers * page))
        num_blocks = 2 * moved
        for variant in args.variants:
            shard = BenchShard(
                variant=variant,
                page_bytes=page,
                layers=args.layers,
                num_blocks=num_blocks,
                num_rows=moved,
                staging_bytes=None if args.staging_mib is None else args.staging_mib << 20,
            )
            with WorkerPool(shard, gpus) as pool:
                if ceiling is None:
                    note = _gpu_note(gpus, [info.device for info in pool.infos])
                    print(note)
                    ceiling = _ceilings(pool, gpus, total, args.repeat)
                    copy_name = "host memcpy" if variant == "cpu" else "contiguous pinned copy"
                    for way, label in (("store", "D2H"), ("load", "H2D")):
                        c = ceiling[way]
                        print(
                            f"ceiling {way} {label} ({copy_name}, {args.gib} "
                            f"GiB): rank 0 alone {c['single']:.1f} GB/s; all {gpus} at once "
                            f"{c['together']:.1f} GB/s aggregate "
                            f"({c['together'] / (gpus * c['single']):.2f} of {gpus} x alone)"
                        )
                    header = (
                        f"{'executor':<15} {'dir':<6} {'page':>8} {'aggr GB/s':>10} "
                        f"{'N x ceil':>9} {'ratio':>6} {'rank GB/s':>10}"
                    )
                    print(header)
                    print("-" * len(header))
                for direction in (Direction.STORE, Direction.LOAD):
                    totals, ranks = [], []
                    for job in range(args.repeat + 1):
                        bound = bound_plan(
                            job + 1,
                            direction,
                            rng.choice(num_blocks, size=moved, replace=False),
                            catalog_rows(moved),
                        )
                        bound = attrs.evolve(bound, layout_fingerprint=pool.layout_fingerprint)
                        start = time.perf_counter()
                        done = [*pool.submit([bound]), *pool.wait([bound.job_id])]
                        totals.append(time.perf_counter() - start)
                        results = [r for c in done for r in c.results]
                        if len(results) != gpus or not all(r.success for r in results):
                            raise RuntimeError(f"job {bound.job_id}: {results}")
                        ranks.append(max(r.seconds for r in results))
                    nbytes = moved * args.layers * page
                    aggregate = gpus * nbytes / statistics.median(totals[1:]) / 1e9
                    per_rank = nbytes / statistics.median(ranks[1:]) / 1e9
                    reference = gpus * ceiling[direction.value]["single"]
                    ratio = aggregate / reference
                    shared = "  SHARED" if note.startswith("SHARED") else ""
                    print(
                        f"{variant:<15} {direction.value:<6} {page_kib:>6}Ki {aggregate:>10.1f} "
                        f"{reference:>9.1f} {ratio:>6.2f} {per_rank:>10.1f}{shared}",
                        flush=True,
                    )
                    rows_out.append({
                        "executor": variant,
                        "direction": direction.value,
                        "page_bytes": page,
                        "layers": args.layers,
                        "gpus": gpus,
                        "bytes_per_rank": nbytes,
                        "seconds": statistics.median(totals[1:]),
                        "gbps": aggregate,
                        "reference_gbps": reference,
                        "ratio_to_ceiling": ratio,
                        "rank_copy_gbps": per_rank,
                    })  # fmt: skip
    ceilings = ceiling or {}
    return {
        "measured_on": measured_on(torch),
        "gpus": gpus,
        "note": note,
        "jobs": f"{gpus} ranks, {args.layers} layers, random block ids, catalog CPU rows",
        "ceilings": ceilings,
        "ceiling_gbps": {d: gpus * c["single"] for d, c in ceilings.items()},
        "results": rows_out,
    }


# -- one GPU -----------------------------------------------------------------------------------


def _submit_of_2048_block_load(
    torch: Any, variant: str, repeat: int, page: int
) -> dict[str, float]:
    """Return the median seconds inside `submit()` of a 2048-block x 32-layer load (`page`-byte
    pages, catalog rows, random block ids), as the thread's CPU time ("cpu") and on the wall
    clock ("wall")."""
    name, options = VARIANTS[variant]
    moved, num_blocks, kv = bench_kv_caches(torch, 32, page, 2048 * 32 * page)
    rng = np.random.default_rng(1)
    executor = make_executor(name, kv_caches=kv, blocks_per_chunk=1, num_rows=moved, **options)
    try:
        bounds = [
            bound_plan(
                job, Direction.LOAD, rng.choice(num_blocks, moved, False), catalog_rows(moved)
            )
            for job in range(repeat + 1)
        ]
        measured = _measure(executor, bounds)
        return {"cpu": measured.submit_cpu, "wall": measured.submit}
    finally:
        executor.close()
        del kv
        torch.cuda.empty_cache()


def _what(row: dict[str, Any]) -> str:
    """Return what a result row measured: a model's group, or a page size."""
    if "model" in row:
        return f"{row['model']} group {row['group']}, {row['page_kind']}"
    return f"{row['page_bytes'] // KIB} KiB"


def bars(
    rows: list[dict[str, Any]], submit_2048: dict[str, dict[str, float]]
) -> list[dict[str, Any]]:
    """Return the verdict of each bar on the measured rows and 2048-block loads: each direction
    against the pinned copy, the submit's share of a job, and a 2048-block load's submit."""
    out = []
    worst = min(rows, key=lambda r: r["ratio_to_ceiling"])
    per_variant = {
        v: min(r["ratio_to_ceiling"] for r in rows if r["executor"] == v)
        for v in dict.fromkeys(r["executor"] for r in rows)
    }
    out.append(
        bar_result(
            worst["ratio_to_ceiling"] >= RATIO_BAR,
            f"each direction >= {RATIO_BAR} x the contiguous pinned copy of this run, "
            "every executor and page size",
            f"worst {worst['ratio_to_ceiling']:.2f} ({worst['executor']} {worst['direction']} "
            f"{_what(worst)}); per variant "
            + ", ".join(f"{v} {r:.2f}" for v, r in per_variant.items()),
        )
    )
    share = max(rows, key=lambda r: r["submit_cpu_seconds"] / r["seconds"])
    ratio = share["submit_cpu_seconds"] / share["seconds"]
    wall = max(r["submit_seconds"] / r["seconds"] for r in rows)
    out.append(
        bar_result(
            ratio <= SUBMIT_SHARE_BAR,
            f"CPU time inside submit() <= {SUBMIT_SHARE_BAR:.0%} of the job's time, every job",
            f"worst {ratio:.1%} ({share['executor']} {share['direction']} "
            f"{_what(share)}, {share['submit_cpu_seconds'] * 1e3:.2f} of "
            f"{share['seconds'] * 1e3:.2f} ms); on the wall clock worst {wall:.1%}",
        )
    )
    if submit_2048:
        worst_us = max(t["cpu"] for t in submit_2048.values()) * 1e6
        out.append(
            bar_result(
                worst_us <= SUBMIT_2048_BAR_US,
                "CPU time inside submit() of a 2048-block x 32-layer load <= "
                f"{SUBMIT_2048_BAR_US} us (wall clock in brackets)",
                ", ".join(
                    f"{v} {t['cpu'] * 1e6:.0f} us ({t['wall'] * 1e6:.0f})"
                    for v, t in submit_2048.items()
                ),
            )
        )
    return out


def run_one_gpu(args: argparse.Namespace, torch: Any) -> dict[str, Any]:
    """Measure every variant at every page size on this process's GPU; print the table and the
    bars; return the results as the JSON holds them."""
    info = measured_on(torch)
    print(measured_on_line(info))
    total = int(args.gib * (1 << 30))
    ceiling = pinned_copy_gbps(torch, total, args.repeat)
    rng = np.random.default_rng(0)
    rows_out = []
    layout = f"{args.layers} layers, random block ids, {args.rows} CPU rows, {args.gib} GiB jobs"
    print(
        f"ceiling (contiguous pinned copy, {args.gib} GiB): store (GPU to CPU) "
        f"{ceiling['store']:.1f} GB/s, load (CPU to GPU) {ceiling['load']:.1f} GB/s"
    )
    print(f"jobs: {layout}")
    header = (
        f"{'executor':<15} {'dir':<6} {'page':>8} {'GB/s':>7} {'ratio':>6} {'submit ms':>10} "
        f"{'cpu ms':>7} {'GPU GB/s':>9}"
    )
    print(header)
    print("-" * len(header))
    for page_kib in args.pages_kib:
        page = page_kib * KIB
        moved, num_blocks, kv = bench_kv_caches(torch, args.layers, page, total)
        for variant in args.variants:
            name, options = VARIANTS[variant]
            if args.staging_mib is not None:
                options = {**options, "staging_bytes": args.staging_mib << 20}
            executor = make_executor(
                name, kv_caches=kv, blocks_per_chunk=1, num_rows=moved, **options
            )
            try:
                for direction in (Direction.STORE, Direction.LOAD):
                    bounds = [
                        bound_plan(
                            job,
                            direction,
                            rng.choice(num_blocks, size=moved, replace=False),
                            catalog_rows(moved)
                            if args.rows == "catalog"
                            else rng.permutation(moved),
                        )
                        for job in range(args.repeat + 1)
                    ]
                    seconds, submit, gpu_seconds, submit_cpu = _measure(executor, bounds)
                    nbytes = moved * args.layers * page
                    gbps = nbytes / seconds / 1e9
                    ratio = gbps / ceiling[direction.value]
                    print(
                        f"{variant:<15} {direction.value:<6} {page_kib:>6}Ki {gbps:>7.1f} "
                        f"{ratio:>6.2f} {submit * 1e3:>10.2f} {submit_cpu * 1e3:>7.2f} "
                        f"{nbytes / gpu_seconds / 1e9:>9.1f}",
                        flush=True,
                    )
                    rows_out.append({
                        "executor": variant,
                        "direction": direction.value,
                        "page_bytes": page,
                        "layers": args.layers,
                        "rows": args.rows,
                        "bytes": nbytes,
                        "seconds": seconds,
                        "submit_seconds": submit,
                        "submit_cpu_seconds": submit_cpu,
                        "gpu_seconds": gpu_seconds,
                        "gbps": gbps,
                        "ratio_to_ceiling": ratio,
                    })  # fmt: skip
            finally:
                executor.close()
        del kv
        torch.cuda.empty_cache()
    submit_2048 = {
        f"{v} {page_kib} KiB pages": _submit_of_2048_block_load(
            torch, v, max(args.repeat, SUBMIT_2048_REPEAT), page_kib * KIB
        )
        for v in args.variants
        for page_kib in (4, 16)
    }
    verdicts = bars(rows_out, submit_2048)
    for verdict in verdicts:
        print(bar_line(verdict["passed"], verdict["bar"], verdict["measured"]))
    return {
        "measured_on": info,
        "ceiling_gbps": ceiling,
        "jobs": layout,
        "results": rows_out,
        "submit_2048_block_load_seconds": submit_2048,
        "bars": verdicts,
    }


def group_bound(
    job: int,
    direction: Direction,
    *,
    group: int,
    groups: int,
    ids: np.ndarray,
    rows: np.ndarray,
    f: int = 1,
) -> BoundPlan:
    """Return job `job` moving the blocks `ids` of `group` alone (`f` blocks per chunk, whole
    chunks) to or from the CPU rows `rows`."""
    sizes = [0] * groups
    sizes[group] = len(ids)
    plan = TransferPlan(
        request_id=f"bench{job}",
        direction=direction,
        blocks_per_chunk=f,
        keys=[OffloadKey(group, int(i).to_bytes(8, "little")) for i in range(len(rows))],
        gpu_block_ids=ids,
        group_sizes=sizes,
        block_indices=[0] * groups,
    )
    return BoundPlan(job_id=job, plan=plan, cpu_rows=rows)


def _torch_view(torch: Any) -> Any:
    def view(buffer: Any, v: EngineView) -> Any:
        dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}[v.itemsize]
        return buffer.view(dtype).as_strided(v.shape, v.strides, v.offset // v.itemsize)

    return view


def _verify(  # noqa: PLR0917
    torch: Any,
    executor: Any,
    model: Model,
    buffers: list[Any],
    group: int,
    rows: np.ndarray,
    rng: Any,
    job: int,
    f: int,
) -> None:
    """Store 16 blocks to `rows`, load them into 16 other blocks, and compare their data bytes
    (as `engine_layouts.data_regions` states them); raise RuntimeError on a difference."""
    ids = rng.choice(model.num_blocks, size=32, replace=False)
    src, dst = ids[:16], ids[16:]
    groups = len(model.groups)
    for j, (direction, which) in enumerate(((Direction.STORE, src), (Direction.LOAD, dst))):
        bound = group_bound(
            job + j, direction, group=group, groups=groups, ids=which, rows=rows[: 16 // f], f=f
        )
        executor.submit(bound)
        (result,) = executor.wait([bound.job_id])
        if not result.success:
            raise RuntimeError(result.error)
    torch.cuda.synchronize()
    for a, b in zip(src.tolist(), dst.tolist(), strict=True):
        for (buf, s0, n), (_, d0, _) in zip(
            data_regions(model, group, a), data_regions(model, group, b), strict=True
        ):
            if not torch.equal(buffers[buf][s0 : s0 + n], buffers[buf][d0 : d0 + n]):
                raise RuntimeError(f"{model.name} group {group}: block {b} differs from {a}")


def run_models(args: argparse.Namespace, torch: Any, device: str = "cuda") -> dict[str, Any]:
    """Measure every `--model`'s groups with every variant, each direction; print the table
    (ratio per direction and page kind) and the bars; return the results as the JSON holds them.
    `device` "cpu" (with the `cpu` variant) exercises the same steps on the host."""
    info = measured_on(torch)
    print(measured_on_line(info))
    total = int(args.gib * (1 << 30))
    ceiling = pinned_copy_gbps(torch, total, args.repeat)
    print(
        f"ceiling (contiguous pinned copy, {args.gib} GiB): store (GPU to CPU) "
        f"{ceiling['store']:.1f} GB/s, load (CPU to GPU) {ceiling['load']:.1f} GB/s"
    )
    layout = (
        f"vLLM allocator layouts, F = {args.blocks_per_chunk}, random block ids, catalog CPU "
        f"rows per group (each group's rows at its own pitch), {args.gib} GiB jobs"
    )
    print(f"jobs: {layout}")
    header = (
        f"{'model':<12} {'g':>1} {'page kind':<44} {'executor':<12} {'dir':<6} {'GB/s':>6} "
        f"{'ratio':>6} {'submit ms':>9} {'cpu ms':>7}"
    )
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    rows_out: list[dict[str, Any]] = []
    view = _torch_view(torch)
    for name in args.model:
        probe = engine_model(name, 2)
        f = args.blocks_per_chunk
        moved = [  # whole chunks, at least 16 blocks
            max(-(-total // group_block_bytes(probe, g) // f) * f, 16)
            for g in range(len(probe.groups))
        ]
        model = engine_model(name, 2 * max(moved) + 32)
        buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in model.buffer_bytes]
        for buffer in buffers:
            buffer.random_(0, 255)
        kv = kv_caches(model, buffers, view)
        for variant in args.variants:
            executor_name, options = VARIANTS[variant]
            if args.staging_mib is not None:
                options = {**options, "staging_bytes": args.staging_mib << 20}
            executor = make_executor(
                executor_name,
                kv_caches=kv,
                blocks_per_chunk=f,
                num_rows=[m // f for m in moved],  # each group's own rows, at its own pitch
                **options,
            )
            try:
                for g, kind in enumerate(model.page_kinds):
                    rows = catalog_rows(moved[g] // f)
                    _verify(torch, executor, model, buffers, g, rows, rng, 10_000, f)
                    for direction in (Direction.STORE, Direction.LOAD):
                        bounds = [
                            group_bound(
                                job,
                                direction,
                                group=g,
                                groups=len(model.groups),
                                ids=rng.choice(model.num_blocks, size=moved[g], replace=False),
                                rows=rows,
                                f=f,
                            )
                            for job in range(args.repeat + 1)
                        ]
                        seconds, submit, gpu_seconds, submit_cpu = _measure(executor, bounds)
                        nbytes = moved[g] * group_block_bytes(model, g)
                        gbps = nbytes / seconds / 1e9
                        ratio = gbps / ceiling[direction.value]
                        print(
                            f"{name:<12} {g:>1} {kind[:44]:<44} {variant:<12} "
                            f"{direction.value:<6} {gbps:>6.1f} {ratio:>6.2f} "
                            f"{submit * 1e3:>9.2f} {submit_cpu * 1e3:>7.2f}",
                            flush=True,
                        )
                        rows_out.append({
                            "executor": variant,
                            "model": name,
                            "group": g,
                            "page_kind": kind,
                            "blocks_per_chunk": f,
                            "direction": direction.value,
                            "page_bytes": group_block_bytes(model, g),
                            "bytes": nbytes,
                            "seconds": seconds,
                            "submit_seconds": submit,
                            "submit_cpu_seconds": submit_cpu,
                            "gpu_seconds": gpu_seconds,
                            "gbps": gbps,
                            "ratio_to_ceiling": ratio,
                        })  # fmt: skip
            finally:
                executor.close()
        del kv, buffers
        torch.cuda.empty_cache()
    verdicts = bars(rows_out, {})
    for verdict in verdicts:
        print(bar_line(verdict["passed"], verdict["bar"], verdict["measured"]))
    return {
        "measured_on": info,
        "ceiling_gbps": ceiling,
        "jobs": layout,
        "results": rows_out,
        "bars": verdicts,
    }


def plot(results: Path, png: Path, *, log: TextIO | None = None) -> Path | None:
    """Draw GB/s against page size per executor and direction, with the pinned-copy ceilings,
    from this benchmark's JSON; return the PNG's path, or None (said on `log`) when matplotlib
    is not installed."""
    plt = pyplot(log)
    if plt is None:
        return None
    data: dict[str, Any] = json.loads(results.read_text(encoding="utf-8"))
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for row in data.get("results", []):
        key = (str(row["executor"]), str(row["direction"]))
        series.setdefault(key, []).append((int(row["page_bytes"]), float(row["gbps"])))
    figure, axis = plt.subplots(figsize=(8, 5))
    for (executor, direction), points in sorted(series.items()):
        points.sort()
        axis.plot(
            [p / KIB for p, _ in points],
            [g for _, g in points],
            marker="o",
            linestyle="-" if direction == "store" else "--",
            label=f"{executor} {direction}",
        )
    for direction, gbps in data.get("ceiling_gbps", {}).items():
        axis.axhline(float(gbps), color="grey", linewidth=0.8, linestyle=":")
        axis.annotate(f"pinned copy, {direction}: {float(gbps):.1f}", (1, float(gbps)), fontsize=7)
    finish_axis(axis, xlabel="page (KiB)", ylabel="GB/s, submit() to the end of wait()")
    measured = data.get("measured_on", {})
    return save_plot(
        plt,
        figure,
        png,
        f"kvferry transfer, {measured.get('gpu', 'GPU')}, {measured.get('date', '')}\n"
        + str(data.get("jobs", "")),
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"kvferry bench {NAME}",
        description=(__doc__ or "").split("\n\n")[0],
        epilog="Needs a CUDA GPU (except --gpus N --variants cpu); exits 3 without one.",
    )
    parser.add_argument(
        "--variants",
        type=names,
        default=None,
        help="comma-separated, of " + ", ".join(VARIANTS) + " (default torch,cupy)",
    )
    parser.add_argument("--pages-kib", type=kib_list, default=None, help=f"default {DEFAULT_PAGES}")
    parser.add_argument("--layers", type=positive_int, default=32)
    parser.add_argument(
        "--gib", type=positive_float, default=None, help="bytes per job (default 1)"
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=None, help="jobs per median (default 3)"
    )
    parser.add_argument(
        "--staging-mib", type=positive_int, default=None, help="default: the executor's"
    )
    parser.add_argument(
        "--rows",
        choices=("catalog", "random"),
        default="catalog",
        help="CPU rows of a job: as a fresh kvferry Catalog allocates them (default), or a random "
        "permutation (a fragmented tier: one link copy per row)",
    )
    parser.add_argument(
        "--model",
        type=names,
        default=None,
        help="comma-separated, of " + ", ".join(MODELS) + ": measure that model's KV caches as "
        "vLLM's allocator lays them out, per group and direction (instead of the page sweep)",
    )
    parser.add_argument(
        "--blocks-per-chunk",
        type=int,
        choices=(1, 2, 4, 8, 16),
        default=1,
        help="F of the --model jobs: blocks per chunk, one CPU row per chunk (default 1)",
    )
    parser.add_argument(
        "--gpus",
        type=positive_int,
        default=None,
        help="run on N GPUs at once (one process each) and print the aggregate GB/s",
    )
    add_common_options(
        parser, quick=f"a short run: pages {QUICK_PAGES} KiB, 0.25 GiB jobs, median of 1"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep; print the table and the bars; write the JSON and the PNG under `--out`.
    Return 0, or `EXIT_SKIPPED` when there is no CUDA GPU."""
    parser = _parser()
    args = parser.parse_args(argv)
    args.variants = args.variants or ["torch", "cupy"]
    args.pages_kib = args.pages_kib or kib_list(QUICK_PAGES if args.quick else DEFAULT_PAGES)
    args.gib = args.gib or (0.25 if args.quick else 1.0)
    args.repeat = args.repeat or (1 if args.quick else 3)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    unknown = [m for m in args.model or () if m not in MODELS]
    if unknown:
        parser.error(f"--model: unknown {', '.join(unknown)}; known: {', '.join(MODELS)}")
    if args.model and args.gpus is not None:
        parser.error("--model runs on one GPU (no --gpus)")
    on_host = args.variants == ["cpu"]
    if "cpu" in args.variants and (args.gpus is None or not on_host):
        parser.error("--variants cpu: alone, and only with --gpus (a dry run of the processes)")
    torch = None if on_host else cuda_torch(NAME)
    if torch is None and not on_host:
        return EXIT_SKIPPED
    json_path, png_path = output_paths(args.out, NAME)
    run = run_multi_gpu if args.gpus is not None else run_models if args.model else run_one_gpu
    results = run(args, torch)
    write_json(json_path, results)
    drawn = plot(json_path, png_path)
    print(f"wrote {json_path}" + (f" and {drawn}" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
