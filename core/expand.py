"""Copy expansion: a bound plan against a layout becomes byte-level copies, as numpy columns.

Pure and vectorised (one numpy pass per group, never a Python loop per page or descriptor);
addresses are plain integers, so one expansion serves every executor. It never copies a byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from kvferry.core.arrays import IdArray
from kvferry.core.bound import BoundPlan
from kvferry.core.errors import InvalidInputError, PlanInvariantError
from kvferry.core.layout import KVLayout, TierLayout
from kvferry.core.plan import Direction, chunks_spanned

BoolArray = npt.NDArray[np.bool_]


def _readonly(value: Any) -> IdArray:
    """Return a read-only int64 view of `value` (no copy when it already is int64)."""
    array: IdArray = np.asarray(value, dtype=np.int64).view()
    array.setflags(write=False)
    return array


@attrs.frozen(kw_only=True)
class PageCopies:
    """One entry per (page, ref) copy of a plan, in CPU-row order: group, row, ref, slot.

    That order puts the slots of a ref in one row next to each other (F > 1), then the refs of a
    row, so copies contiguous on the CPU side are neighbours and merge.
    """

    direction: Direction
    """LOAD copies CPU -> GPU, STORE copies GPU -> CPU."""
    gpu_address: IdArray = attrs.field(converter=_readonly, eq=False)
    """Absolute address of the page on the GPU side."""
    cpu_offset: IdArray = attrs.field(converter=_readonly, eq=False)
    """Byte offset of the slot from the start of the CPU tier (its group's region, row and
    slot: `TierLayout.row_offset` plus the slot's place in the row)."""
    nbytes: IdArray = attrs.field(converter=_readonly, eq=False)
    """Bytes to copy (the ref's `page_bytes`)."""
    key_index: IdArray = attrs.field(converter=_readonly, eq=False)
    """Index, in the plan's keys (and the bound plan's rows), of the chunk the page belongs to."""
    group: IdArray = attrs.field(converter=_readonly, eq=False)
    """Group of the page."""
    block_id: IdArray = attrs.field(converter=_readonly, eq=False)
    """GPU block id of the page."""

    @property
    def total_bytes(self) -> int:
        """Return the bytes the plan moves."""
        return int(self.nbytes.sum())

    def __len__(self) -> int:
        return len(self.nbytes)


@attrs.frozen(kw_only=True)
class CopyList:
    """Byte copies `(src, dst, nbytes)` as three int64 columns of the same length."""

    src: IdArray = attrs.field(converter=_readonly, eq=False)
    """Source addresses (or offsets, when the caller works in offsets)."""
    dst: IdArray = attrs.field(converter=_readonly, eq=False)
    """Destination addresses (or offsets)."""
    nbytes: IdArray = attrs.field(converter=_readonly, eq=False)
    """Bytes per copy."""

    @property
    def total_bytes(self) -> int:
        """Return the bytes copied."""
        return int(self.nbytes.sum())

    def __len__(self) -> int:
        return len(self.nbytes)


def check_bound(
    bound: BoundPlan, layout: KVLayout, *, num_rows: int | Sequence[int] | None = None
) -> int:
    """Return the bytes `bound` moves against `layout`, after checking that it fits.

    Group `g` with `n = group_sizes[g] > 0` consumes `n` GPU ids and `ceil((n + skip) / F)` rows
    of its own (every group has its own row ids), with `skip = block_indices[g] % F`. Every id
    and row must be consumed exactly, ids must index every ref of the group, rows must lie below
    the group's `num_rows` (one count for every group, or one per group; when given), and a
    store may not write a row of a group twice: otherwise PlanInvariantError names the group.
    Costs O(ids + rows) in numpy, never a step per page, so a GPU executor can afford it on
    every submit.
    """
    plan = bound.plan
    f = layout.blocks_per_chunk
    request = plan.request_id

    def fail(field: str, expected: str, got: object, group: int | None = None) -> None:
        raise PlanInvariantError(
            request=request, group=group, field=field, expected=expected, got=got
        )

    if plan.blocks_per_chunk != f:
        fail("blocks_per_chunk", f"{f} (the layout's F)", plan.blocks_per_chunk)
    if plan.num_groups != layout.num_groups:
        fail("group_sizes", f"{layout.num_groups} groups (the layout's)", plan.num_groups)
    limits = None if num_rows is None else layout.tier(num_rows).rows
    store = plan.direction is Direction.STORE
    id_start = key_start = total = 0
    for g, (n, first) in enumerate(zip(plan.group_sizes, plan.block_indices, strict=True)):
        skip = first % f
        n_rows = chunks_spanned(n, skip, f)
        ids = plan.gpu_block_ids[id_start : id_start + n]
        rows = bound.cpu_rows[key_start : key_start + n_rows]
        if len(ids) != n:
            fail("gpu_block_ids", f"{n} ids for this group", len(ids), g)
        if len(rows) != n_rows:
            fail("cpu_rows", f"{n_rows} rows for {n} blocks after a skip of {skip}", len(rows), g)
        id_start += n
        key_start += n_rows
        if n == 0:
            continue
        if int(ids.max()) >= layout.groups[g].num_blocks:
            fail("gpu_block_ids", f"ids below {layout.groups[g].num_blocks}", int(ids.max()), g)
        if limits is not None and int(rows.max()) >= limits[g]:
            fail(
                "cpu_rows", f"rows below {limits[g]} (the group's in the tier)", int(rows.max()), g
            )
        if store and not bool((rows[1:] > rows[:-1]).all()):
            ordered = np.sort(rows)  # only when not already increasing (a fresh tier's rows are)
            if bool((ordered[1:] == ordered[:-1]).any()):
                fail("cpu_rows", "distinct rows (a store writes each row once)", rows.tolist(), g)
        total += n * layout.groups[g].block_copy_bytes
    if id_start != len(plan.gpu_block_ids):
        fail("gpu_block_ids", f"{id_start} ids in all", len(plan.gpu_block_ids))
    if key_start != len(bound.cpu_rows):
        fail("cpu_rows", f"{key_start} rows in all", len(bound.cpu_rows))
    return total


def expand_pages(bound: BoundPlan, layout: KVLayout, tier: TierLayout) -> PageCopies:
    """Return the page copies of `bound` against `layout` and the CPU `tier`, in CPU-row order.

    `check_bound` checks the plan first, with the tier's rows (and raises what it raises).
    Group `g`'s page `k` lands in slot `(skip + k) % F` of the group's row `(skip + k) // F`.
    """
    if tier.pitch != layout.row_pitches:
        raise InvalidInputError(
            field="tier", expected=f"row pitches {layout.row_pitches} (the layout's)", got=tier
        )
    check_bound(bound, layout, num_rows=tier.rows)
    plan = bound.plan
    f = layout.blocks_per_chunk
    parts: list[tuple[IdArray, ...]] = []
    id_start = key_start = 0
    for g, (n, first) in enumerate(zip(plan.group_sizes, plan.block_indices, strict=True)):
        skip = first % f
        n_rows = chunks_spanned(n, skip, f)
        ids = plan.gpu_block_ids[id_start : id_start + n]
        rows = bound.cpu_rows[key_start : key_start + n_rows]
        id_start += n
        key_start += n_rows
        if n == 0:
            continue
        parts.append(
            _expand_group(
                g=g,
                ids=ids,
                rows=rows,
                skip=skip,
                first_key=key_start - n_rows,
                layout=layout,
                base=tier.base[g],
            )
        )
    if len(parts) == 1:
        gpu, cpu, nbytes, key, group, block = parts[0]
    else:
        empty = np.zeros(0, np.int64)
        gpu, cpu, nbytes, key, group, block = (
            (np.concatenate(column) for column in zip(*parts, strict=True))
            if parts
            else (empty,) * 6
        )
    return PageCopies(
        direction=plan.direction,
        gpu_address=gpu,
        cpu_offset=cpu,
        nbytes=nbytes,
        key_index=key,
        group=group,
        block_id=block,
    )


def _expand_group(
    *,
    g: int,
    ids: IdArray,
    rows: IdArray,
    skip: int,
    first_key: int,
    layout: KVLayout,
    base: int,
) -> tuple[IdArray, ...]:
    """Return the six columns of one group's pages: a (row, ref, slot) grid, masked to the plan."""
    f = layout.blocks_per_chunk
    group = layout.groups[g]
    n = len(ids)
    address = np.array([r.address for r in group.refs], np.int64)[None, :, None]
    stride = np.array([r.page_stride for r in group.refs], np.int64)[None, :, None]
    size = np.array([r.page_bytes for r in group.refs], np.int64)[None, :, None]
    offset = np.array(group.row_offsets(f), np.int64)[None, :, None]
    grid_shape = (len(rows), len(group.refs), f)
    position = np.arange(len(rows) * f, dtype=np.int64).reshape(len(rows), 1, f)
    whole = skip == 0 and n == len(rows) * f
    valid = np.broadcast_to((position >= skip) & (position < skip + n), grid_shape).ravel()
    row_of = position // f
    slot = position % f
    block = ids[np.clip(position - skip, 0, n - 1)]
    gpu = address + block * stride
    cpu = base + rows[row_of] * layout.row_pitches[g] + offset + slot * size

    def column(values: IdArray) -> IdArray:
        flat: IdArray = np.broadcast_to(values, grid_shape).reshape(-1)
        return flat if whole else flat[valid]

    count = len(rows) * len(group.refs) * f if whole else int(valid.sum())
    return (
        column(gpu),
        column(cpu),
        column(size),
        column(first_key + row_of),
        np.full(count, g, np.int64),
        column(block),
    )


def merge_copies(
    src: IdArray, dst: IdArray, nbytes: IdArray, *, breaks: BoolArray | None = None
) -> CopyList:
    """Return the copies with neighbours contiguous on both sides merged into one.

    `breaks[i]` True forbids merging copy `i` into the one before it (e.g. at the boundary of
    two separately pinned pieces of host memory).
    """
    src, dst, nbytes = (np.asarray(a, dtype=np.int64) for a in (src, dst, nbytes))
    starts = merge_starts(src, dst, nbytes, breaks=breaks)
    if len(starts) == 0:
        return CopyList(src=src, dst=dst, nbytes=nbytes)
    return CopyList(src=src[starts], dst=dst[starts], nbytes=np.add.reduceat(nbytes, starts))


def merge_starts(
    src: IdArray, dst: IdArray, nbytes: IdArray, *, breaks: BoolArray | None = None
) -> IdArray:
    """Return the index of the first copy of each merged copy `merge_copies` makes."""
    if len(nbytes) == 0:
        return np.zeros(0, np.int64)
    joins = (src[1:] == src[:-1] + nbytes[:-1]) & (dst[1:] == dst[:-1] + nbytes[:-1])
    if breaks is not None:
        joins &= ~np.asarray(breaks, dtype=np.bool_)[1:]
    return np.flatnonzero(np.concatenate(([True], ~joins)))


def copy_list(
    pages: PageCopies, host_address: int, *, piece_starts: Sequence[int] = ()
) -> CopyList:
    """Return the merged `(src, dst, nbytes)` copies of `pages`, with the tier at `host_address`.

    Source and destination follow the direction (a store copies GPU -> CPU). No copy crosses
    an offset of `piece_starts` (where separately pinned pieces of the tier begin) on the CPU
    side.
    """
    cpu = pages.cpu_offset + np.int64(host_address)
    gpu = pages.gpu_address
    breaks = None
    if len(piece_starts) > 1:
        breaks = np.isin(pages.cpu_offset, np.asarray(piece_starts, np.int64))
    if pages.direction is Direction.STORE:
        return merge_copies(gpu, cpu, pages.nbytes, breaks=breaks)
    return merge_copies(cpu, gpu, pages.nbytes, breaks=breaks)


def split_copies(copies: CopyList, max_bytes: int) -> CopyList:
    """Return `copies` with every copy longer than `max_bytes` cut into pieces of `max_bytes`.

    The pieces keep the copy's alignment when `max_bytes` is a multiple of it (e.g. 16).
    """
    if max_bytes < 1:
        raise InvalidInputError(field="max_bytes", expected="an integer >= 1", got=max_bytes)
    counts = -(-copies.nbytes // max_bytes)
    if len(counts) == 0 or int(counts.max()) <= 1:
        return copies
    owner = np.repeat(np.arange(len(counts)), counts)
    firsts = np.cumsum(counts) - counts
    offset = (np.arange(int(counts.sum())) - firsts[owner]) * max_bytes
    return CopyList(
        src=copies.src[owner] + offset,
        dst=copies.dst[owner] + offset,
        nbytes=np.minimum(copies.nbytes[owner] - offset, max_bytes),
    )
