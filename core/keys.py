"""Offload keys (which chunk of which group) and what the CPU tier may say about one.

Pure: keys are derived from the engine's chained prefix hashes, never computed from tokens here.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from kvferry.core.config import OffloadConfig


class OffloadKey(NamedTuple):
    """Names chunk `j` of a group: the group index and the hash of the chunk's last hash block.

    Hashes are chained, so the key names the whole prefix up to the chunk's end. A named tuple
    (not an attrs class) because keys are made by the thousand and used as dictionary keys.
    """

    group: int
    block_hash: bytes

    def __str__(self) -> str:
        return f"g{self.group}:{self.block_hash.hex()}"


class KeyStatus(enum.IntEnum):
    """What the CPU tier says of one key."""

    MISS = 0
    """Not in the tier."""
    HIT = 1
    """Readable now."""
    PENDING = 2
    """Being written, or being loaded by another request: ask again later."""


class KeyStatusView(Protocol):
    """A read-only view of the CPU tier: the status of each key, in order."""

    def statuses(self, keys: Sequence[OffloadKey]) -> Sequence[KeyStatus]:
        """Return one status per key, in the same order."""
        ...


def chunk_keys(
    config: OffloadConfig, group: int, block_hashes: Sequence[bytes], start: int
) -> tuple[OffloadKey, ...]:
    """Return the keys of `group`'s complete chunks from chunk `start` on.

    Chunk `j` is keyed by hash number `(j + 1) * hashes_per_chunk - 1`; only chunks whose last
    hash block is present in `block_hashes` are complete.
    """
    step = config.hashes_per_chunk(group)
    first_hash = (start + 1) * step - 1
    make = tuple.__new__  # what OffloadKey(group, h) does, without its Python-level __new__
    return tuple([make(OffloadKey, (group, h)) for h in block_hashes[first_hash::step]])
