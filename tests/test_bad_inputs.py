"""Every public entry point refuses malformed input with a typed error that says where (request,
group, field), what was expected and what came, and leaves every object exactly as it was."""

from __future__ import annotations

import importlib
import importlib.util
import json
import threading
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest
from offload_rig import chain
from session_world import CONFIG, FULL, PROMPT, World, make_world, rebound

from kvferry.adapters import messages
from kvferry.adapters.session import OffloadSession, RunningRequest
from kvferry.core.blocks import GroupBlocks
from kvferry.core.bound import BoundPlan, JobResult
from kvferry.core.catalog import Catalog, CatalogConfig, rows_for_budget
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.errors import InvalidInputError, KvferryError, PlanInvariantError
from kvferry.core.keys import OffloadKey
from kvferry.core.layout import (
    GroupLayout,
    KVLayout,
    PageRef,
    TensorLayout,
    TierLayout,
    describe_tensor,
)
from kvferry.core.load import plan_load
from kvferry.core.lookup import lookup
from kvferry.core.plan import Direction, TransferPlan
from kvferry.core.scenario_schema import parse_scenario
from kvferry.core.state import extend_keys, new_request_state
from kvferry.core.store import plan_store
from kvferry.executors import KVTensor, make_executor
from kvferry.executors.host import HostTier

HAS_TORCH_CUDA = False
if importlib.util.find_spec("torch") is not None:
    import torch

    HAS_TORCH_CUDA = bool(torch.cuda.is_available())
HAS_CUPY = importlib.util.find_spec("cupy") is not None


def _plan(**changes: Any) -> TransferPlan:
    fields: dict[str, Any] = {
        "request_id": "p1",
        "direction": Direction.LOAD,
        "blocks_per_chunk": 2,
        "keys": (OffloadKey(0, b"a"), OffloadKey(1, b"b")),
        "gpu_block_ids": [3, 4, 5, 6],
        "group_sizes": (2, 2),
        "block_indices": (0, 0),
    }
    fields.update(changes)
    return TransferPlan(**fields)


def _edit_jobs(job: BoundPlan, **first: Any) -> bytes:
    """Return a jobs message for `job` with the first entries of the named lists replaced."""
    document = json.loads(messages.encode_jobs([job]))
    entry = document["jobs"][0]
    for name, values in first.items():
        where = entry if name in entry else entry["plan"]
        where[name][: len(values)] = values
    return json.dumps(document).encode()


def _host_tensor(shape: tuple[int, ...], dtype: Any = np.uint8) -> np.ndarray:
    return np.zeros(shape, dtype=dtype)


class _CudaLike:
    """An object that says it lives in CUDA memory (no GPU needed to build one)."""

    def __init__(self) -> None:
        self.__cuda_array_interface__ = {
            "shape": (32, 24),
            "typestr": "|u1",
            "data": (1 << 20, False),
            "version": 3,
            "strides": None,
        }


def _cpu_executor(kv_caches: Any, **options: Any) -> Any:
    fields = {"kv_caches": kv_caches, "blocks_per_chunk": 2, "num_rows": 4, **options}
    return make_executor("cpu", **fields)


def _scenario(**sections: Any) -> bytes:
    """Return a small scenario document (one group, one lookup step) with `sections` replaced."""
    document: dict[str, Any] = {
        "schema_version": 1,
        "config": {
            "hash_block_size": 4,
            "blocks_per_chunk": 1,
            "groups": [{"kind": "full_attention", "block_size": 4}],
        },
        "request": {"num_tokens": 16},
        "steps": [{"op": "lookup", "num_computed_tokens": 0}],
    }
    document.update(sections)
    return json.dumps(document).encode()


def _adapter_config() -> Any:
    return importlib.import_module("kvferry.adapters.config").KvferryConfig


def _vllm() -> Any:
    return importlib.import_module("kvferry.adapters.vllm")


@attrs.frozen
class _Group:
    kv_cache_spec: object


@attrs.frozen
class _Groups:
    kv_cache_groups: list[_Group]


def _spec(class_name: str, block_size: int) -> object:
    """Return an object of a class named like a vLLM spec, with `block_size`."""
    return type(class_name, (), {"block_size": block_size, "sliding_window": None})()


def _mla(tensor: Any) -> KVTensor:
    return KVTensor(tensor=tensor, layout=TensorLayout.MLA)


def _running(**changes: Any) -> RunningRequest:
    fields: dict[str, Any] = {
        "request_id": "r2",
        "blocks": [GroupBlocks.of(range(1, 13)), GroupBlocks.of(range(20, 26))],
        "num_computed_tokens": 16,
        "num_scheduled_tokens": 16,
        "num_tokens": 48,
        "block_hashes": chain(12, 0, 0),
    }
    fields.update(changes)
    return RunningRequest(**fields)


# -- the table --------------------------------------------------------------------------------


@attrs.frozen
class Case:
    """One malformed input: how to make the call, and the error it must raise."""

    name: str
    call: Callable[[World], object]
    error: type[KvferryError]
    field: str
    """The error's `field` must contain this."""
    request: str | None = None
    """The request the error must name (None: none applies)."""
    group: int | None = None
    """The group the error must name (None: none applies)."""
    words: tuple[str, ...] = ()
    """Words the message must contain besides where, expected and got."""
    marks: tuple[Any, ...] = ()


BAD = InvalidInputError
BROKEN = PlanInvariantError

CASES = [
    # -- configuration ---------------------------------------------------------------------
    Case(
        "F < 1",
        lambda w: OffloadConfig(hash_block_size=4, blocks_per_chunk=0, groups=(FULL,)),
        BAD,
        "blocks_per_chunk",
        words=(">= 1",),
    ),
    Case(
        "F as a float",
        lambda w: OffloadConfig(hash_block_size=4, blocks_per_chunk=2.0, groups=(FULL,)),
        BAD,
        "blocks_per_chunk",
        words=("integer",),
    ),
    Case(
        "hash block size as a bool",
        lambda w: OffloadConfig(hash_block_size=True, blocks_per_chunk=1, groups=(FULL,)),
        BAD,
        "hash_block_size",
    ),
    Case(
        "hash block size as a string",
        lambda w: OffloadConfig(hash_block_size="16", blocks_per_chunk=1, groups=(FULL,)),
        BAD,
        "hash_block_size",
    ),
    Case(
        "block size not a multiple of the hash block size",
        lambda w: OffloadConfig(
            hash_block_size=8,
            blocks_per_chunk=1,
            groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16), FULL),
        ),
        BAD,
        "block_size",
        group=1,
        words=("multiple of hash_block_size=8",),
    ),
    Case(
        "no groups",
        lambda w: OffloadConfig(hash_block_size=4, blocks_per_chunk=1, groups=()),
        BAD,
        "groups",
    ),
    Case(
        "a group that is not a GroupSpec",
        lambda w: OffloadConfig(hash_block_size=4, blocks_per_chunk=1, groups=(FULL, "full")),
        BAD,
        "groups",
        group=1,
    ),
    Case(
        "store_decoded_tokens as a string",
        lambda w: OffloadConfig(
            hash_block_size=4, blocks_per_chunk=1, groups=(FULL,), store_decoded_tokens="no"
        ),
        BAD,
        "store_decoded_tokens",
    ),
    Case(
        "negative block size",
        lambda w: GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=-16),
        BAD,
        "block_size",
    ),
    Case(
        "block size as a float",
        lambda w: GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16.0),
        BAD,
        "block_size",
    ),
    Case(
        "group kind as a string",
        lambda w: GroupSpec(kind="full_attention", block_size=16),
        BAD,
        "kind",
        words=("GroupKind",),
    ),
    Case(
        "window of 0 tokens",
        lambda w: GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=0),
        BAD,
        "sliding_window",
    ),
    Case(
        "CPU tier of 0 bytes (session)",
        lambda w: OffloadSession(
            CONFIG, Catalog(CatalogConfig(capacity_rows=rows_for_budget(0, 4096)))
        ),
        BAD,
        "capacity_rows",
        words=(">= 1",),
    ),
    Case(
        "CPU tier of a negative size",
        lambda w: rows_for_budget(-4096, 4096),
        BAD,
        "budget_bytes",
    ),
    Case(
        "capacity as a float",
        lambda w: CatalogConfig(capacity_rows=8.0),
        BAD,
        "capacity_rows",
    ),
    # -- layout builders -------------------------------------------------------------------
    Case(
        "negative address",
        lambda w: PageRef(address=-1, num_blocks=4, page_stride=64, page_bytes=64),
        BAD,
        "address",
    ),
    Case(
        "page larger than its stride",
        lambda w: PageRef(address=0, num_blocks=4, page_stride=64, page_bytes=65),
        BAD,
        "page_bytes",
    ),
    Case(
        "page stride as a float",
        lambda w: PageRef(address=0, num_blocks=4, page_stride=64.0, page_bytes=64),
        BAD,
        "page_stride",
    ),
    Case(
        "layout F < 1",
        lambda w: KVLayout(
            blocks_per_chunk=0,
            groups=(
                GroupLayout(refs=(PageRef(address=0, num_blocks=4, page_stride=8, page_bytes=8),)),
            ),
        ),
        BAD,
        "blocks_per_chunk",
    ),
    Case("group without refs", lambda w: GroupLayout(refs=()), BAD, "refs"),
    Case(
        "tensor not contiguous after the block dimension",
        lambda w: describe_tensor(
            TensorLayout.MLA, address=0, shape=(8, 4, 16), strides=(64, 1, 4), itemsize=2, group=1
        ),
        BAD,
        "strides",
        group=1,
        words=("densely packed",),
    ),
    Case(
        "K/V split tensor without a size-2 dimension",
        lambda w: describe_tensor(
            TensorLayout.KV_SPLIT,
            address=0,
            shape=(3, 8, 4, 2, 8),
            strides=(512, 64, 16, 8, 1),
            itemsize=2,
            group=0,
        ),
        BAD,
        "shape",
        group=0,
    ),
    Case(
        "layout kind as a string",
        lambda w: describe_tensor(
            "mla", address=0, shape=(8, 4, 16), strides=(64, 16, 1), itemsize=2, group=0
        ),
        BAD,
        "kind",
        group=0,
    ),
    Case(
        "shape with a non-integer size",
        lambda w: describe_tensor(
            TensorLayout.MLA, address=0, shape=(8, 4.5, 16), strides=(64, 16, 1), itemsize=2
        ),
        BAD,
        "shape",
    ),
    # -- planner values ----------------------------------------------------------------------
    Case("negative block id", lambda w: GroupBlocks.of([3, -1]), BAD, "ids[1]"),
    Case("block id as a float", lambda w: GroupBlocks.of([3, 4.5]), BAD, "ids"),
    Case(
        "block ids as bools (flags passed as ids)",
        lambda w: GroupBlocks.of([True, False]),
        BAD,
        "ids",
    ),
    Case("block id as a string", lambda w: GroupBlocks.of(["3"]), BAD, "ids"),
    Case(
        "duplicate destination blocks in one plan",
        lambda w: _plan(gpu_block_ids=[3, 4, 5, 5]),
        BROKEN,
        "gpu_block_ids",
        request="p1",
        group=1,
        words=("distinct destination",),
    ),
    Case(
        "negative GPU block id in a plan",
        lambda w: _plan(gpu_block_ids=[3, -4, 5, 6]),
        BROKEN,
        "gpu_block_ids",
        request="p1",
        group=0,
    ),
    Case(
        "plan F < 1",
        lambda w: _plan(blocks_per_chunk=0),
        BROKEN,
        "blocks_per_chunk",
        request="p1",
    ),
    Case(
        "plan group count mismatch",
        lambda w: _plan(block_indices=(0,)),
        BROKEN,
        "block_indices",
        request="p1",
    ),
    Case(
        "plan GPU id as a float",
        lambda w: _plan(gpu_block_ids=[3, 4.5, 5, 6]),
        BROKEN,
        "gpu_block_ids",
        request="p1",
    ),
    Case(
        "negative CPU row",
        lambda w: rebound(w.load_job, cpu_rows=[-1] * len(w.load_job.cpu_rows)),
        BROKEN,
        "cpu_rows",
        request="r2",
    ),
    Case(
        "one CPU row short",
        lambda w: rebound(w.load_job, cpu_rows=w.load_job.cpu_rows[:-1]),
        BROKEN,
        "cpu_rows",
        request="r2",
    ),
    Case(
        "negative job id",
        lambda w: rebound(w.load_job, job_id=-1),
        BAD,
        "job_id",
        request="r2",
    ),
    Case(
        "job result: success as a string",
        lambda w: JobResult(job_id=1, success="false", nbytes=0, seconds=0.0),
        BAD,
        "success",
    ),
    Case(
        "job result: negative bytes",
        lambda w: JobResult(job_id=1, success=True, nbytes=-1, seconds=0.0),
        BAD,
        "nbytes",
    ),
    Case(
        "job result: seconds not finite",
        lambda w: JobResult(job_id=1, success=True, nbytes=0, seconds=float("inf")),
        BAD,
        "seconds",
    ),
    # -- planner functions -------------------------------------------------------------------
    Case(
        "negative prompt length",
        lambda w: new_request_state(CONFIG, "r9", num_prompt_tokens=-1),
        BAD,
        "num_prompt_tokens",
        request="r9",
    ),
    Case(
        "prompt length as a float",
        lambda w: new_request_state(CONFIG, "r9", num_prompt_tokens=31.5),
        BAD,
        "num_prompt_tokens",
        request="r9",
    ),
    Case(
        "hashes as strings",
        lambda w: new_request_state(CONFIG, "r9", num_prompt_tokens=8, block_hashes=["ab", "cd"]),
        BAD,
        "block_hashes",
        request="r9",
        group=0,
    ),
    Case(
        "hash list missing",
        lambda w: new_request_state(CONFIG, "r9", num_prompt_tokens=8, block_hashes=None),
        BAD,
        "block_hashes",
        request="r9",
    ),
    Case(
        "hash list shorter than before",
        lambda w: extend_keys(CONFIG, w.state, PROMPT[:5]),
        BAD,
        "block_hashes",
        request="r9",
        group=0,
        words=("extends the earlier one",),
    ),
    Case(
        "state of another group count",
        lambda w: extend_keys(
            OffloadConfig(hash_block_size=4, blocks_per_chunk=2, groups=(FULL,)), w.state, PROMPT
        ),
        BAD,
        "keys",
        request="r9",
        words=("1 groups",),
    ),
    Case(
        "lookup: computed beyond the tokens",
        lambda w: lookup(CONFIG, w.state, num_tokens=32, num_computed_tokens=33, tier=w.catalog),
        BAD,
        "num_computed_tokens",
        request="r9",
    ),
    Case(
        "lookup: tokens as a float",
        lambda w: lookup(CONFIG, w.state, num_tokens=32.0, num_computed_tokens=0, tier=w.catalog),
        BAD,
        "num_tokens",
        request="r9",
    ),
    Case(
        "lookup: computed as a bool",
        lambda w: lookup(CONFIG, w.state, num_tokens=32, num_computed_tokens=True, tier=w.catalog),
        BAD,
        "num_computed_tokens",
        request="r9",
    ),
    Case(
        "plan_load: one block list short",
        lambda w: plan_load(CONFIG, w.state, w.blocks[:1], num_computed_tokens=0, hit_tokens=16),
        BAD,
        "blocks",
        request="r9",
        words=("one block list per group",),
    ),
    Case(
        "plan_load: too few blocks",
        lambda w: plan_load(
            CONFIG,
            w.state,
            [GroupBlocks.of([1, 2]), w.blocks[1]],
            num_computed_tokens=0,
            hit_tokens=16,
        ),
        BAD,
        "blocks",
        request="r9",
        group=0,
    ),
    Case(
        "plan_load: more tokens than the hashes key",
        lambda w: plan_load(
            CONFIG,
            w.state,
            [GroupBlocks.of(range(1, 13)), GroupBlocks.of(range(21, 27))],
            num_computed_tokens=0,
            hit_tokens=40,
        ),
        BAD,
        "hit_tokens",
        request="r9",
        group=0,
    ),
    Case(
        "plan_load: into the null block",
        lambda w: plan_load(
            CONFIG,
            w.state,
            [w.blocks[0], GroupBlocks.of([11, 12, 13, 0], null=[3])],
            num_computed_tokens=0,
            hit_tokens=32,
        ),
        BAD,
        "blocks[3]",
        request="r9",
        group=1,
        words=("null",),
    ),
    Case(
        "plan_load: negative hit",
        lambda w: plan_load(CONFIG, w.state, w.blocks, num_computed_tokens=0, hit_tokens=-8),
        BAD,
        "hit_tokens",
        request="r9",
    ),
    Case(
        "plan_load: hit as a float",
        lambda w: plan_load(CONFIG, w.state, w.blocks, num_computed_tokens=0, hit_tokens=16.0),
        BAD,
        "hit_tokens",
        request="r9",
    ),
    Case(
        "plan_store: negative scheduled tokens",
        lambda w: plan_store(
            CONFIG,
            w.state,
            w.blocks,
            num_computed_tokens=0,
            num_scheduled_tokens=-1,
            num_tokens=32,
            tier=w.catalog,
        ),
        BAD,
        "num_scheduled_tokens",
        request="r9",
    ),
    Case(
        "plan_store: tokens as a string",
        lambda w: plan_store(
            CONFIG,
            w.state,
            w.blocks,
            num_computed_tokens=0,
            num_scheduled_tokens=8,
            num_tokens="32",
            tier=w.catalog,
        ),
        BAD,
        "num_tokens",
        request="r9",
    ),
    Case(
        "plan_store: too few blocks for the complete chunks",
        lambda w: plan_store(
            CONFIG,
            w.state,
            [GroupBlocks.of([1, 2]), w.blocks[1]],
            num_computed_tokens=0,
            num_scheduled_tokens=32,
            num_tokens=32,
            tier=w.catalog,
        ),
        BAD,
        "blocks",
        request="r9",
        group=0,
    ),
    # -- session -----------------------------------------------------------------------------
    Case(
        "session lookup: a new request with computed beyond its tokens",
        lambda w: w.session.lookup(
            "r7", block_hashes=PROMPT, num_tokens=32, num_computed_tokens=40
        ),
        BAD,
        "num_computed_tokens",
        request="r7",
    ),
    Case(
        "session lookup: a known request with computed beyond its tokens and new hashes",
        lambda w: w.session.lookup(
            "r3", block_hashes=chain(8, 1, 0), num_tokens=32, num_computed_tokens=40
        ),
        BAD,
        "num_computed_tokens",
        request="r3",
    ),
    Case(
        "session lookup: a shorter hash list",
        lambda w: w.session.lookup(
            "r2", block_hashes=PROMPT[:3], num_tokens=12, num_computed_tokens=0
        ),
        BAD,
        "block_hashes",
        request="r2",
        group=0,
    ),
    Case(
        "session lookup: request id not a string",
        lambda w: w.session.lookup(7, block_hashes=(), num_tokens=0, num_computed_tokens=0),
        BAD,
        "request_id",
    ),
    Case(
        "session start_load: unknown request",
        lambda w: w.session.start_load("r8", w.blocks, num_computed_tokens=0, hit_tokens=16),
        BAD,
        "request_id",
        request="r8",
    ),
    Case(
        "session start_load: group count mismatch",
        lambda w: w.session.start_load("r3", w.blocks[:1], num_computed_tokens=0, hit_tokens=8),
        BAD,
        "blocks",
        request="r3",
    ),
    Case(
        "session start_load: hit as a float",
        lambda w: w.session.start_load("r3", w.blocks, num_computed_tokens=0, hit_tokens=8.0),
        BAD,
        "hit_tokens",
        request="r3",
    ),
    Case(
        "session start_stores: running request with negative tokens",
        lambda w: w.session.start_stores([_running(num_scheduled_tokens=-4)]),
        BAD,
        "num_scheduled_tokens",
        request="r2",
    ),
    Case(
        "session start_stores: a new request with too few blocks, after a good one",
        lambda w: w.session.start_stores(
            [
                _running(num_computed_tokens=32, num_scheduled_tokens=16),
                _running(
                    request_id="r6",
                    blocks=[GroupBlocks.of([1]), GroupBlocks.of([2])],
                    num_computed_tokens=0,
                ),
            ]
        ),
        BAD,
        "blocks",
        request="r6",
        group=0,
    ),
    Case(
        "session start_stores: a live request id reused for another prompt",
        lambda w: w.session.start_stores([_running(block_hashes=chain(12, 1, 0))]),
        BAD,
        "block_hashes",
        request="r2",
        words=("reused for another prompt",),
    ),
    Case(
        "session report: worker out of range",
        lambda w: w.session.report(
            1, [JobResult(job_id=w.store_job.job_id, success=True, nbytes=0, seconds=0.0)]
        ),
        BAD,
        "worker",
    ),
    Case(
        "session report: a job never issued, after a good one",
        lambda w: w.session.report(
            0,
            [
                JobResult(job_id=w.store_job.job_id, success=True, nbytes=0, seconds=0.0),
                JobResult(job_id=999, success=True, nbytes=0, seconds=0.0),
            ],
        ),
        BAD,
        "job_id",
        words=("never issued",),
    ),
    Case(
        "session report: worker as a bool",
        lambda w: w.session.report(True, []),
        BAD,
        "worker",
    ),
    Case(
        "session: world size 0",
        lambda w: OffloadSession(CONFIG, w.catalog, world_size=0),
        BAD,
        "world_size",
    ),
    Case(
        "session preempt: unknown request",
        lambda w: w.session.preempt("r8"),
        BAD,
        "request_id",
        request="r8",
    ),
    # -- catalog -----------------------------------------------------------------------------
    Case(
        "catalog: a key twice in one reservation",
        lambda w: w.catalog.reserve([OffloadKey(0, b"x"), OffloadKey(0, b"x")], request="r9"),
        BAD,
        "keys",
        request="r9",
        words=("each key once",),
    ),
    Case(
        "catalog: positions that do not match the keys",
        lambda w: w.catalog.reserve([OffloadKey(0, b"x")], positions=[8, 16], request="r9"),
        BAD,
        "positions",
        request="r9",
    ),
    Case(
        "catalog: pin a key that is not ready",
        lambda w: w.catalog.pin([OffloadKey(0, b"absent")], request="r9"),
        BROKEN,
        "keys",
        request="r9",
        group=0,
        words=("absent",),
    ),
    Case(
        "catalog: unpin a key no load pins",
        lambda w: w.catalog.unpin([w.load_job.plan.keys[0]]),
        BROKEN,
        "keys",
        group=0,
    ),
    Case(
        "catalog: complete a store of a ready key",
        lambda w: w.catalog.complete_store([w.load_job.plan.keys[0]], success=True),
        BROKEN,
        "keys",
        group=0,
        words=("ready",),
    ),
    Case(
        "catalog: another lock than its own",
        lambda w: w.catalog.use_lock(threading.RLock()),
        BAD,
        "lock",
    ),
    Case("catalog: a config that is not a CatalogConfig", lambda w: Catalog({}), BAD, "config"),
    # -- scenario files ------------------------------------------------------------------------
    Case(
        "scenario: a flag written as a string",
        lambda w: parse_scenario(_scenario(request={"num_tokens": 16, "store_loaded": "false"})),
        BAD,
        "request.store_loaded",
    ),
    Case(
        "scenario: a count written as a float",
        lambda w: parse_scenario(_scenario(steps=[{"op": "lookup", "num_computed_tokens": 4.0}])),
        BAD,
        "steps[0].num_computed_tokens",
    ),
    Case(
        "scenario: a billion tokens",
        lambda w: parse_scenario(_scenario(request={"num_tokens": 10**9})),
        BAD,
        "request.num_tokens",
        words=("hash blocks",),
    ),
    Case(
        "scenario: a hash that is not hex",
        lambda w: parse_scenario(_scenario(request={"num_tokens": 4, "block_hashes": ["zz"]})),
        BAD,
        "request.block_hashes[0]",
    ),
    Case(
        "scenario: not UTF-8",
        lambda w: parse_scenario(b"\xff\xfe{}"),
        BAD,
        "scenario",
        words=("UTF-8",),
    ),
    # -- environment ---------------------------------------------------------------------------
    *(
        [
            Case(
                "environment: a number in superscript digits",
                lambda w: _adapter_config().from_env({"KVFERRY_BLOCKS_PER_CHUNK": "\u00b2"}),
                BAD,
                "KVFERRY_BLOCKS_PER_CHUNK",
            ),
            Case(
                "environment: a 5000-digit size",
                lambda w: _adapter_config().from_env({"KVFERRY_CPU_TIER_BYTES": "9" * 5000}),
                BAD,
                "KVFERRY_CPU_TIER_BYTES",
            ),
            Case(
                "environment: a timeout of 0 seconds",
                lambda w: _adapter_config().from_env({"KVFERRY_WORKER_REPLY_TIMEOUT": "0"}),
                BAD,
                "KVFERRY_WORKER_REPLY_TIMEOUT",
            ),
            Case(
                "adapter config: a CPU tier larger than the host",
                lambda w: (
                    _adapter_config().from_mapping({"cpu_tier_bytes": 1 << 62}).catalog_config(4096)
                ),
                BAD,
                "cpu_tier_bytes",
                words=("host's memory",),
            ),
            Case(
                "adapter config: a GPU setting with a host executor",
                lambda w: (
                    _adapter_config()
                    .from_mapping({"staging_bytes": "1MiB"})
                    .executor_options(on_gpu=False)
                ),
                BAD,
                "staging_bytes",
                words=("GPU executors only",),
            ),
        ]
        if importlib.util.find_spec("kvferry.adapters.config")
        else []
    ),
    # -- executors ---------------------------------------------------------------------------
    Case(
        "host tier larger than the host",
        lambda w: HostTier(tier=TierLayout(rows=(1 << 50,), pitch=(4096,))),
        BAD,
        "num_rows",
        words=("host's memory",),
    ),
    Case(
        "executor: CPU tier of 0 bytes",
        lambda w: _cpu_executor([[_mla(_host_tensor((8, 24)))]], num_rows=0),
        BAD,
        "num_rows",
        group=0,
    ),
    Case(
        "host tier of 0 rows",
        lambda w: HostTier(tier=TierLayout(rows=(4, 0), pitch=(64, 32))),
        BAD,
        "num_rows",
        group=1,
    ),
    Case(
        "executor: F < 1",
        lambda w: _cpu_executor([[_mla(_host_tensor((8, 24)))]], blocks_per_chunk=0),
        BAD,
        "blocks_per_chunk",
    ),
    Case(
        "executor: tensor not contiguous",
        lambda w: _cpu_executor(
            [[_mla(_host_tensor((8, 4)))], [_mla(_host_tensor((8, 4, 6)).transpose(0, 2, 1))]]
        ),
        BAD,
        "strides",
        group=1,
    ),
    Case(
        "executor: object dtype",
        lambda w: _cpu_executor([[_mla(np.empty((8, 4), dtype=object))]]),
        BAD,
        "dtype",
        group=0,
    ),
    Case(
        "executor: a CUDA tensor for the cpu executor",
        lambda w: _cpu_executor([[_mla(_host_tensor((32, 24)))], [_mla(_CudaLike())]]),
        BAD,
        "kv_caches",
        group=1,
        words=("host tensors",),
    ),
    Case(
        "executor: not a KVTensor",
        lambda w: _cpu_executor([[_host_tensor((8, 24))]]),
        BAD,
        "kv_caches",
        group=0,
    ),
    Case(
        "executor: a plan bound for another layout",
        lambda w: w.cpu.submit(rebound(w.store_job, job_id=901, layout_fingerprint="0" * 16)),
        BAD,
        "layout_fingerprint",
        request="r2",
    ),
    Case(
        "executor: block id beyond the tensor",
        lambda w: w.cpu.submit(
            rebound(
                w.load_job,
                job_id=902,
                plan=attrs.evolve(
                    w.load_job.plan,
                    gpu_block_ids=[*w.load_job.plan.gpu_block_ids.tolist()[:-1], 32],
                ),
            )
        ),
        BROKEN,
        "gpu_block_ids",
        request="r2",
        group=1,
    ),
    Case(
        "executor: CPU row beyond the tier",
        lambda w: w.cpu.submit(
            rebound(w.load_job, job_id=903, cpu_rows=[8] * len(w.load_job.cpu_rows))
        ),
        BROKEN,
        "cpu_rows",
        request="r2",
        group=0,
    ),
    Case(
        "executor: a plan of another group count",
        lambda w: w.cpu.submit(
            BoundPlan(
                job_id=904,
                plan=_plan(
                    keys=(OffloadKey(0, b"a"),),
                    gpu_block_ids=[1, 2],
                    group_sizes=(2,),
                    block_indices=(0,),
                ),
                cpu_rows=[0],
            )
        ),
        BROKEN,
        "group_sizes",
        request="p1",
    ),
    Case(
        "executor: a store writing one row twice",
        lambda w: w.cpu.submit(
            rebound(w.store_job, job_id=905, cpu_rows=[0] * len(w.store_job.cpu_rows))
        ),
        BROKEN,
        "cpu_rows",
        request="r2",
        group=0,
    ),
    Case(
        "executor: a job id already in flight",
        lambda w: w.cpu.submit(rebound(w.store_job, job_id=900)),
        BAD,
        "job_id",
        request="r2",
    ),
    Case("executor: wait for an unknown job", lambda w: w.cpu.wait([77]), BAD, "job_ids"),
    Case(
        "torch executor: host tensors",
        lambda w: make_executor(
            "torch", kv_caches=[[_mla(_host_tensor((8, 24)))]], blocks_per_chunk=1, num_rows=2
        ),
        BAD,
        "kv_caches",
        group=0,
        marks=(pytest.mark.skipif(not HAS_TORCH_CUDA, reason="needs torch with CUDA"),),
    ),
    Case(
        "cupy executor: host tensors",
        lambda w: make_executor(
            "cupy", kv_caches=[[_mla(_host_tensor((8, 24)))]], blocks_per_chunk=1, num_rows=2
        ),
        BAD,
        "kv_caches",
        group=0,
        marks=(pytest.mark.skipif(not HAS_CUPY, reason="needs cupy"),),
    ),
    # -- adapters: configuration and the vLLM facade -----------------------------------------
    *(
        [
            Case(
                "adapter config: F < 1",
                lambda w: _adapter_config().from_mapping({"blocks_per_chunk": 0}),
                BAD,
                "blocks_per_chunk",
            ),
            Case(
                "adapter config: F as a float",
                lambda w: _adapter_config().from_mapping({"blocks_per_chunk": 2.5}),
                BAD,
                "blocks_per_chunk",
            ),
            Case(
                "adapter config: a CPU tier of 0 bytes",
                lambda w: _adapter_config().from_mapping({"cpu_tier_bytes": 0}),
                BAD,
                "cpu_tier_bytes",
            ),
            Case(
                "adapter config: a budget that holds no row",
                lambda w: (
                    _adapter_config().from_mapping({"cpu_tier_bytes": 100}).catalog_config(4096)
                ),
                BAD,
                "cpu_tier_bytes",
                words=("at least one row",),
            ),
            Case(
                "adapter config: a flag as a string",
                lambda w: _adapter_config().from_mapping({"record_events": "maybe"}),
                BAD,
                "record_events",
            ),
        ]
        if importlib.util.find_spec("kvferry.adapters.config")
        else []
    ),
    *(
        [
            Case(
                "vLLM: a spec of no known kind",
                lambda w: _vllm().group_kind_of(object(), group=2),
                BAD,
                "kv_cache_spec",
                group=2,
            ),
            Case(
                "vLLM: no KV-cache groups",
                lambda w: _vllm().offload_config_from_vllm(_Groups([]), hash_block_size=16),
                BAD,
                "kv_cache_groups",
            ),
            Case(
                "vLLM: block size not a multiple of the hash block size",
                lambda w: _vllm().offload_config_from_vllm(
                    _Groups(
                        [_Group(_spec("FullAttentionSpec", 16)), _Group(_spec("MambaSpec", 24))]
                    ),
                    hash_block_size=16,
                ),
                BAD,
                "block_size",
                group=1,
            ),
            Case(
                "vLLM: block tables that are no sequence",
                lambda w: _vllm().blocks_from_vllm(7),
                BAD,
                "blocks",
            ),
        ]
        if importlib.util.find_spec("kvferry.adapters.vllm")
        else []
    ),
    # -- messages ----------------------------------------------------------------------------
    Case("message: not JSON", lambda w: messages.decode_jobs(b"{oops"), BAD, "message"),
    Case(
        "message: job id as a string",
        lambda w: messages.decode_jobs(
            messages.encode_jobs([w.load_job]).replace(
                f'"job_id": {w.load_job.job_id}'.encode(), b'"job_id": "2"'
            )
        ),
        BAD,
        "jobs[0].job_id",
        request="r2",
    ),
    Case(
        "message: a CPU row as a float",
        lambda w: messages.decode_jobs(_edit_jobs(w.load_job, cpu_rows=[0.5])),
        BAD,
        "jobs[0].cpu_rows[0]",
        request="r2",
    ),
    Case(
        "message: a GPU block id as a float",
        lambda w: messages.decode_jobs(_edit_jobs(w.load_job, gpu_block_ids=[2.0])),
        BAD,
        "jobs[0].plan.gpu_block_ids[0]",
        request="r2",
    ),
    Case(
        "message: duplicate destination blocks",
        lambda w: messages.decode_jobs(
            messages.encode_jobs([w.load_job]).replace(
                str(w.load_job.plan.gpu_block_ids.tolist()[1]).encode(),
                str(w.load_job.plan.gpu_block_ids.tolist()[0]).encode(),
            )
        ),
        BROKEN,
        "gpu_block_ids",
        request="r2",
        group=0,
    ),
    Case(
        "message: worker as a string",
        lambda w: messages.decode_completions(
            messages.encode_completions(0, []).replace(b'"worker": 0', b'"worker": "0"')
        ),
        BAD,
        "worker",
    ),
    Case(
        "message: seconds not finite",
        lambda w: messages.decode_completions(
            messages.encode_completions(
                0, [JobResult(job_id=1, success=True, nbytes=0, seconds=0.5)]
            ).replace(b"0.5", b"NaN")
        ),
        BAD,
        "message",
        words=("finite number", "NaN"),
    ),
    Case(
        "message: a negative byte count",
        lambda w: messages.decode_completions(
            messages.encode_completions(
                0, [JobResult(job_id=1, success=True, nbytes=5, seconds=0.5)]
            ).replace(b'"nbytes": 5', b'"nbytes": -5')
        ),
        BAD,
        "results[0].nbytes",
    ),
    Case(
        "message: a plan without a direction",
        lambda w: messages.decode_jobs(
            messages.encode_jobs([w.load_job]).replace(b'"direction": "load",', b"")
        ),
        BAD,
        "jobs[0].plan.direction",
        request="r2",
    ),
    Case(
        "message: a misspelled field",
        lambda w: messages.decode_jobs(
            messages.encode_jobs([w.store_job]).replace(
                b'"layout_fingerprint"', b'"layout_fingerprnt"'
            )
        ),
        BAD,
        "jobs[0].layout_fingerprnt",
        words=("did you mean 'layout_fingerprint'",),
    ),
]


def _params() -> list[Any]:
    return [pytest.param(case, id=case.name, marks=case.marks) for case in CASES]


@pytest.mark.parametrize("case", _params())
def test_bad_input_raises_a_located_typed_error_and_changes_nothing(case: Case) -> None:
    world = make_world()
    before = world.snapshot()
    with pytest.raises(case.error) as caught:
        case.call(world)
    error = caught.value
    message = str(error)
    assert case.field in error.field, (error.field, message)  # type: ignore[attr-defined]
    assert error.request == case.request, message  # type: ignore[attr-defined]
    assert error.group == case.group, message  # type: ignore[attr-defined]
    assert f"field {error.field!r}" in message  # type: ignore[attr-defined]
    if case.request is not None:
        assert f"request {case.request!r}" in message
    if case.group is not None:
        assert f"group {case.group}" in message
    assert ": expected " in message and ", got " in message, message
    for word in case.words:
        assert word in message, (word, message)
    assert world.snapshot() == before


# -- the command line ---------------------------------------------------------------------------


@attrs.frozen
class CliCase:
    """A malformed command line (or environment, or file): exit 2 and one line naming it."""

    name: str
    argv: tuple[str, ...]
    words: tuple[str, ...]
    environ: tuple[tuple[str, str], ...] = ()
    file: bytes | None = None
    """Written to a file whose path replaces `FILE` in `argv`."""


CLI_CASES = [
    CliCase("no command", (), ("required: command",)),
    CliCase("an unknown command", ("plant",), ("invalid choice",)),
    CliCase("requests of 0", ("demo", "--requests", "0"), ("--requests", ">= 1")),
    CliCase("a negative seed", ("demo", "--seed", "-1"), ("--seed", ">= 0")),
    CliCase("ranks in superscript", ("demo", "--tp", "\u00b2"), ("--tp",)),
    CliCase("5000-digit requests", ("demo", "--requests", "9" * 5000), ("5000 characters",)),
    CliCase("an unknown profile", ("demo", "--profile", "lama"), ("'profile'", "llama")),
    CliCase("an unknown executor", ("demo", "--executor", "tourch"), ("did you mean 'torch'",)),
    CliCase("an unknown policy", ("demo", "--eviction-policy", "lfu"), ("eviction_policy",)),
    CliCase(
        "a size in other digits", ("demo", "--cpu-tier-bytes", "\u00b2GiB"), ("cpu_tier_bytes",)
    ),
    CliCase("a tier no host has", ("demo", "--cpu-tier-bytes", str(1 << 62)), ("host's memory",)),
    CliCase("a rank count that splits no heads", ("demo", "--tp", "3"), ("divisor",)),
    CliCase(
        "a missing config file", ("demo", "--config", "/nonexistent/k.toml"), ("No such file",)
    ),
    CliCase(
        "a config file that is not TOML", ("demo", "--config", "FILE"), ("valid TOML",), file=b"x ="
    ),
    CliCase(
        "an unknown variable",
        ("demo",),
        ("KVFERRY_EXECUTR", "did you mean"),
        environ=(("KVFERRY_EXECUTR", "cpu"),),
    ),
    CliCase(
        "a GPU setting for the cpu executor",
        ("demo",),
        ("staging_bytes",),
        environ=(("KVFERRY_STAGING_BYTES", "1MiB"),),
    ),
    CliCase("a missing scenario", ("plan", "/nonexistent/s.json"), ("No such file",)),
    CliCase("a scenario that is a folder", ("plan", "/"), ("Is a directory",)),
    CliCase("a scenario that is not JSON", ("plan", "FILE"), ("JSON text",), file=b"{oops"),
    CliCase(
        "a scenario with a wrong kind",
        ("plan", "FILE"),
        ("request.num_tokens",),
        file=_scenario(request={"num_tokens": "16"}),
    ),
    CliCase("an unknown benchmark", ("bench", "planer"), ("benchmark", "did you mean")),
]


@pytest.mark.parametrize("case", CLI_CASES, ids=[c.name for c in CLI_CASES])
def test_a_malformed_command_line_exits_2_with_one_line_naming_it(
    case: CliCase,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvferry.adapters import cli

    for name, value in case.environ:
        monkeypatch.setenv(name, value)
    argv = list(case.argv)
    if case.file is not None:
        path = tmp_path / "input"
        path.write_bytes(case.file)
        argv = [str(path) if arg == "FILE" else arg for arg in argv]
    try:
        code = cli.main([*argv, "--no-progress"] if argv[:1] == ["demo"] else argv)
    except SystemExit as exit_:  # argparse exits from inside main
        code = exit_.code
    captured = capsys.readouterr()
    assert code == cli.EXIT_INPUT, captured.err
    assert captured.err.count("\n") == 1 and "error: " in captured.err, captured.err
    assert captured.out == ""
    for word in case.words:
        assert word in captured.err, (word, captured.err)
