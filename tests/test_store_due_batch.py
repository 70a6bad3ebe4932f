"""The batched due check `due_for_store`: which running requests store planning must look at.

Scenario tests for the rule and its errors; property tests that it agrees with the per-request
`store_due` and that `plan_store` finds nothing for a request it leaves out.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from planner_strategies import StoreCase, configs, hashes_for, store_cases
from test_planner_properties import run_store

from kvferry.core import (
    GroupKind,
    GroupSpec,
    InvalidInputError,
    OffloadConfig,
    RequestState,
    StoreOutcome,
    due_for_store,
    new_request_state,
    store_due,
    stored_tokens_after_step,
)

CONFIG = OffloadConfig(
    hash_block_size=4,
    blocks_per_chunk=2,
    groups=(
        GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=4),  # 8-token chunks
        GroupSpec(kind=GroupKind.MAMBA, block_size=8),  # 16-token chunks
    ),
)


def _state(request_id: str, num_tokens: int, cursor: tuple[int, int]) -> RequestState:
    hashes = [bytes([i + 1]) for i in range(num_tokens // 4)]
    state = new_request_state(CONFIG, request_id, num_prompt_tokens=16, block_hashes=hashes)
    return attrs.evolve(state, store_cursor=cursor)


def test_a_request_is_due_when_this_step_completes_a_chunk_past_its_cursor() -> None:
    states = [_state("a", 16, (1, 0)), _state("b", 16, (1, 0))]
    # a: 15 -> 16 tokens completes chunk 1 (8-token) and chunk 0 (16-token); b stays at 12.
    due = due_for_store(
        CONFIG,
        states,
        num_computed_tokens=[15, 11],
        num_scheduled_tokens=[1, 1],
        num_tokens=[16, 12],
    )
    assert due.tolist() == [0]


def test_a_request_whose_cursor_is_past_the_completed_chunks_is_not_due() -> None:
    states = [_state("a", 16, (2, 1))]  # a load already moved both cursors past token 16
    due = due_for_store(
        CONFIG, states, num_computed_tokens=[15], num_scheduled_tokens=[1], num_tokens=[16]
    )
    assert due.tolist() == []


def test_scheduled_tokens_past_the_request_count_only_up_to_its_tokens() -> None:
    states = [_state("a", 16, (1, 1))]
    due = due_for_store(
        CONFIG, states, num_computed_tokens=[12], num_scheduled_tokens=[8], num_tokens=[15]
    )
    assert due.tolist() == []


def test_without_decoded_tokens_a_chunk_past_the_prompt_is_never_due() -> None:
    config = attrs.evolve(CONFIG, store_decoded_tokens=False)
    hashes = [bytes([i + 1]) for i in range(6)]
    state = new_request_state(config, "a", num_prompt_tokens=16, block_hashes=hashes)
    state = attrs.evolve(state, store_cursor=(2, 1))  # the prompt is stored
    due = due_for_store(
        config, [state], num_computed_tokens=[23], num_scheduled_tokens=[1], num_tokens=[24]
    )
    assert due.tolist() == []


def test_no_running_requests_give_no_due_request() -> None:
    due = due_for_store(CONFIG, [], num_computed_tokens=[], num_scheduled_tokens=[], num_tokens=[])
    assert due.tolist() == []


def test_token_counts_may_be_numpy_arrays() -> None:
    states = [_state("a", 16, (0, 0))]
    tokens = np.array([16], dtype=np.int32)
    due = due_for_store(
        CONFIG, states, num_computed_tokens=tokens - 1, num_scheduled_tokens=[1], num_tokens=tokens
    )
    assert due.tolist() == [0]


def test_a_token_count_list_of_the_wrong_length_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidInputError, match=r"num_scheduled_tokens.*2 integers"):
        due_for_store(
            CONFIG,
            [_state("a", 16, (0, 0)), _state("b", 16, (0, 0))],
            num_computed_tokens=[1, 2],
            num_scheduled_tokens=[1],
            num_tokens=[3, 3],
        )


def test_a_float_token_count_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="num_tokens"):
        due_for_store(
            CONFIG,
            [_state("a", 16, (0, 0))],
            num_computed_tokens=[1],
            num_scheduled_tokens=[1],
            num_tokens=[2.0],
        )


def test_a_negative_token_count_is_refused_naming_the_request() -> None:
    with pytest.raises(InvalidInputError, match=r"request 'b'.*num_computed_tokens") as info:
        due_for_store(
            CONFIG,
            [_state("a", 16, (0, 0)), _state("b", 16, (0, 0))],
            num_computed_tokens=[1, -3],
            num_scheduled_tokens=[1, 1],
            num_tokens=[3, 3],
        )
    assert info.value.request == "b"


def test_a_state_made_for_another_configuration_is_refused() -> None:
    one_group = OffloadConfig(
        hash_block_size=4,
        blocks_per_chunk=2,
        groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=4),),
    )
    stranger = new_request_state(one_group, "x", num_prompt_tokens=8, block_hashes=[b"1", b"2"])
    with pytest.raises(InvalidInputError, match=r"request 'x'.*keys"):
        due_for_store(
            CONFIG,
            [_state("a", 16, (0, 0)), stranger],
            num_computed_tokens=[1, 1],
            num_scheduled_tokens=[1, 1],
            num_tokens=[2, 2],
        )


# -- properties ---------------------------------------------------------------------------------

_COUNTS = st.tuples(st.integers(0, 80), st.integers(0, 80), st.integers(0, 80), st.binary())


@st.composite
def batches(draw: st.DrawFn) -> tuple[OffloadConfig, list[RequestState], list[tuple[int, ...]]]:
    """Return a configuration, 0-8 requests of it with any reachable cursors, and per request
    (computed, scheduled, tokens) counts, some past the request's keys or prompt."""
    config = draw(configs())
    states, counts = [], []
    for r in range(draw(st.integers(0, 8))):
        num_tokens, prompt, computed, cursor_bytes = draw(_COUNTS)
        state = new_request_state(
            config,
            f"r{r}",
            num_prompt_tokens=prompt,
            block_hashes=hashes_for(config, num_tokens),
        )
        cursors = tuple(
            min(len(keys), cursor_bytes[g] % 8 if g < len(cursor_bytes) else 0)
            for g, keys in enumerate(state.keys)
        )
        states.append(attrs.evolve(state, store_cursor=cursors))
        computed = min(computed, num_tokens)
        scheduled = draw(st.integers(0, num_tokens - computed + 3))
        counts.append((computed, scheduled, num_tokens))
    return config, states, counts


@given(batches())
def test_the_batched_answer_is_the_per_request_answer(
    batch: tuple[OffloadConfig, list[RequestState], list[tuple[int, ...]]],
) -> None:
    config, states, counts = batch
    due = due_for_store(
        config,
        states,
        num_computed_tokens=[c for c, _, _ in counts],
        num_scheduled_tokens=[s for _, s, _ in counts],
        num_tokens=[t for _, _, t in counts],
    )
    per_request = [
        r
        for r, (state, (computed, scheduled, tokens)) in enumerate(zip(states, counts, strict=True))
        if store_due(
            config,
            state,
            stored_tokens_after_step(
                config,
                state,
                num_computed_tokens=computed,
                num_scheduled_tokens=scheduled,
                num_tokens=tokens,
            ),
        )
    ]
    assert due.tolist() == per_request


def _due_alone(case: StoreCase) -> bool:
    """Return whether `due_for_store` names the case's request, asked for it alone."""
    due = due_for_store(
        case.config,
        [case.state],
        num_computed_tokens=[case.num_computed_tokens],
        num_scheduled_tokens=[case.num_scheduled_tokens],
        num_tokens=[case.num_tokens],
    )
    return due.tolist() == [0]


@given(store_cases())
def test_plan_store_finds_nothing_for_a_request_left_out(case: StoreCase) -> None:
    decision = run_store(case)
    if not _due_alone(case):
        assert (decision.outcome, decision.state) == (StoreOutcome.NOTHING, case.state)


@given(store_cases())
def test_a_due_request_has_a_chunk_end_within_done(case: StoreCase) -> None:
    chunk_ends = [
        (cursor + 1) * case.config.chunk_tokens(g)
        for g, cursor in enumerate(case.state.store_cursor)
    ]
    assert _due_alone(case) == (min(chunk_ends) <= case.done)
