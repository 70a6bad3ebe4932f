"""The planning core stays pure: no GPU library, no I/O modules, no clocks."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvferry.core

CORE = Path(kvferry.core.__file__).resolve().parent
ALLOWED_THIRD_PARTY = {"attrs", "numpy"}
FORBIDDEN_STDLIB = {"time", "random", "os", "io", "socket", "subprocess", "threading", "datetime"}


def test_importing_core_leaves_torch_and_cupy_out_of_sys_modules() -> None:
    code = (
        "import sys, kvferry.core, kvferry.core.codec, kvferry.core.scenario; "
        "print(sorted(m for m in ('torch', 'cupy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _imported_top_level_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_core_modules_import_only_stdlib_attrs_numpy_and_core() -> None:
    offenders = {}
    for path in sorted(CORE.glob("*.py")):
        imported = _imported_top_level_modules(path)
        third_party = {
            name for name in imported if name not in sys.stdlib_module_names and name != "kvferry"
        }
        bad = (third_party - ALLOWED_THIRD_PARTY) | (imported & FORBIDDEN_STDLIB)
        if bad:
            offenders[path.name] = sorted(bad)
    assert offenders == {}


def test_core_modules_import_nothing_from_executors_or_adapters() -> None:
    offenders = []
    for path in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                ("kvferry.executors", "kvferry.adapters")
            ):
                offenders.append(path.name)
    assert offenders == []
