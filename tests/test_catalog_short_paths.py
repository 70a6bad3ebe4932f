"""Reservations of absent keys with room for all take short paths (the stores of a decode step):
one reservation of a few keys, and one call for a step's stores. Whatever the policy and history,
they answer and change exactly what the general path would, row for row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvferry.core.catalog import Catalog, CatalogConfig, Reservation, StoreAsk
from kvferry.core.errors import InvalidInputError
from kvferry.core.eviction import EvictionPolicyKind
from kvferry.core.keys import OffloadKey


class _GeneralPathOnly(Catalog):
    """The catalog with its short path for absent keys turned off."""

    def _reserve_absent_each(self, asks: Sequence[StoreAsk]) -> None:
        return None


@dataclass(frozen=True)
class _Reserve:
    keys: list[OffloadKey]
    request: str | None
    with_positions: bool


@dataclass(frozen=True)
class _ReserveEach:
    asks: list[_Reserve]


@dataclass(frozen=True)
class _Complete:
    success: bool


_UNIVERSE = [OffloadKey(g, bytes([h]) * 8) for g in range(3) for h in range(4)]
_RESERVE = st.builds(
    _Reserve,
    st.lists(st.sampled_from(_UNIVERSE), max_size=5),
    st.sampled_from(["a", "b", None]),
    st.booleans(),
)
_STEPS = st.lists(
    st.one_of(
        _RESERVE,
        st.builds(_ReserveEach, st.lists(_RESERVE, max_size=4)),
        st.builds(_Complete, st.booleans()),
    ),
    max_size=30,
)


def _answer(reservation: Reservation | None) -> object:
    if reservation is None:
        return None
    rows, evicted_rows = reservation.rows.tolist(), reservation.evicted_rows.tolist()
    return (reservation.keys, rows, reservation.evicted, evicted_rows)


def _ask(step: _Reserve) -> StoreAsk:
    positions = [16 * (i + 1) for i in range(len(step.keys))]
    return StoreAsk(step.keys, positions if step.with_positions else None, step.request)


def _reserve_each(catalog: Catalog, asks: list[StoreAsk]) -> list[Reservation | None]:
    """`reserve_each` by its definition: `reserve` for one ask after the other, after a check
    that none would be refused (a refusal changes nothing)."""
    for ask in asks:
        if len(set(ask.keys)) != len(ask.keys):
            return catalog.reserve_each([ask])  # the refusal, raised by the code under test
    return [catalog.reserve(a.keys, positions=a.positions, request=a.request) for a in asks]


def _run(
    catalog: Catalog, steps: list[_Reserve | _ReserveEach | _Complete], *, each: bool = True
) -> list[object]:
    """Return what each step answered, and what the catalog holds after it; `each=False`
    reserves a step's stores one after the other instead of calling `reserve_each`."""
    seen: list[object] = []
    writing: list[tuple[OffloadKey, ...]] = []
    for step in steps:
        if isinstance(step, (_Reserve, _ReserveEach)):
            asks = [_ask(s) for s in step.asks] if isinstance(step, _ReserveEach) else [_ask(step)]
            try:
                if isinstance(step, _Reserve):
                    a = asks[0]
                    answers = [catalog.reserve(a.keys, positions=a.positions, request=a.request)]
                elif each:
                    answers = catalog.reserve_each(asks)
                else:
                    answers = _reserve_each(catalog, asks)
            except InvalidInputError as refusal:  # a key twice: the same refusal on both
                seen.append(str(refusal))
                continue
            seen.append([_answer(reservation) for reservation in answers])
            writing += [r.keys for r in answers if r is not None and r.keys]
        elif writing:
            catalog.complete_store(writing.pop(0), success=step.success)
        seen.append((catalog.snapshot(), catalog.counters(), catalog.drain_events()))
    return seen


def _key(hash_byte: int) -> OffloadKey:
    return OffloadKey(0, bytes([hash_byte]) * 8)


def _a_then_b_then(third: _Reserve | _ReserveEach) -> list[_Reserve | _ReserveEach | _Complete]:
    """Return a history with one row left: "a" stores key 1, "b" key 2, then `third`, then a
    store of key 4 that must evict (tail-first: the least recently active request's key)."""
    return [
        _Reserve([_key(1)], "a", True),
        _Complete(True),
        _Reserve([_key(2)], "b", True),
        _Complete(True),
        third,
        _Reserve([_key(4)], None, True),
    ]


@settings(max_examples=1000)
@example(  # reserving key 3 makes "a" the most recently active: key 4 evicts "b"'s key 2
    policy=EvictionPolicyKind.TAIL_FIRST,
    capacity=3,
    steps=_a_then_b_then(_Reserve([_key(3)], "a", True)),
)
@given(
    policy=st.sampled_from(list(EvictionPolicyKind)),
    capacity=st.integers(1, 4),
    steps=_STEPS,
)
def test_a_quick_reservation_answers_and_changes_what_the_general_path_does(
    policy: EvictionPolicyKind, capacity: int, steps: list[_Reserve | _ReserveEach | _Complete]
) -> None:
    config = CatalogConfig(capacity_rows=capacity, policy=policy, record_events=True)
    assert _run(Catalog(config), steps) == _run(_GeneralPathOnly(config), steps, each=False)


@settings(max_examples=1000)
@example(  # two stores of one step, both absent and with room: rows taken in the asks' order
    policy=EvictionPolicyKind.LRU,
    capacity=4,
    steps=[
        _ReserveEach(
            [
                _Reserve([_key(1), OffloadKey(1, _key(1).block_hash)], "a", True),
                _Reserve([_key(2)], "b", False),
            ]
        ),
        _Complete(True),
        _ReserveEach([_Reserve([_key(3)], "b", True), _Reserve([_key(4)], "a", True)]),
    ],
)
@example(  # the step's store of key 3 makes "a" the most recently active: key 4 evicts key 2
    policy=EvictionPolicyKind.TAIL_FIRST,
    capacity=3,
    steps=_a_then_b_then(_ReserveEach([_Reserve([_key(3)], "a", True)])),
)
@given(
    policy=st.sampled_from(list(EvictionPolicyKind)),
    capacity=st.integers(1, 6),
    steps=_STEPS,
)
def test_reserving_a_steps_stores_in_one_call_answers_and_changes_what_one_after_the_other_does(
    policy: EvictionPolicyKind, capacity: int, steps: list[_Reserve | _ReserveEach | _Complete]
) -> None:
    config = CatalogConfig(capacity_rows=capacity, policy=policy, record_events=True)
    assert _run(Catalog(config), steps) == _run(Catalog(config), steps, each=False)
