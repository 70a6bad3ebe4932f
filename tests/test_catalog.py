"""The CPU-tier catalog's rules: rows, reservation, completion, pins, views, events, counters."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.core.blocks import GroupBlocks
from kvferry.core.catalog import (
    Catalog,
    CatalogConfig,
    CatalogEntry,
    CatalogEvent,
    EventKind,
    KeyState,
    rows_for_budget,
)
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.errors import InvalidInputError, PlanInvariantError
from kvferry.core.eviction import EvictionPolicyKind
from kvferry.core.group_rows import FoundRows
from kvferry.core.keys import KeyStatus, OffloadKey
from kvferry.core.state import new_request_state
from kvferry.core.store import StoreOutcome, StoreTierView, plan_store

HIT, MISS, PENDING = KeyStatus.HIT, KeyStatus.MISS, KeyStatus.PENDING


def k(i: int, group: int = 0) -> OffloadKey:
    return OffloadKey(group, i.to_bytes(4, "big"))


def catalog(capacity: int, *, events: bool = False) -> Catalog:
    return Catalog(CatalogConfig(capacity_rows=capacity, record_events=events))


def stored(capacity: int, keys: list[OffloadKey], *, events: bool = False) -> Catalog:
    """A catalog where `keys` are ready (stored in that order)."""
    cat = catalog(capacity, events=events)
    reservation = cat.reserve(keys)
    assert reservation is not None
    cat.complete_store(keys, success=True)
    return cat


# -- capacity ---------------------------------------------------------------------------------


def test_rows_for_budget_counts_whole_rows() -> None:
    assert rows_for_budget(10 * 2**30, 3 * 2**20) == (3413,)


def test_rows_for_budget_gives_every_group_the_same_number_of_chunks() -> None:
    # 1000 + 100 + 100 bytes hold one chunk of every group: 10 of each in 12,345 bytes
    assert rows_for_budget(12_345, [1000, 100, 100]) == (10, 10, 10)


def test_rows_for_budget_gives_each_group_its_weight_in_chunks() -> None:
    # weights 1, 4: n * (1000 + 4 * 100) <= 14_000 gives n = 10
    assert rows_for_budget(14_000, [1000, 100], weights=[1, 4]) == (10, 40)


def test_rows_for_budget_refuses_a_weight_below_one_naming_the_group() -> None:
    with pytest.raises(InvalidInputError, match=r"group 1.*weights"):
        rows_for_budget(1 << 20, [1000, 100], weights=[1, 0])


def test_rows_for_budget_refuses_weights_for_another_number_of_groups() -> None:
    with pytest.raises(InvalidInputError, match="weights"):
        rows_for_budget(1 << 20, [1000, 100], weights=[1])


def test_rows_for_budget_rejects_a_zero_row_size() -> None:
    with pytest.raises(InvalidInputError, match="row_pitches"):
        rows_for_budget(1024, 0)


def test_rows_for_budget_rejects_a_negative_budget() -> None:
    with pytest.raises(InvalidInputError, match="budget_bytes"):
        rows_for_budget(-1, 64)


def test_config_rejects_a_negative_capacity() -> None:
    with pytest.raises(InvalidInputError, match="capacity_rows"):
        CatalogConfig(capacity_rows=-1)


def test_config_rejects_a_policy_given_as_a_string() -> None:
    with pytest.raises(TypeError):
        CatalogConfig(capacity_rows=4, policy="lru")  # type: ignore[arg-type]


def test_catalog_rejects_a_config_that_is_not_a_catalog_config() -> None:
    with pytest.raises(InvalidInputError, match="config"):
        Catalog({"capacity_rows": 4})  # type: ignore[arg-type]


def test_a_zero_capacity_tier_has_no_room_for_one_key() -> None:
    assert catalog(0).reserve([k(1)]) is None


# -- rows per group -------------------------------------------------------------------------------


def test_every_group_has_its_own_rows_from_zero() -> None:
    reservation = catalog(2).reserve([k(1, 0), k(2, 1), k(3, 0)])
    assert reservation is not None
    assert reservation.rows.tolist() == [0, 0, 1]


def test_one_capacity_applies_to_every_group() -> None:
    cat = stored(2, [k(1, 0), k(2, 0), k(3, 1), k(4, 1)])
    assert cat.rows_used == 4
    assert (cat.free_rows(0), cat.free_rows(1)) == (0, 0)


def test_per_group_capacities_bound_each_group_on_its_own() -> None:
    cat = Catalog(CatalogConfig(capacity_rows=(1, 3)))
    assert cat.reserve([k(1, 1), k(2, 1), k(3, 1)]) is not None
    assert cat.reserve([k(4, 0), k(5, 0)]) is None
    assert cat.group_capacity(1) == 3


def test_making_room_evicts_only_keys_of_the_group_that_needs_it() -> None:
    cat = stored(1, [k(1, 0), k(2, 1)])
    reservation = cat.reserve([k(3, 1)])
    assert reservation is not None
    assert reservation.evicted == (k(2, 1),)
    assert cat.statuses([k(1, 0)]) == [HIT]


def test_a_full_group_refuses_its_keys_while_another_group_has_room() -> None:
    cat = stored(1, [k(1, 0)])
    cat.pin([k(1, 0)])
    assert not cat.can_reserve([k(2, 0)])
    assert cat.can_reserve([k(3, 1)])


def test_a_key_of_a_group_the_per_group_capacities_lack_is_refused_changing_nothing() -> None:
    cat = Catalog(CatalogConfig(capacity_rows=(2, 2)))
    with pytest.raises(InvalidInputError, match=r"group 2.*capacity_rows"):
        cat.reserve([k(1, 0), k(2, 2)])
    assert cat.rows_used == 0


def test_config_rejects_a_negative_capacity_of_one_group() -> None:
    with pytest.raises(InvalidInputError, match=r"group 1.*capacity_rows"):
        CatalogConfig(capacity_rows=(4, -1))


# -- reservation ------------------------------------------------------------------------------


def test_reserve_gives_fresh_rows_in_the_order_asked() -> None:
    reservation = catalog(4).reserve([k(1), k(2), k(3)])
    assert reservation is not None
    assert reservation.keys == (k(1), k(2), k(3))
    assert reservation.rows.tolist() == [0, 1, 2]


def test_reserved_keys_are_pending_never_hits() -> None:
    cat = catalog(4)
    cat.reserve([k(1)])
    assert cat.statuses([k(1), k(2)]) == [PENDING, MISS]


def test_reserve_skips_keys_already_present_without_error() -> None:
    cat = stored(4, [k(1)])
    cat.reserve([k(2)])
    reservation = cat.reserve([k(1), k(2), k(3)])
    assert reservation is not None
    assert reservation.keys == (k(3),)
    assert reservation.rows.tolist() == [2]


def test_reserve_refuses_a_repeated_key_changing_nothing() -> None:
    cat = catalog(4)
    with pytest.raises(InvalidInputError, match="each key once") as caught:
        cat.reserve([k(1), k(1)], request="r1")
    assert caught.value.request == "r1"
    assert cat.snapshot() == {} and cat.counters().misses == 0


def test_reserve_reuses_rows_freed_by_a_failed_store() -> None:
    cat = catalog(2)
    cat.reserve([k(1), k(2)])
    cat.complete_store([k(2)], success=False)
    reservation = cat.reserve([k(3)])
    assert reservation is not None
    assert reservation.rows.tolist() == [1]


def test_reserve_evicts_ready_keys_to_make_room() -> None:
    cat = stored(2, [k(1), k(2)])
    reservation = cat.reserve([k(3)])
    assert reservation is not None
    assert reservation.evicted == (k(1),)
    assert reservation.rows.tolist() == [0]
    assert cat.statuses([k(1), k(2), k(3)]) == [MISS, HIT, PENDING]


def test_reserve_with_too_little_room_changes_nothing_and_says_no_room() -> None:
    cat = stored(3, [k(1), k(2)])
    cat.pin([k(1)])
    cat.reserve([k(3)])
    before = cat.snapshot()
    assert cat.reserve([k(4), k(5)]) is None
    assert cat.snapshot() == before


def test_reserve_never_evicts_a_key_of_the_same_call() -> None:
    cat = stored(2, [k(1), k(2)])
    assert cat.reserve([k(1), k(2), k(3)]) is None
    assert cat.statuses([k(1), k(2)]) == [HIT, HIT]


def test_reserve_never_evicts_a_pinned_key() -> None:
    cat = stored(2, [k(1), k(2)])
    cat.pin([k(1)])
    reservation = cat.reserve([k(3)])
    assert reservation is not None
    assert reservation.evicted == (k(2),)


def test_reserve_never_evicts_a_writing_key() -> None:
    cat = catalog(2)
    cat.reserve([k(1), k(2)])
    assert cat.reserve([k(3)]) is None


def test_reserve_rejects_positions_that_do_not_match_the_keys() -> None:
    with pytest.raises(InvalidInputError, match="positions"):
        catalog(4).reserve([k(1), k(2)], positions=[16])


def test_can_reserve_agrees_with_reserve_and_changes_nothing() -> None:
    cat = stored(2, [k(1), k(2)])
    cat.pin([k(1)])
    before = cat.snapshot()
    assert cat.can_reserve([k(3)]) is True
    assert cat.can_reserve([k(3), k(4)]) is False
    assert cat.can_reserve([k(2), k(3)]) is False
    assert cat.snapshot() == before


def test_can_reserve_is_true_when_every_key_is_present() -> None:
    assert stored(1, [k(1)]).can_reserve([k(1)]) is True


# -- store completion -------------------------------------------------------------------------


def test_a_successful_store_makes_its_keys_ready() -> None:
    cat = catalog(2)
    cat.reserve([k(1)])
    cat.complete_store([k(1)], success=True)
    assert cat.entry(k(1)) == CatalogEntry(state=KeyState.READY, row=0, pins=0)


def test_a_failed_store_forgets_its_keys_and_frees_their_rows() -> None:
    cat = catalog(2)
    cat.reserve([k(1), k(2)])
    cat.complete_store([k(1), k(2)], success=False)
    assert cat.statuses([k(1), k(2)]) == [MISS, MISS]
    assert cat.rows_used == 0


def test_a_failed_store_never_leaves_a_ready_key() -> None:
    cat = stored(3, [k(1)])
    cat.reserve([k(2)])
    cat.complete_store([k(2)], success=False)
    assert cat.snapshot() == {k(1): CatalogEntry(state=KeyState.READY, row=0, pins=0)}


def test_completing_a_store_of_a_key_not_writing_raises_and_changes_nothing() -> None:
    cat = stored(3, [k(1)])
    cat.reserve([k(2)])
    before = cat.snapshot()
    with pytest.raises(PlanInvariantError, match="ready"):
        cat.complete_store([k(2), k(1)], success=False)
    assert cat.snapshot() == before


# -- pins -------------------------------------------------------------------------------------


def test_pin_returns_the_rows_of_the_keys_in_order() -> None:
    cat = stored(4, [k(1), k(2), k(3)])
    assert cat.pin([k(3), k(1)]).tolist() == [2, 0]


def test_pinned_keys_stay_hits_in_the_catalog() -> None:
    cat = stored(2, [k(1)])
    cat.pin([k(1)])
    assert cat.statuses([k(1)]) == [HIT]
    assert cat.entry(k(1)) == CatalogEntry(state=KeyState.READY, row=0, pins=1)


def test_pinning_a_writing_key_raises_and_pins_nothing() -> None:
    cat = stored(3, [k(1)])
    cat.reserve([k(2)])
    with pytest.raises(PlanInvariantError, match="writing"):
        cat.pin([k(1), k(2)], request="r1")
    assert not cat.is_pinned(k(1))


def test_pinning_an_absent_key_raises() -> None:
    with pytest.raises(PlanInvariantError, match="absent"):
        catalog(2).pin([k(1)])


def test_a_key_pinned_twice_needs_two_unpins_to_become_evictable() -> None:
    cat = stored(1, [k(1)])
    cat.pin([k(1)])
    cat.pin([k(1)])
    cat.unpin([k(1)])
    assert cat.reserve([k(2)]) is None
    cat.unpin([k(1)])
    assert cat.reserve([k(2)]) is not None


def test_unpinning_more_than_pinned_raises_and_changes_nothing() -> None:
    cat = stored(2, [k(1), k(2)])
    cat.pin([k(1), k(2)])
    with pytest.raises(PlanInvariantError, match="pinned 1 time"):
        cat.unpin([k(2), k(1), k(1)])
    assert cat.is_pinned(k(1))
    assert cat.is_pinned(k(2))


# -- views ------------------------------------------------------------------------------------


def test_a_view_with_pinned_as_pending_reports_pinned_keys_pending() -> None:
    cat = stored(3, [k(1), k(2)])
    cat.reserve([k(3)])
    cat.pin([k(1)])
    assert cat.view(pinned_as_pending=True).statuses([k(1), k(2), k(3), k(4)]) == [
        PENDING,
        HIT,
        PENDING,
        MISS,
    ]


def test_a_plain_view_reports_what_the_catalog_reports() -> None:
    cat = stored(3, [k(1)])
    cat.pin([k(1)])
    assert cat.view().statuses([k(1), k(2)]) == cat.statuses([k(1), k(2)])


def test_the_catalog_is_a_store_tier_view_the_planner_accepts() -> None:
    config = OffloadConfig(
        hash_block_size=4,
        blocks_per_chunk=1,
        groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=4),),
    )
    state = new_request_state(config, "r1", num_prompt_tokens=8, block_hashes=[b"\x01", b"\x02"])
    cat = catalog(1)
    tier: StoreTierView = cat
    decision = plan_store(
        config,
        state,
        [GroupBlocks.of([5, 6])],
        num_computed_tokens=0,
        num_scheduled_tokens=8,
        num_tokens=8,
        tier=tier,
    )
    assert decision.outcome is StoreOutcome.NO_ROOM


# -- events and counters ----------------------------------------------------------------------


def test_events_report_stored_keys_per_group() -> None:
    cat = catalog(4, events=True)
    cat.reserve([k(1), k(2, group=1), k(3)])
    cat.complete_store([k(1), k(2, group=1), k(3)], success=True)
    assert cat.drain_events() == (
        CatalogEvent(kind=EventKind.STORED, group=0, keys=(k(1), k(3))),
        CatalogEvent(kind=EventKind.STORED, group=1, keys=(k(2, group=1),)),
    )


def test_events_report_evicted_keys_as_removed() -> None:
    cat = stored(1, [k(1)], events=True)
    cat.drain_events()
    cat.reserve([k(2)])
    assert cat.drain_events() == (CatalogEvent(kind=EventKind.REMOVED, group=0, keys=(k(1),)),)


def test_a_failed_store_records_no_event() -> None:
    cat = catalog(2, events=True)
    cat.reserve([k(1)])
    cat.complete_store([k(1)], success=False)
    assert cat.drain_events() == ()


def test_draining_events_empties_the_queue() -> None:
    cat = stored(1, [k(1)], events=True)
    cat.drain_events()
    assert cat.drain_events() == ()


def test_no_events_accumulate_unless_asked_for() -> None:
    assert stored(1, [k(1)]).drain_events() == ()


def test_counters_count_hits_misses_stores_failures_evictions_and_rows() -> None:
    cat = stored(2, [k(1), k(2)])
    cat.pin([k(2)])
    cat.reserve([k(3)])
    cat.complete_store([k(3)], success=False)
    counters = cat.counters()
    assert (counters.hits, counters.misses, counters.stores) == (1, 3, 2)
    assert (counters.failed_stores, counters.evictions) == (1, 1)
    assert (counters.rows_used, counters.capacity_rows) == (1, 2)
    assert (counters.group_rows_used, counters.group_capacity_rows) == ((1,), (2,))


# -- reset ------------------------------------------------------------------------------------


def test_reset_forgets_every_key_and_pin() -> None:
    cat = stored(3, [k(1), k(2)])
    cat.pin([k(1)])
    cat.reserve([k(3)])
    cat.reset()
    assert cat.snapshot() == {}
    assert cat.rows_used == 0


def test_rows_are_handed_out_from_zero_again_after_reset() -> None:
    cat = stored(3, [k(1), k(2)])
    cat.reset()
    reservation = cat.reserve([k(5)])
    assert reservation is not None
    assert reservation.rows.tolist() == [0]


def test_reset_reports_the_ready_keys_as_removed() -> None:
    cat = stored(3, [k(1)], events=True)
    cat.reserve([k(2)])
    cat.drain_events()
    cat.reset()
    assert cat.drain_events() == (CatalogEvent(kind=EventKind.REMOVED, group=0, keys=(k(1),)),)


def test_reset_keeps_the_counter_totals() -> None:
    cat = stored(3, [k(1)])
    cat.reset()
    assert cat.counters().stores == 1


# -- scale ----------------------------------------------------------------------------------------


def test_statuses_answer_every_key_of_a_long_request() -> None:
    keys = [k(i) for i in range(8192)]
    cat = stored(8192, keys[::2])
    statuses = np.array(cat.statuses(keys))
    assert statuses[::2].tolist() == [HIT] * 4096
    assert statuses[1::2].tolist() == [MISS] * 4096


def test_the_default_policy_is_lru() -> None:
    assert CatalogConfig(capacity_rows=1).policy is EvictionPolicyKind.LRU


def test_completing_a_store_that_names_a_key_twice_completes_it_once() -> None:
    cat = catalog(2)
    cat.reserve([k(1)])
    cat.complete_store([k(1), k(1)], success=False)
    assert cat.rows_used == 0


# -- discarding suspect keys (a load of them failed) ---------------------------------------------


def test_discard_drops_an_unpinned_ready_key_and_frees_its_row() -> None:
    cat = stored(2, [k(1), k(2)])
    cat.discard([k(1)])
    assert cat.statuses([k(1), k(2)]) == [MISS, HIT]
    assert cat.free_rows(0) == 1


def test_discard_of_a_pinned_key_waits_for_its_last_unpin() -> None:
    cat = stored(2, [k(1)])
    cat.pin([k(1)])
    cat.pin([k(1)])
    cat.discard([k(1)])
    cat.unpin([k(1)])
    assert cat.statuses([k(1)]) == [HIT]
    cat.unpin([k(1)])
    assert cat.statuses([k(1)]) == [MISS]


def test_discard_leaves_writing_and_absent_keys_alone() -> None:
    cat = catalog(2)
    cat.reserve([k(1)])
    cat.discard([k(1), k(9)])
    assert cat.statuses([k(1), k(9)]) == [PENDING, MISS]


def test_discard_reports_the_keys_as_removed() -> None:
    cat = stored(2, [k(1)], events=True)
    cat.drain_events()
    cat.discard([k(1)])
    assert cat.drain_events() == (CatalogEvent(kind=EventKind.REMOVED, group=0, keys=(k(1),)),)


def test_a_key_listed_twice_in_one_pin_needs_two_unpins() -> None:
    catalog = Catalog(CatalogConfig(capacity_rows=4))
    key = OffloadKey(0, b"k" * 8)
    reservation = catalog.reserve([key])
    assert reservation is not None
    catalog.complete_store([key], success=True)
    catalog.pin([key, key])
    catalog.unpin([key])
    assert catalog.is_pinned(key)
    catalog.unpin([key])
    assert not catalog.is_pinned(key)


# -- rows a lookup found ----------------------------------------------------------------------


def looked_up(cat: Catalog, keys: list[OffloadKey]) -> FoundRows:
    """Ask a view of `cat` for the statuses of `keys` (one group) by hash, keeping the rows."""
    seen = FoundRows()
    cat.view(seen=seen).hash_statuses(keys[0].group, [key.block_hash for key in keys])
    return seen


def test_a_pin_given_its_lookups_rows_answers_each_keys_row() -> None:
    keys = [k(i) for i in range(6)]
    cat = stored(8, keys)
    seen = looked_up(cat, keys)
    rows = cat.pin(keys[:4], seen=seen)  # the head of what the lookup read
    assert rows.tolist() == [cat_row(cat, key) for key in keys[:4]]
    assert cat.pin(keys[3:], seen=seen).tolist() == [cat_row(cat, key) for key in keys[3:]]


def test_a_pin_finds_rows_again_once_a_row_was_freed_after_the_lookup() -> None:
    a, b, c = k(1), k(2), k(3)
    cat = stored(2, [a, b])
    seen = looked_up(cat, [a])
    before = cat_row(cat, a)
    store_all(cat, [c])  # evicts a (least recent): c takes a's row
    store_all(cat, [a])  # evicts b: a comes back in b's row
    assert cat_row(cat, c) == before
    assert cat.pin([a], seen=seen).tolist() == [cat_row(cat, a)] != [before]


def cat_row(cat: Catalog, key: OffloadKey) -> int:
    entry = cat.entry(key)
    assert entry is not None
    return entry.row


def store_all(cat: Catalog, keys: list[OffloadKey]) -> None:
    reservation = cat.reserve(keys)
    assert reservation is not None
    cat.complete_store(list(reservation.keys), success=True)


def expected_status(cat: Catalog, key: OffloadKey) -> KeyStatus:
    entry = cat.entry(key)
    if entry is None:
        return KeyStatus.MISS
    return KeyStatus.HIT if entry.state is KeyState.READY else KeyStatus.PENDING


@given(
    stores=st.lists(st.lists(st.integers(0, 400), min_size=1, max_size=90), max_size=8),
    asked=st.lists(st.integers(0, 400), min_size=64, max_size=160),
    width=st.sampled_from([8, 16, 5]),
    run_start=st.integers(0, 400),
)
def test_a_long_lookup_answers_each_key_as_its_entry_does(
    stores: list[list[int]], asked: list[int], width: int, run_start: int
) -> None:
    """Long lookups try runs of consecutive rows first; each answer must still be the key's."""

    def key(i: int) -> OffloadKey:
        return OffloadKey(0, i.to_bytes(width, "big"))

    cat = catalog(128)
    for batch in stores:  # stores that evict, so rows are reused out of order
        reservation = cat.reserve([key(i) for i in dict.fromkeys(batch)])
        if reservation is not None:
            cat.complete_store(list(reservation.keys[::2]), success=True)
            cat.complete_store(list(reservation.keys[1::2]), success=len(batch) % 3 > 0)
    for numbers in (asked, list(range(run_start, run_start + len(asked)))):
        keys = [key(i) for i in numbers]
        answers = cat.hash_statuses(0, [k.block_hash for k in keys])
        assert answers == [expected_status(cat, k) for k in keys]
        ready = [k for k, status in zip(keys, answers, strict=True) if status is KeyStatus.HIT]
        if ready:
            assert cat.pin(ready).tolist() == [cat_row(cat, k) for k in ready]
            cat.unpin(ready)


def test_a_pin_given_another_lookups_rows_finds_its_own() -> None:
    keys = [k(i) for i in range(4)]
    cat = stored(8, keys)
    seen = looked_up(cat, keys[:3])
    other = [keys[0], keys[3], keys[2]]  # the same first and last hash, another in between
    assert cat.pin(other, seen=seen).tolist() == [cat_row(cat, key) for key in other]
