"""The staged copy path both GPU executors share: batches through a double-buffered staging buffer.

A store gathers a batch's pages into staging with one kernel launch (the page addresses are
computed on the GPU from a few lines of a slice table and the layout's ref table), then copies
the staging to the tier in one DMA per contiguous range of rows; a load does the reverse. Each
direction has two *lanes*, each a stream that owns one staging half, and its batches take them
in turn (across jobs too), so stream order alone keeps a half from being reused too early, and
the kernel of one batch overlaps the DMA of the previous one on the other lane. A batch costs
two host calls (a launch and a DMA) and no event. A backend supplies its library's streams,
memory and compiled kernel; a job's calls go to the CUDA driver from one compiled call.
"""

from __future__ import annotations

import abc
import ctypes
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import attrs
import numpy as np

from kvferry.core.arrays import IdArray
from kvferry.core.bound import BoundPlan
from kvferry.core.plan import Direction
from kvferry.executors.base import CopyPath, Executor
from kvferry.executors.driver import CudaDriver, DriverBindings, check_status
from kvferry.executors.jobcode import Submitter
from kvferry.executors.kernels import (
    PIECE_BYTES,
    STAGE_COPY_NAME,
    STAGE_COPY_SOURCE,
    TABLE_COPY_NAME,
    TABLE_COPY_SOURCE,
    THREADS,
    WARPS,
)
from kvferry.executors.staging import StagePlanner
from kvferry.executors.tensors import KVCacheEntry

DEFAULT_STAGING_BYTES = 256 << 20
"""GPU staging per direction (two halves) unless told otherwise. Each batch costs a few host
calls; on an NVIDIA H200, 256 MiB gave 0.90-0.96 of the link where 128 MiB gave 0.90-0.95 and
half the submit time went to per-batch calls."""

TABLE_SLOTS = 4
"""Pinned table buffers per direction, taken by jobs in turn (see `_free_slot`)."""

STAGE_COPY_ARGUMENTS = (
    ctypes.c_uint64,  # slice lines
    ctypes.c_int,  # their count
    ctypes.c_uint64,  # ref table
    ctypes.c_uint64,  # block ids
    ctypes.c_uint64,  # staging half
    ctypes.c_int,  # to_stage
    ctypes.c_int,  # piece bytes
)
"""The C types of `kernels.STAGE_COPY_SOURCE`'s parameters, in order, as the job code passes
them."""
TABLE_COPY_ARGUMENTS = (ctypes.c_uint64, ctypes.c_uint64, ctypes.c_longlong)
"""The same for `kernels.TABLE_COPY_SOURCE` (source, destination, int64 count)."""

DEFAULT_COPY_BLOCKS = 512
"""Thread blocks of a staging kernel launch at most (about four per SM of an H200). Alone, 128
reach HBM speed already; beside a model whose kernels hold every SM's registers, a staging
kernel runs only in the gaps between them, and more blocks move more bytes per gap: on the
NVIDIA H200, 512 blocks slowed a matmul by +3.7..4.8 % where 128 slowed it by +5.8..6.5 %, about
what the least any staged path does costs there."""

StageCopy = Callable[[int, int, int, int, int], int | None]
"""One job's staging-kernel launch as a callable: `(stream, segments, count, stage, blocks)` runs
the kernel on raw stream `stream` over the `count` slice lines at address `segments`, with
staging half `stage`, on `blocks` thread blocks. Like every driver call given as a callable, it
returns None (or 0) when made, or a CUDA error status, which stops the job and names the
call."""

NativeLaunch = tuple[int, int, int, int, int, bool, int]
"""One job's staging-kernel launch for the compiled job code to make itself: the address of
`cuLaunchKernel`, the kernel's `CUfunction`, threads per block, and the job's constant kernel
parameters (ref table address, block ids address, to_stage, piece bytes)."""

StageKernel = StageCopy | NativeLaunch
"""What `StagedGpuExecutor._stage_kernel` returns: either form serves the compiled route, the
callable the Python route."""

Dma = Callable[[int, int, int, int], int | None] | int
"""`(dst, src, nbytes, stream)` queues one copy between unified addresses (pinned host or
device) on raw stream `stream`; or, for the compiled job code to call, the address of a
function of `cuMemcpyAsync`'s signature."""

Record = Callable[[Any, int], int | None] | int
"""`(event, stream)` records `event` on raw stream `stream`; or the address of `cuEventRecord`."""

Wait = Callable[[int, Any], int | None] | int
"""`(stream, event)` makes raw stream `stream` wait for `event`'s last record; or the address
of `cuStreamWaitEvent`."""

DriverCalls = tuple[Record, Wait, Dma]
"""How the job code records events, makes streams wait and queues DMAs
(`StagedGpuExecutor._driver_calls`); the Python route takes callables only."""

TableCopy = Callable[[int, int, int, int], int | None] | tuple[int, int, int, int]
"""`(dst, src, count, stream)` copies `count` int64 from pinned `src` to GPU `dst`; or, for the
compiled job code to launch `kernels.TABLE_COPY_SOURCE` itself, the address of
`cuLaunchKernel`, the kernel's `CUfunction`, threads per block and the most blocks (it takes one
per `threads` values)."""


@attrs.define
class GpuJob:
    """One queued transfer: its timing events, what must outlive it, and the path it took."""

    start: Any
    end: Any
    keep: list[Any]
    path: CopyPath
    batches: int = 0
    """Staging batches of a staged job (0 on another path)."""
    finished: bool = False
    """Whether the host saw it end and gave its events to later jobs (`_finish`): from then on
    nothing waits on them for this job."""
    ticket: int = 0
    """With a submission thread: the number of the ticket that makes the job's calls, until the
    host knows it was made (0: none, or made). CUDA reports an event that was never recorded as
    complete, so nothing may ask the job's events anything before."""
    ready: Any = None
    """With a submission thread: the job's own `ready` event, recorded on the compute stream by
    `submit()`, until the ticket (which waits on it) is made; then it goes back to the pool."""


class StagedGpuExecutor(Executor):
    """An executor whose transfers go through GPU staging; subclasses bind a CUDA library.

    Every job first waits, with an event, on the compute stream (the one given at construction,
    else the current stream at submit time), so it sees the bytes queued compute writes; it
    writes the tier or KV blocks, and ends, only after the previous job of its direction has
    ended, so one direction's writes land in submission order (a staged job prepares its first
    batch before that: `_enqueue_staged`). Staging is two halves of `staging_bytes // 2` per
    direction (at least one row each), allocated on first use. The library owns streams, memory
    and the compiled kernel; a job's calls (events, DMAs, launches) go to the CUDA driver
    (`executors.driver`), on integer handles.

    With `submit_thread` (the default), a common staged job's calls after its `ready` record are
    made by a thread of the executor's own (the route's `Submitter`), so `submit()` returns once
    the job is planned, its tables written and `ready` recorded: see docs/executors.md, "The
    submission thread".

    `route` picks the code that makes each job's host work (`executors.jobcode`): `"native"`
    (the compiled module), `"python"` (numpy and `cuda-bindings`), or None for the compiled
    module where it is built. Both make the same driver calls and write the same tables.
    """

    min_table_values = 1 << 16
    """int64 values a table slot (and its GPU tables) holds at least (512 KiB); a job that needs
    more grows them."""

    def __init__(
        self,
        *,
        kv_caches: Sequence[Sequence[KVCacheEntry]],
        blocks_per_chunk: int,
        num_rows: int | Sequence[int],
        staging_bytes: int,
        copy_blocks: int,
        kernel_priority: int = 0,
        submit_thread: bool = True,
        route: str | None = None,
    ) -> None:
        super().__init__(
            kv_caches=kv_caches, blocks_per_chunk=blocks_per_chunk, num_rows=num_rows, route=route
        )
        self._submit_thread = submit_thread
        self._submitter: Submitter | None = None
        """The submission thread, started at the first staged job when `submit_thread`."""
        self._half_bytes = max(staging_bytes // 2, self.layout.largest_row_bytes)
        self._copy_blocks = copy_blocks
        self._planner = StagePlanner(
            self.layout,
            capacity=self._half_bytes,
            piece_bytes=PIECE_BYTES,
            tier=self.host_tier.tier,
            # a tier pinned in one piece per group has no registration boundary to respect
            rows_per_piece=(
                ()
                if len(self.host_tier.pieces) == self.layout.num_groups
                else [self.host_tier.rows_per_piece(g) for g in range(self.layout.num_groups)]
            ),
            code=self._code,
        )
        self._bindings: DriverBindings | None = None
        """The Python route's per-job driver calls (`cuda-bindings`), made at first use."""
        self._driver: CudaDriver | None = None
        self._functions: dict[str, int] = {}
        """The `CUfunction` of each kernel compiled so far, by name."""
        with self._on_device():
            self._lanes = {
                d: (
                    self._new_stream(priority=kernel_priority),
                    self._new_stream(priority=kernel_priority),
                )
                for d in Direction
            }
            # events re-recorded by every job: a wait sees the record made before it, so one of
            # each per direction is enough
            self._ready = {d: self._new_event() for d in Direction}
            self._joined = {d: self._new_event() for d in Direction}
            self._uploaded = {d: self._new_event() for d in Direction}
        self._lane_handles = {
            d: (self._stream_handle(pair[0]), self._stream_handle(pair[1]))
            for d, pair in self._lanes.items()
        }
        self._last_job: dict[Direction, GpuJob] = {}
        """The job each direction queued last: the next one waits for its end event."""
        self._next_lane: dict[Direction, int] = {}
        """The lane (and staging half) the direction's next batch runs on: a job starts on the
        lane after its previous job's last batch (see `_enqueue_staged`)."""
        self._spare_events: list[Any] = []
        """Timing events of finished jobs, for the next jobs (creating one is a driver call)."""
        self._spare_ready: list[Any] = []
        """`ready` events of jobs whose tickets were made (`GpuJob.ready`), for the next ones."""
        self._staging: dict[Direction, tuple[list[Any], tuple[int, int]]] = {}
        self._tables: dict[Direction, list[_TableSlot]] = {}
        self._next_slot: dict[Direction, int] = {}
        self._constants: dict[Direction, tuple[Any, ...]] = {}
        """Per direction, what no job changes, as the job code's `stage_job` takes it
        (`_job_constants`)."""

    # --- what a CUDA library provides ----------------------------------------------------------

    @abc.abstractmethod
    def _on_device(self) -> AbstractContextManager[Any]:
        """Return a context that makes the KV tensors' device (and its context) current."""

    @abc.abstractmethod
    def _compute_stream_now(self) -> int:
        """Return the raw stream a job must wait on: the configured compute one or the current."""

    @abc.abstractmethod
    def _allocate(self, nbytes: int) -> Any:
        """Return a new GPU byte buffer of `nbytes`."""

    @abc.abstractmethod
    def _allocate_pinned(self, count: int) -> tuple[Any, IdArray]:
        """Return a pinned host buffer of `count` int64 (the owner) and a numpy view of it."""

    @abc.abstractmethod
    def _address(self, buffer: Any) -> int:
        """Return the device address of a GPU buffer's first byte."""

    @abc.abstractmethod
    def _kernel_function(self, source: str, name: str) -> Any:
        """Return the `CUfunction` of kernel `name` in CUDA C `source` (compiled here: the
        executor asks once per kernel)."""

    # --- the job's calls, through the CUDA driver -----------------------------------------------

    def _cuda(self) -> CudaDriver:
        if self._driver is None:
            self._driver = CudaDriver()
        return self._driver

    def _calls(self) -> DriverBindings:
        """Return the Python route's per-job driver calls (through `cuda-bindings`)."""
        if self._bindings is None:
            self._bindings = DriverBindings()
        return self._bindings

    def _thread_context(self) -> tuple[Any, int]:
        """Return what a submission thread calls, once, to make the executor's CUDA context
        current, and that context (read on the device): `cuCtxSetCurrent`, by address for the
        compiled route, as a callable for the Python route."""
        cuda = self._cuda()
        if self.route == "native":
            return cuda.set_context_address, cuda.current_context()
        return self._calls().set_context, cuda.current_context()

    def _new_stream(self, *, priority: int = 0) -> Any:
        """Return a new non-blocking stream of the executor's own on its device (current in
        `_on_device`); `priority` as CUDA counts it (lower is more urgent, 0 the default).

        Made through the driver, not the library: torch hands out its streams from a pool
        shared with the engine (`CudaDriver.stream`)."""
        return self._cuda().stream(priority=priority)

    def _stream_handle(self, stream: Any) -> int:
        """Return the raw `CUstream` of a stream made by `_new_stream`."""
        return int(stream)

    def _synchronize(self, stream: Any) -> None:
        """Block until a stream made by `_new_stream` is idle."""
        self._cuda().synchronize_stream(stream)

    def _destroy_stream(self, stream: Any) -> None:
        """Release a stream made by `_new_stream`."""
        self._cuda().destroy_stream(stream)

    def _new_event(self, *, timing: bool = False) -> Any:
        """Return a new event (with timing when asked)."""
        return self._cuda().event(timing=timing)

    def _event_done(self, event: Any) -> bool:
        """Return True once `event` has completed."""
        return self._cuda().done(event)

    def _elapsed(self, start: Any, end: Any) -> float:
        """Block until `end`; return the seconds from `start` to `end`."""
        return self._cuda().elapsed(start, end)

    def _synchronize_event(self, event: Any) -> None:
        """Block until `event` has completed."""
        self._cuda().synchronize(event)

    def _destroy_event(self, event: Any) -> None:
        """Release an event made by `_new_event`."""
        self._cuda().destroy(event)

    def _driver_calls(self) -> DriverCalls:
        """Return how the job code records events, makes streams wait and queues DMAs
        (`DriverCalls`): the driver's own functions, by address for the compiled route, through
        `cuda-bindings` for the Python route."""
        if self.route == "native":
            cuda = self._cuda()
            return (cuda.record_address, cuda.wait_address, cuda.memcpy_address)
        calls = self._calls()
        return (calls.record, calls.wait, calls.copy)

    def _stage_kernel(self, *, refs: int, ids: int, to_stage: bool) -> StageKernel:
        """Return one job's launch of `kernels.STAGE_COPY_SOURCE` (`StageKernel`), gathering into
        staging when `to_stage` (else scattering from it), with the ref table at `refs` and the
        block ids at `ids`: the driver's `cuLaunchKernel` with the kernel's parameters in
        `STAGE_COPY_ARGUMENTS`' order, called from the compiled job code by address (a
        `NativeLaunch`) or, for the Python route, through `cuda-bindings` (a `StageCopy`)."""
        function = self._function(STAGE_COPY_SOURCE, STAGE_COPY_NAME)
        if self.route == "native":
            launch = self._cuda().launch_address
            return (launch, function, THREADS, refs, ids, to_stage, PIECE_BYTES)
        return self._calls().stage_copy(
            function, THREADS, refs=refs, ids=ids, to_stage=to_stage, piece=PIECE_BYTES
        )

    def _table_copy(self) -> TableCopy:
        """Return how the job code copies a job's tables to the GPU (`TableCopy`; see
        `_enqueue_staged`): a launch of `kernels.TABLE_COPY_SOURCE`, its parameters in
        `TABLE_COPY_ARGUMENTS`' order, one block per `THREADS` values, at most `copy_blocks`;
        by address for the compiled route, through `cuda-bindings` for the Python route."""
        function = self._function(TABLE_COPY_SOURCE, TABLE_COPY_NAME)
        if self.route == "native":
            return (self._cuda().launch_address, function, THREADS, self._copy_blocks)
        return self._calls().table_copy(function, THREADS, self._copy_blocks)

    def _function(self, source: str, name: str) -> int:
        """Return the `CUfunction` of kernel `name` as an integer (compiled on first use)."""
        function = self._functions.get(name)
        if function is None:
            compiled = self._kernel_function(source, name)
            # a CUfunction as an int (CuPy) or already a c_void_p (torch)
            function = self._functions[name] = int(getattr(compiled, "value", compiled) or 0)
        return function

    # --- the shared path -------------------------------------------------------------------------

    def _stages(self, direction: Direction) -> tuple[int, int]:
        """Return the addresses of the direction's two staging halves (allocated on first use)."""
        if direction not in self._staging:
            halves = [self._allocate(self._half_bytes) for _ in range(2)]
            self._staging[direction] = (
                halves,
                (self._address(halves[0]), self._address(halves[1])),
            )
        return self._staging[direction][1]

    def _new_job(self, direction: Direction, path: CopyPath) -> tuple[GpuJob, Any]:
        """Return a new job of `direction` (its timing events from finished jobs where there are
        some) and the end event of the direction's previous job, None when the host saw that
        one finish (it has ended: nothing needs to wait for it)."""
        spare = self._spare_events
        job = GpuJob(
            start=spare.pop() if spare else self._new_event(timing=True),
            end=spare.pop() if spare else self._new_event(timing=True),
            keep=[],
            path=path,
        )
        previous = self._last_job.get(direction)
        if previous is None or previous.finished:
            return job, None
        return job, previous.end

    def _begin(self, direction: Direction, path: CopyPath) -> GpuJob:
        """Return a new job of `direction` whose first lane waits on compute and on the previous
        job, its start recorded there (for a path that queues its own work; the staged path's
        the job code's `queue_job` makes these calls itself)."""
        self._drain()  # the thread's jobs first: these calls go to the same lanes
        job, previous = self._new_job(direction, path)
        failed = self._code.begin_job(
            self._driver_calls(),
            self._lane_handles[direction],
            self._compute_stream_now(),
            self._ready[direction],
            previous,
            job.start,
        )
        if failed:
            check_status(*failed)
        return job

    def _end(self, direction: Direction, job: GpuJob, batches: int) -> None:
        """Record the job's end on the lane of its last batch (batch k runs on lane k % 2; a job
        of no batch ends on the first), after the other lane's work when it has some; the next
        job of the direction waits for it."""
        failed = self._code.end_job(
            self._driver_calls(),
            self._lane_handles[direction],
            batches,
            self._joined[direction],
            job.end,
        )
        if failed:
            check_status(*failed)
        self._last_job[direction] = job
        self._next_lane[direction] = batches % 2

    def _enqueue_staged(self, bound: BoundPlan) -> GpuJob:
        """Queue a staged transfer; return its job.

        The job's tables go to the GPU first (`_new_slot`), on its first lane, after that lane
        waited for compute. Batch k runs on the direction's lane `(first + k) % 2` with that
        lane's staging half, where `first` is the lane after the previous job's last batch: a
        store gathers the batch's pages into the half with one kernel launch and then copies
        the half out with the batch's link copies; a load copies in, then scatters. The second
        lane starts after the upload. The launch takes one block per `WARPS` kernel pieces, at
        most `copy_blocks`. Then `_end`'s calls.

        The job waits for the previous job of its direction (its end event) only on its first
        lane, just before it first writes what that job may also write (a store's first DMA to
        the tier, a load's first scatter), so the upload and the first gather or DMA into
        staging overlap the previous job's last batch, on the other lane: its work and theirs
        then touch different halves and tables, and beside a model's kernels, which keep the
        staging kernels waiting for SMs, the link no longer idles between jobs. Every later op
        follows the previous job in stream order or through the upload's event.

        The common job (its rows one consecutive run, every group it moves filling its rows,
        and for a store whole chunks of unpadded pages) is planned, written to its table slot
        and queued by one call of the job code, `stage_job`; any other takes `_queue_planned`,
        the same steps one by one, which are that call's specification. Right after a `wait()`
        the Python between those steps cost most of a 2048-block load's submit, cold, which is
        why the compiled route makes them in one C call.
        """
        direction = bound.plan.direction
        k, slot = self._free_slot(direction)
        job, previous = self._new_job(direction, CopyPath.STAGED)
        first = self._next_lane.get(direction, 0)
        compute = self._compute_stream_now()
        batches = self._queue_compiled(bound, slot, job, previous, first=first, compute=compute)
        if batches < 0:
            slot, batches = self._queue_planned(
                bound, k, job, previous, first=first, compute=compute
            )
        job.batches = batches
        self._last_job[direction] = job
        self._next_lane[direction] = (first + batches) % 2
        slot.job = job  # its end comes after the upload that read the slot
        return job

    def _queue_compiled(
        self,
        bound: BoundPlan,
        slot: _TableSlot,
        job: GpuJob,
        previous: Any,
        *,
        first: int,
        compute: int,
    ) -> int:
        """Plan `bound`, write its tables to the direction's free `slot` and queue it as `job` from
        lane `first`, after `previous` (an end event, or None) and the work queued on raw stream
        `compute`, in one call of the job code (`stage_job`); return the job's batches, or -1,
        having written and queued nothing, for a job that call does not cover (see
        `_enqueue_staged`) or one whose tables do not fit the slot."""
        direction = bound.plan.direction
        plan = bound.plan
        submitter = self._submitter_now()
        ready = None
        if submitter is not None:  # the job's own: see GpuJob.ready
            ready = self._spare_ready.pop() if self._spare_ready else self._new_event()
        batches, failed = self._code.stage_job(
            self._constants.get(direction) or self._job_constants(direction),
            first,
            compute,
            previous,
            job.start,
            job.end,
            slot.job_tables,
            plan.gpu_block_ids,
            bound.cpu_rows,
            plan.group_sizes,
            plan.block_indices,
            submitter,
            ready,
        )
        if submitter is not None:
            if batches >= 0 and not failed:
                job.ticket, job.ready = submitter.pushed, ready
            else:  # declined, or its record failed: no ticket waits on it
                self._spare_ready.append(ready)
        if failed:
            check_status(*failed)
        return batches

    def _queue_planned(
        self, bound: BoundPlan, k: int, job: GpuJob, previous: Any, *, first: int, compute: int
    ) -> tuple[_TableSlot, int]:
        """Plan `bound` (`StagePlanner.plan`), write its tables to the direction's free slot `k`
        (`_write_tables`) and queue it as `job` from lane `first` (the job code's `queue_job`),
        after `previous` (an end event, or None) and the work queued on raw stream `compute`;
        return the slot and the job's batches. What `stage_job` does in one call for the common
        job, step by step, for every job (on the submitting thread, after the submission
        thread's jobs)."""
        self._drain()
        direction = bound.plan.direction
        plan = self._planner.plan(bound)
        ids = np.asarray(bound.plan.gpu_block_ids, np.int64)
        slot = self._write_tables(direction, k, ids, plan.table)
        values = self._planner.ref_table.size + len(ids) + plan.table.size
        refs = slot.tables_address
        ids_address = refs + self._planner.ref_table.nbytes
        store = direction is Direction.STORE
        lanes, stages = self._lane_handles[direction], self._stages(direction)
        if first:
            lanes, stages = (lanes[1], lanes[0]), (stages[1], stages[0])
        failed = self._code.queue_job(
            self._driver_calls(),
            lanes,
            compute,
            (
                self._ready[direction],
                previous,
                job.start,
                self._uploaded[direction],
                self._joined[direction],
                job.end,
            ),
            (self._table_copy(), refs, slot.address, values),
            slot.kernel,
            (
                stages,
                self.host_tier.address,
                store,
                ids_address + 8 * len(ids),
                plan.table.shape[1] * 8,
                self._copy_blocks,
                WARPS,
                plan.items,
                plan.line_bounds,
                plan.link_bounds,
                plan.link_src,
                plan.link_dst,
                plan.link_size,
            ),
        )
        if failed:
            check_status(*failed)
        return slot, len(plan)

    def _job_constants(self, direction: Direction) -> tuple[Any, ...]:
        """Return (and keep) what the job code's `stage_job` needs of the direction that no job
        changes: the driver calls, lanes, staging halves, the direction's events, the table
        copy, the tier, the kernel's block limits and the planner's layout constants
        (`StagePlanner.job_constants`). Built at the direction's first staged job, so the
        driver calls are read then."""
        constants = self._constants[direction] = (
            self._driver_calls(),
            self._lane_handles[direction],
            self._stages(direction),
            (self._ready[direction], self._uploaded[direction], self._joined[direction]),
            self._table_copy(),
            self.host_tier.address,
            direction is Direction.STORE,
            self._copy_blocks,
            WARPS,
            self._planner.job_constants,
        )
        return constants

    def _free_slot(self, direction: Direction) -> tuple[int, _TableSlot]:
        """Return the direction's next table slot and its index, once no job in flight reads it.

        Jobs take the `TABLE_SLOTS` slots in turn; a slot is written again only once the job
        that last used it has ended (its end event, unless the host saw it finish; with a few
        jobs in flight, long since)."""
        slots = self._tables.get(direction)
        if slots is None:  # all at once: no allocation once jobs flow
            slots = self._tables[direction] = [
                self._new_slot(direction, 0) for _ in range(TABLE_SLOTS)
            ]
        k = self._next_slot.get(direction, 0)
        self._next_slot[direction] = (k + 1) % TABLE_SLOTS
        slot = slots[k]
        if slot.job is not None and not slot.job.finished:
            if slot.job.ticket and self._submitter is not None:
                self._submitter.wait(slot.job.ticket)  # its failure stays for its job's report
            self._synchronize_event(slot.job.end)
        slot.job = None
        return k, slot

    def _write_tables(
        self, direction: Direction, k: int, ids: IdArray, table: IdArray
    ) -> _TableSlot:
        """Write `ids` and the slice `table` (int64) after the ref table into the direction's
        free slot `k` (`_free_slot`), first replacing it with a larger one when they do not
        fit, and return the slot (the job copies it to the slot's GPU tables, `_new_slot`)."""
        refs = self._planner.ref_table.size
        end = refs + len(ids) + table.size
        slot = self._tables[direction][k]
        if slot.capacity < end:
            slot = self._tables[direction][k] = self._new_slot(direction, end)
        slot.view[refs : refs + len(ids)] = ids
        slot.view[refs + len(ids) : end] = table.ravel()
        return slot

    def _new_slot(self, direction: Direction, values: int) -> _TableSlot:
        """Return a new table slot of `direction` of at least `values` int64, the ref table
        written in, with GPU tables of the same size, where its jobs copy it.

        The kernels read their tables from GPU memory: read from pinned memory, every warp's
        lookups would cross the link, which is busy with the job's own DMAs (a store's 4 KiB
        pages ran at 0.90-0.95 of the link that way, 0.97-0.99 from a GPU copy). The copy is a
        kernel (`_table_copy`), not a DMA: a host-to-device DMA queues on the copy engines
        behind the load DMAs in flight, which held stores back when both directions ran. Each
        slot has GPU tables of its own, so a job's upload never overwrites tables that a job
        still in flight reads: the slot, and so its GPU tables, is taken again only once its
        last job has ended (`_free_slot`).
        """
        capacity = max(values, self.min_table_values)
        host, view = self._allocate_pinned(capacity)
        refs = self._planner.ref_table.ravel()
        view[: len(refs)] = refs
        tables = self._allocate(capacity * 8)
        address, tables_address = int(view.ctypes.data), self._address(tables)
        kernel = self._stage_kernel(
            refs=tables_address,
            ids=tables_address + refs.nbytes,
            to_stage=direction is Direction.STORE,
        )
        return _TableSlot(
            host=host,
            view=view,
            address=address,
            capacity=capacity,
            tables=tables,
            tables_address=tables_address,
            kernel=kernel,
            job_tables=(view, address, tables_address, kernel),
        )

    def _done(self, handle: GpuJob) -> bool:
        if handle.ticket and not self._ticket_made(handle, block=False):
            return False
        return self._event_done(handle.end)

    def _finish(self, handle: GpuJob) -> float:
        try:
            if handle.ticket:
                self._ticket_made(handle, block=True)
            return self._elapsed(handle.start, handle.end)
        finally:  # both have completed: the next jobs may record them again
            handle.finished = True
            self._spare_events += (handle.start, handle.end)

    # --- the submission thread -----------------------------------------------------------------

    def _submitter_now(self) -> Submitter | None:
        """Return the submission thread (started now, on the device, at the first call), or
        None without `submit_thread`."""
        if self._submitter is None and self._submit_thread:
            self._submitter = self._code.Submitter(*self._thread_context())
        return self._submitter

    def _drain(self) -> None:
        """Block until the submission thread has made every job's calls handed to it."""
        if self._submitter is not None:
            self._submitter.drain()

    def _ticket_made(self, job: GpuJob, *, block: bool) -> bool:
        """Return whether the submission thread has made `job`'s calls (waiting for that when
        `block`); once it has, forget the ticket, raising RuntimeError if its calls failed."""
        submitter = self._submitter
        if submitter is None:  # released, which made every ticket first
            return True
        if block:
            submitter.wait(job.ticket)
        elif not submitter.finished(job.ticket):
            return False
        failure = submitter.failure(job.ticket)
        job.ticket = 0
        if job.ready is not None:  # the ticket's wait on it is made: a new record cannot move it
            self._spare_ready.append(job.ready)
            job.ready = None
        if failure is not None:
            status, what = failure
            if status < 0:  # an exception of a callable driver (CPU tests)
                raise RuntimeError(what)
            check_status(status, what)
        return True

    def _release(self) -> None:
        if self._submitter is not None:
            self._submitter.close()  # every ticket made: the streams then hold all the work
            self._submitter = None
        for pair in self._lanes.values():
            for stream in pair:
                self._synchronize(stream)
                self._destroy_stream(stream)
        for event in (
            *self._ready.values(),
            *self._joined.values(),
            *self._uploaded.values(),
            *self._spare_events,
            *self._spare_ready,
        ):
            self._destroy_event(event)
        self._spare_events.clear()
        self._spare_ready.clear()
        self._last_job.clear()
        self._staging.clear()
        self._tables.clear()
        self._constants.clear()
        self._next_lane.clear()


@attrs.define(kw_only=True)
class _TableSlot:
    """A pinned buffer for a job's tables: the ref table, then its block ids and slice table."""

    host: Any
    """Owner of the pinned buffer."""
    view: IdArray
    """The buffer as numpy."""
    address: int
    """Its address, which the table-copy kernel reads (pinned memory is mapped for the GPU)."""
    capacity: int
    """int64 values it holds."""
    tables: Any
    """The GPU buffer of as many int64 that its jobs copy it to, which their kernels read."""
    tables_address: int
    """That buffer's address."""
    kernel: StageKernel
    """The staging kernel of the slot's jobs, which read their tables there (`_stage_kernel`)."""
    job_tables: tuple[IdArray, int, int, StageKernel]
    """`(view, address, tables_address, kernel)`, as the job code's `stage_job` takes the
    slot."""
    job: GpuJob | None = None
    """The last job that read it, until the host knows that job ended."""
