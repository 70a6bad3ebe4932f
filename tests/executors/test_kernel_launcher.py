"""`KernelLauncher` hands `cuLaunchKernel` the values it is given, in order, and checks arity."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from kvferry.executors.driver import KernelLauncher
from kvferry.executors.kernels import THREADS

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
