"""The staging kernel's CUDA source, compiled for the CPU: test support only.

g++ compiles `kernels.STAGE_COPY_SOURCE` unchanged, with CUDA's few keywords defined away and a
loop that runs every thread of the grid one after another. The kernel's threads share nothing
and never synchronise, so running them in sequence does what the GPU does, and CI (no GPU)
checks the kernel's own arithmetic, not only its numpy specification.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from kvferry.executors.kernels import STAGE_COPY_SOURCE, THREADS

_PRELUDE = r"""
struct int4 { int x, y, z, w; };
struct dim3 { unsigned x, y, z; };
static dim3 threadIdx, blockIdx, gridDim, blockDim;
#define __global__
#define __device__
"""

_GRID = r"""
extern "C" void run_grid(const long long* seg, int n_seg, const long long* refs,
                         const long long* ids, unsigned char* stage, int to_stage, int piece,
                         int blocks, int threads) {
    gridDim.x = blocks;
    blockDim.x = threads;
    for (int b = 0; b < blocks; ++b) {
        for (int t = 0; t < threads; ++t) {
            blockIdx.x = b;
            threadIdx.x = t;
            kvferry_stage_copy(seg, n_seg, refs, ids, stage, to_stage, piece);
        }
    }
}
"""


@functools.cache
def stage_copy_on_cpu() -> ctypes.CDLL | None:
    """Return the kernel compiled for the CPU (`run_grid`), or None without a C++ compiler."""
    compiler = shutil.which("g++")
    if compiler is None:
        return None
    folder = Path(tempfile.mkdtemp(prefix="kvferry-kernel-"))
    source, library = folder / "stage_copy.cpp", folder / "stage_copy.so"
    source.write_text(_PRELUDE + STAGE_COPY_SOURCE + _GRID)
    subprocess.run(
        [compiler, "-O1", "-shared", "-fPIC", "-o", str(library), str(source)],
        check=True,
        capture_output=True,
    )
    compiled = ctypes.CDLL(str(library))
    pointer, number = ctypes.c_void_p, ctypes.c_int
    compiled.run_grid.argtypes = [pointer, number, pointer, pointer, pointer, *[number] * 4]
    compiled.run_grid.restype = None
    return compiled


def run_stage_copy(
    compiled: ctypes.CDLL,
    *,
    segments: np.ndarray,
    refs: np.ndarray,
    ids: np.ndarray,
    stage: int,
    to_stage: bool,
    piece: int,
    blocks: int,
) -> None:
    """Run the kernel over a batch's slice lines as a launch of `blocks` x `THREADS` would."""
    if not len(segments):
        return
    lines = np.ascontiguousarray(segments, np.int64)
    table = np.ascontiguousarray(refs, np.int64)
    block_ids = np.ascontiguousarray(ids, np.int64)
    compiled.run_grid(
        lines.ctypes.data,
        len(lines),
        table.ctypes.data,
        block_ids.ctypes.data,
        stage,
        int(to_stage),
        piece,
        blocks,
        THREADS,
    )
