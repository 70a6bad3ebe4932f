"""kvferry.adapters.vllm maps vLLM's objects by their class and attribute names: spec classes
to group kinds and specs, `KVCacheBlocks` to block tables. Stand-ins with vLLM's names, so
that these run without vLLM (the connector's flows are in test_vllm_connector.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from kvferry.adapters.vllm import (
    blocks_from_vllm,
    offload_config_from_vllm,
)
from kvferry.core.config import GroupKind
from kvferry.core.errors import InvalidInputError

# -- stand-ins with vLLM's names -------------------------------------------------------------


@dataclass
class FullAttentionSpec:
    block_size: int
    sliding_window: int | None = None


@dataclass
class MLAAttentionSpec(FullAttentionSpec):
    pass


@dataclass
class SlidingWindowSpec:
    block_size: int
    sliding_window: int
    extra_retained_tokens: int = 0


@dataclass
class MambaSpec:
    block_size: int


@dataclass
class ChunkedLocalAttentionSpec:
    block_size: int
    attention_chunk_size: int


@dataclass
class CrossAttentionSpec:
    block_size: int


@dataclass
class KVCacheBlock:
    block_id: int
    block_hash: bytes | None = None
    is_null: bool = False


def kv_cache_config(*specs: object) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])


def kv_blocks(*groups: Sequence[int], cached: int = 0) -> SimpleNamespace:
    """KVCacheBlocks: id 0 is the null block; the first `cached` real blocks carry a hash."""
    return SimpleNamespace(
        blocks=tuple(
            [
                KVCacheBlock(b, block_hash=b"h" if i < cached and b else None, is_null=b == 0)
                for i, b in enumerate(ids)
            ]
            for ids in groups
        )
    )


# -- mapping --------------------------------------------------------------------------------


def test_spec_kinds_are_recognised_by_class_name() -> None:
    config = offload_config_from_vllm(
        kv_cache_config(
            FullAttentionSpec(16), MLAAttentionSpec(16), SlidingWindowSpec(16, 128), MambaSpec(32)
        ),
        hash_block_size=16,
    )
    assert [g.kind for g in config.groups] == [
        GroupKind.FULL_ATTENTION,
        GroupKind.FULL_ATTENTION,
        GroupKind.SLIDING_WINDOW,
        GroupKind.MAMBA,
    ]
    assert config.groups[2].sliding_window == 128
    assert config.groups[3].block_size == 32


def test_sliding_window_spec_brings_its_extra_retained_tokens() -> None:
    config = offload_config_from_vllm(
        kv_cache_config(SlidingWindowSpec(16, 128, extra_retained_tokens=3)), hash_block_size=16
    )
    assert (config.groups[0].sliding_window, config.groups[0].extra_retained_tokens) == (128, 3)


def test_full_attention_spec_with_a_window_stays_full_attention() -> None:
    config = offload_config_from_vllm(
        kv_cache_config(FullAttentionSpec(16, sliding_window=128)), hash_block_size=16
    )
    assert config.groups[0].kind is GroupKind.FULL_ATTENTION
    assert config.groups[0].sliding_window is None


def test_chunked_local_attention_spec_brings_its_attention_chunk_size() -> None:
    config = offload_config_from_vllm(
        kv_cache_config(FullAttentionSpec(16), ChunkedLocalAttentionSpec(16, 64)),
        hash_block_size=16,
    )
    assert config.groups[1].kind is GroupKind.CHUNKED_LOCAL_ATTENTION
    assert config.groups[1].attention_chunk_size == 64


def test_unknown_spec_class_is_refused_naming_the_group() -> None:
    with pytest.raises(InvalidInputError, match=r"group 1.*CrossAttentionSpec"):
        offload_config_from_vllm(
            kv_cache_config(FullAttentionSpec(16), CrossAttentionSpec(16)),
            hash_block_size=16,
        )


def test_blocks_with_a_hash_are_cached_and_null_blocks_are_null() -> None:
    (group,) = blocks_from_vllm(kv_blocks([0, 7, 8, 9], cached=3))
    assert group.ids.tolist() == [0, 7, 8, 9]
    assert group.is_null.tolist() == [True, False, False, False]
    assert group.is_cached.tolist() == [False, True, True, False]
