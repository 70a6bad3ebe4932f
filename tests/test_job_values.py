"""Job results and bound plans are validated when they are built, like every other value: a
failed job can never read as a success, and a job id is never negative."""

from __future__ import annotations

from typing import Any

import pytest

from kvferry.core.bound import BoundPlan, JobResult
from kvferry.core.errors import InvalidInputError
from kvferry.core.keys import OffloadKey
from kvferry.core.plan import Direction, TransferPlan


def result(**changes: Any) -> JobResult:
    fields: dict[str, Any] = {"job_id": 3, "success": True, "nbytes": 64, "seconds": 0.5}
    fields.update(changes)
    return JobResult(**fields)


def test_a_well_formed_result_keeps_its_fields() -> None:
    done = result(success=False, nbytes=0, error="CUDA error 700")
    assert (done.job_id, done.success, done.nbytes, done.error) == (3, False, 0, "CUDA error 700")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("success", "false"),
        ("success", 0),
        ("success", None),
        ("job_id", -1),
        ("job_id", 2.0),
        ("job_id", True),
        ("job_id", "3"),
        ("nbytes", -64),
        ("nbytes", 64.0),
        ("seconds", -0.1),
        ("seconds", float("nan")),
        ("seconds", float("inf")),
        ("seconds", "0.5"),
        ("seconds", True),
        ("error", 700),
    ],
)
def test_a_malformed_result_is_refused_naming_its_field(field: str, value: object) -> None:
    with pytest.raises(InvalidInputError) as caught:
        result(**{field: value})
    assert caught.value.field == field
    assert repr(caught.value.got) == repr(value)


def test_a_result_of_a_failed_job_is_never_truthy_as_a_success() -> None:
    with pytest.raises(InvalidInputError, match="success"):
        result(success="false")


def test_seconds_given_as_an_integer_are_kept_as_a_number() -> None:
    assert result(seconds=2).seconds == 2


def _plan() -> TransferPlan:
    return TransferPlan(
        request_id="r1",
        direction=Direction.STORE,
        blocks_per_chunk=1,
        keys=(OffloadKey(0, b"\x01"),),
        gpu_block_ids=[4],
        group_sizes=(1,),
        block_indices=(0,),
    )


@pytest.mark.parametrize("job_id", [-1, True, 1.0, "1"])
def test_a_bound_plan_with_a_malformed_job_id_is_refused(job_id: object) -> None:
    with pytest.raises(InvalidInputError) as caught:
        BoundPlan(job_id=job_id, plan=_plan(), cpu_rows=[0])
    assert (caught.value.field, caught.value.request) == ("job_id", "r1")
