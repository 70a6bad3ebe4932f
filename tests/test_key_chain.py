"""A request's key list per group (`KeyChain`): an immutable sequence that grows without copying
what it holds, whichever earlier chain a caller extends."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.core import (
    GroupKind,
    GroupSpec,
    InvalidInputError,
    KeyChain,
    OffloadConfig,
    OffloadKey,
    RequestState,
    extend_keys,
    new_request_state,
)


def _keys(*numbers: int) -> tuple[OffloadKey, ...]:
    return tuple(OffloadKey(0, bytes([n])) for n in numbers)


def test_a_chain_equals_and_hashes_like_the_tuple_of_its_keys() -> None:
    chain = KeyChain(_keys(1, 2))
    assert chain == _keys(1, 2)
    assert _keys(1, 2) == chain
    assert chain != _keys(1)
    assert chain == KeyChain(_keys(1, 2))
    assert hash(chain) == hash(_keys(1, 2))


def test_extending_leaves_the_original_chain_unchanged() -> None:
    short = KeyChain(_keys(1))
    longer = short.extended(_keys(2, 3))
    assert longer == _keys(1, 2, 3)
    assert short == _keys(1)
    assert len(short) == 1
    assert list(short) == list(_keys(1))


def test_an_older_chain_extended_again_forks_without_touching_the_newer_one() -> None:
    base = KeyChain(_keys(1))
    first = base.extended(_keys(2))
    second = base.extended(_keys(9))
    assert (first, second, base) == (_keys(1, 2), _keys(1, 9), _keys(1))
    assert first.extended(_keys(3)) == _keys(1, 2, 3)


def test_a_chain_sees_only_its_own_length_of_a_longer_shared_list() -> None:
    short = KeyChain(_keys(1, 2))
    short.extended(_keys(3, 4))
    assert short[-1] == OffloadKey(0, b"\x02")
    assert short[1:] == _keys(2)
    assert short[0:10] == _keys(1, 2)
    assert OffloadKey(0, b"\x03") not in short
    with pytest.raises(IndexError):
        short[2]


def test_a_chain_refuses_anything_but_offload_keys() -> None:
    with pytest.raises(InvalidInputError, match="OffloadKey"):
        KeyChain([(0, b"\x01")])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="OffloadKey"):
        KeyChain().extended([b"\x01"])  # type: ignore[list-item]


def test_a_chain_cannot_be_changed_in_place() -> None:
    chain = KeyChain(_keys(1))
    with pytest.raises(AttributeError):
        chain._length = 0  # type: ignore[misc]


def test_a_chain_survives_pickling_as_its_keys() -> None:
    chain = KeyChain(_keys(1, 2)).extended(_keys(3))
    assert pickle.loads(pickle.dumps(chain)) == _keys(1, 2, 3)


def test_a_request_state_made_from_tuples_holds_chains() -> None:
    state = RequestState(
        request_id="r1", num_prompt_tokens=32, keys=(_keys(1, 2),), store_cursor=(1,)
    )
    assert isinstance(state.keys[0], KeyChain)
    assert state.keys == (_keys(1, 2),)


@given(
    st.lists(
        st.tuples(st.integers(min_value=0, max_value=20), st.integers(min_value=0, max_value=3)),
        max_size=30,
    )
)
def test_any_history_of_extensions_gives_each_chain_exactly_its_concatenation(
    steps: list[tuple[int, int]],
) -> None:
    """Each step extends one earlier chain (by its index, modulo how many exist) by some keys;
    every chain made must still equal the tuple built by concatenating plain tuples."""
    chains = [KeyChain()]
    expected: list[tuple[OffloadKey, ...]] = [()]
    for number, (pick, count) in enumerate(steps):
        index = pick % len(chains)
        added = tuple(OffloadKey(0, (number * 4 + i).to_bytes(2, "big")) for i in range(count))
        chains.append(chains[index].extended(added))
        expected.append(expected[index] + added)
    assert [tuple(chain) for chain in chains] == expected
    assert chains == expected


def test_extending_a_states_keys_keeps_the_earlier_states_keys() -> None:
    config = OffloadConfig(
        hash_block_size=16,
        blocks_per_chunk=1,
        groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),),
    )
    hashes = [bytes([i]) for i in range(4)]
    state = new_request_state(config, "r1", num_prompt_tokens=64, block_hashes=hashes[:3])
    grown = extend_keys(config, state, hashes)
    assert state.keys[0] == tuple(OffloadKey(0, h) for h in hashes[:3])
    assert grown.keys[0] == tuple(OffloadKey(0, h) for h in hashes)


@given(
    st.lists(
        st.tuples(
            st.integers(min_value=-12, max_value=12), st.integers(min_value=-12, max_value=12)
        ),
        max_size=12,
    )
)
def test_reads_in_any_order_see_the_keys_the_hashes_name(reads: list[tuple[int, int]]) -> None:
    """Keys are made from the hashes when first read, by index or slice in any order (the
    made ones kept); every read must see what a tuple of the keys would."""
    keys = tuple(OffloadKey(2, bytes([n])) for n in range(10))
    chain = KeyChain().extended_hashes(2, [key.block_hash for key in keys])
    for start, stop in reads:
        assert chain[start:stop] == keys[start:stop]
        if -10 <= start < 10:
            assert chain[start] == keys[start]
    assert tuple(chain) == keys
    assert chain.group == 2


def test_a_chain_holds_keys_of_one_group() -> None:
    with pytest.raises(InvalidInputError, match="one group"):
        KeyChain([OffloadKey(0, b"\x01"), OffloadKey(1, b"\x02")])
    with pytest.raises(InvalidInputError, match="group 0"):
        KeyChain(_keys(1)).extended_hashes(1, [b"\x02"])


def test_keying_a_request_makes_no_key_object_until_one_is_read() -> None:
    config = OffloadConfig(
        hash_block_size=16,
        blocks_per_chunk=1,
        groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16),),
    )
    state = new_request_state(
        config, "r1", num_prompt_tokens=64, block_hashes=[bytes([i]) for i in range(4)]
    )
    column = state.keys[0]._column
    assert column.keys == []
    assert state.keys[0][2:4] == (OffloadKey(0, b"\x02"), OffloadKey(0, b"\x03"))
    made_past_the_prefix = len(column.keys)
    assert state.keys[0][0:2] == (OffloadKey(0, b"\x00"), OffloadKey(0, b"\x01"))
    assert (made_past_the_prefix, len(column.keys)) == (0, 2)  # a prefix read is kept
