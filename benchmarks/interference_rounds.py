"""Target 3's floor: what the copy engines alone cost the matmul, in paired rounds.

A benchmark, never part of the test suite: it needs a CUDA GPU; without one it says so and exits 0.

`interference.py` measures each variant once, right after one matmul-alone loop; on a board at its
power cap one such pair moves by several per cent from one run to the next. This script measures
in *rounds*: each round runs the same bf16 8192³ matmul loop once per arm, in a shuffled order
(seeded), where an arm is the loop alone, beside back-to-back contiguous pinned copies both ways
(the copy engines alone, no SM: the bidirectional ceiling's own transfer), or beside an
executor's back-to-back loads and stores. A round's slowdown of an arm is its loop time over the
same round's loop alone, minus one, so drift between rounds cancels. Per arm it prints the
median over the rounds with a distribution-free 95 % interval (order statistics of the median),
the transfers' combined GB/s over the bidirectional ceiling while the loop ran, and the SM clock
and board power (`nvidia-smi`, medians). Each executor arm gets a target 3 line on those medians
(slowdown <= 3 % and combined >= 0.90), beside `interference.py`'s single pair per variant.

If even the copy engines alone cost the matmul more than 3 % (the interval's low end above it),
no transfer at the link's rate meets target 3 on this board: the copy engines are the least a
transfer can use (no SM, one pass over HBM). The arm `pinned-copy+sm-pass` adds to those copies
one pass of every byte through the SMs (an elementwise copy in GPU memory on the whole GPU, at
HBM speed): the least SM work any staged path does, so if it is over the bar, so is every
staged path.

    python3 benchmarks/interference_rounds.py --rounds 12 --variants pinned-copy,torch,cupy
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Any

import numpy as np
from interference import (
    COMBINED_TARGET,
    PINNED,
    SLOWDOWN_TARGET,
    SM_PASS,
    _bidirectional_ceiling,
    _drive,
    _GpuSampler,
    _Jobs,
    _make_jobs,
    _Matmul,
    _warm_up,
    add_job_and_matmul_options,
    matmul_beside,
)
from transfer import KIB, bench_kv_caches, cuda_torch, write_json

ALONE = "alone"

FLOORS = {
    PINNED: (
        "copy engines alone, both directions",
        "no transfer at the link's rate meets target 3 here",
    ),
    SM_PASS: (
        "copy engines and one pass of every byte through the SMs",
        "no staged path (which does at least that pass) meets target 3 here",
    ),
}
"""The reference arms: what each measures, and what it means when even it is over the bar."""


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """Return the distribution-free interval of the median of `values` (order statistics: the
    k-th smallest and k-th largest, k the largest with P(Binomial(n, 1/2) < k) <= (1 - c) / 2);
    the extremes when there are too few values for that confidence."""
    ordered = sorted(values)
    n = len(ordered)
    tail = (1 - confidence) / 2
    k, below = 0, 0.0
    while k < n // 2:
        below_next = below + math.comb(n, k) / 2**n
        if below_next > tail:
            break
        below, k = below_next, k + 1
    k = max(k, 1)
    return ordered[k - 1], ordered[n - k]


def _arm_round(
    torch: Any, jobs: _Jobs | None, matmul: _Matmul, settle: float, bidir: float
) -> dict[str, Any]:
    """Run the matmul loop once beside `jobs` (None: alone); return its time per matmul, the
    combined transfer ratio while it ran, and the GPU's clock and power."""
    device = torch.cuda.current_device()
    if jobs is None:
        with _GpuSampler(device) as sampled:
            seconds = matmul.alone()
        return {"matmul_ms": seconds * 1e3, "combined": float("nan"), "gpu": sampled.result}
    until = time.perf_counter() + settle
    _drive(jobs, lambda: time.perf_counter() > until, depth=2, extend=False)
    rates, seconds, sampled = matmul_beside(torch, jobs, matmul)
    combined = (rates["store"]["gbps"] + rates["load"]["gbps"]) / bidir
    return {"matmul_ms": seconds * 1e3, "combined": combined, "gpu": sampled.result}


def run_rounds(
    torch: Any,
    sources: dict[str, _Jobs],
    matmul: _Matmul,
    *,
    args: argparse.Namespace,
    bidir: float,
) -> list[dict[str, dict[str, Any]]]:
    """Run `args.rounds` rounds; in each, the matmul loop once alone and once beside each source,
    in an order shuffled with `args.seed`. Return per round and arm what `_arm_round` returns
    (the arm `alone` for the loop alone)."""
    arms = [ALONE, *sources]
    rng = np.random.default_rng(args.seed)
    rounds: list[dict[str, dict[str, Any]]] = []
    for _ in range(args.rounds):
        order = [arms[i] for i in rng.permutation(len(arms))]
        rounds.append(
            {arm: _arm_round(torch, sources.get(arm), matmul, args.settle, bidir) for arm in order}
        )
    return rounds


def add_round_options(parser: argparse.ArgumentParser) -> None:
    """Add the options of `run_rounds` (rounds, settle, seed)."""
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--settle", type=float, default=0.3, help="seconds of transfers first")
    parser.add_argument("--seed", type=int, default=0, help="of the arms' order in each round")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=f"{PINNED},{SM_PASS},torch,cupy")
    parser.add_argument("--page-kib", type=int, default=16, help="the executors' page size")
    add_job_and_matmul_options(parser)
    add_round_options(parser)
    parser.add_argument("--json", default=None)
    return parser


def main() -> int:
    """Run the rounds; print one line per arm, then the target 3 and floor lines; write JSON when
    asked."""
    args = _parser().parse_args()
    torch = cuda_torch("interference_rounds.py")
    if torch is None:
        return 0
    total = int(args.gib * (1 << 30))
    page = args.page_kib * KIB
    bidir = _bidirectional_ceiling(torch, total, 0.8)
    matmul = _Matmul(torch, args.matmuls, args.warmup_matmuls, priority=args.matmul_priority)
    matmul.alone()  # warm-up (cuBLAS heuristics, clocks)
    moved, num_blocks, kv = bench_kv_caches(torch, args.layers, page, total)
    variants = args.variants.split(",")
    sources: dict[str, _Jobs] = {}
    try:
        for variant in variants:
            sources[variant] = _make_jobs(
                torch,
                variant,
                kv=kv,
                num_blocks=num_blocks,
                moved=moved,
                page_kib=args.page_kib,
                total=total,
            )
            _warm_up(sources[variant])
        rounds = run_rounds(torch, sources, matmul, args=args, bidir=bidir)
    finally:
        for jobs in sources.values():
            if not jobs.hung:
                jobs.close()
    print(f"device: {torch.cuda.get_device_name()}; bidirectional ceiling {bidir:.1f} GB/s")
    print(
        f"{args.rounds} rounds, arms in shuffled order each round; executors at {args.page_kib} "
        f"KiB pages, {args.layers} layers, {args.gib} GiB jobs; matmul stream priority "
        f"{args.matmul_priority}"
    )
    lines, summary = report_rounds(rounds, variants)
    for line in lines + summary:
        print(line)
    if args.json:
        write_json(
            args.json,
            {"args": vars(args), "bidir_gbps": bidir, "rounds": rounds, "summary": summary},
        )
    return 0


def report_rounds(
    rounds: list[dict[str, dict[str, Any]]],
    variants: list[str],
    labels: dict[str, str] | None = None,
) -> tuple[list[str], list[str]]:
    """Return the per-arm table lines and the summary lines: one per arm against target 3's
    bars, each headed by the arm's label in `labels` ("target 3 by rounds" where it has none)
    and the arm, then one per reference arm (`FLOORS`)."""
    header = (
        f"{'arm':<20} {'slowdown med':>11} {'95 % interval':>17} {'combined':>8} "
        f"{'SM MHz':>7} {'power W':>7}  per round (%)"
    )
    lines = [header, "-" * len(header)]
    alone_ms = [r[ALONE]["matmul_ms"] for r in rounds]
    spread = (max(alone_ms) - min(alone_ms)) / statistics.median(alone_ms)
    lines.append(
        f"{ALONE:<20} {'':>11} {'':>17} {'':>8} "
        f"{statistics.median(r[ALONE]['gpu']['sm_mhz'] for r in rounds):>7.0f} "
        f"{statistics.median(r[ALONE]['gpu']['power_w'] for r in rounds):>7.0f}  "
        f"matmul {statistics.median(alone_ms):.3f} ms, spread {100 * spread:.1f} %"
    )
    summary, floors = [], []
    for variant in variants:
        slowdowns = [r[variant]["matmul_ms"] / r[ALONE]["matmul_ms"] - 1 for r in rounds]
        low, high = median_interval(slowdowns)
        median = statistics.median(slowdowns)
        combined = statistics.median(r[variant]["combined"] for r in rounds)
        lines.append(
            f"{variant:<20} {100 * median:>+10.1f}% {100 * low:>+7.1f} .. {100 * high:>+5.1f}% "
            f"{combined:>8.2f} "
            f"{statistics.median(r[variant]['gpu']['sm_mhz'] for r in rounds):>7.0f} "
            f"{statistics.median(r[variant]['gpu']['power_w'] for r in rounds):>7.0f}  "
            + " ".join(f"{100 * s:+.1f}" for s in slowdowns)
        )
        measured = (
            f"matmul slowdown median {100 * median:+.1f} % (95 % interval {100 * low:+.1f} .. "
            f"{100 * high:+.1f} %), combined transfer {combined:.2f} x bidirectional ceiling"
        )
        if variant in FLOORS:
            if low > SLOWDOWN_TARGET:
                verdict = f"above the target: {FLOORS[variant][1]}"
            elif high < SLOWDOWN_TARGET:
                verdict = "below the target: target 3 is not at this limit"
            else:
                verdict = "not separable from the target with these rounds"
            floors.append(f"target 3 floor, {FLOORS[variant][0]}: {measured} -> {verdict}")
            continue
        meets = median <= SLOWDOWN_TARGET and combined >= COMBINED_TARGET
        summary.append(
            f"{(labels or {}).get(variant, 'target 3 by rounds')}, {variant}: {measured} -> "
            + ("PASS" if meets else "FAIL")
            + f" (bars: <= {100 * SLOWDOWN_TARGET:.0f} %, >= {COMBINED_TARGET:.2f})"
        )
    summary += floors
    return lines, summary


if __name__ == "__main__":
    sys.exit(main())
