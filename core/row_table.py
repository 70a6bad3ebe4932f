"""A vectorised key -> row table for one group of the CPU tier, with row-indexed columns.

A tier of a million rows cannot afford a Python dictionary read per key per step: at that size
each read costs ~100 ns and a long request reads hundreds of thousands. Here a group's keys are
fixed-width hash bytes held as rows of a `uint64` matrix, found by open addressing (linear
probing) over a power-of-two slot array, and every step's keys are probed together: each probing
round is a handful of numpy operations over all the keys still looking, and rounds are few
(the table is kept at most half full). Whatever the tier keeps per row (its state, its pins, its
recency) is a column indexed by row, read and written for all of a call's rows at once.

Pure: numpy only, no I/O and no clock. Recency is a counter the table advances once per `touch`.
One table per group: rows are the group's own row space (`0 .. capacity - 1`).

Usage, the lifecycle of a row:

* `reserve(keys)` gives absent keys free rows, WRITING (no eviction: the caller evicts first,
  choosing among `evictable()` rows by its own policy, `recency` for LRU);
* `complete(rows, success=...)` makes them READY, or frees them and forgets their keys;
* `find(keys)` returns each key's row (-1: absent), and `states(rows)` what the row holds;
* `pin(rows)` / `unpin(rows)` count the loads reading a READY row (a pinned row is never
  evictable); `touch(rows)` marks rows used now;
* `evict(rows)` frees READY unpinned rows.

Every method checks its input first and raises InvalidInputError, changing nothing, on bad
input (a key of the wrong width, a row that is not in the state the call needs).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvferry.core.arrays import IdArray
from kvferry.core.checks import check_count
from kvferry.core.errors import InvalidInputError

KeyMatrix = npt.NDArray[np.uint64]
"""Keys as rows of `uint64` words: a key of `w` bytes is `ceil(w / 8)` words, zero-padded."""

_EMPTY = -1
_GONE = -2
"""Slot markers: never used, or used by a key since removed (probing goes on past it)."""
_MIX = np.uint64(0x9E3779B97F4A7C15)
_SHIFT = np.uint64(29)


class RowState(enum.IntEnum):
    """What a row holds."""

    FREE = 0
    """No key."""
    WRITING = 1
    """A key whose store is in flight: not readable yet."""
    READY = 2
    """A key whose bytes are in the row."""


def key_matrix(hashes: Sequence[bytes], key_bytes: int) -> KeyMatrix:
    """Return `hashes` (each exactly `key_bytes` long) as a key matrix; raise
    InvalidInputError naming the first hash of another length."""
    check_count(key_bytes, field="key_bytes")
    blob = b"".join(hashes)
    if len(blob) != len(hashes) * key_bytes or (hashes and set(map(len, hashes)) != {key_bytes}):
        bad = next(h for h in hashes if len(h) != key_bytes)
        raise InvalidInputError(field="keys", expected=f"hashes of {key_bytes} bytes", got=bad)
    return key_matrix_of_blob(blob, key_bytes)


def key_matrix_of_blob(blob: bytes, key_bytes: int) -> KeyMatrix:
    """Return the key matrix of `blob`, hashes of `key_bytes` bytes back to back (one copy, no
    Python step per key); raise InvalidInputError unless its length is a multiple."""
    if key_bytes < 1 or len(blob) % key_bytes:
        raise InvalidInputError(
            field="keys", expected=f"a multiple of {key_bytes} bytes", got=len(blob)
        )
    count = len(blob) // key_bytes
    words = -(-key_bytes // 8)
    padded = np.zeros((count, words * 8), dtype=np.uint8)
    padded[:, :key_bytes] = np.frombuffer(blob, dtype=np.uint8).reshape(count, key_bytes)
    return padded.view(np.uint64).reshape(count, words)


def _slots_of(first_words: npt.NDArray[np.uint64], mask: np.uint64) -> npt.NDArray[np.int64]:
    """Return each key's home slot from its first word, mixed (hashes are near-uniform
    already; the mix spreads keys that differ only in high bytes, such as counters). Keys that
    share a first word share a home and are told apart by the rest when probed."""
    with np.errstate(over="ignore"):
        mixed = first_words * _MIX
    mixed ^= mixed >> _SHIFT
    mixed &= mask
    return mixed.astype(np.int64)


def _equal(
    columns: npt.NDArray[np.uint64], rows: IdArray, keys: npt.NDArray[np.uint64]
) -> npt.NDArray[np.bool_]:
    """Return, per entry, whether the key held at `rows[i]` is `keys[:, i]` (word columns)."""
    same: npt.NDArray[np.bool_] = columns[0][rows] == keys[0]
    for word in range(1, len(columns)):
        same &= columns[word][rows] == keys[word]
    return same


class RowTable:
    """One group's key -> row table and its row columns (see the module's docstring)."""

    def __init__(self, capacity: int, key_bytes: int) -> None:
        """Make an empty table of `capacity` rows for keys of `key_bytes` bytes."""
        check_count(capacity, field="capacity")
        check_count(key_bytes, field="key_bytes")
        if key_bytes < 1:
            raise InvalidInputError(field="key_bytes", expected="at least 1", got=key_bytes)
        self._key_bytes = key_bytes
        self._words = -(-key_bytes // 8)
        self._capacity = capacity
        self._columns = np.zeros((self._words, capacity), dtype=np.uint64)
        """Word `w` of the key each row holds, as row-indexed columns (one gather per word)."""
        self.state = np.zeros(capacity, dtype=np.uint8)
        """Each row's `RowState` (read-only for callers)."""
        self.pins = np.zeros(capacity, dtype=np.int64)
        """How many loads read each row."""
        self.recency = np.zeros(capacity, dtype=np.int64)
        """The `touch` count at each row's last touch (0: never): LRU evicts the lowest."""
        self._slot_of_row = np.full(capacity, _EMPTY, dtype=np.int64)
        self._free: IdArray = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self._num_free = capacity
        self._ticks = 0
        self._slots = np.full(_slot_count(capacity), _EMPTY, dtype=np.int64)
        self._gone = 0

    @property
    def capacity(self) -> int:
        """Return the number of rows."""
        return self._capacity

    @property
    def key_bytes(self) -> int:
        """Return the width of a key, in bytes."""
        return self._key_bytes

    @property
    def num_free(self) -> int:
        """Return how many rows hold no key."""
        return self._num_free

    # -- probing -------------------------------------------------------------------------------

    def find(self, keys: KeyMatrix) -> IdArray:
        """Return each key's row, or -1 for a key the table does not hold, in one vectorised
        probe of all `keys`."""
        self._check_keys(keys)
        rows, _ = self._probe(keys)
        return rows

    def _probe(self, keys: KeyMatrix) -> tuple[IdArray, IdArray]:
        """Return per key its row (-1: absent) and, for an absent key, the first free slot
        (empty or removed) on its probe path, where it would be inserted."""
        count = len(keys)
        rows = np.full(count, -1, dtype=np.int64)
        free_slot = np.full(count, -1, dtype=np.int64)
        if not count:
            return rows, free_slot
        mask = np.uint64(len(self._slots) - 1)
        words = np.ascontiguousarray(keys.T)
        slots = _slots_of(words[0], mask)
        active = np.arange(count)
        while len(active):
            at = slots[active]
            held = self._slots[at]
            gone = held == _GONE
            first_gone = gone & (free_slot[active] < 0)
            free_slot[active[first_gone]] = at[first_gone]
            empty = held == _EMPTY
            ended = active[empty]
            no_gone_yet = free_slot[ended] < 0
            free_slot[ended[no_gone_yet]] = at[empty][no_gone_yet]
            used = ~empty & ~gone
            candidates = active[used]
            hit = _equal(self._columns, held[used], words[:, candidates])
            rows[candidates[hit]] = held[used][hit]
            active = active[(gone | used) & ~_scatter(len(active), used, hit)]
            slots[active] = (slots[active] + 1) & int(mask)
        return rows, free_slot

    # -- lifecycle ---------------------------------------------------------------------------

    def reserve(self, keys: KeyMatrix) -> IdArray:
        """Give every key of `keys` (distinct, none held) a free row, WRITING; return the rows
        in key order. Raise InvalidInputError, changing nothing, for a repeated or held key or
        when fewer rows are free than keys (evict first)."""
        self._check_keys(keys)
        count = len(keys)
        if count > self._num_free:
            raise InvalidInputError(
                field="keys",
                expected=f"at most {self._num_free} keys (the free rows; evict first)",
                got=count,
            )
        if count > 1 and len(np.unique(keys, axis=0)) != count:
            raise InvalidInputError(field="keys", expected="distinct keys", got="a repeated key")
        if self._needs_rebuild(count):
            self._rebuild(self._live_rows().size + count)
        held, free_slot = self._probe(keys)
        if (held >= 0).any():
            index = int(np.argmax(held >= 0))
            raise InvalidInputError(
                field=f"keys[{index}]", expected="a key the table does not hold", got="held"
            )
        rows = self._free[self._num_free - count : self._num_free][::-1].copy()
        self._num_free -= count
        self._columns[:, rows] = keys.T
        self.state[rows] = RowState.WRITING
        self.pins[rows] = 0
        self.recency[rows] = 0
        self._place(rows, free_slot)
        return rows

    def complete(self, rows: IdArray, *, success: bool) -> None:
        """Finish the stores of WRITING `rows`: success makes them READY, failure frees them
        and forgets their keys. Raise InvalidInputError, changing nothing, for a row not
        WRITING."""
        rows = self._checked_rows(rows, RowState.WRITING, "complete")
        if success:
            self.state[rows] = RowState.READY
        else:
            self._release(rows)

    def pin(self, rows: IdArray) -> None:
        """Count one more load reading each of `rows` (a row listed twice, twice). Raise
        InvalidInputError, changing nothing, for a row not READY."""
        rows = self._checked_rows(rows, RowState.READY, "pin")
        np.add.at(self.pins, rows, 1)

    def unpin(self, rows: IdArray) -> None:
        """Release one pin of each of `rows`. Raise InvalidInputError, changing nothing, when a
        row is pinned fewer times than it is listed."""
        rows = self._checked_rows(rows, RowState.READY, "unpin")
        unique, listed = np.unique(rows, return_counts=True)
        short = listed > self.pins[unique]
        if short.any():
            at = int(np.argmax(short))
            raise InvalidInputError(
                field="rows",
                expected=f"row {int(unique[at])} pinned at least {int(listed[at])} times",
                got=int(self.pins[unique[at]]),
            )
        self.pins[unique] -= listed

    def touch(self, rows: IdArray) -> None:
        """Mark `rows` used now (one recency tick for the whole call)."""
        rows = self._checked_rows(rows, None, "touch")
        self._ticks += 1
        self.recency[rows] = self._ticks

    def evictable(self) -> IdArray:
        """Return the READY rows no load pins, in row order."""
        found: IdArray = np.flatnonzero((self.state == RowState.READY) & (self.pins == 0))
        return found

    def least_recent(self, count: int) -> IdArray:
        """Return up to `count` evictable rows, least recently touched first (ties by row)."""
        check_count(count, field="count")
        rows = self.evictable()
        order = np.lexsort((rows, self.recency[rows]))
        chosen: IdArray = rows[order[:count]]
        return chosen

    def evict(self, rows: IdArray) -> None:
        """Free READY unpinned `rows` and forget their keys. Raise InvalidInputError, changing
        nothing, for a row not READY or pinned."""
        rows = self._checked_rows(rows, RowState.READY, "evict")
        pinned = self.pins[rows] > 0
        if pinned.any():
            raise InvalidInputError(
                field="rows", expected="unpinned rows", got=int(rows[np.argmax(pinned)])
            )
        self._release(np.unique(rows))

    def keys_of(self, rows: IdArray) -> list[bytes]:
        """Return the key bytes of `rows` (held rows only; for events and checks)."""
        rows = self._checked_rows(rows, None, "keys_of")
        raw = np.ascontiguousarray(self._columns[:, rows].T).view(np.uint8)
        return [bytes(row[: self._key_bytes]) for row in raw]

    # -- internals -----------------------------------------------------------------------------

    def _check_keys(self, keys: object) -> None:
        if (
            not isinstance(keys, np.ndarray)
            or keys.dtype != np.uint64
            or keys.ndim != 2
            or keys.shape[1] != self._words
        ):
            raise InvalidInputError(
                field="keys",
                expected=f"a key matrix of {self._key_bytes}-byte keys (key_matrix)",
                got=getattr(keys, "shape", type(keys).__name__),
            )

    def _checked_rows(self, rows: object, state: RowState | None, call: str) -> IdArray:
        array = np.asarray(rows)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise InvalidInputError(field="rows", expected="a 1-D array of row ids", got=rows)
        array = array.astype(np.int64, copy=False)
        if array.size and (int(array.min()) < 0 or int(array.max()) >= self._capacity):
            raise InvalidInputError(
                field="rows", expected=f"rows in [0, {self._capacity})", got=array.tolist()
            )
        held = self.state[array]
        wrong = held == RowState.FREE if state is None else held != state
        if wrong.any():
            index = int(np.argmax(wrong))
            raise InvalidInputError(
                field=f"rows[{index}]",
                expected=f"a {'held' if state is None else state.name} row to {call}",
                got=RowState(int(held[index])).name,
            )
        return array

    def _place(self, rows: IdArray, free_slot: IdArray) -> None:
        """Write `rows` into the slot array at their first free slots. Keys that want the same
        slot get it one per round; the others move on along their probe paths to the next slot
        holding no key (every slot they pass holds one, so each stays reachable from home)."""
        mask = len(self._slots) - 1
        want = free_slot.copy()
        pending = np.arange(len(rows))
        while len(pending):
            _, first = np.unique(want[pending], return_index=True)
            winners = pending[first]
            at = want[winners]
            self._gone -= int((self._slots[at] == _GONE).sum())
            self._slots[at] = rows[winners]
            self._slot_of_row[rows[winners]] = at
            pending = np.setdiff1d(pending, winners, assume_unique=True)
            moving = pending
            while len(moving):
                want[moving] = (want[moving] + 1) & mask
                moving = moving[self._slots[want[moving]] >= 0]

    def _release(self, rows: IdArray) -> None:
        slots = self._slot_of_row[rows]
        self._slots[slots] = _GONE
        self._gone += len(rows)
        self._slot_of_row[rows] = _EMPTY
        self.state[rows] = RowState.FREE
        self.pins[rows] = 0
        self.recency[rows] = 0
        self._free[self._num_free : self._num_free + len(rows)] = rows
        self._num_free += len(rows)

    def _live_rows(self) -> IdArray:
        live: IdArray = np.flatnonzero(self.state != RowState.FREE)
        return live

    def _needs_rebuild(self, adding: int) -> bool:
        used = self._capacity - self._num_free
        return 2 * (used + self._gone + adding) > len(self._slots)

    def _rebuild(self, live: int) -> None:
        """Re-insert every held key into a fresh slot array (drops removed markers)."""
        rows = self._live_rows()
        self._slots = np.full(_slot_count(max(live, self._capacity)), _EMPTY, dtype=np.int64)
        self._gone = 0
        if len(rows):
            _, free_slot = self._probe(np.ascontiguousarray(self._columns[:, rows].T))
            self._place(rows, free_slot)


def _slot_count(rows: int) -> int:
    """Return the slot array's size for `rows` keys: a power of two, at least twice `rows`."""
    return 1 << max(3, (2 * max(rows, 1) - 1).bit_length())


def _scatter(
    size: int, where: npt.NDArray[np.bool_], values: npt.NDArray[np.bool_]
) -> npt.NDArray[np.bool_]:
    """Return a flag per entry of a `size`-long selection: `values` at the `where` entries,
    False elsewhere."""
    out = np.zeros(size, dtype=np.bool_)
    out[where] = values
    return out
