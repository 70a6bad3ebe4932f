"""Input checks shared by the planner's entry points, and the one way to skip them (for values
the planner has just built from checked ones).

Pure: a check raises InvalidInputError naming where, or returns; it never rounds or converts.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from kvferry.core.errors import InvalidInputError

T = TypeVar("T")


def check_count(
    value: object,
    *,
    field: str,
    request: str | None = None,
    group: int | None = None,
    low: int = 0,
) -> None:
    """Raise InvalidInputError unless `value` is an integer (not a bool) of at least `low`."""
    if type(value) is int and value >= low:  # the common case, without the ABC check
        return
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


def unchecked(cls: type[T], **fields: Any) -> T:
    """Return an instance of the frozen attrs class `cls` with `fields` set as given, running
    no converter, validator or `__attrs_post_init__`.

    Only for values the planner has just built from values already checked, where every
    invariant holds by construction (hot paths: a store plan per step); `fields` must name
    every field, in its final type. Everything built from outside input goes through `cls(...)`.
    """
    instance = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(instance, name, value)
    return instance


def unchecked_maker(cls: type[T]) -> Callable[..., T]:
    """Return a function that makes an instance of the frozen, slotted attrs class `cls` as
    `unchecked(cls, **fields)` does, every field by keyword (a missing one is a TypeError).

    The same contract as `unchecked`, for the hottest paths: the function is generated once,
    as attrs generates `__init__`, and sets each slot directly (about half the time per call).
    """
    names = _field_names(cls)
    lines = [f"def make(*, {', '.join(names)}):", "    self = new(cls)"]
    lines += [f"    set_{name}(self, {name})" for name in names]
    lines.append("    return self")
    return _generated(cls, names, lines, "make")


def unchecked_evolver(cls: type[T]) -> Callable[..., T]:
    """Return a function `evolve(instance, **changes)` for the frozen, slotted attrs class
    `cls`: a copy of `instance` with `changes`, made as `unchecked` makes a value (no check),
    for a next state whose invariants the caller has just established; generated once as
    `unchecked_maker` is (fields not named in `changes` are copied from `instance`)."""
    names = _field_names(cls)
    lines = [f"def evolve(instance, *, {', '.join(f'{name}=keep' for name in names)}):"]
    lines.append("    self = new(cls)")
    lines += [
        f"    set_{name}(self, get_{name}(instance) if {name} is keep else {name})"
        for name in names
    ]
    lines.append("    return self")
    return _generated(cls, names, lines, "evolve")


def _field_names(cls: type[Any]) -> list[str]:
    """Return the field names of the attrs class `cls`, in order."""
    return [field.name for field in attrs.fields(cls)]


def _generated(cls: type[T], names: list[str], lines: list[str], name: str) -> Callable[..., T]:
    """Return the function `name` that `lines` define, with the slot setters and getters of
    `cls`'s fields `names` (and `new`, `cls`, `keep`) in its namespace."""
    namespace: dict[str, Any] = {"new": object.__new__, "cls": cls, "keep": object()}
    for field_name in names:
        slot = cls.__dict__[field_name]  # a slotted class holds one descriptor per field
        namespace[f"set_{field_name}"] = slot.__set__
        namespace[f"get_{field_name}"] = slot.__get__
    exec("\n".join(lines), namespace)  # code built above from field names only
    function: Callable[..., T] = namespace[name]
    return function
