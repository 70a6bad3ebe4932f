"""The `cupy` executor: the same contract on CuPy memory and kernels, and a zero-copy path.

Imports CuPy only when built (the `cupy12`/`cupy13` extras); wraps torch-owned (or any) GPU memory
by raw address through `__cuda_array_interface__`, never copying or owning it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvferry.core.arrays import IdArray
from kvferry.core.bound import BoundPlan
from kvferry.core.errors import ExecutorUnavailableError
from kvferry.core.expand import copy_list, expand_pages, split_copies
from kvferry.executors.base import CopyPath
from kvferry.executors.host import HostRegistrar
from kvferry.executors.kernels import (
    PIECE_BYTES,
    THREADS,
    ZERO_COPY_NAME,
    ZERO_COPY_SOURCE,
)
from kvferry.executors.staged import (
    DEFAULT_COPY_BLOCKS,
    DEFAULT_STAGING_BYTES,
    GpuJob,
    StagedGpuExecutor,
)
from kvferry.executors.tensors import KVCacheEntry

_HOST_REGISTER_FLAGS = 1 | 2
"""cudaHostRegisterPortable | cudaHostRegisterMapped (device access through UVA)."""

_MEMCPY_DEFAULT = 4
"""cudaMemcpyDefault: the direction follows from the (unified) addresses."""

_MAX_BLOCKS = 65535
"""Most thread blocks of one launch in x."""


def load_cupy() -> Any:
    """Return the cupy module, or raise ExecutorUnavailableError naming the extras."""
    try:
        return importlib.import_module("cupy")
    except ImportError as error:
        raise ExecutorUnavailableError(
            "the cupy executor needs CuPy: pip install -e '.[cupy13]' (CUDA 13) or"
            f" -e '.[cupy12]' (CUDA 12) in a checkout of kvferry ({error})"
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


PathChoice = Callable[[BoundPlan], CopyPath]


class CupyExecutor(StagedGpuExecutor):
    """The staged path (`executors.staged`) on CuPy streams, events and `RawKernel`s.

    `CopyPath.STAGED` (default): see `StagedGpuExecutor`. `CopyPath.ZERO_COPY`: one kernel reads
    or writes the pinned tier directly (UVA), on `zero_copy_blocks` thread blocks, from page
    copies listed on the host. `copy_path` may be a function choosing per transfer.
    """

    name = "cupy"

    def __init__(
        self,
        *,
        kv_caches: Sequence[Sequence[KVCacheEntry]],
        blocks_per_chunk: int,
        num_rows: int | Sequence[int],
        compute_stream: Any = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        copy_blocks: int = DEFAULT_COPY_BLOCKS,
        kernel_priority: int = 0,
        submit_thread: bool = True,
        route: str | None = None,
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
        self._device_index: int | None = None
        """The tensors' CUDA device (-1: not named, the current one), once `_on_device` read it."""
        super().__init__(
            kv_caches=kv_caches,
            blocks_per_chunk=blocks_per_chunk,
            num_rows=num_rows,
            staging_bytes=staging_bytes,
            copy_blocks=copy_blocks,
            kernel_priority=kernel_priority,
            submit_thread=submit_thread,
            route=route,
        )
        with self._on_device():
            self._compute_stream = as_cupy_stream(cupy, compute_stream)
            self._kernels: list[Any] = []
            """The `RawKernel`s compiled for the staged path (their modules live as they do)."""
            self._zero_copy_kernel = cupy.RawKernel(ZERO_COPY_SOURCE, ZERO_COPY_NAME)
        self._copy_path = copy_path
        self._zero_copy_blocks = zero_copy_blocks

    def _on_device(self) -> Any:
        index = self._device_index
        if index is None:  # first use (the base class's constructor): read it from the tensors
            _, _, number = self.device.partition(":")
            index = self._device_index = int(number) if number else -1
        if index < 0 or self._cupy.cuda.runtime.getDevice() == index:
            return contextlib.nullcontext()  # the usual case, checked once per submit
        return self._cupy.cuda.Device(index)

    def _registrar(self) -> HostRegistrar:
        return CupyRegistrar(self._cupy)

    def choose_path(self, bound: BoundPlan) -> CopyPath:
        """Return the copy path for one transfer (the configured one, or what its function says)."""
        if isinstance(self._copy_path, CopyPath):
            return self._copy_path
        return self._copy_path(bound)

    # --- StagedGpuExecutor's primitives, in CuPy -----------------------------------------------

    def _compute_stream_now(self) -> int:
        return int((self._compute_stream or self._cupy.cuda.get_current_stream()).ptr)

    def _allocate(self, nbytes: int) -> Any:
        return self._cupy.empty(nbytes, dtype=np.uint8)

    def _allocate_pinned(self, count: int) -> tuple[Any, IdArray]:
        host = self._cupyx.empty_pinned(count, dtype=np.int64)
        return host, host

    def _address(self, buffer: Any) -> int:
        return int(buffer.data.ptr)

    def _kernel_function(self, source: str, name: str) -> Any:
        with self._on_device():
            kernel = self._cupy.RawKernel(source, name)
            function = kernel.kernel.ptr
        self._kernels.append(kernel)
        return function

    # --- the job ---------------------------------------------------------------------------------

    def _enqueue(self, bound: BoundPlan) -> GpuJob:
        with self._on_device():
            if self.choose_path(bound) is CopyPath.ZERO_COPY:
                return self._enqueue_zero_copy(bound)
            return self._enqueue_staged(bound)

    def _enqueue_zero_copy(self, bound: BoundPlan) -> GpuJob:
        """Queue one kernel that copies every page straight between the KV tensors and the tier."""
        direction = bound.plan.direction
        link = as_cupy_stream(self._cupy, self._lane_handles[direction][0])
        job = self._begin(direction, CopyPath.ZERO_COPY)
        pages = expand_pages(bound, self.layout, self.host_tier.tier)
        copies = copy_list(pages, self.host_tier.address, piece_starts=self.host_tier.piece_starts)
        if self._zero_copy_blocks >= _MAX_BLOCKS:
            copies = split_copies(copies, PIECE_BYTES)
        n = len(copies)
        if n:
            table = np.concatenate((copies.src, copies.dst, copies.nbytes))
            host = self._cupyx.empty_pinned(len(table), dtype=np.int64)
            host[:] = table
            with link:
                device = self._cupy.empty(len(table), dtype=np.int64)
            self._cupy.cuda.runtime.memcpyAsync(
                device.data.ptr, host.ctypes.data, host.nbytes, 1, link.ptr
            )
            job.keep.extend((host, device))
            with link:
                self._zero_copy_kernel(
                    (max(1, min(n, self._zero_copy_blocks, _MAX_BLOCKS)),),
                    (THREADS,),
                    (device, np.int64(n)),
                )
        self._end(direction, job, 1)  # one kernel, on the first lane
        return job


def as_cupy_stream(cupy: Any, stream: Any) -> Any:
    """Return `stream` as a CuPy stream: None, a CuPy stream, a raw handle or a torch stream.

    Where CuPy has `Stream.from_external` (CuPy 14 deprecates `ExternalStream`), everything goes
    through it: objects that speak the CUDA stream protocol (`__cuda_stream__`) as they are,
    others by their raw handle; older CuPy wraps the raw handle in an `ExternalStream`.
    """
    cuda = cupy.cuda
    if stream is None or isinstance(stream, cuda.Stream | cuda.ExternalStream):
        return stream
    from_external = getattr(cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    handle = int(getattr(stream, "cuda_stream", stream))
    if from_external is not None:
        return from_external(_RawStream(handle))
    return cuda.ExternalStream(handle)


class _RawStream:
    """A raw `CUstream` that speaks the CUDA stream protocol (for `Stream.from_external`)."""

    def __init__(self, handle: int) -> None:
        self._handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._handle)  # (the protocol's version, the handle)
