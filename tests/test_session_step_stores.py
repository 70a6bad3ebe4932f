"""A step's due stores are planned against one read of the tier and reserved in one call when no
key repeats across them and every group has free rows for all of them; otherwise one after the
other. Either way the step gives the jobs, rows, refusals and catalog that planning and
reserving them one after the other gives."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from session_fakes import blocks, prefix_hashes

from kvferry.adapters.session import OffloadSession, RunningRequest
from kvferry.core.bound import JobResult
from kvferry.core.catalog import Catalog, CatalogConfig
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.eviction import EvictionPolicyKind
from kvferry.core.store import StoreCandidates

FULL = GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=4)
WINDOW = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=8, sliding_window=16)


class _OneAfterTheOther(OffloadSession):
    """The session with its one-call path for a step's stores turned off."""

    def _step_answers(self, checked: Sequence[StoreCandidates]) -> None:
        return None


def _config(f: int) -> OffloadConfig:
    return OffloadConfig(hash_block_size=4, blocks_per_chunk=f, groups=(FULL, WINDOW))


def _running(
    config: OffloadConfig, rid: str, hashes: tuple[bytes, ...], computed: int, scheduled: int
) -> RunningRequest:
    """Return request `rid`'s step: its own blocks (ids from its number on), all of them real."""
    tokens = len(hashes) * 4
    base = 1 + int(rid[1:]) * 1000
    tables = [
        blocks(range(base + 500 * g, base + 500 * g + -(-tokens // spec.block_size)))
        for g, spec in enumerate(config.groups)
    ]
    return RunningRequest(
        request_id=rid,
        blocks=tables,
        num_computed_tokens=computed,
        num_scheduled_tokens=scheduled,
        num_tokens=tokens,
        block_hashes=hashes,
    )


_REQUESTS = st.lists(
    st.tuples(st.integers(4, 16), st.integers(0, 2), st.integers(0, 8)),  # length, family, shared
    min_size=2,
    max_size=5,
)


@settings(max_examples=300, deadline=None)
@given(
    f=st.sampled_from([1, 2]),
    capacity=st.integers(1, 12),
    policy=st.sampled_from(list(EvictionPolicyKind)),
    requests=_REQUESTS,
    data=st.data(),
)
def test_a_steps_stores_are_what_planning_them_one_after_the_other_gives(
    f: int,
    capacity: int,
    policy: EvictionPolicyKind,
    requests: list[tuple[int, int, int]],
    data: st.DataObject,
) -> None:
    config = _config(f)
    sessions = [
        kind(
            config,
            Catalog(CatalogConfig(capacity_rows=capacity, policy=policy, record_events=True)),
        )
        for kind in (OffloadSession, _OneAfterTheOther)
    ]
    hashes = {
        f"r{i}": prefix_hashes(length, family, min(shared, length))
        for i, (length, family, shared) in enumerate(requests)
    }
    computed = dict.fromkeys(hashes, 0)
    for step in range(6):
        scheduled = {
            rid: data.draw(st.integers(0, len(h) * 4 - computed[rid]), label=f"step {step} {rid}")
            for rid, h in hashes.items()
        }
        seen = []
        for session in sessions:
            result = session.start_stores(
                [
                    _running(config, rid, h, computed[rid], scheduled[rid])
                    for rid, h in hashes.items()
                ]
            )
            catalog = session.catalog
            seen.append((result, catalog.snapshot(), catalog.counters(), catalog.drain_events()))
        assert seen[0] == seen[1]
        for rid in hashes:
            computed[rid] += scheduled[rid]
        done = data.draw(st.lists(st.sampled_from(sorted(sessions[0].in_flight()) or [0])))
        for job_id in dict.fromkeys(job for job in done if job):
            result = JobResult(job_id=job_id, success=job_id % 3 != 0, nbytes=0, seconds=0.0)
            assert sessions[0].report(0, [result]) == sessions[1].report(0, [result])


def _decode_step(session: OffloadSession, shared: int) -> None:
    """Store three requests' prompts (16 tokens each; the first `shared` hash blocks common)."""
    config = session.config
    session.start_stores(
        [
            _running(config, f"r{i}", prefix_hashes(4, family=i, shared=shared), 0, 16)
            for i in range(3)
        ]
    )


def test_a_step_reserves_the_rows_of_stores_with_distinct_keys_in_one_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    catalog = Catalog(CatalogConfig(capacity_rows=64))
    calls: list[str] = []
    monkeypatch.setattr(catalog, "reserve", lambda *a, **k: calls.append("reserve"))
    each = catalog.reserve_each
    monkeypatch.setattr(catalog, "reserve_each", lambda asks: calls.append("each") or each(asks))
    _decode_step(OffloadSession(_config(1), catalog), shared=0)
    assert calls == ["each"]
    assert catalog.rows_used == 3 * (4 + 2)


def test_a_step_whose_stores_share_a_key_reserves_them_one_after_the_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    catalog = Catalog(CatalogConfig(capacity_rows=64))
    calls: list[str] = []
    reserve = catalog.reserve
    monkeypatch.setattr(catalog, "reserve", lambda *a, **k: calls.append("one") or reserve(*a, **k))
    monkeypatch.setattr(catalog, "reserve_each", lambda asks: calls.append("each"))
    _decode_step(OffloadSession(_config(1), catalog), shared=1)
    assert calls == ["one", "one", "one"]
    assert catalog.rows_used == 6 + 2 * 5  # the shared chunk is stored once
