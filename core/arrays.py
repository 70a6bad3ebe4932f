"""Read-only numpy arrays for frozen values: conversion and equality.

Pure helpers; they never keep a reference to a caller's writable array.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

IdArray = npt.NDArray[np.int64]
FlagArray = npt.NDArray[np.bool_]


def frozen_ids(value: Any) -> IdArray:
    """Return a read-only int64 copy of `value` (a sequence or an array of integers)."""
    array = np.array(value, dtype=np.int64, copy=True)
    array.setflags(write=False)
    return array


def integral_ids(value: Any) -> IdArray:
    """Return `frozen_ids(value)` when `value`'s elements are integers (or there are none);
    otherwise `value` as a read-only array, unconverted, for the caller to refuse where it
    can say which request and field it was (`is_integral` tells which)."""
    array = np.asarray(value)
    if is_integral(array):
        return frozen_ids(array)
    array = array.view()
    array.setflags(write=False)
    return array


def is_integral(array: npt.NDArray[Any]) -> bool:
    """Return True when `array` holds integers (bools excluded), or nothing."""
    return array.size == 0 or array.dtype.kind in "iu"


def frozen_flags(value: Any) -> FlagArray:
    """Return a read-only bool copy of `value`."""
    array = np.array(value, dtype=np.bool_, copy=True)
    array.setflags(write=False)
    return array


def arrays_equal(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> bool:
    """Return True when both arrays have the same shape and elements (attrs `eq` helper)."""
    return bool(np.array_equal(a, b))


FEW = 16
"""Up to this many entries, a column is read or written entry by entry: numpy's fancy indexing
costs more than it saves on a store's few chunks."""


def assign(column: npt.NDArray[Any], rows: Sequence[int] | IdArray, value: object) -> None:
    """Set `column[rows] = value` (entry by entry for up to `FEW` rows)."""
    if len(rows) <= FEW:
        for row in rows:
            column[row] = value
    else:
        column[rows] = value
