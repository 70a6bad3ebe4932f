"""`kvferry.adapters.layer_pages`: an engine's per-layer KV views become one byte page per block
and layer, or are refused with the group, the layer and its shape and strides."""

from __future__ import annotations

import pytest

from kvferry.core.config import GroupKind
from kvferry.core.errors import InvalidInputError
from kvferry.core.layout import TensorLayout

torch = pytest.importorskip("torch")

from kvferry.adapters.layer_pages import (  # noqa: E402
    LayerGroup,
    group_kv_tensors,
    manager_blocks,
    page_view,
)

NUM_BLOCKS = 5


def _attention_view(order: str = "BHNC", kernel_blocks: int = 1) -> torch.Tensor:
    """A `[blocks, heads, tokens, K|V]` float16 view whose dimensions lie in memory as `order`."""
    shape = {"B": NUM_BLOCKS * kernel_blocks, "H": 2, "N": 4, "C": 16}
    strides, step = {}, 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    buffer = torch.zeros(step, dtype=torch.float16)
    return buffer.as_strided([shape[d] for d in "BHNC"], [strides[d] for d in "BHNC"])


def test_a_dense_page_per_block_becomes_one_byte_row_per_block() -> None:
    view = _attention_view()

    pages = page_view(view, NUM_BLOCKS, group=0, layer="l0")

    assert pages.dtype == torch.uint8
    assert tuple(pages.shape) == (NUM_BLOCKS, 2 * 4 * 16 * 2)
    assert pages.data_ptr() == view.data_ptr()


def test_kernel_blocks_of_a_block_make_one_page() -> None:
    view = _attention_view(kernel_blocks=2)

    pages = page_view(view, NUM_BLOCKS, group=0, layer="l0")

    assert tuple(pages.shape) == (NUM_BLOCKS, 2 * 2 * 4 * 16 * 2)
    assert pages.stride(0) == 2 * 2 * 4 * 16 * 2


def test_kernel_blocks_regroup_with_manager_blocks_first() -> None:
    view = _attention_view(kernel_blocks=3)

    grouped = manager_blocks(view, NUM_BLOCKS, group=0, layer="l0")

    assert tuple(grouped.shape) == (NUM_BLOCKS, 3, 2, 4, 16)
    assert grouped[1, 2].data_ptr() == view[5].data_ptr()


def test_a_first_dimension_that_is_not_a_multiple_of_the_blocks_is_refused() -> None:
    view = _attention_view()[:4]

    with pytest.raises(InvalidInputError) as caught:
        page_view(view, NUM_BLOCKS, group=2, layer="model.layers.7.attn")

    assert caught.value.group == 2
    assert "model.layers.7.attn" in caught.value.field
    assert "(4, 2, 4, 16)" in str(caught.value.got)


def test_a_page_split_by_heads_outside_the_blocks_is_refused_with_shape_and_strides() -> None:
    view = _attention_view(order="HBNC")

    with pytest.raises(InvalidInputError) as caught:
        page_view(view, NUM_BLOCKS, group=1, layer="model.layers.3.attn")

    assert caught.value.group == 1
    assert caught.value.field == "kv_caches['model.layers.3.attn']"
    assert str(caught.value.got) == f"shape {tuple(view.shape)}, strides {view.stride()}"


def test_something_that_is_not_a_tensor_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="a tensor"):
        page_view([1, 2, 3], NUM_BLOCKS, group=0, layer="l0")  # type: ignore[arg-type]


def test_a_layer_missing_from_the_kv_caches_is_refused_naming_its_group() -> None:
    group = LayerGroup(group=3, kind=GroupKind.FULL_ATTENTION, layer_names=("a", "b"))

    with pytest.raises(InvalidInputError) as caught:
        group_kv_tensors({"a": _attention_view()}, [group], NUM_BLOCKS)

    assert (caught.value.group, caught.value.expected) == (3, "layer 'b'")


def test_each_group_kind_gets_its_layout_rule_and_the_layer_name() -> None:
    groups = [
        LayerGroup(group=0, kind=GroupKind.SLIDING_WINDOW, layer_names=("a",)),
        LayerGroup(group=1, kind=GroupKind.MAMBA, layer_names=("m",)),
    ]
    views = {"a": _attention_view(), "m": _attention_view()}

    (attention,), (mamba,) = group_kv_tensors(views, groups, NUM_BLOCKS)

    assert (attention.layout, attention.name) == (TensorLayout.MLA, "a")
    assert (mamba.layout, mamba.name) == (TensorLayout.MAMBA, "m")


def test_layers_sharing_one_cache_are_mapped_once() -> None:
    view = _attention_view()
    group = LayerGroup(group=0, kind=GroupKind.FULL_ATTENTION, layer_names=("a", "b", "c"))

    (tensors,) = group_kv_tensors({"a": view, "b": view, "c": _attention_view()}, [group], 5)

    assert [t.name for t in tensors] == ["a", "c"]


def test_a_group_without_layers_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="at least one layer"):
        LayerGroup(group=0, kind=GroupKind.FULL_ATTENTION, layer_names=())
