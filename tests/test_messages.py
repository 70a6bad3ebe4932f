"""Messages across the process boundary: bound plans out and job results back, as bytes."""

from __future__ import annotations

import json
from typing import Any

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
    with pytest.raises(InvalidInputError, match="UTF-8"):
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


def test_a_plan_without_a_direction_is_refused_naming_it() -> None:
    document = json.loads(encode_jobs([store_job()]))
    del document["jobs"][0]["plan"]["direction"]
    with pytest.raises(InvalidInputError) as caught:
        decode_jobs(json.dumps(document).encode())
    assert caught.value.field == "jobs[0].plan.direction"


@pytest.mark.parametrize("field", ["job_id", "nbytes"])
def test_a_negative_count_in_a_result_is_refused(field: str) -> None:
    document = json.loads(encode_completions(0, [done(7)]))
    document["results"][0][field] = -1
    with pytest.raises(InvalidInputError) as caught:
        decode_completions(json.dumps(document).encode())
    assert caught.value.field == f"results[0].{field}"


def test_a_negative_job_id_is_refused() -> None:
    document = json.loads(encode_jobs([store_job()]))
    document["jobs"][0]["job_id"] = -42
    with pytest.raises(InvalidInputError, match="job_id"):
        decode_jobs(json.dumps(document).encode())


def test_a_negative_worker_rank_is_refused() -> None:
    document = json.loads(encode_completions(0, []))
    document["worker"] = -1
    with pytest.raises(InvalidInputError) as caught:
        decode_completions(json.dumps(document).encode())
    assert caught.value.field == "worker"


def test_a_misspelled_field_is_refused_not_ignored() -> None:
    document = json.loads(encode_jobs([load_job()]))
    entry = document["jobs"][0]
    entry["layout_fingerprnt"] = entry.pop("layout_fingerprint")
    with pytest.raises(InvalidInputError, match="layout_fingerprint"):
        decode_jobs(json.dumps(document).encode())


@pytest.mark.parametrize("where", ["message", "job", "plan", "result"])
def test_an_unknown_field_is_refused_wherever_it_is(where: str) -> None:
    if where == "result":
        document = json.loads(encode_completions(0, [done(7)]))
        document["results"][0]["extra"] = 1
        decode: Any = decode_completions
    else:
        document = json.loads(encode_jobs([load_job()]))
        target = {
            "message": document,
            "job": document["jobs"][0],
            "plan": document["jobs"][0]["plan"],
        }[where]
        target["extra"] = 1
        decode = decode_jobs
    with pytest.raises(InvalidInputError, match="extra"):
        decode(json.dumps(document).encode())


@pytest.mark.parametrize(
    "text",
    [
        b'{"message_version": 1, "kind": "jobs", "jobs": [], "n": ' + b"9" * 5000 + b"}",
        b'{"message_version": 1.' + b"5" * 5000 + b"}",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"message_version": Infinity}',
        b"\xff\xfe{}",
    ],
    ids=["5000-digit integer", "5000-digit fraction", "deep nesting", "Infinity", "not UTF-8"],
)
def test_a_message_that_is_not_bounded_json_is_refused(text: bytes) -> None:
    with pytest.raises(InvalidInputError) as caught:
        decode_jobs(text)
    assert caught.value.field == "message"


def done(job_id: int) -> JobResult:
    return JobResult(job_id=job_id, success=True, nbytes=128, seconds=0.25)


def _mutations(value: Any) -> list[Any]:
    """Return values of the wrong kind, sign or size to put where `value` was."""
    wrong: list[Any] = [None, True, "7", -1, 1.5, 10**30, [], {}, [1, "x"], {"a": None}]
    if isinstance(value, str):
        wrong += ["", "g9:zz", "load" if value != "load" else "store"]
    if isinstance(value, list) and value:
        wrong += [value[:-1], [*value, value[-1]], [-v if isinstance(v, int) else v for v in value]]
    return wrong


def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Return the path of every value in a JSON document (the document itself excluded)."""
    found: list[tuple[Any, ...]] = []
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for key, child in items:
        found.append((*path, key))
        found += _paths(child, (*path, key))
    return found


def _mutated(document: Any, path: tuple[Any, ...], value: Any, *, delete: bool) -> bytes:
    copy = json.loads(json.dumps(document))
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return json.dumps(copy).encode()


def _every_mutation() -> list[Any]:
    cases = []
    for name, data, decode in (
        ("jobs", encode_jobs([load_job(), store_job()]), decode_jobs),
        ("completions", encode_completions(1, [done(7), done(8)]), decode_completions),
    ):
        document = json.loads(data)
        for path in _paths(document):
            parent = document
            for key in path[:-1]:
                parent = parent[key]
            for value in _mutations(parent[path[-1]]):
                cases.append((name, decode, _mutated(document, path, value, delete=False)))
            cases.append((name, decode, _mutated(document, path, None, delete=True)))
    return cases


def test_every_mutated_message_decodes_or_raises_a_typed_error() -> None:
    outcomes = {"decoded": 0, "refused": 0}
    for _name, decode, data in _every_mutation():
        try:
            decode(data)
        except (InvalidInputError, PlanInvariantError):
            outcomes["refused"] += 1
        else:
            outcomes["decoded"] += 1
    assert outcomes["refused"] > outcomes["decoded"], outcomes
