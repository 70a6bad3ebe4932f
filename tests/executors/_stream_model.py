"""A stream-order model of the staged executor: what a GPU would be asked to do, as a log.

Test support only. `StreamOrderModel` is the torch executor on CPU tensors (`TorchOnCpuExecutor`:
the copies still happen, at once, in call order) whose CUDA primitives also log every operation:

- a stream is a FIFO queue: an op happens after the op queued before it on the same stream;
- an event is the op recorded on it last; `_wait(stream, event)` captures that op *at call time*
  (as `cuStreamWaitEvent` does: a later re-record does not move an earlier wait), and the ops
  queued on `stream` afterwards happen after it;
- a blocking host call (`_synchronize`, `_synchronize_event`, `_elapsed`, `_event_done` answering
  True) makes every op queued afterwards, on any stream, happen after what the host waited for,
  and so does a host write (the host queues nothing before it has written).

The host writes a job's tables into a pinned table slot (in the job code's `stage_job`, or in
`_write_tables`) before the job's first driver call, where the model logs that write; they are
then copied to the slot's own GPU buffer of tables (a table-copy kernel on the job's first lane,
an UPLOAD op that reads the slot and writes the device tables), and the job's kernels read them
there. The model logs the host's writes of the slot, each upload, and each kernel's reads of
its tables (the ref table, the block ids its slice lines use, and those lines).
`happens_before` is the transitive closure of the edges above; every op carries the memory it
touches (a staging half as a whole, a byte range of a pinned table slot, of the device tables,
of the tier), so a hazard is two ops touching the same memory, one writing, that it does not
order.
"""

from __future__ import annotations

import ctypes
import enum
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np
from _torch_on_cpu import TorchOnCpuExecutor

from kvferry.core.bound import BoundPlan
from kvferry.core.plan import Direction
from kvferry.executors.staged import TABLE_SLOTS, GpuJob
from kvferry.executors.staging import SLICE_FIELDS

COMPUTE_STREAMS = (1, 2)
"""Raw handles of the engine's compute streams (lanes get handles from 100 on)."""


class Kind(enum.Enum):
    """What an op is."""

    COMPUTE = "compute"
    """The engine's work on a compute stream (it writes the KV blocks of the next job)."""
    RECORD = "record"
    WAIT = "wait"
    UPLOAD = "upload"
    """The copy of a job's tables from its pinned table slot to its direction's device tables."""
    DMA = "dma"
    """A memcpy between a staging half and the tier."""
    KERNEL = "kernel"
    """A staging kernel launch (it reads its job's tables from its direction's device tables)."""
    HOST = "host"
    """The host writing a job's tables into a pinned table slot."""


WORK = frozenset({Kind.UPLOAD, Kind.DMA, Kind.KERNEL})
"""The ops that move a job's bytes (what must lie between its start and end records)."""


@attrs.frozen
class Access:
    """Bytes `lo .. hi - 1` of `resource`, read or written."""

    resource: tuple[Any, ...]
    """`("stage", direction, half)`, `("pinned", base)` (a table slot), `("tables", base)` (a
    direction's device tables) or `("tier",)`."""
    lo: int
    hi: int
    write: bool

    def conflicts(self, other: Access) -> bool:
        """Return True when the two overlap in one resource and one of them writes."""
        return (
            self.resource == other.resource
            and self.lo < other.hi
            and other.lo < self.hi
            and (self.write or other.write)
        )


@attrs.define(eq=False)
class Op:
    """One logged operation; `after` is the set (a bitset of indices) of ops it happens after."""

    index: int
    kind: Kind
    stream: int | None
    """Raw stream handle, None for the host."""
    job: int | None
    label: str
    accesses: tuple[Access, ...]
    after: int

    def __repr__(self) -> str:
        where = "host" if self.stream is None else f"stream {self.stream}"
        return f"<#{self.index} {self.kind.value} {self.label} job={self.job} on {where}>"


@attrs.define(eq=False)
class ModelEvent:
    """An event: the op recorded on it last (None before any record)."""

    serial: int
    timing: bool
    record: Op | None = None
    destroyed: bool = False


class Trace:
    """The log: ops in the order the host queued them, and what happens before what."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.misuse: list[str] = []
        """Events recorded, waited on or destroyed after being destroyed."""
        self._last_on: dict[int, Op] = {}
        self._host = 0
        """What the host knows has happened: every op queued from now on happens after it."""

    def queue(
        self,
        kind: Kind,
        stream: int | None,
        *,
        job: int | None = None,
        label: str = "",
        accesses: Iterable[Access] = (),
        waits_for: Op | None = None,
    ) -> Op:
        """Log an op queued now on `stream` (None: done by the host at once)."""
        after = self._host
        previous = self._last_on.get(stream) if stream is not None else None
        for dependency in (previous, waits_for):
            if dependency is not None:
                after |= dependency.after | 1 << dependency.index
        op = Op(len(self.ops), kind, stream, job, label, tuple(accesses), after)
        self.ops.append(op)
        if stream is None:
            self._host |= after | 1 << op.index
        else:
            self._last_on[stream] = op
        return op

    def host_waits_for(self, op: Op | None) -> None:
        """The host blocks until `op` has run."""
        if op is not None:
            self._host |= op.after | 1 << op.index

    def last_on(self, stream: int) -> Op | None:
        """Return the op queued last on `stream` (None before any)."""
        return self._last_on.get(stream)

    def host_knows(self, op: Op) -> bool:
        """Return True when the host has waited for `op` (it has run)."""
        return bool(self._host >> op.index & 1)

    def host_synchronizes(self, stream: int) -> None:
        """The host blocks until `stream` is idle."""
        self.host_waits_for(self._last_on.get(stream))


def happens_before(a: Op, b: Op) -> bool:
    """Return True when `a` is ordered before `b` (stream order, waits, host syncs)."""
    return bool(b.after >> a.index & 1)


@attrs.define(eq=False)
class JobTrace:
    """One submitted job, as the log saw it."""

    job_id: int
    direction: Direction
    batches: int
    compute: Op
    """The engine's op on the compute stream the job was submitted behind."""
    start: Op
    end: Op
    work: list[Op]
    tables: Op
    """The host's write of the job's block ids and slice table into its table slot."""
    upload: Op | None = None
    """The copy of its tables to the device tables (None only if the job queued none)."""
    timed: list[tuple[Op | None, Op]] = attrs.Factory(list)
    """What the host's waits on the job's timing events captured: (start or None, end)."""


class StreamOrderModel(TorchOnCpuExecutor):
    """`TorchOnCpuExecutor` whose CUDA primitives log into `trace` (see the module docstring).

    Submit through `submit_behind_compute`, which logs the engine's work first."""

    name = "stream-order-model"

    def __init__(self, **options: Any) -> None:
        self.trace = Trace()
        self.jobs: dict[int, JobTrace] = {}
        """Every submitted job, in submission order."""
        self.compute_stream = COMPUTE_STREAMS[0]
        self._handles: dict[int, int] = {}
        self._regions: list[tuple[int, int, tuple[Any, ...]]] = []
        self._keep: list[Any] = []
        """Everything allocated or handed out, so that no address or id is reused."""
        self._job: int | None = None
        self._job_ids: dict[int, int] = {}
        self._compute_op: Op | None = None
        self._allocating_tables = False
        self._events = 0
        self._writing: BoundPlan | None = None
        """The job whose table writes are not logged yet (`_log_table_writes`)."""
        self._logged_regions = 0
        super().__init__(**options)

    # --- the engine --------------------------------------------------------------------------

    def submit_behind_compute(self, bound: BoundPlan, compute_stream: int) -> int:
        """Queue the engine's work writing the job's KV blocks on `compute_stream`, make it the
        current stream, and submit `bound`."""
        self.compute_stream = compute_stream
        ids = [int(i) for i in bound.plan.gpu_block_ids]
        self._compute_op = self.trace.queue(Kind.COMPUTE, compute_stream, label=f"writes {ids}")
        return self.submit(bound)

    # --- job attribution ---------------------------------------------------------------------

    def _enqueue(self, bound: BoundPlan) -> GpuJob:
        assert self._compute_op is not None, "submit through submit_behind_compute"
        self._job, first = bound.job_id, len(self.trace.ops)
        self._writing = bound
        try:
            handle = super()._enqueue(bound)
            # with a submission thread: let it make the job's calls now, so that the log
            # names their job (the order they are queued in is the thread's, not changed)
            self._drain()
        finally:
            self._job = None
        self._keep.append(handle)
        self._job_ids[id(handle)] = bound.job_id
        start, end = handle.start.record, handle.end.record
        assert start is not None and end is not None
        start.label, end.label = f"start ({start.label})", f"end ({end.label})"
        self.jobs[bound.job_id] = JobTrace(
            job_id=bound.job_id,
            direction=bound.plan.direction,
            batches=handle.batches,
            compute=self._compute_op,
            start=start,
            end=end,
            work=[op for op in self.trace.ops[first:] if op.kind in WORK],
            tables=next(op for op in self.trace.ops[first:] if op.label == "tables"),
            upload=next((op for op in self.trace.ops[first:] if op.kind is Kind.UPLOAD), None),
        )
        self._compute_op = None
        return handle

    def _job_of(self, handle: GpuJob) -> JobTrace:
        return self.jobs[self._job_ids[id(handle)]]

    def _finish(self, handle: GpuJob) -> float:
        job = self._job_of(handle)
        job.timed.append((handle.start.record, handle.end.record))
        return super()._finish(handle)

    def _done(self, handle: GpuJob) -> bool:
        job = self._job_of(handle)
        job.timed.append((None, handle.end.record))
        return super()._done(handle)

    # --- memory ------------------------------------------------------------------------------

    def _allocate(self, nbytes: int) -> Any:
        """Allocate; within `_new_slot` the buffer is a slot's device tables, else a staging
        half (`_stages` names it)."""
        buffer = super()._allocate(nbytes)
        self._keep.append(buffer)
        if self._allocating_tables:
            address = self._address(buffer)
            self._regions.append((address, address + nbytes, ("tables", address)))
        return buffer

    def _allocate_pinned(self, count: int) -> tuple[Any, Any]:
        host, view = super()._allocate_pinned(count)
        self._keep.append(host)
        address = int(view.ctypes.data)
        self._regions.append((address, address + 8 * count, ("pinned", address)))
        return host, view

    def _stages(self, direction: Direction) -> tuple[int, int]:
        fresh = direction not in self._staging
        halves = super()._stages(direction)
        if fresh:
            for half, address in enumerate(halves):
                self._regions.append(
                    (address, address + self._half_bytes, ("stage", direction, half))
                )
        return halves

    def _log_table_writes(self) -> None:
        """Log the host's writes of the job being queued, once, at its first driver call (both
        paths write before it, after whatever the host waited for): the ref table into each
        slot made since the last job ("ref table"), then the job's block ids and slice table
        after the ref table of its slot ("tables")."""
        bound, self._writing = self._writing, None
        if bound is None:
            return
        direction = bound.plan.direction
        ref_bytes = self._planner.ref_table.nbytes
        for base, _, resource in self._regions[self._logged_regions :]:
            if resource[0] == "pinned":
                written = self._access(base, ref_bytes, write=True)
                self.trace.queue(Kind.HOST, None, label="ref table", accesses=[written])
        self._logged_regions = len(self._regions)
        k = (self._next_slot[direction] - 1) % TABLE_SLOTS
        slot = self._tables[direction][k]
        values = len(bound.plan.gpu_block_ids) + self._planner.plan(bound).table.size
        written = self._access(slot.address + ref_bytes, 8 * values, write=True)
        self.trace.queue(Kind.HOST, None, job=self._job, label="tables", accesses=[written])

    def _new_slot(self, direction: Direction, values: int) -> Any:
        """Mark the device allocation made here as device tables."""
        self._allocating_tables = True
        try:
            return super()._new_slot(direction, values)
        finally:
            self._allocating_tables = False

    def _access(self, address: int, nbytes: int, *, write: bool) -> Access:
        """Return the access to `nbytes` at `address` (a staging half counts as a whole)."""
        tier = self.host_tier
        regions = [
            *self._regions,
            (tier.address, tier.address + tier.nbytes, ("tier",)),
        ]
        for lo, hi, resource in regions:
            if lo <= address and address + nbytes <= hi:
                if resource[0] == "stage":
                    return Access(resource, lo, hi, write)
                return Access(resource, address, address + nbytes, write)
        raise AssertionError(f"{nbytes} bytes at {address:#x} lie in no known buffer")

    # --- CUDA, logged ------------------------------------------------------------------------

    def _stream_handle(self, stream: Any) -> int:
        self._keep.append(stream)
        return self._handles.setdefault(id(stream), 100 + len(self._handles))

    def _compute_stream_now(self) -> int:
        return self.compute_stream

    def _synchronize(self, stream: Any) -> None:
        self.trace.host_synchronizes(self._stream_handle(stream))

    def _new_event(self, *, timing: bool = False) -> ModelEvent:
        self._events += 1
        event = ModelEvent(self._events, timing)
        self._keep.append(event)
        return event

    def _label(self, event: ModelEvent) -> str:
        for name in ("ready", "joined", "uploaded"):
            for direction, mine in getattr(self, f"_{name}").items():
                if mine is event:
                    return f"{name} {direction.value}"
        return f"{'timing ' if event.timing else ''}event {event.serial}"

    def _check_alive(self, event: ModelEvent, use: str) -> None:
        if event.destroyed:
            self.trace.misuse.append(f"{use} of destroyed {self._label(event)}")

    def _record(self, event: ModelEvent, stream: int) -> None:
        self._log_table_writes()
        self._check_alive(event, "record")
        label = self._label(event)
        event.record = self.trace.queue(Kind.RECORD, stream, job=self._job, label=label)

    def _wait(self, stream: int, event: ModelEvent) -> None:
        self._check_alive(event, "wait")
        self.trace.queue(
            Kind.WAIT, stream, job=self._job, label=self._label(event), waits_for=event.record
        )

    def _event_done(self, event: ModelEvent) -> bool:
        self._check_alive(event, "query")
        self.trace.host_waits_for(event.record)
        return True

    def _elapsed(self, start: ModelEvent, end: ModelEvent) -> float:
        self._check_alive(start, "elapsed")
        self._check_alive(end, "elapsed")
        self.trace.host_waits_for(end.record)
        return 0.0

    def _synchronize_event(self, event: ModelEvent) -> None:
        self._check_alive(event, "synchronize")
        self.trace.host_waits_for(event.record)

    def _destroy_event(self, event: ModelEvent) -> None:
        self._check_alive(event, "destroy")
        event.destroyed = True

    def _memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.trace.queue(
            Kind.DMA,
            stream,
            job=self._job,
            accesses=[
                self._access(src, nbytes, write=False),
                self._access(dst, nbytes, write=True),
            ],
        )
        super()._memcpy(dst, src, nbytes, stream)

    def _copy_table(self, dst: int, src: int, count: int, stream: int) -> None:
        # it reads the slot's ref table and the job's tables: two host writes
        ref_bytes = self._planner.ref_table.nbytes
        reads = [self._access(src, ref_bytes, write=False)]
        if 8 * count > ref_bytes:
            reads.append(self._access(src + ref_bytes, 8 * count - ref_bytes, write=False))
        self.trace.queue(
            Kind.UPLOAD,
            stream,
            job=self._job,
            label="upload",
            accesses=[*reads, self._access(dst, 8 * count, write=True)],
        )
        super()._copy_table(dst, src, count, stream)

    def _stage_copy(
        self,
        stream: int,
        segments: int,
        count: int,
        stage: int,
        blocks: int,
        *,
        refs: int,
        ids: int,
        to_stage: bool,
    ) -> None:
        # what the kernel reads: the whole ref table, its slice lines, and the block ids they
        # span (the lines are in memory already: the host wrote them, and the upload copied
        # them, before the launch)
        line_bytes = len(SLICE_FIELDS) * 8
        lines = np.ctypeslib.as_array(
            (ctypes.c_int64 * (count * len(SLICE_FIELDS))).from_address(segments)
        ).reshape(count, len(SLICE_FIELDS))
        fields = dict(zip(SLICE_FIELDS, lines.T, strict=True))
        first_id, end_id = 0, 0
        if count:
            first_id = int(fields["id_offset"].min())
            end_id = int((fields["id_offset"] + fields["count"]).max())
        self.trace.queue(
            Kind.KERNEL,
            stream,
            job=self._job,
            label="gather" if to_stage else "scatter",
            accesses=[
                self._access(stage, 1, write=to_stage),
                self._access(refs, self._planner.ref_table.nbytes, write=False),
                self._access(ids + 8 * first_id, 8 * (end_id - first_id), write=False),
                self._access(segments, count * line_bytes, write=False),
            ],
        )
        super()._stage_copy(
            stream, segments, count, stage, blocks, refs=refs, ids=ids, to_stage=to_stage
        )


# --- the hazards -----------------------------------------------------------------------------


def unordered_conflicts(ops: Iterable[Op], kind: str) -> list[tuple[Op, Op]]:
    """Return the pairs (earlier, later) of ops touching memory of `kind` ("stage", "pinned",
    "tables") in a conflicting way that happens-before leaves unordered."""
    touching: dict[tuple[Any, ...], list[tuple[Op, Access]]] = defaultdict(list)
    for op in ops:
        for access in op.accesses:
            if access.resource[0] == kind:
                touching[access.resource].append((op, access))
    found = []
    for pairs in touching.values():
        for i, (a, x) in enumerate(pairs):
            for b, y in pairs[i + 1 :]:
                if a is not b and x.conflicts(y) and not happens_before(a, b):
                    found.append((a, b))
    return found
