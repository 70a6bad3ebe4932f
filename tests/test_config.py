"""The configuration value: from a dict, a TOML file and `KVFERRY_*` variables; every bad value
names its key and the allowed values."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvferry.adapters import config as config_module
from kvferry.adapters.config import CONFIG_KEYS, KvferryConfig, parse_bytes
from kvferry.core.errors import InvalidInputError
from kvferry.core.eviction import EvictionPolicyKind

DOCS = Path(__file__).parent.parent / "docs" / "configuration.md"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvferry.toml"
    path.write_text(text, encoding="utf-8")
    return path


# -- sources --------------------------------------------------------------------------------------


def test_defaults_select_the_cpu_executor_and_lru() -> None:
    config = KvferryConfig()
    assert config.executor == "cpu"
    assert config.eviction_policy is EvictionPolicyKind.LRU
    assert config.cpu_tier_bytes is None
    assert config.store_decoded_tokens is True


def test_a_dict_sets_every_key() -> None:
    config = KvferryConfig.from_mapping(
        {
            "executor": "torch",
            "cpu_tier_bytes": 1 << 30,
            "eviction_policy": "tail_first",
            "blocks_per_chunk": 4,
            "store_decoded_tokens": False,
            "staging_bytes": "64MiB",
            "record_events": True,
        }
    )
    assert config == KvferryConfig(
        executor="torch",
        cpu_tier_bytes=1 << 30,
        eviction_policy=EvictionPolicyKind.TAIL_FIRST,
        blocks_per_chunk=4,
        store_decoded_tokens=False,
        staging_bytes=64 << 20,
        record_events=True,
    )


def test_a_toml_file_sets_its_keys(tmp_path: Path) -> None:
    path = write(tmp_path, 'executor = "cupy"\ncpu_tier_bytes = "8GiB"\nblocks_per_chunk = 2\n')
    config = KvferryConfig.from_toml(path)
    assert (config.executor, config.cpu_tier_bytes, config.blocks_per_chunk) == ("cupy", 8 << 30, 2)


def test_environment_variables_set_their_keys() -> None:
    env = {
        "KVFERRY_EVICTION_POLICY": "arc",
        "KVFERRY_STORE_DECODED_TOKENS": "no",
        "KVFERRY_BLOCKS_PER_CHUNK": "8",
        "HOME": "/root",
    }
    config = KvferryConfig.from_env(env)
    assert config.eviction_policy is EvictionPolicyKind.ARC
    assert config.store_decoded_tokens is False
    assert config.blocks_per_chunk == 8


def test_the_environment_overrides_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, 'eviction_policy = "arc"\nblocks_per_chunk = 2\n')
    config = KvferryConfig.load(path, {"KVFERRY_EVICTION_POLICY": "lru"})
    assert config.eviction_policy is EvictionPolicyKind.LRU
    assert config.blocks_per_chunk == 2


def test_the_config_value_is_frozen() -> None:
    config = KvferryConfig()
    with pytest.raises(AttributeError):
        config.executor = "torch"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512MiB", 512 << 20), ("8 GB", 8 * 10**9), ("4096", 4096), ("1kib", 1024), (77, 77)],
)
def test_sizes_take_units(text: str | int, expected: int) -> None:
    assert parse_bytes("cpu_tier_bytes", text) == expected


def test_the_catalog_gets_whole_rows_of_the_budget_and_the_policy() -> None:
    config = KvferryConfig.from_mapping({"cpu_tier_bytes": 1000, "eviction_policy": "arc"})
    catalog = config.catalog_config(300)
    assert catalog.capacity_rows == (3,)
    assert catalog.policy is EvictionPolicyKind.ARC


def test_group_weights_give_each_group_its_share_of_chunks() -> None:
    config = KvferryConfig.from_env(
        {"KVFERRY_CPU_TIER_BYTES": "1000", "KVFERRY_CPU_TIER_GROUP_WEIGHTS": "1, 4"}
    )
    assert config.cpu_tier_group_weights == (1, 4)
    assert config.catalog_config([300, 20]).capacity_rows == (2, 8)  # 2 * (300 + 4 * 20) <= 1000


def test_group_weights_for_another_number_of_groups_are_refused_naming_the_setting() -> None:
    config = KvferryConfig.from_mapping({"cpu_tier_bytes": 1000, "cpu_tier_group_weights": [1, 4]})
    with pytest.raises(InvalidInputError, match="cpu_tier_group_weights") as caught:
        config.catalog_config([300, 20, 50])
    assert "one weight per KV-cache group (3)" in caught.value.expected


def test_a_group_weight_below_one_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="cpu_tier_group_weights"):
        KvferryConfig.from_mapping({"cpu_tier_group_weights": [1, 0]})


def test_the_budget_gives_every_group_the_same_number_of_chunks() -> None:
    config = KvferryConfig.from_mapping({"cpu_tier_bytes": 1000, "eviction_policy": "arc"})
    catalog = config.catalog_config([300, 20, 50])
    assert catalog.capacity_rows == (2, 2, 2)
    assert catalog.policy is EvictionPolicyKind.ARC


def test_staging_bytes_become_an_executor_option() -> None:
    config = KvferryConfig.from_mapping({"staging_bytes": "32MiB"})
    assert config.executor_options() == {"staging_bytes": 32 << 20}
    assert KvferryConfig().executor_options() == {}


def test_the_submission_thread_becomes_an_executor_option_only_when_turned_off() -> None:
    config = KvferryConfig.from_env({"KVFERRY_SUBMIT_THREAD": "0"})
    assert config.executor_options() == {"submit_thread": False}
    assert KvferryConfig.from_mapping({"submit_thread": True}).executor_options() == {}


def test_kvferry_no_native_puts_the_executors_on_the_python_route() -> None:
    config = KvferryConfig.from_env({"KVFERRY_NO_NATIVE": "1"})
    assert config.executor_options() == {"route": "python"}
    assert KvferryConfig().executor_options() == {}


# -- errors name the key and the allowed values ---------------------------------------------------


def test_an_unknown_executor_names_the_key_the_executors_and_a_close_one() -> None:
    with pytest.raises(InvalidInputError) as caught:
        KvferryConfig.from_mapping({"executor": "tourch"})
    message = str(caught.value)
    assert "'executor'" in message
    known = message.split("(known: ")[1].split(")", maxsplit=1)[0].split(", ")
    assert {"cpu", "cupy", "torch"} <= set(known)  # tests may register more
    assert "did you mean 'torch'" in message


def test_an_unknown_policy_names_the_key_and_the_policies() -> None:
    with pytest.raises(InvalidInputError) as caught:
        KvferryConfig.from_mapping({"eviction_policy": "lfu"})
    assert caught.value.field == "eviction_policy"
    assert "lru, arc, tail_first" in str(caught.value)


def test_a_policy_typo_gets_a_suggestion() -> None:
    with pytest.raises(InvalidInputError, match="did you mean 'tail_first'"):
        KvferryConfig.from_mapping({"eviction_policy": "tailfirst"})


@pytest.mark.parametrize("value", [0, -1, "two", 1.5, True])
def test_blocks_per_chunk_must_be_a_positive_integer(value: object) -> None:
    with pytest.raises(InvalidInputError, match="'blocks_per_chunk': expected an integer >= 1"):
        KvferryConfig.from_mapping({"blocks_per_chunk": value})


@pytest.mark.parametrize("value", ["lots", "12 parsecs", 0, -5, True, 1.5])
def test_a_bad_size_names_the_key_and_the_form(value: object) -> None:
    with pytest.raises(InvalidInputError) as caught:
        KvferryConfig.from_mapping({"cpu_tier_bytes": value})
    assert caught.value.field == "cpu_tier_bytes"
    assert "'512MiB'" in caught.value.expected


def test_a_bad_boolean_names_the_key_and_the_spellings() -> None:
    with pytest.raises(InvalidInputError, match="'store_decoded_tokens': expected true or false"):
        KvferryConfig.from_mapping({"store_decoded_tokens": "maybe"})


def test_an_unknown_key_gets_a_suggestion() -> None:
    with pytest.raises(InvalidInputError, match="did you mean 'cpu_tier_bytes'"):
        KvferryConfig.from_mapping({"cpu_tier_byte": 1})


def test_an_unknown_environment_variable_gets_a_suggestion() -> None:
    with pytest.raises(InvalidInputError, match="did you mean 'KVFERRY_EXECUTOR'"):
        KvferryConfig.from_env({"KVFERRY_EXECUTER": "cpu"})


def test_a_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(InvalidInputError) as caught:
        KvferryConfig.from_env({"KVFERRY_BLOCKS_PER_CHUNK": "zero"})
    assert caught.value.field == "KVFERRY_BLOCKS_PER_CHUNK (blocks_per_chunk)"


def test_a_bad_value_in_a_file_names_the_key(tmp_path: Path) -> None:
    path = write(tmp_path, 'eviction_policy = "mru"\n')
    with pytest.raises(InvalidInputError, match="'eviction_policy'"):
        KvferryConfig.from_toml(path)


def test_a_file_that_is_not_toml_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "executor = \n")
    with pytest.raises(InvalidInputError, match="valid TOML"):
        KvferryConfig.from_toml(path)


def test_a_budget_below_one_row_is_refused() -> None:
    config = KvferryConfig.from_mapping({"cpu_tier_bytes": 100})
    with pytest.raises(InvalidInputError, match="at least one row"):
        config.catalog_config(300)


def test_python_3_10_without_tomli_gets_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    class Sys:
        version_info = (3, 10, 14)

    monkeypatch.setattr(config_module, "sys", Sys)
    monkeypatch.setitem(sys.modules, "tomli", None)  # import tomli -> ImportError
    with pytest.raises(InvalidInputError, match="tomli"):
        KvferryConfig.from_toml(write(tmp_path, 'executor = "cpu"\n'))


# -- the reference page ---------------------------------------------------------------------------


def test_the_reference_page_lists_every_key_and_its_variable() -> None:
    text = DOCS.read_text(encoding="utf-8")
    for key in CONFIG_KEYS.values():
        assert f"`{key.name}`" in text
        assert f"`{key.env}`" in text
