"""Transfer bandwidth per executor, direction and page size, against the pinned-copy ceiling.

A benchmark, never part of the test suite: it needs a CUDA GPU and prints a table plus JSON.
Effective GB/s is measured on the host clock from `submit()` to the end of `wait()`
(expansion, staging plans and descriptor uploads included); the ceiling is a contiguous 1 GiB
pinned copy in each direction, measured in the same run.

    python3 benchmarks/transfer.py --json bench-out/transfer.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from kvferry.core.bound import BoundPlan
from kvferry.core.keys import OffloadKey
from kvferry.core.layout import TensorLayout
from kvferry.core.plan import Direction, TransferPlan
from kvferry.executors import CopyPath, KVTensor, make_executor

KIB = 1024
DEFAULT_PAGES = "4,8,16,28,32,64,256,2048"
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "torch": ("torch", {}),
    "cupy": ("cupy", {"copy_path": CopyPath.STAGED}),
    "cupy-zero-copy": ("cupy", {"copy_path": CopyPath.ZERO_COPY}),
    "torch-64MiB": ("torch", {"staging_bytes": 64 << 20}),
}


def _ceiling(torch: Any, nbytes: int, repeat: int) -> dict[str, float]:
    """Return GB/s of one contiguous pinned copy, each way, timed with CUDA events."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.random_(0, 255)
    out = {}
    for name, dst, src in (("store", host, device), ("load", device, host)):
        times = []
        for _ in range(repeat + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        out[name] = nbytes / statistics.median(times[1:]) / 1e9
    return out


def _bound(job: int, direction: Direction, ids: np.ndarray, rows: np.ndarray) -> BoundPlan:
    plan = TransferPlan(
        request_id=f"bench{job}",
        direction=direction,
        blocks_per_chunk=1,
        keys=[OffloadKey(0, int(i).to_bytes(8, "little")) for i in range(len(ids))],
        gpu_block_ids=ids,
        group_sizes=[len(ids)],
        block_indices=[0],
    )
    return BoundPlan(job_id=job, plan=plan, cpu_rows=rows)


def _measure(executor: Any, bounds: list[BoundPlan]) -> tuple[float, float]:
    """Return (median seconds submit->wait end, median seconds inside submit)."""
    totals, submits = [], []
    for bound in bounds:
        start = time.perf_counter()
        executor.submit(bound)
        submitted = time.perf_counter()
        (result,) = executor.wait([bound.job_id])
        end = time.perf_counter()
        if not result.success:
            raise RuntimeError(result.error)
        totals.append(end - start)
        submits.append(submitted - start)
    return statistics.median(totals[1:]), statistics.median(submits[1:])


def main() -> None:
    """Run the sweep; print the table; write JSON when asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="torch,cupy,cupy-zero-copy")
    parser.add_argument("--pages-kib", default=DEFAULT_PAGES)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--staging-mib", type=int, default=None, help="default: the executor's")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    total = int(args.gib * (1 << 30))
    ceiling = _ceiling(torch, total, args.repeat)
    rng = np.random.default_rng(0)
    rows_out = []
    print(f"ceiling (contiguous pinned copy, {args.gib} GiB): ", end="")
    print(f"store D2H {ceiling['store']:.1f} GB/s, load H2D {ceiling['load']:.1f} GB/s")
    header = f"{'executor':<15} {'dir':<6} {'page':>8} {'GB/s':>7} {'ratio':>6} {'submit ms':>10}"
    print(header)
    print("-" * len(header))
    for page_kib in (int(p) for p in args.pages_kib.split(",")):
        page = page_kib * KIB
        moved = -(-total // (args.layers * page))
        num_blocks = 2 * moved
        tensors = [
            torch.empty((num_blocks, 2, page // 2), dtype=torch.uint8, device="cuda")
            for _ in range(args.layers)
        ]
        for tensor in tensors:
            tensor.random_(0, 255)
        kv = [[KVTensor(tensor=t, layout=TensorLayout.BLOCKS_FIRST) for t in tensors]]
        for variant in args.variants.split(","):
            name, options = VARIANTS[variant]
            if args.staging_mib is not None:
                options = {**options, "staging_bytes": args.staging_mib << 20}
            executor = make_executor(
                name, kv_caches=kv, blocks_per_chunk=1, num_rows=moved, **options
            )
            try:
                for direction in (Direction.STORE, Direction.LOAD):
                    bounds = [
                        _bound(
                            job,
                            direction,
                            rng.choice(num_blocks, size=moved, replace=False),
                            rng.permutation(moved),
                        )
                        for job in range(args.repeat + 1)
                    ]
                    seconds, submit = _measure(executor, bounds)
                    nbytes = moved * args.layers * page
                    gbps = nbytes / seconds / 1e9
                    ratio = gbps / ceiling[direction.value]
                    print(
                        f"{variant:<15} {direction.value:<6} {page_kib:>6}Ki {gbps:>7.1f} "
                        f"{ratio:>6.2f} {submit * 1e3:>10.2f}",
                        flush=True,
                    )
                    rows_out.append({
                        "executor": variant,
                        "direction": direction.value,
                        "page_bytes": page,
                        "layers": args.layers,
                        "bytes": nbytes,
                        "seconds": seconds,
                        "submit_seconds": submit,
                        "gbps": gbps,
                        "ratio_to_ceiling": ratio,
                    })  # fmt: skip
            finally:
                executor.close()
        del tensors, kv
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "ceiling_gbps": ceiling,
                    "results": rows_out,
                },
                handle,
                indent=2,
            )


if __name__ == "__main__":
    main()
