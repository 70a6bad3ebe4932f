"""The kinds table: every row keeps the meaning `KindRule` documents, and a group spec carries
exactly the parameters its kind's row asks for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvferry.core import GroupKind, GroupSpec, InvalidInputError, OffloadConfig
from kvferry.core.kinds import KIND_RULES, PARAMETER_DEFAULTS, Scan

SEMANTICS = Path(__file__).resolve().parent.parent / "docs" / "semantics.md"


def spec_of(kind: GroupKind, block_size: int = 4, value: int = 10) -> GroupSpec:
    """Return a spec of `kind` with every parameter its row asks for set to `value`."""
    return GroupSpec(
        kind=kind,
        block_size=block_size,
        **{name: value for name in KIND_RULES[kind].parameters},
    )


def _required(kind: GroupKind) -> dict[str, int]:
    return {name: 10 for name in KIND_RULES[kind].parameters}


KINDS = list(GroupKind)


def test_every_kind_has_a_row() -> None:
    assert set(KIND_RULES) == set(GroupKind)


@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
def test_first_needed_token_never_passes_the_token_and_never_moves_back(kind: GroupKind) -> None:
    spec = spec_of(kind)
    firsts = [spec.first_needed_token(t) for t in range(100)]
    assert all(0 <= first <= t for t, first in enumerate(firsts))
    assert firsts == sorted(firsts)


@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
def test_window_tokens_bound_what_the_group_needs(kind: GroupKind) -> None:
    spec = spec_of(kind)
    rule = KIND_RULES[kind]
    if rule.window_tokens is None:
        assert all(spec.first_needed_token(t) == 0 for t in range(100))
        return
    window = rule.window_tokens(spec)
    assert all(t - spec.first_needed_token(t) <= window for t in range(100))
    if rule.scan is Scan.WINDOW:  # exactly the window, wherever it fits
        assert all(spec.first_needed_token(t) == max(0, t - window) for t in range(100))


@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
def test_only_groups_needing_every_earlier_token_are_scanned_as_a_prefix(kind: GroupKind) -> None:
    rule = KIND_RULES[kind]
    assert (rule.scan is Scan.PREFIX) == (not rule.windowed)


@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
def test_a_state_exists_only_at_its_own_chunk_ends(kind: GroupKind) -> None:
    rule = KIND_RULES[kind]
    assert rule.boundary_on_grid == rule.recurrent_state


@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
def test_parameters_are_known_fields(kind: GroupKind) -> None:
    rule = KIND_RULES[kind]
    assert set(rule.parameters + rule.optional_parameters) <= set(PARAMETER_DEFAULTS)


@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
def test_an_optional_parameter_is_at_least_zero(kind: GroupKind) -> None:
    for name in KIND_RULES[kind].optional_parameters:
        assert getattr(spec_of(kind), name) == 0
        with pytest.raises(InvalidInputError, match=name):
            GroupSpec(kind=kind, block_size=4, **{name: -1}, **_required(kind))


@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
def test_a_spec_without_a_parameter_of_its_kind_is_refused_by_name(kind: GroupKind) -> None:
    for name in KIND_RULES[kind].parameters:
        with pytest.raises(InvalidInputError, match=name):
            GroupSpec(kind=kind, block_size=4)
        with pytest.raises(InvalidInputError, match=name):
            GroupSpec(kind=kind, block_size=4, **{name: 0})


@pytest.mark.parametrize("kind", KINDS, ids=[k.value for k in KINDS])
def test_a_spec_with_a_parameter_of_another_kind_is_refused_by_name(kind: GroupKind) -> None:
    rule = KIND_RULES[kind]
    for name in set(PARAMETER_DEFAULTS) - set(rule.parameters + rule.optional_parameters):
        with pytest.raises(InvalidInputError, match=name):
            GroupSpec(kind=kind, block_size=4, **{name: 7}, **_required(kind))


def test_a_window_of_w_needs_the_w_minus_one_tokens_before_the_token() -> None:
    spec = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=4, sliding_window=5)
    assert [spec.first_needed_token(t) for t in (0, 3, 4, 5, 20)] == [0, 0, 0, 1, 16]


def test_retained_tokens_extend_a_window_below_its_w_minus_one_tokens() -> None:
    spec = GroupSpec(
        kind=GroupKind.SLIDING_WINDOW, block_size=4, sliding_window=5, extra_retained_tokens=3
    )
    assert [spec.first_needed_token(t) for t in (4, 7, 8, 20)] == [0, 0, 1, 13]


def test_window_chunks_count_retained_tokens_too() -> None:
    window = GroupSpec(
        kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=33, extra_retained_tokens=1
    )
    config = OffloadConfig(hash_block_size=16, blocks_per_chunk=2, groups=(window,))
    assert config.window_chunks(0) == 2  # 32 + 1 tokens before a boundary on the 32-token grid


def test_mamba_needs_the_state_after_the_previous_token() -> None:
    spec = GroupSpec(kind=GroupKind.MAMBA, block_size=4)
    assert [spec.first_needed_token(t) for t in (0, 1, 8)] == [0, 0, 7]


def test_chunked_local_attention_needs_its_attention_chunk_so_far() -> None:
    spec = GroupSpec(kind=GroupKind.CHUNKED_LOCAL_ATTENTION, block_size=4, attention_chunk_size=8)
    assert [spec.first_needed_token(t) for t in (0, 7, 8, 13, 16)] == [0, 0, 8, 8, 16]


def test_window_chunks_count_the_w_minus_one_tokens_on_the_grid() -> None:
    window = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=33)
    config = OffloadConfig(hash_block_size=16, blocks_per_chunk=2, groups=(window,))
    assert config.window_chunks(0) == 1  # 32 tokens before a boundary on the 32-token grid


def test_semantics_page_has_a_row_per_kind() -> None:
    section = SEMANTICS.read_text(encoding="utf-8").split("\n## Group kinds\n", 1)[1]
    table = section.split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `(\w+)` \|", table, re.M))
    assert named == {kind.value for kind in GroupKind}
