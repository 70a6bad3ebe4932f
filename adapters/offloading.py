"""One call from an engine's KV tensors to working offloading: executor, catalog and session.

The executor's layout decides how many bytes one CPU-tier row holds, the tier's byte budget how
many rows the catalog has, and the catalog's rows how much pinned memory the executor allocates;
`build_offloading` makes the three agree, and binds the session to the executor's layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kvferry.adapters.config import KvferryConfig
from kvferry.adapters.session import OffloadSession
from kvferry.core.catalog import Catalog
from kvferry.core.config import OffloadConfig
from kvferry.core.errors import InvalidInputError
from kvferry.core.layout import KVLayout
from kvferry.executors.base import Executor
from kvferry.executors.registry import executor_class, make_executor
from kvferry.executors.tensors import KVTensor, build_layout

ExecutorFactory = Callable[..., Executor]
"""Makes an executor from a name and keyword arguments, as `make_executor` does."""


@attrs.frozen(kw_only=True)
class Offloading:
    """The scheduler side and the worker side of kvferry in one process, built to agree.

    Use it as a context manager, or call `close()`, to drain the executor and unpin its tier.
    """

    session: OffloadSession
    """What the engine's scheduler calls: lookup, start_load, start_stores, report, finish."""
    executor: Executor
    """What runs the session's jobs: `submit`, `poll`, `wait`, `close`."""
    catalog: Catalog
    """The CPU tier's catalog (the session's; read it, change it only through the session)."""
    layout: KVLayout
    """Where the registered KV pages lie; the session's jobs are bound to its fingerprint."""

    def close(self) -> None:
        """Wait for every job in flight, then release the executor and its pinned tier."""
        self.executor.close()

    def __enter__(self) -> Offloading:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def build_offloading(
    config: OffloadConfig,
    *,
    tensors: Sequence[Sequence[KVTensor]],
    executor: str | None = None,
    cpu_tier_bytes: int | str | None = None,
    settings: KvferryConfig | None = None,
    executor_options: Mapping[str, Any] | None = None,
    executor_factory: ExecutorFactory = make_executor,
) -> Offloading:
    """Return the session, executor, catalog and layout for `config` and the engine's `tensors`.

    `tensors` holds one sequence of `KVTensor`s per group of `config`, in group order.
    `executor` (a registered name) and `cpu_tier_bytes` (bytes, or a size such as `"64GiB"`)
    override the same keys of `settings` (default: `KvferryConfig()`, the `cpu` executor);
    the tier budget must come from one of them. The eviction policy, events, staging size and
    submission thread are the settings'. `executor_options` are further keyword arguments of
    the executor (e.g. `compute_stream` for `torch`). `config` holds the planning values: a
    `blocks_per_chunk` the settings set to another value is refused.

    Raises InvalidInputError naming the field for a bad value, a tier smaller than one row, or
    tensors whose group count differs from the config's; the registry's errors for an unknown
    or unavailable executor.
    """
    if not isinstance(config, OffloadConfig):
        raise InvalidInputError(field="config", expected="an OffloadConfig", got=config)
    overrides = {
        key: value
        for key, value in (("executor", executor), ("cpu_tier_bytes", cpu_tier_bytes))
        if value is not None
    }
    settings = KvferryConfig.from_mapping(overrides, base=settings)
    f = config.blocks_per_chunk
    if settings.blocks_per_chunk not in (None, f):
        raise InvalidInputError(
            field="blocks_per_chunk",
            expected=f"the OffloadConfig's blocks_per_chunk={f} (or unset)",
            got=settings.blocks_per_chunk,
        )
    tensors = tuple(tensors)
    if len(tensors) != config.num_groups:
        raise InvalidInputError(
            field="tensors",
            expected=f"one sequence of KVTensor per group: {config.num_groups}",
            got=len(tensors),
        )
    on_gpu = executor_class(settings.executor).on_gpu
    layout, _ = build_layout(tensors, f, on_gpu=on_gpu)
    catalog = Catalog(settings.catalog_config(layout.row_pitches))
    gpu_options = settings.executor_options(on_gpu=on_gpu)  # refuses GPU-only keys for `cpu`
    options = {**(gpu_options if on_gpu else {}), **(executor_options or {})}
    made = executor_factory(
        settings.executor,
        kv_caches=tensors,
        blocks_per_chunk=f,
        num_rows=catalog.capacity_rows,
        **options,
    )
    if made.layout.fingerprint != layout.fingerprint:
        made.close()
        raise InvalidInputError(
            field="layout_fingerprint", expected=layout.fingerprint, got=made.layout.fingerprint
        )
    session = OffloadSession(config, catalog, layout_fingerprint=made.layout.fingerprint)
    return Offloading(session=session, executor=made, catalog=catalog, layout=made.layout)
