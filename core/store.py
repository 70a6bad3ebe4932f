"""Store planning: which newly completed chunks to copy to the CPU tier, from which GPU blocks.

Pure: the tier is asked (read-only) which keys it has and whether the rest fit; the caller
reserves the rows afterwards, with the decision's `reserve_keys` (the plan's keys are among them).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

import attrs
import numpy as np

from kvferry.core.blocks import GroupBlocks
from kvferry.core.checks import check_count
from kvferry.core.config import OffloadConfig
from kvferry.core.errors import InvalidInputError
from kvferry.core.keys import KeyStatus, KeyStatusView, OffloadKey
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


def _candidate_chunks(
    config: OffloadConfig, state: RequestState, group: int, blocks: GroupBlocks, done: int
) -> tuple[np.ndarray, int]:
    """Return (complete chunks from the cursor whose blocks are all real, the new cursor)."""
    f = config.blocks_per_chunk
    cursor = state.store_cursor[group]
    end = min(done // config.chunk_tokens(group), len(state.keys[group]))
    if end <= cursor:  # e.g. a load moved the cursor past the chunk this step is still filling
        return np.empty(0, dtype=np.int64), cursor
    if len(blocks) < end * f:
        raise InvalidInputError(
            request=state.request_id,
            group=group,
            field="blocks",
            expected=f"at least {end * f} blocks for {end} complete chunks",
            got=len(blocks),
        )
    has_null = blocks.is_null[cursor * f : end * f].reshape(-1, f).any(axis=1)
    return cursor + np.flatnonzero(~has_null), end


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
    limit = num_tokens if config.store_decoded_tokens else min(num_tokens, state.num_prompt_tokens)
    return min(num_computed_tokens + num_scheduled_tokens, limit)


def store_due(config: OffloadConfig, state: RequestState, done: int) -> bool:
    """Return True when some group may complete a chunk past its store cursor by `done` tokens.

    A cheap test (no block table, no tier) for the many decode steps that complete nothing:
    `plan_store` answers NOTHING, with the state unchanged, whenever this is False, so a caller
    planning many requests per step may skip those.
    """
    return any(
        done // chunk > cursor
        for chunk, cursor in zip(config.all_chunk_tokens, state.store_cursor, strict=True)
    )


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
    """Return what to store this step for one running request (DESIGN §4.3).

    Tokens whose KV exists once this step's forward pass ends are
    `done = min(num_computed + num_scheduled, num_tokens)` (capped at the prompt when decoded
    tokens are not stored). Per group, the complete chunks from the store cursor to `done // C_g`
    whose GPU blocks are all real are candidates; keys the tier has are skipped. If the rest do
    not fit, the outcome is NO_ROOM and the cursors stay; otherwise they move to `done // C_g`.
    """
    state.check_matches(config)
    check_block_lists(config, state, blocks)
    for field, value in (
        ("num_computed_tokens", num_computed_tokens),
        ("num_scheduled_tokens", num_scheduled_tokens),
        ("num_tokens", num_tokens),
    ):
        check_count(value, request=state.request_id, field=field)
    done = stored_tokens_after_step(
        config,
        state,
        num_computed_tokens=num_computed_tokens,
        num_scheduled_tokens=num_scheduled_tokens,
        num_tokens=num_tokens,
    )
    if not store_due(config, state, done):
        return StoreDecision(outcome=StoreOutcome.NOTHING, plan=None, state=state)
    per_group = [
        _candidate_chunks(config, state, g, blocks[g], done) for g in range(config.num_groups)
    ]
    candidates = [state.keys[g][int(j)] for g, (chunks, _) in enumerate(per_group) for j in chunks]
    missing = {
        key
        for key, status in zip(candidates, tier.statuses(candidates), strict=True)
        if status is KeyStatus.MISS
    }
    moved = attrs.evolve(state, store_cursor=tuple(end for _, end in per_group))
    if not missing:
        return StoreDecision(outcome=StoreOutcome.NOTHING, plan=None, state=moved)
    if not tier.can_reserve(candidates):
        return StoreDecision(outcome=StoreOutcome.NO_ROOM, plan=None, state=state)

    f = config.blocks_per_chunk
    keys: list[OffloadKey] = []
    ids: list[np.ndarray] = []
    sizes: list[int] = []
    firsts: list[int] = []
    for g, (chunks, _) in enumerate(per_group):
        new = [int(j) for j in chunks if state.keys[g][int(j)] in missing]
        keys.extend(state.keys[g][j] for j in new)
        slots = (np.asarray(new, dtype=np.int64)[:, None] * f + np.arange(f)).ravel()
        ids.append(blocks[g].ids[slots])
        sizes.append(len(slots))
        firsts.append(new[0] * f if new else 0)
    plan = TransferPlan(
        request_id=state.request_id,
        direction=Direction.STORE,
        blocks_per_chunk=f,
        keys=tuple(keys),
        gpu_block_ids=np.concatenate(ids),
        group_sizes=tuple(sizes),
        block_indices=tuple(firsts),
    )
    return StoreDecision(
        outcome=StoreOutcome.STORE, plan=plan, state=moved, reserve_keys=tuple(candidates)
    )
