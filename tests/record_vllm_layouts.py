"""vLLM 0.33's KV caches for four model shapes, planned and allocated by vLLM's own worker code
on the CPU, and recorded as the JSON fixtures in `tests/vllm_layouts/`.

Each model is its layers' `KVCacheSpec`s (the dimensions of a real model, fewer layers) and the
attention backend a CUDA worker picks for them. From there everything is vLLM's: the backend's
`customize_spec`, the hybrid grouping and `kv_cache_config` (`get_global_kv_cache_groups`,
`get_kv_cache_configs`), the kernel block sizes (`prepare_kernel_block_sizes`), the one shared
buffer and its per-layer views (`allocate_kv_cache`, in the layout the connector requires) and
cross-layer KV sharing (`add_kv_sharing_layers_to_kv_cache_groups`). A fixture records what the
worker then hands `register_kv_caches`: the groups and, per layer, the view's shape, stride,
storage offset and dtype into the buffer.

Imports vLLM: load it only after `pytest.importorskip("vllm")`.
`python tests/record_vllm_layouts.py` rewrites the fixtures (review the diff before committing).
"""

from __future__ import annotations

import json
import math
import tempfile
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import (
    add_kv_sharing_layers_to_kv_cache_groups,
    allocate_kv_cache,
    customize_attention_spec,
    prepare_kernel_block_sizes,
)
from vllm_rig import tiny_model_config

from kvferry.adapters.layer_pages import REQUIRED_KV_CACHE_LAYOUT
from kvferry.adapters.vllm import group_spec_from_vllm
from kvferry.core.errors import InvalidInputError

FIXTURE_DIR = Path(__file__).parent / "vllm_layouts"
NUM_BLOCKS = 40
"""Manager blocks of memory each model's KV cache is given (vLLM may fit more or fewer)."""
BF16 = torch.bfloat16


@dataclass(frozen=True)
class LayoutModel:
    """One model shape: its layers' specs, their CUDA attention backends, the block size."""

    description: str
    specs: dict[str, KVCacheSpec]
    backends: dict[str, type]
    block_size: int
    shared: dict[str, str]
    """Layers that reuse another layer's KV cache (vLLM's cross-layer KV sharing)."""


def _attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _full_attention() -> LayoutModel:
    specs: dict[str, KVCacheSpec] = {
        _attn(i): FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=BF16)
        for i in range(4)
    }
    return LayoutModel(
        description=(
            "Llama-3-8B-like: full attention, 8 KV heads of 128, bfloat16, 16-token blocks, "
            "FlashAttention; 4 layers plus a fifth that shares layer 3's KV cache"
        ),
        specs=specs,
        backends=dict.fromkeys(specs, FlashAttentionBackend),
        block_size=16,
        shared={_attn(4): _attn(3)},
    )


def _sliding_window() -> LayoutModel:
    specs: dict[str, KVCacheSpec] = {}
    for i in range(4):
        if i % 2 == 0:
            specs[_attn(i)] = SlidingWindowSpec(
                block_size=16, num_kv_heads=8, head_size=64, dtype=BF16, sliding_window=128
            )
        else:
            specs[_attn(i)] = FullAttentionSpec(
                block_size=16, num_kv_heads=8, head_size=64, dtype=BF16
            )
    return LayoutModel(
        description=(
            "gpt-oss-20b-like: sliding-window (128 tokens) and full attention layers "
            "alternating, 8 KV heads of 64, bfloat16, 16-token blocks, FlashAttention; 4 layers"
        ),
        specs=specs,
        backends=dict.fromkeys(specs, FlashAttentionBackend),
        block_size=16,
        shared={},
    )


def _mla() -> LayoutModel:
    specs: dict[str, KVCacheSpec] = {
        _attn(i): MLAAttentionSpec(
            block_size=128, num_kv_heads=1, head_size=576, dtype=BF16, cache_dtype_str="auto"
        )
        for i in range(3)
    }
    return LayoutModel(
        description=(
            "DeepSeek-V2-Lite-like: MLA, one latent of 512 + 64 rope dims, bfloat16, "
            "--block-size 128 with FlashMLA (64-token kernel blocks: two per block); 3 layers"
        ),
        specs=specs,
        backends=dict.fromkeys(specs, FlashMLABackend),
        block_size=128,
        shared={},
    )


def _mamba_hybrid() -> LayoutModel:
    conv, ssm = (3, 640), (8, 64, 64)
    mamba_page = MambaSpec(block_size=1, shapes=(conv, ssm), dtypes=(BF16, torch.float32))
    attention_1 = FullAttentionSpec(block_size=1, num_kv_heads=4, head_size=64, dtype=BF16)
    # vLLM's platform (`_align_hybrid_block_size`) grows the attention block, in steps of the
    # backend's kernel alignment, until its page holds a Mamba state, and pads the state pages
    # to the attention page.
    alignment = 16
    block_size = alignment * math.ceil(
        mamba_page.page_size_bytes / (alignment * attention_1.page_size_bytes)
    )
    page = block_size * attention_1.page_size_bytes
    specs: dict[str, KVCacheSpec] = {}
    for i in range(4):
        if i == 1:
            specs[_attn(i)] = FullAttentionSpec(
                block_size=block_size, num_kv_heads=4, head_size=64, dtype=BF16
            )
        else:
            specs[f"model.layers.{i}.mixer"] = MambaSpec(
                block_size=block_size,
                shapes=(conv, ssm),
                dtypes=(BF16, torch.float32),
                page_size_padded=page,
                mamba_cache_mode="align",
            )
    return LayoutModel(
        description=(
            "Mamba2 hybrid (Nemotron-H-like): three Mamba2 layers (conv state 3 x 640 bfloat16, "
            "SSM state 8 x 64 x 64 float32) and one full attention layer (4 KV heads of 64, "
            f"bfloat16, FlashAttention); blocks of {block_size} tokens so that an attention "
            "page holds a state, state pages padded to it; prefix caching in align mode"
        ),
        specs=specs,
        backends={name: FlashAttentionBackend for name in specs if "attn" in name},
        block_size=block_size,
        shared={},
    )


MODELS: dict[str, Callable[[], LayoutModel]] = {
    "full_attention": _full_attention,
    "sliding_window": _sliding_window,
    "mla": _mla,
    "mamba_hybrid": _mamba_hybrid,
}
"""The recorded models by fixture name (`tests/vllm_layouts/NAME.json`)."""


@dataclass
class Allocated:
    """What vLLM's worker built for one model: its config, kernel block sizes, the views."""

    config: KVCacheConfig
    kernel_block_sizes: list[int]
    kv_caches: dict[str, torch.Tensor]


def _vllm_config(model_config: ModelConfig, block_size: int) -> VllmConfig:
    cache_config = CacheConfig(
        block_size=block_size, enable_prefix_caching=True, mamba_cache_mode="align"
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=512,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=cache_config,
        device_config=DeviceConfig("cpu"),
    )
    # vLLM turns its hybrid allocator off on a CPU platform; a CUDA worker keeps it on.
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    cache_config.kv_cache_layout = REQUIRED_KV_CACHE_LAYOUT
    return vllm_config


def allocate(name: str, model_config: ModelConfig) -> Allocated:
    """Return the KV caches vLLM's worker allocates for model `name`, on the CPU."""
    model = MODELS[name]()
    specs = {
        layer: customize_attention_spec(model.backends[layer], spec)
        if isinstance(spec, AttentionSpec)
        else spec
        for layer, spec in model.specs.items()
    }
    vllm_config = _vllm_config(model_config, model.block_size)
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    page = sum(spec.page_size_bytes for spec in specs.values())
    (config,) = get_kv_cache_configs(vllm_config, [specs], [page * NUM_BLOCKS], groups)
    config.kv_cache_layout = REQUIRED_KV_CACHE_LAYOUT
    add_kv_sharing_layers_to_kv_cache_groups(model.shared, config.kv_cache_groups)
    # The worker's attention groups: what `prepare_kernel_block_sizes` reads of them.
    attn_groups = [
        [
            types.SimpleNamespace(backend=model.backends[layer], kv_cache_spec=group.kv_cache_spec)
            for layer in group.layer_names[:1]
            if layer in model.backends
        ]
        for group in config.kv_cache_groups
    ]
    kernel_block_sizes = prepare_kernel_block_sizes(config, attn_groups)  # type: ignore[arg-type]
    kv_caches = allocate_kv_cache(
        config,
        torch.device("cpu"),
        KVCacheLayout[REQUIRED_KV_CACHE_LAYOUT],
        kernel_block_sizes,
    )
    for layer, target in model.shared.items():
        kv_caches[layer] = kv_caches[target]
    return Allocated(config=config, kernel_block_sizes=kernel_block_sizes, kv_caches=kv_caches)


def _layer_spec(spec: KVCacheSpec) -> KVCacheSpec:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return next(iter(spec.kv_cache_specs.values()))
    return spec


def _kind(spec: KVCacheSpec, group: int) -> str | None:
    try:
        return group_spec_from_vllm(spec, group=group).kind.value
    except InvalidInputError:
        return None


def record(name: str, model_config: ModelConfig) -> str:
    """Return fixture `name`'s text: what vLLM's worker hands `register_kv_caches`."""
    allocated = allocate(name, model_config)
    config = allocated.config
    cacheable = set(config.prefix_cacheable_group_ids)
    buffers = {tensor.size for tensor in config.kv_cache_tensors}
    (buffer_bytes,) = buffers
    groups = []
    for gid, group in enumerate(config.kv_cache_groups):
        spec = _layer_spec(group.kv_cache_spec)
        groups.append(
            {
                "group": gid,
                "spec": type(spec).__name__,
                "kind": _kind(spec, gid),
                "prefix_cacheable": gid in cacheable,
                "block_size": spec.block_size,
                "kernel_block_size": allocated.kernel_block_sizes[gid],
                "page_size_bytes": spec.page_size_bytes,
                "layer_names": list(group.layer_names),
            }
        )
    layers = {}
    for layer, view in allocated.kv_caches.items():
        layers[layer] = {
            "dtype": str(view.dtype).removeprefix("torch."),
            "shape": list(view.shape),
            "stride": list(view.stride()),
            "storage_offset": view.storage_offset(),
        }
    fixture: dict[str, Any] = {
        "model": name,
        "description": MODELS[name]().description,
        "recorded_with": "vLLM 0.33 (allocate_kv_cache on the CPU, the hybrid allocator on)",
        "kv_cache_layout": REQUIRED_KV_CACHE_LAYOUT,
        "num_blocks": config.num_blocks,
        "buffer_bytes": buffer_bytes,
        "groups": groups,
        "kv_cache_tensors": [
            {
                "size": tensor.size,
                "offset": tensor.offset,
                "layer_stride": tensor.layer_stride,
                "block_stride": tensor.block_stride,
                "layers": list(tensor.layers),
            }
            for tensor in config.kv_cache_tensors
        ],
        "layers": layers,
    }
    return json.dumps(fixture, indent=2) + "\n"


def fixture_path(name: str) -> Path:
    """Return where fixture `name` is kept."""
    return FIXTURE_DIR / f"{name}.json"


def main() -> None:
    """Rewrite every fixture from vLLM's allocator."""
    with tempfile.TemporaryDirectory() as folder:
        model_config = tiny_model_config(Path(folder) / "model")
        FIXTURE_DIR.mkdir(exist_ok=True)
        for name in MODELS:
            fixture_path(name).write_text(record(name, model_config), encoding="utf-8")
            print(f"wrote {fixture_path(name)}")


if __name__ == "__main__":
    main()
