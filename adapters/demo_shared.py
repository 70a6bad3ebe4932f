"""`kvferry demo --shared-tier URL [--replicas N]`: engines sharing one Valkey/Redis tier.

Each replica is a separate engine process with its own GPU block pool, CPU tier, session and
executor; all of them use one server below their CPU tiers. Replicas run one after the other
(each starts once the one before has finished and written its stores behind), all with the
same workload and page patterns, so that replica B's requests find the prefixes replica A
computed in the shared tier, promote them into B's CPU rows and load them; every loaded page
is verified, as in the one-engine demo.
"""

from __future__ import annotations

import argparse
import multiprocessing
import string
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from kvferry.adapters.demo_report import DemoReport
from kvferry.adapters.shared_tier import SharedTierSettings, WriteBehind
from kvferry.core.errors import InvalidInputError

if TYPE_CHECKING:  # the demo's modules load when a demo runs, not with the parser
    from kvferry.adapters.demo import DemoOptions


def add_arguments(demo: argparse.ArgumentParser) -> None:
    """Add the shared tier's flags to the demo's parser."""
    group = demo.add_argument_group("shared tier (docs/shared-tier.md)")
    group.add_argument(
        "--shared-tier",
        metavar="URL",
        help="a Valkey/Redis server below the CPU tier: redis://HOST:PORT (valkey:// works; "
        "rediss:// or valkeys:// for TLS)",
    )
    group.add_argument(
        "--replicas",
        type=_positive,
        default=1,
        help="engine processes sharing the tier, run one after the other (default 1)",
    )
    group.add_argument(
        "--shared-tier-cluster",
        action="store_true",
        help="the URL names one node of a Valkey/Redis Cluster (the others are discovered)",
    )
    group.add_argument("--shared-tier-user", help="ACL user (AUTH user password)")
    group.add_argument(
        "--shared-tier-password-file",
        help="a file holding the password (its first line); never printed",
    )
    group.add_argument("--shared-tier-tls-ca", help="CA bundle verifying the server (TLS)")
    group.add_argument("--shared-tier-tls-cert", help="client certificate (TLS)")
    group.add_argument("--shared-tier-tls-key", help="client certificate's key (TLS)")
    group.add_argument(
        "--shared-tier-timeout",
        type=float,
        default=0.5,
        help="seconds a request to the server may take before its chunks are recomputed "
        "(default 0.5)",
    )
    group.add_argument(
        "--write-behind",
        choices=[mode.value for mode in WriteBehind],
        default=WriteBehind.ON_STORE.value,
        help="when stores are written to the shared tier (default on-store)",
    )


def _positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def settings_from_args(args: argparse.Namespace, model: str) -> SharedTierSettings | None:
    """Return the shared tier's settings the flags give, or None without `--shared-tier`.
    Raise InvalidInputError for `--replicas` above 1 without a shared tier."""
    if args.shared_tier is None:
        if args.replicas != 1:
            raise InvalidInputError(
                field="replicas", expected="1 without --shared-tier", got=args.replicas
            )
        return None
    password = None
    if args.shared_tier_password_file:
        lines = Path(args.shared_tier_password_file).read_text().splitlines()
        password = lines[0] if lines else ""
    return SharedTierSettings(
        url=args.shared_tier,
        model=model,
        timeout_s=args.shared_tier_timeout,
        write_behind=WriteBehind(args.write_behind),
        cluster=args.shared_tier_cluster,
        username=args.shared_tier_user,
        password=password,
        tls_ca_file=args.shared_tier_tls_ca,
        tls_cert_file=args.shared_tier_tls_cert,
        tls_key_file=args.shared_tier_tls_key,
    )


def replica_name(index: int) -> str:
    """Return the name of replica `index`: A, B, ..."""
    return string.ascii_uppercase[index % 26] + ("" if index < 26 else str(index // 26))


def run_replicas(options: DemoOptions, replicas: int) -> list[DemoReport]:
    """Run `replicas` engine processes, one after the other, on `options.shared_tier`; return
    their reports in order. Raise InvalidInputError without a shared tier or with `tp`."""
    if options.shared_tier is None or options.tp is not None:
        raise InvalidInputError(
            field="replicas",
            expected="a shared tier and one rank per replica",
            got=f"shared tier {options.shared_tier}, tp {options.tp}",
        )
    from kvferry.adapters.demo import run_demo

    if replicas < 1:
        raise InvalidInputError(field="replicas", expected="an integer >= 1", got=replicas)
    reports = []
    context = multiprocessing.get_context("spawn")
    for index in range(replicas):
        named = attrs.evolve(options, replica=replica_name(index))
        with ProcessPoolExecutor(max_workers=1, mp_context=context) as process:
            reports.append(process.submit(run_demo, named).result())
    return reports


def summary(reports: Sequence[DemoReport]) -> tuple[str, bool]:
    """Return the closing lines of a run with several replicas, and whether it passed: every
    replica after the first loaded chunks that the shared tier brought, and every loaded page
    of every replica was verified."""
    lines = []
    passed = True
    for report in reports[1:]:
        shared = report.shared
        brought = 0 if shared is None else shared.loaded_from_shared
        promoted = 0 if shared is None else shared.promoted_bytes
        lines.append(
            f"replica {report.replica} reused the prefixes of the replicas before it: "
            f"{brought} chunks loaded from the shared tier ({promoted / 1e6:.1f} MB promoted)"
        )
        passed = passed and brought > 0
    verified = sum(report.pages_verified for report in reports)
    lines.append(f"all {verified} loaded pages of {len(reports)} replicas verified")
    return "\n".join(lines) + "\n", passed
