"""A request id the engine reuses for another prompt (or whose hash list it rewrites in place)
is refused, naming the request: the session never stores one prompt's pages under another's
keys, so no later request can load the wrong bytes."""

from __future__ import annotations

import pytest
from offload_rig import Rig, chain, two_group_config

from kvferry.adapters.session import OffloadSession, RunningRequest
from kvferry.core.blocks import GroupBlocks
from kvferry.core.bound import JobResult
from kvferry.core.catalog import Catalog, CatalogConfig
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.errors import InvalidInputError

CONFIG = OffloadConfig(
    hash_block_size=4,
    blocks_per_chunk=2,
    groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=4),),
)
PROMPT_A = chain(8, family=0, shared=0)
PROMPT_B = chain(8, family=1, shared=0)
"""Two prompts of 32 tokens (8 hash blocks, 4 chunks of 8 tokens), nothing in common."""
BLOCKS = [GroupBlocks.of(range(1, 9))]


def running(hashes: object, computed: int) -> RunningRequest:
    return RunningRequest(
        request_id="r1",
        blocks=BLOCKS,
        num_computed_tokens=computed,
        num_scheduled_tokens=16,
        num_tokens=32,
        block_hashes=hashes,  # type: ignore[arg-type]
    )


def session_with_half_of_a_stored() -> OffloadSession:
    """Return a session where r1 (prompt A) stored its first 16 tokens."""
    session = OffloadSession(CONFIG, Catalog(CatalogConfig(capacity_rows=16)))
    (job,) = session.start_stores([running(PROMPT_A, 0)]).jobs
    session.report(0, [JobResult(job_id=job.job_id, success=True, nbytes=0, seconds=0.0)])
    return session


def test_a_live_request_id_reused_for_another_prompt_of_the_same_length_is_refused() -> None:
    session = session_with_half_of_a_stored()
    with pytest.raises(InvalidInputError) as caught:
        session.start_stores([running(PROMPT_B, 16)])
    assert (caught.value.request, caught.value.field) == ("r1", "block_hashes")
    assert session.in_flight() == frozenset()


def test_a_hash_list_rewritten_in_place_is_refused() -> None:
    session = OffloadSession(CONFIG, Catalog(CatalogConfig(capacity_rows=16)))
    hashes = list(PROMPT_A)
    (job,) = session.start_stores([running(hashes, 0)]).jobs
    session.report(0, [JobResult(job_id=job.job_id, success=True, nbytes=0, seconds=0.0)])
    hashes[:] = PROMPT_B
    with pytest.raises(InvalidInputError, match=r"request 'r1'.*block_hashes"):
        session.start_stores([running(hashes, 16)])


def test_a_lookup_of_a_reused_id_with_another_prompt_is_refused() -> None:
    session = session_with_half_of_a_stored()
    with pytest.raises(InvalidInputError, match="request 'r1'"):
        session.lookup("r1", block_hashes=PROMPT_B, num_tokens=32, num_computed_tokens=0)


def test_the_same_prompt_again_is_accepted() -> None:
    session = session_with_half_of_a_stored()
    step = session.start_stores([running(list(PROMPT_A), 16)])
    assert [job.plan.request_id for job in step.jobs] == ["r1"]


def test_a_reused_id_never_serves_another_prompt_s_bytes() -> None:
    rig = Rig(two_group_config(), capacity_rows=32)
    first = rig.arrive("r1", chain(8, family=0, shared=0))
    rig.admit(first)
    rig.store_step({"r1": 16})
    rig.deliver()
    first.hashes = chain(8, family=1, shared=0)  # the engine reuses "r1" for another prompt
    with pytest.raises(InvalidInputError, match="request 'r1'"):
        rig.store_step({"r1": 16})
    rig.check_ready_rows()  # every ready row still holds its own chunk's bytes
