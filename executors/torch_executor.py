"""The `torch` executor: CUDA streams and events through torch; staged copies at link speed.

Imports torch only when built (the `torch` extra). It never decides what to move, never syncs
the engine's compute stream from the host, and never allocates more staging than it was given
(or two rows, when a row is larger than half of it).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import attrs

from kvferry.core.bound import BoundPlan
from kvferry.core.errors import ExecutorUnavailableError
from kvferry.core.expand import PageCopies
from kvferry.core.plan import Direction
from kvferry.executors.base import CopyPath, Executor
from kvferry.executors.host import HostRegistrar
from kvferry.executors.staging import GroupSlice, StageBatch, plan_stages
from kvferry.executors.tensors import KVTensor, RegisteredTensor

DEFAULT_STAGING_BYTES = 256 << 20
"""GPU staging per direction (two halves) unless told otherwise. torch pays ~4 dispatches per
(batch, ref), so fewer, larger batches matter more here than for the CuPy executor."""

_HOST_REGISTER_FLAGS = 1 | 2
"""cudaHostRegisterPortable | cudaHostRegisterMapped."""

_UNIT_DTYPES = {8: "int64", 4: "int32", 2: "int16", 1: "uint8"}


def load_torch() -> Any:
    """Return the torch module, or raise ExecutorUnavailableError naming the extra."""
    try:
        return importlib.import_module("torch")
    except ImportError as error:
        raise ExecutorUnavailableError(
            f"the torch executor needs torch: pip install 'kvferry[torch]' ({error})"
        ) from error


class TorchRegistrar:
    """Pins host memory with `cudaHostRegister` through torch's cudart bindings."""

    def __init__(self, torch: Any) -> None:
        self._cudart = torch.cuda.cudart()

    def register(self, address: int, nbytes: int) -> None:
        """Pin `nbytes` at `address` (portable, mapped); raise ExecutorUnavailableError if not."""
        error = int(self._cudart.cudaHostRegister(address, nbytes, _HOST_REGISTER_FLAGS))
        if error:
            raise ExecutorUnavailableError(
                f"cudaHostRegister of {nbytes} bytes failed with CUDA error {error}"
            )

    def unregister(self, address: int) -> None:
        """Unpin the piece at `address`."""
        self._cudart.cudaHostUnregister(address)


@attrs.define
class _TorchJob:
    start: Any
    end: Any
    keep: list[Any]


def _unit(values: Sequence[int]) -> int:
    """Return the widest element size (8, 4, 2, 1) that divides every value."""
    for unit in (8, 4, 2):
        if all(v % unit == 0 for v in values):
            return unit
    return 1


class TorchExecutor(Executor):
    """Stores: gather pages on the GPU into a staging buffer laid out as CPU rows, then one DMA
    per contiguous CPU range. Loads: the reverse (DMAs in, then a scatter at HBM speed).

    Loads and stores each have a link stream, a work stream and two staging buffers of half
    `staging_bytes` (at least one row each), so gathers and scatters overlap the DMAs. Each job
    first waits, with an event, on the compute stream (the one given at construction, else the
    current stream at submit time), so it sees the bytes queued compute writes, and on the
    previous job of its direction, so one direction runs in submission order.
    """

    name = "torch"

    def __init__(
        self,
        *,
        kv_caches: Sequence[Sequence[KVTensor]],
        blocks_per_chunk: int,
        num_rows: int,
        compute_stream: Any = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ) -> None:
        torch = load_torch()
        if not torch.cuda.is_available():
            raise ExecutorUnavailableError(
                "the torch executor needs a CUDA device; none is visible"
            )
        self._torch = torch
        super().__init__(kv_caches=kv_caches, blocks_per_chunk=blocks_per_chunk, num_rows=num_rows)
        first = next(t.tensor for group in kv_caches for t in group)
        self._device = first.device
        self._compute_stream = compute_stream
        self._streams = {
            Direction.LOAD: torch.cuda.Stream(device=self._device),
            Direction.STORE: torch.cuda.Stream(device=self._device),
        }
        self._work_streams = {
            Direction.LOAD: torch.cuda.Stream(device=self._device),
            Direction.STORE: torch.cuda.Stream(device=self._device),
        }
        self._last_end: dict[Direction, Any] = {}
        self._half_bytes = max(staging_bytes // 2, self.layout.row_bytes)
        self._staging: dict[Direction, list[Any]] = {}
        layout = self.layout
        self._unit = _unit(
            [self.host_tier.row_bytes]
            + [layout.group_row_bytes(g) for g in range(layout.num_groups)]
            + [v for g in layout.groups for r in g.refs for v in (r.page_stride, r.page_bytes)]
            + [v for g in layout.groups for v in g.row_offsets(layout.blocks_per_chunk)]
            + [r.address for g in layout.groups for r in g.refs]
            + [t.tensor.tensor.untyped_storage().data_ptr() for g in self.tensors for t in g]
        )
        self._dtype = getattr(torch, _UNIT_DTYPES[self._unit])
        self._ref_views = [self._views_of(group) for group in self.tensors]
        self._host_bytes = torch.from_numpy(self.host_tier.array)

    def _registrar(self) -> HostRegistrar:
        return TorchRegistrar(self._torch)

    def _views_of(self, group: Sequence[RegisteredTensor]) -> list[Any]:
        """Return one `(num_blocks, page_units)` view per ref, over the tensors' storage."""
        views = []
        for registered in group:
            storage = registered.tensor.tensor.untyped_storage()
            whole = self._torch.empty(0, dtype=self._dtype, device=self._device)
            whole.set_(storage, 0, (storage.nbytes() // self._unit,), (1,))
            for ref in registered.refs:
                offset = ref.address - storage.data_ptr()
                views.append(
                    whole.as_strided(
                        (ref.num_blocks, ref.page_bytes // self._unit),
                        (ref.page_stride // self._unit, 1),
                        offset // self._unit,
                    )
                )
        return views

    def _stages(self, direction: Direction) -> list[Any]:
        """Return the direction's two staging buffers (allocated on first use)."""
        if direction not in self._staging:
            self._staging[direction] = [
                self._torch.empty(self._half_bytes, dtype=self._torch.uint8, device=self._device)
                for _ in range(2)
            ]
        staging: list[Any] = self._staging[direction]
        return staging

    def choose_path(self, pages: PageCopies) -> CopyPath:
        """Return the copy path for one transfer (the torch executor only stages, for now)."""
        return CopyPath.STAGED

    def _enqueue(self, bound: BoundPlan, pages: PageCopies) -> _TorchJob:
        """Queue a staged transfer, double-buffered: while the copy stream moves batch k over
        the link, the work stream gathers batch k+1 (store) or scatters batch k-1 (load)."""
        torch = self._torch
        direction = pages.direction
        link, work = self._streams[direction], self._work_streams[direction]
        compute = self._compute_stream or torch.cuda.current_stream(self._device)
        batches = plan_stages(
            bound,
            pages,
            self.layout,
            capacity=self._half_bytes,
            piece_bytes=self.host_tier.piece_bytes,
            device_copies=False,
        )
        job = _TorchJob(
            start=torch.cuda.Event(enable_timing=True),
            end=torch.cuda.Event(enable_timing=True),
            keep=[],
        )
        ready = torch.cuda.Event()
        ready.record(compute)
        previous = self._last_end.get(direction)
        for stream in (link, work):
            stream.wait_event(ready)
            if previous is not None:
                stream.wait_event(previous)
        job.start.record(link)
        stages = self._stages(direction)
        freed: list[Any] = [None, None]
        for k, batch in enumerate(batches):
            stage = stages[k % 2]
            done = torch.cuda.Event()
            if direction is Direction.STORE:
                if freed[k % 2] is not None:
                    work.wait_event(freed[k % 2])
                with torch.cuda.stream(work):
                    self._gather(batch, stage, job.keep)
                done.record(work)
                link.wait_event(done)
                with torch.cuda.stream(link):
                    self._dma(batch, stage, to_host=True)
                freed[k % 2] = torch.cuda.Event()
                freed[k % 2].record(link)
            else:
                if freed[k % 2] is not None:
                    link.wait_event(freed[k % 2])
                with torch.cuda.stream(link):
                    self._dma(batch, stage, to_host=False)
                done.record(link)
                work.wait_event(done)
                with torch.cuda.stream(work):
                    self._scatter(batch, stage, job.keep)
                freed[k % 2] = torch.cuda.Event()
                freed[k % 2].record(work)
        last = link if direction is Direction.STORE else work
        job.end.record(last)
        self._last_end[direction] = job.end
        return job

    def _ids(self, values: Any, keep: list[Any]) -> Any:
        host = self._torch.from_numpy(values.copy()).pin_memory()
        keep.append(host)
        return host.to(self._device, non_blocking=True)

    def _stage_view(self, stage: Any, piece: GroupSlice, ref_index: int) -> Any:
        f = self.layout.blocks_per_chunk
        group = self.layout.groups[piece.group]
        ref = group.refs[ref_index]
        unit = self._unit
        offset = piece.stage_offset + group.row_offsets(f)[ref_index]
        return stage.view(self._dtype).as_strided(
            (piece.rows, f, ref.page_bytes // unit),
            (self.layout.group_row_bytes(piece.group) // unit, ref.page_stride // unit, 1),
            offset // unit,
        )

    def _gather(self, batch: StageBatch, stage: Any, keep: list[Any]) -> None:
        for piece in batch.groups:
            ids = self._ids(piece.padded_ids, keep)
            for r, pages in enumerate(self._ref_views[piece.group]):
                target = self._stage_view(stage, piece, r)
                target.copy_(pages.index_select(0, ids).view(target.shape))

    def _scatter(self, batch: StageBatch, stage: Any, keep: list[Any]) -> None:
        for piece in batch.groups:
            ids = self._ids(piece.ids, keep)
            for r, pages in enumerate(self._ref_views[piece.group]):
                source = self._stage_view(stage, piece, r)
                flat = source.reshape(-1, source.shape[-1])
                pages.index_copy_(0, ids, flat[piece.position_start : piece.position_end])

    def _dma(self, batch: StageBatch, stage: Any, *, to_host: bool) -> None:
        host = self._host_bytes
        for src, dst, size in zip(
            batch.dma.src.tolist(), batch.dma.dst.tolist(), batch.dma.nbytes.tolist(), strict=True
        ):
            if to_host:
                host[dst : dst + size].copy_(stage[src : src + size], non_blocking=True)
            else:
                stage[dst : dst + size].copy_(host[src : src + size], non_blocking=True)

    def _done(self, handle: _TorchJob) -> bool:
        return bool(handle.end.query())

    def _finish(self, handle: _TorchJob) -> float:
        handle.end.synchronize()
        return float(handle.start.elapsed_time(handle.end)) / 1000.0

    def _release(self) -> None:
        for stream in (*self._streams.values(), *self._work_streams.values()):
            stream.synchronize()
        self._staging.clear()
