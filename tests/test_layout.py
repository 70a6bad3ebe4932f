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
    coalesce_refs,
    describe_pages,
    describe_tensor,
)
from kvferry.executors import KVPages, KVTensor
from kvferry.executors.tensors import build_layout


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


def test_each_group_s_row_is_its_own_chunk_with_no_padding() -> None:
    big = GroupLayout(refs=[PageRef(address=0, num_blocks=4, page_stride=100, page_bytes=100)] * 2)
    small = GroupLayout(refs=[PageRef(address=0, num_blocks=4, page_stride=64, page_bytes=40)])
    layout = KVLayout(blocks_per_chunk=3, groups=[big, small])
    assert layout.row_pitches == (600, 120)
    assert layout.largest_row_bytes == 600


def test_a_tier_lays_each_group_s_rows_after_the_previous_group_s() -> None:
    big = GroupLayout(refs=[PageRef(address=0, num_blocks=4, page_stride=100, page_bytes=100)])
    small = GroupLayout(refs=[PageRef(address=0, num_blocks=4, page_stride=64, page_bytes=40)])
    tier = KVLayout(blocks_per_chunk=1, groups=[big, small]).tier((3, 10))
    assert (tier.base, tier.pitch, tier.nbytes) == ((0, 300), (100, 40), 700)


def test_a_tier_needs_one_row_count_per_group() -> None:
    ref = PageRef(address=0, num_blocks=4, page_stride=64, page_bytes=40)
    layout = KVLayout(blocks_per_chunk=1, groups=[GroupLayout(refs=[ref])] * 2)
    with pytest.raises(InvalidInputError, match="num_rows"):
        layout.tier((3, 4, 5))


def test_the_fingerprint_ignores_addresses_and_follows_the_geometry() -> None:
    def layout(address: int, f: int) -> KVLayout:
        ref = PageRef(address=address, num_blocks=4, page_stride=64, page_bytes=64)
        return KVLayout(blocks_per_chunk=f, groups=[GroupLayout(refs=[ref])])

    assert layout(0, 2).fingerprint == layout(4096, 2).fingerprint
    assert layout(0, 2).fingerprint != layout(0, 3).fingerprint


def test_kv_halves_side_by_side_in_a_page_become_one_ref_of_the_whole_page() -> None:
    hidden = 16 * 4 * 8
    (ref,) = describe_tensor(
        TensorLayout.KV_SPLIT,
        address=1 << 20,
        shape=(2, 10, 16, 4, 8),
        strides=(hidden, 2 * hidden, 32, 8, 1),
        itemsize=2,
    )
    assert (ref.address, ref.page_stride, ref.page_bytes) == (1 << 20, 4 * hidden, 4 * hidden)


def test_kernel_blocks_per_block_joins_touching_kernel_pages_into_one_manager_page() -> None:
    (ref,) = describe_tensor(
        TensorLayout.MLA,
        address=0,
        shape=(8, 16, 64),
        strides=(1024, 64, 1),
        itemsize=2,
        kernel_blocks_per_block=2,
    )
    assert (ref.num_blocks, ref.page_stride, ref.page_bytes) == (4, 4096, 4096)


def test_kernel_blocks_per_block_with_padded_kernel_pages_gives_a_ref_per_kernel_page() -> None:
    refs = describe_tensor(
        TensorLayout.MAMBA,
        address=0,
        shape=(8, 100),
        strides=(512, 1),
        itemsize=1,
        kernel_blocks_per_block=2,
    )
    assert [(r.address, r.num_blocks, r.page_stride, r.page_bytes) for r in refs] == [
        (0, 4, 1024, 100),
        (512, 4, 1024, 100),
    ]


def test_kernel_blocks_per_block_must_divide_the_kernel_blocks_and_is_never_guessed() -> None:
    with pytest.raises(InvalidInputError, match="kernel_blocks_per_block"):
        describe_tensor(
            TensorLayout.MLA,
            address=0,
            shape=(9, 16, 64),
            strides=(1024, 64, 1),
            itemsize=2,
            kernel_blocks_per_block=2,
        )


def test_a_refused_tensor_is_named_with_its_shape_and_strides() -> None:
    with pytest.raises(InvalidInputError) as caught:
        describe_tensor(
            TensorLayout.MLA,
            address=0,
            shape=(4, 16, 64),
            strides=(1024, 1, 16),
            itemsize=2,
            group=1,
            name="model.layers.3.attn",
        )
    message = str(caught.value)
    assert "model.layers.3.attn.strides" in message
    assert "(1024, 1, 16)" in message and "(4, 16, 64)" in message


def test_describe_pages_places_pages_at_offset_plus_block_times_stride() -> None:
    ref = describe_pages(
        address=4096, buffer_bytes=10 * 512, page_bytes=333, page_stride=512, offset=7
    )
    assert (ref.address, ref.num_blocks, ref.page_stride, ref.page_bytes) == (4103, 10, 512, 333)


def test_describe_pages_refuses_pages_past_the_buffer_naming_them() -> None:
    with pytest.raises(InvalidInputError, match=r"layer0\.num_blocks"):
        describe_pages(
            address=0,
            buffer_bytes=4 * 512,
            page_bytes=333,
            page_stride=512,
            offset=200,
            num_blocks=4,
            name="layer0",
        )


def test_describe_pages_refuses_a_stride_shorter_than_the_page() -> None:
    with pytest.raises(InvalidInputError, match="page_stride"):
        describe_pages(address=0, buffer_bytes=4096, page_bytes=600, page_stride=512)


def test_coalescing_keeps_refs_that_do_not_touch_apart() -> None:
    a = PageRef(address=0, num_blocks=4, page_stride=1024, page_bytes=100)
    b = PageRef(address=200, num_blocks=4, page_stride=1024, page_bytes=100)
    assert coalesce_refs([a, b]) == (a, b)


def test_kv_pages_of_a_shared_buffer_register_like_the_views_they_describe() -> None:
    buffer = np.zeros(10 * 1024, np.uint8)
    states = np.lib.stride_tricks.as_strided(buffer, shape=(10, 300), strides=(1024, 1))
    pages = KVPages(buffer=buffer, page_bytes=300, page_stride=1024, name="mamba0")
    view = KVTensor(tensor=states, layout=TensorLayout.MAMBA)
    from_pages, _ = build_layout([[pages]], 2, on_gpu=False)
    from_view, _ = build_layout([[view]], 2, on_gpu=False)
    assert from_pages.groups == from_view.groups


def test_kv_pages_that_overrun_their_buffer_are_refused_naming_the_entry() -> None:
    buffer = np.zeros(4 * 1024, np.uint8)
    pages = KVPages(buffer=buffer, page_bytes=300, page_stride=1024, offset=800, num_blocks=4)
    with pytest.raises(InvalidInputError, match=r"kv_caches\[0\]\[0\]"):
        build_layout([[pages]], 1, on_gpu=False)


def test_a_cpu_row_holds_page_data_only_not_the_padding() -> None:
    ref = PageRef(address=0, num_blocks=4, page_stride=1024, page_bytes=300)
    layout = KVLayout(blocks_per_chunk=3, groups=[GroupLayout(refs=[ref])])
    assert layout.row_pitches == (900,)
