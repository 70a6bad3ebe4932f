"""The CUDA sources compile for the reference GPU (Hopper, sm_90) with nvcc, without a GPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvferry.executors.kernels import STAGE_COPY_SOURCE, TABLE_COPY_SOURCE, ZERO_COPY_SOURCE


@pytest.mark.parametrize(
    "source",
    [STAGE_COPY_SOURCE, TABLE_COPY_SOURCE, ZERO_COPY_SOURCE],
    ids=["stage_copy", "table_copy", "zero_copy"],
)
def test_the_kernel_source_compiles_for_hopper(source: str, tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("needs nvcc (the CUDA compiler; no GPU needed)")
    cu = tmp_path / "kernel.cu"
    cu.write_text(source)
    done = subprocess.run(
        [
            nvcc,
            "--ptx",
            "-arch=sm_90",
            "-Werror",
            "all-warnings",
            "-o",
            str(tmp_path / "k.ptx"),
            str(cu),
        ],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert ".entry" in (tmp_path / "k.ptx").read_text()
