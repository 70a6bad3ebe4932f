"""The per-request planning state: offload keys per group and the store cursor per group.

Immutable: every planning function returns the next state instead of changing this one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from kvferry.core.checks import check_count, unchecked_evolver
from kvferry.core.config import OffloadConfig
from kvferry.core.errors import InvalidInputError, PlanInvariantError
from kvferry.core.keys import KeyChain, OffloadKey, hash_width


def _key_chains(value: Iterable[Iterable[OffloadKey]]) -> tuple[KeyChain, ...]:
    """Return one KeyChain per group of `value` (chains are kept, other sequences copied)."""
    return tuple(keys if isinstance(keys, KeyChain) else KeyChain(keys) for keys in value)


@attrs.frozen(kw_only=True)
class RequestState:
    """What the planner remembers of one request between calls."""

    request_id: str
    """The engine's request id (named in every error)."""
    num_prompt_tokens: int
    """Prompt length; with `store_decoded_tokens` off, nothing past it is stored."""
    keys: tuple[KeyChain, ...] = attrs.field(converter=_key_chains)
    """Per group, the keys of the request's complete chunks so far, in token order (any
    sequences of keys are taken; each becomes a KeyChain, which grows without copying)."""
    store_cursor: tuple[int, ...]
    """Per group, the first chunk not yet stored nor loaded (earlier ones are never stored)."""
    store_loaded: bool = False
    """Store again the chunks this request loaded (a prefill node feeding a remote decoder)."""

    def __attrs_post_init__(self) -> None:
        check_count(self.num_prompt_tokens, request=self.request_id, field="num_prompt_tokens")
        if len(self.keys) != len(self.store_cursor):
            raise PlanInvariantError(
                request=self.request_id,
                field="store_cursor",
                expected=f"one cursor per group ({len(self.keys)} groups of keys)",
                got=len(self.store_cursor),
            )
        for group, cursor in enumerate(self.store_cursor):
            if not 0 <= cursor <= len(self.keys[group]):
                raise PlanInvariantError(
                    request=self.request_id,
                    group=group,
                    field="store_cursor",
                    expected=f"a chunk index in [0, {len(self.keys[group])}]",
                    got=cursor,
                )

    def check_matches(self, config: OffloadConfig) -> None:
        """Raise InvalidInputError unless this state was made for `config`'s groups."""
        if len(self.keys) != config.num_groups:
            raise InvalidInputError(
                request=self.request_id,
                field="keys",
                expected=f"one key list per group ({config.num_groups} groups in the config)",
                got=len(self.keys),
            )


_with_changes = unchecked_evolver(RequestState)


def new_request_state(
    config: OffloadConfig,
    request_id: str,
    *,
    num_prompt_tokens: int,
    block_hashes: Sequence[bytes] = (),
    store_loaded: bool = False,
) -> RequestState:
    """Return the planning state of a request that has just arrived, keyed from its hashes."""
    empty = RequestState(
        request_id=request_id,
        num_prompt_tokens=num_prompt_tokens,
        keys=tuple(KeyChain() for _ in config.groups),
        store_cursor=tuple(0 for _ in config.groups),
        store_loaded=store_loaded,
    )
    return extend_keys(config, empty, block_hashes)


def check_hash_count(
    config: OffloadConfig, request_id: str, num_hashes: int, num_tokens: int
) -> None:
    """Raise InvalidInputError unless `num_hashes` is one hash per full hash block of
    `num_tokens` tokens: a different count means the engine hashes every other number of
    tokens than `config.hash_block_size`, and keys would name chunks by the wrong prefix."""
    expected = num_tokens // config.hash_block_size
    if num_hashes != expected:
        raise InvalidInputError(
            request=request_id,
            field="block_hashes",
            expected=(
                f"{expected} hashes for {num_tokens} tokens, one per "
                f"hash_block_size={config.hash_block_size} tokens (is it the engine's?)"
            ),
            got=f"{num_hashes} hashes",
        )


def _check_bytes(request_id: str, group: int, hashes: Sequence[object]) -> None:
    """Raise InvalidInputError naming the first of `hashes` that is not bytes."""
    if set(map(type, hashes)) - {bytes}:  # one pass in C; the loop only finds the culprit
        for block_hash in hashes:
            if not isinstance(block_hash, bytes):
                raise InvalidInputError(
                    request=request_id,
                    group=group,
                    field="block_hashes",
                    expected="bytes for every hash",
                    got=block_hash,
                )


def extend_keys(
    config: OffloadConfig, state: RequestState, block_hashes: Sequence[bytes]
) -> RequestState:
    """Return `state` with keys for every chunk that `block_hashes` now completes.

    `block_hashes` is the request's whole list of chained hash-block hashes (it only grows);
    keys already known are kept, and only the new chunks are keyed, so calling this every step
    costs time in proportion to what is new.
    """
    state.check_matches(config)
    if type(block_hashes) not in (list, tuple) and (
        not isinstance(block_hashes, Sequence) or isinstance(block_hashes, (str, bytes))
    ):
        raise InvalidInputError(
            request=state.request_id,
            field="block_hashes",
            expected="a sequence of bytes (one hash per full hash block)",
            got=block_hashes,
        )
    num_hashes = len(block_hashes)
    chains = state.keys
    new_keys: list[KeyChain] | None = None
    taken: dict[tuple[int, int], tuple[list[bytes], int]] = {}
    """Per (keys known, hashes per chunk): the new chunks' hashes, checked, and their one
    length; groups alike (often all of them) take one list, checked once."""
    for group, chunk in enumerate(config.all_chunk_tokens):
        step = chunk // config.hash_block_size  # `hashes_per_chunk(group)`, without two calls
        known = chains[group]
        count = len(known)
        if count:
            last_hash_index = count * step - 1
            if (
                last_hash_index >= num_hashes
                or block_hashes[last_hash_index] != known[count - 1].block_hash
            ):
                raise InvalidInputError(
                    request=state.request_id,
                    group=group,
                    field="block_hashes",
                    expected=(
                        f"a list that extends the earlier one (hash {last_hash_index} "
                        f"= {known[count - 1].block_hash.hex()})"
                    ),
                    got=f"{num_hashes} hashes",
                )
        if (count + 1) * step > num_hashes:
            continue  # the next chunk is not complete yet (most decode steps)
        if (count, step) not in taken:
            added = list(block_hashes[(count + 1) * step - 1 :: step])  # new chunks' last hashes
            _check_bytes(state.request_id, group, added)
            taken[count, step] = (added, hash_width(added))
        added, width = taken[count, step]
        if new_keys is None:
            new_keys = list(chains)
        new_keys[group] = known.extended_hashes(group, added, width=width)
    if new_keys is None:
        return state
    # Key lists only grew, so every store cursor still lies within its list.
    return _with_changes(state, keys=tuple(new_keys))
