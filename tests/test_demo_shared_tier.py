"""`kvferry demo --shared-tier URL --replicas 2`: two engine processes, one real server;
replica B loads the prefixes replica A computed, and every loaded page is verified."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from valkey_server import Server, needs_server, server_in

from kvferry.adapters.config import KvferryConfig
from kvferry.adapters.demo import DemoOptions, run_demo
from kvferry.adapters.demo_profiles import ProfileName
from kvferry.adapters.demo_shared import run_replicas, summary
from kvferry.adapters.shared_tier import SharedTierSettings, WriteBehind

pytestmark = needs_server()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    yield from server_in(tmp_path)


def options(url: str, requests: int = 12) -> DemoOptions:
    return DemoOptions(
        profile=ProfileName.LLAMA,
        requests=requests,
        shared_tier=SharedTierSettings(url=url, model="llama"),
    )


def test_replica_b_loads_the_prefixes_replica_a_computed(server: Server) -> None:
    a, b = run_replicas(options(server.url), 2)
    assert (a.replica, b.replica) == ("A", "B")
    assert a.shared is not None and b.shared is not None
    assert a.shared.written > 0
    assert b.shared.loaded_from_shared > 0
    assert b.shared.promoted_bytes > 0
    assert b.shared.refused == b.shared.errors == b.shared.timeouts == 0
    assert b.pages_verified > 0  # a wrong byte would have raised
    assert b.recomputed_tokens < a.recomputed_tokens


def test_written_behind_on_eviction_replica_b_loads_what_a_evicted(server: Server) -> None:
    small = KvferryConfig.from_mapping({"cpu_tier_bytes": "48MiB"})
    settings = SharedTierSettings(
        url=server.url, model="llama", write_behind=WriteBehind.ON_EVICTION
    )
    run = DemoOptions(profile=ProfileName.LLAMA, requests=16, config=small, shared_tier=settings)
    a, b = run_replicas(run, 2)
    assert a.shared is not None and b.shared is not None
    assert a.chunks_evicted > 0
    assert a.shared.written == a.chunks_evicted  # each evicted chunk, nothing else
    assert b.shared.loaded_from_shared > 0
    assert b.pages_verified > 0


def test_the_two_replica_summary_passes_only_when_b_reused_a_prefix(server: Server) -> None:
    reports = run_replicas(options(server.url), 2)
    text, passed = summary(reports)
    assert passed
    assert "replica B reused" in text
    no_reuse = attrs.evolve(reports[1], shared=None, replica="C")
    _, passed_with_c = summary([*reports, no_reuse])
    assert not passed_with_c


def test_one_engine_with_an_unreachable_shared_tier_recomputes_and_verifies() -> None:
    report = run_demo(options("redis://127.0.0.1:1", requests=8))
    assert report.shared is not None
    assert report.shared.errors + report.shared.timeouts >= 1
    assert report.shared.promoted == 0
    assert report.requests == 8


def test_the_command_line_runs_two_replicas_and_reports_each_tier(server: Server) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvferry.adapters.cli",
            "demo",
            "--requests",
            "12",
            "--shared-tier",
            server.url.replace("redis://", "valkey://"),
            "--replicas",
            "2",
            "--shared-tier-timeout",
            "10",  # a busy machine must not turn the server's answers into misses
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("chunks loaded from CPU / shared") == 2
    assert "promoted shared->CPU" in done.stdout
    assert "replica B reused the prefixes" in done.stdout
    assert "loaded pages of 2 replicas verified" in done.stdout


def test_replicas_need_a_shared_tier() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvferry.adapters.cli", "demo", "--replicas", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "replicas" in done.stderr
