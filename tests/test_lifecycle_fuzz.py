"""Fuzzed lifecycles: random hybrid configurations and request streams through the session, the
catalog and a faulty cpu executor, with byte-level checks after every step.

Profiles: the default (`ci`) runs a short fuzz; `--hypothesis-profile long` runs >= 100 000 steps
(docs/testing.md).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from offload_rig import Rig, RigRequest, chain

from kvferry.core.bound import BoundPlan
from kvferry.core.catalog import KeyState
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.eviction import EvictionPolicyKind
from kvferry.core.keys import OffloadKey
from kvferry.core.kinds import KIND_RULES
from kvferry.core.plan import Direction
from kvferry.executors.faults import FaultPoint

MAX_LIVE = 4
STEPS = Counter[str]()
"""Rules run, by name, over the whole module (printed at the end with `-s`)."""

FAULTS = st.one_of(st.none(), st.none(), st.none(), st.sampled_from(list(FaultPoint)))


@st.composite
def configs(draw: st.DrawFn) -> OffloadConfig:
    """Return a random hybrid configuration: 1-3 groups of any kind, F in 1..3."""
    hash_block = draw(st.sampled_from([2, 4]))
    f = draw(st.integers(1, 3))
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(list(GroupKind)))
        block = hash_block * draw(st.integers(1, 2))
        parameters = {  # windows and attention chunks of up to 3 chunks
            name: draw(st.integers(1, 3 * f * block)) for name in KIND_RULES[kind].parameters
        }
        groups.append(GroupSpec(kind=kind, block_size=block, **parameters))
    return OffloadConfig(hash_block_size=hash_block, blocks_per_chunk=f, groups=tuple(groups))


class LifecycleMachine(RuleBasedStateMachine):
    """Drives the rig like an engine; the model is only what is in flight, checked after every
    step against the session, the catalog and the bytes of the CPU tier."""

    def __init__(self) -> None:
        super().__init__()
        self.rig: Rig
        self.capacity = 0
        self.arrivals = 0
        self.flying: dict[int, tuple[Direction, tuple[OffloadKey, ...]]] = {}

    @initialize(
        config=configs(),
        capacity=st.integers(2, 8),
        policy=st.sampled_from(list(EvictionPolicyKind)),
    )
    def start(self, config: OffloadConfig, capacity: int, policy: EvictionPolicyKind) -> None:
        self.capacity = capacity
        self.rig = Rig(config, capacity_rows=capacity, num_blocks=2048, policy=policy)

    # -- helpers ----------------------------------------------------------------------------

    def live(self, *phases: str) -> list[RigRequest]:
        return [r for r in self.rig.requests.values() if r.phase in phases]

    def track(self, jobs: list[BoundPlan]) -> None:
        for job in jobs:
            assert job.job_id not in self.flying
            self.flying[job.job_id] = (job.plan.direction, job.plan.keys)

    # -- rules ------------------------------------------------------------------------------

    @rule(
        family=st.integers(0, 2),
        hash_blocks=st.integers(1, 14),
        shared=st.integers(0, 8),
        extra=st.integers(0, 3),
    )
    def arrive(self, family: int, hash_blocks: int, shared: int, extra: int) -> None:
        if len(self.live("waiting", "loading", "running")) >= MAX_LIVE:
            STEPS["idle (engine full)"] += 1
            self.deliver_all()  # a full engine waits for its workers
            return
        STEPS["arrive"] += 1
        self.arrivals += 1
        extra = min(extra, self.rig.config.hash_block_size - 1)
        self.rig.arrive(f"r{self.arrivals}", chain(hash_blocks, family, shared), extra)

    @precondition(lambda self: self.live("waiting"))
    @rule(data=st.data(), fault=FAULTS)
    def admit(self, data: st.DataObject, fault: FaultPoint | None) -> None:
        STEPS["admit"] += 1
        request = data.draw(st.sampled_from(self.live("waiting")))
        job = self.rig.admit(request, fault=fault)
        if job is not None:
            self.track([job])

    @precondition(lambda self: self.live("waiting", "running"))
    @rule(data=st.data())
    def engine_step(self, data: st.DataObject) -> None:
        """One scheduler step: admit waiting requests, compute and store for running ones."""
        STEPS["engine_step"] += 1
        for request in self.live("waiting"):
            job = self.rig.admit(request, fault=data.draw(FAULTS, label=f"load {request.rid}"))
            if job is not None:
                self.track([job])
        schedule, faults = {}, {}
        for request in self.live("running"):
            schedule[request.rid] = data.draw(st.integers(0, 12), label=f"tokens {request.rid}")
            fault = data.draw(FAULTS, label=f"fault {request.rid}")
            if fault is not None:
                faults[request.rid] = fault
        self.track(self.rig.store_step(schedule, faults))
        if data.draw(st.booleans(), label="deliver everything"):
            self.deliver_all()

    def deliver_all(self) -> None:
        """Report every result the workers hold (what most engine steps do)."""
        if self.rig.undelivered:
            self.settle([r.job_id for r in self.rig.undelivered])

    def settle(self, chosen: list[int]) -> None:
        """Deliver the results of `chosen` and drop them from the jobs in flight."""
        report = self.rig.deliver(chosen)
        assert sorted(report.completed) == sorted(chosen)
        loads = sum(self.flying[j][0] is Direction.LOAD for j in chosen)
        STEPS["loads delivered"] += loads
        STEPS["stores delivered"] += len(chosen) - loads
        STEPS["failures delivered"] += len(report.failed)
        for job_id in chosen:
            del self.flying[job_id]

    @precondition(lambda self: self.rig.undelivered)
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        STEPS["deliver"] += 1
        ids = [r.job_id for r in self.rig.undelivered]
        self.settle(data.draw(st.lists(st.sampled_from(ids), min_size=1, unique=True)))

    @precondition(lambda self: self.live("running", "loading", "waiting"))
    @rule(data=st.data(), abort=st.integers(0, 3))
    def finish_or_abort(self, data: st.DataObject, abort: int) -> None:
        done = [r for r in self.live("running") if r.computed == r.num_tokens]
        if not done and abort:
            STEPS["idle (no abort)"] += 1
            return  # abort a request in a quarter of the calls; finish done ones always
        STEPS["finish" if done else "abort"] += 1
        request = data.draw(st.sampled_from(done or self.live("running", "loading", "waiting")))
        self.rig.finish(request.rid)

    @precondition(lambda self: self.live("running", "loading"))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        STEPS["preempt"] += 1
        request = data.draw(st.sampled_from(self.live("running", "loading")))
        self.rig.preempt(request.rid)

    @precondition(lambda self: self.rig.requests)
    @rule(now=st.integers(0, 15))
    def reset(self, now: int) -> None:
        if now:  # rare: an engine resets its caches seldom
            STEPS["idle (no reset)"] += 1
            return
        STEPS["reset"] += 1
        self.rig.reset()
        self.flying.clear()

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def capacity_is_never_exceeded(self) -> None:
        if self.capacity:  # every group's rows on their own
            assert all(
                used <= self.capacity for used in self.rig.catalog.counters().group_rows_used
            )

    @invariant()
    def every_ready_key_holds_exactly_its_chunks_bytes(self) -> None:
        if self.capacity:
            self.rig.check_ready_rows()

    @invariant()
    def writing_and_pinned_keys_are_never_evicted(self) -> None:
        if not self.capacity:
            return
        snapshot = self.rig.catalog.snapshot()
        pins: Counter[OffloadKey] = Counter()
        for direction, keys in self.flying.values():
            if direction is Direction.STORE:
                for key in keys:
                    assert key in snapshot, f"key {key} of a store in flight was evicted"
                    assert snapshot[key].state is KeyState.WRITING, key
            else:
                pins.update(keys)
        for key, count in pins.items():
            assert key in snapshot, f"key {key} pinned by a load in flight was evicted"
            assert snapshot[key].state is KeyState.READY and snapshot[key].pins == count, key

    @invariant()
    def no_job_is_lost(self) -> None:
        if not self.capacity:
            return
        assert self.rig.session.in_flight() == frozenset(self.flying)
        undelivered = [r.job_id for r in self.rig.undelivered]
        assert sorted(undelivered) == sorted(self.flying)  # each job reported exactly once
        assert self.rig.executor.poll() == []

    def teardown(self) -> None:
        """Deliver everything: nothing stays in flight, pinned or writing."""
        if not self.capacity:
            return
        self.rig.deliver()
        assert self.rig.session.in_flight() == frozenset()
        assert all(
            e.state is KeyState.READY and not e.pins for e in self.rig.catalog.snapshot().values()
        )
        self.rig.check_ready_rows()


def _machine_settings() -> settings:
    """Return the CI settings (< 60 s) or, under the `long` profile, >= 100 000 steps."""
    if settings.get_current_profile_name() == "long":
        return settings(
            max_examples=5_000,
            stateful_step_count=60,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
    return settings(
        max_examples=150,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


TestLifecycle = LifecycleMachine.TestCase
TestLifecycle.settings = _machine_settings()


@pytest.fixture(scope="module", autouse=True)
def _print_step_counts() -> object:
    yield
    steps = sum(n for name, n in STEPS.items() if "delivered" not in name)
    idle = sum(n for name, n in STEPS.items() if name.startswith("idle"))
    print(f"\nlifecycle fuzz: {steps} steps ({idle} idle) {dict(sorted(STEPS.items()))}")
