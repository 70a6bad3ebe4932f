"""The JSON examples of docs/plan-format.md are what the planner produces.

(Every python and sh block of the docs runs in tests/test_docs_code_blocks.py.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvferry.core.scenario import run_scenario

ROOT = Path(__file__).resolve().parent.parent


def _code_blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(encoding="utf-8"), re.S)


def test_plan_format_scenario_example_runs() -> None:
    scenario = json.loads(_code_blocks(ROOT / "docs" / "plan-format.md", "json")[1])
    steps = run_scenario(scenario)["steps"]
    assert [step["op"] for step in steps] == ["lookup", "load", "store"]


def test_plan_format_plan_example_is_the_first_step_of_its_scenario() -> None:
    plan_example, scenario_text = _code_blocks(ROOT / "docs" / "plan-format.md", "json")[:2]
    scenario = json.loads(scenario_text)
    documented = json.loads(plan_example)
    load_plan = run_scenario(scenario)["steps"][1]["plan"]
    assert documented == load_plan
