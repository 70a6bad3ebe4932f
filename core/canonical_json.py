"""Canonical JSON text: sorted keys, two-space indentation, short scalar lists on one line.

Pure text in, text out: the same value gives the same bytes on every machine (golden files).
"""

from __future__ import annotations

import json
from typing import Any


def _is_scalar(value: object) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _encode(value: Any, depth: int) -> str:
    pad, inner = "  " * depth, "  " * (depth + 1)
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = (
            f"{inner}{json.dumps(str(k))}: {_encode(value[k], depth + 1)}" for k in sorted(value)
        )
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, (list, tuple)):
        if all(_is_scalar(v) for v in value):
            return "[" + ", ".join(json.dumps(v) for v in value) + "]"
        items = (f"{inner}{_encode(v, depth + 1)}" for v in value)
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    if _is_scalar(value):
        return json.dumps(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def dumps_canonical(value: Any) -> str:
    """Return `value` (dicts, lists, scalars) as canonical JSON text ending in a newline."""
    return _encode(value, 0) + "\n"
