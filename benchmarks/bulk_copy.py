"""Bulk asynchronous copies (Hopper's TMA) between pinned host rows and KV pages: a candidate
path for target 3, measured against the staged path's floor.

A benchmark, never part of the test suite: it needs a Hopper-class CUDA GPU (sm_90), torch and
CuPy; without a GPU it says so and exits 0.

DESIGN §5.1 names two ways to move pages across the link with little SM work: the copy engines
(a DMA into a staging buffer, then an on-GPU gather or scatter: kvferry's staged path) and *bulk
asynchronous copies*. An ordinary copy kernel reads host memory one register at a time, so the
link's latency caps it per SM and it needs ~16 SMs to read at the link's rate. A bulk copy
(`cp.async.bulk`) is issued by one thread and moves up to a whole page between global memory
(host memory mapped into the GPU's address space, or HBM) and shared memory with no register
holding the bytes, so the bytes in flight per SM are bounded by shared memory, not by threads.

The kernel here gives each warp one *pipe*: lane 0 keeps a ring of `stages` shared-memory
buffers of `chunk` bytes, reads a piece of a page into a buffer (completion counted on an
mbarrier) and writes it out with a bulk store, so `stages - 1` reads are in flight per pipe.
Pages move from and to random KV block ids (32 layers, blocks-first tensors as
`transfer.py`'s) and consecutive host rows, as a fresh catalog gives them. A configuration is
`BLOCKSxWARPSxSTAGESxCHUNK_KIB`; each direction runs its own kernel on its own stream.

It prints, in one run:

1. per configuration, each direction's rate alone and both at once, as ratios to the
   contiguous pinned copy's ceilings (targets 1 and 2's bars are 0.92 and 0.90), and whether a
   store and a load of the moved pages round-trip their bytes;
2. the same for a few configurations at other page sizes;
3. `interference_rounds.py`'s paired rounds of the bf16 8192^3 matmul loop, alone and beside the
   copy engines alone (`pinned-copy`), the staged floor (`pinned-copy+sm-pass`), kvferry's staged
   executors (`--executors`) and back-to-back bulk copies of the chosen configurations (`--arms`):
   median slowdown with its 95 % interval, and the combined transfer rate.

    python3 benchmarks/bulk_copy.py --rounds 8 --json bulk.json
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np
from interference import (
    PINNED,
    SM_PASS,
    _bidirectional_ceiling,
    _drive,
    _Jobs,
    _make_jobs,
    _Matmul,
    _PinnedCopyJobs,
    _SmPassJobs,
    _warm_up,
    add_job_and_matmul_options,
)
from interference_rounds import add_round_options, report_rounds, run_rounds
from transfer import KIB, bench_kv_caches, cuda_torch, own_stream, write_json

from kvferry.core.plan import Direction

KERNEL_NAME = "bulk_copy"
KERNEL_SOURCE = r"""
__device__ __forceinline__ unsigned shared_address(const void* p) {
    unsigned address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
        : "=r"(address) : "l"(p));
    return address;
}

__device__ __forceinline__ void read_piece(unsigned buffer, unsigned long long src, int bytes,
                                           unsigned barrier) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(barrier), "r"(bytes) : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        :: "r"(buffer), "l"(src), "r"(bytes), "r"(barrier) : "memory");
}

__device__ __forceinline__ void wait_phase(unsigned barrier, unsigned phase) {
    unsigned done = 0;
    do {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
            "selp.u32 %0, 1, 0, p; }"
            : "=r"(done) : "r"(barrier), "r"(phase) : "memory");
    } while (!done);
}

extern "C" __global__ void bulk_copy(
    const unsigned long long* __restrict__ src_pages,
    const unsigned long long* __restrict__ dst_pages, const long long n_pages, const int pieces,
    const int chunk, const int stages) {
    // src_pages, dst_pages: the address of each page; a page is `pieces` pieces of `chunk`
    // bytes. One pipe per warp, run by lane 0; pieces go to pipes round robin.
    extern __shared__ __align__(128) unsigned char ring_memory[];
    __shared__ __align__(8) unsigned long long barriers[256];
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if ((threadIdx.x & 31) != 0) return;
    unsigned char* ring = ring_memory + (size_t)warp * stages * chunk;
    unsigned long long* barrier = barriers + warp * stages;
    for (int s = 0; s < stages; s++)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(shared_address(barrier + s)));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const long long pipe = (long long)blockIdx.x * warps + warp;
    const long long pipes = (long long)gridDim.x * warps;
    const long long total = n_pages * pieces;
    if (pipe >= total) return;
    const long long mine = (total - pipe + pipes - 1) / pipes;
    #define PIECE_AT(table, k) (table[(pipe + (k) * pipes) / pieces] \
        + (unsigned long long)((pipe + (k) * pipes) % pieces) * chunk)
    for (long long k = 0; k < mine && k < stages; k++)
        read_piece(shared_address(ring + k * chunk), PIECE_AT(src_pages, k), chunk,
                   shared_address(barrier + k));
    for (long long k = 0; k < mine; k++) {
        const int s = (int)(k % stages);
        const unsigned buffer = shared_address(ring + (size_t)s * chunk);
        const unsigned bar = shared_address(barrier + s);
        wait_phase(bar, (unsigned)((k / stages) & 1));
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     :: "l"(PIECE_AT(dst_pages, k)), "r"(buffer), "r"(chunk) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        if (k + stages < mine) {
            // the buffer is refilled once the store has read it
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            read_piece(buffer, PIECE_AT(src_pages, k + stages), chunk, bar);
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""
"""The bulk-copy kernel (CUDA C with inline PTX, sm_90), compiled with NVRTC by CuPy."""

DEFAULT_CONFIGS = (
    "1x4x3x16,2x1x4x16,2x2x4x16,2x4x3x16,4x1x4x16,4x2x4x16,4x2x8x8,8x1x2x8,8x1x4x16,16x1x2x8"
)
DEFAULT_ARMS = "2x4x3x16,4x1x4x16,16x1x2x8"


class Config:
    """One launch shape: `blocks` thread blocks of `warps` pipes, each a ring of `stages`
    buffers of `chunk` bytes (at most the page)."""

    def __init__(self, text: str, page: int) -> None:
        blocks, warps, stages, chunk_kib = (int(x) for x in text.split("x"))
        if warps * stages > 256 or warps * stages < 1 or stages < 1:
            raise ValueError(f"{text}: warps x stages must be 1..256")
        self.blocks, self.warps, self.stages = blocks, warps, stages
        self.chunk = min(chunk_kib * KIB, page)
        if page % self.chunk:
            raise ValueError(f"{text}: the chunk must divide the {page}-byte page")
        self.pieces = page // self.chunk
        self.shared_bytes = warps * stages * self.chunk


class BulkJobs(_PinnedCopyJobs):
    """Back-to-back jobs of the bulk-copy kernel, one stream per direction (the `_Jobs` of
    `interference.py`): a store moves `moved` random blocks of the first half of the KV blocks
    to the first `moved` host rows, a load the second half's from the next `moved` rows."""

    def __init__(
        self,
        torch: Any,
        kernel: Any,
        config: Config,
        *,
        kv: list[Any],
        page: int,
        moved: int,
        host: Any,
    ) -> None:
        import cupy

        from kvferry.executors.cupy_executor import as_cupy_stream

        self._torch = torch
        self._kernel = kernel
        self.config = config
        layers = len(kv)
        self._nbytes = moved * layers * page
        self._n_pages = moved * layers
        self._streams = {d: own_stream(torch) for d in Direction}
        self._launch_streams = {d: as_cupy_stream(cupy, s) for d, s in self._streams.items()}
        self._pending: list[tuple[Direction, Any, Any]] = []
        kernel.max_dynamic_shared_size_bytes = max(
            kernel.max_dynamic_shared_size_bytes, config.shared_bytes
        )
        num_blocks = kv[0].shape[0]
        ids = np.random.default_rng(page).permutation(num_blocks)
        self.block_ids = {
            Direction.STORE: ids[: num_blocks // 2][:moved],
            Direction.LOAD: ids[num_blocks // 2 :][:moved],
        }
        self.first_row = {Direction.STORE: 0, Direction.LOAD: moved}
        layer_bases = torch.tensor([t.data_ptr() for t in kv], dtype=torch.int64, device="cuda")
        layer_index = torch.arange(layers, dtype=torch.int64, device="cuda")
        self._tables: dict[Direction, tuple[Any, Any]] = {}
        for d in Direction:
            block = torch.as_tensor(self.block_ids[d], dtype=torch.int64, device="cuda")
            row = torch.arange(moved, dtype=torch.int64, device="cuda") + self.first_row[d]
            device_pages = (layer_bases[None, :] + block[:, None] * page).reshape(-1)
            host_pages = (host.data_ptr() + (row[:, None] * layers + layer_index) * page).reshape(
                -1
            )
            pair = (
                (device_pages, host_pages) if d is Direction.STORE else (host_pages, device_pages)
            )
            self._tables[d] = (pair[0].contiguous(), pair[1].contiguous())

    @property
    def nbytes(self) -> int:
        """Bytes one job moves."""
        return self._nbytes

    def launch(self, direction: Direction) -> None:
        """Queue one job's kernel on the direction's stream."""
        c = self.config
        src, dst = self._tables[direction]
        with self._launch_streams[direction]:
            self._kernel(
                (c.blocks,),
                (c.warps * 32,),
                (
                    np.uint64(src.data_ptr()),
                    np.uint64(dst.data_ptr()),
                    np.int64(self._n_pages),
                    np.int32(c.pieces),
                    np.int32(c.chunk),
                    np.int32(c.stages),
                ),
                shared_mem=c.shared_bytes,
            )

    def submit(self, direction: Direction) -> None:
        torch = self._torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = self._streams[direction]
        start.record(stream)
        self.launch(direction)
        end.record(stream)
        self._pending.append((direction, start, end))


def one_way_gbps(torch: Any, jobs: _PinnedCopyJobs, direction: Direction, count: int) -> float:
    """Return the GB/s of `count` jobs of one direction run back to back after one warm-up job
    (bytes over the jobs' summed CUDA-event time)."""
    jobs.submit(direction)
    torch.cuda.synchronize()
    jobs.ended()
    for _ in range(count):
        jobs.submit(direction)
    torch.cuda.synchronize()
    done = jobs.ended()
    return sum(n for _, n, _ in done) / sum(s for _, _, s in done) / 1e9


def round_trips(torch: Any, jobs: BulkJobs, kv: list[Any], host: Any, page: int) -> bool:
    """Run one store and, after zeroing every KV page, one load; return True when, in three
    layers, each job's rows and pages hold the same bytes."""
    layers = len(kv)
    rows = host[: 2 * jobs.nbytes].view(-1, layers, page)

    def same(direction: Direction) -> bool:
        ids = torch.as_tensor(jobs.block_ids[direction], device="cuda")
        first = jobs.first_row[direction]
        return all(
            torch.equal(
                kv[layer].view(kv[layer].shape[0], -1)[ids].cpu(),
                rows[first : first + len(ids), layer],
            )
            for layer in (0, layers // 2, layers - 1)
        )

    jobs.launch(Direction.STORE)
    torch.cuda.synchronize()
    stored = same(Direction.STORE)
    for tensor in kv:
        tensor.zero_()
    torch.cuda.synchronize()  # the kernel's stream does not wait for the default stream
    jobs.launch(Direction.LOAD)
    torch.cuda.synchronize()
    return stored and same(Direction.LOAD)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-kib", type=int, default=16)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="BLOCKSxWARPSxSTAGESxCHUNK_KIB")
    parser.add_argument("--arms", default=DEFAULT_ARMS, help="configurations in the rounds")
    parser.add_argument("--pages-kib", default="4,64,256,2048", help="other pages, for --arms")
    parser.add_argument(
        "--executors", default="torch,cupy", help="kvferry's variants in the rounds, beside them"
    )
    add_job_and_matmul_options(parser)
    add_round_options(parser)
    parser.add_argument("--json", default=None)
    return parser


class _Run:
    """What every section shares: torch, the kernel, the arguments, one page size's KV caches
    and host rows, and the ceilings measured at the start."""

    def __init__(self, torch: Any, kernel: Any, args: argparse.Namespace) -> None:
        self.torch, self.kernel, self.args = torch, kernel, args
        self.total = int(args.gib * (1 << 30))
        self.page = args.page_kib * KIB
        self.moved, self.num_blocks, self.caches = bench_kv_caches(
            torch, args.layers, self.page, self.total
        )
        self.kv = [k.tensor for k in self.caches[0]]
        largest = max([args.page_kib, *(int(p) for p in args.pages_kib.split(",") if p)]) * KIB
        # two jobs' rows at any page size (a job rounds up to whole blocks)
        self.host = torch.empty(
            2 * (self.total + args.layers * largest), dtype=torch.uint8, pin_memory=True
        )
        self.host.random_(0, 255)
        pinned = _PinnedCopyJobs(torch, self.moved * args.layers * self.page)
        self.ceiling = {d: one_way_gbps(torch, pinned, d, 4) for d in Direction}
        self.bidir = _bidirectional_ceiling(torch, self.total, 0.8)

    def jobs(self, text: str, page: int, kv: list[Any], moved: int) -> BulkJobs:
        """Return the bulk-copy jobs of configuration `text` on `kv`."""
        return BulkJobs(
            self.torch,
            self.kernel,
            Config(text, page),
            kv=kv,
            page=page,
            moved=moved,
            host=self.host,
        )

    def alone(self, jobs: BulkJobs) -> dict[Direction, float]:
        """Return each direction's rate alone over its ceiling."""
        return {d: one_way_gbps(self.torch, jobs, d, 3) / self.ceiling[d] for d in Direction}

    def combined(self, jobs: BulkJobs) -> float:
        """Return both directions' rate at once over the bidirectional ceiling."""
        _warm_up(jobs)
        until = time.perf_counter() + 0.5
        both = _drive(jobs, lambda: time.perf_counter() > until, depth=2, extend=True)
        return (both["store"]["gbps"] + both["load"]["gbps"]) / self.bidir


def _verdict(correct: bool) -> str:
    return "bytes equal" if correct else "BYTES DIFFER"


def _section_configs(run: _Run) -> tuple[list[dict[str, Any]], dict[str, _Jobs]]:
    """Section 1: every configuration at the main page size; return its rows and the jobs of
    the configurations the rounds use."""
    args = run.args
    print(f"\n1. {args.page_kib} KiB pages, {args.layers} layers, {args.gib} GiB per job")
    print(f"{'config':>10} {'smem/block':>10} {'store':>6} {'load':>6} {'both':>6}  round trip")
    rows: list[dict[str, Any]] = []
    sources: dict[str, _Jobs] = {}
    for text in args.configs.split(","):
        jobs = run.jobs(text, run.page, run.kv, run.moved)
        correct = round_trips(run.torch, jobs, run.kv, run.host, run.page)
        alone = run.alone(jobs)
        combined = run.combined(jobs)
        shared = jobs.config.shared_bytes
        rows.append(
            {
                "config": text,
                "page_kib": args.page_kib,
                "shared_bytes": shared,
                "store": alone[Direction.STORE],
                "load": alone[Direction.LOAD],
                "combined": combined,
                "round_trip": correct,
            }
        )
        print(
            f"{text:>10} {shared // KIB:>6} KiB {alone[Direction.STORE]:>6.2f} "
            f"{alone[Direction.LOAD]:>6.2f} {combined:>6.2f}  {_verdict(correct)}"
        )
        if text in args.arms.split(","):
            sources[f"bulk-{text}"] = jobs
    return rows, sources


def _section_pages(run: _Run) -> list[dict[str, Any]]:
    """Section 2: the rounds' configurations at the other page sizes; return the rows."""
    args = run.args
    print(f"\n2. other page sizes ({args.arms}), each direction alone")
    rows = []
    for page_kib in [int(p) for p in args.pages_kib.split(",") if p]:
        page = page_kib * KIB
        moved, _, caches = bench_kv_caches(run.torch, args.layers, page, run.total)
        kv = [k.tensor for k in caches[0]]
        for text in args.arms.split(","):
            jobs = run.jobs(text, page, kv, moved)
            correct = round_trips(run.torch, jobs, kv, run.host, page)
            alone = run.alone(jobs)
            rows.append(
                {
                    "config": text,
                    "page_kib": page_kib,
                    "store": alone[Direction.STORE],
                    "load": alone[Direction.LOAD],
                    "round_trip": correct,
                }
            )
            print(
                f"{page_kib:>5} KiB {text:>10}: store {alone[Direction.STORE]:.2f} load "
                f"{alone[Direction.LOAD]:.2f}  {_verdict(correct)}"
            )
        del kv, caches
    return rows


def main() -> int:
    """Measure and print sections 1-3 (module docstring); write JSON when asked."""
    args = _parser().parse_args()
    torch = cuda_torch("bulk_copy.py")
    if torch is None:
        return 0
    if torch.cuda.get_device_capability() < (9, 0):
        print("bulk_copy.py needs an sm_90 GPU (bulk asynchronous copies); nothing measured")
        return 0
    import cupy

    module = cupy.RawModule(code=KERNEL_SOURCE, options=("-arch=sm_90",))
    run = _Run(torch, module.get_function(KERNEL_NAME), args)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name()}, {sms} SMs")
    print(
        f"ceilings (contiguous pinned copy): store {run.ceiling[Direction.STORE]:.1f} GB/s, "
        f"load {run.ceiling[Direction.LOAD]:.1f} GB/s, both at once {run.bidir:.1f} GB/s"
    )
    rows, sources = _section_configs(run)
    rows += _section_pages(run)
    print(f"\n3. the matmul loop beside each arm, {args.rounds} paired rounds")
    matmul = _Matmul(torch, args.matmuls, args.warmup_matmuls, priority=args.matmul_priority)
    matmul.alone()
    references: dict[str, _Jobs] = {
        PINNED: _PinnedCopyJobs(torch, run.total),
        SM_PASS: _SmPassJobs(torch, run.total),
    }
    for name in [e for e in args.executors.split(",") if e]:
        references[name] = _make_jobs(
            torch,
            name,
            kv=run.caches,
            num_blocks=run.num_blocks,
            moved=run.moved,
            page_kib=args.page_kib,
            total=run.total,
        )
    for jobs in references.values():
        _warm_up(jobs)
    rounds = run_rounds(torch, {**references, **sources}, matmul, args=args, bidir=run.bidir)
    lines, summary = report_rounds(
        rounds,
        [*references, *sources],
        labels=dict.fromkeys(sources, "bulk copies by rounds (not a kvferry path)"),
    )
    for line in lines + summary:
        print(line)
    if args.json:
        write_json(
            args.json,
            {
                "args": vars(args),
                "ceilings_gbps": {d.value: g for d, g in run.ceiling.items()},
                "bidir_gbps": run.bidir,
                "configs": rows,
                "rounds": rounds,
                "summary": summary,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
