"""Splitting a transfer into batches that pass through a bounded GPU staging buffer.

numpy only: it computes offsets and copy lists for the GPU executors, and never copies a byte.
The staging buffer mirrors CPU rows, so each batch crosses the link in few large DMAs.
"""

from __future__ import annotations

import attrs
import numpy as np

from kvferry.core.arrays import IdArray
from kvferry.core.bound import BoundPlan
from kvferry.core.errors import InvalidInputError
from kvferry.core.expand import CopyList, PageCopies, merge_copies
from kvferry.core.layout import KVLayout
from kvferry.core.plan import Direction, chunks_spanned


@attrs.frozen(kw_only=True)
class GroupSlice:
    """The rows of one group inside a batch, for backends that copy one ref at a time."""

    group: int
    """The group."""
    rows: int
    """Rows of the group in the batch; the staging holds them back to back."""
    stage_offset: int
    """Offset, in the staging buffer, of the first of these rows."""
    position_start: int
    """First slot position (row-local * F + slot, counted from the batch's first row) moved."""
    position_end: int
    """One past the last slot position moved."""
    padded_ids: IdArray
    """`rows * F` GPU ids, one per slot; slots outside the plan repeat a real id (read only)."""
    ids: IdArray
    """The real GPU ids of positions `[position_start, position_end)`."""


@attrs.frozen(kw_only=True, eq=False)
class StageBatch:
    """One trip through the staging buffer: whole CPU rows, at most the buffer's size."""

    stage_bytes: int
    """Bytes of the staging buffer this batch uses."""
    dma: CopyList
    """Link copies as offsets: store stage -> tier, load tier -> stage (merged)."""
    device: CopyList
    """On-GPU copies: store GPU address -> stage offset, load stage offset -> GPU address."""
    groups: tuple[GroupSlice, ...]
    """The same batch, described per group for per-ref backends."""
    nbytes: int
    """Bytes of the plan moved by this batch."""


_NO_COPIES = CopyList(src=np.zeros(0, np.int64), dst=np.zeros(0, np.int64), nbytes=np.zeros(0))


def plan_stages(
    bound: BoundPlan,
    pages: PageCopies,
    layout: KVLayout,
    *,
    capacity: int,
    piece_bytes: int = 0,
    device_copies: bool = True,
    group_slices: bool = True,
) -> tuple[StageBatch, ...]:
    """Return the batches of `bound`: consecutive keys whose rows fit in `capacity` bytes.

    A key's rows take `layout.group_row_bytes(g)` of staging, in CPU row layout, so each batch's
    link copies merge into one per contiguous CPU range (a row, or consecutive rows). A backend
    that copies flat descriptors needs only `device_copies`, one that copies per ref only
    `group_slices`; the other is left empty when turned off.
    """
    plan = bound.plan
    f = layout.blocks_per_chunk
    if capacity < layout.row_bytes:
        raise InvalidInputError(
            field="staging_bytes", expected=f"at least one row ({layout.row_bytes})", got=capacity
        )
    key_groups = np.array([key.group for key in plan.keys], dtype=np.int64)
    group_bytes = np.array([layout.group_row_bytes(g) for g in range(layout.num_groups)])
    key_bytes = group_bytes[key_groups] if len(key_groups) else np.zeros(0, np.int64)
    ends = np.cumsum(key_bytes)
    starts_bytes = ends - key_bytes
    key_ranges = []
    first = 0
    while first < len(key_bytes):
        last = int(np.searchsorted(ends, starts_bytes[first] + capacity, side="right"))
        key_ranges.append((first, last))
        first = last
    in_row = pages.cpu_offset - bound.cpu_rows[pages.key_index] * layout.row_bytes
    # per group: first key, skip, ids
    group_first_key = np.concatenate(
        (
            [0],
            np.cumsum(
                [
                    chunks_spanned(n, i % f, f)
                    for n, i in zip(plan.group_sizes, plan.block_indices, strict=True)
                ]
            ),
        )
    )
    id_starts = np.concatenate(([0], np.cumsum(plan.group_sizes)))
    batches = []
    for k0, k1 in key_ranges:
        p0, p1 = np.searchsorted(pages.key_index, [k0, k1])
        base = starts_bytes[k0]
        stage = starts_bytes[pages.key_index[p0:p1]] - base + in_row[p0:p1]
        cpu = pages.cpu_offset[p0:p1]
        size = pages.nbytes[p0:p1]
        gpu = pages.gpu_address[p0:p1]
        breaks = cpu % piece_bytes == 0 if piece_bytes else None
        device = _NO_COPIES
        if pages.direction is Direction.STORE:
            dma = merge_copies(stage, cpu, size, breaks=breaks)
            if device_copies:
                device = merge_copies(gpu, stage, size)
        else:
            dma = merge_copies(cpu, stage, size, breaks=breaks)
            if device_copies:
                device = merge_copies(stage, gpu, size)
        slices = []
        for g in range(plan.num_groups if group_slices else 0):
            g0, g1 = max(k0, int(group_first_key[g])), min(k1, int(group_first_key[g + 1]))
            if g0 >= g1:
                continue
            n, skip = plan.group_sizes[g], plan.block_indices[g] % f
            row0 = g0 - int(group_first_key[g])
            rows = g1 - g0
            positions = np.arange(row0 * f, (row0 + rows) * f, dtype=np.int64)
            ids = plan.gpu_block_ids[id_starts[g] : id_starts[g] + n]
            padded = ids[np.clip(positions - skip, 0, n - 1)]
            lo = max(skip, row0 * f)
            hi = min(skip + n, (row0 + rows) * f)
            slices.append(
                GroupSlice(
                    group=g,
                    rows=rows,
                    stage_offset=int(starts_bytes[g0] - base),
                    position_start=lo - row0 * f,
                    position_end=hi - row0 * f,
                    padded_ids=padded,
                    ids=ids[lo - skip : hi - skip],
                )
            )
        batches.append(
            StageBatch(
                stage_bytes=int(ends[k1 - 1] - base),
                dma=dma,
                device=device,
                groups=tuple(slices),
                nbytes=int(size.sum()),
            )
        )
    return tuple(batches)
