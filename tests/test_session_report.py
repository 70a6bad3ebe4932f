"""`report` trusts only well-formed results of jobs it issued: job ids 0 and below are never
issued (ids start at 1) and are refused like any unknown id; results of jobs from before a
reset are the only ones ignored."""

from __future__ import annotations

import pytest
from session_world import make_world

from kvferry.core.bound import JobResult
from kvferry.core.errors import InvalidInputError


def result(job_id: int, *, success: bool = True) -> JobResult:
    return JobResult(job_id=job_id, success=success, nbytes=0, seconds=0.0)


def test_job_id_0_is_refused_as_never_issued() -> None:
    world = make_world()
    with pytest.raises(InvalidInputError, match="never issued") as caught:
        world.session.report(0, [result(0)])
    assert caught.value.field == "job_id"


def test_a_result_that_says_failure_in_words_cannot_be_made() -> None:
    with pytest.raises(InvalidInputError, match="success"):
        JobResult(job_id=3, success="false", nbytes=0, seconds=0.0)  # type: ignore[arg-type]


def test_a_failed_result_fails_its_job() -> None:
    world = make_world()
    report = world.session.report(0, [result(world.store_job.job_id, success=False)])
    assert report.failed == (world.store_job.job_id,)


def test_results_of_jobs_from_before_a_reset_are_still_ignored() -> None:
    world = make_world()
    abandoned = world.session.reset()
    assert world.store_job.job_id in abandoned
    assert world.session.report(0, [result(world.store_job.job_id)]).completed == ()
