"""Splitting a transfer into batches that pass through a bounded GPU staging buffer.

numpy, and the job code's loops (`executors.jobcode`: compiled, or Python) for the arithmetic per
batch and slice; O(keys) per job in one pass, and it never lists a page. A batch is a run of
consecutive keys whose CPU rows fit in the buffer, laid out there exactly as in the tier, so its
link copies are one DMA per contiguous range of rows (a group's rows lie at its own pitch in its
own region of the tier, so consecutive rows of a group are one range). The on-GPU side of a batch
is a few lines of a *slice table* (one line per group in the batch), read with the layout's *ref
table* (one line per ref, built once): from the two the copy kernel (`kernels.STAGE_COPY_SOURCE`)
computes every page address itself. `segment_copies` is the same arithmetic in numpy, the kernel's
specification and its stand-in on machines without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import attrs
import numpy as np

from kvferry.core.arrays import IdArray
from kvferry.core.bound import BoundPlan
from kvferry.core.checks import unchecked_maker
from kvferry.core.errors import InvalidInputError
from kvferry.core.expand import CopyList
from kvferry.core.layout import KVLayout, TierLayout
from kvferry.core.plan import Direction, chunks_spanned
from kvferry.executors.jobcode import JobCode, job_code

REF_FIELDS = (
    "gpu_base",
    "page_stride",
    "page_bytes",
    "row_offset",
    "row_pitch",
    "slots",
    "piece_prefix",
    "pieces",
    "slot_bytes",
)
"""Columns of the ref table, in order (int64 each), one line per ref of every group, group
after group. A page of the ref with GPU id `i` lies at `gpu_base + i * page_stride`; in a CPU
row (and so in staging) the ref's `slots` (F) pages start `row_offset` bytes in, `slot_bytes`
apart (the page's bytes: a row holds no padding), and a group's rows are `row_pitch` bytes (in
staging as in the tier).
The kernel cuts a page into `pieces` pieces of at most `piece_bytes`; `piece_prefix` is the
pieces per page of the group's refs before this one."""

SLICE_FIELDS = (
    "first_ref",
    "refs",
    "stage_offset",
    "id_offset",
    "first_position",
    "count",
    "first_item",
)
"""Columns of a slice table, in order (int64 each). A slice is the keys of one group in one
batch: refs `first_ref .. first_ref + refs - 1` of the ref table, and `count` pages per ref, at
positions `q = first_position + p` (p < count) of the group's rows laid one after another from
`stage_offset` in staging; page p has GPU id `ids[id_offset + p]`. So ref r's page p lies at
`stage_offset + row_offset + (q // slots) * row_pitch + (q % slots) * slot_bytes` in staging.
The kernel numbers the pieces of a batch one after another, slice after slice, ref after ref,
page after page; `first_item` is the slice's first."""

_REF = {name: i for i, name in enumerate(REF_FIELDS)}
_SLICE = {name: i for i, name in enumerate(SLICE_FIELDS)}

_Columns = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""Link copies as three columns: sources, destinations, bytes."""


@attrs.frozen(kw_only=True, eq=False)
class StageBatch:
    """One trip through the staging buffer: whole CPU rows, at most the buffer's size."""

    stage_bytes: int
    """Bytes of the staging buffer this batch uses."""
    dma: CopyList
    """Link copies as offsets: a store copies stage -> tier, a load tier -> stage (merged)."""
    first_line: int
    """Index of the batch's first line in the job's slice table."""
    segments: IdArray
    """The batch's lines of the slice table, `(n, len(SLICE_FIELDS))` int64 (a view); their
    `first_item` counts from 0 in each batch."""
    refs: IdArray
    """The layout's ref table, which the slice lines point into."""
    items: int
    """Pieces the copy kernel moves for this batch (the sum over segments of pages x pieces)."""
    nbytes: int
    """Bytes of the plan this batch moves."""


@attrs.frozen(kw_only=True, eq=False)
class StagePlan:
    """A job's batches, as columns: one slice table and one list of link copies for the whole
    job (uploaded or queued batch after batch), cut by per-batch bounds.

    An executor reads the columns (one Python value per batch, no object per batch); `batches`
    gives the same data one `StageBatch` at a time, for reading and tests.
    """

    table: IdArray
    """Every batch's slice lines, batch after batch, `(n, len(SLICE_FIELDS))` int64."""
    refs: IdArray
    """The layout's ref table (`REF_FIELDS`), which the slice lines point into."""
    line_bounds: tuple[int, ...]
    """Batch k's lines are `table[line_bounds[k]:line_bounds[k + 1]]`."""
    link_src: tuple[int, ...]
    """Every batch's link copies, batch after batch, as offsets (see `StageBatch.dma`): their
    sources, ..."""
    link_dst: tuple[int, ...]
    """... destinations ..."""
    link_size: tuple[int, ...]
    """... and bytes (Python integers: the executor queues them one by one)."""
    link_bounds: tuple[int, ...]
    """Batch k's link copies are entries `link_bounds[k]` to `link_bounds[k + 1]`."""
    stage_bytes: tuple[int, ...]
    """Per batch: the staging bytes it uses."""
    items: tuple[int, ...]
    """Per batch: the pieces the copy kernel moves."""
    nbytes: tuple[int, ...]
    """Per batch: the bytes of the plan it moves."""

    def __len__(self) -> int:
        return len(self.stage_bytes)

    @property
    def batches(self) -> tuple[StageBatch, ...]:
        """Return the trips through staging, in order, one object each."""
        lines, link = self.line_bounds, self.link_bounds
        return tuple(
            StageBatch(
                stage_bytes=self.stage_bytes[k],
                dma=CopyList(
                    src=self.link_src[link[k] : link[k + 1]],
                    dst=self.link_dst[link[k] : link[k + 1]],
                    nbytes=self.link_size[link[k] : link[k + 1]],
                ),
                first_line=lines[k],
                segments=self.table[lines[k] : lines[k + 1]],
                refs=self.refs,
                items=self.items[k],
                nbytes=self.nbytes[k],
            )
            for k in range(len(self))
        )


_new_plan = unchecked_maker(StagePlan)


class StagePlanner:
    """Plans staged transfers for one layout: what depends only on the layout is worked out
    once here, so planning a job costs arithmetic per batch and group, plus one numpy pass over
    its rows."""

    def __init__(
        self,
        layout: KVLayout,
        *,
        capacity: int,
        piece_bytes: int,
        tier: TierLayout,
        rows_per_piece: Sequence[int] = (),
        ramp_bytes: int = 8 << 20,
        code: JobCode | None = None,
    ) -> None:
        self._code = job_code() if code is None else code
        """The job code whose loops plan (`executors.jobcode`; its default route when None)."""
        if capacity < layout.largest_row_bytes:
            raise InvalidInputError(
                field="staging_bytes",
                expected=f"at least the largest group's row ({layout.largest_row_bytes})",
                got=capacity,
            )
        if tier.pitch != layout.row_pitches:
            raise InvalidInputError(
                field="tier", expected=f"row pitches {layout.row_pitches} (the layout's)", got=tier
            )
        if rows_per_piece and (len(rows_per_piece) != layout.num_groups or min(rows_per_piece) < 1):
            raise InvalidInputError(
                field="rows_per_piece",
                expected=f"one count >= 1 per group ({layout.num_groups}), or none",
                got=rows_per_piece,
            )
        if piece_bytes < 16 or piece_bytes % 16:
            raise InvalidInputError(
                field="piece_bytes", expected="a positive multiple of 16", got=piece_bytes
            )
        f = layout.blocks_per_chunk
        self._layout = layout
        self._capacity = capacity
        self._ramp_bytes = min(ramp_bytes, capacity)
        self._bases = tier.base
        """Offset of each group's region in the tier."""
        self._per_piece = tuple(rows_per_piece) or (0,) * layout.num_groups
        """Per group: its rows per registered piece of the tier (0: one piece)."""
        self._sizes = list(layout.row_pitches)
        self._dense = [True] * layout.num_groups
        """Whether a group's slots in a row are all data: always, since rows hold no padding
        (`PageRef.page_bytes` is the slot); the job code's constants still carry the flag."""
        lines: list[tuple[int, ...]] = []
        self._refs_of: list[_GroupRefs] = []
        for g, group in enumerate(layout.groups):
            first_ref = len(lines)
            prefix = 0
            for ref, offset in zip(group.refs, group.row_offsets(f), strict=True):
                pieces = -(-ref.page_bytes // piece_bytes)
                lines.append(
                    (
                        ref.address,
                        ref.page_stride,
                        ref.page_bytes,
                        offset,
                        self._sizes[g],
                        f,
                        prefix,
                        pieces,
                        ref.page_bytes,
                    )
                )
                prefix += pieces
            self._refs_of.append(
                _GroupRefs(first_ref, len(group.refs), prefix, group.block_copy_bytes)
            )
        self.ref_table: IdArray = np.array(lines, np.int64).reshape(-1, len(REF_FIELDS))
        """The layout's ref table (`REF_FIELDS`), the same for every job."""
        self.ref_table.setflags(write=False)
        self.job_constants = (
            capacity,
            self._ramp_bytes,
            f,
            self.ref_table.size,
            tuple(
                (
                    *refs[:4],
                    self._sizes[g],
                    self._dense[g],
                    self._bases[g],
                    self._per_piece[g],
                )
                for g, refs in enumerate(self._refs_of)
            ),
        )
        """What the job code's `stage_job` plans with: staging capacity, ramp bytes, blocks per
        chunk, the ref table's int64 count, and per layout group its first ref, refs, pieces and
        bytes per page, row bytes (its pitch), whether its pages are unpadded, the offset of its
        region in the tier and its rows per registered piece of the tier (0: one piece)."""

    def plan(self, bound: BoundPlan) -> StagePlan:
        """Return the batches of `bound`: runs of consecutive keys whose rows fit in staging.

        Expects a plan `check_bound` accepted. A key of group `g` takes `group_row_bytes(g)` of
        staging. Keys are cut into batches greedily, group after group (a group's keys all take
        the same staging bytes, so this is arithmetic per batch). Where the link waits for a
        kernel, the batch holds at most `ramp_bytes`: a store's first (its gather runs before
        the first DMA can start), a load's last (its scatter runs after the last DMA); the other
        batches fill the staging half, since each batch costs host calls. A load reads whole
        rows (bytes it does not need land in staging and stay there); a store writes whole rows
        only where the plan fills them, and exactly its pages elsewhere (a partial last chunk,
        padded pages), so the tier keeps every byte the plan does not name. No link copy crosses
        a registered piece of the tier (`rows_per_piece` rows of a group).

        Work per job: the job code's loops over batches and slices, numpy over link copies
        where the rows are not one run; the keys themselves are touched by one pass.
        """
        groups = self._groups(bound)
        direction = bound.plan.direction
        table_bytes, line_bytes, line_bounds, stage_bytes, items, nbytes = self._code.slice_batches(
            groups,
            direction is Direction.STORE,
            self._capacity,
            self._ramp_bytes,
            self._layout.blocks_per_chunk,
        )
        rows = np.ascontiguousarray(bound.cpu_rows, np.int64)
        (src, dst, size), link_bounds = self._link_copies(
            direction, groups, line_bytes, len(stage_bytes), rows
        )
        # built unchecked: every field comes from the arithmetic above, on a checked plan
        return _new_plan(
            table=np.frombuffer(table_bytes, np.int64).reshape(-1, len(SLICE_FIELDS)),
            refs=self.ref_table,
            line_bounds=line_bounds,
            link_src=src,
            link_dst=dst,
            link_size=size,
            link_bounds=link_bounds,
            stage_bytes=stage_bytes,
            items=items,
            nbytes=nbytes,
        )

    def _groups(self, bound: BoundPlan) -> list[_Group]:
        """Return the groups the plan moves blocks of, with where their keys and ids start."""
        plan = bound.plan
        f = self._layout.blocks_per_chunk
        out = []
        key0 = id0 = 0
        for g, (n, first) in enumerate(zip(plan.group_sizes, plan.block_indices, strict=True)):
            skip = first % f
            keys = chunks_spanned(n, skip, f)
            if keys:
                out.append(_Group(*self._refs_of[g], n, skip, keys, key0, id0, self._sizes[g], g))
            key0 += keys
            id0 += n
        return out

    def _link_copies(
        self,
        direction: Direction,
        groups: list[_Group],
        lines: bytes,
        n_batches: int,
        rows: IdArray,
    ) -> tuple[_Columns, tuple[int, ...]]:
        """Return the job's merged link copies, as (src, dst, size) offsets batch after batch
        (stage -> tier for a store, tier -> stage for a load), and the bounds of each batch's.
        `lines` are the job's slices as the job code's `slice_batches` returns them (int64,
        `_SLICE_LINE_WIDTH` columns: batch, group, first key, keys, stage offset).

        A copy is a run of keys of one slice whose rows are consecutive (and so adjacent in the
        tier: a group's rows lie at its own pitch); a store's keys the plan does not fill, or
        whose pages are padded, are copied page by page instead.
        """
        if not groups:
            return ((), (), ()), (0,) * (n_batches + 1)
        exact = self._exact_keys(direction, groups)
        consecutive = self._code.consecutive
        if not len(exact) and all(
            consecutive(rows[group.key0 : group.key0 + group.keys]) for group in groups
        ):
            # one copy per slice, cut only at the tier's registration boundaries (the common job)
            run_src, run_dst, run_size, run_bounds = self._code.run_copies(
                lines,
                [group.key0 for group in groups],
                n_batches,
                [int(rows[group.key0]) for group in groups],
                [self._bases[group.g] for group in groups],
                [group.size for group in groups],
                [self._per_piece[group.g] for group in groups],
                direction is Direction.STORE,
            )
            return (run_src, run_dst, run_size), run_bounds
        breaks = np.flatnonzero(rows[1:] - rows[:-1] != 1) + 1
        slices = np.frombuffer(lines, np.int64).reshape(-1, _SLICE_LINE_WIDTH)
        batch_of, group_of, first, _, stage_of = slices.T
        key0 = np.asarray([group.key0 for group in groups], np.int64)[group_of] + first
        starts = self._copy_starts(groups, key0, rows, breaks, exact)
        ends = np.append(starts[1:], len(rows))
        # each copy's slice: the last slice starting at or before its first key
        owner = np.searchsorted(key0, starts, side="right") - 1
        size_of = np.asarray([group.size for group in groups], np.int64)[group_of[owner]]
        base_of = np.asarray([self._bases[group.g] for group in groups], np.int64)[group_of[owner]]
        stage = stage_of[owner] + (starts - key0[owner]) * size_of
        tier = base_of + rows[starts] * size_of
        size = (ends - starts) * size_of
        batch = batch_of[owner]
        if len(exact):
            is_exact = np.isin(starts, exact)
            parts = [(stage[~is_exact], tier[~is_exact], size[~is_exact], batch[~is_exact])]
            for i in np.flatnonzero(is_exact).tolist():
                group = groups[int(group_of[owner[i]])]
                in_row, piece = self._exact_pieces(group, int(starts[i]) - group.key0)
                parts.append(
                    (stage[i] + in_row, tier[i] + in_row, piece, np.full(len(piece), batch[i]))
                )
            stage, tier, size, batch = (
                np.concatenate(column) for column in zip(*parts, strict=True)
            )
            order = np.lexsort((stage, batch))
            stage, tier, size, batch = stage[order], tier[order], size[order], batch[order]
        src, dst = (stage, tier) if direction is Direction.STORE else (tier, stage)
        bounds = np.searchsorted(batch, np.arange(n_batches + 1)).tolist()
        columns = (tuple(src.tolist()), tuple(dst.tolist()), tuple(size.tolist()))
        return columns, tuple(bounds)

    def _exact_keys(self, direction: Direction, groups: list[_Group]) -> IdArray:
        """Return the keys a store must copy page by page: partial chunks, padded pages."""
        if direction is not Direction.STORE:
            return _NO_KEYS
        f = self._layout.blocks_per_chunk
        exact: list[int] = []
        for group in groups:
            if not self._dense[group.g]:
                exact.extend(range(group.key0, group.key0 + group.keys))
                continue
            if group.skip:
                exact.append(group.key0)
            if group.skip + group.n - (group.keys - 1) * f < f:
                exact.append(group.key0 + group.keys - 1)
        return np.asarray(sorted(set(exact)), np.int64)

    def _copy_starts(
        self, groups: list[_Group], key0: IdArray, rows: IdArray, breaks: IdArray, exact: IdArray
    ) -> IdArray:
        """Return the keys where a link copy must start: a slice's first key, a break in the
        rows, a registration boundary of the tier, and around the keys copied page by page
        (`breaks`: the keys whose row does not follow the previous key's)."""
        cuts = [key0, breaks]
        if len(exact):
            cuts += [exact, exact + 1]
        for group in groups:
            per_piece = self._per_piece[group.g]
            if per_piece:
                own = rows[group.key0 : group.key0 + group.keys]
                cuts.append(group.key0 + np.flatnonzero(own % per_piece == 0))
        starts = np.unique(np.concatenate(cuts))
        return starts[starts < len(rows)]

    def _exact_pieces(self, group: _Group, local: int) -> tuple[IdArray, IdArray]:
        """Return (offset in the row, size) of each page the plan fills in the row of the
        group's key `local`; staging mirrors the tier, so the offset serves both sides."""
        f = self._layout.blocks_per_chunk
        first = group.skip if local == 0 else 0
        end = min(group.skip + group.n - local * f, f)
        refs = self.ref_table[group.first_ref : group.first_ref + group.refs]
        slots = np.arange(first, end, dtype=np.int64)
        offset = refs[:, _REF["row_offset"], None]
        size = refs[:, _REF["page_bytes"], None]
        in_row = (offset + slots[None, :] * size).ravel()
        return in_row, np.broadcast_to(size, (len(refs), len(slots))).ravel()


class _GroupRefs(NamedTuple):
    """A layout group's lines of the ref table, and what a page of the group costs."""

    first_ref: int
    refs: int
    page_pieces: int
    """Kernel pieces per page of the group (over all its refs)."""
    page_bytes: int
    """Bytes per page of the group (over all its refs)."""


class _Group(NamedTuple):
    """A group the plan moves: its ref-table lines and page costs (as `_GroupRefs`), then its
    blocks, skip, keys, first key and first id, key bytes, and its number in the layout. The
    job code's slicer (`slice_batches`) reads the fields before `g`, in this order."""

    first_ref: int
    refs: int
    page_pieces: int
    page_bytes: int
    n: int
    skip: int
    keys: int
    key0: int
    id0: int
    size: int
    g: int


_NO_KEYS = np.zeros(0, np.int64)
_NO_KEYS.setflags(write=False)

_SLICE_LINE_WIDTH = 5
"""Columns of a job's slice list (the job code's `slice_batches`): the batch, the group (an index
into the job's groups, not the layout's group number), the slice's first key counted in its group,
its key count, and the offset of its first key in the batch's staging."""


def segment_copies(
    slices: IdArray, refs: IdArray, ids: IdArray, *, direction: Direction
) -> CopyList:
    """Return the page copies a slice table means, with the ref table `refs`, as (src, dst,
    nbytes) with the GPU side as absolute addresses and the staging side as offsets: the copy
    kernel's work, page by page (the kernel also cuts pages into pieces, which moves the same
    bytes), in the kernel's order (slice, ref, page)."""
    column = {name: slices[:, i] for name, i in _SLICE.items()}
    # one line per (slice, ref): the slice's columns beside the ref's
    per_slice = column["refs"]
    line_slice = np.repeat(np.arange(len(slices)), per_slice)
    starts = np.cumsum(per_slice) - per_slice
    line_ref = column["first_ref"][line_slice] + np.arange(len(line_slice)) - starts[line_slice]
    ref = {name: refs[line_ref, i] for name, i in _REF.items()}
    count = column["count"][line_slice]
    line = np.repeat(np.arange(len(line_slice)), count)
    p = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    q = column["first_position"][line_slice][line] + p
    stride, slots = ref["page_stride"][line], ref["slots"][line]
    stage = (
        column["stage_offset"][line_slice][line]
        + ref["row_offset"][line]
        + (q // slots) * ref["row_pitch"][line]
        + (q % slots) * ref["slot_bytes"][line]
    )
    ids = np.asarray(ids, np.int64)
    gpu = ref["gpu_base"][line] + ids[column["id_offset"][line_slice][line] + p] * stride
    size = ref["page_bytes"][line]
    if direction is Direction.STORE:
        return CopyList(src=gpu, dst=stage, nbytes=size)
    return CopyList(src=stage, dst=gpu, nbytes=size)
