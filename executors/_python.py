"""The staged path's per-job host work in Python: the route that needs no C compiler.

The same functions as the compiled module `_native` (`_native.pyi` states them), with the same
arguments and answers, so the executors call either one the same way (`executors.jobcode`):
Python and numpy for the tables, and the job's driver calls through callables, which on a GPU
are `executors.driver.DriverBindings`' calls into NVIDIA's `cuda-bindings` (they release the GIL
while the driver works). Each function is specified by its caller's docstring, as the C one is;
`executors/_native.c` has the same steps, function by function.

A driver call here is a callable; what it returns is None (or 0) when the call was made, or a
CUDA error status (an int above 0), which stops the job and is answered as `(status, the call's
name)`. An exception it raises propagates. A driver given by address (the compiled route's form)
is refused with a TypeError: Python cannot call an address without ctypes.
"""

from __future__ import annotations

import threading
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvferry.core.arrays import IdArray

SLICE_WIDTH = 7
"""int64 per line of a slice table (`staging.SLICE_FIELDS`)."""
LINE_WIDTH = 5
"""int64 per slice of a job's slice list: batch, group, first key, keys, stage offset."""
G_WIDTH = 10
"""The fields of a group tuple that the slicer reads (`staging._Group` before `g`)."""

Failure = tuple[int, str] | None
"""What a job function answers: None, or (CUDA status, the call that failed)."""

_Calls = tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]


def _callable(value: Any, what: str) -> Callable[..., Any]:
    if not callable(value):
        raise TypeError(
            f"the Python route makes {what} through a callable, not {value!r}; the compiled"
            " module takes driver addresses"
        )
    function: Callable[..., Any] = value
    return function


def _driver(driver: Sequence[Any]) -> _Calls:
    record, wait, copy = driver
    return (
        _callable(record, "event records"),
        _callable(wait, "stream waits"),
        _callable(copy, "DMAs"),
    )


def _int64(values: bytes) -> array[int]:
    table = array("q")
    table.frombytes(values)
    return table


# --- the planner's loops ---------------------------------------------------------------------


def _slice_into(
    groups: Sequence[Sequence[int]], small_first: bool, capacity: int, ramp: int, f: int
) -> tuple[list[int], list[int], list[int], list[int], list[int], list[int]]:
    """Cut the groups into staging batches: the job's slice table (SLICE_WIDTH per line), its
    slices (LINE_WIDTH each), the batches' first slices (and the end), and per batch its staging
    bytes, kernel items and plan bytes. StagePlanner.plan states the rule."""
    total = sum(group[6] * group[9] for group in groups)
    table: list[int] = []
    lines: list[int] = []
    bounds = [0]
    stage_bytes: list[int] = []
    items: list[int] = []
    nbytes: list[int] = []
    gi = taken = batched = 0
    n_groups = len(groups)
    while gi < n_groups:
        left = total - batched
        limit = ramp if small_first and batched == 0 else capacity
        if not small_first and ramp < left <= capacity + ramp and left - ramp < limit:
            limit = left - ramp  # leave a small last batch
        used = batch_items = batch_bytes = 0
        batch = len(stage_bytes)
        while gi < n_groups:
            first_ref, refs, page_pieces, page_bytes, n, skip, keys, _, id0, size = groups[gi][
                :G_WIDTH
            ]
            room = (limit - used) // size if limit > used else 0
            count = min(room, keys - taken)
            if count == 0 and used:
                break
            if count == 0:
                count = 1  # a row larger than the ramp still moves, alone
            # the slice's line of the table: positions start .. end - 1 of the group's rows
            start, end, stop = taken * f, (taken + count) * f, skip + n
            lo = max(start, skip)
            pages = min(end, stop) - lo
            lines += (batch, gi, taken, count, used)
            table += (first_ref, refs, used, id0 + lo - skip, lo - start, pages, batch_items)
            batch_items += pages * page_pieces
            batch_bytes += pages * page_bytes
            used += count * size
            taken += count
            if taken < keys:
                break  # the batch is full: not even one more of these keys fits
            gi += 1
            taken = 0
        bounds.append(len(lines) // LINE_WIDTH)
        stage_bytes.append(used)
        items.append(batch_items)
        nbytes.append(batch_bytes)
        batched += used
    return table, lines, bounds, stage_bytes, items, nbytes


def slice_batches(
    groups: Sequence[Sequence[int]], small_first: bool, capacity: int, ramp: int, f: int, /
) -> tuple[bytes, bytes, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Return `_slice_into`'s columns: the two tables as bytes of int64, the rest as tuples.
    Raises ValueError for a group of fewer than G_WIDTH fields."""
    for group in groups:
        if len(group) < G_WIDTH:
            raise ValueError(f"a group has {len(group)} fields, not {G_WIDTH}")
    table, lines, bounds, stage_bytes, items, nbytes = _slice_into(
        groups, bool(small_first), capacity, ramp, f
    )
    return (
        array("q", table).tobytes(),
        array("q", lines).tobytes(),
        tuple(bounds),
        tuple(stage_bytes),
        tuple(items),
        tuple(nbytes),
    )


def _runs_into(  # noqa: PLR0917 (as executors/_native.c's, function for function)
    lines: Sequence[int],
    key0: Sequence[int],
    batches: int,
    first_row: Sequence[int],
    base: Sequence[int],
    pitch: Sequence[int],
    per_piece: Sequence[int],
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Return the link copies of a job whose rows are, in each of its groups, one consecutive
    run, as (stage offsets, tier offsets, sizes, each batch's end). Per group of the job (the
    slices' group index): its first key, its first row, its region's offset in the tier, its
    row pitch and its rows per registered piece (0: one piece). One copy per slice, cut at
    multiples of the group's `per_piece` rows. Raises ValueError for a slice naming a batch or
    group out of range, or per-group values of unequal lengths."""
    stage: list[int] = []
    tier: list[int] = []
    size: list[int] = []
    bounds = [0] * (batches + 1)
    n_groups = len(key0)
    if not len(first_row) == len(base) == len(pitch) == len(per_piece) == n_groups:
        raise ValueError("the per-group values must be one per group")
    for i in range(0, len(lines) - LINE_WIDTH + 1, LINE_WIDTH):
        b, gi, first, keys, at = lines[i : i + LINE_WIDTH]
        if not (0 <= b < batches and 0 <= gi < n_groups):
            raise ValueError("a slice names a batch or group out of range")
        bytes_per_row, piece, origin = pitch[gi], per_piece[gi], base[gi]
        start = first_row[gi] + first
        row, end = start, start + keys
        while row < end:
            stop = min((row // piece + 1) * piece, end) if piece else end
            stage.append(at + (row - start) * bytes_per_row)
            tier.append(origin + row * bytes_per_row)
            size.append((stop - row) * bytes_per_row)
            row = stop
        bounds[b + 1] = len(size)
    return stage, tier, size, bounds


def run_copies(  # noqa: PLR0917 (the compiled module's signature)
    lines: bytes,
    key0: Sequence[int],
    batches: int,
    first_row: Sequence[int],
    base: Sequence[int],
    pitch: Sequence[int],
    per_piece: Sequence[int],
    store: bool,
    /,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Return `_runs_into`'s copies as (src, dst, size, bounds) tuples, from `lines` as
    `slice_batches` returns them."""
    stage, tier, size, bounds = _runs_into(
        _int64(lines), key0, batches, first_row, base, pitch, per_piece
    )
    src, dst = (stage, tier) if store else (tier, stage)
    return tuple(src), tuple(dst), tuple(size), tuple(bounds)


def _is_int64(values: Any) -> bool:
    return (
        isinstance(values, np.ndarray)
        and values.dtype == np.int64
        and values.ndim == 1
        and bool(values.flags.c_contiguous)
    )


def consecutive(rows: IdArray, /) -> bool:
    """Return whether the int64 array `rows` counts up by one throughout; raises TypeError for
    rows that are not int64."""
    if not (isinstance(rows, np.ndarray) and rows.dtype == np.int64):
        raise TypeError("rows must be int64")
    return len(rows) < 2 or bool((rows[1:] - rows[:-1] == 1).all())


def bound_bytes(  # noqa: PLR0917 (the compiled module's signature)
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
) -> int:
    """Return -1: the caller then runs `check_bound`, the rule itself, which in numpy costs what
    a second numpy pass here would (the compiled pass exists to be cheaper than it)."""
    return -1


# --- a job's driver calls --------------------------------------------------------------------


def _failed(status: Any, call: str) -> Failure:
    """Return (status, call) when a callable answered a CUDA error status, else None."""
    if not status or not isinstance(status, int) or status < 0:
        return None
    return int(status), call


def _begin(  # noqa: PLR0917 (as executors/_native.c's, function for function)
    calls: _Calls,
    lanes: Sequence[int],
    compute: int,
    ready_recorded: bool,
    ready: Any,
    previous: Any,
    start: Any,
) -> Failure:
    """The job's first calls: `ready` recorded on the compute stream (unless the submitting
    thread did that), lane 0 waits for it and for the previous job (its end event, unless
    None), then records `start`."""
    record, wait, _ = calls
    if not ready_recorded and (failure := _failed(record(ready, compute), "cuEventRecord")):
        return failure
    if failure := _failed(wait(lanes[0], ready), "cuStreamWaitEvent"):
        return failure
    if previous is not None and (failure := _failed(wait(lanes[0], previous), "cuStreamWaitEvent")):
        return failure
    return _failed(record(start, lanes[0]), "cuEventRecord")


def _finish(calls: _Calls, lanes: Sequence[int], batches: int, joined: Any, end: Any) -> Failure:
    """The job's last calls: `end` is recorded on the lane of its last batch (batch k runs on
    lane k % 2; a job of no batch ends on lane 0), after the other lane's work when it has
    some."""
    record, wait, _ = calls
    last = lanes[(batches - 1) % 2] if batches else lanes[0]
    if batches > 1:
        if failure := _failed(record(joined, lanes[batches % 2]), "cuEventRecord"):
            return failure
        if failure := _failed(wait(last, joined), "cuStreamWaitEvent"):
            return failure
    return _failed(record(end, last), "cuEventRecord")


def begin_job(  # noqa: PLR0917 (the compiled module's signature)
    driver: tuple[Any, Any, Any],
    lanes: tuple[int, int],
    compute: int,
    ready: Any,
    previous: Any,
    start: Any,
    /,
) -> Failure:
    """StagedGpuExecutor._begin: a job's first calls (`_begin`)."""
    return _begin(_driver(driver), lanes, compute, False, ready, previous, start)


def end_job(
    driver: tuple[Any, Any, Any],
    lanes: tuple[int, int],
    batches: int,
    joined: Any,
    end: Any,
    /,
) -> Failure:
    """StagedGpuExecutor._end: a job's last calls (`_finish`)."""
    return _finish(_driver(driver), lanes, batches, joined, end)


def _queue(  # noqa: PLR0917 (as executors/_native.c's, function for function)
    calls: _Calls,
    lanes: Sequence[int],
    compute: int,
    ready_recorded: bool,
    events: Sequence[Any],
    upload: tuple[Callable[..., Any], int, int, int],
    kernel: Callable[..., Any],
    staging: tuple[Sequence[int], int, int, bool, int, int, int],
    columns: Sequence[Sequence[int]],
) -> Failure:
    """A whole staged job's calls, as `queue_job` documents them."""
    ready, previous, start, uploaded, joined, end = events
    record, wait, copy = calls
    stages, host, segments, store, line_bytes, most, warps = staging
    items, lines, link, src, dst, size = columns
    batches = len(items)
    if failure := _begin(calls, lanes, compute, ready_recorded, ready, None, start):
        return failure
    table_copy, table_dst, table_src, count = upload
    if failure := _failed(table_copy(table_dst, table_src, count, lanes[0]), "cuLaunchKernel"):
        return failure
    if failure := _failed(record(uploaded, lanes[0]), "cuEventRecord"):
        return failure
    # after what lane 0 waited on, and the upload
    if batches > 1 and (failure := _failed(wait(lanes[1], uploaded), "cuStreamWaitEvent")):
        return failure
    for k in range(batches):
        lane, stage = lanes[k % 2], stages[k % 2]
        src_base, dst_base = (stage, host) if store else (host, stage)
        count = lines[k + 1] - lines[k]  # none for a batch of no slice line
        blocks = (items[k] + warps - 1) // warps
        blocks = min(blocks, most) if blocks else 1
        at = segments + line_bytes * lines[k]
        if (
            store
            and count
            and (failure := _failed(kernel(lane, at, count, stage, blocks), "cuLaunchKernel"))
        ):
            return failure  # gather, then copy out
        if (
            k == 0
            and store
            and previous is not None
            and (failure := _failed(wait(lane, previous), "cuStreamWaitEvent"))
        ):
            return failure  # before writing the tier
        for i in range(link[k], link[k + 1]):
            if failure := _failed(
                copy(dst_base + dst[i], src_base + src[i], size[i], lane), "cuMemcpyAsync"
            ):
                return failure
        if (
            k == 0
            and not store
            and previous is not None
            and (failure := _failed(wait(lane, previous), "cuStreamWaitEvent"))
        ):
            return failure  # before writing KV blocks
        if (
            count
            and not store
            and (failure := _failed(kernel(lane, at, count, stage, blocks), "cuLaunchKernel"))
        ):
            return failure  # copy in, then scatter
    if (
        not batches
        and previous is not None
        and (failure := _failed(wait(lanes[0], previous), "cuStreamWaitEvent"))
    ):
        return failure  # the end comes after the previous one's
    return _finish(calls, lanes, batches, joined, end)


def queue_job(  # noqa: PLR0917 (the compiled module's signature)
    driver: tuple[Any, Any, Any],
    lanes: tuple[int, int],
    compute: int,
    events: tuple[Any, Any, Any, Any, Any, Any],
    upload: tuple[Any, int, int, int],
    kernel: Any,
    batches: tuple[Any, ...],
    /,
) -> Failure:
    """A whole staged job, as StagedGpuExecutor._enqueue_staged documents it (see the compiled
    module's `queue_job` for the order of its calls). Raises ValueError, having made no call,
    when the plan's columns disagree in length."""
    calls = _driver(driver)
    table_copy, dst, src, count = upload
    upload_call = (_callable(table_copy, "the table copy"), dst, src, count)
    stage_copy = _callable(kernel, "staging-kernel launches")
    stages, host, store, segments, line_bytes, most, warps, *columns = batches
    items, lines, link, src_column, dst_column, size = columns
    n = len(items)
    if (
        len(lines) != n + 1
        or len(link) != n + 1
        or len(src_column) != len(size)
        or len(dst_column) != len(size)
        or (n and link[n] > len(size))
    ):
        raise ValueError("the plan's columns do not agree in length")
    staging = (stages, host, segments, bool(store), line_bytes, most, warps)
    return _queue(calls, lanes, compute, False, events, upload_call, stage_copy, staging, columns)


# --- the submission thread -------------------------------------------------------------------


class _Tickets:
    """A submission thread's queue and what it answers, shared by the thread and its owner (the
    thread holds this, not the `Submitter`, so an owner no one holds is collected and closes
    the thread)."""

    def __init__(self) -> None:
        self.changed = threading.Condition(threading.Lock())
        self.queued: deque[tuple[int, Callable[[], Failure]]] = deque()
        self.pushed = 0
        self.completed = 0
        self.failures: dict[int, tuple[int, str]] = {}
        self.running = True


def _submit_tickets(tickets: _Tickets, set_context: Any, context: int) -> None:
    """The thread: make the context current, then each ticket's calls in order, until closed
    with none left."""
    context_failure: Failure = None
    if set_context:
        try:
            context_failure = _failed(set_context(context), "cuCtxSetCurrent")
        except Exception as error:
            context_failure = (-1, f"{type(error).__name__}: {error}")
    while True:
        with tickets.changed:
            while not tickets.queued and tickets.running:
                tickets.changed.wait()
            if not tickets.queued:
                return
            number, calls = tickets.queued.popleft()
        failure = context_failure
        if failure is None:
            try:
                failure = calls()
            except Exception as error:
                failure = (-1, f"{type(error).__name__}: {error}")
        with tickets.changed:
            if failure is not None:
                tickets.failures[number] = failure
            tickets.completed = number
            tickets.changed.notify_all()


class Submitter:
    """A thread that makes staged jobs' driver calls, as numbered tickets, in order.

    `stage_job` hands it a job's calls as the next ticket (numbered from 1). The thread first
    calls `set_context(context)` (a callable: the driver's `cuCtxSetCurrent`; 0 or None for
    none). A ticket that fails is remembered, by number, until `failure` takes it; later tickets
    still run. The thread is a daemon, and a Submitter that is collected closes it.
    """

    def __init__(self, set_context: Any = 0, context: int = 0) -> None:
        if set_context and not callable(set_context):
            raise TypeError(
                "the Python route's submission thread sets its CUDA context through a callable"
            )
        self._tickets = _Tickets()
        self._thread = threading.Thread(
            target=_submit_tickets,
            args=(self._tickets, set_context, context),
            name="kvferry-submit",
            daemon=True,
        )
        self._thread.start()

    def push(self, calls: Callable[[], Failure]) -> int:
        """Hand `calls` to the thread as the next ticket; return its number. Raises
        RuntimeError once the thread is closed."""
        tickets = self._tickets
        with tickets.changed:
            if not tickets.running:
                raise RuntimeError("the submission thread is closed")
            tickets.pushed += 1
            tickets.queued.append((tickets.pushed, calls))
            tickets.changed.notify_all()
            return tickets.pushed

    @property
    def pushed(self) -> int:
        """Return the number of the last ticket handed over."""
        return self._tickets.pushed

    def finished(self, number: int, /) -> bool:
        """Return whether the thread has made ticket `number`'s calls."""
        return self._tickets.completed >= number

    def wait(self, number: int, /) -> None:
        """Block until ticket `number`'s calls are made (every ticket for 0 and past the last)."""
        tickets = self._tickets
        with tickets.changed:
            until = number if 0 < number < tickets.pushed else tickets.pushed
            while tickets.completed < until:
                tickets.changed.wait()

    def drain(self) -> None:
        """Block until every ticket handed over is made."""
        self.wait(0)

    def failure(self, number: int, /) -> tuple[int, str] | None:
        """Take ticket `number`'s failure: None, or (status, the call or the exception)."""
        with self._tickets.changed:
            return self._tickets.failures.pop(number, None)

    def close(self) -> None:
        """Make every ticket, then stop the thread (idempotent)."""
        tickets = self._tickets
        with tickets.changed:
            tickets.running = False
            tickets.changed.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def __del__(self) -> None:
        if getattr(self, "_thread", None) is not None:  # not when __init__ refused its input
            self.close()


# --- a common job, planned and queued in one call --------------------------------------------

_R_WIDTH = 8
"""Fields of a layout group in `StagePlanner.job_constants`: first ref, refs, pieces and bytes
per page, row bytes (its pitch), whether its pages are unpadded, the offset of its region in the
tier, its rows per registered piece of the tier (0: one piece)."""


def _moved_groups(  # noqa: PLR0917 (stage_job's inputs, in its order)
    rows: IdArray,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    layout_groups: Sequence[Sequence[int]],
    f: int,
    store: bool,
    n_ids: int,
) -> tuple[list[tuple[int, ...]], tuple[list[int], ...]] | None:
    """Return the groups a common staged job moves, as StagePlanner._groups lists them, and per
    group its first key, first row, region offset, pitch and rows per piece (`_runs_into`'s
    per-group values); None for a job `stage_job` leaves to the Python path."""
    groups: list[tuple[int, ...]] = []
    runs: tuple[list[int], ...] = ([], [], [], [], [])
    next_key = next_id = 0
    for n, index, refs in zip(group_sizes, block_indices, layout_groups, strict=True):
        skip = index % f
        keys = (n + skip + f - 1) // f if n > 0 else 0
        if keys:
            if len(refs) != _R_WIDTH:
                return None
            first_ref, n_refs, pieces, page_bytes, size, dense, base, per_piece = refs
            if store and not (dense and not skip and n == keys * f):
                return None  # rows it fills in part, or pages copied one by one
            own = rows[next_key : next_key + keys]
            if len(own) != keys or (keys > 1 and bool((own[1:] - own[:-1] != 1).any())):
                return None  # rows of the group that are not one run
            groups.append(
                (first_ref, n_refs, pieces, page_bytes, n, skip, keys, next_key, next_id, size)
            )
            for column, value in zip(
                runs, (next_key, int(own[0]), base, size, per_piece), strict=True
            ):
                column.append(value)
        next_key += keys
        next_id += n
    if next_key != len(rows) or next_id != n_ids:
        return None
    return groups, runs


def stage_job(  # noqa: PLR0917 (the compiled module's signature)
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
) -> tuple[int, Failure]:
    """Plan and queue a common staged job in one call, as the compiled module's `stage_job`
    documents it: for a job whose rows are one consecutive run in each group it moves and, for a
    store, its chunks whole and its pages unpadded, it plans as
    StagePlanner.plan, writes the ids and slice table into the slot's view after the ref table,
    and queues the job (or, with `submitter`, records `ready` on the compute stream and hands
    the rest to the thread as its next ticket); it returns the job's batches and the answer.
    For any other job, or a slot too small, it returns (-1, None) having written and queued
    nothing. `StagedGpuExecutor._queue_planned` is its specification."""
    (
        driver,
        lanes_in,
        stages_in,
        (direction_ready, uploaded, joined),
        table_copy,
        host,
        store,
        most,
        warps,
        (capacity, ramp, f, ref_values, layout_groups),
    ) = constants
    view, slot_address, tables, kernel = slot
    if submitter is not None and not isinstance(submitter, Submitter):
        raise TypeError("submitter must be a Submitter or None")
    calls = _driver(driver)
    table_call = _callable(table_copy, "the table copy")
    stage_copy = _callable(kernel, "staging-kernel launches")
    if not (_is_int64(ids) and _is_int64(rows)):
        return -1, None
    n_groups = len(group_sizes)
    if len(block_indices) != n_groups or len(layout_groups) != n_groups or f < 1:
        return -1, None
    moved = _moved_groups(rows, group_sizes, block_indices, layout_groups, f, store, len(ids))
    if moved is None:
        return -1, None
    groups, (key0, first_rows, bases, pitches, per_pieces) = moved
    n_ids = len(ids)
    slices, lines, bounds, _, items, _ = _slice_into(groups, store, capacity, ramp, f)
    values = ref_values + n_ids + len(slices)
    if values * 8 > view.nbytes:
        return -1, None
    batches = len(items)
    stage, tier, size, link = _runs_into(
        lines, key0, batches, first_rows, bases, pitches, per_pieces
    )
    view[ref_values : ref_values + n_ids] = ids
    view[ref_values + n_ids : values] = slices
    lanes = (lanes_in[first], lanes_in[1 - first])
    stages = (stages_in[first], stages_in[1 - first])
    ids_at = tables + 8 * ref_values
    staging = (stages, host, ids_at + 8 * n_ids, bool(store), 8 * SLICE_WIDTH, most, warps)
    src, dst = (stage, tier) if store else (tier, stage)
    columns = (items, bounds, link, src, dst, size)
    upload = (table_call, tables, slot_address, values)
    if submitter is None:
        events = (direction_ready, previous, start, uploaded, joined, end)
        failure = _queue(calls, lanes, compute, False, events, upload, stage_copy, staging, columns)
        return batches, failure
    # `ready` marks the compute work queued before this submit: record it now; the job's own
    # event when given (a later job's record cannot then move what this one waits for)
    own = direction_ready if ready is None else ready
    if failure := _failed(calls[0](own, compute), "cuEventRecord"):
        return batches, failure
    events = (own, previous, start, uploaded, joined, end)
    submitter.push(
        lambda: _queue(calls, lanes, compute, True, events, upload, stage_copy, staging, columns)
    )
    return batches, None
