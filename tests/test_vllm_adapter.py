"""The vLLM-shaped adapter: stand-ins with vLLM's attribute names drive whole request lives
through the connector facade, with the `cpu` executor moving real bytes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from kvferry.adapters.messages import decode_completions, decode_jobs
from kvferry.adapters.session import OffloadSession
from kvferry.adapters.vllm import (
    ConnectorMetadata,
    ConnectorOutput,
    KvferryConnectorScheduler,
    KvferryConnectorWorker,
    blocks_from_vllm,
    offload_config_from_vllm,
)
from kvferry.core.catalog import Catalog, CatalogConfig
from kvferry.core.config import GroupKind
from kvferry.core.errors import InvalidInputError
from kvferry.core.layout import TensorLayout
from kvferry.core.plan import Direction
from kvferry.executors import KVTensor, make_executor

# -- stand-ins with vLLM's names -------------------------------------------------------------


@dataclass
class FullAttentionSpec:
    block_size: int
    sliding_window: int | None = None


@dataclass
class MLAAttentionSpec(FullAttentionSpec):
    pass


@dataclass
class SlidingWindowSpec:
    block_size: int
    sliding_window: int
    extra_retained_tokens: int = 0


@dataclass
class MambaSpec:
    block_size: int


@dataclass
class ChunkedLocalAttentionSpec:
    block_size: int
    attention_chunk_size: int


@dataclass
class CrossAttentionSpec:
    block_size: int


@dataclass
class Request:
    request_id: str
    num_tokens: int
    num_prompt_tokens: int
    block_hashes: list[bytes]


@dataclass
class KVCacheBlock:
    block_id: int
    block_hash: bytes | None = None
    is_null: bool = False


def kv_cache_config(*specs: object) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])


def kv_blocks(*groups: Sequence[int], cached: int = 0) -> SimpleNamespace:
    """KVCacheBlocks: id 0 is the null block; the first `cached` real blocks carry a hash."""
    return SimpleNamespace(
        blocks=tuple(
            [
                KVCacheBlock(b, block_hash=b"h" if i < cached and b else None, is_null=b == 0)
                for i, b in enumerate(ids)
            ]
            for ids in groups
        )
    )


def hashes(count: int, family: int = 0) -> list[bytes]:
    return [bytes([family]) + i.to_bytes(4, "big") for i in range(count)]


def new_req(rid: str, block_ids: Sequence[Sequence[int]], computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        req_id=rid, block_ids=tuple(list(g) for g in block_ids), num_computed_tokens=computed
    )


def scheduler_output(
    new: Iterable[SimpleNamespace] = (),
    cached: Iterable[tuple[str, Sequence[Sequence[int]] | None, int]] = (),
    scheduled: dict[str, int] | None = None,
    preempted: Iterable[str] = (),
) -> SimpleNamespace:
    cached = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            new_block_ids=[None if c[1] is None else tuple(list(g) for g in c[1]) for c in cached],
            num_computed_tokens=[c[2] for c in cached],
            resumed_req_ids=set(),
        ),
        num_scheduled_tokens=dict(scheduled or {}),
        preempted_req_ids=set(preempted),
    )


class Engine:
    """The facade's scheduler side and one `cpu` worker over numpy KV tensors (K/V split)."""

    def __init__(
        self, *specs: object, hash_block_size: int = 4, blocks_per_chunk: int = 1, rows: int = 32
    ) -> None:
        config = offload_config_from_vllm(
            kv_cache_config(*specs),
            hash_block_size=hash_block_size,
            blocks_per_chunk=blocks_per_chunk,
        )
        self.kv = [np.zeros((2, 64, 4, 8), dtype=np.uint8) for _ in specs]
        executor = make_executor(
            "cpu",
            kv_caches=[[KVTensor(tensor=kv, layout=TensorLayout.KV_SPLIT)] for kv in self.kv],
            blocks_per_chunk=blocks_per_chunk,
            num_rows=rows,
        )
        session = OffloadSession(
            config,
            Catalog(CatalogConfig(capacity_rows=rows)),
            layout_fingerprint=executor.layout.fingerprint,
        )
        self.scheduler = KvferryConnectorScheduler(session)
        self.worker = KvferryConnectorWorker(executor)
        self.rng = np.random.default_rng(0)

    def forward(self, group: int, ids: Sequence[int]) -> None:
        """The forward pass writes fresh KV bytes into `ids` of `group`."""
        shape = self.kv[group][:, list(ids)].shape
        self.kv[group][:, list(ids)] = self.rng.integers(1, 256, size=shape, dtype=np.uint8)

    def step(self, output: SimpleNamespace) -> tuple[ConnectorMetadata, ConnectorOutput]:
        """One engine step: metadata to the worker, loads, stores, results back."""
        meta = self.scheduler.build_connector_meta(output)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv()
        self.worker.wait_for_save()
        return meta, self.scheduler.update_connector_output([self.worker.get_finished()])


# -- mapping --------------------------------------------------------------------------------


def test_spec_kinds_are_recognised_by_class_name() -> None:
    config = offload_config_from_vllm(
        kv_cache_config(
            FullAttentionSpec(16), MLAAttentionSpec(16), SlidingWindowSpec(16, 128), MambaSpec(32)
        ),
        hash_block_size=16,
    )
    assert [g.kind for g in config.groups] == [
        GroupKind.FULL_ATTENTION,
        GroupKind.FULL_ATTENTION,
        GroupKind.SLIDING_WINDOW,
        GroupKind.MAMBA,
    ]
    assert config.groups[2].sliding_window == 128
    assert config.groups[3].block_size == 32


def test_sliding_window_spec_brings_its_extra_retained_tokens() -> None:
    config = offload_config_from_vllm(
        kv_cache_config(SlidingWindowSpec(16, 128, extra_retained_tokens=3)), hash_block_size=16
    )
    assert (config.groups[0].sliding_window, config.groups[0].extra_retained_tokens) == (128, 3)


def test_full_attention_spec_with_a_window_stays_full_attention() -> None:
    config = offload_config_from_vllm(
        kv_cache_config(FullAttentionSpec(16, sliding_window=128)), hash_block_size=16
    )
    assert config.groups[0].kind is GroupKind.FULL_ATTENTION
    assert config.groups[0].sliding_window is None


def test_chunked_local_attention_spec_brings_its_attention_chunk_size() -> None:
    config = offload_config_from_vllm(
        kv_cache_config(FullAttentionSpec(16), ChunkedLocalAttentionSpec(16, 64)),
        hash_block_size=16,
    )
    assert config.groups[1].kind is GroupKind.CHUNKED_LOCAL_ATTENTION
    assert config.groups[1].attention_chunk_size == 64


def test_unknown_spec_class_is_refused_naming_the_group() -> None:
    with pytest.raises(InvalidInputError, match=r"group 1.*CrossAttentionSpec"):
        offload_config_from_vllm(
            kv_cache_config(FullAttentionSpec(16), CrossAttentionSpec(16)),
            hash_block_size=16,
        )


def test_blocks_with_a_hash_are_cached_and_null_blocks_are_null() -> None:
    (group,) = blocks_from_vllm(kv_blocks([0, 7, 8, 9], cached=3))
    assert group.ids.tolist() == [0, 7, 8, 9]
    assert group.is_null.tolist() == [True, False, False, False]
    assert group.is_cached.tolist() == [False, True, True, False]


def test_more_hashes_than_full_hash_blocks_is_refused() -> None:
    engine = Engine(FullAttentionSpec(8), hash_block_size=8)
    request = Request("a", num_tokens=16, num_prompt_tokens=16, block_hashes=hashes(4))
    with pytest.raises(InvalidInputError, match="hash_block_size"):
        engine.scheduler.get_num_new_matched_tokens(request, 0)


# -- whole request lives -----------------------------------------------------------------------


def store_prompt(engine: Engine, request: Request, ids: Sequence[Sequence[int]]) -> None:
    """Run `request`'s prompt in one step and finish it, its stores completed."""
    assert engine.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    engine.scheduler.update_state_after_alloc(request, kv_blocks(*ids), 0)
    for group, group_ids in enumerate(ids):
        engine.forward(group, [b for b in group_ids if b])
    rid = request.request_id
    meta, _ = engine.step(
        scheduler_output(new=[new_req(rid, ids)], scheduled={rid: request.num_tokens})
    )
    assert [job.plan.direction for job in decode_jobs(meta.jobs)] == [Direction.STORE]
    assert engine.scheduler.request_finished(request) == (False, frozenset())


def test_second_request_loads_the_stored_prefix_byte_for_byte() -> None:
    engine = Engine(FullAttentionSpec(4))
    store_prompt(engine, Request("a", 16, 16, hashes(4)), [[1, 2, 3, 4]])
    b = Request("b", num_tokens=22, num_prompt_tokens=22, block_hashes=[*hashes(4), b"x" * 5])

    assert engine.scheduler.get_num_new_matched_tokens(b, 0) == (16, True)
    engine.scheduler.update_state_after_alloc(b, kv_blocks([10, 11, 12, 13, 14, 15]), 16)
    _, output = engine.step(scheduler_output())

    assert output.finished_recving == {"b"}
    assert np.array_equal(engine.kv[0][:, [10, 11, 12, 13]], engine.kv[0][:, [1, 2, 3, 4]])
    assert not engine.kv[0][:, [14, 15]].any()


def test_sliding_window_group_loads_only_its_window() -> None:
    engine = Engine(FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=8))
    store_prompt(engine, Request("a", 32, 32, hashes(8)), [range(1, 9), range(21, 29)])
    b = Request("b", num_tokens=33, num_prompt_tokens=33, block_hashes=hashes(8))

    assert engine.scheduler.get_num_new_matched_tokens(b, 0) == (32, True)
    window_ids = [0] * 6 + [46, 47, 48]  # vLLM nulls the blocks below the window
    engine.scheduler.update_state_after_alloc(b, kv_blocks(range(31, 40), window_ids), 32)
    meta, output = engine.step(scheduler_output())

    (load,) = decode_jobs(meta.jobs)
    assert load.plan.group_sizes == (8, 2)
    assert load.plan.gpu_ids_of(1).tolist() == [46, 47]
    assert output.finished_recving == {"b"}
    assert np.array_equal(engine.kv[1][:, [46, 47]], engine.kv[1][:, [27, 28]])
    assert np.array_equal(engine.kv[0][:, range(31, 39)], engine.kv[0][:, range(1, 9)])


def test_lookup_retries_while_the_prefix_store_is_in_flight() -> None:
    engine = Engine(FullAttentionSpec(4))
    a = Request("a", 16, 16, hashes(4))
    engine.scheduler.get_num_new_matched_tokens(a, 0)
    engine.scheduler.update_state_after_alloc(a, kv_blocks([1, 2, 3, 4]), 0)
    meta = engine.scheduler.build_connector_meta(
        scheduler_output(new=[new_req("a", [[1, 2, 3, 4]])], scheduled={"a": 16})
    )
    engine.worker.bind_connector_metadata(meta)
    engine.worker.wait_for_save()
    b = Request("b", 20, 20, hashes(5))

    assert engine.scheduler.get_num_new_matched_tokens(b, 0) == (None, False)
    engine.scheduler.update_connector_output([engine.worker.get_finished()])
    assert engine.scheduler.get_num_new_matched_tokens(b, 0) == (16, True)


def test_finished_request_holds_its_blocks_until_its_store_completes() -> None:
    engine = Engine(FullAttentionSpec(4))
    a = Request("a", 16, 16, hashes(4))
    engine.scheduler.get_num_new_matched_tokens(a, 0)
    engine.scheduler.update_state_after_alloc(a, kv_blocks([1, 2, 3, 4]), 0)
    meta = engine.scheduler.build_connector_meta(
        scheduler_output(new=[new_req("a", [[1, 2, 3, 4]])], scheduled={"a": 16})
    )
    (store,) = decode_jobs(meta.jobs)

    assert engine.scheduler.request_finished(a) == (True, frozenset({store.job_id}))
    engine.worker.bind_connector_metadata(meta)
    engine.worker.wait_for_save()
    output = engine.scheduler.update_connector_output([engine.worker.get_finished()])
    assert output.finished_sending == {"a"}


def test_preempted_request_jobs_are_flushed_before_the_next_step() -> None:
    engine = Engine(FullAttentionSpec(4))
    a = Request("a", 16, 16, hashes(4))
    engine.scheduler.get_num_new_matched_tokens(a, 0)
    engine.scheduler.update_state_after_alloc(a, kv_blocks([1, 2, 3, 4]), 0)
    meta = engine.scheduler.build_connector_meta(
        scheduler_output(new=[new_req("a", [[1, 2, 3, 4]])], scheduled={"a": 16})
    )
    (store,) = decode_jobs(meta.jobs)
    engine.worker.bind_connector_metadata(meta)
    engine.worker.wait_for_save()

    next_meta = engine.scheduler.build_connector_meta(scheduler_output(preempted=["a"]))
    assert next_meta.flush == (store.job_id,)
    engine.worker.bind_connector_metadata(next_meta)
    reported = decode_completions(engine.worker.get_finished())
    assert [r.job_id for r in reported.results] == [store.job_id]


def test_window_store_skips_blocks_the_engine_already_nulled() -> None:
    engine = Engine(SlidingWindowSpec(4, sliding_window=4), blocks_per_chunk=2)
    a = Request("a", 6, 6, hashes(1))
    engine.scheduler.get_num_new_matched_tokens(a, 0)
    engine.scheduler.update_state_after_alloc(a, kv_blocks([1, 2]), 0)
    engine.step(scheduler_output(new=[new_req("a", [[1, 2]])], scheduled={"a": 6}))
    a.num_tokens, a.block_hashes = 8, hashes(2)
    # Token 7 completes chunk 0 (blocks 0 and 1), but vLLM already freed block 0: at 7 computed
    # tokens a 4-token window needs tokens 4.. only. The kept table still says id 1.
    meta, _ = engine.step(scheduler_output(cached=[("a", [[]], 7)], scheduled={"a": 1}))

    assert decode_jobs(meta.jobs) == ()


def test_load_with_nothing_to_move_reports_the_request_loaded() -> None:
    engine = Engine(FullAttentionSpec(4))
    store_prompt(engine, Request("a", 16, 16, hashes(4)), [[1, 2, 3, 4]])
    b = Request("b", 20, 20, hashes(5))
    tokens, _ = engine.scheduler.get_num_new_matched_tokens(b, 0)
    engine.scheduler.update_state_after_alloc(b, kv_blocks([1, 2, 3, 4, 9], cached=4), tokens)

    meta, output = engine.step(scheduler_output())
    assert decode_jobs(meta.jobs) == ()
    assert output.finished_recving == {"b"}


def test_load_of_chunks_gone_since_lookup_reports_a_recompute_range() -> None:
    engine = Engine(FullAttentionSpec(4))
    store_prompt(engine, Request("a", 16, 16, hashes(4)), [[1, 2, 3, 4]])
    b = Request("b", 20, 20, hashes(5))
    tokens, _ = engine.scheduler.get_num_new_matched_tokens(b, 0)
    engine.scheduler.session.catalog.reset()  # the tier lost the chunks after the lookup

    engine.scheduler.update_state_after_alloc(b, kv_blocks([5, 6, 7, 8, 9]), tokens)
    meta, output = engine.step(scheduler_output())
    assert decode_jobs(meta.jobs) == ()
    assert output.finished_recving == {"b"}
    assert [(r.request_id, r.start, r.stop) for r in output.recompute] == [("b", 0, 16)]


def test_job_completes_only_when_every_worker_reported_it() -> None:
    engine = Engine(FullAttentionSpec(4))
    session = OffloadSession(
        engine.scheduler.session.config,
        Catalog(CatalogConfig(capacity_rows=32)),
        world_size=2,
        layout_fingerprint=engine.worker.executor.layout.fingerprint,
    )
    scheduler = KvferryConnectorScheduler(session)
    second = KvferryConnectorWorker(
        make_executor(
            "cpu",
            kv_caches=[
                [KVTensor(tensor=np.zeros((2, 64, 4, 8), np.uint8), layout=TensorLayout.KV_SPLIT)]
            ],
            blocks_per_chunk=1,
            num_rows=32,
        ),
        rank=1,
    )
    a = Request("a", 16, 16, hashes(4))
    scheduler.get_num_new_matched_tokens(a, 0)
    scheduler.update_state_after_alloc(a, kv_blocks([1, 2, 3, 4]), 0)
    meta = scheduler.build_connector_meta(
        scheduler_output(new=[new_req("a", [[1, 2, 3, 4]])], scheduled={"a": 16})
    )
    scheduler.request_finished(a)
    for worker in (engine.worker, second):
        worker.bind_connector_metadata(meta)
        worker.wait_for_save()

    first_output = scheduler.update_connector_output([engine.worker.get_finished()])
    assert first_output.finished_sending == frozenset()
    second_output = scheduler.update_connector_output([second.get_finished()])
    assert second_output.finished_sending == {"a"}


def test_chunked_prefill_stores_from_block_id_deltas_and_the_next_request_loads_them() -> None:
    engine = Engine(FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=8))
    a = Request("a", 32, 32, hashes(8))
    engine.scheduler.get_num_new_matched_tokens(a, 0)
    engine.scheduler.update_state_after_alloc(a, kv_blocks([1, 2, 3, 4], [21, 22, 23, 24]), 0)
    engine.forward(0, [1, 2, 3, 4])
    engine.forward(1, [21, 22, 23, 24])
    first, _ = engine.step(
        scheduler_output(new=[new_req("a", [[1, 2, 3, 4], [21, 22, 23, 24]])], scheduled={"a": 16})
    )
    engine.forward(0, [5, 6, 7, 8])
    engine.forward(1, [25, 26, 27, 28])
    second, _ = engine.step(
        scheduler_output(cached=[("a", [[5, 6, 7, 8], [25, 26, 27, 28]], 16)], scheduled={"a": 16})
    )
    engine.scheduler.request_finished(a)
    stores = [job for meta in (first, second) for job in decode_jobs(meta.jobs)]
    assert [job.plan.gpu_block_ids.tolist() for job in stores] == [
        [1, 2, 3, 4, 21, 22, 23, 24],
        [5, 6, 7, 8, 25, 26, 27, 28],
    ]

    b = Request("b", 33, 33, hashes(8))
    assert engine.scheduler.get_num_new_matched_tokens(b, 0) == (32, True)
    engine.scheduler.update_state_after_alloc(
        b, kv_blocks(range(31, 40), [0] * 6 + [46, 47, 48]), 32
    )
    _, output = engine.step(scheduler_output())
    assert output.finished_recving == {"b"}
    assert np.array_equal(engine.kv[0][:, range(31, 39)], engine.kv[0][:, range(1, 9)])
    assert np.array_equal(engine.kv[1][:, [46, 47]], engine.kv[1][:, [27, 28]])
