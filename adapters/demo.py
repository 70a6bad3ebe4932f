"""`kvferry demo`: wires a profile, a chat workload, the session, the catalog and an executor
into the demo engine, runs it and returns its report.

Assembly and the progress bar only: the engine plays the engine, kvferry does the rest; it
reads no file and no environment (the command line hands it a config value).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import NoReturn, TextIO

import attrs
from tqdm import tqdm

from kvferry.adapters.config import KvferryConfig
from kvferry.adapters.demo_engine import DemoEngine
from kvferry.adapters.demo_pages import DemoKVCache, PagePattern
from kvferry.adapters.demo_profiles import PROFILES, ModelProfile, ProfileName, check_profile
from kvferry.adapters.demo_ranks import DemoRanks, DemoShard, LocalRanks, ProcessRanks
from kvferry.adapters.demo_report import DemoReport
from kvferry.adapters.demo_workload import ChatWorkload, WorkloadShape
from kvferry.adapters.offloading import ExecutorFactory, build_offloading
from kvferry.adapters.session import OffloadSession
from kvferry.adapters.shared_tier import SharedTier, SharedTierSettings
from kvferry.adapters.workers import WorkerPool
from kvferry.core.catalog import Catalog
from kvferry.core.config import OffloadConfig
from kvferry.core.errors import InvalidInputError
from kvferry.executors.registry import executor_class, make_executor
from kvferry.executors.tensors import build_layout


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
    shared_tier: SharedTierSettings | None = None
    """A shared tier (Valkey/Redis) below the CPU tier; one rank only (`tp` None)."""
    replica: str | None = None
    """The name of this replica in the report, when several share the tier."""


class ProgressBar:
    """Requests served so far, drawn by tqdm on a text stream only when it is a terminal (a log
    gets no progress lines); call it as the engine's `progress`, then `close()` it."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self._stream = stream
        self._bar: tqdm[NoReturn] | None = None

    def __call__(self, done: int, total: int, steps: int) -> None:
        """Show `done` of `total` requests served after `steps` steps."""
        if self._bar is None:
            self._bar = tqdm(
                total=total,
                unit="request",
                file=self._stream,
                disable=not self._stream.isatty(),
                leave=False,
            )
        self._bar.set_postfix_str(f"step {steps}", refresh=False)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        """Take the bar off the terminal."""
        if self._bar is not None:
            self._bar.close()


def tier_shortfall(
    profile: ModelProfile, offload: OffloadConfig, rows: int | Sequence[int]
) -> str | None:
    """Return a one-line warning when some group's rows in the CPU tier (one count for every
    group, or one per group) are fewer than the chunks of that group one request completes in
    one full prefill step (a store reserves all of them or none), else None."""
    counts = (rows,) * offload.num_groups if isinstance(rows, int) else tuple(rows)
    for group, (held, tokens) in enumerate(zip(counts, offload.all_chunk_tokens, strict=True)):
        need = -(-profile.step_tokens // tokens)
        if held < need:
            return (
                f"the CPU tier holds {held} chunk(s) of group {group}, fewer than the {need} a "
                f"{profile.step_tokens}-token prefill step completes; a store takes all of a "
                "step's chunks or none, so such steps store nothing (a larger "
                "--cpu-tier-bytes stores them)"
            )
    return None


def _local_ranks(
    options: DemoOptions,
    profile: ModelProfile,
    offload: OffloadConfig,
    *,
    executor_factory: ExecutorFactory,
    torch_device: str | None,
) -> tuple[LocalRanks, OffloadSession, tuple[int, ...]]:
    """Build the one in-process rank: the whole model's tensors and, from them, the executor,
    the catalog and the session (`build_offloading`); return them with each group's row bytes."""
    config = options.config
    if torch_device is None and executor_class(config.executor).on_gpu:
        torch_device = "cuda"
    cache = DemoKVCache(profile, torch_device=torch_device)
    pattern = PagePattern(options.seed, cache.max_width())
    offloading = build_offloading(
        offload,
        tensors=cache.kv_tensors,
        settings=_with_tier(config, profile),
        executor_factory=executor_factory,
    )
    ranks = LocalRanks(offloading.executor, cache, pattern, block_size=profile.block_size)
    return ranks, offloading.session, offloading.layout.row_pitches


def _with_tier(config: KvferryConfig, profile: ModelProfile) -> KvferryConfig:
    """Return `config` with the profile's CPU-tier budget when it sets none."""
    if config.cpu_tier_bytes is not None:
        return config
    return attrs.evolve(config, cpu_tier_bytes=profile.cpu_tier_bytes)


def _process_ranks(
    options: DemoOptions, profile: ModelProfile, offload: OffloadConfig, tp: int
) -> tuple[ProcessRanks, OffloadSession, tuple[int, ...]]:
    """Start `tp` worker processes, one shard each; return them, the session, whose CPU-tier
    budget covers every rank, and each group's row bytes (a row is one chunk of the whole
    model)."""
    config = options.config
    f = offload.blocks_per_chunk
    on_gpu = executor_class(config.executor).on_gpu
    shard = profile.sharded(tp)
    # host arrays of the shard, never touched (zeros are mapped lazily): its layout only
    layout = build_layout(DemoKVCache(shard).kv_tensors, f, on_gpu=False)[0]
    pitches = tuple(tp * pitch for pitch in layout.row_pitches)  # a row: a chunk of every rank
    catalog = Catalog(_with_tier(config, profile).catalog_config(pitches))
    factory = DemoShard(
        profile=profile,
        executor=config.executor,
        executor_options=config.executor_options(on_gpu=on_gpu),
        on_gpu=on_gpu,
        blocks_per_chunk=f,
        num_rows=catalog.capacity_rows,
        seed=options.seed,
    )
    pool = WorkerPool(factory, tp, reply_timeout=config.worker_reply_timeout)
    if pool.layout_fingerprint != layout.fingerprint:
        pool.close()
        raise InvalidInputError(
            field="layout_fingerprint", expected=layout.fingerprint, got=pool.layout_fingerprint
        )
    session = OffloadSession(offload, catalog, world_size=tp, layout_fingerprint=layout.fingerprint)
    return ProcessRanks(pool), session, pitches


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
    warn: Callable[[str], None] | None = None,
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
    at their defaults. `warn` is called with a one-line warning before the run when the CPU tier
    is too small for the chunks one prefill step completes (see `tier_shortfall`)."""
    started = time.perf_counter()
    profile = PROFILES[options.profile]
    check_profile(profile)
    config = options.config
    f = config.blocks_per_chunk or profile.blocks_per_chunk
    offload = profile.offload_config(f, store_decoded_tokens=config.store_decoded_tokens)
    ranks: DemoRanks
    session: OffloadSession
    if options.tp is None:
        ranks, session, pitches = _local_ranks(
            options, profile, offload, executor_factory=executor_factory, torch_device=torch_device
        )
    else:
        if executor_factory is not make_executor or torch_device is not None:
            raise InvalidInputError(
                field="tp",
                expected="no executor_factory or torch_device (workers make executors by name)",
                got=options.tp,
            )
        if options.shared_tier is not None:
            raise InvalidInputError(
                field="shared_tier", expected="one rank (no tp) with a shared tier", got=options.tp
            )
        ranks, session, pitches = _process_ranks(options, profile, offload, options.tp)
    shared: SharedTier | None = None
    devices = (
        tuple(info.device for info in ranks.pool.infos) if isinstance(ranks, ProcessRanks) else ()
    )
    try:
        shortfall = tier_shortfall(profile, offload, session.catalog.capacity_rows)
        if warn is not None and shortfall is not None:
            warn(shortfall)
        shape = WorkloadShape(
            system_prompt_tokens=profile.system_prompt_tokens,
            user_tokens=profile.user_tokens,
            answer_tokens=profile.answer_tokens,
        )
        workload = ChatWorkload(shape, seed=options.seed, num_requests=options.requests)
        if options.shared_tier is not None and isinstance(ranks, LocalRanks):
            from kvferry.adapters.valkey_tier import open_shared_tier

            shared = open_shared_tier(session, ranks.executor, options.shared_tier)
        engine = DemoEngine(
            profile=profile,
            config=offload,
            session=session,
            ranks=ranks,
            workload=workload,
            total_requests=options.requests,
            progress=progress,
            shared=shared,
        )
        tally = engine.run()
        counters = session.counters()
        verified = ranks.pages_verified
        device = ranks.executor.device if isinstance(ranks, LocalRanks) else devices[0]
    finally:
        if shared is not None:
            shared.close()
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
        cpu_tier_bytes=_with_tier(config, profile).cpu_tier_bytes or 0,
        cpu_tier_rows=session.catalog.counters().group_capacity_rows,
        cpu_tier_row_bytes=pitches,
        group_kinds=tuple(group.kind.value for group in profile.groups),
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
        windowed_chunks_complete=tally.windowed_chunks_complete,
        windowed_chunks_not_stored=tally.windowed_chunks_not_stored,
        windowed_bytes_complete=tally.windowed_bytes_complete,
        windowed_bytes_not_stored=tally.windowed_bytes_not_stored,
        pages_verified=sum(verified),
        wall_seconds=time.perf_counter() - started,
        tp=options.tp,
        rank_devices=devices,
        ranks_note=describe_ranks(devices) if devices else None,
        pages_verified_per_rank=verified if devices else (),
        shared_tier=None if options.shared_tier is None else options.shared_tier.safe_url,
        shared=None if shared is None else shared.counters(),
        replica=options.replica,
    )
