"""Messages across the process boundary: bound plans out and job results back, as bytes."""

from __future__ import annotations

import json

import pytest

from kvferry.adapters.messages import (
    MESSAGE_VERSION,
    Completions,
    decode_completions,
    decode_jobs,
    encode_completions,
    encode_jobs,
)
from kvferry.core.bound import BoundPlan, JobResult
from kvferry.core.errors import InvalidInputError, PlanInvariantError
from kvferry.core.keys import OffloadKey
from kvferry.core.plan import Direction, TransferPlan


def load_job() -> BoundPlan:
    plan = TransferPlan(
        request_id="r7",
        direction=Direction.LOAD,
        blocks_per_chunk=3,
        keys=(OffloadKey(0, b"\x00\x0a"), OffloadKey(0, b"\x00\x0b"), OffloadKey(1, b"\x01\x02")),
        gpu_block_ids=[102, 103, 104, 105, 7],
        group_sizes=(4, 1),
        block_indices=(2, 0),
    )
    return BoundPlan(job_id=41, plan=plan, cpu_rows=[10, 11, 3], layout_fingerprint="sha:ab12")


def store_job() -> BoundPlan:
    plan = TransferPlan(
        request_id="r8",
        direction=Direction.STORE,
        blocks_per_chunk=1,
        keys=(OffloadKey(0, b"\xff"),),
        gpu_block_ids=[9],
        group_sizes=(1,),
        block_indices=(0,),
    )
    return BoundPlan(job_id=42, plan=plan, cpu_rows=[0])


def test_bound_plans_survive_the_round_trip() -> None:
    jobs = (load_job(), store_job())
    assert decode_jobs(encode_jobs(jobs)) == jobs


def test_an_empty_batch_of_jobs_survives_the_round_trip() -> None:
    assert decode_jobs(encode_jobs([])) == ()


def test_job_results_survive_the_round_trip() -> None:
    results = (
        JobResult(job_id=41, success=True, nbytes=3 << 20, seconds=0.000123),
        JobResult(job_id=42, success=False, nbytes=0, seconds=1e-9, error="CUDA error: 700"),
    )
    assert decode_completions(encode_completions(3, results)) == Completions(
        worker=3, results=results
    )


def test_the_same_jobs_give_the_same_bytes() -> None:
    assert encode_jobs([load_job()]) == encode_jobs([load_job()])


def test_a_jobs_message_carries_the_plan_in_its_canonical_form() -> None:
    document = json.loads(encode_jobs([load_job()]))
    assert document["message_version"] == MESSAGE_VERSION
    assert document["kind"] == "jobs"
    assert document["jobs"][0]["plan"]["keys"] == ["g0:000a", "g0:000b", "g1:0102"]


def test_a_completions_message_is_refused_where_jobs_are_expected() -> None:
    with pytest.raises(InvalidInputError, match="kind"):
        decode_jobs(encode_completions(0, []))


def test_a_message_of_another_version_is_refused() -> None:
    data = json.dumps({"message_version": 99, "kind": "jobs", "jobs": []}).encode()
    with pytest.raises(InvalidInputError, match="message_version"):
        decode_jobs(data)


def test_bytes_that_are_not_json_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="UTF-8 JSON"):
        decode_completions(b"\xff\x00")


def test_a_job_whose_rows_do_not_match_its_keys_is_refused() -> None:
    document = json.loads(encode_jobs([store_job()]))
    document["jobs"][0]["cpu_rows"] = [0, 1]
    with pytest.raises(PlanInvariantError, match="cpu_rows"):
        decode_jobs(json.dumps(document).encode())


def test_a_result_whose_success_is_not_a_boolean_is_refused() -> None:
    document = json.loads(
        encode_completions(0, [JobResult(job_id=1, success=True, nbytes=0, seconds=0.0)])
    )
    document["results"][0]["success"] = 1
    with pytest.raises(InvalidInputError, match="success"):
        decode_completions(json.dumps(document).encode())


def test_a_job_id_given_as_a_boolean_is_refused() -> None:
    document = json.loads(encode_jobs([store_job()]))
    document["jobs"][0]["job_id"] = True
    with pytest.raises(InvalidInputError, match="job_id"):
        decode_jobs(json.dumps(document).encode())
