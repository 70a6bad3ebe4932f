"""The statistics, the bars and the plot of `kvferry bench interference` (its measurement needs a
GPU; what it makes of the numbers does not)."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path
from typing import Any

import pytest

from kvferry.benchmarks.interference import (
    ALONE,
    PINNED,
    SM_PASS,
    bars,
    median_interval,
    plot,
    reference_lines,
    summarize_page,
)


def test_the_median_interval_of_twelve_rounds_is_the_third_and_tenth_smallest() -> None:
    # P(Binomial(12, 1/2) <= 2) = 0.019 <= 0.025 < P(... <= 3) = 0.073
    assert median_interval([float(v) for v in range(12)]) == (2.0, 9.0)


def test_the_median_interval_ignores_the_order_of_the_rounds() -> None:
    values = [5.0, -1.0, 3.0, 8.0, 0.0, 2.0, 9.0, 4.0, 7.0, 1.0, 6.0, 10.0]
    assert median_interval(values) == (1.0, 8.0)


def test_too_few_rounds_for_the_confidence_give_the_extremes() -> None:
    # five rounds: even the extremes cover the median with only 1 - 2/32 = 0.94
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)


@pytest.mark.parametrize("n", [6, 9, 20, 41])
def test_the_median_lies_inside_its_interval(n: int) -> None:
    values = [float((7 * k) % n) for k in range(n)]
    low, high = median_interval(values)
    assert low <= sorted(values)[n // 2] <= high


def _page(matmul_ms: dict[str, float], combined: float = 0.95, count: int = 8) -> dict[str, Any]:
    """One page's raw numbers: every round the same, every variant at `combined`."""
    gpu = {"sm_mhz": 1500.0, "power_w": 500.0}
    arm = {"combined": combined, "store_ratio": 0.9, "load_ratio": 0.9, "gpu": gpu}
    rounds = [
        {
            name: {"matmul_ms": ms, "gpu": gpu} if name == ALONE else {"matmul_ms": ms, **arm}
            for name, ms in matmul_ms.items()
        }
        for _ in range(count)
    ]
    variants = [name for name in matmul_ms if name != ALONE]
    return {"page_kib": 16, "combined_alone": dict.fromkeys(variants, 0.97), "rounds": rounds}


def test_a_rounds_slowdown_is_its_loop_over_the_same_rounds_loop_alone() -> None:
    page = _page({ALONE: 1.0, "torch": 1.02})
    page["rounds"][0] = {
        ALONE: {**page["rounds"][0][ALONE], "matmul_ms": 2.0},
        "torch": {**page["rounds"][0]["torch"], "matmul_ms": 2.04},
    }
    (arm,) = summarize_page(page, ["torch"])
    assert arm["slowdown_per_round"] == pytest.approx([0.02] * 8)


def test_an_executor_under_both_bars_passes_them() -> None:
    arms = summarize_page(_page({ALONE: 1.0, "torch": 1.02}), ["torch"])
    assert [bar["passed"] for bar in bars(arms)] == [True, True]


def test_an_executor_slowing_the_matmul_over_3_percent_fails_the_second_bar() -> None:
    arms = summarize_page(_page({ALONE: 1.0, "torch": 1.04}), ["torch"])
    alone, beside = bars(arms)
    assert alone["passed"]
    assert not beside["passed"]
    assert "torch 16 KiB +4.0 % [+4.0, +4.0] at 0.95" in beside["measured"]


def test_an_executor_under_3_percent_at_too_low_a_rate_fails_the_second_bar() -> None:
    arms = summarize_page(_page({ALONE: 1.0, "torch": 1.01}, combined=0.80), ["torch"])
    assert not bars(arms)[1]["passed"]


def test_the_references_are_no_part_of_the_bars() -> None:
    page = _page({ALONE: 1.0, PINNED: 1.10, "cupy": 1.02})
    arms = summarize_page(page, [PINNED, "cupy"])
    assert all(bar["passed"] for bar in bars(arms))
    assert PINNED not in bars(arms)[1]["measured"]


def test_a_staged_floor_over_3_percent_says_no_staged_path_stays_under_it() -> None:
    arms = summarize_page(_page({ALONE: 1.0, SM_PASS: 1.05}), [SM_PASS])
    (line,) = reference_lines(arms)
    assert line.endswith("above 3 %: no staged path, kvferry's executors included, stays under "
                         "it on this GPU")  # fmt: skip


def test_copy_engines_under_3_percent_leave_room_under_the_bar() -> None:
    arms = summarize_page(_page({ALONE: 1.0, PINNED: 1.01}), [PINNED])
    (line,) = reference_lines(arms)
    assert line.endswith("below 3 %: the link's traffic alone leaves room under it")


def test_an_interval_across_3_percent_is_not_separable_from_it() -> None:
    page = _page({ALONE: 1.0, PINNED: 1.03}, count=8)
    for i, ms in enumerate([1.00, 1.01, 1.02, 1.03, 1.03, 1.04, 1.05, 1.06]):
        page["rounds"][i][PINNED]["matmul_ms"] = ms
    (line,) = reference_lines(summarize_page(page, [PINNED]))
    assert line.endswith("not separable from 3 % with these rounds")


def test_the_plot_is_a_png_when_matplotlib_is_installed(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    arms = summarize_page(_page({ALONE: 1.0, PINNED: 1.01, "torch": 1.04}), [PINNED, "torch"])
    results = tmp_path / "interference.json"
    results.write_text(json.dumps({"arms": arms, "args": {"rounds": 8}}), encoding="utf-8")
    png = plot(results, tmp_path / "interference.png", log=io.StringIO())
    assert png is not None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_no_plot_is_drawn_and_that_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    results = tmp_path / "interference.json"
    results.write_text(json.dumps({"arms": []}), encoding="utf-8")
    log = io.StringIO()
    assert plot(results, tmp_path / "interference.png", log=log) is None
    assert "matplotlib is not installed" in log.getvalue()
