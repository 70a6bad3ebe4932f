"""docs/offload-config.md names every field of OffloadConfig and GroupSpec, every public member
of OffloadConfig and every GroupKind, so the page cannot fall behind the code."""

from __future__ import annotations

import inspect
from pathlib import Path

import attrs
import pytest

from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig

PAGE = Path(__file__).resolve().parent.parent / "docs" / "offload-config.md"
TEXT = PAGE.read_text(encoding="utf-8")


def _rows() -> list[str]:
    return [line for line in TEXT.splitlines() if line.startswith("| `")]


@pytest.mark.parametrize("cls", [OffloadConfig, GroupSpec], ids=lambda cls: cls.__name__)
def test_every_field_has_a_row(cls: type) -> None:
    fields = [field.name for field in attrs.fields(cls) if field.init]
    rows = _rows()
    missing = [name for name in fields if not any(row.startswith(f"| `{name}`") for row in rows)]
    assert not missing, f"{cls.__name__} fields missing from {PAGE.name}: {missing}"


def test_every_public_member_of_the_config_has_a_row() -> None:
    members = [
        name
        for name, _ in inspect.getmembers(OffloadConfig)
        if not name.startswith("_") and name not in {f.name for f in attrs.fields(OffloadConfig)}
    ]
    rows = _rows()
    missing = [name for name in members if not any(row.startswith(f"| `{name}") for row in rows)]
    assert not missing, f"OffloadConfig members missing from {PAGE.name}: {missing}"


def test_every_group_kind_has_a_row_with_its_value() -> None:
    for kind in GroupKind:
        assert f'| `GroupKind.{kind.name}` | `"{kind.value}"` |' in TEXT, kind
