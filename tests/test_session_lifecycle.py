"""Whole request lives driven through the session, with fake workers finishing jobs on command."""

from __future__ import annotations

import pytest
from session_fakes import FakeWorkers, blocks, prefix_hashes

from kvferry.adapters.session import (
    CompletionReport,
    OffloadSession,
    RecomputeRange,
    RunningRequest,
)
from kvferry.core.catalog import Catalog, CatalogConfig, KeyState
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.errors import InvalidInputError, PlanInvariantError
from kvferry.core.eviction import EvictionPolicyKind
from kvferry.core.keys import KeyStatus, OffloadKey
from kvferry.core.lookup import LookupResult
from kvferry.core.plan import Direction

CHUNK = 4
CONFIG = OffloadConfig(
    hash_block_size=4,
    blocks_per_chunk=1,
    groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=4),),
)
PROMPT = prefix_hashes(4)  # a 16-token prompt: chunks 0..3
RETRY = LookupResult(retry=True)


def make(
    capacity: int = 8,
    *,
    world_size: int = 1,
    policy: EvictionPolicyKind = EvictionPolicyKind.LRU,
    config: OffloadConfig = CONFIG,
) -> tuple[OffloadSession, FakeWorkers]:
    catalog = Catalog(CatalogConfig(capacity_rows=capacity, policy=policy))
    session = OffloadSession(config, catalog, world_size=world_size, layout_fingerprint="L1")
    return session, FakeWorkers(session)


def step(
    rid: str,
    ids: list[int],
    *,
    computed: int,
    scheduled: int,
    hashes: tuple[bytes, ...] = PROMPT,
) -> RunningRequest:
    tokens = len(hashes) * CHUNK
    return RunningRequest(
        request_id=rid,
        blocks=[blocks(ids)],
        num_computed_tokens=computed,
        num_scheduled_tokens=scheduled,
        num_tokens=tokens,
        block_hashes=hashes,
    )


def key(chunk: int, hashes: tuple[bytes, ...] = PROMPT) -> OffloadKey:
    return OffloadKey(0, hashes[chunk])


def store_prompt(session: OffloadSession, workers: FakeWorkers, rid: str = "r1") -> None:
    """Compute and store r1's whole 16-token prompt, then finish r1."""
    workers.submit(
        session.start_stores([step(rid, [10, 11, 12, 13], computed=0, scheduled=16)]).jobs
    )
    workers.finish_all()
    session.finish(rid)


def lookup(
    session: OffloadSession, rid: str, *, computed: int = 0, hashes: tuple[bytes, ...] = PROMPT
) -> LookupResult:
    return session.lookup(
        rid, block_hashes=hashes, num_tokens=len(hashes) * CHUNK + 1, num_computed_tokens=computed
    )


# -- stores -----------------------------------------------------------------------------------


def test_a_running_request_stores_the_chunks_its_step_completes() -> None:
    session, _ = make()
    (job,) = session.start_stores([step("r1", [10, 11, 12, 13], computed=0, scheduled=9)]).jobs
    assert job.plan.direction is Direction.STORE
    assert job.plan.keys == (key(0), key(1))
    assert job.plan.gpu_block_ids.tolist() == [10, 11]
    assert job.cpu_rows.tolist() == [0, 1]
    assert job.layout_fingerprint == "L1"


def test_the_next_step_stores_only_the_chunks_completed_since() -> None:
    session, _ = make()
    session.start_stores([step("r1", [10, 11, 12, 13], computed=0, scheduled=9)])
    (job,) = session.start_stores([step("r1", [10, 11, 12, 13], computed=9, scheduled=7)]).jobs
    assert job.plan.keys == (key(2), key(3))
    assert job.cpu_rows.tolist() == [2, 3]


def test_a_store_in_flight_leaves_its_keys_pending() -> None:
    session, _ = make()
    session.start_stores([step("r1", [10, 11, 12, 13], computed=0, scheduled=16)])
    assert session.catalog.statuses([key(0)]) == [KeyStatus.PENDING]


def test_a_completed_store_makes_its_keys_ready() -> None:
    session, workers = make()
    workers.submit(session.start_stores([step("r1", [10, 11], computed=0, scheduled=8)]).jobs)
    report = workers.finish_all()
    assert report == CompletionReport(completed=(1,))
    assert session.catalog.statuses([key(0), key(1)]) == [KeyStatus.HIT] * 2


def test_a_failed_store_leaves_no_ready_key_and_frees_its_rows() -> None:
    session, workers = make()
    workers.submit(session.start_stores([step("r1", [10, 11], computed=0, scheduled=8)]).jobs)
    report = workers.finish_all(success=False)
    assert report.failed == (1,)
    assert session.catalog.snapshot() == {}
    assert session.catalog.rows_used == 0


def test_a_step_with_no_new_complete_chunk_makes_no_job() -> None:
    session, _ = make()
    assert session.start_stores([step("r1", [10], computed=0, scheduled=3)]).jobs == ()


def test_a_store_with_no_room_is_reported_and_retried_next_step() -> None:
    session, workers = make(capacity=2)
    short = prefix_hashes(2)
    workers.submit(
        session.start_stores([step("r1", [10, 11], computed=0, scheduled=8, hashes=short)]).jobs
    )
    workers.finish_all()
    lookup(session, "r2", hashes=short)
    load = session.start_load("r2", [blocks([20, 21])], num_computed_tokens=0, hit_tokens=8)
    assert load is not None
    workers.submit([load])  # both rows are pinned by r2's load
    other = prefix_hashes(2, family=1)
    blocked = session.start_stores([step("r3", [30, 31], computed=0, scheduled=8, hashes=other)])
    assert (blocked.jobs, blocked.no_room) == ((), ("r3",))
    workers.finish(load.job_id)
    retried = session.start_stores([step("r3", [30, 31], computed=8, scheduled=0, hashes=other)])
    assert [job.plan.keys for job in retried.jobs] == [(key(0, other), key(1, other))]


def test_a_store_never_evicts_a_present_key_of_the_same_request() -> None:
    session, workers = make(capacity=2)
    workers.submit(session.start_stores([step("r1", [10, 11], computed=0, scheduled=8)]).jobs)
    workers.finish_all()
    blocked = session.start_stores([step("r2", [20, 21, 22], computed=0, scheduled=12)])
    assert blocked.no_room == ("r2",)
    assert session.catalog.statuses([key(0), key(1)]) == [KeyStatus.HIT] * 2


def test_a_request_first_seen_at_a_store_step_needs_no_lookup() -> None:
    session, _ = make()
    assert len(session.start_stores([step("r1", [10], computed=0, scheduled=4)]).jobs) == 1


# -- lookups and loads ------------------------------------------------------------------------


def test_lookup_finds_the_stored_prefix_of_a_later_request() -> None:
    session, workers = make()
    store_prompt(session, workers)
    assert lookup(session, "r2") == LookupResult(tokens=16)


def test_lookup_is_idempotent() -> None:
    session, workers = make()
    store_prompt(session, workers)
    before = session.catalog.snapshot()
    assert lookup(session, "r2") == lookup(session, "r2")
    assert session.catalog.snapshot() == before


def test_lookup_retries_while_a_needed_chunk_is_being_written() -> None:
    session, workers = make()
    workers.submit(
        session.start_stores([step("r1", [10, 11, 12, 13], computed=0, scheduled=16)]).jobs
    )
    assert lookup(session, "r2") == RETRY
    workers.finish_all()
    assert lookup(session, "r2") == LookupResult(tokens=16)


def test_the_load_job_binds_the_plan_to_the_rows_of_its_keys() -> None:
    session, workers = make()
    store_prompt(session, workers)
    lookup(session, "r2", computed=4)
    job = session.start_load(
        "r2", [blocks([20, 21, 22, 23, 24], cached=[0])], num_computed_tokens=4, hit_tokens=12
    )
    assert job is not None
    assert job.plan.direction is Direction.LOAD
    assert job.plan.keys == (key(1), key(2), key(3))
    assert job.plan.gpu_block_ids.tolist() == [21, 22, 23]
    assert job.cpu_rows.tolist() == [1, 2, 3]


def test_a_load_pins_its_keys_until_it_completes() -> None:
    session, workers = make()
    store_prompt(session, workers)
    lookup(session, "r2")
    job = session.start_load("r2", [blocks([20, 21, 22, 23])], num_computed_tokens=0, hit_tokens=16)
    assert job is not None
    workers.submit([job])
    assert all(session.catalog.is_pinned(key(c)) for c in range(4))
    workers.finish(job.job_id)
    assert not any(session.catalog.is_pinned(key(c)) for c in range(4))


def test_no_load_job_when_nothing_was_accepted() -> None:
    session, _ = make()
    lookup(session, "r1")
    assert session.start_load("r1", [blocks([1])], num_computed_tokens=0, hit_tokens=0) is None


def test_a_second_request_retries_while_the_first_loads_its_prefix_then_needs_no_load() -> None:
    session, workers = make()
    store_prompt(session, workers)
    assert lookup(session, "r2") == LookupResult(tokens=16)
    job = session.start_load("r2", [blocks([20, 21, 22, 23])], num_computed_tokens=0, hit_tokens=16)
    assert job is not None
    workers.submit([job])
    assert lookup(session, "r3") == RETRY
    workers.finish(job.job_id)
    # the engine's GPU prefix cache now holds r2's 16 tokens: r3 computes from there
    assert lookup(session, "r3", computed=16) == LookupResult(tokens=0)
    assert session.counters().hits == 4


def test_a_load_of_a_key_evicted_since_the_lookup_raises_and_changes_nothing() -> None:
    session, workers = make(capacity=4)
    store_prompt(session, workers)
    lookup(session, "r2")
    other = prefix_hashes(1, family=1)
    workers.submit(
        session.start_stores([step("r3", [30], computed=0, scheduled=4, hashes=other)]).jobs
    )
    with pytest.raises(PlanInvariantError, match="absent"):
        session.start_load("r2", [blocks([20, 21, 22, 23])], num_computed_tokens=0, hit_tokens=16)
    assert session.jobs_of("r2") == frozenset()
    assert session.request_state("r2").store_cursor == (0,)  # type: ignore[union-attr]


def test_a_failed_load_unpins_and_names_the_tokens_to_recompute() -> None:
    session, workers = make()
    store_prompt(session, workers)
    lookup(session, "r2", computed=4)
    job = session.start_load(
        "r2", [blocks([20, 21, 22, 23], cached=[0])], num_computed_tokens=4, hit_tokens=12
    )
    assert job is not None
    workers.submit([job])
    report = workers.finish(job.job_id, success=False)
    assert report.recompute == (RecomputeRange(request_id="r2", start=4, stop=16),)
    assert not any(session.catalog.is_pinned(key(c)) for c in range(4))


def test_a_loaded_chunk_is_not_stored_again() -> None:
    session, workers = make()
    store_prompt(session, workers)
    hashes = prefix_hashes(5)
    lookup(session, "r2", hashes=hashes)
    load = session.start_load(
        "r2", [blocks([20, 21, 22, 23, 24])], num_computed_tokens=0, hit_tokens=16
    )
    assert load is not None
    workers.submit([load])
    workers.finish(load.job_id)
    stores = session.start_stores(
        [step("r2", [20, 21, 22, 23, 24], computed=16, scheduled=4, hashes=hashes)]
    )
    assert [job.plan.keys for job in stores.jobs] == [(key(4, hashes),)]


# -- workers ----------------------------------------------------------------------------------


def test_a_job_completes_only_when_every_worker_has_reported() -> None:
    session, workers = make(world_size=2)
    (job,) = workers.submit(session.start_stores([step("r1", [10], computed=0, scheduled=4)]).jobs)
    assert workers.finish(job.job_id, workers=[1]) == CompletionReport()
    assert session.catalog.statuses([key(0)]) == [KeyStatus.PENDING]
    assert workers.finish(job.job_id, workers=[0]).completed == (job.job_id,)
    assert session.catalog.statuses([key(0)]) == [KeyStatus.HIT]


def test_a_job_that_fails_on_one_worker_fails() -> None:
    session, workers = make(world_size=2)
    (job,) = workers.submit(session.start_stores([step("r1", [10], computed=0, scheduled=4)]).jobs)
    report = workers.finish(job.job_id, failing_worker=0)
    assert report.failed == (job.job_id,)
    assert session.catalog.statuses([key(0)]) == [KeyStatus.MISS]


def test_a_worker_reporting_a_job_twice_is_refused() -> None:
    session, workers = make(world_size=2)
    (job,) = workers.submit(session.start_stores([step("r1", [10], computed=0, scheduled=4)]).jobs)
    workers.finish(job.job_id, workers=[0])
    with pytest.raises(InvalidInputError, match="not yet reported by worker 0"):
        workers.finish(job.job_id, workers=[0])


def test_a_result_for_a_job_never_issued_is_refused() -> None:
    _session, workers = make()
    with pytest.raises(InvalidInputError, match="never issued"):
        workers.finish(7)


def test_a_worker_outside_the_world_is_refused() -> None:
    session, _workers = make(world_size=2)
    with pytest.raises(InvalidInputError, match="worker"):
        session.report(2, [])


def test_job_ids_are_unique_and_increasing() -> None:
    session, _ = make()
    first = session.start_stores([step("r1", [10], computed=0, scheduled=4)]).jobs
    second = session.start_stores(
        [step("r2", [20], computed=0, scheduled=4, hashes=prefix_hashes(1, family=2))]
    ).jobs
    assert [j.job_id for j in first + second] == [1, 2]


def test_a_session_needs_at_least_one_worker() -> None:
    with pytest.raises(InvalidInputError, match="world_size"):
        OffloadSession(CONFIG, Catalog(CatalogConfig(capacity_rows=1)), world_size=0)


# -- finish, abort, preemption, reset ---------------------------------------------------------


def test_finish_names_the_stores_in_flight_and_releases_the_request_when_they_complete() -> None:
    session, workers = make()
    (job,) = workers.submit(session.start_stores([step("r1", [10], computed=0, scheduled=4)]).jobs)
    assert session.finish("r1") == frozenset({job.job_id})
    assert workers.finish(job.job_id).released == ("r1",)
    assert session.request_state("r1") is None


def test_finish_with_nothing_in_flight_waits_for_nothing_and_forgets_the_request() -> None:
    session, workers = make()
    store_prompt(session, workers)
    assert session.finish("r1") == frozenset()
    assert session.request_state("r1") is None


def test_finishing_an_unknown_request_waits_for_nothing() -> None:
    session, _ = make()
    assert session.finish("nobody") == frozenset()


def test_an_aborted_request_waits_for_its_load_and_asks_no_recompute_when_it_fails() -> None:
    session, workers = make()
    store_prompt(session, workers)
    lookup(session, "r2")
    job = session.start_load("r2", [blocks([20, 21, 22, 23])], num_computed_tokens=0, hit_tokens=16)
    assert job is not None
    workers.submit([job])
    assert session.finish("r2") == frozenset({job.job_id})
    report = workers.finish(job.job_id, success=False)
    assert (report.released, report.recompute) == (("r2",), ())
    assert not session.catalog.is_pinned(key(0))


def test_a_finished_request_cannot_store_again() -> None:
    session, workers = make()
    workers.submit(session.start_stores([step("r1", [10], computed=0, scheduled=4)]).jobs)
    session.finish("r1")
    with pytest.raises(InvalidInputError, match="finished"):
        session.start_stores([step("r1", [10, 11], computed=4, scheduled=4)])


def test_preemption_names_the_jobs_to_wait_for_before_reusing_the_blocks() -> None:
    session, workers = make()
    (job,) = workers.submit(
        session.start_stores([step("r1", [10, 11], computed=0, scheduled=8)]).jobs
    )
    assert session.preempt("r1") == frozenset({job.job_id})
    assert workers.finish(job.job_id).released == ("r1",)
    assert session.request_state("r1") is not None


def test_a_preempted_request_stores_from_the_block_table_the_engine_resends() -> None:
    session, workers = make()
    workers.submit(session.start_stores([step("r1", [10, 11], computed=0, scheduled=8)]).jobs)
    workers.finish_all()
    session.preempt("r1")
    (job,) = session.start_stores([step("r1", [40, 41, 42, 43], computed=0, scheduled=16)]).jobs
    assert job.plan.keys == (key(2), key(3))
    assert job.plan.gpu_block_ids.tolist() == [42, 43]


def test_a_preempted_request_stores_again_a_chunk_evicted_meanwhile() -> None:
    session, workers = make(capacity=2)
    workers.submit(session.start_stores([step("r1", [10, 11], computed=0, scheduled=8)]).jobs)
    workers.finish_all()
    session.preempt("r1")
    other = prefix_hashes(1, family=1)
    workers.submit(
        session.start_stores([step("r2", [20], computed=0, scheduled=4, hashes=other)]).jobs
    )
    workers.finish_all()  # r2's chunk evicted r1's chunk 0
    (job,) = session.start_stores([step("r1", [40, 41], computed=0, scheduled=8)]).jobs
    assert job.plan.keys == (key(0),)
    assert job.plan.gpu_block_ids.tolist() == [40]


def test_a_failed_load_of_a_preempted_request_asks_no_recompute() -> None:
    session, workers = make()
    store_prompt(session, workers)
    lookup(session, "r2")
    job = session.start_load("r2", [blocks([20, 21, 22, 23])], num_computed_tokens=0, hit_tokens=16)
    assert job is not None
    workers.submit([job])
    session.preempt("r2")
    assert workers.finish(job.job_id, success=False).recompute == ()


def test_reset_forgets_everything_and_names_the_jobs_it_abandons() -> None:
    session, workers = make()
    store_prompt(session, workers)
    (job,) = workers.submit(
        session.start_stores(
            [step("r2", [20], computed=0, scheduled=4, hashes=prefix_hashes(1, 3))]
        ).jobs
    )
    assert session.reset() == frozenset({job.job_id})
    assert session.catalog.snapshot() == {}
    assert session.in_flight() == frozenset()
    assert session.request_state("r2") is None


def test_late_completions_of_jobs_from_before_a_reset_are_ignored() -> None:
    session, workers = make()
    (job,) = workers.submit(session.start_stores([step("r1", [10], computed=0, scheduled=4)]).jobs)
    session.reset()
    assert workers.finish(job.job_id) == CompletionReport()
    assert session.catalog.snapshot() == {}


def test_job_ids_keep_growing_across_a_reset() -> None:
    session, _ = make()
    session.start_stores([step("r1", [10], computed=0, scheduled=4)])
    session.reset()
    (job,) = session.start_stores([step("r1", [10], computed=0, scheduled=4)]).jobs
    assert job.job_id == 2


# -- hybrid models and policies ---------------------------------------------------------------


def test_a_hybrid_request_stores_each_group_on_its_own_chunk_grid() -> None:
    config = OffloadConfig(
        hash_block_size=4,
        blocks_per_chunk=1,
        groups=(
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=4),
            GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=8, sliding_window=8),
        ),
    )
    session, _ = make(config=config)
    hashes = prefix_hashes(4)
    (job,) = session.start_stores(
        [
            RunningRequest(
                request_id="r1",
                blocks=[blocks([10, 11, 12, 13]), blocks([20, 21])],
                num_computed_tokens=0,
                num_scheduled_tokens=16,
                num_tokens=16,
                block_hashes=hashes,
            )
        ]
    ).jobs
    assert job.plan.keys == (
        *(OffloadKey(0, h) for h in hashes),
        OffloadKey(1, hashes[1]),
        OffloadKey(1, hashes[3]),
    )
    assert job.plan.group_sizes == (4, 2)


def test_tail_first_evicts_a_finished_request_tail_before_its_head() -> None:
    session, workers = make(capacity=4, policy=EvictionPolicyKind.TAIL_FIRST)
    for computed in (0, 4, 8, 12):  # the prompt is computed and stored chunk by chunk
        workers.submit(
            session.start_stores(
                [step("r1", [10, 11, 12, 13], computed=computed, scheduled=4)]
            ).jobs
        )
        workers.finish_all()
    other = prefix_hashes(1, family=1)
    workers.submit(
        session.start_stores([step("r2", [20], computed=0, scheduled=4, hashes=other)]).jobs
    )
    assert session.catalog.entry(key(3)) is None
    entry = session.catalog.entry(key(0))
    assert entry is not None and entry.state is KeyState.READY


def test_a_recompute_range_must_hold_at_least_one_token() -> None:
    with pytest.raises(InvalidInputError, match="stop"):
        RecomputeRange(request_id="r1", start=8, stop=8)


def test_a_running_request_refuses_a_negative_token_count() -> None:
    with pytest.raises(InvalidInputError, match="num_scheduled_tokens"):
        step("r1", [10], computed=0, scheduled=-1)


def test_a_step_that_completes_no_chunk_leaves_the_store_cursor_alone() -> None:
    session, _ = make()
    session.start_stores([step("r1", [10, 11], computed=0, scheduled=8)])
    session.start_stores([step("r1", [10, 11, 12], computed=8, scheduled=3)])
    assert session.request_state("r1").store_cursor == (2,)  # type: ignore[union-attr]


def test_a_refused_request_undoes_the_reservations_of_its_step() -> None:
    session, _ = make()
    session.start_stores([step("r2", [20], computed=0, scheduled=4, hashes=prefix_hashes(1, 2))])
    session.finish("r2")
    with pytest.raises(InvalidInputError, match="finished"):
        session.start_stores(
            [
                step("r1", [10, 11], computed=0, scheduled=8),
                step("r2", [20, 21], computed=4, scheduled=4, hashes=prefix_hashes(2, 2)),
            ]
        )
    assert session.catalog.statuses([key(0), key(1)]) == [KeyStatus.MISS] * 2
    assert session.request_state("r1") is None
    assert session.in_flight() == frozenset({1})


def test_a_report_of_something_other_than_job_results_is_refused() -> None:
    session, _ = make()
    with pytest.raises(InvalidInputError, match="JobResult"):
        session.report(0, [{"job_id": 1}])  # type: ignore[list-item]
