"""Random interleavings of lookup / allocate / store / complete / fail / finish / preempt / reset,
checked against a simple model of the session and its catalog."""

from __future__ import annotations

import enum

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from session_fakes import blocks, prefix_hashes

from kvferry.adapters.session import (
    CompletionReport,
    OffloadSession,
    RecomputeRange,
    RunningRequest,
)
from kvferry.core.bound import JobResult
from kvferry.core.catalog import Catalog, CatalogConfig, EventKind, KeyState
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.eviction import EvictionPolicyKind
from kvferry.core.keys import OffloadKey
from kvferry.core.lookup import LookupResult
from kvferry.core.plan import Direction

CONFIG = OffloadConfig(
    hash_block_size=4,
    blocks_per_chunk=1,
    groups=(
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=4),
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=8),
    ),
)
CHUNKS = (4, 8)
MAX_LIVE = 5


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Phase(enum.Enum):
    WAITING = "waiting"  # needs a lookup (new, or preempted)
    LOADING = "loading"  # its load is in flight; not scheduled
    RUNNING = "running"


@attrs.define
class ModelRequest:
    hashes: tuple[bytes, ...]
    phase: Phase = Phase.WAITING
    computed: int = 0
    cursor: list[int] = attrs.field(factory=lambda: [0, 0])
    block_ids: list[list[int]] = attrs.field(factory=list)
    jobs: set[int] = attrs.field(factory=set)
    fence: set[int] | None = None
    finished: bool = False
    load: tuple[int, int] | None = None  # (job id, hit tokens) of the load in flight

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * 4

    def keys(self, group: int) -> list[OffloadKey]:
        step = CHUNKS[group] // 4
        return [OffloadKey(group, h) for h in self.hashes[step - 1 :: step]]


@attrs.define
class ModelJob:
    rid: str
    direction: Direction
    keys: tuple[OffloadKey, ...]
    reported: set[int] = attrs.field(factory=set)
    failed: bool = False
    recompute: RecomputeRange | None = None
    cursor_before: list[int] = attrs.field(factory=list)


class SessionMachine(RuleBasedStateMachine):
    """Drives an OffloadSession like an engine would, and keeps a model to compare against."""

    def __init__(self) -> None:
        super().__init__()
        self.session: OffloadSession
        self.capacity = 0
        self.requests: dict[str, ModelRequest] = {}
        self.jobs: dict[int, ModelJob] = {}
        self.ready: set[OffloadKey] = set()
        self.writing: dict[OffloadKey, int] = {}
        self.pins: dict[OffloadKey, int] = {}
        self.doomed: set[OffloadKey] = set()
        self.stale: list[int] = []
        self.arrivals = 0
        self.next_block = 1

    # -- set-up -----------------------------------------------------------------------------

    @initialize(
        capacity=st.integers(min_value=2, max_value=8),
        policy=st.sampled_from(list(EvictionPolicyKind)),
        world_size=st.integers(min_value=1, max_value=2),
    )
    def start(self, capacity: int, policy: EvictionPolicyKind, world_size: int) -> None:
        self.capacity = capacity
        catalog = Catalog(CatalogConfig(capacity_rows=capacity, policy=policy, record_events=True))
        self.session = OffloadSession(CONFIG, catalog, world_size=world_size)

    # -- model helpers ----------------------------------------------------------------------

    def live(self, *phases: Phase) -> list[str]:
        return sorted(
            rid for rid, r in self.requests.items() if not r.finished and r.phase in phases
        )

    def present(self, key: OffloadKey) -> bool:
        return key in self.ready or key in self.writing

    def expected_lookup(self, request: ModelRequest) -> LookupResult:
        boundary = request.num_tokens
        for group, chunk in enumerate(CHUNKS):
            keys = request.keys(group)
            boundary = min(boundary, len(keys) * chunk)
            if boundary < chunk:
                return LookupResult()
            hits = 0
            while hits < ceil_div(boundary, chunk) and self.present(keys[hits]):
                hits += 1
            boundary = min(boundary, hits * chunk)
            if boundary < chunk:
                return LookupResult()
        for group, chunk in enumerate(CHUNKS):
            needed = request.keys(group)[: ceil_div(boundary, chunk)]
            if any(key in self.writing or key in self.pins for key in needed):
                return LookupResult(retry=True)
        return LookupResult(tokens=boundary)

    def take_events(self, kind: EventKind) -> list[OffloadKey]:
        events = self.session.drain_events()
        assert all(event.kind is kind for event in events), events
        return [key for event in events for key in event.keys]

    def new_job(self, job_id: int, job: ModelJob) -> None:
        assert job_id not in self.jobs
        self.jobs[job_id] = job
        self.requests[job.rid].jobs.add(job_id)

    # -- rules ------------------------------------------------------------------------------

    @precondition(lambda self: len(self.live(*Phase)) < MAX_LIVE)
    @rule(family=st.integers(0, 2), hash_blocks=st.sampled_from([2, 3, 4, 6, 8]))
    def arrive(self, family: int, hash_blocks: int) -> None:
        self.arrivals += 1
        hashes = prefix_hashes(hash_blocks, family=family, shared=2)
        self.requests[f"r{self.arrivals}"] = ModelRequest(hashes=hashes)

    def lookup_and_allocate(self, rid: str) -> None:
        """Look a waiting request up and, unless told to retry, allocate its blocks (and load)."""
        request = self.requests[rid]
        expected = self.expected_lookup(request)
        found = self.session.lookup(
            rid, block_hashes=request.hashes, num_tokens=request.num_tokens, num_computed_tokens=0
        )
        assert found == expected
        if found.retry:
            return
        request.block_ids = [
            list(range(self.next_block, self.next_block + ceil_div(request.num_tokens, size)))
            for size in (4, 8)
        ]
        self.next_block += 100
        request.computed = 0
        if not found.tokens:
            request.phase = Phase.RUNNING
            return
        job = self.session.start_load(
            rid,
            [blocks(ids) for ids in request.block_ids],
            num_computed_tokens=0,
            hit_tokens=found.tokens,
        )
        assert job is not None
        keys = [
            key
            for group, chunk in enumerate(CHUNKS)
            for key in request.keys(group)[: ceil_div(found.tokens, chunk)]
        ]
        assert list(job.plan.keys) == keys
        for key in keys:  # a pending (writing or being loaded) key is never reported as a hit
            assert key in self.ready and key not in self.pins
        for key in keys:
            self.pins[key] = self.pins.get(key, 0) + 1
        cursor_before = list(request.cursor)
        for group, chunk in enumerate(CHUNKS):
            request.cursor[group] = max(request.cursor[group], ceil_div(found.tokens, chunk))
        self.new_job(
            job.job_id,
            ModelJob(
                cursor_before=cursor_before,
                rid=rid,
                direction=Direction.LOAD,
                keys=job.plan.keys,
                recompute=RecomputeRange(request_id=rid, start=0, stop=found.tokens),
            ),
        )
        request.phase = Phase.LOADING
        request.load = (job.job_id, found.tokens)

    @precondition(lambda self: self.live(Phase.WAITING, Phase.RUNNING))
    @rule(data=st.data())
    def engine_step(self, data: st.DataObject) -> None:
        """One scheduler step: look up the waiting requests, then store for the running ones."""
        for rid in self.live(Phase.WAITING):
            self.lookup_and_allocate(rid)
        if self.live(Phase.RUNNING):
            self.store_step(data)

    def store_step(self, data: st.DataObject) -> None:
        running = []
        for rid in self.live(Phase.RUNNING):
            request = self.requests[rid]
            left = request.num_tokens - request.computed
            scheduled = data.draw(st.integers(0, left), label=f"scheduled {rid}")
            running.append((rid, request, scheduled))
        step = self.session.start_stores(
            [
                RunningRequest(
                    request_id=rid,
                    blocks=[blocks(ids) for ids in request.block_ids],
                    num_computed_tokens=request.computed,
                    num_scheduled_tokens=scheduled,
                    num_tokens=request.num_tokens,
                    block_hashes=request.hashes,
                )
                for rid, request, scheduled in running
            ]
        )
        removed = iter(self.take_events(EventKind.REMOVED))
        jobs = iter(step.jobs)
        no_room = []
        for rid, request, scheduled in running:
            done = request.computed + scheduled
            candidates, ends = [], []
            for group, chunk in enumerate(CHUNKS):
                keys = request.keys(group)
                end = max(request.cursor[group], min(done // chunk, len(keys)))
                candidates += keys[request.cursor[group] : end]
                ends.append(end)
            missing = [key for key in candidates if not self.present(key)]
            request.computed = done
            if not missing:
                request.cursor = ends
                continue
            evictable = {k for k in self.ready if k not in self.pins and k not in candidates}
            held = [*self.ready, *self.writing]
            need = {  # every group has its own rows, and makes room among its own keys
                g: sum(k.group == g for k in missing)
                - (self.capacity - sum(k.group == g for k in held))
                for g in {k.group for k in missing}
            }
            if any(n > sum(k.group == g for k in evictable) for g, n in need.items()):
                no_room.append(rid)
                continue
            for _ in range(sum(max(n, 0) for n in need.values())):
                victim = next(removed)
                assert victim in evictable  # ready, unpinned, not of this call; never writing
                assert need[victim.group] > 0  # of a group that needed room
                need[victim.group] -= 1
                self.ready.discard(victim)
                evictable.discard(victim)
            job = next(jobs)
            assert (job.plan.request_id, list(job.plan.keys)) == (rid, missing)
            assert attrs.evolve(job) == job  # built unchecked: BoundPlan's own checks pass
            for key in missing:
                self.writing[key] = job.job_id
            self.new_job(
                job.job_id, ModelJob(rid=rid, direction=Direction.STORE, keys=job.plan.keys)
            )
            request.cursor = ends
        assert next(jobs, None) is None
        assert next(removed, None) is None
        assert list(step.no_room) == no_room

    @precondition(lambda self: self.jobs)
    @rule(data=st.data(), success=st.integers(0, 3).map(bool))
    def report(self, data: st.DataObject, success: bool) -> None:
        job_id = data.draw(st.sampled_from(sorted(self.jobs)))
        job = self.jobs[job_id]
        worker = data.draw(
            st.sampled_from([w for w in range(self.session.world_size) if w not in job.reported])
        )
        result = JobResult(job_id=job_id, success=success, nbytes=0, seconds=0.0)
        report = self.session.report(worker, [result])
        job.reported.add(worker)
        job.failed = job.failed or not success
        if len(job.reported) < self.session.world_size:
            assert report == CompletionReport()
            return
        assert report == self.complete(job_id)

    def complete(self, job_id: int) -> CompletionReport:
        """Apply a job's completion to the model; return the report the session must give."""
        job = self.jobs.pop(job_id)
        request = self.requests[job.rid]
        request.jobs.discard(job_id)
        recompute: tuple[RecomputeRange, ...] = ()
        if job.direction is Direction.STORE:
            for key in job.keys:
                del self.writing[key]
            if not job.failed:
                self.ready.update(job.keys)
            assert self.take_events(EventKind.STORED) == ([] if job.failed else list(job.keys))
        else:
            for key in job.keys:
                self.pins[key] -= 1
                if not self.pins[key]:
                    del self.pins[key]
            if job.failed:  # a failed load's keys leave the tier once nothing pins them
                self.doomed.update(key for key in job.keys if key in self.ready)
            dropped = {key for key in self.doomed if key not in self.pins}
            self.doomed -= dropped
            self.ready -= dropped
            assert sorted(self.take_events(EventKind.REMOVED)) == sorted(dropped)
            if job.failed and job.recompute is not None:  # stored again after the recompute
                request.cursor = [
                    min(now, before)
                    for now, before in zip(request.cursor, job.cursor_before, strict=True)
                ]
                recompute = (job.recompute,)
            if request.load is not None and request.load[0] == job_id:
                if request.phase is Phase.LOADING:
                    request.phase = Phase.RUNNING
                    request.computed = 0 if job.failed else request.load[1]
                request.load = None
        released: tuple[str, ...] = ()
        if request.fence is not None:
            request.fence.discard(job_id)
            if not request.fence:
                request.fence = None
                released = (job.rid,)
        if request.finished and not request.jobs:
            del self.requests[job.rid]
        return CompletionReport(
            completed=(job_id,),
            failed=(job_id,) if job.failed else (),
            recompute=recompute,
            released=released,
        )

    def fence(self, rid: str) -> frozenset[int]:
        request = self.requests[rid]
        for job_id in request.jobs:
            self.jobs[job_id].recompute = None
        if not request.jobs:
            return frozenset()
        request.fence = (request.fence or set()) | request.jobs
        return frozenset(request.fence)

    @precondition(lambda self: len(self.live(*Phase)) > 1)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.live(*Phase)))
        expected = self.fence(rid)
        assert self.session.finish(rid) == expected
        self.requests[rid].finished = True
        if not self.requests[rid].jobs:
            del self.requests[rid]

    @precondition(lambda self: self.live(Phase.RUNNING, Phase.LOADING))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.live(Phase.RUNNING, Phase.LOADING)))
        expected = self.fence(rid)
        assert self.session.preempt(rid) == expected
        request = self.requests[rid]
        request.phase, request.computed, request.cursor = Phase.WAITING, 0, [0, 0]

    @rule(now=st.integers(0, 7))
    def reset(self, now: int) -> None:
        if now:  # rare: an engine resets its caches seldom
            return
        assert self.session.reset() == frozenset(self.jobs)
        assert set(self.take_events(EventKind.REMOVED)) == self.ready
        self.stale += sorted(self.jobs)
        self.requests.clear()
        self.jobs.clear()
        self.ready.clear()
        self.writing.clear()
        self.pins.clear()
        self.doomed.clear()

    @precondition(lambda self: self.stale)
    @rule(data=st.data(), success=st.booleans())
    def late_report(self, data: st.DataObject, success: bool) -> None:
        job_id = data.draw(st.sampled_from(self.stale))
        result = JobResult(job_id=job_id, success=success, nbytes=0, seconds=0.0)
        assert self.session.report(0, [result]) == CompletionReport()

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def capacity_is_never_exceeded(self) -> None:
        if self.capacity:
            used = self.session.catalog.counters().group_rows_used
        assert all(rows <= self.capacity for rows in used)  # every group's rows on their own

    @invariant()
    def the_catalog_equals_the_model(self) -> None:
        if not self.capacity:
            return
        snapshot = self.session.catalog.snapshot()
        assert {k for k, e in snapshot.items() if e.state is KeyState.READY} == self.ready
        assert {k for k, e in snapshot.items() if e.state is KeyState.WRITING} == set(self.writing)
        assert {k: e.pins for k, e in snapshot.items() if e.pins} == self.pins
        for group in {key.group for key in snapshot}:  # each group's own rows
            rows = [e.row for key, e in snapshot.items() if key.group == group]
            assert len(set(rows)) == len(rows)
            assert all(0 <= row < self.capacity for row in rows)

    @invariant()
    def the_jobs_and_requests_equal_the_model(self) -> None:
        if not self.capacity:
            return
        assert self.session.in_flight() == frozenset(self.jobs)
        for rid, request in self.requests.items():
            assert self.session.jobs_of(rid) == frozenset(request.jobs)
            state = self.session.request_state(rid)
            if state is not None and not request.finished:
                assert list(state.store_cursor) == request.cursor

    def teardown(self) -> None:
        """Every job completes once the workers report it: nothing stays pinned or writing."""
        if not self.capacity:
            return
        for job_id in sorted(self.jobs):
            job = self.jobs[job_id]
            for worker in range(self.session.world_size):
                if worker not in job.reported:
                    self.session.report(
                        worker, [JobResult(job_id=job_id, success=True, nbytes=0, seconds=0.0)]
                    )
        assert self.session.in_flight() == frozenset()
        snapshot = self.session.catalog.snapshot()
        assert all(e.state is KeyState.READY and not e.pins for e in snapshot.values())
        for rid, request in self.requests.items():
            if request.finished:
                assert self.session.request_state(rid) is None


TestSessionMachine = SessionMachine.TestCase
