"""The compiled route's check of a bound plan (`_native.bound_bytes`) against its specification,
`check_bound`: it returns the same bytes for every plan that fits, except the few it leaves to
`check_bound` (-1: a store whose rows do not increase, ids or rows that are not contiguous
int64), and -1 for every plan `check_bound` refuses. (The Python route leaves every plan to
`check_bound`: `test_job_code_routes.py`.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.core.errors import PlanInvariantError
from kvferry.core.expand import check_bound
from kvferry.core.layout import GroupLayout, KVLayout, PageRef
from kvferry.core.plan import Direction
from kvferry.executors.jobcode import job_code, native_available

pytestmark = pytest.mark.skipif(
    not native_available(), reason="the compiled module kvferry.executors._native is not built here"
)


def _layout(f: int, groups: list[tuple[int, int]]) -> KVLayout:
    """A layout of one ref per group: (blocks, page bytes) each."""
    return KVLayout(
        blocks_per_chunk=f,
        groups=[
            GroupLayout(
                refs=[PageRef(address=1 << 20, num_blocks=n, page_stride=size, page_bytes=size)]
            )
            for n, size in groups
        ],
    )


def _compiled(bound: Any, layout: KVLayout, num_rows: int) -> int:
    plan = bound.plan
    return job_code("native").bound_bytes(
        plan.gpu_block_ids,
        bound.cpu_rows,
        plan.group_sizes,
        plan.block_indices,
        plan.blocks_per_chunk,
        layout.blocks_per_chunk,
        tuple(group.num_blocks for group in layout.groups),
        tuple(group.block_copy_bytes for group in layout.groups),
        () if num_rows < 0 else (num_rows,) * layout.num_groups,
        plan.direction is Direction.STORE,
    )


def _bound(
    f: int, sizes: list[int], firsts: list[int], ids: list[int], rows: list[int], *, store: bool
) -> Any:
    """A bound plan as `check_bound` reads it, with none of the value types' own checks, so
    inputs those would refuse reach both checks too."""
    plan = SimpleNamespace(
        request_id="r",
        direction=Direction.STORE if store else Direction.LOAD,
        blocks_per_chunk=f,
        num_groups=len(sizes),
        group_sizes=tuple(sizes),
        block_indices=tuple(firsts),
        gpu_block_ids=np.array(ids, np.int64),
    )
    return SimpleNamespace(plan=plan, cpu_rows=np.array(rows, np.int64))


@st.composite
def _cases(draw: st.DrawFn) -> tuple[Any, KVLayout, int]:
    f = draw(st.integers(1, 3))
    layout_groups = draw(
        st.lists(
            st.tuples(st.integers(1, 12), st.sampled_from([8, 16, 24])), min_size=1, max_size=3
        )
    )
    n_groups = draw(st.sampled_from([len(layout_groups), len(layout_groups), 1, 2]))
    sizes = draw(st.lists(st.integers(0, 6), min_size=n_groups, max_size=n_groups))
    firsts = draw(st.lists(st.integers(0, 5), min_size=n_groups, max_size=n_groups))
    skips = [first % f for first in firsts]
    fitting_rows = sum(-(-(n + s) // f) if n else 0 for n, s in zip(sizes, skips, strict=True))
    n_ids = sum(sizes) + draw(st.sampled_from([0, 0, 0, -1, 1]))
    n_rows = fitting_rows + draw(st.sampled_from([0, 0, 0, -1, 1]))
    ids = draw(st.lists(st.integers(0, 13), min_size=max(n_ids, 0), max_size=max(n_ids, 0)))
    rows = draw(st.lists(st.integers(0, 16), min_size=max(n_rows, 0), max_size=max(n_rows, 0)))
    if draw(st.booleans()):
        rows = sorted(set(rows)) + [17 + i for i in range(len(rows) - len(set(rows)))]
    plan_f = draw(st.sampled_from([f, f, f, f + 1]))
    store = draw(st.booleans())
    num_rows = draw(st.sampled_from([-1, 8, 18, 32]))
    bound = _bound(plan_f, sizes, firsts, ids, rows, store=store)
    return bound, _layout(f, layout_groups), num_rows


def _group_rows(bound: Any) -> list[Any]:
    """Return each group's rows of `bound` (every group has its own row ids)."""
    plan, out, start = bound.plan, [], 0
    for n, first in zip(plan.group_sizes, plan.block_indices, strict=True):
        f = plan.blocks_per_chunk
        count = (n + first % f + f - 1) // f if n > 0 else 0
        out.append(bound.cpu_rows[start : start + count])
        start += count
    return out


@given(_cases())
def test_the_compiled_check_gives_check_bound_s_bytes_and_leaves_it_every_refusal(
    case: tuple[Any, KVLayout, int],
) -> None:
    bound, layout, num_rows = case
    compiled = _compiled(bound, layout, num_rows)
    left_to_check_bound = bound.plan.direction is Direction.STORE and not all(
        all(rows[1:] > rows[:-1]) for rows in _group_rows(bound)
    )
    try:
        expected = check_bound(bound, layout, num_rows=None if num_rows < 0 else num_rows)
    except PlanInvariantError:
        assert compiled == -1
    else:
        assert compiled == (-1 if left_to_check_bound else expected)


def test_the_compiled_check_returns_the_bytes_of_a_plan_that_fits() -> None:
    layout = _layout(2, [(10, 16), (10, 8)])
    bound = _bound(2, [3, 2], [1, 0], [1, 2, 3, 4, 5], [0, 1, 2], store=False)
    assert _compiled(bound, layout, 3) == check_bound(bound, layout, num_rows=3) == 3 * 16 + 2 * 8


def test_the_compiled_check_passes_a_store_whose_groups_reuse_each_other_s_row_ids() -> None:
    layout = _layout(1, [(10, 16), (10, 8)])
    bound = _bound(1, [2, 2], [0, 0], [1, 2, 3, 4], [0, 1, 0, 1], store=True)
    assert _compiled(bound, layout, 2) == check_bound(bound, layout, num_rows=2) == 2 * 16 + 2 * 8


def test_the_compiled_check_leaves_a_store_whose_rows_do_not_increase_to_check_bound() -> None:
    layout = _layout(1, [(10, 16)])
    bound = _bound(1, [2], [0], [1, 2], [5, 3], store=True)
    assert _compiled(bound, layout, 8) == -1
    assert check_bound(bound, layout, num_rows=8) == 32


@pytest.mark.parametrize("dtype", [np.int32, np.uint64])
def test_the_compiled_check_leaves_ids_that_are_not_int64_to_check_bound(dtype: type) -> None:
    layout = _layout(1, [(10, 16)])
    bound = _bound(1, [2], [0], [1, 2], [0, 1], store=False)
    bound.plan.gpu_block_ids = bound.plan.gpu_block_ids.astype(dtype)
    assert _compiled(bound, layout, 8) == -1


def test_the_compiled_check_leaves_rows_that_are_not_contiguous_to_check_bound() -> None:
    layout = _layout(1, [(10, 16)])
    bound = _bound(1, [2], [0], [1, 2], [0, 1], store=False)
    bound.cpu_rows = np.arange(4, dtype=np.int64)[::2]
    assert _compiled(bound, layout, 8) == -1
