"""`build_offloading`: one call makes an executor, a catalog and a session that agree."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvferry.adapters import Offloading, build_offloading
from kvferry.adapters.config import KvferryConfig
from kvferry.adapters.session import RunningRequest
from kvferry.core.blocks import GroupBlocks
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.errors import InvalidInputError
from kvferry.core.eviction import EvictionPolicyKind
from kvferry.core.layout import TensorLayout
from kvferry.executors import Executor, KVTensor, make_executor
from kvferry.executors.cpu import CpuExecutor

CONFIG = OffloadConfig(
    hash_block_size=16,
    blocks_per_chunk=2,
    groups=[GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16)],
)
ROW_BYTES = 2 * 2 * 16 * 2 * 8 * 2
"""One chunk of the tensors below: F=2 blocks x K and V x 16 tokens x 2 heads x 8 dims x 2 B."""


def _tensors() -> tuple[np.ndarray[Any, Any], list[list[KVTensor]]]:
    kv = np.zeros((2, 32, 16, 2, 8), dtype=np.float16)
    return kv, [[KVTensor(tensor=kv, layout=TensorLayout.KV_SPLIT)]]


def _build(**options: Any) -> Offloading:
    options.setdefault("cpu_tier_bytes", 8 * ROW_BYTES)
    return build_offloading(CONFIG, tensors=_tensors()[1], **options)


def test_the_catalog_gets_the_whole_rows_of_the_budget() -> None:
    with _build(cpu_tier_bytes=8 * ROW_BYTES + ROW_BYTES // 2) as offloading:
        assert offloading.layout.row_pitches == (ROW_BYTES,)
        assert offloading.catalog.capacity_rows == (8,)


def test_the_executor_allocates_one_tier_row_per_catalog_row() -> None:
    with _build() as offloading:
        assert offloading.executor.host_tier.num_rows == offloading.catalog.capacity_rows
        assert offloading.executor.layout == offloading.layout


def test_the_session_plans_with_the_config_and_the_catalog() -> None:
    with _build() as offloading:
        assert offloading.session.config is CONFIG
        assert offloading.session.catalog is offloading.catalog
        assert offloading.session.world_size == 1


def test_a_size_string_sets_the_budget() -> None:
    with _build(cpu_tier_bytes="16KiB") as offloading:
        assert offloading.catalog.capacity_rows == ((16 << 10) // ROW_BYTES,)


def test_the_settings_choose_the_eviction_policy_and_the_events() -> None:
    settings = KvferryConfig.from_mapping({"eviction_policy": "arc", "record_events": True})
    with _build(settings=settings) as offloading:
        assert offloading.catalog.config.policy is EvictionPolicyKind.ARC
        assert offloading.catalog.config.record_events


def test_the_arguments_override_the_settings() -> None:
    settings = KvferryConfig.from_mapping({"executor": "torch", "cpu_tier_bytes": "1GiB"})
    with _build(settings=settings, executor="cpu", cpu_tier_bytes=4 * ROW_BYTES) as offloading:
        assert isinstance(offloading.executor, CpuExecutor)
        assert offloading.catalog.capacity_rows == (4,)


def test_a_stored_chunk_loads_back_into_other_blocks() -> None:
    kv, tensors = _tensors()
    kv[:, 1:3] = np.arange(kv[:, 1:3].size, dtype=np.float16).reshape(kv[:, 1:3].shape)
    hashes = [b"h1", b"h2"]
    with build_offloading(CONFIG, tensors=tensors, cpu_tier_bytes=8 * ROW_BYTES) as offloading:
        session, executor = offloading.session, offloading.executor
        stored = RunningRequest(
            request_id="a",
            blocks=[GroupBlocks.of([1, 2])],
            num_computed_tokens=0,
            num_scheduled_tokens=32,
            num_tokens=32,
            block_hashes=hashes,
        )
        step = session.start_stores([stored])
        session.report(0, executor.wait([executor.submit(job) for job in step.jobs]))
        hit = session.lookup("b", block_hashes=hashes, num_tokens=40, num_computed_tokens=0)
        load = session.start_load(
            "b", [GroupBlocks.of([7, 8, 9])], num_computed_tokens=0, hit_tokens=hit.tokens
        )
        assert load is not None
        session.report(0, executor.wait([executor.submit(load)]))
    assert hit.tokens == 32
    assert np.array_equal(kv[:, 7:9], kv[:, 1:3])


def test_leaving_the_with_block_closes_the_executor() -> None:
    with _build() as offloading:
        pass
    with pytest.raises(InvalidInputError, match="an open executor"):
        offloading.executor.submit(None)  # type: ignore[arg-type]


def test_a_budget_is_required() -> None:
    with pytest.raises(InvalidInputError, match="cpu_tier_bytes"):
        build_offloading(CONFIG, tensors=_tensors()[1])


def test_a_budget_below_one_row_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="at least one row"):
        _build(cpu_tier_bytes=ROW_BYTES - 1)


def test_tensors_for_another_number_of_groups_are_refused() -> None:
    _, tensors = _tensors()
    with pytest.raises(InvalidInputError, match="tensors") as caught:
        build_offloading(CONFIG, tensors=tensors * 2, cpu_tier_bytes="1MiB")
    assert caught.value.got == 2


def test_settings_with_another_chunk_size_are_refused() -> None:
    settings = KvferryConfig.from_mapping({"blocks_per_chunk": 4})
    with pytest.raises(InvalidInputError, match="blocks_per_chunk"):
        _build(settings=settings)


def test_an_unknown_executor_is_refused_with_a_suggestion() -> None:
    with pytest.raises(InvalidInputError, match="did you mean 'cpu'"):
        _build(executor="cpux")


def test_a_config_of_another_type_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="OffloadConfig"):
        build_offloading(
            {"blocks_per_chunk": 2},  # type: ignore[arg-type]
            tensors=[],
            cpu_tier_bytes="1MiB",
        )


def test_a_gpu_setting_for_a_host_executor_is_refused_naming_it() -> None:
    settings = KvferryConfig.from_mapping({"staging_bytes": "64MiB"})
    with pytest.raises(InvalidInputError, match="staging_bytes"):
        _build(settings=settings)


def test_executor_options_reach_a_host_executor() -> None:
    made: dict[str, Any] = {}

    def factory(name: str, **options: Any) -> Executor:
        made.update(options)
        return make_executor(name, **{k: v for k, v in options.items() if k != "trace"})

    with _build(executor_options={"trace": "on"}, executor_factory=factory):
        pass
    assert "staging_bytes" not in made and "submit_thread" not in made
    assert made["trace"] == "on"
