"""The scheduler-side session: the facade an engine calls to look up, load, store and finish.

An impure shell around the pure planner and the catalog: it keeps requests and jobs, binds plans
to rows and job ids, and holds no planning rule of its own; it never copies a byte.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol, TypeVar

import attrs
import numpy as np

from kvferry.core.arrays import IdArray
from kvferry.core.blocks import GroupBlocks
from kvferry.core.bound import BoundPlan, JobResult
from kvferry.core.catalog import (
    Catalog,
    CatalogCounters,
    CatalogEvent,
    Lock,
    Reservation,
    StoreAsk,
    locked_method,
)
from kvferry.core.checks import at_least, unchecked_maker
from kvferry.core.config import OffloadConfig
from kvferry.core.errors import InvalidInputError, KvferryError, PlanInvariantError
from kvferry.core.group_rows import FoundRows
from kvferry.core.keys import KeyStatus, KeyStatusView, OffloadKey
from kvferry.core.load import plan_load
from kvferry.core.lookup import LookupResult, lookup
from kvferry.core.plan import Direction
from kvferry.core.state import RequestState, check_hash_count, extend_keys, new_request_state
from kvferry.core.store import (
    StoreCandidates,
    StoreDecision,
    StoreOutcome,
    StoreTierView,
    check_store_inputs,
    due_for_store,
    plan_checked_store,
)

BlockTable = Callable[[tuple[int, ...]], Iterable[GroupBlocks]]
"""A request's block table read on demand: the session calls it only for a request whose store
is due this step (most decode steps, few are), so an engine that resolves tables lazily pays
for the few it needs. It is called with, per group, the first block a store may read (the
group's store cursor times `blocks_per_chunk`): the table may give the blocks before it as
null, so an engine reads only a long request's last few blocks."""


def _blocks_tuple(
    value: Iterable[GroupBlocks] | BlockTable,
) -> tuple[GroupBlocks, ...] | BlockTable:
    if callable(value):
        return value
    return tuple(value)


@attrs.frozen(kw_only=True)
class RunningRequest:
    """What the engine says of one running request at one step (input of `start_stores`)."""

    request_id: str = attrs.field(validator=attrs.validators.instance_of(str))
    """The engine's request id."""
    blocks: tuple[GroupBlocks, ...] | BlockTable = attrs.field(converter=_blocks_tuple)
    """The request's whole block table, one GroupBlocks per group (resent after preemption),
    or a `BlockTable` returning it, called at most once and only when a store is due (the
    blocks before the ones it is asked for are never read)."""
    num_computed_tokens: int = attrs.field(validator=at_least(0))
    """Tokens whose KV existed before this step."""
    num_scheduled_tokens: int = attrs.field(validator=at_least(0))
    """Tokens this step's forward pass computes."""
    num_tokens: int = attrs.field(validator=at_least(0))
    """The request's tokens so far (prompt and generated)."""
    block_hashes: Sequence[bytes]
    """The request's chained hash-block hashes so far (it only grows); read during the call,
    and only when its length changed since the session last saw it."""
    num_prompt_tokens: int | None = None
    """Prompt length; needed only when the session has not seen the request (else ignored)."""
    _table: list[tuple[GroupBlocks, ...]] = attrs.field(
        factory=list, init=False, eq=False, repr=False
    )

    def block_table(self, starts: tuple[int, ...]) -> tuple[GroupBlocks, ...]:
        """Return the block table, one GroupBlocks per group: a `BlockTable` is called once,
        with `starts` (per group, the first block a store may read)."""
        blocks = self.blocks
        if not callable(blocks):
            return blocks
        if not self._table:
            self._table.append(tuple(blocks(starts)))
        return self._table[0]


@attrs.frozen(kw_only=True)
class StoreStep:
    """The store jobs of one step."""

    jobs: tuple[BoundPlan, ...]
    """Store jobs to submit to every worker, after this step's forward pass is enqueued."""
    no_room: tuple[str, ...]
    """Requests whose new chunks found no room in the tier; they are tried again next step."""
    released: tuple[str, ...] = ()
    """Finished requests whose last store (see `OffloadSession.finish`) found no room again, or
    nothing left to store: no job will report them, and their GPU blocks may be reused now."""


@attrs.frozen(kw_only=True)
class RecomputeRange:
    """Tokens of a request that a failed load did not bring: the engine must compute them."""

    request_id: str
    """The request whose load failed."""
    start: int = attrs.field(validator=at_least(0))
    """First token to recompute (the request's `num_computed_tokens` when the load began)."""
    stop: int = attrs.field(validator=at_least(0))
    """One past the last token the load was to bring."""

    def __attrs_post_init__(self) -> None:
        if self.stop <= self.start:
            raise InvalidInputError(
                request=self.request_id,
                field="stop",
                expected=f"a token after start={self.start}",
                got=self.stop,
            )


@attrs.frozen(kw_only=True)
class CompletionReport:
    """What changed because workers reported results."""

    completed: tuple[int, ...] = ()
    """Jobs every worker has now reported, in the order they completed."""
    failed: tuple[int, ...] = ()
    """The jobs of `completed` that failed on at least one worker."""
    recompute: tuple[RecomputeRange, ...] = ()
    """Live requests whose load failed: tokens they must compute instead."""
    released: tuple[str, ...] = ()
    """Requests (finished or preempted) whose awaited jobs are now all complete: their GPU
    blocks may be reused."""


@attrs.define
class _Job:
    """A job in flight (mutable bookkeeping, private)."""

    job_id: int
    request_id: str
    direction: Direction
    keys: Sequence[OffloadKey]
    recompute: RecomputeRange | None = None
    cursor_before: tuple[int, ...] = ()
    """A load's request store cursors before it: a failed load puts them back."""
    reported: set[int] = attrs.field(factory=set)
    failed: bool = False


@attrs.define
class _Request:
    """What the session keeps of one request (mutable bookkeeping, private)."""

    _state: RequestState
    num_hashes: int = 0
    """How many block hashes `state` was keyed from (unchanged: no new key to derive)."""
    keyed_from: tuple[RequestState, int, bytes] | None = None
    """For the state it was read from: the index and value of the hash that ends the last
    keyed chunk of any group (-1 when no chunk is keyed), checked at every call."""
    jobs: set[int] = attrs.field(factory=set)
    fence: set[int] | None = None
    finished: bool = False
    seen: FoundRows | None = None
    """The rows the last lookup with a hit found, until the load that follows pins them."""
    store_at: int = -1
    """The fewest stored tokens at which a store is due for `state` (some group completes a
    chunk past its store cursor); -1 until `store_candidates` reads it for this state; 0 once
    the request is finished."""

    @property
    def state(self) -> RequestState:
        """Return the request's planning state."""
        return self._state

    @state.setter
    def state(self, state: RequestState) -> None:
        self._state = state
        self.store_at = 0 if self.finished else -1

    def finish(self) -> None:
        """Mark the request finished: `start_stores` refuses it from now on, so
        `store_candidates` always lists it."""
        self.finished = True
        self.store_at = 0


class _StepAnswer:
    """The tier's answers to one due store's planning, read with those of the whole step
    (`OffloadSession._step_answers`): a `StoreTierView` of that store's candidates only."""

    __slots__ = ("_keys", "_statuses")

    def __init__(self, keys: Sequence[OffloadKey], statuses: list[KeyStatus]) -> None:
        self._keys = keys
        self._statuses = statuses

    def statuses(self, keys: Sequence[OffloadKey]) -> list[KeyStatus]:
        """Return the statuses read for the store's candidates (the only keys asked)."""
        self._check_asked(keys)
        return self._statuses

    def can_reserve(self, keys: Sequence[OffloadKey]) -> bool:
        """Return True: the step's candidates all fit without evicting."""
        self._check_asked(keys)
        return True

    def _check_asked(self, keys: Sequence[OffloadKey]) -> None:
        if keys is not self._keys:
            raise PlanInvariantError(
                field="keys",
                expected="the candidates the step's answers were read for",
                got=keys,
            )


_T = TypeVar("_T")

_new_bound = unchecked_maker(BoundPlan)

_NEVER = np.iinfo(np.int64).max
"""A token count no request reaches."""


def _next_chunk_end(cursor: int, chunk_tokens: int) -> int:
    """Return the tokens at which a group whose store cursor is `cursor` completes its next
    chunk: `done // chunk_tokens > cursor` exactly when `done` reaches it."""
    return (cursor + 1) * chunk_tokens


def _listed(values: Iterable[_T], kind: type[_T], field: str) -> list[_T]:
    """Return `values` as a list, or raise InvalidInputError unless it is an iterable of
    `kind` values."""
    try:
        listed = list(values)
    except TypeError:
        raise InvalidInputError(
            field=field, expected=f"an iterable of {kind.__name__}", got=values
        ) from None
    for value in listed:
        if not isinstance(value, kind):
            raise InvalidInputError(field=field, expected=f"{kind.__name__} values", got=value)
    return listed


def _check_distinct(request_id: str, keys: Sequence[OffloadKey]) -> None:
    """Raise InvalidInputError when a key repeats among a store's keys: the request's hashes
    repeat (chained hashes never do), and the tier would give the key one row, not two."""
    if len(set(keys)) == len(keys):
        return
    seen: set[OffloadKey] = set()
    for key in keys:
        if key in seen:
            raise InvalidInputError(
                request=request_id,
                group=key.group,
                field="block_hashes",
                expected="hashes that do not repeat (chained hashes never do)",
                got=key.block_hash.hex(),
            )
        seen.add(key)


class LowerTier(Protocol):
    """A tier below the CPU tier (e.g. `kvferry.adapters.shared_tier.SharedTier`): what the
    session tells it. Its calls run under the session's lock and must not call the session."""

    def view(self, above: KeyStatusView) -> KeyStatusView:
        """Return the view lookups read: `above` (the CPU tier's) with this tier's keys."""
        ...

    def stored(self, keys: Sequence[OffloadKey]) -> None:
        """Hear that a store made `keys` ready in the CPU tier."""
        ...

    def evicting(self, keys: Sequence[OffloadKey], rows: IdArray) -> None:
        """Hear that `keys` were evicted from `rows`, whose bytes a store will overwrite once
        the call returns (copy them now or never)."""
        ...


class OffloadSession:
    """The scheduler side of kvferry for one engine: requests, jobs and the CPU-tier catalog.

    Call order per request (docs/session.md): `lookup` (again each step while it answers
    retry), `start_load` after the engine allocated blocks, `start_stores` every step for all
    running requests, `report` whenever workers deliver results, and `finish` (or `preempt`)
    with the job ids to wait for before the request's GPU blocks are reused.

    Safe for an engine's threads: every public call holds one re-entrant lock, shared with
    the catalog (the catalog's own when it came with one), so calls never interleave.
    """

    def __init__(
        self,
        config: OffloadConfig,
        catalog: Catalog,
        *,
        world_size: int = 1,
        layout_fingerprint: str | None = None,
    ) -> None:
        if not isinstance(config, OffloadConfig):
            raise InvalidInputError(field="config", expected="an OffloadConfig", got=config)
        if not isinstance(catalog, Catalog):
            raise InvalidInputError(field="catalog", expected="a Catalog", got=catalog)
        if catalog.config.least_rows < 1:  # a group of 0 rows could never store a chunk
            raise InvalidInputError(
                field="capacity_rows",
                expected="a CPU tier of >= 1 row for each group",
                got=catalog.capacity_rows,
            )
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise InvalidInputError(field="world_size", expected="an integer >= 1", got=world_size)
        self._lock: Lock | None = threading.RLock() if catalog.lock is None else catalog.lock
        """Held by every public call, and shared with the catalog (one lock: no ordering)."""
        catalog.use_lock(self._lock)
        self._config = config
        self._catalog = catalog
        self._world_size = world_size
        self._fingerprint = layout_fingerprint
        self._lower: LowerTier | None = None
        self._requests: dict[str, _Request] = {}
        self._jobs: dict[int, _Job] = {}
        self._next_job = 1
        self._first_live_job = 1
        self._last_stores: list[BoundPlan] = []
        """Stores planned by `finish`, handed out by the next `start_stores`."""
        self._last_retries: dict[int, RunningRequest] = {}
        """Last stores `finish` found no room for, by the job id reserved for them: offered
        once more by the next `start_stores`."""

    # -- reading -------------------------------------------------------------------------------

    @property
    def config(self) -> OffloadConfig:
        """Return the planner configuration."""
        return self._config

    @property
    def catalog(self) -> Catalog:
        """Return the CPU-tier catalog (read it; change it only through the session)."""
        return self._catalog

    @property
    def world_size(self) -> int:
        """Return how many workers must report a job before it is complete."""
        return self._world_size

    @locked_method
    def in_flight(self) -> frozenset[int]:
        """Return the ids of the jobs not yet reported by every worker."""
        return frozenset(self._jobs)

    @locked_method
    def jobs_of(self, request_id: str) -> frozenset[int]:
        """Return the ids of `request_id`'s jobs in flight (empty for an unknown request)."""
        request = self._requests.get(request_id)
        return frozenset(request.jobs) if request else frozenset()

    @locked_method
    def request_state(self, request_id: str) -> RequestState | None:
        """Return the planning state of `request_id`, or None when the session has none."""
        request = self._requests.get(request_id)
        return request.state if request else None

    @locked_method
    def counters(self) -> CatalogCounters:
        """Return the catalog's counters."""
        return self._catalog.counters()

    @locked_method
    def drain_events(self) -> tuple[CatalogEvent, ...]:
        """Return and forget the catalog's stored/removed events (see CatalogConfig)."""
        return self._catalog.drain_events()

    @locked_method
    def attach_lower_tier(self, tier: LowerTier) -> None:
        """Put `tier` below the CPU tier: lookups read its view, and it hears of stores and
        evictions (docs/semantics.md, "The shared tier")."""
        self._lower = tier

    # -- the calls of a request's life --------------------------------------------------------

    @locked_method
    def lookup(
        self,
        request_id: str,
        *,
        block_hashes: Sequence[bytes],
        num_tokens: int,
        num_computed_tokens: int,
        num_prompt_tokens: int | None = None,
        store_loaded: bool = False,
    ) -> LookupResult:
        """Return how many tokens past `num_computed_tokens` the tier can supply, or retry.

        Idempotent: asking again (next step) reads the tier again and changes nothing but the
        request's known keys. Keys that a load in flight is reading answer *pending*, so a
        second request with the same prefix retries until the first has put the blocks on the
        GPU (where the engine's prefix cache then finds them). `num_prompt_tokens` (default
        `num_tokens`) and `store_loaded` are read when the request is first seen.
        """
        known = self._requests.get(request_id)
        before = None if known is None else (known.state, known.num_hashes)
        check_hash_count(self._config, request_id, len(block_hashes), num_tokens)
        request = self._known(
            request_id,
            block_hashes,
            num_prompt_tokens=num_tokens if num_prompt_tokens is None else num_prompt_tokens,
            store_loaded=store_loaded,
            call="lookup",
        )
        seen = FoundRows()  # the rows found, for the load that follows (`start_load`)
        view: KeyStatusView = self._catalog.view(pinned_as_pending=True, seen=seen)
        if self._lower is not None:
            view = self._lower.view(view)
        try:
            result = lookup(
                self._config,
                request.state,
                num_tokens=num_tokens,
                num_computed_tokens=num_computed_tokens,
                tier=view,
            )
            request.seen = seen if result.tokens else None
            return result
        except KvferryError:  # a refused lookup leaves the request as it was (or unknown)
            if before is None:
                del self._requests[request_id]
            else:
                request.state, request.num_hashes = before
            raise

    @locked_method
    def start_load(
        self,
        request_id: str,
        blocks: Sequence[GroupBlocks],
        *,
        num_computed_tokens: int,
        hit_tokens: int,
    ) -> BoundPlan | None:
        """Return the load job for `hit_tokens` accepted after a lookup, or None (nothing to
        move); its keys are pinned until the job completes.

        Call it in the same scheduling step as the lookup that found the tokens (stores of
        that step may evict what was found). Raise PlanInvariantError, changing nothing, when a
        key is no longer readable.
        """
        request = self._live(request_id, "start_load")
        seen = request.seen
        if hit_tokens == 0:
            request.seen = None
            return None
        plan, state = plan_load(
            self._config,
            request.state,
            blocks,
            num_computed_tokens=num_computed_tokens,
            hit_tokens=hit_tokens,
        )
        if plan.is_empty:
            request.state, request.seen = state, None
            return None
        keys = plan.keys  # a KeyColumn: the catalog pins it by its columns, no key made
        rows = self._catalog.pin(keys, request=request_id, seen=seen)
        request.seen = None
        cursor_before = request.state.store_cursor
        request.state = state
        job = self._new_job(request_id, request, Direction.LOAD, keys)
        job.cursor_before = cursor_before
        job.recompute = RecomputeRange(
            request_id=request_id,
            start=num_computed_tokens,
            stop=num_computed_tokens + hit_tokens,
        )
        return BoundPlan(
            job_id=job.job_id, plan=plan, cpu_rows=rows, layout_fingerprint=self._fingerprint
        )

    @locked_method
    def store_candidates(
        self,
        request_ids: Sequence[str],
        *,
        num_computed_tokens: Sequence[int],
        num_scheduled_tokens: Sequence[int],
        num_tokens: Sequence[int] | None = None,
    ) -> list[int]:
        """Return the positions, in `request_ids` (this step's running requests, with their
        token counts at the same positions), of those `start_stores` must be given: every
        request whose store is due (some group completes a chunk past its store cursor, the
        rule of `due_for_store`), and every request the session has not seen or has finished
        (`start_stores` creates or refuses it). Without `num_tokens` (which caps what a step
        stores only when it schedules tokens not yet sampled, as speculative decoding does),
        the answer may list a few more, for which `start_stores` plans nothing.

        For any other request `start_stores` plans nothing and changes nothing that a later
        step does not redo, so an engine may leave it out, and build only the inputs of the
        few requests due at a decode step. Each known request's threshold is kept until its
        state changes; the thresholds are compared with the token counts in one numpy pass.
        """
        requests = list(map(self._requests.get, request_ids))
        store_at = [0 if request is None else request.store_at for request in requests]
        if store_at and min(store_at) < 0:  # some state changed since its threshold was read
            for index, (at, request) in enumerate(zip(store_at, requests, strict=True)):
                if at < 0 and request is not None:
                    store_at[index] = self._store_at(request)
        done = np.asarray(num_computed_tokens, dtype=np.int64) + np.asarray(
            num_scheduled_tokens, dtype=np.int64
        )
        if num_tokens is not None:
            np.minimum(done, np.asarray(num_tokens, dtype=np.int64), out=done)
        picked: list[int] = np.flatnonzero(done >= store_at).tolist()
        return picked

    def _store_at(self, request: _Request) -> int:
        """Return (and keep until its state changes) the fewest tokens, as `done` of
        `stored_tokens_after_step`, at which a store of `request` is due."""
        state = request.state
        at = min(map(_next_chunk_end, state.store_cursor, self._config.all_chunk_tokens))
        if not self._config.store_decoded_tokens and state.num_prompt_tokens < at:
            at = _NEVER  # `done` is capped at the prompt, which ends before that chunk
        request.store_at = at
        return at

    @locked_method
    def start_stores(self, requests: Iterable[RunningRequest]) -> StoreStep:
        """Return this step's store jobs for the running `requests` (rows reserved, keys
        writing), and the requests that found no room.

        Call it every step after scheduling, for every running request. A refused step
        (a request finished, listed twice, with hashes that repeat, or inputs the planner
        rejects) raises and changes nothing: every request's inputs are checked before the
        first row is reserved, so no key is evicted, no row left writing, no job id used.
        """
        running_list = _listed(requests, RunningRequest, "requests")
        jobs: list[BoundPlan] = []
        no_room: list[str] = []
        undo: list[tuple[_Request, RequestState, int]] = []
        created: list[str] = []
        first_job = self._next_job
        try:
            known: list[_Request] = []
            listed: set[str] = set()
            for running in running_list:
                rid = running.request_id
                if rid in listed:
                    raise InvalidInputError(
                        request=rid,
                        field="requests",
                        expected="each running request once a step",
                        got=f"{rid!r} twice",
                    )
                listed.add(rid)
                request = self._requests.get(rid)
                if request is None:
                    created.append(rid)
                else:
                    undo.append((request, request.state, request.num_hashes))
                known.append(self._known_running(running))
            due = due_for_store(  # one pass for all: most decode steps complete no chunk
                self._config,
                [request.state for request in known],
                num_computed_tokens=[r.num_computed_tokens for r in running_list],
                num_scheduled_tokens=[r.num_scheduled_tokens for r in running_list],
                num_tokens=[r.num_tokens for r in running_list],
            )
            due_list = due.tolist()
            # Every due request's inputs are checked before the first row is reserved.
            checked = [self._check_store(running_list[i], known[i]) for i in due_list]
            answers = self._step_answers(checked)
            if answers is None:  # keys shared, or a store may evict: one after the other
                for index, candidates in zip(due_list, checked, strict=True):
                    self._store_one(running_list[index], known[index], candidates, jobs, no_room)
            else:
                self._store_together(
                    [(running_list[i], known[i]) for i in due_list], checked, answers, jobs
                )
        except BaseException:
            for job in jobs:
                self._catalog.complete_store(self._jobs[job.job_id].keys, success=False)
                self._forget_job(job.job_id)
            self._next_job = first_job
            for request, state, num_hashes in reversed(undo):
                request.state, request.num_hashes = state, num_hashes
            for rid in created:
                self._requests.pop(rid, None)
            raise
        jobs += self._last_stores
        self._last_stores = []
        released: list[str] = []
        for job_id, last in sorted(self._last_retries.items()):
            held = self._jobs[job_id]
            request = self._requests[held.request_id]
            decision, candidates = self._decide_store(last, request)
            if decision.plan is None:  # still no room, or nothing left: give up the last store
                self._complete(held, released)
            else:
                jobs.append(self._bind_store(request, decision, candidates.positions, held))
                request.state = decision.state
        self._last_retries.clear()
        return StoreStep(jobs=tuple(jobs), no_room=tuple(no_room), released=tuple(released))

    def _check_store(self, running: RunningRequest, request: _Request) -> StoreCandidates:
        """Return the candidates of `running`'s store; raise what planning it would raise,
        reserving nothing."""
        candidates = check_store_inputs(
            self._config,
            request.state,
            self._store_blocks(running, request),
            num_computed_tokens=running.num_computed_tokens,
            num_scheduled_tokens=running.num_scheduled_tokens,
            num_tokens=running.num_tokens,
        )
        _check_distinct(running.request_id, candidates.keys)
        return candidates

    def _store_blocks(self, running: RunningRequest, request: _Request) -> tuple[GroupBlocks, ...]:
        """Return `running`'s block table as a store of `request` reads it: from each group's
        store cursor on (blocks before it are never read)."""
        f = self._config.blocks_per_chunk
        return running.block_table(tuple(cursor * f for cursor in request.state.store_cursor))

    def _known_running(self, running: RunningRequest) -> _Request:
        """Return the session's record of a running request, created or with its keys
        extended to the request's hashes."""
        check_hash_count(
            self._config, running.request_id, len(running.block_hashes), running.num_tokens
        )
        return self._known(
            running.request_id,
            running.block_hashes,
            num_prompt_tokens=(
                running.num_tokens
                if running.num_prompt_tokens is None
                else running.num_prompt_tokens
            ),
            store_loaded=False,
            call="start_stores",
        )

    def _store_one(
        self,
        running: RunningRequest,
        request: _Request,
        candidates: StoreCandidates,
        jobs: list[BoundPlan],
        no_room: list[str],
    ) -> None:
        """Plan and bind the store of one running request that is due, from its checked
        `candidates` (appending to `jobs`/`no_room`)."""
        decision = self._plan_checked(running, request, candidates)
        if decision.outcome is StoreOutcome.NO_ROOM:
            no_room.append(running.request_id)
        elif decision.plan is not None:
            jobs.append(self._bind_store(request, decision, candidates.positions))
        request.state = decision.state

    def _step_answers(self, checked: Sequence[StoreCandidates]) -> list[_StepAnswer] | None:
        """Return, per due store of this step, the tier's answers to its planning, read once
        for the whole step; or None when they could differ from what planning the stores one
        after the other reads (then the caller does that).

        They cannot differ when no key repeats across the step's candidates and each group
        has free rows for all of them: no reservation then evicts, or takes a key a later
        store asks about, so every store finds the statuses read before the first, and room."""
        if len(checked) < 2:
            return None
        per_group: dict[int, list[bytes]] = {}
        for candidates in checked:
            for group, block_hash in candidates.keys:
                per_group.setdefault(group, []).append(block_hash)
        catalog = self._catalog
        found: dict[int, Iterator[KeyStatus]] = {}
        for group, hashes in per_group.items():
            if len(hashes) > catalog.free_rows(group) or len(set(hashes)) != len(hashes):
                return None
            found[group] = iter(catalog.hash_statuses(group, hashes))
        return [
            _StepAnswer(candidates.keys, [next(found[group]) for group, _ in candidates.keys])
            for candidates in checked
        ]

    def _store_together(
        self,
        due: Sequence[tuple[RunningRequest, _Request]],
        checked: Sequence[StoreCandidates],
        answers: Sequence[_StepAnswer],
        jobs: list[BoundPlan],
    ) -> None:
        """Plan and bind the stores of this step's `due` requests from their checked
        candidates and the `answers` read for them all (`_step_answers`), reserving their rows
        in one call (appending to `jobs`); none finds no room."""
        decisions = [
            self._plan_checked(running, request, candidates, tier=answer)
            for (running, request), candidates, answer in zip(due, checked, answers, strict=True)
        ]
        storing = [
            (request, decision, candidates)
            for (_, request), decision, candidates in zip(due, decisions, checked, strict=True)
            if decision.plan is not None
        ]
        reservations = self._catalog.reserve_each(
            [
                StoreAsk(decision.reserve_keys, candidates.positions, decision.state.request_id)
                for _, decision, candidates in storing
            ]
        )
        bound = 0
        try:
            for (request, decision, _), reservation in zip(storing, reservations, strict=True):
                jobs.append(self._bind_reserved(request, decision, reservation))
                bound += 1
        except BaseException:
            for reservation in reservations[bound + 1 :]:  # rows no job holds yet
                if reservation is not None:
                    self._catalog.complete_store(reservation.keys, success=False)
            raise
        for (_, request), decision in zip(due, decisions, strict=True):
            request.state = decision.state

    def _decide_store(
        self, running: RunningRequest, request: _Request
    ) -> tuple[StoreDecision, StoreCandidates]:
        """Return the planner's store decision for one step of `running`, and its candidates."""
        candidates = self._check_store(running, request)
        return self._plan_checked(running, request, candidates), candidates

    def _plan_checked(
        self,
        running: RunningRequest,
        request: _Request,
        candidates: StoreCandidates,
        *,
        tier: StoreTierView | None = None,
    ) -> StoreDecision:
        """Return the planner's store decision for `running` from its checked `candidates`,
        reading `tier` (default: the catalog)."""
        return plan_checked_store(
            self._config,
            request.state,
            self._store_blocks(running, request),
            candidates,
            tier=self._catalog if tier is None else tier,
        )

    def _bind_store(
        self,
        request: _Request,
        decision: StoreDecision,
        positions: Sequence[int],
        job: _Job | None = None,
    ) -> BoundPlan:
        """Return the store job of a decision with a plan: its rows reserved, its keys writing,
        under a new job id or the one `job` holds for it. `positions` are the token positions
        where the chunks of the decision's `reserve_keys` end (`StoreCandidates.positions`);
        the keys were checked not to repeat."""
        rid = decision.state.request_id
        reservation = self._catalog.reserve(decision.reserve_keys, positions=positions, request=rid)
        return self._bind_reserved(request, decision, reservation, job)

    def _bind_reserved(
        self,
        request: _Request,
        decision: StoreDecision,
        reservation: Reservation | None,
        job: _Job | None = None,
    ) -> BoundPlan:
        """Return `_bind_store`'s job once the decision's `reserve_keys` got `reservation`."""
        plan = decision.plan
        if plan is None:
            raise PlanInvariantError(
                request=decision.state.request_id,
                field="plan",
                expected="a store decision with a plan",
                got=decision.outcome,
            )
        rid = plan.request_id
        if reservation is not None and reservation.evicted and self._lower is not None:
            self._lower.evicting(reservation.evicted, reservation.evicted_rows)
        if reservation is None or reservation.keys != plan.keys:
            if reservation is not None:  # never with distinct keys; give the rows back
                self._catalog.complete_store(reservation.keys, success=False)
            raise PlanInvariantError(
                request=rid,
                field="keys",
                expected="a reservation of exactly the store plan's keys",
                got=None if reservation is None else reservation.keys,
            )
        if job is None:
            job = self._new_job(rid, request, Direction.STORE, reservation.keys)
        else:
            job.keys = reservation.keys
        # A new job id, and one row (int64, read-only) per plan key: BoundPlan's checks hold.
        return _new_bound(
            job_id=job.job_id,
            plan=plan,
            cpu_rows=reservation.rows,
            layout_fingerprint=self._fingerprint,
        )

    @locked_method
    def report(self, worker: int, results: Iterable[JobResult]) -> CompletionReport:
        """Record `worker`'s results; return what completed (every worker reported) and what
        follows from it.

        A job succeeds only if it succeeded on every worker. A completed store makes its keys
        ready, or forgets them when it failed; a completed load unpins its keys, and a failed
        one names the tokens its request must recompute (unless the request was finished or
        preempted since). Results of jobs from before a `reset` are ignored. Raise
        InvalidInputError, changing nothing, for a worker out of range, results that are not
        JobResults, a job never issued (ids start at 1: 0 and below never are), or a result a
        worker already gave.
        """
        if isinstance(worker, bool) or not isinstance(worker, int):
            raise InvalidInputError(field="worker", expected="an integer", got=worker)
        if not 0 <= worker < self._world_size:
            raise InvalidInputError(
                field="worker", expected=f"a worker in [0, {self._world_size})", got=worker
            )
        results = _listed(results, JobResult, "results")
        live = []
        seen: set[int] = set()
        for result in results:
            job_id = result.job_id
            if 1 <= job_id < self._first_live_job:  # issued before a reset: abandoned
                continue
            job = self._jobs.get(job_id)
            if job is None or worker in job.reported or job_id in seen:
                issued = 1 <= job_id < self._next_job  # job ids start at 1
                raise InvalidInputError(
                    field="job_id",
                    expected=f"a job in flight not yet reported by worker {worker}",
                    got=job_id if issued else f"{job_id} (never issued)",
                )
            seen.add(job_id)
            live.append((job, result.success))
        completed: list[int] = []
        failed: list[int] = []
        recompute: list[RecomputeRange] = []
        released: list[str] = []
        for job, success in live:
            job.reported.add(worker)
            job.failed = job.failed or not success
            if len(job.reported) < self._world_size:
                continue
            completed.append(job.job_id)
            if job.failed:
                failed.append(job.job_id)
            redo = self._complete(job, released)
            if redo is not None:
                recompute.append(redo)
        return CompletionReport(
            completed=tuple(completed),
            failed=tuple(failed),
            recompute=tuple(recompute),
            released=tuple(released),
        )

    @locked_method
    def finish(self, request_id: str, *, last: RunningRequest | None = None) -> frozenset[int]:
        """Return the jobs that must complete before the finished (or aborted) request's GPU
        blocks may be reused: its stores read them, its loads write them. Empty: reuse now.

        With `last` (the request's final block table, `num_computed_tokens` = the tokens whose
        KV exists, `num_scheduled_tokens` = 0, its `num_tokens` and hashes), the request's
        chunks not stored yet — completed by its last step, or refused earlier for lack of
        room — are offered once more: planned now, or, when the tier has no room now, once more
        by the next `start_stores` (which drops them if there is still none). Either way the
        store's job id is among those returned; the job itself comes with the next
        `start_stores`, or that call lists the request in `StoreStep.released` when nothing
        was stored. The request is forgotten once those jobs complete (`report` then lists it
        as released); a failed load of a finished request asks for no recompute. Unknown ids
        answer empty. Raise InvalidInputError, changing nothing, for a `last` of another
        request or one the planner refuses.
        """
        request = self._requests.get(request_id)
        if request is None:
            return frozenset()
        if last is not None and not request.finished:
            self._last_store(request_id, request, last)
        request.finish()
        waiting = self._fence(request)
        if not request.jobs:
            del self._requests[request_id]
        return waiting

    def _last_store(self, request_id: str, request: _Request, last: RunningRequest) -> None:
        """Plan the store of a finishing request's chunks not stored yet (see `finish`)."""
        if not isinstance(last, RunningRequest) or last.request_id != request_id:
            raise InvalidInputError(
                request=request_id,
                field="last",
                expected=f"a RunningRequest of request {request_id!r}",
                got=last,
            )
        check_hash_count(self._config, request_id, len(last.block_hashes), last.num_tokens)
        before = (request.state, request.num_hashes)
        if len(last.block_hashes) != request.num_hashes:
            request.state = extend_keys(self._config, request.state, last.block_hashes)
            request.num_hashes = len(last.block_hashes)
        try:
            decision, candidates = self._decide_store(last, request)
        except KvferryError:
            request.state, request.num_hashes = before
            raise
        if decision.outcome is StoreOutcome.NO_ROOM:
            job = self._new_job(request_id, request, Direction.STORE, ())
            self._last_retries[job.job_id] = last
        elif decision.plan is not None:
            self._last_stores.append(self._bind_store(request, decision, candidates.positions))
        request.state = decision.state

    @locked_method
    def preempt(self, request_id: str) -> frozenset[int]:
        """Return the jobs that must complete before the preempted request's GPU blocks may be
        reused (as for `finish`); the request stays known.

        Its loads in flight will ask for no recompute (the engine recomputes a preempted request
        anyway), and its store cursor goes back to the start, so chunks evicted meanwhile are
        stored again from the blocks the engine will resend (present ones are skipped).
        """
        request = self._live(request_id, "preempt")
        request.state = attrs.evolve(
            request.state, store_cursor=tuple(0 for _ in request.state.store_cursor)
        )
        return self._fence(request)

    @locked_method
    def reset(self) -> frozenset[int]:
        """Forget every request, job and key (the catalog is emptied); return the jobs that were
        in flight, whose results will be ignored. Wait for them on the workers before reusing
        their GPU blocks or CPU rows."""
        abandoned = frozenset(self._jobs)
        self._catalog.reset()
        self._jobs.clear()
        self._requests.clear()
        self._last_stores.clear()
        self._last_retries.clear()
        self._first_live_job = self._next_job
        return abandoned

    # -- private -------------------------------------------------------------------------------

    def _known(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        *,
        num_prompt_tokens: int,
        store_loaded: bool,
        call: str,
    ) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            if not isinstance(request_id, str):
                raise InvalidInputError(field="request_id", expected="a string", got=request_id)
            state = new_request_state(
                self._config,
                request_id,
                num_prompt_tokens=num_prompt_tokens,
                block_hashes=block_hashes,
                store_loaded=store_loaded,
            )
            request = self._requests[request_id] = _Request(
                state=state, num_hashes=len(block_hashes)
            )
            return request
        if request.finished:
            raise self._finished_error(request_id, call)
        if len(block_hashes) != request.num_hashes:
            request.state = extend_keys(self._config, request.state, block_hashes)
            request.num_hashes = len(block_hashes)
        else:
            self._check_keyed_from(request, block_hashes)
        return request

    def _check_keyed_from(self, request: _Request, block_hashes: Sequence[bytes]) -> None:
        """Raise InvalidInputError unless `block_hashes` (as long as before) still holds the
        hash that ends the request's last keyed chunk. Hashes are chained, so one hash vouches
        for the whole keyed prefix: a live request id reused for another prompt of the same
        length, or a list rewritten in place, is refused before its pages are stored under the
        other prompt's keys."""
        keyed = request.keyed_from
        if keyed is None or keyed[0] is not request.state:
            index, last = -1, b""
            for group, keys in enumerate(request.state.keys):
                end = len(keys) * self._config.hashes_per_chunk(group) - 1
                if keys and end > index:
                    index, last = end, keys[-1].block_hash
            keyed = request.keyed_from = (request.state, index, last)
        _, index, last = keyed
        if type(block_hashes) not in (list, tuple) and (
            not isinstance(block_hashes, Sequence) or isinstance(block_hashes, (str, bytes))
        ):
            raise InvalidInputError(
                request=request.state.request_id,
                field="block_hashes",
                expected="a sequence of bytes (one hash per full hash block)",
                got=block_hashes,
            )
        if index >= 0 and block_hashes[index] != last:
            raise InvalidInputError(
                request=request.state.request_id,
                field="block_hashes",
                expected=(
                    f"the hashes the request was keyed with (hash {index} = {last.hex()}); "
                    "a request id reused for another prompt is refused"
                ),
                got=block_hashes[index],
            )

    def _live(self, request_id: str, call: str) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise InvalidInputError(
                request=request_id,
                field="request_id",
                expected=f"a request the session knows (lookup before {call})",
                got=request_id,
            )
        if request.finished:
            raise self._finished_error(request_id, call)
        return request

    @staticmethod
    def _finished_error(request_id: str, call: str) -> InvalidInputError:
        return InvalidInputError(
            request=request_id,
            field="request_id",
            expected=f"a request not finished (called {call})",
            got="a finished request",
        )

    def _new_job(
        self,
        request_id: str,
        request: _Request,
        direction: Direction,
        keys: Sequence[OffloadKey],
    ) -> _Job:
        job = _Job(job_id=self._next_job, request_id=request_id, direction=direction, keys=keys)
        self._next_job += 1
        self._jobs[job.job_id] = job
        request.jobs.add(job.job_id)
        return job

    def _fence(self, request: _Request) -> frozenset[int]:
        for job_id in request.jobs:
            self._jobs[job_id].recompute = None
        if not request.jobs:
            return frozenset()
        request.fence = (request.fence or set()) | request.jobs
        return frozenset(request.fence)

    def _forget_job(self, job_id: int) -> None:
        job = self._jobs.pop(job_id)
        self._requests[job.request_id].jobs.discard(job_id)

    def _complete(self, job: _Job, released: list[str]) -> RecomputeRange | None:
        del self._jobs[job.job_id]
        success = not job.failed
        if job.direction is Direction.STORE:
            if job.keys:  # a last store given up before it was planned has none
                self._catalog.complete_store(job.keys, success=success)
                if success and self._lower is not None:
                    self._lower.stored(job.keys)
        else:
            self._catalog.unpin(job.keys)
            if not success:  # the rows may hold bad bytes: never hand them out again
                self._catalog.discard(job.keys)
        request = self._requests[job.request_id]
        request.jobs.discard(job.job_id)
        if not success and job.recompute is not None:
            # The request recomputes what the load did not bring: store those chunks again
            # (the tier just dropped them).
            cursors = zip(request.state.store_cursor, job.cursor_before, strict=True)
            request.state = attrs.evolve(
                request.state, store_cursor=tuple(min(now, before) for now, before in cursors)
            )
        if request.fence is not None:
            request.fence.discard(job.job_id)
            if not request.fence:
                request.fence = None
                released.append(job.request_id)
        if request.finished and not request.jobs:
            del self._requests[job.request_id]
        return None if success else job.recompute
