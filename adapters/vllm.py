"""vLLM-shaped glue: engine objects -> kvferry values; a connector-shaped facade over the session.

A thin mapping, duck-typed on vLLM's attribute names (it never imports vLLM): it holds no
planning rule of its own — lookup, load and store decisions are `OffloadSession`'s.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np

from kvferry.adapters.messages import (
    decode_completions,
    decode_jobs,
    encode_completions,
)
from kvferry.adapters.session import OffloadSession, RecomputeRange, RunningRequest
from kvferry.adapters.wire import encode_jobs_binary
from kvferry.core.blocks import GroupBlocks
from kvferry.core.bound import BoundPlan, JobResult
from kvferry.core.catalog import CatalogEvent
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.errors import InvalidInputError, KvferryError, PlanInvariantError
from kvferry.core.kinds import KIND_RULES, PARAMETER_DEFAULTS
from kvferry.core.plan import Direction
from kvferry.executors.base import Executor

# -- what vLLM's objects look like (only the attributes read here) ----------------------------


class VllmRequest(Protocol):
    """vLLM's `Request`, as far as kvferry reads it (the engine keeps it up to date)."""

    @property
    def request_id(self) -> str:
        """The engine's request id."""
        ...

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens so far."""
        ...

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length."""
        ...

    @property
    def block_hashes(self) -> Sequence[bytes]:
        """One chained hash per full hash block of `hash_block_size` tokens (it only grows)."""
        ...


class VllmBlock(Protocol):
    """vLLM's `KVCacheBlock`, as far as kvferry reads it."""

    @property
    def block_id(self) -> int:
        """The GPU block id."""
        ...

    @property
    def block_hash(self) -> object | None:
        """Set when the block is full and in the GPU prefix cache; None for a fresh block."""
        ...

    @property
    def is_null(self) -> bool:
        """True for the engine's shared null block (a block the group no longer needs)."""
        ...


# -- KV-cache config -> OffloadConfig -----------------------------------------------------------

SPEC_KINDS: dict[str, GroupKind] = {
    "FullAttentionSpec": GroupKind.FULL_ATTENTION,
    "MLAAttentionSpec": GroupKind.FULL_ATTENTION,
    "SlidingWindowSpec": GroupKind.SLIDING_WINDOW,
    "SlidingWindowMLASpec": GroupKind.SLIDING_WINDOW,
    "MambaSpec": GroupKind.MAMBA,
    "ChunkedLocalAttentionSpec": GroupKind.CHUNKED_LOCAL_ATTENTION,
}
"""vLLM spec class names and the group kind each means; drives `group_kind_of`, its tests and
docs/embedding.md. A spec is recognised by the first of its classes (its MRO) named here, so
subclasses count. A `FullAttentionSpec` whose `sliding_window` is set stays full attention:
vLLM uses it for sliding-window layers when its hybrid allocator is off, and then keeps every
block of the group."""


def group_kind_of(spec: object, *, group: int | None = None) -> GroupKind:
    """Return the GroupKind a vLLM `kv_cache_spec` stands for, by its class name (SPEC_KINDS).

    Raises InvalidInputError naming the group and the class for a spec of another kind
    (e.g. `CrossAttentionSpec`): kvferry has no rule for it.
    """
    for cls in type(spec).__mro__:
        kind = SPEC_KINDS.get(cls.__name__)
        if kind is not None:
            return kind
    raise InvalidInputError(
        group=group,
        field="kv_cache_spec",
        expected=f"a spec of class (or subclass of) {', '.join(sorted(SPEC_KINDS))}",
        got=type(spec).__name__,
    )


def group_spec_from_vllm(spec: object, *, group: int | None = None) -> GroupSpec:
    """Return the GroupSpec of one vLLM `kv_cache_spec`: its kind, `block_size`, and the
    parameters the kind uses (`KIND_RULES[kind]`, read from vLLM's attributes of the same
    names: `sliding_window` and `extra_retained_tokens` of a sliding window,
    `attention_chunk_size` of chunked local attention)."""
    kind = group_kind_of(spec, group=group)
    block_size = getattr(spec, "block_size", None)
    if block_size is None:
        raise InvalidInputError(
            group=group, field="kv_cache_spec.block_size", expected="a block size", got=spec
        )
    rule = KIND_RULES[kind]
    parameters: dict[str, Any] = {
        name: getattr(spec, name, PARAMETER_DEFAULTS[name])
        for name in rule.parameters + rule.optional_parameters
    }
    try:
        return GroupSpec(kind=kind, block_size=block_size, **parameters)
    except InvalidInputError as error:
        raise InvalidInputError(
            group=group,
            field=f"kv_cache_spec.{error.field}",
            expected=error.expected,
            got=error.got,
        ) from error


def offload_config_from_vllm(
    kv_cache_config: object,
    *,
    hash_block_size: int,
    blocks_per_chunk: int = 1,
    store_decoded_tokens: bool = True,
) -> OffloadConfig:
    """Return the OffloadConfig of vLLM's `kv_cache_config` (`kv_cache_groups[i].kv_cache_spec`).

    `hash_block_size` is the engine's prefix-hash block size (vLLM: the tokens behind each
    entry of `request.block_hashes`); it is not guessed, because a wrong value would name
    chunks by the wrong prefix.
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not isinstance(groups, Sequence) or not groups:
        raise InvalidInputError(
            field="kv_cache_config.kv_cache_groups", expected="a non-empty sequence", got=groups
        )
    specs = tuple(
        group_spec_from_vllm(getattr(g, "kv_cache_spec", None), group=i)
        for i, g in enumerate(groups)
    )
    return OffloadConfig(
        hash_block_size=hash_block_size,
        blocks_per_chunk=blocks_per_chunk,
        groups=specs,
        store_decoded_tokens=store_decoded_tokens,
    )


# -- block tables -> GroupBlocks ------------------------------------------------------------------


def group_blocks_from_vllm(
    blocks: Iterable[VllmBlock], *, start: int = 0, stop: int | None = None
) -> GroupBlocks:
    """Return one group's GroupBlocks from vLLM blocks: `is_null` marks null blocks, and a
    real block with a `block_hash` is a GPU prefix-cache hit (fresh blocks have none yet).

    Only blocks `[start, stop)` are read (`stop` None: to the end); the table returned ends at
    `stop`, and its blocks below `start` are null. A load reads only the blocks its
    destinations can be in (`load_block_ranges`), not every block object of a long request.
    """
    window = list(blocks)[start:stop] if not isinstance(blocks, Sequence) else blocks[start:stop]
    count = len(window)
    ids = np.fromiter(map(_BLOCK_ID, window), dtype=np.int64, count=count)
    null = np.fromiter(map(_IS_NULL, window), dtype=np.bool_, count=count)
    hashed = [block_hash is not None for block_hash in map(_BLOCK_HASH, window)]
    cached = np.array(hashed, dtype=np.bool_).reshape(count) & ~null
    skipped = max(start, 0)
    if skipped:
        ids = np.concatenate((np.zeros(skipped, dtype=np.int64), ids))
        null = np.concatenate((np.ones(skipped, dtype=np.bool_), null))
        cached = np.concatenate((np.zeros(skipped, dtype=np.bool_), cached))
    return GroupBlocks(ids=ids, is_null=null, is_cached=cached)


_BLOCK_ID = operator.attrgetter("block_id")
_IS_NULL = operator.attrgetter("is_null")
_BLOCK_HASH = operator.attrgetter("block_hash")


def blocks_from_vllm(
    kv_cache_blocks: object, *, ranges: Sequence[tuple[int, int]] | None = None
) -> tuple[GroupBlocks, ...]:
    """Return per-group GroupBlocks of vLLM's `KVCacheBlocks` (its `.blocks`: one sequence of
    blocks per group) or of a plain sequence of such sequences; with `ranges`, group `g`
    reads only its blocks `ranges[g]` (see `group_blocks_from_vllm`)."""
    groups = getattr(kv_cache_blocks, "blocks", kv_cache_blocks)
    if not isinstance(groups, Sequence):
        raise InvalidInputError(
            field="blocks", expected="KVCacheBlocks or a sequence per group", got=groups
        )
    if ranges is None:
        return tuple(group_blocks_from_vllm(group) for group in groups)
    if len(ranges) != len(groups):
        raise InvalidInputError(
            field="blocks", expected=f"one block list per group ({len(ranges)})", got=len(groups)
        )
    return tuple(
        group_blocks_from_vllm(group, start=start, stop=stop)
        for group, (start, stop) in zip(groups, ranges, strict=True)
    )


def load_block_ranges(
    config: OffloadConfig, *, num_computed_tokens: int, hit_tokens: int
) -> tuple[tuple[int, int], ...]:
    """Return, per group, the block range `[start, stop)` a load of `hit_tokens` after
    `num_computed_tokens` can write into: from the block the GPU prefix ends inside, or the
    group's first needed block if later, to the block holding the last loaded token. A load
    plan reads nothing outside it, so a translation needs nothing outside it either."""
    cached = num_computed_tokens + hit_tokens
    ranges = []
    for spec in config.groups:
        stop = -(-cached // spec.block_size)
        first = spec.first_needed_token(cached) // spec.block_size
        ranges.append((min(max(num_computed_tokens // spec.block_size, first), stop), stop))
    return tuple(ranges)


NULL_BLOCK_ID = 0
"""vLLM's shared null block is block 0 of its pool; id lists (scheduler output) show it as 0."""


def engine_skipped_tokens(spec: GroupSpec, num_computed_tokens: int) -> int:
    """Return how many leading tokens' blocks vLLM has replaced by its null block once
    `num_computed_tokens` are computed (vLLM's `get_num_skipped_tokens`): the tokens below the
    first one the group needs to go on (`GroupSpec.first_needed_token`): none for full
    attention, `n - window + 1` for a sliding window, `n - 1` for Mamba."""
    return spec.first_needed_token(num_computed_tokens)


def group_blocks_from_ids(
    config: OffloadConfig, block_ids: Sequence[Sequence[int]], *, num_computed_tokens: int
) -> tuple[GroupBlocks, ...]:
    """Return per-group GroupBlocks of a block table kept from vLLM's id lists, as vLLM's own
    table stands at this step: id 0 is null, and so is every block vLLM has nulled since
    (`engine_skipped_tokens` at the step's `num_computed_tokens`).

    vLLM ships only *new* block ids per step and never says which old ones it freed; a kept
    table would otherwise name freed (and possibly reused) blocks as sources of a store.
    """
    if len(block_ids) != config.num_groups:
        raise InvalidInputError(
            field="block_ids",
            expected=f"one id list per group ({config.num_groups} groups)",
            got=len(block_ids),
        )
    tables = []
    for spec, ids in zip(config.groups, block_ids, strict=True):
        skipped = engine_skipped_tokens(spec, num_computed_tokens) // spec.block_size
        unflagged = np.zeros(len(ids), dtype=np.bool_)
        checked = GroupBlocks(ids=ids, is_null=unflagged, is_cached=unflagged)  # refuses bad ids
        null = checked.ids == NULL_BLOCK_ID  # one vectorised pass, no Python loop per block
        null[:skipped] = True
        tables.append(GroupBlocks(ids=checked.ids, is_null=null, is_cached=unflagged))
    return tuple(tables)


# -- scheduler side --------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ConnectorMetadata:
    """What the scheduler ships to every worker for one step (vLLM's `KVConnectorMetadata`)."""

    jobs: bytes
    """The step's bound plans, loads first, as a binary jobs message
    (`kvferry.adapters.wire.encode_jobs_binary`; `decode_jobs` reads it)."""
    flush: tuple[int, ...] = ()
    """Jobs to wait for before this step's forward pass (stores and loads of preempted
    requests, whose GPU blocks the step may reuse)."""


@attrs.frozen(kw_only=True)
class ConnectorOutput:
    """What workers' results mean for the engine (vLLM's `KVConnectorOutput`, by request)."""

    finished_recving: frozenset[str] = frozenset()
    """Requests whose asynchronous load ended (successfully or not): schedule them again."""
    finished_sending: frozenset[str] = frozenset()
    """Finished requests whose blocks were held (`request_finished` said so): free them now."""
    recompute: tuple[RecomputeRange, ...] = ()
    """Tokens that failed loads did not bring: compute them instead (vLLM's load errors)."""
    failed_jobs: tuple[int, ...] = ()
    """Jobs that failed on some worker."""


def _scheduled(scheduler_output: Any) -> Iterator[tuple[str, Any, bool, int]]:
    """Yield (request id, new block ids per group or None, resumed, num_computed_tokens) for
    every request of vLLM's `SchedulerOutput`, new ones first (as vLLM's `yield_req_data`)."""
    for data in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        yield data.req_id, data.block_ids, True, int(data.num_computed_tokens)
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is None:
        return
    resumed = set(getattr(cached, "resumed_req_ids", None) or ())
    for rid, new_ids, computed in zip(
        cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
    ):
        yield rid, new_ids, rid in resumed, int(computed)


class KvferryConnectorScheduler:
    """The scheduler-side call points of a vLLM KV connector, mapped onto an OffloadSession.

    Call order per step, as vLLM does: `get_num_new_matched_tokens` for waiting requests (again
    each step while it answers None), `update_state_after_alloc` after their blocks are
    allocated, `build_connector_meta` once the step is scheduled, `update_connector_output`
    with the workers' messages, and `request_finished` when a request ends.
    """

    def __init__(self, session: OffloadSession) -> None:
        if not isinstance(session, OffloadSession):
            raise InvalidInputError(field="session", expected="an OffloadSession", got=session)
        self._session = session
        self._requests: dict[str, VllmRequest] = {}
        self._computed: dict[str, int] = {}
        self._tables: dict[str, list[list[int]]] = {}
        self._built: dict[str, tuple[tuple[int, ...], tuple[GroupBlocks, ...]]] = {}
        """Each request's GroupBlocks as last built, with the null prefix per group they were
        built for: a decode step changes few tables, so most are reused as they are."""
        self._loads: list[BoundPlan] = []
        self._load_jobs: dict[int, str] = {}
        self._ready_now: set[str] = set()
        self._refused: list[RecomputeRange] = []
        self._held: set[str] = set()
        self._released: set[str] = set()

    @property
    def session(self) -> OffloadSession:
        """Return the session this facade drives."""
        return self._session

    def get_num_new_matched_tokens(
        self, request: VllmRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Return `(tokens, load_async)` as vLLM expects: `(None, False)` to ask again next step
        (a needed chunk is being written or loaded), `(0, False)` for nothing to load, else
        `(tokens, True)`: that many tokens past `num_computed_tokens` (vLLM's GPU prefix hit)
        will be loaded asynchronously.

        Side-effect free for the tier, as vLLM requires; the request object is kept so that
        later steps read its growing `block_hashes` and `num_tokens`.
        """
        rid = request.request_id
        result = self._session.lookup(  # refuses a hash count other than the tokens need
            rid,
            block_hashes=request.block_hashes,
            num_tokens=request.num_tokens,
            num_computed_tokens=num_computed_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
        )
        self._requests[rid] = request
        self._computed[rid] = num_computed_tokens
        if result.retry:
            return None, False
        return result.tokens, result.tokens > 0

    def update_state_after_alloc(
        self, request: VllmRequest, blocks: object, num_external_tokens: int
    ) -> None:
        """Plan the load of `num_external_tokens` into the request's allocated `blocks`
        (vLLM's `KVCacheBlocks`: the whole table, GPU prefix hits carrying a `block_hash`).

        The job is shipped by the next `build_connector_meta`. When nothing needs moving, or
        the chunks are no longer readable, the request is reported by the next
        `update_connector_output` as loaded (with a recompute range in the second case), so
        the engine never waits for a load that does not exist.
        """
        rid = request.request_id
        self._requests[rid] = request
        if num_external_tokens == 0:
            return
        computed = self._computed.get(rid)
        if computed is None:
            raise InvalidInputError(
                request=rid,
                field="request",
                expected="a request asked with get_num_new_matched_tokens first",
                got="an unknown request",
            )
        try:
            ranges = load_block_ranges(
                self._session.config,
                num_computed_tokens=computed,
                hit_tokens=num_external_tokens,
            )
            job = self._session.start_load(
                rid,
                blocks_from_vllm(blocks, ranges=ranges),
                num_computed_tokens=computed,
                hit_tokens=num_external_tokens,
            )
        except PlanInvariantError:
            self._refused.append(
                RecomputeRange(request_id=rid, start=computed, stop=computed + num_external_tokens)
            )
            self._ready_now.add(rid)
            return
        if job is None:
            self._ready_now.add(rid)
            return
        self._loads.append(job)
        self._load_jobs[job.job_id] = rid

    def build_connector_meta(self, scheduler_output: object) -> ConnectorMetadata:
        """Return this step's metadata for the workers: the loads planned since the last call
        and the stores of every scheduled request, as message bytes, plus the jobs of preempted
        requests to wait for.

        Reads vLLM's `SchedulerOutput`: `scheduled_new_reqs` (`req_id`, `block_ids`,
        `num_computed_tokens`), `scheduled_cached_reqs` (`req_ids`, `new_block_ids`,
        `num_computed_tokens`, `resumed_req_ids`), `num_scheduled_tokens` and
        `preempted_req_ids`. Block ids arrive as deltas; the facade keeps each request's table
        (see `group_blocks_from_ids`).
        """
        flush: set[int] = set()
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            if self._session.request_state(rid) is not None:
                flush |= self._session.preempt(rid)
            self._tables.pop(rid, None)
            self._built.pop(rid, None)
        num_scheduled: Mapping[str, int] = getattr(scheduler_output, "num_scheduled_tokens", {})
        running = []
        for rid, new_ids, whole, computed in _scheduled(scheduler_output):
            request = self._requests.get(rid)
            if request is None:
                raise InvalidInputError(
                    request=rid,
                    field="scheduler_output",
                    expected="a request seen by get_num_new_matched_tokens",
                    got="an unknown request",
                )
            running.append(
                RunningRequest(
                    request_id=rid,
                    blocks=self._group_blocks(rid, new_ids, whole, computed),
                    num_computed_tokens=computed,
                    num_scheduled_tokens=int(num_scheduled[rid]),
                    num_tokens=request.num_tokens,
                    block_hashes=request.block_hashes,
                    num_prompt_tokens=request.num_prompt_tokens,
                )
            )
        step = self._session.start_stores(running)
        self._released.update(step.released)
        jobs, self._loads = [*self._loads, *step.jobs], []
        return ConnectorMetadata(jobs=encode_jobs_binary(jobs), flush=tuple(sorted(flush)))

    def update_connector_output(self, messages: Iterable[bytes]) -> ConnectorOutput:
        """Record the workers' completion messages; return which requests finished loading,
        which finished requests may free their blocks, and what failed loads did not bring."""
        recving = set(self._ready_now)
        recompute = list(self._refused)
        self._ready_now.clear()
        self._refused.clear()
        failed: list[int] = []
        released: list[str] = []
        for message in messages:
            completions = decode_completions(message)
            report = self._session.report(completions.worker, completions.results)
            for job_id in report.completed:
                rid = self._load_jobs.pop(job_id, None)
                if rid is not None and rid in self._requests:
                    recving.add(rid)
            failed.extend(report.failed)
            recompute.extend(report.recompute)
            released.extend(report.released)
        sending = self._held.intersection(released) | self._held.intersection(self._released)
        self._released.clear()
        self._held -= sending
        return ConnectorOutput(
            finished_recving=frozenset(recving),
            finished_sending=frozenset(sending),
            recompute=tuple(recompute),
            failed_jobs=tuple(failed),
        )

    def request_finished(
        self, request: VllmRequest, block_ids: object = None
    ) -> tuple[bool, frozenset[int]]:
        """Return `(delay_free_blocks, jobs)`: the request's jobs in flight (stores read its
        blocks, loads write them) and whether vLLM must hold its blocks until
        `update_connector_output` lists it in `finished_sending`.

        The request's chunks not stored yet (completed by its last step, or refused earlier
        for lack of room) are offered once more from the table kept for it, covering the
        tokens whose KV exists (`num_computed_tokens`, at most `num_tokens - 1`: the last
        sampled token has none); that store is shipped by the next `build_connector_meta`.
        vLLM's second element is `kv_transfer_params`; kvferry has none and names the jobs.
        `block_ids` is accepted for vLLM's signature and not read.
        """
        rid = request.request_id
        kept = self._tables.get(rid)
        last = None
        if kept is not None:
            computed = max(
                0,
                min(
                    int(getattr(request, "num_computed_tokens", request.num_tokens - 1)),
                    request.num_tokens - 1,
                ),
            )
            last = RunningRequest(
                request_id=rid,
                blocks=group_blocks_from_ids(
                    self._session.config, kept, num_computed_tokens=computed
                ),
                num_computed_tokens=computed,
                num_scheduled_tokens=0,
                num_tokens=request.num_tokens,
                block_hashes=request.block_hashes,
            )
        jobs = self._session.finish(rid, last=last)
        for table in (self._requests, self._computed, self._tables, self._built):
            table.pop(rid, None)
        self._ready_now.discard(rid)
        if jobs:
            self._held.add(rid)
        return bool(jobs), jobs

    def take_events(self) -> tuple[CatalogEvent, ...]:
        """Return the CPU tier's stored/removed events since the last call (if recorded)."""
        return self._session.drain_events()

    def _group_blocks(
        self, rid: str, new_ids: Any, whole: bool, computed: int
    ) -> tuple[GroupBlocks, ...]:
        """Return the request's GroupBlocks at this step, rebuilt only when its ids changed
        or a group nulled more blocks since they were last built."""
        table = self._table(rid, new_ids, whole)
        config = self._session.config
        nulled = tuple(
            engine_skipped_tokens(spec, computed) // spec.block_size for spec in config.groups
        )
        grown = whole or (new_ids is not None and any(len(ids) for ids in new_ids))
        built = None if grown else self._built.get(rid)
        if built is not None and built[0] == nulled:
            return built[1]
        blocks = group_blocks_from_ids(config, table, num_computed_tokens=computed)
        self._built[rid] = (nulled, blocks)
        return blocks

    def _table(self, rid: str, new_ids: Any, whole: bool) -> list[list[int]]:
        groups = self._session.config.num_groups
        table = None if whole else self._tables.get(rid)
        if table is None:
            table = [[] for _ in range(groups)]
        if new_ids is not None:
            if len(new_ids) != groups:
                raise InvalidInputError(
                    request=rid,
                    field="block_ids",
                    expected=f"one id list per group ({groups} groups)",
                    got=len(new_ids),
                )
            for group, ids in zip(table, new_ids, strict=True):
                group.extend(int(i) for i in ids)
        self._tables[rid] = table
        return table


# -- worker side -----------------------------------------------------------------------------------


class KvferryConnectorWorker:
    """The worker-side call points of a vLLM KV connector: one per GPU (rank), owning an
    executor; it decodes the scheduler's metadata, submits its jobs and returns results as
    completion messages. It never plans."""

    def __init__(self, executor: Executor, *, rank: int = 0) -> None:
        if not isinstance(executor, Executor):
            raise InvalidInputError(field="executor", expected="an Executor", got=executor)
        self._executor = executor
        self._rank = rank
        self._loads: list[BoundPlan] = []
        self._stores: list[BoundPlan] = []
        self._in_flight: set[int] = set()
        self._results: list[JobResult] = []

    @property
    def executor(self) -> Executor:
        """Return the executor this worker submits to."""
        return self._executor

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        """Take one step's metadata: wait now for its `flush` jobs still in flight here (their
        blocks may be reused by this step), and hold its loads and stores for submission."""
        waiting = [job for job in metadata.flush if job in self._in_flight]
        self._collect(self._executor.wait(waiting))
        jobs = decode_jobs(metadata.jobs)
        self._loads = [job for job in jobs if job.plan.direction is Direction.LOAD]
        self._stores = [job for job in jobs if job.plan.direction is Direction.STORE]

    def start_load_kv(self) -> None:
        """Submit the step's loads (before the forward pass; they are asynchronous). A job the
        executor refuses is reported failed (its error names this rank and why), never left
        in flight: other ranks may have run it."""
        self._submit(self._loads)
        self._loads = []

    def wait_for_save(self) -> None:
        """Submit the step's stores; call it once the forward pass is enqueued, since a store
        reads what that pass writes. Unlike vLLM's hook of this name it does not block."""
        self._submit(self._stores)
        self._stores = []

    def get_finished(self) -> bytes:
        """Return a completion message (`encode_completions`) with every job that ended since
        the last call, for the scheduler's `update_connector_output`."""
        self._collect(self._executor.poll())
        results, self._results = self._results, []
        return encode_completions(self._rank, results)

    def shutdown(self) -> bytes:
        """Drain and close the executor; return the completion message of what was left."""
        self._collect(self._executor.close())
        results, self._results = self._results, []
        return encode_completions(self._rank, results)

    def _submit(self, jobs: Sequence[BoundPlan]) -> None:
        for job in jobs:
            try:
                self._executor.submit(job)
            except KvferryError as error:  # refused here, maybe run on other ranks: a failed job
                reason = f"refused by rank {self._rank}: {type(error).__name__}: {error}"
                self._results.append(
                    JobResult(job_id=job.job_id, success=False, nbytes=0, seconds=0.0, error=reason)
                )
                continue
            self._in_flight.add(job.job_id)

    def _collect(self, results: Iterable[JobResult]) -> None:
        for result in results:
            self._in_flight.discard(result.job_id)
            self._results.append(result)
