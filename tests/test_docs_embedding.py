"""The engine loop of docs/embedding.md runs as written and prints what its last line says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "embedding.md"


def test_embedding_engine_loop_prints_its_commented_result() -> None:
    (example,) = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    promised = example.strip().splitlines()[-1].split("#", 1)[1].strip()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, str(DOC), "exec"), {"__name__": "docs_embedding"})
    assert out.getvalue().strip() == promised
