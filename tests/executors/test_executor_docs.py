"""The example in docs/executors.md runs and prints what its comment says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "executors.md"


def test_the_quick_start_prints_its_commented_result() -> None:
    (example,) = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    promised = example.strip().splitlines()[-1].split("#", 1)[1].strip()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, str(DOC), "exec"), {})
    assert out.getvalue().strip() == promised
