"""Golden files: each `tests/golden/NAME.scenario.json` must plan exactly `NAME.expected.json`.

`pytest --update-goldens` rewrites the expected files from their scenarios and still fails, so
that a changed plan is always reviewed (`git diff tests/golden`) before it is accepted.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from kvferry.adapters.cli import main
from kvferry.core.canonical_json import dumps_canonical
from kvferry.core.codec import parse_object
from kvferry.core.scenario import run_scenario

GOLDEN_DIR = Path(__file__).parent / "golden"
SCENARIO_SUFFIX = ".scenario.json"
EXPECTED_SUFFIX = ".expected.json"
MIN_SCENARIOS = 20

SCENARIOS = sorted(GOLDEN_DIR.glob(f"*{SCENARIO_SUFFIX}"))


def _name(path: Path, suffix: str) -> str:
    return path.name[: -len(suffix)]


def _expected_path(scenario: Path) -> Path:
    return GOLDEN_DIR / f"{_name(scenario, SCENARIO_SUFFIX)}{EXPECTED_SUFFIX}"


def _planned(scenario: Path) -> str:
    return dumps_canonical(run_scenario(parse_object(scenario.read_text(encoding="utf-8"))))


def _diff(expected: str, actual: str, expected_path: Path) -> str:
    return "".join(
        difflib.unified_diff(
            expected.splitlines(keepends=True),
            actual.splitlines(keepends=True),
            fromfile=f"{expected_path.name} (golden)",
            tofile=f"{expected_path.name} (planned now)",
        )
    )


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[_name(p, SCENARIO_SUFFIX) for p in SCENARIOS])
def test_golden_scenario_plans_its_expected_file(
    scenario: Path, request: pytest.FixtureRequest
) -> None:
    expected_path = _expected_path(scenario)
    actual = _planned(scenario)
    expected = expected_path.read_text(encoding="utf-8") if expected_path.exists() else None

    if request.config.getoption("--update-goldens"):
        if expected == actual:
            pytest.fail(
                f"--update-goldens: {expected_path.name} is unchanged; an update run always "
                "fails, run again without --update-goldens",
                pytrace=False,
            )
        expected_path.write_text(actual, encoding="utf-8")
        pytest.fail(
            f"--update-goldens: rewrote {expected_path.relative_to(GOLDEN_DIR.parent.parent)}; "
            "review the diff (git diff tests/golden) and run again without --update-goldens",
            pytrace=False,
        )

    if expected is None:
        pytest.fail(
            f"{scenario.name} has no {expected_path.name}: run `pytest --update-goldens`, "
            "check the new file by hand and commit it",
            pytrace=False,
        )
    if actual != expected:
        pytest.fail(
            f"{scenario.name} plans differently from {expected_path.name} "
            "(if the change is intended: pytest --update-goldens, then review the diff):\n"
            + _diff(expected, actual, expected_path),
            pytrace=False,
        )


def test_every_expected_file_has_its_scenario() -> None:
    orphans = [
        path.name
        for path in sorted(GOLDEN_DIR.glob(f"*{EXPECTED_SUFFIX}"))
        if not (GOLDEN_DIR / f"{_name(path, EXPECTED_SUFFIX)}{SCENARIO_SUFFIX}").exists()
    ]
    assert not orphans, (
        f"orphaned golden files (no matching *{SCENARIO_SUFFIX}): {', '.join(orphans)}; "
        "delete them or restore their scenarios"
    )


def test_golden_directory_has_at_least_twenty_scenarios() -> None:
    assert len(SCENARIOS) >= MIN_SCENARIOS, (
        f"expected at least {MIN_SCENARIOS} scenarios in {GOLDEN_DIR}, found {len(SCENARIOS)}"
    )


def test_kvferry_plan_prints_the_expected_file(capsys: pytest.CaptureFixture[str]) -> None:
    scenario = GOLDEN_DIR / f"two_full_groups_design_example{SCENARIO_SUFFIX}"

    status = main(["plan", str(scenario)])

    captured = capsys.readouterr()
    assert (status, captured.err) == (0, "")
    assert captured.out == _expected_path(scenario).read_text(encoding="utf-8")
