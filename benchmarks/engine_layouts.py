"""KV caches laid out as vLLM's allocator lays them out, for the transfer benchmark and the tests.

vLLM (v1 `gpu_model_runner`) allocates one raw int8 buffer per `KVCacheTensor` of
`page_size_bytes * num_blocks` and gives it to every layer in its `shared_by` list (one layer of
each group), then views it per layer:

- attention: `attn_backend.get_kv_cache_shape(num_blocks, block_size, kv_heads, head_size)`,
  `(2, num_blocks, block_size, kv_heads, head_size)` for FlashAttention (K and V halves split),
  `(num_blocks, 2, block_size, kv_heads, head_size)` for FlashInfer, `(num_blocks, block_size,
  latent)` for MLA; in a model that also has Mamba layers, `_update_hybrid_attention_mamba_layout`
  restrides the FlashAttention view to strides `(hidden, 2 * hidden, ...)` with
  `hidden = block_size * kv_heads * head_size`, so K and V of a block lie side by side in its
  page;
- Mamba: each state shape `s` is viewed as `(num_blocks, *s)` with `as_strided`, the block
  stride being the (padded) page in elements, at the byte offset where the previous state ends;
  `MambaSpec`'s page is padded up to the attention page so that both share the buffer.

A `Model` here is that: the buffers (sizes), and per group the views (shape, strides, offset,
itemsize) as `EngineView`s, with the data bytes of each page (`data_regions`) stated from the
engine's arithmetic, independently of kvferry's layout code, so a test can check every byte.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs

from kvferry.core.layout import TensorLayout
from kvferry.executors.tensors import KVCacheEntry, KVPages, KVTensor

MODELS = ("llama", "gpt-oss", "jamba", "mla", "cross-layer", "synthetic")
"""Every model `engine_model` builds; `synthetic` is the transfer benchmark's own layout (32
blocks-first layers of 64 KiB pages), not an engine's."""


@attrs.frozen(kw_only=True)
class EngineView:
    """One layer's view of a buffer, as the engine makes it (strides in elements)."""

    buffer: int
    """Index of the buffer in `Model.buffer_bytes`."""
    layout: TensorLayout
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    offset: int = 0
    """Bytes from the buffer's start to element 0."""
    regions: tuple[tuple[int, int], ...] = ()
    """Per block `b`, the data bytes `(start + b * stride_bytes, length)`: `(start, length)`."""
    stride_bytes: int = 0
    """Bytes between one block's data and the next."""


@attrs.frozen(kw_only=True)
class Model:
    """A model's KV caches as vLLM allocates them."""

    name: str
    buffer_bytes: tuple[int, ...]
    groups: tuple[tuple[EngineView, ...], ...]
    """Per group, its layers' views; one block id indexes every view of a group."""
    page_kinds: tuple[str, ...]
    """Per group, a short description of its page."""
    num_blocks: int
    """Blocks of the engine's pool (every group indexes the same pool)."""


def _dense_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _attention(
    buffer: int, nb: int, *, bs: int, heads: int, dim: int, itemsize: int, hybrid: bool
) -> EngineView:
    """FlashAttention's `(2, nb, bs, heads, dim)` view; K/V side by side when `hybrid`."""
    hidden = bs * heads * dim
    shape = (2, nb, bs, heads, dim)
    strides = (hidden, 2 * hidden, heads * dim, dim, 1) if hybrid else _dense_strides(shape)
    half = hidden * itemsize
    regions = ((0, 2 * half),) if hybrid else ((0, half), (nb * half, half))
    return EngineView(
        buffer=buffer,
        layout=TensorLayout.KV_SPLIT,
        shape=shape,
        strides=strides,
        itemsize=itemsize,
        regions=regions,
        stride_bytes=2 * half if hybrid else half,
    )


def _blocks_first(
    buffer: int, layout: TensorLayout, shape: tuple[int, ...], itemsize: int
) -> EngineView:
    """A dense `(nb, ...)` view (MLA, FlashInfer, cross-layer): one page per block."""
    page = math.prod(shape[1:]) * itemsize
    return EngineView(
        buffer=buffer,
        layout=layout,
        shape=shape,
        strides=_dense_strides(shape),
        itemsize=itemsize,
        regions=((0, page),),
        stride_bytes=page,
    )


def _mamba_states(
    buffer: int, nb: int, page: int, states: tuple[tuple[tuple[int, ...], int], ...]
) -> list[EngineView]:
    """vLLM's Mamba views: state `(shape, itemsize)` after state, in `page`-byte padded pages."""
    views, at = [], 0
    for shape, itemsize in states:
        size = math.prod(shape) * itemsize
        views.append(
            EngineView(
                buffer=buffer,
                layout=TensorLayout.MAMBA,
                shape=(nb, *shape),
                strides=(page // itemsize, *_dense_strides(shape)),
                itemsize=itemsize,
                offset=at,
                regions=((at, size),),
                stride_bytes=page,
            )
        )
        at += size
    return views


def engine_model(name: str, num_blocks: int, *, small: bool = False) -> Model:
    """Return model `name` (one of `MODELS`) with `num_blocks` blocks; `small` shrinks the
    layers and heads (same strides' structure) for tests on the host."""
    nb = num_blocks
    if name == "llama":  # Llama-3-8B: 32 layers, 8 KV heads of 128, bf16, block 16
        layers, heads = (3, 2) if small else (32, 8)
        dim = 8 if small else 128
        views = tuple(
            _attention(i, nb, bs=16, heads=heads, dim=dim, itemsize=2, hybrid=False)
            for i in range(layers)
        )
        page = 2 * 16 * heads * dim * 2
        return Model(
            name=name,
            buffer_bytes=(nb * page,) * layers,
            groups=(views,),
            page_kinds=(f"K|V split {page // 2} B halves",),
            num_blocks=nb,
        )
    if name == "gpt-oss":  # gpt-oss-20b: full and sliding groups share 12 per-layer buffers
        layers, heads, dim = (2, 2, 8) if small else (12, 8, 64)
        page = 2 * 16 * heads * dim * 2
        groups = tuple(
            tuple(
                _attention(i, nb, bs=16, heads=heads, dim=dim, itemsize=2, hybrid=False)
                for i in range(layers)
            )
            for _ in range(2)
        )
        return Model(
            name=name,
            buffer_bytes=(nb * page,) * layers,
            groups=groups,
            page_kinds=(f"full, {page // 2} B halves", f"sliding, {page // 2} B halves"),
            num_blocks=nb,
        )
    if name == "jamba":  # attention + two Mamba groups sharing one padded page per layer
        layers, heads, dim, bs = (2, 2, 8, 16) if small else (8, 8, 128, 32)
        page = 2 * bs * heads * dim * 2
        # conv (d_conv - 1, conv_dim) bf16 then ssm (heads, head_dim, d_state) fp32; the small
        # model's are odd-sized and unaligned (333 and 100 bytes)
        states = (((333,), 1), ((25, 4), 1)) if small else (((3, 1024), 2), ((16, 64, 16), 4))
        state_bytes = sum(math.prod(s) * i for s, i in states)
        groups = (
            tuple(
                _attention(i, nb, bs=bs, heads=heads, dim=dim, itemsize=2, hybrid=True)
                for i in range(layers)
            ),
            tuple(v for i in range(layers) for v in _mamba_states(i, nb, page, states)),
            tuple(v for i in range(layers) for v in _mamba_states(i, nb, page, states)),
        )
        return Model(
            name=name,
            buffer_bytes=(nb * page,) * layers,
            groups=groups,
            page_kinds=(
                f"attention K|V side by side, {page} B pages",
                f"mamba {state_bytes} B state in {page} B pages",
                f"mamba {state_bytes} B state in {page} B pages",
            ),
            num_blocks=nb,
        )
    if name == "mla":  # DeepSeek-V2-Lite: 27 layers, one 576-wide bf16 latent, block 64
        layers, width = (3, 72) if small else (27, 576)
        views = tuple(_blocks_first(i, TensorLayout.MLA, (nb, 64, width), 2) for i in range(layers))
        return Model(
            name=name,
            buffer_bytes=(nb * 64 * width * 2,) * layers,
            groups=(views,),
            page_kinds=(f"MLA latent, {64 * width * 2} B pages",),
            num_blocks=nb,
        )
    if name == "cross-layer":  # one (blocks, layers, 2, 16, heads, dim) buffer
        layers, heads, dim = (3, 2, 8) if small else (32, 8, 128)
        shape = (nb, layers, 2, 16, heads, dim)
        view = _blocks_first(0, TensorLayout.CROSS_LAYER, shape, 2)
        return Model(
            name=name,
            buffer_bytes=(nb * math.prod(shape[1:]) * 2,),
            groups=((view,),),
            page_kinds=(f"cross-layer, {math.prod(shape[1:]) * 2} B pages",),
            num_blocks=nb,
        )
    if name == "synthetic":
        layers, half = (3, 64) if small else (32, 32 << 10)
        views = tuple(
            _blocks_first(i, TensorLayout.BLOCKS_FIRST, (nb, 2, half), 1) for i in range(layers)
        )
        return Model(
            name=name,
            buffer_bytes=(nb * 2 * half,) * layers,
            groups=(views,),
            page_kinds=(f"blocks-first, {2 * half} B pages",),
            num_blocks=nb,
        )
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


ViewMaker = Callable[[Any, EngineView], Any]
"""`(buffer, view) -> tensor`: the framework's strided view of a raw byte buffer."""


def kv_caches(
    model: Model, buffers: list[Any], view: ViewMaker, *, neutral: bool = False
) -> list[list[KVCacheEntry]]:
    """Return the model's `kv_caches` for an executor: each engine view as a `KVTensor` of its
    `TensorLayout`, made by `view` over `buffers` (one per `model.buffer_bytes`); with
    `neutral`, each view's data regions as `KVPages` of the raw buffers instead."""
    if neutral:
        return [
            [
                KVPages(
                    buffer=buffers[v.buffer],
                    page_bytes=length,
                    page_stride=v.stride_bytes,
                    offset=start,
                    num_blocks=model.num_blocks,
                    name=f"group{g}.view{i}.region{r}",
                )
                for i, v in enumerate(group)
                for r, (start, length) in enumerate(v.regions)
            ]
            for g, group in enumerate(model.groups)
        ]
    return [
        [
            KVTensor(tensor=view(buffers[v.buffer], v), layout=v.layout, name=f"group{g}.view{i}")
            for i, v in enumerate(group)
        ]
        for g, group in enumerate(model.groups)
    ]


def data_regions(model: Model, group: int, block: int) -> list[tuple[int, int, int]]:
    """Return `(buffer, start, length)` of every data byte range of `block` in `group`."""
    return [
        (v.buffer, start + block * v.stride_bytes, length)
        for v in model.groups[group]
        for start, length in v.regions
    ]


def group_block_bytes(model: Model, group: int) -> int:
    """Return the data bytes one block of `group` holds (every layer)."""
    return sum(length for v in model.groups[group] for _, length in v.regions)
