"""The demo's workload: multi-turn chats that grow turn by turn and share system prompts.

Deterministic from a seed; it only produces tokens, their identities and prefix hashes, and never
touches the engine, the planner or a tensor.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import attrs
import numpy as np
import numpy.typing as npt

from kvferry.core.errors import InvalidInputError

_MASK = (1 << 64) - 1
VOCAB = 128_000
"""Token ids are drawn below this."""


def mix64(value: int) -> int:
    """Return the splitmix64 finaliser of `value`: a cheap, well-spread 64-bit mix."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK
    return value ^ (value >> 31)


@attrs.define
class TokenChain:
    """A growing token sequence with one identity per token: a chained hash of every token up
    to it, so equal identities mean equal prefixes (what a token's KV depends on)."""

    tokens: list[int] = attrs.field(factory=list)
    """Token ids, in order."""
    ids: list[int] = attrs.field(factory=list)
    """`ids[t]` identifies the prefix `tokens[: t + 1]`."""

    def extend(self, new: list[int]) -> None:
        """Append `new` tokens and their identities."""
        last = self.ids[-1] if self.ids else 0x9E3779B97F4A7C15
        for token in new:
            last = mix64(last ^ (token * 0x9E3779B97F4A7C15 & _MASK))
            self.ids.append(last)
        self.tokens.extend(new)

    def id_array(self, stop: int) -> npt.NDArray[np.uint64]:
        """Return the identities of the first `stop` tokens as a uint64 array."""
        return np.asarray(self.ids[:stop], dtype=np.uint64)

    def block_hashes(self, stop: int, hash_block_size: int) -> list[bytes]:
        """Return the engine's chained hash of each full hash block among the first `stop`
        tokens: the identity of its last token, as 8 bytes."""
        return [
            self.ids[end - 1].to_bytes(8, "big")
            for end in range(hash_block_size, stop + 1, hash_block_size)
        ]


@attrs.frozen(kw_only=True)
class Turn:
    """One request: a conversation's prompt so far and the answer the engine will produce."""

    request_id: str
    """`c<conversation>-t<turn>`."""
    conversation: int
    """The conversation it belongs to."""
    turn: int
    """Its index in the conversation (0 = first)."""
    chain: TokenChain = attrs.field(eq=False)
    """The conversation's tokens (prompt, answer and later turns share it: read only up to
    `prompt_tokens + answer_tokens`)."""
    prompt_tokens: int
    """Prompt length (system prompt, earlier turns and answers, the new user message)."""
    answer_tokens: int
    """Tokens the engine samples before the turn ends."""


@attrs.frozen(kw_only=True)
class WorkloadShape:
    """How the chats are drawn."""

    system_prompts: int = 3
    """Distinct system prompts, shared by the conversations."""
    system_prompt_tokens: tuple[int, int] = (400, 900)
    """Range of a system prompt's length."""
    user_tokens: tuple[int, int] = (40, 300)
    """Range of a user message's length."""
    answer_tokens: tuple[int, int] = (16, 64)
    """Range of an answer's length."""
    turns: tuple[int, int] = (2, 6)
    """Range of a conversation's number of turns."""
    active: int = 10
    """Conversations open at once; a finished one is replaced by a new one."""


class ChatWorkload:
    """Hands out turns: a conversation's next turn is ready only once its previous one ended.

    `first_turns()` opens the first conversations; `next_turn(turn)` after a turn finished gives
    the same conversation's next turn, or the first turn of a new conversation, or None once
    `num_requests` turns were handed out.
    """

    def __init__(self, shape: WorkloadShape, *, seed: int, num_requests: int) -> None:
        if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
            raise InvalidInputError(field="requests", expected="an integer >= 1", got=num_requests)
        self._shape = shape
        self._random = random.Random(seed)
        self._remaining = num_requests
        self._system = [
            self._tokens(shape.system_prompt_tokens) for _ in range(shape.system_prompts)
        ]
        self._conversations = 0
        self._turns_left: dict[int, int] = {}

    def _tokens(self, bounds: tuple[int, int]) -> list[int]:
        return [self._random.randrange(VOCAB) for _ in range(self._random.randint(*bounds))]

    def first_turns(self) -> Iterator[Turn]:
        """Yield the first turn of each initially open conversation."""
        for _ in range(self._shape.active):
            turn = self._open()
            if turn is None:
                return
            yield turn

    def next_turn(self, finished: Turn) -> Turn | None:
        """Return what becomes ready when `finished` ended: the conversation's next turn, a new
        conversation's first turn, or None when every request was handed out."""
        if self._remaining <= 0:
            return None
        left = self._turns_left.get(finished.conversation, 0)
        if left <= 0:
            self._turns_left.pop(finished.conversation, None)
            return self._open()
        self._turns_left[finished.conversation] = left - 1
        chain = finished.chain
        chain.extend(self._tokens(self._shape.user_tokens))
        return self._turn(finished.conversation, finished.turn + 1, chain)

    def _open(self) -> Turn | None:
        if self._remaining <= 0:
            return None
        conversation = self._conversations
        self._conversations += 1
        self._turns_left[conversation] = self._random.randint(*self._shape.turns) - 1
        chain = TokenChain()
        chain.extend(self._random.choice(self._system))
        chain.extend(self._tokens(self._shape.user_tokens))
        return self._turn(conversation, 0, chain)

    def _turn(self, conversation: int, index: int, chain: TokenChain) -> Turn:
        self._remaining -= 1
        prompt = len(chain.tokens)
        answer = self._tokens(self._shape.answer_tokens)
        chain.extend(answer)
        return Turn(
            request_id=f"c{conversation}-t{index}",
            conversation=conversation,
            turn=index,
            chain=chain,
            prompt_tokens=prompt,
            answer_tokens=len(answer),
        )
