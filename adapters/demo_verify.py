"""Verification of every page the demo loads from the CPU tier, against what must be there.

Reads pages and compares; it never writes a page, and one wrong byte is an error, never a warning.
"""

from __future__ import annotations

import attrs
import numpy as np

from kvferry.adapters.demo_pages import DemoKVCache, PagePattern, Words, expected_pages
from kvferry.core.errors import KvferryError
from kvferry.core.plan import TransferPlan


class VerificationFailedError(KvferryError):
    """A page loaded from the CPU tier does not hold the bytes its prefix must give."""

    def __init__(
        self,
        *,
        request: str,
        group: int,
        ref: int,
        block_id: int,
        position: int,
        word: int,
        rank: int | None = None,
    ) -> None:
        self.request = request
        self.group = group
        self.ref = ref
        self.block_id = block_id
        self.position = position
        self.word = word
        self.byte_offset = word * 8
        self.rank = rank
        where = "" if rank is None else f"tensor-parallel rank {rank}, "
        super().__init__(
            f"{where}request {request!r}, group {group}, ref {ref}: GPU block {block_id} (block "
            f"{position} of the request) differs from its expected bytes at byte offset "
            f"{self.byte_offset} (of the 8-byte word there)"
        )


@attrs.define
class PageVerifier:
    """Checks loaded pages; counts the pages it checked."""

    cache: DemoKVCache
    """The KV tensors loads write into."""
    pattern: PagePattern
    """What pages must hold."""
    block_size: int
    """Tokens per GPU block."""
    pages_verified: int = 0
    """Pages (one ref of one block) checked so far, all equal to what they must hold."""

    def verify_load(self, plan: TransferPlan, ids: Words) -> int:
        """Check every destination page of a completed load `plan` against the request's token
        identities `ids`; return the pages checked. Raise VerificationFailedError naming the
        request, group, ref, block and byte at the first difference."""
        checked = 0
        for g, refs in enumerate(self.cache.refs):
            count = plan.group_sizes[g]
            if not count:
                continue
            blocks = np.asarray(plan.gpu_ids_of(g), dtype=np.uint64)
            positions = plan.block_indices[g] + np.arange(count)
            for ref in refs:
                actual = self.cache.read_pages(ref, blocks)
                expected = expected_pages(self.pattern, ref, positions, ids, self.block_size)
                wrong = (actual != expected).reshape(count, -1)
                if wrong.any():
                    page, word = (int(i) for i in np.argwhere(wrong)[0])
                    raise VerificationFailedError(
                        request=plan.request_id,
                        group=g,
                        ref=ref.ref,
                        block_id=int(blocks[page]),
                        position=int(positions[page]),
                        word=word,
                    )
                checked += count
        self.pages_verified += checked
        return checked
