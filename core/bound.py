"""A plan bound to CPU-tier rows and a job id: what an executor receives; and a job's result.

Values only: the session binds plans (it owns rows and job ids); executors only read these.
"""

from __future__ import annotations

import attrs

from kvferry.core.arrays import IdArray, arrays_equal, integral_ids, is_integral
from kvferry.core.errors import PlanInvariantError
from kvferry.core.plan import TransferPlan


@attrs.frozen(kw_only=True)
class BoundPlan:
    """A TransferPlan with one CPU-tier row per key (same order) and the job id it runs as."""

    job_id: int
    """Assigned by the scheduler side; unique per session."""
    plan: TransferPlan
    """What to move."""
    cpu_rows: IdArray = attrs.field(converter=integral_ids, eq=attrs.cmp_using(eq=arrays_equal))
    """CPU-tier row of each key of `plan.keys`, in the same order."""
    layout_fingerprint: str | None = None
    """Fingerprint of the layout the rows were sized for; an executor with another refuses it."""

    def __attrs_post_init__(self) -> None:
        if not is_integral(self.cpu_rows):
            raise PlanInvariantError(
                request=self.plan.request_id,
                field="cpu_rows",
                expected="integer rows",
                got=self.cpu_rows.tolist(),
            )
        if self.cpu_rows.shape != (len(self.plan.keys),):
            raise PlanInvariantError(
                request=self.plan.request_id,
                field="cpu_rows",
                expected=f"one row per key ({len(self.plan.keys)} keys)",
                got=self.cpu_rows.shape,
            )
        if len(self.cpu_rows) and int(self.cpu_rows.min()) < 0:
            raise PlanInvariantError(
                request=self.plan.request_id,
                field="cpu_rows",
                expected="rows >= 0",
                got=int(self.cpu_rows.min()),
            )


@attrs.frozen(kw_only=True)
class JobResult:
    """What an executor reports when a job ends."""

    job_id: int
    """The job's id, from its BoundPlan."""
    success: bool
    """True when every byte of the plan was copied."""
    nbytes: int
    """Bytes copied (the plan's full size on success)."""
    seconds: float
    """Time from submission to completion, as the executor measured it."""
    error: str | None = None
    """Why the job failed, when it did."""
