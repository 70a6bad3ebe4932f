"""Offload keys (which chunk of which group) and what the CPU tier may say about one.

Pure: keys are derived from the engine's chained prefix hashes, never computed from tokens here.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol, final, overload

from kvferry.core.config import OffloadConfig
from kvferry.core.errors import InvalidInputError


class OffloadKey(NamedTuple):
    """Names chunk `j` of a group: the group index and the hash of the chunk's last hash block.

    Hashes are chained, so the key names the whole prefix up to the chunk's end. A named tuple
    (not an attrs class) because keys are made by the thousand and used as dictionary keys.
    """

    group: int
    block_hash: bytes

    def __str__(self) -> str:
        return f"g{self.group}:{self.block_hash.hex()}"


@final
class KeyChain(Sequence[OffloadKey]):
    """One group's keys of one request, in chunk order: an immutable sequence that grows, by
    `extended`, in time proportional to the keys added (not to those it already holds).

    Chains made from one another share one append-only list; each sees only its first
    `len(chain)` entries of it, and an entry, once written, never changes. Extending the
    longest chain of a list appends to it in place; extending any shorter one (an older state
    kept by the caller) copies its part first. A chain compares equal to another chain, or to
    a tuple, with the same keys, and hashes like that tuple.
    """

    __slots__ = ("_keys", "_length")
    _keys: list[OffloadKey]
    _length: int

    def __init__(self, keys: Iterable[OffloadKey] = ()) -> None:
        """Make a chain of `keys`; raise InvalidInputError unless each is an OffloadKey."""
        store = list(keys)
        _check_keys(store)
        object.__setattr__(self, "_keys", store)
        object.__setattr__(self, "_length", len(store))

    def extended(self, keys: Sequence[OffloadKey]) -> KeyChain:
        """Return this chain followed by `keys` (this chain is unchanged); raise
        InvalidInputError unless each of `keys` is an OffloadKey."""
        added = list(keys)
        _check_keys(added)
        store, length = self._keys, self._length
        end = length + len(added)
        shared = len(store) == length  # the longest chain of its list: append in place
        if shared:
            store.extend(added)  # one step under the GIL; another thread may have gone first:
            shared = store[length:end] == added  # are the entries past `length` ours?
        if not shared:  # an older chain (or a race lost): copy its part
            store = store[:length] + added
        chain = _new(KeyChain)
        _set_keys(chain, store)
        _set_length(chain, end)
        return chain

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> OffloadKey: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[OffloadKey, ...]: ...

    def __getitem__(self, index: int | slice) -> OffloadKey | tuple[OffloadKey, ...]:
        if isinstance(index, slice):
            return tuple(self._keys[slice(*index.indices(self._length))])
        position = index + self._length if index < 0 else index
        if not 0 <= position < self._length:
            raise IndexError(f"key index {index} out of range for {self._length} keys")
        return self._keys[position]

    def __iter__(self) -> Iterator[OffloadKey]:
        return itertools.islice(self._keys, self._length)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KeyChain):
            if other._length != self._length:
                return False
            if other._keys is self._keys:
                return True
            return self._keys[: self._length] == other._keys[: other._length]
        if isinstance(other, tuple):
            return len(other) == self._length and tuple(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"KeyChain({list(self)!r})"

    def __reduce__(self) -> tuple[type[KeyChain], tuple[tuple[OffloadKey, ...]]]:
        return (KeyChain, (tuple(self),))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"KeyChain is immutable (cannot set {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"KeyChain is immutable (cannot delete {name!r})")


_new = object.__new__
_set_keys = KeyChain.__dict__["_keys"].__set__  # the slots' own setters: no attribute lookup
_set_length = KeyChain.__dict__["_length"].__set__


def _check_keys(keys: list[OffloadKey]) -> None:
    """Raise InvalidInputError unless every entry of `keys` is an OffloadKey."""
    for key in keys:
        if type(key) is not OffloadKey and not isinstance(key, OffloadKey):
            raise InvalidInputError(field="keys", expected="OffloadKey values", got=key)


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
