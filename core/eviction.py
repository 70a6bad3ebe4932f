"""Eviction policies of the CPU-tier catalog: which ready keys to give up when rows run out.

Deterministic bookkeeping only: recency is the order of operations (no clock), no randomness,
no I/O; a policy never decides whether a key may go (the catalog's `protected` predicate does).

A policy orders opaque, hashable keys: the catalog keeps one policy per KV-cache group and gives
it the group's chunk hashes (the bytes the engine computed), so ordering a group's keys makes no
key object and hashes nothing twice (a bytes object keeps its hash).
"""

from __future__ import annotations

import abc
import bisect
import enum
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvferry.core.arrays import FEW
from kvferry.core.errors import InvalidInputError, member_named

PolicyKey = Hashable
"""What a policy orders: within the catalog, one group's chunk hashes."""
RowIds = Sequence[int] | npt.NDArray[np.int64]
"""The catalog's rows of a call's keys, one per key."""


class EvictionPolicyKind(enum.Enum):
    """The eviction policies a catalog can use; the value is the name used in configuration."""

    LRU = "lru"
    """Least recently used key first."""
    ARC = "arc"
    """Adaptive replacement cache (Megiddo & Modha): balances recency against reuse."""
    TAIL_FIRST = "tail_first"
    """Least recently active request first, and within it the latest token positions first."""

    @classmethod
    def from_name(cls, name: str) -> EvictionPolicyKind:
        """Return the kind named `name` (e.g. "lru"), or raise InvalidInputError with the
        closest known names."""
        return member_named(cls, name, field="policy")


Protected = Callable[[PolicyKey], bool]
"""Says whether a key must not be evicted now (pinned, or among the keys of the same call)."""


class EvictionPolicy(Protocol):
    """Orders the catalog's ready keys for eviction; it sees only ready keys.

    The catalog calls `admit` when a store makes a key ready, `touch` when ready keys are used
    (pinned for a load, or asked to be stored again), `remove` when it evicts a key, and `choose`
    to pick victims. `choose` changes nothing, so a reservation can stay all-or-nothing.
    """

    follows_requests: bool
    """Whether the policy orders keys by their requests' activity: it must then hear of a
    request's activity even in a call that uses none of its keys."""

    def admit(self, key: PolicyKey, *, row: int, position: int, request: str | None) -> None:
        """Record that `key` (in `row`, ending at token `position`, stored for `request`)
        became ready."""
        ...

    def admit_all(
        self,
        keys: Sequence[PolicyKey],
        *,
        rows: RowIds,
        positions: Sequence[int],
        request: str | None,
    ) -> None:
        """Record that `keys` (distinct, none held; `rows[i]` the row of `keys[i]`,
        `positions[i]` where its chunk ends) became ready together, in that order: `admit` of
        each."""
        ...

    def touch(
        self,
        keys: Iterable[PolicyKey],
        *,
        rows: RowIds = (),
        request: str | None,
    ) -> None:
        """Record that `request` used `keys` (in `rows`, one per key) now (and, when given,
        that `request` is active now); keys the policy does not hold are ignored."""
        ...

    def remove(self, key: PolicyKey, *, row: int) -> None:
        """Forget `key` (in `row`): the catalog evicted it."""
        ...

    def choose(self, count: int, protected: Protected) -> list[PolicyKey] | None:
        """Return `count` unprotected keys, first victim first, or None when there are fewer;
        nothing is changed."""
        ...

    def clear(self) -> None:
        """Forget every key (and any history)."""
        ...

    def __len__(self) -> int:
        """Return the number of keys held."""
        ...


class _AdmitsEach(abc.ABC):
    """Admits a call's keys one `admit` at a time (policies with no faster way)."""

    @abc.abstractmethod
    def admit(self, key: PolicyKey, *, row: int = -1, position: int, request: str | None) -> None:
        """Record that `key` became ready (see `EvictionPolicy.admit`)."""

    def admit_all(
        self,
        keys: Sequence[PolicyKey],
        *,
        rows: RowIds,
        positions: Sequence[int],
        request: str | None,
    ) -> None:
        """`admit` each of `keys`, in order."""
        for key, row, position in zip(keys, np.asarray(rows).tolist(), positions, strict=True):
            self.admit(key, row=row, position=position, request=request)


def _first_unprotected(
    keys: Iterable[PolicyKey], count: int, protected: Protected
) -> list[PolicyKey] | None:
    if count <= 0:
        return []
    victims: list[PolicyKey] = []
    for key in keys:
        if not protected(key):
            victims.append(key)
            if len(victims) == count:
                return victims
    return None


class LruPolicy:
    """Least recently used first: admission and every touch make a key the most recent.

    Recency is a column indexed by each key's row (the catalog's row in the group), written for
    all of a call's rows at once: a long prompt's load touches thousands of keys in a few array
    operations. Victims come, oldest first, from a queue of the oldest rows sorted by recency,
    taken again only when it cannot answer: a row touched or removed after the queue was taken
    has a new recency (or none) and is passed over, and a row admitted or touched since is newer
    than every row still in the queue, so the queue's valid rows are the oldest of all.
    """

    follows_requests = False
    QUEUE_ROWS = 4096
    """The fewest oldest rows a queue takes (more when a call asks for more victims)."""

    def __init__(self, capacity: int) -> None:
        self._recency = np.zeros(capacity, dtype=np.int64)
        """Per row, the clock of its key's last admission or touch; 0: no key held."""
        self._keys = np.empty(capacity, dtype=object)
        """Per row, the key it holds."""
        self._clock = 0
        self._held = 0
        self._queue: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        self._queued: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        """The queue's rows, oldest first, and their recency when it was taken."""
        self._queue_whole = True
        """Whether the queue held every row with a key when it was taken."""

    def admit(self, key: PolicyKey, *, row: int, position: int, request: str | None) -> None:
        """Make `key` (in `row`) the most recently used."""
        self.admit_all([key], rows=[row], positions=[position], request=request)

    def admit_all(
        self,
        keys: Sequence[PolicyKey],
        *,
        rows: RowIds,
        positions: Sequence[int],
        request: str | None,
    ) -> None:
        """Make `keys` (in `rows`, none held) the most recently used, the last one most."""
        if len(rows) <= FEW:  # a store's few chunks: entry by entry
            recency, held_keys = self._recency, self._keys
            for key, row in zip(keys, rows, strict=True):
                self._held += not recency[row]
                self._clock += 1
                recency[row] = self._clock
                held_keys[row] = key
            self._queue_whole = self._queue_whole and not len(rows)
            return
        at = np.asarray(rows, dtype=np.int64)
        self._held += int(np.count_nonzero(self._recency[at] == 0))
        self._stamp(at)
        self._keys[at] = keys

    def touch(
        self,
        keys: Iterable[PolicyKey],
        *,
        rows: RowIds = (),
        request: str | None,
    ) -> None:
        """Make each held key of `keys` (in `rows`) the most recently used, in order."""
        if not len(rows):
            return
        at = np.asarray(rows, dtype=np.int64)
        self._stamp(at[self._recency[at] > 0])

    def _stamp(self, rows: npt.NDArray[np.int64]) -> None:
        """Give `rows` the next clock values, in order (a row listed twice keeps the later)."""
        if len(rows):
            self._recency[rows] = np.arange(self._clock + 1, self._clock + 1 + len(rows))
            self._clock += len(rows)
            self._queue_whole = False  # these rows are newer than the queue, or not in it

    def remove(self, key: PolicyKey, *, row: int) -> None:
        """Forget `key` (in `row`)."""
        if self._recency[row]:
            self._held -= 1
            self._recency[row] = 0
            self._keys[row] = None

    def choose(self, count: int, protected: Protected) -> list[PolicyKey] | None:
        """Return the `count` least recently used unprotected keys, or None."""
        if count <= 0:
            return []
        while True:
            valid = self._queue[self._recency[self._queue] == self._queued]
            victims = _first_unprotected(self._keys[valid], count, protected)
            if victims is not None or self._queue_whole:
                return victims
            self._take_queue(max(self.QUEUE_ROWS, 4 * count, 2 * len(self._queue)))

    def _take_queue(self, size: int) -> None:
        """Queue the `size` oldest rows with a key (all of them when fewer), oldest first."""
        held = np.flatnonzero(self._recency)
        if size < len(held):
            held = held[np.argpartition(self._recency[held], size)[:size]]
        self._queue = held[np.argsort(self._recency[held])]
        self._queued = self._recency[self._queue]
        self._queue_whole = len(self._queue) == self._held

    def clear(self) -> None:
        """Forget every key."""
        self._recency[:] = 0
        self._keys[:] = None
        self._held = 0
        self._queue = self._queued = np.zeros(0, dtype=np.int64)
        self._queue_whole = True

    def __len__(self) -> int:
        return self._held


class ArcPolicy(_AdmitsEach):
    """Adaptive replacement cache over rows.

    T1 holds keys used once since admission, T2 keys used again (a load, or a repeated store);
    B1/B2 remember keys recently evicted from them. Admitting a key remembered in B1 grows the
    target size `p` of T1, one remembered in B2 shrinks it; such a key goes straight to T2.
    Victims come from T1 while it is larger than `p`, else from T2 (the other list when the
    chosen one has no unprotected key). ARC's tie rule for a request found in B2 is left out:
    the key being stored is not known when victims are chosen.
    """

    follows_requests = False

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._p = 0
        self._t1: OrderedDict[PolicyKey, None] = OrderedDict()
        self._t2: OrderedDict[PolicyKey, None] = OrderedDict()
        self._b1: OrderedDict[PolicyKey, None] = OrderedDict()
        self._b2: OrderedDict[PolicyKey, None] = OrderedDict()

    @property
    def target_t1(self) -> int:
        """Return `p`, the size ARC currently aims at for T1 (keys used once)."""
        return self._p

    def lists(self) -> tuple[tuple[PolicyKey, ...], ...]:
        """Return (T1, T2, B1, B2), each least recent first (for tests and debugging)."""
        return tuple(tuple(d) for d in (self._t1, self._t2, self._b1, self._b2))

    def _trim_ghosts(self) -> None:
        c = self._capacity
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)

    def admit(self, key: PolicyKey, *, row: int = -1, position: int, request: str | None) -> None:
        """Put `key` in T1, or in T2 (adapting `p`) when a ghost list remembers it."""
        if key in self._t1 or key in self._t2:
            self.touch((key,), request=request)
            return
        if key in self._b1:
            self._p = min(self._capacity, self._p + max(1, len(self._b2) // len(self._b1)))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0, self._p - max(1, len(self._b1) // len(self._b2)))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def touch(
        self,
        keys: Iterable[PolicyKey],
        *,
        rows: RowIds = (),
        request: str | None,
    ) -> None:
        """Move each held key of `keys` to the most recent end of T2."""
        for key in keys:
            if key in self._t1:
                del self._t1[key]
                self._t2[key] = None
            elif key in self._t2:
                self._t2.move_to_end(key)

    def remove(self, key: PolicyKey, *, row: int = -1) -> None:
        """Move an evicted key to the ghost list of the list it was in."""
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            self._b2[key] = None
        self._trim_ghosts()

    def choose(self, count: int, protected: Protected) -> list[PolicyKey] | None:
        """Return `count` victims by ARC's replacement rule, or None."""
        if count <= 0:
            return []
        from_t1 = (key for key in self._t1 if not protected(key))
        from_t2 = (key for key in self._t2 if not protected(key))
        next1, next2 = next(from_t1, None), next(from_t2, None)
        t1_size = len(self._t1)
        victims: list[PolicyKey] = []
        while len(victims) < count:
            if next1 is not None and (t1_size > self._p or next2 is None):
                victims.append(next1)
                t1_size -= 1
                next1 = next(from_t1, None)
            elif next2 is not None:
                victims.append(next2)
                next2 = next(from_t2, None)
            else:
                return None
        return victims

    def clear(self) -> None:
        """Forget every key, the ghost lists and the adaptation."""
        for d in (self._t1, self._t2, self._b1, self._b2):
            d.clear()
        self._p = 0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


class TailFirstPolicy(_AdmitsEach):
    """The least recently active request's keys first, latest token position first.

    Every key belongs to the request that last stored or used it (`request`; keys given none
    share one anonymous owner). Requests are ordered by their last activity; within one, keys
    are ordered by the token position where their chunk ends, across groups, so a request's
    tail goes before its head (a prefix is useful only from its start). A request storing its
    prompt chunk by chunk keeps its head as recent as its tail.
    """

    follows_requests = True

    def __init__(self, capacity: int) -> None:
        self._owners: OrderedDict[str | None, list[tuple[int, int]]] = OrderedDict()
        """Per owner, least recently active first: (position, admission number), ascending."""
        self._where: dict[PolicyKey, tuple[str | None, int, int]] = {}
        self._key_of: dict[int, PolicyKey] = {}
        self._admitted = 0

    def _insert(self, key: PolicyKey, owner: str | None, position: int, number: int) -> None:
        bisect.insort(self._owners.setdefault(owner, []), (position, number))
        self._where[key] = (owner, position, number)
        self._key_of[number] = key

    def _drop(self, key: PolicyKey) -> tuple[int, int]:
        owner, position, number = self._where.pop(key)
        del self._key_of[number]
        entries = self._owners[owner]
        del entries[bisect.bisect_left(entries, (position, number))]
        if not entries:
            del self._owners[owner]
        return position, number

    def admit(self, key: PolicyKey, *, row: int = -1, position: int, request: str | None) -> None:
        """Give `key` to `request` and make that request the most recently active."""
        if key in self._where:
            self._drop(key)
        self._admitted += 1
        self._insert(key, request, position, self._admitted)
        self._owners.move_to_end(request)

    def touch(
        self,
        keys: Iterable[PolicyKey],
        *,
        rows: RowIds = (),
        request: str | None,
    ) -> None:
        """Give each held key of `keys` to `request` (when given) and make the owners of the
        keys, then `request`, the most recently active."""
        for key in keys:
            where = self._where.get(key)
            if where is None:
                continue
            owner = where[0]
            if request is not None and owner != request:
                position, number = self._drop(key)
                self._insert(key, request, position, number)
                owner = request
            self._owners.move_to_end(owner)
        if request in self._owners:
            self._owners.move_to_end(request)

    def remove(self, key: PolicyKey, *, row: int = -1) -> None:
        """Forget `key`."""
        if key in self._where:
            self._drop(key)

    def _order(self) -> Iterator[PolicyKey]:
        for entries in self._owners.values():
            for _, number in reversed(entries):
                yield self._key_of[number]

    def choose(self, count: int, protected: Protected) -> list[PolicyKey] | None:
        """Return `count` victims, tails of the least recently active requests first, or None."""
        return _first_unprotected(self._order(), count, protected)

    def clear(self) -> None:
        """Forget every key."""
        self._owners.clear()
        self._where.clear()
        self._key_of.clear()

    def __len__(self) -> int:
        return len(self._where)


_POLICIES: dict[EvictionPolicyKind, Callable[[int], EvictionPolicy]] = {
    EvictionPolicyKind.LRU: LruPolicy,
    EvictionPolicyKind.ARC: ArcPolicy,
    EvictionPolicyKind.TAIL_FIRST: TailFirstPolicy,
}


def make_policy(kind: EvictionPolicyKind, capacity: int) -> EvictionPolicy:
    """Return a new, empty policy of `kind` for a catalog of `capacity` rows."""
    if not isinstance(kind, EvictionPolicyKind):
        raise InvalidInputError(field="policy", expected="an EvictionPolicyKind", got=kind)
    return _POLICIES[kind](capacity)
