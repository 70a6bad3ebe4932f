"""Eviction policies: naming, the rules every policy keeps, and each policy's own order."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.core.catalog import Catalog, CatalogConfig
from kvferry.core.errors import InvalidInputError
from kvferry.core.eviction import (
    ArcPolicy,
    EvictionPolicyKind,
    LruPolicy,
    TailFirstPolicy,
    make_policy,
)
from kvferry.core.keys import KeyStatus, OffloadKey

ALL = list(EvictionPolicyKind)


def k(i: int, group: int = 0) -> OffloadKey:
    return OffloadKey(group, i.to_bytes(4, "big"))


def catalog(capacity: int, policy: EvictionPolicyKind) -> Catalog:
    return Catalog(CatalogConfig(capacity_rows=capacity, policy=policy))


def store(
    cat: Catalog,
    keys: list[OffloadKey],
    *,
    positions: list[int] | None = None,
    request: str | None = None,
) -> tuple[OffloadKey, ...]:
    """Store `keys` (successfully); return the keys evicted to make room."""
    reservation = cat.reserve(keys, positions=positions, request=request)
    assert reservation is not None
    cat.complete_store(list(reservation.keys), success=True)
    return reservation.evicted


def present(cat: Catalog, keys: list[OffloadKey]) -> list[bool]:
    return [s is KeyStatus.HIT for s in cat.statuses(keys)]


# -- naming -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ALL)
def test_a_policy_kind_is_found_by_its_name(kind: EvictionPolicyKind) -> None:
    assert EvictionPolicyKind.from_name(kind.value) is kind


def test_an_unknown_policy_name_suggests_the_closest_one() -> None:
    with pytest.raises(InvalidInputError, match="did you mean 'tail_first'"):
        EvictionPolicyKind.from_name("tail-first")


def test_make_policy_rejects_a_bare_string() -> None:
    with pytest.raises(InvalidInputError, match="EvictionPolicyKind"):
        make_policy("lru", 4)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "cls"),
    [
        (EvictionPolicyKind.LRU, LruPolicy),
        (EvictionPolicyKind.ARC, ArcPolicy),
        (EvictionPolicyKind.TAIL_FIRST, TailFirstPolicy),
    ],
)
def test_make_policy_builds_the_policy_of_each_kind(kind: EvictionPolicyKind, cls: type) -> None:
    assert isinstance(make_policy(kind, 4), cls)


# -- rules every policy keeps -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ALL)
def test_every_policy_skips_pinned_keys(kind: EvictionPolicyKind) -> None:
    cat = catalog(3, kind)
    store(cat, [k(1), k(2), k(3)])
    cat.pin([k(1), k(2)])
    assert store(cat, [k(4)]) == (k(3),)


@pytest.mark.parametrize("kind", ALL)
def test_every_policy_skips_keys_of_the_same_call(kind: EvictionPolicyKind) -> None:
    cat = catalog(2, kind)
    store(cat, [k(1), k(2)])
    assert store(cat, [k(1), k(3)]) == (k(2),)


@pytest.mark.parametrize("kind", ALL)
def test_every_policy_says_no_room_when_too_few_keys_are_evictable(
    kind: EvictionPolicyKind,
) -> None:
    cat = catalog(3, kind)
    store(cat, [k(1), k(2), k(3)])
    cat.pin([k(1)])
    before = cat.snapshot()
    assert cat.reserve([k(2), k(4), k(5)]) is None
    assert cat.snapshot() == before


@pytest.mark.parametrize("kind", ALL)
def test_every_policy_forgets_evicted_keys(kind: EvictionPolicyKind) -> None:
    policy = make_policy(kind, 2)
    policy.admit(k(1), row=0, position=4, request="a")
    policy.remove(k(1), row=0)
    assert len(policy) == 0
    assert policy.choose(1, lambda key: False) is None


@pytest.mark.parametrize("kind", ALL)
def test_choosing_victims_changes_nothing(kind: EvictionPolicyKind) -> None:
    policy = make_policy(kind, 4)
    for i in range(1, 5):
        policy.admit(k(i), row=i - 1, position=4 * i, request="a")
    first = policy.choose(2, lambda key: False)
    assert policy.choose(2, lambda key: False) == first
    assert len(policy) == 4


@pytest.mark.parametrize("kind", ALL)
def test_a_catalog_never_holds_more_rows_than_its_capacity(kind: EvictionPolicyKind) -> None:
    cat = catalog(5, kind)  # five rows of each group
    for i in range(40):
        store(cat, [k(i), k(i + 100, group=1)], positions=[16, 16], request=f"r{i % 3}")
        if i % 4 == 0:
            cat.pin([k(i)])
        if i % 4 == 1:
            cat.unpin([k(i - 1)])
        assert all(used <= 5 for used in cat.counters().group_rows_used)
        assert cat.rows_used <= 10


# -- LRU --------------------------------------------------------------------------------------


def test_lru_evicts_the_least_recently_stored_key() -> None:
    cat = catalog(3, EvictionPolicyKind.LRU)
    store(cat, [k(1), k(2), k(3)])
    assert store(cat, [k(4), k(5)]) == (k(1), k(2))


def test_lru_keeps_a_key_that_a_load_used_recently() -> None:
    cat = catalog(3, EvictionPolicyKind.LRU)
    store(cat, [k(1), k(2), k(3)])
    cat.pin([k(1)])
    cat.unpin([k(1)])
    assert store(cat, [k(4)]) == (k(2),)


def test_lru_keeps_a_present_key_asked_to_be_stored_again() -> None:
    cat = catalog(3, EvictionPolicyKind.LRU)
    store(cat, [k(1), k(2), k(3)])
    store(cat, [k(1)])
    assert store(cat, [k(4)]) == (k(2),)


# -- ARC --------------------------------------------------------------------------------------


def test_arc_keeps_reused_keys_through_a_scan_that_lru_lets_through() -> None:
    def run(kind: EvictionPolicyKind) -> list[bool]:
        cat = catalog(4, kind)
        store(cat, [k(1), k(2)])
        cat.pin([k(1), k(2)])
        cat.unpin([k(1), k(2)])
        for i in range(10, 16):  # a scan of keys used once
            store(cat, [k(i)])
        return present(cat, [k(1), k(2)])

    assert run(EvictionPolicyKind.LRU) == [False, False]
    assert run(EvictionPolicyKind.ARC) == [True, True]


def test_arc_moves_a_key_used_again_from_t1_to_t2() -> None:
    policy = ArcPolicy(4)
    policy.admit(k(1), position=4, request=None)
    policy.admit(k(2), position=8, request=None)
    policy.touch([k(1)], request=None)
    assert policy.lists() == ((k(2),), (k(1),), (), ())


def test_arc_remembers_evicted_keys_in_the_ghost_list_of_their_list() -> None:
    policy = ArcPolicy(4)
    policy.admit(k(1), position=4, request=None)
    policy.admit(k(2), position=8, request=None)
    policy.touch([k(2)], request=None)
    policy.remove(k(1))
    policy.remove(k(2))
    assert policy.lists() == ((), (), (k(1),), (k(2),))


def test_arc_grows_its_t1_target_when_a_key_evicted_from_t1_returns() -> None:
    policy = ArcPolicy(4)
    policy.admit(k(1), position=4, request=None)
    policy.remove(k(1))
    policy.admit(k(1), position=4, request=None)
    assert policy.target_t1 == 1
    assert policy.lists()[1] == (k(1),)


def test_arc_shrinks_its_t1_target_when_a_key_evicted_from_t2_returns() -> None:
    policy = ArcPolicy(4)
    for i in (1, 2):
        policy.admit(k(i), position=4 * i, request=None)
        policy.remove(k(i))
        policy.admit(k(i), position=4 * i, request=None)  # B1 hits: p = 2
    policy.remove(k(2))  # from T2 to B2
    policy.admit(k(2), position=8, request=None)
    assert policy.target_t1 == 1


def test_arc_evicts_from_t2_while_t1_is_within_its_target() -> None:
    policy = ArcPolicy(4)
    policy.admit(k(1), position=4, request=None)
    policy.remove(k(1))
    policy.admit(k(1), position=4, request=None)  # p = 1, k1 in T2
    policy.admit(k(2), position=8, request=None)  # T1 = [k2], at its target
    assert policy.choose(1, lambda key: False) == [k(1)]


def test_arc_falls_back_to_t1_when_t2_has_no_evictable_key() -> None:
    policy = ArcPolicy(4)
    policy.admit(k(1), position=4, request=None)
    policy.remove(k(1))
    policy.admit(k(1), position=4, request=None)
    policy.admit(k(2), position=8, request=None)
    assert policy.choose(1, lambda key: key == k(1)) == [k(2)]


def test_arc_keeps_its_ghost_lists_within_twice_the_capacity() -> None:
    policy = ArcPolicy(2)
    for i in range(20):
        policy.admit(k(i), position=4, request=None)
        policy.touch([k(i)], request=None)
        policy.remove(k(i))
    assert sum(len(part) for part in policy.lists()) <= 4


# -- tail-first -------------------------------------------------------------------------------


def test_tail_first_evicts_later_token_positions_first_within_the_group_needing_room() -> None:
    cat = catalog(3, EvictionPolicyKind.TAIL_FIRST)
    keys = [k(1), k(2), k(3), k(11, group=1), k(12, group=1)]
    store(cat, keys, positions=[16, 32, 48, 24, 48], request="a")
    assert store(cat, [k(20), k(21)], request="b") == (k(3), k(2))
    assert store(cat, [k(30, group=1), k(31, group=1)], request="b") == (k(12, group=1),)


def test_tail_first_evicts_the_least_recently_active_request_first() -> None:
    cat = catalog(4, EvictionPolicyKind.TAIL_FIRST)
    store(cat, [k(1), k(2)], positions=[16, 32], request="a")
    store(cat, [k(3), k(4)], positions=[16, 32], request="b")
    assert store(cat, [k(5)], positions=[16], request="c") == (k(2),)


def test_tail_first_keeps_a_head_stored_before_its_tail() -> None:
    cat = catalog(4, EvictionPolicyKind.TAIL_FIRST)
    store(cat, [k(1)], positions=[16], request="a")  # prompt stored chunk by chunk
    store(cat, [k(2)], positions=[32], request="a")
    store(cat, [k(3)], positions=[48], request="a")
    store(cat, [k(9)], positions=[16], request="b")
    assert store(cat, [k(4)], positions=[64], request="a") == (k(9),)
    assert store(cat, [k(5)], positions=[16], request="c") == (k(4),)


def test_tail_first_gives_keys_a_load_uses_to_the_loading_request() -> None:
    cat = catalog(4, EvictionPolicyKind.TAIL_FIRST)
    store(cat, [k(1), k(2), k(3)], positions=[16, 32, 48], request="a")
    store(cat, [k(4)], positions=[16], request="b")
    cat.pin([k(1)], request="c")  # c shares a's head
    cat.unpin([k(1)])
    assert store(cat, [k(5), k(6), k(7)], request="d") == (k(3), k(2), k(4))
    assert present(cat, [k(1)]) == [True]


def test_tail_first_without_requests_orders_one_owner_by_position() -> None:
    policy = TailFirstPolicy(4)
    policy.admit(k(1), position=48, request=None)
    policy.admit(k(2), position=16, request=None)
    policy.admit(k(3), position=32, request=None)
    assert policy.choose(3, lambda key: False) == [k(1), k(3), k(2)]


class _ReferenceLru:
    """The LRU order kept the plain way: an ordered dictionary, oldest first."""

    def __init__(self) -> None:
        self.order: OrderedDict[OffloadKey, None] = OrderedDict()

    def choose(self, count: int, protected: set[OffloadKey]) -> list[OffloadKey] | None:
        victims = [key for key in self.order if key not in protected][:count]
        return victims if len(victims) == count else None


_LRU_CALLS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "touch", "remove", "choose"]),
        st.lists(st.integers(0, 11), min_size=1, max_size=6),
        st.integers(1, 5),
    ),
    max_size=60,
)


@given(calls=_LRU_CALLS, queue_rows=st.integers(1, 8))
def test_lru_chooses_exactly_what_an_ordered_dictionary_would(
    calls: list[tuple[str, list[int], int]], queue_rows: int
) -> None:
    policy = LruPolicy(12)
    policy.QUEUE_ROWS = queue_rows  # small queues: retaken often
    reference = _ReferenceLru()
    for call, rows, count in calls:
        held = [row for row in dict.fromkeys(rows) if k(row) in reference.order]
        if call == "admit":
            new = [row for row in dict.fromkeys(rows) if k(row) not in reference.order]
            policy.admit_all(
                [k(row) for row in new], rows=new, positions=[0] * len(new), request=None
            )
            reference.order.update(dict.fromkeys(k(row) for row in new))
        elif call == "touch":
            policy.touch([k(row) for row in rows], rows=rows, request=None)
            for row in rows:
                if k(row) in reference.order:
                    reference.order.move_to_end(k(row))
        elif call == "remove":
            for row in held:
                policy.remove(k(row), row=row)
                del reference.order[k(row)]
        else:
            shielded = {k(row) for row in rows}
            assert policy.choose(count, shielded.__contains__) == reference.choose(count, shielded)
        assert len(policy) == len(reference.order)
