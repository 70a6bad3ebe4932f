"""The scenario generator (`planner_strategies`) against every documented planning rule, on
thousands of random hybrid scenarios: each generated lookup, load, store and shared-prefix
scenario is checked by every property of `test_planner_properties` that applies to it.

A fixed, CI-sized number of examples and no deadline: a property run, not a timed test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import test_planner_properties as rules
from hypothesis import HealthCheck, given, settings
from planner_strategies import (
    LoadCase,
    LookupCase,
    SharedPrefixCase,
    StoreCase,
    load_cases,
    lookup_cases,
    shared_prefix_cases,
    store_cases,
)

SCENARIOS = 2500
"""Scenarios per kind (lookup, load, store, shared prefix)."""

RUN = settings(
    max_examples=SCENARIOS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def check(properties: list[Callable[..., Any]], *case: object) -> None:
    """Run every property's body on `case` (the test without its own example generation)."""
    for prop in properties:
        prop.hypothesis.inner_test(*case)  # type: ignore[attr-defined]


@RUN
@given(lookup_cases())
def test_lookup_scenarios_keep_every_lookup_rule(case: LookupCase) -> None:
    check(
        [
            rules.test_lookup_boundary_is_valid_for_every_group,
            rules.test_lookup_finds_the_highest_valid_boundary,
            rules.test_lookup_retries_only_when_a_key_is_pending,
            rules.test_lookup_never_retries_once_pending_keys_are_hits,
            rules.test_lookup_retries_exactly_when_its_answer_needs_a_pending_key,
        ],
        case,
    )


@RUN
@given(load_cases())
def test_load_scenarios_keep_every_load_rule(case: LoadCase) -> None:
    check(
        [
            rules.test_load_keys_are_the_chunks_its_blocks_touch,
            rules.test_load_never_writes_a_gpu_cached_block,
            rules.test_load_fills_exactly_the_fresh_blocks_of_the_hit,
            rules.test_load_leaves_no_needed_token_unfilled,
            rules.test_load_reads_only_keys_the_lookup_saw_as_hits,
            rules.test_load_moves_store_cursors_past_the_hit,
            rules.test_store_after_a_load_accepts_the_blocks_the_engine_allocated,
        ],
        case,
    )


@RUN
@given(store_cases())
def test_store_scenarios_keep_every_store_rule(case: StoreCase) -> None:
    check(
        [
            rules.test_store_copies_exactly_the_blocks_of_its_keys,
            rules.test_store_plans_only_complete_chunks,
            rules.test_store_never_plans_a_chunk_with_a_null_block,
            rules.test_store_never_plans_a_key_the_tier_has,
            rules.test_store_plans_every_new_complete_real_chunk,
            rules.test_store_without_room_leaves_the_state_unchanged,
            rules.test_store_moves_each_cursor_to_the_last_complete_chunk_unless_no_room,
        ],
        case,
    )


@RUN
@given(shared_prefix_cases())
def test_shared_prefix_scenarios_lose_no_hit_to_the_chunks_not_stored(
    case: SharedPrefixCase,
) -> None:
    check([rules.test_a_stored_request_serves_every_lookup_every_chunk_of_it_would], case)
