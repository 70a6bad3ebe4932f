"""`kvferry demo`: wires a profile, a chat workload, the session, the catalog and an executor
into the demo engine, runs it and returns its report.

Assembly and the progress line only: the engine plays the engine, kvferry does the rest; it
reads no file and no environment (the command line hands it a config value).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import attrs

from kvferry.adapters.config import KvferryConfig
from kvferry.adapters.demo_engine import DemoEngine
from kvferry.adapters.demo_pages import DemoKVCache, PagePattern
from kvferry.adapters.demo_profiles import PROFILES, ModelProfile, ProfileName, check_profile
from kvferry.adapters.demo_ranks import DemoRanks, DemoShard, LocalRanks, ProcessRanks
from kvferry.adapters.demo_report import DemoReport
from kvferry.adapters.demo_workload import ChatWorkload, WorkloadShape
from kvferry.adapters.session import OffloadSession
from kvferry.adapters.workers import WorkerPool
from kvferry.core.catalog import Catalog, CatalogConfig
from kvferry.core.errors import InvalidInputError
from kvferry.executors.base import Executor
from kvferry.executors.registry import executor_class, make_executor
from kvferry.executors.tensors import build_layout

ExecutorFactory = Callable[..., Executor]
"""Makes the executor: `make_executor` by default; tests pass a wrapper to inject faults."""


@attrs.frozen(kw_only=True)
class DemoOptions:
    """What one demo run plays."""

    profile: ProfileName = ProfileName.LLAMA
    """The model profile."""
    requests: int = 64
    """Chat turns to serve."""
    seed: int = 0
    """Seed of the workload and of the page patterns."""
    config: KvferryConfig = attrs.field(factory=KvferryConfig)
    """Executor, CPU tier, eviction policy, F, decoded-token stores."""
    tp: int | None = None
    """Tensor-parallel ranks, one worker process each; None: one rank, in this process."""


class ProgressLine:
    """A one-line progress bar on a text stream (`\\r`, redrawn at most ten times a second)."""

    def __init__(self, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self._stream = stream
        self._width = width
        self._last = 0.0

    def __call__(self, done: int, total: int, steps: int) -> None:
        """Redraw the line for `done` of `total` requests after `steps` steps."""
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        filled = self._width * done // max(total, 1)
        bar = "#" * filled + "-" * (self._width - filled)
        self._stream.write(f"\r[{bar}] {done}/{total} requests, step {steps}")
        self._stream.flush()

    def close(self) -> None:
        """End the line."""
        self._stream.write("\n")
        self._stream.flush()


def _local_ranks(
    options: DemoOptions,
    profile: ModelProfile,
    *,
    f: int,
    on_gpu: bool,
    executor_factory: ExecutorFactory,
    torch_device: str | None,
) -> tuple[LocalRanks, CatalogConfig]:
    """Build the one in-process rank: the whole model's tensors and their executor."""
    config = options.config
    if torch_device is None and on_gpu:
        torch_device = "cuda"
    cache = DemoKVCache(profile, torch_device=torch_device)
    pattern = PagePattern(options.seed, cache.max_width())
    row_bytes = build_layout(cache.kv_tensors, f, on_gpu=on_gpu)[0].row_bytes
    catalog_config = config.catalog_config(row_bytes, default_tier_bytes=profile.cpu_tier_bytes)
    extra: dict[str, Any] = config.executor_options(on_gpu=on_gpu)
    executor = executor_factory(
        config.executor,
        kv_caches=cache.kv_tensors,
        blocks_per_chunk=f,
        num_rows=catalog_config.capacity_rows,
        **extra,
    )
    ranks = LocalRanks(executor, cache, pattern, block_size=profile.block_size)
    if executor.layout.row_bytes != row_bytes:
        ranks.close()
        raise InvalidInputError(
            field="row_bytes", expected=str(row_bytes), got=executor.layout.row_bytes
        )
    return ranks, catalog_config


def _process_ranks(
    options: DemoOptions, profile: ModelProfile, f: int, on_gpu: bool, tp: int
) -> tuple[ProcessRanks, CatalogConfig, str]:
    """Start `tp` worker processes, one shard each; return them, the catalog configuration
    (the CPU-tier budget covers every rank: a row is one chunk of the whole model) and the
    layout fingerprint they share."""
    config = options.config
    shard = profile.sharded(tp)
    # host arrays of the shard, never touched (zeros are mapped lazily): its layout only
    layout = build_layout(DemoKVCache(shard).kv_tensors, f, on_gpu=False)[0]
    catalog_config = config.catalog_config(
        tp * layout.row_bytes, default_tier_bytes=profile.cpu_tier_bytes
    )
    factory = DemoShard(
        profile=profile,
        executor=config.executor,
        executor_options=config.executor_options(on_gpu=on_gpu),
        on_gpu=on_gpu,
        blocks_per_chunk=f,
        num_rows=catalog_config.capacity_rows,
        seed=options.seed,
    )
    pool = WorkerPool(factory, tp, reply_timeout=config.worker_reply_timeout)
    if pool.layout_fingerprint != layout.fingerprint:
        pool.close()
        raise InvalidInputError(
            field="layout_fingerprint", expected=layout.fingerprint, got=pool.layout_fingerprint
        )
    return ProcessRanks(pool), catalog_config, layout.fingerprint


def describe_ranks(devices: Sequence[str]) -> str:
    """Return where the ranks run, saying when several share one GPU (or the host)."""
    where = ", ".join(f"rank {rank}: {device}" for rank, device in enumerate(devices))
    distinct = set(devices)
    if len(distinct) == len(devices):
        return f"{len(devices)} worker processes ({where})"
    kind = "the host" if distinct == {"cpu"} else f"{len(distinct)} GPU(s)"
    return (
        f"{len(devices)} worker processes ({where}); fewer devices than ranks: "
        f"{len(devices)} ranks share {kind}"
    )


def run_demo(
    options: DemoOptions,
    *,
    executor_factory: ExecutorFactory = make_executor,
    progress: Callable[[int, int, int], None] | None = None,
    torch_device: str | None = None,
) -> DemoReport:
    """Serve `options.requests` chat turns with the real planner, session, catalog and executor;
    return the report. Every page loaded from the CPU tier is verified: a wrong byte raises
    VerificationFailedError (and a failed job TransferFailedError).

    The KV tensors are numpy arrays for a host executor and torch CUDA tensors for a GPU one;
    `torch_device` forces torch tensors on that device (tests run the torch executor's copy path
    on `cpu` tensors this way). With `options.tp` set, `tp` worker processes hold one shard
    each (`cuda:rank` for a GPU executor, round-robin when there are fewer GPUs); the executor
    is then made by name in each worker, so `executor_factory` and `torch_device` must be left
    at their defaults."""
    started = time.perf_counter()
    profile = PROFILES[options.profile]
    check_profile(profile)
    config = options.config
    f = config.blocks_per_chunk or profile.blocks_per_chunk
    offload = profile.offload_config(f, store_decoded_tokens=config.store_decoded_tokens)
    on_gpu = executor_class(config.executor).on_gpu
    ranks: DemoRanks
    if options.tp is None:
        ranks, catalog_config = _local_ranks(
            options,
            profile,
            f=f,
            on_gpu=on_gpu,
            executor_factory=executor_factory,
            torch_device=torch_device,
        )
        fingerprint = ranks.executor.layout.fingerprint
        devices: tuple[str, ...] = ()
    else:
        if executor_factory is not make_executor or torch_device is not None:
            raise InvalidInputError(
                field="tp",
                expected="no executor_factory or torch_device (workers make executors by name)",
                got=options.tp,
            )
        ranks, catalog_config, fingerprint = _process_ranks(options, profile, f, on_gpu, options.tp)
        devices = tuple(info.device for info in ranks.pool.infos)
    try:
        catalog = Catalog(catalog_config)
        session = OffloadSession(
            offload, catalog, world_size=ranks.world_size, layout_fingerprint=fingerprint
        )
        shape = WorkloadShape(
            system_prompt_tokens=profile.system_prompt_tokens,
            user_tokens=profile.user_tokens,
            answer_tokens=profile.answer_tokens,
        )
        workload = ChatWorkload(shape, seed=options.seed, num_requests=options.requests)
        engine = DemoEngine(
            profile=profile,
            config=offload,
            session=session,
            ranks=ranks,
            workload=workload,
            total_requests=options.requests,
            progress=progress,
        )
        tally = engine.run()
        counters = session.counters()
        verified = ranks.pages_verified
        device = ranks.executor.device if isinstance(ranks, LocalRanks) else devices[0]
    finally:
        ranks.close()
    return DemoReport(
        profile=profile.name.value,
        title=profile.title,
        scale=profile.scale_note(),
        executor=config.executor,
        device=device,
        seed=options.seed,
        blocks_per_chunk=f,
        block_size=profile.block_size,
        gpu_blocks=profile.gpu_blocks,
        cpu_tier_bytes=(
            config.cpu_tier_bytes if config.cpu_tier_bytes is not None else profile.cpu_tier_bytes
        ),
        cpu_tier_rows=catalog_config.capacity_rows,
        eviction_policy=config.eviction_policy.value,
        requests=tally.finished,
        steps=tally.steps,
        prompt_tokens=tally.prompt_tokens,
        gpu_hit_tokens=tally.gpu_hit_tokens,
        loaded_tokens=tally.loaded_tokens,
        recomputed_tokens=tally.prompt_tokens - tally.gpu_hit_tokens - tally.loaded_tokens,
        decoded_tokens=tally.decoded_tokens,
        preemptions=tally.preemptions,
        gpu_evictions=engine.gpu_evictions,
        load_jobs=tally.load_jobs,
        store_jobs=tally.store_jobs,
        chunks_stored=counters.stores,
        chunks_evicted=counters.evictions,
        chunks_loaded=tally.chunks_loaded,
        bytes_stored=tally.bytes_stored,
        bytes_loaded=tally.bytes_loaded,
        store_seconds=tally.store_seconds,
        load_seconds=tally.load_seconds,
        windowed_bytes_loaded=tally.windowed_bytes_loaded,
        windowed_bytes_all_blocks=tally.windowed_bytes_all_blocks,
        pages_verified=sum(verified),
        wall_seconds=time.perf_counter() - started,
        tp=options.tp,
        rank_devices=devices,
        ranks_note=describe_ranks(devices) if devices else None,
        pages_verified_per_rank=verified if devices else (),
    )
