"""kvferry as a vLLM 0.33 KV connector: `--kv-transfer-config` names `KvferryConnector` here.

The only kvferry module that imports vLLM. It maps vLLM's objects onto kvferry's values and
calls: the scheduler side drives an `OffloadSession` (every lookup, load and store decision is
the planner's), the worker side drives an executor on the KV tensors vLLM's allocator made.
Without vLLM installed this module does not import; the rest of kvferry does not need it.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
)

from kvferry.adapters.layer_pages import REQUIRED_KV_CACHE_LAYOUT, LayerGroup, group_kv_tensors
from kvferry.adapters.messages import decode_completions, encode_completions
from kvferry.adapters.session import OffloadSession, RunningRequest
from kvferry.adapters.vllm import group_spec_from_vllm
from kvferry.adapters.vllm_settings import ConnectorSettings
from kvferry.adapters.wire import decode_jobs_binary, encode_jobs_binary
from kvferry.core.blocks import GroupBlocks
from kvferry.core.bound import BoundPlan, JobResult
from kvferry.core.catalog import Catalog, CatalogConfig, EventKind, rows_for_budget
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.errors import InvalidInputError, PlanInvariantError
from kvferry.core.keys import OffloadKey
from kvferry.core.plan import Direction
from kvferry.executors import make_executor
from kvferry.executors.base import Executor

logger = logging.getLogger(__name__)


# -- metadata crossing the process boundary ----------------------------------------------------


@dataclass
class KvferryConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler side ships to every worker for one step."""

    jobs: bytes
    """The step's bound plans (loads first, then stores) as a binary `encode_jobs_binary`
    message (`kvferry.adapters.messages.decode_jobs` reads it too)."""
    flush: tuple[int, ...] = ()
    """Jobs to finish before this step's forward pass may overwrite their GPU blocks."""
    ready: tuple[tuple[str, bool], ...] = ()
    """Requests vLLM waits on whose load moved nothing: (request id, loaded). Every worker
    reports them finished receiving; `loaded` False also reports the load failed."""
    held: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Finished requests whose blocks vLLM holds for kvferry, with the jobs that still read or
    write them; a worker reports a request finished sending once those jobs ended there."""


@dataclass
class KvferryWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Job results of every worker, as `encode_completions` messages (one per worker)."""

    messages: tuple[bytes, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Return this step's messages followed by `other`'s (vLLM merges workers so)."""
        if not isinstance(other, KvferryWorkerMetadata):
            raise InvalidInputError(
                field="kv_connector_worker_meta", expected="KvferryWorkerMetadata", got=other
            )
        return KvferryWorkerMetadata(messages=self.messages + other.messages)


@dataclass
class KvferryConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """The CPU tier's counters and the bytes moved, summed over the interval."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        """Forget every counter."""
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Return the sum of both counter sets."""
        merged = dict(self.data)
        for name, value in other.data.items():
            merged[name] = merged.get(name, 0) + value
        return KvferryConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        """Return the counters as they are (they are sums already)."""
        return dict(self.data)

    def is_empty(self) -> bool:
        """Return True when no counter moved."""
        return not any(self.data.values())


# -- what is read from vLLM's configuration ----------------------------------------------------


@dataclass(frozen=True)
class _Groups:
    """vLLM's KV-cache groups as kvferry sees them."""

    offloaded: tuple[int, ...]
    """vLLM group ids kvferry offloads, in kvferry's group order."""
    specs: tuple[GroupSpec, ...]
    """Their kvferry specs."""
    left_alone: tuple[int, ...]
    """Prefix-cacheable groups of a kind kvferry has no rule for: never offloaded, and a hit
    never reaches past what vLLM's own prefix cache holds for them."""


def _layer_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """Return the per-layer spec of a group (the first one of a uniform-type group)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return next(iter(spec.kv_cache_specs.values()))
    return spec


def _read_groups(kv_cache_config: KVCacheConfig) -> _Groups:
    offloaded, specs, left_alone = [], [], []
    cacheable = set(kv_cache_config.prefix_cacheable_group_ids)
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        if gid not in cacheable:
            continue
        try:
            spec = group_spec_from_vllm(_layer_spec(group.kv_cache_spec), group=gid)
        except InvalidInputError:
            left_alone.append(gid)
            continue
        offloaded.append(gid)
        specs.append(spec)
    kinds = [type(_layer_spec(g.kv_cache_spec)).__name__ for g in kv_cache_config.kv_cache_groups]
    if left_alone:
        names = ", ".join(f"group {gid} ({kinds[gid]})" for gid in left_alone)
        logger.warning(
            "kvferry does not offload %s: no rule for that kind; its hits stay on the GPU", names
        )
    if not offloaded:
        raise InvalidInputError(
            field="kv_cache_config.kv_cache_groups",
            expected="at least one group kvferry can offload",
            got=kinds,
        )
    return _Groups(offloaded=tuple(offloaded), specs=tuple(specs), left_alone=tuple(left_alone))


def _hash_block_size(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """Return the tokens behind each entry of `request.block_hashes`, as vLLM resolves it."""
    if kv_cache_config.hash_block_size is not None:
        return int(kv_cache_config.hash_block_size)
    return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])


def _layer_block_strides(kv_cache_config: KVCacheConfig) -> dict[str, int]:
    return {
        layer: int(tensor.block_stride)
        for tensor in kv_cache_config.kv_cache_tensors
        for layer in tensor.layers
    }


def expected_row_bytes(
    kv_cache_config: KVCacheConfig, offloaded: Sequence[int], f: int
) -> tuple[int, ...]:
    """Return the bytes of one CPU-tier row of each offloaded group on one worker (every group
    has its own rows): `F` pages of every layer of the group, each page slot as wide as the
    layer's block stride."""
    strides = _layer_block_strides(kv_cache_config)
    per_group = []
    for gid in offloaded:
        names = kv_cache_config.kv_cache_groups[gid].layer_names
        per_group.append(f * sum(strides[name] for name in names if name in strides))
    return tuple(per_group)


@dataclass(frozen=True)
class _Shape:
    """Everything both sides derive from vLLM's configuration, identically."""

    settings: ConnectorSettings
    groups: _Groups
    config: OffloadConfig
    world_size: int
    rank: int
    row_bytes: tuple[int, ...]
    num_rows: tuple[int, ...]


def _shape(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> _Shape:
    transfer = vllm_config.kv_transfer_config
    settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
    parallel = vllm_config.parallel_config
    if parallel.decode_context_parallel_size != 1 or parallel.prefill_context_parallel_size != 1:
        raise InvalidInputError(
            field="parallel_config",
            expected="no context parallelism (kvferry does not shard a block's tokens)",
            got=(parallel.prefill_context_parallel_size, parallel.decode_context_parallel_size),
        )
    groups = _read_groups(kv_cache_config)
    config = OffloadConfig(
        hash_block_size=_hash_block_size(vllm_config, kv_cache_config),
        blocks_per_chunk=settings.blocks_per_chunk,
        groups=groups.specs,
        store_decoded_tokens=settings.store_decoded_tokens,
    )
    world_size = int(parallel.world_size)
    row_bytes = expected_row_bytes(kv_cache_config, groups.offloaded, settings.blocks_per_chunk)
    weights = settings.cpu_tier_group_weights
    if weights is not None and len(weights) != len(row_bytes):
        raise InvalidInputError(
            field="kv_connector_extra_config.cpu_tier_group_weights",
            expected=f"one weight per offloaded KV-cache group ({len(row_bytes)})",
            got=list(weights),
        )
    num_rows = rows_for_budget(
        settings.cpu_bytes_to_use, [world_size * r for r in row_bytes], weights=weights
    )
    if min(num_rows) < 1:
        raise InvalidInputError(
            field="kv_connector_extra_config.cpu_bytes_to_use",
            expected=(
                f"at least one row of each group: {world_size * sum(row_bytes)} bytes "
                f"({world_size} workers)"
            ),
            got=settings.cpu_bytes_to_use,
        )
    return _Shape(
        settings=settings,
        groups=groups,
        config=config,
        world_size=world_size,
        rank=int(parallel.rank),
        row_bytes=row_bytes,
        num_rows=num_rows,
    )


# -- the connector -------------------------------------------------------------------------------


class KvferryConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM's KV connector for kvferry: CPU offloading of every KV-cache group it knows.

    vLLM builds one with role SCHEDULER in its scheduler and one with role WORKER per worker,
    from `--kv-transfer-config '{"kv_connector":"KvferryConnector",
    "kv_connector_module_path":"kvferry.adapters.vllm_connector","kv_role":"kv_both",
    "kv_connector_extra_config":{"cpu_bytes_to_use":...}}'`.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        shape = _shape(vllm_config, kv_cache_config)
        self._shape = shape
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            events = vllm_config.kv_events_config
            self._scheduler = _SchedulerSide(
                shape,
                kv_cache_config,
                kv_events=events is not None and bool(events.enable_kv_cache_events),
            )
        else:
            self._worker = _WorkerSide(shape, kv_cache_config)

    # -- what vLLM asks of any connector ------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        """Return False: a dropped store is a future cache miss, not a lost hand-off."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Return the KV-cache layout the worker side maps (`REQUIRED_KV_CACHE_LAYOUT`)."""
        return REQUIRED_KV_CACHE_LAYOUT

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        """Return kvferry's stats object (holding `data` when given)."""
        return KvferryConnectorStats(data=dict(data or {}))

    @property
    def scheduler_side(self) -> _SchedulerSide:
        """Return the scheduler side (raise InvalidInputError in a worker)."""
        if self._scheduler is None:
            raise InvalidInputError(field="role", expected="SCHEDULER", got=self.role)
        return self._scheduler

    @property
    def worker_side(self) -> _WorkerSide:
        """Return the worker side (raise InvalidInputError in the scheduler)."""
        if self._worker is None:
            raise InvalidInputError(field="role", expected="WORKER", got=self.role)
        return self._worker

    # -- scheduler side ---------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """Remember a request vLLM just added (its hashes and tokens grow in place)."""
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Return `(tokens, load_async)`: `(None, False)` to ask again next step, `(0, False)`
        for no hit, else `(tokens, True)`: tokens past `num_computed_tokens` loaded async."""
        bound = self._bound(request, num_computed_tokens)
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens, bound)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """Return the vLLM groups a load restores: the offloaded ones."""
        return self._shape.groups.offloaded

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of `num_external_tokens` into the request's allocated blocks."""
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Return this step's metadata: loads, stores, jobs to flush, held requests."""
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Record the workers' job results (the aggregated worker metadata)."""
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Return `(delay_free, None)`; see `request_finished_all_groups`."""
        return self.scheduler_side.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Return `(delay_free, None)`: True while the request's stores still read its
        blocks (vLLM frees them when a worker report lists it finished sending). Its chunks
        not stored yet (refused earlier while the tier was full) are offered once more, from
        `block_ids`, its final block table. Never True for a request vLLM already holds
        because its load is in flight."""
        return self.scheduler_side.request_finished(request, block_ids)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Return the CPU tier's events since the last call, one per hash block."""
        return self.scheduler_side.take_events()

    def reset_cache(self) -> bool | None:
        """Empty the CPU tier; jobs in flight are flushed by the workers next step."""
        self.scheduler_side.reset_cache()
        return True

    def has_pending_push_work(self) -> bool:
        """Return True while jobs are in flight, so the engine keeps stepping to collect them."""
        return self._scheduler is not None and self._scheduler.busy()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Return the tier's counters moved since the last call (scheduler side only)."""
        return None if self._scheduler is None else self._scheduler.stats()

    def _bound(self, request: Any, num_computed_tokens: int) -> int | None:
        """Return how far past `num_computed_tokens` a hit may reach, as vLLM's own offloading
        connector bounds it: groups left alone are refilled by nothing, so a hit stops where
        vLLM's prefix cache holds them."""
        left_alone = self._shape.groups.left_alone
        if not left_alone or self._kv_cache_manager is None:
            return None
        coordinator = self._kv_cache_manager.coordinator
        _, hits = coordinator.find_longest_cache_hit_per_group(
            request.block_hashes, request.num_tokens - 1
        )
        bound = int(min(hits[gid] for gid in left_alone))
        return max(0, bound - num_computed_tokens)

    # -- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map vLLM's per-layer KV views onto kvferry refs and make the executor."""
        self.worker_side.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Wait for the jobs whose GPU blocks this step may reuse (before the forward pass)."""
        self.worker_side.flush(_metadata(kv_connector_metadata))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take this step's metadata (flushing first, if `handle_preemptions` did not)."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(_metadata(connector_metadata))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Submit this step's loads; they run asynchronously."""
        self.worker_side.start_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: loads are whole-request and asynchronous (vLLM waits on the request)."""
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing: stores are submitted once per step, in `wait_for_save`."""
        return None

    def wait_for_save(self) -> None:
        """Submit this step's stores, ordered after the forward pass already enqueued; the
        source blocks stay protected until the stores report (they are asynchronous)."""
        self.worker_side.start_stores()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Return `(finished sending, finished receiving)` request ids on this worker."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Return this worker's completed sends and receives and its failed receives."""
        sending, recving, failed = self.worker_side.transfer_results()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Return this worker's job results since the last call, for the scheduler side."""
        if self._worker is None:
            return None
        message = self._worker.take_completions()
        return None if message is None else KvferryWorkerMetadata(messages=(message,))

    def shutdown(self) -> None:
        """Drain and close the executor (worker side)."""
        if self._worker is not None:
            self._worker.shutdown()


def _metadata(value: object) -> KvferryConnectorMetadata:
    if not isinstance(value, KvferryConnectorMetadata):
        raise InvalidInputError(
            field="kv_connector_metadata", expected="KvferryConnectorMetadata", got=value
        )
    return value


# -- scheduler side --------------------------------------------------------------------------------


@dataclass
class _Chunk:
    """What a stored key stands for, kept for vLLM's per-block events."""

    group: int
    hashes: tuple[bytes, ...]
    parent: bytes | None
    token_ids: tuple[int, ...]


class _SchedulerSide:
    """The scheduler half: vLLM's scheduler calls mapped onto one OffloadSession."""

    def __init__(
        self, shape: _Shape, kv_cache_config: KVCacheConfig, *, kv_events: bool = True
    ) -> None:
        self._shape = shape
        self._kv_events = kv_events
        """Whether vLLM publishes KV events: only then are stored chunks remembered for them
        (as vLLM's own offloading connector records them only then)."""
        self._kinds = {
            gid: type(_layer_spec(kv_cache_config.kv_cache_groups[gid].kv_cache_spec)).__name__
            for gid in shape.groups.offloaded
        }
        catalog = Catalog(
            CatalogConfig(
                capacity_rows=shape.num_rows,
                policy=shape.settings.eviction_policy,
                record_events=kv_events,
            )
        )
        self._session = OffloadSession(shape.config, catalog, world_size=shape.world_size)
        logger.info(
            "kvferry: CPU tier per group, per worker: %s",
            ", ".join(
                f"group {gid} ({self._kinds[gid]}): {rows} chunks of {pitch} bytes"
                for gid, rows, pitch in zip(
                    shape.groups.offloaded, shape.num_rows, shape.row_bytes, strict=True
                )
            ),
        )
        self._requests: dict[str, Any] = {}
        self._computed: dict[str, int] = {}
        self._loads: list[BoundPlan] = []
        self._loading: set[str] = set()
        """Requests vLLM keeps waiting for a load (its finished-receiving report not seen)."""
        self._ready: list[tuple[str, bool]] = []
        self._held: dict[str, frozenset[int]] = {}
        self._flush: set[int] = set()
        self._fenced: dict[int, set[int]] = {}
        """GPU blocks of sliding-window and Mamba groups that stores in flight read, with
        those stores: vLLM frees such a block while its request runs, once the window has
        passed it, and may hand it out again before the store has read it."""
        self._chunks: dict[OffloadKey, _Chunk] = {}
        self._windowed = tuple(
            spec.kind is not GroupKind.FULL_ATTENTION for spec in shape.config.groups
        )
        """Per kvferry group: True when vLLM frees its blocks while the request runs."""
        self._counted = shape_counters(self._session)

    @property
    def session(self) -> OffloadSession:
        """Return the session this side drives."""
        return self._session

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int, bound: int | None
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        self._requests[rid] = request
        self._computed[rid] = num_computed_tokens
        if request.skip_reading_prefix_cache:
            return 0, False
        result = self._session.lookup(
            rid,
            block_hashes=request.block_hashes,
            num_tokens=request.num_tokens,
            num_computed_tokens=num_computed_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
        )
        if result.retry:
            return None, False
        tokens = result.tokens if bound is None else min(result.tokens, bound)
        return tokens, tokens > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        if num_external_tokens == 0:
            return
        computed = self._computed[rid]
        chosen = _load_tables(
            self._shape, blocks, num_computed_tokens=computed, hit_tokens=num_external_tokens
        )
        self._loading.add(rid)
        try:
            job = self._session.start_load(
                rid, chosen, num_computed_tokens=computed, hit_tokens=num_external_tokens
            )
        except PlanInvariantError:
            logger.warning("kvferry: request %s: its chunks left the CPU tier; recomputing", rid)
            self._ready.append((rid, False))
            return
        if job is None:
            self._ready.append((rid, True))
            return
        self._fence_reallocated_ids(job.plan.gpu_block_ids)
        self._loads.append(job)

    def build_connector_meta(self, scheduler_output: Any) -> KvferryConnectorMetadata:
        for rid in scheduler_output.preempted_req_ids or ():
            if self._session.request_state(rid) is not None:
                self._flush |= self._session.preempt(rid)
        self._fence_reallocated(scheduler_output)
        block_state = scheduler_output.kv_connector_block_state
        ids, computed = _scheduled_columns(scheduler_output)
        scheduled = list(map(scheduler_output.num_scheduled_tokens.__getitem__, ids))
        due = self._session.store_candidates(
            ids, num_computed_tokens=computed, num_scheduled_tokens=scheduled
        )
        offloaded = self._shape.groups.offloaded
        running = []
        for index in due:  # only the requests a store may be due for: their tables are read
            rid = ids[index]
            request = self._requests[rid]
            running.append(
                RunningRequest(
                    request_id=rid,
                    blocks=_BlockTable(block_state, rid, offloaded),
                    num_computed_tokens=computed[index],
                    num_scheduled_tokens=int(scheduled[index]),
                    num_tokens=request.num_tokens,
                    block_hashes=request.block_hashes,
                    num_prompt_tokens=request.num_prompt_tokens,
                )
            )
        step = self._session.start_stores(running)
        for job in step.jobs:
            if self._kv_events:
                self._remember_chunks(job)
            self._fence(job)
        jobs, self._loads = [*self._loads, *step.jobs], []
        meta = KvferryConnectorMetadata(
            jobs=encode_jobs_binary(jobs),
            flush=tuple(sorted(self._flush)),
            ready=tuple(self._ready),
            held=tuple((rid, tuple(sorted(ids))) for rid, ids in sorted(self._held.items())),
        )
        self._flush, self._ready = set(), []
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if meta is not None:
            if not isinstance(meta, KvferryWorkerMetadata):
                raise InvalidInputError(
                    field="kv_connector_worker_meta", expected="KvferryWorkerMetadata", got=meta
                )
            for message in meta.messages:
                completions = decode_completions(message)
                report = self._session.report(completions.worker, completions.results)
                self._unfence({*report.completed, *report.failed})
        self._loading -= set(connector_output.finished_recving or ())
        for rid in connector_output.finished_sending or ():
            self._held.pop(rid, None)
            self._requests.pop(rid, None)

    def request_finished(
        self, request: Any, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        last = None
        if rid not in self._loading and self._session.request_state(rid) is not None:
            last = RunningRequest(
                request_id=rid,
                blocks=_group_blocks([block_ids[gid] for gid in self._shape.groups.offloaded]),
                num_computed_tokens=min(request.num_computed_tokens, request.num_tokens - 1),
                num_scheduled_tokens=0,
                num_tokens=request.num_tokens,
                block_hashes=request.block_hashes,
                num_prompt_tokens=request.num_prompt_tokens,
            )
        jobs = self._session.finish(rid, last=last)
        self._computed.pop(rid, None)
        if rid in self._loading or not jobs:
            # vLLM holds a loading request's blocks until its finished-receiving report.
            self._requests.pop(rid, None)
            return False, None
        self._held[rid] = jobs  # its request is kept for the events of its last store
        return True, None

    def take_events(self) -> list[KVCacheEvent]:
        events: list[KVCacheEvent] = []
        for event in self._session.drain_events():
            gid = self._shape.groups.offloaded[event.group]
            for key in event.keys:
                chunk = self._chunks.get(key)
                if chunk is None:
                    continue
                if event.kind is EventKind.STORED:
                    events.extend(self._stored_events(chunk, gid))
                else:
                    del self._chunks[key]
                    events.append(
                        BlockRemoved(
                            block_hashes=[maybe_convert_block_hash(h) for h in chunk.hashes],
                            medium="CPU",
                            group_idx=gid,
                        )
                    )
        return events

    def reset_cache(self) -> None:
        self._flush |= self._session.reset()
        self._fenced.clear()
        self._chunks.clear()
        self._loading.clear()

    def busy(self) -> bool:
        return bool(self._session.in_flight() or self._ready or self._held or self._flush)

    def stats(self) -> KvferryConnectorStats | None:
        now = shape_counters(self._session)
        moved = {name: value - self._counted.get(name, 0) for name, value in now.items()}
        self._counted = now
        stats = KvferryConnectorStats(data=moved)
        return None if stats.is_empty() else stats

    def _fence(self, store: BoundPlan) -> None:
        """Remember the blocks of `store` that vLLM may free before the request ends."""
        plan = store.plan
        fenced = self._fenced
        start = 0
        for windowed, size in zip(self._windowed, plan.group_sizes, strict=True):
            if windowed and size:
                for block in plan.gpu_block_ids[start : start + size].tolist():
                    fenced.setdefault(block, set()).add(store.job_id)
            start += size

    def _unfence(self, jobs: set[int]) -> None:
        if not jobs or not self._fenced:
            return
        for block in list(self._fenced):
            self._fenced[block] -= jobs
            if not self._fenced[block]:
                del self._fenced[block]

    def _fence_reallocated(self, scheduler_output: Any) -> None:
        """Make the workers wait, before this step's forward pass, for the stores still
        reading a block vLLM hands out again in this step (as vLLM's own connector does)."""
        self._fence_reallocated_ids(_allocated_blocks(scheduler_output))

    def _fence_reallocated_ids(self, blocks: Iterable[int]) -> None:
        if not self._fenced:
            return
        for block in blocks:
            self._flush |= self._fenced.get(int(block), set())

    def _remember_chunks(self, job: BoundPlan) -> None:
        request = self._requests[job.plan.request_id]
        hashes = request.block_hashes
        config = self._shape.config
        size = config.hash_block_size
        tokens = request.all_token_ids
        for key in job.plan.keys:
            if key in self._chunks:
                continue
            per_chunk = config.hashes_per_chunk(key.group)
            last = _index_of(hashes, key.block_hash)
            first = last + 1 - per_chunk
            self._chunks[key] = _Chunk(
                group=key.group,
                hashes=tuple(hashes[first : last + 1]),
                parent=hashes[first - 1] if first > 0 else None,
                token_ids=tuple(tokens[first * size : (last + 1) * size]),
            )

    def _stored_events(self, chunk: _Chunk, gid: int) -> Iterator[KVCacheEvent]:
        size = self._shape.config.hash_block_size
        spec = self._shape.config.groups[chunk.group]
        parent = chunk.parent
        for index, block_hash in enumerate(chunk.hashes):
            yield BlockStored(
                block_hashes=[maybe_convert_block_hash(block_hash)],
                parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
                token_ids=list(chunk.token_ids[index * size : (index + 1) * size]),
                block_size=size,
                lora_id=None,
                medium="CPU",
                lora_name=None,
                group_idx=gid,
                kv_cache_spec_kind=spec.kind.value,
                kv_cache_spec_sliding_window=spec.sliding_window,
            )
            parent = block_hash


def shape_counters(session: OffloadSession) -> dict[str, int]:
    """Return the session's catalog counters as a plain dict (stats are differences of it)."""
    counters = session.counters()
    return {
        "hits": counters.hits,
        "misses": counters.misses,
        "stores": counters.stores,
        "failed_stores": counters.failed_stores,
        "evictions": counters.evictions,
    }


def _index_of(hashes: Sequence[bytes], block_hash: bytes) -> int:
    for index in range(len(hashes) - 1, -1, -1):
        if hashes[index] == block_hash:
            return index
    raise PlanInvariantError(
        field="block_hashes", expected="the hash a store key names", got=block_hash.hex()
    )


_NULL_BLOCK_ID = 0
"""The id of vLLM's shared null block."""


def _group_blocks(
    tables: Sequence[Sequence[int]], starts: Sequence[int] | None = None
) -> tuple[GroupBlocks, ...]:
    """Return the GroupBlocks of the offloaded groups' tables of vLLM's block ids, each given
    from block `starts[g]` on (default: whole)."""
    return GroupBlocks.of_engine_tables(tables, null_id=_NULL_BLOCK_ID, starts=starts)


def _current_table(state: Any, rid: str) -> tuple[tuple[Sequence[Any], ...], bool]:
    """Return request `rid`'s current block table from vLLM's `KVConnectorBlockState`, per
    group, and whether its entries are vLLM's block objects (else block ids).

    vLLM 0.33's scheduler resolves a table with its KV-cache manager's `get_block_ids`, which
    builds the id list of every block of every group; the same manager's `get_blocks` gives
    the same table as its lists of block objects, copying nothing, so a store reads the ids of
    the few blocks it needs and its cost does not grow with the request. Any other resolver
    is called as it is."""
    if state is None or rid not in state.req_ids:
        raise InvalidInputError(
            request=rid,
            field="scheduler_output.kv_connector_block_state",
            expected="the block table of every scheduled request",
            got=None,
        )
    resolve = state.resolve_block_ids
    get_blocks = getattr(getattr(resolve, "__self__", None), "get_blocks", None)
    if get_blocks is None:
        return tuple(resolve(rid)), False
    return tuple(get_blocks(rid).blocks), True


class _BlockTable:
    """A scheduled request's block table, read from vLLM's `KVConnectorBlockState` only when
    called: the session calls it for the requests whose store is due this step, so the tables
    of the others are never resolved, and only from each group's store cursor on."""

    __slots__ = ("_offloaded", "_rid", "_state")

    def __init__(self, state: Any, rid: str, offloaded: tuple[int, ...]) -> None:
        self._state = state
        self._rid = rid
        self._offloaded = offloaded

    def __call__(self, starts: tuple[int, ...]) -> tuple[GroupBlocks, ...]:
        table, objects = _current_table(self._state, self._rid)
        firsts = [
            min(asked, len(table[gid])) for gid, asked in zip(self._offloaded, starts, strict=True)
        ]
        windows = [table[gid][first:] for gid, first in zip(self._offloaded, firsts, strict=True)]
        if objects:
            windows = [list(map(_BLOCK_ID, window)) for window in windows]
        return _group_blocks(windows, firsts)


def load_block_ranges(
    config: OffloadConfig, *, num_computed_tokens: int, hit_tokens: int
) -> tuple[tuple[int, int], ...]:
    """Return, per kvferry group, the block range `[start, stop)` a load of `hit_tokens` after
    `num_computed_tokens` can write into: from the block the GPU prefix ends inside, or the
    group's first needed block if later, to the block holding the last loaded token. A load
    plan reads nothing outside it, so its translation reads nothing outside it either."""
    cached = num_computed_tokens + hit_tokens
    ranges = []
    for spec in config.groups:
        stop = -(-cached // spec.block_size)
        first = spec.first_needed_token(cached) // spec.block_size
        ranges.append((min(max(num_computed_tokens // spec.block_size, first), stop), stop))
    return tuple(ranges)


_BLOCK_ID = operator.attrgetter("block_id")


def _load_tables(
    shape: _Shape, kv_cache_blocks: Any, *, num_computed_tokens: int, hit_tokens: int
) -> tuple[GroupBlocks, ...]:
    """Return the offloaded groups' GroupBlocks a load reads from vLLM's `KVCacheBlocks`: only
    the block objects of `load_block_ranges` are read (a long request's others never are); the
    tables end there, null below. Id 0 is vLLM's null block. A block with a `block_hash` is a
    GPU prefix-cache hit; only a range's first block can be one (the block the GPU prefix ends
    inside): vLLM clears the hash of every block it hands out fresh, and the blocks past the
    GPU prefix are fresh, so their hashes are not read."""
    groups = getattr(kv_cache_blocks, "blocks", kv_cache_blocks)
    if not isinstance(groups, Sequence):
        raise InvalidInputError(
            field="blocks", expected="KVCacheBlocks or a sequence per group", got=groups
        )
    ranges = load_block_ranges(
        shape.config, num_computed_tokens=num_computed_tokens, hit_tokens=hit_tokens
    )
    tables = []
    for gid, (start, stop) in zip(shape.groups.offloaded, ranges, strict=True):
        window = groups[gid][start:stop]
        count = len(window)
        ids = np.zeros(start + count, dtype=np.int64)
        ids[start:] = np.fromiter(map(_BLOCK_ID, window), dtype=np.int64, count=count)
        null = ids == 0
        null[:start] = True
        cached = np.zeros(start + count, dtype=np.bool_)
        if count and not null[start]:
            cached[start] = window[0].block_hash is not None
        tables.append(GroupBlocks(ids=ids, is_null=null, is_cached=cached))
    return tuple(tables)


def _allocated_blocks(scheduler_output: Any) -> Iterator[int]:
    """Yield the GPU blocks vLLM allocated in this step (every group's new ids)."""
    for data in scheduler_output.scheduled_new_reqs:
        for ids in data.block_ids:
            yield from ids
    for new_ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
        for ids in new_ids or ():
            yield from ids
    for copy in scheduler_output.kv_cache_block_copies or ():
        yield copy.dst_block_id


def _scheduled_columns(scheduler_output: Any) -> tuple[list[str], list[int]]:
    """Return the ids and num_computed_tokens of every scheduled request, new ones first."""
    ids = [data.req_id for data in scheduler_output.scheduled_new_reqs]
    computed = [int(data.num_computed_tokens) for data in scheduler_output.scheduled_new_reqs]
    cached = scheduler_output.scheduled_cached_reqs
    if len(cached.req_ids) != len(cached.num_computed_tokens):
        raise InvalidInputError(
            field="scheduler_output.scheduled_cached_reqs.num_computed_tokens",
            expected=f"one count per request ({len(cached.req_ids)})",
            got=len(cached.num_computed_tokens),
        )
    ids += cached.req_ids
    computed += map(int, cached.num_computed_tokens)
    return ids, computed


# -- worker side -----------------------------------------------------------------------------------


class _WorkerSide:
    """The worker half: vLLM's KV views -> an executor; metadata -> submitted jobs."""

    def __init__(self, shape: _Shape, kv_cache_config: KVCacheConfig) -> None:
        self._shape = shape
        self._kv_cache_config = kv_cache_config
        self._executor: Executor | None = None
        self._loads: list[BoundPlan] = []
        self._stores: list[BoundPlan] = []
        self._in_flight: dict[int, tuple[str, Direction]] = {}
        self._results: list[JobResult] = []
        self._recving: set[str] = set()
        self._failed: set[str] = set()
        self._held: dict[str, frozenset[int]] = {}
        self._flushed: KvferryConnectorMetadata | None = None

    @property
    def executor(self) -> Executor:
        """Return the executor (raise InvalidInputError before `register_kv_caches`)."""
        if self._executor is None:
            raise InvalidInputError(
                field="executor", expected="register_kv_caches called first", got=None
            )
        return self._executor

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        config = self._kv_cache_config
        groups = [
            LayerGroup(
                group=gid,
                kind=self._shape.config.groups[index].kind,
                layer_names=config.kv_cache_groups[gid].layer_names,
            )
            for index, gid in enumerate(self._shape.groups.offloaded)
        ]
        tensors = group_kv_tensors(kv_caches, groups, config.num_blocks)
        executor = make_executor(
            self._shape.settings.executor,
            kv_caches=tensors,
            blocks_per_chunk=self._shape.settings.blocks_per_chunk,
            num_rows=self._shape.num_rows,
        )
        if executor.layout.row_pitches != self._shape.row_bytes:
            executor.close()
            raise InvalidInputError(
                field="kv_caches",
                expected=(
                    f"CPU rows of {self._shape.row_bytes} bytes per group, as the scheduler "
                    "side derived "
                    "from kv_cache_config"
                ),
                got=executor.layout.row_pitches,
            )
        self._executor = executor

    def flush(self, meta: KvferryConnectorMetadata) -> None:
        if self._flushed is meta:
            return
        waiting = [job for job in meta.flush if job in self._in_flight]
        self._collect(self.executor.wait(waiting))
        self._flushed = meta

    def bind(self, meta: KvferryConnectorMetadata) -> None:
        self.flush(meta)
        jobs = decode_jobs_binary(meta.jobs)
        self._loads = [job for job in jobs if job.plan.direction is Direction.LOAD]
        self._stores = [job for job in jobs if job.plan.direction is Direction.STORE]
        for rid, loaded in meta.ready:
            self._recving.add(rid)
            if not loaded:
                self._failed.add(rid)
        for rid, ids in meta.held:
            self._held.setdefault(rid, frozenset(ids))

    def start_loads(self) -> None:
        self._submit(self._loads)
        self._loads = []

    def start_stores(self) -> None:
        self._submit(self._stores)
        self._stores = []

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        self._collect(self.executor.poll())
        sending = {
            rid for rid, ids in self._held.items() if not any(job in self._in_flight for job in ids)
        }
        for rid in sending:
            del self._held[rid]
        recving, failed = self._recving, self._failed
        self._recving, self._failed = set(), set()
        return sending, recving, failed

    def take_completions(self) -> bytes | None:
        if not self._results:
            return None
        results, self._results = self._results, []
        return encode_completions(self._shape.rank, results)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._collect(self._executor.close())

    def _submit(self, jobs: Sequence[BoundPlan]) -> None:
        for job in jobs:
            self.executor.submit(job)
            self._in_flight[job.job_id] = (job.plan.request_id, job.plan.direction)

    def _collect(self, results: Iterable[JobResult]) -> None:
        for result in results:
            rid, direction = self._in_flight.pop(result.job_id)
            self._results.append(result)
            if direction is Direction.LOAD:
                self._recving.add(rid)
                if not result.success:
                    self._failed.add(rid)


__all__ = [
    "REQUIRED_KV_CACHE_LAYOUT",
    "KvferryConnector",
    "KvferryConnectorMetadata",
    "KvferryConnectorStats",
    "KvferryWorkerMetadata",
    "expected_row_bytes",
]
