"""Every refusal of the session changes nothing: one case per place a session call can refuse,
each checked against a snapshot of everything observable (requests, jobs, job ids, the
catalog's entries, counters and free rows, the CPU tier's and the GPU tensors' bytes)."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
from offload_rig import chain
from session_world import PROMPT, World, make_world

from kvferry.adapters.session import RunningRequest
from kvferry.core.blocks import GroupBlocks
from kvferry.core.bound import JobResult
from kvferry.core.errors import KvferryError
from kvferry.core.keys import KeyStatus

FRESH = chain(4, family=2, shared=0)
"""A 16-token prompt the tier has never seen: 3 chunks, which the full tier makes room for by
evicting 3 of its 5 ready keys."""
SAME = (FRESH[0],) * 8
"""Hashes that repeat: a buggy engine's list (chained hashes never do)."""


def fresh_blocks() -> list[GroupBlocks]:
    return [GroupBlocks.of(range(20, 28)), GroupBlocks.of(range(20, 24))]


def new_running(rid: str, hashes: tuple[bytes, ...], **changes: object) -> RunningRequest:
    """Return a new request's first step: every token of its `hashes` is computed now."""
    fields: dict[str, object] = {
        "request_id": rid,
        "blocks": fresh_blocks(),
        "num_computed_tokens": 0,
        "num_scheduled_tokens": 4 * len(hashes),
        "num_tokens": 4 * len(hashes),
        "block_hashes": hashes,
    }
    fields.update(changes)
    return RunningRequest(**fields)  # type: ignore[arg-type]


def ok(job_id: int) -> JobResult:
    return JobResult(job_id=job_id, success=True, nbytes=0, seconds=0.0)


def nothing(w: World) -> None:
    return None


def finish_r2(w: World) -> None:
    w.session.finish("r2")  # its store is in flight: it is finished, not yet forgotten


def lookup_r5_then_drop_its_keys(w: World) -> None:
    found = w.session.lookup("r5", block_hashes=PROMPT, num_tokens=35, num_computed_tokens=0)
    assert found.tokens > 0
    w.catalog.discard(list(w.session.request_state("r5").keys[0]))  # type: ignore[union-attr]


@attrs.frozen
class Refusal:
    name: str
    call: Callable[[World], object]
    setup: Callable[[World], None] = nothing


REFUSALS = [
    # -- lookup ------------------------------------------------------------------------------
    Refusal(
        "lookup: request id not a string",
        lambda w: w.session.lookup(7, block_hashes=(), num_tokens=0, num_computed_tokens=0),
    ),
    Refusal(
        "lookup: hashes that are not bytes, new request",
        lambda w: w.session.lookup(
            "r7", block_hashes=["ab"] * 8, num_tokens=32, num_computed_tokens=0
        ),
    ),
    Refusal(
        "lookup: a finished request whose store is in flight",
        lambda w: w.session.lookup("r2", block_hashes=PROMPT, num_tokens=48, num_computed_tokens=0),
        finish_r2,
    ),
    Refusal(
        "lookup: a hash list shorter than before",
        lambda w: w.session.lookup(
            "r2", block_hashes=PROMPT[:3], num_tokens=12, num_computed_tokens=0
        ),
    ),
    Refusal(
        "lookup: a live request id reused for another prompt",
        lambda w: w.session.lookup(
            "r2", block_hashes=chain(12, 1, 0), num_tokens=48, num_computed_tokens=0
        ),
    ),
    Refusal(
        "lookup: hashes as a set, as many as before",
        lambda w: w.session.lookup(
            "r2", block_hashes=set(chain(12, 0, 0)), num_tokens=48, num_computed_tokens=0
        ),
    ),
    Refusal(
        "lookup: computed beyond the tokens, new hashes",
        lambda w: w.session.lookup(
            "r3", block_hashes=chain(8, 1, 0), num_tokens=32, num_computed_tokens=40
        ),
    ),
    # -- start_load ----------------------------------------------------------------------------
    Refusal(
        "start_load: unknown request",
        lambda w: w.session.start_load("r8", w.blocks, num_computed_tokens=0, hit_tokens=16),
    ),
    Refusal(
        "start_load: finished request",
        lambda w: w.session.start_load("r2", w.blocks, num_computed_tokens=0, hit_tokens=16),
        finish_r2,
    ),
    Refusal(
        "start_load: one block list short",
        lambda w: w.session.start_load("r3", w.blocks[:1], num_computed_tokens=0, hit_tokens=8),
    ),
    Refusal(
        "start_load: keys gone since the lookup",
        lambda w: w.session.start_load("r5", fresh_blocks(), num_computed_tokens=0, hit_tokens=16),
        lookup_r5_then_drop_its_keys,
    ),
    # -- start_stores --------------------------------------------------------------------------
    Refusal("start_stores: not a list", lambda w: w.session.start_stores(5)),  # type: ignore[arg-type]
    Refusal("start_stores: not RunningRequests", lambda w: w.session.start_stores(["r2"])),  # type: ignore[list-item]
    Refusal(
        "start_stores: hashes that repeat (all equal)",
        lambda w: w.session.start_stores([new_running("r6", SAME)]),
    ),
    Refusal(
        "start_stores: hashes that repeat, after a request that reserved rows",
        lambda w: w.session.start_stores([new_running("r7", FRESH), new_running("r6", SAME)]),
    ),
    Refusal(
        "start_stores: too few blocks, after a request that reserved rows",
        lambda w: w.session.start_stores(
            [
                new_running("r7", FRESH),
                new_running(
                    "r6", chain(8, 3, 0), blocks=[GroupBlocks.of([1]), GroupBlocks.of([2])]
                ),
            ]
        ),
    ),
    Refusal(
        "start_stores: negative tokens, after a request that reserved rows",
        lambda w: w.session.start_stores(
            [new_running("r7", FRESH), new_running("r6", chain(8, 3, 0), num_scheduled_tokens=-1)]
        ),
    ),
    Refusal(
        "start_stores: a finished request, after a request that reserved rows",
        lambda w: w.session.start_stores(
            [
                new_running("r7", FRESH),
                new_running(
                    "r2",
                    chain(12, 0, 0),
                    num_tokens=48,
                    blocks=[GroupBlocks.of(range(1, 13)), GroupBlocks.of(range(20, 26))],
                ),
            ]
        ),
        finish_r2,
    ),
    Refusal(
        "start_stores: a live request id reused for another prompt",
        lambda w: w.session.start_stores(
            [
                new_running("r7", FRESH),
                new_running(
                    "r2",
                    chain(12, 1, 0),
                    num_tokens=48,
                    blocks=[GroupBlocks.of(range(1, 13)), GroupBlocks.of(range(20, 26))],
                ),
            ]
        ),
    ),
    # -- report --------------------------------------------------------------------------------
    Refusal("report: worker as a bool", lambda w: w.session.report(True, [])),  # type: ignore[arg-type]
    Refusal("report: worker out of range", lambda w: w.session.report(1, [])),
    Refusal("report: results not a list", lambda w: w.session.report(0, 5)),  # type: ignore[arg-type]
    Refusal("report: not JobResults", lambda w: w.session.report(0, [w.store_job.job_id])),  # type: ignore[list-item]
    Refusal("report: job id 0", lambda w: w.session.report(0, [ok(w.store_job.job_id), ok(0)])),
    Refusal(
        "report: a job never issued",
        lambda w: w.session.report(0, [ok(w.store_job.job_id), ok(999)]),
    ),
    Refusal(
        "report: a job twice in one call",
        lambda w: w.session.report(0, [ok(w.store_job.job_id), ok(w.store_job.job_id)]),
    ),
    Refusal(
        "report: a job already reported",
        lambda w: w.session.report(0, [ok(w.load_job.job_id)]),
    ),
    # -- preempt -------------------------------------------------------------------------------
    Refusal("preempt: unknown request", lambda w: w.session.preempt("r8")),
    Refusal("preempt: finished request", lambda w: w.session.preempt("r2"), finish_r2),
]


@pytest.mark.parametrize("refusal", REFUSALS, ids=[r.name for r in REFUSALS])
def test_a_refused_session_call_raises_a_typed_error_and_changes_nothing(refusal: Refusal) -> None:
    world = make_world()
    refusal.setup(world)
    before = world.snapshot()
    with pytest.raises(KvferryError):
        refusal.call(world)
    assert world.snapshot() == before


def test_a_request_whose_hashes_repeat_leaves_no_row_writing() -> None:
    world = make_world()
    with pytest.raises(KvferryError):
        world.session.start_stores([new_running("r6", SAME)])
    found = world.session.lookup("r9", block_hashes=SAME, num_tokens=32, num_computed_tokens=0)
    assert not found.retry
    statuses = world.catalog.statuses(
        [key for keys in world.session.request_state("r9").keys for key in keys]
    )  # type: ignore[union-attr]
    assert KeyStatus.PENDING not in statuses


def test_the_first_request_of_those_steps_reserves_rows_when_alone() -> None:
    world = make_world()
    before = world.catalog.counters()
    step = world.session.start_stores([new_running("r7", FRESH)])
    keys = step.jobs[0].plan.keys
    assert len(keys) == 3
    free = [c - u for c, u in zip(before.group_capacity_rows, before.group_rows_used, strict=True)]
    # each group evicts what its own rows lack
    short = sum(max(0, sum(k.group == g for k in keys) - room) for g, room in enumerate(free))
    assert world.catalog.counters().evictions == before.evictions + short
    assert world.catalog.statuses(keys) == [KeyStatus.PENDING] * 3


def test_a_refused_store_step_burns_no_job_id() -> None:
    world = make_world()
    with pytest.raises(KvferryError):
        world.session.start_stores([new_running("r7", FRESH), new_running("r6", SAME)])
    (job,) = world.session.start_stores([new_running("r7", FRESH)]).jobs
    assert job.job_id == world.load_job.job_id + 2  # the load, the store in flight, this one
