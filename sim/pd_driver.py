"""A minimal P/D driver over real HTTP, for tests and integration checks (not the router).

It does what vLLM's example proxy does for one turn: P with ``do_remote_decode`` (plus D's handle
from the previous turn, if any), non-streaming, ``max_tokens=1``; then D with P's params; it
returns D's reply text and D's kv_transfer_params for the next turn.

Usage::

    async with aiohttp.ClientSession() as session:
        turn = await run_turn(session, p.url, d.url, messages, handle=None, request_id="c1-t1")
        messages += [{"role": "assistant", "content": turn.reply}, {"role": "user", "content": "next"}]
        turn2 = await run_turn(session, p.url, d.url, messages, handle=turn.d_params, request_id="c1-t2")
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class TurnResult:
    """What one turn returned from P and D."""

    p_status: int
    p_body: dict[str, Any]
    d_status: int = 0
    reply: str = ""
    d_params: dict[str, Any] | None = None
    d_chunks: list[dict[str, Any]] = field(default_factory=list)
    d_body: dict[str, Any] | None = None

    @property
    def p_params(self) -> dict[str, Any] | None:
        """P's kv_transfer_params."""
        value = self.p_body.get("kv_transfer_params")
        return value if isinstance(value, dict) else None

    @property
    def report(self) -> dict[str, Any] | None:
        """P's kvdiag report (instrumented mode): in its params, or in the error object of a failed request."""
        params = self.p_params
        if params:
            return params.get("kvdiag")
        error = self.p_body.get("error")
        report = error.get("kvdiag") if isinstance(error, dict) else None
        return report if isinstance(report, dict) else None


async def read_sse(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE response (``data: [DONE]`` excluded)."""
    chunks = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[len("data: "):]))
    return chunks


async def run_turn(session: aiohttp.ClientSession, p_url: str, d_url: str, messages: list[dict[str, Any]],
                   handle: dict[str, Any] | None, request_id: str, max_tokens: int = 32,
                   stream: bool = True, extra: dict[str, Any] | None = None) -> TurnResult:
    """One P then D turn; stops after P if P failed (no params or an error).

    ``extra`` fields (``tools``, ``kvdiag_sim``, ``chat_template_kwargs``, ...) go into both requests.
    """
    p_params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                "remote_block_ids": None, "remote_host": None, "remote_port": None}
    if handle:
        p_params = {k: v for k, v in handle.items() if k != "kvdiag"}
        p_params.update(do_remote_decode=True, do_remote_prefill=False)
    headers = {"X-Request-Id": request_id}
    async with session.post(f"{p_url}/v1/chat/completions", headers=headers, json={
            **(extra or {}), "messages": messages, "max_tokens": 1, "stream": False,
            "kv_transfer_params": p_params}) as resp:
        result = TurnResult(resp.status, await resp.json())
    params = result.p_params
    choices = result.p_body.get("choices") or [{}]
    if result.p_status != 200 or params is None or choices[0].get("finish_reason") == "error":
        return result
    d_params = {k: v for k, v in params.items() if k != "kvdiag"}
    body = {**(extra or {}), "messages": messages, "max_tokens": max_tokens, "stream": stream,
            "kv_transfer_params": d_params}
    async with session.post(f"{d_url}/v1/chat/completions", headers=headers, json=body) as resp:
        result.d_status = resp.status
        if stream:
            result.d_chunks = await read_sse(resp)
            for chunk in result.d_chunks:
                for choice in chunk.get("choices") or []:
                    result.reply += choice.get("delta", {}).get("content") or ""
                if chunk.get("kv_transfer_params") is not None:  # vLLM writes null on every other chunk
                    result.d_params = chunk["kv_transfer_params"]
        else:
            result.d_body = await resp.json()
            result.reply = result.d_body["choices"][0]["message"]["content"]
            result.d_params = result.d_body.get("kv_transfer_params")
    return result
