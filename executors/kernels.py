"""CUDA C sources of the copy kernels, shared by the GPU executors (compiled with NVRTC).

The torch executor compiles them with `torch.cuda._compile_kernel`, the CuPy executor with
`cupy.RawKernel`; both launch them with the same arguments, so both move the same bytes.
"""

from __future__ import annotations

from kvferry.executors.staging import REF_FIELDS, SLICE_FIELDS

THREADS = 256
"""Threads per thread block of every kernel here."""

WARPS = THREADS // 32
"""Warps per thread block: the staging kernel gives each warp one piece of a page at a time."""

PIECE_BYTES = 16 << 10
"""Largest piece of a page one warp copies at a time, so a large page is shared by many."""

STAGE_COPY_NAME = "kvferry_stage_copy"

_STAGE_COPY_BODY = r"""
template <typename T>
__device__ void warp_copy(unsigned long long src, unsigned long long dst, long long n, int lane) {
    // n elements of T, 32 lanes, four loads in flight per lane before the stores.
    const T* a = (const T*)src;
    T* b = (T*)dst;
    long long i = lane;
    for (; i + 96 < n; i += 128) {
        const T x0 = a[i], x1 = a[i + 32], x2 = a[i + 64], x3 = a[i + 96];
        b[i] = x0; b[i + 32] = x1; b[i + 64] = x2; b[i + 96] = x3;
    }
    for (; i < n; i += 32) b[i] = a[i];
}

extern "C" __global__ void kvferry_stage_copy(
    const long long* __restrict__ seg, const int n_seg, const long long* __restrict__ refs,
    const long long* __restrict__ ids, unsigned char* stage, const int to_stage, const int piece) {
    // seg: n_seg slice lines of S_WIDTH int64; refs: the ref table, R_WIDTH int64 per line;
    // columns named as in executors/staging.py. One warp per item (a piece of a page), grid
    // stride; items run slice after slice, ref after ref, page after page.
    const long long* last = seg + (long long)(n_seg - 1) * S_WIDTH;
    const long long* last_ref = refs + (last[S_FIRST_REF] + last[S_REFS] - 1) * R_WIDTH;
    const long long total =
        last[S_FIRST_ITEM] + last[S_COUNT] * (last_ref[R_PIECE_PREFIX] + last_ref[R_PIECES]);
    const int lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long item = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; item < total;
         item += warps) {
        int lo = 0, hi = n_seg - 1;  // the last slice whose first item is <= item
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (seg[(long long)mid * S_WIDTH + S_FIRST_ITEM] <= item) lo = mid; else hi = mid - 1;
        }
        const long long* s = seg + (long long)lo * S_WIDTH;
        const long long local = item - s[S_FIRST_ITEM];
        const long long count = s[S_COUNT];
        long long first = s[S_FIRST_REF], end = first + s[S_REFS] - 1;
        while (first < end) {  // the slice's last ref whose first item is <= local
            const long long mid = (first + end + 1) >> 1;
            if (count * refs[mid * R_WIDTH + R_PIECE_PREFIX] <= local) first = mid;
            else end = mid - 1;
        }
        const long long* r = refs + first * R_WIDTH;
        const long long within = local - count * r[R_PIECE_PREFIX];
        const long long p = within / r[R_PIECES];
        const long long c = (within - p * r[R_PIECES]) * piece;
        const long long q = s[S_FIRST_POSITION] + p;
        const unsigned long long staged = (unsigned long long)stage + s[S_STAGE_OFFSET]
            + r[R_ROW_OFFSET] + (q / r[R_SLOTS]) * r[R_ROW_PITCH]
            + (q % r[R_SLOTS]) * r[R_SLOT_BYTES] + c;
        const unsigned long long paged =
            (unsigned long long)r[R_GPU_BASE] + ids[s[S_ID_OFFSET] + p] * r[R_PAGE_STRIDE] + c;
        const long long m = (r[R_PAGE_BYTES] - c < piece) ? r[R_PAGE_BYTES] - c : piece;
        const unsigned long long src = to_stage ? paged : staged;
        const unsigned long long dst = to_stage ? staged : paged;
        const unsigned long long all = src | dst | (unsigned long long)m;
        if ((all & 15ULL) == 0ULL) warp_copy<int4>(src, dst, m >> 4, lane);
        else if ((all & 3ULL) == 0ULL) warp_copy<int>(src, dst, m >> 2, lane);
        else warp_copy<unsigned char>(src, dst, m, lane);
    }
}
"""

STAGE_COPY_SOURCE = (
    "".join(f"#define S_{name.upper()} {i}\n" for i, name in enumerate(SLICE_FIELDS))
    + f"#define S_WIDTH {len(SLICE_FIELDS)}\n"
    + "".join(f"#define R_{name.upper()} {i}\n" for i, name in enumerate(REF_FIELDS))
    + f"#define R_WIDTH {len(REF_FIELDS)}\n"
    + _STAGE_COPY_BODY
)
"""Copies the pages of one staged batch between the KV tensors and the staging buffer:
`to_stage` 1 gathers (store), 0 scatters (load). One warp per piece of a page, grid stride; the
page addresses come from the slice table, the ref table and the block ids, never from the host."""

TABLE_COPY_NAME = "kvferry_copy_table"

TABLE_COPY_SOURCE = r"""
extern "C" __global__ void kvferry_copy_table(
    const long long* __restrict__ src, long long* __restrict__ dst, const long long n) {
    // one int64 per thread, grid stride: a job's tables are a few KiB to a few hundred KiB
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = src[i];
}
"""
"""Copies `n` int64 from `src` (a pinned table slot, read through the link) to `dst` (GPU
memory): the staged path's upload of a job's tables. A kernel, not a copy-engine DMA, so that
it does not queue behind the DMAs of the other jobs in flight."""

ZERO_COPY_NAME = "kvferry_copy"

ZERO_COPY_SOURCE = r"""
extern "C" __global__ void kvferry_copy(const long long* __restrict__ desc, const long long n) {
    // desc holds three columns of n: source addresses, destination addresses, byte counts.
    for (long long d = blockIdx.x; d < n; d += gridDim.x) {
        const unsigned long long s = (unsigned long long)desc[d];
        const unsigned long long t = (unsigned long long)desc[n + d];
        const long long m = desc[2 * n + d];
        const unsigned long long all = s | t | (unsigned long long)m;
        if ((all & 15ULL) == 0ULL) {
            const int4* src = (const int4*)s;
            int4* dst = (int4*)t;
            for (long long i = threadIdx.x; i < (m >> 4); i += blockDim.x) dst[i] = src[i];
        } else if ((all & 3ULL) == 0ULL) {
            const int* src = (const int*)s;
            int* dst = (int*)t;
            for (long long i = threadIdx.x; i < (m >> 2); i += blockDim.x) dst[i] = src[i];
        } else {
            const unsigned char* src = (const unsigned char*)s;
            unsigned char* dst = (unsigned char*)t;
            for (long long i = threadIdx.x; i < m; i += blockDim.x) dst[i] = src[i];
        }
    }
}
"""
"""Copies listed `(src, dst, nbytes)` descriptors; the CuPy executor's zero-copy path runs it
with the pinned tier as one side (UVA addresses)."""
