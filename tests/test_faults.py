"""Injected faults lose nothing: failed stores leave no ready key, failed loads release their
pins and name the tokens to recompute, and no ready key ever holds bytes not fully written."""

from __future__ import annotations

import numpy as np
import pytest
from offload_rig import Rig, chain, two_group_config

from kvferry.core.bound import BoundPlan
from kvferry.core.catalog import KeyState
from kvferry.core.errors import InvalidInputError
from kvferry.core.keys import KeyStatus
from kvferry.core.lookup import LookupResult
from kvferry.executors.cpu import CpuExecutor
from kvferry.executors.faults import FaultPoint, FaultyExecutor, truncated_plan

POINTS = list(FaultPoint)
PROMPT = chain(8, family=0, shared=0)  # 32 tokens: chunks of 8 and 16 tokens (F = 2)


def _stored_rig(capacity: int = 8) -> tuple[Rig, list[BoundPlan]]:
    """Return a rig where request r1 has stored its whole prompt (and finished)."""
    rig = Rig(two_group_config(), capacity_rows=capacity)
    request = rig.arrive("r1", PROMPT)
    rig.admit(request)
    jobs = rig.store_step({"r1": request.num_tokens})
    rig.deliver()
    rig.finish("r1")
    return rig, jobs


def _failed_load(point: FaultPoint) -> tuple[Rig, BoundPlan]:
    """Return a rig where r2's load of r1's stored prompt failed at `point` (delivered)."""
    rig, _ = _stored_rig()
    request = rig.arrive("r2", PROMPT, extra_tokens=1)
    job = rig.admit(request, fault=point)
    assert job is not None
    rig.deliver()
    return rig, job


# -- stores -----------------------------------------------------------------------------------


@pytest.mark.parametrize("point", POINTS)
def test_a_failed_store_leaves_no_key_of_it_ready(point: FaultPoint) -> None:
    rig = Rig(two_group_config(), capacity_rows=8)
    request = rig.arrive("r1", PROMPT)
    rig.admit(request)
    (job,) = rig.store_step({"r1": 32}, faults={"r1": point})
    report = rig.deliver()
    assert report.failed == (job.job_id,)
    assert rig.catalog.statuses(job.plan.keys) == [KeyStatus.MISS] * len(job.plan.keys)


@pytest.mark.parametrize("point", POINTS)
def test_a_failed_store_frees_its_rows(point: FaultPoint) -> None:
    rig = Rig(two_group_config(), capacity_rows=8)
    request = rig.arrive("r1", PROMPT)
    rig.admit(request)
    rig.store_step({"r1": 32}, faults={"r1": point})
    rig.deliver()
    counters = rig.session.counters()
    assert (counters.rows_used, counters.failed_stores, counters.stores) == (0, 6, 0)


def test_a_store_failing_midway_has_written_part_of_its_rows() -> None:
    rig = Rig(two_group_config(), capacity_rows=8)
    request = rig.arrive("r1", PROMPT)
    rig.admit(request)
    rig.store_step({"r1": 32}, faults={"r1": FaultPoint.MIDWAY})
    (result,) = rig.undelivered
    assert not result.success and result.nbytes > 0
    assert rig.executor.host_tier.array.any()  # some bytes landed: the rows are dirty


def test_rows_freed_by_a_failed_store_are_rewritten_whole_before_they_are_ready() -> None:
    rig = Rig(two_group_config(), capacity_rows=6)
    first = rig.arrive("r1", PROMPT)
    rig.admit(first)
    rig.store_step({"r1": 32}, faults={"r1": FaultPoint.MIDWAY})
    rig.deliver()
    rig.finish("r1")
    second = rig.arrive("r2", chain(8, family=1, shared=0))
    rig.admit(second)
    rig.store_step({"r2": 32})
    rig.deliver()
    assert rig.session.counters().rows_used == 6
    rig.check_ready_rows()


# -- loads ------------------------------------------------------------------------------------


@pytest.mark.parametrize("point", POINTS)
def test_a_failed_load_releases_its_pins(point: FaultPoint) -> None:
    rig, job = _failed_load(point)
    assert not any(rig.catalog.is_pinned(key) for key in job.plan.keys)


@pytest.mark.parametrize("point", POINTS)
def test_a_failed_load_names_the_request_and_tokens_to_recompute(point: FaultPoint) -> None:
    rig, job = _failed_load(point)
    assert rig.recomputed == [("r2", 0, rig.hits[job.job_id])]
    assert rig.hits[job.job_id] == 32


def test_a_load_failing_midway_has_written_only_part_of_its_blocks() -> None:
    rig, job = _failed_load(FaultPoint.MIDWAY)
    request = rig.requests["r2"]
    with pytest.raises(AssertionError, match="loaded"):
        rig.check_loaded(request, job)


@pytest.mark.parametrize("point", POINTS)
def test_a_lookup_after_a_failed_load_does_not_hand_out_its_keys(point: FaultPoint) -> None:
    rig, _ = _failed_load(point)
    found = rig.session.lookup("r3", block_hashes=PROMPT, num_tokens=33, num_computed_tokens=0)
    assert found == LookupResult(tokens=0)


def test_chunks_of_a_failed_load_are_stored_again_and_load_back_whole() -> None:
    rig, _ = _failed_load(FaultPoint.MIDWAY)
    again = rig.arrive("r3", PROMPT, extra_tokens=1)
    assert rig.admit(again) is None  # nothing to load: it computes and stores the prompt
    rig.store_step({"r3": 33})
    rig.deliver()
    later = rig.arrive("r4", PROMPT, extra_tokens=1)
    assert rig.admit(later) is not None
    report = rig.deliver()  # the rig checks every loaded page against the stored pattern
    assert report.failed == ()
    assert rig.requests["r4"].computed == 32


@pytest.mark.parametrize("point", POINTS)
def test_the_request_whose_load_failed_stores_the_recomputed_chunks_again(
    point: FaultPoint,
) -> None:
    rig, job = _failed_load(point)
    rig.store_step({"r2": 33})
    rig.deliver()
    assert rig.catalog.statuses(job.plan.keys) == [KeyStatus.HIT] * len(job.plan.keys)
    rig.check_ready_rows()


def test_a_failed_load_drops_its_keys_from_the_tier() -> None:
    rig, job = _failed_load(FaultPoint.AT_COMPLETION)
    assert rig.catalog.statuses(job.plan.keys) == [KeyStatus.MISS] * len(job.plan.keys)


# -- the invariant under many faults --------------------------------------------------------


def test_no_ready_key_holds_bytes_not_fully_written_under_random_faults() -> None:
    rng = np.random.default_rng(11)
    rig = Rig(two_group_config(), capacity_rows=10)
    points: list[FaultPoint | None] = [None, None, *POINTS]
    for n in range(60):
        rid = f"r{n}"
        request = rig.arrive(rid, chain(int(rng.integers(2, 12)), int(rng.integers(3)), 4))
        rig.admit(request, fault=points[int(rng.integers(len(points)))])
        rig.deliver()
        while rid in rig.requests and request.computed < request.num_tokens:
            if request.phase != "running":
                rig.admit(request)
                rig.deliver()
                continue
            point = points[int(rng.integers(len(points)))]
            rig.store_step({rid: int(rng.integers(1, 12))}, faults={rid: point} if point else {})
            rig.deliver()
            rig.check_ready_rows()
        rig.finish(rid)
    assert rig.executor.injected_count > 20
    assert all(e.state is KeyState.READY for e in rig.catalog.snapshot().values())


# -- the wrapper itself -----------------------------------------------------------------------


def test_the_wrapper_refuses_a_plan_the_wrapped_executor_would_refuse() -> None:
    rig = Rig(two_group_config(), capacity_rows=8)
    request = rig.arrive("r1", PROMPT)
    rig.admit(request)
    rig.compute(request, 0, 32)
    step = rig.session.start_stores([rig.running(request, 32)])
    bad = BoundPlan(
        job_id=step.jobs[0].job_id,
        plan=step.jobs[0].plan,
        cpu_rows=step.jobs[0].cpu_rows,
        layout_fingerprint="another layout",
    )
    rig.executor.inject(bad.job_id, FaultPoint.BEFORE_START)
    with pytest.raises(InvalidInputError, match="layout_fingerprint"):
        rig.executor.submit(bad)
    assert rig.executor.poll() == []


def test_a_job_failing_before_start_copies_nothing() -> None:
    rig = Rig(two_group_config(), capacity_rows=8)
    request = rig.arrive("r1", PROMPT)
    rig.admit(request)
    rig.store_step({"r1": 32}, faults={"r1": FaultPoint.BEFORE_START})
    assert not rig.executor.host_tier.array.any()


def test_a_job_failing_at_completion_copies_every_byte() -> None:
    rig = Rig(two_group_config(), capacity_rows=8)
    request = rig.arrive("r1", PROMPT)
    rig.admit(request)
    (job,) = rig.store_step({"r1": 32}, faults={"r1": FaultPoint.AT_COMPLETION})
    (result,) = rig.undelivered
    assert (result.success, result.nbytes) == (False, 2 * 24 * len(job.plan.gpu_block_ids))


def test_wait_reports_each_job_once_in_the_order_asked() -> None:
    rig = Rig(two_group_config(), capacity_rows=8)
    executor = FaultyExecutor(rig.executor.inner, {1: FaultPoint.BEFORE_START})
    request = rig.arrive("r1", PROMPT)
    rig.admit(request)
    rig.compute(request, 0, 32)
    first = rig.session.start_stores([rig.running(request, 16)]).jobs
    second = rig.session.start_stores([rig.running(request, 32)]).jobs
    for job in (*first, *second):
        executor.submit(job)
    results = executor.wait([2, 1])
    assert [(r.job_id, r.success) for r in results] == [(2, True), (1, False)]
    assert executor.poll() == []
    with pytest.raises(InvalidInputError, match="in flight"):
        executor.wait([1])


def test_a_truncated_plan_keeps_the_first_half_of_each_group() -> None:
    _, jobs = _stored_rig()
    (job,) = jobs
    cut = truncated_plan(job)
    assert cut.plan.group_sizes == tuple(-(-n // 2) for n in job.plan.group_sizes)
    assert cut.plan.gpu_ids_of(1).tolist() == job.plan.gpu_ids_of(1)[:2].tolist()


class _LateCpuExecutor(CpuExecutor):
    """The cpu executor, but a job ends only when `wait` asks for it (as a GPU job would)."""

    name = "late-cpu"

    def _done(self, handle: float) -> bool:
        return False


def test_the_wrapper_reports_a_late_executors_jobs_only_when_they_end() -> None:
    rig = Rig(two_group_config(), capacity_rows=8)
    late = _LateCpuExecutor(
        kv_caches=[[t.tensor for t in group] for group in rig.executor.inner.tensors],
        blocks_per_chunk=2,
        num_rows=8,
    )
    executor = FaultyExecutor(late, {1: FaultPoint.BEFORE_START, 2: FaultPoint.AT_COMPLETION})
    request = rig.arrive("r1", PROMPT)
    rig.admit(request)
    rig.compute(request, 0, 32)
    jobs = [
        *rig.session.start_stores([rig.running(request, 16)]).jobs,
        *rig.session.start_stores([rig.running(request, 32)]).jobs,
    ]
    for job in jobs:
        executor.submit(job)
    assert [(r.job_id, r.success) for r in executor.poll()] == [(1, False)]
    assert [(r.job_id, r.success) for r in executor.wait([2])] == [(2, False)]
    assert executor.close() == []
