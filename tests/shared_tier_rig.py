"""Test support: rigs (session, catalog, cpu executor, page bytes derived from keys) with a
shared tier on a real server, and the loops an engine runs around it."""

from __future__ import annotations

import time
from typing import Any

from offload_rig import Rig, RigRequest, two_group_config

from kvferry.adapters.shared_tier import SharedTier, SharedTierSettings
from kvferry.adapters.valkey_tier import open_shared_tier
from kvferry.core.bound import BoundPlan

CONFIG = two_group_config()


def replica(
    url: str, *, capacity_rows: int | tuple[int, ...] = 16, **settings: Any
) -> tuple[Rig, SharedTier]:
    """Return a rig (one engine) with a shared tier at `url` below its CPU tier."""
    rig = Rig(CONFIG, capacity_rows=capacity_rows, num_blocks=64)
    values: dict[str, Any] = {"timeout_s": 1.0, "retry_after_s": 0.2, "absent_ttl_s": 0.05}
    values.update(settings)
    tier = open_shared_tier(
        rig.session, rig.executor.inner, SharedTierSettings(url=url, model="rig", **values)
    )
    return rig, tier


def compute_and_store(rig: Rig, tier: SharedTier, rid: str, hashes: tuple[bytes, ...]) -> None:
    """Serve `rid` from scratch: compute every token, store it, finish, and flush the tier."""
    request = rig.arrive(rid, hashes)
    admit(rig, tier, request)
    rig.store_step({rid: request.num_tokens})
    rig.deliver()
    rig.finish(rid)
    tier.flush(5.0)


def admit(
    rig: Rig, tier: SharedTier, request: RigRequest, limit_s: float = 5.0
) -> BoundPlan | None:
    """Look `request` up each step (polling the tier between) until it is admitted; return
    its load job (delivered and its pages verified), or None when it loads nothing."""
    stop = time.monotonic() + limit_s
    while time.monotonic() < stop:
        tier.poll()
        job = rig.admit(request)
        if request.phase != "waiting":
            if job is not None:
                rig.deliver()
                tier.count_loaded(job.plan.keys)
            return job
        tier.wait(0.01)
    raise AssertionError(f"{request.rid} was told to retry for {limit_s} s")


def retries(rig: Rig, request: RigRequest) -> bool:
    """Return True when a lookup of `request` now answers retry (changing nothing else)."""
    found = rig.session.lookup(
        request.rid,
        block_hashes=rig.hashes_now(request),
        num_tokens=request.num_tokens,
        num_computed_tokens=0,
    )
    return found.retry
