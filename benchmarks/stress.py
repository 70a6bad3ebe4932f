"""Stress: 10 000 requests and over 100 000 jobs through the session and the cpu executor.

Needs no GPU. An engine loop keeps `--live` requests in flight: it admits new ones (lookup, and
a load of a prefix another request stored), prefills them `--step-tokens` tokens a step (store
jobs), reports the results every step and finishes the requests that are done; the CPU tier is
small enough that it evicts all the time. It prints jobs/s, the executor's share of the time,
peak RSS and RSS sampled along the run, and one PASS/FAIL line per bar.

    kvferry bench stress                    # 10 000 requests
    kvferry bench stress --requests 2000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs
import numpy as np

from kvferry.adapters.session import OffloadSession, RunningRequest
from kvferry.benchmarks.common import (
    add_common_options,
    bar_line,
    bar_result,
    finish_axis,
    measured_on,
    measured_on_line,
    output_paths,
    positive_int,
    pyplot,
    save_plot,
    write_json,
)
from kvferry.core.blocks import GroupBlocks
from kvferry.core.bound import BoundPlan
from kvferry.core.catalog import Catalog, CatalogConfig
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.eviction import EvictionPolicyKind
from kvferry.core.layout import TensorLayout
from kvferry.executors import KVTensor, make_executor

NAME = "stress"
HASH_BLOCK = 16
CONFIG = OffloadConfig(
    hash_block_size=HASH_BLOCK,
    blocks_per_chunk=2,
    groups=(
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),
        GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=32, sliding_window=128),
    ),
)
PAGE_BYTES = 256
NUM_BLOCKS = 8192
FLAT_LIMIT_BYTES = 16 << 20
"""Largest RSS growth allowed across the second half of the run (flatness threshold)."""
JOBS_BAR = 100_000
"""Jobs a run must reach to be long enough to judge its memory."""


def _rss_bytes() -> int:
    """Return the process's resident set size now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _peak_rss_bytes() -> int:
    """Return the peak RSS from getrusage (KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _hashes(count: int, family: int, shared: int) -> list[bytes]:
    out, prev = [], b"stress"
    for i in range(count):
        tag = b"common" if i < shared else family.to_bytes(8, "big")
        prev = hashlib.blake2b(prev + tag, digest_size=16).digest()
        out.append(prev)
    return out


@attrs.define
class _Live:
    rid: str
    hashes: list[bytes]
    num_tokens: int
    blocks: list[list[int]]
    computed: int = 0
    loading: int | None = None


class Stress:
    """An engine loop: admit (lookup + load), prefill in steps (stores), finish, report."""

    def __init__(self, *, requests: int, live: int, step_tokens: int, rows: int, seed: int):
        self.rng = np.random.default_rng(seed)
        self.requests, self.live_limit, self.step_tokens = requests, live, step_tokens
        self.caches = [
            np.zeros((NUM_BLOCKS, PAGE_BYTES), dtype=np.uint8) for _ in range(len(CONFIG.groups))
        ]
        self.executor = make_executor(
            "cpu",
            kv_caches=[[KVTensor(tensor=c, layout=TensorLayout.MLA)] for c in self.caches],
            blocks_per_chunk=CONFIG.blocks_per_chunk,
            num_rows=rows,
        )
        catalog = Catalog(CatalogConfig(capacity_rows=rows, policy=EvictionPolicyKind.LRU))
        self.session = OffloadSession(
            CONFIG, catalog, layout_fingerprint=self.executor.layout.fingerprint
        )
        self.free = [deque(range(1, NUM_BLOCKS)) for _ in CONFIG.groups]
        self.live: dict[str, _Live] = {}
        self.fenced: dict[str, list[list[int]]] = {}
        self.arrived = self.finished = 0
        self.jobs = {"load": 0, "store": 0, "failed": 0}
        self.issued: set[int] = set()
        self.load_of: dict[int, str] = {}
        self.copy_seconds = 0.0
        """Time inside the executor (submit and poll), the reference the total is compared to."""

    def _arrive(self) -> None:
        n = self.arrived
        self.arrived += 1
        family = int(self.rng.integers(0, 1 << 30))
        shared = int(self.rng.integers(0, 20)) if self.rng.random() < 0.4 else 0
        count = int(self.rng.integers(20, 40))
        hashes = _hashes(count, family, shared)
        num_tokens = count * HASH_BLOCK + int(self.rng.integers(0, HASH_BLOCK))
        rid = f"q{n}"
        found = self.session.lookup(
            rid, block_hashes=hashes, num_tokens=num_tokens, num_computed_tokens=0
        )
        blocks = [
            [self.free[g].popleft() for _ in range(-(-num_tokens // spec.block_size))]
            for g, spec in enumerate(CONFIG.groups)
        ]
        request = _Live(rid=rid, hashes=hashes, num_tokens=num_tokens, blocks=blocks)
        self.live[rid] = request
        if found.tokens:
            job = self.session.start_load(
                rid,
                [GroupBlocks.of(ids) for ids in blocks],
                num_computed_tokens=0,
                hit_tokens=found.tokens,
            )
            if job is not None:
                self._submit(job)
                self.issued.add(job.job_id)
                self.jobs["load"] += 1
                self.load_of[job.job_id] = rid
                request.loading = found.tokens

    def _submit(self, job: BoundPlan) -> None:
        start = time.perf_counter()
        self.executor.submit(job)
        self.copy_seconds += time.perf_counter() - start

    def _step(self) -> None:
        running = []
        for request in self.live.values():
            if request.loading is None and request.computed < request.num_tokens:
                scheduled = min(self.step_tokens, request.num_tokens - request.computed)
                running.append((request, scheduled))
        step = self.session.start_stores(
            RunningRequest(
                request_id=r.rid,
                blocks=[GroupBlocks.of(ids) for ids in r.blocks],
                num_computed_tokens=r.computed,
                num_scheduled_tokens=n,
                num_tokens=r.num_tokens,
                block_hashes=r.hashes,
            )
            for r, n in running
        )
        for request, scheduled in running:
            request.computed += scheduled
        for job in step.jobs:
            self._submit(job)
            self.issued.add(job.job_id)
            self.jobs["store"] += 1

    def _report(self) -> None:
        start = time.perf_counter()
        results = self.executor.poll()
        self.copy_seconds += time.perf_counter() - start
        report = self.session.report(0, results)
        self.issued.difference_update(report.completed)
        self.jobs["failed"] += len(report.failed)
        failed = set(report.failed)
        for job_id in report.completed:
            rid = self.load_of.pop(job_id, None)
            if rid is not None and rid in self.live:
                request = self.live[rid]
                hit = request.loading or 0
                request.computed, request.loading = (0 if job_id in failed else hit), None
        for rid in report.released:
            for g, ids in enumerate(self.fenced.pop(rid)):
                self.free[g].extend(ids)

    def _finish_done(self) -> None:
        for rid in [r.rid for r in self.live.values() if r.computed >= r.num_tokens]:
            request = self.live.pop(rid)
            waiting = self.session.finish(rid)
            if waiting:
                self.fenced[rid] = request.blocks
            else:
                for g, ids in enumerate(request.blocks):
                    self.free[g].extend(ids)
            self.finished += 1

    def run(self) -> dict[str, Any]:
        """Serve every request; return the seconds it took ("elapsed_s") and the RSS sampled
        every 2.5 % of the requests ("samples": finished requests, bytes)."""
        samples: list[tuple[int, int]] = []
        every = max(1, self.requests // 40)
        start = time.perf_counter()
        while self.finished < self.requests:
            while len(self.live) < self.live_limit and self.arrived < self.requests:
                self._arrive()
            self._report()  # loads finish within submit on the cpu executor
            self._step()
            self._report()
            self._finish_done()
            if self.finished // every > len(samples) - 1 or not samples:
                samples.append((self.finished, _rss_bytes()))
        elapsed = time.perf_counter() - start
        self.executor.close()
        return {"elapsed_s": elapsed, "samples": samples}


def plot(results: Path, png: Path, *, log: TextIO | None = None) -> Path | None:
    """Draw RSS against finished requests from this benchmark's JSON, with the second half's
    allowed growth; return the PNG's path, or None (said on `log`) without matplotlib."""
    plt = pyplot(log)
    if plt is None:
        return None
    data: dict[str, Any] = json.loads(results.read_text(encoding="utf-8"))
    mib = 1 << 20
    samples = [(int(done), int(rss)) for done, rss in data.get("rss_samples", [])]
    figure, axis = plt.subplots(figsize=(7, 4.5))
    axis.plot([d for d, _ in samples], [r / mib for _, r in samples], marker=".", label="RSS")
    half = [r for d, r in samples if d >= int(data.get("requests", 0)) // 2]
    finish_axis(axis, xlabel="requests finished", ylabel="RSS (MiB)", log2_x=False)
    if half:
        limit = (half[0] + FLAT_LIMIT_BYTES) / mib
        axis.axhline(limit, color="grey", linewidth=0.8, linestyle="--")
        axis.annotate("the bar: the second half's start + 16 MiB", (0, limit), fontsize=7)
        axis.set_ylim(top=1.1 * limit)
    measured = data.get("measured_on", {})
    return save_plot(
        plt,
        figure,
        png,
        f"kvferry stress, CPU {measured.get('cpu', '')}, {measured.get('date', '')}\n"
        f"{data.get('requests', '?')} requests, {data.get('jobs_total', '?')} jobs, "
        f"{float(data.get('jobs_per_s', 0)):,.0f} jobs/s",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the stress loop; print the rates, the memory and the bars; write the JSON and the PNG
    under `--out`; return 0."""
    parser = argparse.ArgumentParser(
        prog=f"kvferry bench {NAME}", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--requests", type=positive_int, default=None, help="default 10000")
    parser.add_argument("--live", type=positive_int, default=48, help="requests in flight at once")
    parser.add_argument(
        "--step-tokens", type=positive_int, default=32, help="prefill tokens per step"
    )
    parser.add_argument(
        "--rows",
        type=positive_int,
        default=4096,
        help="CPU-tier rows of each group (one chunk each)",
    )
    parser.add_argument("--seed", type=int, default=0)
    add_common_options(parser, quick="a short run: 500 requests (too few jobs to judge memory)")
    args = parser.parse_args(argv)
    requests = args.requests or (500 if args.quick else 10_000)

    info = measured_on()
    print(measured_on_line(info))
    rss_start = _rss_bytes()
    stress = Stress(
        requests=requests,
        live=args.live,
        step_tokens=args.step_tokens,
        rows=args.rows,
        seed=args.seed,
    )
    out = stress.run()
    jobs = stress.jobs["load"] + stress.jobs["store"]
    elapsed = out["elapsed_s"]
    samples = out["samples"]
    second_half = [rss for done, rss in samples if done >= requests // 2]
    growth = max(second_half) - second_half[0] if second_half else 0
    counters = stress.session.counters()
    mib = 1 << 20
    print(
        f"requests {requests}  jobs {jobs} "
        f"(loads {stress.jobs['load']}, stores {stress.jobs['store']}, "
        f"failed {stress.jobs['failed']})"
    )
    print(
        f"catalog: hits {counters.hits}  stores {counters.stores}  evictions {counters.evictions}"
        "  rows per group "
        + ", ".join(
            f"{used}/{capacity}"
            for used, capacity in zip(
                counters.group_rows_used, counters.group_capacity_rows, strict=True
            )
        )
    )
    copy_s = stress.copy_seconds
    print(
        f"elapsed {elapsed:.1f} s  ->  {jobs / elapsed:,.0f} jobs/s, "
        f"{requests / elapsed:,.0f} requests/s; executor submit+poll {copy_s:.1f} s "
        f"= {copy_s / elapsed:.2f} of the run (the rest: session, planner, this loop)"
    )
    print(
        f"RSS: start {rss_start / mib:.1f} MiB  peak (getrusage) {_peak_rss_bytes() / mib:.1f} MiB"
        f"  second half {second_half[0] / mib:.1f} -> {second_half[-1] / mib:.1f} MiB"
        f" (max growth {growth / mib:.2f} MiB over {len(second_half)} samples)"
    )
    print(
        "RSS samples (finished requests: MiB): "
        + ", ".join(
            f"{done}: {rss / mib:.1f}" for done, rss in samples[:: max(1, len(samples) // 10)]
        )
    )
    in_flight = len(stress.session.in_flight())
    verdicts = [
        bar_result(
            jobs >= JOBS_BAR,
            f"the run is long enough to judge its memory: >= {JOBS_BAR} jobs",
            f"{jobs} jobs",
        ),
        bar_result(
            not stress.issued and not in_flight,
            "no job lost: every job issued was reported",
            f"in flight {in_flight}, unreported {len(stress.issued)}",
        ),
        bar_result(
            growth <= FLAT_LIMIT_BYTES,
            f"memory flat: RSS grows <= {FLAT_LIMIT_BYTES // mib} MiB across the second half",
            f"{growth / mib:.2f} MiB",
        ),
    ]
    for verdict in verdicts:
        print(bar_line(verdict["passed"], verdict["bar"], verdict["measured"]))
    json_path, png_path = output_paths(args.out, NAME)
    write_json(
        json_path,
        {
            "measured_on": info,
            "requests": requests,
            "jobs": stress.jobs,
            "jobs_total": jobs,
            "elapsed_s": elapsed,
            "jobs_per_s": jobs / elapsed,
            "executor_share": copy_s / elapsed,
            "peak_rss_bytes": _peak_rss_bytes(),
            "rss_samples": samples,
            "second_half_growth_bytes": growth,
            "bars": verdicts,
        },
    )
    drawn = plot(json_path, png_path)
    print(f"wrote {json_path}" + (f" and {drawn}" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
