"""Where a model's KV pages lie in memory: per group, the tensors ("refs") and their page geometry.

Pure values built from shapes, strides and integer addresses: never touches a tensor or a device.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import math
import numbers
from collections.abc import Sequence

import attrs

from kvferry.core.checks import at_least
from kvferry.core.errors import InvalidInputError

_MAX_ADDRESS = 2**63
"""Addresses are held in int64 arrays by the copy expansion."""


class TensorLayout(enum.Enum):
    """How an engine arranges one KV tensor; `LAYOUT_RULES` says what each means for copying."""

    KV_SPLIT = "kv_split"
    """FlashAttention's `(2, num_blocks, ...)`: K and V halves are two refs of one layer."""
    BLOCKS_FIRST = "blocks_first"
    """`(num_blocks, 2, ...)`: one page holds K and V of one layer; one ref."""
    CROSS_LAYER = "cross_layer"
    """`(num_blocks, layers, ...)`: one page holds every layer; one ref for the whole model."""
    MLA = "mla"
    """`(num_blocks, block_size, latent_dim)`: one compressed latent per token; one ref."""
    MAMBA = "mamba"
    """`(num_blocks, ...)` state views into padded pages: the page stride exceeds the state."""


@attrs.frozen(kw_only=True)
class LayoutRule:
    """What one `TensorLayout` means: where the block dimension is, and what precedes it."""

    block_dim: int
    """Index of the `num_blocks` dimension; each index of the dimensions before it is a ref."""
    kv_dim: int | None
    """Dimension that must have size 2 (K and V), or None."""
    min_ndim: int
    """Fewest dimensions a tensor of this layout has."""
    shape: str
    """The shape, as written in docs and errors."""


LAYOUT_RULES: dict[TensorLayout, LayoutRule] = {
    TensorLayout.KV_SPLIT: LayoutRule(
        block_dim=1, kv_dim=0, min_ndim=3, shape="(2, num_blocks, block_size, heads, head_dim)"
    ),
    TensorLayout.BLOCKS_FIRST: LayoutRule(
        block_dim=0, kv_dim=1, min_ndim=3, shape="(num_blocks, 2, block_size, heads, head_dim)"
    ),
    TensorLayout.CROSS_LAYER: LayoutRule(
        block_dim=0, kv_dim=None, min_ndim=3, shape="(num_blocks, layers, ...)"
    ),
    TensorLayout.MLA: LayoutRule(
        block_dim=0, kv_dim=None, min_ndim=2, shape="(num_blocks, block_size, latent_dim)"
    ),
    TensorLayout.MAMBA: LayoutRule(
        block_dim=0, kv_dim=None, min_ndim=2, shape="(num_blocks, ...) with a padded page stride"
    ),
}
"""The rules table: drives `describe_tensor`, its tests and docs/executors.md."""


def _non_negative(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_ADDRESS:
        raise InvalidInputError(
            field=attribute.name, expected="an integer in [0, 2**63)", got=value
        )


@attrs.frozen(kw_only=True)
class PageRef:
    """One KV tensor as a row of pages: page `b` starts at `address + b * page_stride`."""

    address: int = attrs.field(validator=_non_negative)
    """Absolute address of block 0's page (a GPU address, or a host one for the cpu executor)."""
    num_blocks: int = attrs.field(validator=at_least(1))
    """Pages in the tensor; a block id must be below it."""
    page_stride: int = attrs.field(validator=at_least(1))
    """Bytes between consecutive pages; also the size of a slot in a CPU row."""
    page_bytes: int = attrs.field(validator=at_least(1))
    """Bytes to copy per page (at most `page_stride`: padded pages copy only the real state)."""

    def __attrs_post_init__(self) -> None:
        if self.page_bytes > self.page_stride:
            raise InvalidInputError(
                field="page_bytes",
                expected=f"at most page_stride={self.page_stride} (pages must not overlap)",
                got=self.page_bytes,
            )
        end = self.address + self.num_blocks * self.page_stride
        if end >= _MAX_ADDRESS:
            raise InvalidInputError(field="address", expected="pages below 2**63", got=end)


def _refs_tuple(value: Sequence[PageRef]) -> tuple[PageRef, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class GroupLayout:
    """The refs one KV-cache group's layers use, in the order their slots lie in a CPU row."""

    refs: tuple[PageRef, ...] = attrs.field(converter=_refs_tuple)
    """At least one ref; every block id of the group indexes each of them."""

    def __attrs_post_init__(self) -> None:
        if not self.refs or not all(isinstance(r, PageRef) for r in self.refs):
            raise InvalidInputError(
                field="refs", expected="a non-empty sequence of PageRef", got=self.refs
            )

    @functools.cached_property  # every submit checks ids against it
    def num_blocks(self) -> int:
        """Return the number of GPU blocks every ref of the group can index."""
        return min(r.num_blocks for r in self.refs)

    def row_offsets(self, blocks_per_chunk: int) -> tuple[int, ...]:
        """Return each ref's byte offset inside a CPU row (refs one after another, F slots each)."""
        offsets, total = [], 0
        for ref in self.refs:
            offsets.append(total)
            total += blocks_per_chunk * ref.page_stride
        return tuple(offsets)

    def row_bytes(self, blocks_per_chunk: int) -> int:
        """Return the bytes one chunk of this group occupies in a CPU row."""
        return blocks_per_chunk * sum(r.page_stride for r in self.refs)

    def chunk_copy_bytes(self, blocks_per_chunk: int) -> int:
        """Return the bytes one full chunk of this group actually copies (no padding)."""
        return blocks_per_chunk * self.block_copy_bytes

    @functools.cached_property  # every submit counts the bytes it moves
    def block_copy_bytes(self) -> int:
        """Return the bytes one block of this group copies: its page in every ref."""
        return sum(r.page_bytes for r in self.refs)


def _groups_tuple(value: Sequence[GroupLayout]) -> tuple[GroupLayout, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class KVLayout:
    """Every group's refs plus `F`: all an expansion needs to turn a plan into byte copies.

    CPU rows share one id space across groups: a row is `row_bytes` long, the largest group's
    chunk; a smaller group's chunk leaves the rest of its row unused (see `padding_bytes`).
    """

    blocks_per_chunk: int = attrs.field(validator=at_least(1))
    """`F`: slots per ref in one CPU row."""
    groups: tuple[GroupLayout, ...] = attrs.field(converter=_groups_tuple)
    """One entry per KV-cache group, in the planner's group order."""

    def __attrs_post_init__(self) -> None:
        if not self.groups or not all(isinstance(g, GroupLayout) for g in self.groups):
            raise InvalidInputError(
                field="groups", expected="a non-empty sequence of GroupLayout", got=self.groups
            )

    @property
    def num_groups(self) -> int:
        """Return the number of groups."""
        return len(self.groups)

    @functools.cached_property
    def row_bytes(self) -> int:
        """Return the size of one CPU row: the largest group's chunk, page strides counted."""
        return max(g.row_bytes(self.blocks_per_chunk) for g in self.groups)

    def group_row_bytes(self, group: int) -> int:
        """Return the bytes of a row that a chunk of `group` uses."""
        return self.groups[group].row_bytes(self.blocks_per_chunk)

    def padding_bytes(self, group: int) -> int:
        """Return the bytes of a row that a chunk of `group` leaves unused or never copies."""
        return self.row_bytes - self.groups[group].chunk_copy_bytes(self.blocks_per_chunk)

    @functools.cached_property  # every submit compares it
    def fingerprint(self) -> str:
        """Return a short hash of the row geometry (F, strides, sizes); addresses not included.

        Workers of one tensor-parallel job share it; a plan bound for another geometry is refused.
        """
        text = f"F={self.blocks_per_chunk};" + "|".join(
            ",".join(f"{r.page_stride}:{r.page_bytes}" for r in g.refs) for g in self.groups
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe_tensor(
    kind: TensorLayout,
    *,
    address: int,
    shape: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
    group: int | None = None,
) -> tuple[PageRef, ...]:
    """Return the refs of one KV tensor, from its shape, strides (in elements) and address.

    Dimensions before the block dimension (the K/V half of `KV_SPLIT`) become separate refs;
    dimensions after it form the page and must be densely packed (size-1 dimensions excepted).
    """

    def fail(field: str, expected: str, got: object) -> None:
        raise InvalidInputError(group=group, field=field, expected=expected, got=got)

    if not isinstance(kind, TensorLayout):
        fail("kind", "a TensorLayout", kind)
    rule = LAYOUT_RULES[kind]
    for name, values in (("shape", shape), ("strides", strides), ("itemsize", (itemsize,))):
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
            fail(name, "integers", values)
    shape, strides = tuple(int(s) for s in shape), tuple(int(s) for s in strides)

    if len(shape) < rule.min_ndim or len(strides) != len(shape):
        fail("shape", f"{rule.shape} for {kind.value} (strides of the same rank)", (shape, strides))
    if rule.kv_dim is not None and shape[rule.kv_dim] != 2:
        fail("shape", f"{rule.shape}: size 2 at dimension {rule.kv_dim}", shape)
    if itemsize < 1 or any(s < 0 for s in strides):
        fail("strides", "non-negative strides and an itemsize >= 1", (strides, itemsize))
    trailing = shape[rule.block_dim + 1 :]
    expected_stride = 1
    for size, stride in reversed(list(zip(trailing, strides[rule.block_dim + 1 :], strict=True))):
        if size != 1 and stride != expected_stride:
            fail("strides", f"densely packed dimensions after the block one, {rule.shape}", strides)
        expected_stride *= size
    page_bytes = math.prod(trailing) * itemsize
    num_blocks = shape[rule.block_dim]
    page_stride = strides[rule.block_dim] * itemsize if num_blocks > 1 else page_bytes
    if page_stride < page_bytes:
        fail("strides", f"a page stride of at least the page ({page_bytes} bytes)", page_stride)
    leading = shape[: rule.block_dim]
    refs = []
    for index in _all_indices(leading):
        offset = sum(i * s for i, s in zip(index, strides, strict=False)) * itemsize
        refs.append(
            PageRef(
                address=address + offset,
                num_blocks=num_blocks,
                page_stride=page_stride,
                page_bytes=page_bytes,
            )
        )
    return tuple(refs)


def _all_indices(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    indices: list[tuple[int, ...]] = [()]
    for size in shape:
        indices = [(*prefix, i) for prefix in indices for i in range(size)]
    return indices
