"""The exceptions kvferry raises, all under one base class.

Never raise a bare built-in exception for a caller's mistake: raise one of these, naming where.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Iterable
from typing import TypeVar

_E = TypeVar("_E", bound=enum.Enum)


class KvferryError(Exception):
    """Base class of every error kvferry raises on purpose."""


def _where(request: str | None, group: int | None, field: str) -> str:
    parts = []
    if request is not None:
        parts.append(f"request {request!r}")
    if group is not None:
        parts.append(f"group {group}")
    parts.append(f"field {field!r}")
    return ", ".join(parts)


class _LocatedError(KvferryError):
    """An error that says where (request, group, field), what was expected and what came."""

    def __init__(
        self,
        *,
        field: str,
        expected: str,
        got: object,
        request: str | None = None,
        group: int | None = None,
    ) -> None:
        self.field = field
        self.expected = expected
        self.got = got
        self.request = request
        self.group = group
        super().__init__(f"{_where(request, group, field)}: expected {expected}, got {got!r}")


class InvalidInputError(_LocatedError, ValueError):
    """A value handed to kvferry breaks its contract; nothing was changed."""


class PlanInvariantError(_LocatedError):
    """A plan (or a request's planning state) would break an invariant; nothing was changed."""


class UnknownExecutorError(KvferryError, LookupError):
    """No executor is registered under the requested name."""


class ExecutorUnavailableError(KvferryError, ImportError):
    """The executor exists, but a dependency it needs is not installed."""


class TransferFailedError(KvferryError):
    """A transfer job failed; `job_id` says which."""

    def __init__(self, job_id: int, reason: str) -> None:
        self.job_id = job_id
        self.reason = reason
        super().__init__(f"transfer job {job_id} failed: {reason}")


def did_you_mean(name: object, known: Iterable[str]) -> str:
    """Return ` (did you mean 'x'?)` for the known name closest to `name`, or "" if none is."""
    close = difflib.get_close_matches(str(name), list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def member_named(kind: type[_E], name: object, *, field: str) -> _E:
    """Return the member of the string-valued enum `kind` whose value is `name`, or raise
    InvalidInputError naming `field`, the known values and the closest one."""
    try:
        return kind(name)
    except ValueError:
        known = [str(member.value) for member in kind]
        raise InvalidInputError(
            field=field,
            expected="one of " + ", ".join(known) + did_you_mean(name, known),
            got=name,
        ) from None
