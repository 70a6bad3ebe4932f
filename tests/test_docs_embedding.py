"""The worked examples of docs/semantics.md quote their golden files exactly."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GOLDEN = ROOT / "tests" / "golden"


def _worked_examples() -> list[tuple[str, str, str, str]]:
    text = (DOCS / "semantics.md").read_text(encoding="utf-8").split("## Worked examples", 1)[1]
    pattern = (
        r"Golden `(\w+)`:\n\n> (.*?)\n\n"
        r"Inputs:\n\n```json\n(.*?)```\n\nOutput:\n\n```json\n(.*?)```"
    )
    return re.findall(pattern, text, re.S)


def test_semantics_worked_examples_quote_their_golden_files() -> None:
    examples = _worked_examples()
    assert len(examples) >= 6
    for name, description, inputs, output in examples:
        scenario = json.loads((GOLDEN / f"{name}.scenario.json").read_text(encoding="utf-8"))
        expected = json.loads((GOLDEN / f"{name}.expected.json").read_text(encoding="utf-8"))
        assert description == scenario.pop("description"), name
        assert json.loads(inputs) == scenario, name
        assert json.loads(output) == expected["steps"], name
