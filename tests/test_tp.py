"""`kvferry demo --tp N`: N worker processes, one shard of the KV heads each, on the cpu executor;
every rank verifies every page it loads, and a wrong page is reported with its rank."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import numpy as np
import pytest

from kvferry.adapters import cli
from kvferry.adapters.demo_pages import ForwardBatch, PagePattern
from kvferry.adapters.demo_profiles import PROFILES, ProfileName
from kvferry.adapters.demo_ranks import DemoShard, ProcessRanks
from kvferry.adapters.demo_verify import VerificationFailedError
from kvferry.adapters.workers import WorkerPool
from kvferry.core.keys import OffloadKey
from kvferry.core.plan import Direction, TransferPlan

REQUESTS = "32"


def demo_json(*flags: str) -> dict[str, Any]:
    """Run `kvferry demo` on the cpu executor with `flags`; return its JSON report."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["demo", "--requests", REQUESTS, "--no-progress", "--json", *flags]) == 0
    report: dict[str, Any] = json.loads(out.getvalue())
    return report


@pytest.fixture(scope="module")
def reports() -> tuple[dict[str, Any], dict[str, Any]]:
    """The same workload with one in-process rank and with two worker processes."""
    return demo_json(), demo_json("--tp", "2")


def test_two_ranks_verify_every_loaded_page_on_every_rank(
    reports: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    one, two = reports
    assert one["pages_verified"] > 0
    assert two["pages_verified_per_rank"] == [one["pages_verified"]] * 2
    assert two["pages_verified"] == 2 * one["pages_verified"]
    assert two["requests"] == int(REQUESTS)


def test_two_ranks_serve_the_same_tokens_as_one(
    reports: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    one, two = reports
    for field in ("prompt_tokens", "gpu_hit_tokens", "loaded_tokens", "chunks_stored"):
        assert two[field] == one[field], field


def test_two_ranks_together_move_the_bytes_of_one(
    reports: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    one, two = reports
    assert (two["bytes_stored"], two["bytes_loaded"]) == (one["bytes_stored"], one["bytes_loaded"])
    assert two["cpu_tier_rows"] == one["cpu_tier_rows"]


def test_the_table_says_that_the_ranks_share_the_host(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--requests", "16", "--no-progress", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel 2: 2 worker processes (rank 0: cpu, rank 1: cpu)" in out
    assert "2 ranks share the host" in out
    assert "pages verified (rank 0: " in out


def test_a_rank_count_that_does_not_divide_the_heads_exits_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["demo", "--requests", "2", "--no-progress", "--tp", "3"]) == cli.EXIT_INPUT
    assert "divisor of the 8 KV heads" in capsys.readouterr().err


def test_pages_of_different_ranks_differ() -> None:
    ids = np.arange(32, dtype=np.uint64)
    pattern = PagePattern(0, 16)
    rank0 = pattern.words(ids, PagePattern.salt(0, 0, 0), 16)
    rank1 = pattern.words(ids, PagePattern.salt(0, 0, 1), 16)
    assert not (rank0 == rank1).all(axis=1).any()


def _load_plan(blocks: list[int]) -> TransferPlan:
    keys = [OffloadKey(0, bytes([1, i])) for i in range(len(blocks) // 4)]
    return TransferPlan(
        request_id="r",
        direction=Direction.LOAD,
        blocks_per_chunk=4,
        keys=keys,
        gpu_block_ids=blocks,
        group_sizes=[len(blocks)],
        block_indices=[0],
    )


def test_a_wrong_page_on_one_rank_is_reported_with_its_rank() -> None:
    profile = PROFILES[ProfileName.LLAMA]
    shard = DemoShard(
        profile=profile, executor="cpu", on_gpu=False, blocks_per_chunk=4, num_rows=4, seed=0
    )
    with WorkerPool(shard, 2, reply_timeout=30) as pool:
        ranks = ProcessRanks(pool)
        ids = np.arange(100, 164, dtype=np.uint64)
        batch = ForwardBatch.empty(1)
        batch.add_tokens(0, np.array([5, 6, 7, 8], dtype=np.uint64), ids, start=0, stop=64,
                         block_size=16)  # fmt: skip
        ranks.write(batch)
        plan = _load_plan([5, 6, 7, 8])
        ranks.verify(plan, ids)
        assert ranks.pages_verified == (8 * 4, 8 * 4)  # 4 blocks x 8 refs (K, V of 4 layers)
        pool.call_each("poison", [_load_plan([]), plan])
        with pytest.raises(VerificationFailedError, match="tensor-parallel rank 1") as caught:
            ranks.verify(plan, ids)
        assert caught.value.rank == 1


@pytest.mark.parametrize("profile", ["gpt-oss", "jamba"])
def test_hybrid_profiles_verify_every_loaded_page_on_two_ranks(profile: str) -> None:
    report = demo_json("--profile", profile, "--requests", "24", "--tp", "2")
    per_rank = report["pages_verified_per_rank"]
    assert per_rank[0] == per_rank[1] > 0
