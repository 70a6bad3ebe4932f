"""The torch executor's staged copy path run on CPU tensors, with stand-ins for CUDA objects.

Test support only: lets CI (when torch is installed) check the gather/scatter/DMA arithmetic of
the torch executor without a GPU; ordering and speed are the GPU tests' business.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvferry.core.plan import Direction
from kvferry.executors.host import HostRegistrar
from kvferry.executors.staged import DriverCalls, StageCopy, TableCopy
from kvferry.executors.staging import REF_FIELDS, SLICE_FIELDS, segment_copies
from kvferry.executors.torch_executor import TorchExecutor


class _Event:
    def __init__(self, **_: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _Stream:
    def __init__(self, **_: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


@contextlib.contextmanager
def _no_stream(stream: Any) -> Iterator[None]:
    yield


class _CudaStandIn:
    Event = _Event
    stream = staticmethod(_no_stream)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def current_stream(device: Any = None) -> Any:
        return _Stream()


class _TorchStandIn:
    """torch, except that `torch.cuda` is a stand-in and pinning is a no-op."""

    def __init__(self) -> None:
        self._torch = importlib.import_module("torch")
        self.cuda = _CudaStandIn()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def from_numpy(self, array: Any) -> Any:
        tensor = self._torch.from_numpy(array)
        return _Unpinnable(tensor)


class _Unpinnable:
    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def pin_memory(self) -> Any:
        return self.tensor

    def __getitem__(self, item: Any) -> Any:
        return self.tensor[item]


class TorchOnCpuExecutor(TorchExecutor):
    """The torch executor over host tensors: same batches, uploads and DMAs; the staging kernel's
    work done by `segment_copies`, no CUDA."""

    name = "torch-on-cpu"
    on_gpu = False

    def __init__(self, **options: Any) -> None:
        import kvferry.executors.torch_executor as module

        original = module.load_torch
        module.load_torch = _TorchStandIn  # type: ignore[assignment]
        try:
            super().__init__(**options)
        finally:
            module.load_torch = original

    def _registrar(self) -> HostRegistrar | None:
        return None

    def _on_device(self) -> Any:
        return contextlib.nullcontext()

    def _thread_context(self) -> tuple[int, int]:
        return 0, 0  # no CUDA context for a submission thread to make current

    # no CUDA driver here: streams and events are placeholders and every copy happens at once,
    # in order

    def _new_stream(self, *, priority: int = 0) -> Any:
        return _Stream()

    def _stream_handle(self, stream: Any) -> int:
        return 0

    def _synchronize(self, stream: Any) -> None:
        return None

    def _destroy_stream(self, stream: Any) -> None:
        return None

    def _compute_stream_now(self) -> int:
        return 0

    def _new_event(self, *, timing: bool = False) -> Any:
        return object()

    def _record(self, event: Any, stream: int) -> None:
        return None

    def _wait(self, stream: int, event: Any) -> None:
        return None

    def _event_done(self, event: Any) -> bool:
        return True

    def _elapsed(self, start: Any, end: Any) -> float:
        return 0.0

    def _destroy_event(self, event: Any) -> None:
        return None

    def _synchronize_event(self, event: Any) -> None:
        return None

    def _allocate_pinned(self, count: int) -> tuple[Any, Any]:
        host = np.zeros(count, np.int64)
        return host, host

    def _stage_kernel(self, *, refs: int, ids: int, to_stage: bool) -> StageCopy:
        return functools.partial(self._stage_copy, refs=refs, ids=ids, to_stage=to_stage)

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
        """Do the kernel's work with `segment_copies` and memmove (no CUDA here), reading the
        tables from where the executor uploaded them."""
        table = _int64s(segments, count, len(SLICE_FIELDS))
        ref_table = _int64s(refs, len(self._planner.ref_table), len(REF_FIELDS))
        fields = dict(zip(SLICE_FIELDS, table.T, strict=True))
        n_ids = int((fields["id_offset"] + fields["count"]).max())
        block_ids = np.ctypeslib.as_array((ctypes.c_int64 * n_ids).from_address(ids))
        direction = Direction.STORE if to_stage else Direction.LOAD
        copies = segment_copies(table, ref_table, block_ids, direction=direction)
        src_base, dst_base = (0, stage) if to_stage else (stage, 0)
        for src, dst, size in zip(
            copies.src.tolist(), copies.dst.tolist(), copies.nbytes.tolist(), strict=True
        ):
            ctypes.memmove(dst + dst_base, src + src_base, size)

    def _driver_calls(self) -> DriverCalls:
        return (self._record, self._wait, self._memcpy)

    def _memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def _table_copy(self) -> TableCopy:
        return self._copy_table

    def _copy_table(self, dst: int, src: int, count: int, stream: int) -> None:
        """Do the table-copy kernel's work: `count` int64 from `src` to `dst`."""
        ctypes.memmove(dst, src, 8 * count)


def _int64s(address: int, lines: int, width: int) -> np.ndarray:
    """Return the `lines` x `width` int64 table at `address` (a view of that memory)."""
    flat = np.ctypeslib.as_array((ctypes.c_int64 * (lines * width)).from_address(address))
    return flat.reshape(lines, width)
