"""`kvferry bench`: the benchmarks a user runs to judge kvferry on their machine, chosen by name.

A table of names to modules of `kvferry.benchmarks`, each imported only when it runs (so the
command works from an installed package, and importing this module imports no GPU framework).
Each benchmark prints its table and bars and writes its JSON and PNG; this module only picks
them, runs them in turn and sums up what ran.
"""

from __future__ import annotations

import enum
import importlib
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence
from typing import TextIO

import attrs

from kvferry.benchmarks.common import EXIT_SKIPPED
from kvferry.core.errors import InvalidInputError, did_you_mean

EXIT_FAILED = 1
"""A benchmark stopped on an error (the `kvferry` command's status for a failed run)."""


@attrs.frozen(kw_only=True)
class BenchmarkEntry:
    """Where a benchmark lives and what it needs."""

    module: str
    """The module whose `main(argv) -> int` runs it."""
    summary: str
    """What it measures, in one line."""
    needs_gpu: bool
    """Whether it measures nothing without a CUDA GPU."""


BENCHMARKS: dict[str, BenchmarkEntry] = {
    "transfer": BenchmarkEntry(
        module="kvferry.benchmarks.transfer",
        summary="GB/s per executor, direction and page size against a contiguous pinned copy; "
        "time inside submit()",
        needs_gpu=True,
    ),
    "interference": BenchmarkEntry(
        module="kvferry.benchmarks.interference",
        summary="what transfers both ways cost a bf16 matmul loop beside them, and the rate they "
        "keep",
        needs_gpu=True,
    ),
    "planner": BenchmarkEntry(
        module="kvferry.benchmarks.planner",
        summary="planning time on the CPU: a 131072-token lookup + load plan, store planning "
        "for 256 decode requests",
        needs_gpu=False,
    ),
    "stress": BenchmarkEntry(
        module="kvferry.benchmarks.stress",
        summary="10000 requests through the session and the cpu executor: jobs/s, nothing "
        "lost, memory flat",
        needs_gpu=False,
    ),
    "shared-tier": BenchmarkEntry(
        module="kvferry.benchmarks.shared_tier",
        summary="promotion GB/s into CPU rows and lookup latency on Valkey/Redis against a "
        "plain pipelined GET/EXISTS",
        needs_gpu=False,
    ),
}
"""The benchmarks `kvferry bench` runs, in the order it runs them all."""

Main = Callable[[Sequence[str]], int]
"""A benchmark's `main(argv) -> int`."""


class BenchStatus(enum.Enum):
    """How one benchmark went."""

    RAN = "ran"
    """It measured and wrote its results (whatever its bars said)."""
    SKIPPED = "skipped"
    """It measured nothing: the hardware it needs is missing."""
    FAILED = "failed"
    """It stopped on an error."""


@attrs.frozen(kw_only=True)
class BenchOutcome:
    """What happened to one benchmark."""

    name: str
    """Which benchmark."""
    status: BenchStatus
    """Ran, skipped or failed."""


def benchmark_main(name: str) -> Main:
    """Return the `main` of benchmark `name`, importing its module now; raise InvalidInputError
    (with a "did you mean") for a name that is not a benchmark."""
    entry = BENCHMARKS.get(name)
    if entry is None:
        raise InvalidInputError(
            field="benchmark",
            expected="one of " + ", ".join(BENCHMARKS) + did_you_mean(name, BENCHMARKS),
            got=name,
        )
    main: Main = importlib.import_module(entry.module).main
    return main


def run_benchmarks(
    names: Sequence[str],
    argv: Sequence[str] = (),
    *,
    log: TextIO | None = None,
    mains: Callable[[str], Main] = benchmark_main,
) -> list[BenchOutcome]:
    """Run the benchmarks `names` in turn, each with the arguments `argv`; return how each went.

    A benchmark that returns `EXIT_SKIPPED` skipped itself (it says why); one that raises
    or returns another non-zero status failed (said on `log`, standard error by default), and
    the next one still runs.
    """
    log = log or sys.stderr
    outcomes = []
    for name in names:
        main = mains(name)
        if len(names) > 1:
            print(f"== kvferry bench {name}", flush=True)
        try:
            status = main(list(argv))
        except Exception:  # one benchmark's error must not lose the others' results
            traceback.print_exc(file=log)
            status = EXIT_FAILED
        if status == 0:
            outcome = BenchStatus.RAN
        elif status == EXIT_SKIPPED:
            outcome = BenchStatus.SKIPPED
        else:
            outcome = BenchStatus.FAILED
            print(f"kvferry bench {name}: FAILED (exit status {status})", file=log)
        outcomes.append(BenchOutcome(name=name, status=outcome))
    return outcomes


def exit_status(outcomes: Sequence[BenchOutcome]) -> int:
    """Return the command's exit status: `EXIT_FAILED` when a benchmark failed, else 0 when one
    ran, else `EXIT_SKIPPED` (everything asked for was skipped: nothing was measured)."""
    if any(o.status is BenchStatus.FAILED for o in outcomes):
        return EXIT_FAILED
    if any(o.status is BenchStatus.RAN for o in outcomes):
        return 0
    return EXIT_SKIPPED


def summary_line(outcomes: Sequence[BenchOutcome]) -> str:
    """Return one line saying which benchmarks ran, were skipped and failed."""
    if all(o.status is BenchStatus.SKIPPED for o in outcomes):
        names = [o.name for o in outcomes]
        return (
            f"kvferry bench: nothing was measured: {', '.join(names)} "
            f"{'needs' if len(names) == 1 else 'need'} a CUDA GPU"
        )
    parts = []
    for status in BenchStatus:
        names = [o.name for o in outcomes if o.status is status]
        if names:
            parts.append(f"{status.value} {', '.join(names)}")
    return "kvferry bench: " + "; ".join(parts)


def listing(width: int = 79) -> str:
    """Return the benchmarks' names, what each measures and what it needs, one paragraph each,
    wrapped at `width`."""
    return "\n".join(
        textwrap.fill(
            f"{entry.summary} ({'needs a CUDA GPU' if entry.needs_gpu else 'CPU only'})",
            width=width,
            initial_indent=f"  {name:<13} ",
            subsequent_indent=" " * 16,
        )
        for name, entry in BENCHMARKS.items()
    )
