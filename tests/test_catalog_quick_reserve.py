"""A reservation of a few absent keys with room for all takes a short path (a store at a decode
step): whatever the policy and history, it answers and changes exactly what the general path
would, row for row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvferry.core.catalog import Catalog, CatalogConfig, Reservation
from kvferry.core.errors import InvalidInputError
from kvferry.core.eviction import EvictionPolicyKind
from kvferry.core.keys import OffloadKey


class _GeneralPathOnly(Catalog):
    """The catalog with its short path for absent keys turned off."""

    def _reserve_absent(
        self, keys: Sequence[OffloadKey], positions: Sequence[int] | None, request: str | None
    ) -> Reservation | None:
        return None


@dataclass(frozen=True)
class _Reserve:
    keys: list[OffloadKey]
    request: str | None
    with_positions: bool


@dataclass(frozen=True)
class _Complete:
    success: bool


_UNIVERSE = [OffloadKey(g, bytes([h]) * 8) for g in range(3) for h in range(4)]
_STEPS = st.lists(
    st.one_of(
        st.builds(
            _Reserve,
            st.lists(st.sampled_from(_UNIVERSE), max_size=5),
            st.sampled_from(["a", "b", None]),
            st.booleans(),
        ),
        st.builds(_Complete, st.booleans()),
    ),
    max_size=30,
)


def _answer(reservation: Reservation | None) -> object:
    if reservation is None:
        return None
    rows, evicted_rows = reservation.rows.tolist(), reservation.evicted_rows.tolist()
    return (reservation.keys, rows, reservation.evicted, evicted_rows)


def _run(catalog: Catalog, steps: list[_Reserve | _Complete]) -> list[object]:
    """Return what each step answered, and what the catalog holds after it."""
    seen: list[object] = []
    writing: list[tuple[OffloadKey, ...]] = []
    for step in steps:
        if isinstance(step, _Reserve):
            positions = [16 * (i + 1) for i in range(len(step.keys))]
            try:
                reservation = catalog.reserve(
                    step.keys,
                    positions=positions if step.with_positions else None,
                    request=step.request,
                )
            except InvalidInputError as refusal:  # a key twice: the same refusal on both
                seen.append(str(refusal))
                continue
            seen.append(_answer(reservation))
            if reservation is not None and reservation.keys:
                writing.append(reservation.keys)
        elif writing:
            catalog.complete_store(writing.pop(0), success=step.success)
        seen.append((catalog.snapshot(), catalog.counters(), catalog.drain_events()))
    return seen


def _key(hash_byte: int) -> OffloadKey:
    return OffloadKey(0, bytes([hash_byte]) * 8)


@settings(max_examples=1000)
@example(  # reserving key 3 makes "a" the most recently active: key 4 evicts "b"'s key 2
    policy=EvictionPolicyKind.TAIL_FIRST,
    capacity=3,
    steps=[
        _Reserve([_key(1)], "a", True),
        _Complete(True),
        _Reserve([_key(2)], "b", True),
        _Complete(True),
        _Reserve([_key(3)], "a", True),
        _Reserve([_key(4)], None, True),
    ],
)
@given(
    policy=st.sampled_from(list(EvictionPolicyKind)),
    capacity=st.integers(1, 4),
    steps=_STEPS,
)
def test_a_quick_reservation_answers_and_changes_what_the_general_path_does(
    policy: EvictionPolicyKind, capacity: int, steps: list[_Reserve | _Complete]
) -> None:
    config = CatalogConfig(capacity_rows=capacity, policy=policy, record_events=True)
    assert _run(Catalog(config), steps) == _run(_GeneralPathOnly(config), steps)
