"""RowTable: one group's vectorised key -> row table and its row columns."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.errors import InvalidInputError
from kvferry.core.row_table import RowState, RowTable, key_matrix, key_matrix_of_blob


def _keys(*numbers: int, width: int = 8) -> np.ndarray:
    return key_matrix([n.to_bytes(width, "big") for n in numbers], width)


def _ready(table: RowTable, *numbers: int) -> np.ndarray:
    rows = table.reserve(_keys(*numbers, width=table.key_bytes))
    table.complete(rows, success=True)
    return rows


def test_a_reserved_key_is_found_at_its_row_and_an_absent_one_is_not() -> None:
    table = RowTable(4, 8)
    rows = table.reserve(_keys(10, 11))
    assert table.find(_keys(11, 12, 10)).tolist() == [rows[1], -1, rows[0]]


def test_reserve_gives_distinct_free_rows_that_are_writing() -> None:
    table = RowTable(4, 8)
    rows = table.reserve(_keys(1, 2, 3))
    assert sorted(rows.tolist()) == [0, 1, 2]
    assert table.state[rows].tolist() == [RowState.WRITING] * 3
    assert table.num_free == 1


def test_a_successful_store_makes_rows_ready_and_a_failed_one_forgets_the_keys() -> None:
    table = RowTable(4, 8)
    rows = table.reserve(_keys(1, 2))
    table.complete(rows[:1], success=True)
    table.complete(rows[1:], success=False)
    assert table.state[rows].tolist() == [RowState.READY, RowState.FREE]
    assert table.find(_keys(1, 2)).tolist() == [rows[0], -1]
    assert table.num_free == 3


def test_reserve_refuses_a_held_key_and_changes_nothing() -> None:
    table = RowTable(4, 8)
    _ready(table, 1)
    with pytest.raises(InvalidInputError, match="does not hold"):
        table.reserve(_keys(2, 1))
    assert table.find(_keys(2)).tolist() == [-1]
    assert table.num_free == 3


def test_reserve_refuses_a_repeated_key() -> None:
    with pytest.raises(InvalidInputError, match="distinct"):
        RowTable(4, 8).reserve(_keys(5, 5))


def test_reserve_refuses_more_keys_than_free_rows() -> None:
    table = RowTable(2, 8)
    with pytest.raises(InvalidInputError, match="evict first"):
        table.reserve(_keys(1, 2, 3))
    assert table.num_free == 2


def test_keys_of_another_width_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="key matrix of 8-byte keys"):
        RowTable(2, 8).find(_keys(1, width=16))
    with pytest.raises(InvalidInputError, match="hashes of 8 bytes"):
        key_matrix([b"\x01" * 8, b"\x02" * 7], 8)


def test_a_blob_and_a_list_of_the_same_hashes_make_the_same_keys() -> None:
    hashes = [bytes([n]) * 12 for n in range(5)]
    assert np.array_equal(key_matrix(hashes, 12), key_matrix_of_blob(b"".join(hashes), 12))


def test_keys_that_differ_only_past_the_first_word_are_told_apart() -> None:
    table = RowTable(4, 16)
    first = b"\x00" * 8 + b"\x01" * 8
    second = b"\x00" * 8 + b"\x02" * 8
    rows = table.reserve(key_matrix([first], 16))
    assert table.find(key_matrix([first, second], 16)).tolist() == [rows[0], -1]


def test_pins_count_per_listing_and_unpin_gives_them_back() -> None:
    table = RowTable(4, 8)
    rows = _ready(table, 1, 2)
    table.pin(np.array([rows[0], rows[0], rows[1]]))
    assert table.pins[rows].tolist() == [2, 1]
    table.unpin(np.array([rows[0], rows[1]]))
    assert table.pins[rows].tolist() == [1, 0]


def test_unpinning_more_than_was_pinned_is_refused_and_changes_nothing() -> None:
    table = RowTable(4, 8)
    rows = _ready(table, 1)
    table.pin(rows)
    with pytest.raises(InvalidInputError, match="pinned at least 2 times"):
        table.unpin(np.array([rows[0], rows[0]]))
    assert table.pins[rows].tolist() == [1]


def test_a_row_still_writing_cannot_be_pinned() -> None:
    table = RowTable(4, 8)
    rows = table.reserve(_keys(1))
    with pytest.raises(InvalidInputError, match="READY row to pin"):
        table.pin(rows)


def test_a_pinned_row_is_not_evictable_and_cannot_be_evicted() -> None:
    table = RowTable(4, 8)
    rows = _ready(table, 1, 2)
    table.pin(rows[:1])
    assert table.evictable().tolist() == [rows[1]]
    with pytest.raises(InvalidInputError, match="unpinned"):
        table.evict(rows)
    assert table.state[rows].tolist() == [RowState.READY] * 2


def test_eviction_frees_the_row_and_forgets_the_key() -> None:
    table = RowTable(2, 8)
    rows = _ready(table, 1, 2)
    table.evict(rows[:1])
    assert table.find(_keys(1, 2)).tolist() == [-1, rows[1]]
    assert table.reserve(_keys(3)).tolist() == [rows[0]]


def test_least_recent_lists_untouched_rows_first_then_by_last_touch() -> None:
    table = RowTable(4, 8)
    rows = _ready(table, 1, 2, 3, 4)
    table.touch(rows[[2]])
    table.touch(rows[[0]])
    assert table.least_recent(4).tolist() == [rows[1], rows[3], rows[2], rows[0]]
    assert table.least_recent(1).tolist() == [rows[1]]


def test_keys_of_returns_the_bytes_each_row_holds() -> None:
    table = RowTable(2, 5)
    rows = table.reserve(key_matrix([b"abcde", b"\x00\x01\x02\x03\x00"], 5))
    assert table.keys_of(rows) == [b"abcde", b"\x00\x01\x02\x03\x00"]


def test_many_keys_sharing_a_few_home_slots_are_all_found() -> None:
    table = RowTable(4096, 8)
    numbers = [n << 40 for n in range(4096)]  # counters that differ only in high bytes
    rows = table.reserve(_keys(*numbers))
    assert np.array_equal(table.find(_keys(*numbers)), rows)
    assert len(set(rows.tolist())) == 4096


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "fail", "evict"]), st.lists(st.integers(0, 40), max_size=6)
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(_OPS)
def test_the_table_agrees_with_a_dictionary_through_stores_failures_and_evictions(
    ops: list[tuple[str, list[int]]],
) -> None:
    """Removed keys leave markers the probe walks past, and the slots are rebuilt when they
    pile up: every key held must still be found at its row, and every other key not at all."""
    table = RowTable(16, 8)
    model: dict[int, int] = {}
    for op, numbers in ops:
        distinct = list(dict.fromkeys(numbers))
        if op == "evict":
            held = [n for n in distinct if n in model]
            table.evict(np.array([model.pop(n) for n in held], dtype=np.int64))
            continue
        new = [n for n in distinct if n not in model][: table.num_free]
        if not new:
            continue
        rows = table.reserve(_keys(*new))
        table.complete(rows, success=op == "store")
        if op == "store":
            model.update(zip(new, rows.tolist(), strict=True))
    probe = list(range(41))
    assert table.find(_keys(*probe)).tolist() == [model.get(n, -1) for n in probe]
    assert table.num_free == 16 - len(model)
