"""The demo's small inference engine: a block manager with its own GPU prefix cache, a scheduler
with chunked prefill, decoding and preemption, driving the real session, catalog and executor.

It plays an engine around kvferry and holds no planning rule of kvferry's: lookups, loads,
stores and completions go through `OffloadSession`; copies through the executor of every
tensor-parallel rank (`DemoRanks`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from kvferry.adapters.demo_pages import ForwardBatch, Words
from kvferry.adapters.demo_profiles import ModelProfile
from kvferry.adapters.demo_ranks import DemoRanks
from kvferry.adapters.demo_workload import ChatWorkload, Turn
from kvferry.adapters.messages import Completions
from kvferry.adapters.session import OffloadSession, RunningRequest
from kvferry.adapters.shared_tier import SharedTier
from kvferry.adapters.workers import report_all
from kvferry.core.blocks import GroupBlocks
from kvferry.core.bound import BoundPlan
from kvferry.core.config import OffloadConfig
from kvferry.core.errors import KvferryError, TransferFailedError
from kvferry.core.keys import KeyStatus, OffloadKey
from kvferry.core.lookup import lookup
from kvferry.core.plan import Direction
from kvferry.core.state import new_request_state

NULL = 0
"""The engine's shared null block id."""
MAX_RUNNING = 16
"""Requests the engine runs at once."""


class EngineStalledError(KvferryError):
    """The demo engine cannot make progress (a request needs more GPU blocks than the pool has)."""


class BlockPool:
    """One group's GPU blocks: reference counts, a prefix cache (block hash -> block) and an LRU
    queue of free blocks, whose cached contents stay reusable until the block is reallocated."""

    def __init__(self, num_blocks: int) -> None:
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict(
            (b, None) for b in range(1, num_blocks + 1)
        )
        self._refs: dict[int, int] = {}
        self._cached: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.evictions = 0
        """Cached blocks reallocated (their contents forgotten)."""

    @property
    def free_count(self) -> int:
        """Return how many blocks are free (cached or not)."""
        return len(self._free)

    def cached_block(self, block_hash: bytes) -> int | None:
        """Return the block holding `block_hash`'s contents, or None."""
        return self._cached.get(block_hash)

    def is_free(self, block: int) -> bool:
        """Return True when `block` is in the free queue."""
        return block in self._free

    def allocate(self) -> int:
        """Return a fresh block (the least recently freed); its cached contents are forgotten."""
        block, _ = self._free.popitem(last=False)
        old = self._hash_of.pop(block, None)
        if old is not None:
            del self._cached[old]
            self.evictions += 1
        self._refs[block] = 1
        return block

    def touch(self, block: int) -> None:
        """Take one more reference to a cached block (out of the free queue if it was free)."""
        self._free.pop(block, None)
        self._refs[block] = self._refs.get(block, 0) + 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; a block with none left joins the free queue (at the
        end when its contents are cached, so it is reused last; at the front otherwise)."""
        for block in blocks:
            left = self._refs[block] - 1
            if left:
                self._refs[block] = left
                continue
            del self._refs[block]
            self._free[block] = None
            if block not in self._hash_of:
                self._free.move_to_end(block, last=False)

    def register(self, block: int, block_hash: bytes) -> None:
        """Record that `block` holds the complete contents named by `block_hash` (the first
        block to do so keeps the name)."""
        if block_hash not in self._cached and block not in self._hash_of:
            self._cached[block_hash] = block
            self._hash_of[block] = block_hash


class _GpuCacheView:
    """The GPU prefix cache as a tier the planner's `lookup` can read (chunks of one block)."""

    def __init__(self, pools: Sequence[BlockPool]) -> None:
        self._pools = pools

    def statuses(self, keys: Sequence[OffloadKey]) -> list[KeyStatus]:
        return [
            KeyStatus.HIT
            if self._pools[key.group].cached_block(key.block_hash) is not None
            else KeyStatus.MISS
            for key in keys
        ]


@attrs.define
class _Request:
    """A request the engine runs (mutable bookkeeping, private)."""

    turn: Turn
    num_tokens: int
    """Tokens known: the prompt, then one more per sampled token."""
    computed: int = 0
    """Tokens whose KV exists."""
    tables: list[list[int]] = attrs.field(factory=list)
    """Per group, the block of each position (NULL where the group needs none)."""
    registered: list[int] = attrs.field(factory=list)
    """Per group, positions below this were offered to the GPU prefix cache."""
    ids: Words = attrs.field(factory=lambda: np.empty(0, dtype=np.uint64))
    """Token identities of the whole turn (prompt and answer)."""
    hashes: list[bytes] = attrs.field(factory=list)
    """Block hashes of the `num_tokens` tokens."""
    admitted_once: bool = False
    counted: list[int] = attrs.field(factory=list)
    """Per group, the chunks whose store worth was counted (`EngineTally.windowed_*`)."""


@attrs.define
class EngineTally:
    """Running counts of one engine run."""

    steps: int = 0
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    loaded_tokens: int = 0
    decoded_tokens: int = 0
    preemptions: int = 0
    load_jobs: int = 0
    store_jobs: int = 0
    chunks_loaded: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    windowed_bytes_loaded: int = 0
    windowed_bytes_all_blocks: int = 0
    windowed_chunks_complete: int = 0
    """Chunks of windowed groups completed with real blocks (what a store could copy)."""
    windowed_chunks_not_stored: int = 0
    """Those of them in no window a lookup can load, which kvferry does not store."""
    windowed_bytes_complete: int = 0
    windowed_bytes_not_stored: int = 0
    finished: int = 0


class DemoEngine:
    """Serves a chat workload step by step: admit (GPU prefix lookup, kvferry lookup, block
    allocation, load), schedule (chunked prefill and decode), forward (writes every computed
    token's page bytes), stores, then frees what finished requests and windows left behind
    once the jobs reading those blocks are complete."""

    def __init__(
        self,
        *,
        profile: ModelProfile,
        config: OffloadConfig,
        session: OffloadSession,
        ranks: DemoRanks,
        workload: ChatWorkload,
        total_requests: int,
        progress: Callable[[int, int, int], None] | None = None,
        shared: SharedTier | None = None,
    ) -> None:
        self._profile = profile
        self._shared = shared
        """The shared tier below the CPU tier, polled once per step (None: none)."""
        self._config = config
        self._session = session
        self._ranks = ranks
        self._workload = workload
        self._total = total_requests
        self._progress = progress
        self._block = profile.block_size
        self._pools = [BlockPool(profile.gpu_blocks) for _ in profile.groups]
        self._gpu_config = attrs.evolve(config, blocks_per_chunk=1)
        self._gpu_view = _GpuCacheView(self._pools)
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._deferred: list[tuple[frozenset[int], int, list[int]]] = []
        self._jobs: dict[int, BoundPlan] = {}
        self._watermark = max(1, profile.gpu_blocks // 20)
        self._page_bytes = list(ranks.page_bytes)
        self.tally = EngineTally()

    # -- the run ---------------------------------------------------------------------------------

    @property
    def pages_verified(self) -> int:
        """Return the loaded pages verified so far, over every rank."""
        return sum(self._ranks.pages_verified)

    @property
    def gpu_evictions(self) -> int:
        """Return the cached GPU blocks reallocated so far, over all groups."""
        return sum(pool.evictions for pool in self._pools)

    def run(self) -> EngineTally:
        """Serve every request of the workload; return the tally. Raises
        VerificationFailedError on a wrong loaded byte, TransferFailedError on a failed job."""
        for turn in self._workload.first_turns():
            self._waiting.append(self._new(turn))
        while self._waiting or self._running:
            self._step()
        self._store([])  # the last stores of the requests that finished last
        self._drain()
        if self._shared is not None:  # the last writes behind, for the other replicas
            self._shared.flush()
        return self.tally

    def _new(self, turn: Turn) -> _Request:
        self.tally.prompt_tokens += turn.prompt_tokens
        ids = turn.chain.id_array(turn.prompt_tokens + turn.answer_tokens)
        request = _Request(turn=turn, num_tokens=turn.prompt_tokens, ids=ids)
        request.hashes = turn.chain.block_hashes(request.num_tokens, self._config.hash_block_size)
        return request

    def _step(self) -> None:
        self._collect(self._ranks.poll())
        if self._shared is not None:
            self._shared.poll()
        self._admit()
        if not self._running:
            self._store([])  # the last stores of requests that finished, if any
            if self._shared is not None and self._shared.busy and not self._jobs:
                self._shared.wait(0.01)  # waiting requests retry until it answers
                return
            if not self._jobs:
                head = self._waiting[0].turn.request_id if self._waiting else "none"
                raise EngineStalledError(
                    f"no request can run (first waiting: {head}): the GPU pool of "
                    f"{self._profile.gpu_blocks} blocks per group is too small"
                )
            self._drain()
            return
        self.tally.steps += 1
        scheduled = self._schedule()
        batch = ForwardBatch.empty(len(self._pools))
        for request, count in scheduled:
            self._forward(batch, request, count)
        self._ranks.write(batch)
        self._store(scheduled)
        for request, count in scheduled:
            self._advance(request, count)
        if self._progress is not None:
            self._progress(self.tally.finished, self._total, self.tally.steps)

    # -- admission -------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Admit waiting requests in order while they fit (those told to retry wait)."""
        skipped: list[_Request] = []
        while self._waiting and len(self._running) < MAX_RUNNING:
            request = self._waiting.popleft()
            outcome = self._try_admit(request)
            if outcome is None:  # retry later: keep its place, let others go
                skipped.append(request)
                continue
            if not outcome:
                self._waiting.appendleft(request)
                break
        self._waiting.extendleft(reversed(skipped))

    def _gpu_hit(self, request: _Request) -> int:
        """Return the tokens the engine's own prefix cache holds for `request` (block aligned,
        leaving at least the last token to compute), found with the planner's lookup rules."""
        n = request.num_tokens
        boundary = (n - 1) // self._block * self._block
        if boundary < self._block:
            return 0
        state = new_request_state(
            self._gpu_config,
            request.turn.request_id,
            num_prompt_tokens=n,
            block_hashes=request.hashes,
        )
        extra = 1 if self._config.has_windowed_group else 0
        found = lookup(
            self._gpu_config,
            state,
            num_tokens=boundary + extra,
            num_computed_tokens=0,
            tier=self._gpu_view,
        )
        return found.tokens

    def _needed(self, group: int, position: int, boundary: int) -> bool:
        """Return whether `group` needs the block at `position` to resume at `boundary`: the
        blocks from the one holding its first needed token (`KIND_RULES`) on."""
        first = self._config.groups[group].first_needed_token(boundary)
        return position >= first // self._block

    def _try_admit(self, request: _Request) -> bool | None:
        """Admit `request` if it fits: True; no room: False; the tier says retry: None."""
        rid = request.turn.request_id
        gpu = self._gpu_hit(request)
        found = self._session.lookup(
            rid,
            block_hashes=request.hashes,
            num_tokens=request.num_tokens,
            num_computed_tokens=gpu,
            num_prompt_tokens=request.turn.prompt_tokens,
        )
        if found.retry:
            return None
        hit = min(found.tokens, request.num_tokens - 1 - gpu)
        boundary = gpu + hit
        n_blocks = -(-boundary // self._block)
        plans: list[list[tuple[int, bool]]] = []  # per group: (position, from the GPU cache)
        for g, pool in enumerate(self._pools):
            wanted = [
                (i, i < gpu // self._block) for i in range(n_blocks) if self._needed(g, i, boundary)
            ]
            taken = sum(
                1
                for i, hit_block in wanted
                if not hit_block or pool.is_free(self._cached(g, request, i))
            )
            full = not self._config.groups[g].rule.windowed
            # full attention keeps every block: room for the whole prompt; the others: its
            # first chunk (the window or state moves along)
            stop = request.num_tokens if full else boundary + self._profile.step_tokens
            taken += -(-min(stop, request.num_tokens) // self._block) - n_blocks
            if pool.free_count - taken < self._watermark:
                return False
            plans.append(wanted)
        request.tables = [[NULL] * n_blocks for _ in self._pools]
        request.registered = [0] * len(self._pools)
        cached_flags: list[list[int]] = []
        for g, (pool, wanted) in enumerate(zip(self._pools, plans, strict=True)):
            flags = []
            for i, from_cache in wanted:  # touch every hit before allocating anything
                if from_cache:
                    block = self._cached(g, request, i)
                    pool.touch(block)
                    request.tables[g][i] = block
                    flags.append(i)
            for i, from_cache in wanted:
                if not from_cache:
                    request.tables[g][i] = pool.allocate()
            cached_flags.append(flags)
        blocks = [
            _group_blocks(table, cached=flags)
            for table, flags in zip(request.tables, cached_flags, strict=True)
        ]
        if not request.admitted_once:
            self.tally.gpu_hit_tokens += gpu
            self.tally.loaded_tokens += hit
        request.admitted_once = True
        job = self._session.start_load(rid, blocks, num_computed_tokens=gpu, hit_tokens=hit)
        if job is not None:
            self._load(job, request, gpu, boundary)
        request.computed = boundary
        self._register(request)
        for g, pool in enumerate(self._pools):  # the blocks its first step(s) will fill
            full = not self._config.groups[g].rule.windowed
            stop = request.num_tokens if full else boundary + self._profile.step_tokens
            table = request.tables[g]
            while len(table) < -(-min(stop, request.num_tokens) // self._block):
                table.append(pool.allocate())
        self._running.append(request)
        return True

    def _cached(self, group: int, request: _Request, position: int) -> int:
        block_hash = request.hashes[
            (position + 1) * self._block // self._config.hash_block_size - 1
        ]
        block = self._pools[group].cached_block(block_hash)
        if block is None:
            raise EngineStalledError(
                f"request {request.turn.request_id!r}, group {group}: the GPU prefix cache lost "
                f"block {position} between lookup and allocation"
            )
        return block

    def _load(self, job: BoundPlan, request: _Request, gpu: int, boundary: int) -> None:
        """Run a load to completion, verify every page it wrote, and count it."""
        self._ranks.poison(job.plan)
        self._jobs[job.job_id] = job
        self._ranks.submit([job])
        self._collect(self._ranks.wait([job.job_id]))
        plan = job.plan
        self._ranks.verify(plan, request.ids)
        if self._shared is not None:
            self._shared.count_loaded(plan.keys)
        self.tally.load_jobs += 1
        self.tally.chunks_loaded += len(plan.keys)
        first = gpu // self._block
        for g, spec in enumerate(self._config.groups):
            if not spec.rule.windowed:
                continue
            every = -(-boundary // self._block) - first
            self.tally.windowed_bytes_loaded += plan.group_sizes[g] * self._page_bytes[g]
            self.tally.windowed_bytes_all_blocks += every * self._page_bytes[g]

    # -- one step --------------------------------------------------------------------------------

    def _schedule(self) -> list[tuple[_Request, int]]:
        """Give each running request its tokens of this step (a prefill chunk or one decode
        token) and the blocks they need, preempting the latest requests when blocks run out."""
        budget = self._profile.step_tokens
        scheduled: list[tuple[_Request, int]] = []
        index = 0
        while index < len(self._running) and budget > 0:
            request = self._running[index]
            count = min(request.num_tokens - request.computed, budget)
            if not self._grow(request, request.computed + count):
                continue  # `request` itself was preempted; the next one moved to `index`
            scheduled.append((request, count))
            budget -= count
            index += 1
        return scheduled

    def _grow(self, request: _Request, stop: int) -> bool:
        """Give `request` blocks for every position up to token `stop`; return False when it
        had to be preempted itself."""
        need = -(-stop // self._block)
        for g, pool in enumerate(self._pools):
            table = request.tables[g]
            while len(table) < need:
                while pool.free_count == 0:
                    if self._jobs:
                        self._drain()
                        continue
                    victim = self._running[-1]
                    if victim is request and len(self._running) == 1:
                        raise EngineStalledError(
                            f"request {request.turn.request_id!r} needs more than the "
                            f"{self._profile.gpu_blocks} GPU blocks of group {g}"
                        )
                    self._preempt(victim)
                    if victim is request:
                        return False
                table.append(pool.allocate())
        return True

    def _preempt(self, request: _Request) -> None:
        gate = self._session.preempt(request.turn.request_id)
        self._free_tables(request, gate)
        self._running.remove(request)
        request.computed = 0
        request.counted = []
        self._waiting.appendleft(request)
        self.tally.preemptions += 1

    def _forward(self, batch: ForwardBatch, request: _Request, count: int) -> None:
        start, stop = request.computed, request.computed + count
        for g, spec in enumerate(self._config.groups):
            table = np.asarray(request.tables[g], dtype=np.uint64)
            if spec.rule.recurrent_state:
                batch.add_states(
                    g, table, request.ids, start=start, stop=stop, block_size=self._block
                )
            else:
                batch.add_tokens(
                    g, table, request.ids, start=start, stop=stop, block_size=self._block
                )

    def _store(self, scheduled: list[tuple[_Request, int]]) -> None:
        counts = {id(request): count for request, count in scheduled}
        step = self._session.start_stores(
            RunningRequest(
                request_id=request.turn.request_id,
                blocks=[_group_blocks(table) for table in request.tables],
                num_computed_tokens=request.computed,
                num_scheduled_tokens=counts.get(id(request), 0),
                num_tokens=request.num_tokens,
                block_hashes=request.hashes,
                num_prompt_tokens=request.turn.prompt_tokens,
            )
            for request in self._running
        )
        for request in self._running:
            self._count_windowed_chunks(request, request.computed + counts.get(id(request), 0))
        for job in step.jobs:
            self._jobs[job.job_id] = job
            self.tally.store_jobs += 1
        self._ranks.submit(step.jobs)
        if step.released:  # last stores given up: their requests' blocks are free now
            self._release_deferred()

    def _count_windowed_chunks(self, request: _Request, done: int) -> None:
        """Count the windowed groups' chunks that `done` computed tokens complete, and those of
        them kvferry passes over as no lookup can load them."""
        if not self._config.store_decoded_tokens:
            done = min(done, request.turn.prompt_tokens)
        f = self._config.blocks_per_chunk
        if not request.counted:
            request.counted = [0] * len(self._pools)
        for g, spec in enumerate(self._config.groups):
            end = min(done, request.num_tokens) // self._config.chunk_tokens(g)
            if spec.rule.windowed:
                table = request.tables[g]
                for j in range(request.counted[g], min(end, len(table) // f)):
                    if NULL in table[j * f : (j + 1) * f]:
                        continue
                    self.tally.windowed_chunks_complete += 1
                    self.tally.windowed_bytes_complete += f * self._page_bytes[g]
                    if not self._config.keeps_chunk(g, j):
                        self.tally.windowed_chunks_not_stored += 1
                        self.tally.windowed_bytes_not_stored += f * self._page_bytes[g]
            request.counted[g] = max(request.counted[g], end)

    def _advance(self, request: _Request, count: int) -> None:
        """After the forward pass: sample, cache complete blocks, drop blocks the groups no
        longer need, finish the request when its answer is complete."""
        request.computed += count
        if request.computed == request.num_tokens:  # the step's last token was sampled
            request.num_tokens += 1
            self.tally.decoded_tokens += 1
            hb = self._config.hash_block_size
            if request.num_tokens % hb == 0:
                request.hashes = request.turn.chain.block_hashes(request.num_tokens, hb)
            if request.num_tokens - request.turn.prompt_tokens == request.turn.answer_tokens:
                self._finish(request)
                return
        self._register(request)
        jobs = self._session.jobs_of(request.turn.request_id)
        for g, spec in enumerate(self._config.groups):
            if not spec.rule.windowed:
                continue
            # What an engine frees: the blocks wholly below the first token still needed.
            below = spec.first_needed_token(request.computed) // self._block
            table = request.tables[g]
            dropped = [table[i] for i in range(min(below, len(table))) if table[i] != NULL]
            if dropped:
                for i in range(min(below, len(table))):
                    table[i] = NULL
                self._defer(jobs, g, dropped)

    def _register(self, request: _Request) -> None:
        """Offer the request's complete blocks to the GPU prefix cache."""
        complete = request.computed // self._block
        hb = self._config.hash_block_size
        for g, pool in enumerate(self._pools):
            table = request.tables[g]
            for i in range(request.registered[g], min(complete, len(table))):
                if table[i] != NULL:
                    pool.register(table[i], request.hashes[(i + 1) * self._block // hb - 1])
            request.registered[g] = max(request.registered[g], complete)

    def _finish(self, request: _Request) -> None:
        self._running.remove(request)
        self._register(request)
        last = RunningRequest(  # offer once more what is not stored yet
            request_id=request.turn.request_id,
            blocks=[_group_blocks(table) for table in request.tables],
            num_computed_tokens=request.computed,
            num_scheduled_tokens=0,
            num_tokens=request.num_tokens,
            block_hashes=request.hashes,
        )
        gate = self._session.finish(request.turn.request_id, last=last)
        self._free_tables(request, gate)
        self.tally.finished += 1
        following = self._workload.next_turn(request.turn)
        if following is not None:
            self._waiting.append(self._new(following))

    def _free_tables(self, request: _Request, gate: frozenset[int]) -> None:
        for g, table in enumerate(request.tables):
            blocks = [b for b in reversed(table) if b != NULL]  # tail blocks are reused first
            if blocks:
                self._defer(gate, g, blocks)
        request.tables = [[] for _ in self._pools]
        request.registered = [0] * len(self._pools)

    # -- jobs and deferred frees -----------------------------------------------------------------

    def _defer(self, gate: frozenset[int], group: int, blocks: list[int]) -> None:
        """Free `blocks` once every job of `gate` is complete (at once when none is pending)."""
        pending = gate & self._session.in_flight()
        if pending:
            self._deferred.append((pending, group, blocks))
        else:
            self._pools[group].release(blocks)

    def _collect(self, completions: list[Completions]) -> None:
        """Report every rank's results to the session, count them, and free what the jobs that
        completed (reported by every rank) gated."""
        if not completions:
            return
        for part in completions:
            for result in part.results:
                job = self._jobs[result.job_id]
                if not result.success:
                    rank = f"rank {part.worker}: " if self._ranks.world_size > 1 else ""
                    raise TransferFailedError(result.job_id, rank + (result.error or "unknown"))
                if job.plan.direction is Direction.STORE:
                    self.tally.bytes_stored += result.nbytes
                    self.tally.store_seconds += result.seconds
                else:
                    self.tally.bytes_loaded += result.nbytes
                    self.tally.load_seconds += result.seconds
        for job_id in report_all(self._session, completions).completed:
            del self._jobs[job_id]
        self._release_deferred()

    def _release_deferred(self) -> None:
        """Free the deferred blocks whose gating jobs are all complete."""
        live = self._session.in_flight()
        still = []
        for gate, group, blocks in self._deferred:
            if gate & live:
                still.append((gate & live, group, blocks))
            else:
                self._pools[group].release(blocks)
        self._deferred = still

    def _drain(self) -> None:
        """Wait for every job in flight (on every rank)."""
        if self._jobs:
            self._collect(self._ranks.wait(list(self._jobs)))


def _group_blocks(table: list[int], cached: Sequence[int] = ()) -> GroupBlocks:
    return GroupBlocks.of(table, null=[i for i, b in enumerate(table) if b == NULL], cached=cached)
