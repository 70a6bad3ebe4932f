"""The CPU tier's memory: one host buffer of exactly `num_rows * row_bytes`, pinned in pieces.

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
from kvferry.core.layout import KVLayout

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


class HostTier:
    """`num_rows` rows of `row_bytes` in one host buffer (anonymous mmap, page-aligned).

    With a registrar the buffer is pinned piece by piece; `close()` unpins it.
    """

    def __init__(
        self,
        *,
        num_rows: int,
        row_bytes: int,
        registrar: HostRegistrar | None = None,
        piece_limit: int = PIECE_LIMIT,
    ) -> None:
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 1:
            raise InvalidInputError(field="num_rows", expected="an integer >= 1", got=num_rows)
        self.num_rows = num_rows
        self.row_bytes = row_bytes
        self.nbytes = num_rows * row_bytes
        asked = f"{num_rows} rows of {row_bytes} bytes = {self.nbytes} bytes"
        if self.nbytes > (memory := host_memory_bytes()):  # checked before allocating anything
            raise InvalidInputError(
                field="num_rows",
                expected=f"a CPU tier of at most the host's memory ({memory} bytes; lower "
                "cpu_tier_bytes)",
                got=asked,
            )
        self.pieces = split_pieces(self.nbytes, row_bytes, piece_limit)
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
        """Address of row 0."""
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

    @property
    def piece_bytes(self) -> int:
        """Return the size of a full piece (a multiple of `row_bytes`)."""
        return self.pieces[0][1]

    def mirror(self, layout: KVLayout, group: int, ref: int) -> npt.NDArray[np.uint8]:
        """Return the CPU mirror of one ref: a `(num_rows, F, page_bytes)` view of the tier."""
        f = layout.blocks_per_chunk
        page = layout.groups[group].refs[ref]
        offset = layout.groups[group].row_offsets(f)[ref]
        view: npt.NDArray[np.uint8] = np.lib.stride_tricks.as_strided(
            self.array[offset:],
            shape=(self.num_rows, f, page.page_bytes),
            strides=(self.row_bytes, page.page_stride, 1),
        )
        return view

    def close(self) -> None:
        """Unpin every registered piece (idempotent); the memory is freed with the object."""
        while self._registered and self._registrar is not None:
            self._registrar.unregister(self._registered.pop())
