"""The `kvferry` command line: `plan` prints a scenario's plans, `demo` plays an engine serving a
chat workload through kvferry, `bench` runs the benchmarks.

Does the file I/O and environment reading the core never does; holds no planning rule of its own.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

EXIT_FAILED = 1
"""A run failed: a page did not verify, a transfer failed, a benchmark failed."""
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
    from kvferry.adapters.config import KvferryConfig
    from kvferry.adapters.demo import DemoOptions, ProgressLine, run_demo
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
    options = DemoOptions(
        profile=ProfileName.from_name(args.profile),
        requests=args.requests,
        seed=args.seed,
        config=config,
        tp=args.tp,
    )
    progress = None if args.no_progress else ProgressLine(sys.stderr)
    try:
        report = run_demo(options, progress=progress)
    finally:
        if progress is not None:
            progress.close()
    sys.stdout.write(report.to_json() if args.json else report.to_table())
    return 0


def _bench(args: argparse.Namespace) -> int:
    from kvferry.adapters.bench import Benchmark, BenchStatus, run_benchmarks

    outcomes = run_benchmarks(
        benchmarks=Path(args.benchmarks),
        out=Path(args.out),
        which=[Benchmark(name) for name in args.only] if args.only else tuple(Benchmark),
        extra=args.args,
    )
    for outcome in outcomes:
        line = f"{outcome.benchmark.value}: {outcome.status.value}"
        if outcome.reason:
            line += f" ({outcome.reason})"
        for path in (outcome.json_path, outcome.plot_path):
            if path is not None:
                line += f"; wrote {path}"
        print(line)
    return EXIT_FAILED if any(o.status is BenchStatus.FAILED for o in outcomes) else 0


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
    demo.add_argument("--profile", default="llama", help="llama (default), gpt-oss or jamba")
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
    demo.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    demo.set_defaults(run=_demo)

    bench = commands.add_parser(
        "bench", help="run benchmarks/transfer.py (GPU) and benchmarks/planner.py; plot them"
    )
    bench.add_argument("--benchmarks", default="benchmarks", help="the scripts' folder")
    bench.add_argument("--out", default="bench-out", help="where JSON and PNG files go")
    bench.add_argument(
        "--only", action="append", choices=("transfer", "planner"), help="run only this one"
    )
    bench.add_argument("args", nargs="*", help="arguments for the scripts (after --)")
    bench.set_defaults(run=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `kvferry` command; return its exit status (1: a run failed, e.g. a page did not
    verify or a worker process died; 2: bad input; 130: interrupted by Ctrl-C, after ending
    every worker process, with one line on stderr)."""
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
