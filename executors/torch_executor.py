"""The `torch` executor: the staged path on torch memory and kernels; copies at link speed.

Imports torch only when built (the `torch` extra). It never decides what to move, never syncs
the engine's compute stream from the host, and never allocates more staging than it was given
(or two rows, when a row is larger than half of it).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Sequence
from typing import Any

from kvferry.core.arrays import IdArray
from kvferry.core.bound import BoundPlan
from kvferry.core.errors import ExecutorUnavailableError
from kvferry.executors.base import CopyPath
from kvferry.executors.host import HostRegistrar
from kvferry.executors.staged import (
    DEFAULT_COPY_BLOCKS,
    DEFAULT_STAGING_BYTES,
    GpuJob,
    StagedGpuExecutor,
)
from kvferry.executors.tensors import KVCacheEntry, KVPages

_HOST_REGISTER_FLAGS = 1 | 2
"""cudaHostRegisterPortable | cudaHostRegisterMapped."""


def load_torch() -> Any:
    """Return the torch module, or raise ExecutorUnavailableError naming the extra."""
    try:
        return importlib.import_module("torch")
    except ImportError as error:
        raise ExecutorUnavailableError(
            "the torch executor needs torch: pip install -e '.[torch]' in a checkout of"
            f" kvferry ({error})"
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


class TorchExecutor(StagedGpuExecutor):
    """The staged path (`executors.staged`) on torch memory; its kernels are compiled with
    NVRTC through `torch.cuda._compile_kernel` on first use. Its lanes are streams of its own,
    made through the driver, never taken from torch's shared pool (`CudaDriver.stream`)."""

    name = "torch"

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
    ) -> None:
        torch = load_torch()
        if not torch.cuda.is_available():
            raise ExecutorUnavailableError(
                "the torch executor needs a CUDA device; none is visible"
            )
        self._torch = torch
        self._device = next(
            t.buffer if isinstance(t, KVPages) else t.tensor for group in kv_caches for t in group
        ).device
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
        self._compute_stream = compute_stream

    def _registrar(self) -> HostRegistrar:
        return TorchRegistrar(self._torch)

    def choose_path(self, bound: BoundPlan) -> CopyPath:
        """Return the copy path for one transfer (the torch executor only stages)."""
        return CopyPath.STAGED

    def _enqueue(self, bound: BoundPlan) -> GpuJob:
        with self._on_device():
            return self._enqueue_staged(bound)

    # --- StagedGpuExecutor's primitives, in torch ----------------------------------------------

    def _on_device(self) -> Any:
        if self._torch.cuda.current_device() == self._device.index:
            return contextlib.nullcontext()  # the usual case; switching costs ~10 us a submit
        return self._torch.cuda.device(self._device)

    def _compute_stream_now(self) -> int:
        if self._compute_stream is not None:
            return int(self._compute_stream.cuda_stream)
        # the raw handle without building a Stream object (what torch's own compiled code
        # calls); through the public API where a torch build lacks it
        raw = getattr(self._torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return int(raw(self._device.index))
        return int(self._torch.cuda.current_stream(self._device).cuda_stream)

    def _allocate(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self._device)

    def _allocate_pinned(self, count: int) -> tuple[Any, IdArray]:
        host = self._torch.empty(count, dtype=self._torch.int64, pin_memory=True)
        return host, host.numpy()

    def _address(self, buffer: Any) -> int:
        return int(buffer.data_ptr())

    def _kernel_function(self, source: str, name: str) -> Any:
        return self._torch.cuda._compile_kernel(source, name).func
