"""Promotion and write-behind: two engines (rigs) with their own CPU tiers share one server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from offload_rig import chain
from shared_tier_rig import admit, compute_and_store, replica, retries
from valkey_server import Server, needs_server, server_in

from kvferry.adapters.shared_tier import WriteBehind
from kvferry.core.catalog import KeyState

pytestmark = needs_server()
PROMPT = chain(8, family=0, shared=0)  # 32 tokens: 4 chunks of group 0, 2 of group 1


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    yield from server_in(tmp_path)


def test_a_chunk_only_in_the_shared_tier_is_pending_then_a_hit(server: Server) -> None:
    a, tier_a = replica(server.url)
    compute_and_store(a, tier_a, "r1", PROMPT)
    b, tier_b = replica(server.url)
    request = b.arrive("r1", PROMPT)
    assert retries(b, request)  # asked of the shared tier: pending
    job = admit(b, tier_b, request)  # promoted into B's CPU rows, then loaded and verified
    assert job is not None
    assert b.hits[job.job_id] == 32  # the whole prompt, from the shared tier
    counters = tier_b.counters()
    assert counters.promoted == 6
    assert counters.promoted_bytes == 6 * b.executor.inner.layout.group_row_bytes(0)
    assert counters.loaded_from_shared == len(job.plan.keys)
    b.check_ready_rows()


def test_promoted_chunks_are_plain_cpu_hits_afterwards(server: Server) -> None:
    a, tier_a = replica(server.url)
    compute_and_store(a, tier_a, "r1", PROMPT)
    b, tier_b = replica(server.url)
    admit(b, tier_b, b.arrive("r1", PROMPT))
    b.finish("r1")
    again = b.arrive("r2", PROMPT)
    assert not retries(b, again)
    assert tier_b.counters().probes == 6  # asked once


def test_a_chunk_the_shared_tier_lacks_is_a_miss_after_one_probe(server: Server) -> None:
    b, tier_b = replica(server.url)
    request = b.arrive("r1", PROMPT)
    assert retries(b, request)
    job = admit(b, tier_b, request)
    assert job is None
    assert request.phase == "running"  # admitted to compute everything
    assert tier_b.counters().found == 0


def test_write_behind_on_store_writes_every_stored_chunk(server: Server) -> None:
    a, tier_a = replica(server.url)
    compute_and_store(a, tier_a, "r1", PROMPT)
    counters = tier_a.counters()
    assert counters.written == 6
    assert counters.write_failures == 0


def test_write_behind_off_writes_nothing(server: Server) -> None:
    a, tier_a = replica(server.url, write_behind=WriteBehind.OFF)
    compute_and_store(a, tier_a, "r1", PROMPT)
    assert tier_a.counters().written == 0


def test_write_behind_on_eviction_writes_the_evicted_chunks_bytes(server: Server) -> None:
    a, tier_a = replica(server.url, capacity_rows=(4, 2), write_behind=WriteBehind.ON_EVICTION)
    compute_and_store(a, tier_a, "r1", PROMPT)
    assert tier_a.counters().written == 0  # stored in the CPU tier only
    compute_and_store(a, tier_a, "r2", chain(8, family=1, shared=0))  # evicts r1's six
    assert tier_a.counters().written == 6
    b, tier_b = replica(server.url)
    job = admit(b, tier_b, b.arrive("r1", PROMPT))  # r1's bytes, verified page by page
    assert job is not None
    assert tier_b.counters().promoted == 6


def test_promotion_never_evicts_writing_rows(server: Server) -> None:
    a, tier_a = replica(server.url)
    compute_and_store(a, tier_a, "r1", PROMPT)
    b, tier_b = replica(server.url, capacity_rows=(4, 2))
    other = b.arrive("r0", chain(8, family=1, shared=0))
    admit(b, tier_b, other)
    b.store_step({"r0": 32})  # six rows writing, results not delivered
    request = b.arrive("r1", PROMPT)
    job = admit(b, tier_b, request)
    assert job is None  # no row for the promotion: recomputed
    assert tier_b.counters().no_room == 6
    assert all(e.state is KeyState.WRITING for e in b.catalog.snapshot().values())


def test_promotion_evicts_ready_unpinned_rows_by_the_catalog_policy(server: Server) -> None:
    a, tier_a = replica(server.url)
    compute_and_store(a, tier_a, "r1", PROMPT)
    b, tier_b = replica(server.url, capacity_rows=(4, 2))
    compute_and_store(b, tier_b, "r0", chain(8, family=1, shared=0))  # six ready rows
    job = admit(b, tier_b, b.arrive("r1", PROMPT))
    assert job is not None
    assert b.catalog.counters().evictions == 6
    b.check_ready_rows()
