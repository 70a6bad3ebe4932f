"""The settings of kvferry's vLLM connector: `kv_connector_extra_config` -> checked values.

Pure: reads one JSON-like mapping and never imports vLLM, so it is tested without vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvferry.core.checks import at_least
from kvferry.core.errors import InvalidInputError, did_you_mean, member_named
from kvferry.core.eviction import EvictionPolicyKind

SETTINGS: dict[str, str] = {
    "cpu_bytes_to_use": "bytes of pinned CPU memory for the tier, all workers together (required)",
    "executor": 'the copy executor: "torch" (default), "cupy", or "cpu" (host tensors only)',
    "blocks_per_chunk": "GPU blocks per CPU-tier chunk, every group alike (default 1)",
    "store_decoded_tokens": "store chunks of generated tokens too (default true)",
    "eviction_policy": 'which ready chunks go first when the tier is full: "lru" (default), '
    '"arc" or "tail_first"',
    "cpu_tier_group_weights": "how many chunks of each offloaded KV-cache group the tier holds, "
    "relative: a list of integers >= 1, one per offloaded group (default: 1 each)",
}
"""Every key kvferry reads from `kv_connector_extra_config`, with what it means; drives the
parser, its error messages and docs/embedding.md."""


def _flag(instance: object, attribute: attrs.Attribute[bool], value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidInputError(field=attribute.name, expected="true or false", got=value)


@attrs.frozen(kw_only=True)
class ConnectorSettings:
    """What a user sets in `kv_connector_extra_config`, checked."""

    cpu_bytes_to_use: int = attrs.field(validator=at_least(1))
    """Bytes of CPU tier for all workers together; each worker holds its share of every row."""
    executor: str = "torch"
    """The executor name (`kvferry.executors.make_executor`)."""
    blocks_per_chunk: int = attrs.field(default=1, validator=at_least(1))
    """`F`: GPU blocks per chunk."""
    store_decoded_tokens: bool = attrs.field(default=True, validator=_flag)
    """Store generated tokens' chunks as well as the prompt's."""
    eviction_policy: EvictionPolicyKind = EvictionPolicyKind.LRU
    """The tier's eviction policy."""
    cpu_tier_group_weights: tuple[int, ...] | None = None
    """Each offloaded group's share of the tier's chunks (`rows_for_budget`'s weights); None:
    every group holds the same number of chunks."""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        """Return the settings of vLLM's `kv_connector_extra_config`, or raise
        InvalidInputError naming the key: a key kvferry does not read is refused rather than
        ignored, so a misspelt setting never silently falls back to its default."""
        if not isinstance(extra, Mapping):
            raise InvalidInputError(
                field="kv_connector_extra_config", expected="a JSON object", got=extra
            )
        for key in extra:
            if key not in SETTINGS:
                raise InvalidInputError(
                    field=f"kv_connector_extra_config.{key}",
                    expected="one of " + ", ".join(SETTINGS) + did_you_mean(key, SETTINGS),
                    got=key,
                )
        if "cpu_bytes_to_use" not in extra:
            raise InvalidInputError(
                field="kv_connector_extra_config.cpu_bytes_to_use",
                expected="the CPU tier's size in bytes",
                got="nothing",
            )
        values: dict[str, Any] = {"cpu_bytes_to_use": _integer(extra, "cpu_bytes_to_use")}
        if "executor" in extra:
            executor = extra["executor"]
            if not isinstance(executor, str) or not executor:
                raise InvalidInputError(
                    field="kv_connector_extra_config.executor",
                    expected="an executor name",
                    got=executor,
                )
            values["executor"] = executor
        if "blocks_per_chunk" in extra:
            values["blocks_per_chunk"] = _integer(extra, "blocks_per_chunk")
        if "store_decoded_tokens" in extra:
            values["store_decoded_tokens"] = extra["store_decoded_tokens"]
        if "eviction_policy" in extra:
            values["eviction_policy"] = member_named(
                EvictionPolicyKind,
                extra["eviction_policy"],
                field="kv_connector_extra_config.eviction_policy",
            )
        if "cpu_tier_group_weights" in extra:
            weights = extra["cpu_tier_group_weights"]
            if (
                not isinstance(weights, list)
                or not weights
                or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in weights)
            ):
                raise InvalidInputError(
                    field="kv_connector_extra_config.cpu_tier_group_weights",
                    expected="a list of integers >= 1, one per offloaded KV-cache group",
                    got=weights,
                )
            values["cpu_tier_group_weights"] = tuple(weights)
        return cls(**values)


def _integer(extra: Mapping[str, Any], key: str) -> int:
    """Return `extra[key]` as an int: JSON gives ints (or floats such as 64e9 when written so);
    a float is accepted only when it is a whole number."""
    value = extra[key]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(
            field=f"kv_connector_extra_config.{key}", expected="an integer", got=value
        )
    return value
