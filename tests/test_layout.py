"""Layouts: every tensor arrangement the engines use becomes refs with the right page geometry."""

from __future__ import annotations

import numpy as np
import pytest

from kvferry.core.errors import InvalidInputError
from kvferry.core.layout import (
    LAYOUT_RULES,
    GroupLayout,
    KVLayout,
    PageRef,
    TensorLayout,
    describe_tensor,
)


def _describe(kind: TensorLayout, array: np.ndarray, address: int = 1 << 20) -> tuple[PageRef, ...]:
    return describe_tensor(
        kind,
        address=address,
        shape=array.shape,
        strides=[s // array.itemsize for s in array.strides],
        itemsize=array.itemsize,
    )


def test_kv_split_gives_two_refs_one_per_half() -> None:
    kv = np.zeros((2, 10, 16, 4, 8), np.float16)
    k, v = _describe(TensorLayout.KV_SPLIT, kv)
    assert (k.num_blocks, k.page_stride, k.page_bytes) == (10, 1024, 1024)
    assert v.address - k.address == 10 * 1024


def test_blocks_first_gives_one_ref_holding_k_and_v() -> None:
    (ref,) = _describe(TensorLayout.BLOCKS_FIRST, np.zeros((10, 2, 16, 4, 8), np.float16))
    assert (ref.page_stride, ref.page_bytes) == (2048, 2048)


def test_cross_layer_gives_one_ref_for_the_whole_model() -> None:
    (ref,) = _describe(TensorLayout.CROSS_LAYER, np.zeros((10, 32, 2, 16, 8), np.float16))
    assert ref.page_bytes == 32 * 2 * 16 * 8 * 2


def test_mla_gives_one_ref_of_the_latent() -> None:
    (ref,) = _describe(TensorLayout.MLA, np.zeros((10, 16, 576), np.float16))
    assert ref.page_bytes == 16 * 576 * 2


def test_a_padded_mamba_page_copies_only_the_state() -> None:
    pages = np.zeros((10, 4096), np.uint8)
    state = pages[:, 128 : 128 + 3000]
    (ref,) = _describe(TensorLayout.MAMBA, state, address=1 << 20)
    assert (ref.page_stride, ref.page_bytes) == (4096, 3000)


@pytest.mark.parametrize(("shape", "size"), [((10, 41, 8), 656), ((10, 13, 16), 416)])
def test_odd_page_sizes_are_kept_exact(shape: tuple[int, ...], size: int) -> None:
    (ref,) = _describe(TensorLayout.MLA, np.zeros(shape, np.float16))
    assert ref.page_bytes == ref.page_stride == size


@pytest.mark.parametrize("kind", list(LAYOUT_RULES))
def test_every_layout_rule_refuses_a_page_that_is_not_densely_packed(kind: TensorLayout) -> None:
    rule = LAYOUT_RULES[kind]
    shape = [3] * max(rule.min_ndim, rule.block_dim + 2)
    if rule.kv_dim is not None:
        shape[rule.kv_dim] = 2
    array = np.zeros([*shape[:-1], shape[-1] * 2], np.uint8)[..., ::2]
    with pytest.raises(InvalidInputError, match="densely packed"):
        _describe(kind, array)


def test_kv_split_without_a_leading_two_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="size 2 at dimension 0"):
        _describe(TensorLayout.KV_SPLIT, np.zeros((3, 10, 4, 8), np.uint8))


def test_a_page_larger_than_its_stride_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="page_bytes"):
        PageRef(address=0, num_blocks=2, page_stride=8, page_bytes=16)


def test_row_bytes_is_the_largest_groups_chunk_and_smaller_groups_pad() -> None:
    big = GroupLayout(refs=[PageRef(address=0, num_blocks=4, page_stride=100, page_bytes=100)] * 2)
    small = GroupLayout(refs=[PageRef(address=0, num_blocks=4, page_stride=64, page_bytes=40)])
    layout = KVLayout(blocks_per_chunk=3, groups=[big, small])
    assert layout.row_bytes == 600
    assert layout.padding_bytes(0) == 0
    assert layout.padding_bytes(1) == 600 - 120


def test_the_fingerprint_ignores_addresses_and_follows_the_geometry() -> None:
    def layout(address: int, f: int) -> KVLayout:
        ref = PageRef(address=address, num_blocks=4, page_stride=64, page_bytes=64)
        return KVLayout(blocks_per_chunk=f, groups=[GroupLayout(refs=[ref])])

    assert layout(0, 2).fingerprint == layout(4096, 2).fingerprint
    assert layout(0, 2).fingerprint != layout(0, 3).fingerprint
