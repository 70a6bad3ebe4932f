"""A vLLM 0.33 engine in miniature for the connector's tests: vLLM's real scheduler, vLLM's
own KV-cache planning and allocator on CPU tensors, and a stand-in model that writes, for every
computed position, bytes that depend only on the tokens up to it (as a real model's KV does).

Imports vLLM: load it only after `pytest.importorskip("vllm")`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec, MambaSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.kv_offload.base import TransferResult
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvferry.adapters.messages import decode_jobs
from kvferry.core.plan import Direction

TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""A model config vLLM can read from a local folder (no weights are ever loaded)."""


def tiny_model_config(folder: Path) -> ModelConfig:
    """Return vLLM's ModelConfig of `TINY_MODEL`, written to `folder` (slow: make it once)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_MODEL))
    return ModelConfig(
        model=str(folder), skip_tokenizer_init=True, dtype="float16", seed=0, max_model_len=512
    )


def kvferry_transfer_config(
    extra: dict[str, Any], *, failure_policy: str = "recompute"
) -> KVTransferConfig:
    """Return the JSON line's `KVTransferConfig` for kvferry with `extra` settings."""
    return KVTransferConfig(
        kv_connector="KvferryConnector",
        kv_connector_module_path="kvferry.adapters.vllm_connector",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        kv_load_failure_policy=failure_policy,
    )


def offloading_transfer_config(extra: dict[str, Any]) -> KVTransferConfig:
    """Return the `KVTransferConfig` of vLLM's built-in OffloadingConnector."""
    return KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )


@dataclass
class Engine:
    """vLLM's scheduler, one worker-side connector and the KV tensors it registered."""

    vllm_config: VllmConfig
    scheduler: Scheduler
    worker: Any
    kv_caches: dict[str, torch.Tensor]
    worker_config: KVCacheConfig
    kernel_block_sizes: list[int]
    hash_block_size: int
    requests: dict[str, Request] = field(default_factory=dict)
    checked_positions: int = 0
    history: list[Any] = field(default_factory=list)
    """Every step's scheduler output."""
    outputs: list[Any] = field(default_factory=list)
    """Every step's engine-core outputs (what `update_from_output` returned)."""
    on_forward: Callable[[Engine, Any], None] | None = None
    verify: bool = True
    """Check every computed position's bytes before each forward pass (False for a
    connector whose worker moves no bytes here)."""
    decisions: list[StepDecisions] = field(default_factory=list)
    """What the scheduler-side connector decided at every step (`record_decisions`)."""
    overlap: bool = False
    """Schedule each step before the previous step's output is processed, as vLLM's engine
    does with async scheduling (set by `build_engine(async_scheduling=True)`)."""
    pending_update: tuple[Any, Any] | None = None
    """The step scheduled and run whose output vLLM has not processed yet (`overlap`)."""

    @property
    def connector(self) -> Any:
        """Return the scheduler-side connector."""
        return self.scheduler.connector

    def add(self, request_id: str, prompt: Sequence[int], max_tokens: int) -> Request:
        """Add a request whose generated tokens are ignored until `max_tokens`."""
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=get_request_block_hasher(self.hash_block_size, sha256),
        )
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def step(self) -> Any:
        """Run one engine step as vLLM's model runner drives a connector; return the
        scheduler output. Before the forward pass, every scheduled request's computed
        positions are checked."""
        self.decisions.append(StepDecisions())
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        self.decisions[-1].loads, self.decisions[-1].stores = transfers_of(
            meta, self.connector, len(self.worker_config.kv_cache_groups)
        )
        self.history.append(output)
        if self.pending_update is not None:
            self._update(*self.pending_update)
        runner_output = self._execute(output)
        if self.overlap and output.total_num_scheduled_tokens > 0:
            self.pending_update = (output, runner_output)
        else:
            self._update(output, runner_output)
        return output

    def _update(self, output: Any, runner_output: Any) -> None:
        self.pending_update = None
        self.outputs.append(self.scheduler.update_from_output(output, runner_output))

    def _execute(self, output: Any) -> Any:
        """Run the worker side and the stand-in model on one step; return the runner output."""
        meta = output.kv_connector_metadata
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        scheduled = self._scheduled(output)
        for rid, computed, _ in scheduled:
            if self.verify:
                self.check(rid, computed, output)
        if self.on_forward is not None:
            self.on_forward(self, output)
        for rid, computed, count in scheduled:
            self.forward(rid, computed, count)
        self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        results = self.worker.get_transfer_results(output.finished_req_ids)
        kv_output = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            kv_connector_worker_meta=self.worker.build_connector_worker_meta(),
        )
        self.worker.clear_connector_metadata()
        sampled = []
        for rid, computed, count in scheduled:
            request = self.requests[rid]
            done = computed + count >= request.num_tokens
            sampled.append([next_token(request.all_token_ids)] if done else [])
        ids = [rid for rid, _, _ in scheduled]
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )

    def wrap_executor(self, wrap: Callable[[Any], Any]) -> Any:
        """Replace the worker's executor by `wrap(executor)` (a fault or delay wrapper)."""
        side = self.worker.worker_side
        side._executor = wrap(side.executor)
        return side._executor

    def evict_gpu(self) -> None:
        """Empty vLLM's GPU prefix cache and zero the KV memory, so that a later hit can only
        come from the CPU tier (and stale bytes cannot pass a check)."""
        assert self.scheduler.reset_prefix_cache()
        for view in self.kv_caches.values():
            view.view(torch.uint8).zero_()

    def scheduled_at(self, rid: str) -> list[tuple[int, int]]:
        """Return (num_computed_tokens, num_scheduled_tokens) of every step that ran `rid`."""
        return [
            (computed, count)
            for output in self.history
            for r, computed, count in self._scheduled(output)
            if r == rid
        ]

    def finish_reasons(self) -> dict[str, Any]:
        """Return each finished request's finish reason."""
        reasons = {}
        for outputs in self.outputs:
            for client in outputs.values():
                for out in client.outputs:
                    if out.finish_reason is not None:
                        reasons[out.request_id] = out.finish_reason
        return reasons

    def run(self, limit: int = 200) -> int:
        """Step until no request is left and no transfer is pending; return the steps."""
        for count in range(1, limit + 1):
            self.step()
            drained = not self.scheduler.has_requests() and self.pending_update is None
            if drained and not self.connector.has_pending_push_work():
                return count
        raise AssertionError(f"the engine did not drain in {limit} steps")

    # -- the stand-in model ----------------------------------------------------------------------

    def _scheduled(self, output: Any) -> list[tuple[str, int, int]]:
        rows = [(d.req_id, d.num_computed_tokens) for d in output.scheduled_new_reqs]
        cached = output.scheduled_cached_reqs
        rows += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        return [(rid, c, output.num_scheduled_tokens[rid]) for rid, c in rows]

    def _slots(self, rid: str, positions: range) -> list[tuple[str, int, int, int]]:
        """Return (layer, kernel block, slot, position) of `positions` in every group."""
        tables = self.scheduler.kv_cache_manager.get_block_ids(rid)
        slots = []
        for gid, group in enumerate(self.worker_config.kv_cache_groups):
            size = group.kv_cache_spec.block_size
            kernel = self.kernel_block_sizes[gid]
            ratio = size // kernel
            for p in positions:
                if p // size >= len(tables[gid]):
                    continue
                block = tables[gid][p // size]
                offset = p % size
                for layer in group.layer_names:
                    slots.append((layer, block * ratio + offset // kernel, offset % kernel, p))
        return slots

    def needed(self, rid: str, computed: int) -> range:
        """Return the positions some group must hold to resume at `computed` (all of them
        for full attention; each group's own needs are filtered in `check`)."""
        return range(computed)

    def check(self, rid: str, computed: int, output: Any) -> None:
        """Assert that every position below `computed` that a group keeps holds its bytes."""
        request = self.requests[rid]
        digests = prefix_digests(request.all_token_ids[:computed])
        tables = self.scheduler.kv_cache_manager.get_block_ids(rid)
        for gid, group in enumerate(self.worker_config.kv_cache_groups):
            spec = group.kv_cache_spec
            window = getattr(spec, "sliding_window", None)
            chunk = getattr(spec, "attention_chunk_size", None)
            first = 0 if window is None else max(0, computed - window + 1)
            if chunk is not None:  # chunked local attention reads its own chunk only
                first = computed - computed % chunk
            mamba = isinstance(spec, MambaSpec)
            if mamba:  # a Mamba layer reads the state after the last computed token only
                first = max(0, computed - 1)
            size, kernel = spec.block_size, self.kernel_block_sizes[gid]
            for p in range(first, computed):
                block = tables[gid][p // size]
                assert block != 0, f"{rid}: group {gid} lost position {p} (null block)"
                offset = 0 if mamba else p % size
                for index, layer in enumerate(group.layer_names):
                    got = self._slot(
                        layer, block * (size // kernel) + offset // kernel, offset % kernel
                    )
                    want = pattern(digests[p], index, got.numel()).reshape(got.shape)
                    assert torch.equal(got, want), (
                        f"{rid}: group {gid} layer {layer} position {p}: wrong KV bytes"
                    )
                    self.checked_positions += 1

    def forward(self, rid: str, computed: int, count: int) -> None:
        """Write the KV of positions `computed .. computed + count` of `rid` (for a Mamba
        group: the state after the last of them, as the whole page of its block)."""
        request = self.requests[rid]
        tokens = request.all_token_ids
        end = min(computed + count, len(tokens))
        digests = prefix_digests(tokens[:end])
        tables = self.scheduler.kv_cache_manager.get_block_ids(rid)
        for gid, group in enumerate(self.worker_config.kv_cache_groups):
            size, kernel = group.kv_cache_spec.block_size, self.kernel_block_sizes[gid]
            mamba = isinstance(group.kv_cache_spec, MambaSpec)
            # A Mamba layer's page is its state after the last token its block has seen.
            for p in range(max(computed, end - 1) if mamba else computed, end):
                block = tables[gid][p // size]
                if block == 0:
                    continue
                offset = 0 if mamba else p % size
                for index, layer in enumerate(group.layer_names):
                    slot = self._slot(
                        layer, block * (size // kernel) + offset // kernel, offset % kernel
                    )
                    slot.copy_(pattern(digests[p], index, slot.numel()).reshape(slot.shape))

    def _slot(self, layer: str, kernel_block: int, slot: int) -> torch.Tensor:
        view = self.kv_caches[layer]
        return view.view(torch.uint8)[kernel_block, :, slot, :]


class DelayedExecutor:
    """Wraps an executor and keeps the results of the jobs `hold` picks until `release()`
    (a store whose completion is late); `wait` releases what it waits for."""

    def __init__(self, inner: Any, hold: Callable[[Any], bool]) -> None:
        self.inner = inner
        self._hold = hold
        self._held: set[int] = set()
        self._kept: list[Any] = []
        self.layout = inner.layout
        self.host_tier = inner.host_tier

    def submit(self, bound: Any) -> int:
        """Submit to the wrapped executor; remember the job if it is held."""
        if self._hold(bound):
            self._held.add(bound.job_id)
        return int(self.inner.submit(bound))

    def poll(self) -> list[Any]:
        """Return ended jobs, keeping back the held ones."""
        ended = [*self._kept, *self.inner.poll()]
        self._kept = [r for r in ended if r.job_id in self._held]
        return [r for r in ended if r.job_id not in self._held]

    def wait(self, job_ids: Any) -> list[Any]:
        """Return the jobs asked for, held ones too (waiting ends a delay)."""
        ids = list(job_ids)
        self._held -= set(ids)
        kept = {r.job_id: r for r in self._kept if r.job_id in ids}
        self._kept = [r for r in self._kept if r.job_id not in ids]
        rest = [i for i in ids if i not in kept]
        ended = {r.job_id: r for r in self.inner.wait(rest)}
        return [kept.get(i) or ended[i] for i in ids]

    def release(self) -> None:
        """Let every held job report."""
        self._held.clear()

    def close(self) -> list[Any]:
        """Close the wrapped executor, reporting what it still had."""
        self._held.clear()
        kept, self._kept = self._kept, []
        return [*kept, *self.inner.close()]


@dataclass(frozen=True, order=True)
class Transfer:
    """One load or store a connector planned: the request, and per vLLM group the GPU blocks
    and the index of the first one in the request's block table."""

    request_id: str
    blocks: tuple[tuple[int, ...], ...]
    first: tuple[int, ...]


@dataclass
class StepDecisions:
    """What a scheduler-side connector decided in one engine step."""

    lookups: list[tuple[str, int, int | None]] = field(default_factory=list)
    """(request, num_computed_tokens, tokens it offered: None = ask again) per lookup."""
    loads: list[Transfer] = field(default_factory=list)
    stores: list[Transfer] = field(default_factory=list)
    finished: list[tuple[str, bool]] = field(default_factory=list)
    """(request, whether vLLM must hold its blocks) per finished request."""


def _transfer(
    rid: str,
    *,
    ids: Sequence[int],
    sizes: Sequence[int],
    firsts: Sequence[int],
    groups: Sequence[int],
    total: int,
) -> Transfer:
    blocks: list[tuple[int, ...]] = [() for _ in range(total)]
    first = [0] * total
    start = 0
    for gid, size, index in zip(groups, sizes, firsts, strict=True):
        blocks[gid] = tuple(int(b) for b in ids[start : start + size])
        first[gid] = int(index) if size else 0
        start += size
    return Transfer(rid, tuple(blocks), tuple(first))


def transfers_of(
    meta: Any, connector: Any, num_groups: int
) -> tuple[list[Transfer], list[Transfer]]:
    """Return the (loads, stores) one step's connector metadata carries, kvferry's or
    vLLM's OffloadingConnector's, as GPU blocks per vLLM group."""
    loads: list[Transfer] = []
    stores: list[Transfer] = []
    if hasattr(meta, "load_jobs"):  # vLLM's OffloadingConnector
        everything = range(num_groups)
        for job in meta.load_jobs.values():
            spec = job.dst_spec
            loads.append(
                _transfer(
                    job.req_id,
                    ids=spec.block_ids,
                    sizes=spec.group_sizes,
                    firsts=spec.block_indices,
                    groups=everything,
                    total=num_groups,
                )
            )
        for job in meta.store_jobs.values():
            spec = job.src_spec
            stores.append(
                _transfer(
                    job.req_id,
                    ids=spec.block_ids,
                    sizes=spec.group_sizes,
                    firsts=spec.block_indices,
                    groups=everything,
                    total=num_groups,
                )
            )
    else:
        offloaded = connector.get_loaded_kv_cache_group_ids(None)
        for bound in decode_jobs(meta.jobs):
            plan = bound.plan
            side = loads if plan.direction is Direction.LOAD else stores
            side.append(
                _transfer(
                    plan.request_id,
                    ids=plan.gpu_block_ids,
                    sizes=plan.group_sizes,
                    firsts=plan.block_indices,
                    groups=offloaded,
                    total=num_groups,
                )
            )
    return sorted(loads), sorted(stores)


def record_decisions(engine: Engine) -> None:
    """Make the scheduler-side connector's lookups and finished answers land in
    `engine.decisions` (its loads and stores are read from each step's metadata)."""
    connector = engine.connector
    lookup, finished = connector.get_num_new_matched_tokens, connector.request_finished_all_groups

    def recorded_lookup(request: Any, num_computed_tokens: int, *args: Any) -> Any:
        tokens, load_async = lookup(request, num_computed_tokens, *args)
        engine.decisions[-1].lookups.append((request.request_id, num_computed_tokens, tokens))
        return tokens, load_async

    def recorded_finished(request: Any, block_ids: Any) -> Any:
        delay, params = finished(request, block_ids)
        engine.decisions[-1].finished.append((request.request_id, bool(delay)))
        return delay, params

    connector.get_num_new_matched_tokens = recorded_lookup
    connector.request_finished_all_groups = recorded_finished


class InstantOffloadingWorker:
    """Stands in for the copy worker of vLLM's OffloadingConnector, which runs on GPUs only:
    every submitted job succeeds at once and moves no bytes (its decisions are what is
    compared, not its copies)."""

    def __init__(self) -> None:
        self._done: list[int] = []

    def submit_store(self, job_id: int, src: Any, dst: Any) -> bool:
        """Accept a store."""
        self._done.append(job_id)
        return True

    def submit_load(self, job_id: int, src: Any, dst: Any, expedited: bool = False) -> bool:
        """Accept a load."""
        self._done.append(job_id)
        return True

    def get_finished(self) -> list[TransferResult]:
        """Return every job accepted since the last call, succeeded."""
        done, self._done = self._done, []
        return [TransferResult(job_id=job_id, success=True) for job_id in done]

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for."""

    def shutdown(self) -> None:
        """Nothing to release."""


class DeferredExecutor:
    """Wraps an executor and runs the jobs `defer` picks only when they are waited for or at
    `release()`: a store still reading its GPU blocks long after it was submitted, as a copy
    queued behind others on a GPU may. `reading()` names the blocks such stores still read."""

    def __init__(self, inner: Any, defer: Callable[[Any], bool]) -> None:
        self.inner = inner
        self._defer = defer
        self._deferred: dict[int, Any] = {}
        self.waited: list[int] = []
        """Deferred jobs that a wait (a fence) made run."""
        self.layout = inner.layout
        self.host_tier = inner.host_tier

    def submit(self, bound: Any) -> int:
        """Keep a deferred job back; submit the others."""
        if self._defer(bound):
            self._deferred[bound.job_id] = bound
            return int(bound.job_id)
        return int(self.inner.submit(bound))

    def reading(self) -> set[int]:
        """Return the GPU blocks deferred jobs have not read yet."""
        return {int(b) for job in self._deferred.values() for b in job.plan.gpu_block_ids}

    def poll(self) -> list[Any]:
        """Return the ended jobs (deferred ones have not run)."""
        return list(self.inner.poll())

    def wait(self, job_ids: Any) -> list[Any]:
        """Run the deferred jobs asked for, then wait for all of them."""
        ids = list(job_ids)
        for job_id in ids:
            if job_id in self._deferred:
                self.waited.append(job_id)
                self.inner.submit(self._deferred.pop(job_id))
        return list(self.inner.wait(ids))

    def release(self) -> None:
        """Run every deferred job, and defer none from now on."""
        self._defer = lambda bound: False
        for job_id in list(self._deferred):
            self.inner.submit(self._deferred.pop(job_id))

    def close(self) -> list[Any]:
        """Run what is deferred and close the wrapped executor."""
        self.release()
        return list(self.inner.close())


class EventRecorder:
    """Stands in for vLLM's KV-event publisher and keeps every event published."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        """Keep the batch's events."""
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        """Nothing to release."""


def prefix_digests(tokens: Sequence[int]) -> list[int]:
    """Return, per position, a number that depends on every token up to it."""
    digests, value = [], 17
    for token in tokens:
        value = (value * 1_000_003 + token + 1) % (1 << 61)
        digests.append(value)
    return digests


def pattern(digest: int, layer: int, numel: int) -> torch.Tensor:
    """Return the stand-in KV bytes of one token of one layer (a function of its prefix)."""
    base = torch.arange(numel, dtype=torch.int64)
    return (((base + digest + 7919 * layer) * 2_654_435_761) >> 13).to(torch.uint8).reshape(-1)


def next_token(tokens: Sequence[int]) -> int:
    """Return the stand-in model's next token (a function of the sequence so far)."""
    return 3 + sum(tokens) % 997


def build_engine(
    model_config: ModelConfig,
    specs: dict[str, KVCacheSpec],
    transfer: KVTransferConfig,
    *,
    block_size: int = 16,
    num_gpu_blocks: int = 64,
    max_num_batched_tokens: int = 64,
    async_scheduling: bool = False,
    layout: str = "LBHNC",
    mamba_cache_mode: str = "none",
    kv_events: bool = False,
) -> Engine:
    """Return an engine whose KV cache has the layers `specs`, `num_gpu_blocks` blocks each,
    planned and allocated by vLLM's own code on the CPU, with `transfer`'s connector; with
    `kv_events`, vLLM publishes KV-cache events (to its null publisher until a test replaces
    it)."""
    scheduler_config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=512,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
    )
    cache_config = CacheConfig(
        block_size=block_size, enable_prefix_caching=True, mamba_cache_mode=mamba_cache_mode
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
        kv_events_config=(
            KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
        ),
    )
    # vLLM turns its hybrid allocator off on a CPU platform; the engine under test is the
    # GPU one, where it is on (one group per kind, sliding-window blocks freed as they pass).
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    cache_config.kv_cache_layout = layout
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    page = sum(spec.page_size_bytes for spec in specs.values())
    (worker_config,) = get_kv_cache_configs(vllm_config, [specs], [page * num_gpu_blocks], groups)
    worker_config.kv_cache_layout = layout
    scheduler_config_kv = generate_scheduler_kv_cache_config([worker_config])
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
        scheduler_config_kv, vllm_config
    )
    for config in (worker_config, scheduler_config_kv):
        config.hash_block_size = hash_block_size
    cache_config.num_gpu_blocks = scheduler_config_kv.num_blocks
    init_none_hash(sha256)
    scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=scheduler_config_kv,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        log_stats=True,
    )
    kernel_block_sizes = [g.kv_cache_spec.block_size for g in worker_config.kv_cache_groups]
    kv_caches = allocate_kv_cache(
        worker_config, torch.device("cpu"), KVCacheLayout[layout], kernel_block_sizes
    )
    worker = type(scheduler.connector)(vllm_config, KVConnectorRole.WORKER, worker_config)
    offloading = transfer.kv_connector == "OffloadingConnector"
    if offloading:
        inner = worker.connector_worker
        inner._init_worker = lambda caches: setattr(inner, "worker", InstantOffloadingWorker())
    worker.register_kv_caches(kv_caches)
    engine = Engine(
        vllm_config=vllm_config,
        scheduler=scheduler,
        worker=worker,
        kv_caches=kv_caches,
        worker_config=worker_config,
        kernel_block_sizes=kernel_block_sizes,
        hash_block_size=hash_block_size,
        verify=not offloading,
        overlap=async_scheduling,
    )
    record_decisions(engine)
    return engine
