"""The shared tier on a Valkey/Redis Cluster: batches split by hash slot over the nodes."""

from __future__ import annotations

from pathlib import Path

from offload_rig import chain
from shared_tier_rig import admit, compute_and_store, replica
from valkey_server import cluster_in, needs_server

from kvferry.adapters.shared_tier import SharedTierSettings
from kvferry.adapters.valkey_tier import connect

pytestmark = needs_server()


def test_two_engines_share_prefixes_through_a_cluster(tmp_path: Path) -> None:
    for nodes in cluster_in(tmp_path):
        url = nodes[0].url
        a, tier_a = replica(url, cluster=True)
        prompts = [chain(8, family=f, shared=0) for f in range(4)]
        for f, prompt in enumerate(prompts):
            compute_and_store(a, tier_a, f"a{f}", prompt)
        assert tier_a.counters().written == 24
        b, tier_b = replica(url, cluster=True, capacity_rows=64)
        for f, prompt in enumerate(prompts):
            assert admit(b, tier_b, b.arrive(f"b{f}", prompt)) is not None  # pages verified
            b.finish(f"b{f}")
        assert tier_b.counters().promoted == 24
        holding = [
            int(connect(SharedTierSettings(url=node.url, model="x")).dbsize()) for node in nodes
        ]
        assert sum(holding) == 24
        assert sum(1 for count in holding if count) >= 2  # spread over the nodes
