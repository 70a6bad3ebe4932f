"""vLLM 0.33's KV caches, rebuilt from the allocator's recorded output (`tests/vllm_layouts/`),
mapped by `kvferry.adapters.layer_pages` and copied by every executor: a store then a load of
blocks of every offloaded group round trip each planned page byte-exact, and no other byte of the
shared buffer or of the CPU tier moves. Needs torch, not vLLM: on a CUDA machine the same body runs
the `torch` and `cupy` executors on CUDA tensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _harness import GroupMove, bound_plan

from kvferry.core.config import GroupKind
from kvferry.core.plan import Direction
from kvferry.executors import make_executor

torch = pytest.importorskip("torch")

from kvferry.adapters.layer_pages import LayerGroup, group_kv_tensors  # noqa: E402

pytestmark = pytest.mark.usefixtures("route")

FIXTURES = sorted((Path(__file__).parents[1] / "vllm_layouts").glob("*.json"))
EXECUTORS = [
    "cpu",
    pytest.param("torch", marks=pytest.mark.gpu),
    pytest.param("cupy", marks=pytest.mark.gpu),
]
POISON = 0xEE
TIER_FILL = 0xAB


def _fixture(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return loaded


def _views(fixture: dict[str, Any], buffer: Any) -> dict[str, Any]:
    """Return the per-layer views as vLLM's allocator made them: `as_strided` into `buffer`."""
    views = {}
    for layer, v in fixture["layers"].items():
        typed = buffer.view(getattr(torch, v["dtype"]))
        views[layer] = typed.as_strided(v["shape"], v["stride"], v["storage_offset"])
    return views


def _offloaded(fixture: dict[str, Any]) -> list[LayerGroup]:
    return [
        LayerGroup(group=g["group"], kind=GroupKind(g["kind"]), layer_names=g["layer_names"])
        for g in fixture["groups"]
        if g["kind"] is not None and g["prefix_cacheable"]
    ]


def _page_addresses(fixture: dict[str, Any], layer: str, block: int) -> Any:
    """Return the buffer byte offsets of `layer`'s page of manager block `block`, in memory
    order, computed from the recorded view alone (kernel blocks `b*k .. b*k + k - 1`)."""
    v = fixture["layers"][layer]
    itemsize = torch.empty(0, dtype=getattr(torch, v["dtype"])).element_size()
    ratio = v["shape"][0] // fixture["num_blocks"]
    inner = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(v["shape"][1:], v["stride"][1:], strict=True):
        inner = inner.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    kernel = torch.arange(block * ratio, (block + 1) * ratio, dtype=torch.int64) * v["stride"][0]
    elements = v["storage_offset"] + kernel.reshape(-1, 1) + inner.reshape(1, -1)
    addresses = elements.reshape(-1, 1) * itemsize + torch.arange(itemsize)
    return addresses.reshape(-1).sort().values


def _moves(
    num_blocks: int, groups: int, f: int, rows: list[int], generator: Any
) -> tuple[list[GroupMove], list[GroupMove]]:
    """Return store and load moves of two chunks per group; every block id is used once (the
    groups share one buffer, so a block id belongs to one group at a time). Each group has its
    own row ids, so groups may use the same row numbers."""
    ids = [int(i) for i in torch.randperm(num_blocks, generator=generator)]
    stores, loads = [], []
    for g in range(groups):
        source = ids[4 * f * g : 4 * f * g + 2 * f]
        target = ids[4 * f * g + 2 * f : 4 * f * (g + 1)]
        group_rows = tuple(rows[2 * g : 2 * g + 2])
        stores.append(GroupMove(ids=tuple(source), first=0, rows=group_rows))
        loads.append(GroupMove(ids=tuple(target), first=0, rows=group_rows))
    return stores, loads


def _read(buffer: Any) -> Any:
    if buffer.is_cuda:
        torch.cuda.synchronize()
    return buffer.cpu().view(torch.uint8).clone()


def _write(buffer: Any, values: Any) -> None:
    buffer.copy_(values.view(torch.int8).to(buffer.device))
    if buffer.is_cuda:
        torch.cuda.synchronize()


@pytest.mark.parametrize("name", EXECUTORS)
@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
@pytest.mark.parametrize("f", [1, 2])
def test_a_recorded_vllm_layout_round_trips_every_group_and_touches_nothing_else(
    name: str, path: Path, f: int
) -> None:
    if name == "cupy":
        pytest.importorskip("cupy")
    fixture = _fixture(path)
    device = "cpu" if name == "cpu" else "cuda"
    groups = _offloaded(fixture)
    num_blocks = fixture["num_blocks"]
    generator = torch.Generator().manual_seed(f)
    buffer = torch.zeros(fixture["buffer_bytes"], dtype=torch.int8, device=device)
    source = torch.randint(0, 256, (buffer.numel(),), dtype=torch.uint8, generator=generator)
    _write(buffer, source)
    num_rows = 2 * len(groups) + 3
    executor = make_executor(
        name,
        kv_caches=group_kv_tensors(_views(fixture, buffer), groups, num_blocks),
        blocks_per_chunk=f,
        num_rows=num_rows,
    )
    try:
        executor.host_tier.array[:] = TIER_FILL
        rows = [int(r) for r in torch.randperm(num_rows, generator=generator)]
        stores, loads = _moves(num_blocks, len(groups), f, rows, generator)
        fingerprint = executor.layout.fingerprint

        executor.submit(bound_plan(1, Direction.STORE, f, stores, fingerprint))
        (stored,) = executor.wait([1])
        assert stored.success, stored.error
        assert torch.equal(_read(buffer), source)
        layout = executor.host_tier.tier  # each group's rows in its own region, at its pitch
        for g, move in enumerate(stores):
            for row in sorted(set(range(num_rows)) - set(move.rows)):
                start = layout.row_offset(g, row)
                assert (
                    executor.host_tier.array[start : start + layout.pitch[g]] == TIER_FILL
                ).all()
        tier_after_store = executor.host_tier.array.copy()

        _write(buffer, torch.full_like(source, POISON))
        executor.submit(bound_plan(2, Direction.LOAD, f, loads, fingerprint))
        (loaded,) = executor.wait([2])
        assert loaded.success, loaded.error
        assert (executor.host_tier.array == tier_after_store).all()

        expected = torch.full_like(source, POISON)
        for group, store, load in zip(groups, stores, loads, strict=True):
            for layer in group.layer_names:
                for a, b in zip(store.ids, load.ids, strict=True):
                    expected[_page_addresses(fixture, layer, b)] = source[
                        _page_addresses(fixture, layer, a)
                    ]
        after = _read(buffer)
        wrong = int((after != expected).sum())
        assert wrong == 0, f"{wrong} of {after.numel()} buffer bytes differ from the plan's"
        assert int((expected != POISON).sum()) > 0
    finally:
        executor.close()


def test_the_recorded_layouts_cover_full_attention_sliding_window_mla_and_mamba() -> None:
    specs = {group["spec"] for path in FIXTURES for group in _fixture(path)["groups"]}
    assert {"FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec", "MambaSpec"} <= specs


def test_the_mla_layout_is_recorded_in_kernel_blocks_half_its_blocks() -> None:
    split = {
        path.stem
        for path in FIXTURES
        for v in _fixture(path)["layers"].values()
        if v["shape"][0] != _fixture(path)["num_blocks"]
    }
    assert split == {"mla"}
    mla = _fixture(FIXTURES[[p.stem for p in FIXTURES].index("mla")])
    assert all(v["shape"][0] == 2 * mla["num_blocks"] for v in mla["layers"].values())


def test_the_recorded_layouts_share_a_cache_between_two_layers() -> None:
    full = _fixture(FIXTURES[[p.stem for p in FIXTURES].index("full_attention")])
    (group,) = _offloaded(full)
    buffer = torch.zeros(full["buffer_bytes"], dtype=torch.int8)
    (tensors,) = group_kv_tensors(_views(full, buffer), [group], full["num_blocks"])
    assert len(group.layer_names) == len(tensors) + 1
