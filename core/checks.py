"""Input checks shared by the planner's entry points: counts that must be whole numbers.

Pure: a check raises InvalidInputError naming where, or returns; it never rounds or converts.
"""

from __future__ import annotations

import numbers

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
