"""One KV-cache group's part of the CPU tier's catalog: its rows, its keys by chunk hash, what
it knows of each row as columns, and the rows a lookup found for the load that follows.

Pure bookkeeping for `kvferry.core.catalog.Catalog`, which keeps one `GroupRows` per group and
holds every rule of the tier's states; no I/O, no clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvferry.core.arrays import FEW, IdArray, assign
from kvferry.core.eviction import EvictionPolicyKind, make_policy
from kvferry.core.keys import KeyStatus, hash_width

_HIT = KeyStatus.HIT
_MISS = KeyStatus.MISS
_PENDING = KeyStatus.PENDING

Rows = IdArray | list[int]
"""Row ids: an array, or a list for a few (`FEW`)."""


class GroupRows:
    """One group's part of the tier: its rows (capacity, free list, next never-used row, rows
    held), its keys by chunk hash (row, store in flight), as row-indexed columns whether each
    row is held, ready and pinned and the hash it holds, and its eviction policy over the same
    hashes.

    Keyed by the engine's hash bytes, not by `OffloadKey`: a bytes object keeps its hash, so a
    lookup, pin or reservation of a long prompt probes the dictionary in one C-level pass (`map`
    of a bound method) and makes no key object. A prompt's keys stored together sit in
    consecutive rows, so `find` first tries that: it compares the hashes with those the
    predicted rows hold, as arrays, and reads the dictionary only for the keys that differ
    (a dictionary read slows as the tier grows past the CPU's caches; the arrays do not).
    """

    __slots__ = (
        "capacity",
        "doomed",
        "freed",
        "held",
        "key_words",
        "mark",
        "next_fresh",
        "pin_total",
        "pins",
        "policy",
        "ready",
        "row_of",
        "used",
        "width",
        "writing",
    )

    def __init__(self, capacity: int, policy: EvictionPolicyKind) -> None:
        self.capacity = capacity
        self.policy = make_policy(policy, capacity)
        self.freed: list[int] = []
        self.next_fresh = 0
        self.used = 0
        self.row_of: dict[bytes, int] = {}
        """The row of each present key (writing or ready)."""
        self.writing: dict[bytes, tuple[int, str | None]] = {}
        """Per writing key: the token position its chunk ends at, and the storing request."""
        columns = max(capacity, 1)  # one spare row: absent keys read row 0, masked
        self.ready = np.zeros(columns, dtype=np.bool_)
        """Whether each row holds a ready key (else it is free, or its key is writing)."""
        self.pins = np.zeros(columns, dtype=np.int32)
        """Loads reading each row."""
        self.mark = np.zeros(columns, dtype=np.int32)
        """Scratch: tells in one pass whether a call lists a row twice (`add_pins`)."""
        self.held = np.zeros(columns, dtype=np.bool_)
        """Whether each row holds a key (writing or ready)."""
        self.width = 0
        """The one length of every hash held so far (0: none yet; -1: they differ, or it is
        not a multiple of 8 bytes, and `find` reads the dictionary only)."""
        self.key_words = np.zeros((0, 0), dtype=np.uint64)
        """Each row's hash as `width // 8` words (made with the first key)."""
        self.pin_total = 0
        """The sum of `pins`: 0 means no row is pinned (the common case, checked first)."""
        self.doomed: set[bytes] = set()
        """Ready keys to drop once their last pin is released (a load of them failed)."""

    def take(self, count: int) -> list[int]:
        """Return `count` free rows (freed ones first, last freed first), now used."""
        self.used += count
        freed = self.freed
        reused = min(count, len(freed))
        rows = freed[len(freed) - reused :][::-1]
        del freed[len(freed) - reused :]
        fresh = self.next_fresh
        self.next_fresh = fresh + count - reused
        rows.extend(range(fresh, self.next_fresh))
        return rows

    def hold(self, hashes: list[bytes], rows: list[int]) -> None:
        """Record that `hashes` (absent) now sit in `rows` (free)."""
        if not hashes:
            return
        self.row_of.update(zip(hashes, rows, strict=True))
        assign(self.held, rows, True)
        if self.width >= 0:
            width = hash_width(hashes)
            if not self.width and width > 0 and width % 8 == 0:
                self.width = width
                self.key_words = np.zeros((len(self.held), width // 8), dtype=np.uint64)
            if width != self.width:
                self.width = -1
            elif len(rows) <= FEW:
                for row, block_hash in zip(rows, hashes, strict=True):
                    self.key_words[row] = np.frombuffer(block_hash, dtype=np.uint64)
            else:
                self.key_words[rows] = _words(hashes, width)

    def give_back(self, row: int) -> None:
        self.held[row] = False
        self.ready[row] = False
        self.used -= 1
        self.freed.append(row)

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def rows(self, hashes: Sequence[bytes]) -> Rows:
        """Return the rows of `hashes`, all present (a list for a few: `FEW`)."""
        if len(hashes) <= FEW:
            return list(map(self.row_of.__getitem__, hashes))
        return np.fromiter(map(self.row_of.__getitem__, hashes), dtype=np.int64, count=len(hashes))

    def find(self, hashes: Sequence[bytes], width: int = 0) -> IdArray:
        """Return the row of each of `hashes`, -1 for an absent key; `width` is their one
        length when the caller knows it (0: found here, reading every hash)."""
        if len(hashes) < _RUN_WORTH or self.width <= 0:
            return self._read(hashes)
        if (width or hash_width(hashes)) != self.width:
            return self._read(hashes)
        found = np.full(len(hashes), -1, dtype=np.int64)
        probe = _words(hashes, self.width)
        start, runs = 0, 0
        while start < len(hashes) and runs < _RUNS_TRIED:  # a run of rows from each miss
            anchor = self.row_of.get(hashes[start])
            runs += 1
            if anchor is None:
                start += 1
                continue
            stop = min(len(hashes), start + len(self.held) - anchor)
            rows = np.arange(anchor, anchor + stop - start)
            same = self.held[rows] & (self.key_words[rows] == probe[start:stop]).all(axis=1)
            run = max(stop - start if same.all() else int(np.argmin(same)), 1)  # anchor: found
            found[start : start + run] = rows[:run]
            start += run
        if start < len(hashes):
            found[start:] = self._read(hashes[start:])
        return found

    def _read(self, hashes: Sequence[bytes]) -> IdArray:
        """Return the rows of `hashes` read from the dictionary (one pass in C), -1: absent."""
        return np.fromiter(map(self.row_of.get, hashes, _NO_ROW), dtype=np.int64, count=len(hashes))

    def statuses_of(self, rows: IdArray, *, pinned_as_pending: bool) -> list[KeyStatus]:
        """Return the status of the key of each of `rows` (-1: MISS); with
        `pinned_as_pending`, PENDING for ready keys a load pins."""
        held = rows >= 0
        at = np.where(held, rows, 0)
        ready = self.ready[at] & held
        pinned = pinned_as_pending and self.pin_total > 0
        if not pinned and ready.all():  # a long prompt's whole prefix: one list
            return [_HIT] * len(rows)
        codes = np.where(ready, _HIT_CODE, np.where(held, _PENDING_CODE, _MISS_CODE))
        if pinned:
            codes[ready & (self.pins[at] > 0)] = _PENDING_CODE
        return list(map(_STATUS_OF_CODE.__getitem__, codes.tolist()))

    def status(self, block_hash: bytes, *, pinned_as_pending: bool = False) -> KeyStatus:
        """Return the status of one key: MISS, HIT (ready) or PENDING (writing; with
        `pinned_as_pending`, also ready and pinned)."""
        row = self.row_of.get(block_hash)
        if row is None:
            return _MISS
        if not self.ready[row] or (pinned_as_pending and self.pin_total and self.pins[row]):
            return _PENDING
        return _HIT

    def add_pins(self, rows: IdArray) -> None:
        """Count one more pin of each of `rows` (a row listed k times, k more)."""
        order = np.arange(len(rows), dtype=np.int32)
        self.mark[rows] = order  # a row listed twice keeps only its last index here
        if np.array_equal(self.mark[rows], order):  # each row once: one vectorised add
            self.pins[rows] += 1
        else:
            unique, listed = np.unique(rows, return_counts=True)
            self.pins[unique] += listed.astype(np.int32)
        self.pin_total += len(rows)

    def protection(self, asked: dict[bytes, None]) -> Callable[[object], bool]:
        """Return the predicate a policy's `choose` skips keys by: a key of `asked` (the
        same call) or one a load pins."""
        row_of, pins = self.row_of, self.pins
        return lambda h: h in asked or bool(pins[row_of[h]])  # type: ignore[index]

    def is_pinned(self, block_hash: bytes) -> bool:
        row = self.row_of.get(block_hash)
        return row is not None and self.pin_total > 0 and bool(self.pins[row] > 0)

    def clear(self) -> None:
        self.freed.clear()
        self.next_fresh = self.used = 0
        self.row_of.clear()
        self.writing.clear()
        self.doomed.clear()
        self.pins[:] = 0
        self.ready[:] = False
        self.held[:] = False
        self.pin_total = 0
        self.policy.clear()


_NO_ROW = itertools.repeat(-1)
_RUN_WORTH = 64
"""From this many keys, `find` tries runs of consecutive rows before the dictionary."""
_RUNS_TRIED = 8
"""Runs `find` tries before it reads the rest from the dictionary."""


def _words(hashes: Sequence[bytes], width: int) -> npt.NDArray[np.uint64]:
    """Return `hashes`, each `width` bytes (a multiple of 8), as rows of `width // 8` words."""
    return np.frombuffer(b"".join(hashes), dtype=np.uint64).reshape(len(hashes), width // 8)


_MISS_CODE, _HIT_CODE, _PENDING_CODE = 0, 1, 2

_STATUS_OF_CODE = {_MISS_CODE: _MISS, _HIT_CODE: _HIT, _PENDING_CODE: _PENDING}


def first_not_ready(rows: GroupRows, found: IdArray) -> int:
    """Return the index of the first of `found` (rows, -1 for an absent key) that is not a
    ready row, or -1 when all are."""
    held = found >= 0
    ready = rows.ready[np.where(held, found, 0)] & held
    return -1 if ready.all() else int(np.argmin(ready))


class FoundRows:
    """The rows a lookup found, by group, for the load that follows it to pin without finding
    them again (a long prompt's pin then reads no dictionary): given to
    `Catalog.hash_statuses` as `seen`, then to `Catalog.pin`.

    A pin's keys of one group are matched to those of one of the lookup's calls when they are
    that call's first or last ones (a prefix's load starts where its lookup did, a window's
    ends where it did), every hash equal (a comparison of the two lists, which stops at each
    entry on finding the very same object). The rows are used only while the catalog has freed
    no row since they were found (its generation is the same), so each still holds the key it
    held then; a pin checks that every row is ready, as always. Otherwise the pin finds its
    rows itself.
    """

    __slots__ = ("_generation", "_pieces")

    def __init__(self) -> None:
        self._generation = -1
        self._pieces: dict[int, list[tuple[Sequence[bytes], IdArray]]] = {}

    def add(self, group: int, hashes: Sequence[bytes], rows: IdArray, generation: int) -> None:
        """Record the `rows` found for `hashes` of `group` at the catalog's `generation`."""
        if generation != self._generation:
            self._pieces.clear()
            self._generation = generation
        self._pieces.setdefault(group, []).append((hashes, rows))

    def rows_of(self, group: int, hashes: Sequence[bytes], generation: int) -> IdArray | None:
        """Return the rows found for `hashes` of `group` (the head or the tail of the hashes of
        one lookup's call), or None."""
        if generation != self._generation or not hashes:
            return None
        for found, rows in self._pieces.get(group, ()):
            for start in (0, len(found) - len(hashes)):  # a head (a prefix), or a tail (a window)
                stop = start + len(hashes)
                if start >= 0 and found[start] is hashes[0] and found[start:stop] == hashes:
                    return rows[start:stop]
        return None
