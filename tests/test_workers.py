"""Worker processes (`kvferry.adapters.workers`): real spawned processes with the cpu executor,
each rank over its own shard; byte-exact round trips, world-size counting, failures by rank."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest
from session_fakes import blocks, prefix_hashes

from kvferry.adapters.session import OffloadSession, RunningRequest
from kvferry.adapters.workers import (
    Handler,
    WorkerCrashedError,
    WorkerPool,
    WorkerRaisedError,
    WorkerShard,
    WorkerTimeoutError,
    report_all,
)
from kvferry.core.bound import BoundPlan
from kvferry.core.catalog import Catalog, CatalogConfig
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.errors import InvalidInputError
from kvferry.core.layout import TensorLayout
from kvferry.executors import KVTensor, make_executor
from kvferry.executors.cpu import CpuExecutor
from kvferry.executors.faults import FaultPoint, FaultyExecutor

CONFIG = OffloadConfig(
    hash_block_size=4,
    blocks_per_chunk=2,
    groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=4),),
)
NUM_BLOCKS = 24
LAYERS = 2
HEADS = 4
"""KV heads of the whole model; each of the ranks holds HEADS / world_size of them."""
HEAD_BYTES = 16
NUM_ROWS = 8


def shard_tensor(rank: int, layer: int, heads: int) -> npt.NDArray[np.uint8]:
    """Return what a rank's layer holds at start: bytes derived from (rank, layer)."""
    rng = np.random.default_rng([rank, layer])
    return rng.integers(0, 256, size=(NUM_BLOCKS, 2, heads * HEAD_BYTES), dtype=np.uint8)


class SlowCpuExecutor(CpuExecutor):
    """The cpu executor, but a job only counts as ended `delay` seconds after its submission."""

    name = "slow-cpu"
    delay = 0.3

    def _enqueue(self, bound: BoundPlan) -> float:
        super()._enqueue(bound)
        return time.monotonic() + self.delay

    def _done(self, handle: float) -> bool:
        return time.monotonic() >= handle

    def _finish(self, handle: float) -> float:
        time.sleep(max(handle - time.monotonic(), 0.0))
        return self.delay


@attrs.frozen
class HostShard:
    """A rank's shard on host memory: LAYERS blocks-first tensors of HEADS / world_size heads."""

    slow: bool = False
    odd_rank_heads: int | None = None
    fail_rank: int | None = None
    faults: tuple[tuple[int, FaultPoint], ...] = ()
    """Jobs the ranks' executors fail on purpose (a FaultyExecutor wraps the cpu executor)."""
    short_rank: int | None = None
    """A rank whose CPU tier has 2 rows instead of NUM_ROWS (it refuses plans for row >= 2)."""
    not_an_executor: bool = False

    def __call__(self, rank: int, world_size: int) -> WorkerShard:
        if rank == self.fail_rank:
            raise InvalidInputError(field="shard", expected="a shard", got=f"rank {rank} refuses")
        heads = HEADS // world_size
        if rank % 2 and self.odd_rank_heads is not None:
            heads = self.odd_rank_heads
        tensors = [shard_tensor(rank, layer, heads) for layer in range(LAYERS)]
        kv = [[KVTensor(tensor=t, layout=TensorLayout.BLOCKS_FIRST) for t in tensors]]
        rows = 2 if rank == self.short_rank else NUM_ROWS
        if self.slow:
            executor: Any = SlowCpuExecutor(kv_caches=kv, blocks_per_chunk=2, num_rows=rows)
        else:
            executor = make_executor("cpu", kv_caches=kv, blocks_per_chunk=2, num_rows=rows)
        if self.faults:
            executor = FaultyExecutor(executor, dict(self.faults))

        def pages(ids: Sequence[int]) -> list[bytes]:
            return [t[list(ids)].tobytes() for t in tensors]

        def zero(ids: Sequence[int]) -> None:
            for t in tensors:
                t[list(ids)] = 0

        def crash(code: int | None) -> None:
            if code is not None:
                os._exit(code)

        def sleep(seconds: float) -> None:
            time.sleep(seconds)

        def leave(reason: str) -> None:
            if reason:
                raise SystemExit(reason)

        def unpicklable(_: object) -> object:
            return lambda: None

        handlers: dict[str, Handler] = {
            "pages": pages,
            "zero": zero,
            "crash": crash,
            "sleep": sleep,
            "leave": leave,
            "unpicklable": unpicklable,
        }
        return WorkerShard(executor=None if self.not_an_executor else executor, handlers=handlers)


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    """Two healthy ranks, shared by the tests that leave them healthy."""
    with WorkerPool(HostShard(), 2, reply_timeout=30) as workers:
        yield workers


def new_session(pool: WorkerPool) -> OffloadSession:
    """Return a session counting the pool's ranks, bound to their layout."""
    catalog = Catalog(CatalogConfig(capacity_rows=NUM_ROWS))
    return OffloadSession(
        CONFIG, catalog, world_size=pool.world_size, layout_fingerprint=pool.layout_fingerprint
    )


def store_prompt(
    session: OffloadSession, request: str, ids: list[int], family: int = 0
) -> BoundPlan:
    """Return the store job of a request whose prompt fills `ids` (prefix family `family`)."""
    step = session.start_stores(
        [
            RunningRequest(
                request_id=request,
                blocks=[blocks(ids)],
                num_computed_tokens=0,
                num_scheduled_tokens=4 * len(ids),
                num_tokens=4 * len(ids),
                block_hashes=prefix_hashes(len(ids), family=family),
            )
        ]
    )
    (job,) = step.jobs
    return job


def test_a_stored_prompt_loads_back_byte_exact_on_every_rank(pool: WorkerPool) -> None:
    session = new_session(pool)
    first, second = [3, 7, 1, 5], [20, 11, 12, 9, 2]
    report_all(session, pool.submit([store_prompt(session, "r1", first)]))
    session.finish("r1")
    before = pool.call("pages", first)
    pool.call("zero", first)
    hashes = prefix_hashes(4)
    session.lookup("r2", block_hashes=hashes, num_tokens=17, num_computed_tokens=0)
    load = session.start_load("r2", [blocks(second)], num_computed_tokens=0, hit_tokens=16)
    assert load is not None
    report = report_all(session, pool.submit([load]))
    assert report.completed == (load.job_id,)
    assert pool.call("pages", second[:4]) == before


def test_each_rank_moves_its_own_bytes(pool: WorkerPool) -> None:
    ids = [4, 6]
    rank0, rank1 = pool.call("pages", ids)
    assert rank0 == [shard_tensor(0, layer, 2)[ids].tobytes() for layer in range(LAYERS)]
    assert rank1 == [shard_tensor(1, layer, 2)[ids].tobytes() for layer in range(LAYERS)]
    assert rank0 != rank1


def test_a_job_completes_only_once_every_rank_reported(pool: WorkerPool) -> None:
    session = new_session(pool)
    job = store_prompt(session, "r3", [13, 14])
    rank0, rank1 = pool.submit([job])
    assert report_all(session, [rank0]).completed == ()
    assert job.job_id in session.in_flight()
    assert report_all(session, [rank1]).completed == (job.job_id,)
    assert session.in_flight() == frozenset()


def test_every_rank_reports_under_its_own_rank(pool: WorkerPool) -> None:
    session = new_session(pool)
    completions = pool.submit([store_prompt(session, "r4", [15, 16])])
    assert [c.worker for c in completions] == [0, 1]


def test_a_plan_for_another_layout_fails_on_every_rank_naming_the_refusal(
    pool: WorkerPool,
) -> None:
    session = new_session(pool)
    job = attrs.evolve(store_prompt(session, "r5", [17, 18]), layout_fingerprint="other")
    completions = pool.submit([job])
    for rank, part in enumerate(completions):
        (result,) = part.results
        assert (result.job_id, result.success) == (job.job_id, False)
        assert f"refused by rank {rank}" in (result.error or "")
        assert "layout_fingerprint" in (result.error or "")
    assert report_all(session, completions).failed == (job.job_id,)
    assert session.in_flight() == frozenset()


def test_a_job_one_rank_refuses_fails_instead_of_staying_in_flight() -> None:
    with WorkerPool(HostShard(short_rank=1), 2, reply_timeout=30) as workers:
        session = new_session(workers)
        job = store_prompt(session, "r7", [3, 4, 5, 6, 7, 8, 9, 10])  # rows 0-3: rank 1 has 2
        rank0, rank1 = workers.submit([job])  # the cpu executor's jobs end inside submit
        assert [r.success for r in rank0.results] == [True]
        assert [r.success for r in rank1.results] == [False]
        assert "refused by rank 1" in (rank1.results[0].error or "")
        report = report_all(session, [rank0, rank1])
        assert (report.completed, report.failed) == ((job.job_id,), (job.job_id,))
        assert session.in_flight() == frozenset()
        assert session.catalog.rows_used == 0  # the failed store's rows came back


def test_a_command_raising_in_a_worker_names_the_rank_and_keeps_the_pool(
    pool: WorkerPool,
) -> None:
    with pytest.raises(WorkerRaisedError, match="worker rank 0: InvalidInputError"):
        pool.call("no-such-command")
    assert [c.results for c in pool.poll()] == [(), ()]


def test_ranks_start_with_one_layout_fingerprint(pool: WorkerPool) -> None:
    assert {info.layout_fingerprint for info in pool.infos} == {pool.layout_fingerprint}
    assert [info.rank for info in pool.infos] == [0, 1]


def test_ranks_with_different_layouts_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="layout_fingerprint of rank 1"):
        WorkerPool(HostShard(odd_rank_heads=1), 2, reply_timeout=30)


def test_a_rank_failing_to_start_is_named() -> None:
    with pytest.raises(WorkerRaisedError, match="worker rank 1: InvalidInputError"):
        WorkerPool(HostShard(fail_rank=1), 2, reply_timeout=30)


def test_a_dead_worker_raises_a_crash_naming_its_rank() -> None:
    with WorkerPool(HostShard(), 2, reply_timeout=30) as workers:
        with pytest.raises(WorkerCrashedError) as caught:
            workers.call_each("crash", [None, 3])
        assert (caught.value.rank, caught.value.exitcode) == (1, 3)
        with pytest.raises(WorkerCrashedError):
            workers.poll()  # a broken pool refuses further commands


def test_a_hung_worker_raises_a_timeout_naming_its_rank() -> None:
    started = time.monotonic()
    with WorkerPool(HostShard(), 2, reply_timeout=1.0) as workers:
        with pytest.raises(WorkerTimeoutError) as caught:
            workers.call_each("sleep", [0.0, 60.0])
        assert caught.value.rank == 1
    assert time.monotonic() - started < 30


def test_close_drains_jobs_still_running_and_reports_them() -> None:
    workers = WorkerPool(HostShard(slow=True), 2, reply_timeout=30)
    session = new_session(workers)
    job = store_prompt(session, "r6", [3, 4])
    assert [c.results for c in workers.submit([job])] == [(), ()]
    drained = workers.close()
    assert [[r.job_id for r in c.results] for c in drained] == [[job.job_id], [job.job_id]]
    assert report_all(session, drained).completed == (job.job_id,)


def test_close_ends_every_worker_process() -> None:
    workers = WorkerPool(HostShard(), 2, reply_timeout=30)
    pids = [info.pid for info in workers.infos]
    workers.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_closed_pool_refuses_commands() -> None:
    workers = WorkerPool(HostShard(), 1, reply_timeout=30)
    workers.close()
    with pytest.raises(InvalidInputError, match="closed"):
        workers.poll()


ORPHANED = """
import os, sys, time
sys.path.insert(0, {tests!r})
from test_workers import HostShard
from kvferry.adapters.workers import WorkerPool

if __name__ == "__main__":
    pool = WorkerPool(HostShard(), 2, reply_timeout=30)
    print(" ".join(str(info.pid) for info in pool.infos), flush=True)
    for entry in pool._ranks:  # rank 1 answers after its parent is gone
        entry.conn.send(("call", "sleep", 0.0 if entry.rank == 0 else 1.0))
    time.sleep(0.3)
    os.kill(os.getpid(), 9)
"""


def test_workers_whose_parent_died_exit_quietly(tmp_path: Path) -> None:
    script = tmp_path / "orphaned.py"
    script.write_text(ORPHANED.format(tests=str(Path(__file__).parent)), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == -9
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)
    assert done.stderr == ""  # the workers held the pipe until they ended: all they wrote


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text(encoding="ascii").rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_fault_injecting_executor_runs_inside_a_worker() -> None:
    with WorkerPool(HostShard(faults=((1, FaultPoint.MIDWAY),)), 2, reply_timeout=30) as workers:
        session = new_session(workers)
        job = store_prompt(session, "r8", [3, 4])
        assert job.job_id == 1
        completions = workers.submit([job])
        results = [r for part in completions for r in part.results]
        assert [r.success for r in results] == [False, False]
        assert all("injected fault midway" in (r.error or "") for r in results)
        assert report_all(session, completions).failed == (1,)


def test_a_worker_that_dies_of_an_error_carries_its_text_to_the_parent() -> None:
    with (
        WorkerPool(HostShard(), 2, reply_timeout=30) as workers,
        pytest.raises(WorkerCrashedError) as caught,
    ):
        workers.call_each("leave", ["", "the shard gave up"])
    assert caught.value.rank == 1
    assert "SystemExit: the shard gave up" in str(caught.value)


def test_an_answer_that_cannot_be_sent_is_an_error_of_the_command() -> None:
    with WorkerPool(HostShard(), 1, reply_timeout=30) as workers:
        with pytest.raises(WorkerRaisedError, match=r"worker rank 0: .*(Pickl|pickle)"):
            workers.call("unpicklable")
        assert [c.results for c in workers.poll()] == [()]


def test_a_shard_without_an_executor_fails_at_start_naming_why() -> None:
    with pytest.raises(WorkerRaisedError, match=r"worker rank 0: InvalidInputError.*executor"):
        WorkerPool(HostShard(not_an_executor=True), 1, reply_timeout=30)
