"""Executors are chosen by name, with helpful errors, and third parties can register their own."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from kvferry.core.errors import ExecutorUnavailableError, InvalidInputError, UnknownExecutorError
from kvferry.core.layout import TensorLayout
from kvferry.executors import (
    BUILTIN_EXECUTORS,
    ENTRY_POINT_GROUP,
    KVTensor,
    executor_class,
    make_executor,
    registry,
)
from kvferry.executors.cpu import CpuExecutor


def _kv() -> list[list[KVTensor]]:
    return [[KVTensor(tensor=np.zeros((8, 64), np.uint8), layout=TensorLayout.MLA)]]


def test_make_executor_builds_the_cpu_executor_by_name() -> None:
    with make_executor("cpu", kv_caches=_kv(), blocks_per_chunk=2, num_rows=3) as executor:
        assert isinstance(executor, CpuExecutor)
        assert executor.host_tier.nbytes == 3 * 2 * 64


def test_an_unknown_name_suggests_the_closest_one() -> None:
    with pytest.raises(UnknownExecutorError, match="did you mean 'torch'"):
        executor_class("troch")


def test_a_missing_backend_names_the_checkout_install_of_its_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "torch" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ExecutorUnavailableError, match=r"pip install -e '\.\[torch\]'"):
        executor_class("torch")


def test_every_builtin_executor_names_its_requirements_and_extra() -> None:
    for name, entry in BUILTIN_EXECUTORS.items():
        assert (entry.extra is None) == (not entry.requires), name


def test_an_entry_point_registers_a_third_party_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    point = importlib.metadata.EntryPoint(
        name="vendor", value="kvferry.executors.cpu:CpuExecutor", group=ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [point])
    assert executor_class("vendor") is CpuExecutor


def test_registering_a_target_that_is_not_an_executor_fails_clearly() -> None:
    registry.register_executor("not-one", "kvferry.core.plan:TransferPlan")
    try:
        with pytest.raises(ExecutorUnavailableError, match="not an Executor"):
            executor_class("not-one")
    finally:
        registry._registered.pop("not-one")


def test_importing_the_executors_package_imports_no_gpu_framework() -> None:
    code = (
        "import sys, kvferry.executors, kvferry.executors.cpu; "
        "print(sorted(m for m in ('torch', 'cupy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_torch_executor_without_a_cuda_device_says_so() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    tensor = torch.zeros((8, 64), dtype=torch.uint8)
    kv = [[KVTensor(tensor=tensor, layout=TensorLayout.MLA)]]
    with pytest.raises(ExecutorUnavailableError, match="CUDA device"):
        make_executor("torch", kv_caches=kv, blocks_per_chunk=1, num_rows=2)


def test_an_entry_that_is_not_a_kv_tensor_is_refused_naming_its_group() -> None:
    kv = [[KVTensor(tensor=np.zeros((8, 64), np.uint8), layout=TensorLayout.MLA)], [object()]]
    with pytest.raises(InvalidInputError, match="group 1"):
        make_executor("cpu", kv_caches=kv, blocks_per_chunk=1, num_rows=2)
