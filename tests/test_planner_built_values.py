"""Values the planner builds without re-running their checks (plans, next states, decisions)
are exactly what the public, checking constructors make of the same fields.

`plan_load` and `plan_store` skip `TransferPlan`'s validation because every invariant holds by
construction; these properties are what makes that safe to keep.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import given
from planner_strategies import LoadCase, StoreCase, load_cases, store_cases
from test_planner_properties import run_load, run_store

from kvferry.core import (
    GroupBlocks,
    GroupKind,
    GroupSpec,
    KeyChain,
    OffloadConfig,
    OffloadKey,
    PlanInvariantError,
    RequestState,
    StoreDecision,
    TransferPlan,
    extend_keys,
    new_request_state,
    plan_load,
)
from kvferry.core.checks import unchecked_evolver, unchecked_maker


def _checked(value: object) -> object:
    """Return `value` rebuilt through its class's public constructor (every check runs)."""
    cls = type(value)
    return cls(**{a.name: getattr(value, a.name) for a in attrs.fields(cls)})


def _assert_checked_alike(plan: TransferPlan) -> None:
    rebuilt = _checked(plan)
    assert rebuilt == plan
    assert plan.gpu_block_ids.dtype == np.int64
    assert not plan.gpu_block_ids.flags.writeable


@given(load_cases())
def test_a_load_plan_and_its_next_state_pass_the_public_checks(case: LoadCase) -> None:
    plan, state = run_load(case)
    _assert_checked_alike(plan)
    assert _checked(state) == state


@given(store_cases())
def test_a_store_decision_its_plan_and_its_next_state_pass_the_public_checks(
    case: StoreCase,
) -> None:
    decision = run_store(case)
    assert isinstance(decision, StoreDecision)
    assert _checked(decision) == decision
    assert _checked(decision.state) == decision.state
    if decision.plan is not None:
        _assert_checked_alike(decision.plan)


@given(store_cases())
def test_extended_keys_make_a_state_that_passes_the_public_checks(case: StoreCase) -> None:
    hashes = [(i + 1).to_bytes(4, "big") for i in range(case.num_tokens + 8)]
    state = extend_keys(case.config, case.state, hashes)
    assert isinstance(state, RequestState)
    assert _checked(state) == state


def test_a_load_into_a_repeated_block_is_still_refused() -> None:
    config = OffloadConfig(
        hash_block_size=4,
        blocks_per_chunk=1,
        groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=4),),
    )
    state = new_request_state(config, "r1", num_prompt_tokens=12, block_hashes=[b"a", b"b", b"c"])
    with pytest.raises(PlanInvariantError, match="distinct destination") as info:
        plan_load(config, state, [GroupBlocks.of([7, 9, 7])], num_computed_tokens=0, hit_tokens=12)
    error = info.value
    assert (error.request, error.group, error.field, error.got) == ("r1", 0, "gpu_block_ids", 7)


def test_a_generated_unchecked_maker_builds_what_the_checked_constructor_builds() -> None:
    make = unchecked_maker(RequestState)
    fields = {
        "request_id": "r1",
        "num_prompt_tokens": 32,
        "keys": (KeyChain([OffloadKey(0, b"\x01")]),),
        "store_cursor": (1,),
        "store_loaded": True,
    }
    assert make(**fields) == RequestState(**fields)


def test_a_generated_unchecked_maker_needs_every_field() -> None:
    make = unchecked_maker(RequestState)
    with pytest.raises(TypeError, match="store_loaded"):
        make(request_id="r1", num_prompt_tokens=32, keys=(KeyChain(),), store_cursor=(0,))


def test_a_generated_unchecked_evolver_copies_the_fields_it_is_not_given() -> None:
    evolve = unchecked_evolver(RequestState)
    state = RequestState(
        request_id="r1", num_prompt_tokens=32, keys=((OffloadKey(0, b"\x01"),),), store_cursor=(0,)
    )
    moved = evolve(state, store_cursor=(1,))
    assert moved == attrs.evolve(state, store_cursor=(1,))
    assert state.store_cursor == (0,)
