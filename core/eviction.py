"""Eviction policies of the CPU-tier catalog: which ready keys to give up when rows run out.

Deterministic bookkeeping only: recency is the order of operations (no clock), no randomness,
no I/O; a policy never decides whether a key may go (the catalog's `protected` predicate does).

A policy orders opaque, hashable keys: the catalog keeps one policy per KV-cache group and gives
it the group's chunk hashes (the bytes the engine computed), so ordering a group's keys makes no
key object and hashes nothing twice (a bytes object keeps its hash).
"""

from __future__ import annotations

import bisect
import collections
import enum
import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Protocol

from kvferry.core.errors import InvalidInputError, member_named

PolicyKey = Hashable
"""What a policy orders: within the catalog, one group's chunk hashes."""


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

    def admit(self, key: PolicyKey, *, position: int, request: str | None) -> None:
        """Record that `key` (ending at token `position`, stored for `request`) became ready."""
        ...

    def admit_all(
        self, keys: Sequence[PolicyKey], *, positions: Sequence[int], request: str | None
    ) -> None:
        """Record that `keys` (distinct, none held; `positions[i]` where the chunk of
        `keys[i]` ends) became ready together, in that order: `admit` of each."""
        ...

    def touch(self, keys: Iterable[PolicyKey], *, request: str | None) -> None:
        """Record that `request` used `keys` now (and, when given, that `request` is active
        now); keys the policy does not hold are ignored."""
        ...

    def remove(self, key: PolicyKey) -> None:
        """Forget `key`: the catalog evicted it."""
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


def _exhaust(calls: Iterator[object]) -> None:
    """Run every call of the lazy `calls` (a `map`) without keeping a result."""
    collections.deque(calls, maxlen=0)


def _admit_each(
    policy: EvictionPolicy,
    keys: Sequence[PolicyKey],
    positions: Sequence[int],
    request: str | None,
) -> None:
    for key, position in zip(keys, positions, strict=True):
        policy.admit(key, position=position, request=request)


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
    """Least recently used first: admission and every touch make a key the most recent."""

    def __init__(self, capacity: int) -> None:
        self._order: OrderedDict[PolicyKey, None] = OrderedDict()

    def admit(self, key: PolicyKey, *, position: int, request: str | None) -> None:
        """Make `key` the most recently used."""
        self._order[key] = None
        self._order.move_to_end(key)

    def admit_all(
        self, keys: Sequence[PolicyKey], *, positions: Sequence[int], request: str | None
    ) -> None:
        """Make `keys` (none held) the most recently used, the last one most."""
        self._order.update(zip(keys, itertools.repeat(None)))

    def touch(self, keys: Iterable[PolicyKey], *, request: str | None) -> None:
        """Make each held key of `keys` the most recently used, in order."""
        order = self._order
        keys = keys if isinstance(keys, Sequence) else list(keys)
        try:  # every key held (a load's, a repeated store's): one pass in C
            _exhaust(map(order.move_to_end, keys))
        except KeyError:  # moving the held ones again, in order, gives the same final order
            for key in keys:
                if key in order:
                    order.move_to_end(key)

    def remove(self, key: PolicyKey) -> None:
        """Forget `key`."""
        self._order.pop(key, None)

    def choose(self, count: int, protected: Protected) -> list[PolicyKey] | None:
        """Return the `count` least recently used unprotected keys, or None."""
        return _first_unprotected(self._order, count, protected)

    def clear(self) -> None:
        """Forget every key."""
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)


class ArcPolicy:
    """Adaptive replacement cache over rows.

    T1 holds keys used once since admission, T2 keys used again (a load, or a repeated store);
    B1/B2 remember keys recently evicted from them. Admitting a key remembered in B1 grows the
    target size `p` of T1, one remembered in B2 shrinks it; such a key goes straight to T2.
    Victims come from T1 while it is larger than `p`, else from T2 (the other list when the
    chosen one has no unprotected key). ARC's tie rule for a request found in B2 is left out:
    the key being stored is not known when victims are chosen.
    """

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

    def admit(self, key: PolicyKey, *, position: int, request: str | None) -> None:
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

    def admit_all(
        self, keys: Sequence[PolicyKey], *, positions: Sequence[int], request: str | None
    ) -> None:
        """`admit` each of `keys`, in order."""
        _admit_each(self, keys, positions, request)

    def touch(self, keys: Iterable[PolicyKey], *, request: str | None) -> None:
        """Move each held key of `keys` to the most recent end of T2."""
        for key in keys:
            if key in self._t1:
                del self._t1[key]
                self._t2[key] = None
            elif key in self._t2:
                self._t2.move_to_end(key)

    def remove(self, key: PolicyKey) -> None:
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


class TailFirstPolicy:
    """The least recently active request's keys first, latest token position first.

    Every key belongs to the request that last stored or used it (`request`; keys given none
    share one anonymous owner). Requests are ordered by their last activity; within one, keys
    are ordered by the token position where their chunk ends, across groups, so a request's
    tail goes before its head (a prefix is useful only from its start). A request storing its
    prompt chunk by chunk keeps its head as recent as its tail.
    """

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

    def admit(self, key: PolicyKey, *, position: int, request: str | None) -> None:
        """Give `key` to `request` and make that request the most recently active."""
        if key in self._where:
            self._drop(key)
        self._admitted += 1
        self._insert(key, request, position, self._admitted)
        self._owners.move_to_end(request)

    def admit_all(
        self, keys: Sequence[PolicyKey], *, positions: Sequence[int], request: str | None
    ) -> None:
        """`admit` each of `keys`, in order."""
        _admit_each(self, keys, positions, request)

    def touch(self, keys: Iterable[PolicyKey], *, request: str | None) -> None:
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

    def remove(self, key: PolicyKey) -> None:
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
