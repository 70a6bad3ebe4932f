"""The binary jobs message: the same bound plans as the JSON form, as raw buffers, and refused
whole when its bytes are not one."""

from __future__ import annotations

import struct

import pytest

from kvferry.adapters.messages import decode_jobs, encode_jobs
from kvferry.adapters.wire import MAGIC, decode_jobs_binary, encode_jobs_binary, is_binary
from kvferry.core.bound import BoundPlan
from kvferry.core.errors import InvalidInputError, PlanInvariantError
from kvferry.core.keys import OffloadKey
from kvferry.core.plan import Direction, TransferPlan


def load_job() -> BoundPlan:
    plan = TransferPlan(
        request_id="r7",
        direction=Direction.LOAD,
        blocks_per_chunk=3,
        keys=(OffloadKey(0, b"\x00\x0a"), OffloadKey(0, b"\x00\x0b"), OffloadKey(1, b"\x01")),
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
        keys=(OffloadKey(0, b"\xff" * 32),),
        gpu_block_ids=[9],
        group_sizes=(1,),
        block_indices=(0,),
    )
    return BoundPlan(job_id=42, plan=plan, cpu_rows=[0])


def test_bound_plans_survive_the_binary_round_trip() -> None:
    jobs = (load_job(), store_job())
    assert decode_jobs_binary(encode_jobs_binary(jobs)) == jobs


def test_an_empty_batch_survives_the_binary_round_trip() -> None:
    assert decode_jobs_binary(encode_jobs_binary([])) == ()


def test_decode_jobs_reads_the_binary_form_and_the_json_form_alike() -> None:
    jobs = (load_job(), store_job())
    assert decode_jobs(encode_jobs_binary(jobs)) == decode_jobs(encode_jobs(jobs)) == jobs


def test_a_binary_message_starts_with_its_magic_and_a_json_one_does_not() -> None:
    assert is_binary(encode_jobs_binary([store_job()]))
    assert not is_binary(encode_jobs([store_job()]))


def test_a_truncated_binary_message_is_refused() -> None:
    data = encode_jobs_binary([load_job()])
    with pytest.raises(InvalidInputError, match="bytes left"):
        decode_jobs_binary(data[:-1])


def test_bytes_after_the_last_job_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="no bytes after the last job"):
        decode_jobs_binary(encode_jobs_binary([store_job()]) + b"\x00")


def test_another_wire_version_is_refused() -> None:
    data = bytearray(encode_jobs_binary([store_job()]))
    struct.pack_into("<H", data, len(MAGIC), 99)
    with pytest.raises(InvalidInputError, match="wire_version"):
        decode_jobs_binary(bytes(data))


def test_an_unknown_direction_is_refused() -> None:
    data = bytearray(encode_jobs_binary([store_job()]))
    direction_at = struct.calcsize("<4sHI") + struct.calcsize("<q")
    data[direction_at] = 7
    with pytest.raises(InvalidInputError, match="direction"):
        decode_jobs_binary(bytes(data))


def test_a_decoded_plan_is_validated_like_any_plan() -> None:
    data = bytearray(encode_jobs_binary([store_job()]))
    ids_at = len(data) - 16  # the GPU block id, then the CPU row
    struct.pack_into("<q", data, ids_at, -5)
    with pytest.raises(PlanInvariantError, match="gpu_block_ids"):
        decode_jobs_binary(bytes(data))


def test_a_message_that_is_not_bytes_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="bytes"):
        decode_jobs_binary("KVFJ")  # type: ignore[arg-type]
