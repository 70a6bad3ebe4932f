"""Fault injection: an executor wrapper that fails chosen jobs before, midway through or at the end.

For tests and drills only; it never changes a job it was not told to fail, and never reports a
failed job as a success.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import numpy as np

from kvferry.core.arrays import IdArray
from kvferry.core.bound import BoundPlan, JobResult
from kvferry.core.errors import InvalidInputError
from kvferry.core.expand import check_bound
from kvferry.core.keys import OffloadKey
from kvferry.core.layout import KVLayout
from kvferry.core.plan import TransferPlan, chunks_spanned
from kvferry.executors.base import Executor, checked_job_ids
from kvferry.executors.host import HostTier
from kvferry.executors.tensors import RegisteredTensor


class FaultPoint(enum.Enum):
    """When an injected fault strikes a job."""

    BEFORE_START = "before_start"
    """Nothing is copied; the job is reported failed."""
    MIDWAY = "midway"
    """About the first half of each group's pages is copied, then the job is reported failed."""
    AT_COMPLETION = "at_completion"
    """Every byte is copied, but the job is reported failed (e.g. an error at the last event)."""


FaultChooser = Callable[[BoundPlan], "FaultPoint | None"]
"""Decides, per submitted job, whether (and where) it fails; None lets it run untouched."""


def _no_fault(bound: BoundPlan) -> FaultPoint | None:
    return None


def truncated_plan(bound: BoundPlan) -> BoundPlan:
    """Return `bound` cut to the first `ceil(n / 2)` GPU blocks of each group that moves `n`
    (and the rows those blocks touch): what a job had copied when it failed midway."""
    plan = bound.plan
    f = plan.blocks_per_chunk
    ids: list[IdArray] = []
    rows: list[IdArray] = []
    keys: list[OffloadKey] = []
    sizes: list[int] = []
    firsts: list[int] = []
    id_start = key_start = 0
    for n, first in zip(plan.group_sizes, plan.block_indices, strict=True):
        skip = first % f
        n_keys = chunks_spanned(n, skip, f)
        kept = -(-n // 2)
        kept_keys = chunks_spanned(kept, skip, f)
        ids.append(plan.gpu_block_ids[id_start : id_start + kept])
        keys.extend(plan.keys[key_start : key_start + kept_keys])
        rows.append(bound.cpu_rows[key_start : key_start + kept_keys])
        sizes.append(kept)
        firsts.append(first if kept else 0)
        id_start += n
        key_start += n_keys
    cut = TransferPlan(
        request_id=plan.request_id,
        direction=plan.direction,
        blocks_per_chunk=f,
        keys=tuple(keys),
        gpu_block_ids=np.concatenate(ids) if ids else np.zeros(0, np.int64),
        group_sizes=tuple(sizes),
        block_indices=tuple(firsts),
    )
    return BoundPlan(
        job_id=bound.job_id,
        plan=cut,
        cpu_rows=np.concatenate(rows) if rows else np.zeros(0, np.int64),
        layout_fingerprint=bound.layout_fingerprint,
    )


@attrs.define
class _Pending:
    point: FaultPoint | None
    nbytes: int


class FaultyExecutor:
    """Wraps any `Executor` and fails the jobs a chooser (or `inject`) names; it is itself an
    `Executor` (registered as one), so it runs wherever one does, worker processes included.

    Plans are checked as the wrapped executor would check them (a bad plan still raises and
    queues nothing). A job failing `BEFORE_START` never reaches the wrapped executor; one failing
    `MIDWAY` runs a plan cut to the first half of each group's blocks; one failing
    `AT_COMPLETION` runs whole. Each job is reported exactly once, by `poll` or `wait`.
    """

    def __init__(
        self,
        inner: Executor,
        choose: FaultChooser | Mapping[int, FaultPoint] | None = None,
    ) -> None:
        if not isinstance(inner, Executor):
            raise InvalidInputError(field="inner", expected="an Executor", got=inner)
        self._inner = inner
        if choose is None:
            self._choose: FaultChooser = _no_fault
        elif isinstance(choose, Mapping):
            table = dict(choose)
            self._choose = lambda bound: table.get(bound.job_id)
        else:
            self._choose = choose
        self.name = f"faulty {inner.name}"
        """The wrapped executor's name, marked."""
        self._injected: dict[int, FaultPoint] = {}
        self._pending: dict[int, _Pending] = {}
        """Jobs submitted and not yet reported, in submission order."""
        self._closed = False
        self.injected_count = 0
        """How many jobs this wrapper has failed on purpose."""

    # -- what the wrapped executor provides ---------------------------------------------------

    @property
    def inner(self) -> Executor:
        """Return the wrapped executor."""
        return self._inner

    @property
    def layout(self) -> KVLayout:
        """Return the wrapped executor's layout."""
        return self._inner.layout

    @property
    def host_tier(self) -> HostTier:
        """Return the wrapped executor's CPU tier."""
        return self._inner.host_tier

    @property
    def device(self) -> str:
        """Return where the wrapped executor's tensors live."""
        return self._inner.device

    @property
    def tensors(self) -> tuple[tuple[RegisteredTensor, ...], ...]:
        """Return the wrapped executor's registered tensors."""
        return self._inner.tensors

    # -- injection ------------------------------------------------------------------------------

    def inject(self, job_id: int, point: FaultPoint) -> None:
        """Make the job `job_id`, when submitted, fail at `point` (overrides the chooser)."""
        if not isinstance(point, FaultPoint):
            raise InvalidInputError(field="point", expected="a FaultPoint", got=point)
        self._injected[job_id] = point

    # -- the executor contract ----------------------------------------------------------------

    def submit(self, bound: BoundPlan) -> int:
        """Queue `bound` (failing it as chosen) and return its job id; raise as the wrapped
        executor would for a plan it refuses, queueing nothing."""
        if self._closed:
            raise InvalidInputError(field="executor", expected="an open executor", got="closed")
        if bound.job_id in self._pending:
            raise InvalidInputError(
                request=bound.plan.request_id,
                field="job_id",
                expected="a job id not in flight",
                got=bound.job_id,
            )
        point = self._injected.pop(bound.job_id, None) or self._choose(bound)
        if point is FaultPoint.BEFORE_START:
            fingerprint = self._inner.layout.fingerprint
            if bound.layout_fingerprint is not None and bound.layout_fingerprint != fingerprint:
                raise InvalidInputError(
                    request=bound.plan.request_id,
                    field="layout_fingerprint",
                    expected=fingerprint,
                    got=bound.layout_fingerprint,
                )
            check_bound(bound, self._inner.layout, num_rows=self._inner.host_tier.num_rows)
        elif point is FaultPoint.MIDWAY:
            check_bound(bound, self._inner.layout, num_rows=self._inner.host_tier.num_rows)
            self._inner.submit(truncated_plan(bound))
        else:
            self._inner.submit(bound)
        if point is not None:
            self.injected_count += 1
        self._pending[bound.job_id] = _Pending(point=point, nbytes=0)
        return bound.job_id

    def _result(self, job_id: int, inner: JobResult | None) -> JobResult:
        pending = self._pending.pop(job_id)
        if pending.point is None and inner is not None:
            return inner
        copied = 0 if inner is None or not inner.success else inner.nbytes
        seconds = 0.0 if inner is None else inner.seconds
        reason = f"injected fault {pending.point.value if pending.point else '?'}"
        if inner is not None and not inner.success:
            reason = f"{reason}; {inner.error}"
        return JobResult(
            job_id=job_id,
            success=False,
            nbytes=copied,
            seconds=seconds,
            error=f"{reason} after {copied} bytes",
        )

    def poll(self) -> list[JobResult]:
        """Return the results of jobs that ended since the last report, in submission order."""
        ended = {result.job_id: result for result in self._inner.poll()}
        out = []
        for job_id, pending in list(self._pending.items()):
            if pending.point is FaultPoint.BEFORE_START:
                out.append(self._result(job_id, None))
            elif job_id in ended:
                out.append(self._result(job_id, ended[job_id]))
        return out

    def wait(self, job_ids: Iterable[int]) -> list[JobResult]:
        """Block until the given jobs end; return their results in the order asked."""
        ids = checked_job_ids(job_ids, self._pending)
        started = [i for i in ids if self._pending[i].point is not FaultPoint.BEFORE_START]
        inner = dict(zip(started, self._inner.wait(started), strict=True))
        return [self._result(job_id, inner.get(job_id)) for job_id in ids]

    def close(self) -> list[JobResult]:
        """Wait for every job in flight and close the wrapped executor (idempotent)."""
        if self._closed:
            return []
        results = self.wait(list(self._pending))
        self._closed = True
        self._inner.close()
        return results

    def __enter__(self) -> FaultyExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# It keeps the whole executor contract, so it is one wherever an Executor is asked for (the
# vLLM worker connector, a tensor-parallel worker process).
Executor.register(FaultyExecutor)
