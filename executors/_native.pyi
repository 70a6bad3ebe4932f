"""Types of the compiled module `_native.c` (the staged path's per-job loops)."""

from collections.abc import Callable, Sequence

from kvferry.core.arrays import IdArray

def slice_batches(
    groups: Sequence[Sequence[int]], small_first: bool, capacity: int, ramp: int, f: int, /
) -> tuple[bytes, bytes, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]: ...
def run_copies(
    lines: bytes,
    key0: Sequence[int],
    batches: int,
    first_row: int,
    row_bytes: int,
    per_piece: int,
    store: bool,
    /,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]: ...
def consecutive(rows: IdArray, /) -> bool: ...
def queue_batches(
    kernel: Callable[[int, int, int, int, int], None] | tuple[int, int, int, int, int, bool, int],
    dma: Callable[[int, int, int, int], None] | int,
    lanes: tuple[int, int],
    stages: tuple[int, int],
    host: int,
    store: bool,
    segments: int,
    line_bytes: int,
    most: int,
    warps: int,
    items: Sequence[int],
    lines: Sequence[int],
    link: Sequence[int],
    src: Sequence[int],
    dst: Sequence[int],
    size: Sequence[int],
    /,
) -> tuple[int, str] | None: ...
