"""A request's GPU blocks in one KV-cache group, as the engine's block table gives them.

A value: the arrays are private read-only copies, checked once at construction.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from kvferry.core.arrays import (
    FlagArray,
    IdArray,
    arrays_equal,
    frozen_flags,
    integral_ids,
    is_integral,
)
from kvferry.core.checks import unchecked_maker
from kvferry.core.errors import InvalidInputError

_eq_arrays = attrs.cmp_using(eq=arrays_equal)


def _checked_ids(value: object) -> IdArray:
    try:
        ids = integral_ids(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidInputError(
            field="ids", expected="a 1-D sequence of integers", got=value
        ) from exc
    if not is_integral(ids):
        raise InvalidInputError(field="ids", expected="a 1-D sequence of integers", got=value)
    if ids.ndim != 1:
        raise InvalidInputError(field="ids", expected="a 1-D sequence", got=value)
    return ids


@attrs.frozen(kw_only=True)
class GroupBlocks:
    """The GPU blocks of one group of one request, in token order (block `i` holds tokens
    `[i*T_g, (i+1)*T_g)`)."""

    ids: IdArray = attrs.field(converter=_checked_ids, eq=_eq_arrays)
    """GPU block ids (int64, read-only)."""
    is_null: FlagArray = attrs.field(converter=frozen_flags, eq=_eq_arrays)
    """True where the engine put its shared null block: the group no longer needs that block."""
    is_cached: FlagArray = attrs.field(converter=frozen_flags, eq=_eq_arrays)
    """True where the block is a GPU prefix-cache hit (it already holds the right tokens)."""

    def __attrs_post_init__(self) -> None:
        n = len(self.ids)
        for name in ("is_null", "is_cached"):
            flags = getattr(self, name)
            if flags.shape != (n,):
                raise InvalidInputError(
                    field=name, expected=f"{n} flags, one per block id", got=flags.shape
                )
        if n and int(self.ids.min()) < 0:
            index = int(np.argmax(self.ids < 0))
            raise InvalidInputError(
                field=f"ids[{index}]", expected="a block id >= 0", got=int(self.ids[index])
            )
        both = self.is_null & self.is_cached
        if both.any():
            index = int(np.argmax(both))
            raise InvalidInputError(
                field=f"is_cached[{index}]",
                expected="a null block never marked as cached",
                got=True,
            )

    @classmethod
    def of(
        cls,
        ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        *,
        null: Sequence[int] = (),
        cached: Sequence[int] = (),
    ) -> GroupBlocks:
        """Return blocks with the given ids (a sequence or a 1-D array of integers), null at the
        indices `null`, cached at `cached`."""
        n = len(ids)
        is_null = np.zeros(n, dtype=np.bool_)
        is_cached = np.zeros(n, dtype=np.bool_)
        for name, indices, flags in (("null", null, is_null), ("cached", cached, is_cached)):
            for index in indices:
                if not 0 <= index < n:
                    raise InvalidInputError(
                        field=name, expected=f"block indices in [0, {n})", got=index
                    )
                flags[index] = True
        return cls(ids=ids, is_null=is_null, is_cached=is_cached)

    @classmethod
    def of_engine_tables(
        cls,
        tables: Sequence[Sequence[int]],
        *,
        null_id: int,
        starts: Sequence[int] | None = None,
    ) -> tuple[GroupBlocks, ...]:
        """Return the blocks of each group of an engine's block table, one table per group,
        each the engine's own list of block ids (each >= 0) with `null_id` where it put its
        shared null block; none is cached. With `starts`, `tables[g]` holds group `g`'s blocks
        from block `starts[g]` on, and the blocks before it are null: for a caller that never
        reads those (a store reads nothing before its cursor), so a long request's table is
        not read whole.

        For the engine adapters' hot path: the ids of every group are read into one array
        (each group's blocks a read-only view of it) and not checked again (an executor checks
        every block id of a plan against its KV tensors before it copies a byte).
        """
        firsts = [0] * len(tables) if starts is None else starts
        ends = list(itertools.accumulate(map(operator.add, firsts, map(len, tables))))
        column = np.full(ends[-1] if ends else 0, null_id, dtype=np.int64)
        for table, end in zip(tables, ends, strict=True):
            column[end - len(table) : end] = table
        is_null = column == null_id
        is_cached = np.zeros(len(column), dtype=np.bool_)
        for array in (column, is_null, is_cached):
            array.setflags(write=False)
        return tuple(
            _new_blocks(ids=column[a:b], is_null=is_null[a:b], is_cached=is_cached[a:b])
            for a, b in itertools.pairwise([0, *ends])
        )

    def __len__(self) -> int:
        return len(self.ids)


_new_blocks = unchecked_maker(GroupBlocks)
