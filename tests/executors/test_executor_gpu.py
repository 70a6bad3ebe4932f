"""GPU-only parts of the contract: ordering against the compute stream, torch and CuPy agreeing."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest
from _harness import (
    LAYOUT_CASES,
    POISON_HOST,
    GroupMove,
    Model,
    backend_for,
    bound_plan,
    expected_gpu,
    expected_host,
)

from kvferry.core.plan import Direction
from kvferry.executors import CopyPath

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("route")]

GPU_EXECUTORS = ["torch", "cupy"]
SLEEP_CYCLES = 200_000_000  # ~0.1 s of a spinning kernel queued ahead on the compute stream


def _torch() -> Any:
    return importlib.import_module("torch")


def _flat(groups: list[list[np.ndarray]]) -> list[np.ndarray]:
    return [array for group in groups for array in group]


def _model(name: str, **options: object) -> Model:
    if name == "cupy":
        pytest.importorskip("cupy")
    return Model(backend_for(name), LAYOUT_CASES["hybrid_three_groups"], 3, **options)


def _moves() -> list[GroupMove]:
    return [
        GroupMove(ids=(5, 9, 2, 30, 31, 7), first=0, rows=(4, 1)),
        GroupMove(ids=(), first=0, rows=()),
        GroupMove(ids=(11, 12, 13), first=0, rows=(9,)),
    ]


def _load_moves() -> list[GroupMove]:
    return [
        GroupMove(ids=(20, 21, 22, 23, 24), first=1, rows=(4, 1)),
        GroupMove(ids=(), first=0, rows=()),
        GroupMove(ids=(14, 15, 16), first=0, rows=(9,)),
    ]


@pytest.mark.parametrize("name", GPU_EXECUTORS)
def test_a_store_submitted_after_a_kernel_that_writes_the_source_reads_the_new_bytes(
    name: str,
) -> None:
    torch = _torch()
    model = _model(name)
    with model.executor as executor:
        model.fill_random(np.random.default_rng(1))
        torch.cuda._sleep(SLEEP_CYCLES)
        for group in model.buffers:
            for buffer in group:
                buffer.fill_(0x5A)
        executor.submit(bound_plan(1, Direction.STORE, 3, _moves()))
        (result,) = executor.wait([1])
        assert result.success
        for g, move in enumerate(_moves()):
            for r in range(len(executor.layout.groups[g].refs)):
                mirror = executor.host_tier.mirror(executor.layout, g, r)
                assert (mirror[list(move.rows)] == 0x5A).all()


@pytest.mark.parametrize("name", GPU_EXECUTORS)
def test_a_load_lands_after_zeroing_queued_before_it(name: str) -> None:
    torch = _torch()
    model = _model(name)
    with model.executor as executor:
        model.fill_random(np.random.default_rng(2))
        executor.submit(bound_plan(1, Direction.STORE, 3, _moves()))
        executor.wait([1])
        torch.cuda._sleep(SLEEP_CYCLES)
        for group in model.buffers:
            for buffer in group:
                buffer.zero_()
        executor.submit(bound_plan(2, Direction.LOAD, 3, _load_moves()))
        (result,) = executor.wait([2])
        assert result.success
        torch.cuda.synchronize()
        mirror = executor.host_tier.mirror(executor.layout, 0, 0)
        pages = executor.tensors[0][0].refs[0]
        data = model.snapshot()[0][0]
        base = int(model.buffers[0][0].data_ptr())
        for k, block in enumerate((20, 21, 22, 23, 24)):
            position = 1 + k
            row, slot = (4, 1)[position // 3], position % 3
            start = pages.address - base + block * pages.page_stride
            got = data[start : start + pages.page_bytes]
            np.testing.assert_array_equal(got, mirror[row, slot])
            assert got.any()


POOL_STREAMS = 32
"""The streams torch's pool holds per priority; `torch.cuda.Stream()` hands them out round robin,
so this many asks in a row return every one of them."""
LONG_SLEEP_CYCLES = 2_000_000_000  # ~1 s: far longer than the jobs below take


@pytest.mark.parametrize("name", GPU_EXECUTORS)
def test_jobs_end_while_every_stream_torch_hands_out_is_busy(name: str) -> None:
    # An engine's own streams come from torch's pool; an executor that took its lanes from
    # there would run its copies in turn with the model's work on whichever stream it shares.
    torch = _torch()
    model = _model(name)
    with model.executor as executor:
        model.fill_random(np.random.default_rng(5))
        model.run(bound_plan(1, Direction.STORE, 3, _moves()))  # kernels compiled, tables made
        busy = [torch.cuda.Stream(priority=p) for p in (0, -1) for _ in range(POOL_STREAMS)]
        slept = []
        for stream in busy:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(LONG_SLEEP_CYCLES)
                slept.append(torch.cuda.Event())
                slept[-1].record(stream)
        executor.submit(bound_plan(2, Direction.STORE, 3, _moves()))
        executor.submit(bound_plan(3, Direction.LOAD, 3, _load_moves()))
        results = executor.wait([2, 3])
        still_busy = not any(event.query() for event in slept)
        torch.cuda.synchronize()
        assert all(result.success for result in results), [r.error for r in results]
        assert still_busy, "a job waited for work queued on streams from torch's pool"


def _destination_after(name: str, **options: object) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    model = _model(name, **options)
    with model.executor as executor:
        model.fill_random(np.random.default_rng(3))
        executor.host_tier.array[:] = POISON_HOST
        model.run(bound_plan(1, Direction.STORE, 3, _moves()))
        model.poison()
        model.run(bound_plan(2, Direction.LOAD, 3, _load_moves()))
        return executor.host_tier.array.copy(), model.snapshot()


def test_torch_and_cupy_give_identical_bytes_for_the_same_plans() -> None:
    host_t, gpu_t = _destination_after("torch")
    host_c, gpu_c = _destination_after("cupy")
    np.testing.assert_array_equal(host_t, host_c)
    for a, b in zip(_flat(gpu_t), _flat(gpu_c), strict=True):
        np.testing.assert_array_equal(a, b)


def test_cupy_zero_copy_path_gives_the_same_bytes_as_the_staged_one() -> None:
    host_s, gpu_s = _destination_after("cupy", copy_path=CopyPath.STAGED)
    host_z, gpu_z = _destination_after("cupy", copy_path=CopyPath.ZERO_COPY)
    np.testing.assert_array_equal(host_s, host_z)
    for a, b in zip(_flat(gpu_s), _flat(gpu_z), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", GPU_EXECUTORS)
def test_a_small_staging_buffer_splits_a_transfer_into_batches_with_the_same_bytes(
    name: str,
) -> None:
    host_big, gpu_big = _destination_after(name)
    model = _model(name)
    row = model.executor.layout.largest_row_bytes
    model.executor.close()
    host_small, gpu_small = _destination_after(name, staging_bytes=row)
    np.testing.assert_array_equal(host_big, host_small)
    for a, b in zip(_flat(gpu_big), _flat(gpu_small), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", GPU_EXECUTORS)
def test_the_host_tier_is_pinned(name: str) -> None:
    model = _model(name)
    with model.executor as executor:
        assert executor.host_tier.pinned
        assert _torch().from_numpy(executor.host_tier.array).is_pinned()


@pytest.mark.parametrize("name", GPU_EXECUTORS)
def test_a_store_waits_on_the_compute_stream_given_at_construction(name: str) -> None:
    torch = _torch()
    side = torch.cuda.Stream()
    model = _model(name, compute_stream=side)
    with model.executor as executor:
        model.fill_random(np.random.default_rng(4))
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            for group in model.buffers:
                for buffer in group:
                    buffer.fill_(0x3C)
        executor.submit(bound_plan(1, Direction.STORE, 3, _moves()))
        (result,) = executor.wait([1])
        assert result.success
        mirror = executor.host_tier.mirror(executor.layout, 2, 1)
        assert (mirror[9] == 0x3C).all()


@pytest.mark.parametrize("name", GPU_EXECUTORS)
def test_stores_queued_back_to_back_each_write_their_own_rows(name: str) -> None:
    model = _model(name)
    model.fill_random(np.random.default_rng(3))
    source = model.snapshot()
    batches = [
        [
            GroupMove(ids=(5 + j, 9 + j, 2 + j), first=0, rows=(3 * j,)),
            GroupMove(ids=(), first=0, rows=()),
            GroupMove(ids=(11 + j,), first=0, rows=(3 * j + 1,)),
        ]
        for j in range(4)
    ]
    with model.executor as executor:
        before = executor.host_tier.array.copy()
        for j, moves in enumerate(batches):  # no wait in between: uploads reuse one buffer
            executor.submit(bound_plan(j + 1, Direction.STORE, 3, moves))
        results = executor.wait(list(range(1, len(batches) + 1)))
        assert all(result.success for result in results), [r.error for r in results]
        expected = before
        for moves in batches:
            expected = expected_host(model, expected, source, moves)
        np.testing.assert_array_equal(executor.host_tier.array, expected)


def _group_0(ids: tuple[int, ...], rows: tuple[int, ...]) -> list[GroupMove]:
    """Whole rows of group 0 alone (F = 3)."""
    return [
        GroupMove(ids=ids, first=0, rows=rows),
        GroupMove(ids=(), first=0, rows=()),
        GroupMove(ids=(), first=0, rows=()),
    ]


def _batched_model(name: str) -> Model:
    """A model whose staging halves hold one row: every job below is three batches, and each
    starts beside the last batch of the job before it."""
    model = _model(name)
    row = model.executor.layout.largest_row_bytes
    model.executor.close()
    return _model(name, staging_bytes=2 * row)


@pytest.mark.parametrize("name", GPU_EXECUTORS)
def test_stores_of_the_same_rows_queued_back_to_back_land_in_submission_order(name: str) -> None:
    # each job's first batch writes the row the previous job's last batch writes
    model = _batched_model(name)
    model.fill_random(np.random.default_rng(4))
    source = model.snapshot()
    first = _group_0((5, 9, 2, 30, 31, 7, 11, 12, 13), (4, 1, 9))
    second = _group_0((20, 21, 22, 23, 24, 25, 14, 15, 16), (9, 1, 4))
    jobs = [first, second] * 4
    with model.executor as executor:
        before = executor.host_tier.array.copy()
        for j, moves in enumerate(jobs):  # no wait in between
            executor.submit(bound_plan(j + 1, Direction.STORE, 3, moves))
        results = executor.wait(list(range(1, len(jobs) + 1)))
        assert all(result.success for result in results), [r.error for r in results]
        expected = expected_host(model, before, source, second)
        np.testing.assert_array_equal(executor.host_tier.array, expected)


@pytest.mark.parametrize("name", GPU_EXECUTORS)
def test_loads_into_the_same_blocks_queued_back_to_back_land_in_submission_order(
    name: str,
) -> None:
    # each job's first batch writes the blocks the previous job's last batch writes
    model = _batched_model(name)
    rng = np.random.default_rng(5)
    model.fill_random(rng)
    first = _group_0((20, 21, 22, 23, 24, 25, 26, 27, 28), (4, 1, 9))
    second = _group_0((26, 27, 28, 23, 24, 25, 20, 21, 22), (2, 3, 8))
    jobs = [first, second] * 4
    with model.executor as executor:
        tier = executor.host_tier.array
        tier[:] = rng.integers(0, 256, tier.shape, dtype=np.uint8)
        host, before = tier.copy(), model.snapshot()
        for j, moves in enumerate(jobs):  # no wait in between
            executor.submit(bound_plan(j + 1, Direction.LOAD, 3, moves))
        results = executor.wait(list(range(1, len(jobs) + 1)))
        assert all(result.success for result in results), [r.error for r in results]
        model.backend.sync()
        expected = expected_gpu(model, before, host, second)
        for got, want in zip(_flat(model.snapshot()), _flat(expected), strict=True):
            np.testing.assert_array_equal(got, want)
