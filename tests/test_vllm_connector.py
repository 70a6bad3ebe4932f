"""KvferryConnector inside vLLM 0.33's real scheduler, with vLLM's own KV-cache planning and
allocator on CPU tensors and the `cpu` executor: whole request flows, every computed position's
KV bytes checked before each forward pass (`vllm_rig.Engine.check`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM 0.33 is not installed")
if not vllm.__version__.startswith("0.33."):
    pytest.skip(f"vLLM 0.33 is not installed (found {vllm.__version__})", allow_module_level=True)

import torch  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_events import BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm_rig import (  # noqa: E402
    DeferredExecutor,
    DelayedExecutor,
    Engine,
    EventRecorder,
    build_engine,
    kvferry_transfer_config,
    tiny_model_config,
)

from kvferry.adapters import vllm_connector  # noqa: E402
from kvferry.adapters.vllm import SPEC_KINDS  # noqa: E402
from kvferry.core.config import GroupKind  # noqa: E402
from kvferry.core.errors import InvalidInputError  # noqa: E402
from kvferry.core.plan import Direction  # noqa: E402
from kvferry.executors.faults import FaultPoint, FaultyExecutor  # noqa: E402

PROMPT = list(range(100, 170))
"""70 tokens: four full 16-token blocks and a tail."""


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_model_config(Path(tmp_path_factory.mktemp("tiny-llama")))


def full_attention(layers: int = 2, block_size: int = 16) -> dict[str, Any]:
    return {
        f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
            block_size=block_size, num_kv_heads=2, head_size=8, dtype=torch.float16
        )
        for i in range(layers)
    }


def full_and_sliding(window: int = 32, block_size: int = 16) -> dict[str, Any]:
    return {
        "model.layers.0.self_attn.attn": FullAttentionSpec(
            block_size=block_size, num_kv_heads=2, head_size=8, dtype=torch.float16
        ),
        "model.layers.1.self_attn.attn": SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=2,
            head_size=8,
            dtype=torch.float16,
            sliding_window=window,
        ),
    }


def full_and_mamba() -> dict[str, Any]:
    """A full-attention layer beside a Mamba layer whose state pages are as large as the
    attention pages (vLLM's hybrid allocator needs one page size)."""
    return {
        "model.layers.0.self_attn.attn": FullAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16
        ),
        "model.layers.1.mixer": MambaSpec(
            block_size=16,
            shapes=((4, 32), (4, 96)),
            dtypes=(torch.float16, torch.float16),
            mamba_cache_mode="align",
        ),
    }


def kvferry(**extra: Any) -> Any:
    failure_policy = extra.pop("failure_policy", "recompute")
    return kvferry_transfer_config(
        {"cpu_bytes_to_use": 1 << 22, "executor": "cpu", **extra}, failure_policy=failure_policy
    )


def serve_then_reload(engine: Engine, tail: list[int]) -> None:
    """Serve `PROMPT` once (its chunks are stored), empty the GPU, then serve it again with
    `tail` appended: the second request's prefix can only come from the CPU tier."""
    engine.add("a", PROMPT, max_tokens=3)
    engine.run()
    engine.evict_gpu()
    engine.add("b", PROMPT + tail, max_tokens=3)
    engine.run()


def test_the_json_line_makes_vllms_scheduler_build_kvferrys_connector(model_config: Any) -> None:
    engine = build_engine(model_config, full_attention(), kvferry(blocks_per_chunk=2))
    session = engine.connector.scheduler_side.session
    assert type(engine.connector).__name__ == "KvferryConnector"
    assert session.config.hash_block_size == 16
    assert session.config.blocks_per_chunk == 2
    assert [g.kind for g in session.config.groups] == [GroupKind.FULL_ATTENTION]


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_full_attention_prefix_is_loaded_back_from_the_cpu_tier(
    model_config: Any, blocks_per_chunk: int
) -> None:
    engine = build_engine(
        model_config, full_attention(), kvferry(blocks_per_chunk=blocks_per_chunk)
    )
    serve_then_reload(engine, tail=[7, 8, 9])
    assert engine.scheduled_at("b")[0][0] == 64  # four 16-token blocks from the tier
    assert engine.connector.scheduler_side.session.counters().hits == 4 // blocks_per_chunk
    assert engine.checked_positions >= 2 * 64


def test_a_full_prompt_hit_recomputes_only_the_last_token(model_config: Any) -> None:
    engine = build_engine(model_config, full_attention(), kvferry())
    prompt = PROMPT[:64]
    engine.add("a", prompt, max_tokens=2)
    engine.run()
    engine.evict_gpu()
    engine.add("b", prompt, max_tokens=2)
    engine.run()
    assert engine.scheduled_at("b")[0] == (63, 1)


def test_sliding_window_and_full_attention_groups_are_offloaded_together(
    model_config: Any,
) -> None:
    engine = build_engine(model_config, full_and_sliding(window=32), kvferry())
    session = engine.connector.scheduler_side.session
    assert [g.kind for g in session.config.groups] == [
        GroupKind.FULL_ATTENTION,
        GroupKind.SLIDING_WINDOW,
    ]
    serve_then_reload(engine, tail=[7, 8, 9])
    computed, _ = engine.scheduled_at("b")[0]
    assert computed == 64
    assert engine.checked_positions > 0


def test_a_due_store_reads_the_tail_of_vllms_current_table_through_its_block_objects(
    model_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = build_engine(model_config, full_and_sliding(window=32), kvferry())
    reads = []
    original = vllm_connector._BlockTable.__call__

    def recording(table: Any, starts: tuple[int, ...]) -> Any:
        blocks = original(table, starts)
        state, rid = table._state, table._rid
        current = state.get_block_ids(rid)  # vLLM's own resolver, every id
        reads.append((starts, blocks, current, vllm_connector._current_table(state, rid)[1]))
        return blocks

    monkeypatch.setattr(vllm_connector._BlockTable, "__call__", recording)
    engine.add("a", PROMPT, max_tokens=20)
    engine.run()
    assert any(max(starts) > 0 for starts, *_ in reads)  # decode steps read only a tail
    for starts, blocks, current, objects in reads:
        assert objects  # vLLM's scheduler offers its KV-cache manager's block objects
        for group, start, ids in zip(blocks, starts, current, strict=True):
            assert group.ids[start:].tolist() == ids[start:]
            assert group.is_null.tolist() == [True] * start + [i == 0 for i in ids[start:]]


def test_preempted_requests_resume_with_the_right_bytes(model_config: Any) -> None:
    engine = build_engine(model_config, full_attention(), kvferry(), num_gpu_blocks=33)
    for index in range(3):
        engine.add(f"r{index}", list(range(200 * index + 10, 200 * index + 160)), max_tokens=60)
    engine.run(limit=400)
    assert any(output.preempted_req_ids for output in engine.history)
    assert set(engine.finish_reasons().values()) == {FinishReason.LENGTH}
    assert len(engine.finish_reasons()) == 3


def test_a_request_finishing_while_its_store_is_in_flight_keeps_its_blocks(
    model_config: Any,
) -> None:
    engine = build_engine(model_config, full_attention(), kvferry())
    delayed = engine.wrap_executor(
        lambda inner: DelayedExecutor(inner, lambda job: job.plan.direction is Direction.STORE)
    )
    engine.add("a", PROMPT, max_tokens=1)
    for _ in range(4):
        engine.step()
    assert "a" in engine.finish_reasons()
    assert "a" in engine.scheduler.requests  # vLLM still holds its blocks for kvferry
    pool = engine.scheduler.kv_cache_manager.block_pool
    held = pool.get_num_free_blocks()
    delayed.release()
    engine.run()
    assert "a" not in engine.scheduler.requests
    assert pool.get_num_free_blocks() > held


def test_a_failed_load_is_recomputed_under_the_recompute_policy(model_config: Any) -> None:
    engine = build_engine(model_config, full_attention(), kvferry(failure_policy="recompute"))
    engine.add("a", PROMPT, max_tokens=3)
    engine.run()
    engine.evict_gpu()
    faulty = engine.wrap_executor(
        lambda inner: FaultyExecutor(
            inner,
            lambda job: FaultPoint.MIDWAY if job.plan.direction is Direction.LOAD else None,
        )
    )
    engine.add("b", [*PROMPT, 7, 8, 9], max_tokens=3)
    engine.run()
    assert faulty.injected_count == 1
    assert [computed for computed, _ in engine.scheduled_at("b")][:1] == [0]
    assert engine.finish_reasons()["b"] == FinishReason.LENGTH


def test_a_failed_load_ends_the_request_with_an_error_under_the_fail_policy(
    model_config: Any,
) -> None:
    engine = build_engine(model_config, full_attention(), kvferry(failure_policy="fail"))
    engine.add("a", PROMPT, max_tokens=3)
    engine.run()
    engine.evict_gpu()
    engine.wrap_executor(
        lambda inner: FaultyExecutor(
            inner,
            lambda job: FaultPoint.BEFORE_START if job.plan.direction is Direction.LOAD else None,
        )
    )
    engine.add("b", [*PROMPT, 7, 8, 9], max_tokens=3)
    engine.run()
    assert engine.finish_reasons()["b"] == FinishReason.ERROR
    assert engine.scheduled_at("b") == []


def test_kv_events_name_every_stored_block_with_its_parent(model_config: Any) -> None:
    engine = build_engine(
        model_config, full_attention(), kvferry(blocks_per_chunk=2), kv_events=True
    )
    recorder = EventRecorder()
    engine.scheduler.kv_event_publisher = recorder
    engine.add("a", PROMPT, max_tokens=1)
    engine.run()
    stored = [e for e in recorder.events if isinstance(e, BlockStored) and e.medium == "CPU"]
    hashes = [maybe_convert_block_hash(h) for h in engine.requests["a"].block_hashes]
    assert [e.block_hashes for e in stored] == [[h] for h in hashes[:4]]
    assert [e.parent_block_hash for e in stored] == [None, *hashes[:3]]
    assert stored[1].token_ids == PROMPT[16:32]


def test_no_kv_event_is_made_while_vllm_publishes_none(model_config: Any) -> None:
    engine = build_engine(model_config, full_attention(), kvferry(blocks_per_chunk=2))
    recorder = EventRecorder()
    engine.scheduler.kv_event_publisher = recorder
    engine.add("a", PROMPT, max_tokens=1)
    engine.run()
    assert engine.connector.scheduler_side.session.counters().stores > 0
    assert [e for e in recorder.events if getattr(e, "medium", None) == "CPU"] == []


def full_and_chunked_local() -> dict[str, Any]:
    specs = full_attention(layers=1)
    specs["model.layers.1.self_attn.attn"] = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16, attention_chunk_size=32
    )
    return specs


def test_chunked_local_attention_and_full_attention_groups_are_offloaded_together(
    model_config: Any,
) -> None:
    engine = build_engine(model_config, full_and_chunked_local(), kvferry())
    session = engine.connector.scheduler_side.session
    assert [g.kind for g in session.config.groups] == [
        GroupKind.FULL_ATTENTION,
        GroupKind.CHUNKED_LOCAL_ATTENTION,
    ]
    serve_then_reload(engine, tail=[7, 8, 9])
    assert engine.scheduled_at("b")[0][0] == 64
    assert engine.finish_reasons()["b"] == FinishReason.LENGTH


def test_a_group_of_a_kind_kvferry_does_not_know_is_left_alone(
    model_config: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chunked local attention with its entry taken out of kvferry's table of vLLM's specs
    # stands for a kind vLLM offers and kvferry has no rule for.
    monkeypatch.delitem(SPEC_KINDS, "ChunkedLocalAttentionSpec")
    with caplog.at_level("WARNING"):
        engine = build_engine(model_config, full_and_chunked_local(), kvferry())
    session = engine.connector.scheduler_side.session
    assert [g.kind for g in session.config.groups] == [GroupKind.FULL_ATTENTION]
    assert "ChunkedLocalAttentionSpec" in caplog.text
    serve_then_reload(engine, tail=[7, 8, 9])
    # Nothing refills the group left alone: a hit stops where vLLM's prefix cache says that
    # group needs nothing more, here the 32-token chunk boundary at 64 (its earlier chunks are
    # never read again); the full-attention group's 64 tokens come from the tier.
    assert engine.scheduled_at("b")[0][0] == 64
    assert session.counters().hits == 4
    assert engine.finish_reasons()["b"] == FinishReason.LENGTH


def test_vllms_async_scheduler_overlapping_steps_loads_a_shared_prefix(model_config: Any) -> None:
    engine = build_engine(
        model_config, full_and_sliding(window=32), kvferry(), async_scheduling=True
    )
    overlapped = []
    schedule = engine.scheduler.schedule

    def scheduled_while_a_step_is_unfinished() -> Any:
        overlapped.append(engine.pending_update is not None)
        return schedule()

    engine.scheduler.schedule = scheduled_while_a_step_is_unfinished
    engine.add("a", list(range(100, 250)), max_tokens=20)
    engine.run()
    engine.evict_gpu()
    engine.add("b", [*range(100, 200), *[5] * 30], max_tokens=3)
    engine.run()
    assert type(engine.scheduler).__name__ == "AsyncScheduler"
    assert sum(overlapped) > 10
    assert engine.scheduled_at("b")[0][0] == 96  # six 16-token blocks of the shared 100 tokens
    assert engine.finish_reasons() == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}


def test_a_sliding_window_block_freed_while_its_store_is_in_flight_is_fenced(
    model_config: Any,
) -> None:
    """vLLM frees a sliding-window block once the window has passed it and may hand it out
    again at once; a store still reading it must end before a forward pass writes it."""
    engine = build_engine(model_config, full_and_sliding(window=32), kvferry(), num_gpu_blocks=24)
    deferred = engine.wrap_executor(
        lambda inner: DeferredExecutor(inner, lambda job: job.plan.direction is Direction.STORE)
    )
    overwritten = []

    def forward_writes_no_block_a_store_reads(engine: Engine, output: Any) -> None:
        reading = deferred.reading()
        for rid, computed, count in engine._scheduled(output):
            for table in engine.scheduler.kv_cache_manager.get_block_ids(rid):
                written = {table[p // 16] for p in range(computed, computed + count)}
                overwritten.extend(written & reading)

    engine.on_forward = forward_writes_no_block_a_store_reads
    engine.add("a", list(range(100, 250)), max_tokens=4)
    engine.add("c", list(range(300, 450)), max_tokens=4)
    for _ in range(12):
        engine.step()
    deferred.release()
    engine.run()
    assert deferred.waited  # some store was fenced: its block was handed out again
    assert overwritten == []
    engine.evict_gpu()
    engine.add("b", [*range(100, 200), *[5] * 30], max_tokens=2)
    engine.run()
    assert engine.scheduled_at("b")[0][0] == 96  # the window came back from the tier, checked


def test_a_mamba_hybrid_loads_the_state_and_the_attention_prefix_back(model_config: Any) -> None:
    engine = build_engine(model_config, full_and_mamba(), kvferry(), mamba_cache_mode="align")
    session = engine.connector.scheduler_side.session
    assert [g.kind for g in session.config.groups] == [GroupKind.FULL_ATTENTION, GroupKind.MAMBA]
    engine.add("a", list(range(100, 250)), max_tokens=4)
    engine.run()
    engine.evict_gpu()
    engine.add("b", [*range(100, 200), *[5] * 30], max_tokens=3)
    engine.run()
    # A Mamba state exists where a prefill step of "a" ended (64, 128, ...): the longest
    # shared boundary with one is 64, whose state and four attention blocks are loaded.
    assert engine.scheduled_at("b")[0][0] == 64
    assert session.counters().hits == 5
    assert engine.finish_reasons() == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}


def test_a_finished_request_stores_the_chunks_refused_while_the_tier_was_full(
    model_config: Any,
) -> None:
    # Two rows: one 16-token page of each of the two layers per row.
    engine = build_engine(model_config, full_attention(), kvferry(cpu_bytes_to_use=2 * 2048))
    delayed = engine.wrap_executor(
        lambda inner: DelayedExecutor(inner, lambda job: job.plan.request_id == "other")
    )
    engine.add("other", list(range(500, 532)), max_tokens=1)
    engine.step()  # its two chunks take both rows, still being written
    engine.add("a", [*PROMPT[:32], 7], max_tokens=1)
    engine.on_forward = lambda engine, output: delayed.release()
    engine.step()  # a's chunks find no room; a finishes: they are offered once more
    engine.on_forward = None
    engine.run()
    engine.evict_gpu()
    engine.add("b", [*PROMPT[:32], 8, 9], max_tokens=1)
    engine.run()
    assert engine.scheduled_at("b")[0][0] == 32


def test_the_json_line_of_the_docs_with_the_cpu_executor_serves_a_reload(
    model_config: Any,
) -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "embedding.md").read_text()
    line = re.search(r"--kv-transfer-config '(.*?)'", page, re.S)
    assert line is not None
    settings = json.loads(line.group(1))
    assert settings["kv_connector_extra_config"]["executor"] == "torch"
    settings["kv_connector_extra_config"].update(executor="cpu", cpu_bytes_to_use=1 << 22)
    engine = build_engine(model_config, full_attention(), KVTransferConfig(**settings))
    serve_then_reload(engine, tail=[7, 8, 9])
    assert type(engine.connector).__name__ == "KvferryConnector"
    assert engine.scheduled_at("b")[0][0] == 64


def test_group_weights_give_each_offloaded_group_its_share_of_the_tier(
    model_config: Any,
) -> None:
    even = build_engine(model_config, full_and_sliding(window=32), kvferry())
    weighted = build_engine(
        model_config, full_and_sliding(window=32), kvferry(cpu_tier_group_weights=[1, 3])
    )
    (n, m) = even.connector.scheduler_side.session.catalog.config.capacity_rows
    (a, b) = weighted.connector.scheduler_side.session.catalog.config.capacity_rows
    assert n == m and b == 3 * a


def test_group_weights_of_the_wrong_length_are_refused(model_config: Any) -> None:
    with pytest.raises(InvalidInputError, match="cpu_tier_group_weights"):
        build_engine(model_config, full_attention(), kvferry(cpu_tier_group_weights=[1, 3]))
