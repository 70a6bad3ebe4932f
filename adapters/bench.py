"""`kvferry bench`: runs the repository's benchmark scripts and plots what they measured.

Starts the scripts as subprocesses and draws a PNG when matplotlib is importable; it never
measures anything itself and never installs anything.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs


class Benchmark(enum.Enum):
    """The benchmark scripts `kvferry bench` knows; the value is the script's name."""

    TRANSFER = "transfer"
    """`benchmarks/transfer.py`: GB/s per executor, direction and page size (needs a GPU)."""
    PLANNER = "planner"
    """`benchmarks/planner.py`: planning time (skipped while the script is absent)."""


class BenchStatus(enum.Enum):
    """How one benchmark went."""

    RAN = "ran"
    """It ran and exited 0."""
    FAILED = "failed"
    """It ran and exited non-zero."""
    SKIPPED = "skipped"
    """It was not run (script absent, or its hardware missing)."""


@attrs.frozen(kw_only=True)
class BenchOutcome:
    """What happened to one benchmark."""

    benchmark: Benchmark
    """Which benchmark."""
    status: BenchStatus
    """Ran, failed or skipped."""
    reason: str = ""
    """Why it was skipped or failed."""
    json_path: Path | None = None
    """Its JSON results, when it wrote some."""
    plot_path: Path | None = None
    """The PNG drawn from them, when matplotlib was importable."""


Runner = Callable[[Sequence[str]], int]
"""Runs a command line; returns its exit status (tests replace it)."""


def _run(command: Sequence[str]) -> int:
    return subprocess.run(list(command), check=False).returncode


def cuda_available() -> bool:
    """Return True when torch is installed and sees a CUDA device (imports torch if present)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def _help_mentions(script: Path, flag: str) -> bool:
    """Return True when the script's `--help` mentions `flag`."""
    done = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, check=False
    )
    return flag in done.stdout


def run_benchmarks(
    *,
    benchmarks: Path,
    out: Path,
    which: Sequence[Benchmark] = tuple(Benchmark),
    extra: Sequence[str] = (),
    runner: Runner = _run,
    has_gpu: Callable[[], bool] = cuda_available,
    log: TextIO = sys.stderr,
) -> list[BenchOutcome]:
    """Run the benchmarks in `which` from the folder `benchmarks`, writing JSON (and a PNG
    per benchmark, when matplotlib is importable) under `out`; return one outcome each.

    `transfer` needs a CUDA GPU and is skipped without one; `planner` is skipped when its
    script is absent. `extra` arguments go to every script.
    """
    out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for benchmark in which:
        name = benchmark.value
        script = benchmarks / f"{name}.py"
        if not script.is_file():
            outcomes.append(
                BenchOutcome(
                    benchmark=benchmark, status=BenchStatus.SKIPPED, reason=f"{script} not found"
                )
            )
            continue
        if name == "transfer" and not has_gpu():
            outcomes.append(
                BenchOutcome(
                    benchmark=benchmark,
                    status=BenchStatus.SKIPPED,
                    reason="needs torch and a CUDA GPU",
                )
            )
            continue
        json_path = out / f"{name}.json"
        command = [sys.executable, str(script), *extra]
        if benchmark is Benchmark.TRANSFER or _help_mentions(script, "--json"):
            command += ["--json", str(json_path)]
        print(f"kvferry bench: {' '.join(command)}", file=log)
        status = runner(command)
        if status != 0:
            outcomes.append(
                BenchOutcome(
                    benchmark=benchmark, status=BenchStatus.FAILED, reason=f"exit status {status}"
                )
            )
            continue
        written = json_path if json_path.is_file() else None
        plot = None
        if written is not None:
            draw = plot_transfer if benchmark is Benchmark.TRANSFER else plot_planner
            plot = draw(written, out / f"{name}.png", log=log)
        outcomes.append(
            BenchOutcome(
                benchmark=benchmark, status=BenchStatus.RAN, json_path=written, plot_path=plot
            )
        )
    return outcomes


def _save(
    plt: Any, figure: Any, axis: Any, png: Path, *, xlabel: str, ylabel: str, title: str
) -> Path:
    """Finish a plot of either benchmark (log2 x axis, labels, legend), write it; return `png`."""
    axis.set_xscale("log", base=2)
    axis.set_ylim(bottom=0)  # ratios read true only from zero
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.set_title(f"kvferry {title}")
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(png, dpi=120)
    plt.close(figure)
    return png


def plot_transfer(results: Path, png: Path, *, log: TextIO = sys.stderr) -> Path | None:
    """Draw GB/s against page size per executor and direction, with the pinned-copy ceilings,
    from `benchmarks/transfer.py`'s JSON; return the PNG's path, or None (and say so on `log`)
    when matplotlib is not installed."""
    plt = _pyplot(log)
    if plt is None:
        return None
    data: dict[str, Any] = json.loads(results.read_text(encoding="utf-8"))
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for row in data.get("results", []):
        key = (str(row["executor"]), str(row["direction"]))
        series.setdefault(key, []).append((int(row["page_bytes"]), float(row["gbps"])))
    figure, axis = plt.subplots(figsize=(8, 5))
    for (executor, direction), points in sorted(series.items()):
        points.sort()
        axis.plot(
            [p / 1024 for p, _ in points],
            [g for _, g in points],
            marker="o",
            linestyle="-" if direction == "store" else "--",
            label=f"{executor} {direction}",
        )
    for direction, gbps in data.get("ceiling_gbps", {}).items():
        axis.axhline(float(gbps), color="grey", linewidth=0.8, linestyle=":")
        axis.annotate(f"ceiling {direction} {float(gbps):.1f}", (1, float(gbps)), fontsize=7)
    return _save(
        plt,
        figure,
        axis,
        png,
        xlabel="page (KiB)",
        ylabel="GB/s",
        title=f"transfer, {data.get('device', 'GPU')}"
        + (f"\n{data['jobs']}" if data.get("jobs") else ""),
    )


def plot_planner(results: Path, png: Path, *, log: TextIO = sys.stderr) -> Path | None:
    """Draw planning milliseconds against `F` (lookup, lookup + load plan, store step) from
    `benchmarks/planner.py`'s JSON; return the PNG's path, or None (said on `log`) without
    matplotlib."""
    plt = _pyplot(log)
    if plt is None:
        return None
    data: dict[str, Any] = json.loads(results.read_text(encoding="utf-8"))
    curves = (
        ("lookup", "lookup_ms", "lookup"),
        ("lookup", "lookup_and_load_ms", "lookup + load plan"),
        ("store", "step_ms_mean", "store planning per step (mean)"),
    )
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for section, field, label in curves:
        rows = [r for r in data.get(section, []) if field in r and "blocks_per_chunk" in r]
        if rows:
            rows.sort(key=lambda r: int(r["blocks_per_chunk"]))
            axis.plot(
                [int(r["blocks_per_chunk"]) for r in rows],
                [float(r[field]) for r in rows],
                marker="o",
                label=label,
            )
    return _save(
        plt,
        figure,
        axis,
        png,
        xlabel="blocks per chunk (F)",
        ylabel="ms",
        title=f"planner, {data.get('machine', '')}",
    )


def plot_interference(results: Path, png: Path, *, log: TextIO = sys.stderr) -> Path | None:
    """Draw, per variant, the combined (store + load) GB/s during the matmul loop against page
    size, each point labelled with the matmul's slowdown, with the bidirectional ceiling and
    target 2's 0.90 of it, from `benchmarks/interference.py`'s JSON; return the PNG's path, or
    None (said on `log`) without matplotlib."""
    plt = _pyplot(log)
    if plt is None:
        return None
    data: dict[str, Any] = json.loads(results.read_text(encoding="utf-8"))
    series: dict[str, list[tuple[int, float, float]]] = {}
    for row in data.get("results", []):
        together = row.get("together", {})
        gbps = sum(float(together.get(d, {}).get("gbps", float("nan"))) for d in ("store", "load"))
        series.setdefault(str(row["variant"]), []).append(
            (int(row["page_kib"]), gbps, 100 * float(row["slowdown"]))
        )
    figure, axis = plt.subplots(figsize=(8, 5))
    for variant, points in sorted(series.items()):
        points.sort()
        axis.plot([p for p, _, _ in points], [g for _, g, _ in points], marker="o", label=variant)
        for page, gbps, slowdown in points:
            axis.annotate(f"{slowdown:+.1f}%", (page, gbps), fontsize=6)
    bidirectional = data.get("ceiling_gbps", {}).get("bidirectional")
    if bidirectional is not None:
        for share, style in ((1.0, ":"), (0.9, "--")):
            level = share * float(bidirectional)
            axis.axhline(level, color="grey", linewidth=0.8, linestyle=style)
            axis.annotate(f"{share:.2f} x both-ways ceiling", (16, level), fontsize=7)
    return _save(
        plt,
        figure,
        axis,
        png,
        xlabel="page (KiB)",
        ylabel="store + load GB/s beside the matmul (labels: matmul slowdown)",
        title=f"interference, {data.get('device', 'GPU')}",
    )


def _pyplot(log: TextIO) -> Any:
    """Return matplotlib.pyplot on the Agg backend, or None (said on `log`) when matplotlib is
    not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        print(
            "kvferry bench: matplotlib is not installed, no plot drawn "
            "(pip install matplotlib, or the 'kvferry[bench]' extra)",
            file=log,
        )
        return None
    matplotlib: Any = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")
