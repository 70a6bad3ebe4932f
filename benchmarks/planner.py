"""Planner: planning time on the CPU, a long request's lookup and load plan, and store planning
for a batch of decode requests at every step.

Needs no GPU. Three KV-cache groups (full attention, block 16; a sliding window of 128 tokens,
block 16; Mamba, block 16), at 1, 4 and 16 blocks per chunk (F):

* lookup + load plan of a 131 072-token request whose every chunk is in the tier;
* store planning for 256 running decode requests, per step: the due check of every request
  (`due_for_store`, once for the batch), the keys of the hash blocks that completed, and
  `plan_store` for the due ones. The `x per-request` column is that time over the same steps
  with `store_due` called per request.

    kvferry bench planner
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvferry.benchmarks.common import (
    add_common_options,
    bar_line,
    bar_result,
    finish_axis,
    measured_on,
    measured_on_line,
    output_paths,
    positive_int,
    pyplot,
    save_plot,
    write_json,
)
from kvferry.core import (
    GroupBlocks,
    GroupKind,
    GroupSpec,
    OffloadConfig,
    RequestState,
    StoreOutcome,
    TransferPlan,
    due_for_store,
    extend_keys,
    lookup,
    new_request_state,
    plan_load,
    plan_store,
    store_due,
    stored_tokens_after_step,
)
from kvferry.core.catalog import Catalog, CatalogConfig

NAME = "planner"
LOOKUP_BAR_MS = 1.0
"""Lookup + load plan of the 131 072-token request, worst F."""
STORE_STEP_BAR_MS = 0.5
"""Store planning for 256 decode requests, mean per step, worst F."""
BLOCKS_PER_CHUNK = (1, 4, 16)
BLOCK = 16
WINDOW = 128


def _config(blocks_per_chunk: int) -> OffloadConfig:
    return OffloadConfig(
        hash_block_size=BLOCK,
        blocks_per_chunk=blocks_per_chunk,
        groups=(
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=BLOCK),
            GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=BLOCK, sliding_window=WINDOW),
            GroupSpec(kind=GroupKind.MAMBA, block_size=BLOCK),
        ),
    )


def _hashes(request: int, count: int) -> list[bytes]:
    return [(request << 40 | i).to_bytes(8, "big") for i in range(count)]


def _median_ms(run: Callable[[], object], repeat: int) -> float:
    run()  # warm caches and lazy imports
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def _engine_blocks(num_tokens: int, cached: int) -> list[GroupBlocks]:
    """Block tables an engine would hold after allocating for a `cached`-token hit."""
    n = -(-num_tokens // BLOCK)
    full = GroupBlocks.of(np.arange(1, n + 1))
    window_first = max(cached - WINDOW, 0) // BLOCK
    window = GroupBlocks(
        ids=np.where(np.arange(n) >= window_first, np.arange(n) + 100_000, 0),
        is_null=np.arange(n) < window_first,
        is_cached=np.zeros(n, dtype=bool),
    )
    state_block = -(-cached // BLOCK) - 1
    mamba = GroupBlocks(
        ids=np.where(np.arange(n) >= state_block, np.arange(n) + 200_000, 0),
        is_null=np.arange(n) < state_block,
        is_cached=np.zeros(n, dtype=bool),
    )
    return [full, window, mamba]


def bench_lookup_and_load(blocks_per_chunk: int, repeat: int) -> dict[str, Any]:
    """Return timings of lookup + plan_load for one 131 072-token request fully in the tier."""
    num_tokens = 131_072
    config = _config(blocks_per_chunk)
    state = new_request_state(
        config, "long", num_prompt_tokens=num_tokens, block_hashes=_hashes(1, num_tokens // BLOCK)
    )
    keys = [key for group_keys in state.keys for key in group_keys]
    catalog = Catalog(CatalogConfig(capacity_rows=len(keys)))
    reservation = catalog.reserve(keys)
    if reservation is None:
        raise RuntimeError("a catalog of len(keys) rows had no room for the keys")
    catalog.complete_store(reservation.keys, success=True)
    view = catalog.view()
    hit = lookup(config, state, num_tokens=num_tokens, num_computed_tokens=0, tier=view)
    blocks = _engine_blocks(num_tokens, hit.tokens)

    def lookup_and_load() -> tuple[TransferPlan, RequestState]:
        found = lookup(config, state, num_tokens=num_tokens, num_computed_tokens=0, tier=view)
        return plan_load(config, state, blocks, num_computed_tokens=0, hit_tokens=found.tokens)

    plan, _ = lookup_and_load()
    return {
        "blocks_per_chunk": blocks_per_chunk,
        "keys": len(keys),
        "hit_tokens": hit.tokens,
        "plan_blocks": list(plan.group_sizes),
        "lookup_ms": _median_ms(
            lambda: lookup(config, state, num_tokens=num_tokens, num_computed_tokens=0, tier=view),
            repeat,
        ),
        "lookup_and_load_ms": _median_ms(lookup_and_load, repeat),
        "block_tables_ms": _median_ms(lambda: _engine_blocks(num_tokens, hit.tokens), repeat),
    }


def _decode_requests(
    config: OffloadConfig, steps: int
) -> tuple[list[int], list[list[GroupBlocks]], list[list[bytes]], list[RequestState], Catalog]:
    """Return 256 requests whose prompts are stored already (prompt r: 2 048 + r tokens, so
    chunk completions are spread over the steps as in a real batch): prompt lengths, block
    tables, hash lists for the whole run, planning states, and the tier."""
    num_requests = 256
    prompts = [2048 + r for r in range(num_requests)]
    catalog = Catalog(CatalogConfig(capacity_rows=num_requests * (steps + 2048 // BLOCK)))
    blocks: list[list[GroupBlocks]] = []
    hashes: list[list[bytes]] = []
    states: list[RequestState] = []
    for r, prompt in enumerate(prompts):
        total_blocks = -(-(prompt + steps) // BLOCK) + 1
        blocks.append([GroupBlocks.of(np.arange(total_blocks) + 1) for _ in range(3)])
        hashes.append(_hashes(r + 2, (prompt + steps) // BLOCK))
        state = new_request_state(
            config, f"r{r}", num_prompt_tokens=prompt, block_hashes=hashes[r][: prompt // BLOCK]
        )
        prefill = plan_store(
            config,
            state,
            blocks[r],
            num_computed_tokens=0,
            num_scheduled_tokens=prompt,
            num_tokens=prompt,
            tier=catalog.view(),
        )
        states.append(prefill.state)
    return prompts, blocks, hashes, states, catalog


def _store_steps(blocks_per_chunk: int, steps: int, *, batched: bool) -> tuple[int, list[float]]:
    """Return (store plans made, ms per step) of `steps` decode steps of 256 requests.

    Timed per step, all an engine does: keys extended where a hash block completed, the due
    check for every request (`due_for_store` once when `batched`, else `store_due` per request,
    the reference), and `plan_store` for the requests that are due.
    """
    config = _config(blocks_per_chunk)
    prompts, blocks, hashes, states, catalog = _decode_requests(config, steps)
    view = catalog.view()
    prompt_column = np.array(prompts, dtype=np.int64)
    ones = np.ones(len(prompts), dtype=np.int64)
    step_ms: list[float] = []
    stored = 0
    gc.collect()  # the set-up's garbage is no cost of a step (a running engine's is long gone)
    for step in range(steps):
        start = time.perf_counter()
        num_tokens = prompt_column + (step + 1)
        for r in np.flatnonzero(num_tokens % BLOCK == 0).tolist():  # the engine hashed a block
            states[r] = extend_keys(config, states[r], hashes[r][: int(num_tokens[r]) // BLOCK])
        if batched:
            due = due_for_store(
                config,
                states,
                num_computed_tokens=num_tokens - 1,
                num_scheduled_tokens=ones,
                num_tokens=num_tokens,
            ).tolist()
        else:
            due = [
                r
                for r, state in enumerate(states)
                if store_due(
                    config,
                    state,
                    stored_tokens_after_step(
                        config,
                        state,
                        num_computed_tokens=prompts[r] + step,
                        num_scheduled_tokens=1,
                        num_tokens=prompts[r] + step + 1,
                    ),
                )
            ]
        for r in due:
            decision = plan_store(
                config,
                states[r],
                blocks[r],
                num_computed_tokens=prompts[r] + step,
                num_scheduled_tokens=1,
                num_tokens=prompts[r] + step + 1,
                tier=view,
            )
            stored += decision.outcome is StoreOutcome.STORE
            states[r] = decision.state
        step_ms.append((time.perf_counter() - start) * 1e3)
    return stored, step_ms


def bench_store_steps(blocks_per_chunk: int, steps: int) -> dict[str, Any]:
    """Return per-step timings of store planning for 256 decode requests over `steps` steps,
    with the batched due check, and the mean of the per-request check (the reference)."""
    stored, step_ms = _store_steps(blocks_per_chunk, steps, batched=True)
    reference_stored, reference_ms = _store_steps(blocks_per_chunk, steps, batched=False)
    if stored != reference_stored:
        raise RuntimeError(
            f"F={blocks_per_chunk}: {stored} store plans with due_for_store, "
            f"{reference_stored} with store_due per request"
        )
    return {
        "blocks_per_chunk": blocks_per_chunk,
        "requests": 256,
        "steps": steps,
        "store_plans": stored,
        "step_ms_median": statistics.median(step_ms),
        "step_ms_mean": statistics.fmean(step_ms),
        "step_ms_max": max(step_ms),
        "per_request_step_ms_mean": statistics.fmean(reference_ms),
    }


def bars(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Return the verdicts of the two bars, each on the worst F: the long request's lookup + load
    plan, and store planning's mean per step."""
    worst_lookup = max(results["lookup"], key=lambda r: r["lookup_and_load_ms"])
    worst_store = max(results["store"], key=lambda r: r["step_ms_mean"])
    return [
        bar_result(
            worst_lookup["lookup_and_load_ms"] <= LOOKUP_BAR_MS,
            f"lookup + load plan of a 131072-token request, 3 groups <= {LOOKUP_BAR_MS} ms, "
            "every F",
            f"worst {worst_lookup['lookup_and_load_ms']:.3f} ms "
            f"(F = {worst_lookup['blocks_per_chunk']})",
        ),
        bar_result(
            worst_store["step_ms_mean"] <= STORE_STEP_BAR_MS,
            f"store planning for 256 decode requests <= {STORE_STEP_BAR_MS} ms per step "
            "(mean), every F",
            f"worst {worst_store['step_ms_mean']:.3f} ms (F = {worst_store['blocks_per_chunk']})",
        ),
    ]


def plot(results: Path, png: Path, *, log: TextIO | None = None) -> Path | None:
    """Draw planning milliseconds against F (lookup, lookup + load plan, store step) with the two
    bars, from this benchmark's JSON; return the PNG's path, or None (said on `log`) without
    matplotlib."""
    plt = pyplot(log)
    if plt is None:
        return None
    data: dict[str, Any] = json.loads(results.read_text(encoding="utf-8"))
    curves = (
        ("lookup", "lookup_ms", "lookup"),
        ("lookup", "lookup_and_load_ms", "lookup + load plan"),
        ("store", "step_ms_mean", "store planning per step (mean)"),
        ("store", "step_ms_median", "store planning per step (median)"),
    )
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for section, field, label in curves:
        rows = [r for r in data.get(section, []) if field in r and "blocks_per_chunk" in r]
        if rows:
            rows.sort(key=lambda r: int(r["blocks_per_chunk"]))
            axis.plot(
                [int(r["blocks_per_chunk"]) for r in rows],
                [float(r[field]) for r in rows],
                marker="o",
                label=label,
            )
    for level in (LOOKUP_BAR_MS, STORE_STEP_BAR_MS):
        axis.axhline(level, color="grey", linewidth=0.8, linestyle="--")
    finish_axis(axis, xlabel="blocks per chunk (F)", ylabel="ms")
    measured = data.get("measured_on", {})
    return save_plot(
        plt,
        figure,
        png,
        f"kvferry planner, CPU {measured.get('cpu', '')}, {measured.get('date', '')}\n"
        "dashed: the bars (lookup + load 1 ms, store step 0.5 ms)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the planner benchmarks; print the tables and the bars; write the JSON and the PNG
    under `--out`; return 0."""
    parser = argparse.ArgumentParser(
        prog=f"kvferry bench {NAME}", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=None, help="timings per median (default 200)"
    )
    parser.add_argument(
        "--steps", type=positive_int, default=None, help="decode steps timed (default 64)"
    )
    add_common_options(parser, quick="a short run: 20 timings per median, 16 decode steps")
    args = parser.parse_args(argv)
    repeat = args.repeat or (20 if args.quick else 200)
    steps = args.steps or (16 if args.quick else 64)

    info = measured_on()
    print(measured_on_line(info))
    results: dict[str, Any] = {
        "measured_on": info,
        "repeat": repeat,
        "steps": steps,
        "lookup": [bench_lookup_and_load(f, repeat) for f in BLOCKS_PER_CHUNK],
        "store": [bench_store_steps(f, steps) for f in BLOCKS_PER_CHUNK],
    }
    print(f"{'F':>3} {'keys':>7} {'hit':>7} {'lookup ms':>10} {'+load ms':>9} {'tables ms':>10}")
    for row in results["lookup"]:
        print(
            f"{row['blocks_per_chunk']:>3} {row['keys']:>7} {row['hit_tokens']:>7} "
            f"{row['lookup_ms']:>10.3f} {row['lookup_and_load_ms']:>9.3f} "
            f"{row['block_tables_ms']:>10.3f}"
        )
    print(
        f"{'F':>3} {'requests':>8} {'steps':>6} {'plans':>6} {'mean ms':>8} {'median ms':>10} "
        f"{'max ms':>8} {'x per-request':>14}"
    )
    for row in results["store"]:
        print(
            f"{row['blocks_per_chunk']:>3} {row['requests']:>8} {row['steps']:>6} "
            f"{row['store_plans']:>6} {row['step_ms_mean']:>8.3f} {row['step_ms_median']:>10.3f} "
            f"{row['step_ms_max']:>8.3f} "
            f"{row['step_ms_mean'] / row['per_request_step_ms_mean']:>14.2f}"
        )
    results["bars"] = bars(results)
    for verdict in results["bars"]:
        print(bar_line(verdict["passed"], verdict["bar"], verdict["measured"]))
    json_path, png_path = output_paths(args.out, NAME)
    write_json(json_path, results)
    drawn = plot(json_path, png_path)
    print(f"wrote {json_path}" + (f" and {drawn}" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
