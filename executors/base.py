"""The executor contract: submit a bound plan, poll or wait for its result, close to drain.

Bookkeeping shared by every executor lives here; backends only enqueue copies and report when
they end. An executor never decides what to move: it runs the plans it is given.
"""

from __future__ import annotations

import abc
import enum
import time
from collections.abc import Container, Iterable, Sequence
from typing import Any, ClassVar

import attrs

from kvferry.core.bound import BoundPlan, JobResult
from kvferry.core.errors import InvalidInputError, KvferryError
from kvferry.core.expand import check_bound
from kvferry.core.layout import KVLayout
from kvferry.core.plan import Direction
from kvferry.executors.host import HostRegistrar, HostTier
from kvferry.executors.jobcode import JobCode, job_code, route_of
from kvferry.executors.tensors import KVCacheEntry, RegisteredTensor, build_layout


def checked_job_ids(job_ids: Iterable[int], in_flight: Container[int]) -> list[int]:
    """Return `job_ids` as a list, or raise InvalidInputError (changing nothing) for a repeated
    id or one that is not in flight: what every executor's `wait` accepts."""
    ids = list(job_ids)
    if len(set(ids)) != len(ids):
        raise InvalidInputError(field="job_ids", expected="distinct ids", got=ids)
    for job_id in ids:
        if job_id not in in_flight:
            raise InvalidInputError(field="job_ids", expected="ids of jobs in flight", got=job_id)
    return ids


class CopyPath(enum.Enum):
    """How a GPU executor moves one transfer's bytes."""

    STAGED = "staged"
    """Gather on the GPU into a staging buffer + one DMA per CPU range (or the reverse)."""
    ZERO_COPY = "zero_copy"
    """A copy kernel that reads or writes pinned host memory directly (no staging)."""


@attrs.define(kw_only=True)
class _Job:
    job_id: int
    nbytes: int
    submitted: float
    handle: Any
    failure: str | None = None


class Executor(abc.ABC):
    """Runs bound plans asynchronously between registered KV tensors and a host tier.

    `submit` returns at once; every job is reported exactly once, by `poll` or `wait`.

    `num_rows` is the host tier's rows of each group: one count for every group, or one per
    group (every group has its own rows, at its own pitch: `KVLayout.tier`).

    `route` picks the code of the per-job host work (`executors.jobcode`): `"native"` (the
    compiled module), `"python"`, or None for the compiled module where it is built (unless
    `KVFERRY_NO_NATIVE=1`). Every route gives the same results.
    """

    name: ClassVar[str]
    """The name it is registered under."""
    on_gpu: ClassVar[bool] = True
    """Whether its KV tensors live in CUDA memory."""

    def __init__(
        self,
        *,
        kv_caches: Sequence[Sequence[KVCacheEntry]],
        blocks_per_chunk: int,
        num_rows: int | Sequence[int],
        route: str | None = None,
    ) -> None:
        self._code: JobCode = job_code(route)
        """The module that makes the per-job host work: the compiled one or `_python`."""
        self._layout, self._tensors = build_layout(kv_caches, blocks_per_chunk, on_gpu=self.on_gpu)
        devices = {t.geometry.device for group in self._tensors for t in group}
        if len(devices) > 1:
            raise InvalidInputError(
                field="kv_caches", expected="tensors on one device", got=sorted(devices)
            )
        self._host = HostTier(tier=self._layout.tier(num_rows), registrar=self._registrar())
        self._jobs: dict[int, _Job] = {}
        self._closed = False
        groups = self._layout.groups
        self._group_limits = (
            tuple(group.num_blocks for group in groups),
            tuple(group.block_copy_bytes for group in groups),
        )
        """The layout's block count and bytes per block of each group, for `_checked_bytes`."""

    # --- what a backend provides -------------------------------------------------------------

    def _registrar(self) -> HostRegistrar | None:
        """Return how to pin the host tier, or None to leave it pageable."""
        return None

    @abc.abstractmethod
    def _enqueue(self, bound: BoundPlan) -> Any:
        """Queue the copies of `bound` (checked by `check_bound`); return a handle
        `_done`/`_finish` understand."""

    @abc.abstractmethod
    def _done(self, handle: Any) -> bool:
        """Return True once the job's copies have finished (raise if they failed)."""

    @abc.abstractmethod
    def _finish(self, handle: Any) -> float:
        """Block until the job ends; return its copy time in seconds (raise if it failed)."""

    def _release(self) -> None:
        """Free backend resources after every job has ended (the base class holds none)."""
        return None

    # --- the contract --------------------------------------------------------------------------

    @property
    def layout(self) -> KVLayout:
        """Return the layout of the registered tensors."""
        return self._layout

    @property
    def route(self) -> str:
        """Return the route that makes the per-job host work: `"native"` or `"python"`."""
        return route_of(self._code)

    @property
    def tensors(self) -> tuple[tuple[RegisteredTensor, ...], ...]:
        """Return every registered tensor (geometry and refs), group by group."""
        return self._tensors

    @property
    def device(self) -> str:
        """Return where the registered tensors live (`cpu`, `cuda:N`, or `cuda` when unknown)."""
        return next(t.geometry.device for group in self._tensors for t in group)

    @property
    def host_tier(self) -> HostTier:
        """Return the CPU tier this executor copies to and from."""
        return self._host

    def submit(self, bound: BoundPlan) -> int:
        """Queue `bound` and return its job id at once.

        Raises InvalidInputError (nothing queued) for a closed executor, a job id already in
        flight, or a plan bound for another layout; PlanInvariantError for a plan that does not
        fit the layout or the tier.
        """
        if self._closed:
            raise InvalidInputError(field="executor", expected="an open executor", got="closed")
        fingerprint = self._layout.fingerprint
        if bound.layout_fingerprint is not None and bound.layout_fingerprint != fingerprint:
            raise InvalidInputError(
                request=bound.plan.request_id,
                field="layout_fingerprint",
                expected=fingerprint,
                got=bound.layout_fingerprint,
            )
        if bound.job_id in self._jobs:
            raise InvalidInputError(
                request=bound.plan.request_id,
                field="job_id",
                expected="a job id not in flight",
                got=bound.job_id,
            )
        submitted = time.perf_counter()
        nbytes = self._checked_bytes(bound)
        job = _Job(job_id=bound.job_id, nbytes=nbytes, submitted=submitted, handle=None)
        try:
            job.handle = self._enqueue(bound)
        except KvferryError:
            raise
        except Exception as error:  # a backend failure becomes a failed job, not a crash
            job.failure = f"{type(error).__name__}: {error}"
        self._jobs[bound.job_id] = job
        return bound.job_id

    def _checked_bytes(self, bound: BoundPlan) -> int:
        """Return the bytes `bound` moves, after `check_bound`'s checks against the layout and
        the tier (raising what it raises).

        On the compiled route the checks run first as one C pass (`bound_bytes`), which answers
        only for a plan that certainly fits; for any other, and on the Python route, `check_bound`
        runs and says what is wrong. Right after a `wait()` a submit's code and data are partly
        out of the CPU caches, where each numpy call costs ten times what it does warm:
        `check_bound` took 11-46 us of a 2048-block load's submit on an NVIDIA H200's host, and
        46-50 us against 14-16 us for the C pass on a development CPU with the caches swept
        (`benchmarks/host_steps.py`).
        """
        plan = bound.plan
        num_blocks, copy_bytes = self._group_limits
        nbytes = self._code.bound_bytes(
            plan.gpu_block_ids,
            bound.cpu_rows,
            plan.group_sizes,
            plan.block_indices,
            plan.blocks_per_chunk,
            self._layout.blocks_per_chunk,
            num_blocks,
            copy_bytes,
            self._host.num_rows,
            plan.direction is Direction.STORE,
        )
        if nbytes < 0:
            return check_bound(bound, self._layout, num_rows=self._host.num_rows)
        return nbytes

    def poll(self) -> list[JobResult]:
        """Return the results of jobs that have ended since the last report, in submission order."""
        ended = []
        for job in list(self._jobs.values()):
            try:
                finished = job.failure is not None or self._done(job.handle)
            except Exception as error:
                job.failure = f"{type(error).__name__}: {error}"
                finished = True
            if finished:
                ended.append(self._report(job))
        return ended

    def wait(self, job_ids: Iterable[int]) -> list[JobResult]:
        """Block until the given jobs end; return their results in the order asked.

        Raises InvalidInputError for an id that is not in flight (unknown or already reported).
        """
        ids = checked_job_ids(job_ids, self._jobs)
        return [self._report(self._jobs[job_id]) for job_id in ids]

    def close(self) -> list[JobResult]:
        """Wait for every job in flight, release the backend and unpin the tier (idempotent).

        Returns the results of the jobs that were still unreported.
        """
        if self._closed:
            return []
        results = self.wait(list(self._jobs))
        self._closed = True
        self._release()
        self._host.close()
        return results

    def _report(self, job: _Job) -> JobResult:
        seconds = 0.0
        if job.failure is None:
            try:
                seconds = self._finish(job.handle)
            except Exception as error:
                job.failure = f"{type(error).__name__}: {error}"
        del self._jobs[job.job_id]
        if job.failure is not None:
            elapsed = time.perf_counter() - job.submitted
            return JobResult(
                job_id=job.job_id, success=False, nbytes=0, seconds=elapsed, error=job.failure
            )
        return JobResult(job_id=job.job_id, success=True, nbytes=job.nbytes, seconds=seconds)

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
