"""The fixtures in `tests/vllm_layouts/` are vLLM 0.33's allocator output, regenerated here byte
for byte, and kvferry's regrouping of kernel blocks (`layer_pages.manager_blocks`) is vLLM's own
`group_kernel_blocks` on every view the allocator makes.

`pytest --update-goldens` rewrites a fixture that differs and still fails, so that a changed
layout is always reviewed (`git diff tests/vllm_layouts`) before it is accepted.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from record_vllm_layouts import MODELS, allocate, fixture_path, record
from vllm.v1.kv_cache_interface import group_kernel_blocks
from vllm_rig import tiny_model_config

from kvferry.adapters.layer_pages import manager_blocks


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_model_config(tmp_path_factory.mktemp("model"))


def _diff(expected: str, actual: str, path: Path) -> str:
    return "".join(
        difflib.unified_diff(
            expected.splitlines(keepends=True),
            actual.splitlines(keepends=True),
            fromfile=f"{path.name} (committed)",
            tofile=f"{path.name} (vLLM now)",
        )
    )


@pytest.mark.parametrize("name", list(MODELS))
def test_a_layout_fixture_is_what_vllms_allocator_makes(
    name: str, model_config: Any, request: pytest.FixtureRequest
) -> None:
    path = fixture_path(name)
    actual = record(name, model_config)
    expected = path.read_text(encoding="utf-8") if path.exists() else None
    if request.config.getoption("--update-goldens"):
        if expected == actual:
            pytest.fail(
                f"--update-goldens: {path.name} is unchanged; an update run always fails, "
                "run again without --update-goldens",
                pytrace=False,
            )
        path.write_text(actual, encoding="utf-8")
        pytest.fail(
            f"--update-goldens: rewrote tests/vllm_layouts/{path.name}; review the diff "
            "(git diff tests/vllm_layouts) and run again without --update-goldens",
            pytrace=False,
        )
    if expected is None:
        pytest.fail(
            f"tests/vllm_layouts/{path.name} is missing: run `pytest --update-goldens`",
            pytrace=False,
        )
    if actual != expected:
        pytest.fail(
            f"vLLM lays out {name} differently from tests/vllm_layouts/{path.name} (if vLLM "
            "changed on purpose: pytest --update-goldens, then review the diff):\n"
            + _diff(expected, actual, path),
            pytrace=False,
        )


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
    )


@pytest.mark.parametrize("name", list(MODELS))
def test_kvferry_regroups_kernel_blocks_as_vllms_group_kernel_blocks(
    name: str, model_config: Any
) -> None:
    allocated = allocate(name, model_config)
    num_blocks = allocated.config.num_blocks
    for layer, view in allocated.kv_caches.items():
        ours = manager_blocks(view, num_blocks, group=0, layer=layer)
        assert _same_view(ours, group_kernel_blocks(view, num_blocks)), layer


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_kvferry_regroups_kernel_blocks_of_a_strided_view_as_vllm_does(ratio: int) -> None:
    num_blocks = 6
    buffer = torch.zeros(num_blocks * ratio * 3 * 40, dtype=torch.int8)
    view = buffer.view(torch.float16).as_strided((num_blocks * ratio, 2, 8), (60, 8, 1), 4)
    ours = manager_blocks(view, num_blocks, group=0, layer="layer")
    assert _same_view(ours, group_kernel_blocks(view, num_blocks))
