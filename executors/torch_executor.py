"""The `torch` executor: CUDA streams and events through torch; staged copies at link speed.

Imports torch only when built (the `torch` extra). It never decides what to move, never syncs
the engine's compute stream from the host, and never allocates more staging than it was given.
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

DEFAULT_STAGING_BYTES = 64 << 20
"""GPU staging per direction unless told otherwise."""

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

    Loads and stores have their own stream and staging buffer; each job first waits, with an
    event, on the compute stream (the one given at construction, else the current stream at
    submit time), so it sees the bytes queued compute writes.
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
        self._staging_bytes = max(staging_bytes, self.layout.row_bytes)
        self._staging: dict[Direction, Any] = {}
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

    def _stage(self, direction: Direction) -> Any:
        if direction not in self._staging:
            self._staging[direction] = self._torch.empty(
                self._staging_bytes, dtype=self._torch.uint8, device=self._device
            )
        return self._staging[direction]

    def choose_path(self, pages: PageCopies) -> CopyPath:
        """Return the copy path for one transfer (the torch executor only stages, for now)."""
        return CopyPath.STAGED

    def _enqueue(self, bound: BoundPlan, pages: PageCopies) -> _TorchJob:
        torch = self._torch
        direction = pages.direction
        stream = self._streams[direction]
        compute = self._compute_stream or torch.cuda.current_stream(self._device)
        batches = plan_stages(
            bound,
            pages,
            self.layout,
            capacity=self._staging_bytes,
            piece_bytes=self.host_tier.piece_bytes,
            device_copies=False,
        )
        ready = torch.cuda.Event()
        ready.record(compute)
        stream.wait_event(ready)
        job = _TorchJob(
            start=torch.cuda.Event(enable_timing=True),
            end=torch.cuda.Event(enable_timing=True),
            keep=[],
        )
        stage = self._stage(direction)
        with torch.cuda.stream(stream):
            job.start.record(stream)
            for batch in batches:
                if direction is Direction.STORE:
                    self._gather(batch, stage, job.keep)
                    self._dma(batch, stage, to_host=True)
                else:
                    self._dma(batch, stage, to_host=False)
                    self._scatter(batch, stage, job.keep)
            job.end.record(stream)
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
        for stream in self._streams.values():
            stream.synchronize()
        self._staging.clear()
