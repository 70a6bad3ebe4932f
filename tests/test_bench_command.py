"""`kvferry bench`: benchmarks chosen by name, skipped in one line without a GPU, and an exit
status that tells a run that measured something from one that measured nothing."""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvferry.adapters import cli
from kvferry.adapters.bench import (
    BENCHMARKS,
    EXIT_FAILED,
    BenchOutcome,
    BenchStatus,
    Main,
    benchmark_main,
    exit_status,
    run_benchmarks,
    summary_line,
)
from kvferry.benchmarks.common import EXIT_SKIPPED
from kvferry.core.errors import InvalidInputError


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torch, where it is installed, see no CUDA GPU."""
    if importlib.util.find_spec("torch") is not None:
        torch = importlib.import_module("torch")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_the_five_benchmarks_are_known_by_name() -> None:
    assert list(BENCHMARKS) == ["transfer", "interference", "planner", "stress", "shared-tier"]


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_each_benchmark_imports_by_name_to_a_main(name: str) -> None:
    assert callable(benchmark_main(name))


def test_an_unknown_benchmark_is_refused_with_the_closest_name() -> None:
    with pytest.raises(InvalidInputError, match="did you mean 'planner'"):
        benchmark_main("planer")


def test_the_command_exits_2_for_an_unknown_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "transfr"]) == 2
    assert "did you mean 'transfer'" in capsys.readouterr().err


@pytest.mark.usefixtures("no_cuda")
@pytest.mark.parametrize("name", ["transfer", "interference"])
def test_a_gpu_benchmark_without_cuda_says_so_in_one_line_and_exits_3(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", name, "--out", str(tmp_path)]) == EXIT_SKIPPED
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"kvferry bench {name}: skipped: it needs a CUDA GPU")
    assert out[1] == f"kvferry bench: nothing was measured: {name} needs a CUDA GPU"
    assert list(tmp_path.iterdir()) == []


def test_the_planner_runs_ci_sized_and_writes_its_json_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "planner", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "planner.json").read_text(encoding="utf-8"))
    assert list(results["long"]) == ["plan", "pin", "cold"]  # the engine rows need no --quick
    assert list(results["store"]) == ["plan", "reserve"]
    assert len(results["bars"]) == 4
    verdicts = [line for line in out.splitlines() if line.startswith(("PASS: ", "FAIL: "))]
    assert [line.split(": ")[1] for line in verdicts] == [bar["bar"] for bar in results["bars"]]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "planner.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _main(status: int, calls: list[Sequence[str]]) -> Main:
    def main(argv: Sequence[str]) -> int:
        calls.append(argv)
        return status

    return main


def test_every_benchmark_gets_the_same_arguments() -> None:
    calls: list[Sequence[str]] = []
    run_benchmarks(["planner", "stress"], ["--quick"], mains=lambda _: _main(0, calls))
    assert calls == [["--quick"], ["--quick"]]


def test_a_benchmark_that_raises_fails_and_the_next_one_still_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    calls: list[Sequence[str]] = []

    def mains(name: str) -> Main:
        if name == "transfer":

            def broken(argv: Sequence[str]) -> int:
                raise RuntimeError("the link is down")

            return broken
        return _main(0, calls)

    log = io.StringIO()
    outcomes = run_benchmarks(["transfer", "planner"], [], mains=mains, log=log)
    assert [o.status for o in outcomes] == [BenchStatus.FAILED, BenchStatus.RAN]
    assert "the link is down" in log.getvalue()
    assert exit_status(outcomes) == EXIT_FAILED


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        ([BenchStatus.SKIPPED, BenchStatus.RAN], 0),
        ([BenchStatus.SKIPPED, BenchStatus.SKIPPED], EXIT_SKIPPED),
        ([BenchStatus.RAN, BenchStatus.FAILED], EXIT_FAILED),
        ([BenchStatus.SKIPPED, BenchStatus.FAILED], EXIT_FAILED),
    ],
)
def test_the_exit_status_is_0_only_when_something_ran_and_nothing_failed(
    statuses: list[BenchStatus], expected: int
) -> None:
    outcomes = [BenchOutcome(name=f"b{i}", status=s) for i, s in enumerate(statuses)]
    assert exit_status(outcomes) == expected


def test_a_benchmark_that_skips_itself_is_reported_skipped() -> None:
    (outcome,) = run_benchmarks(["transfer"], mains=lambda _: _main(EXIT_SKIPPED, []))
    assert outcome.status is BenchStatus.SKIPPED


def test_the_summary_names_what_ran_and_what_was_skipped() -> None:
    outcomes = [
        BenchOutcome(name="transfer", status=BenchStatus.SKIPPED),
        BenchOutcome(name="planner", status=BenchStatus.RAN),
        BenchOutcome(name="stress", status=BenchStatus.RAN),
    ]
    assert summary_line(outcomes) == "kvferry bench: ran planner, stress; skipped transfer"


def test_a_run_that_skipped_everything_says_nothing_was_measured() -> None:
    outcomes = [
        BenchOutcome(name="transfer", status=BenchStatus.SKIPPED),
        BenchOutcome(name="interference", status=BenchStatus.SKIPPED),
    ]
    assert summary_line(outcomes) == (
        "kvferry bench: nothing was measured: transfer, interference need a CUDA GPU"
    )
