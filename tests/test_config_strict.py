"""Settings from files and the environment are read strictly: only ASCII digits make a number,
numbers are bounded, and a setting the chosen executor does not use is refused, not ignored."""

from __future__ import annotations

import pytest

from kvferry.adapters import cli
from kvferry.adapters.config import CONFIG_KEYS, KvferryConfig, parse_bytes
from kvferry.core.errors import InvalidInputError

NUMBER_KEYS = ("blocks_per_chunk", "cpu_tier_bytes", "staging_bytes")
NOT_ASCII_NUMBERS = ["\u00b2", "\u0663", "\uff15", "1\u00b2", "\u00b2MiB", "8 \uff27iB"]
"""Superscript two, Arabic-Indic three, fullwidth five: str.isdigit() says yes to each."""
HUGE_NUMBERS = ["9" * 5000, "9" * 5000 + "GiB", "9" * 20, str(1 << 63)]


@pytest.mark.parametrize("key", NUMBER_KEYS)
@pytest.mark.parametrize("text", NOT_ASCII_NUMBERS)
def test_a_number_in_other_digits_is_refused_naming_the_variable(key: str, text: str) -> None:
    variable = CONFIG_KEYS[key].env
    with pytest.raises(InvalidInputError) as caught:
        KvferryConfig.from_env({variable: text})
    assert variable in caught.value.field
    assert caught.value.got == text


@pytest.mark.parametrize("key", NUMBER_KEYS)
@pytest.mark.parametrize("text", HUGE_NUMBERS)
def test_a_number_too_large_for_any_host_is_refused(key: str, text: str) -> None:
    with pytest.raises(InvalidInputError) as caught:
        KvferryConfig.from_env({CONFIG_KEYS[key].env: text})
    assert "at most" in caught.value.expected


@pytest.mark.parametrize("key", NUMBER_KEYS)
def test_a_python_integer_too_large_is_refused_as_well(key: str) -> None:
    with pytest.raises(InvalidInputError) as caught:
        KvferryConfig.from_mapping({key: 1 << 70})
    assert caught.value.field == key


def test_the_largest_byte_count_still_parses() -> None:
    assert parse_bytes("cpu_tier_bytes", str((1 << 63) - 1)) == (1 << 63) - 1
    assert parse_bytes("cpu_tier_bytes", "8388607TiB") == 8388607 << 40


@pytest.mark.parametrize(
    ("key", "value"),
    [("staging_bytes", "64MiB"), ("submit_thread", "true")],
)
def test_a_gpu_setting_with_a_host_executor_is_refused_not_ignored(key: str, value: str) -> None:
    config = KvferryConfig.from_env({CONFIG_KEYS[key].env: value})
    with pytest.raises(InvalidInputError) as caught:
        config.executor_options(on_gpu=False)
    assert caught.value.field == key
    assert "GPU executors only" in caught.value.expected
    assert "'cpu'" in caught.value.expected


def test_a_gpu_setting_with_a_gpu_executor_becomes_an_option() -> None:
    config = KvferryConfig.from_mapping({"executor": "torch", "staging_bytes": "1MiB"})
    assert config.executor_options(on_gpu=True) == {"staging_bytes": 1 << 20}


def test_a_host_executor_without_gpu_settings_gets_no_options() -> None:
    assert KvferryConfig().executor_options(on_gpu=False) == {}


def test_the_demo_refuses_a_gpu_setting_with_the_cpu_executor_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVFERRY_STAGING_BYTES", "64MiB")
    assert cli.main(["demo", "--requests", "1", "--no-progress"]) == cli.EXIT_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "'staging_bytes'" in err and "GPU executors only" in err


@pytest.mark.parametrize(("text", "seconds"), [("2.5", 2.5), ("30", 30.0), (" 1 ", 1.0)])
def test_the_worker_reply_timeout_is_a_setting(text: str, seconds: float) -> None:
    config = KvferryConfig.from_env({"KVFERRY_WORKER_REPLY_TIMEOUT": text})
    assert config.worker_reply_timeout == seconds


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e3", "\u00b2", "86401", True])
def test_a_malformed_worker_reply_timeout_is_refused(value: object) -> None:
    with pytest.raises(InvalidInputError) as caught:
        KvferryConfig.from_mapping({"worker_reply_timeout": value})
    assert caught.value.field == "worker_reply_timeout"
