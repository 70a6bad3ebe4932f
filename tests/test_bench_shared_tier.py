"""`kvferry bench shared-tier` on a local server: it runs, checks the promoted bytes and
writes its bars."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from valkey_server import needs_server

from kvferry.benchmarks import shared_tier
from kvferry.benchmarks.common import EXIT_SKIPPED


@needs_server()
def test_a_quick_run_measures_both_ratios_and_writes_its_bars(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = shared_tier.main(["--quick", "--chunk-kib", "64", "--out", str(tmp_path)])
    assert status == 0
    out = capsys.readouterr().out
    assert out.count("PASS: ") + out.count("FAIL: ") == 2
    data = json.loads((tmp_path / "shared-tier.json").read_text())
    assert data["promotion_gbps"] > 0
    assert data["plain_get_gbps"] > 0
    assert [bar["bar"] for bar in data["bars"]] == [
        "promotion >= 0.9 x plain GET",
        "lookup rate >= 0.9 x plain EXISTS",
    ]


def test_without_a_server_binary_or_url_it_skips(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(shared_tier.shutil, "which", lambda name: None)
    assert shared_tier.main(["--quick"]) == EXIT_SKIPPED
    assert "redis-server" in capsys.readouterr().err
