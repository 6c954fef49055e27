"""The synthetic conversation a check sends: unique per run, long enough to show a D->P read.

The first message starts with a random nonce, so no earlier run (or other traffic) can have put
its blocks in P's prefix cache. Replies are forced to ``reply_tokens`` tokens (``min_tokens`` =
``max_tokens``, vLLM's sampling extension) so that even with P's prefix cache on, turn 2 leaves
more than vLLM's default ``kv_recompute_threshold`` (64 tokens) for P to read from D.
"""

from __future__ import annotations

import random
import secrets
from dataclasses import dataclass, field
from typing import Any, Final

_WORDS: Final = ("river", "stone", "lantern", "harbor", "meadow", "copper", "window", "signal", "garden",
                 "orbit", "canvas", "ledger", "thunder", "velvet", "compass", "beacon", "quartz", "willow",
                 "anchor", "ember", "summit", "prism", "falcon", "cedar")
DEFAULT_REPLY_TOKENS: Final = 96
FIRST_MESSAGE_WORDS: Final = 120


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


@dataclass
class Conversation:
    """Messages of the probe conversation and the ids the check sends with them."""

    nonce: str = field(default_factory=lambda: secrets.token_hex(6))
    messages: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.nonce)
        if not self.messages:
            self.messages = [{"role": "user", "content": f"kvdiag check {self.nonce}. Please summarise: "
                                                         + _text(self._rng, FIRST_MESSAGE_WORDS)}]

    @property
    def conversation_id(self) -> str:
        """The conversation id sent to the router."""
        return f"kvdiag-check-{self.nonce}"

    def request_id(self, label: str) -> str:
        """An X-Request-Id that names the check, the run and the step (it shows in vLLM's logs)."""
        return f"kvdiag-check-{self.nonce}-{label}"

    def extend(self, reply: str) -> list[dict[str, Any]]:
        """Append the assistant's reply and a new user message; return the new prompt's messages."""
        self.messages = [*self.messages, {"role": "assistant", "content": reply},
                         {"role": "user", "content": "Go on: " + _text(self._rng, 12)}]
        return self.messages

    @staticmethod
    def plain(nonce: str, words: int = 60) -> list[dict[str, Any]]:
        """A one-message prompt for the prefix-caching probe (its own nonce, unrelated to the conversation)."""
        rng = random.Random(nonce)
        return [{"role": "user", "content": f"kvdiag check cache probe {nonce}: " + _text(rng, words)}]
