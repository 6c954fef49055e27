"""The perfect-knowledge baseline: how many of D's tokens a router that knew every token id could let P read.

For a later turn, D's handle covers D's sequence of the previous turn (its prompt ids and the
reply ids it generated, all but the last: ``remote_num_tokens``). A router with perfect
knowledge injects as much of it as the new prompt reproduces token for token:

* the whole handle when the new prompt starts with D's whole sequence (a reply sent back
  verbatim), else the longest common token prefix rounded down to whole blocks (a cut handle
  must end on a block boundary, docs/router.md);
* capped as vLLM caps the read: at most ``prompt - 1`` tokens (the last prompt token is always
  recomputed), and nothing when the count is under ``kv_recompute_threshold``.

:class:`PerfectOracle` computes it per turn against the emulated engines: the new prompt's ids
from P's ``/tokenize`` (the ids P prefills), D's sequence from the blocks D holds for the turn
(what P's read would load: the prompt ids D reports with ``return_token_ids`` followed by its
output ids). It runs as the agent client's turn hook, so it sees each handle before the next
turn's read frees it.

Usage::

    oracle = PerfectOracle(p_url, d_handle.engine, block_size=16, threshold=64)
    await run_agent_workload(config, spec, on_turn=oracle.on_turn)
    oracle.perfect["<request id>"]   # tokens a perfect router would have let P read on that turn
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import aiohttp

_TOKENIZE_FIELDS: Final = ("model", "messages", "tools", "chat_template_kwargs", "add_generation_prompt",
                           "continue_final_message")


class _Pool(Protocol):
    holds: dict[str, Any]

    def content(self, block: int) -> Sequence[int]: ...


class _Engine(Protocol):
    pool: _Pool


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[lo:mid]) == list(b[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo


def perfect_read_tokens(d_sequence: Sequence[int], prompt: Sequence[int], block_size: int, threshold: int = 0) -> int:
    """Tokens of D's handle a perfect router lets P read for ``prompt`` (P's prefix cache empty)."""
    lcp = common_prefix(d_sequence, prompt)
    handle = len(d_sequence) if lcp >= len(d_sequence) else lcp // block_size * block_size
    offered = min(handle, len(prompt))
    if threshold > 0 and 0 < offered < threshold:
        return 0
    return max(0, min(handle, len(prompt) - 1))


def held_sequence(engine: _Engine, request_id: str | None) -> list[int] | None:
    """The token ids of the blocks D holds for the request with this X-Request-Id (None: nothing held)."""
    if request_id is None:
        return None
    for hold in list(engine.pool.holds.values()):
        if hold.kind == "ttl" and hold.attrs.get("request_id") == request_id:
            ids: list[int] = []
            for block in hold.block_ids:
                ids.extend(engine.pool.content(block))
            return ids[:hold.num_tokens]
    return None


@dataclass
class TurnTruth:
    """What the oracle knows about one answered turn."""

    conversation_id: str
    turn: int
    request_id: str | None
    prompt_tokens: int
    held_tokens: int | None          # D's remote_num_tokens for this turn's handle
    perfect_tokens: int | None       # for this turn's read of the previous turn's handle (None: turn 1)
    common_tokens: int | None        # the plain common prefix with the previous sequence


@dataclass
class PerfectOracle:
    """The agent client's turn hook that records, per request, what a perfect router would reuse."""

    prefill_url: str
    decode_engine: _Engine
    block_size: int = 16
    threshold: int = 64
    session: aiohttp.ClientSession | None = None
    turns: list[TurnTruth] = field(default_factory=list)
    _sequences: dict[str, list[int]] = field(default_factory=dict)

    @property
    def perfect(self) -> dict[str, int]:
        """Perfect-router read tokens by request id (later turns only)."""
        return {t.request_id: t.perfect_tokens for t in self.turns
                if t.request_id is not None and t.perfect_tokens is not None}

    async def tokenize(self, body: dict[str, Any]) -> list[int]:
        """P's ids for the request's prompt (its ``/tokenize``)."""
        request = {k: body[k] for k in _TOKENIZE_FIELDS if k in body}
        assert self.session is not None, "PerfectOracle.session is set before the run"
        async with self.session.post(f"{self.prefill_url}/tokenize", json=request) as resp:
            data = await resp.json()
            if resp.status != 200 or not isinstance(data.get("tokens"), list):
                raise RuntimeError(f"/tokenize answered {resp.status}: {str(data)[:200]}")
            return list(data["tokens"])

    async def on_turn(self, conv: Any, number: int, body: dict[str, Any], result: Any) -> None:
        """Record the turn: the perfect read of the previous handle, then this turn's held sequence."""
        if self.session is None:
            self.session = aiohttp.ClientSession()
        prompt = await self.tokenize(body)
        key = str(conv.conversation_id)
        previous = self._sequences.pop(key, None)
        perfect = common = None
        if previous is not None:
            perfect = perfect_read_tokens(previous, prompt, self.block_size, self.threshold)
            common = common_prefix(previous, prompt)
        held = held_sequence(self.decode_engine, result.request_id)
        if held is not None:
            self._sequences[key] = held
        self.turns.append(TurnTruth(key, number, result.request_id, len(prompt), len(held) if held else None,
                                    perfect, common))

    async def close(self) -> None:
        """Close the oracle's HTTP session."""
        if self.session is not None:
            await self.session.close()
            self.session = None
