"""Planner: what one scheduler step costs on the CPU, kvferry against vLLM 0.33's own
scheduler-side code on the same requests in the same process.

Needs no GPU. Three KV-cache groups (full attention, block 16; a sliding window of 128 tokens,
block 16; Mamba, block 16), one block per chunk (F = 1). Each row is timed in CPU time
(`time.process_time`), in interleaved rounds: one kvferry sample of every row, then one vLLM
sample of the same workload, round after round, so both sides see the same machine. Per row:
the median of kvferry's samples, of vLLM's, and the median ratio vLLM / kvferry with its spread
(lowest and highest round ratio).

* a 131 072-token request whose every chunk is in the tier: lookup + load plan; plus
  `Catalog.pin`; cold (a new request's state, lookup, load plan, pin); through the engine-facing
  layer (`KvferryConnector`'s scheduler side: `on_new_request`, `get_num_new_matched_tokens`,
  `update_state_after_alloc` and `build_connector_meta`, the worker message included);
* one decode step of 256 running requests: store planning; plus `Catalog.reserve`; through the
  engine-facing layer (`KvferryConnector.build_connector_meta` with every request scheduled);
* the worker message of one 2048-block x 3-group load plan, encoded and decoded;
* a scaling table: a cold long request at 1k-1M tokens x 1, 2, 3 and 6 groups, and the store
  step with reserve at 16, 256 and 1024 running requests.

The engine-facing rows need vLLM (they drive both connectors with vLLM's own requests, block
objects and scheduler outputs); without it, or with `--quick`, they are left out and their bars
fail as not measured. vLLM's side is its OffloadingConnector's scheduler side, built from vLLM's
own config and KV-cache planning for the same three groups (LRU, a 2 GiB CPU tier for each
connector, decode chunks stored: `offload_prompt_only` off), driven as vLLM's scheduler drives
it: for the long request `on_new_request`, `get_num_new_matched_tokens`,
`update_state_after_alloc` with the allocated `KVCacheBlocks`, and `build_connector_meta`; for
the decode step `build_connector_meta` with every request scheduled and the step's
`KVConnectorBlockState` (its resolver a KV-cache manager's `get_block_ids`, as vLLM's scheduler
offers it; the tables fixed, behind the two reads vLLM's `KVCacheManager` has). Both
sides find the same hit and store the same chunks.

    kvferry bench planner
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvferry.adapters.messages import decode_jobs, encode_jobs
from kvferry.adapters.wire import decode_jobs_binary, encode_jobs_binary
from kvferry.benchmarks.common import (
    add_common_options,
    bar_line,
    bar_result,
    measured_on,
    measured_on_line,
    output_paths,
    positive_int,
    pyplot,
    save_plot,
    write_json,
)
from kvferry.core import (
    GroupBlocks,
    GroupKind,
    GroupSpec,
    OffloadConfig,
    StoreOutcome,
    due_for_store,
    extend_keys,
    lookup,
    new_request_state,
    plan_load,
    plan_store,
)
from kvferry.core.bound import BoundPlan, JobResult
from kvferry.core.catalog import Catalog, CatalogConfig
from kvferry.core.group_rows import FoundRows
from kvferry.core.keys import KeyColumn, OffloadKey
from kvferry.core.state import RequestState

NAME = "planner"
BLOCK = 16
WINDOW = 128
LONG_TOKENS = 131_072
RUNNING = 256
MESSAGE_BLOCKS = 2048
TIER_BYTES = 1 << 31
"""Each connector's CPU tier."""
RATIO_BAR = 10.0
"""kvferry's engine-facing step must be at least this many times faster than vLLM's."""
LINEAR_BAR = 10.0
"""8x the tokens may cost at most this many times the time (linear, with slack)."""
MESSAGE_BAR_MS = 0.1
"""Encode + decode of the 2048-block x 3-group plan's worker message."""
SCALE_TOKENS = (1024, 8192, 131_072, 1_048_576)
SCALE_TOKENS_QUICK = (1024, 2048, 16_384)
SCALE_GROUPS = (1, 2, 3, 6)
SCALE_RUNNING = (16, 256, 1024)
SCALE_RUNNING_QUICK = (16, 32)
SCALE_REPEAT = 7
"""Samples per cell of the scaling table (the median is kept)."""

Sample = Callable[[], float]
"""One timed sample of a row: runs its untimed set-up, then returns the timed part's CPU ms."""


def config_of(num_groups: int = 3, blocks_per_chunk: int = 1) -> OffloadConfig:
    """Return the benchmark's config: groups cycle full attention, sliding window, Mamba."""
    kinds = (
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=BLOCK),
        GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=BLOCK, sliding_window=WINDOW),
        GroupSpec(kind=GroupKind.MAMBA, block_size=BLOCK),
    )
    return OffloadConfig(
        hash_block_size=BLOCK,
        blocks_per_chunk=blocks_per_chunk,
        groups=tuple(kinds[g % 3] for g in range(num_groups)),
    )


def _hashes(request: int, count: int) -> list[bytes]:
    return [(request << 40 | i).to_bytes(8, "big") for i in range(count)]


class _CpuTimer:
    """Accumulates CPU time over `with` blocks (the timed parts of one sample)."""

    def __init__(self) -> None:
        self.ms = 0.0
        self._start = 0.0

    def __enter__(self) -> _CpuTimer:
        self._start = time.process_time()
        return self

    def __exit__(self, *_: object) -> None:
        self.ms += (time.process_time() - self._start) * 1e3


def _engine_blocks(config: OffloadConfig, num_tokens: int, cached: int) -> list[GroupBlocks]:
    """Block tables an engine would hold after allocating for a `cached`-token hit: every block
    of full attention, a sliding window's last window, Mamba's last block (the rest null)."""
    n = -(-num_tokens // BLOCK)
    index = np.arange(n)
    tables = []
    for g, spec in enumerate(config.groups):
        first = spec.first_needed_token(cached) // BLOCK
        tables.append(
            GroupBlocks(
                ids=np.where(index >= first, index + 1 + g * n, 0),
                is_null=index < first,
                is_cached=np.zeros(n, dtype=bool),
            )
        )
    return tables


def _filled_catalog(keys: Sequence[OffloadKey], capacity: int) -> Catalog:
    catalog = Catalog(CatalogConfig(capacity_rows=capacity))
    reservation = catalog.reserve(keys)
    if reservation is None:
        raise RuntimeError(f"a catalog of {capacity} rows had no room for {len(keys)} keys")
    catalog.complete_store(reservation.keys, success=True)
    return catalog


# -- the long request --------------------------------------------------------------------------


def long_request_rows(num_tokens: int, num_groups: int = 3) -> dict[str, Sample]:
    """Return kvferry's samples of the long request, all of whose chunks are in the tier:
    `plan` (lookup + load plan), `pin` (plus `Catalog.pin`), `cold` (a new request's state
    first) and `engine` (through `KvferryConnectorScheduler`)."""
    config = config_of(num_groups)
    hashes = _hashes(1, num_tokens // BLOCK)
    state = new_request_state(config, "long", num_prompt_tokens=num_tokens, block_hashes=hashes)
    keys = [key for group_keys in state.keys for key in group_keys]
    catalog = _filled_catalog(keys, len(keys) + 16)
    view = catalog.view()
    hit = lookup(config, state, num_tokens=num_tokens, num_computed_tokens=0, tier=view).tokens
    tables = _engine_blocks(config, num_tokens, hit)

    def plan() -> float:
        with _CpuTimer() as timer:
            found = lookup(config, state, num_tokens=num_tokens, num_computed_tokens=0, tier=view)
            plan_load(config, state, tables, num_computed_tokens=0, hit_tokens=found.tokens)
        return timer.ms

    def load_and_pin(request: RequestState, request_id: str) -> KeyColumn:
        """Look `request` up, plan its load and pin the plan's keys (with the lookup's rows,
        as `OffloadSession` does); return the keys pinned."""
        seen = FoundRows()
        tier = catalog.view(seen=seen)
        found = lookup(config, request, num_tokens=num_tokens, num_computed_tokens=0, tier=tier)
        load, _ = plan_load(config, request, tables, num_computed_tokens=0, hit_tokens=found.tokens)
        catalog.pin(load.keys, request=request_id, seen=seen)
        return load.keys

    def pin() -> float:
        with _CpuTimer() as timer:
            pinned = load_and_pin(state, "long")
        catalog.unpin(pinned)
        return timer.ms

    def cold() -> float:
        with _CpuTimer() as timer:
            fresh = new_request_state(
                config, "cold", num_prompt_tokens=num_tokens, block_hashes=hashes
            )
            pinned = load_and_pin(fresh, "cold")
        catalog.unpin(pinned)
        return timer.ms

    return {"plan": plan, "pin": pin, "cold": cold}


def engine_long_request(num_tokens: int) -> tuple[Sample, Sample]:
    """Return the samples of the same long request through both connectors' scheduler sides,
    kvferry's `KvferryConnector` then vLLM's `OffloadingConnector`, each driven as vLLM's
    scheduler drives it: `on_new_request`, `get_num_new_matched_tokens`,
    `update_state_after_alloc` with the allocated `KVCacheBlocks`, and `build_connector_meta`
    of the step (the load job and its worker message). Every chunk of the request is in both
    tiers; both find the same hit."""
    side = _VllmSide.shared()
    request = side.request("long", num_tokens, max_tokens=1)
    hit = (len(request.block_hashes) - 1) * BLOCK
    tables = _engine_blocks(config_of(3), num_tokens, hit)
    null = side.KVCacheBlock(0)
    null.is_null = True
    blocks = side.KVCacheBlocks(
        blocks=tuple(
            [
                null if n else side.KVCacheBlock(i)
                for i, n in zip(t.ids.tolist(), t.is_null.tolist(), strict=True)
            ]
            for t in tables
        )
    )
    block_ids = tuple(t.ids.tolist() for t in tables)

    vllm = side.connector()
    manager = vllm.connector_scheduler.manager
    context = side.ReqContext(req_id="fill")
    every = [side.make_offload_key(bytes(h), g) for g in range(3) for h in request.block_hashes]
    if manager.prepare_store(every, context) is None:
        raise RuntimeError("vLLM's manager had no room for the long request")
    manager.complete_store(every, context)

    kvferry = side.kvferry()
    session = kvferry.scheduler_side.session
    state = new_request_state(
        session.config, "fill", num_prompt_tokens=num_tokens, block_hashes=request.block_hashes
    )
    keys = [key for group_keys in state.keys for key in group_keys]
    reservation = session.catalog.reserve(keys)
    if reservation is None:
        raise RuntimeError("kvferry's tier had no room for the long request")
    session.catalog.complete_store(reservation.keys, success=True)
    empty = side.output()

    def ours() -> float:
        with _CpuTimer() as timer:
            kvferry.on_new_request(request)
            tokens, _ = kvferry.get_num_new_matched_tokens(request, 0)
            kvferry.update_state_after_alloc(request, blocks, tokens or 0)
            kvferry.build_connector_meta(empty)
        if tokens != hit:
            raise RuntimeError(f"kvferry's connector found {tokens} tokens, expected {hit}")
        side.kvferry_complete(kvferry, finished_recving={request.request_id})
        kvferry.request_finished_all_groups(request, block_ids)
        return timer.ms

    def theirs() -> float:
        with _CpuTimer() as timer:
            vllm.on_new_request(request)
            tokens, _ = vllm.get_num_new_matched_tokens(request, 0)
            vllm.update_state_after_alloc(request, blocks, tokens)
            meta = vllm.build_connector_meta(empty)
        if tokens != hit:
            raise RuntimeError(f"vLLM's connector found {tokens} tokens, expected {hit}")
        side.complete(vllm, meta.load_jobs, finished_recving={request.request_id})
        vllm.request_finished(request, [])
        return timer.ms

    return ours, theirs


# -- the decode step ---------------------------------------------------------------------------


def _prompts(num_requests: int) -> list[int]:
    """Prompt lengths 2048 + r: block completions spread over the steps as in a real batch."""
    return [2048 + r for r in range(num_requests)]


def _step_samples(step: Callable[[int], float]) -> Sample:
    """A sample that runs the next decode step each time it is called."""
    steps = iter(range(1 << 62))
    return lambda: step(next(steps))


def store_step_rows(num_requests: int, steps: int) -> dict[str, Sample]:
    """Return kvferry's samples of one decode step of `num_requests` running requests whose
    prompts are stored: `plan` (keys of completed hash blocks, the due check, `plan_store` for
    the due), `reserve` (plus `Catalog.reserve` of each store) and `engine` (through
    `KvferryConnectorScheduler.build_connector_meta`, every request scheduled). Each sample is
    the next step; at most `steps` samples."""
    config = config_of(3)
    prompts = _prompts(num_requests)
    capacity = 3 * num_requests * (2048 // BLOCK + num_requests // BLOCK + steps // BLOCK + 4)
    hashes = [_hashes(r + 2, (p + steps + 1) // BLOCK) for r, p in enumerate(prompts)]
    tables = [
        [GroupBlocks.of(np.arange(-(-(p + steps) // BLOCK) + 1) + 1) for _ in range(3)]
        for p in prompts
    ]
    prompt_column = np.array(prompts, dtype=np.int64)
    ones = np.ones(num_requests, dtype=np.int64)

    def planner(reserve: bool) -> Sample:
        catalog = Catalog(CatalogConfig(capacity_rows=capacity))
        view = catalog.view()
        states = []
        for r, prompt in enumerate(prompts):
            state = new_request_state(
                config, f"r{r}", num_prompt_tokens=prompt, block_hashes=hashes[r][: prompt // BLOCK]
            )
            prefill = plan_store(
                config,
                state,
                tables[r],
                num_computed_tokens=0,
                num_scheduled_tokens=prompt,
                num_tokens=prompt,
                tier=view,
            )
            if prefill.plan is not None:
                done = catalog.reserve(prefill.plan.keys)
                if done is not None:
                    catalog.complete_store(done.keys, success=True)
            states.append(prefill.state)

        def step(s: int) -> float:
            written: list[OffloadKey] = []
            with _CpuTimer() as timer:
                num_tokens = prompt_column + (s + 1)
                for r in np.flatnonzero(num_tokens % BLOCK == 0).tolist():
                    states[r] = extend_keys(
                        config, states[r], hashes[r][: int(num_tokens[r]) // BLOCK]
                    )
                due = due_for_store(
                    config,
                    states,
                    num_computed_tokens=num_tokens - 1,
                    num_scheduled_tokens=ones,
                    num_tokens=num_tokens,
                )
                for r in due.tolist():
                    decision = plan_store(
                        config,
                        states[r],
                        tables[r],
                        num_computed_tokens=prompts[r] + s,
                        num_scheduled_tokens=1,
                        num_tokens=prompts[r] + s + 1,
                        tier=view,
                    )
                    states[r] = decision.state
                    if reserve and decision.outcome is StoreOutcome.STORE and decision.plan:
                        reservation = catalog.reserve(decision.plan.keys)
                        if reservation is not None:
                            written.extend(reservation.keys)
            if written:
                catalog.complete_store(written, success=True)
            return timer.ms

        return _step_samples(step)

    return {"plan": planner(reserve=False), "reserve": planner(reserve=True)}


def engine_store_step(num_requests: int, steps: int) -> tuple[Sample, Sample]:
    """Return the samples of one decode step of `num_requests` running requests through both
    connectors' scheduler sides, kvferry's then vLLM's: `build_connector_meta` of the same
    `SchedulerOutput` (every request scheduled, one token each; decode chunks stored, vLLM's
    `offload_prompt_only` off), after the same prompts were stored through each. kvferry's
    sample moves the requests one token on first (the engine's own work, not timed); vLLM's
    sample times the same step, so call them in that order."""
    side = _VllmSide.shared()
    prompts = _prompts(num_requests)
    requests = [
        side.request(f"r{r}", prompt, max_tokens=steps + 2, seed=r)
        for r, prompt in enumerate(prompts)
    ]
    tables: dict[str, tuple[list[Any], ...]] = {}
    base = 1
    new = []
    vllm, kvferry = side.connector(), side.kvferry()
    for request in requests:  # vLLM's add_request, before its scheduling
        vllm.on_new_request(request)
        kvferry.on_new_request(request)
    for request, prompt in zip(requests, prompts, strict=True):
        count = -(-(prompt + steps + 2) // BLOCK)
        ids = tuple(list(range(base + g * count, base + (g + 1) * count)) for g in range(3))
        base += 3 * count
        tables[request.request_id] = tuple([side.KVCacheBlock(i) for i in g] for g in ids)
        blocks = side.KVCacheBlocks(blocks=tables[request.request_id])
        for connector in (vllm, kvferry):
            connector.get_num_new_matched_tokens(request, 0)
            connector.update_state_after_alloc(request, blocks, 0)
        new.append(side.NewRequestData.from_request(request, ids))

    resolve = _BlockTables(side, tables).get_block_ids
    request_ids = [q.request_id for q in requests]
    prefill = side.output(
        scheduled_new_reqs=new,
        num_scheduled_tokens={q.request_id: q.num_tokens for q in requests},
        total_num_scheduled_tokens=sum(prompts),
        kv_connector_block_state=side.block_state(request_ids, resolve),
    )
    side.complete(vllm, vllm.build_connector_meta(prefill).store_jobs)
    kvferry.build_connector_meta(prefill)
    side.kvferry_complete(kvferry)
    no_new_blocks: list[Any] = [None] * num_requests
    outputs: list[Any] = []
    counter = iter(range(1 << 62))

    def ours() -> float:
        s = next(counter)
        for request, prompt in zip(requests, prompts, strict=True):  # the engine's own work
            request.num_computed_tokens = prompt + s
            request.append_output_token_ids(5)
        cached = side.CachedRequestData(
            req_ids=request_ids,
            resumed_req_ids=set(),
            new_token_ids=[],
            all_token_ids={},
            new_block_ids=no_new_blocks,
            num_computed_tokens=[p + s for p in prompts],
            num_output_tokens=[s + 1] * num_requests,
        )
        output = side.output(
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict.fromkeys(request_ids, 1),
            total_num_scheduled_tokens=num_requests,
            kv_connector_block_state=side.block_state(request_ids, resolve),
        )
        outputs.append(output)
        with _CpuTimer() as timer:
            kvferry.build_connector_meta(output)
        side.kvferry_complete(kvferry)
        return timer.ms

    def theirs() -> float:
        output = outputs.pop()
        with _CpuTimer() as timer:
            meta = vllm.build_connector_meta(output)
        side.complete(vllm, meta.store_jobs)
        return timer.ms

    return ours, theirs


class _BlockTables:
    """Fixed block tables read as vLLM 0.33's `KVCacheManager` reads a request's: `get_blocks`
    wraps its lists of block objects, copying nothing; `get_block_ids`, the resolver vLLM's
    scheduler puts in the `KVConnectorBlockState` it offers a connector, builds the id list of
    every block of every group."""

    def __init__(self, side: _VllmSide, tables: dict[str, tuple[list[Any], ...]]) -> None:
        self._blocks = side.KVCacheBlocks
        self._tables = tables

    def get_blocks(self, request_id: str) -> Any:
        """Return the request's `KVCacheBlocks`."""
        return self._blocks(blocks=self._tables[request_id])

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Return the ids of every block of the request, per group."""
        ids: tuple[list[int], ...] = self.get_blocks(request_id).get_block_ids()
        return ids


def _tiny_model_config() -> Any:
    """Return vLLM's ModelConfig of a three-layer model (its config written to a temporary
    folder; no weights are ever loaded)."""
    import tempfile

    from vllm.config import ModelConfig

    with tempfile.TemporaryDirectory() as folder:
        model = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 3,
            "vocab_size": 1000,
            "max_position_embeddings": 1 << 21,
            "torch_dtype": "float16",
        }
        (Path(folder) / "config.json").write_text(json.dumps(model), encoding="utf-8")
        model_config = ModelConfig(
            model=folder,
            skip_tokenizer_init=True,
            dtype="float16",
            seed=0,
            max_model_len=1 << 21,
        )
    return model_config


class _VllmSide:
    """vLLM 0.33's OffloadingConnector, scheduler side, for the same groups as `config_of(3)`:
    built from vLLM's own config and KV-cache planning on the CPU (a model config written to a
    temporary folder; no weights), with a `TIER_BYTES` CPU tier."""

    def __init__(self) -> None:
        import dataclasses
        import logging

        import torch
        from vllm import SamplingParams
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
        from vllm.v1.core.kv_cache_utils import (
            KVCacheBlock,
            generate_scheduler_kv_cache_config,
            get_request_block_hasher,
            init_none_hash,
            resolve_kv_cache_block_sizes,
        )
        from vllm.v1.core.sched.output import (
            CachedRequestData,
            KVConnectorBlockState,
            NewRequestData,
            SchedulerOutput,
        )
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key
        from vllm.v1.outputs import KVConnectorOutput
        from vllm.v1.request import Request

        logging.getLogger("vllm").setLevel(logging.ERROR)
        self.KVCacheBlock = KVCacheBlock
        self.KVCacheBlocks = KVCacheBlocks
        self.SchedulerOutput = SchedulerOutput
        self.NewRequestData = NewRequestData
        self.CachedRequestData = CachedRequestData
        self.ReqContext = ReqContext
        self.make_offload_key = make_offload_key
        self._replace = dataclasses.replace
        self._KVConnectorOutput = KVConnectorOutput
        self._WorkerMetadata = OffloadingWorkerMetadata
        self._Request = Request
        self._SamplingParams = SamplingParams
        self._hasher = get_request_block_hasher(BLOCK, sha256)
        init_none_hash(sha256)
        model_config = _tiny_model_config()

        def vllm_config_of(transfer: KVTransferConfig) -> VllmConfig:
            made = VllmConfig(
                model_config=model_config,
                scheduler_config=SchedulerConfig(
                    max_num_seqs=1024,
                    max_num_batched_tokens=8192,
                    max_model_len=1 << 21,
                    enable_chunked_prefill=True,
                    is_encoder_decoder=False,
                ),
                cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
                kv_transfer_config=transfer,
                device_config=DeviceConfig("cpu"),
            )
            # vLLM turns its hybrid allocator off on a CPU platform; on a GPU it is on.
            made.scheduler_config.disable_hybrid_kv_cache_manager = False
            made.cache_config.kv_cache_layout = "LBHNC"
            return made

        vllm_config = vllm_config_of(
            KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config={
                    "cpu_bytes_to_use": TIER_BYTES,
                    "block_size": BLOCK,
                    "offload_prompt_only": False,
                },
            )
        )
        kvferry_config = vllm_config_of(
            KVTransferConfig(
                kv_connector="KvferryConnector",
                kv_connector_module_path="kvferry.adapters.vllm_connector",
                kv_role="kv_both",
                kv_connector_extra_config={"cpu_bytes_to_use": TIER_BYTES},
            )
        )
        specs = {
            "model.layers.0.self_attn.attn": FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16
            ),
            "model.layers.1.self_attn.attn": SlidingWindowSpec(
                block_size=BLOCK,
                num_kv_heads=2,
                head_size=8,
                dtype=torch.float16,
                sliding_window=WINDOW,
            ),
            "model.layers.2.mixer": MambaSpec(
                block_size=BLOCK,
                shapes=((4, 16),),
                dtypes=(torch.float16,),
                mamba_cache_mode="align",
            ),
        }
        groups = get_global_kv_cache_groups(vllm_config, [specs])
        page = sum(spec.page_size_bytes for spec in specs.values())
        (worker,) = get_kv_cache_configs(vllm_config, [specs], [page * 400_000], groups)
        kv_cache_config = generate_scheduler_kv_cache_config([worker])
        _, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        kv_cache_config.hash_block_size = hash_block_size
        self._connector_args = (vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
        self._kvferry_args = (kvferry_config, KVConnectorRole.SCHEDULER, kv_cache_config)
        self._Connector = OffloadingConnector
        self._BlockState = KVConnectorBlockState

    _made: _VllmSide | None = None

    @classmethod
    def shared(cls) -> _VllmSide:
        """Return the one instance of this process (vLLM's config is slow to build)."""
        if cls._made is None:
            cls._made = cls()
        return cls._made

    def connector(self) -> Any:
        """Return a new scheduler-side OffloadingConnector."""
        return self._Connector(*self._connector_args)

    def kvferry(self) -> Any:
        """Return a new scheduler-side KvferryConnector for the same model and KV cache."""
        from kvferry.adapters.vllm_connector import KvferryConnector

        return KvferryConnector(*self._kvferry_args)

    def block_state(self, request_ids: Sequence[str], resolve: Callable[[str], Any]) -> Any:
        """Return the step's `KVConnectorBlockState`, resolving block ids on access as vLLM's
        scheduler does."""
        return self._BlockState(
            req_ids=set(request_ids), resolve_block_ids=resolve, boundary_state_offloads={}
        )

    def kvferry_complete(self, connector: Any, **output: Any) -> None:
        """Report every job kvferry's connector has in flight done, as its workers would."""
        from kvferry.adapters.messages import encode_completions
        from kvferry.adapters.vllm_connector import KvferryWorkerMetadata

        jobs = sorted(connector.scheduler_side.session.in_flight())
        results = [JobResult(job_id=j, success=True, nbytes=0, seconds=0.0) for j in jobs]
        meta = KvferryWorkerMetadata(messages=(encode_completions(0, results),)) if jobs else None
        connector.update_connector_output(
            self._KVConnectorOutput(kv_connector_worker_meta=meta, **output)
        )

    def request(self, request_id: str, num_tokens: int, *, max_tokens: int, seed: int = 0) -> Any:
        """Return a vLLM `Request` of `num_tokens` prompt tokens, its block hashes computed."""
        return self._Request(
            request_id=request_id,
            prompt_token_ids=[(seed * 131 + i * 7) % 997 + 3 for i in range(num_tokens)],
            sampling_params=self._SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=self._hasher,
        )

    def output(self, **fields: Any) -> Any:
        """Return an empty `SchedulerOutput` with `fields` set."""
        return self._replace(self.SchedulerOutput.make_empty(), **fields)

    def complete(self, scheduler: Any, jobs: Any, **output: Any) -> None:
        """Report every job of `jobs` done, as vLLM's workers would."""
        done = self._WorkerMetadata(completed_jobs=dict.fromkeys(jobs, 1))
        scheduler.update_connector_output(
            self._KVConnectorOutput(kv_connector_worker_meta=done, **output)
        )


# -- the worker message ------------------------------------------------------------------------


def message_job() -> BoundPlan:
    """Return the bound load plan of 2048 blocks in each of 3 full-attention groups."""
    config = OffloadConfig(
        hash_block_size=BLOCK,
        blocks_per_chunk=1,
        groups=tuple(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=BLOCK) for _ in range(3)),
    )
    num_tokens = (MESSAGE_BLOCKS + 1) * BLOCK
    state = new_request_state(
        config,
        "message",
        num_prompt_tokens=num_tokens,
        block_hashes=_hashes(7, num_tokens // BLOCK),
    )
    tables = _engine_blocks(config, num_tokens, MESSAGE_BLOCKS * BLOCK)
    plan, _ = plan_load(
        config, state, tables, num_computed_tokens=0, hit_tokens=MESSAGE_BLOCKS * BLOCK
    )
    return BoundPlan(
        job_id=1, plan=plan, cpu_rows=np.arange(len(plan.keys)), layout_fingerprint=None
    )


def message_row() -> Sample:
    """Return the sample of one worker message as the engine-facing layer sends it: the binary
    `encode_jobs_binary` + `decode_jobs_binary` of `message_job`."""
    jobs = [message_job()]

    def sample() -> float:
        with _CpuTimer() as timer:
            decode_jobs_binary(encode_jobs_binary(jobs))
        return timer.ms

    return sample


def json_message_ms(repeat: int) -> float:
    """Return the median CPU ms of the JSON form of the same message (`encode_jobs` +
    `decode_jobs`), the readable form, for comparison."""
    jobs = [message_job()]

    def sample() -> float:
        with _CpuTimer() as timer:
            decode_jobs(encode_jobs(jobs))
        return timer.ms

    sample()
    return statistics.median(sample() for _ in range(repeat))


# -- rounds, ratios, bars ----------------------------------------------------------------------


def interleave(kvferry: dict[str, Sample], vllm: Sample | None, rounds: int) -> dict[str, Any]:
    """Run `rounds` rounds, each one sample of every kvferry row then one of vLLM's; return per
    row the median ms, and with vLLM the median ratio vLLM / kvferry and its spread."""
    samples: dict[str, list[float]] = {name: [] for name in kvferry}
    reference: list[float] = []
    for sample in (*kvferry.values(), *([vllm] if vllm else [])):
        sample()  # warm caches and lazy imports
    for _ in range(rounds):
        for name, sample in kvferry.items():
            samples[name].append(sample())
        if vllm is not None:
            reference.append(vllm())
    rows: dict[str, Any] = {}
    for name, values in samples.items():
        row: dict[str, Any] = {"kvferry_ms": statistics.median(values)}
        if reference:
            ratios = [v / max(k, 1e-6) for k, v in zip(values, reference, strict=True)]
            row |= {
                "vllm_ms": statistics.median(reference),
                "ratio": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
            }
        rows[name] = row
    return rows


def scaling(
    tokens: Sequence[int], running: Sequence[int], repeat: int, steps: int
) -> dict[str, Any]:
    """Return the scaling table: the cold long request's median ms per (tokens, groups), and
    the store step with reserve's median ms per running-request count."""
    cold = []
    for num_groups in SCALE_GROUPS:
        for num_tokens in tokens:
            sample = long_request_rows(num_tokens, num_groups)["cold"]
            sample()
            ms = statistics.median(sample() for _ in range(repeat))
            cold.append({"groups": num_groups, "tokens": num_tokens, "cold_ms": ms})
    store = []
    for num_requests in running:
        sample = store_step_rows(num_requests, steps + 1)["reserve"]
        sample()
        ms = statistics.median(sample() for _ in range(steps))
        store.append({"requests": num_requests, "step_ms": ms})
    return {"cold": cold, "store": store}


def _ratio_bar(name: str, row: dict[str, Any] | None) -> dict[str, Any]:
    if row is None or "ratio" not in row:
        return bar_result(
            False, f"{name} >= {RATIO_BAR:g}x vLLM's", "not measured (needs vLLM, not --quick)"
        )
    return bar_result(
        row["ratio"] >= RATIO_BAR,
        f"{name} >= {RATIO_BAR:g}x vLLM's (median ratio of the rounds)",
        f"{row['ratio']:.1f}x (rounds {row['ratio_min']:.1f}-{row['ratio_max']:.1f}x; "
        f"kvferry {row['kvferry_ms']:.3f} ms, vLLM {row['vllm_ms']:.3f} ms)",
    )


def bars(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Return the verdicts of the four bars: the two engine-facing steps against vLLM, linear
    scaling of the cold long request per group count, and the worker message."""
    verdicts = [
        _ratio_bar(
            "lookup + load + pin through the engine-facing layer, 131072 tokens, 3 groups",
            results["long"].get("engine"),
        ),
        _ratio_bar(
            f"store step + reserve through the engine-facing layer, {RUNNING} requests, F = 1",
            results["store"].get("engine"),
        ),
    ]
    cold = results["scaling"]["cold"]
    top = max(row["tokens"] for row in cold)
    base = top // 8
    growth = []
    for num_groups in SCALE_GROUPS:
        by_tokens = {row["tokens"]: row["cold_ms"] for row in cold if row["groups"] == num_groups}
        growth.append((num_groups, by_tokens[top] / max(by_tokens[base], 1e-6)))
    worst = max(growth, key=lambda item: item[1])
    verdicts.append(
        bar_result(
            worst[1] <= LINEAR_BAR,
            f"{top} tokens cost <= {LINEAR_BAR:g}x the {base}-token case (cold lookup + load + "
            f"pin), every group count",
            ", ".join(f"{g} groups {x:.1f}x" for g, x in growth),
        )
    )
    message = results["message_ms"]
    verdicts.append(
        bar_result(
            message <= MESSAGE_BAR_MS,
            f"worker message of a {MESSAGE_BLOCKS}-block x 3-group load plan, encode + decode "
            f"<= {MESSAGE_BAR_MS} ms",
            f"{message:.3f} ms",
        )
    )
    return verdicts


LONG_ROWS = {
    "plan": "lookup + load, FA + SW + Mamba: plan only",
    "pin": "... plus Catalog.pin",
    "cold": "... cold (new request state, plan, pin)",
    "engine": "... through the engine-facing layer",
}
STORE_ROWS = {
    "plan": "store step, F = 1: plan only",
    "reserve": "... plus Catalog.reserve",
    "engine": "... through the engine-facing layer",
}


def _print_rows(title: str, names: dict[str, str], rows: dict[str, Any]) -> None:
    print(f"{title:<58} {'kvferry ms':>10} {'vLLM ms':>9} {'vLLM/kvferry':>13} {'rounds':>13}")
    for key, label in names.items():
        row = rows.get(key)
        if row is None:
            continue
        if "ratio" in row:
            extra = (
                f"{row['vllm_ms']:>9.3f} {row['ratio']:>13.1f} "
                f"{row['ratio_min']:>6.1f}-{row['ratio_max']:<6.1f}"
            )
        else:
            extra = f"{'-':>9} {'-':>13} {'-':>13}"
        print(f"{label:<58} {row['kvferry_ms']:>10.3f} {extra}")


def plot(results: Path, png: Path, *, log: TextIO | None = None) -> Path | None:
    """Draw the cold long request's ms against its tokens, one curve per group count, from this
    benchmark's JSON; return the PNG's path, or None (said on `log`) without matplotlib."""
    plt = pyplot(log)
    if plt is None:
        return None
    data: dict[str, Any] = json.loads(results.read_text(encoding="utf-8"))
    figure, axis = plt.subplots(figsize=(7, 4.5))
    cold = data.get("scaling", {}).get("cold", [])
    for num_groups in sorted({int(row["groups"]) for row in cold}):
        rows = sorted((r for r in cold if r["groups"] == num_groups), key=lambda r: r["tokens"])
        axis.plot(
            [int(r["tokens"]) for r in rows],
            [float(r["cold_ms"]) for r in rows],
            marker="o",
            label=f"{num_groups} groups",
        )
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("tokens of the request")
    axis.set_ylabel("CPU ms, cold lookup + load + pin")
    axis.legend(fontsize=7)
    measured = data.get("measured_on", {})
    return save_plot(
        plt,
        figure,
        png,
        f"kvferry planner, CPU {measured.get('cpu', '')}, {measured.get('date', '')}",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the planner benchmarks; print the rows, the scaling table and the bars; write the
    JSON and the PNG under `--out`; return 0."""
    parser = argparse.ArgumentParser(
        prog=f"kvferry bench {NAME}", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=None, help="interleaved rounds (default 30)"
    )
    add_common_options(
        parser,
        quick="a CI-sized run: 3 rounds, a 16384-token request, 32 running requests, "
        "scaling to 16384 tokens, no vLLM",
    )
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 30)
    long_tokens = 16_384 if args.quick else LONG_TOKENS
    running = 32 if args.quick else RUNNING
    with_vllm = not args.quick and importlib.util.find_spec("vllm") is not None

    info = measured_on()
    print(measured_on_line(info))
    results: dict[str, Any] = {"measured_on": info, "rounds": rounds, "vllm": with_vllm}
    long_rows = long_request_rows(long_tokens)
    vllm_long = None
    if with_vllm:
        long_rows["engine"], vllm_long = engine_long_request(long_tokens)
    results["long"] = interleave(long_rows, vllm_long, rounds)
    store_rows = store_step_rows(running, 2 * rounds + 2)
    vllm_store = None
    if with_vllm:
        store_rows["engine"], vllm_store = engine_store_step(running, 2 * rounds + 2)
    results["store"] = interleave(store_rows, vllm_store, 2 * rounds)
    message = message_row()
    message()
    results["message_ms"] = statistics.median(message() for _ in range(max(rounds, 20)))
    results["json_message_ms"] = json_message_ms(max(rounds // 3, 3))
    results["scaling"] = scaling(
        SCALE_TOKENS_QUICK if args.quick else SCALE_TOKENS,
        SCALE_RUNNING_QUICK if args.quick else SCALE_RUNNING,
        1 if args.quick else SCALE_REPEAT,
        2 * rounds,
    )
    _print_rows(f"{long_tokens}-token request", LONG_ROWS, results["long"])
    _print_rows(f"{running} decode requests", STORE_ROWS, results["store"])
    print(
        f"worker message, {MESSAGE_BLOCKS} blocks x 3 groups, encode + decode: "
        f"{results['message_ms']:.3f} ms (binary; JSON {results['json_message_ms']:.3f} ms)"
    )
    print(f"{'groups':>6} {'tokens':>9} {'cold ms':>9}")
    for row in results["scaling"]["cold"]:
        print(f"{row['groups']:>6} {row['tokens']:>9} {row['cold_ms']:>9.3f}")
    print(f"{'running':>7} {'step + reserve ms':>18}")
    for row in results["scaling"]["store"]:
        print(f"{row['requests']:>7} {row['step_ms']:>18.3f}")
    results["bars"] = bars(results)
    for verdict in results["bars"]:
        print(bar_line(verdict["passed"], verdict["bar"], verdict["measured"]))
    json_path, png_path = output_paths(args.out, NAME)
    write_json(json_path, results)
    drawn = plot(json_path, png_path)
    print(f"wrote {json_path}" + (f" and {drawn}" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
