"""The `kvferry` command line: `plan` prints a scenario's plans, `demo` plays an engine serving a
chat workload through kvferry, `bench` runs the benchmarks.

Does the file I/O and environment reading the core never does; holds no planning rule of its own.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

EXIT_FAILED = 1
"""A run failed: a page did not verify (or none was loaded to verify), a transfer failed, a
benchmark failed."""
EXIT_INPUT = 2
"""The command's input was wrong (arguments, configuration, files)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (SIGINT) ended the command: 128 + the signal's number, as shells report it."""


def _plan(args: argparse.Namespace) -> int:
    from kvferry.core.canonical_json import dumps_canonical
    from kvferry.core.scenario import run_scenario
    from kvferry.core.scenario_schema import MAX_SCENARIO_BYTES, parse_scenario

    with Path(args.scenario).open("rb") as file:  # one byte past the limit says "too large"
        data = file.read(MAX_SCENARIO_BYTES + 1)
    sys.stdout.write(dumps_canonical(run_scenario(parse_scenario(data))))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvferry.adapters import demo_shared
    from kvferry.adapters.config import KvferryConfig
    from kvferry.adapters.demo import DemoOptions, ProgressBar, run_demo
    from kvferry.adapters.demo_profiles import ProfileName

    config = KvferryConfig.load(args.config)
    flags: dict[str, Any] = {
        "executor": args.executor,
        "cpu_tier_bytes": args.cpu_tier_bytes,
        "eviction_policy": args.eviction_policy,
        "blocks_per_chunk": args.blocks_per_chunk,
    }
    config = KvferryConfig.from_mapping(
        {k: v for k, v in flags.items() if v is not None}, base=config
    )
    profile = ProfileName.from_name(args.profile)
    options = DemoOptions(
        profile=profile,
        requests=args.requests,
        seed=args.seed,
        config=config,
        tp=args.tp,
        shared_tier=demo_shared.settings_from_args(args, profile.value),
    )
    if options.shared_tier is not None and args.replicas > 1:
        reports = demo_shared.run_replicas(options, args.replicas)
        for report in reports:
            sys.stdout.write((report.to_json() if args.json else report.to_table()) + "\n")
        closing, passed = demo_shared.summary(reports)
        sys.stdout.write(closing)
        return 0 if passed else EXIT_FAILED
    progress = None if args.no_progress else ProgressBar(sys.stderr)
    try:
        report = run_demo(options, progress=progress, warn=_warn)
    finally:
        if progress is not None:
            progress.close()
    sys.stdout.write(report.to_json() if args.json else report.to_table())
    if report.pages_verified == 0:
        print(
            f"kvferry: FAILED: {report.verified} ({report.requests} requests, "
            f"{report.chunks_stored} chunks stored); try more --requests or a larger "
            "--cpu-tier-bytes",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return 0


def _warn(text: str) -> None:
    print(f"kvferry: warning: {text}", file=sys.stderr)


def _bench(args: argparse.Namespace) -> int:
    from kvferry.adapters.bench import (
        BENCHMARKS,
        BenchStatus,
        exit_status,
        run_benchmarks,
        summary_line,
    )

    names = list(BENCHMARKS) if args.name == "all" else [args.name]
    outcomes = run_benchmarks(names, args.args)
    if len(names) > 1 or all(o.status is BenchStatus.SKIPPED for o in outcomes):
        print(summary_line(outcomes))
    return exit_status(outcomes)


def _version() -> str:
    """Return the installed distribution's version (`importlib.metadata`)."""
    try:
        return importlib.metadata.version("kvferry")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _count(text: str, low: int) -> int:
    """Return `text` as an integer >= `low` written in at most 18 ASCII digits (no sign)."""
    if not (text.isascii() and text.isdigit() and len(text) <= 18) or int(text) < low:
        shown = text if len(text) <= 20 else f"{text[:12]}... ({len(text)} characters)"
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {shown!r}")
    return int(text)


def _nonnegative(text: str) -> int:
    return _count(text, 0)


def _positive(text: str) -> int:
    return _count(text, 1)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (argparse prints the usage first)."""

    def error(self, message: str) -> NoReturn:
        """Exit with EXIT_INPUT after one line naming the problem and where help is."""
        self.exit(EXIT_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the `kvferry` command (its subcommands' parsers are of
    the same class: every argument error is one line and exit code 2)."""
    parser = _Parser(prog="kvferry", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"kvferry {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    plan = commands.add_parser("plan", help="print the plans of a planner scenario (JSON)")
    plan.add_argument("scenario", help="a scenario file, e.g. tests/golden/*.scenario.json")
    plan.set_defaults(run=_plan)

    demo = commands.add_parser(
        "demo",
        help="play an engine serving multi-turn chats through kvferry; verify every loaded page",
        description="Play a small inference engine serving a multi-turn chat workload with a GPU "
        "block pool too small for it, offloading to and loading from the CPU tier through "
        "kvferry; every page loaded is verified. Settings: defaults < --config file < "
        "KVFERRY_* variables < flags.",
    )
    demo.add_argument(
        "--profile", default="llama", help="llama (default), gpt-oss, jamba or llama4"
    )
    demo.add_argument("--requests", type=_positive, default=64, help="chat turns (default 64)")
    demo.add_argument("--seed", type=_nonnegative, default=0, help="workload seed (default 0)")
    demo.add_argument("--executor", help="cpu (default), torch or cupy")
    demo.add_argument(
        "--cpu-tier-bytes", help="CPU-tier budget, e.g. 256MiB (default: the profile's)"
    )
    demo.add_argument("--eviction-policy", help="lru (default), arc or tail_first")
    demo.add_argument(
        "--blocks-per-chunk", type=_positive, help="GPU blocks per chunk (default: the profile's)"
    )
    demo.add_argument(
        "--tp",
        type=_positive,
        help="tensor-parallel ranks: N worker processes, one shard of the KV heads each "
        "(cuda:rank for a GPU executor; ranks share GPUs when there are fewer)",
    )
    demo.add_argument("--config", help="a TOML file of settings (docs/configuration.md)")
    demo.add_argument("--json", action="store_true", help="print the report as JSON")
    demo.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (one is drawn on stderr only when it is a terminal)",
    )
    from kvferry.adapters import demo_shared

    demo_shared.add_arguments(demo)
    demo.set_defaults(run=_demo)

    from kvferry.adapters.bench import listing

    bench = commands.add_parser(
        "bench",
        help="run a benchmark (transfer, interference, planner, stress); write its JSON and PNG",
        description="Run a benchmark, or all of them in turn. Each prints a table and one\n"
        "PASS/FAIL line per bar, and writes NAME.json and NAME.png under --out (default\n"
        "bench-out). A benchmark that needs a CUDA GPU says so in one line and is skipped\n"
        "where there is none.",
        epilog="benchmarks:\n"
        + listing()
        + "\n\nexit status: 0 when a benchmark ran (whatever its bars said), 1 when one\n"
        "failed, 2 for bad input, 3 when everything asked for was skipped (nothing was\n"
        "measured).\n\n"
        "examples:\n"
        "  kvferry bench planner --quick\n"
        "  kvferry bench transfer --variants torch --out results\n"
        "  kvferry bench all --quick",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "name",
        nargs="?",
        default="all",
        help="a benchmark, or all (the default: each in turn, with the same options)",
    )
    bench.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="the benchmark's options (kvferry bench NAME --help lists them)",
    )
    bench.set_defaults(run=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `kvferry` command; return its exit status (1: a run failed, e.g. a page did not
    verify, the demo verified no page, a worker process died or a benchmark stopped on an error;
    2: bad input; 3: every benchmark asked for was skipped, as it needs a CUDA GPU; 130:
    interrupted by Ctrl-C, after ending every worker process, with one line on stderr)."""
    try:
        return _run(argv)
    except KeyboardInterrupt:  # raised wherever Ctrl-C struck; cleanup ran on its way here
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the exit
        print("kvferry: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(argv: Sequence[str] | None) -> int:
    # Imported here, not at the top: a Ctrl-C while numpy loads then reaches `main`'s handler.
    from kvferry.adapters.demo_engine import EngineStalledError
    from kvferry.adapters.demo_verify import VerificationFailedError
    from kvferry.adapters.workers import WorkerError
    from kvferry.core.errors import KvferryError, TransferFailedError

    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (VerificationFailedError, TransferFailedError, EngineStalledError, WorkerError) as exc:
        print(f"kvferry: FAILED: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (KvferryError, OSError) as exc:
        print(f"kvferry: error: {exc}", file=sys.stderr)
        return EXIT_INPUT


if __name__ == "__main__":
    raise SystemExit(main())
