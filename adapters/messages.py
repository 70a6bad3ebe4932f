"""Messages that cross the process boundary: bound plans to workers, job results back.

Bytes in, values out (and back), through the canonical plan JSON of `kvferry.core.codec`; no
sockets or queues here: the engine carries the bytes however it likes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvferry.adapters.wire import decode_jobs_binary, is_binary
from kvferry.core.bound import BoundPlan, JobResult
from kvferry.core.canonical_json import dumps_canonical
from kvferry.core.checks import at_least
from kvferry.core.codec import plan_from_dict, plan_to_dict
from kvferry.core.errors import InvalidInputError
from kvferry.core.json_input import JsonObject, parse_json
from kvferry.core.plan import TransferPlan

MESSAGE_VERSION = 1
"""Bumped whenever a message field changes meaning or shape (plans carry their own version)."""


class MessageKind(enum.Enum):
    """What a message carries."""

    JOBS = "jobs"
    """Scheduler -> workers: bound plans to run."""
    COMPLETIONS = "completions"
    """Worker -> scheduler: results of finished jobs."""


@attrs.frozen(kw_only=True)
class Completions:
    """The results one worker reports (the input of `OffloadSession.report`)."""

    worker: int = attrs.field(validator=at_least(0))
    """The reporting worker's rank, in `[0, world_size)`."""
    results: tuple[JobResult, ...] = attrs.field(
        validator=attrs.validators.deep_iterable(attrs.validators.instance_of(JobResult))
    )
    """Its finished jobs."""


MAX_MESSAGE_BYTES = 1 << 30
"""Largest message decoded (1 GiB: far above a step's jobs, below what exhausts a host)."""

_JOB_FIELDS = ("job_id", "cpu_rows", "layout_fingerprint", "plan")
_PLAN_FIELDS = (
    "schema_version",
    "request_id",
    "direction",
    "blocks_per_chunk",
    "keys",
    "gpu_block_ids",
    "group_sizes",
    "block_indices",
)
_RESULT_FIELDS = ("job_id", "success", "nbytes", "seconds", "error")


def _encode(kind: MessageKind, fields: Mapping[str, Any]) -> bytes:
    document = {"message_version": MESSAGE_VERSION, "kind": kind.value, **fields}
    return dumps_canonical(document).encode("utf-8")


def _decode(data: bytes, kind: MessageKind, fields: Sequence[str]) -> JsonObject:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidInputError(field="message", expected="bytes", got=type(data).__name__)
    document = parse_json(data, field="message", max_bytes=MAX_MESSAGE_BYTES)
    if not isinstance(document, dict):
        raise InvalidInputError(field="message", expected="a JSON object", got=document)
    version = document.get("message_version")
    if version != MESSAGE_VERSION or isinstance(version, bool):
        raise InvalidInputError(field="message_version", expected=str(MESSAGE_VERSION), got=version)
    if document.get("kind") != kind.value:
        raise InvalidInputError(field="kind", expected=repr(kind.value), got=document.get("kind"))
    message = JsonObject(document)
    message.only(("message_version", "kind", *fields))
    return message


def _plan(entry: JsonObject) -> TransferPlan:
    """Return the plan of a job entry, every field checked for its kind first."""
    unnamed = entry.child("plan")
    unnamed.only(_PLAN_FIELDS)
    plan = unnamed.for_request(unnamed.get("request_id", str))
    plan.get("schema_version", int)
    plan.get("direction", str)
    plan.get("blocks_per_chunk", int)
    for index, key in enumerate(plan.get("keys", list)):
        plan.check(f"keys[{index}]", key, str)
    for name in ("gpu_block_ids", "group_sizes", "block_indices"):
        plan.integers(name)
    with plan.building():
        return plan_from_dict(plan.document)


def encode_jobs(jobs: Sequence[BoundPlan]) -> bytes:
    """Return the bytes of a message carrying `jobs` to the workers."""
    body = [
        {
            "job_id": job.job_id,
            "cpu_rows": job.cpu_rows.tolist(),
            "layout_fingerprint": job.layout_fingerprint,
            "plan": plan_to_dict(job.plan),
        }
        for job in jobs
    ]
    return _encode(MessageKind.JOBS, {"jobs": body})


def decode_jobs(data: bytes) -> tuple[BoundPlan, ...]:
    """Return the bound plans of an `encode_jobs` message, or of the binary form
    `kvferry.adapters.wire.encode_jobs_binary` writes (validated like any plan); raise
    InvalidInputError naming where for anything else, an unknown or missing field included."""
    if isinstance(data, (bytes, bytearray, memoryview)) and is_binary(data):
        return decode_jobs_binary(data)
    jobs = []
    for unnamed in _decode(data, MessageKind.JOBS, ("jobs",)).children("jobs"):
        unnamed.only(_JOB_FIELDS)
        plan = _plan(unnamed)
        entry = unnamed.for_request(plan.request_id)
        job_id = entry.get("job_id", int)
        rows = entry.integers("cpu_rows")
        fingerprint = entry.get("layout_fingerprint", str, type(None))
        with entry.building():
            jobs.append(
                BoundPlan(job_id=job_id, plan=plan, cpu_rows=rows, layout_fingerprint=fingerprint)
            )
    return tuple(jobs)


def encode_completions(worker: int, results: Sequence[JobResult]) -> bytes:
    """Return the bytes of a message carrying `worker`'s job results to the scheduler."""
    body = [
        {
            "job_id": result.job_id,
            "success": result.success,
            "nbytes": result.nbytes,
            "seconds": result.seconds,
            "error": result.error,
        }
        for result in results
    ]
    return _encode(MessageKind.COMPLETIONS, {"worker": worker, "results": body})


def decode_completions(data: bytes) -> Completions:
    """Return the worker and results of an `encode_completions` message; raise
    InvalidInputError naming where for anything else, an unknown or missing field included."""
    message = _decode(data, MessageKind.COMPLETIONS, ("worker", "results"))
    results = []
    for entry in message.children("results"):
        entry.only(_RESULT_FIELDS)
        fields = {
            "job_id": entry.get("job_id", int),
            "success": entry.get("success", bool),
            "nbytes": entry.get("nbytes", int),
            "seconds": entry.get("seconds", int, float),
            "error": entry.get("error", str, type(None)),
        }
        with entry.building():
            results.append(JobResult(**fields))
    with message.building():
        return Completions(worker=message.get("worker", int), results=tuple(results))
