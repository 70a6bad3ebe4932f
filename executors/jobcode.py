"""Which code makes the staged path's per-job host work: the compiled module or plain Python.

A GPU executor's submit checks a plan, cuts it into staging batches, writes its tables and makes
its CUDA driver calls. Two *routes* do this, with the same functions, arguments and answers:

* `"native"`: the C extension `kvferry.executors._native`, built by `pip install` where a C
  compiler works. It calls the driver through `libcuda`'s function addresses.
* `"python"`: `kvferry.executors._python`, numpy for the tables and NVIDIA's `cuda-bindings`
  for the driver calls (which release the GIL). It needs no compiler.

Neither is needed to import `kvferry.executors` or to run the `cpu` executor. An executor made
without `route=` takes the compiled module when it is importable, else the Python route; the
environment variable `KVFERRY_NO_NATIVE=1` makes the Python route the default (it also keeps
`pip install` from building the module).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Protocol

from kvferry.core.arrays import IdArray
from kvferry.core.errors import ExecutorUnavailableError, InvalidInputError

ROUTES = ("native", "python")
"""The routes, by name."""

NO_NATIVE_ENV = "KVFERRY_NO_NATIVE"
"""Set to `1`, it makes `"python"` the default route (and `pip install` builds no module)."""

INSTALL_HINT = "pip install -e . with a C compiler on PATH (in a checkout of kvferry)"
"""How to get the compiled module."""


class Submitter(Protocol):
    """A thread that makes staged jobs' driver calls, as numbered tickets, in order."""

    @property
    def pushed(self) -> int:
        """Return the number of the last ticket handed over."""
        ...

    def finished(self, number: int, /) -> bool:
        """Return whether ticket `number`'s calls are made."""
        ...

    def wait(self, number: int, /) -> None:
        """Block until ticket `number`'s calls are made."""
        ...

    def drain(self) -> None:
        """Block until every ticket handed over is made."""
        ...

    def failure(self, number: int, /) -> tuple[int, str] | None:
        """Take ticket `number`'s failure: None, or (status, the call or the exception)."""
        ...

    def close(self) -> None:
        """Make every ticket, then stop the thread (idempotent)."""
        ...


class JobCode(Protocol):
    """What a route provides: the functions of `_native.pyi`, with the same arguments and answers
    (the modules `_native` and `_python` are the two implementations)."""

    def slice_batches(
        self,
        groups: Sequence[Sequence[int]],
        small_first: bool,
        capacity: int,
        ramp: int,
        f: int,
        /,
    ) -> tuple[bytes, bytes, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Cut a job's keys into staging batches."""
        ...

    def run_copies(  # noqa: PLR0917 (the compiled module's signature)
        self,
        lines: bytes,
        key0: Sequence[int],
        batches: int,
        first_row: Sequence[int],
        base: Sequence[int],
        pitch: Sequence[int],
        per_piece: Sequence[int],
        store: bool,
        /,
    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Return the link copies of a job on one run of rows."""
        ...

    def consecutive(self, rows: IdArray, /) -> bool:
        """Return whether int64 rows count up by one."""
        ...

    def bound_bytes(  # noqa: PLR0917 (the compiled module's signature)
        self,
        ids: IdArray,
        rows: IdArray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        plan_f: int,
        f: int,
        num_blocks: Sequence[int],
        copy_bytes: Sequence[int],
        num_rows: Sequence[int],
        store: bool,
        /,
    ) -> int:
        """Return the bytes of a bound plan that certainly fits, else -1."""
        ...

    def begin_job(  # noqa: PLR0917 (the compiled module's signature)
        self,
        driver: tuple[Any, Any, Any],
        lanes: tuple[int, int],
        compute: int,
        ready: Any,
        previous: Any,
        start: Any,
        /,
    ) -> tuple[int, str] | None:
        """Queue a job's first event records and waits."""
        ...

    def end_job(
        self,
        driver: tuple[Any, Any, Any],
        lanes: tuple[int, int],
        batches: int,
        joined: Any,
        end: Any,
        /,
    ) -> tuple[int, str] | None:
        """Queue a job's last event records and waits."""
        ...

    def queue_job(  # noqa: PLR0917 (the compiled module's signature)
        self,
        driver: tuple[Any, Any, Any],
        lanes: tuple[int, int],
        compute: int,
        events: tuple[Any, Any, Any, Any, Any, Any],
        upload: tuple[Any, int, int, int],
        kernel: Any,
        batches: tuple[Any, ...],
        /,
    ) -> tuple[int, str] | None:
        """Queue a whole staged job."""
        ...

    def stage_job(  # noqa: PLR0917 (the compiled module's signature)
        self,
        constants: tuple[Any, ...],
        first: int,
        compute: int,
        previous: Any,
        start: Any,
        end: Any,
        slot: tuple[IdArray, int, int, Any],
        ids: IdArray,
        rows: IdArray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        submitter: Any = None,
        ready: Any = None,
        /,
    ) -> tuple[int, tuple[int, str] | None]:
        """Plan and queue a common staged job, else return (-1, None)."""
        ...

    @property
    def Submitter(self) -> Callable[..., Submitter]:  # noqa: N802 (the class, as modules name it)
        """The route's submission thread class: `Submitter(set_context, context)`."""
        ...


@functools.cache
def _load_native() -> tuple[ModuleType | None, str]:
    """Return the compiled module, or None and why it does not import (once per process)."""
    try:
        return importlib.import_module("kvferry.executors._native"), ""
    except ImportError as error:
        return None, str(error)


def native_available() -> bool:
    """Return True where the compiled module `kvferry.executors._native` imports."""
    return _load_native()[0] is not None


def default_route() -> str:
    """Return the route an executor takes without `route=`: `"python"` when `KVFERRY_NO_NATIVE`
    is `1` or the compiled module is not built, else `"native"`."""
    if os.environ.get(NO_NATIVE_ENV, "") == "1" or not native_available():
        return "python"
    return "native"


def job_code(route: str | None = None) -> JobCode:
    """Return the module that makes the per-job host work for `route` (`"native"`,
    `"python"`, or None for `default_route()`).

    Raises InvalidInputError for another name, and ExecutorUnavailableError for `"native"`
    where the compiled module is not built.
    """
    name = default_route() if route is None else route
    if name not in ROUTES:
        raise InvalidInputError(field="route", expected=" or ".join(ROUTES), got=route)
    if name == "python":
        from kvferry.executors import _python

        return _python
    module, why = _load_native()
    if module is None:
        raise ExecutorUnavailableError(
            "route 'native' needs the compiled module kvferry.executors._native, which is not"
            f" built here ({why}): {INSTALL_HINT}, or use route='python'"
        )
    code: JobCode = module  # _native.pyi states the functions JobCode names
    return code


def route_of(code: JobCode) -> str:
    """Return the name of the route whose module is `code`."""
    return "python" if getattr(code, "__name__", "").endswith("._python") else "native"
