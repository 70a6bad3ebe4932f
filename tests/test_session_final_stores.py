"""Stores at a request's end: in a multi-turn chat, every complete chunk of one turn is loadable
by the next, including the chunk its last step completed and chunks refused earlier while the
CPU tier was full; the finished request's blocks are held until that last store ends."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

from session_fakes import FakeWorkers, blocks, prefix_hashes

from kvferry.adapters.messages import decode_jobs, encode_completions
from kvferry.adapters.session import OffloadSession, RunningRequest
from kvferry.adapters.vllm import KvferryConnectorScheduler
from kvferry.core.bound import JobResult
from kvferry.core.catalog import Catalog, CatalogConfig
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.lookup import LookupResult

CONFIG = OffloadConfig(
    hash_block_size=4,
    blocks_per_chunk=1,
    groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=4),),
)
ROWS = 8
TURN_IDS = list(range(10, 16))
"""The first turn's blocks: 17 tokens need 5 blocks of 4 (one spare)."""


def running(
    rid: str, ids: Sequence[int], computed: int, scheduled: int, tokens: int
) -> RunningRequest:
    """Return one step of a chat request whose token `i` has hash block `i // 4`."""
    return RunningRequest(
        request_id=rid,
        blocks=[blocks(ids)],
        num_computed_tokens=computed,
        num_scheduled_tokens=scheduled,
        num_tokens=tokens,
        block_hashes=prefix_hashes(tokens // 4),
        num_prompt_tokens=10,
    )


def fill_the_tier_with_writes(session: OffloadSession, workers: FakeWorkers) -> list[int]:
    """Return the jobs of another request whose stores take every row (still being written)."""
    step = session.start_stores(
        [
            RunningRequest(
                request_id="other",
                blocks=[blocks(range(30, 30 + ROWS))],
                num_computed_tokens=0,
                num_scheduled_tokens=4 * ROWS,
                num_tokens=4 * ROWS,
                block_hashes=prefix_hashes(ROWS, family=9),
            )
        ]
    )
    workers.submit(step.jobs)
    return [job.job_id for job in step.jobs]


def serve_first_turn(session: OffloadSession, workers: FakeWorkers) -> list[str]:
    """Serve a 10-token prompt and a 7-token answer one step at a time, storing every step;
    return each step's refusals. Its 16 computed tokens are 4 chunks, the last one completed
    by the last step (token 15; token 16, sampled last, has no KV yet)."""
    refused = []
    steps = [(0, 10, 10)] + [(t, 1, t + 1) for t in range(10, 16)]
    for computed, scheduled, tokens in steps:
        step = session.start_stores([running("turn-1", TURN_IDS, computed, scheduled, tokens)])
        workers.submit(step.jobs)
        refused.extend(step.no_room)
    return refused


def test_every_complete_chunk_of_a_turn_is_loadable_by_the_next_turn() -> None:
    session = OffloadSession(CONFIG, Catalog(CatalogConfig(capacity_rows=ROWS)))
    workers = FakeWorkers(session)
    other = fill_the_tier_with_writes(session, workers)
    assert serve_first_turn(session, workers) == ["turn-1"] * 7  # the tier was full throughout
    for job in other:
        workers.finish(job)  # room: the other request's chunks are ready, hence evictable

    gate = session.finish("turn-1", last=running("turn-1", TURN_IDS, 16, 0, 17))

    assert gate  # the blocks stay held while the last store reads them
    workers.submit(session.start_stores([]).jobs)
    released = workers.finish_all().released
    assert released == ("turn-1",)
    found = session.lookup(
        "turn-2", block_hashes=prefix_hashes(5), num_tokens=22, num_computed_tokens=0
    )
    assert found == LookupResult(tokens=16)


def test_a_last_store_without_room_is_offered_once_more_with_the_next_stores() -> None:
    session = OffloadSession(CONFIG, Catalog(CatalogConfig(capacity_rows=ROWS)))
    workers = FakeWorkers(session)
    other = fill_the_tier_with_writes(session, workers)
    serve_first_turn(session, workers)

    gate = session.finish("turn-1", last=running("turn-1", TURN_IDS, 16, 0, 17))
    for job in other:  # the room comes only after the finish
        workers.finish(job)
    assert gate <= session.in_flight()
    step = session.start_stores([])

    assert [job.job_id for job in step.jobs] == sorted(gate)
    assert len(step.jobs[0].plan.keys) == 4
    workers.submit(step.jobs)
    assert workers.finish_all().released == ("turn-1",)


def test_a_last_store_still_without_room_releases_the_blocks_without_storing() -> None:
    session = OffloadSession(CONFIG, Catalog(CatalogConfig(capacity_rows=ROWS)))
    workers = FakeWorkers(session)
    fill_the_tier_with_writes(session, workers)
    serve_first_turn(session, workers)

    gate = session.finish("turn-1", last=running("turn-1", TURN_IDS, 16, 0, 17))
    step = session.start_stores([])

    assert gate and step.jobs == () and step.released == ("turn-1",)
    assert not gate & session.in_flight()
    assert session.request_state("turn-1") is None


def test_a_finish_with_every_chunk_stored_plans_nothing_and_holds_nothing() -> None:
    session = OffloadSession(CONFIG, Catalog(CatalogConfig(capacity_rows=ROWS)))
    workers = FakeWorkers(session)
    serve_first_turn(session, workers)
    workers.finish_all()

    assert session.finish("turn-1", last=running("turn-1", TURN_IDS, 16, 0, 17)) == frozenset()
    assert session.start_stores([]).jobs == ()


# -- the same through the vLLM-shaped facade, with its own call points ------------------------


def request(rid: str, tokens: int, computed: int) -> SimpleNamespace:
    """Return a vLLM-like request of `tokens` tokens (hash block `i` for tokens 4i..4i+3)."""
    return SimpleNamespace(
        request_id=rid,
        num_tokens=tokens,
        num_prompt_tokens=8,
        num_computed_tokens=computed,
        block_hashes=list(prefix_hashes(tokens // 4)),
    )


def output(
    new: Sequence[tuple[str, list[int]]] = (), scheduled: dict[str, int] | None = None
) -> SimpleNamespace:
    """Return a vLLM-like scheduler output with only new requests."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=rid, block_ids=(ids,), num_computed_tokens=0) for rid, ids in new
        ],
        scheduled_cached_reqs=None,
        num_scheduled_tokens=dict(scheduled or {}),
        preempted_req_ids=set(),
    )


def done(jobs: Sequence[int]) -> bytes:
    """Return one worker's message saying every job of `jobs` succeeded."""
    return encode_completions(
        0, [JobResult(job_id=j, success=True, nbytes=0, seconds=0.0) for j in jobs]
    )


def test_vllm_finished_request_stores_chunks_refused_while_the_tier_was_full() -> None:
    session = OffloadSession(CONFIG, Catalog(CatalogConfig(capacity_rows=2)))
    scheduler = KvferryConnectorScheduler(session)
    other = SimpleNamespace(
        request_id="other",
        num_tokens=8,
        num_prompt_tokens=8,
        num_computed_tokens=0,
        block_hashes=list(prefix_hashes(2, family=9)),
    )
    first = request("a", 8, 0)
    for req in (other, first):
        assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        scheduler.update_state_after_alloc(req, SimpleNamespace(blocks=((),)), 0)
    meta = scheduler.build_connector_meta(output([("other", [20, 21])], {"other": 8}))
    writing = [job.job_id for job in decode_jobs(meta.jobs)]
    meta = scheduler.build_connector_meta(output([("a", [1, 2, 3])], {"a": 8}))
    assert decode_jobs(meta.jobs) == ()  # no room: both rows are being written
    first.num_tokens, first.num_computed_tokens = 9, 8  # one token sampled: finished
    scheduler.update_connector_output([done(writing)])

    held, jobs = scheduler.request_finished(first, ([1, 2, 3],))

    assert held
    (last,) = decode_jobs(scheduler.build_connector_meta(output()).jobs)
    assert set(jobs) == {last.job_id} and len(last.plan.keys) == 2
    assert scheduler.update_connector_output([done([last.job_id])]).finished_sending == {"a"}
    again = request("b", 12, 0)
    assert scheduler.get_num_new_matched_tokens(again, 0) == (8, True)
