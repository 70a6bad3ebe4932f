"""The catalog of the CPU tier: which key sits in which row, writing, ready or pinned by loads.

The one stateful object of the scheduler side; it changes only when called, and does no I/O,
reads no clock and draws no random number (recency is the order of operations).
"""

from __future__ import annotations

import enum
import functools
import itertools
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import attrs
import numpy as np

from kvferry.core.arrays import FEW, IdArray, arrays_equal, assign, frozen_ids
from kvferry.core.checks import unchecked_maker
from kvferry.core.errors import InvalidInputError, PlanInvariantError
from kvferry.core.eviction import EvictionPolicyKind
from kvferry.core.group_rows import FoundRows, GroupRows, Rows, first_not_ready
from kvferry.core.keys import KeyColumn, KeyStatus, OffloadKey

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


_new_reservation = unchecked_maker(Reservation)


@attrs.frozen
class StoreAsk:
    """One store's reservation, as `Catalog.reserve_each` takes it: the arguments of
    `Catalog.reserve`."""

    keys: Sequence[OffloadKey]
    """The store's keys (each once)."""
    positions: Sequence[int] | None
    """Per key, the token index where its chunk ends (None: not known)."""
    request: str | None
    """The request storing them."""


def _repeated_keys(keys: Sequence[OffloadKey], request: str | None) -> InvalidInputError:
    """Return the refusal of a reservation that lists a key twice (one row would stand for
    two chunks)."""
    return InvalidInputError(
        request=request, field="keys", expected="each key once", got=[str(key) for key in keys]
    )


def _mismatched_positions(
    keys: Sequence[OffloadKey], positions: Sequence[int], request: str | None
) -> InvalidInputError:
    """Return the refusal of a reservation whose positions do not match its keys."""
    return InvalidInputError(
        request=request,
        field="positions",
        expected=f"one position per key ({len(keys)})",
        got=len(positions),
    )


_NO_ROW_IDS = frozen_ids(())

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


def _runs(keys: Sequence[OffloadKey]) -> list[tuple[int, list[bytes]]]:
    """Return `keys` as runs of one group each, in order: (group, the run's hashes). A
    `KeyColumn` gives its runs from its group column, no key made."""
    if isinstance(keys, KeyColumn):
        groups = keys.groups
        if not len(groups):
            return []
        hashes = keys.hashes()
        if groups[0] == groups[-1]:  # one group (the column is listed group by group)
            return [(int(groups[0]), hashes)]
        starts = [0, *(np.flatnonzero(groups[1:] != groups[:-1]) + 1).tolist(), len(groups)]
        return [
            (int(groups[start]), hashes[start:stop]) for start, stop in itertools.pairwise(starts)
        ]
    return [(group, list(map(_HASH, run))) for group, run in itertools.groupby(keys, key=_GROUP)]


def _merged(runs: list[tuple[int, list[bytes]]]) -> dict[int, list[bytes]]:
    """Return the hashes of `runs` per group (repeats kept), groups in order of first
    appearance."""
    grouped: dict[int, list[bytes]] = {}
    for group, hashes in runs:
        grouped[group] = [*grouped[group], *hashes] if group in grouped else hashes
    return grouped


def _keys_of(group: int, hashes: Iterable[bytes]) -> tuple[OffloadKey, ...]:
    """Return the OffloadKeys of `hashes` in `group`."""
    return tuple(map(_make_key, zip(itertools.repeat(group), hashes)))


def _make_key(pair: tuple[int, bytes]) -> OffloadKey:
    return OffloadKey._make(pair)


_GROUP = operator.itemgetter(0)
_HASH = operator.itemgetter(1)


class Catalog:
    """The CPU tier's bookkeeping: rows, key states, pins, eviction, events and counters.

    Every group has its own rows (`CatalogConfig.group_rows`), free list and eviction policy:
    a key takes a row of its group, and making room evicts only keys of the same group.

    It is a `StoreTierView` (and so a `KeyStatusView`, and a `HashStatusView`): the planner may
    read it directly. Every changing method either does all it says or raises and changes
    nothing. Calls given a `KeyColumn` (a plan's keys) work on its columns of groups and hashes
    and make no `OffloadKey`.

    Given a `lock` (a re-entrant lock such as `threading.RLock()`), every public call holds it,
    so threads may share the catalog; without one it is for one thread. An `OffloadSession`
    gives the catalog its own lock when it has none.
    """

    def __init__(self, config: CatalogConfig, *, lock: Lock | None = None) -> None:
        if not isinstance(config, CatalogConfig):
            raise InvalidInputError(field="config", expected="a CatalogConfig", got=config)
        self._lock = lock
        self._config = config
        self._groups: dict[int, GroupRows] = {}
        """Per group seen (or configured), its rows and keys; made on first use."""
        if isinstance(config.capacity_rows, tuple):
            for g in range(len(config.capacity_rows)):
                self._group(g)
        self._events: list[CatalogEvent] = []
        self._hits = self._misses = self._stores = self._failed = self._evictions = 0
        self._generation = 0
        """Counts the changes that free a row (evict, drop, failed store, reset): rows found
        at one generation still hold the same keys while it lasts."""

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
        return sum(rows.used for rows in self._groups.values())

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
        answer: list[KeyStatus] = []
        for group, hashes in _runs(keys):
            answer += self.hash_statuses(group, hashes, pinned_as_pending=pinned_as_pending)
        return answer

    @locked_method
    def hash_statuses(
        self,
        group: int,
        hashes: Sequence[bytes],
        *,
        width: int = 0,
        pinned_as_pending: bool = False,
        seen: FoundRows | None = None,
    ) -> list[KeyStatus]:
        """Return `statuses` of the keys of `group` whose hashes are `hashes` (no key made);
        `width`, when the caller knows it, is the one length of the hashes (`hash_width`).
        The rows found are added to `seen` when given, for a `pin` of the same keys."""
        rows = self._groups.get(group)
        if rows is None:
            return [_MISS] * len(hashes)
        if len(hashes) <= FEW and seen is None:  # a store's few keys: no array worth making
            return [rows.status(h, pinned_as_pending=pinned_as_pending) for h in hashes]
        found = rows.find(hashes, width)
        if seen is not None:
            seen.add(group, hashes, found, self._generation)
        return rows.statuses_of(found, pinned_as_pending=pinned_as_pending)

    @locked_method
    def entry(self, key: OffloadKey) -> CatalogEntry | None:
        """Return what the catalog holds for `key`, or None when the key is absent."""
        rows = self._groups.get(key.group)
        row = None if rows is None else rows.row_of.get(key.block_hash)
        if rows is None or row is None:
            return None
        return CatalogEntry(
            state=KeyState.READY if rows.ready[row] else KeyState.WRITING,
            row=row,
            pins=int(rows.pins[row]),
        )

    @locked_method
    def snapshot(self) -> dict[OffloadKey, CatalogEntry]:
        """Return every present key's entry (a copy; for checks and debugging, not hot paths)."""
        entries = {}
        for group, rows in sorted(self._groups.items()):
            for block_hash in rows.row_of:
                key = OffloadKey(group, block_hash)
                entry = self.entry(key)
                if entry is not None:
                    entries[key] = entry
        return entries

    @locked_method
    def is_pinned(self, key: OffloadKey) -> bool:
        """Return True when a load is reading `key`."""
        rows = self._groups.get(key.group)
        return rows is not None and rows.is_pinned(key.block_hash)

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
            rows_used=sum(rows.used for rows in self._groups.values()),
            capacity_rows=self._config.capacity_rows,
        )

    def view(
        self, *, pinned_as_pending: bool = False, seen: FoundRows | None = None
    ) -> CatalogView:
        """Return a read-only view of this catalog for the planner.

        With `pinned_as_pending`, keys that a load is reading answer PENDING instead of HIT: a
        second request with the same prefix then retries until the first load has put the
        blocks on the GPU, where the engine's prefix cache finds them. With `seen`, the rows
        its answers by hash find are kept there (`FoundRows`).
        """
        return CatalogView(self, pinned_as_pending=pinned_as_pending, seen=seen)

    # -- stores --------------------------------------------------------------------------------

    def _asked(self, keys: Sequence[OffloadKey]) -> tuple[dict[int, dict[bytes, None]], bool]:
        """Return the distinct hashes of `keys` per group, in the order asked, and whether
        each group's keys came as one run (then the groups in turn are the order asked)."""
        asked: dict[int, dict[bytes, None]] = {}
        if len(keys) <= FEW and not isinstance(keys, KeyColumn):  # a store's few: one pass
            runs, last = 0, None
            for group, block_hash in keys:
                asked.setdefault(group, {})[block_hash] = None
                runs += group != last
                last = group
            return asked, runs == len(asked)
        group_runs = _runs(keys)
        for group, hashes in group_runs:
            asked.setdefault(group, {}).update(dict.fromkeys(hashes))
        return asked, len(group_runs) == len(asked)

    def _present_ready(
        self, asked: dict[int, dict[bytes, None]], new: dict[int, list[bytes]]
    ) -> dict[int, tuple[list[bytes], Rows]]:
        """Return per group the hashes of `asked` that are ready (present, not writing), and
        their rows."""
        ready: dict[int, tuple[list[bytes], Rows]] = {}
        for group, hashes in asked.items():
            rows = self._groups.get(group)
            if rows is None or len(new.get(group, ())) == len(hashes):
                continue
            writing = rows.writing
            found = [h for h in hashes if h in rows.row_of and h not in writing]
            ready[group] = (found, rows.rows(found))
        return ready

    def _victims(
        self, asked: dict[int, dict[bytes, None]]
    ) -> tuple[dict[int, list[bytes]], dict[int, list[bytes]]]:
        """Return, per group, (the distinct absent hashes of `asked`, the victims making room),
        or raise _NoRoomError."""
        new: dict[int, list[bytes]] = {}
        for group, hashes in asked.items():
            rows = self._groups.get(group)
            absent = (
                list(hashes)
                if rows is None
                else list(itertools.filterfalse(rows.row_of.__contains__, hashes))
            )
            if absent:
                new[group] = absent
        if isinstance(self._config.capacity_rows, tuple) and new:  # refuse an unknown group
            self._group(max(new))
        victims: dict[int, list[bytes]] = {}
        if sum(map(len, new.values())) <= self._least_free():
            return new, victims
        for group, group_new in new.items():
            rows = self._group(group)
            need = len(group_new) - rows.free
            if need <= 0:
                continue
            chosen = rows.policy.choose(need, rows.protection(asked[group]))
            if chosen is None:
                raise _NoRoomError
            victims[group] = chosen  # type: ignore[assignment]  # the policy holds hashes
        return new, victims

    def _least_free(self) -> int:
        """Return the free rows of the group with the fewest (groups unseen yet: all free)."""
        free = min((rows.free for rows in self._groups.values()), default=-1)
        unseen = self._config.least_rows
        return unseen if free < 0 else min(free, unseen)

    def _group(self, group: int) -> GroupRows:
        rows = self._groups.get(group)
        if rows is None:
            rows = GroupRows(self._config.group_rows(group), self._config.policy)
            self._groups[group] = rows
        return rows

    def _touch(self, used: Mapping[int, tuple[Sequence[bytes], Rows]], request: str | None) -> None:
        """Tell each group's policy of its keys used now, given with their rows (and every
        policy of `request`'s activity)."""
        for g, rows in self._groups.items():
            if g in used:
                hashes, found = used[g]
                rows.policy.touch(hashes, rows=found, request=request)
            elif request is not None and rows.policy.follows_requests:
                rows.policy.touch((), rows=_NO_ROWS, request=request)

    @locked_method
    def can_reserve(self, keys: Sequence[OffloadKey]) -> bool:
        """Return True when every key of `keys` that is absent can get a row, evicting only
        ready, unpinned keys outside `keys` (what `reserve` would do; nothing changes)."""
        if len(keys) <= self._least_free():  # room even if every key is absent: no search
            return True
        try:
            self._victims(self._asked(keys)[0])
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
            raise _mismatched_positions(keys, positions, request)
        if len(keys) <= FEW:  # a store's few keys: the short path, when they are all absent
            quick = self._reserve_absent_each([StoreAsk(keys, positions, request)])
            if quick is not None:
                return quick[0]
        asked, in_order = self._asked(keys)
        if sum(map(len, asked.values())) != len(keys):  # one row would stand for two chunks
            raise _repeated_keys(keys, request)
        try:
            new, victims = self._victims(asked)
        except _NoRoomError:
            return None
        self._touch(self._present_ready(asked, new), request)
        if victims:  # the touch may reorder the candidates, never their number
            new, victims = self._victims(asked)
        evicted: list[OffloadKey] = []
        evicted_rows: list[int] = []
        for group, hashes in victims.items():
            rows = self._groups[group]
            evicted_rows += map(rows.row_of.__getitem__, hashes)
            for block_hash in hashes:
                self._evict(rows, block_hash)
            evicted += _keys_of(group, hashes)
        if evicted:
            self._record(EventKind.REMOVED, evicted)
        every_key_new = in_order and sum(map(len, new.values())) == len(keys)
        position_of = (
            {} if positions is None or every_key_new else dict(zip(keys, positions, strict=True))
        )
        new_keys: list[OffloadKey] = list(keys) if every_key_new else []
        new_rows: list[int] = []
        for group, hashes in new.items():
            rows = self._group(group)
            taken = rows.take(len(hashes))
            if every_key_new:  # the keys as given, each group's a run in turn
                ends: Iterable[int] = (
                    itertools.repeat(0)
                    if positions is None
                    else positions[len(new_rows) : len(new_rows) + len(hashes)]
                )
            else:
                made = _keys_of(group, hashes)
                new_keys += made
                ends = map(position_of.get, made, itertools.repeat(0))
            rows.hold(hashes, taken)
            rows.writing.update(zip(hashes, zip(ends, itertools.repeat(request)), strict=False))
            new_rows += taken
        self._misses += len(new_keys)
        if not in_order:  # the answer lists the keys in the order asked
            order = {key: index for index, key in enumerate(keys)}
            ranked = sorted(range(len(new_keys)), key=lambda i: order[new_keys[i]])
            new_keys = [new_keys[i] for i in ranked]
            new_rows = [new_rows[i] for i in ranked]
        # One row per key, each a free row just taken (>= 0): Reservation's checks hold.
        return _new_reservation(
            keys=tuple(new_keys),
            rows=frozen_ids(new_rows),
            evicted=tuple(evicted),
            evicted_rows=frozen_ids(evicted_rows) if evicted_rows else _NO_ROW_IDS,
        )

    @locked_method
    def reserve_each(self, asks: Sequence[StoreAsk]) -> list[Reservation | None]:
        """Return `reserve`'s answer for each ask, in order: the answers, rows and catalog that
        calling `reserve` for one ask after the other gives (one call for a step's stores).

        Raise InvalidInputError, changing nothing, for an ask `reserve` would refuse (positions
        that do not match its keys, a key given twice within it)."""
        for ask in asks:
            keys, positions = ask.keys, ask.positions
            if positions is not None and len(positions) != len(keys):
                raise _mismatched_positions(keys, positions, ask.request)
            if len(set(keys)) != len(keys):
                raise _repeated_keys(keys, ask.request)
        answers = self._reserve_absent_each(asks)
        if answers is not None:
            return answers
        return [self.reserve(a.keys, positions=a.positions, request=a.request) for a in asks]

    def _reserve_absent_each(self, asks: Sequence[StoreAsk]) -> list[Reservation | None] | None:
        """Return `reserve_each`'s answers when each key is of a group the catalog has seen,
        no key of any ask is present, none repeats, and each group has free rows for all of
        its keys (so no reservation evicts, and none changes what a later one finds);
        otherwise None, changing nothing. The short path of `reserve` too (one ask).
        Each group's rows are taken in the asks' order, as one `reserve` after the other takes
        them, and each storing request is made active in that order."""
        groups = self._groups
        per_group: dict[int, list[bytes]] = {}
        for ask in asks:
            for group, block_hash in ask.keys:
                rows = groups.get(group)
                if rows is None or block_hash in rows.row_of:
                    return None
                per_group.setdefault(group, []).append(block_hash)
        for group, hashes in per_group.items():
            if len(hashes) > groups[group].free or len(set(hashes)) != len(hashes):
                return None
        for ask in asks:
            self._touch({}, ask.request)
        taken: dict[int, Iterator[int]] = {}
        for group, hashes in per_group.items():
            rows = groups[group]
            got = rows.take(len(hashes))
            rows.hold(hashes, got)
            taken[group] = iter(got)
        answers: list[Reservation | None] = []
        for ask in asks:
            keys, positions, request = ask.keys, ask.positions, ask.request
            rows_of_ask = [next(taken[group]) for group, _ in keys]
            for index, (group, block_hash) in enumerate(keys):
                groups[group].writing[block_hash] = (
                    0 if positions is None else positions[index],
                    request,
                )
            answers.append(
                _new_reservation(
                    keys=tuple(keys),
                    rows=frozen_ids(rows_of_ask),
                    evicted=(),
                    evicted_rows=_NO_ROW_IDS,
                )
            )
        self._misses += sum(map(len, per_group.values()))
        return answers

    @locked_method
    def complete_store(self, keys: Sequence[OffloadKey], *, success: bool) -> None:
        """Finish the store of `keys` (all writing): success makes them ready, failure forgets
        them and frees their rows. Raise PlanInvariantError, changing nothing, when a key is
        not writing."""
        asked, _ = self._asked(keys)
        for group, distinct in asked.items():
            rows = self._groups.get(group)
            writing = {} if rows is None else rows.writing
            if not all(map(writing.__contains__, distinct)):
                key = OffloadKey(group, next(h for h in distinct if h not in writing))
                raise PlanInvariantError(
                    group=group,
                    field="keys",
                    expected="keys being written (reserved, store in flight)",
                    got=f"{key} ({self._describe(key)})",
                )
        done = sum(map(len, asked.values()))
        for group, listed_once in asked.items():
            rows, hashes = self._groups[group], list(listed_once)
            if success:
                ends = list(map(rows.writing.pop, hashes))
                stored = rows.rows(hashes)
                assign(rows.ready, stored, True)
                # one admission per storing request, in order (a reservation has one)
                start = 0
                for request, run in itertools.groupby(ends, key=_storing_request):
                    stop = start + len(list(run))
                    rows.policy.admit_all(
                        hashes[start:stop],
                        rows=stored[start:stop],
                        positions=[position for position, _ in ends[start:stop]],
                        request=request,
                    )
                    start = stop
            else:
                for block_hash in hashes:
                    del rows.writing[block_hash]
                    rows.give_back(rows.row_of.pop(block_hash))
                self._generation += 1
        if success:
            self._stores += done
            if self._config.record_events:
                self._record(
                    EventKind.STORED, [k for g, hs in asked.items() for k in _keys_of(g, hs)]
                )
        else:
            self._failed += done

    # -- loads ---------------------------------------------------------------------------------

    @locked_method
    def pin(
        self,
        keys: Sequence[OffloadKey],
        *,
        request: str | None = None,
        seen: FoundRows | None = None,
    ) -> IdArray:
        """Pin ready `keys` for a load by `request`; return their rows in the same order.

        `seen`, the rows a lookup of these keys found (`hash_statuses`), saves finding them
        again when still valid. A key pinned k times is unpinned k times before it can be
        evicted. Raise PlanInvariantError, changing nothing, when a key is not ready.
        """
        runs = _runs(keys)
        answer: list[IdArray] = []
        for group, hashes in runs:
            rows = self._groups.get(group)
            found = None if seen is None else seen.rows_of(group, hashes, self._generation)
            if rows is not None and found is None:
                found = rows.find(hashes)
            not_ready = 0 if rows is None or found is None else first_not_ready(rows, found)
            if rows is None or found is None or not_ready >= 0:
                key = OffloadKey(group, hashes[not_ready])
                raise PlanInvariantError(
                    request=request,
                    group=group,
                    field="keys",
                    expected="ready keys to load",
                    got=f"{key} ({self._describe(key)})",
                )
            answer.append(found)
        for (group, _), found in zip(runs, answer, strict=True):
            self._groups[group].add_pins(found)
        self._hits += len(keys)
        used: dict[int, tuple[Sequence[bytes], IdArray]] = {}
        for (group, hashes), found in zip(runs, answer, strict=True):
            before, before_rows = used.get(group, _NONE_USED)  # a group in two runs: one touch
            used[group] = (
                ([*before, *hashes], np.concatenate([before_rows, found]))
                if before
                else (hashes, found)
            )
        self._touch(used, request)
        return frozen_ids(np.concatenate(answer) if answer else np.zeros(0, dtype=np.int64))

    @locked_method
    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        """Release one pin of each key of `keys` (a load ended). Raise PlanInvariantError,
        changing nothing, when a key is pinned fewer times than it appears in `keys`."""
        releases = []
        for group, hashes in _merged(_runs(keys)).items():
            rows = self._groups.get(group)
            row_of = {} if rows is None else rows.row_of
            if rows is None or not all(map(row_of.__contains__, hashes)):
                block_hash = next(h for h in hashes if h not in row_of)
                raise PlanInvariantError(
                    group=group,
                    field="keys",
                    expected=f"a key pinned at least {hashes.count(block_hash)} time(s)",
                    got=f"{OffloadKey(group, block_hash)} pinned 0 time(s)",
                )
            unique, first, listed = np.unique(
                rows.rows(hashes), return_index=True, return_counts=True
            )
            short = listed > rows.pins[unique]
            if short.any():
                at = int(np.argmax(short))
                key = OffloadKey(group, hashes[int(first[at])])
                raise PlanInvariantError(
                    group=group,
                    field="keys",
                    expected=f"a key pinned at least {int(listed[at])} time(s)",
                    got=f"{key} pinned {int(rows.pins[unique[at]])} time(s)",
                )
            releases.append((group, rows, hashes, unique, listed))
        for group, rows, hashes, unique, listed in releases:
            rows.pins[unique] -= listed.astype(np.int32)
            rows.pin_total -= len(hashes)  # one pin per listing
            if rows.doomed:
                unpinned = [h for h in dict.fromkeys(hashes) if not rows.is_pinned(h)]
                self._drop(group, rows, [h for h in unpinned if h in rows.doomed])

    @locked_method
    def discard(self, keys: Sequence[OffloadKey]) -> None:
        """Drop ready `keys` from the tier (their data is suspect: a load of them failed).

        Unpinned keys go now and free their rows; keys other loads still pin go when their
        last pin is released. Absent and writing keys are left alone.
        """
        for group, hashes in _runs(keys):
            rows = self._groups.get(group)
            if rows is None:
                continue
            ready = [h for h in dict.fromkeys(hashes) if rows.status(h) is _HIT]
            rows.doomed.update(h for h in ready if rows.is_pinned(h))
            self._drop(group, rows, [h for h in ready if not rows.is_pinned(h)])

    def _drop(self, group: int, rows: GroupRows, hashes: list[bytes]) -> None:
        for block_hash in hashes:
            rows.doomed.discard(block_hash)
            row = rows.row_of.pop(block_hash)
            rows.give_back(row)
            rows.policy.remove(block_hash, row=row)
        if hashes:
            self._generation += 1
            self._record(EventKind.REMOVED, _keys_of(group, hashes))

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
        ready = [
            OffloadKey(group, block_hash)
            for group, rows in self._groups.items()
            for block_hash, row in rows.row_of.items()
            if rows.ready[row]
        ]
        if ready:
            self._record(EventKind.REMOVED, ready)
        for rows in self._groups.values():
            rows.clear()
        self._generation += 1

    # -- private -------------------------------------------------------------------------------

    def _evict(self, rows: GroupRows, block_hash: bytes) -> None:
        row = rows.row_of.pop(block_hash)
        rows.give_back(row)
        rows.policy.remove(block_hash, row=row)
        self._evictions += 1
        self._generation += 1

    def _record(self, kind: EventKind, keys: Sequence[OffloadKey]) -> None:
        if not self._config.record_events:
            return
        for group, group_keys in _by_group(keys).items():
            self._events.append(CatalogEvent(kind=kind, group=group, keys=tuple(group_keys)))

    def _describe(self, key: OffloadKey) -> str:
        rows = self._groups.get(key.group)
        status = _MISS if rows is None else rows.status(key.block_hash)
        if rows is None or status is _MISS:
            return "absent"
        if status is _PENDING:
            return "writing"
        row = rows.row_of[key.block_hash]
        pins = int(rows.pins[row])
        return f"ready, pinned {pins} time(s)" if pins else "ready"


def _by_group(keys: Iterable[OffloadKey]) -> dict[int, list[OffloadKey]]:
    grouped: dict[int, list[OffloadKey]] = {}
    for key in keys:
        grouped.setdefault(key.group, []).append(key)
    return grouped


def _storing_request(entry: tuple[int, str | None]) -> str | None:
    """Return the request of a writing key's (position, request)."""
    return entry[1]


_NO_ROWS: IdArray = np.zeros(0, dtype=np.int64)
_NONE_USED: tuple[Sequence[bytes], Rows] = ((), _NO_ROWS)


class _NoRoomError(Exception):
    """Private signal: a reservation cannot make enough room."""


class CatalogView:
    """A read-only view of a Catalog for the planner (`StoreTierView`)."""

    def __init__(
        self, catalog: Catalog, *, pinned_as_pending: bool = False, seen: FoundRows | None = None
    ) -> None:
        self._catalog = catalog
        self._pinned_as_pending = pinned_as_pending
        self._seen = seen

    def statuses(self, keys: Sequence[OffloadKey]) -> list[KeyStatus]:
        """Return the catalog's statuses; with `pinned_as_pending`, PENDING for pinned keys."""
        return self._catalog.statuses(keys, pinned_as_pending=self._pinned_as_pending)

    def hash_statuses(
        self, group: int, hashes: Sequence[bytes], *, width: int = 0
    ) -> list[KeyStatus]:
        """Return the catalog's `hash_statuses` (PENDING for pinned keys, as `statuses`)."""
        return self._catalog.hash_statuses(
            group, hashes, width=width, pinned_as_pending=self._pinned_as_pending, seen=self._seen
        )

    def can_reserve(self, keys: Sequence[OffloadKey]) -> bool:
        """Return the catalog's `can_reserve(keys)`."""
        return self._catalog.can_reserve(keys)
