"""The bars and plot of `kvferry bench transfer` (its measurement needs a GPU), and a short
`kvferry bench stress` run on the CPU."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from kvferry.benchmarks import stress, transfer


def _row(executor: str, direction: str, ratio: float, submit_cpu: float = 0.001) -> dict[str, Any]:
    return {
        "executor": executor,
        "direction": direction,
        "page_bytes": 16 * 1024,
        "ratio_to_ceiling": ratio,
        "seconds": 0.02,
        "submit_seconds": submit_cpu,
        "submit_cpu_seconds": submit_cpu,
        "gbps": 50.0 * ratio,
    }


def test_the_direction_bar_is_judged_on_the_worst_cell() -> None:
    rows = [_row("torch", "store", 0.99), _row("torch", "load", 0.91), _row("cupy", "load", 0.98)]
    first = transfer.bars(rows, {})[0]
    assert not first["passed"]
    assert first["measured"].startswith("worst 0.91 (torch load 16 KiB)")


def test_the_submit_share_bar_reads_the_cpu_time_inside_submit() -> None:
    rows = [_row("torch", "store", 0.99, submit_cpu=0.0009), _row("cupy", "load", 0.99)]
    assert transfer.bars(rows, {})[1]["passed"]
    rows.append(_row("cupy", "store", 0.99, submit_cpu=0.0011))
    assert not transfer.bars(rows, {})[1]["passed"]


def test_a_2048_block_load_over_200_us_fails_its_bar() -> None:
    rows = [_row("torch", "store", 0.99)]
    fast = {"torch 16 KiB pages": {"cpu": 150e-6, "wall": 151e-6}}
    slow = {**fast, "cupy 16 KiB pages": {"cpu": 210e-6, "wall": 212e-6}}
    assert transfer.bars(rows, fast)[2]["passed"]
    assert not transfer.bars(rows, slow)[2]["passed"]


def test_the_transfer_plot_is_a_png_when_matplotlib_is_installed(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = tmp_path / "transfer.json"
    data = {"ceiling_gbps": {"store": 55.0}, "results": [_row("torch", "store", 0.98)]}
    results.write_text(json.dumps(data), encoding="utf-8")
    png = transfer.plot(results, tmp_path / "transfer.png", log=io.StringIO())
    assert png is not None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_short_stress_run_loses_no_job_and_writes_its_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert stress.main(["--requests", "150", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "stress.json").read_text(encoding="utf-8"))
    verdicts = {bar["bar"]: bar["passed"] for bar in results["bars"]}
    assert verdicts["no job lost: every job issued was reported"]
    assert results["jobs"]["failed"] == 0
    assert "PASS: no job lost" in capsys.readouterr().out
