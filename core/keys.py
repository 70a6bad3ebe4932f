"""Offload keys (which chunk of which group) and what the CPU tier may say about one.

Pure: keys are derived from the engine's chained prefix hashes, never computed from tokens here.
"""

from __future__ import annotations

import enum
import itertools
import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol, final, overload, runtime_checkable

import numpy as np
import numpy.typing as npt

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
    """The append-only storage chains made from one another share: the chunks' hashes, the
    keys made from them so far (a prefix of the hashes, grown as keys are read), and the hashes'
    one length (-1 once two differ, 0 while there is none)."""

    __slots__ = ("hashes", "keys", "width")

    def __init__(self, hashes: list[bytes], keys: list[OffloadKey], width: int = 0) -> None:
        self.hashes = hashes
        self.keys = keys
        self.width = _width_with(width, hashes)


def _width_with(width: int, added: list[bytes]) -> int:
    """Return the one length of hashes of length `width` (0: none yet) and `added`, or -1."""
    if not added or width == -1:
        return width
    return _joined_width(width, hash_width(added))


def _joined_width(width: int, other: int) -> int:
    """Return the one length of two lists of hashes whose one lengths are `width` and `other`
    (0: empty, -1: lengths differ)."""
    if not width or not other:
        return width or other
    return width if width == other else -1


def hash_width(hashes: Sequence[bytes]) -> int:
    """Return the length every hash of `hashes` has: 0 for none, -1 when they differ."""
    if not hashes:
        return 0
    lengths = set(map(len, hashes))
    return lengths.pop() if len(lengths) == 1 else -1


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
        hashes = [key.block_hash for key in added]
        return self._grown(group, hashes, hash_width(hashes))

    def extended_hashes(
        self, group: int, hashes: list[bytes], *, width: int | None = None
    ) -> KeyChain:
        """Return this chain followed by the keys of `group` whose hashes are `hashes` (bytes,
        which the caller has checked; `width`, when the caller knows it, is their
        `hash_width`); no key object is made. Raise InvalidInputError when the chain holds
        keys of another group."""
        if self._length and group != self._group:
            raise InvalidInputError(
                group=group, field="keys", expected=f"keys of group {self._group}", got=group
            )
        return self._grown(group, hashes, hash_width(hashes) if width is None else width)

    def _grown(self, group: int, added: list[bytes], added_width: int) -> KeyChain:
        column, length = self._column, self._length
        store = column.hashes
        end = length + len(added)
        shared = len(store) == length and (group == self._group or not length)
        if shared:
            store.extend(added)  # one step under the GIL; another thread may have gone first:
            shared = store[length:end] == added  # are the entries past `length` ours?
            if shared:
                column.width = _joined_width(column.width, added_width)
        if not shared:  # an older chain (or a race lost): copy its part
            column = _Column(store[:length] + added, column.keys[:length])
        chain = _new(KeyChain)
        _set_column(chain, column)
        _set_group(chain, group)
        _set_length(chain, end)
        return chain

    def hash_slice(self, start: int, stop: int) -> list[bytes]:
        """Return the hashes of keys `start` to `stop` (clipped to the chain), no key made."""
        return self._column.hashes[start : min(stop, self._length)]

    def made_keys(self, start: int, stop: int) -> list[OffloadKey] | None:
        """Return keys `start` to `stop` (clipped to the chain) when a reader has made them
        already (a lookup reads a request's keys), else None: nothing is made here."""
        stop = min(stop, self._length)
        keys = self._column.keys
        return keys[start:stop] if len(keys) >= stop else None

    @property
    def hash_width(self) -> int:
        """Return the length every hash of the chain's column has (-1 when they differ, 0 for
        none), a bound for the chain's own hashes."""
        return self._column.width

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


@final
class KeyColumn(Sequence[OffloadKey]):
    """Keys listed group by group, held as two columns: their groups (an int64 array) and their
    hashes (a list of bytes, or one blob of equal-length hashes back to back). An immutable
    sequence of `OffloadKey`s that makes them only when a caller reads them (a plan's JSON, the
    catalog), kept for the next read; a message carries the columns as they are. Compares
    equal to another column, or to a tuple, with the same keys, and hashes like that tuple.
    """

    __slots__ = ("_blob", "_groups", "_hashes", "_tuple", "_width")
    _groups: npt.NDArray[np.int64]
    _hashes: list[bytes] | None
    _blob: bytes | None
    _width: int
    _tuple: tuple[OffloadKey, ...] | None

    def __init__(self, keys: Iterable[OffloadKey] = ()) -> None:
        """Make a column of `keys`; raise InvalidInputError unless each is an OffloadKey."""
        listed = tuple(keys)
        _check_keys(list(listed))
        groups = np.fromiter(map(_GROUP, listed), dtype=np.int64, count=len(listed))
        _fill(self, groups, hashes=list(map(_HASH, listed)), blob=None, width=0, keys=listed)

    @classmethod
    def of_hashes(
        cls,
        groups: npt.NDArray[np.int64],
        hashes: list[bytes],
        width: int = 0,
        *,
        made: tuple[OffloadKey, ...] | None = None,
    ) -> KeyColumn:
        """Return the column of keys `(groups[i], hashes[i])`, no key made. `width` is the one
        length of the hashes when the caller knows it (else 0, or -1 when they differ);
        `made`, when given, is those very keys, made already (kept instead of made again).
        Raise InvalidInputError when the lengths disagree."""
        _check_groups(groups, len(hashes))
        if made is not None and len(made) != len(hashes):
            raise InvalidInputError(
                field="keys", expected=f"{len(hashes)} keys made", got=len(made)
            )
        column = _new(KeyColumn)
        _fill(column, groups, hashes=hashes, blob=None, width=width, keys=made)
        return column

    @classmethod
    def of_blob(cls, groups: npt.NDArray[np.int64], blob: bytes, width: int) -> KeyColumn:
        """Return the column of keys whose hashes, each `width` bytes, are `blob` back to
        back; raise InvalidInputError unless the blob holds exactly one hash per group entry."""
        if width < 1 or len(blob) != width * len(groups):
            raise InvalidInputError(
                field="keys",
                expected=f"{len(groups)} hashes of {width} bytes",
                got=f"{len(blob)} bytes",
            )
        _check_groups(groups, len(groups))
        column = _new(KeyColumn)
        _fill(column, groups, hashes=None, blob=blob, width=width, keys=None)
        return column

    @property
    def groups(self) -> npt.NDArray[np.int64]:
        """Return each key's group (a read-only int64 array)."""
        return self._groups

    def hashes(self) -> list[bytes]:
        """Return each key's hash, in order (the list is the column's own: do not change it)."""
        if self._hashes is None:
            blob, width = self._blob or b"", self._width
            self._hashes = [blob[at : at + width] for at in range(0, len(blob), width)]
        return self._hashes

    def hash_blob(self) -> tuple[bytes, int]:
        """Return the hashes back to back and their one length, or `(b"", -1)` when their
        lengths differ (the caller then needs `hashes`)."""
        if self._blob is None:
            hashes = self.hashes()
            width = self._width if self._width else _width_with(0, hashes)
            self._width = width
            if width == -1:
                return b"", -1
            self._blob = b"".join(hashes)
        return self._blob, self._width

    def as_tuple(self) -> tuple[OffloadKey, ...]:
        """Return the keys as a tuple of OffloadKeys (made once, then kept)."""
        if self._tuple is None:
            pairs = zip(self._groups.tolist(), self.hashes(), strict=True)
            self._tuple = tuple(map(_make, itertools.repeat(OffloadKey), pairs))
        return self._tuple

    def of_group(self, group: int) -> tuple[OffloadKey, ...]:
        """Return the keys of `group`, in order."""
        start, stop = np.searchsorted(self._groups, [group, group + 1]).tolist()
        return self.as_tuple()[start:stop]

    def __len__(self) -> int:
        return len(self._groups)

    @overload
    def __getitem__(self, index: int) -> OffloadKey: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[OffloadKey, ...]: ...

    def __getitem__(self, index: int | slice) -> OffloadKey | tuple[OffloadKey, ...]:
        return self.as_tuple()[index]

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(self.as_tuple())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KeyColumn):
            return np.array_equal(self._groups, other._groups) and (self.hashes() == other.hashes())
        if isinstance(other, tuple):
            return self.as_tuple() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.as_tuple())

    def __repr__(self) -> str:
        return f"KeyColumn({list(self.as_tuple())!r})"


_GROUP = operator.itemgetter(0)
_HASH = operator.itemgetter(1)


def _fill(
    column: KeyColumn,
    groups: npt.NDArray[np.int64],
    *,
    hashes: list[bytes] | None,
    blob: bytes | None,
    width: int,
    keys: tuple[OffloadKey, ...] | None,
) -> None:
    groups = np.asarray(groups, dtype=np.int64)
    groups.setflags(write=False)
    object.__setattr__(column, "_groups", groups)
    object.__setattr__(column, "_hashes", hashes)
    object.__setattr__(column, "_blob", blob)
    object.__setattr__(column, "_width", width)
    object.__setattr__(column, "_tuple", keys)


def _check_groups(groups: object, count: int) -> None:
    if not isinstance(groups, np.ndarray) or groups.ndim != 1 or groups.dtype.kind not in "iu":
        raise InvalidInputError(field="keys", expected="a 1-D integer array of groups", got=groups)
    if len(groups) != count:
        raise InvalidInputError(
            field="keys", expected=f"one group per hash ({count})", got=len(groups)
        )


def key_column(value: Iterable[OffloadKey]) -> KeyColumn:
    """Return `value` as a KeyColumn (a column as it is)."""
    return value if isinstance(value, KeyColumn) else KeyColumn(value)


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


@runtime_checkable
class HashStatusView(KeyStatusView, Protocol):
    """A KeyStatusView that also answers for one group's keys given as their hashes: the
    planner asks it for a request's keys straight from the request's hash column, making no
    `OffloadKey` (a long prompt's lookup reads thousands)."""

    def hash_statuses(
        self, group: int, hashes: Sequence[bytes], *, width: int = 0
    ) -> Sequence[KeyStatus]:
        """Return `statuses` of the keys `(group, h)` for each `h` of `hashes`, in order;
        `width` is the one length of the hashes when the caller knows it (0 when not)."""
        ...
