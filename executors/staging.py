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
from kvferry.core.expand import CopyList, merge_starts
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
    first_line: int
    """Index of the batch's first line in the job's segment table."""
    segments: IdArray
    """The batch's lines of the segment table, `(n, len(SEGMENT_FIELDS))` int64 (a view); their
    `first_item` counts from 0 in each batch."""
    items: int
    """Pieces the copy kernel moves for this batch (the sum over segments of pages x pieces)."""
    nbytes: int
    """Bytes of the plan this batch moves."""


@attrs.frozen(kw_only=True, eq=False)
class StagePlan:
    """A job's batches and the one segment table they share (uploaded to the GPU once)."""

    table: IdArray
    """Every batch's lines, batch after batch, `(n, len(SEGMENT_FIELDS))` int64."""
    batches: tuple[StageBatch, ...]
    """The trips through staging, in order."""


class StagePlanner:
    """Plans staged transfers for one layout: what depends only on the layout is worked out
    once here, so planning a job costs a few numpy passes over its keys and batches."""

    def __init__(
        self,
        layout: KVLayout,
        *,
        capacity: int,
        piece_bytes: int,
        tier_piece_bytes: int = 0,
        ramp_bytes: int = 8 << 20,
    ) -> None:
        if capacity < layout.row_bytes:
            raise InvalidInputError(
                field="staging_bytes",
                expected=f"at least one row ({layout.row_bytes})",
                got=capacity,
            )
        if piece_bytes < 16 or piece_bytes % 16:
            raise InvalidInputError(
                field="piece_bytes", expected="a positive multiple of 16", got=piece_bytes
            )
        f = layout.blocks_per_chunk
        self._layout = layout
        self._capacity = capacity
        self._ramp_bytes = min(ramp_bytes, capacity)
        self._piece_bytes = piece_bytes
        self._tier_piece_bytes = tier_piece_bytes
        self._row_bytes = layout.row_bytes
        self._group_bytes = np.array(
            [layout.group_row_bytes(g) for g in range(layout.num_groups)], np.int64
        )
        self._dense = np.array(
            [all(r.page_bytes == r.page_stride for r in g.refs) for g in layout.groups]
        )
        self._refs = []
        for g, group in enumerate(layout.groups):
            refs = np.zeros((len(group.refs), len(SEGMENT_FIELDS)), np.int64)
            refs[:, _FIELD["gpu_base"]] = [r.address for r in group.refs]
            refs[:, _FIELD["page_stride"]] = [r.page_stride for r in group.refs]
            refs[:, _FIELD["page_bytes"]] = [r.page_bytes for r in group.refs]
            refs[:, _FIELD["stage_offset"]] = group.row_offsets(f)
            refs[:, _FIELD["row_pitch"]] = self._group_bytes[g]
            refs[:, _FIELD["slots"]] = f
            self._refs.append(refs)
        self._pieces = [-(-refs[:, _FIELD["page_bytes"]] // piece_bytes) for refs in self._refs]

    def plan(self, bound: BoundPlan) -> StagePlan:
        """Return the batches of `bound`: runs of consecutive keys whose rows fit in staging.

        Expects a plan `check_bound` accepted. A key takes `group_row_bytes(g)` of staging. A load
        reads whole rows (bytes it does not need land in staging and stay there); a store writes
        whole rows only where the plan fills them, and exactly its pages elsewhere (a partial
        last chunk, padded pages), so the tier keeps every byte the plan does not name. No link
        copy crosses a multiple of `tier_piece_bytes` in the tier (when it is > 0).
        """
        keys = self._keys(bound)
        dma = self._link_copies(bound.plan.direction, keys)
        table, batch_of_line = self._segment_table(bound, keys)
        pieces = table[:, _FIELD["first_item"]].copy()  # pieces per line, until turned below
        nbytes = table[:, _FIELD["count"]] * table[:, _FIELD["page_bytes"]]
        line_bounds = np.searchsorted(batch_of_line, np.arange(len(keys.bounds)))
        running = np.cumsum(pieces) - pieces
        table[:, _FIELD["first_item"]] = running - running[line_bounds[:-1]][batch_of_line]
        table.setflags(write=False)
        ends = keys.stage + keys.size
        batches = []
        for b in range(len(keys.bounds) - 1):
            l0, l1 = int(line_bounds[b]), int(line_bounds[b + 1])
            batches.append(
                StageBatch(
                    stage_bytes=int(ends[keys.bounds[b + 1] - 1]),
                    dma=dma[b],
                    first_line=l0,
                    segments=table[l0:l1],
                    items=int(pieces[l0:l1].sum()),
                    nbytes=int(nbytes[l0:l1].sum()),
                )
            )
        return StagePlan(table=table, batches=tuple(batches))

    def _keys(self, bound: BoundPlan) -> _Keys:
        """Return the job's keys as columns, with their batches and staging offsets."""
        plan = bound.plan
        f = self._layout.blocks_per_chunk
        sizes = np.asarray(plan.group_sizes, np.int64)
        skips = np.asarray(plan.block_indices, np.int64) % f
        rows = np.where(sizes > 0, -(-(sizes + skips) // f), 0)
        group = np.repeat(np.arange(len(sizes)), rows)
        first_row = np.cumsum(rows) - rows
        first_slot = np.zeros(len(group), np.int64)
        end_slot = np.full(len(group), f, np.int64)
        used = rows > 0
        first_slot[first_row[used]] = skips[used]
        end_slot[(first_row + rows - 1)[used]] = (skips + sizes - (rows - 1) * f)[used]
        size = self._group_bytes[group]
        ends = np.cumsum(size)
        starts = ends - size
        bounds = self._batch_bounds(starts, ends)
        batch = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))
        return _Keys(
            group=group,
            first_slot=first_slot,
            end_slot=end_slot,
            size=size,
            stage=starts - starts[np.asarray(bounds[:-1], np.int64)][batch],
            tier=np.asarray(bound.cpu_rows, np.int64) * self._row_bytes,
            batch=batch,
            bounds=tuple(bounds),
        )

    def _batch_bounds(self, starts: IdArray, ends: IdArray) -> tuple[int, ...]:
        """Return the first key of each batch and the key count: greedy batches of at most
        `capacity` bytes, except that the first and the last hold at most `ramp_bytes`.

        The first batch's kernel (a store) or DMA (a load) runs before the other direction of
        the pipeline has anything to do, and the last one's after; small ends keep those short.
        """
        bounds = [0]
        total = int(ends[-1]) if len(ends) else 0
        while bounds[-1] < len(ends):
            first = bounds[-1]
            left = total - int(starts[first])
            limit = self._ramp_bytes if first == 0 else self._capacity
            if self._ramp_bytes < left <= self._capacity + self._ramp_bytes:
                limit = min(limit, left - self._ramp_bytes)  # leave a small last batch
            cut = int(np.searchsorted(ends, starts[first] + max(limit, 1), "right"))
            bounds.append(max(cut, first + 1))
        return tuple(bounds)

    def _segment_table(self, bound: BoundPlan, keys: _Keys) -> tuple[IdArray, IdArray]:
        """Return the job's segment table, batch after batch (column `first_item` holding each
        line's piece count), and the batch of each line."""
        plan = bound.plan
        f = self._layout.blocks_per_chunk
        lines, line_batch = [], []
        id_start = key_start = 0
        for g, (n, first_block) in enumerate(
            zip(plan.group_sizes, plan.block_indices, strict=True)
        ):
            skip = first_block % f
            rows = chunks_spanned(n, skip, f)
            if rows:
                # one slice per batch the group's rows fall in; k0/k1 count from its first row
                cuts = np.flatnonzero(np.diff(keys.batch[key_start : key_start + rows])) + 1
                k0 = np.concatenate(([0], cuts))
                lo = np.maximum(skip, k0 * f)
                hi = np.minimum(skip + n, np.concatenate((cuts, [rows])) * f)
                refs = self._refs[g]
                block = np.broadcast_to(refs, (len(k0), *refs.shape)).copy()
                block[:, :, _FIELD["stage_offset"]] += keys.stage[key_start + k0][:, None]
                block[:, :, _FIELD["id_offset"]] = (id_start + lo - skip)[:, None]
                block[:, :, _FIELD["first_position"]] = (lo - k0 * f)[:, None]
                block[:, :, _FIELD["count"]] = (hi - lo)[:, None]
                block[:, :, _FIELD["first_item"]] = (hi - lo)[:, None] * self._pieces[g][None, :]
                lines.append(block.reshape(-1, len(SEGMENT_FIELDS)))
                line_batch.append(np.repeat(keys.batch[key_start + k0], len(refs)))
            id_start += n
            key_start += rows
        if not lines:
            return np.zeros((0, len(SEGMENT_FIELDS)), np.int64), np.zeros(0, np.int64)
        batch_of_line = np.concatenate(line_batch)
        order = np.argsort(batch_of_line, kind="stable")
        return np.concatenate(lines)[order], batch_of_line[order]

    def _link_copies(self, direction: Direction, keys: _Keys) -> list[CopyList]:
        """Return each batch's merged link copies, as (stage, tier) offsets."""
        f = self._layout.blocks_per_chunk
        stage, tier, size, batch = keys.stage, keys.tier, keys.size, keys.batch
        if len(batch) == 0:
            return []
        if direction is Direction.STORE:
            whole = (keys.first_slot == 0) & (keys.end_slot == f) & self._dense[keys.group]
            if not whole.all():
                parts = [(stage[whole], tier[whole], size[whole], batch[whole])]
                for k in np.flatnonzero(~whole).tolist():
                    in_row, piece = self._exact_pieces(
                        int(keys.group[k]), int(keys.first_slot[k]), int(keys.end_slot[k])
                    )
                    parts.append(
                        (stage[k] + in_row, tier[k] + in_row, piece, np.full(len(piece), batch[k]))
                    )
                stage, tier, size, batch = (
                    np.concatenate(column) for column in zip(*parts, strict=True)
                )
                order = np.lexsort((stage, batch))
                stage, tier, size, batch = stage[order], tier[order], size[order], batch[order]
        breaks = np.concatenate(([True], batch[1:] != batch[:-1]))
        if self._tier_piece_bytes:
            breaks |= tier % self._tier_piece_bytes == 0
        starts = merge_starts(stage, tier, size, breaks=breaks)
        copy_batch = batch[starts]
        size = np.add.reduceat(size, starts) if len(starts) else size
        stage, tier = stage[starts], tier[starts]
        src, dst = (stage, tier) if direction is Direction.STORE else (tier, stage)
        cuts = np.searchsorted(copy_batch, np.arange(len(keys.bounds)))
        return [
            CopyList(src=src[a:b], dst=dst[a:b], nbytes=size[a:b])
            for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True)
        ]

    def _exact_pieces(self, g: int, first_slot: int, end_slot: int) -> tuple[IdArray, IdArray]:
        """Return (offset in the row, size) of each page a row of group `g` holds in slots
        `[first_slot, end_slot)`; staging mirrors the tier, so the offset serves both sides."""
        refs = self._refs[g]
        slots = np.arange(first_slot, end_slot, dtype=np.int64)
        offset = refs[:, _FIELD["stage_offset"], None]
        stride = refs[:, _FIELD["page_stride"], None]
        size = refs[:, _FIELD["page_bytes"], None]
        in_row = (offset + slots[None, :] * stride).ravel()
        return in_row, np.broadcast_to(size, (len(refs), len(slots))).ravel()


@attrs.frozen(kw_only=True, eq=False)
class _Keys:
    """A job's keys as columns: group, the slots `[first_slot, end_slot)` of the row the plan
    fills, staging bytes, offsets in its batch's staging and in the tier, and its batch."""

    group: IdArray
    first_slot: IdArray
    end_slot: IdArray
    size: IdArray
    stage: IdArray
    tier: IdArray
    batch: IdArray
    bounds: tuple[int, ...]
    """Batch `b` holds keys `[bounds[b], bounds[b + 1])`."""


def plan_stages(
    bound: BoundPlan,
    layout: KVLayout,
    *,
    capacity: int,
    piece_bytes: int,
    tier_piece_bytes: int = 0,
) -> tuple[StageBatch, ...]:
    """Return the batches of `bound` (a one-off `StagePlanner(...).plan(bound).batches`)."""
    planner = StagePlanner(
        layout, capacity=capacity, piece_bytes=piece_bytes, tier_piece_bytes=tier_piece_bytes
    )
    return planner.plan(bound).batches


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
