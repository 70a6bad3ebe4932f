"""The host steps of a staged submit, with the CPU caches warm and after a sweep, on any CPU.

A benchmark, never part of the test suite, and it needs no GPU: the layout is built from page
references alone (nothing is allocated). For target 4's job, a 2048-block x 32-layer load (one
group of 64 refs, K and V per layer, random block ids, consecutive rows), it times each host
step of the staged path's `submit()` that does not call the driver: `check_bound`, the
compiled check the executors run first (`_native.bound_bytes`), and the stage planner (which,
since the eighth session, plans only the jobs `_native.stage_job` declines; that call plans
the common job, this one among them, in C, with the driver calls, so it is not timed here);
and, for scale, one numpy call and one compiled call on the same 2048 integers. Each step runs
`--repeat` times in a hot loop, as many times right after reading `--sweep-mib` MiB of host
memory, which pushes the step's code and data out of the CPU caches, as a `wait()` on a long
transfer does in part (docs/benchmark-history.md, seventh session), and as many times right
after the thread spun in Python, or slept, for each of `--pause-ms` (no memory touched: what
does time spent elsewhere alone do?). A ctypes call into libc is timed the same ways. Medians,
in microseconds.

    python3 benchmarks/host_steps.py
    python3 benchmarks/host_steps.py --pause-ms 0.2,1,2,4,8,20
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from kvferry.core.bound import BoundPlan
from kvferry.core.expand import check_bound
from kvferry.core.keys import OffloadKey
from kvferry.core.layout import GroupLayout, KVLayout, PageRef
from kvferry.core.plan import Direction, TransferPlan
from kvferry.executors import _native
from kvferry.executors.kernels import PIECE_BYTES
from kvferry.executors.staged import DEFAULT_STAGING_BYTES
from kvferry.executors.staging import StagePlanner

BLOCKS = 2048
LAYERS = 32


def _job(page: int, seed: int) -> tuple[KVLayout, BoundPlan]:
    """Return a layout of `LAYERS` layers of K and V pages and a 2048-block load on it."""
    num_blocks = 2 * BLOCKS
    refs = [
        PageRef(
            address=(1 << 40) + r * num_blocks * page,
            num_blocks=num_blocks,
            page_stride=page,
            page_bytes=page,
        )
        for r in range(2 * LAYERS)
    ]
    layout = KVLayout(blocks_per_chunk=1, groups=[GroupLayout(refs=refs)])
    ids = np.random.default_rng(seed).choice(num_blocks, BLOCKS, replace=False)
    plan = TransferPlan(
        request_id="host-steps",
        direction=Direction.LOAD,
        blocks_per_chunk=1,
        keys=[OffloadKey(0, i.to_bytes(8, "little")) for i in range(BLOCKS)],
        gpu_block_ids=ids,
        group_sizes=[BLOCKS],
        block_indices=[0],
    )
    return layout, BoundPlan(job_id=1, plan=plan, cpu_rows=np.arange(BLOCKS, dtype=np.int64))


def _median_us(step: Callable[[], object], repeat: int, before: Callable[[], object]) -> float:
    """Return the median microseconds of `step` over `repeat` runs, each right after `before`."""
    times = []
    for _ in range(repeat):
        before()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def spin(seconds: float) -> None:
    """Keep the thread busy in Python for `seconds`, touching no memory to speak of."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _befores(sweep_mib: int, pauses_ms: list[float]) -> dict[str, Callable[[], object]]:
    """Return what runs before each timed step, by column name: nothing (hot), a sweep of host
    memory, and for each pause a spin in Python and a sleep that long."""
    sweep = np.ones(sweep_mib << 17)
    befores: dict[str, Callable[[], object]] = {"hot": lambda: None, "swept": sweep.sum}
    for ms in pauses_ms:
        befores[f"spun {ms:g} ms"] = functools.partial(spin, ms / 1e3)
    for ms in pauses_ms:
        befores[f"slept {ms:g} ms"] = functools.partial(time.sleep, ms / 1e3)
    return befores


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-kib", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--sweep-mib", type=int, default=64)
    parser.add_argument("--pause-ms", default="20", help="comma-separated pauses, ms")
    args = parser.parse_args(argv)
    layout, bound = _job(args.page_kib << 10, seed=1)
    planner = StagePlanner(layout, capacity=DEFAULT_STAGING_BYTES // 2, piece_bytes=PIECE_BYTES)
    plan = bound.plan
    ids = plan.gpu_block_ids
    limits = ((layout.groups[0].num_blocks,), (layout.groups[0].block_copy_bytes,))
    libc = ctypes.CDLL("libc.so.6")
    steps: dict[str, Callable[[], object]] = {
        "check_bound": lambda: check_bound(bound, layout, num_rows=BLOCKS),
        "_native.bound_bytes (the executors' check)": lambda: _native.bound_bytes(
            ids, bound.cpu_rows, plan.group_sizes, plan.block_indices, 1, 1, *limits, BLOCKS, False
        ),
        "StagePlanner.plan": lambda: planner.plan(bound),
        "one numpy call: int(ids.max())": lambda: int(ids.max()),
        "one compiled call: _native.consecutive(rows)": lambda: _native.consecutive(bound.cpu_rows),
        "a ctypes call into libc: abs(1)": lambda: libc.abs(1),
    }
    befores = _befores(args.sweep_mib, [float(ms) for ms in args.pause_ms.split(",")])
    print(
        f"{BLOCKS}-block x {LAYERS}-layer load, {args.page_kib} KiB pages: median us per step, "
        f"in a hot loop, after a {args.sweep_mib} MiB sweep, and after pauses"
    )
    print(f"{'step':48s}" + "".join(f" {column:>13s}" for column in befores))
    for name, step in steps.items():
        medians = [_median_us(step, args.repeat, before) for before in befores.values()]
        print(f"{name:48s}" + "".join(f" {us:13.1f}" for us in medians))
    return 0


if __name__ == "__main__":
    sys.exit(main())
