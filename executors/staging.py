"""Splitting a transfer into batches that pass through a bounded GPU staging buffer.

numpy only, and O(keys + refs) per job: it never lists a page. A batch is a run of consecutive
keys whose CPU rows fit in the buffer, laid out there exactly as in the tier, so its link copies
are one DMA per contiguous range of rows. The on-GPU side of a batch is a small *segment table*
(one line per group and ref) from which the copy kernel (`kernels.STAGE_COPY_SOURCE`) computes
every page address itself; `segment_copies` is the same arithmetic in numpy, the kernel's
specification and its stand-in on machines without a GPU.
"""

from __future__ import annotations

import attrs
import numpy as np

from kvferry.core.arrays import IdArray
from kvferry.core.bound import BoundPlan
from kvferry.core.errors import InvalidInputError
from kvferry.core.expand import CopyList, merge_copies
from kvferry.core.layout import KVLayout
from kvferry.core.plan import Direction, chunks_spanned

SEGMENT_FIELDS = (
    "gpu_base",
    "page_stride",
    "page_bytes",
    "stage_offset",
    "row_pitch",
    "slots",
    "id_offset",
    "first_position",
    "count",
    "first_item",
)
"""Columns of a segment table, in order (int64 each). A segment is one ref of one group in one
batch: its `count` pages are positions `first_position + p` (p < count) of rows `row_pitch` bytes
apart in the staging buffer, `slots` (F) pages per ref and row; page p has GPU id
`ids[id_offset + p]`, so it lies at `gpu_base + id * page_stride` on the GPU and at
`stage_offset + (q // slots) * row_pitch + (q % slots) * page_stride` in the staging buffer
(`q = first_position + p`). The kernel cuts each page into pieces of at most `piece_bytes` and
numbers the pieces of all segments one after another; `first_item` is the segment's first."""

_FIELD = {name: i for i, name in enumerate(SEGMENT_FIELDS)}


@attrs.frozen(kw_only=True, eq=False)
class StageBatch:
    """One trip through the staging buffer: whole CPU rows, at most the buffer's size."""

    stage_bytes: int
    """Bytes of the staging buffer this batch uses."""
    dma: CopyList
    """Link copies as offsets: a store copies stage -> tier, a load tier -> stage (merged)."""
    segments: IdArray
    """The segment table, `(n, len(SEGMENT_FIELDS))` int64; its `first_item` counts from 0."""
    items: int
    """Pieces the copy kernel moves for this batch (the sum over segments of pages x pieces)."""
    nbytes: int
    """Bytes of the plan this batch moves."""


def plan_stages(
    bound: BoundPlan,
    layout: KVLayout,
    *,
    capacity: int,
    piece_bytes: int,
    tier_piece_bytes: int = 0,
) -> tuple[StageBatch, ...]:
    """Return the batches of `bound`: runs of consecutive keys whose rows fit in `capacity`.

    Expects a plan `check_bound` accepted. A key takes `layout.group_row_bytes(g)` of staging.
    A load reads whole rows (bytes it does not need land in staging and stay there); a store
    writes whole rows only where the plan fills them, and exactly its pages elsewhere (a partial
    first or last chunk, padded pages), so the tier keeps every byte the plan does not name.
    With `tier_piece_bytes > 0` no link copy crosses a multiple of it in the tier.
    """
    if capacity < layout.row_bytes:
        raise InvalidInputError(
            field="staging_bytes", expected=f"at least one row ({layout.row_bytes})", got=capacity
        )
    if piece_bytes < 16 or piece_bytes % 16:
        raise InvalidInputError(
            field="piece_bytes", expected="a positive multiple of 16", got=piece_bytes
        )
    plan = bound.plan
    keys = _key_table(bound, layout)
    ends = np.cumsum(keys.stage_bytes)
    starts = ends - keys.stage_bytes
    batches = []
    first = 0
    while first < len(ends):
        last = int(np.searchsorted(ends, starts[first] + capacity, side="right"))
        base = int(starts[first])
        segments = _segments(bound, layout, keys=keys, first=first, last=last, base=base)
        pages = segments[:, _FIELD["count"]]
        page_bytes = segments[:, _FIELD["page_bytes"]]
        pieces = pages * -(-page_bytes // piece_bytes)
        segments[:, _FIELD["first_item"]] = np.cumsum(pieces) - pieces
        segments.setflags(write=False)
        batches.append(
            StageBatch(
                stage_bytes=int(ends[last - 1]) - base,
                dma=_link_copies(
                    plan.direction,
                    layout,
                    keys=keys,
                    first=first,
                    last=last,
                    base=base,
                    tier_piece_bytes=tier_piece_bytes,
                ),
                segments=segments,
                items=int(pieces.sum()),
                nbytes=int((pages * page_bytes).sum()),
            )
        )
        first = last
    return tuple(batches)


@attrs.frozen(kw_only=True, eq=False)
class _Keys:
    """Per key of a plan: its group, row, staging bytes, and which slots the plan fills."""

    group: IdArray
    row: IdArray
    stage_bytes: IdArray
    first_slot: IdArray
    """Slots before this one (in the key's row) are outside the plan (the skip)."""
    end_slot: IdArray
    """Slots from this one on are outside the plan (a short last chunk)."""


def _key_table(bound: BoundPlan, layout: KVLayout) -> _Keys:
    plan = bound.plan
    f = layout.blocks_per_chunk
    groups, firsts, ends = [], [], []
    for g, (n, first) in enumerate(zip(plan.group_sizes, plan.block_indices, strict=True)):
        skip = first % f
        rows = chunks_spanned(n, skip, f)
        if rows == 0:
            continue
        groups.append(np.full(rows, g, np.int64))
        first_slot = np.zeros(rows, np.int64)
        first_slot[0] = skip
        end_slot = np.full(rows, f, np.int64)
        end_slot[-1] = (skip + n) - (rows - 1) * f
        firsts.append(first_slot)
        ends.append(end_slot)
    if not groups:
        empty = np.zeros(0, np.int64)
        return _Keys(group=empty, row=empty, stage_bytes=empty, first_slot=empty, end_slot=empty)
    group = np.concatenate(groups)
    group_bytes = np.array([layout.group_row_bytes(g) for g in range(layout.num_groups)])
    return _Keys(
        group=group,
        row=np.asarray(bound.cpu_rows, np.int64),
        stage_bytes=group_bytes[group],
        first_slot=np.concatenate(firsts),
        end_slot=np.concatenate(ends),
    )


def _segments(
    bound: BoundPlan, layout: KVLayout, *, keys: _Keys, first: int, last: int, base: int
) -> IdArray:
    """Return the segment table of keys `[first, last)` (its `first_item` column still zero)."""
    plan = bound.plan
    f = layout.blocks_per_chunk
    stage_start = np.cumsum(keys.stage_bytes) - keys.stage_bytes - base
    id_start = 0
    key_start = 0
    lines: list[list[int]] = []
    for g, (n, first_block) in enumerate(zip(plan.group_sizes, plan.block_indices, strict=True)):
        skip = first_block % f
        rows = chunks_spanned(n, skip, f)
        k0, k1 = max(first, key_start), min(last, key_start + rows)
        if k0 < k1:
            row0 = k0 - key_start
            lo = max(skip, row0 * f)
            hi = min(skip + n, (k1 - key_start) * f)
            group = layout.groups[g]
            for ref, offset in zip(group.refs, group.row_offsets(f), strict=True):
                lines.append(
                    [
                        ref.address,
                        ref.page_stride,
                        ref.page_bytes,
                        int(stage_start[k0]) + offset,
                        layout.group_row_bytes(g),
                        f,
                        id_start + lo - skip,
                        lo - row0 * f,
                        hi - lo,
                        0,
                    ]
                )
        id_start += n
        key_start += rows
    return np.array(lines, dtype=np.int64).reshape(-1, len(SEGMENT_FIELDS))


def _link_copies(
    direction: Direction,
    layout: KVLayout,
    *,
    keys: _Keys,
    first: int,
    last: int,
    base: int,
    tier_piece_bytes: int,
) -> CopyList:
    """Return the merged link copies of keys `[first, last)`, as (stage, tier) offsets."""
    f = layout.blocks_per_chunk
    sl = slice(first, last)
    stage = (np.cumsum(keys.stage_bytes) - keys.stage_bytes)[sl] - base
    tier = keys.row[sl] * layout.row_bytes
    size = keys.stage_bytes[sl]
    group = keys.group[sl]
    if direction is Direction.STORE:
        full = (keys.first_slot[sl] == 0) & (keys.end_slot[sl] == f)
        dense = np.array(
            [all(r.page_bytes == r.page_stride for r in g.refs) for g in layout.groups]
        )
        whole = full & dense[group]
        parts = [(stage[whole], tier[whole], size[whole])]
        for k in np.flatnonzero(~whole).tolist():
            parts.append(
                _exact_pieces(
                    layout,
                    int(group[k]),
                    stage=int(stage[k]),
                    tier=int(tier[k]),
                    first_slot=int(keys.first_slot[first + k]),
                    end_slot=int(keys.end_slot[first + k]),
                )
            )
        stage_all, tier_all, size_all = (
            np.concatenate(column) for column in zip(*parts, strict=True)
        )
        order = np.argsort(stage_all, kind="stable")
        stage, tier, size = stage_all[order], tier_all[order], size_all[order]
    breaks = tier % tier_piece_bytes == 0 if tier_piece_bytes else None
    if direction is Direction.STORE:
        return merge_copies(stage, tier, size, breaks=breaks)
    return merge_copies(tier, stage, size, breaks=breaks)


def _exact_pieces(
    layout: KVLayout, g: int, *, stage: int, tier: int, first_slot: int, end_slot: int
) -> tuple[IdArray, IdArray, IdArray]:
    """Return (stage, tier, size) of each page the plan fills in one row of group `g`."""
    group = layout.groups[g]
    f = layout.blocks_per_chunk
    slots = np.arange(first_slot, end_slot, dtype=np.int64)
    offsets = np.array(group.row_offsets(f), np.int64)[:, None]
    strides = np.array([r.page_stride for r in group.refs], np.int64)[:, None]
    sizes = np.array([r.page_bytes for r in group.refs], np.int64)[:, None]
    in_row = (offsets + slots[None, :] * strides).ravel()
    size = np.broadcast_to(sizes, (len(group.refs), len(slots))).ravel()
    return stage + in_row, tier + in_row, size


def segment_copies(segments: IdArray, ids: IdArray, *, direction: Direction) -> CopyList:
    """Return the page copies a segment table means, as (src, dst, nbytes) with the GPU side as
    absolute addresses and the staging side as offsets: the copy kernel's work, page by page
    (the kernel also cuts pages into pieces, which moves the same bytes)."""
    field = {name: segments[:, i] for name, i in _FIELD.items()}
    count = field["count"]
    seg = np.repeat(np.arange(len(count)), count)
    p = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    q = field["first_position"][seg] + p
    stride = field["page_stride"][seg]
    stage = (
        field["stage_offset"][seg]
        + (q // field["slots"][seg]) * field["row_pitch"][seg]
        + (q % field["slots"][seg]) * stride
    )
    gpu = field["gpu_base"][seg] + np.asarray(ids, np.int64)[field["id_offset"][seg] + p] * stride
    size = field["page_bytes"][seg]
    if direction is Direction.STORE:
        return CopyList(src=gpu, dst=stage, nbytes=size)
    return CopyList(src=stage, dst=gpu, nbytes=size)
