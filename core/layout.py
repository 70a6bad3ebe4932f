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
    """Bytes between consecutive pages on the GPU."""
    page_bytes: int = attrs.field(validator=at_least(1))
    """Bytes to copy per page (at most `page_stride`: padded pages copy only the real state);
    also the size of the page's slot in a CPU row, which holds no padding."""

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
        """Return each ref's byte offset inside a CPU row (refs one after another, F slots of
        `page_bytes` each)."""
        offsets, total = [], 0
        for ref in self.refs:
            offsets.append(total)
            total += blocks_per_chunk * ref.page_bytes
        return tuple(offsets)

    def row_bytes(self, blocks_per_chunk: int) -> int:
        """Return the bytes one chunk of this group occupies in a CPU row: its data only."""
        return blocks_per_chunk * self.block_copy_bytes

    def chunk_copy_bytes(self, blocks_per_chunk: int) -> int:
        """Return the bytes one full chunk of this group actually copies (no padding)."""
        return blocks_per_chunk * self.block_copy_bytes

    @functools.cached_property  # every submit counts the bytes it moves
    def block_copy_bytes(self) -> int:
        """Return the bytes one block of this group copies: its page in every ref."""
        return sum(r.page_bytes for r in self.refs)


def _groups_tuple(value: Sequence[GroupLayout]) -> tuple[GroupLayout, ...]:
    return tuple(value)


def _rows_tuple(value: object) -> tuple[int, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise InvalidInputError(field="rows", expected="a sequence of row counts", got=value)


def _non_negative_ints(
    instance: object, attribute: attrs.Attribute[tuple[int, ...]], value: tuple[int, ...]
) -> None:
    for group, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise InvalidInputError(
                group=group, field=attribute.name, expected="an integer >= 0", got=item
            )


@attrs.frozen(kw_only=True)
class TierLayout:
    """Where each group's CPU rows lie in the tier: every group has its own row ids and region.

    Row `r` of group `g` starts `base[g] + r * pitch[g]` bytes into the tier; a group's rows are
    packed at its own chunk's size, so consecutive rows of a group are one contiguous run.
    """

    rows: tuple[int, ...] = attrs.field(converter=_rows_tuple, validator=_non_negative_ints)
    """Rows of each group."""
    pitch: tuple[int, ...] = attrs.field(converter=_rows_tuple, validator=_non_negative_ints)
    """Bytes of one row of each group (its chunk's data: `KVLayout.group_row_bytes`)."""
    base: tuple[int, ...] = attrs.field(init=False)
    """Offset of each group's row 0 in the tier: the groups' regions one after another."""
    nbytes: int = attrs.field(init=False)
    """Bytes of the whole tier."""

    def __attrs_post_init__(self) -> None:
        if not self.rows or len(self.pitch) != len(self.rows):
            raise InvalidInputError(
                field="rows",
                expected=f"one row count per group ({len(self.pitch)})",
                got=self.rows,
            )
        base, total = [], 0
        for rows, pitch in zip(self.rows, self.pitch, strict=True):
            base.append(total)
            total += rows * pitch
        object.__setattr__(self, "base", tuple(base))
        object.__setattr__(self, "nbytes", total)

    @property
    def num_groups(self) -> int:
        """Return the number of groups."""
        return len(self.rows)

    def row_offset(self, group: int, row: int) -> int:
        """Return the byte offset of row `row` of `group` in the tier."""
        return self.base[group] + row * self.pitch[group]


@attrs.frozen(kw_only=True)
class KVLayout:
    """Every group's refs plus `F`: all an expansion needs to turn a plan into byte copies.

    CPU rows are per group: a row of group `g` holds one chunk of that group and is exactly
    `group_row_bytes(g)` long (its data, no padding); each group has its own row ids and its own
    region of the tier (`tier`).
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
    def row_pitches(self) -> tuple[int, ...]:
        """Return each group's row size: its chunk's data bytes (`group_row_bytes`)."""
        return tuple(g.row_bytes(self.blocks_per_chunk) for g in self.groups)

    @functools.cached_property
    def largest_row_bytes(self) -> int:
        """Return the largest group's row: what a buffer holding any one chunk needs."""
        return max(self.row_pitches)

    def group_row_bytes(self, group: int) -> int:
        """Return the bytes of one row (one chunk) of `group`."""
        return self.row_pitches[group]

    def tier(self, num_rows: int | Sequence[int]) -> TierLayout:
        """Return the tier of `num_rows` rows per group (one count for every group, or one per
        group), its groups' regions one after another. Raise InvalidInputError for counts that
        are not integers >= 0, one per group."""
        if isinstance(num_rows, bool):
            raise InvalidInputError(field="num_rows", expected="an integer >= 0", got=num_rows)
        rows = (num_rows,) * self.num_groups if isinstance(num_rows, int) else tuple(num_rows)
        if len(rows) != self.num_groups:
            raise InvalidInputError(
                field="num_rows",
                expected=f"one row count per group ({self.num_groups})",
                got=num_rows,
            )
        return TierLayout(rows=rows, pitch=self.row_pitches)

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
    name: str | None = None,
    kernel_blocks_per_block: int = 1,
) -> tuple[PageRef, ...]:
    """Return the refs of one KV tensor, from its shape, strides (in elements) and address.

    Dimensions before the block dimension (the K/V half of `KV_SPLIT`) become separate refs;
    dimensions after it form the page and must be densely packed (size-1 dimensions excepted).
    Refs whose pages lie side by side (K and V of one block next to each other, as a hybrid
    model's attention layers have them) become one ref of the two pages' bytes.

    `kernel_blocks_per_block` says how many of the tensor's blocks (the attention kernel's) make
    one block of the cache manager, whose ids plans carry: manager block `b` is kernel blocks
    `k*b .. k*b + k - 1`. It is never guessed from the shape. A refusal is an InvalidInputError
    whose field names the tensor (`name`) and whose value shows its shape and strides.
    """
    label = f"{name}." if name else ""

    def fail(field: str, expected: str, got: object) -> None:
        raise InvalidInputError(group=group, field=label + field, expected=expected, got=got)

    if not isinstance(kind, TensorLayout):
        fail("kind", "a TensorLayout", kind)
    rule = LAYOUT_RULES[kind]
    for what, values in (
        ("shape", shape),
        ("strides", strides),
        ("itemsize", (itemsize,)),
        ("kernel_blocks_per_block", (kernel_blocks_per_block,)),
    ):
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
            fail(what, "integers", values)
    shape, strides = tuple(int(s) for s in shape), tuple(int(s) for s in strides)
    seen = {"shape": shape, "strides": strides}

    if len(shape) < rule.min_ndim or len(strides) != len(shape):
        fail("shape", f"{rule.shape} for {kind.value} (strides of the same rank)", seen)
    if rule.kv_dim is not None and shape[rule.kv_dim] != 2:
        fail("shape", f"{rule.shape}: size 2 at dimension {rule.kv_dim}", seen)
    if itemsize < 1 or any(s < 0 for s in strides):
        fail("strides", "non-negative strides and an itemsize >= 1", {**seen, "itemsize": itemsize})
    trailing = shape[rule.block_dim + 1 :]
    expected_stride = 1
    for size, stride in reversed(list(zip(trailing, strides[rule.block_dim + 1 :], strict=True))):
        if size != 1 and stride != expected_stride:
            fail("strides", f"densely packed dimensions after the block one, {rule.shape}", seen)
        expected_stride *= size
    page_bytes = math.prod(trailing) * itemsize
    num_blocks = shape[rule.block_dim]
    page_stride = strides[rule.block_dim] * itemsize if num_blocks > 1 else page_bytes
    if page_stride < page_bytes:
        fail("strides", f"a page stride of at least the page ({page_bytes} bytes)", seen)
    k = kernel_blocks_per_block
    if k < 1 or num_blocks % k:
        fail(
            "kernel_blocks_per_block",
            f"a divisor >= 1 of the tensor's {num_blocks} kernel blocks",
            {**seen, "kernel_blocks_per_block": k},
        )
    leading = shape[: rule.block_dim]
    refs: list[PageRef] = []
    for index in _all_indices(leading):
        offset = sum(i * s for i, s in zip(index, strides, strict=False)) * itemsize
        # a manager block's k kernel pages: one page when they touch, else one ref per page
        parts = (
            [(0, page_bytes * k)]
            if page_stride == page_bytes
            else [(j * page_stride, page_bytes) for j in range(k)]
        )
        refs.extend(
            PageRef(
                address=address + offset + start,
                num_blocks=num_blocks // k,
                page_stride=page_stride * k,
                page_bytes=size,
            )
            for start, size in parts
        )
    return coalesce_refs(refs)


def describe_pages(
    *,
    address: int,
    buffer_bytes: int,
    page_bytes: int,
    page_stride: int,
    offset: int = 0,
    num_blocks: int | None = None,
    group: int | None = None,
    name: str | None = None,
) -> PageRef:
    """Return the ref of "each block is a page of `page_bytes` at `page_stride`, starting
    `offset` bytes into a buffer of `buffer_bytes` at `address`": the neutral form of any layout.

    `num_blocks` defaults to every page that fits in the buffer. A page that would reach past
    the buffer, or overlap the next page, is refused with an InvalidInputError naming `name`.
    """
    label = f"{name}." if name else ""
    seen = {
        "buffer_bytes": buffer_bytes,
        "offset": offset,
        "page_bytes": page_bytes,
        "page_stride": page_stride,
        "num_blocks": num_blocks,
    }

    def fail(field: str, expected: str) -> None:
        raise InvalidInputError(group=group, field=label + field, expected=expected, got=seen)

    values = [address, buffer_bytes, page_bytes, page_stride, offset]
    if num_blocks is not None:
        values.append(num_blocks)
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
        fail("page_bytes", "integer sizes, strides and offsets")
    if page_bytes < 1 or page_stride < page_bytes or offset < 0:
        fail("page_stride", "page_bytes >= 1, page_stride >= page_bytes, offset >= 0")
    room = buffer_bytes - offset - page_bytes
    fits = room // page_stride + 1 if room >= 0 else 0
    blocks = fits if num_blocks is None else int(num_blocks)
    if blocks < 1 or blocks > fits:
        fail("num_blocks", f"1 to {fits} pages (what fits in the buffer after the offset)")
    return PageRef(
        address=int(address) + int(offset),
        num_blocks=blocks,
        page_stride=int(page_stride),
        page_bytes=int(page_bytes),
    )


def coalesce_refs(refs: Sequence[PageRef]) -> tuple[PageRef, ...]:
    """Return `refs` with each run of refs whose pages lie back to back in one page (same
    blocks and stride, the next starting where the previous ends) joined into one ref: the same
    bytes, copied as one piece per block."""
    out: list[PageRef] = []
    for ref in refs:
        last = out[-1] if out else None
        if (
            last is not None
            and ref.num_blocks == last.num_blocks
            and ref.page_stride == last.page_stride
            and ref.address == last.address + last.page_bytes
            and last.page_bytes + ref.page_bytes <= ref.page_stride
        ):
            out[-1] = attrs.evolve(last, page_bytes=last.page_bytes + ref.page_bytes)
        else:
            out.append(ref)
    return tuple(out)


def _all_indices(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    indices: list[tuple[int, ...]] = [()]
    for size in shape:
        indices = [(*prefix, i) for prefix in indices for i in range(size)]
    return indices
