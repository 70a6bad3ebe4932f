"""The `kvferry` command's conventions: `--version`."""

from __future__ import annotations

import importlib.metadata

import pytest

from kvferry.adapters import cli


def test_version_prints_the_installed_distribution_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"kvferry {importlib.metadata.version('kvferry')}\n"
