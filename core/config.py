"""The shape of the KV cache as the planner sees it: groups, block sizes, chunk size.

Values only: no I/O, no defaults read from the environment (adapters do that).
"""

from __future__ import annotations

import attrs

from kvferry.core.checks import at_least
from kvferry.core.errors import InvalidInputError
from kvferry.core.kinds import KIND_RULES, PARAMETER_DEFAULTS, GroupKind, KindRule
from kvferry.core.reach import KeptChunks, kept_chunks

__all__ = ["GroupKind", "GroupSpec", "OffloadConfig"]


def _group_kind(instance: object, attribute: attrs.Attribute[GroupKind], value: object) -> None:
    if not isinstance(value, GroupKind):
        raise InvalidInputError(field=attribute.name, expected="a GroupKind", got=value)


def _flag(instance: object, attribute: attrs.Attribute[bool], value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidInputError(field=attribute.name, expected="a bool", got=value)


@attrs.frozen(kw_only=True)
class GroupSpec:
    """One KV-cache group: its kind, its GPU block size and the parameters its kind needs
    (`KIND_RULES[kind].parameters`)."""

    kind: GroupKind = attrs.field(validator=_group_kind)
    """How the group's layers use earlier tokens."""
    block_size: int = attrs.field(validator=at_least(1))
    """Tokens per GPU block of this group (`T_g`)."""
    sliding_window: int | None = None
    """Window in tokens; required for sliding-window groups, absent for the others."""
    extra_retained_tokens: int = 0
    """Tokens below a sliding window whose blocks the engine keeps too (vLLM's
    `SlidingWindowSpec.extra_retained_tokens`, set with several speculative draft modules):
    they are loaded with the window. 0 for every other kind."""
    attention_chunk_size: int | None = None
    """Tokens per attention chunk of a chunked-local-attention group (vLLM's
    `ChunkedLocalAttentionSpec.attention_chunk_size`); absent for the others."""

    def __attrs_post_init__(self) -> None:
        rule = self.rule
        for name, default in PARAMETER_DEFAULTS.items():
            value = getattr(self, name)
            if name in rule.parameters or name in rule.optional_parameters:
                least = 1 if name in rule.parameters else 0
                if isinstance(value, bool) or not isinstance(value, int) or value < least:
                    raise InvalidInputError(
                        field=name,
                        expected=f"an integer >= {least} for a {self.kind.value} group",
                        got=value,
                    )
            elif value != default:
                raise InvalidInputError(
                    field=name, expected=f"{default} for a {self.kind.value} group", got=value
                )

    @property
    def rule(self) -> KindRule:
        """Return the rules of this group's kind."""
        return KIND_RULES[self.kind]

    def first_needed_token(self, t: int) -> int:
        """Return the first token this group needs to compute token `t` (it needs every token
        from there up to `t`; the engine nulls the blocks wholly below it)."""
        return self.rule.first_needed_token(self, t)


def _groups_tuple(value: object) -> tuple[GroupSpec, ...]:
    if not isinstance(value, (list, tuple)):
        raise InvalidInputError(field="groups", expected="a sequence of GroupSpec", got=value)
    return tuple(value)


@attrs.frozen(kw_only=True)
class OffloadConfig:
    """Everything the planner needs to know about the model's KV cache and the CPU tier."""

    hash_block_size: int = attrs.field(validator=at_least(1))
    """Tokens per prefix-hash block; the engine gives one chained hash per full hash block."""
    blocks_per_chunk: int = attrs.field(validator=at_least(1))
    """GPU blocks per offloaded chunk (`F`), the same for every group."""
    groups: tuple[GroupSpec, ...] = attrs.field(converter=_groups_tuple)
    """The KV-cache groups, in the engine's order; a group is named by its index here."""
    store_decoded_tokens: bool = attrs.field(default=True, validator=_flag)
    """Store chunks of generated tokens too (pays off in multi-turn chat), or the prompt's only."""

    _chunk_tokens: tuple[int, ...] = attrs.field(init=False, repr=False, eq=False)
    """`C_g` per group, computed once (hot paths read it every step)."""
    _kept: tuple[KeptChunks, ...] = attrs.field(init=False, repr=False, eq=False)
    """Per group, which chunks are worth storing (`kept_chunks`), computed once."""

    def __attrs_post_init__(self) -> None:
        if not self.groups:
            raise InvalidInputError(field="groups", expected="at least one group", got=self.groups)
        for index, group in enumerate(self.groups):
            if not isinstance(group, GroupSpec):
                raise InvalidInputError(
                    group=index, field="groups", expected="a GroupSpec", got=group
                )
            if group.block_size % self.hash_block_size:
                raise InvalidInputError(
                    group=index,
                    field="block_size",
                    expected=f"a multiple of hash_block_size={self.hash_block_size}",
                    got=group.block_size,
                )
        chunk_tokens = tuple(self.blocks_per_chunk * g.block_size for g in self.groups)
        object.__setattr__(self, "_chunk_tokens", chunk_tokens)
        object.__setattr__(self, "_kept", kept_chunks(self.groups, chunk_tokens))

    @property
    def num_groups(self) -> int:
        """Return the number of KV-cache groups."""
        return len(self.groups)

    def chunk_tokens(self, group: int) -> int:
        """Return `C_g`, the tokens in one chunk of `group` (`F * T_g`)."""
        return self._chunk_tokens[group]

    @property
    def all_chunk_tokens(self) -> tuple[int, ...]:
        """Return `C_g` of every group, in group order."""
        return self._chunk_tokens

    def hashes_per_chunk(self, group: int) -> int:
        """Return how many hash blocks one chunk of `group` spans."""
        return self._chunk_tokens[group] // self.hash_block_size

    def window_chunks(self, group: int) -> int:
        """Return `W`, the chunks a windowed group needs at most at a boundary on its chunk
        grid: `ceil(window_tokens / C_g)` (`ceil((w - 1 + e) / C_g)` for a sliding window,
        1 for Mamba, exactly that many away from the start); 0 for full attention, which has
        no window."""
        spec = self.groups[group]
        window_tokens = spec.rule.window_tokens
        return 0 if window_tokens is None else -(-window_tokens(spec) // self.chunk_tokens(group))

    def keeps_chunk(self, group: int, chunk: int) -> bool:
        """Return True when chunk `chunk` of `group` is worth storing: every chunk of a
        full-attention group; of a windowed group, one inside the window of some boundary a
        lookup can answer (docs/semantics.md, "Which windowed chunks are stored")."""
        kept = self._kept[group]
        return kept is None or chunk % kept[0] in kept[1]

    def keeps_every_chunk(self, group: int) -> bool:
        """Return True when every chunk of `group` is worth storing (`keeps_chunk`)."""
        return self._kept[group] is None

    @property
    def has_windowed_group(self) -> bool:
        """Return True when any group needs only some earlier tokens (not full attention)."""
        return any(g.rule.windowed for g in self.groups)
