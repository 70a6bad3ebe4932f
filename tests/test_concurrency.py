"""One session, and its catalog, driven from several threads at once (an engine's scheduler and
its output thread, say): every public call holds the session's lock, so the calls do not
interleave and the bookkeeping stays whole."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator

import pytest
from offload_rig import chain

from kvferry.adapters.session import OffloadSession, RunningRequest
from kvferry.core.blocks import GroupBlocks
from kvferry.core.bound import JobResult
from kvferry.core.catalog import Catalog, CatalogConfig, KeyState
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.errors import PlanInvariantError
from kvferry.core.eviction import EvictionPolicyKind

CONFIG = OffloadConfig(
    hash_block_size=4,
    blocks_per_chunk=2,
    groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=4),),
)
TOKENS = 32
"""Tokens of every request: 4 chunks of 8 tokens, 8 blocks."""
BLOCKS = [GroupBlocks.of(range(1, 9))]
ROUNDS = 300


@pytest.fixture(autouse=True)
def _switch_threads_often() -> Iterator[None]:
    """Let the interpreter switch threads every microsecond: interleavings that a default run
    meets once in hours come every few calls."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def done(session: OffloadSession, job_ids: list[int]) -> None:
    session.report(0, [JobResult(job_id=j, success=True, nbytes=0, seconds=0.0) for j in job_ids])


def serve(session: OffloadSession, name: str) -> None:
    """Play an engine's life for ROUNDS requests with shared prefixes: look up, load what hits,
    store the rest, report, finish."""
    for index in range(ROUNDS):
        rid = f"{name}{index}"
        hashes = chain(TOKENS // 4, family=index % 3, shared=4)
        found = session.lookup(rid, block_hashes=hashes, num_tokens=TOKENS, num_computed_tokens=0)
        computed = 0
        if not found.retry and found.tokens:
            try:
                load = session.start_load(
                    rid, BLOCKS, num_computed_tokens=0, hit_tokens=found.tokens
                )
            except PlanInvariantError:  # another thread's store evicted the hit since: compute
                load = None
            else:
                computed = found.tokens
            if load is not None:
                done(session, [load.job_id])
        step = session.start_stores(
            [
                RunningRequest(
                    request_id=rid,
                    blocks=BLOCKS,
                    num_computed_tokens=computed,
                    num_scheduled_tokens=TOKENS - computed,
                    num_tokens=TOKENS,
                    block_hashes=hashes,
                )
            ]
        )
        done(session, [job.job_id for job in step.jobs])
        session.finish(rid)


def read(catalog: Catalog) -> None:
    """Read the catalog the way a router or a metrics thread would."""
    for _ in range(ROUNDS * 4):
        catalog.snapshot()
        catalog.counters()
        catalog.drain_events()


def run_threads(*targets: Callable[[], None]) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


@pytest.mark.parametrize("policy", list(EvictionPolicyKind))
def test_two_engine_threads_and_a_reader_share_one_session(policy: EvictionPolicyKind) -> None:
    catalog = Catalog(CatalogConfig(capacity_rows=6, policy=policy, record_events=True))
    session = OffloadSession(CONFIG, catalog)
    errors = run_threads(
        lambda: serve(session, "a"), lambda: serve(session, "b"), lambda: read(catalog)
    )
    assert errors == []
    assert session.in_flight() == frozenset()
    snapshot = catalog.snapshot()
    assert len(snapshot) == catalog.rows_used <= 6
    assert all(e.state is KeyState.READY and e.pins == 0 for e in snapshot.values())
    assert len({e.row for e in snapshot.values()}) == len(snapshot)


def test_a_catalog_given_a_lock_holds_it_in_every_public_call() -> None:
    class Counting:
        def __init__(self) -> None:
            self.entered = 0

        def __enter__(self) -> None:
            self.entered += 1

        def __exit__(self, *exc: object) -> None:
            return None

    lock = Counting()
    catalog = Catalog(CatalogConfig(capacity_rows=2), lock=lock)
    catalog.counters()
    catalog.statuses([])
    assert lock.entered == 2


def test_the_session_gives_its_lock_to_a_catalog_without_one() -> None:
    catalog = Catalog(CatalogConfig(capacity_rows=2))
    assert catalog.lock is None
    OffloadSession(CONFIG, catalog)
    assert catalog.lock is not None
