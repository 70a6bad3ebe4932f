"""vLLM's objects -> kvferry values: group kinds and specs, and block tables.

The mapping under `kvferry.adapters.vllm_connector` (vLLM's KV connector), duck-typed on
vLLM's class and attribute names so that it never imports vLLM and is tested without it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from kvferry.core.blocks import GroupBlocks
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.errors import InvalidInputError
from kvferry.core.kinds import KIND_RULES, PARAMETER_DEFAULTS

# -- what vLLM's objects look like (only the attributes read here) ----------------------------


class VllmBlock(Protocol):
    """vLLM's `KVCacheBlock`, as far as kvferry reads it."""

    @property
    def block_id(self) -> int:
        """The GPU block id."""
        ...

    @property
    def block_hash(self) -> object | None:
        """Set when the block is full and in the GPU prefix cache; None for a fresh block."""
        ...

    @property
    def is_null(self) -> bool:
        """True for the engine's shared null block (a block the group no longer needs)."""
        ...


# -- KV-cache config -> OffloadConfig -----------------------------------------------------------

SPEC_KINDS: dict[str, GroupKind] = {
    "FullAttentionSpec": GroupKind.FULL_ATTENTION,
    "MLAAttentionSpec": GroupKind.FULL_ATTENTION,
    "SlidingWindowSpec": GroupKind.SLIDING_WINDOW,
    "SlidingWindowMLASpec": GroupKind.SLIDING_WINDOW,
    "MambaSpec": GroupKind.MAMBA,
    "ChunkedLocalAttentionSpec": GroupKind.CHUNKED_LOCAL_ATTENTION,
}
"""vLLM spec class names and the group kind each means; drives `group_kind_of`, its tests and
docs/embedding.md. A spec is recognised by the first of its classes (its MRO) named here, so
subclasses count. A `FullAttentionSpec` whose `sliding_window` is set stays full attention:
vLLM uses it for sliding-window layers when its hybrid allocator is off, and then keeps every
block of the group."""


def group_kind_of(spec: object, *, group: int | None = None) -> GroupKind:
    """Return the GroupKind a vLLM `kv_cache_spec` stands for, by its class name (SPEC_KINDS).

    Raises InvalidInputError naming the group and the class for a spec of another kind
    (e.g. `CrossAttentionSpec`): kvferry has no rule for it.
    """
    for cls in type(spec).__mro__:
        kind = SPEC_KINDS.get(cls.__name__)
        if kind is not None:
            return kind
    raise InvalidInputError(
        group=group,
        field="kv_cache_spec",
        expected=f"a spec of class (or subclass of) {', '.join(sorted(SPEC_KINDS))}",
        got=type(spec).__name__,
    )


def group_spec_from_vllm(spec: object, *, group: int | None = None) -> GroupSpec:
    """Return the GroupSpec of one vLLM `kv_cache_spec`: its kind, `block_size`, and the
    parameters the kind uses (`KIND_RULES[kind]`, read from vLLM's attributes of the same
    names: `sliding_window` and `extra_retained_tokens` of a sliding window,
    `attention_chunk_size` of chunked local attention)."""
    kind = group_kind_of(spec, group=group)
    block_size = getattr(spec, "block_size", None)
    if block_size is None:
        raise InvalidInputError(
            group=group, field="kv_cache_spec.block_size", expected="a block size", got=spec
        )
    rule = KIND_RULES[kind]
    parameters: dict[str, Any] = {
        name: getattr(spec, name, PARAMETER_DEFAULTS[name])
        for name in rule.parameters + rule.optional_parameters
    }
    try:
        return GroupSpec(kind=kind, block_size=block_size, **parameters)
    except InvalidInputError as error:
        raise InvalidInputError(
            group=group,
            field=f"kv_cache_spec.{error.field}",
            expected=error.expected,
            got=error.got,
        ) from error


def offload_config_from_vllm(
    kv_cache_config: object,
    *,
    hash_block_size: int,
    blocks_per_chunk: int = 1,
    store_decoded_tokens: bool = True,
) -> OffloadConfig:
    """Return the OffloadConfig of vLLM's `kv_cache_config` (`kv_cache_groups[i].kv_cache_spec`).

    `hash_block_size` is the engine's prefix-hash block size (vLLM: the tokens behind each
    entry of `request.block_hashes`); it is not guessed, because a wrong value would name
    chunks by the wrong prefix.
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not isinstance(groups, Sequence) or not groups:
        raise InvalidInputError(
            field="kv_cache_config.kv_cache_groups", expected="a non-empty sequence", got=groups
        )
    specs = tuple(
        group_spec_from_vllm(getattr(g, "kv_cache_spec", None), group=i)
        for i, g in enumerate(groups)
    )
    return OffloadConfig(
        hash_block_size=hash_block_size,
        blocks_per_chunk=blocks_per_chunk,
        groups=specs,
        store_decoded_tokens=store_decoded_tokens,
    )


# -- block tables -> GroupBlocks ------------------------------------------------------------------


def group_blocks_from_vllm(blocks: Iterable[VllmBlock]) -> GroupBlocks:
    """Return one group's GroupBlocks from vLLM blocks: `is_null` marks null blocks, and a
    real block with a `block_hash` is a GPU prefix-cache hit (fresh blocks have none yet)."""
    ids, null, cached = [], [], []
    for index, block in enumerate(blocks):
        ids.append(int(block.block_id))
        if block.is_null:
            null.append(index)
        elif block.block_hash is not None:
            cached.append(index)
    return GroupBlocks.of(ids, null=null, cached=cached)


def blocks_from_vllm(kv_cache_blocks: object) -> tuple[GroupBlocks, ...]:
    """Return per-group GroupBlocks of vLLM's `KVCacheBlocks` (its `.blocks`: one sequence of
    blocks per group) or of a plain sequence of such sequences."""
    groups = getattr(kv_cache_blocks, "blocks", kv_cache_blocks)
    if not isinstance(groups, Sequence):
        raise InvalidInputError(
            field="blocks", expected="KVCacheBlocks or a sequence per group", got=groups
        )
    return tuple(group_blocks_from_vllm(group) for group in groups)
