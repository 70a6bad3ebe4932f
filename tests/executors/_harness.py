"""Test harness for the executor contract: model layouts, backends, plans and a byte oracle.

Test support only: it allocates tensors through each backend and computes expected bytes with
plain Python loops over pages, independent of the copy expansion under test.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import numpy as np
import numpy.typing as npt

from kvferry.core.bound import BoundPlan
from kvferry.core.keys import OffloadKey
from kvferry.core.layout import TensorLayout
from kvferry.core.plan import Direction, TransferPlan, chunks_spanned
from kvferry.executors import Executor, KVTensor, make_executor, register_executor

Bytes = npt.NDArray[np.uint8]
POISON_GPU = 0xEE
POISON_HOST = 0xAB
NUM_BLOCKS = 40
NUM_ROWS = 16


@attrs.frozen(kw_only=True)
class TensorSpec:
    """One engine tensor: a byte buffer of `nbytes` seen through `shape`/`strides` at `offset`."""

    layout: TensorLayout
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    itemsize: int
    offset: int = 0  # elements from the buffer start
    nbytes: int = 0  # buffer size; 0 = exactly what the view spans

    def buffer_bytes(self) -> int:
        span = self.offset + sum(
            (s - 1) * st for s, st in zip(self.shape, self.strides, strict=True)
        )
        return max(self.nbytes, (span + 1) * self.itemsize)


def _dense(layout: TensorLayout, shape: tuple[int, ...], itemsize: int = 2) -> TensorSpec:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return TensorSpec(
        layout=layout, shape=shape, strides=tuple(reversed(strides)), itemsize=itemsize
    )


def _mamba_pair() -> list[TensorSpec]:
    """Two state views (100 and 300 bytes) sharing 512-byte padded pages of one buffer."""
    nb, page = NUM_BLOCKS, 512
    return [
        TensorSpec(
            layout=TensorLayout.MAMBA,
            shape=(nb, 100),
            strides=(page, 1),
            itemsize=1,
            nbytes=nb * page,
        ),
        TensorSpec(
            layout=TensorLayout.MAMBA,
            shape=(nb, 25, 12),
            strides=(page, 12, 1),
            itemsize=1,
            offset=128,
            nbytes=nb * page,
        ),
    ]


NB = NUM_BLOCKS
LAYOUT_CASES: dict[str, list[list[TensorSpec]]] = {
    "kv_split": [[_dense(TensorLayout.KV_SPLIT, (2, NB, 4, 2, 8)) for _ in range(2)]],
    "blocks_first": [[_dense(TensorLayout.BLOCKS_FIRST, (NB, 2, 4, 2, 8)) for _ in range(2)]],
    "cross_layer": [[_dense(TensorLayout.CROSS_LAYER, (NB, 3, 2, 4, 8))]],
    "mla": [[_dense(TensorLayout.MLA, (NB, 4, 72))]],
    "mamba_padded": [_mamba_pair()],
    "odd_pages_656_416": [
        [_dense(TensorLayout.MLA, (NB, 41, 8)), _dense(TensorLayout.MLA, (NB, 13, 16))]
    ],
    "hybrid_three_groups": [
        [_dense(TensorLayout.KV_SPLIT, (2, NB, 4, 2, 8)) for _ in range(2)],
        [_dense(TensorLayout.BLOCKS_FIRST, (NB, 2, 8, 1, 8))],
        _mamba_pair(),
    ],
}
"""Every layout kvferry supports, as tensors of a small model."""


class Backend:
    """How a test allocates, fills and reads tensors for one executor."""

    name: str = ""
    executor: str = ""
    options: ClassVar[dict[str, Any]] = {}

    def buffer(self, nbytes: int) -> Any:
        raise NotImplementedError

    def view(self, buffer: Any, spec: TensorSpec) -> Any:
        raise NotImplementedError

    def write(self, buffer: Any, values: Bytes) -> None:
        raise NotImplementedError

    def read(self, buffer: Any) -> Bytes:
        raise NotImplementedError

    def sync(self) -> None:
        return None


class NumpyBackend(Backend):
    name = executor = "cpu"

    def buffer(self, nbytes: int) -> Any:
        return np.zeros(nbytes, dtype=np.uint8)

    def view(self, buffer: Any, spec: TensorSpec) -> Any:
        typed = buffer.view(np.dtype(f"<i{spec.itemsize}") if spec.itemsize > 1 else np.uint8)
        return np.lib.stride_tricks.as_strided(
            typed[spec.offset :],
            shape=spec.shape,
            strides=tuple(s * spec.itemsize for s in spec.strides),
        )

    def write(self, buffer: Any, values: Bytes) -> None:
        buffer[:] = values

    def read(self, buffer: Any) -> Bytes:
        return np.array(buffer, dtype=np.uint8)


class TorchBackend(Backend):
    """CUDA tensors owned by torch (the cupy executor wraps the same memory)."""

    def __init__(self, executor: str, device: str = "cuda") -> None:
        self.name = self.executor = executor
        self.torch = importlib.import_module("torch")
        self.device = device

    def buffer(self, nbytes: int) -> Any:
        return self.torch.zeros(nbytes, dtype=self.torch.uint8, device=self.device)

    def view(self, buffer: Any, spec: TensorSpec) -> Any:
        dtype = {1: self.torch.uint8, 2: self.torch.int16, 4: self.torch.int32}[spec.itemsize]
        return buffer.view(dtype).as_strided(spec.shape, spec.strides, spec.offset)

    def write(self, buffer: Any, values: Bytes) -> None:
        buffer.copy_(self.torch.from_numpy(values.copy()))
        self.sync()

    def read(self, buffer: Any) -> Bytes:
        self.sync()
        result: Bytes = buffer.cpu().numpy().copy()
        return result

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()


def backend_for(name: str) -> Backend:
    """Return the backend that allocates tensors for executor `name`."""
    if name == "cpu":
        return NumpyBackend()
    if name == "torch-on-cpu":
        register_executor(name, "_torch_on_cpu:TorchOnCpuExecutor")
        return TorchBackend(name, device="cpu")
    return TorchBackend(name)


class Model:
    """One layout case allocated through a backend: buffers, engine views, and an executor."""

    def __init__(
        self, backend: Backend, specs: list[list[TensorSpec]], blocks_per_chunk: int, **options: Any
    ) -> None:
        self.backend = backend
        self.specs = specs
        self.f = blocks_per_chunk
        self.buffers = [[backend.buffer(s.buffer_bytes()) for s in group] for group in specs]
        views = [
            [
                KVTensor(tensor=backend.view(b, s), layout=s.layout)
                for b, s in zip(bs, ss, strict=True)
            ]
            for bs, ss in zip(self.buffers, specs, strict=True)
        ]
        self.executor: Executor = make_executor(
            backend.executor,
            kv_caches=views,
            blocks_per_chunk=blocks_per_chunk,
            num_rows=NUM_ROWS,
            **{**backend.options, **options},
        )
        self.views = views

    # --- bytes -------------------------------------------------------------------------------

    def fill_random(self, rng: np.random.Generator) -> None:
        for group in self.buffers:
            for buffer in group:
                n = len(self.backend.read(buffer))
                self.backend.write(buffer, rng.integers(0, 256, n, dtype=np.uint8))

    def poison(self) -> None:
        for group in self.buffers:
            for buffer in group:
                n = len(self.backend.read(buffer))
                self.backend.write(buffer, np.full(n, POISON_GPU, dtype=np.uint8))

    def snapshot(self) -> list[list[Bytes]]:
        return [[self.backend.read(b) for b in group] for group in self.buffers]

    def ref_pages(
        self, snapshot: list[list[Bytes]], group: int
    ) -> list[tuple[int, Bytes, int, int, int]]:
        """Return, per ref of `group`: (tensor index, bytes, offset, page stride, page bytes)."""
        out = []
        for t, registered in enumerate(self.executor.tensors[group]):
            base = self._buffer_address(group, t)
            for ref in registered.refs:
                out.append(
                    (t, snapshot[group][t], ref.address - base, ref.page_stride, ref.page_bytes)
                )
        return out

    def _buffer_address(self, group: int, t: int) -> int:
        buffer = self.buffers[group][t]
        if isinstance(buffer, np.ndarray):
            return int(buffer.ctypes.data)
        return int(buffer.data_ptr())

    def run(self, bound: BoundPlan) -> int:
        """Submit, wait, check success; return the bytes reported."""
        self.executor.submit(bound)
        (result,) = self.executor.wait([bound.job_id])
        assert result.success, result.error
        self.backend.sync()
        return result.nbytes


# --- plans ---------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class GroupMove:
    """What one group moves: GPU ids, the request-block index of the first, and its rows."""

    ids: tuple[int, ...]
    first: int
    rows: tuple[int, ...]


def bound_plan(
    job_id: int,
    direction: Direction,
    f: int,
    moves: Sequence[GroupMove],
    fingerprint: str | None = None,
) -> BoundPlan:
    keys, ids, sizes, firsts, rows = [], [], [], [], []
    for g, move in enumerate(moves):
        n = len(move.ids)
        count = chunks_spanned(n, move.first % f, f)
        assert count == len(move.rows)
        keys += [OffloadKey(g, bytes([g, job_id % 256, i])) for i in range(count)]
        ids += list(move.ids)
        sizes.append(n)
        firsts.append(move.first if n else 0)
        rows += list(move.rows)
    plan = TransferPlan(
        request_id=f"job{job_id}",
        direction=direction,
        blocks_per_chunk=f,
        keys=keys,
        gpu_block_ids=ids,
        group_sizes=sizes,
        block_indices=firsts,
    )
    return BoundPlan(job_id=job_id, plan=plan, cpu_rows=rows, layout_fingerprint=fingerprint)


def page_bytes_of(model: Model, group: int) -> int:
    return sum(ref.page_bytes for ref in model.executor.layout.groups[group].refs)


def expected_host(
    model: Model, before: Bytes, source: list[list[Bytes]], moves: Sequence[GroupMove]
) -> Bytes:
    """Return the host tier after a store of `moves` from `source`, by plain loops."""
    host = before.copy()
    layout = model.executor.layout
    tier = model.executor.host_tier.tier
    f = model.f
    for g, move in enumerate(moves):
        offsets = layout.groups[g].row_offsets(f)
        for k, block in enumerate(move.ids):
            position = move.first % f + k
            row = move.rows[position // f]
            slot = position % f
            for r, (_t, data, off, stride, size) in enumerate(model.ref_pages(source, g)):
                dst = tier.row_offset(g, row) + offsets[r] + slot * size
                host[dst : dst + size] = data[off + block * stride : off + block * stride + size]
    return host


def expected_gpu(
    model: Model, before: list[list[Bytes]], host: Bytes, moves: Sequence[GroupMove]
) -> list[list[Bytes]]:
    """Return the GPU buffers after a load of `moves` from `host`, by plain loops."""
    after = [[b.copy() for b in group] for group in before]
    layout = model.executor.layout
    tier = model.executor.host_tier.tier
    f = model.f
    for g, move in enumerate(moves):
        offsets = layout.groups[g].row_offsets(f)
        for k, block in enumerate(move.ids):
            position = move.first % f + k
            row = move.rows[position // f]
            slot = position % f
            for r, (t, _data, off, stride, size) in enumerate(model.ref_pages(before, g)):
                src = tier.row_offset(g, row) + offsets[r] + slot * size
                after[g][t][off + block * stride : off + block * stride + size] = host[
                    src : src + size
                ]
    return after


Check = Callable[[Model], None]
