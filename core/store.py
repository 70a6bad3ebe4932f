"""Store planning: which newly completed chunks to copy to the CPU tier, from which GPU blocks.

Pure: the tier is asked (read-only) which keys it has and whether the rest fit; the caller
reserves the rows afterwards, with the decision's `reserve_keys` (the plan's keys are among them).
"""

from __future__ import annotations

import enum
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from kvferry.core.arrays import FlagArray, IdArray, is_integral
from kvferry.core.blocks import GroupBlocks
from kvferry.core.checks import check_count, unchecked_evolver, unchecked_maker
from kvferry.core.config import OffloadConfig
from kvferry.core.errors import InvalidInputError
from kvferry.core.keys import KeyColumn, KeyStatus, KeyStatusView, OffloadKey
from kvferry.core.load import check_block_lists
from kvferry.core.plan import Direction, TransferPlan
from kvferry.core.state import RequestState


class StoreTierView(KeyStatusView, Protocol):
    """A read-only view of the CPU tier that can also say whether a reservation would fit."""

    def can_reserve(self, keys: Sequence[OffloadKey]) -> bool:
        """Return True when every key of `keys` not yet in the tier can get a row, evicting
        only keys outside `keys` (the all-or-nothing rule of a reservation)."""
        ...


class StoreOutcome(enum.Enum):
    """What a store-planning call decided."""

    STORE = "store"
    """A plan to run; the store cursors moved."""
    NOTHING = "nothing"
    """No new chunk needs storing (none completed, or the tier has them all); cursors moved."""
    NO_ROOM = "no_room"
    """The tier cannot take the new chunks now; cursors unchanged, so the next step retries."""


@attrs.frozen(kw_only=True)
class StoreDecision:
    """The result of `plan_store`: what to do, the plan if any, and the next state."""

    outcome: StoreOutcome
    """Whether to store, and if not, why."""
    plan: TransferPlan | None
    """The store plan when `outcome` is STORE, else None."""
    state: RequestState
    """The request's planning state after this decision."""
    reserve_keys: tuple[OffloadKey, ...] = ()
    """With a plan: the keys to hand to the tier's reservation — the plan's keys and the
    candidates the tier already has, which the reservation must not evict to make room (the
    same keys `can_reserve` was asked about). Empty without a plan."""

    def __attrs_post_init__(self) -> None:
        if (self.plan is None) == (self.outcome is StoreOutcome.STORE):
            raise InvalidInputError(
                request=self.state.request_id,
                field="plan",
                expected="a plan exactly when the outcome is STORE",
                got=(self.outcome, self.plan),
            )


def _stored_tokens(
    minimum: Callable[[Any, Any], Any],
    config: OffloadConfig,
    *,
    prompt: Any,
    computed: Any,
    scheduled: Any,
    num_tokens: Any,
) -> Any:
    """Return `done`, the tokens a step may store: the one definition, for one request
    (integers, `min`) or for many (arrays with one entry per request, `np.minimum`)."""
    limit = num_tokens if config.store_decoded_tokens else minimum(num_tokens, prompt)
    return minimum(computed + scheduled, limit)


def _completes_chunk(config: OffloadConfig, cursors: IdArray, done: IdArray) -> FlagArray:
    """Return, per request (a row of `cursors`, an entry of `done`), whether some group
    completes a chunk past its store cursor by `done` tokens: the one definition of *due*.

    One pass per group (a column of `cursors`), OR-ed: a few times faster than a 2-D pass and
    `any(axis=1)` for a few hundred requests."""
    first, *rest = config.all_chunk_tokens
    due: FlagArray = done // first > cursors[:, 0]
    for group, chunk in enumerate(rest, start=1):
        due |= done // chunk > cursors[:, group]
    return due


def stored_tokens_after_step(
    config: OffloadConfig,
    state: RequestState,
    *,
    num_computed_tokens: int,
    num_scheduled_tokens: int,
    num_tokens: int,
) -> int:
    """Return `done`: the tokens whose KV exists once this step's forward pass ends and that
    may be stored (capped at the prompt when decoded tokens are not stored)."""
    done: int = _stored_tokens(
        min,
        config,
        prompt=state.num_prompt_tokens,
        computed=num_computed_tokens,
        scheduled=num_scheduled_tokens,
        num_tokens=num_tokens,
    )
    return done


def store_due(config: OffloadConfig, state: RequestState, done: int) -> bool:
    """Return True when some group may complete a chunk past its store cursor by `done` tokens.

    The rule of `due_for_store` for one request; a caller planning many requests per step
    calls that instead, once, for all of them. `plan_store` answers NOTHING, with the state
    unchanged, whenever this is False.
    """
    state.check_matches(config)
    cursors = np.array([state.store_cursor], dtype=np.int64)
    return bool(_completes_chunk(config, cursors, np.array([done], dtype=np.int64))[0])


_MISS = KeyStatus.MISS
_CURSORS = operator.attrgetter("store_cursor")
_PROMPTS = operator.attrgetter("num_prompt_tokens")


def _token_column(values: npt.ArrayLike, states: Sequence[RequestState], field: str) -> IdArray:
    """Return `values` as int64, one entry per state; raise InvalidInputError naming the field
    (and the request, for a negative entry) unless they are that many integers >= 0."""
    column = np.asarray(values)
    if column.shape != (len(states),) or not is_integral(column):
        raise InvalidInputError(
            field=field,
            expected=f"{len(states)} integers, one per request",
            got=f"shape {column.shape}, dtype {column.dtype}",
        )
    if len(column) and column.min() < 0:
        index = int(np.argmin(column))
        raise InvalidInputError(
            request=states[index].request_id,
            field=field,
            expected="an integer >= 0",
            got=int(column[index]),
        )
    as_ids: IdArray = column.astype(np.int64, copy=False)
    return as_ids


def due_for_store(
    config: OffloadConfig,
    states: Sequence[RequestState],
    *,
    num_computed_tokens: npt.ArrayLike,
    num_scheduled_tokens: npt.ArrayLike,
    num_tokens: npt.ArrayLike,
) -> IdArray:
    """Return the indices, ascending, of the `states` that are due for `plan_store` this step.

    The per-step form of `store_due` for every running request at once (columnar: one
    numpy pass, no Python loop per request beyond reading the cursors): entry `i` of each
    token count belongs to `states[i]`. A request is due when some group completes a chunk
    past its store cursor by `done` tokens; `plan_store` answers NOTHING, with the state
    unchanged, for every request not returned, so the caller plans only these.
    """
    computed = _token_column(num_computed_tokens, states, "num_computed_tokens")
    scheduled = _token_column(num_scheduled_tokens, states, "num_scheduled_tokens")
    tokens = _token_column(num_tokens, states, "num_tokens")
    cursors = list(map(_CURSORS, states))
    if set(map(len, cursors)) - {config.num_groups}:
        for state in states:
            state.check_matches(config)
    n_groups = config.num_groups
    cursor_table = np.fromiter(
        itertools.chain.from_iterable(cursors), dtype=np.int64, count=len(states) * n_groups
    ).reshape(len(states), n_groups)
    prompts = (
        None
        if config.store_decoded_tokens
        else np.fromiter(map(_PROMPTS, states), dtype=np.int64, count=len(states))
    )
    done = _stored_tokens(
        np.minimum,
        config,
        prompt=prompts,
        computed=computed,
        scheduled=scheduled,
        num_tokens=tokens,
    )
    due: IdArray = np.flatnonzero(_completes_chunk(config, cursor_table, done))
    return due


def _check_reach(request: str, group: int, blocks: GroupBlocks, end: int, f: int) -> None:
    """Raise InvalidInputError when a group's blocks do not reach chunk `end`."""
    if len(blocks.ids) < end * f:
        raise InvalidInputError(
            request=request,
            group=group,
            field="blocks",
            expected=f"at least {end * f} blocks for {end} complete chunks",
            got=len(blocks.ids),
        )


def _candidate_chunks(
    request: str, group: int, blocks: GroupBlocks, cursor: int, end: int, *, f: int
) -> Sequence[int]:
    """Return the complete chunks from `cursor` up to `end` (past it) whose blocks are all
    real; raise InvalidInputError when the blocks do not reach `end`."""
    _check_reach(request, group, blocks, end, f)
    nulls = blocks.is_null[cursor * f : end * f]
    if 1 not in nulls.tobytes():  # no null block (a C scan; cheaper than numpy's any())
        return range(cursor, end)
    has_null = nulls.reshape(-1, f).any(axis=1)
    chunks: list[int] = (cursor + np.flatnonzero(~has_null)).tolist()
    return chunks


def _source_ids(blocks: GroupBlocks, chunks: Sequence[int], f: int) -> IdArray:
    """Return the GPU block ids of `chunks` (ascending) of one group, chunk by chunk."""
    if chunks[-1] - chunks[0] + 1 == len(chunks):  # consecutive: one slice
        return blocks.ids[chunks[0] * f : (chunks[-1] + 1) * f]
    slots = (np.asarray(chunks, dtype=np.int64)[:, None] * f + np.arange(f)).ravel()
    picked: IdArray = blocks.ids[slots]
    return picked


def _gpu_side(
    blocks: Sequence[GroupBlocks],
    per_group: Sequence[tuple[int, Sequence[int]]],
    num_groups: int,
    f: int,
) -> tuple[IdArray, tuple[int, ...], tuple[int, ...]]:
    """Return a store plan's GPU side for the chunks to store of each group listed in
    `per_group` (ascending): the source block ids (read-only), `group_sizes`, `block_indices`."""
    ids: list[IdArray] = []
    sizes = [0] * num_groups
    firsts = [0] * num_groups
    for g, chunks in per_group:
        if isinstance(chunks, range):  # consecutive chunks (the common case): one slice
            ids.append(blocks[g].ids[chunks.start * f : chunks.stop * f])
        elif chunks:
            ids.append(_source_ids(blocks[g], chunks, f))
        else:
            continue
        firsts[g] = chunks[0] * f
        sizes[g] = len(chunks) * f
    gpu_block_ids = np.concatenate(ids)
    gpu_block_ids.setflags(write=False)
    return gpu_block_ids, tuple(sizes), tuple(firsts)


# Values `plan_store` builds from checked ones, every invariant holding by construction: made
# without re-running the checks (`test_planner_built_values` keeps that safe).
_new_decision = unchecked_maker(StoreDecision)
_new_plan = unchecked_maker(TransferPlan)
_with_changes = unchecked_evolver(RequestState)


@attrs.frozen(kw_only=True)
class StoreCandidates:
    """A store's checked inputs, before the tier is asked: what `check_store_inputs` returns
    and `plan_checked_store` plans from (the tier is never read to find them)."""

    per_group: tuple[tuple[int, Sequence[int]], ...]
    """Per group with any, the group and its candidate chunks (ascending)."""
    keys: tuple[OffloadKey, ...]
    """The candidates' keys, group by group, chunk by chunk: the keys the tier is asked about."""
    positions: tuple[int, ...]
    """Per key of `keys`, the token position where its chunk ends."""
    next_cursor: tuple[int, ...]
    """Every group's store cursor once the step is planned."""


_new_candidates = unchecked_maker(StoreCandidates)


def _candidates(
    config: OffloadConfig, state: RequestState, blocks: Sequence[GroupBlocks], done: int
) -> StoreCandidates:
    """Return a store's candidates once `done` tokens exist. Raise InvalidInputError when a
    group's blocks do not reach its last complete chunk."""
    request = state.request_id
    f = config.blocks_per_chunk
    cursors = state.store_cursor
    chains = state.keys
    ends = list(cursors)
    per_group: list[tuple[int, Sequence[int]]] = []  # (group, its candidate chunks)
    candidates: list[OffloadKey] = []
    positions: list[int] = []
    for g, chunk in enumerate(config.all_chunk_tokens):
        cursor = cursors[g]
        end = min(done // chunk, len(chains[g]))
        if end <= cursor:  # none completed, or a load moved the cursor past this step's chunk
            continue
        ends[g] = end
        chunks = _candidate_chunks(request, g, blocks[g], cursor, end, f=f)
        if not config.keeps_every_chunk(g):  # only windows some lookup can load
            chunks = [j for j in chunks if config.keeps_chunk(g, j)]
        if chunks:
            per_group.append((g, chunks))
            chain = chains[g]
            if isinstance(chunks, range):
                candidates += chain[cursor:end]
                positions += range((cursor + 1) * chunk, (end + 1) * chunk, chunk)
            else:
                candidates += [chain[j] for j in chunks]
                positions += [(j + 1) * chunk for j in chunks]
    return _new_candidates(
        per_group=tuple(per_group),
        keys=tuple(candidates),
        positions=tuple(positions),
        next_cursor=tuple(ends),
    )


def check_store_inputs(
    config: OffloadConfig,
    state: RequestState,
    blocks: Sequence[GroupBlocks],
    *,
    num_computed_tokens: int,
    num_scheduled_tokens: int,
    num_tokens: int,
) -> StoreCandidates:
    """Raise what `plan_store` raises for these inputs, whatever the tier would answer (a
    caller planning many requests checks them all before it reserves a row); otherwise return
    the store's candidates, for `plan_checked_store` (the caller checks their keys do not
    repeat)."""
    state.check_matches(config)
    check_block_lists(config, state, blocks)
    request = state.request_id
    check_count(num_computed_tokens, request=request, field="num_computed_tokens")
    check_count(num_scheduled_tokens, request=request, field="num_scheduled_tokens")
    check_count(num_tokens, request=request, field="num_tokens")
    done = stored_tokens_after_step(
        config,
        state,
        num_computed_tokens=num_computed_tokens,
        num_scheduled_tokens=num_scheduled_tokens,
        num_tokens=num_tokens,
    )
    return _candidates(config, state, blocks, done)


def plan_store(
    config: OffloadConfig,
    state: RequestState,
    blocks: Sequence[GroupBlocks],
    *,
    num_computed_tokens: int,
    num_scheduled_tokens: int,
    num_tokens: int,
    tier: StoreTierView,
) -> StoreDecision:
    """Return what to store this step for one running request.

    Tokens whose KV exists once this step's forward pass ends are
    `done = min(num_computed + num_scheduled, num_tokens)` (capped at the prompt when decoded
    tokens are not stored). Per group, the complete chunks from the store cursor to `done // C_g`
    whose GPU blocks are all real and that are worth storing (`OffloadConfig.keeps_chunk`: of a
    windowed group, only chunks in the window of a boundary a lookup can answer) are
    candidates; keys the tier has are skipped. If the rest do not fit, the outcome is NO_ROOM
    and the cursors stay; otherwise they move to `done // C_g`.
    """
    candidates = check_store_inputs(
        config,
        state,
        blocks,
        num_computed_tokens=num_computed_tokens,
        num_scheduled_tokens=num_scheduled_tokens,
        num_tokens=num_tokens,
    )
    return plan_checked_store(config, state, blocks, candidates, tier=tier)


def plan_checked_store(
    config: OffloadConfig,
    state: RequestState,
    blocks: Sequence[GroupBlocks],
    candidates: StoreCandidates,
    *,
    tier: StoreTierView,
) -> StoreDecision:
    """Return `plan_store`'s decision from the `candidates` that `check_store_inputs` returned
    for the same state and blocks (the inputs are not checked again)."""
    request = state.request_id
    cursors = state.store_cursor
    chains = state.keys
    f = config.blocks_per_chunk
    per_group = candidates.per_group
    asked = candidates.keys
    next_cursor = candidates.next_cursor
    if next_cursor == cursors:  # not due (`store_due` is False)
        return _new_decision(outcome=StoreOutcome.NOTHING, plan=None, state=state, reserve_keys=())
    # The cursors stay within the key lists (`end` is capped by them): no check needed.
    moved = _with_changes(state, store_cursor=next_cursor)
    statuses = tier.statuses(asked)
    if len(statuses) != len(asked):
        raise InvalidInputError(
            request=request,
            field="statuses",
            expected=f"one status per key from the tier ({len(asked)})",
            got=len(statuses),
        )
    num_missing = statuses.count(_MISS)
    if not num_missing:
        return _new_decision(outcome=StoreOutcome.NOTHING, plan=None, state=moved, reserve_keys=())
    if not tier.can_reserve(asked):
        return _new_decision(outcome=StoreOutcome.NO_ROOM, plan=None, state=state, reserve_keys=())

    keys: Sequence[OffloadKey] = asked
    new_per_group: Sequence[tuple[int, Sequence[int]]] = per_group
    if num_missing != len(asked):  # some candidates are in the tier already: skip them
        missing = {key for key, status in zip(asked, statuses, strict=True) if status == _MISS}
        keys = [key for key in asked if key in missing]
        new_per_group = [
            (g, [j for j in chunks if chains[g][j] in missing]) for g, chunks in per_group
        ]
    gpu_block_ids, sizes, firsts = _gpu_side(blocks, new_per_group, len(cursors), f)
    # Built from checked block lists and keys, chunk by chunk: every plan invariant holds.
    plan = _new_plan(
        request_id=request,
        direction=Direction.STORE,
        blocks_per_chunk=f,
        keys=KeyColumn(keys),
        gpu_block_ids=gpu_block_ids,
        group_sizes=sizes,
        block_indices=firsts,
    )
    return _new_decision(outcome=StoreOutcome.STORE, plan=plan, state=moved, reserve_keys=asked)
