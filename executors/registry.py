"""Executors chosen by name: a table of `"module:Class"` targets imported only when asked for.

It imports no backend until `make_executor` needs one, and never guesses a name it was not given.
Third-party packages add executors through the entry-point group `kvferry.executors`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from typing import Any

import attrs

from kvferry.core.errors import (
    ExecutorUnavailableError,
    InvalidInputError,
    UnknownExecutorError,
    did_you_mean,
)
from kvferry.executors.base import Executor

ENTRY_POINT_GROUP = "kvferry.executors"
"""Entry-point group a package uses to register an executor: `name = "module:Class"`."""


@attrs.frozen(kw_only=True)
class ExecutorEntry:
    """Where an executor lives and what it needs installed."""

    target: str
    """`"module:Class"`, imported on first use."""
    requires: tuple[str, ...] = ()
    """Top-level modules that must be importable."""
    extra: str | None = None
    """The pip extra of kvferry that installs them."""


BUILTIN_EXECUTORS: dict[str, ExecutorEntry] = {
    "cpu": ExecutorEntry(target="kvferry.executors.cpu:CpuExecutor"),
    "torch": ExecutorEntry(
        target="kvferry.executors.torch_executor:TorchExecutor", requires=("torch",), extra="torch"
    ),
    "cupy": ExecutorEntry(
        target="kvferry.executors.cupy_executor:CupyExecutor",
        requires=("cupy",),
        extra="cupy13",
    ),
}
"""The executors kvferry ships; the table drives `make_executor`, its tests and the docs."""

_registered: dict[str, ExecutorEntry] = {}


def register_executor(name: str, target: str, *, requires: tuple[str, ...] = ()) -> None:
    """Register `target` (`"module:Class"`) under `name` for this process (replaces a previous)."""
    if ":" not in target:
        raise InvalidInputError(field="target", expected='"module:Class"', got=target)
    _registered[name] = ExecutorEntry(target=target, requires=requires)


def _entry_point_executors() -> dict[str, ExecutorEntry]:
    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return {ep.name: ExecutorEntry(target=ep.value) for ep in found}


def executor_entries() -> dict[str, ExecutorEntry]:
    """Return every known executor: built-ins, then entry points, then `register_executor`."""
    return {**BUILTIN_EXECUTORS, **_entry_point_executors(), **_registered}


def executor_class(name: str) -> type[Executor]:
    """Return the class registered under `name`, importing its module now.

    Raises UnknownExecutorError (with a "did you mean") for an unknown name, and
    ExecutorUnavailableError naming the pip extra when a dependency is missing.
    """
    entries = executor_entries()
    entry = entries.get(name)
    if entry is None:
        raise UnknownExecutorError(
            f"no executor named {name!r}{did_you_mean(name, entries)}"
            f" (known: {', '.join(sorted(entries))})"
        )
    for module in entry.requires:
        if importlib.util.find_spec(module) is None:
            how = (
                f"pip install -e '.[{entry.extra}]' in a checkout of kvferry"
                if entry.extra
                else f"install {module}"
            )
            raise ExecutorUnavailableError(
                f"executor {name!r} needs {module!r}, which is not installed: {how}"
            )
    module_name, _, class_name = entry.target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise ExecutorUnavailableError(
            f"executor {name!r} could not be loaded from {entry.target!r}: {error}"
        ) from error
    if not (isinstance(cls, type) and issubclass(cls, Executor)):
        raise ExecutorUnavailableError(
            f"executor {name!r}: {entry.target!r} is not an Executor subclass"
        )
    return cls


def make_executor(name: str, **options: Any) -> Executor:
    """Return a new executor of the kind `name` (e.g. `"torch"`), built with `options`.

    `options` are the executor's keyword arguments: `kv_caches`, `blocks_per_chunk`,
    `num_rows`, and backend ones (e.g. `compute_stream`, `staging_bytes`).
    """
    return executor_class(name)(**options)
