"""The two routes of the per-job host work (`executors.jobcode`) plan byte-identical tables and
make identical driver calls: the Python route (`_python`) against the compiled module
(`_native`), on the same inputs. Also how an executor picks its route."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from _harness import LAYOUT_CASES, NUM_ROWS, Model, NumpyBackend
from hypothesis import given, settings
from hypothesis import strategies as st
from test_stage_job import COMPUTE, _made, _with_tier_pieces, jobs

from kvferry.core.bound import BoundPlan
from kvferry.core.errors import ExecutorUnavailableError, InvalidInputError
from kvferry.executors import make_executor
from kvferry.executors.base import CopyPath
from kvferry.executors.jobcode import NO_NATIVE_ENV, job_code, native_available
from kvferry.executors.staged import GpuJob

NATIVE = pytest.mark.skipif(
    not native_available(), reason="the compiled module kvferry.executors._native is not built here"
)


@st.composite
def _groups(draw: st.DrawFn) -> tuple[int, list[tuple[int, ...]]]:
    """Blocks per chunk, and groups as the slicer reads them (`staging._Group` before `g`: ref
    lines, pieces and bytes per page, blocks, skip, keys, first key and id, row bytes), each
    moving at least one key."""
    f = draw(st.integers(1, 4))
    out: list[tuple[int, ...]] = []
    key0 = id0 = 0
    for g in range(draw(st.integers(0, 4))):
        n = draw(st.integers(1, 40))
        skip = draw(st.integers(0, f - 1))
        keys = -(-(n + skip) // f)
        size = draw(st.integers(1, 5)) * 64
        refs, pieces = draw(st.integers(1, 3)), draw(st.integers(1, 9))
        out.append((g, refs, pieces, size // 2, n, skip, keys, key0, id0, size))
        key0 += keys
        id0 += n
    return f, out


@NATIVE
@settings(max_examples=300, deadline=None)
@given(
    _groups(),
    st.booleans(),
    st.tuples(st.integers(64, 2048), st.integers(1, 2048)),
    st.tuples(st.integers(0, 9), st.integers(0, 6)),
)
def test_both_routes_slice_a_job_into_the_same_batches_and_link_copies(
    drawn: tuple[int, list[tuple[int, ...]]],
    store: bool,
    sizes: tuple[int, int],
    rows: tuple[int, int],
) -> None:
    (f, groups), (capacity, ramp), (first_row, per_piece) = drawn, sizes, rows
    native, python = job_code("native"), job_code("python")
    sliced = native.slice_batches(groups, store, capacity, min(ramp, capacity), f)
    assert python.slice_batches(groups, store, capacity, min(ramp, capacity), f) == sliced
    lines, batches = sliced[1], len(sliced[3])
    key0 = [group[7] for group in groups]
    count = len(groups)  # each group its own first row, region and pitch
    first_rows = [first_row + 3 * g for g in range(count)]
    bases = [1000 * g for g in range(count)]
    pitches = [128 + 16 * g for g in range(count)]
    runs = (lines, key0, batches, first_rows, bases, pitches, [per_piece] * count, store)
    assert python.run_copies(*runs) == native.run_copies(*runs)


@NATIVE
@settings(max_examples=200, deadline=None)
@given(jobs(), st.integers(0, 1), st.booleans(), st.integers(0, 3), st.booleans())
def test_both_routes_plan_and_queue_a_job_with_the_same_calls_and_tables(
    job: tuple[str, int, int, BoundPlan],
    first: int,
    after_previous: bool,
    piece_rows: int,
    thread: bool,
) -> None:
    """One executor, the same state before each route's call, with or without the thread."""
    case, f, rows_per_half, bound = job
    executor = _made(case, f, rows_per_half, "native")
    _with_tier_pieces(executor, piece_rows)
    direction = bound.plan.direction
    _, slot = executor._free_slot(direction)
    refs = executor._planner.ref_table.size
    previous = object() if after_previous else None
    answers = []
    for route in ("native", "python"):
        executor._code = job_code(route)
        executor._submit_thread = thread
        slot.view[refs:] = -1
        job_state = GpuJob(start=1, end=2, keep=[], path=CopyPath.STAGED)
        executor.calls.clear()
        batches = executor._queue_compiled(
            bound, slot, job_state, previous, first=first, compute=COMPUTE
        )
        executor._drain()
        answers.append((batches, list(executor.calls), slot.view[refs:].copy()))
        if job_state.ready is not None:  # the next route takes the same event
            executor._spare_ready.append(job_state.ready)
        if executor._submitter is not None:
            executor._submitter.close()
            executor._submitter = None
    executor._code, executor._submit_thread = job_code("native"), False
    (n_batches, n_calls, n_view), (p_batches, p_calls, p_view) = answers
    assert (p_batches, p_calls) == (n_batches, n_calls)
    assert np.array_equal(p_view, n_view)


# --- choosing a route ------------------------------------------------------------------------


def _cpu(**options: object) -> object:
    tensors = LAYOUT_CASES["mla"]
    return Model(NumpyBackend(), tensors, 1, **options).executor


def test_an_executor_takes_the_python_route_when_kvferry_no_native_is_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(NO_NATIVE_ENV, "1")
    assert _cpu().route == "python"  # type: ignore[attr-defined]


@NATIVE
def test_an_executor_takes_the_compiled_route_by_default_where_it_is_built() -> None:
    assert _cpu().route == "native"  # type: ignore[attr-defined]


def test_route_python_needs_no_compiled_module() -> None:
    assert _cpu(route="python").route == "python"  # type: ignore[attr-defined]


def test_an_unknown_route_is_refused_naming_the_choices() -> None:
    with pytest.raises(InvalidInputError, match="native or python"):
        _cpu(route="fast")


def test_route_native_without_the_compiled_module_says_how_to_build_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvferry.executors import jobcode

    why = "No module named 'kvferry.executors._native'"
    monkeypatch.setattr(jobcode, "_load_native", lambda: (None, why))
    with pytest.raises(ExecutorUnavailableError, match="C compiler on PATH"):
        make_executor("cpu", kv_caches=[], blocks_per_chunk=1, num_rows=NUM_ROWS, route="native")


def test_the_python_route_leaves_every_plan_to_check_bound() -> None:
    ids = np.arange(4, dtype=np.int64)
    python = job_code("python")
    assert python.bound_bytes(ids, ids, (4,), (0,), 1, 1, (8,), (16,), 8, False) == -1


def test_kvferry_imports_and_the_cpu_executor_runs_where_the_compiled_module_is_missing() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["kvferry.executors._native"] = None  # as where no compiler built it
        import numpy as np
        from kvferry.core import Direction, OffloadKey, TransferPlan
        from kvferry.core.bound import BoundPlan
        from kvferry.core.layout import TensorLayout
        from kvferry.executors import KVTensor, make_executor

        kv = np.arange(2 * 8 * 4 * 16, dtype=np.uint8).reshape(2, 8, 4, 16)
        executor = make_executor(
            "cpu", kv_caches=[[KVTensor(tensor=kv, layout=TensorLayout.KV_SPLIT)]],
            blocks_per_chunk=2, num_rows=4,
        )
        plan = TransferPlan(
            request_id="r", direction=Direction.STORE, blocks_per_chunk=2,
            keys=[OffloadKey(0, b"\\x01")], gpu_block_ids=[5, 3], group_sizes=[2],
            block_indices=[0],
        )
        executor.submit(BoundPlan(job_id=1, plan=plan, cpu_rows=[2]))
        (result,) = executor.wait([1])
        print(executor.route, result.success, result.nbytes)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["python", "True", "256"]
