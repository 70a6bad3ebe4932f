"""Messages that cross the process boundary: bound plans to workers, job results back.

Bytes in, values out (and back), through the canonical plan JSON of `kvferry.core.codec`; no
sockets or queues here: the engine carries the bytes however it likes.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvferry.adapters.wire import decode_jobs_binary, is_binary
from kvferry.core.bound import BoundPlan, JobResult
from kvferry.core.canonical_json import dumps_canonical
from kvferry.core.codec import plan_from_dict, plan_to_dict
from kvferry.core.errors import InvalidInputError

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

    worker: int
    """The reporting worker's rank, in `[0, world_size)`."""
    results: tuple[JobResult, ...]
    """Its finished jobs."""


def _field(document: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in document:
        raise InvalidInputError(field=name, expected="a value", got="nothing")
    value = document[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise InvalidInputError(field=name, expected=f"a {kind}", got=value)
    return value


def _encode(kind: MessageKind, fields: Mapping[str, Any]) -> bytes:
    document = {"message_version": MESSAGE_VERSION, "kind": kind.value, **fields}
    return dumps_canonical(document).encode("utf-8")


def _decode(data: bytes, kind: MessageKind, body_name: str) -> tuple[Mapping[str, Any], list[Any]]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidInputError(field="message", expected="bytes", got=type(data).__name__)
    try:
        document = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInputError(field="message", expected="UTF-8 JSON", got=str(exc)) from exc
    if not isinstance(document, dict):
        raise InvalidInputError(field="message", expected="a JSON object", got=document)
    version = document.get("message_version")
    if version != MESSAGE_VERSION:
        raise InvalidInputError(field="message_version", expected=str(MESSAGE_VERSION), got=version)
    if document.get("kind") != kind.value:
        raise InvalidInputError(field="kind", expected=repr(kind.value), got=document.get("kind"))
    return document, _field(document, body_name, list)


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
    `kvferry.adapters.wire.encode_jobs_binary` writes (validated like any plan)."""
    if isinstance(data, (bytes, bytearray, memoryview)) and is_binary(data):
        return decode_jobs_binary(data)
    _, body = _decode(data, MessageKind.JOBS, "jobs")
    jobs = []
    for entry in body:
        if not isinstance(entry, dict):
            raise InvalidInputError(field="jobs[]", expected="a JSON object", got=entry)
        fingerprint = entry.get("layout_fingerprint")
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise InvalidInputError(
                field="layout_fingerprint", expected="a string or null", got=fingerprint
            )
        jobs.append(
            BoundPlan(
                job_id=_field(entry, "job_id", int),
                plan=plan_from_dict(_field(entry, "plan", dict)),
                cpu_rows=_field(entry, "cpu_rows", list),
                layout_fingerprint=fingerprint,
            )
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
    """Return the worker and results of an `encode_completions` message."""
    document, body = _decode(data, MessageKind.COMPLETIONS, "results")
    results = []
    for entry in body:
        if not isinstance(entry, dict):
            raise InvalidInputError(field="results[]", expected="a JSON object", got=entry)
        error = entry.get("error")
        if error is not None and not isinstance(error, str):
            raise InvalidInputError(field="error", expected="a string or null", got=error)
        seconds = float(_field(entry, "seconds", (int, float)))
        if not math.isfinite(seconds):
            raise InvalidInputError(field="seconds", expected="a finite number", got=seconds)
        results.append(
            JobResult(
                job_id=_field(entry, "job_id", int),
                success=_field(entry, "success", bool),
                nbytes=_field(entry, "nbytes", int),
                seconds=seconds,
                error=error,
            )
        )
    return Completions(worker=_field(document, "worker", int), results=tuple(results))
