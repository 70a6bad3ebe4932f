"""Types of the compiled module `_native.c` (the staged path's per-job loops)."""

from collections.abc import Callable, Sequence
from typing import Any

from kvferry.core.arrays import IdArray

def slice_batches(
    groups: Sequence[Sequence[int]], small_first: bool, capacity: int, ramp: int, f: int, /
) -> tuple[bytes, bytes, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]: ...
def run_copies(
    lines: bytes,
    key0: Sequence[int],
    batches: int,
    first_row: Sequence[int],
    base: Sequence[int],
    pitch: Sequence[int],
    per_piece: Sequence[int],
    store: bool,
    /,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]: ...
def consecutive(rows: IdArray, /) -> bool: ...
def bound_bytes(
    ids: IdArray,
    rows: IdArray,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    plan_f: int,
    f: int,
    num_blocks: Sequence[int],
    copy_bytes: Sequence[int],
    num_rows: Sequence[int],
    store: bool,
    /,
) -> int: ...
def begin_job(
    driver: tuple[Any, Any, Any],
    lanes: tuple[int, int],
    compute: int,
    ready: Any,
    previous: Any,
    start: Any,
    /,
) -> tuple[int, str] | None: ...
def end_job(
    driver: tuple[Any, Any, Any],
    lanes: tuple[int, int],
    batches: int,
    joined: Any,
    end: Any,
    /,
) -> tuple[int, str] | None: ...
def queue_job(
    driver: tuple[Any, Any, Any],
    lanes: tuple[int, int],
    compute: int,
    events: tuple[Any, Any, Any, Any, Any, Any],
    upload: tuple[Callable[[int, int, int, int], None] | tuple[int, int, int, int], int, int, int],
    kernel: Callable[[int, int, int, int, int], None] | tuple[int, int, int, int, int, bool, int],
    batches: tuple[
        tuple[int, int],
        int,
        bool,
        int,
        int,
        int,
        int,
        Sequence[int],
        Sequence[int],
        Sequence[int],
        Sequence[int],
        Sequence[int],
        Sequence[int],
    ],
    /,
) -> tuple[int, str] | None: ...
def stage_job(
    constants: tuple[Any, ...],
    first: int,
    compute: int,
    previous: Any,
    start: Any,
    end: Any,
    slot: tuple[IdArray, int, int, Any],
    ids: IdArray,
    rows: IdArray,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    submitter: Submitter | None = None,
    ready: Any = None,
    /,
) -> tuple[int, tuple[int, str] | None]: ...

class Submitter:
    """A thread that makes staged jobs' driver calls, as numbered tickets, in order."""

    def __init__(self, set_context: int = 0, context: int = 0) -> None: ...
    @property
    def pushed(self) -> int: ...
    def finished(self, number: int, /) -> bool: ...
    def wait(self, number: int, /) -> None: ...
    def drain(self) -> None: ...
    def failure(self, number: int, /) -> tuple[int, str] | None: ...
    def close(self) -> None: ...
