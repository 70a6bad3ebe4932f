"""A small engine for tests: a session, a catalog and a cpu executor (optionally faulty) over host
"GPU" tensors whose pages hold bytes derived from the chunk key, slot and layer.

Test support only: it checks bytes with plain numpy, independently of the copy expansion.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

from kvferry.adapters.session import CompletionReport, OffloadSession, RunningRequest
from kvferry.core.blocks import GroupBlocks
from kvferry.core.bound import BoundPlan, JobResult
from kvferry.core.catalog import Catalog, CatalogConfig, KeyState
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.eviction import EvictionPolicyKind
from kvferry.core.keys import OffloadKey
from kvferry.core.layout import TensorLayout
from kvferry.executors import KVTensor, make_executor
from kvferry.executors.faults import FaultPoint, FaultyExecutor

Bytes = npt.NDArray[np.uint8]
PAGE = 24
"""Bytes per page of every rig tensor (small, not a power of two)."""
LAYERS = 2
"""Tensors ("layers") per group."""


def page_pattern(key: OffloadKey, slot: int, layer: int) -> Bytes:
    """Return the bytes block `slot` of the chunk `key` holds in `layer` once computed."""
    seed = hashlib.blake2b(
        key.block_hash + bytes([key.group, slot, layer]), digest_size=PAGE
    ).digest()
    return np.frombuffer(seed, dtype=np.uint8)


def junk(seed: int) -> Bytes:
    """Return bytes no computed page holds (a fresh or half-written block)."""
    return np.full(PAGE, 0xA0 + seed % 16, dtype=np.uint8)


def chain(count: int, family: int, shared: int) -> tuple[bytes, ...]:
    """Return `count` chained stand-in hashes; families share their first `shared`."""
    out, prev = [], b"root"
    for i in range(count):
        tag = b"shared" if i < shared else b"f%d" % family
        prev = hashlib.blake2b(prev + tag + i.to_bytes(4, "big"), digest_size=8).digest()
        out.append(prev)
    return tuple(out)


@attrs.define
class RigRequest:
    """One request of the rig: its hashes, blocks and progress."""

    rid: str
    hashes: tuple[bytes, ...]
    num_tokens: int
    blocks: list[list[int]] = attrs.field(factory=list)
    fenced: list[list[int]] = attrs.field(factory=list)
    """Blocks given up (preempted or finished) that jobs in flight still use."""
    computed: int = 0
    phase: str = "waiting"  # waiting | loading | running | done
    load: BoundPlan | None = None


class Rig:
    """Session + catalog + (faulty) cpu executor, and an engine's block tables over them."""

    def __init__(
        self,
        config: OffloadConfig,
        *,
        capacity_rows: int | tuple[int, ...],
        num_blocks: int = 256,
        policy: EvictionPolicyKind = EvictionPolicyKind.LRU,
    ) -> None:
        self.config = config
        self.num_blocks = num_blocks
        self.caches = [
            [np.zeros((num_blocks, PAGE), dtype=np.uint8) for _ in range(LAYERS)]
            for _ in config.groups
        ]
        inner = make_executor(
            "cpu",
            kv_caches=[
                [KVTensor(tensor=t, layout=TensorLayout.MLA) for t in group]
                for group in self.caches
            ],
            blocks_per_chunk=config.blocks_per_chunk,
            num_rows=capacity_rows,
        )
        self.executor = FaultyExecutor(inner)
        self.catalog = Catalog(CatalogConfig(capacity_rows=capacity_rows, policy=policy))
        self.session = OffloadSession(
            config, self.catalog, layout_fingerprint=inner.layout.fingerprint
        )
        self.free = [list(range(num_blocks - 1, 0, -1)) for _ in config.groups]
        self.requests: dict[str, RigRequest] = {}
        self.undelivered: list[JobResult] = []
        self.recomputed: list[tuple[str, int, int]] = []
        self.hits: dict[int, int] = {}
        """Hit tokens of each load job started."""

    # -- the engine's side --------------------------------------------------------------------

    def tokens_per_block(self, group: int) -> int:
        """Return `T_g`."""
        return self.config.groups[group].block_size

    def block_key(self, request: RigRequest, group: int, index: int) -> tuple[OffloadKey, int]:
        """Return the chunk key and slot of block `index` of `group`, when its chunk is complete
        in the request's hashes (else a key of empty hash)."""
        f = self.config.blocks_per_chunk
        step = self.config.hashes_per_chunk(group)
        last = (index // f + 1) * step - 1
        if last < len(request.hashes):
            return OffloadKey(group, request.hashes[last]), index % f
        return OffloadKey(group, b""), index % f

    def compute(self, request: RigRequest, start: int, stop: int) -> None:
        """Write the pages of every block that tokens `[start, stop)` complete or touch."""
        for g in range(self.config.num_groups):
            size = self.tokens_per_block(g)
            for index in range(start // size, -(-stop // size)):
                key, slot = self.block_key(request, g, index)
                for layer in range(LAYERS):
                    self.caches[g][layer][request.blocks[g][index]] = page_pattern(key, slot, layer)

    def allocate(self, request: RigRequest) -> bool:
        """Give the request fresh blocks filled with junk; False when the pool is short."""
        need = [-(-request.num_tokens // self.tokens_per_block(g)) for g in range(len(self.free))]
        if any(len(free) < n for free, n in zip(self.free, need, strict=True)):
            return False
        request.blocks = [[self.free[g].pop() for _ in range(n)] for g, n in enumerate(need)]
        for g, ids in enumerate(request.blocks):
            for layer in range(LAYERS):
                self.caches[g][layer][ids] = junk(layer)
        return True

    def release(self, request: RigRequest, *, fenced: bool = False) -> None:
        """Return the request's blocks (or, with `fenced`, the ones it gave up) to the pool."""
        tables = request.fenced if fenced else [request.blocks]
        for table in tables:
            for g, ids in enumerate(table):
                self.free[g].extend(ids)
        if fenced:
            request.fenced = []
        else:
            request.blocks = []

    def give_up(self, request: RigRequest, waiting: frozenset[int]) -> None:
        """Return the request's blocks now, or once the jobs of `waiting` complete."""
        if waiting:
            request.fenced.append(request.blocks)
            request.blocks = []
        else:
            self.release(request)

    def group_blocks(self, request: RigRequest) -> list[GroupBlocks]:
        """Return the request's block table."""
        return [GroupBlocks.of(ids) for ids in request.blocks]

    def hashes_now(self, request: RigRequest) -> tuple[bytes, ...]:
        """Return the hashes of the request's full hash blocks."""
        return request.hashes[: request.num_tokens // self.config.hash_block_size]

    def running(self, request: RigRequest, scheduled: int) -> RunningRequest:
        """Return the session's input for one step of `request`."""
        return RunningRequest(
            request_id=request.rid,
            blocks=self.group_blocks(request),
            num_computed_tokens=request.computed,
            num_scheduled_tokens=scheduled,
            num_tokens=request.num_tokens,
            block_hashes=self.hashes_now(request),
        )

    def submit(self, jobs: Sequence[BoundPlan]) -> None:
        """Hand jobs to the executor and keep its results until `deliver`."""
        for job in jobs:
            self.executor.submit(job)
        self.undelivered.extend(self.executor.poll())

    def deliver(self, job_ids: Sequence[int] | None = None) -> CompletionReport:
        """Report results (all, or those of `job_ids`) to the session and act on the report."""
        chosen = [r for r in self.undelivered if job_ids is None or r.job_id in job_ids]
        self.undelivered = [r for r in self.undelivered if r not in chosen]
        report = self.session.report(0, chosen)
        failed = set(report.failed)
        for request in list(self.requests.values()):
            job = request.load
            if job is not None and job.job_id in report.completed:
                request.load = None
                if request.phase == "loading":
                    request.phase = "running"
                    if job.job_id not in failed:
                        self.check_loaded(request, job)
                        request.computed = request.computed + self.loaded_tokens(job)
        for redo in report.recompute:
            self.recomputed.append((redo.request_id, redo.start, redo.stop))
        for rid in report.released:
            request = self.requests[rid]
            self.release(request, fenced=True)
            if request.phase == "done":
                del self.requests[rid]
        return report

    def loaded_tokens(self, job: BoundPlan) -> int:
        """Return the hit tokens the load `job` was started for."""
        return self.hits[job.job_id]

    # -- byte checks --------------------------------------------------------------------------

    def check_loaded(self, request: RigRequest, job: BoundPlan) -> None:
        """Raise AssertionError unless every page `job` loaded equals what was stored."""
        plan = job.plan
        for g in range(plan.num_groups):
            first = plan.block_indices[g]
            for k, block in enumerate(plan.gpu_ids_of(g).tolist()):
                key, slot = self.block_key(request, g, first + k)
                for layer in range(LAYERS):
                    got = self.caches[g][layer][block]
                    want = page_pattern(key, slot, layer)
                    if not np.array_equal(got, want):
                        raise AssertionError(
                            f"job {job.job_id} group {g} block {block} layer {layer}: loaded "
                            f"{bytes(got).hex()}, stored {bytes(want).hex()}"
                        )

    def row_pages(self, key: OffloadKey, row: int) -> list[list[Bytes]]:
        """Return the CPU row's pages of `key`'s group: `[slot][layer]`."""
        layout = self.executor.layout
        tier = self.executor.host_tier
        mirrors = [tier.mirror(layout, key.group, layer) for layer in range(LAYERS)]
        return [
            [mirrors[layer][row, slot] for layer in range(LAYERS)]
            for slot in range(self.config.blocks_per_chunk)
        ]

    def check_ready_rows(self) -> None:
        """Raise AssertionError unless every ready key's row holds exactly its chunk's bytes."""
        for key, entry in self.catalog.snapshot().items():
            if entry.state is not KeyState.READY:
                continue
            for slot, layers in enumerate(self.row_pages(key, entry.row)):
                for layer, got in enumerate(layers):
                    if not np.array_equal(got, page_pattern(key, slot, layer)):
                        raise AssertionError(
                            f"ready key {key} row {entry.row} slot {slot} layer {layer} holds "
                            f"{bytes(got).hex()}, not its chunk's bytes"
                        )

    # -- a request's life, step by step --------------------------------------------------------

    def arrive(self, rid: str, hashes: tuple[bytes, ...], extra_tokens: int = 0) -> RigRequest:
        """Add a waiting request of `len(hashes)` hash blocks (+ `extra_tokens`)."""
        num_tokens = len(hashes) * self.config.hash_block_size + extra_tokens
        request = RigRequest(rid=rid, hashes=hashes, num_tokens=num_tokens)
        self.requests[rid] = request
        return request

    def admit(self, request: RigRequest, fault: FaultPoint | None = None) -> BoundPlan | None:
        """Look a waiting request up; unless told to retry, allocate it and start its load
        (failing it at `fault`). Return the load job, if any."""
        found = self.session.lookup(
            request.rid,
            block_hashes=self.hashes_now(request),
            num_tokens=request.num_tokens,
            num_computed_tokens=0,
        )
        if found.retry or not self.allocate(request):
            return None
        request.computed = 0
        request.phase = "running"
        if not found.tokens:
            return None
        job = self.session.start_load(
            request.rid,
            self.group_blocks(request),
            num_computed_tokens=0,
            hit_tokens=found.tokens,
        )
        if job is None:
            return None
        self.hits[job.job_id] = found.tokens
        request.phase = "loading"
        request.load = job
        if fault is not None:
            self.executor.inject(job.job_id, fault)
        self.submit([job])
        return job

    def store_step(
        self,
        schedule: dict[str, int],
        faults: dict[str, FaultPoint] | None = None,
    ) -> list[BoundPlan]:
        """Compute `schedule[rid]` more tokens of each running request and start its stores
        (failing the store of `rid` at `faults[rid]`); return the store jobs."""
        running = []
        for rid, wanted in schedule.items():
            request = self.requests[rid]
            count = min(wanted, request.num_tokens - request.computed)
            self.compute(request, request.computed, request.computed + count)
            running.append((request, count))
        step = self.session.start_stores([self.running(r, n) for r, n in running])
        for request, count in running:
            request.computed += count
        for job in step.jobs:
            point = (faults or {}).get(job.plan.request_id)
            if point is not None:
                self.executor.inject(job.job_id, point)
        self.submit(step.jobs)
        return list(step.jobs)

    def finish(self, rid: str) -> None:
        """Finish (or abort) a request; its blocks return to the pool once its jobs are done."""
        request = self.requests[rid]
        waiting = self.session.finish(rid)
        request.phase, request.load = "done", None
        self.give_up(request, waiting)
        if not waiting:
            del self.requests[rid]

    def preempt(self, rid: str) -> None:
        """Preempt a request: it waits again; its blocks return once its jobs are done."""
        request = self.requests[rid]
        waiting = self.session.preempt(rid)
        request.phase, request.computed, request.load = "waiting", 0, None
        self.give_up(request, waiting)

    def reset(self) -> None:
        """Reset the session: every request and result is forgotten; blocks return."""
        self.session.reset()
        for request in self.requests.values():
            self.release(request)
            self.release(request, fenced=True)
        self.requests.clear()
        self.undelivered.clear()


def two_group_config(f: int = 2) -> OffloadConfig:
    """Return a config with a full-attention group of 4-token blocks and an 8-token one."""
    return OffloadConfig(
        hash_block_size=4,
        blocks_per_chunk=f,
        groups=(
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=4),
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=8),
        ),
    )
