"""vLLM's KV layouts (`kvferry.benchmarks.engine_layouts`) round trip byte-exact on every
executor, registered as the engine's tensor views and as neutral `KVPages`: the data bytes of the
plan's pages arrive, and no other byte moves, on either side."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _harness import GroupMove, bound_plan

from kvferry.benchmarks.engine_layouts import (
    MODELS,
    EngineView,
    Model,
    data_regions,
    engine_model,
    group_block_bytes,
    kv_caches,
)
from kvferry.core.plan import Direction
from kvferry.executors import make_executor

pytestmark = pytest.mark.usefixtures("route")

NUM_BLOCKS = 40
ROWS = 24
POISON = 0xEE
EXECUTORS = [
    "cpu",
    pytest.param("torch", marks=pytest.mark.gpu),
    pytest.param("cupy", marks=pytest.mark.gpu),
]


class _Numpy:
    def buffer(self, nbytes: int) -> Any:
        return np.zeros(nbytes, np.uint8)

    def view(self, buffer: Any, v: EngineView) -> Any:
        typed = buffer[v.offset :].view(np.uint8)
        return np.lib.stride_tricks.as_strided(
            typed.view(f"<u{v.itemsize}") if v.itemsize > 1 else typed,
            shape=v.shape,
            strides=tuple(s * v.itemsize for s in v.strides),
        )

    def write(self, buffer: Any, values: np.ndarray) -> None:
        buffer[:] = values

    def read(self, buffer: Any) -> np.ndarray:
        return np.array(buffer, np.uint8)


class _Torch:
    def __init__(self) -> None:
        self.torch = pytest.importorskip("torch")

    def buffer(self, nbytes: int) -> Any:
        return self.torch.zeros(nbytes, dtype=self.torch.uint8, device="cuda")

    def view(self, buffer: Any, v: EngineView) -> Any:
        dtype = {1: self.torch.uint8, 2: self.torch.int16, 4: self.torch.int32}[v.itemsize]
        return buffer.view(dtype).as_strided(v.shape, v.strides, v.offset // v.itemsize)

    def write(self, buffer: Any, values: np.ndarray) -> None:
        buffer.copy_(self.torch.from_numpy(values.copy()))
        self.torch.cuda.synchronize()

    def read(self, buffer: Any) -> np.ndarray:
        self.torch.cuda.synchronize()
        return buffer.cpu().numpy().copy()


def _moves(model: Model, rng: np.random.Generator, f: int, rows: list[int]) -> list[GroupMove]:
    """Two chunks per group, block ids distinct across groups (the groups share buffers)."""
    ids = rng.permutation(model.num_blocks)
    moves, used = [], 0
    for g in range(len(model.groups)):
        moves.append(
            GroupMove(
                ids=tuple(int(i) for i in ids[used : used + 2 * f]),
                first=0,
                rows=tuple(rows[2 * g : 2 * g + 2]),
            )
        )
        used += 2 * f
    return moves


@pytest.mark.parametrize("name", EXECUTORS)
@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("f", [1, 2])
@pytest.mark.parametrize("neutral", [False, True], ids=["views", "pages"])
def test_an_engine_layout_round_trips_its_pages_data_and_touches_nothing_else(
    name: str, model_name: str, f: int, neutral: bool
) -> None:
    if name == "cupy":
        pytest.importorskip("cupy")
    backend = _Numpy() if name == "cpu" else _Torch()
    model = engine_model(model_name, NUM_BLOCKS, small=True)
    rng = np.random.default_rng(f)
    buffers = [backend.buffer(n) for n in model.buffer_bytes]
    for b in buffers:
        backend.write(b, rng.integers(0, 256, len(backend.read(b)), dtype=np.uint8))
    executor = make_executor(
        name,
        kv_caches=kv_caches(model, buffers, backend.view, neutral=neutral),
        blocks_per_chunk=f,
        num_rows=ROWS,
    )
    try:
        executor.host_tier.array[:] = 0xAB
        source = [backend.read(b) for b in buffers]
        rows = [int(r) for r in rng.permutation(ROWS)]
        stored = _moves(model, rng, f, rows)
        fingerprint = executor.layout.fingerprint
        executor.submit(bound_plan(1, Direction.STORE, f, stored, fingerprint))
        (result,) = executor.wait([1])
        assert result.success, result.error
        assert result.nbytes == sum(
            len(m.ids) * group_block_bytes(model, g) for g, m in enumerate(stored)
        )
        for b, before in zip(buffers, source, strict=True):
            np.testing.assert_array_equal(backend.read(b), before)
        layout = executor.host_tier.tier
        for g, move in enumerate(stored):  # each group's own region, at its own pitch
            start, pitch = layout.base[g], layout.pitch[g]
            region = executor.host_tier.array[start : start + ROWS * pitch].reshape(ROWS, pitch)
            untouched = sorted(set(range(ROWS)) - set(move.rows))
            assert (region[untouched] == 0xAB).all()
        host_after = executor.host_tier.array.copy()

        for b in buffers:
            backend.write(b, np.full(len(backend.read(b)), POISON, np.uint8))
        targets = _moves(model, rng, f, rows)
        loaded = [
            GroupMove(ids=t.ids, first=0, rows=s.rows) for t, s in zip(targets, stored, strict=True)
        ]
        executor.submit(bound_plan(2, Direction.LOAD, f, loaded, fingerprint))
        (result,) = executor.wait([2])
        assert result.success, result.error
        np.testing.assert_array_equal(executor.host_tier.array, host_after)

        expected = [np.full(len(s), POISON, np.uint8) for s in source]
        for g, (src, dst) in enumerate(zip(stored, loaded, strict=True)):
            for a, b in zip(src.ids, dst.ids, strict=True):
                for (buf, s0, n), (_, d0, _) in zip(
                    data_regions(model, g, a), data_regions(model, g, b), strict=True
                ):
                    expected[buf][d0 : d0 + n] = source[buf][s0 : s0 + n]
        for i, b in enumerate(buffers):
            np.testing.assert_array_equal(backend.read(b), expected[i], err_msg=f"buffer {i}")
    finally:
        executor.close()
