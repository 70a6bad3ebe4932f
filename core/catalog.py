"""The catalog of the CPU tier: which key sits in which row, writing, ready or pinned by loads.

The one stateful object of the scheduler side; it changes only when called, and does no I/O,
reads no clock and draws no random number (recency is the order of operations).
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import attrs
import numpy as np

from kvferry.core.arrays import IdArray, arrays_equal, frozen_ids
from kvferry.core.errors import InvalidInputError, PlanInvariantError
from kvferry.core.eviction import EvictionPolicyKind, make_policy
from kvferry.core.keys import KeyStatus, OffloadKey

_HIT = KeyStatus.HIT
_MISS = KeyStatus.MISS
_PENDING = KeyStatus.PENDING


def _check_int(field: str, value: object, low: int, group: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidInputError(
            group=group, field=field, expected=f"an integer >= {low}", got=value
        )
    return value


def rows_for_budget(
    budget_bytes: int,
    row_pitches: int | Sequence[int],
    *,
    weights: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """Return the rows of each group that fit in `budget_bytes` bytes, one row of group `g`
    taking `row_pitches[g]` bytes (`KVLayout.row_pitches`; one int: one group).

    The rule: every group holds the same number of chunks, `n = budget // sum(pitches)`, since
    a prefix is served only when every group has its chunks; `weights` (one integer >= 1 per
    group) give group `g` `weights[g] * n` rows instead, with `n = budget // sum(w * pitch)`.
    Raise InvalidInputError for a negative budget, a pitch below 1, or weights that are not one
    integer >= 1 per group.
    """
    _check_int("budget_bytes", budget_bytes, 0)
    pitches = (row_pitches,) if isinstance(row_pitches, int) else tuple(row_pitches)
    if not pitches:
        raise InvalidInputError(field="row_pitches", expected="one pitch per group", got=pitches)
    for g, pitch in enumerate(pitches):
        _check_int("row_pitches", pitch, 1, g)
    shares = (1,) * len(pitches) if weights is None else tuple(weights)
    if len(shares) != len(pitches):
        raise InvalidInputError(
            field="weights", expected=f"one weight per group ({len(pitches)})", got=shares
        )
    for g, weight in enumerate(shares):
        _check_int("weights", weight, 1, g)
    chunks = budget_bytes // sum(w * p for w, p in zip(shares, pitches, strict=True))
    return tuple(w * chunks for w in shares)


def _capacity(value: object) -> int | tuple[int, ...]:
    return tuple(value) if isinstance(value, list) else value  # type: ignore[return-value]


def _check_capacity(
    instance: object, attribute: attrs.Attribute[int | tuple[int, ...]], value: object
) -> None:
    if isinstance(value, tuple) and value:
        for g, rows in enumerate(value):
            _check_int(attribute.name, rows, 0, g)
        return
    if isinstance(value, tuple):
        raise InvalidInputError(field=attribute.name, expected="one count per group", got=value)
    _check_int(attribute.name, value, 0)


@attrs.frozen(kw_only=True)
class CatalogConfig:
    """How big the CPU tier is and how it chooses what to evict."""

    capacity_rows: int | tuple[int, ...] = attrs.field(
        converter=_capacity, validator=_check_capacity
    )
    """Rows of each group (one chunk each; every group has its own rows): one count for every
    group, or one per group; `rows_for_budget` derives them from a byte budget."""
    policy: EvictionPolicyKind = attrs.field(
        default=EvictionPolicyKind.LRU,
        validator=attrs.validators.instance_of(EvictionPolicyKind),
    )
    """Which ready keys go first when rows run out."""
    record_events: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """Keep stored/removed events for `drain_events` (off: nothing accumulates undrained)."""

    def group_rows(self, group: int) -> int:
        """Return the rows of `group`; raise InvalidInputError for a group the per-group
        counts do not name."""
        rows = self.capacity_rows
        if isinstance(rows, int):
            return rows
        if not 0 <= group < len(rows):
            raise InvalidInputError(
                group=group,
                field="capacity_rows",
                expected=f"a group below {len(rows)} (the tier's groups)",
                got=group,
            )
        return rows[group]

    @property
    def least_rows(self) -> int:
        """Return the rows of the group that has the fewest."""
        rows = self.capacity_rows
        return rows if isinstance(rows, int) else min(rows)


class KeyState(enum.Enum):
    """Where a key present in the catalog stands."""

    WRITING = "writing"
    """A row is reserved and a store is in flight: not readable, never evicted."""
    READY = "ready"
    """Readable; evictable unless pinned by loads."""


@attrs.frozen(kw_only=True)
class CatalogEntry:
    """What the catalog holds for one present key (a snapshot)."""

    state: KeyState
    """Writing or ready."""
    row: int
    """The key's CPU row, among its group's rows."""
    pins: int
    """Loads reading the key now (a pinned key is ready and never evicted)."""


class EventKind(enum.Enum):
    """What happened to the keys of an event."""

    STORED = "stored"
    """The keys became readable (their store succeeded)."""
    REMOVED = "removed"
    """The readable keys left the tier (evicted, or dropped by a reset)."""


@attrs.frozen(kw_only=True)
class CatalogEvent:
    """Keys of one group that were stored or removed, in the order it happened."""

    kind: EventKind
    """Stored or removed."""
    group: int
    """The KV-cache group of every key of `keys`."""
    keys: tuple[OffloadKey, ...]
    """The keys, in the order the catalog handled them."""


@attrs.frozen(kw_only=True)
class CatalogCounters:
    """Running totals since the catalog was made (a reset keeps them), and the rows in use."""

    hits: int
    """Keys pinned for loads (chunks read from the tier)."""
    misses: int
    """Keys a reservation had to give a row (chunks the tier lacked when asked to store)."""
    stores: int
    """Keys made ready by a successful store."""
    failed_stores: int
    """Keys forgotten because their store failed."""
    evictions: int
    """Ready keys evicted to make room."""
    rows_used: int
    """Rows held now, by writing and ready keys, all groups together."""
    capacity_rows: int | tuple[int, ...]
    """Rows of each group (`CatalogConfig.capacity_rows`)."""
    group_rows_used: tuple[int, ...] = ()
    """Rows held now per group, for every group up to the highest the tier has seen or
    configures."""
    group_capacity_rows: tuple[int, ...] = ()
    """Rows of each group of `group_rows_used`."""


@attrs.frozen(kw_only=True)
class Reservation:
    """The rows a reservation gave: one per key the tier lacked, in the order asked (each
    among its key's group's rows)."""

    keys: tuple[OffloadKey, ...]
    """The keys that got a row (now writing); keys already present are left out."""
    rows: IdArray = attrs.field(converter=frozen_ids, eq=attrs.cmp_using(eq=arrays_equal))
    """The row of each key of `keys`, same order."""
    evicted: tuple[OffloadKey, ...] = ()
    """Ready keys evicted to make the room, first victim first."""
    evicted_rows: IdArray = attrs.field(
        default=(), converter=frozen_ids, eq=attrs.cmp_using(eq=arrays_equal)
    )
    """The row each key of `evicted` held: its bytes are still there until the reservation's
    store overwrites them (a tier below may copy them out first)."""

    def __attrs_post_init__(self) -> None:
        if self.rows.shape != (len(self.keys),):
            raise PlanInvariantError(
                field="rows", expected=f"one row per key ({len(self.keys)})", got=self.rows.shape
            )
        if self.evicted_rows.shape != (len(self.evicted),):
            raise PlanInvariantError(
                field="evicted_rows",
                expected=f"one row per evicted key ({len(self.evicted)})",
                got=self.evicted_rows.shape,
            )


_P = ParamSpec("_P")
_R = TypeVar("_R")
Lock = AbstractContextManager[Any]
"""A re-entrant lock (a `threading.RLock`); the core takes it, it never makes one."""


class Guarded(Protocol):
    """An object whose public calls hold its `_lock` when it has one (`locked_method`)."""

    _lock: Lock | None


_G = TypeVar("_G", bound=Guarded)


def locked_method(method: Callable[Concatenate[_G, _P], _R]) -> Callable[Concatenate[_G, _P], _R]:
    """Return `method` holding its object's lock for the whole call (none: a plain call)."""

    def call(self: _G, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        lock = self._lock
        if lock is None:
            return method(self, *args, **kwargs)
        with lock:
            return method(self, *args, **kwargs)

    functools.update_wrapper(call, method)  # its name and docstring
    return call


class _GroupRows:
    """One group's rows: capacity, free list, next never-used row, rows held, its policy."""

    __slots__ = ("capacity", "freed", "next_fresh", "policy", "used")

    def __init__(self, capacity: int, policy: EvictionPolicyKind) -> None:
        self.capacity = capacity
        self.policy = make_policy(policy, capacity)
        self.freed: list[int] = []
        self.next_fresh = 0
        self.used = 0

    def take(self) -> int:
        self.used += 1
        if self.freed:
            return self.freed.pop()
        row = self.next_fresh
        self.next_fresh += 1
        return row

    def give_back(self, row: int) -> None:
        self.used -= 1
        self.freed.append(row)

    @property
    def free(self) -> int:
        return self.capacity - self.used


def _by_group(keys: Iterable[OffloadKey]) -> dict[int, list[OffloadKey]]:
    grouped: dict[int, list[OffloadKey]] = {}
    for key in keys:
        grouped.setdefault(key.group, []).append(key)
    return grouped


class Catalog:
    """The CPU tier's bookkeeping: rows, key states, pins, eviction, events and counters.

    Every group has its own rows (`CatalogConfig.group_rows`), free list and eviction policy:
    a key takes a row of its group, and making room evicts only keys of the same group.

    It is a `StoreTierView` (and so a `KeyStatusView`): the planner may read it directly.
    Every changing method either does all it says or raises and changes nothing.

    Given a `lock` (a re-entrant lock such as `threading.RLock()`), every public call holds it,
    so threads may share the catalog; without one it is for one thread. An `OffloadSession`
    gives the catalog its own lock when it has none.
    """

    def __init__(self, config: CatalogConfig, *, lock: Lock | None = None) -> None:
        if not isinstance(config, CatalogConfig):
            raise InvalidInputError(field="config", expected="a CatalogConfig", got=config)
        self._lock = lock
        self._config = config
        self._groups: dict[int, _GroupRows] = {}
        """Per group seen (or configured), its rows; made on first use."""
        if isinstance(config.capacity_rows, tuple):
            for g in range(len(config.capacity_rows)):
                self._group(g)
        self._status: dict[OffloadKey, KeyStatus] = {}
        """HIT for ready keys, PENDING for writing ones: `statuses` is one dict lookup a key."""
        self._rows: dict[OffloadKey, int] = {}
        self._pins: dict[OffloadKey, int] = {}
        self._writing: dict[OffloadKey, tuple[int, str | None]] = {}
        """Per writing key: the token position its chunk ends at, and the storing request."""
        self._doomed: set[OffloadKey] = set()
        """Ready keys to drop once their last pin is released (a load of them failed)."""
        self._events: list[CatalogEvent] = []
        self._hits = self._misses = self._stores = self._failed = self._evictions = 0

    @property
    def config(self) -> CatalogConfig:
        """Return the configuration the catalog was made with."""
        return self._config

    @property
    def lock(self) -> Lock | None:
        """Return the lock every public call holds, or None (one thread only)."""
        return self._lock

    def use_lock(self, lock: Lock) -> None:
        """Make every public call hold `lock` (re-entrant) from now on; call it before another
        thread uses the catalog. Raise InvalidInputError when the catalog has another lock."""
        if self._lock is not None and self._lock is not lock:
            raise InvalidInputError(
                field="lock", expected="the catalog's own lock (it has one)", got=lock
            )
        self._lock = lock

    @property
    def capacity_rows(self) -> int | tuple[int, ...]:
        """Return the rows of each group (`CatalogConfig.capacity_rows`)."""
        return self._config.capacity_rows

    def group_capacity(self, group: int) -> int:
        """Return the rows of `group` (InvalidInputError for a group the tier lacks)."""
        return self._config.group_rows(group)

    @property
    @locked_method
    def rows_used(self) -> int:
        """Return the number of rows held by writing and ready keys, all groups together."""
        return len(self._rows)

    @locked_method
    def free_rows(self, group: int) -> int:
        """Return the number of rows of `group` no key holds."""
        return self._group(group).free

    # -- reading -------------------------------------------------------------------------------

    @locked_method
    def statuses(
        self, keys: Sequence[OffloadKey], *, pinned_as_pending: bool = False
    ) -> list[KeyStatus]:
        """Return per key HIT (ready), PENDING (writing) or MISS (absent); with
        `pinned_as_pending`, PENDING also for ready keys that a load is reading."""
        get = self._status.get
        if not pinned_as_pending or not self._pins:
            return list(map(get, keys, itertools.repeat(_MISS)))  # no Python frame per key
        pins = self._pins
        return [_PENDING if key in pins else get(key, _MISS) for key in keys]

    @locked_method
    def entry(self, key: OffloadKey) -> CatalogEntry | None:
        """Return what the catalog holds for `key`, or None when the key is absent."""
        status = self._status.get(key)
        if status is None:
            return None
        return CatalogEntry(
            state=KeyState.READY if status is _HIT else KeyState.WRITING,
            row=self._rows[key],
            pins=self._pins.get(key, 0),
        )

    @locked_method
    def snapshot(self) -> dict[OffloadKey, CatalogEntry]:
        """Return every present key's entry (a copy; for checks and debugging, not hot paths)."""
        return {key: entry for key in self._status if (entry := self.entry(key)) is not None}

    @locked_method
    def is_pinned(self, key: OffloadKey) -> bool:
        """Return True when a load is reading `key`."""
        return key in self._pins

    @locked_method
    def counters(self) -> CatalogCounters:
        """Return the running totals and the rows in use now (in all and per group)."""
        known = range(max(self._groups, default=-1) + 1)
        return CatalogCounters(
            group_rows_used=tuple(self._group(g).used for g in known),
            group_capacity_rows=tuple(self._group(g).capacity for g in known),
            hits=self._hits,
            misses=self._misses,
            stores=self._stores,
            failed_stores=self._failed,
            evictions=self._evictions,
            rows_used=len(self._rows),
            capacity_rows=self._config.capacity_rows,
        )

    def view(self, *, pinned_as_pending: bool = False) -> CatalogView:
        """Return a read-only view of this catalog for the planner.

        With `pinned_as_pending`, keys that a load is reading answer PENDING instead of HIT: a
        second request with the same prefix then retries until the first load has put the
        blocks on the GPU, where the engine's prefix cache finds them.
        """
        return CatalogView(self, pinned_as_pending=pinned_as_pending)

    # -- stores --------------------------------------------------------------------------------

    def _victims(self, keys: Iterable[OffloadKey]) -> tuple[list[OffloadKey], list[OffloadKey]]:
        """Return (the distinct absent keys of `keys`, the victims making room), or raise
        _NoRoom."""
        asked = dict.fromkeys(keys)
        status = self._status
        new = [key for key in asked if key not in status]
        if isinstance(self._config.capacity_rows, tuple) and new:  # refuse an unknown group
            self._group(max(key.group for key in new))
        if len(new) <= self._least_free():
            return new, []
        pins = self._pins
        victims: list[OffloadKey] = []
        for g, group_new in _by_group(new).items():
            rows = self._group(g)
            need = len(group_new) - rows.free
            if need <= 0:
                continue
            chosen = rows.policy.choose(need, lambda key: key in pins or key in asked)
            if chosen is None:
                raise _NoRoomError
            victims += chosen
        return new, victims

    def _least_free(self) -> int:
        """Return the free rows of the group with the fewest (groups unseen yet: all free)."""
        free = min((rows.free for rows in self._groups.values()), default=-1)
        unseen = self._config.least_rows
        return unseen if free < 0 else min(free, unseen)

    def _group(self, group: int) -> _GroupRows:
        rows = self._groups.get(group)
        if rows is None:
            rows = _GroupRows(self._config.group_rows(group), self._config.policy)
            self._groups[group] = rows
        return rows

    def _touch(self, keys: Sequence[OffloadKey], request: str | None) -> None:
        """Tell each group's policy of its keys (and every policy of `request`'s activity)."""
        grouped = _by_group(keys)
        for g, rows in self._groups.items():
            rows.policy.touch(grouped.get(g, ()), request=request)

    @locked_method
    def can_reserve(self, keys: Sequence[OffloadKey]) -> bool:
        """Return True when every key of `keys` that is absent can get a row, evicting only
        ready, unpinned keys outside `keys` (what `reserve` would do; nothing changes)."""
        if len(keys) <= self._least_free():  # room even if every key is absent: no search
            return True
        try:
            self._victims(keys)
        except _NoRoomError:
            return False
        return True

    @locked_method
    def reserve(
        self,
        keys: Sequence[OffloadKey],
        *,
        positions: Sequence[int] | None = None,
        request: str | None = None,
    ) -> Reservation | None:
        """Reserve rows for the keys of `keys` the tier lacks; return them, or None for no room.

        All or nothing: present keys (writing or ready) are skipped; the absent ones become
        writing, in rows that are free or freed by evicting ready, unpinned keys outside `keys`.
        When that cannot make enough room, nothing changes and the answer is None. Otherwise the
        ready present keys count as used, and `request` as active, before victims are chosen.
        `positions[i]` is the token index where the chunk of `keys[i]` ends (the tail-first
        policy evicts later positions first); `request` is the request storing them. Raise
        InvalidInputError, changing nothing, for a key given twice or positions that do not
        match the keys.
        """
        if positions is not None and len(positions) != len(keys):
            raise InvalidInputError(
                request=request,
                field="positions",
                expected=f"one position per key ({len(keys)})",
                got=len(positions),
            )
        if len(set(keys)) != len(keys):  # one row would stand for two chunks: refuse it
            raise InvalidInputError(
                request=request,
                field="keys",
                expected="each key once",
                got=[str(key) for key in keys],
            )
        try:
            new, victims = self._victims(keys)
        except _NoRoomError:
            return None
        present_ready = [key for key in keys if self._status.get(key) is _HIT]
        self._touch(present_ready, request)
        if victims:  # the touch may reorder the candidates, never their number
            new, victims = self._victims(keys)
        victim_rows = [self._rows[key] for key in victims]
        for key in victims:
            self._evict(key)
        if victims:
            self._record(EventKind.REMOVED, victims)
        position_of = dict(zip(keys, positions, strict=True)) if positions is not None else {}
        rows = []
        for key in new:
            row = self._group(key.group).take()
            self._rows[key] = row
            self._status[key] = _PENDING
            self._writing[key] = (position_of.get(key, 0), request)
            rows.append(row)
        self._misses += len(new)
        return Reservation(
            keys=tuple(new), rows=rows, evicted=tuple(victims), evicted_rows=victim_rows
        )

    @locked_method
    def complete_store(self, keys: Sequence[OffloadKey], *, success: bool) -> None:
        """Finish the store of `keys` (all writing): success makes them ready, failure forgets
        them and frees their rows. Raise PlanInvariantError, changing nothing, when a key is
        not writing."""
        keys = list(dict.fromkeys(keys))
        writing = self._writing
        for key in keys:
            if key not in writing:
                raise PlanInvariantError(
                    group=key.group,
                    field="keys",
                    expected="keys being written (reserved, store in flight)",
                    got=f"{key} ({self._describe(key)})",
                )
        if success:
            for key in keys:
                position, request = writing.pop(key)
                self._status[key] = _HIT
                self._groups[key.group].policy.admit(key, position=position, request=request)
            self._stores += len(keys)
            self._record(EventKind.STORED, keys)
        else:
            for key in keys:
                del writing[key]
                del self._status[key]
                self._groups[key.group].give_back(self._rows.pop(key))
            self._failed += len(keys)

    # -- loads ---------------------------------------------------------------------------------

    @locked_method
    def pin(self, keys: Sequence[OffloadKey], *, request: str | None = None) -> IdArray:
        """Pin ready `keys` for a load by `request`; return their rows in the same order.

        A key pinned k times is unpinned k times before it can be evicted. Raise
        PlanInvariantError, changing nothing, when a key is not ready.
        """
        status = self._status
        for key in keys:
            if status.get(key) is not _HIT:
                raise PlanInvariantError(
                    request=request,
                    group=key.group,
                    field="keys",
                    expected="ready keys to load",
                    got=f"{key} ({self._describe(key)})",
                )
        pins = self._pins
        for key in keys:
            pins[key] = pins.get(key, 0) + 1
        self._hits += len(keys)
        self._touch(keys, request)
        rows = self._rows
        return frozen_ids(np.fromiter((rows[key] for key in keys), dtype=np.int64, count=len(keys)))

    @locked_method
    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        """Release one pin of each key of `keys` (a load ended). Raise PlanInvariantError,
        changing nothing, when a key is pinned fewer times than it appears in `keys`."""
        wanted: dict[OffloadKey, int] = {}
        for key in keys:
            wanted[key] = wanted.get(key, 0) + 1
        pins = self._pins
        for key, count in wanted.items():
            if pins.get(key, 0) < count:
                raise PlanInvariantError(
                    group=key.group,
                    field="keys",
                    expected=f"a key pinned at least {count} time(s)",
                    got=f"{key} pinned {pins.get(key, 0)} time(s)",
                )
        for key, count in wanted.items():
            left = pins[key] - count
            if left:
                pins[key] = left
            else:
                del pins[key]
        if self._doomed:
            self._drop([key for key in wanted if key in self._doomed and key not in pins])

    @locked_method
    def discard(self, keys: Sequence[OffloadKey]) -> None:
        """Drop ready `keys` from the tier (their data is suspect: a load of them failed).

        Unpinned keys go now and free their rows; keys other loads still pin go when their
        last pin is released. Absent and writing keys are left alone.
        """
        status, pins = self._status, self._pins
        ready = [key for key in dict.fromkeys(keys) if status.get(key) is _HIT]
        self._doomed.update(key for key in ready if key in pins)
        self._drop([key for key in ready if key not in pins])

    def _drop(self, keys: list[OffloadKey]) -> None:
        for key in keys:
            self._doomed.discard(key)
            del self._status[key]
            rows = self._groups[key.group]
            rows.give_back(self._rows.pop(key))
            rows.policy.remove(key)
        if keys:
            self._record(EventKind.REMOVED, keys)

    # -- events and reset ----------------------------------------------------------------------

    @locked_method
    def drain_events(self) -> tuple[CatalogEvent, ...]:
        """Return the events recorded since the last drain (oldest first) and forget them."""
        events, self._events = tuple(self._events), []
        return events

    @locked_method
    def reset(self) -> None:
        """Forget every key, row and pin (counters keep their totals); ready keys are
        reported as removed."""
        ready = [key for key, status in self._status.items() if status is _HIT]
        if ready:
            self._record(EventKind.REMOVED, ready)
        self._status.clear()
        self._rows.clear()
        self._pins.clear()
        self._writing.clear()
        self._doomed.clear()
        for rows in self._groups.values():
            rows.freed.clear()
            rows.next_fresh = rows.used = 0
            rows.policy.clear()

    # -- private -------------------------------------------------------------------------------

    def _evict(self, key: OffloadKey) -> None:
        del self._status[key]
        rows = self._groups[key.group]
        rows.give_back(self._rows.pop(key))
        rows.policy.remove(key)
        self._evictions += 1

    def _record(self, kind: EventKind, keys: Iterable[OffloadKey]) -> None:
        if not self._config.record_events:
            return
        for group, group_keys in _by_group(keys).items():
            self._events.append(CatalogEvent(kind=kind, group=group, keys=tuple(group_keys)))

    def _describe(self, key: OffloadKey) -> str:
        status = self._status.get(key)
        if status is None:
            return "absent"
        if status is _PENDING:
            return "writing"
        return f"ready, pinned {self._pins[key]} time(s)" if key in self._pins else "ready"


class _NoRoomError(Exception):
    """Private signal: a reservation cannot make enough room."""


class CatalogView:
    """A read-only view of a Catalog for the planner (`StoreTierView`)."""

    def __init__(self, catalog: Catalog, *, pinned_as_pending: bool = False) -> None:
        self._catalog = catalog
        self._pinned_as_pending = pinned_as_pending

    def statuses(self, keys: Sequence[OffloadKey]) -> list[KeyStatus]:
        """Return the catalog's statuses; with `pinned_as_pending`, PENDING for pinned keys."""
        return self._catalog.statuses(keys, pinned_as_pending=self._pinned_as_pending)

    def can_reserve(self, keys: Sequence[OffloadKey]) -> bool:
        """Return the catalog's `can_reserve(keys)`."""
        return self._catalog.can_reserve(keys)
