"""The CPU tier's memory: one host buffer holding every group's rows, pinned in pieces.

Owns the allocation and its (un)registration only; it never decides what goes in a row.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvferry.core.errors import InvalidInputError
from kvferry.core.layout import KVLayout, TierLayout

PIECE_LIMIT = 64 << 30
"""Largest piece registered with the driver in one call (large registrations fail on some)."""


_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes() -> int:
    """Return the most memory this process may use for a CPU tier: the host's physical
    memory, or the memory limit of its cgroup (container) when that is lower."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for name in _CGROUP_LIMITS:
        try:
            text = Path(name).read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            continue
        if text.isascii() and text.isdigit():  # "max": no limit
            limit = min(limit, int(text))
    return limit


class HostRegistrar(Protocol):
    """Pins and unpins host memory for a GPU backend (cudaHostRegister and its inverse)."""

    def register(self, address: int, nbytes: int) -> None:
        """Page-lock `nbytes` at `address` and map them for the device; raise on failure."""
        ...

    def unregister(self, address: int) -> None:
        """Undo `register` for the piece starting at `address`."""
        ...


def split_pieces(nbytes: int, row_bytes: int, limit: int = PIECE_LIMIT) -> list[tuple[int, int]]:
    """Return `(offset, size)` pieces covering `nbytes`: each a whole number of rows, <= `limit`.

    Rows never straddle two pieces, so a copy inside a row never crosses a registration.
    """
    if row_bytes < 1 or nbytes % row_bytes:
        raise InvalidInputError(
            field="nbytes", expected=f"a multiple of row_bytes={row_bytes}", got=nbytes
        )
    if row_bytes > limit:
        raise InvalidInputError(
            field="row_bytes", expected=f"at most the piece limit {limit}", got=row_bytes
        )
    step = (limit // row_bytes) * row_bytes
    return [(offset, min(step, nbytes - offset)) for offset in range(0, nbytes, step)]


def tier_pieces(tier: TierLayout, limit: int = PIECE_LIMIT) -> list[tuple[int, int]]:
    """Return `(offset, size)` pieces covering `tier`: each group's region cut by
    `split_pieces` at its own pitch, so no row straddles two pieces."""
    pieces: list[tuple[int, int]] = []
    for base, rows, pitch in zip(tier.base, tier.rows, tier.pitch, strict=True):
        pieces += [(base + at, size) for at, size in split_pieces(rows * pitch, pitch, limit)]
    return pieces


class HostTier:
    """Every group's rows of a `TierLayout` in one host buffer (anonymous mmap, page-aligned).

    With a registrar the buffer is pinned piece by piece; `close()` unpins it.
    """

    def __init__(
        self,
        *,
        tier: TierLayout,
        registrar: HostRegistrar | None = None,
        piece_limit: int = PIECE_LIMIT,
    ) -> None:
        for group, rows in enumerate(tier.rows):
            if rows < 1:
                raise InvalidInputError(
                    group=group, field="num_rows", expected="an integer >= 1", got=rows
                )
        self.tier = tier
        """Where each group's rows lie in the buffer."""
        self.num_rows = tier.rows
        """Rows of each group."""
        self.nbytes = tier.nbytes
        asked = (
            " + ".join(f"{r} rows of {p} bytes" for r, p in zip(tier.rows, tier.pitch, strict=True))
            + f" = {self.nbytes} bytes"
        )
        if self.nbytes > (memory := host_memory_bytes()):  # checked before allocating anything
            raise InvalidInputError(
                field="num_rows",
                expected=f"a CPU tier of at most the host's memory ({memory} bytes; lower "
                "cpu_tier_bytes)",
                got=asked,
            )
        self._piece_limit = piece_limit
        self.pieces = tier_pieces(tier, piece_limit)
        self.piece_starts = tuple(offset for offset, _ in self.pieces)
        """Offset of each piece: no copy may cross one (each is registered on its own)."""
        try:
            self._mmap = mmap.mmap(-1, self.nbytes)
        except OSError as error:
            raise InvalidInputError(
                field="num_rows",
                expected="a CPU tier the host can allocate now (lower cpu_tier_bytes)",
                got=f"{asked}: {error.strerror or error}",
            ) from None
        self.array: npt.NDArray[np.uint8] = np.frombuffer(self._mmap, dtype=np.uint8)
        """The whole tier as a writable uint8 array (no copy)."""
        self.address: int = int(self.array.ctypes.data)
        """Address of the tier's first byte (group 0's row 0)."""
        self._registrar = registrar
        self._registered: list[int] = []
        if registrar is not None:
            try:
                for offset, _size in self.pieces:
                    registrar.register(self.address + offset, _size)
                    self._registered.append(self.address + offset)
            except BaseException:
                self.close()
                raise

    @property
    def pinned(self) -> bool:
        """Return True while the buffer is registered with a GPU backend."""
        return bool(self._registered)

    def rows_per_piece(self, group: int) -> int:
        """Return how many rows of `group` a full piece of its region holds (its region is
        cut into pieces at multiples of it)."""
        return self._piece_limit // self.tier.pitch[group]

    def mirror(self, layout: KVLayout, group: int, ref: int) -> npt.NDArray[np.uint8]:
        """Return the CPU mirror of one ref: a `(rows of the group, F, page_bytes)` view of the
        tier."""
        f = layout.blocks_per_chunk
        page = layout.groups[group].refs[ref]
        offset = self.tier.base[group] + layout.groups[group].row_offsets(f)[ref]
        view: npt.NDArray[np.uint8] = np.lib.stride_tricks.as_strided(
            self.array[offset:],
            shape=(self.num_rows[group], f, page.page_bytes),
            strides=(self.tier.pitch[group], page.page_bytes, 1),
        )
        return view

    def close(self) -> None:
        """Unpin every registered piece (idempotent); the memory is freed with the object."""
        while self._registered and self._registrar is not None:
            self._registrar.unregister(self._registered.pop())
