"""The staged copy path both GPU executors share: batches through a double-buffered staging buffer.

A store gathers a batch's pages into staging with one kernel launch (the page addresses are
computed on the GPU from a small segment table), then copies the staging to the tier in one DMA
per contiguous range of rows; a load does the reverse. Each direction has a link stream (DMAs), a
work stream (kernels) and two staging halves, so the kernel of one batch overlaps the DMA of the
next. A backend supplies only its library's streams, events, uploads, DMAs and kernel launch.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import attrs
import numpy as np

from kvferry.core.arrays import IdArray
from kvferry.core.bound import BoundPlan
from kvferry.core.plan import Direction
from kvferry.executors.base import CopyPath, Executor
from kvferry.executors.kernels import PIECE_BYTES, WARPS
from kvferry.executors.staging import StageBatch, StagePlanner
from kvferry.executors.tensors import KVTensor

DEFAULT_STAGING_BYTES = 256 << 20
"""GPU staging per direction (two halves) unless told otherwise. Each batch costs a few host
calls; on the device H200, 256 MiB gave 0.90-0.96 of the link where 128 MiB gave 0.90-0.95 and
half the submit time went to per-batch calls (docs/benchmarks.md)."""

DEFAULT_COPY_BLOCKS = 128
"""Thread blocks of a staging kernel launch: enough for HBM speed, far fewer than a full GPU."""


@attrs.define
class GpuJob:
    """One queued transfer: its timing events, what must outlive it, and the path it took."""

    start: Any
    end: Any
    keep: list[Any]
    path: CopyPath


class StagedGpuExecutor(Executor):
    """An executor whose transfers go through GPU staging; subclasses bind a CUDA library.

    Every job first waits, with an event, on the compute stream (the one given at construction,
    else the current stream at submit time), so it sees the bytes queued compute writes, and on
    the previous job of its direction, so one direction runs in submission order. Staging is two
    halves of `staging_bytes // 2` per direction (at least one row each), allocated on first use.
    """

    def __init__(
        self,
        *,
        kv_caches: Sequence[Sequence[KVTensor]],
        blocks_per_chunk: int,
        num_rows: int,
        staging_bytes: int,
        copy_blocks: int,
    ) -> None:
        super().__init__(kv_caches=kv_caches, blocks_per_chunk=blocks_per_chunk, num_rows=num_rows)
        self._half_bytes = max(staging_bytes // 2, self.layout.row_bytes)
        self._copy_blocks = copy_blocks
        self._planner = StagePlanner(
            self.layout,
            capacity=self._half_bytes,
            piece_bytes=PIECE_BYTES,
            tier_piece_bytes=self.host_tier.piece_bytes,
        )
        with self._on_device():
            self._link = {d: self._new_stream() for d in Direction}
            self._work = {d: self._new_stream() for d in Direction}
            # events re-recorded by every batch: a wait sees the record before it, so one
            # `done` per direction and one `released` per staging half are enough
            self._done_event = {d: self._new_event() for d in Direction}
            self._released = {d: (self._new_event(), self._new_event()) for d in Direction}
            self._ready = {d: self._new_event() for d in Direction}
        self._last_end: dict[Direction, Any] = {}
        self._staging: dict[Direction, list[Any]] = {}

    # --- what a CUDA library provides ----------------------------------------------------------

    @abc.abstractmethod
    def _on_device(self) -> AbstractContextManager[Any]:
        """Return a context that makes the KV tensors' device current."""

    @abc.abstractmethod
    def _new_stream(self) -> Any:
        """Return a new non-blocking stream on the executor's device."""

    @abc.abstractmethod
    def _new_event(self, *, timing: bool = False) -> Any:
        """Return a new event (with timing when asked)."""

    @abc.abstractmethod
    def _record(self, event: Any, stream: Any) -> None:
        """Record `event` on `stream`."""

    @abc.abstractmethod
    def _wait(self, stream: Any, event: Any) -> None:
        """Make `stream` wait for `event`."""

    @abc.abstractmethod
    def _compute_stream_now(self) -> Any:
        """Return the stream a job must wait on: the configured compute stream or the current."""

    @abc.abstractmethod
    def _allocate(self, nbytes: int) -> Any:
        """Return a new GPU byte buffer of `nbytes`."""

    @abc.abstractmethod
    def _upload(self, values: IdArray, stream: Any, keep: list[Any]) -> Any:
        """Return a GPU int64 buffer holding `values`, copied asynchronously on `stream`
        (whatever must live until the copy ends goes in `keep`)."""

    @abc.abstractmethod
    def _address(self, buffer: Any) -> int:
        """Return the device address of a GPU buffer's first byte."""

    @abc.abstractmethod
    def _launch_stage_copy(
        self,
        stream: Any,
        *,
        segments: int,
        count: int,
        ids: int,
        stage: int,
        to_stage: bool,
        blocks: int,
    ) -> None:
        """Launch `kernels.STAGE_COPY_SOURCE` on `stream` over the `count` segment lines at
        address `segments`, with the block ids at `ids` and the staging half at `stage`."""

    @abc.abstractmethod
    def _memcpy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """Queue one copy between unified addresses (pinned host or device) on `stream`."""

    @abc.abstractmethod
    def _event_done(self, event: Any) -> bool:
        """Return True once `event` has completed."""

    @abc.abstractmethod
    def _elapsed(self, start: Any, end: Any) -> float:
        """Block until `end`; return the seconds from `start` to `end`."""

    @abc.abstractmethod
    def _synchronize(self, stream: Any) -> None:
        """Block until `stream` is idle."""

    # --- the shared path -------------------------------------------------------------------------

    def _stages(self, direction: Direction) -> list[Any]:
        """Return the direction's two staging halves (allocated on first use)."""
        if direction not in self._staging:
            self._staging[direction] = [self._allocate(self._half_bytes) for _ in range(2)]
        return self._staging[direction]

    def _begin(self, direction: Direction, path: CopyPath) -> GpuJob:
        """Return a new job of `direction` whose streams wait on compute and the previous job."""
        link, work = self._link[direction], self._work[direction]
        ready = self._ready[direction]
        self._record(ready, self._compute_stream_now())
        previous = self._last_end.get(direction)
        for stream in (link, work):
            self._wait(stream, ready)
            if previous is not None:
                self._wait(stream, previous)
        job = GpuJob(
            start=self._new_event(timing=True), end=self._new_event(timing=True), keep=[], path=path
        )
        self._record(job.start, link)
        return job

    def _end(self, direction: Direction, job: GpuJob, stream: Any) -> GpuJob:
        self._record(job.end, stream)
        self._last_end[direction] = job.end
        return job

    def _enqueue_staged(self, bound: BoundPlan) -> GpuJob:
        """Queue a staged transfer, double-buffered; return its job."""
        direction = bound.plan.direction
        link, work = self._link[direction], self._work[direction]
        plan = self._planner.plan(bound)
        job = self._begin(direction, CopyPath.STAGED)
        ids = np.asarray(bound.plan.gpu_block_ids, np.int64)
        device_table = self._upload(np.concatenate((ids, plan.table.ravel())), work, job.keep)
        ids_address = self._address(device_table)
        line_bytes = plan.table.shape[1] * 8
        stages = self._stages(direction)
        done, released = self._done_event[direction], self._released[direction]
        for k, batch in enumerate(plan.batches):
            stage = stages[k % 2]
            launch = {
                "segments": ids_address + 8 * len(ids) + line_bytes * batch.first_line,
                "count": len(batch.segments),
                "ids": ids_address,
                "stage": self._address(stage),
                "to_stage": direction is Direction.STORE,
                "blocks": max(1, min(-(-batch.items // WARPS), self._copy_blocks)),
            }
            if direction is Direction.STORE:
                if k >= 2:
                    self._wait(work, released[k % 2])
                self._on_stream(work, launch)
                self._record(done, work)
                self._wait(link, done)
                self._dma(batch, stage, link, to_host=True)
                self._record(released[k % 2], link)
            else:
                if k >= 2:
                    self._wait(link, released[k % 2])
                self._dma(batch, stage, link, to_host=False)
                self._record(done, link)
                self._wait(work, done)
                self._on_stream(work, launch)
                self._record(released[k % 2], work)
        return self._end(direction, job, link if direction is Direction.STORE else work)

    def _dma(self, batch: StageBatch, stage: Any, stream: Any, *, to_host: bool) -> None:
        """Queue the batch's link copies between `stage` and the host tier on `stream`."""
        dma, stage_address, host = batch.dma, self._address(stage), self.host_tier.address
        if to_host:
            sources, targets = (dma.src + stage_address).tolist(), (dma.dst + host).tolist()
        else:
            sources, targets = (dma.src + host).tolist(), (dma.dst + stage_address).tolist()
        for src, dst, size in zip(sources, targets, dma.nbytes.tolist(), strict=True):
            self._memcpy(dst, src, size, stream)

    def _on_stream(self, stream: Any, launch: dict[str, Any]) -> None:
        """Launch the staging kernel on `stream` when the batch has pages to copy."""
        if launch["count"]:
            self._launch_stage_copy(stream, **launch)

    def _done(self, handle: GpuJob) -> bool:
        return self._event_done(handle.end)

    def _finish(self, handle: GpuJob) -> float:
        return self._elapsed(handle.start, handle.end)

    def _release(self) -> None:
        for stream in (*self._link.values(), *self._work.values()):
            self._synchronize(stream)
        self._staging.clear()
