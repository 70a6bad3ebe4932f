"""Load planning: which CPU-tier chunks go into which freshly allocated GPU blocks.

Pure: returns the plan and the next request state; the caller pins keys and runs the copy.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
import numpy as np

from kvferry.core.blocks import GroupBlocks
from kvferry.core.checks import check_count, unchecked
from kvferry.core.config import GroupSpec, OffloadConfig
from kvferry.core.errors import InvalidInputError
from kvferry.core.keys import KeyColumn, OffloadKey
from kvferry.core.plan import Direction, TransferPlan, check_distinct_destinations
from kvferry.core.state import RequestState


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_block_lists(
    config: OffloadConfig, state: RequestState, blocks: Sequence[GroupBlocks]
) -> None:
    """Raise InvalidInputError unless there is one GroupBlocks per group of `config`."""
    if len(blocks) != config.num_groups:
        raise InvalidInputError(
            request=state.request_id,
            field="blocks",
            expected=f"one block list per group ({config.num_groups} groups)",
            got=len(blocks),
        )
    for group, group_blocks in enumerate(blocks):
        if not isinstance(group_blocks, GroupBlocks):
            raise InvalidInputError(
                request=state.request_id,
                group=group,
                field="blocks",
                expected="a GroupBlocks",
                got=type(group_blocks).__name__,
            )


@attrs.frozen(kw_only=True)
class _GroupLoad:
    first: int
    end: int
    hashes: list[bytes]
    """The hashes of the keys loaded (no key object is made)."""
    made: list[OffloadKey] | None
    """The same keys when the request's chain has made them already (a lookup read them)."""
    next_cursor: int


def _first_needed_block(spec: GroupSpec, block_size: int, cached_tokens: int, n_gpu: int) -> int:
    """Return the first block a group needs to resume at `cached_tokens` (`n_gpu` when it
    needs none): the block of its first needed token (`KIND_RULES`)."""
    first = spec.first_needed_token(cached_tokens)
    return n_gpu if first >= cached_tokens else first // block_size


def _plan_group(
    config: OffloadConfig,
    state: RequestState,
    group: int,
    blocks: GroupBlocks,
    *,
    num_computed_tokens: int,
    cached_tokens: int,
) -> _GroupLoad:
    block_size = config.groups[group].block_size
    f = config.blocks_per_chunk
    n_gpu = _ceil_div(cached_tokens, block_size)
    end_chunk = _ceil_div(cached_tokens, config.chunk_tokens(group))

    def fail(field: str, expected: str, got: object) -> InvalidInputError:
        return InvalidInputError(
            request=state.request_id, group=group, field=field, expected=expected, got=got
        )

    if len(blocks) < n_gpu:
        raise fail("blocks", f"at least {n_gpu} blocks for {cached_tokens} tokens", len(blocks))
    lo = max(
        num_computed_tokens // block_size,  # the block the GPU prefix ends inside is filled whole
        _first_needed_block(config.groups[group], block_size, cached_tokens, n_gpu),
    )
    taken = blocks.is_null[lo:n_gpu] | blocks.is_cached[lo:n_gpu]
    moved_to = 0 if state.store_loaded or cached_tokens == num_computed_tokens else end_chunk
    cursor = max(state.store_cursor[group], min(moved_to, len(state.keys[group])))
    if taken.all():  # nothing to fill (also when the range is empty)
        return _GroupLoad(first=0, end=0, hashes=[], made=[], next_cursor=cursor)
    first = lo + int(np.argmin(taken))  # the first block not taken
    later_taken = taken[first - lo :]
    if later_taken.any():
        index = first + int(np.argmax(later_taken))
        what = "null" if blocks.is_null[index] else "GPU-cached"
        raise fail(
            f"blocks[{index}]",
            f"a fresh block to load into (blocks {first}..{n_gpu - 1} are destinations)",
            f"a {what} block (id {int(blocks.ids[index])})",
        )
    if end_chunk > len(state.keys[group]):
        raise fail(
            "hit_tokens",
            f"at most {len(state.keys[group]) * config.chunk_tokens(group) - num_computed_tokens}"
            " tokens (the request's complete chunks)",
            cached_tokens - num_computed_tokens,
        )
    chain = state.keys[group]
    hashes = chain.hash_slice(first // f, end_chunk)
    made = chain.made_keys(first // f, end_chunk)
    return _GroupLoad(first=first, end=n_gpu, hashes=hashes, made=made, next_cursor=cursor)


def _made_keys(loads: Sequence[_GroupLoad]) -> tuple[OffloadKey, ...] | None:
    """Return the plan's keys when a lookup has made some group's already (kept, not made
    again; a windowed group's few others are made here), else None: the plan makes none."""
    if all(load.made is None for load in loads if load.hashes):
        return None
    keys: list[OffloadKey] = []
    for group, load in enumerate(loads):
        if load.made is not None:
            keys += load.made
        else:
            keys += map(
                _make_key, itertools.repeat(OffloadKey), zip(itertools.repeat(group), load.hashes)
            )
    return tuple(keys)


_make_key = tuple.__new__  # what OffloadKey(group, h) does, without its Python-level __new__


def _one_width(state: RequestState, groups: Sequence[int]) -> int:
    """Return the one length of the hashes of `groups`' key chains (0 when unknown)."""
    widths = {state.keys[g].hash_width for g in groups}
    width = widths.pop() if len(widths) == 1 else 0
    return max(width, 0)


def plan_load(
    config: OffloadConfig,
    state: RequestState,
    blocks: Sequence[GroupBlocks],
    *,
    num_computed_tokens: int,
    hit_tokens: int,
) -> tuple[TransferPlan, RequestState]:
    """Return the load plan for `hit_tokens` accepted past `num_computed_tokens`, and the
    request's next state (store cursors moved past what is loaded, unless `store_loaded`).

    Per group: destinations are the blocks from the first one in
    `[floor(num_computed / T_g), ceil(cached / T_g))` that is neither null nor GPU-cached (the
    block a GPU prefix ends inside is filled whole: its computed part gets the same bytes) and
    holds a token the group needs at `cached` (`KIND_RULES`: from `cached - w + 1` for a
    sliding window of `w`, the state block alone for Mamba), whether or not the engine nulled
    the blocks below; keys are chunks `first // F` to `ceil(cached / C_g)`. A null or cached
    block after the first destination is refused: the copy would overwrite a block that is not
    this request's own.
    """
    state.check_matches(config)
    check_block_lists(config, state, blocks)
    check_count(num_computed_tokens, request=state.request_id, field="num_computed_tokens")
    check_count(hit_tokens, request=state.request_id, field="hit_tokens")
    cached_tokens = num_computed_tokens + hit_tokens
    loads = [
        _plan_group(
            config,
            state,
            g,
            blocks[g],
            num_computed_tokens=num_computed_tokens,
            cached_tokens=cached_tokens,
        )
        for g in range(config.num_groups)
    ]
    destinations = [blocks[g].ids[load.first : load.end] for g, load in enumerate(loads)]
    for g, ids in enumerate(destinations):  # the one plan invariant the block lists can break
        check_distinct_destinations(state.request_id, g, ids)
    gpu_block_ids = np.concatenate(destinations)
    gpu_block_ids.setflags(write=False)
    # Every other invariant of a plan holds by construction: skip TransferPlan's checks.
    plan = unchecked(
        TransferPlan,
        request_id=state.request_id,
        direction=Direction.LOAD,
        blocks_per_chunk=config.blocks_per_chunk,
        keys=KeyColumn.of_hashes(
            np.repeat(np.arange(len(loads), dtype=np.int64), [len(x.hashes) for x in loads]),
            list(itertools.chain.from_iterable(load.hashes for load in loads)),
            _one_width(state, [g for g, load in enumerate(loads) if load.hashes]),
            made=_made_keys(loads),
        ),
        gpu_block_ids=gpu_block_ids,
        group_sizes=tuple(load.end - load.first for load in loads),
        block_indices=tuple(load.first for load in loads),
    )
    next_state = attrs.evolve(state, store_cursor=tuple(load.next_cursor for load in loads))
    return plan, next_state
