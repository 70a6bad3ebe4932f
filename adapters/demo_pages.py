"""The demo's KV tensors and the bytes every page must hold, derived from (group, ref, prefix).

Allocates the "GPU" tensors (numpy on the host for the cpu executor, CUDA tensors through torch
for the GPU executors) and reads and writes their pages; it never plans or copies between tiers.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from kvferry.adapters.demo_profiles import WORD, GroupProfile, ModelProfile
from kvferry.core.errors import InvalidInputError
from kvferry.core.layout import TensorLayout
from kvferry.executors.tensors import KVTensor

Words = npt.NDArray[np.uint64]
POISON = 0xEEEE_EEEE_EEEE_EEEE
"""What a load's destination pages hold before the load writes them."""

_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)


def _mix(values: Words) -> Words:
    """Return splitmix64 of every value (vectorised; uint64 arithmetic wraps)."""
    values = (values ^ (values >> np.uint64(30))) * _C1
    values = (values ^ (values >> np.uint64(27))) * _C2
    mixed: Words = values ^ (values >> np.uint64(31))
    return mixed


class PagePattern:
    """What a page must hold: for each token (or Mamba state) identity, a window of a fixed
    noise array chosen by the identity and XORed with it, salted per (group, ref, rank).

    Different prefixes, groups, refs or tensor-parallel ranks give different bytes; equal
    ones give equal bytes (rank 0's are those of a run without tensor parallelism).
    """

    def __init__(self, seed: int, max_words: int, *, rank: int = 0) -> None:
        self.rank = rank
        """The tensor-parallel rank whose shard these pages are (salts every page)."""
        rng = np.random.default_rng(seed)
        self._noise: Words = rng.integers(0, 2**63, size=max_words + 65_536, dtype=np.uint64)
        self._windows: dict[int, Words] = {}

    @staticmethod
    def salt(group: int, ref: int, rank: int = 0) -> np.uint64:
        """Return the salt of ref `ref` of group `group` on tensor-parallel rank `rank`."""
        key = rank << 48 | (group + 1) << 32 | (ref + 1)
        return np.uint64(key * 0x9E3779B97F4A7C15 % (1 << 64))

    def words(self, ids: Words, salt: np.uint64, width: int) -> Words:
        """Return one row of `width` words per identity in `ids` (shape `(len(ids), width)`)."""
        windows = self._windows.get(width)
        if windows is None:
            count = len(self._noise) - width + 1
            windows = np.lib.stride_tricks.as_strided(
                self._noise, shape=(count, width), strides=(WORD, WORD), writeable=False
            )
            self._windows[width] = windows
        seeds = _mix(np.asarray(ids, dtype=np.uint64) ^ salt)
        rows: Words = windows[seeds % np.uint64(len(windows))] ^ seeds[:, None]
        return rows


@attrs.frozen(kw_only=True)
class RefPages:
    """One ref (a K or V half, or one Mamba state tensor) as the demo reads and writes it."""

    group: int
    """Its group."""
    ref: int
    """Its index among the group's refs (the executor's layout order)."""
    slotted: bool
    """True for attention pages (one slot of `width` words per token); False for a Mamba
    state (one `width`-word state per page)."""
    width: int
    """Words per token slot (attention) or per state (Mamba)."""
    page_bytes: int
    """Bytes of the page the executor copies."""
    words: Any = attrs.field(eq=False, repr=False)
    """The word view: `(num_blocks, block_size, width)` or `(num_blocks, width)`."""


class _NumpyBackend:
    """Host arrays: what the cpu executor copies."""

    def zeros(self, shape: tuple[int, ...], itemsize: int) -> Any:
        return np.zeros(shape, dtype=np.dtype(f"u{itemsize}"))

    def kv_words(self, tensor: Any) -> Any:
        return tensor.view(np.uint64).reshape(*tensor.shape[:3], -1)

    def part(self, buffer: Any, offset: int, shape: tuple[int, ...], itemsize: int) -> Any:
        strides = [itemsize]
        for size in reversed(shape[1:]):
            strides.insert(0, strides[0] * size)
        return np.ndarray(
            shape=(buffer.shape[0], *shape),
            dtype=np.dtype(f"u{itemsize}"),
            buffer=buffer,
            offset=offset,
            strides=(buffer.strides[0], *strides),
        )

    def part_words(self, buffer: Any, offset: int, nbytes: int) -> Any:
        return np.ndarray(
            shape=(buffer.shape[0], nbytes // WORD),
            dtype=np.uint64,
            buffer=buffer,
            offset=offset,
            strides=(buffer.strides[0], WORD),
        )

    def put(self, view: Any, index: tuple[Words, ...], rows: Words) -> None:
        view[index] = rows

    def take(self, view: Any, blocks: Words) -> Words:
        taken: Words = view[blocks.astype(np.int64)]
        return taken


class _TorchBackend:
    """CUDA tensors through torch: what the torch and cupy executors copy."""

    def __init__(self, device: str) -> None:
        import torch

        if device.startswith("cuda") and not torch.cuda.is_available():
            raise InvalidInputError(
                field="executor", expected="a CUDA device for a GPU executor", got="none"
            )
        self._torch = torch
        self._device = device
        self._dtypes = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}

    def zeros(self, shape: tuple[int, ...], itemsize: int) -> Any:
        return self._torch.zeros(shape, dtype=self._dtypes[itemsize], device=self._device)

    def kv_words(self, tensor: Any) -> Any:
        return tensor.view(self._torch.int64).reshape(*tensor.shape[:3], -1)

    def part(self, buffer: Any, offset: int, shape: tuple[int, ...], itemsize: int) -> Any:
        nbytes = math.prod(shape) * itemsize
        flat = buffer[:, offset : offset + nbytes].view(self._dtypes[itemsize])
        return flat.unflatten(1, shape)

    def part_words(self, buffer: Any, offset: int, nbytes: int) -> Any:
        return buffer[:, offset : offset + nbytes].view(self._torch.int64)

    def put(self, view: Any, index: tuple[Words, ...], rows: Words) -> None:
        torch = self._torch
        where = tuple(torch.from_numpy(i.astype(np.int64)).to(self._device) for i in index)
        view[where] = torch.from_numpy(rows.view(np.int64)).to(self._device)

    def take(self, view: Any, blocks: Words) -> Words:
        index = self._torch.from_numpy(blocks.astype(np.int64)).to(self._device)
        taken: Words = view[index].cpu().numpy().view(np.uint64)
        return taken


class DemoKVCache:
    """The model's KV tensors, one set per group, in a layout an engine would use:
    FlashAttention's K/V split per attention layer; per Mamba layer one padded page buffer seen
    through its conv and SSM state tensors.

    With a `torch_device` (e.g. `cuda`) they are torch tensors there; otherwise numpy arrays.
    """

    def __init__(self, profile: ModelProfile, *, torch_device: str | None = None) -> None:
        backend: _NumpyBackend | _TorchBackend = (
            _NumpyBackend() if torch_device is None else _TorchBackend(torch_device)
        )
        self._backend = backend
        self.num_blocks = profile.gpu_blocks + 1  # block 0 is the engine's null block
        self.kv_tensors: list[list[KVTensor]] = []
        self.refs: list[list[RefPages]] = []
        for g, group in enumerate(profile.groups):
            tensors, refs = self._group(profile, g, group)
            self.kv_tensors.append(tensors)
            self.refs.append(refs)

    def _group(
        self, profile: ModelProfile, g: int, group: GroupProfile
    ) -> tuple[list[KVTensor], list[RefPages]]:
        backend, nb, t = self._backend, self.num_blocks, profile.block_size
        tensors: list[KVTensor] = []
        refs: list[RefPages] = []
        for _ in range(group.layers):
            if group.is_attention:
                kv = backend.zeros((2, nb, t, group.kv_heads, group.head_dim), 2)
                tensors.append(KVTensor(tensor=kv, layout=TensorLayout.KV_SPLIT))
                words = backend.kv_words(kv)
                for half in range(2):
                    refs.append(
                        RefPages(
                            group=g,
                            ref=len(refs),
                            slotted=True,
                            width=group.token_bytes() // WORD,
                            page_bytes=profile.attention_page_bytes(group),
                            words=words[half],
                        )
                    )
                continue
            buffer = backend.zeros((nb, profile.mamba_page_stride()), 1)
            offset = 0
            for part in group.states:
                view = backend.part(buffer, offset, part.shape, part.itemsize)
                tensors.append(KVTensor(tensor=view, layout=TensorLayout.MAMBA))
                refs.append(
                    RefPages(
                        group=g,
                        ref=len(refs),
                        slotted=False,
                        width=part.nbytes // WORD,
                        page_bytes=part.nbytes,
                        words=backend.part_words(buffer, offset, part.nbytes),
                    )
                )
                offset += part.nbytes
        return tensors, refs

    def max_width(self) -> int:
        """Return the widest row of words any ref writes at once."""
        return max(ref.width for refs in self.refs for ref in refs)

    def write_slots(self, ref: RefPages, blocks: Words, slots: Words, rows: Words) -> None:
        """Write one token slot per entry: `rows[k]` into slot `slots[k]` of block `blocks[k]`."""
        self._backend.put(ref.words, (blocks, slots), rows)

    def write_states(self, ref: RefPages, blocks: Words, rows: Words) -> None:
        """Write a whole Mamba state per entry: `rows[k]` into block `blocks[k]`."""
        self._backend.put(ref.words, (blocks,), rows)

    def poison(self, ref: RefPages, blocks: Words) -> None:
        """Fill `ref`'s pages of `blocks` with a poison word, so that a page a load fails to
        write can never pass for a right one left over from an earlier owner."""
        shape = (len(blocks), *ref.words.shape[1:])
        self._backend.put(ref.words, (blocks,), np.full(shape, POISON, dtype=np.uint64))

    def read_pages(self, ref: RefPages, blocks: Words) -> Words:
        """Return the words of `ref`'s pages of `blocks` (a host copy)."""
        return self._backend.take(ref.words, blocks)


def expected_pages(
    pattern: PagePattern, ref: RefPages, positions: npt.ArrayLike, ids: Words, block_size: int
) -> Words:
    """Return what `ref`'s pages at block `positions` of a request must hold once complete:
    one slot per token (attention) or the state after the block's last token (Mamba).

    `ids` are the request's token identities (at least up to the last position's end).
    """
    salt = PagePattern.salt(ref.group, ref.ref, pattern.rank)
    positions = np.asarray(positions, dtype=np.int64)
    if ref.slotted:
        tokens = (positions[:, None] * block_size + np.arange(block_size)).ravel()
        rows = pattern.words(ids[tokens], salt, ref.width)
        return rows.reshape(len(positions), block_size, ref.width)
    return pattern.words(ids[(positions + 1) * block_size - 1], salt, ref.width)


@attrs.define
class ForwardBatch:
    """The page writes of one step's "forward pass", gathered across requests per group."""

    slot_blocks: list[list[Words]]
    """Per group, arrays of the block id of each write (a token slot, or a Mamba state)."""
    slot_index: list[list[Words]]
    """Per attention group, the slot of each written token inside its block (Mamba: empty)."""
    slot_ids: list[list[Words]]
    """Per group, the identity each write derives from (the token's, or the state's last
    token's)."""

    @classmethod
    def empty(cls, num_groups: int) -> ForwardBatch:
        """Return a batch with nothing written."""
        return cls(
            slot_blocks=[[] for _ in range(num_groups)],
            slot_index=[[] for _ in range(num_groups)],
            slot_ids=[[] for _ in range(num_groups)],
        )

    def add_tokens(
        self, group: int, table: Words, ids: Words, *, start: int, stop: int, block_size: int
    ) -> None:
        """Record that tokens `[start, stop)` were computed (each writes its own slot)."""
        tokens = np.arange(start, stop, dtype=np.uint64)
        self.slot_blocks[group].append(table[tokens // np.uint64(block_size)])
        self.slot_index[group].append(tokens % np.uint64(block_size))
        self.slot_ids[group].append(ids[start:stop])

    def add_states(
        self, group: int, table: Words, ids: Words, *, start: int, stop: int, block_size: int
    ) -> None:
        """Record a Mamba step over `[start, stop)`: every block it touched gets the state after
        its last computed token (the state at a block's end stays in that block)."""
        first, last = start // block_size, (stop - 1) // block_size
        positions = np.arange(first, last + 1)
        ends = np.minimum((positions + 1) * block_size, stop) - 1
        self.slot_blocks[group].append(table[positions])
        self.slot_ids[group].append(ids[ends])

    def write(self, cache: DemoKVCache, pattern: PagePattern) -> int:
        """Write every recorded page slot or state into `cache`; return the bytes written."""
        written = 0
        for g, refs in enumerate(cache.refs):
            if not self.slot_blocks[g]:
                continue
            blocks = np.concatenate(self.slot_blocks[g]).astype(np.uint64)
            ids = np.concatenate(self.slot_ids[g])
            slots = (
                np.concatenate(self.slot_index[g]).astype(np.uint64) if self.slot_index[g] else None
            )
            for ref in refs:
                salt = PagePattern.salt(ref.group, ref.ref, pattern.rank)
                rows = pattern.words(ids, salt, ref.width)
                if ref.slotted and slots is not None:
                    cache.write_slots(ref, blocks, slots, rows)
                else:
                    cache.write_states(ref, blocks, rows)
                written += rows.nbytes
        return written
