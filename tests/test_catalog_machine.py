"""Random catalog operations, every policy, checked against a model of the catalog's rules."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvferry.core.catalog import Catalog, CatalogConfig, KeyState
from kvferry.core.errors import InvalidInputError
from kvferry.core.eviction import EvictionPolicyKind
from kvferry.core.keys import KeyStatus, OffloadKey

GROUPS = 2
UNIVERSE = [OffloadKey(i % GROUPS, bytes([i])) for i in range(12)]
keys_st = st.lists(st.sampled_from(UNIVERSE), max_size=6)


class CatalogMachine(RuleBasedStateMachine):
    """Reserve / complete / pin / unpin / reset in any order; the model predicts every answer
    except which evictable keys a policy picks, and checks those picks obey the rules. Every
    group has its own rows: a group's keys fit in its capacity, and room is made by evicting
    keys of the same group only."""

    batches = Bundle("batches")

    def __init__(self) -> None:
        super().__init__()
        self.catalog: Catalog
        self.capacity: tuple[int, ...] = (0,) * GROUPS
        self.ready: set[OffloadKey] = set()
        self.writing: set[OffloadKey] = set()
        self.pins: dict[OffloadKey, int] = {}

    @initialize(
        capacity=st.one_of(st.integers(0, 6), st.tuples(*[st.integers(0, 6)] * GROUPS)),
        policy=st.sampled_from(list(EvictionPolicyKind)),
    )
    def start(self, capacity: int | tuple[int, ...], policy: EvictionPolicyKind) -> None:
        self.capacity = (capacity,) * GROUPS if isinstance(capacity, int) else capacity
        self.catalog = Catalog(
            CatalogConfig(capacity_rows=capacity, policy=policy, record_events=True)
        )

    def _free(self, group: int) -> int:
        held = [k for k in self.ready | self.writing if k.group == group]
        return self.capacity[group] - len(held)

    @rule(
        target=batches,
        keys=keys_st,
        request=st.sampled_from(["a", "b", "c", None]),
        data=st.data(),
    )
    def reserve(
        self, keys: list[OffloadKey], request: str | None, data: st.DataObject
    ) -> tuple[OffloadKey, ...]:
        positions = data.draw(st.lists(st.integers(1, 64), min_size=len(keys), max_size=len(keys)))
        asked = set(keys)
        absent = list(dict.fromkeys(k for k in keys if k not in self.ready | self.writing))
        evictable = {k for k in self.ready if k not in self.pins and k not in asked}
        need = {g: max(0, sum(k.group == g for k in absent) - self._free(g)) for g in range(GROUPS)}
        fits = all(need[g] <= sum(k.group == g for k in evictable) for g in range(GROUPS))
        assert self.catalog.can_reserve(keys) is fits
        if len(asked) != len(keys):  # a key twice: refused, nothing changed
            before = (self.catalog.snapshot(), self.catalog.counters())
            with pytest.raises(InvalidInputError, match="each key once"):
                self.catalog.reserve(keys, positions=positions, request=request)
            assert (self.catalog.snapshot(), self.catalog.counters()) == before
            assert self.catalog.drain_events() == ()
            return ()
        reservation = self.catalog.reserve(keys, positions=positions, request=request)
        if not fits:
            assert reservation is None
            assert self.catalog.drain_events() == ()
            return ()
        assert reservation is not None
        assert attrs.evolve(reservation) == reservation  # built unchecked: its checks pass
        assert list(reservation.keys) == absent
        for g in range(GROUPS):  # each group evicts what it needs, of its own keys
            assert sum(k.group == g for k in reservation.evicted) == need[g]
        assert set(reservation.evicted) <= evictable
        removed = [k for e in self.catalog.drain_events() for k in e.keys]
        assert sorted(removed) == sorted(reservation.evicted)
        self.ready -= set(reservation.evicted)
        self.writing |= set(absent)
        return reservation.keys

    @rule(batch=consumes(batches), success=st.booleans())
    def complete(self, batch: tuple[OffloadKey, ...], success: bool) -> None:
        if not batch or not set(batch) <= self.writing:
            return  # emptied by a reset since
        self.catalog.complete_store(batch, success=success)
        self.writing -= set(batch)
        if success:
            self.ready |= set(batch)
        stored = [k for e in self.catalog.drain_events() for k in e.keys]
        assert sorted(stored) == (sorted(batch) if success else [])

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.ready)), min_size=1, max_size=3))
        rows = self.catalog.pin(keys, request=data.draw(st.sampled_from(["a", "d"])))
        assert rows.tolist() == [self.catalog.snapshot()[k].row for k in keys]
        for key in keys:
            self.pins[key] = self.pins.get(key, 0) + 1

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pins)))
        self.catalog.unpin([key])
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]

    @rule(now=st.integers(0, 9))
    def reset(self, now: int) -> None:
        if now:
            return
        self.catalog.reset()
        removed = [k for e in self.catalog.drain_events() for k in e.keys]
        assert sorted(removed) == sorted(self.ready)
        self.ready.clear()
        self.writing.clear()
        self.pins.clear()

    @invariant()
    def the_catalog_equals_the_model(self) -> None:
        if not hasattr(self, "catalog"):
            return
        snapshot = self.catalog.snapshot()
        assert {k for k, e in snapshot.items() if e.state is KeyState.READY} == self.ready
        assert {k for k, e in snapshot.items() if e.state is KeyState.WRITING} == self.writing
        assert {k: e.pins for k, e in snapshot.items() if e.pins} == self.pins
        for g in range(GROUPS):
            rows = sorted(e.row for k, e in snapshot.items() if k.group == g)
            assert len(set(rows)) == len(rows) <= self.capacity[g]
            assert all(0 <= row < self.capacity[g] for row in rows)
            assert self.catalog.counters().group_rows_used[g : g + 1] in ((), (len(rows),))
        expected = [
            KeyStatus.HIT
            if k in self.ready
            else KeyStatus.PENDING
            if k in self.writing
            else KeyStatus.MISS
            for k in UNIVERSE
        ]
        assert self.catalog.statuses(UNIVERSE) == expected
        assert self.catalog.counters().rows_used == len(snapshot)


TestCatalogMachine = CatalogMachine.TestCase
