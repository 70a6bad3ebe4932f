"""Reading a KV tensor's geometry (address, shape, strides, itemsize) from torch, CuPy or numpy.

Duck-typed: it imports no framework and never reads or writes a tensor's contents.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvferry.core.errors import InvalidInputError
from kvferry.core.layout import GroupLayout, KVLayout, PageRef, TensorLayout, describe_tensor


@attrs.frozen(kw_only=True)
class KVTensor:
    """One KV tensor handed to an executor, with the layout it follows."""

    tensor: Any
    """A torch tensor, a CuPy array, a numpy array, or anything with an array interface."""
    layout: TensorLayout = attrs.field(validator=attrs.validators.instance_of(TensorLayout))
    """How its dimensions are arranged."""


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

    tensor: KVTensor
    """What the engine handed over."""
    geometry: TensorGeometry
    """Its address, shape and strides."""
    refs: tuple[PageRef, ...]
    """Its refs, in layout order (two for a K/V split tensor)."""


def build_layout(
    kv_caches: Sequence[Sequence[KVTensor]], blocks_per_chunk: int, *, on_gpu: bool
) -> tuple[KVLayout, tuple[tuple[RegisteredTensor, ...], ...]]:
    """Return the layout of `kv_caches` (one sequence of tensors per group) and each tensor's
    registration (geometry and refs), group by group.

    Every tensor must be on the GPU (`on_gpu`) or on the host, as the executor requires.
    """
    groups, geometries = [], []
    for g, tensors in enumerate(kv_caches):
        refs: list[PageRef] = []
        group_geometry = []
        for item in tensors:
            if not isinstance(item, KVTensor):
                raise InvalidInputError(group=g, field="kv_caches", expected="KVTensor", got=item)
            try:
                geometry = tensor_geometry(item.tensor)
            except InvalidInputError as error:  # name the group
                if error.group is not None:
                    raise
                raise InvalidInputError(
                    group=g, field=error.field, expected=error.expected, got=error.got
                ) from error
            if geometry.on_gpu != on_gpu:
                where = "CUDA" if on_gpu else "host"
                raise InvalidInputError(
                    group=g, field="kv_caches", expected=f"{where} tensors", got=geometry.device
                )
            tensor_refs = describe_tensor(
                item.layout,
                address=geometry.address,
                shape=geometry.shape,
                strides=geometry.strides,
                itemsize=geometry.itemsize,
                group=g,
            )
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
