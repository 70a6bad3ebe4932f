"""`kvferry bench`: which benchmarks run, which are skipped and why, and the plot."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvferry.adapters import cli
from kvferry.adapters.bench import (
    Benchmark,
    BenchStatus,
    plot_interference,
    plot_planner,
    plot_transfer,
    run_benchmarks,
)


class Recorder:
    """Records commands instead of running them; writes the JSON a script would."""

    def __init__(self, status: int = 0) -> None:
        self.status = status
        self.commands: list[list[str]] = []

    def __call__(self, command: Sequence[str]) -> int:
        self.commands.append(list(command))
        if "--json" in command:
            path = Path(command[command.index("--json") + 1])
            path.write_text(json.dumps({"results": [], "ceiling_gbps": {}}), encoding="utf-8")
        return self.status


def scripts(tmp_path: Path, *names: str) -> Path:
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    for name in names:
        (folder / f"{name}.py").write_text("print('ok')\n", encoding="utf-8")
    return folder


def test_the_transfer_benchmark_is_skipped_without_a_gpu(tmp_path: Path) -> None:
    runner = Recorder()
    (outcome,) = run_benchmarks(
        benchmarks=scripts(tmp_path, "transfer"),
        out=tmp_path / "out",
        which=[Benchmark.TRANSFER],
        runner=runner,
        has_gpu=lambda: False,
        log=io.StringIO(),
    )
    assert outcome.status is BenchStatus.SKIPPED
    assert "CUDA" in outcome.reason
    assert runner.commands == []


def test_an_absent_planner_benchmark_is_skipped(tmp_path: Path) -> None:
    (outcome,) = run_benchmarks(
        benchmarks=scripts(tmp_path),
        out=tmp_path / "out",
        which=[Benchmark.PLANNER],
        runner=Recorder(),
        log=io.StringIO(),
    )
    assert outcome.status is BenchStatus.SKIPPED
    assert "not found" in outcome.reason


def test_the_transfer_benchmark_runs_with_a_json_path_on_a_gpu(tmp_path: Path) -> None:
    runner = Recorder()
    (outcome,) = run_benchmarks(
        benchmarks=scripts(tmp_path, "transfer"),
        out=tmp_path / "out",
        which=[Benchmark.TRANSFER],
        extra=["--repeat", "1"],
        runner=runner,
        has_gpu=lambda: True,
        log=io.StringIO(),
    )
    assert outcome.status is BenchStatus.RAN
    assert outcome.json_path == tmp_path / "out" / "transfer.json"
    (command,) = runner.commands
    assert command[0] == sys.executable
    assert command[2:] == ["--repeat", "1", "--json", str(tmp_path / "out" / "transfer.json")]


def test_a_failing_benchmark_is_reported_failed(tmp_path: Path) -> None:
    (outcome,) = run_benchmarks(
        benchmarks=scripts(tmp_path, "planner"),
        out=tmp_path / "out",
        which=[Benchmark.PLANNER],
        runner=Recorder(status=3),
        log=io.StringIO(),
    )
    assert outcome.status is BenchStatus.FAILED
    assert outcome.reason == "exit status 3"


def test_the_plot_is_skipped_with_a_note_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    results = tmp_path / "transfer.json"
    results.write_text(json.dumps({"results": []}), encoding="utf-8")
    log = io.StringIO()
    assert plot_transfer(results, tmp_path / "transfer.png", log=log) is None
    assert "matplotlib is not installed" in log.getvalue()


def test_the_plot_is_a_png_when_matplotlib_is_installed(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = tmp_path / "transfer.json"
    row = {"executor": "torch", "direction": "store", "page_bytes": 4096, "gbps": 9.0}
    data = {"device": "GPU", "ceiling_gbps": {"store": 55.0}, "results": [row]}
    results.write_text(json.dumps(data), encoding="utf-8")
    png = plot_transfer(results, tmp_path / "transfer.png", log=io.StringIO())
    assert png is not None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_reports_skips_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = scripts(tmp_path)
    assert cli.main(["bench", "--benchmarks", str(folder), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "planner: skipped" in out
    assert "transfer: skipped" in out


def test_the_planner_plot_is_a_png_when_matplotlib_is_installed(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = tmp_path / "planner.json"
    rows = [
        {"blocks_per_chunk": f, "lookup_ms": 1.0 / f, "lookup_and_load_ms": 2.0} for f in (1, 4)
    ]
    results.write_text(json.dumps({"machine": "m", "lookup": rows, "store": []}), encoding="utf-8")
    png = plot_planner(results, tmp_path / "planner.png", log=io.StringIO())
    assert png is not None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_interference_plot_is_a_png_when_matplotlib_is_installed(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = tmp_path / "interference.json"
    row = {
        "variant": "cupy",
        "page_kib": 16,
        "slowdown": 0.05,
        "together": {"store": {"gbps": 40.0}, "load": {"gbps": 41.0}},
    }
    data = {"device": "GPU", "ceiling_gbps": {"bidirectional": 100.0}, "results": [row]}
    results.write_text(json.dumps(data), encoding="utf-8")
    png = plot_interference(results, tmp_path / "interference.png", log=io.StringIO())
    assert png is not None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
