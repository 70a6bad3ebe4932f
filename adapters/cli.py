"""The `kvferry` command line: `kvferry plan SCENARIO.json` prints a scenario's plans.

Does the file I/O the core never does; holds no planning rule of its own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvferry.core.canonical_json import dumps_canonical
from kvferry.core.codec import parse_object
from kvferry.core.errors import KvferryError
from kvferry.core.scenario import run_scenario


def _plan(args: argparse.Namespace) -> int:
    text = Path(args.scenario).read_text(encoding="utf-8")
    sys.stdout.write(dumps_canonical(run_scenario(parse_object(text))))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the `kvferry` command."""
    parser = argparse.ArgumentParser(prog="kvferry", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="print the plans of a planner scenario (JSON)")
    plan.add_argument("scenario", help="a scenario file, e.g. tests/golden/*.scenario.json")
    plan.set_defaults(run=_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `kvferry` command; return its exit status (2 on a kvferry input error)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (KvferryError, OSError) as exc:
        print(f"kvferry: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
