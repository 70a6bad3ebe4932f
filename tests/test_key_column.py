"""KeyColumn: a plan's keys as columns (groups, hashes), OffloadKeys made only when read."""

from __future__ import annotations

import numpy as np
import pytest

from kvferry.core import GroupBlocks, GroupKind, GroupSpec, OffloadConfig, new_request_state
from kvferry.core.errors import InvalidInputError
from kvferry.core.keys import KeyColumn, OffloadKey
from kvferry.core.load import plan_load
from kvferry.core.state import RequestState

KEYS = (OffloadKey(0, b"\x01\x01"), OffloadKey(0, b"\x02\x02"), OffloadKey(1, b"\x03\x03"))


def test_a_column_equals_the_tuple_of_its_keys_and_hashes_like_it() -> None:
    column = KeyColumn(KEYS)
    assert column == KEYS
    assert column == KEYS
    assert hash(column) == hash(KEYS)
    assert list(column) == list(KEYS)
    assert column[1] == KEYS[1]
    assert column[1:] == KEYS[1:]


def test_a_blob_column_and_a_hash_list_column_of_the_same_keys_are_equal() -> None:
    groups = np.array([0, 0, 1], dtype=np.int64)
    blob = KeyColumn.of_blob(groups, b"\x01\x01\x02\x02\x03\x03", 2)
    listed = KeyColumn.of_hashes(groups, [b"\x01\x01", b"\x02\x02", b"\x03\x03"], 2)
    assert blob == listed == KEYS
    assert blob.hash_blob() == (b"\x01\x01\x02\x02\x03\x03", 2)


def test_hashes_of_different_lengths_have_no_one_width() -> None:
    column = KeyColumn((OffloadKey(0, b"\x01"), OffloadKey(0, b"\x02\x02")))
    assert column.hash_blob() == (b"", -1)
    assert column.hashes() == [b"\x01", b"\x02\x02"]


def test_a_blob_that_is_not_one_hash_per_group_entry_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="2 hashes of 4 bytes"):
        KeyColumn.of_blob(np.array([0, 0], dtype=np.int64), b"\x00" * 7, 4)


def test_a_column_holds_offload_keys_only() -> None:
    with pytest.raises(InvalidInputError, match="OffloadKey"):
        KeyColumn([(0, b"\x01")])  # type: ignore[list-item]


def test_keys_of_one_group_are_read_from_the_group_column() -> None:
    assert KeyColumn(KEYS).of_group(0) == KEYS[:2]
    assert KeyColumn(KEYS).of_group(2) == ()


def five_chunk_request() -> tuple[OffloadConfig, list[bytes], RequestState]:
    """One full-attention group, 16-token blocks and chunks; a request of 5 chunks."""
    config = OffloadConfig(
        hash_block_size=16,
        blocks_per_chunk=1,
        groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),),
    )
    hashes = [bytes([i]) * 8 for i in range(5)]
    return (
        config,
        hashes,
        new_request_state(config, "r1", num_prompt_tokens=80, block_hashes=hashes),
    )


def test_a_load_plan_carries_its_keys_as_a_column_without_making_key_objects() -> None:
    config, hashes, state = five_chunk_request()
    blocks = [GroupBlocks.of(np.arange(1, 6))]
    plan, _ = plan_load(config, state, blocks, num_computed_tokens=0, hit_tokens=64)
    assert plan.keys._tuple is None  # nothing has read a key yet
    assert plan.keys.hash_blob() == (b"".join(hashes[:4]), 8)
    assert plan.keys == tuple(OffloadKey(0, h) for h in hashes[:4])


def test_a_load_plan_after_a_lookup_keeps_the_keys_the_lookup_made() -> None:
    config, _, state = five_chunk_request()
    read = state.keys[0][0:4]  # what a lookup's status read makes and keeps
    blocks = [GroupBlocks.of(np.arange(1, 6))]
    plan, _ = plan_load(config, state, blocks, num_computed_tokens=0, hit_tokens=64)
    assert all(made is kept for made, kept in zip(plan.keys, read, strict=True))
