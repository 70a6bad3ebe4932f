"""JSON from outside (files, messages), parsed within bounds: every way it can be malformed is
refused with InvalidInputError, never a bare ValueError, RecursionError or MemoryError.

Pure: bytes or text in, a value out; the caller reads the file or the pipe.
"""

from __future__ import annotations

import json
import math
from typing import Any

from kvferry.core.errors import InvalidInputError

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
    UTF-8, text that is not JSON, NaN or Infinity, a number longer than MAX_NUMBER_CHARS, or
    nesting deeper than the interpreter's recursion limit.
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

    try:
        return json.loads(text, parse_int=integer, parse_float=real, parse_constant=constant)
    except json.JSONDecodeError as error:
        raise InvalidInputError(field=field, expected="JSON text", got=str(error)) from None
    except RecursionError:
        raise InvalidInputError(
            field=field, expected="JSON nested at most a few hundred levels", got="deeper nesting"
        ) from None
