"""The host tier: exactly the requested size, pinned in row-aligned pieces, mirrors per ref."""

from __future__ import annotations

import numpy as np
import pytest

from kvferry.core.errors import InvalidInputError
from kvferry.core.layout import GroupLayout, KVLayout, PageRef, TierLayout
from kvferry.executors import HostTier, split_pieces


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def register(self, address: int, nbytes: int) -> None:
        self.calls.append(("register", address, nbytes))

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address, 0))


def test_the_tier_is_exactly_each_groups_rows_times_its_pitch_with_no_rounding() -> None:
    tier = HostTier(tier=TierLayout(rows=(3, 5), pitch=(1000, 24)))
    assert tier.nbytes == 3000 + 5 * 24
    assert tier.array.nbytes == 3000 + 5 * 24


def test_each_group_s_region_follows_the_one_before() -> None:
    tier = TierLayout(rows=(3, 5, 2), pitch=(1000, 24, 8))
    assert tier.base == (0, 3000, 3120)
    assert tier.row_offset(1, 4) == 3000 + 4 * 24


def test_pieces_hold_whole_rows_and_never_exceed_the_limit() -> None:
    assert split_pieces(10 * 96, 96, limit=300) == [(0, 288), (288, 288), (576, 288), (864, 96)]


def test_a_row_larger_than_the_piece_limit_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="row_bytes"):
        split_pieces(400, 200, limit=100)


def test_each_piece_is_registered_and_close_unregisters_them_all() -> None:
    recorder = _Recorder()
    tier = HostTier(
        tier=TierLayout(rows=(10, 2), pitch=(96, 40)), registrar=recorder, piece_limit=300
    )
    registered = [(a - tier.address, n) for kind, a, n in recorder.calls if kind == "register"]
    # each group's region in pieces of whole rows of its own pitch
    assert registered == [(0, 288), (288, 288), (576, 288), (864, 96), (960, 80)]
    assert tier.rows_per_piece(0) == 3
    assert tier.rows_per_piece(1) == 7
    assert tier.pinned
    tier.close()
    assert sorted(a for kind, a, _ in recorder.calls if kind == "unregister") == sorted(
        tier.address + offset for offset, _ in registered
    )
    assert not tier.pinned


def test_a_mirror_shows_one_refs_slots_of_every_row() -> None:
    ref_a = PageRef(address=0, num_blocks=4, page_stride=16, page_bytes=10)
    ref_b = PageRef(address=0, num_blocks=4, page_stride=8, page_bytes=8)
    small = PageRef(address=0, num_blocks=4, page_stride=4, page_bytes=4)
    layout = KVLayout(
        blocks_per_chunk=2, groups=[GroupLayout(refs=[small]), GroupLayout(refs=[ref_a, ref_b])]
    )
    tier = HostTier(tier=layout.tier(3))
    tier.array[:] = np.arange(tier.nbytes) % 251
    mirror = tier.mirror(layout, 1, 1)
    assert mirror.shape == (3, 2, 8)
    start = 3 * 2 * 4 + 2 * layout.group_row_bytes(1) + 2 * 10 + 8
    np.testing.assert_array_equal(mirror[2, 1], tier.array[start : start + 8])
