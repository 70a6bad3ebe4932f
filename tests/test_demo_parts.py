"""The demo's parts on their own: the workload, the GPU block pool, page patterns, the report."""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest

from kvferry.adapters.demo_engine import BlockPool
from kvferry.adapters.demo_pages import DemoKVCache, ForwardBatch, PagePattern, expected_pages
from kvferry.adapters.demo_profiles import PROFILES, ProfileName
from kvferry.adapters.demo_report import DemoReport
from kvferry.adapters.demo_workload import ChatWorkload, TokenChain, WorkloadShape
from kvferry.core.errors import InvalidInputError

SHAPE = WorkloadShape(system_prompts=1, turns=(3, 3), active=2)


# -- workload -------------------------------------------------------------------------------------


def test_a_next_turn_extends_the_previous_prompt_and_answer() -> None:
    workload = ChatWorkload(SHAPE, seed=3, num_requests=10)
    first = next(iter(workload.first_turns()))
    second = workload.next_turn(first)
    assert second is not None
    assert second.conversation == first.conversation
    assert second.prompt_tokens > first.prompt_tokens + first.answer_tokens
    assert second.request_id == f"c{first.conversation}-t1"


def test_conversations_share_their_system_prompt_hashes() -> None:
    workload = ChatWorkload(SHAPE, seed=3, num_requests=10)
    a, b = workload.first_turns()
    shared = min(SHAPE.system_prompt_tokens) // 16
    assert a.chain.block_hashes(shared * 16, 16) == b.chain.block_hashes(shared * 16, 16)
    assert a.chain.ids[a.prompt_tokens - 1] != b.chain.ids[b.prompt_tokens - 1]


def test_the_workload_stops_after_its_requests() -> None:
    workload = ChatWorkload(SHAPE, seed=3, num_requests=2)
    a, b = workload.first_turns()
    assert workload.next_turn(a) is None
    assert workload.next_turn(b) is None


def test_a_finished_conversation_is_replaced_by_a_new_one() -> None:
    workload = ChatWorkload(attrs.evolve(SHAPE, turns=(1, 1), active=1), seed=0, num_requests=3)
    (first,) = workload.first_turns()
    following = workload.next_turn(first)
    assert following is not None
    assert (following.conversation, following.turn) == (1, 0)


def test_equal_prefixes_give_equal_identities_and_hashes() -> None:
    a, b = TokenChain(), TokenChain()
    a.extend([5, 6, 7, 8])
    b.extend([5, 6])
    b.extend([7, 9])
    assert a.ids[:3] == b.ids[:3]
    assert a.ids[3] != b.ids[3]
    assert a.block_hashes(4, 2)[0] == b.block_hashes(4, 2)[0]


def test_zero_requests_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="requests"):
        ChatWorkload(SHAPE, seed=0, num_requests=0)


# -- the GPU block pool ---------------------------------------------------------------------------


def test_a_freed_cached_block_stays_reusable_until_reallocated() -> None:
    pool = BlockPool(2)
    block = pool.allocate()
    pool.register(block, b"h")
    pool.release([block])
    assert pool.cached_block(b"h") == block
    assert pool.is_free(block)


def test_uncached_free_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(2)
    cached, plain = pool.allocate(), pool.allocate()
    pool.register(cached, b"h")
    pool.release([cached])
    pool.release([plain])
    assert pool.allocate() == plain
    assert pool.evictions == 0


def test_reallocating_a_cached_block_forgets_its_contents() -> None:
    pool = BlockPool(1)
    block = pool.allocate()
    pool.register(block, b"h")
    pool.release([block])
    assert pool.allocate() == block
    assert pool.cached_block(b"h") is None
    assert pool.evictions == 1


def test_a_touched_block_leaves_the_free_queue_until_every_reference_is_dropped() -> None:
    pool = BlockPool(1)
    block = pool.allocate()
    pool.register(block, b"h")
    pool.touch(block)
    pool.release([block])
    assert not pool.is_free(block)
    pool.release([block])
    assert pool.is_free(block)


def test_the_first_block_with_a_hash_keeps_it() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, b"h")
    pool.register(b, b"h")
    assert pool.cached_block(b"h") == a


# -- pages ----------------------------------------------------------------------------------------


def test_groups_and_refs_get_different_bytes_for_one_prefix() -> None:
    pattern = PagePattern(0, 64)
    ids = np.array([1, 2, 3], dtype=np.uint64)
    rows = [pattern.words(ids, PagePattern.salt(g, r), 16) for g, r in ((0, 0), (0, 1), (1, 0))]
    assert not np.array_equal(rows[0], rows[1])
    assert not np.array_equal(rows[0], rows[2])
    assert np.array_equal(rows[0], pattern.words(ids, PagePattern.salt(0, 0), 16))


def test_the_forward_pass_writes_what_verification_expects() -> None:
    profile = PROFILES[ProfileName.JAMBA]
    cache = DemoKVCache(profile, torch_device=None)
    pattern = PagePattern(0, cache.max_width())
    t = profile.block_size
    ids = np.arange(1, 2 * t + 1, dtype=np.uint64) * np.uint64(7919)
    table = np.array([3, 5], dtype=np.uint64)
    batch = ForwardBatch.empty(2)
    batch.add_tokens(0, table, ids, start=0, stop=2 * t, block_size=t)
    batch.add_states(1, table, ids, start=0, stop=2 * t, block_size=t)
    batch.write(cache, pattern)
    for refs in cache.refs:
        for ref in refs:
            expected = expected_pages(pattern, ref, [0, 1], ids, t)
            assert np.array_equal(cache.read_pages(ref, table), expected)


def test_poisoned_pages_never_match_what_a_prefix_writes() -> None:
    profile = PROFILES[ProfileName.LLAMA]
    cache = DemoKVCache(profile, torch_device=None)
    pattern = PagePattern(0, cache.max_width())
    ref = cache.refs[0][0]
    blocks = np.array([1], dtype=np.uint64)
    cache.poison(ref, blocks)
    ids = np.arange(1, 17, dtype=np.uint64)
    assert not np.array_equal(
        cache.read_pages(ref, blocks), expected_pages(pattern, ref, [0], ids, 16)
    )


def test_jamba_pads_its_mamba_pages_to_the_attention_page() -> None:
    profile = PROFILES[ProfileName.JAMBA]
    mamba = profile.groups[1]
    assert profile.block_size % profile.hash_block_size == 0
    assert mamba.state_bytes() <= profile.mamba_page_stride()
    assert profile.mamba_page_stride() == 2 * profile.attention_page_bytes(profile.groups[0])


# -- the report -----------------------------------------------------------------------------------


def _report(**changes: object) -> DemoReport:
    fields: dict[str, object] = {a.name: 0 for a in attrs.fields(DemoReport)}
    fields.update(profile="p", title="t", scale="s", executor="cpu", device="cpu")
    fields.update(eviction_policy="lru", wall_seconds=0.0, store_seconds=0.0, load_seconds=0.0)
    fields.update(cpu_tier_rows=(4, 4), cpu_tier_row_bytes=(1 << 20, 1 << 10))
    fields.update(group_kinds=("full_attention", "mamba"))
    fields.update(shared_tier=None, shared=None, replica=None)  # a run without a shared tier
    fields.update(changes)
    return DemoReport(**fields)  # type: ignore[arg-type]


def test_the_table_lists_the_chunks_and_row_size_of_every_group() -> None:
    table = _report(cpu_tier_rows=(173, 173), cpu_tier_row_bytes=(589_824, 573_440)).to_table()
    assert "group 0 (full_attention): 173 chunks of 0.6 MB" in table
    assert "group 1 (mamba): 173 chunks of 0.6 MB" in table


def test_rates_are_bytes_over_copy_seconds() -> None:
    report = _report(bytes_loaded=4 * 10**9, load_seconds=2.0)
    assert report.load_gbps == pytest.approx(2.0)
    assert report.store_gbps == 0.0


def test_the_json_report_carries_the_counts_and_the_verified_line() -> None:
    data = json.loads(_report(pages_verified=7, requests=3).to_json())
    assert data["requests"] == 3
    assert data["verified"] == "all 7 pages verified"


def test_the_table_reports_the_window_savings() -> None:
    table = _report(windowed_bytes_loaded=10**6, windowed_bytes_all_blocks=4 * 10**6).to_table()
    assert "saved 3.0 MB (75.0 %)" in table
