"""Reading a KV tensor's geometry (address, shape, strides, itemsize) from torch, CuPy or numpy.

Duck-typed: it imports no framework and never reads or writes a tensor's contents.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvferry.core.errors import InvalidInputError
from kvferry.core.layout import (
    GroupLayout,
    KVLayout,
    PageRef,
    TensorLayout,
    describe_pages,
    describe_tensor,
)


@attrs.frozen(kw_only=True)
class KVTensor:
    """One KV tensor handed to an executor, with the layout it follows."""

    tensor: Any
    """A torch tensor, a CuPy array, a numpy array, or anything with an array interface."""
    layout: TensorLayout = attrs.field(validator=attrs.validators.instance_of(TensorLayout))
    """How its dimensions are arranged."""
    kernel_blocks_per_block: int = 1
    """How many of the tensor's blocks (the attention kernel's) make one block of the cache
    manager, whose ids plans carry; manager block `b` is kernel blocks `k*b .. k*b + k - 1`."""
    name: str | None = None
    """What errors call the tensor (default `kv_caches[group][index]`), e.g. a layer's name."""


@attrs.frozen(kw_only=True)
class KVPages:
    """The neutral layout: each block of a group is a page of `page_bytes` at `page_stride`
    inside `buffer`, starting `offset` bytes in. One entry per layer (or per view of a layer's
    buffer); several groups may name the same buffer at different offsets.

    Covers any engine layout whose pages are one run of bytes per block: K and V side by side,
    Mamba states inside padded pages (only `page_bytes` is copied), MLA latents, blocks-first
    and cross-layer buffers.
    """

    buffer: Any
    """The memory holding the pages: a torch tensor, a CuPy array or a numpy array."""
    page_bytes: int
    """Bytes of data per block (what is copied)."""
    page_stride: int
    """Bytes from one block's page to the next (at least `page_bytes`)."""
    offset: int = 0
    """Bytes from the buffer's start to block 0's page."""
    num_blocks: int | None = None
    """Blocks the group can index; default every page that fits in the buffer."""
    name: str | None = None
    """What errors call it (default `kv_caches[group][index]`)."""


KVCacheEntry = KVTensor | KVPages
"""One entry of `kv_caches`: a tensor with a `TensorLayout`, or pages in a buffer."""


@attrs.frozen(kw_only=True)
class TensorGeometry:
    """The facts about a tensor that the copy expansion needs."""

    address: int
    """Address of element 0."""
    shape: tuple[int, ...]
    """Sizes of the dimensions."""
    strides: tuple[int, ...]
    """Strides in elements."""
    itemsize: int
    """Bytes per element."""
    on_gpu: bool
    """True for CUDA memory."""
    device: str
    """Where it lives, e.g. `cpu` or `cuda:0` (or `cuda` when unknown)."""


def _interface_geometry(interface: dict[str, Any], on_gpu: bool) -> TensorGeometry:
    shape = tuple(int(s) for s in interface["shape"])
    typestr = str(interface["typestr"])
    if typestr[1:2] not in ("b", "i", "u", "f", "c", "V"):  # no object pointers, no text
        raise InvalidInputError(field="dtype", expected="a numeric dtype", got=typestr)
    itemsize = int(typestr[2:])
    byte_strides = interface.get("strides")
    if byte_strides is None:
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= size
        elements = tuple(reversed(strides))
    else:
        if any(int(s) % itemsize for s in byte_strides):
            raise InvalidInputError(
                field="strides", expected=f"multiples of the itemsize {itemsize}", got=byte_strides
            )
        elements = tuple(int(s) // itemsize for s in byte_strides)
    return TensorGeometry(
        address=int(interface["data"][0]),
        shape=shape,
        strides=elements,
        itemsize=itemsize,
        on_gpu=on_gpu,
        device="cuda" if on_gpu else "cpu",
    )


def tensor_geometry(tensor: Any) -> TensorGeometry:
    """Return the geometry of a torch tensor, an object with a (CUDA) array interface, or numpy."""
    if callable(getattr(tensor, "data_ptr", None)) and callable(getattr(tensor, "stride", None)):
        device = str(tensor.device)
        return TensorGeometry(
            address=int(tensor.data_ptr()),
            shape=tuple(int(s) for s in tensor.shape),
            strides=tuple(int(s) for s in tensor.stride()),
            itemsize=int(tensor.element_size()),
            on_gpu=device.startswith("cuda"),
            device=device,
        )
    if hasattr(tensor, "__cuda_array_interface__"):
        return _interface_geometry(tensor.__cuda_array_interface__, on_gpu=True)
    if hasattr(tensor, "__array_interface__"):
        return _interface_geometry(tensor.__array_interface__, on_gpu=False)
    raise InvalidInputError(
        field="tensor", expected="a torch tensor or an object with an array interface", got=tensor
    )


@attrs.frozen(kw_only=True)
class RegisteredTensor:
    """A KV tensor as an executor holds it: the tensor, its geometry and the refs it yields."""

    tensor: KVCacheEntry
    """What the engine handed over."""
    geometry: TensorGeometry
    """Its address, shape and strides."""
    refs: tuple[PageRef, ...]
    """Its refs, in layout order (two for a K/V split tensor)."""


def _span_bytes(geometry: TensorGeometry) -> int:
    """Return the bytes from element 0 to the end of the last element of `geometry`."""
    if any(size == 0 for size in geometry.shape):
        return 0
    last = sum(
        (size - 1) * stride for size, stride in zip(geometry.shape, geometry.strides, strict=True)
    )
    return (last + 1) * geometry.itemsize


def _entry_refs(
    item: KVCacheEntry, geometry: TensorGeometry, g: int, name: str
) -> tuple[PageRef, ...]:
    """Return the refs of one `kv_caches` entry, refusing what it cannot represent."""
    if isinstance(item, KVPages):
        return (
            describe_pages(
                address=geometry.address,
                buffer_bytes=_span_bytes(geometry),
                page_bytes=item.page_bytes,
                page_stride=item.page_stride,
                offset=item.offset,
                num_blocks=item.num_blocks,
                group=g,
                name=name,
            ),
        )
    return describe_tensor(
        item.layout,
        address=geometry.address,
        shape=geometry.shape,
        strides=geometry.strides,
        itemsize=geometry.itemsize,
        group=g,
        name=name,
        kernel_blocks_per_block=item.kernel_blocks_per_block,
    )


def build_layout(
    kv_caches: Sequence[Sequence[KVCacheEntry]], blocks_per_chunk: int, *, on_gpu: bool
) -> tuple[KVLayout, tuple[tuple[RegisteredTensor, ...], ...]]:
    """Return the layout of `kv_caches` (one sequence of entries per group: `KVTensor` or
    `KVPages`) and each entry's registration (geometry and refs), group by group.

    Every tensor must be on the GPU (`on_gpu`) or on the host, as the executor requires.
    """
    groups, geometries = [], []
    for g, tensors in enumerate(kv_caches):
        refs: list[PageRef] = []
        group_geometry = []
        for index, item in enumerate(tensors):
            if not isinstance(item, (KVTensor, KVPages)):
                raise InvalidInputError(
                    group=g, field="kv_caches", expected="KVTensor or KVPages", got=item
                )
            name = item.name or f"kv_caches[{g}][{index}]"
            try:
                geometry = tensor_geometry(
                    item.buffer if isinstance(item, KVPages) else item.tensor
                )
            except InvalidInputError as error:  # name the group
                if error.group is not None:
                    raise
                raise InvalidInputError(
                    group=g, field=f"{name}.{error.field}", expected=error.expected, got=error.got
                ) from error
            if geometry.on_gpu != on_gpu:
                where = "CUDA" if on_gpu else "host"
                raise InvalidInputError(
                    group=g, field=name, expected=f"{where} tensors", got=geometry.device
                )
            tensor_refs = _entry_refs(item, geometry, g, name)
            group_geometry.append(
                RegisteredTensor(tensor=item, geometry=geometry, refs=tensor_refs)
            )
            refs.extend(tensor_refs)
        if not refs:
            raise InvalidInputError(group=g, field="kv_caches", expected="some tensors", got=[])
        groups.append(GroupLayout(refs=refs))
        geometries.append(tuple(group_geometry))
    layout = KVLayout(blocks_per_chunk=blocks_per_chunk, groups=groups)
    return layout, tuple(geometries)
