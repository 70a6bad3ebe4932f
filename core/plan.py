"""The TransferPlan: what one transfer moves (keys and GPU blocks), never how.

A value: validated at construction, so an executor can trust every plan it is given.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import attrs
import numpy as np

from kvferry.core.arrays import IdArray, arrays_equal, integral_ids, is_integral
from kvferry.core.errors import PlanInvariantError
from kvferry.core.keys import KeyColumn, OffloadKey, key_column


class Direction(enum.Enum):
    """Which way a plan moves bytes."""

    LOAD = "load"
    """CPU tier -> GPU blocks."""
    STORE = "store"
    """GPU blocks -> CPU tier."""


def _int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


def chunks_spanned(size: int, skip: int, blocks_per_chunk: int) -> int:
    """Return how many chunks (CPU rows) a group's `size` blocks touch after `skip` slots."""
    return -(-(size + skip) // blocks_per_chunk) if size else 0


def check_distinct_destinations(request_id: str, group: int, ids: IdArray) -> None:
    """Raise PlanInvariantError when `ids`, a load's destination blocks in `group`, repeat one."""
    if len(ids) < 2 or bool((ids[1:] > ids[:-1]).all()):  # increasing: distinct, no sort
        return
    ordered = np.sort(ids)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(repeated):
        raise PlanInvariantError(
            request=request_id,
            group=group,
            field="gpu_block_ids",
            expected="distinct destination blocks",
            got=int(repeated[0]),
        )


def _increasing_per_group(ids: IdArray, sizes: tuple[int, ...]) -> bool:
    """Return True when `ids` increase within each group's run (`sizes` long, in order)."""
    if len(ids) < 2:
        return True
    increasing = ids[1:] > ids[:-1]
    if bool(increasing.all()):
        return True
    ends = np.cumsum(sizes)[:-1] - 1  # a pair across two groups' runs is not compared
    ends = ends[(ends >= 0) & (ends < len(increasing))]
    increasing = increasing.copy()
    increasing[ends] = True
    return bool(increasing.all())


@attrs.frozen(kw_only=True)
class TransferPlan:
    """One transfer between the GPU blocks of one request and the CPU tier.

    Keys are listed group by group, and so are GPU block ids; `group_sizes[g]` ids belong to
    group `g`. `block_indices[g]` is the position, in the request's block list of group `g`, of
    the first block moved; `block_indices[g] % blocks_per_chunk` is the *skip*: the slots at the
    start of the group's first chunk that are not part of the transfer.

    Constructing one checks every invariant. `plan_load` and `plan_store` build theirs with
    `checks.unchecked` instead (hot paths), checking only what their inputs can break (a load's
    distinct destinations); tests/test_planner_built_values.py holds them to these checks.
    """

    request_id: str
    """The engine's request id."""
    direction: Direction
    """LOAD (CPU -> GPU) or STORE (GPU -> CPU)."""
    blocks_per_chunk: int
    """`F` of the configuration the plan was made for."""
    keys: KeyColumn = attrs.field(converter=key_column)
    """The chunks moved, group by group, in token order within a group (any iterable of
    OffloadKeys is taken; held as a column)."""
    gpu_block_ids: IdArray = attrs.field(
        converter=integral_ids, eq=attrs.cmp_using(eq=arrays_equal)
    )
    """GPU block ids, group by group, in token order within a group."""
    group_sizes: tuple[int, ...] = attrs.field(converter=_int_tuple)
    """GPU blocks moved per group."""
    block_indices: tuple[int, ...] = attrs.field(converter=_int_tuple)
    """Per group, the request-block index of the first block moved (0 when none moves)."""

    def __attrs_post_init__(self) -> None:
        def fail(field: str, expected: str, got: object, group: int | None = None) -> None:
            raise PlanInvariantError(
                request=self.request_id, group=group, field=field, expected=expected, got=got
            )

        f = self.blocks_per_chunk
        if f < 1:
            fail("blocks_per_chunk", "an integer >= 1", f)
        n_groups = len(self.group_sizes)
        if n_groups < 1 or len(self.block_indices) != n_groups:
            fail(
                "block_indices",
                f"one entry per group ({n_groups} groups in group_sizes)",
                len(self.block_indices),
            )
        if self.gpu_block_ids.ndim != 1:
            fail("gpu_block_ids", "a 1-D array", self.gpu_block_ids.shape)
        if not is_integral(self.gpu_block_ids):
            fail("gpu_block_ids", "integer block ids", self.gpu_block_ids.tolist())
        if sum(self.group_sizes) != len(self.gpu_block_ids):
            fail(
                "group_sizes", f"a sum of {len(self.gpu_block_ids)} (the GPU ids)", self.group_sizes
            )
        groups_of_keys = self.keys.groups
        if len(groups_of_keys) and bool((groups_of_keys[1:] < groups_of_keys[:-1]).any()):
            fail("keys", "keys listed group by group, in group order", groups_of_keys.tolist())
        if len(groups_of_keys) and not (
            0 <= int(groups_of_keys[0]) <= int(groups_of_keys[-1]) < n_groups
        ):
            fail("keys", f"group indices in [0, {n_groups})", int(groups_of_keys[-1]))
        bounds = np.searchsorted(groups_of_keys, np.arange(n_groups + 1)).tolist()
        key_counts = {g: bounds[g + 1] - bounds[g] for g in range(n_groups)}
        ids_all = self.gpu_block_ids
        lowest = int(ids_all.min()) if len(ids_all) else 0
        # Destinations increasing within every group are distinct: one pass for all groups.
        check_each = self.direction is Direction.LOAD and not _increasing_per_group(
            ids_all, self.group_sizes
        )
        offset = 0
        for g, (size, first) in enumerate(zip(self.group_sizes, self.block_indices, strict=True)):
            if size < 0 or first < 0:
                fail("group_sizes/block_indices", "non-negative integers", (size, first), g)
            if size == 0 and first != 0:
                fail("block_indices", "0 for a group that moves nothing", first, g)
            if self.direction is Direction.STORE and first % f:
                fail("block_indices", f"a multiple of {f} (stores move whole chunks)", first, g)
            expected_keys = chunks_spanned(size, first % f, f)
            if key_counts.get(g, 0) != expected_keys:
                fail(
                    "keys",
                    f"{expected_keys} keys for {size} blocks after a skip of {first % f}",
                    key_counts.get(g, 0),
                    g,
                )
            ids = self.gpu_block_ids[offset : offset + size]
            offset += size
            if lowest < 0 and size and int(ids.min()) < 0:
                fail("gpu_block_ids", "block ids >= 0", int(ids.min()), g)
            if check_each:
                check_distinct_destinations(self.request_id, g, ids)

    @property
    def num_groups(self) -> int:
        """Return the number of groups the plan covers."""
        return len(self.group_sizes)

    def gpu_ids_of(self, group: int) -> IdArray:
        """Return the GPU block ids of `group` (a read-only view)."""
        start = sum(self.group_sizes[:group])
        return self.gpu_block_ids[start : start + self.group_sizes[group]]

    def keys_of(self, group: int) -> tuple[OffloadKey, ...]:
        """Return the keys of `group`, in order."""
        return self.keys.of_group(group)

    @property
    def is_empty(self) -> bool:
        """Return True when the plan moves nothing."""
        return not len(self.keys)
