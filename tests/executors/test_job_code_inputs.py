"""The job code of each route refuses malformed input with a Python exception that says what is
wrong, instead of reading past what it was given (its callers build the input, so these are its
own guards, not the executor's validation)."""

from __future__ import annotations

import numpy as np
import pytest

from kvferry.executors.jobcode import JobCode

pytestmark = pytest.mark.usefixtures("route")


def test_the_slicer_refuses_a_group_with_too_few_fields(jobs: JobCode) -> None:
    with pytest.raises(ValueError, match="a group has 3 fields"):
        jobs.slice_batches([(0, 1, 2)], False, 1 << 20, 1 << 10, 1)


def test_run_copies_refuses_a_slice_naming_a_group_it_was_not_given(jobs: JobCode) -> None:
    line = np.array([[0, 1, 0, 2, 0]], np.int64).tobytes()  # batch 0, group 1 of 1
    with pytest.raises(ValueError, match="out of range"):
        jobs.run_copies(line, [0], 1, [0], [0], [4096], [0], False)


def test_the_row_check_refuses_rows_that_are_not_int64(jobs: JobCode) -> None:
    with pytest.raises(TypeError, match="int64"):
        jobs.consecutive(np.arange(4, dtype=np.int32))


@pytest.mark.parametrize(
    ("rows", "expected"), [([], True), ([7], True), ([3, 4, 5], True), ([3, 5, 6], False)]
)
def test_the_row_check_says_whether_rows_count_up_by_one(
    jobs: JobCode, rows: list[int], expected: bool
) -> None:
    assert jobs.consecutive(np.array(rows, np.int64)) is expected
