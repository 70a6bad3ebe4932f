"""A plan bound to CPU-tier rows and a job id: what an executor receives; and a job's result.

Values only: the session binds plans (it owns rows and job ids); executors only read these.
"""

from __future__ import annotations

import math

import attrs

from kvferry.core.arrays import IdArray, arrays_equal, integral_ids, is_integral
from kvferry.core.checks import at_least, check_count
from kvferry.core.errors import InvalidInputError, PlanInvariantError
from kvferry.core.plan import TransferPlan


@attrs.frozen(kw_only=True)
class BoundPlan:
    """A TransferPlan with one CPU-tier row per key (same order) and the job id it runs as."""

    job_id: int
    """Assigned by the scheduler side (an integer >= 0); unique per session."""
    plan: TransferPlan
    """What to move."""
    cpu_rows: IdArray = attrs.field(converter=integral_ids, eq=attrs.cmp_using(eq=arrays_equal))
    """CPU-tier row of each key of `plan.keys`, in the same order."""
    layout_fingerprint: str | None = None
    """Fingerprint of the layout the rows were sized for; an executor with another refuses it."""

    def __attrs_post_init__(self) -> None:
        check_count(self.job_id, request=self.plan.request_id, field="job_id")
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


def _a_bool(instance: object, attribute: attrs.Attribute[bool], value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidInputError(field=attribute.name, expected="true or false (a bool)", got=value)


def _seconds(instance: object, attribute: attrs.Attribute[float], value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise InvalidInputError(field=attribute.name, expected="a finite number >= 0", got=value)


def _text_or_none(instance: object, attribute: attrs.Attribute[str | None], value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise InvalidInputError(field=attribute.name, expected="a string or None", got=value)


@attrs.frozen(kw_only=True)
class JobResult:
    """What an executor reports when a job ends (validated when built: a failed job never
    reads as a success)."""

    job_id: int = attrs.field(validator=at_least(0))
    """The job's id, from its BoundPlan."""
    success: bool = attrs.field(validator=_a_bool)
    """True when every byte of the plan was copied."""
    nbytes: int = attrs.field(validator=at_least(0))
    """Bytes copied (the plan's full size on success)."""
    seconds: float = attrs.field(validator=_seconds)
    """Time from submission to completion, as the executor measured it."""
    error: str | None = attrs.field(default=None, validator=_text_or_none)
    """Why the job failed, when it did."""
