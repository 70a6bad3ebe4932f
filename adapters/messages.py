"""Messages that cross the process boundary: bound plans to workers, job results back.

Bytes in, values out (and back), through the canonical plan JSON of `kvferry.core.codec`; no
sockets or queues here: the engine carries the bytes however it likes.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

from kvferry.core.bound import BoundPlan, JobResult
from kvferry.core.canonical_json import dumps_canonical
from kvferry.core.checks import at_least
from kvferry.core.codec import plan_from_dict, plan_to_dict
from kvferry.core.errors import InvalidInputError, PlanInvariantError, did_you_mean
from kvferry.core.json_input import parse_json
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
_KIND_NAMES = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    list: "a list",
    dict: "an object",
    type(None): "null",
}


@attrs.frozen
class _Object:
    """One JSON object of a message, read strictly: where it is (`jobs[2].plan.`) and the
    request it belongs to, when known, are named in every refusal."""

    document: Mapping[str, Any]
    where: str
    request: str | None = None

    def refuse(self, name: str, expected: str, got: object) -> InvalidInputError:
        """Return the error for field `name` of this object."""
        return InvalidInputError(
            request=self.request, field=self.where + name, expected=expected, got=got
        )

    def only(self, known: Sequence[str]) -> None:
        """Raise InvalidInputError for a field not among `known` (a misspelled field would
        otherwise be ignored, and a check it carries skipped)."""
        for name in self.document:
            if name not in known:
                expected = "one of the fields " + ", ".join(known) + did_you_mean(name, known)
                raise self.refuse(str(name), expected, self.document[name])

    def get(self, name: str, *kinds: type) -> Any:
        """Return field `name` when it is present and of one of `kinds` (a bool is never taken
        for a number)."""
        if name not in self.document:
            raise self.refuse(name, "a value", "nothing")
        value = self.document[name]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise self.refuse(name, " or ".join(_KIND_NAMES[k] for k in kinds), value)
        return value

    def integers(self, name: str) -> list[int]:
        """Return field `name` when it is a list of integers (never bools, floats, strings or
        nested lists: numpy would take those as another dtype or a ragged array)."""
        values: list[Any] = self.get(name, list)
        for index, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, int):
                raise self.refuse(f"{name}[{index}]", "an integer", value)
        return values

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Name where this object is in the refusal of a value built from it."""
        try:
            yield
        except (InvalidInputError, PlanInvariantError) as error:
            raise type(error)(
                request=error.request,
                group=error.group,
                field=self.where + error.field,
                expected=error.expected,
                got=error.got,
            ) from None


def _encode(kind: MessageKind, fields: Mapping[str, Any]) -> bytes:
    document = {"message_version": MESSAGE_VERSION, "kind": kind.value, **fields}
    return dumps_canonical(document).encode("utf-8")


def _decode(data: bytes, kind: MessageKind, fields: Sequence[str]) -> _Object:
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
    message = _Object(document, "")
    message.only(("message_version", "kind", *fields))
    return message


def _entries(message: _Object, name: str) -> Iterator[_Object]:
    """Yield each object of the list field `name`."""
    for index, entry in enumerate(message.get(name, list)):
        if not isinstance(entry, dict):
            raise message.refuse(f"{name}[{index}]", "an object", entry)
        yield _Object(entry, f"{name}[{index}].")


def _plan(entry: _Object) -> TransferPlan:
    """Return the plan of a job entry, every field checked for its kind first."""
    unnamed = _Object(entry.get("plan", dict), entry.where + "plan.")
    unnamed.only(_PLAN_FIELDS)
    plan = attrs.evolve(unnamed, request=unnamed.get("request_id", str))
    plan.get("schema_version", int)
    plan.get("direction", str)
    plan.get("blocks_per_chunk", int)
    for index, key in enumerate(plan.get("keys", list)):
        if not isinstance(key, str):
            raise plan.refuse(f"keys[{index}]", "a string", key)
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
    """Return the bound plans of an `encode_jobs` message (validated like any plan); raise
    InvalidInputError naming where for anything else, an unknown or missing field included."""
    jobs = []
    for unnamed in _entries(_decode(data, MessageKind.JOBS, ("jobs",)), "jobs"):
        unnamed.only(_JOB_FIELDS)
        plan = _plan(unnamed)
        entry = attrs.evolve(unnamed, request=plan.request_id)
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
    for entry in _entries(message, "results"):
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
