"""Model profiles of `kvferry demo`: real per-layer KV shapes of three model families, scaled down.

Values and arithmetic on shapes only: a profile never allocates a tensor or plans a transfer.
"""

from __future__ import annotations

import enum
import math

import attrs

from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.errors import InvalidInputError, member_named
from kvferry.core.kinds import KIND_RULES

BF16 = 2
"""Bytes per bf16 element."""
FP32 = 4
"""Bytes per fp32 element."""
WORD = 8
"""Pages are generated and compared in 8-byte words: every page size must be a multiple."""


class ProfileName(enum.Enum):
    """The model profiles the demo knows; the value is the name used on the command line."""

    LLAMA = "llama"
    """Llama-3.1-8B-like: full attention only."""
    GPT_OSS = "gpt-oss"
    """gpt-oss-20b-like: full attention and 128-token sliding window, alternating layers."""
    JAMBA = "jamba"
    """Jamba-1.5-Mini-like: full attention and Mamba, Mamba pages padded to the attention page."""
    LLAMA4 = "llama4"
    """Llama-4-Scout-like: full attention and chunked local attention, one layer in four full."""

    @classmethod
    def from_name(cls, name: str) -> ProfileName:
        """Return the profile named `name`, or raise InvalidInputError listing the known ones."""
        return member_named(cls, name, field="profile")


@attrs.frozen(kw_only=True)
class StatePart:
    """One state tensor of a Mamba layer, inside the layer's padded page."""

    name: str
    """What it is (`conv` or `ssm`)."""
    shape: tuple[int, ...]
    """Its shape per block (elements)."""
    itemsize: int
    """Bytes per element."""

    @property
    def nbytes(self) -> int:
        """Return the bytes of this state per block."""
        return math.prod(self.shape) * self.itemsize


@attrs.frozen(kw_only=True)
class GroupProfile:
    """One KV-cache group of a profile: its kind, its layers and the shape of their pages."""

    kind: GroupKind
    """Full attention, sliding window or Mamba."""
    layers: int
    """Layers of this group in the demo (scaled down from `real_layers`)."""
    real_layers: int
    """Layers of this kind in the real model."""
    sliding_window: int | None = None
    """Window in tokens (sliding-window groups only)."""
    attention_chunk_size: int | None = None
    """Attention chunk in tokens (chunked-local-attention groups only)."""
    kv_heads: int = 0
    """KV heads per attention layer."""
    head_dim: int = 0
    """Head dimension of an attention layer."""
    states: tuple[StatePart, ...] = ()
    """A Mamba layer's state tensors, laid one after another in its padded page."""

    @property
    def is_attention(self) -> bool:
        """Return True for attention groups (a page holds its tokens' K and V), False for a
        recurrent-state group (a page holds one state)."""
        return not KIND_RULES[self.kind].recurrent_state

    def token_bytes(self) -> int:
        """Return the bytes one token takes in one K (or V) page of an attention layer."""
        return self.kv_heads * self.head_dim * BF16

    def state_bytes(self) -> int:
        """Return the real (unpadded) bytes of one Mamba layer's state."""
        return sum(part.nbytes for part in self.states)


@attrs.frozen(kw_only=True)
class ModelProfile:
    """A model family as the demo plays it: groups, block size, chunking and pool sizes."""

    name: ProfileName
    """Its command-line name."""
    title: str
    """What it imitates, for the report."""
    hash_block_size: int
    """Tokens per prefix-hash block."""
    block_size: int
    """Tokens per GPU block, the same in every group (as hybrid engines align them)."""
    groups: tuple[GroupProfile, ...]
    """The KV-cache groups, in the engine's order."""
    blocks_per_chunk: int
    """Default `F`."""
    gpu_blocks: int
    """GPU blocks per group in the demo's pool (too few for the working set, on purpose)."""
    cpu_tier_bytes: int
    """Default CPU-tier budget."""
    system_prompt_tokens: tuple[int, int]
    """Range of a shared system prompt's length."""
    user_tokens: tuple[int, int]
    """Range of a user message's length."""
    answer_tokens: tuple[int, int]
    """Range of an answer's length."""
    step_tokens: int
    """Token budget of one engine step (chunked prefill)."""

    def offload_config(self, blocks_per_chunk: int, *, store_decoded_tokens: bool) -> OffloadConfig:
        """Return the planner configuration of this profile with `F = blocks_per_chunk`."""
        return OffloadConfig(
            hash_block_size=self.hash_block_size,
            blocks_per_chunk=blocks_per_chunk,
            groups=tuple(
                GroupSpec(
                    kind=group.kind,
                    block_size=self.block_size,
                    sliding_window=group.sliding_window,
                    attention_chunk_size=group.attention_chunk_size,
                )
                for group in self.groups
            ),
            store_decoded_tokens=store_decoded_tokens,
        )

    def attention_page_bytes(self, group: GroupProfile) -> int:
        """Return the bytes of one K (or V) page of an attention layer of `group`."""
        return self.block_size * group.token_bytes()

    def mamba_page_stride(self) -> int:
        """Return the padded page of a Mamba layer: the K+V page of one attention layer, as
        hybrid engines pad Mamba pages to share one block pool."""
        attention = [g for g in self.groups if g.is_attention]
        return 2 * self.attention_page_bytes(attention[0]) if attention else 0

    def sharded(self, tp: int) -> ModelProfile:
        """Return one tensor-parallel rank's share of this profile out of `tp`: each attention
        layer keeps `kv_heads / tp` heads and each Mamba state `1 / tp` of its channels (its
        first dimension), as engines shard by head. Raise InvalidInputError when `tp` does not
        divide them."""
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise InvalidInputError(field="tp", expected="an integer >= 1", got=tp)
        groups = []
        for index, group in enumerate(self.groups):
            if group.is_attention:
                if group.kv_heads % tp:
                    raise InvalidInputError(
                        group=index,
                        field="tp",
                        expected=f"a divisor of the {group.kv_heads} KV heads",
                        got=tp,
                    )
                groups.append(attrs.evolve(group, kv_heads=group.kv_heads // tp))
                continue
            states = []
            for part in group.states:
                if part.shape[0] % tp:
                    raise InvalidInputError(
                        group=index,
                        field="tp",
                        expected=f"a divisor of the {part.name} state's {part.shape[0]} channels",
                        got=tp,
                    )
                states.append(attrs.evolve(part, shape=(part.shape[0] // tp, *part.shape[1:])))
            groups.append(attrs.evolve(group, states=tuple(states)))
        return attrs.evolve(self, groups=tuple(groups))

    def scale_note(self) -> str:
        """Return how the demo's layer counts relate to the real model's."""
        return ", ".join(
            f"{g.layers} of {g.real_layers} {g.kind.value.replace('_', '-')} layers"
            for g in self.groups
        )


def _attention_block_size(token_bytes: int, state_bytes: int, multiple: int) -> int:
    """Return the smallest multiple of `multiple` tokens whose K+V page holds a Mamba state."""
    tokens = -(-state_bytes // (2 * token_bytes))
    return -(-tokens // multiple) * multiple


_JAMBA_STATES = (
    StatePart(name="conv", shape=(8192, 3), itemsize=BF16),
    StatePart(name="ssm", shape=(8192, 16), itemsize=FP32),
)
_JAMBA_BLOCK = _attention_block_size(8 * 128 * BF16, sum(p.nbytes for p in _JAMBA_STATES), 16)

PROFILES: dict[ProfileName, ModelProfile] = {
    ProfileName.LLAMA: ModelProfile(
        name=ProfileName.LLAMA,
        title="Llama-3.1-8B-like (8 KV heads x 128, bf16)",
        hash_block_size=16,
        block_size=16,
        groups=(
            GroupProfile(
                kind=GroupKind.FULL_ATTENTION, layers=4, real_layers=32, kv_heads=8, head_dim=128
            ),
        ),
        blocks_per_chunk=4,
        gpu_blocks=320,
        cpu_tier_bytes=160 << 20,
        system_prompt_tokens=(400, 900),
        user_tokens=(40, 300),
        answer_tokens=(16, 64),
        step_tokens=2048,
    ),
    ProfileName.GPT_OSS: ModelProfile(
        name=ProfileName.GPT_OSS,
        title="gpt-oss-20b-like (8 KV heads x 64, bf16, window 128 on alternating layers)",
        hash_block_size=16,
        block_size=16,
        groups=(
            GroupProfile(
                kind=GroupKind.FULL_ATTENTION, layers=2, real_layers=12, kv_heads=8, head_dim=64
            ),
            GroupProfile(
                kind=GroupKind.SLIDING_WINDOW,
                layers=2,
                real_layers=12,
                sliding_window=128,
                kv_heads=8,
                head_dim=64,
            ),
        ),
        blocks_per_chunk=4,
        gpu_blocks=320,
        cpu_tier_bytes=64 << 20,
        system_prompt_tokens=(400, 900),
        user_tokens=(40, 300),
        answer_tokens=(16, 64),
        step_tokens=2048,
    ),
    ProfileName.JAMBA: ModelProfile(
        name=ProfileName.JAMBA,
        title=(
            "Jamba-1.5-Mini-like (attention 8 KV heads x 128 bf16; Mamba d_inner 8192, "
            f"d_state 16, conv 4; {_JAMBA_BLOCK}-token blocks, Mamba pages padded)"
        ),
        hash_block_size=16,
        block_size=_JAMBA_BLOCK,
        groups=(
            GroupProfile(
                kind=GroupKind.FULL_ATTENTION, layers=1, real_layers=4, kv_heads=8, head_dim=128
            ),
            GroupProfile(kind=GroupKind.MAMBA, layers=1, real_layers=28, states=_JAMBA_STATES),
        ),
        blocks_per_chunk=1,
        gpu_blocks=64,
        cpu_tier_bytes=192 << 20,
        system_prompt_tokens=(600, 1400),
        user_tokens=(100, 500),
        answer_tokens=(16, 48),
        step_tokens=2048,
    ),
    ProfileName.LLAMA4: ModelProfile(
        name=ProfileName.LLAMA4,
        title=(
            "Llama-4-Scout-like (8 KV heads x 128, bf16; local attention chunks of 8192 tokens, "
            "scaled to 256, on 3 of 4 layers)"
        ),
        hash_block_size=16,
        block_size=16,
        groups=(
            GroupProfile(
                kind=GroupKind.FULL_ATTENTION, layers=1, real_layers=12, kv_heads=8, head_dim=128
            ),
            GroupProfile(
                kind=GroupKind.CHUNKED_LOCAL_ATTENTION,
                layers=3,
                real_layers=36,
                attention_chunk_size=256,
                kv_heads=8,
                head_dim=128,
            ),
        ),
        blocks_per_chunk=4,
        gpu_blocks=320,
        cpu_tier_bytes=192 << 20,
        system_prompt_tokens=(400, 900),
        user_tokens=(40, 300),
        answer_tokens=(16, 64),
        step_tokens=2048,
    ),
}
"""Every profile; the table drives the command line, the tests and docs/demo.md."""


def check_profile(profile: ModelProfile) -> None:
    """Raise InvalidInputError unless every page of `profile` is a whole number of words and
    every Mamba state fits its padded page."""
    for index, group in enumerate(profile.groups):
        if group.is_attention:
            sizes = [group.token_bytes()]
        else:
            sizes = [part.nbytes for part in group.states]
            if group.state_bytes() > profile.mamba_page_stride():
                raise InvalidInputError(
                    group=index,
                    field="states",
                    expected=f"at most the padded page ({profile.mamba_page_stride()} bytes)",
                    got=group.state_bytes(),
                )
        for size in sizes:
            if size % WORD:
                raise InvalidInputError(
                    group=index, field="page", expected=f"a multiple of {WORD} bytes", got=size
                )
