"""JSON from outside (files, messages), parsed within bounds: every way it can be malformed is
refused with InvalidInputError, never a bare ValueError, RecursionError or MemoryError.

Pure: bytes or text in, a value out; the caller reads the file or the pipe.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

from kvferry.core.errors import InvalidInputError, PlanInvariantError, did_you_mean

MAX_NUMBER_CHARS = 40
"""Longest number accepted, in characters: wider than any count, size or id kvferry takes
(2**64 has 20 digits), far below what makes parsing a number slow."""


def _number_error(field: str, text: str) -> InvalidInputError:
    shown = text if len(text) <= MAX_NUMBER_CHARS else f"{text[:12]}... ({len(text)} characters)"
    return InvalidInputError(
        field=field,
        expected=f"a finite number of at most {MAX_NUMBER_CHARS} characters",
        got=shown,
    )


def parse_json(data: bytes | bytearray | memoryview | str, *, field: str, max_bytes: int) -> Any:
    """Return the JSON value in `data` (UTF-8 bytes, or text).

    Raise InvalidInputError naming `field` for more than `max_bytes` bytes, bytes that are not
    UTF-8, text that is not JSON, NaN or Infinity, a number longer than MAX_NUMBER_CHARS, a key
    given twice in one object (the second would silently win), or nesting deeper than the
    interpreter's recursion limit.
    """
    if isinstance(data, str):
        size = len(data)  # characters: at most the UTF-8 size, checked before encoding anything
        if size > max_bytes:
            raise InvalidInputError(
                field=field, expected=f"at most {max_bytes} bytes", got=f"{size} characters"
            )
        text = data
    elif isinstance(data, (bytes, bytearray, memoryview)):
        size = memoryview(data).nbytes
        if size > max_bytes:
            raise InvalidInputError(
                field=field, expected=f"at most {max_bytes} bytes", got=f"{size} bytes"
            )
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as error:
            raise InvalidInputError(field=field, expected="UTF-8 text", got=str(error)) from None
    else:
        raise InvalidInputError(field=field, expected="bytes or text", got=type(data).__name__)

    def integer(digits: str) -> int:
        if len(digits) > MAX_NUMBER_CHARS:
            raise _number_error(field, digits)
        return int(digits)

    def real(digits: str) -> float:
        value = float(digits)
        if len(digits) > MAX_NUMBER_CHARS or not math.isfinite(value):
            raise _number_error(field, digits)
        return value

    def constant(name: str) -> Any:
        raise _number_error(field, name)

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        document = dict(pairs)
        if len(document) != len(pairs):
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    raise InvalidInputError(
                        field=field, expected="each key once in an object", got=key
                    )
                seen.add(key)
        return document

    try:
        return json.loads(
            text,
            parse_int=integer,
            parse_float=real,
            parse_constant=constant,
            object_pairs_hook=unique,
        )
    except json.JSONDecodeError as error:
        raise InvalidInputError(field=field, expected="JSON text", got=str(error)) from None
    except RecursionError:
        raise InvalidInputError(
            field=field, expected="JSON nested at most a few hundred levels", got="deeper nesting"
        ) from None


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
class JsonObject:
    """One JSON object read strictly: fields are taken only of the kinds asked for (a bool is
    never a number, a float never an integer), unknown fields can be refused, and every
    refusal names the field's path (`steps[2].blocks`) and, when known, the request."""

    document: Mapping[str, Any]
    """The object."""
    where: str = ""
    """Its path followed by a dot (`jobs[0].plan.`), or "" at the top."""
    request: str | None = None
    """The request the object belongs to, named in every refusal."""

    @classmethod
    def of(cls, value: object, path: str, *, request: str | None = None) -> JsonObject:
        """Return `value` (found at `path`) as a JsonObject; raise InvalidInputError unless it
        is a JSON object."""
        if not isinstance(value, dict):
            raise InvalidInputError(request=request, field=path, expected="an object", got=value)
        return cls(value, f"{path}." if path else "", request)

    def path(self, name: str) -> str:
        """Return the path of field `name`."""
        return self.where + name

    def refuse(self, name: str, expected: str, got: object) -> InvalidInputError:
        """Return the error for field `name` (or a path below it, `blocks[1][3]`)."""
        return InvalidInputError(
            request=self.request, field=self.path(name), expected=expected, got=got
        )

    def only(self, known: Sequence[str]) -> None:
        """Raise InvalidInputError for a field not among `known` (a misspelled field would
        otherwise be ignored, and what it says lost)."""
        for name in self.document:
            if name not in known:
                expected = "one of the fields " + ", ".join(known) + did_you_mean(name, known)
                raise self.refuse(str(name), expected, self.document[name])

    def get(self, name: str, *kinds: type) -> Any:
        """Return field `name` when it is present and of one of `kinds`."""
        if name not in self.document:
            raise self.refuse(name, "a value", "nothing")
        return self.check(name, self.document[name], *kinds)

    def check(self, name: str, value: object, *kinds: type) -> Any:
        """Return `value` (at field `name`) when it is of one of `kinds`."""
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise self.refuse(
                name, " or ".join(_KIND_NAMES.get(k, k.__name__) for k in kinds), value
            )
        return value

    def optional(self, name: str, default: Any, *kinds: type) -> Any:
        """Return field `name` when present (of one of `kinds`), else `default`."""
        if name not in self.document:
            return default
        return self.check(name, self.document[name], *kinds)

    def count(self, name: str, *, low: int = 0, default: int | None = None) -> int:
        """Return field `name` when it is an integer >= `low` (`default` when absent, if
        given; else the field is required)."""
        value = self.get(name, int) if default is None else self.optional(name, default, int)
        if value < low:
            raise self.refuse(name, f"an integer >= {low}", value)
        result: int = value
        return result

    def integers(self, name: str) -> list[int]:
        """Return field `name` when it is a list of integers (never bools, floats, strings or
        nested lists: numpy would take those as another dtype or a ragged array)."""
        values: list[Any] = self.get(name, list)
        for index, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, int):
                raise self.refuse(f"{name}[{index}]", "an integer", value)
        return values

    def child(self, name: str) -> JsonObject:
        """Return field `name` as a JsonObject (it must be a JSON object)."""
        return JsonObject.of(self.get(name, dict), self.path(name), request=self.request)

    def children(self, name: str) -> list[JsonObject]:
        """Return field `name` as a list of JsonObjects (a list of JSON objects)."""
        values: list[Any] = self.get(name, list)
        path = self.path(name)
        return [
            JsonObject.of(value, f"{path}[{index}]", request=self.request)
            for index, value in enumerate(values)
        ]

    def for_request(self, request: str) -> JsonObject:
        """Return this object, naming `request` in its refusals from now on."""
        return JsonObject(self.document, self.where, request)

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Prefix the field of a refusal raised inside (building a value from this object)
        with this object's path."""
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
