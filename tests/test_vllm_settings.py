"""The vLLM connector's settings (`kv_connector_extra_config`), checked without vLLM."""

from __future__ import annotations

import pytest

from kvferry.adapters.vllm_settings import SETTINGS, ConnectorSettings
from kvferry.core.errors import InvalidInputError
from kvferry.core.eviction import EvictionPolicyKind


def test_only_the_tier_size_is_required() -> None:
    settings = ConnectorSettings.from_extra_config({"cpu_bytes_to_use": 64_000_000_000})
    assert settings == ConnectorSettings(
        cpu_bytes_to_use=64_000_000_000,
        executor="torch",
        blocks_per_chunk=1,
        store_decoded_tokens=True,
        eviction_policy=EvictionPolicyKind.LRU,
    )


def test_every_setting_is_read() -> None:
    settings = ConnectorSettings.from_extra_config(
        {
            "cpu_bytes_to_use": 1 << 30,
            "executor": "cpu",
            "blocks_per_chunk": 4,
            "store_decoded_tokens": False,
            "eviction_policy": "arc",
        }
    )
    assert (settings.executor, settings.blocks_per_chunk) == ("cpu", 4)
    assert settings.store_decoded_tokens is False
    assert settings.eviction_policy is EvictionPolicyKind.ARC


def test_group_weights_are_read_as_a_tuple() -> None:
    settings = ConnectorSettings.from_extra_config(
        {"cpu_bytes_to_use": 1 << 30, "cpu_tier_group_weights": [1, 4]}
    )
    assert settings.cpu_tier_group_weights == (1, 4)


def test_a_whole_float_size_is_accepted() -> None:
    assert ConnectorSettings.from_extra_config({"cpu_bytes_to_use": 64e9}).cpu_bytes_to_use == (
        64_000_000_000
    )


def test_a_missing_tier_size_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="cpu_bytes_to_use"):
        ConnectorSettings.from_extra_config({"executor": "cpu"})


def test_a_misspelt_key_is_refused_with_the_closest_name() -> None:
    with pytest.raises(InvalidInputError, match="did you mean 'blocks_per_chunk'"):
        ConnectorSettings.from_extra_config({"cpu_bytes_to_use": 1, "block_per_chunk": 2})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("cpu_bytes_to_use", 0),
        ("cpu_bytes_to_use", 1.5),
        ("blocks_per_chunk", 0),
        ("store_decoded_tokens", "yes"),
        ("eviction_policy", "fifo"),
        ("executor", ""),
        ("cpu_tier_group_weights", [1, 0]),
        ("cpu_tier_group_weights", "1,4"),
        ("cpu_tier_group_weights", []),
    ],
)
def test_a_bad_value_is_refused_naming_its_key(key: str, value: object) -> None:
    with pytest.raises(InvalidInputError, match=key):
        ConnectorSettings.from_extra_config({"cpu_bytes_to_use": 1024, key: value})


def test_every_setting_is_documented_in_docs_embedding() -> None:
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "embedding.md").read_text()
    for key in SETTINGS:
        assert f"`{key}`" in page
