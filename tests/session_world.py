"""The world the refusal tests run against: a session with history over the rig, and a snapshot
of everything a caller could observe of it, private bookkeeping included."""

from __future__ import annotations

from typing import Any

import attrs
from offload_rig import Rig, chain

from kvferry.adapters.session import OffloadSession
from kvferry.core.blocks import GroupBlocks
from kvferry.core.bound import BoundPlan
from kvferry.core.catalog import Catalog
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.state import RequestState, new_request_state

H = 4  # hash block size
FULL = GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=4)
WINDOW = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=8, sliding_window=16)
CONFIG = OffloadConfig(hash_block_size=H, blocks_per_chunk=2, groups=(FULL, WINDOW))
PROMPT = chain(8, family=0, shared=0)  # 32 tokens: chunks of 8 (group 0) and 16 (group 1)


@attrs.define
class World:
    """A session with history: r1 stored its prompt and finished; r2 loaded it and has a store
    in flight; r3 was looked up. Plus a planner state, blocks and plans to break."""

    rig: Rig
    state: RequestState
    blocks: list[GroupBlocks]
    store_job: BoundPlan
    load_job: BoundPlan

    @property
    def session(self) -> OffloadSession:
        return self.rig.session

    @property
    def catalog(self) -> Catalog:
        return self.rig.catalog

    @property
    def cpu(self) -> Any:
        return self.rig.executor.inner

    def snapshot(self) -> object:
        """Everything a caller could observe, and the private bookkeeping behind it."""
        session, catalog, cpu = self.session, self.catalog, self.cpu
        return (
            {
                rid: (r.state, frozenset(r.jobs), r.finished, r.num_hashes, r.fence)
                for rid, r in session._requests.items()
            },
            {
                jid: (j.request_id, j.direction, j.keys, frozenset(j.reported), j.failed)
                for jid, j in session._jobs.items()
            },
            (session._next_job, session._first_live_job),
            catalog.snapshot(),
            catalog.counters(),
            tuple((g, tuple(rows.freed)) for g, rows in catalog._groups.items()),
            bytes(cpu.host_tier.array),
            [bytes(t) for group in self.rig.caches for t in group],
            sorted(cpu._jobs),
            self.state,
            [(b.ids.tobytes(), b.is_null.tobytes()) for b in self.blocks],
        )


def make_world() -> World:
    rig = Rig(CONFIG, capacity_rows=8, num_blocks=32)
    r1 = rig.arrive("r1", PROMPT)
    rig.admit(r1)
    rig.store_step({"r1": 32})
    rig.deliver()
    rig.finish("r1")
    r2 = rig.arrive("r2", chain(12, family=0, shared=0))
    load = rig.admit(r2)
    assert load is not None
    rig.deliver()
    (store,) = rig.store_step({"r2": 16})
    rig.executor.inner.submit(rebound(store, job_id=900))  # a job the cpu executor holds
    rig.arrive("r3", chain(4, family=1, shared=0))
    rig.session.lookup("r3", block_hashes=chain(4, 1, 0), num_tokens=16, num_computed_tokens=0)
    state = new_request_state(CONFIG, "r9", num_prompt_tokens=32, block_hashes=PROMPT)
    blocks = [GroupBlocks.of(range(1, 9)), GroupBlocks.of(range(11, 15))]
    return World(rig=rig, state=state, blocks=blocks, store_job=store, load_job=load)


def rebound(bound: BoundPlan, **changes: Any) -> BoundPlan:
    return attrs.evolve(bound, **changes)
