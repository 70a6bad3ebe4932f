"""A reservation names the rows its victims held, so a tier below can copy their bytes out
before the reservation's store overwrites them."""

from __future__ import annotations

import pytest

from kvferry.core.catalog import Catalog, CatalogConfig, Reservation
from kvferry.core.errors import PlanInvariantError
from kvferry.core.keys import OffloadKey


def k(i: int) -> OffloadKey:
    return OffloadKey(0, bytes([i]))


def test_a_reservation_names_each_victims_row() -> None:
    catalog = Catalog(CatalogConfig(capacity_rows=2))
    first = catalog.reserve([k(1), k(2)])
    assert first is not None
    catalog.complete_store([k(1), k(2)], success=True)
    rows = {key: int(row) for key, row in zip(first.keys, first.rows, strict=True)}
    second = catalog.reserve([k(3)])
    assert second is not None
    assert second.evicted == (k(1),)  # least recently used
    assert second.evicted_rows.tolist() == [rows[k(1)]]
    assert second.rows.tolist() == [rows[k(1)]]  # the row the store will overwrite


def test_a_reservation_without_victims_names_no_rows() -> None:
    reservation = Catalog(CatalogConfig(capacity_rows=2)).reserve([k(1)])
    assert reservation is not None
    assert reservation.evicted_rows.tolist() == []


def test_a_reservation_refuses_victim_rows_that_do_not_match_its_victims() -> None:
    with pytest.raises(PlanInvariantError, match="evicted_rows"):
        Reservation(keys=(k(1),), rows=[0], evicted=(k(2),), evicted_rows=[])
