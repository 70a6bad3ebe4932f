"""Stress: 10 000 requests and >= 100 000 jobs through the session and the cpu executor.

A benchmark, never part of the test suite: it prints jobs/s, peak RSS, RSS sampled along the
run, and PASS/FAIL lines (job count, nothing lost, memory flat across the second half).

    python3 benchmarks/stress.py            # defaults: 10 000 requests
    python3 benchmarks/stress.py --requests 2000 --json bench-out/stress.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import time
from collections import deque
from typing import Any

import attrs
import numpy as np

from kvferry.adapters.session import OffloadSession, RunningRequest
from kvferry.core.blocks import GroupBlocks
from kvferry.core.bound import BoundPlan
from kvferry.core.catalog import Catalog, CatalogConfig
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.eviction import EvictionPolicyKind
from kvferry.core.layout import TensorLayout
from kvferry.executors import KVTensor, make_executor

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--live", type=int, default=48, help="requests in flight at once")
    parser.add_argument("--step-tokens", type=int, default=32, help="prefill tokens per step")
    parser.add_argument("--rows", type=int, default=4096, help="CPU-tier rows (one chunk each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    rss_start = _rss_bytes()
    stress = Stress(
        requests=args.requests,
        live=args.live,
        step_tokens=args.step_tokens,
        rows=args.rows,
        seed=args.seed,
    )
    out = stress.run()
    jobs = stress.jobs["load"] + stress.jobs["store"]
    elapsed = out["elapsed_s"]
    samples = out["samples"]
    second_half = [rss for done, rss in samples if done >= args.requests // 2]
    growth = max(second_half) - second_half[0] if second_half else 0
    counters = stress.session.counters()
    mib = 1 << 20
    print(
        f"requests {args.requests}  jobs {jobs} "
        f"(loads {stress.jobs['load']}, stores {stress.jobs['store']}, "
        f"failed {stress.jobs['failed']})"
    )
    print(
        f"catalog: hits {counters.hits}  stores {counters.stores}  evictions {counters.evictions}"
        f"  rows {counters.rows_used}/{counters.capacity_rows}"
    )
    copy_s = stress.copy_seconds
    print(
        f"elapsed {elapsed:.1f} s  ->  {jobs / elapsed:,.0f} jobs/s, "
        f"{args.requests / elapsed:,.0f} requests/s; executor submit+poll {copy_s:.1f} s "
        f"= {copy_s / elapsed:.2f} of the run (the rest: session, planner, this driver)"
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
    checks = [
        (f"jobs >= 100000 (got {jobs})", jobs >= 100_000),
        (
            f"no job lost: every issued job reported (in flight {len(stress.session.in_flight())},"
            f" unreported {len(stress.issued)})",
            not stress.issued and not stress.session.in_flight(),
        ),
        (
            f"memory flat across the second half: RSS growth {growth / mib:.2f} MiB"
            f" <= {FLAT_LIMIT_BYTES / mib:.0f} MiB",
            growth <= FLAT_LIMIT_BYTES,
        ),
    ]
    for text, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {text}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(
                {
                    "requests": args.requests,
                    "jobs": stress.jobs,
                    "elapsed_s": elapsed,
                    "jobs_per_s": jobs / elapsed,
                    "peak_rss_bytes": _peak_rss_bytes(),
                    "rss_samples": samples,
                    "second_half_growth_bytes": growth,
                    "checks": {text: ok for text, ok in checks},
                },
                handle,
                indent=2,
            )


if __name__ == "__main__":
    main()
