"""The executor contract, run against every executor: cpu in CI, torch and cupy on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from _harness import (
    LAYOUT_CASES,
    NUM_BLOCKS,
    NUM_ROWS,
    POISON_HOST,
    GroupMove,
    Model,
    backend_for,
    bound_plan,
    expected_gpu,
    expected_host,
    page_bytes_of,
)

from kvferry.core.errors import InvalidInputError, PlanInvariantError
from kvferry.core.plan import Direction, chunks_spanned

pytestmark = pytest.mark.usefixtures("route")

EXECUTORS = [
    "cpu",
    "torch-on-cpu",
    pytest.param("torch", marks=pytest.mark.gpu),
    pytest.param("cupy", marks=pytest.mark.gpu),
]


def _model(name: str, case: str = "hybrid_three_groups", f: int = 3, **options: object) -> Model:
    if name == "cupy":
        pytest.importorskip("cupy")
    if name.startswith("torch"):
        pytest.importorskip("torch")
    return Model(backend_for(name), LAYOUT_CASES[case], f, **options)


def _store_moves(model: Model, rng: np.random.Generator, chunks: list[int]) -> list[GroupMove]:
    """Whole chunks per group (0 chunks = an empty group), distinct ids; each group draws its
    rows from its own row ids, so groups share row numbers (in their own regions)."""
    f = model.f
    moves = []
    for c in chunks:
        ids = rng.choice(NUM_BLOCKS, size=c * f, replace=False)
        rows = rng.permutation(NUM_ROWS)[:c]
        moves.append(
            GroupMove(ids=tuple(int(i) for i in ids), first=0, rows=tuple(int(r) for r in rows))
        )
    return moves


def _load_moves(
    model: Model, rng: np.random.Generator, stored: list[GroupMove], skip: int, tail: int
) -> list[GroupMove]:
    """Read back every stored chunk except `skip` leading and `tail` trailing slots, elsewhere."""
    f = model.f
    moves = []
    for move in stored:
        chunks = len(move.rows)
        n = max(0, chunks * f - skip - tail) if chunks else 0
        if n == 0:
            moves.append(GroupMove(ids=(), first=0, rows=()))
            continue
        first = f * 2 + skip  # the first chunk is the request's third one
        ids = rng.choice(NUM_BLOCKS, size=n, replace=False)
        count = chunks_spanned(n, skip, f)
        moves.append(GroupMove(ids=tuple(int(i) for i in ids), first=first, rows=move.rows[:count]))
    return moves


def _round_trip(model: Model, seed: int, skip: int, tail: int, chunks: list[int]) -> None:
    rng = np.random.default_rng(seed)
    executor = model.executor
    model.fill_random(rng)
    executor.host_tier.array[:] = POISON_HOST
    source = model.snapshot()
    host_before = executor.host_tier.array.copy()
    store = _store_moves(model, rng, chunks)
    fingerprint = executor.layout.fingerprint
    stored = model.run(bound_plan(1, Direction.STORE, model.f, store, fingerprint))
    host_after = executor.host_tier.array.copy()
    np.testing.assert_array_equal(host_after, expected_host(model, host_before, source, store))
    assert stored == sum(len(m.ids) * page_bytes_of(model, g) for g, m in enumerate(store))

    model.poison()
    poisoned = model.snapshot()
    load = _load_moves(model, rng, store, skip, tail)
    loaded = model.run(bound_plan(2, Direction.LOAD, model.f, load, fingerprint))
    after = model.snapshot()
    expected = expected_gpu(model, poisoned, host_after, load)
    for g, group in enumerate(after):
        for t, data in enumerate(group):
            np.testing.assert_array_equal(data, expected[g][t], err_msg=f"group {g} tensor {t}")
    assert loaded == sum(len(m.ids) * page_bytes_of(model, g) for g, m in enumerate(load))
    np.testing.assert_array_equal(executor.host_tier.array, host_after)


CASES = sorted(LAYOUT_CASES)


@pytest.mark.parametrize("name", EXECUTORS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("f", [1, 3])
def test_store_then_load_round_trips_every_byte_and_touches_nothing_else(
    name: str, case: str, f: int
) -> None:
    model = _model(name, case, f)
    groups = len(LAYOUT_CASES[case])
    try:
        _round_trip(model, seed=f, skip=0, tail=0, chunks=[2] * groups)
    finally:
        model.executor.close()


@pytest.mark.parametrize("name", EXECUTORS)
@pytest.mark.parametrize("case", CASES)
def test_load_with_an_unaligned_first_chunk_skips_its_leading_slots(name: str, case: str) -> None:
    model = _model(name, case, 3)
    groups = len(LAYOUT_CASES[case])
    try:
        _round_trip(model, seed=7, skip=2, tail=1, chunks=[3] * groups)
    finally:
        model.executor.close()


@pytest.mark.parametrize("name", EXECUTORS)
@pytest.mark.parametrize("f", [1, 3])
def test_a_multi_group_plan_with_an_empty_group_moves_the_others(name: str, f: int) -> None:
    model = _model(name, "hybrid_three_groups", f)
    try:
        _round_trip(model, seed=11, skip=1 if f > 1 else 0, tail=0, chunks=[2, 0, 1])
    finally:
        model.executor.close()


@pytest.mark.parametrize("name", EXECUTORS)
def test_a_plan_bound_for_another_layout_is_refused(name: str) -> None:
    model = _model(name)
    move = GroupMove(ids=(1, 2, 3), first=0, rows=(0,))
    empty = GroupMove(ids=(), first=0, rows=())
    bound = bound_plan(1, Direction.STORE, 3, [move, empty, empty], fingerprint="not-this-one")
    with model.executor as executor, pytest.raises(InvalidInputError, match="layout_fingerprint"):
        executor.submit(bound)


@pytest.mark.parametrize("name", EXECUTORS)
def test_a_block_id_beyond_the_tensors_is_refused_naming_the_group(name: str) -> None:
    model = _model(name)
    empty = GroupMove(ids=(), first=0, rows=())
    bad = GroupMove(ids=(1, 2, NUM_BLOCKS), first=0, rows=(0,))
    with model.executor as executor, pytest.raises(PlanInvariantError, match="group 2"):
        executor.submit(bound_plan(1, Direction.STORE, 3, [empty, empty, bad]))


@pytest.mark.parametrize("name", EXECUTORS)
def test_a_row_beyond_the_tier_is_refused(name: str) -> None:
    model = _model(name)
    empty = GroupMove(ids=(), first=0, rows=())
    bad = GroupMove(ids=(1, 2, 3), first=0, rows=(16,))
    with model.executor as executor, pytest.raises(PlanInvariantError, match="cpu_rows"):
        executor.submit(bound_plan(1, Direction.LOAD, 3, [bad, empty, empty]))


@pytest.mark.parametrize("name", EXECUTORS)
def test_every_job_is_reported_once_by_poll_or_wait(name: str) -> None:
    model = _model(name)
    empty = GroupMove(ids=(), first=0, rows=())
    with model.executor as executor:
        for job in (1, 2, 3):
            move = GroupMove(ids=(3 * job, 3 * job + 1, 3 * job + 2), first=0, rows=(job,))
            executor.submit(bound_plan(job, Direction.STORE, 3, [move, empty, empty]))
        (first,) = executor.wait([2])
        reported = [first.job_id]
        while len(reported) < 3:
            reported += [r.job_id for r in executor.poll()]
        assert sorted(reported) == [1, 2, 3]
        assert executor.poll() == []
        with pytest.raises(InvalidInputError, match="job_ids"):
            executor.wait([2])


@pytest.mark.parametrize("name", EXECUTORS)
def test_close_drains_jobs_and_refuses_later_submissions(name: str) -> None:
    model = _model(name)
    empty = GroupMove(ids=(), first=0, rows=())
    move = GroupMove(ids=(1, 2, 3), first=0, rows=(0,))
    executor = model.executor
    executor.submit(bound_plan(1, Direction.STORE, 3, [move, empty, empty]))
    (result,) = executor.close()
    assert result.success and result.job_id == 1
    with pytest.raises(InvalidInputError, match="executor"):
        executor.submit(bound_plan(2, Direction.STORE, 3, [move, empty, empty]))
    assert executor.close() == []


@pytest.mark.parametrize("name", EXECUTORS)
def test_waiting_twice_on_one_id_in_one_call_is_refused(name: str) -> None:
    model = _model(name)
    empty = GroupMove(ids=(), first=0, rows=())
    move = GroupMove(ids=(1, 2, 3), first=0, rows=(0,))
    with model.executor as executor:
        executor.submit(bound_plan(1, Direction.STORE, 3, [move, empty, empty]))
        with pytest.raises(InvalidInputError, match="distinct"):
            executor.wait([1, 1])


STAGING_EXECUTORS = [
    "torch-on-cpu",
    pytest.param("torch", marks=pytest.mark.gpu),
    pytest.param("cupy", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("name", STAGING_EXECUTORS)
@pytest.mark.parametrize("case", ["hybrid_three_groups", "mamba_padded", "kv_split"])
def test_a_staging_buffer_of_one_row_round_trips_in_many_batches(name: str, case: str) -> None:
    probe = _model(name, case, 3)
    row_bytes = probe.executor.layout.largest_row_bytes
    probe.executor.close()
    model = _model(name, case, 3, staging_bytes=row_bytes)
    groups = len(LAYOUT_CASES[case])
    try:
        _round_trip(model, seed=13, skip=2, tail=1, chunks=[3] * groups)
    finally:
        model.executor.close()


@pytest.mark.parametrize("name", EXECUTORS)
def test_a_plan_that_moves_nothing_completes_with_zero_bytes(name: str) -> None:
    model = _model(name)
    empty = GroupMove(ids=(), first=0, rows=())
    with model.executor as executor:
        executor.submit(bound_plan(1, Direction.LOAD, 3, [empty, empty, empty]))
        (result,) = executor.wait([1])
        assert result.success and result.nbytes == 0
