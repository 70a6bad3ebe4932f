"""`kvferry bench transfer --model`: every engine model runs its steps (on the host here, with
the cpu executor; the GPU run is the benchmark itself) and an unknown model is refused."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvferry.benchmarks import transfer
from kvferry.benchmarks.engine_layouts import MODELS, engine_model, group_block_bytes


def test_an_unknown_model_is_refused_naming_the_known_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as stopped:
        transfer.main(["--model", "llama,gpt5"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "unknown gpt5" in error and "cross-layer" in error


@pytest.mark.parametrize("name", MODELS)
def test_every_group_of_a_model_holds_data_in_each_block(name: str) -> None:
    model = engine_model(name, 4)
    assert len(model.page_kinds) == len(model.groups)
    assert all(group_block_bytes(model, g) > 0 for g in range(len(model.groups)))


def test_each_model_group_is_verified_and_measured_with_a_bar_line_per_bar(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(transfer, "measured_on", lambda _torch: {"gpu": "none"})
    monkeypatch.setattr(transfer, "measured_on_line", lambda _info: "measured on the host")
    monkeypatch.setattr(transfer, "pinned_copy_gbps", lambda *_: {"store": 1.0, "load": 1.0})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    args = argparse.Namespace(
        model=["jamba", "gpt-oss"],
        gib=0.002,
        repeat=1,
        variants=["cpu"],
        staging_mib=None,
        blocks_per_chunk=4,
    )
    out: dict[str, Any] = transfer.run_models(args, torch, device="cpu")
    groups = {(r["model"], r["group"], r["direction"]) for r in out["results"]}
    assert len(groups) == (3 + 2) * 2
    printed = capsys.readouterr().out.splitlines()
    assert sum(line.startswith(("PASS: ", "FAIL: ")) for line in printed) == len(out["bars"]) == 2
