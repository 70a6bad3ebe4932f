"""OffloadSession.store_candidates: the running requests `start_stores` must be given.

An engine that passes only the candidates gets the same store jobs, step after step, as one
that passes every running request; a block table given as a function is read only when due.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvferry.adapters.session import OffloadSession, RunningRequest
from kvferry.core.blocks import GroupBlocks
from kvferry.core.catalog import Catalog, CatalogConfig
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig


def _config(blocks_per_chunk: int, store_decoded_tokens: bool) -> OffloadConfig:
    return OffloadConfig(
        hash_block_size=4,
        blocks_per_chunk=blocks_per_chunk,
        groups=(
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=4),
            GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=4, sliding_window=8),
            GroupSpec(kind=GroupKind.MAMBA, block_size=4),
        ),
        store_decoded_tokens=store_decoded_tokens,
    )


def _running(rid: int, prompt: int, step: int, hashes: list[bytes]) -> RunningRequest:
    """Request `rid` at decode step `step` (its prompt computed at step 0)."""
    computed = 0 if step == 0 else prompt + step - 1
    scheduled = prompt if step == 0 else 1
    tokens = computed + scheduled
    return RunningRequest(
        request_id=f"r{rid}",
        blocks=[GroupBlocks.of(np.arange(1, 40) + 100 * rid) for _ in range(3)],
        num_computed_tokens=computed,
        num_scheduled_tokens=scheduled,
        num_tokens=tokens,
        block_hashes=hashes[: tokens // 4],
        num_prompt_tokens=prompt,
    )


def _jobs(step: object) -> list[tuple[object, list[int]]]:
    return [(job.plan, job.cpu_rows.tolist()) for job in step.jobs]  # type: ignore[attr-defined]


@pytest.mark.parametrize("with_num_tokens", [True, False])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
@pytest.mark.parametrize("store_decoded_tokens", [True, False])
def test_passing_only_the_candidates_gives_the_same_store_jobs_every_step(
    blocks_per_chunk: int, store_decoded_tokens: bool, with_num_tokens: bool
) -> None:
    config = _config(blocks_per_chunk, store_decoded_tokens)
    every = OffloadSession(config, Catalog(CatalogConfig(capacity_rows=400)))
    picked = OffloadSession(config, Catalog(CatalogConfig(capacity_rows=400)))
    prompts = [9, 13, 16, 22]
    hashes = [[bytes([r, i]) for i in range(40)] for r in range(len(prompts))]
    stored = translated = 0
    for step in range(30):
        running = [_running(r, p, step, hashes[r]) for r, p in enumerate(prompts)]
        candidates = picked.store_candidates(
            [q.request_id for q in running],
            num_computed_tokens=[q.num_computed_tokens for q in running],
            num_scheduled_tokens=[q.num_scheduled_tokens for q in running],
            num_tokens=[q.num_tokens for q in running] if with_num_tokens else None,
        )
        expected = _jobs(every.start_stores(running))
        assert _jobs(picked.start_stores([running[i] for i in candidates])) == expected
        stored += len(expected)
        translated += len(candidates)
    assert stored > len(prompts) if store_decoded_tokens else stored == len(prompts)
    assert translated < 30 * len(prompts) // 2  # most steps complete no chunk


def test_a_request_the_session_has_not_seen_is_always_a_candidate() -> None:
    session = OffloadSession(_config(1, True), Catalog(CatalogConfig(capacity_rows=8)))
    assert session.store_candidates(
        ["new"], num_computed_tokens=[0], num_scheduled_tokens=[1], num_tokens=[1]
    ) == [0]


def test_a_block_table_given_as_a_function_is_read_only_when_a_store_is_due() -> None:
    config = _config(1, True)
    session = OffloadSession(config, Catalog(CatalogConfig(capacity_rows=64)))
    hashes = [bytes([i]) for i in range(10)]
    reads: list[tuple[int, tuple[int, ...]]] = []

    def table(step: int) -> RunningRequest:
        def blocks(starts: tuple[int, ...]) -> list[GroupBlocks]:
            reads.append((step, starts))
            return [GroupBlocks.of(np.arange(1, 12)) for _ in range(3)]

        tokens = 8 + step
        return RunningRequest(
            request_id="r",
            blocks=blocks,
            num_computed_tokens=0 if step == 0 else tokens - 1,
            num_scheduled_tokens=8 if step == 0 else 1,
            num_tokens=tokens,
            block_hashes=hashes[: tokens // 4],
            num_prompt_tokens=8,
        )

    for step in range(6):
        session.start_stores([table(step)])
    assert [step for step, _ in reads] == [0, 4]  # the prompt's chunks, then token 12's


def test_a_block_table_given_as_a_function_is_asked_from_each_groups_store_cursor() -> None:
    session = OffloadSession(_config(2, True), Catalog(CatalogConfig(capacity_rows=64)))
    hashes = [bytes([i]) for i in range(10)]
    asked: list[tuple[int, ...]] = []

    def blocks(starts: tuple[int, ...]) -> list[GroupBlocks]:
        asked.append(starts)
        return [GroupBlocks.of(np.arange(1, 12)) for _ in range(3)]

    for computed, scheduled in ((0, 8), (8, 8)):
        session.start_stores(
            [
                RunningRequest(
                    request_id="r",
                    blocks=blocks,
                    num_computed_tokens=computed,
                    num_scheduled_tokens=scheduled,
                    num_tokens=computed + scheduled,
                    block_hashes=hashes[: (computed + scheduled) // 4],
                    num_prompt_tokens=16,
                )
            ]
        )
    # Chunks of 2 blocks: the first step stores chunk 0, so the second reads from block 2.
    assert asked == [(0, 0, 0), (2, 2, 2)]


def test_a_step_without_running_requests_has_no_candidates() -> None:
    session = OffloadSession(_config(1, True), Catalog(CatalogConfig(capacity_rows=64)))
    assert (
        session.store_candidates([], num_computed_tokens=[], num_scheduled_tokens=[], num_tokens=[])
        == []
    )


def test_without_num_tokens_a_request_scheduled_past_its_tokens_is_listed_and_stores_nothing() -> (
    None
):
    session = OffloadSession(_config(1, True), Catalog(CatalogConfig(capacity_rows=64)))
    hashes = [bytes([i]) for i in range(10)]
    prompt = _running(0, 8, 0, hashes)
    session.start_stores([prompt])
    # Four tokens scheduled (one sampled, three drafts) after 8 computed: 9 tokens exist, so
    # the chunk ending at token 12 is not complete.
    counts = {"num_computed_tokens": [8], "num_scheduled_tokens": [4]}
    assert session.store_candidates(["r0"], **counts, num_tokens=[9]) == []
    assert session.store_candidates(["r0"], **counts) == [0]
    drafts = RunningRequest(
        request_id="r0",
        blocks=prompt.blocks,
        num_computed_tokens=8,
        num_scheduled_tokens=4,
        num_tokens=9,
        block_hashes=hashes[:2],
    )
    assert session.start_stores([drafts]).jobs == ()
