"""Input checks shared by the planner's entry points: counts that must be whole numbers.

Pure: a check raises InvalidInputError naming where, or returns; it never rounds or converts.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import attrs

from kvferry.core.errors import InvalidInputError


def check_count(
    value: object,
    *,
    field: str,
    request: str | None = None,
    group: int | None = None,
    low: int = 0,
) -> None:
    """Raise InvalidInputError unless `value` is an integer (not a bool) of at least `low`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise InvalidInputError(
            request=request,
            group=group,
            field=field,
            expected=f"an integer >= {low}",
            got=value,
        )


def at_least(low: int) -> Callable[[object, attrs.Attribute[Any], Any], None]:
    """Return an attrs validator: the field is an integer (not a bool) of at least `low`; the
    error names the field, and the request when the instance has a `request_id`."""

    def validate(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        check_count(
            value,
            field=attribute.name,
            request=getattr(instance, "request_id", None),
            low=low,
        )

    return validate
