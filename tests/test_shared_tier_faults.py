"""Fault drills: the server stopped, restarted empty, slow or full, and a tampered value.
Requests recompute, nothing wrong is loaded (the rig verifies every page), nothing waits past
the timeout, and no call an engine's step makes waits on the network."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from offload_rig import chain
from shared_tier_rig import admit, compute_and_store, replica, retries
from valkey_server import DelayProxy, Server, needs_server, server_in

from kvferry.adapters.shared_tier import SharedTier
from kvferry.adapters.valkey_tier import connect

pytestmark = needs_server()
PROMPT = chain(8, family=0, shared=0)
STEP_BUDGET_S = 0.15
"""What one call of an engine's step may take at most here: far below the proxy's delay, so
a call that waited on the network would show (the margin is for a loaded machine)."""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    yield from server_in(tmp_path)


def timed_poll(tier: SharedTier) -> float:
    start = time.monotonic()
    tier.poll()
    return time.monotonic() - start


def test_a_stopped_server_makes_requests_recompute(server: Server) -> None:
    a, tier_a = replica(server.url)
    compute_and_store(a, tier_a, "r1", PROMPT)
    server.stop()
    b, tier_b = replica(server.url, timeout_s=0.3)
    request = b.arrive("r1", PROMPT)
    start = time.monotonic()
    job = admit(b, tier_b, request)
    assert job is None  # computed from scratch
    assert time.monotonic() - start < 0.3 + 0.5
    assert tier_b.counters().errors + tier_b.counters().timeouts >= 1


def test_while_the_server_is_down_lookups_skip_it(server: Server) -> None:
    server.stop()
    b, tier_b = replica(server.url, timeout_s=0.3, retry_after_s=30.0)
    admit(b, tier_b, b.arrive("r1", PROMPT))
    other = b.arrive("r2", chain(8, family=1, shared=0))
    assert not retries(b, other)  # no question sent: a miss at once
    assert tier_b.counters().probes == 6


def test_a_server_restarted_empty_makes_requests_recompute(server: Server) -> None:
    a, tier_a = replica(server.url)
    compute_and_store(a, tier_a, "r1", PROMPT)
    b, tier_b = replica(server.url, retry_after_s=0.05)
    warm = b.arrive("r0", chain(2, family=2, shared=0))
    admit(b, tier_b, warm)  # B's connection is open
    server.restart()
    job = admit(b, tier_b, b.arrive("r1", PROMPT))
    assert job is None
    again, tier_again = replica(server.url)  # another engine computes and stores it again
    compute_and_store(again, tier_again, "r2", PROMPT)
    time.sleep(0.1)  # past retry_after_s and absent_ttl_s
    job = admit(b, tier_b, b.arrive("r3", PROMPT))
    assert job is not None  # its pages verified
    assert tier_b.counters().promoted == 6


def test_a_slow_server_times_out_and_the_step_never_waits(server: Server) -> None:
    a, tier_a = replica(server.url)
    compute_and_store(a, tier_a, "r1", PROMPT)
    proxy = DelayProxy(server.port, delay_s=1.0)
    try:
        b, tier_b = replica(proxy.url, timeout_s=0.2)
        request = b.arrive("r1", PROMPT)
        start = time.monotonic()
        slowest = 0.0
        while request.phase == "waiting":
            slowest = max(slowest, timed_poll(tier_b))
            lookup_start = time.monotonic()
            b.admit(request)
            slowest = max(slowest, time.monotonic() - lookup_start)
            tier_b.wait(0.01)
            assert time.monotonic() - start < 2.0, "still told to retry"
        assert time.monotonic() - start < 0.2 + 0.5  # given up at the timeout
        assert slowest < STEP_BUDGET_S
        counters = tier_b.counters()
        assert counters.timeouts + counters.errors == 1  # given up by the client or the tier
        assert request.load is None  # recomputed
    finally:
        tier_b.close()
        proxy.close()


def test_a_full_server_refuses_writes_and_requests_recompute(tmp_path: Path) -> None:
    for server in server_in(tmp_path, ["--maxmemory", "1", "--maxmemory-policy", "noeviction"]):
        a, tier_a = replica(server.url)
        compute_and_store(a, tier_a, "r1", PROMPT)
        assert tier_a.counters().write_failures == 6
        b, tier_b = replica(server.url)
        assert admit(b, tier_b, b.arrive("r1", PROMPT)) is None


def test_a_server_evicting_for_room_serves_only_whole_verified_chunks(tmp_path: Path) -> None:
    for server in server_in(tmp_path, ["--maxmemory-policy", "allkeys-lru"]):
        a, tier_a = replica(server.url)
        b, tier_b = replica(server.url, capacity_rows=1000)
        compute_and_store(a, tier_a, "a", chain(8, family=999, shared=0))
        admit(b, tier_b, b.arrive("b", chain(8, family=999, shared=0)))
        client = connect(tier_a.settings)
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used + 150_000)  # room for about 500 of the 900 chunks
        prompts = [chain(8, family=f, shared=0) for f in range(150)]
        for f, prompt in enumerate(prompts):
            compute_and_store(a, tier_a, f"a{f}", prompt)
        assert tier_a.counters().write_failures == 0
        assert 0 < int(client.dbsize()) < 150 * 6  # the server evicted some
        loaded = 0
        for f, prompt in enumerate(prompts):
            job = admit(b, tier_b, b.arrive(f"b{f}", prompt))  # pages verified
            loaded += job is not None
            b.finish(f"b{f}")
        assert 0 < loaded < 150
        b.check_ready_rows()


def test_a_tampered_value_is_refused_and_recomputed(server: Server) -> None:
    a, tier_a = replica(server.url)
    compute_and_store(a, tier_a, "r1", PROMPT)
    client = connect(tier_a.settings)
    for name in client.keys("*"):
        value = bytearray(client.get(name))
        value[-1] ^= 1
        client.set(name, bytes(value))
    b, tier_b = replica(server.url)
    assert admit(b, tier_b, b.arrive("r1", PROMPT)) is None
    counters = tier_b.counters()
    assert counters.refused == 6
    assert counters.promoted == 0
    assert b.catalog.counters().rows_used == 0  # the reserved rows were given back
