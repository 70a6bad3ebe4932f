"""The `cupy` executor: the same contract with cupy.cuda streams, events and one copy kernel.

Imports CuPy only when built (the `cupy12`/`cupy13` extras); wraps torch-owned (or any) GPU memory
by raw address through `__cuda_array_interface__`, never copying or owning it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kvferry.core.arrays import IdArray
from kvferry.core.bound import BoundPlan
from kvferry.core.errors import ExecutorUnavailableError
from kvferry.core.expand import CopyList, PageCopies, copy_list, split_copies
from kvferry.core.plan import Direction
from kvferry.executors.base import CopyPath, Executor
from kvferry.executors.host import HostRegistrar
from kvferry.executors.staging import plan_stages
from kvferry.executors.tensors import KVTensor

DEFAULT_STAGING_BYTES = 64 << 20
"""GPU staging per direction unless told otherwise."""

_HOST_REGISTER_FLAGS = 1 | 2
"""cudaHostRegisterPortable | cudaHostRegisterMapped (device access through UVA)."""

_MEMCPY_DEFAULT = 4
"""cudaMemcpyDefault: the direction follows from the (unified) addresses."""

_COPY_KERNEL = r"""
extern "C" __global__ void kvferry_copy(const long long* __restrict__ desc, const long long n) {
    // desc holds three columns of n: source addresses, destination addresses, byte counts.
    for (long long d = blockIdx.x; d < n; d += gridDim.x) {
        const unsigned long long s = (unsigned long long)desc[d];
        const unsigned long long t = (unsigned long long)desc[n + d];
        const long long m = desc[2 * n + d];
        const unsigned long long all = s | t | (unsigned long long)m;
        if ((all & 15ULL) == 0ULL) {
            const int4* src = (const int4*)s;
            int4* dst = (int4*)t;
            for (long long i = threadIdx.x; i < (m >> 4); i += blockDim.x) dst[i] = src[i];
        } else if ((all & 3ULL) == 0ULL) {
            const int* src = (const int*)s;
            int* dst = (int*)t;
            for (long long i = threadIdx.x; i < (m >> 2); i += blockDim.x) dst[i] = src[i];
        } else {
            const unsigned char* src = (const unsigned char*)s;
            unsigned char* dst = (unsigned char*)t;
            for (long long i = threadIdx.x; i < m; i += blockDim.x) dst[i] = src[i];
        }
    }
}
"""

_THREADS = 256
_PIECE_BYTES = 64 << 10
"""Copies longer than this are split, so a large page is shared by many thread blocks."""
_MAX_BLOCKS = 65535


def load_cupy() -> Any:
    """Return the cupy module, or raise ExecutorUnavailableError naming the extras."""
    try:
        return importlib.import_module("cupy")
    except ImportError as error:
        raise ExecutorUnavailableError(
            "the cupy executor needs CuPy: pip install 'kvferry[cupy13]' (CUDA 13) or "
            f"'kvferry[cupy12]' (CUDA 12) ({error})"
        ) from error


class CupyRegistrar:
    """Pins host memory with `cudaHostRegister` through CuPy's runtime bindings."""

    def __init__(self, cupy: Any) -> None:
        self._runtime = cupy.cuda.runtime

    def register(self, address: int, nbytes: int) -> None:
        """Pin `nbytes` at `address` (portable, mapped); raise ExecutorUnavailableError if not."""
        try:
            self._runtime.hostRegister(address, nbytes, _HOST_REGISTER_FLAGS)
        except Exception as error:
            raise ExecutorUnavailableError(
                f"cudaHostRegister of {nbytes} bytes failed: {error}"
            ) from error

    def unregister(self, address: int) -> None:
        """Unpin the piece at `address`."""
        self._runtime.hostUnregister(address)


@attrs.define
class _CupyJob:
    start: Any
    end: Any
    keep: list[Any]
    path: CopyPath


PathChoice = Callable[[PageCopies], CopyPath]


class CupyExecutor(Executor):
    """Moves bytes with one descriptor-driven copy kernel plus DMAs.

    `CopyPath.STAGED` (default): the kernel gathers pages into a GPU staging buffer laid out as
    CPU rows, then one `cudaMemcpyAsync` per contiguous CPU range (loads: the reverse); two
    staging halves and a link and a work stream per direction overlap the kernel and the DMAs.
    `CopyPath.ZERO_COPY`: the kernel reads or writes the pinned tier directly (UVA), on
    `zero_copy_blocks` thread blocks. `copy_path` may be a function choosing per transfer.
    """

    name = "cupy"

    def __init__(
        self,
        *,
        kv_caches: Sequence[Sequence[KVTensor]],
        blocks_per_chunk: int,
        num_rows: int,
        compute_stream: Any = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        copy_path: CopyPath | PathChoice = CopyPath.STAGED,
        zero_copy_blocks: int = 32,
    ) -> None:
        cupy = load_cupy()
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as error:
            raise ExecutorUnavailableError(
                f"the cupy executor needs a CUDA device: {error}"
            ) from error
        if count < 1:
            raise ExecutorUnavailableError("the cupy executor needs a CUDA device; none is visible")
        self._cupy = cupy
        self._cupyx = importlib.import_module("cupyx")
        super().__init__(kv_caches=kv_caches, blocks_per_chunk=blocks_per_chunk, num_rows=num_rows)
        _, _, index = self.device.partition(":")
        self._device = cupy.cuda.Device(int(index)) if index else cupy.cuda.Device()
        with self._device:
            self._compute_stream = self._as_stream(compute_stream)
            self._streams = {
                Direction.LOAD: cupy.cuda.Stream(non_blocking=True),
                Direction.STORE: cupy.cuda.Stream(non_blocking=True),
            }
            self._work_streams = {
                Direction.LOAD: cupy.cuda.Stream(non_blocking=True),
                Direction.STORE: cupy.cuda.Stream(non_blocking=True),
            }
        self._last_end: dict[Direction, Any] = {}
        self._half_bytes = max(staging_bytes // 2, self.layout.row_bytes)
        self._staging: dict[Direction, list[Any]] = {}
        self._copy_path = copy_path
        self._zero_copy_blocks = zero_copy_blocks
        self._kernel = cupy.RawKernel(_COPY_KERNEL, "kvferry_copy")

    def _registrar(self) -> HostRegistrar:
        return CupyRegistrar(self._cupy)

    def _as_stream(self, stream: Any) -> Any:
        """Return `stream` as a CuPy stream: None, a CuPy stream, a raw handle or a torch stream.

        Objects that speak the CUDA stream protocol (`__cuda_stream__`) go through
        `Stream.from_external` where CuPy has it; others are wrapped by their raw handle.
        """
        cuda = self._cupy.cuda
        if stream is None or isinstance(stream, cuda.Stream | cuda.ExternalStream):
            return stream
        from_external = getattr(cuda.Stream, "from_external", None)
        if from_external is not None and hasattr(stream, "__cuda_stream__"):
            return from_external(stream)
        handle = getattr(stream, "cuda_stream", stream)
        return cuda.ExternalStream(int(handle))

    def choose_path(self, pages: PageCopies) -> CopyPath:
        """Return the copy path for one transfer (the configured one, or what its function says)."""
        if isinstance(self._copy_path, CopyPath):
            return self._copy_path
        return self._copy_path(pages)

    def _stages(self, direction: Direction) -> list[int]:
        """Return the addresses of the direction's two staging buffers (allocated on first use)."""
        if direction not in self._staging:
            self._staging[direction] = [
                self._cupy.empty(self._half_bytes, dtype=np.uint8) for _ in range(2)
            ]
        return [int(buffer.data.ptr) for buffer in self._staging[direction]]

    def _launch(self, copies: CopyList, stream: Any, keep: list[Any], *, blocks: int) -> None:
        """Queue one kernel over `copies` (absolute addresses) on `stream`."""
        if blocks >= _MAX_BLOCKS:
            copies = split_copies(copies, _PIECE_BYTES)
        n = len(copies)
        if n == 0:
            return
        host: IdArray = self._cupyx.empty_pinned(3 * n, dtype=np.int64)
        host[:n], host[n : 2 * n], host[2 * n :] = copies.src, copies.dst, copies.nbytes
        with stream:
            device = self._cupy.empty(3 * n, dtype=np.int64)
        self._cupy.cuda.runtime.memcpyAsync(
            device.data.ptr, host.ctypes.data, 3 * n * 8, 1, stream.ptr
        )
        keep.extend((host, device))
        grid = (max(1, min(n, blocks, _MAX_BLOCKS)),)
        with stream:
            self._kernel(grid, (_THREADS,), (device, np.int64(n)))

    def _enqueue(self, bound: BoundPlan, pages: PageCopies) -> _CupyJob:
        with self._device:
            return self._enqueue_on_device(bound, pages)

    def _enqueue_on_device(self, bound: BoundPlan, pages: PageCopies) -> _CupyJob:
        cupy = self._cupy
        direction = pages.direction
        link, work = self._streams[direction], self._work_streams[direction]
        compute = self._compute_stream or cupy.cuda.get_current_stream()
        path = self.choose_path(pages)
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(compute)
        previous = self._last_end.get(direction)
        for stream in (link, work):
            stream.wait_event(ready)
            if previous is not None:
                stream.wait_event(previous)
        job = _CupyJob(start=cupy.cuda.Event(), end=cupy.cuda.Event(), keep=[], path=path)
        job.start.record(link)
        if path is CopyPath.ZERO_COPY:
            copies = copy_list(
                pages, self.host_tier.address, piece_bytes=self.host_tier.piece_bytes
            )
            self._launch(copies, link, job.keep, blocks=self._zero_copy_blocks)
            job.end.record(link)
        else:
            last = self._staged(bound, pages, link, work, job.keep)
            job.end.record(last)
        self._last_end[direction] = job.end
        return job

    def _staged(
        self, bound: BoundPlan, pages: PageCopies, link: Any, work: Any, keep: list[Any]
    ) -> Any:
        """Queue a staged transfer, double-buffered (the kernel on `work` overlaps the DMAs on
        `link`); return the stream whose last operation ends the job."""
        cupy = self._cupy
        direction = pages.direction
        host = self.host_tier.address
        stages = self._stages(direction)
        batches = plan_stages(
            bound,
            pages,
            self.layout,
            capacity=self._half_bytes,
            piece_bytes=self.host_tier.piece_bytes,
            group_slices=False,
        )
        memcpy = cupy.cuda.runtime.memcpyAsync
        freed: list[Any] = [None, None]
        for k, batch in enumerate(batches):
            stage = stages[k % 2]
            dma, dev = batch.dma, batch.device
            done = cupy.cuda.Event(disable_timing=True)
            released = cupy.cuda.Event(disable_timing=True)
            if direction is Direction.STORE:
                if freed[k % 2] is not None:
                    work.wait_event(freed[k % 2])
                gather = CopyList(src=dev.src, dst=dev.dst + stage, nbytes=dev.nbytes)
                self._launch(gather, work, keep, blocks=_MAX_BLOCKS)
                done.record(work)
                link.wait_event(done)
                sources, targets = (dma.src + stage).tolist(), (dma.dst + host).tolist()
                for s, d, size in zip(sources, targets, dma.nbytes.tolist(), strict=True):
                    memcpy(d, s, size, _MEMCPY_DEFAULT, link.ptr)
                released.record(link)
            else:
                if freed[k % 2] is not None:
                    link.wait_event(freed[k % 2])
                sources, targets = (dma.src + host).tolist(), (dma.dst + stage).tolist()
                for s, d, size in zip(sources, targets, dma.nbytes.tolist(), strict=True):
                    memcpy(d, s, size, _MEMCPY_DEFAULT, link.ptr)
                done.record(link)
                work.wait_event(done)
                scatter = CopyList(src=dev.src + stage, dst=dev.dst, nbytes=dev.nbytes)
                self._launch(scatter, work, keep, blocks=_MAX_BLOCKS)
                released.record(work)
            freed[k % 2] = released
        return link if direction is Direction.STORE else work

    def _done(self, handle: _CupyJob) -> bool:
        return bool(handle.end.done)

    def _finish(self, handle: _CupyJob) -> float:
        handle.end.synchronize()
        return float(self._cupy.cuda.get_elapsed_time(handle.start, handle.end)) / 1000.0

    def _release(self) -> None:
        for stream in (*self._streams.values(), *self._work_streams.values()):
            stream.synchronize()
        self._staging.clear()
