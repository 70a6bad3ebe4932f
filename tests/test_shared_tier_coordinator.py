"""The shared tier's rules with a scripted backend and a hand-moved clock (no server): what
lookups see, when requests are given up, what the catalog is left with."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvferry.adapters.shared_tier import (
    BackendCompletion,
    Op,
    SharedTier,
    SharedTierSettings,
    host_rows,
)
from kvferry.core.catalog import Catalog, CatalogConfig, KeyState
from kvferry.core.keys import KeyStatus, OffloadKey
from kvferry.core.layout import TierLayout

ROW = 8
KEYS = [OffloadKey(0, bytes([i])) for i in range(3)]
MISS, HIT, PENDING = KeyStatus.MISS, KeyStatus.HIT, KeyStatus.PENDING


class ScriptedBackend:
    """Records requests; completes them only when told to."""

    def __init__(self) -> None:
        self.requests: dict[int, tuple[Op, tuple[OffloadKey, ...], Sequence[memoryview]]] = {}
        self.done: list[BackendCompletion] = []
        self.cancelled: list[int] = []
        self.next = 1

    def _add(self, op: Op, keys: Sequence[OffloadKey], rows: Sequence[memoryview]) -> int:
        ticket, self.next = self.next, self.next + 1
        self.requests[ticket] = (op, tuple(keys), rows)
        return ticket

    def submit_contains(self, keys: Sequence[OffloadKey], deadline: float) -> int:
        return self._add(Op.CONTAINS, keys, ())

    def submit_get(
        self, keys: Sequence[OffloadKey], rows: Sequence[memoryview], deadline: float
    ) -> int:
        return self._add(Op.GET, keys, rows)

    def submit_put(
        self, keys: Sequence[OffloadKey], rows: Sequence[memoryview], deadline: float
    ) -> int:
        return self._add(Op.PUT, keys, [memoryview(bytes(row)) for row in rows])

    def answer(self, ticket: int, ok: Sequence[bool], fill: int = 7) -> None:
        op, keys, rows = self.requests.pop(ticket)
        if op is Op.GET:
            for row, good in zip(rows, ok, strict=True):
                if good:
                    row[:] = bytes([fill]) * len(row)
        self.done.append(BackendCompletion(ticket=ticket, op=op, keys=keys, ok=tuple(ok)))

    def poll(self) -> list[BackendCompletion]:
        done, self.done = self.done, []
        return done

    def wait(self, timeout_s: float) -> None:
        pass

    def cancel(self, ticket: int) -> bool:
        self.cancelled.append(ticket)
        return self.requests.pop(ticket, None) is not None

    def close(self) -> None:
        pass


class World:
    def __init__(self, capacity: int = 4) -> None:
        self.now = 100.0
        self.backend = ScriptedBackend()
        self.catalog = Catalog(CatalogConfig(capacity_rows=capacity))
        self.tier_bytes = np.zeros(capacity * ROW, dtype=np.uint8)
        settings = SharedTierSettings(
            url="redis://h:1", model="m", timeout_s=1.0, retry_after_s=5.0, absent_ttl_s=2.0
        )
        self.tier = SharedTier(
            self.backend,
            self.catalog,
            host_rows(self.tier_bytes, TierLayout(rows=(capacity,), pitch=(ROW,))),
            settings,
            clock=lambda: self.now,
        )
        self.view = self.tier.view(self.catalog.view())

    def ticket(self, op: Op) -> int:
        return next(t for t, (o, _, _) in self.backend.requests.items() if o is op)


def test_a_miss_is_pending_and_asked_once() -> None:
    world = World()
    assert world.view.statuses(KEYS) == [PENDING] * 3
    assert world.view.statuses(KEYS) == [PENDING] * 3
    world.tier.poll()
    assert [op for op, _, _ in world.backend.requests.values()] == [Op.CONTAINS]
    assert world.tier.counters().probes == 3


def test_found_keys_are_promoted_then_hits_and_absent_ones_misses() -> None:
    world = World()
    world.view.statuses(KEYS)
    world.tier.poll()
    world.backend.answer(world.ticket(Op.CONTAINS), [True, True, False])
    world.tier.poll()
    assert world.view.statuses(KEYS) == [PENDING, PENDING, MISS]  # writing, writing, absent
    world.backend.answer(world.ticket(Op.GET), [True, True])
    world.tier.poll()
    assert world.view.statuses(KEYS) == [HIT, HIT, MISS]
    entry = world.catalog.entry(KEYS[0])
    assert entry is not None
    assert bytes(world.tier_bytes[entry.row * ROW : (entry.row + 1) * ROW]) == bytes([7]) * ROW


def test_an_absent_answer_expires_after_its_ttl() -> None:
    world = World()
    world.view.statuses(KEYS[:1])
    world.tier.poll()
    world.backend.answer(world.ticket(Op.CONTAINS), [False])
    world.tier.poll()
    assert world.view.statuses(KEYS[:1]) == [MISS]
    world.now += 2.0
    assert world.view.statuses(KEYS[:1]) == [PENDING]


def test_a_request_past_its_deadline_is_given_up_and_its_rows_given_back() -> None:
    world = World()
    world.view.statuses(KEYS[:2])
    world.tier.poll()
    world.backend.answer(world.ticket(Op.CONTAINS), [True, True])
    world.tier.poll()
    get = world.ticket(Op.GET)
    assert world.catalog.rows_used == 2
    world.now += 1.0
    world.tier.poll()
    assert get in world.backend.cancelled
    assert world.catalog.rows_used == 0
    assert world.view.statuses(KEYS[:2]) == [MISS, MISS]  # recomputed
    assert world.tier.counters().timeouts == 1


def test_after_a_failure_lookups_skip_the_tier_for_retry_after() -> None:
    world = World()
    world.view.statuses(KEYS[:1])
    world.tier.poll()
    ticket = world.ticket(Op.CONTAINS)
    world.backend.requests.pop(ticket)
    world.backend.done.append(
        BackendCompletion(ticket=ticket, op=Op.CONTAINS, keys=(KEYS[0],), ok=(False,), error="x")
    )
    world.tier.poll()
    assert world.view.statuses(KEYS[1:]) == [MISS, MISS]  # not even asked
    world.now += 5.0
    assert world.view.statuses(KEYS[1:]) == [PENDING, PENDING]


def test_a_failed_get_gives_the_rows_back_and_loads_nothing() -> None:
    world = World()
    world.view.statuses(KEYS[:2])
    world.tier.poll()
    world.backend.answer(world.ticket(Op.CONTAINS), [True, True])
    world.tier.poll()
    world.backend.answer(world.ticket(Op.GET), [True, False])
    world.tier.poll()
    assert world.view.statuses(KEYS[:2]) == [HIT, MISS]
    assert world.tier.counters().promotion_failures == 1
    assert world.catalog.rows_used == 1


def test_promotion_without_a_row_is_a_miss_and_evicts_nothing_writing() -> None:
    world = World(capacity=1)
    other = OffloadKey(0, b"x")  # the same group: its only row is writing
    assert world.catalog.reserve([other]) is not None  # writing: never evicted
    world.view.statuses(KEYS[:1])
    world.tier.poll()
    world.backend.answer(world.ticket(Op.CONTAINS), [True])
    world.tier.poll()
    assert world.view.statuses(KEYS[:1]) == [MISS]
    assert world.tier.counters().no_room == 1
    entry = world.catalog.entry(other)
    assert entry is not None and entry.state is KeyState.WRITING


def test_polling_with_nothing_arrived_changes_nothing() -> None:
    world = World()
    world.view.statuses(KEYS)
    world.tier.poll()
    before = (world.tier.counters(), world.catalog.snapshot())
    world.tier.poll()
    assert (world.tier.counters(), world.catalog.snapshot()) == before
    assert world.tier.busy
