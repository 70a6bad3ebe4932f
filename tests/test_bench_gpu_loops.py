"""The GPU benchmarks' measuring loops, run on the CPU with stand-ins for what needs CUDA: the
sweep of `transfer` through the `cpu` executor, and the rounds of `interference` with job
sources and a matmul loop that only keep time. The numbers mean nothing; the loops, the
reports and the files are what is checked."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvferry.benchmarks import interference, transfer
from kvferry.benchmarks.common import names
from kvferry.core.layout import TensorLayout
from kvferry.core.plan import Direction
from kvferry.executors import KVTensor


class _Cuda:
    """The few `torch.cuda` calls the loops make around the measurements."""

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(index: int = 0) -> str:
        return "a stand-in GPU"

    @staticmethod
    def synchronize() -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


class _Torch:
    cuda = _Cuda()


def _host_kv_caches(
    torch: Any, layers: int, page: int, total: int, device: str = "cuda"
) -> tuple[int, int, list[list[KVTensor]]]:
    """`bench_kv_caches` on host arrays."""
    moved = -(-total // (layers * page))
    tensors = [np.zeros((2 * moved, 2, page // 2), dtype=np.uint8) for _ in range(layers)]
    return (
        moved,
        2 * moved,
        [[KVTensor(tensor=t, layout=TensorLayout.BLOCKS_FIRST) for t in tensors]],
    )


def test_the_transfer_sweep_measures_every_page_and_direction_and_judges_the_bars(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(transfer, "bench_kv_caches", _host_kv_caches)
    monkeypatch.setattr(transfer, "pinned_copy_gbps", lambda torch, nbytes, repeat: {
        "store": 10.0, "load": 10.0})  # fmt: skip
    monkeypatch.setattr(
        transfer,
        "_submit_of_2048_block_load",
        lambda torch, variant, repeat, page: {"cpu": 1e-4, "wall": 1e-4},
    )
    args = argparse.Namespace(
        variants=["cpu"],
        pages_kib=[4, 16],
        layers=1,
        gib=1 / 1024,
        repeat=2,
        staging_mib=None,
        rows="catalog",
    )
    results = transfer.run_one_gpu(args, _Torch())
    cells = [(r["page_bytes"] // 1024, r["direction"]) for r in results["results"]]
    assert cells == [(4, "store"), (4, "load"), (16, "store"), (16, "load")]
    assert [bar["bar"].split(" ")[0] for bar in results["bars"]] == ["each", "CPU", "CPU"]
    out = capsys.readouterr().out
    assert out.startswith("measured on a stand-in GPU (driver ")
    assert sum(line.startswith(("PASS: ", "FAIL: ")) for line in out.splitlines()) == 3


class _Jobs(interference._Jobs):
    """Jobs that end a millisecond after they are asked about."""

    def __init__(self) -> None:
        self.pending: list[Direction] = []
        self.closed = False

    def submit(self, direction: Direction) -> None:
        self.pending.append(direction)

    def ended(self) -> list[tuple[Direction, int, float]]:
        time.sleep(0.001)
        done, self.pending = self.pending, []
        return [(d, 1 << 20, 1e-4) for d in done]

    def close(self) -> None:
        self.closed = True


class _Matmul:
    """A matmul loop that takes 5 ms and reports 1 ms a matmul."""

    def __init__(self, torch: Any, count: int, warmup: int, *, priority: int = 0) -> None:
        self._ends = 0.0

    def start(self) -> None:
        self._ends = time.perf_counter() + 0.005

    def done(self) -> bool:
        return time.perf_counter() > self._ends

    def seconds_per_matmul(self) -> float:
        return 1e-3

    def alone(self) -> float:
        return 1e-3


def test_the_interference_rounds_run_every_arm_and_write_the_results(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    made: list[_Jobs] = []

    def make_jobs(torch: Any, variant: str, **_: Any) -> _Jobs:
        made.append(_Jobs())
        return made[-1]

    monkeypatch.setattr(interference, "cuda_torch", lambda name: _Torch())
    monkeypatch.setattr(interference, "bench_kv_caches", _host_kv_caches)
    monkeypatch.setattr(interference, "pinned_copy_gbps", lambda torch, nbytes, repeat: {
        "store": 10.0, "load": 10.0})  # fmt: skip
    monkeypatch.setattr(interference, "_bidirectional_ceiling", lambda *a: 20.0)
    monkeypatch.setattr(interference, "_Matmul", _Matmul)
    monkeypatch.setattr(interference, "_make_jobs", make_jobs)
    argv = ["--quick", "--rounds", "3", "--pages-kib", "16,64", "--window", "0.02"]
    assert interference.main([*argv, "--settle", "0.01", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "interference.json").read_text(encoding="utf-8"))
    arms = [(a["page_kib"], a["variant"]) for a in results["arms"]]
    variants = names(interference.DEFAULT_VARIANTS)
    assert arms == [(page, v) for page in (16, 64) for v in variants]
    assert all(len(page["rounds"]) == 3 for page in results["pages"])
    assert [len(results["bars"]), len(results["references"])] == [2, 4]
    assert all(jobs.closed for jobs in made)
    assert len(made) == 2 * len(variants)
    out = capsys.readouterr().out
    assert sum(line.startswith(("PASS: ", "FAIL: ")) for line in out.splitlines()) == 2
