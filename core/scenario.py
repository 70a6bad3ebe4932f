"""Planner scenarios: a request, a CPU tier and a few planning steps, written as JSON.

Pure: a scenario document in, a results document out; golden tests and `kvferry plan` do the I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvferry.core.blocks import GroupBlocks
from kvferry.core.codec import (
    SCHEMA_VERSION,
    blocks_from_list,
    check_schema_version,
    config_from_dict,
    plan_to_dict,
)
from kvferry.core.config import OffloadConfig
from kvferry.core.errors import InvalidInputError
from kvferry.core.keys import KeyStatus, OffloadKey
from kvferry.core.load import plan_load
from kvferry.core.lookup import LookupResult, lookup
from kvferry.core.scenario_schema import check_scenario
from kvferry.core.state import RequestState, new_request_state
from kvferry.core.store import plan_store


def counting_hashes(count: int) -> tuple[bytes, ...]:
    """Return `count` readable stand-in hashes: hash block `i` gets `i + 1` as 4 bytes."""
    return tuple((i + 1).to_bytes(4, "big") for i in range(count))


@attrs.frozen(kw_only=True)
class ScenarioTier:
    """A fixed CPU tier for scenarios: ready and pending keys, and the free rows (None: any)."""

    ready: frozenset[OffloadKey]
    pending: frozenset[OffloadKey]
    free_rows: int | None

    def statuses(self, keys: Sequence[OffloadKey]) -> list[KeyStatus]:
        """Return HIT, PENDING or MISS per key."""
        return [
            KeyStatus.HIT
            if key in self.ready
            else KeyStatus.PENDING
            if key in self.pending
            else KeyStatus.MISS
            for key in keys
        ]

    def can_reserve(self, keys: Sequence[OffloadKey]) -> bool:
        """Return True when the keys the tier lacks fit in its free rows."""
        missing = sum(1 for key in keys if key not in self.ready and key not in self.pending)
        return self.free_rows is None or missing <= self.free_rows


def _tier_keys(
    state: RequestState, chunks_by_group: Mapping[str, Any], field: str
) -> set[OffloadKey]:
    keys: set[OffloadKey] = set()
    for group_text, chunks in chunks_by_group.items():
        group = int(group_text)
        if not 0 <= group < len(state.keys):
            raise InvalidInputError(field=field, expected="existing group indices", got=group_text)
        for chunk in chunks:
            if not 0 <= chunk < len(state.keys[group]):
                raise InvalidInputError(
                    group=group,
                    field=field,
                    expected=f"chunk indices in [0, {len(state.keys[group])})",
                    got=chunk,
                )
            keys.add(state.keys[group][chunk])
    return keys


def _blocks(config: OffloadConfig, step: Mapping[str, Any]) -> list[GroupBlocks]:
    lists = step.get("blocks")
    if not isinstance(lists, list) or len(lists) != config.num_groups:
        raise InvalidInputError(
            field="steps[].blocks", expected=f"{config.num_groups} block lists", got=lists
        )
    return [blocks_from_list(entries) for entries in lists]


def run_scenario(document: Mapping[str, Any]) -> dict[str, Any]:
    """Return the results document of a scenario: one entry per step, plans included; raise
    InvalidInputError naming the field's path for a malformed one (`check_scenario`)."""
    check_scenario(document)
    check_schema_version(document)
    config = config_from_dict(document["config"])
    request = document["request"]
    num_tokens = int(request["num_tokens"])
    hashes = request.get("block_hashes")
    block_hashes = (
        counting_hashes(num_tokens // config.hash_block_size)
        if hashes is None
        else tuple(bytes.fromhex(h) for h in hashes)
    )
    state = new_request_state(
        config,
        str(request.get("request_id", "req-0")),
        num_prompt_tokens=int(request.get("num_prompt_tokens", num_tokens)),
        block_hashes=block_hashes,
        store_loaded=bool(request.get("store_loaded", False)),
    )
    tier_doc = document.get("tier", {})
    tier = ScenarioTier(
        ready=frozenset(_tier_keys(state, tier_doc.get("ready", {}), "tier.ready")),
        pending=frozenset(_tier_keys(state, tier_doc.get("pending", {}), "tier.pending")),
        free_rows=tier_doc.get("free_rows"),
    )
    results: list[dict[str, Any]] = []
    last_lookup: LookupResult | None = None
    for step in document["steps"]:
        op = step.get("op")
        if op == "lookup":
            last_lookup = lookup(
                config,
                state,
                num_tokens=num_tokens,
                num_computed_tokens=int(step["num_computed_tokens"]),
                tier=tier,
            )
            results.append(
                {"op": "lookup", "tokens": last_lookup.tokens, "retry": last_lookup.retry}
            )
        elif op == "load":
            hit = step.get("hit_tokens", last_lookup.tokens if last_lookup else None)
            if hit is None:
                raise InvalidInputError(
                    field="steps[].hit_tokens", expected="a number or an earlier lookup", got=None
                )
            plan, state = plan_load(
                config,
                state,
                _blocks(config, step),
                num_computed_tokens=int(step["num_computed_tokens"]),
                hit_tokens=int(hit),
            )
            results.append(
                {"op": "load", "plan": plan_to_dict(plan), "store_cursor": list(state.store_cursor)}
            )
        elif op == "store":
            decision = plan_store(
                config,
                state,
                _blocks(config, step),
                num_computed_tokens=int(step["num_computed_tokens"]),
                num_scheduled_tokens=int(step["num_scheduled_tokens"]),
                num_tokens=int(step.get("num_tokens", num_tokens)),
                tier=tier,
            )
            state = decision.state
            results.append(
                {
                    "op": "store",
                    "outcome": decision.outcome.value,
                    "plan": None if decision.plan is None else plan_to_dict(decision.plan),
                    "store_cursor": list(state.store_cursor),
                }
            )
        else:
            raise InvalidInputError(
                field="steps[].op", expected="'lookup', 'load' or 'store'", got=op
            )
    return {
        "schema_version": SCHEMA_VERSION,
        "description": document.get("description", ""),
        "steps": results,
    }
