"""Offload keys (which chunk of which group) and what the CPU tier may say about one.

Pure: keys are derived from the engine's chained prefix hashes, never computed from tokens here.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol, final, overload

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


class _Column:
    """The append-only storage chains made from one another share: the chunks' hashes, and the
    keys made from them so far (a prefix of the hashes, grown as keys are read)."""

    __slots__ = ("hashes", "keys")

    def __init__(self, hashes: list[bytes], keys: list[OffloadKey]) -> None:
        self.hashes = hashes
        self.keys = keys


@final
class KeyChain(Sequence[OffloadKey]):
    """One group's keys of one request, in chunk order: an immutable sequence that grows, by
    `extended` or `extended_hashes`, in time proportional to the keys added (not to those it
    already holds).

    A column, not a list of objects: the chain holds its group and its chunks' hashes, and
    makes an `OffloadKey` only when a caller first reads it (a lookup's statuses, a plan's
    keys), kept for the next read; keying a long request creates no object per chunk, and keys
    nobody reads (most of a sliding window's or Mamba's) are never made.

    Chains made from one another share one append-only column; each sees only its first
    `len(chain)` entries of it, and an entry, once written, never changes. Extending the
    longest chain of a list appends to it in place; extending any shorter one (an older state
    kept by the caller) copies its part first. A chain compares equal to another chain, or to
    a tuple, with the same keys, and hashes like that tuple.
    """

    __slots__ = ("_column", "_group", "_length")
    _column: _Column
    _group: int
    _length: int

    def __init__(self, keys: Iterable[OffloadKey] = ()) -> None:
        """Make a chain of `keys`; raise InvalidInputError unless each is an OffloadKey, all of
        one group."""
        store = list(keys)
        _check_keys(store)
        group = _group_of(-1, store)
        object.__setattr__(self, "_group", group)
        object.__setattr__(self, "_column", _Column([key.block_hash for key in store], store))
        object.__setattr__(self, "_length", len(store))

    @property
    def group(self) -> int:
        """Return the group the chain's keys name (-1 while it is empty and was never told)."""
        return self._group

    def extended(self, keys: Sequence[OffloadKey]) -> KeyChain:
        """Return this chain followed by `keys` (this chain is unchanged); raise
        InvalidInputError unless each of `keys` is an OffloadKey of the chain's group."""
        added = list(keys)
        _check_keys(added)
        group = _group_of(self._group if self._length else -1, added)
        return self._grown(group, [key.block_hash for key in added])

    def extended_hashes(self, group: int, hashes: list[bytes]) -> KeyChain:
        """Return this chain followed by the keys of `group` whose hashes are `hashes` (bytes,
        which the caller has checked); no key object is made. Raise InvalidInputError when the
        chain holds keys of another group."""
        if self._length and group != self._group:
            raise InvalidInputError(
                group=group, field="keys", expected=f"keys of group {self._group}", got=group
            )
        return self._grown(group, hashes)

    def _grown(self, group: int, added: list[bytes]) -> KeyChain:
        column, length = self._column, self._length
        store = column.hashes
        end = length + len(added)
        shared = len(store) == length and (group == self._group or not length)
        if shared:
            store.extend(added)  # one step under the GIL; another thread may have gone first:
            shared = store[length:end] == added  # are the entries past `length` ours?
        if not shared:  # an older chain (or a race lost): copy its part
            column = _Column(store[:length] + added, column.keys[:length])
        chain = _new(KeyChain)
        _set_column(chain, column)
        _set_group(chain, group)
        _set_length(chain, end)
        return chain

    def _keys_to(self, end: int) -> list[OffloadKey]:
        """Return the column's key list, made up to entry `end` at least."""
        keys = self._column.keys
        made = len(keys)
        if made < end:
            group = self._group
            new = [_make(OffloadKey, (group, h)) for h in self._column.hashes[made:end]]
            if len(keys) == made:  # no other thread made them meanwhile
                keys.extend(new)
            else:
                return keys[:made] + new
        return keys

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> OffloadKey: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[OffloadKey, ...]: ...

    def __getitem__(self, index: int | slice) -> OffloadKey | tuple[OffloadKey, ...]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step == 1 and start > len(self._column.keys):  # past the keys made: not kept
                group = self._group
                hashes = self._column.hashes[start:stop]
                return tuple([_make(OffloadKey, (group, h)) for h in hashes])
            return tuple(self._keys_to(max(start, stop))[start:stop:step])
        position = index + self._length if index < 0 else index
        if not 0 <= position < self._length:
            raise IndexError(f"key index {index} out of range for {self._length} keys")
        keys = self._column.keys
        if position < len(keys):
            return keys[position]
        return _make(OffloadKey, (self._group, self._column.hashes[position]))

    def __iter__(self) -> Iterator[OffloadKey]:
        return itertools.islice(self._keys_to(self._length), self._length)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KeyChain):
            if other._length != self._length:
                return False
            if not self._length:
                return True
            if other._group != self._group:
                return False
            if other._column is self._column:
                return True
            return self._column.hashes[: self._length] == other._column.hashes[: other._length]
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
_make = tuple.__new__  # what OffloadKey(group, h) does, without its Python-level __new__
_set_column = KeyChain.__dict__["_column"].__set__  # the slots' own setters: no lookup
_set_group = KeyChain.__dict__["_group"].__set__
_set_length = KeyChain.__dict__["_length"].__set__


def _check_keys(keys: list[OffloadKey]) -> None:
    """Raise InvalidInputError unless every entry of `keys` is an OffloadKey."""
    for key in keys:
        if type(key) is not OffloadKey and not isinstance(key, OffloadKey):
            raise InvalidInputError(field="keys", expected="OffloadKey values", got=key)


def _group_of(group: int, keys: list[OffloadKey]) -> int:
    """Return the one group of `keys` (and of a chain of `group`, unless -1: none yet); raise
    InvalidInputError when they name more than one."""
    groups = {key.group for key in keys}
    if group != -1:
        groups.add(group)
    if len(groups) > 1:
        raise InvalidInputError(
            field="keys", expected="keys of one group per chain", got=sorted(groups)
        )
    return groups.pop() if groups else group


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
