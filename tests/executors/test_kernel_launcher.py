"""`KernelLauncher` hands `cuLaunchKernel` the values it is given, or its holders hold, in order,
and checks arity."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from kvferry.executors.driver import KernelLauncher
from kvferry.executors.kernels import PIECE_BYTES, THREADS
from kvferry.executors.staged import _STAGE_COPY_ARGUMENTS, StagedGpuExecutor

ARGUMENTS = (ctypes.c_uint64, ctypes.c_int, ctypes.c_longlong)


class _Library:
    """Stands in for `libcuda`: records what each launch passed and what its params held (read
    as `arguments`)."""

    def __init__(self, arguments: tuple[type[Any], ...] = ARGUMENTS) -> None:
        self.launches: list[dict[str, Any]] = []
        self.arguments = arguments

    def cuLaunchKernel(self, function: Any, *rest: Any) -> int:  # noqa: N802 (the CUDA name)
        grid, block, shared, stream, params, extra = rest[:3], rest[3:6], rest[6], *rest[7:]
        values = [
            ctypes.cast(params[i], ctypes.POINTER(kind)).contents.value
            for i, kind in enumerate(self.arguments)
        ]
        self.launches.append(
            {
                "function": function.value,
                "grid": [int(getattr(n, "value", n)) for n in grid],
                "block": [int(getattr(n, "value", n)) for n in block],
                "shared": int(getattr(shared, "value", shared)),
                "stream": stream,
                "values": values,
                "extra": extra,
            }
        )
        return 0


class _Driver:
    def __init__(self, arguments: tuple[type[Any], ...] = ARGUMENTS) -> None:
        self.library = _Library(arguments)


def test_a_launch_passes_its_values_in_order_with_the_grid_asked_for() -> None:
    driver = _Driver()
    launcher = KernelLauncher(driver, 1234, ARGUMENTS)
    launcher(1 << 40, -3, 7, blocks=5, stream=99)
    launcher(2, 4, 1 << 50, blocks=1, stream=100)
    first, second = driver.library.launches
    assert first == {
        "function": 1234,
        "grid": [5, 1, 1],
        "block": [THREADS, 1, 1],
        "shared": 0,
        "stream": 99,
        "values": [1 << 40, -3, 7],
        "extra": None,
    }
    assert second["values"] == [2, 4, 1 << 50]
    assert second["grid"] == [1, 1, 1]


def test_a_function_handle_given_as_a_pointer_is_launched_the_same() -> None:
    driver = _Driver()
    KernelLauncher(driver, ctypes.c_void_p(1234), ARGUMENTS)(0, 0, 0, blocks=1, stream=0)
    assert driver.library.launches[0]["function"] == 1234


@pytest.mark.parametrize("values", [(1, 2), (1, 2, 3, 4)])
def test_a_launch_with_the_wrong_number_of_values_raises_before_launching(
    values: tuple[int, ...],
) -> None:
    driver = _Driver()
    launcher = KernelLauncher(driver, 1234, ARGUMENTS)
    with pytest.raises(TypeError, match="takes 3 values"):
        launcher(*values, blocks=1, stream=0)
    assert driver.library.launches == []


def test_launch_alone_passes_the_values_the_holders_hold_as_last_set() -> None:
    driver = _Driver()
    launcher = KernelLauncher(driver, 1234, ARGUMENTS)
    launcher(1, 2, 3, blocks=1, stream=0)
    launcher.holders[1].value = 9  # a batch sets only what changes
    launcher.launch(4, 7)
    assert driver.library.launches[1]["values"] == [1, 9, 3]
    assert driver.library.launches[1]["grid"] == [4, 1, 1]
    assert driver.library.launches[1]["stream"] == 7


class _LaunchesOne:
    """Stands in for a staged executor whose only kernel is `launcher`."""

    def __init__(self, launcher: KernelLauncher) -> None:
        self.launcher = launcher

    def _launcher(self, *_: Any) -> KernelLauncher:
        return self.launcher


def test_a_jobs_stage_kernel_passes_its_constants_and_each_batchs_values_in_kernel_order() -> None:
    driver = _Driver(_STAGE_COPY_ARGUMENTS)
    launcher = KernelLauncher(driver, 1234, _STAGE_COPY_ARGUMENTS)
    stage_kernel = StagedGpuExecutor._stage_kernel
    stage_copy = stage_kernel(_LaunchesOne(launcher), refs=100, ids=200, to_stage=True)  # type: ignore[arg-type]
    stage_copy(7, 1000, 3, 5000, 12)
    stage_copy(8, 2000, 4, 6000, 13)
    first, second = driver.library.launches
    # segments, count, refs, ids, stage, to_stage, piece bytes
    assert first["values"] == [1000, 3, 100, 200, 5000, 1, PIECE_BYTES]
    assert second["values"] == [2000, 4, 100, 200, 6000, 1, PIECE_BYTES]
    assert (first["stream"], first["grid"][0], second["stream"], second["grid"][0]) == (
        7,
        12,
        8,
        13,
    )
