"""The engine's hash list must have one hash per `hash_block_size` tokens: a count that does
not match the tokens (the engine hashes every other number of tokens) is refused, naming the
setting, instead of keying chunks by the wrong prefix."""

from __future__ import annotations

import pytest
from session_fakes import blocks, prefix_hashes

from kvferry.adapters.session import OffloadSession, RunningRequest
from kvferry.core.catalog import Catalog, CatalogConfig
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.errors import InvalidInputError

CONFIG = OffloadConfig(  # hash_block_size 8, but the engine below hashes every 16 tokens
    hash_block_size=8,
    blocks_per_chunk=1,
    groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),),
)


def session() -> OffloadSession:
    return OffloadSession(CONFIG, Catalog(CatalogConfig(capacity_rows=8)))


def test_too_few_hashes_for_the_tokens_are_refused_at_lookup() -> None:
    with pytest.raises(InvalidInputError, match=r"8 hashes for 64 tokens.*hash_block_size=8"):
        session().lookup("r1", block_hashes=prefix_hashes(4), num_tokens=64, num_computed_tokens=0)


def test_too_many_hashes_for_the_tokens_are_refused_at_lookup() -> None:
    with pytest.raises(InvalidInputError, match="hash_block_size"):
        session().lookup("r1", block_hashes=prefix_hashes(9), num_tokens=64, num_computed_tokens=0)


def test_a_store_step_with_too_few_hashes_is_refused() -> None:
    step = RunningRequest(
        request_id="r1",
        blocks=[blocks([1, 2, 3, 4])],
        num_computed_tokens=0,
        num_scheduled_tokens=64,
        num_tokens=64,
        block_hashes=prefix_hashes(4),
    )
    with pytest.raises(InvalidInputError, match="block_hashes"):
        session().start_stores([step])


def test_a_matching_count_is_taken() -> None:
    found = session().lookup(
        "r1", block_hashes=prefix_hashes(8), num_tokens=67, num_computed_tokens=0
    )
    assert found.tokens == 0
