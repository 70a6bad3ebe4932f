"""An engine's per-layer KV views as kvferry executor entries: one run of bytes per block and layer.

vLLM's allocator hands a worker one view per layer into a buffer shared by every KV-cache group
(`[blocks, heads, tokens, K|V]` for attention, `[blocks, 1, 1, state bytes]` for Mamba), in
kernel blocks where the attention kernel takes smaller blocks than the cache manager. This module
turns those views into the `KVTensor`s an executor is made from, per group, refusing (with the
layer's name, shape and strides) any view whose page is not one dense run of bytes. It imports
torch but not vLLM, so the same mapping runs wherever the executors do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from kvferry.core.config import GroupKind
from kvferry.core.errors import InvalidInputError
from kvferry.core.layout import TensorLayout
from kvferry.executors import KVTensor

REQUIRED_KV_CACHE_LAYOUT = "LBHNC"
"""The KV-cache layout kvferry asks vLLM for (as vLLM's own offloading connector does): layers
outermost, then blocks, so every layer's page of a block is one contiguous run."""

PAGE_LAYOUTS: dict[GroupKind, TensorLayout] = {
    GroupKind.FULL_ATTENTION: TensorLayout.MLA,
    GroupKind.SLIDING_WINDOW: TensorLayout.MLA,
    GroupKind.CHUNKED_LOCAL_ATTENTION: TensorLayout.MLA,
    GroupKind.MAMBA: TensorLayout.MAMBA,
}
"""The kvferry layout rule each group kind's layer pages are described by. vLLM 0.33 keeps a
layer's page as one dense run (attention: `[heads, block_size, K|V]`, K and V side by side), so
kvferry sees each layer as `(num_blocks, page_bytes)`: block dimension first, one ref per layer,
the page dense — the rule kvferry names `MLA` (and `MAMBA` for state pages)."""


@attrs.frozen(kw_only=True)
class LayerGroup:
    """One KV-cache group whose layers are mapped: its engine id, kind and layer names."""

    group: int = attrs.field(validator=attrs.validators.instance_of(int))
    """The engine's id of the group (errors name it)."""
    kind: GroupKind = attrs.field(validator=attrs.validators.instance_of(GroupKind))
    """What the group keeps; picks the layout rule from `PAGE_LAYOUTS`."""
    layer_names: tuple[str, ...] = attrs.field(converter=tuple)
    """The group's layers, in the engine's order (keys of the engine's `kv_caches`)."""

    def __attrs_post_init__(self) -> None:
        if not self.layer_names:
            raise InvalidInputError(
                group=self.group, field="layer_names", expected="at least one layer", got=()
            )


def manager_blocks(view: torch.Tensor, num_blocks: int, *, group: int, layer: str) -> torch.Tensor:
    """Return `view` with the cache manager's blocks as dimension 0.

    A view in kernel blocks (`num_blocks * k` of them, manager block `b` being kernel blocks
    `b*k .. b*k + k - 1`) comes back as `(num_blocks, k, ...)`; a view already in manager blocks
    comes back as it is. A first dimension that is not a multiple of `num_blocks` is refused.
    """
    rows = int(view.shape[0]) if view.dim() else 0
    if rows == num_blocks:
        return view
    if num_blocks < 1 or rows < num_blocks or rows % num_blocks:
        raise InvalidInputError(
            group=group,
            field=f"kv_caches[{layer!r}]",
            expected=f"a first dimension that is a multiple of the {num_blocks} blocks",
            got=f"shape {tuple(view.shape)}",
        )
    return view.view(num_blocks, rows // num_blocks, *view.shape[1:])


def page_view(view: torch.Tensor, num_blocks: int, *, group: int, layer: str) -> torch.Tensor:
    """Return one layer's KV as `(num_blocks, page_bytes)` bytes: row `b` is the layer's page of
    manager block `b`, at the layer's block stride.

    `view` is what the engine's allocator hands out, kernel blocks included (`manager_blocks`
    regroups them). Every dimension after the block one must pack densely (in any order), so
    that a page is one run of bytes; a layout that splits a page (heads outside blocks) is
    refused, naming the layer, its shape and strides.
    """
    if not isinstance(view, torch.Tensor):
        raise InvalidInputError(
            group=group, field=f"kv_caches[{layer!r}]", expected="a tensor", got=type(view).__name__
        )
    pages = manager_blocks(view, num_blocks, group=group, layer=layer)
    dims = sorted(
        (int(stride), int(size))
        for size, stride in zip(pages.shape[1:], pages.stride()[1:], strict=True)
        if size != 1
    )
    expected = 1
    for stride, size in dims:
        if stride != expected:
            raise InvalidInputError(
                group=group,
                field=f"kv_caches[{layer!r}]",
                expected=(
                    "pages that are one dense run per block (a layer-compact KV-cache layout "
                    f"such as {REQUIRED_KV_CACHE_LAYOUT})"
                ),
                got=f"shape {tuple(pages.shape)}, strides {tuple(pages.stride())}",
            )
        expected *= size
    itemsize = pages.element_size()
    page_bytes = expected * itemsize
    stride = int(pages.stride(0)) * itemsize if num_blocks > 1 else page_bytes
    return torch.empty(0, dtype=torch.uint8, device=pages.device).set_(
        pages.untyped_storage(),
        pages.storage_offset() * itemsize,
        (num_blocks, page_bytes),
        (stride, 1),
    )


def group_kv_tensors(
    kv_caches: Mapping[str, Any], groups: Sequence[LayerGroup], num_blocks: int
) -> list[list[KVTensor]]:
    """Return, per group of `groups` (in that order), the `KVTensor`s of its layers' pages.

    Each layer becomes one `(num_blocks, page_bytes)` byte tensor (`page_view`) with its kind's
    rule from `PAGE_LAYOUTS`. A layer sharing another layer's cache (same pages) is listed once,
    so its pages move once; a layer missing from `kv_caches` is refused, naming the group.
    """
    tensors = []
    for spec in groups:
        entries: list[KVTensor] = []
        seen: set[tuple[int, int]] = set()
        for name in spec.layer_names:
            if name not in kv_caches:
                raise InvalidInputError(
                    group=spec.group, field="kv_caches", expected=f"layer {name!r}", got=None
                )
            flat = page_view(kv_caches[name], num_blocks, group=spec.group, layer=name)
            key = (int(flat.data_ptr()), int(flat.stride(0)))
            if key in seen:
                continue
            seen.add(key)
            entries.append(KVTensor(tensor=flat, layout=PAGE_LAYOUTS[spec.kind], name=name))
        tensors.append(entries)
    return tensors


__all__ = [
    "PAGE_LAYOUTS",
    "REQUIRED_KV_CACHE_LAYOUT",
    "LayerGroup",
    "group_kv_tensors",
    "manager_blocks",
    "page_view",
]
