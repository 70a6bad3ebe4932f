"""What every benchmark shares: where its files go, what it was measured on, the GPU check, the
PASS/FAIL lines and the plot backend."""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, TextIO

EXIT_SKIPPED = 3
"""A benchmark's exit status when it measured nothing because the hardware it needs (a CUDA GPU)
is missing; 0 means it ran, whatever its bars said."""

NO_GPU = "no GPU"
"""`measured_on`'s GPU for a benchmark that used none."""

DEFAULT_OUT = Path("bench-out")
"""Where a benchmark writes `NAME.json` and `NAME.png` unless `--out` says otherwise."""


def add_common_options(parser: argparse.ArgumentParser, *, quick: str) -> None:
    """Add `--out` and `--quick` (whose help is `quick`: what the short run leaves out)."""
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"folder for the JSON results and the PNG plot (default {DEFAULT_OUT})",
    )
    parser.add_argument("--quick", action="store_true", help=quick)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def names(text: str) -> list[str]:
    """An argparse type: comma-separated names."""
    return [name for name in text.split(",") if name]


def kib_list(text: str) -> list[int]:
    """An argparse type: comma-separated page sizes in KiB, each >= 1."""
    return [positive_int(part) for part in text.split(",")]


def output_paths(out: Path, name: str) -> tuple[Path, Path]:
    """Create `out` if needed; return the paths of benchmark `name`'s JSON and PNG in it."""
    out.mkdir(parents=True, exist_ok=True)
    return out / f"{name}.json", out / f"{name}.png"


def write_json(path: Path, data: Any) -> None:
    """Write a benchmark's results to `path` as indented JSON."""
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def cuda_torch(name: str, *, log: TextIO | None = None) -> Any:
    """Return torch when it sees a CUDA GPU; else print one line on `log` (standard output by
    default) saying that benchmark `name` needs one and is skipped, and return None."""
    why = ""
    if importlib.util.find_spec("torch") is None:
        why = "torch is not installed"
    else:
        torch: Any = importlib.import_module("torch")
        if torch.cuda.is_available():
            return torch
        why = "torch sees no CUDA GPU"
    print(f"kvferry bench {name}: skipped: it needs a CUDA GPU, and {why}", file=log or sys.stdout)
    return None


def _run(command: list[str], cwd: Path | None = None) -> str:
    """Return the stripped output of `command`, or "" when it cannot run or fails."""
    try:
        done = subprocess.run(
            command, cwd=cwd, capture_output=True, text=True, check=False, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _cpu() -> str:
    """Return the CPU's model name and how many this process may use."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{count} x {model}"


def _kvferry_version() -> str:
    """Return kvferry's installed version, with the commit when it runs from a git checkout of
    kvferry (an installed copy has none)."""
    try:
        version = importlib.metadata.version("kvferry")
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    root = Path(__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    commit = ""
    if pyproject.is_file() and 'name = "kvferry"' in pyproject.read_text(encoding="utf-8"):
        commit = _run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=root)
    return f"{version} ({commit})" if commit else version


def measured_on(torch: Any = None) -> dict[str, str]:
    """Return what a result was measured on: the GPU and its driver (when `torch` is given), the
    CPU, Python, today's date (UTC) and kvferry's version."""
    gpu = NO_GPU
    if torch is not None:
        index = torch.cuda.current_device()
        driver = _run(
            [
                "nvidia-smi",
                "--query-gpu=driver_version",
                "--format=csv,noheader",
                "-i",
                str(index),
            ]
        )
        gpu = f"{torch.cuda.get_device_name(index)} (driver {driver or 'unknown'})"
    return {
        "gpu": gpu,
        "cpu": _cpu(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "kvferry": _kvferry_version(),
    }


def measured_on_line(info: dict[str, str]) -> str:
    """Return `measured_on`'s answer as one line (the GPU left out when none was used)."""
    gpu = "" if info["gpu"] == NO_GPU else f"{info['gpu']}, "
    return (
        f"measured on {gpu}{info['cpu']}, Python {info['python']}, {info['date']}, "
        f"kvferry {info['kvferry']}"
    )


def bar_line(passed: bool, bar: str, measured: str) -> str:
    """Return the PASS/FAIL line of one bar: the verdict, what the bar checks, what was measured."""
    return f"{'PASS' if passed else 'FAIL'}: {bar}: {measured}"


def bar_result(passed: bool, bar: str, measured: str) -> dict[str, Any]:
    """Return one bar's verdict as the JSON results hold it."""
    return {"bar": bar, "passed": passed, "measured": measured}


def pyplot(log: TextIO | None) -> Any:
    """Return matplotlib.pyplot on the Agg backend, or None (said on `log`, standard error by
    default) when matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        print(
            "kvferry bench: matplotlib is not installed, so no plot was drawn "
            "(pip install -e '.[bench]' in a kvferry checkout)",
            file=log or sys.stderr,
        )
        return None
    matplotlib: Any = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def save_plot(plt: Any, figure: Any, png: Path, title: str) -> Path:
    """Title `figure`, write it to `png` and close it; return `png`."""
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(png, dpi=120)
    plt.close(figure)
    return png


def finish_axis(axis: Any, *, xlabel: str, ylabel: str, log2_x: bool = True) -> None:
    """Label an axis, start its y axis at zero (ratios read true only from zero), and add the
    legend when something is labelled."""
    if log2_x:
        axis.set_xscale("log", base=2)
        axis.xaxis.set_major_formatter(lambda value, _position: f"{value:g}")
    axis.set_ylim(bottom=0)
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=7)


def own_stream(torch: Any, *, priority: int = 0) -> Any:
    """Return a torch stream that no one else holds, made through the CUDA driver (alive until
    the process ends).

    `torch.cuda.Stream()` hands out streams round robin from a pool of 32 per priority, so a
    benchmark that asks for more gets one stream twice: an executor's idle compute stream, or a
    pinned copy's, could then be the matmul loop's.
    """
    from kvferry.executors.driver import CudaDriver

    torch.cuda.synchronize()  # makes torch's CUDA context current: the driver call uses it
    return torch.cuda.ExternalStream(CudaDriver().stream(priority=priority))
