"""KvferryConnector beside vLLM 0.33's built-in OffloadingConnector: the same request flows run
in vLLM's real scheduler with each, and their decisions are compared step by step (what a
lookup offered, which GPU blocks each load and store names, what each finished request asked
of vLLM). Every difference found must be one of those docs/embedding.md lists, and every one
listed there must show up in some flow.

A step whose lookups differ schedules the two engines differently from then on, so a flow is
compared up to and including the first such step. vLLM's connector copies only on GPUs: its
copy worker is a stand-in that completes every job at once (its decisions are compared, not
its bytes)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM 0.33 is not installed")
if not vllm.__version__.startswith("0.33."):
    pytest.skip(f"vLLM 0.33 is not installed (found {vllm.__version__})", allow_module_level=True)

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm_rig import (  # noqa: E402
    DelayedExecutor,
    Engine,
    StepDecisions,
    Transfer,
    build_engine,
    kvferry_transfer_config,
    offloading_transfer_config,
    tiny_model_config,
)

from kvferry.adapters.vllm import SPEC_KINDS  # noqa: E402
from kvferry.core.plan import Direction  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "embedding.md"
BLOCK = 16
PROMPT = list(range(100, 170))


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_model_config(Path(tmp_path_factory.mktemp("tiny-llama")))


def _attention(**kind: Any) -> Any:
    common = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 8, "dtype": torch.float16}
    if "sliding_window" in kind:
        return SlidingWindowSpec(**common, **kind)
    if "attention_chunk_size" in kind:
        return ChunkedLocalAttentionSpec(**common, **kind)
    return FullAttentionSpec(**common)


def full_attention() -> dict[str, Any]:
    return {f"model.layers.{i}.self_attn.attn": _attention() for i in range(2)}


def full_and_sliding() -> dict[str, Any]:
    specs = full_attention()
    specs["model.layers.1.self_attn.attn"] = _attention(sliding_window=32)
    return specs


def full_and_chunked_local() -> dict[str, Any]:
    specs = full_attention()
    specs["model.layers.1.self_attn.attn"] = _attention(attention_chunk_size=32)
    return specs


def full_and_mamba() -> dict[str, Any]:
    specs = full_attention()
    specs["model.layers.1.mixer"] = MambaSpec(
        block_size=BLOCK,
        shapes=((4, 32), (4, 96)),
        dtypes=(torch.float16, torch.float16),
        mamba_cache_mode="align",
    )
    del specs["model.layers.1.self_attn.attn"]
    return specs


# -- the flows (each runs on either engine) --------------------------------------------------


def reload(engine: Engine) -> None:
    engine.add("a", PROMPT, max_tokens=3)
    engine.run()
    engine.evict_gpu()
    engine.add("b", [*PROMPT, 7, 8, 9], max_tokens=3)
    engine.run()


def long_prompts(engine: Engine) -> None:
    """A 150-token prompt over three prefill steps, 20 generated tokens, then a prompt that
    shares its first 100 tokens."""
    engine.add("a", list(range(100, 250)), max_tokens=20)
    engine.run()
    engine.evict_gpu()
    engine.add("b", [*range(100, 200), *[5] * 30], max_tokens=3)
    engine.run()


def preemption(engine: Engine) -> None:
    for index in range(3):
        engine.add(f"r{index}", list(range(200 * index + 10, 200 * index + 160)), max_tokens=60)
    engine.run(limit=400)


def finish_with_store_in_flight(engine: Engine) -> None:
    delayed = None
    if engine.verify:  # kvferry's engine: its stores report late
        delayed = engine.wrap_executor(
            lambda inner: DelayedExecutor(inner, lambda job: job.plan.direction is Direction.STORE)
        )
    engine.add("a", PROMPT, max_tokens=1)
    for _ in range(4):
        engine.step()
    if delayed is not None:
        delayed.release()
    engine.run()


@dataclass(frozen=True)
class Flow:
    name: str
    specs: Callable[[], dict[str, Any]]
    run: Callable[[Engine], None]
    blocks_per_chunk: int = 1
    store_decoded_tokens: bool = False
    num_gpu_blocks: int = 64
    mamba_cache_mode: str = "none"
    unknown: tuple[str, ...] = ()
    """vLLM spec classes taken out of kvferry's table: kinds kvferry has no rule for."""
    differences: frozenset[str] = frozenset()


FLOWS = [
    Flow("reload, F=1", full_attention, reload),
    Flow("reload, F=2", full_attention, reload, blocks_per_chunk=2),
    Flow("long prompts, F=2", full_attention, long_prompts, blocks_per_chunk=2),
    Flow("preemption", full_attention, preemption, num_gpu_blocks=33),
    Flow(
        "generated tokens stored",
        full_attention,
        long_prompts,
        store_decoded_tokens=True,
        differences=frozenset({"decoded-tokens"}),
    ),
    Flow(
        "sliding window beside full attention",
        full_and_sliding,
        long_prompts,
        differences=frozenset({"sliding-window-blocks", "sliding-window-hits"}),
    ),
    Flow(
        "Mamba beside full attention",
        full_and_mamba,
        long_prompts,
        mamba_cache_mode="align",
        differences=frozenset({"mamba-states", "mamba-hits"}),
    ),
    Flow(
        "chunked local attention beside full attention",
        full_and_chunked_local,
        long_prompts,
        differences=frozenset({"chunked-local-blocks"}),
    ),
    Flow(
        "a kind kvferry has no rule for beside full attention",
        full_and_chunked_local,
        reload,
        unknown=("ChunkedLocalAttentionSpec",),
        differences=frozenset({"unknown-kind"}),
    ),
    Flow(
        "a request finishing while its store is in flight",
        full_attention,
        finish_with_store_in_flight,
        differences=frozenset({"held-at-finish"}),
    ),
]


# -- comparing --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    """What the classifier needs to know of the engine's KV cache and requests."""

    sliding: frozenset[int]
    mamba: frozenset[int]
    chunked: frozenset[int]
    left_alone: frozenset[int]
    prompt_blocks: dict[str, int]
    """Each request's full prompt blocks (later ones hold generated tokens)."""


def _by_request(transfers: list[Transfer]) -> dict[str, list[set[int]]]:
    merged: dict[str, list[set[int]]] = {}
    for transfer in transfers:
        groups = merged.setdefault(transfer.request_id, [set() for _ in transfer.blocks])
        for group, blocks in zip(groups, transfer.blocks, strict=True):
            group.update(blocks)
    return merged


def _first_index(transfers: list[Transfer], rid: str, gid: int, block: int) -> int:
    for transfer in transfers:
        if transfer.request_id == rid and block in transfer.blocks[gid]:
            return transfer.first[gid] + transfer.blocks[gid].index(block)
    raise LookupError(block)


def _store_differences(ours: StepDecisions, theirs: StepDecisions, model: Model) -> set[str]:
    found = set()
    mine, other = _by_request(ours.stores), _by_request(theirs.stores)
    for rid in mine.keys() | other.keys():
        groups = len(mine.get(rid) or other[rid])
        for gid in range(groups):
            k = mine[rid][gid] if rid in mine else set()
            o = other[rid][gid] if rid in other else set()
            if k == o:
                continue
            if not k and gid in model.left_alone:
                found.add("unknown-kind")
            elif o < k and gid in model.sliding:
                found.add("sliding-window-blocks")
            elif o < k and gid in model.mamba:
                found.add("mamba-states")
            elif k < o and gid in model.chunked:
                found.add("chunked-local-blocks")
            elif o < k and all(
                _first_index(ours.stores, rid, gid, b) >= model.prompt_blocks[rid] for b in k - o
            ):
                found.add("decoded-tokens")
            else:
                found.add(f"unexplained store of {rid} in group {gid}: {sorted(k)} / {sorted(o)}")
    return found


def _lookup_differences(ours: StepDecisions, theirs: StepDecisions, model: Model) -> set[str]:
    found = set()
    for (rid, computed, k), (rid2, computed2, o) in zip(ours.lookups, theirs.lookups, strict=False):
        if (rid, computed, k) == (rid2, computed2, o):
            continue
        more = (rid, computed) == (rid2, computed2) and (k or 0) > (o or 0)
        if more and model.sliding:
            found.add("sliding-window-hits")
        elif more and model.mamba:
            found.add("mamba-hits")
        else:
            found.add(f"unexplained lookup: {(rid, computed, k)} / {(rid2, computed2, o)}")
    if len(ours.lookups) != len(theirs.lookups):
        found.add(f"unexplained lookups: {ours.lookups} / {theirs.lookups}")
    return found


def _finish_differences(ours: StepDecisions, theirs: StepDecisions) -> set[str]:
    found = set()
    mine, other = dict(ours.finished), dict(theirs.finished)
    for rid in mine.keys() | other.keys():
        if mine.get(rid) == other.get(rid):
            continue
        if mine.get(rid) is True and other.get(rid) is False:
            found.add("held-at-finish")
        else:
            found.add(f"unexplained finish of {rid}: {mine.get(rid)} / {other.get(rid)}")
    return found


def _busy(steps: list[StepDecisions]) -> list[StepDecisions]:
    while steps and steps[-1] == StepDecisions():
        steps = steps[:-1]
    return steps


def differences(ours: Engine, theirs: Engine, model: Model) -> set[str]:
    """Return the names of the differences between two engines' decisions, step by step."""
    found: set[str] = set()
    mine, other = _busy(ours.decisions), _busy(theirs.decisions)
    for k, o in zip(mine, other, strict=False):
        found |= _finish_differences(k, o)
        if k.lookups != o.lookups:
            return found | _lookup_differences(k, o, model)
        if k.loads != o.loads:
            found.add(f"unexplained loads: {k.loads} / {o.loads}")
        found |= _store_differences(k, o, model)
    if len(mine) != len(other):
        found.add(f"unexplained: {len(mine)} / {len(other)} steps with decisions")
    return found


def documented_differences() -> set[str]:
    """Return the difference names of docs/embedding.md's step-by-step table."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("### Decisions, step by step", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\| `([a-z-]+)` \|", section, re.M))


def run_flow(model_config: Any, flow: Flow, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    for name in flow.unknown:
        monkeypatch.delitem(SPEC_KINDS, name)
    engines = []
    for transfer in (
        kvferry_transfer_config(
            {
                "cpu_bytes_to_use": 1 << 22,
                "executor": "cpu",
                "blocks_per_chunk": flow.blocks_per_chunk,
                "store_decoded_tokens": flow.store_decoded_tokens,
            }
        ),
        offloading_transfer_config(
            {"cpu_bytes_to_use": 1 << 22, "block_size": BLOCK * flow.blocks_per_chunk}
        ),
    ):
        engine = build_engine(
            model_config,
            flow.specs(),
            transfer,
            num_gpu_blocks=flow.num_gpu_blocks,
            mamba_cache_mode=flow.mamba_cache_mode,
        )
        flow.run(engine)
        engines.append(engine)
    ours, theirs = engines
    groups = ours.worker_config.kv_cache_groups
    model = Model(
        sliding=frozenset(
            gid for gid, g in enumerate(groups) if isinstance(g.kv_cache_spec, SlidingWindowSpec)
        ),
        mamba=frozenset(
            gid for gid, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)
        ),
        chunked=frozenset(
            gid
            for gid, g in enumerate(groups)
            if isinstance(g.kv_cache_spec, ChunkedLocalAttentionSpec)
        ),
        left_alone=frozenset(range(len(groups)))
        - set(ours.connector.get_loaded_kv_cache_group_ids(None)),
        prompt_blocks={
            rid: request.num_prompt_tokens // BLOCK for rid, request in ours.requests.items()
        },
    )
    return differences(ours, theirs, model)


@pytest.mark.parametrize("flow", FLOWS, ids=[flow.name for flow in FLOWS])
def test_decisions_match_vllms_offloading_connector_up_to_the_documented_differences(
    model_config: Any, flow: Flow, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = run_flow(model_config, flow, monkeypatch)
    assert found <= documented_differences(), found
    assert found == flow.differences


def test_every_documented_difference_shows_up_in_some_flow() -> None:
    assert documented_differences() == set().union(*(flow.differences for flow in FLOWS))
