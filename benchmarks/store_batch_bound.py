"""How much a batched store planner could take off target 5's store step: a bound, measured.

A benchmark, never part of the test suite, and not a planner: it answers one question about
`planner.py`'s store step at F = 1 (256 decode requests, 16 of them completing a chunk each
step), the worst case of target 5. If the per-request calls were replaced by one call per step
that does only what the step's result needs, how fast would the step be?

The stripped step below is that call, with everything a batch could leave out already left
out: no input check at all, the keys appended to each chain's list in place (reaching into
`KeyChain`), `done` taken from the due check's column, one `statuses` call for every due
request's candidates, and no room check (the tier is large enough, as in `planner.py`). A real
batched planner would keep the checks and the room rule, so it would be slower than this. The
script first checks, untimed, that the stripped step makes exactly the library's plans and
next states, step by step; then it times both steps over the same 64 decode steps, alternating,
`--rounds` times each, and prints the mean ms per step of each round and the ratio of medians.
With `--keys library` the stripped step keys new chunks with `extend_keys`, as an engine
would (a batched planner changes the planning, not the keying): the bound of the planning alone.

    python3 benchmarks/store_batch_bound.py --rounds 8
    python3 benchmarks/store_batch_bound.py --rounds 8 --keys library
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Sequence

import numpy as np
from planner import BLOCK, _config, _decode_requests, _store_steps

from kvferry.core import (
    GroupBlocks,
    OffloadConfig,
    RequestState,
    StoreDecision,
    StoreOutcome,
    due_for_store,
    extend_keys,
    plan_store,
)
from kvferry.core.catalog import CatalogView
from kvferry.core.keys import KeyChain, OffloadKey, _new, _set_keys, _set_length
from kvferry.core.plan import Direction
from kvferry.core.state import _with_changes as _next_state
from kvferry.core.store import (
    _MISS,
    _candidate_chunks,
    _gpu_side,
    _new_decision,
    _new_plan,
)
from kvferry.core.store import (
    _with_changes as _moved_state,
)

_make_key = tuple.__new__


def _appended(chain: KeyChain, keys: list[OffloadKey]) -> KeyChain:
    """Return `chain` followed by `keys`, appended in place to its list (no check; `chain` must
    be the longest chain of its list, as the latest state's chains are here)."""
    store = chain._keys
    store += keys
    grown = _new(KeyChain)
    _set_keys(grown, store)
    _set_length(grown, len(store))
    return grown


def _extended(state: RequestState, hashes: list[bytes], steps: Sequence[int]) -> RequestState:
    """Return `state` with the keys `hashes` completes, appended in place (no check)."""
    chains = list(state.keys)
    changed = False
    for group, step in enumerate(steps):
        known = chains[group]
        count = len(known)
        if (count + 1) * step > len(hashes):
            continue
        added = [_make_key(OffloadKey, (group, h)) for h in hashes[(count + 1) * step - 1 :: step]]
        chains[group] = _appended(known, added)
        changed = True
    return _next_state(state, keys=tuple(chains)) if changed else state


def _batch_plans(
    config: OffloadConfig,
    *,
    states: Sequence[RequestState],
    blocks: Sequence[Sequence[GroupBlocks]],
    due: Sequence[int],
    done: Sequence[int],
    tier: CatalogView,
) -> list[StoreDecision]:
    """Return the store decisions of the `due` requests, made with no check and one `statuses`
    call (the tier must have room for every plan)."""
    f = config.blocks_per_chunk
    chunk_tokens = config.all_chunk_tokens
    work = []
    candidates: list[OffloadKey] = []
    for r in due:
        state, request_blocks, tokens = states[r], blocks[r], done[r]
        cursors, chains = state.store_cursor, state.keys
        ends: list[int] = list(cursors)
        per_group: list[tuple[int, Sequence[int]]] = []
        first = len(candidates)
        for g, chunk in enumerate(chunk_tokens):
            cursor, end = cursors[g], min(tokens // chunk, len(chains[g]))
            if end <= cursor:
                continue
            ends[g] = end
            chunks = _candidate_chunks(state.request_id, g, request_blocks[g], cursor, end, f=f)
            if chunks:
                per_group.append((g, chunks))
                chain = chains[g]
                candidates += (
                    chain[cursor:end] if isinstance(chunks, range) else [chain[j] for j in chunks]
                )
        work.append((state, request_blocks, tuple(ends), per_group, first, len(candidates)))
    statuses = tier.statuses(candidates)
    decisions = []
    for state, request_blocks, next_cursor, per_group, first, last in work:
        if statuses[first:last].count(_MISS) != last - first:
            raise AssertionError("the bound covers only steps where every candidate is new")
        ids, sizes, firsts = _gpu_side(request_blocks, per_group, len(next_cursor), f)
        keys = tuple(candidates[first:last])
        plan = _new_plan(
            request_id=state.request_id,
            direction=Direction.STORE,
            blocks_per_chunk=f,
            keys=keys,
            gpu_block_ids=ids,
            group_sizes=sizes,
            block_indices=firsts,
        )
        decisions.append(
            _new_decision(
                outcome=StoreOutcome.STORE,
                plan=plan,
                state=_moved_state(state, store_cursor=next_cursor),
                reserve_keys=keys,
            )
        )
    return decisions


def _stripped_steps(steps: int, *, check: bool, library_keys: bool) -> tuple[int, list[float]]:
    """Return (store plans made, ms per step) of the stripped step over `planner.py`'s F = 1
    decode steps (keyed by `extend_keys` when `library_keys`, else appended in place); with
    `check`, compare each step's decisions with the library's (untimed)."""
    config = _config(1)
    prompts, blocks, hashes, states, catalog = _decode_requests(config, steps)
    view = catalog.view()
    grown = [hashes[r][: prompts[r] // BLOCK] for r in range(len(prompts))]
    hash_steps = [chunk // config.hash_block_size for chunk in config.all_chunk_tokens]
    prompt_column = np.array(prompts, dtype=np.int64)
    ones = np.ones(len(prompts), dtype=np.int64)
    step_ms: list[float] = []
    stored = 0
    gc.collect()
    for step in range(steps):
        before = list(states) if check else []
        start = time.perf_counter()
        num_tokens = prompt_column + (step + 1)
        for r in np.flatnonzero(num_tokens % BLOCK == 0).tolist():
            grown[r].append(hashes[r][len(grown[r])])  # the engine's own list grows
            states[r] = (
                extend_keys(config, states[r], grown[r])
                if library_keys
                else _extended(states[r], grown[r], hash_steps)
            )
        due_array = due_for_store(
            config,
            states,
            num_computed_tokens=num_tokens - 1,
            num_scheduled_tokens=ones,
            num_tokens=num_tokens,
        )
        due = due_array.tolist()
        decisions = _batch_plans(
            config, states=states, blocks=blocks, due=due, done=num_tokens.tolist(), tier=view
        )
        for r, decision in zip(due, decisions, strict=True):
            states[r] = decision.state
        step_ms.append((time.perf_counter() - start) * 1e3)
        stored += len(decisions)
        if check:
            made = dict(zip(due, decisions, strict=True))
            _check_step(
                config,
                before=before,
                stripped=made,
                after=states,
                blocks=blocks,
                grown=grown,
                prompts=prompts,
                step=step,
                view=view,
            )
    return stored, step_ms


def _check_step(
    config: OffloadConfig,
    *,
    before: Sequence[RequestState],
    stripped: dict[int, StoreDecision],
    after: Sequence[RequestState],
    blocks: Sequence[Sequence[GroupBlocks]],
    grown: Sequence[list[bytes]],
    prompts: Sequence[int],
    step: int,
    view: CatalogView,
) -> None:
    """Raise AssertionError unless the library, from the states `before` the step, makes the
    stripped step's plans (`stripped`, by request) and next states (`after`)."""
    for r, state in enumerate(before):
        num_tokens = prompts[r] + step + 1
        decision = plan_store(
            config,
            extend_keys(config, state, grown[r]),
            blocks[r],
            num_computed_tokens=num_tokens - 1,
            num_scheduled_tokens=1,
            num_tokens=num_tokens,
            tier=view,
        )
        if decision.state != after[r]:
            raise AssertionError(f"step {step}, request {r}: next states differ")
        plan = stripped[r].plan if r in stripped else None
        if decision.plan != plan:
            raise AssertionError(f"step {step}, request {r}: plans differ")


def main() -> int:
    """Check the stripped step against the library, time both in alternating rounds, print
    each round and the ratio of medians; return 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument(
        "--keys",
        choices=("appended", "library"),
        default="appended",
        help="how the stripped step keys new chunks: appended in place (no check), or "
        "extend_keys (only the planning is stripped)",
    )
    args = parser.parse_args()

    library_keys = args.keys == "library"
    checked, _ = _stripped_steps(args.steps, check=True, library_keys=library_keys)
    print(f"checked: the stripped step made the library's {checked} plans and next states")
    library: list[float] = []
    stripped: list[float] = []
    for _ in range(args.rounds):
        plans, ms = _store_steps(1, args.steps, batched=True)
        library.append(statistics.fmean(ms))
        bound_plans, ms = _stripped_steps(args.steps, check=False, library_keys=library_keys)
        stripped.append(statistics.fmean(ms))
        if bound_plans != plans:
            raise AssertionError(f"{bound_plans} stripped plans, {plans} library plans")
    print("mean ms per F = 1 store step, each round (library, then stripped)")
    for lib, bound in zip(library, stripped, strict=True):
        print(f"  {lib:6.3f}  {bound:6.3f}")
    ratio = statistics.median(stripped) / statistics.median(library)
    print(
        f"median library {statistics.median(library):.3f} ms, stripped "
        f"{statistics.median(stripped):.3f} ms: the stripped step takes {ratio:.2f} x the time"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
