"""The statistics and the report of `benchmarks/interference_rounds.py` (the script itself
needs a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from interference_rounds import median_interval, report_rounds


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


def _rounds(matmul_ms: dict[str, float], count: int = 8) -> list[dict[str, dict[str, object]]]:
    gpu = {"sm_mhz": 1500.0, "power_w": 500.0}
    return [
        {arm: {"matmul_ms": ms, "combined": 0.95, "gpu": gpu} for arm, ms in matmul_ms.items()}
        for _ in range(count)
    ]


def test_an_arm_without_a_label_is_read_against_target_3() -> None:
    _, summary = report_rounds(_rounds({"alone": 1.0, "torch": 1.02}), ["torch"])
    assert summary == [
        "target 3 by rounds, torch: matmul slowdown median +2.0 % (95 % interval +2.0 .. +2.0 %), "
        "combined transfer 0.95 x bidirectional ceiling -> PASS (bars: <= 3 %, >= 0.90)"
    ]


def test_a_labelled_arm_is_reported_under_its_label_and_the_others_under_target_3() -> None:
    rounds = _rounds({"alone": 1.0, "torch": 1.04, "bulk": 1.07})
    _, summary = report_rounds(rounds, ["torch", "bulk"], labels={"bulk": "bulk copies"})
    assert [line.split(":")[0] for line in summary] == [
        "target 3 by rounds, torch",
        "bulk copies, bulk",
    ]
