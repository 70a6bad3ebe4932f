"""Shared pytest set-up: hypothesis profiles, the golden-file update flag, the gpu marker."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

# `ci` is the default; `--hypothesis-profile long` (hypothesis' own option) picks another.
settings.register_profile(
    "ci", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile(
    "long", max_examples=20_000, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _no_kvferry_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run every test without the caller's `KVFERRY_*` variables: the configuration reads
    them (and refuses unknown ones), and a test must not depend on the shell it runs in."""
    for name in [name for name in os.environ if name.startswith("KVFERRY_")]:
        monkeypatch.delenv(name)
    yield


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-goldens",
        action="store_true",
        default=False,
        help="rewrite tests/golden/*.expected.json from their scenarios (the run still fails)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests cleanly, with a reason, where CUDA is not available."""
    if not any("gpu" in item.keywords for item in items):
        return
    try:
        import torch

        has_cuda = bool(torch.cuda.is_available())
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a machine with one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
