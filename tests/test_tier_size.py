"""A CPU tier larger than the host's memory is refused before anything is allocated, naming
`cpu_tier_bytes` (or the executor's `num_rows`), and an allocation the host refuses anyway is
a typed error, not a bare `[Errno 12]`."""

from __future__ import annotations

import errno
import resource
import subprocess
import sys
import time

import pytest

from kvferry.adapters.config import KvferryConfig
from kvferry.core.errors import InvalidInputError
from kvferry.core.layout import TierLayout
from kvferry.executors import host
from kvferry.executors.host import HostTier, host_memory_bytes

TOO_BIG = 1 << 62
"""Bytes no host has (4 EiB), yet a valid byte count."""
CLI = (sys.executable, "-m", "kvferry.adapters.cli")
ADDRESS_SPACE = 3 << 30
"""What the subprocess runs below this may map: a run that allocates gigabytes fails there."""


def test_host_memory_is_known_and_plausible() -> None:
    assert 64 << 20 <= host_memory_bytes() < TOO_BIG


def test_a_budget_above_the_host_memory_is_refused_naming_cpu_tier_bytes() -> None:
    config = KvferryConfig.from_mapping({"cpu_tier_bytes": TOO_BIG})
    with pytest.raises(InvalidInputError) as caught:
        config.catalog_config(4096)
    assert caught.value.field == "cpu_tier_bytes"
    assert "host" in caught.value.expected and str(host_memory_bytes()) in caught.value.expected


def test_a_host_tier_above_the_host_memory_is_refused_before_it_allocates() -> None:
    started = time.perf_counter()
    with pytest.raises(InvalidInputError) as caught:
        HostTier(tier=TierLayout(rows=(1 << 50,), pitch=(4096,)))
    assert caught.value.field == "num_rows"
    assert "cpu_tier_bytes" in caught.value.expected
    assert time.perf_counter() - started < 1.0


def test_an_allocation_the_host_refuses_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(host.mmap, "mmap", refuse)
    with pytest.raises(InvalidInputError) as caught:
        HostTier(tier=TierLayout(rows=(4,), pitch=(4096,)))
    assert caught.value.field == "num_rows"
    assert "Cannot allocate memory" in str(caught.value)


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


@pytest.mark.parametrize("size", [str(TOO_BIG), str((1 << 63) - 1)])
def test_the_demo_refuses_a_tier_no_host_has_in_one_line_without_allocating(size: str) -> None:
    done = subprocess.run(
        [*CLI, "demo", "--requests", "1", "--no-progress", "--cpu-tier-bytes", size],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limited,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "'cpu_tier_bytes'" in done.stderr and "host" in done.stderr
