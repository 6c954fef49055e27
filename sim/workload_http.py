"""One OpenAI chat request as the agent client sends it: streaming or not, timed, optionally dropped.

TTFT is measured as vLLM's multi-turn benchmark does: client-side, from the send to the first
chunk that carries content (the whole body for a non-streaming request); with ``first_output``,
to the first chunk of the reply whatever it carries (vLLM sends the role chunk with the first
token, so a reply that starts with reasoning or a tool call is timed alike).

Besides the content, the result keeps what an agent client sends back: the reasoning text (the
``reasoning`` or older ``reasoning_content`` field) and the tool calls, assembled from their
stream deltas by index as the openai SDK does (id, type, name, and the argument fragments
concatenated).

Usage::

    async with aiohttp.ClientSession() as session:
        result = await send_chat(session, "http://127.0.0.1:8000", payload, request_id="r1", stream=True)
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvdiag.schema.events import now_ts

# Responses are read line by line; a line longer than this is a broken server, not a reply.
_MAX_LINE_BYTES = 4 * 1024 * 1024


@dataclass
class ChatResult:
    """What one request returned, as the client saw it."""

    start_ts: float
    status: str = "ok"  # a schema STATUSES value: ok, error, disconnected, timeout
    http_status: int | None = None
    request_id: str | None = None
    ttft_ms: float | None = None
    duration_ms: float = 0.0
    text: str = ""
    chunks: int = 0
    first_chunk_tokens: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    kv_params_returned: bool = False
    usage: dict[str, Any] = field(default_factory=dict)
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def assistant_message(self, *, send_reasoning: bool = False) -> dict[str, Any]:
        """The reply as an agent client sends it back: content, structured tool calls, reasoning only if asked."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text if self.text or not self.tool_calls
                                   else None}
        if self.tool_calls:
            message["tool_calls"] = [dict(call, function=dict(call["function"])) for call in self.tool_calls]
        if send_reasoning and self.reasoning:
            message["reasoning_content"] = self.reasoning
        return message


def _apply_usage(result: ChatResult, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    result.usage = usage
    if isinstance(usage.get("prompt_tokens"), int):
        result.prompt_tokens = usage["prompt_tokens"]
    if isinstance(usage.get("completion_tokens"), int):
        result.completion_tokens = usage["completion_tokens"]
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        result.cached_tokens = details["cached_tokens"]


def _error_text(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:300]
        return str(err)[:300]
    return str(body)[:300]


async def send_chat(session: aiohttp.ClientSession, url: str, payload: dict[str, Any], *, request_id: str,
                    stream: bool, timeout_s: float = 60.0, disconnect_after_first: bool = False,
                    first_output: bool = False) -> ChatResult:
    """POST ``payload`` to ``{url}/v1/chat/completions`` and return what came back; never raises for HTTP.

    ``first_output``: TTFT at the reply's first chunk (reasoning, tool call or content alike).
    """
    result = ChatResult(start_ts=now_ts(), request_id=request_id)
    started = time.perf_counter()
    body = dict(payload, stream=stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(f"{url.rstrip('/')}/v1/chat/completions", json=body,
                                    headers={"X-Request-Id": request_id}) as resp:
                result.http_status = resp.status
                result.request_id = resp.headers.get("X-Request-Id") or request_id
                if resp.status >= 400:
                    raw = await resp.text()
                    result.status = "error"
                    try:
                        result.error = _error_text(json.loads(raw))
                    except (ValueError, RecursionError):
                        result.error = raw[:300]
                elif stream:
                    await _read_stream(resp, result, started, disconnect_after_first, first_output)
                else:
                    _read_body(await resp.json(content_type=None), result)
                    result.ttft_ms = (time.perf_counter() - started) * 1000.0
    except TimeoutError:
        result.status = "timeout"
        result.error = f"no complete reply within {timeout_s:.0f} s"
    except (aiohttp.ClientError, json.JSONDecodeError, ValueError) as exc:
        result.status = "error"
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.duration_ms = round((time.perf_counter() - started) * 1000.0, 3)
    if result.ttft_ms is not None:
        result.ttft_ms = round(result.ttft_ms, 3)
    return result


def _read_body(obj: Any, result: ChatResult) -> None:
    if not isinstance(obj, dict):
        raise ValueError("response body is not a JSON object")
    choices = obj.get("choices") or [{}]
    message = choices[0].get("message") or {}
    result.text = str(message.get("content") or "")
    result.reasoning = str(message.get("reasoning") or message.get("reasoning_content") or "")
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        result.tool_calls = [_call(c) for c in calls if isinstance(c, dict)]
    result.finish_reason = choices[0].get("finish_reason")
    result.chunks = 1
    result.kv_params_returned = obj.get("kv_transfer_params") is not None
    _apply_usage(result, obj.get("usage"))
    if result.finish_reason == "error":
        result.status = "error"
        result.error = "finish_reason=error"


def _call(raw: dict[str, Any]) -> dict[str, Any]:
    function = raw.get("function") if isinstance(raw.get("function"), dict) else {}
    assert isinstance(function, dict)
    return {"id": str(raw.get("id") or ""), "type": "function",
            "function": {"name": str(function.get("name") or ""), "arguments": str(function.get("arguments") or "")}}


def _merge_tool_deltas(calls: dict[int, dict[str, Any]], deltas: Any) -> None:
    """Assemble streamed tool-call deltas by index (the openai SDK's accumulation)."""
    if not isinstance(deltas, list):
        return
    for delta in deltas:
        if not isinstance(delta, dict):
            continue
        index = delta.get("index", len(calls))
        call = calls.setdefault(index if isinstance(index, int) else len(calls),
                                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        if delta.get("id"):
            call["id"] = str(delta["id"])
        function = delta.get("function")
        if isinstance(function, dict):
            if function.get("name"):
                call["function"]["name"] += str(function["name"])
            if function.get("arguments"):
                call["function"]["arguments"] += str(function["arguments"])


async def _read_stream(resp: aiohttp.ClientResponse, result: ChatResult, started: float,
                       disconnect_after_first: bool, first_output: bool = False) -> None:
    parts: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    while True:
        line_bytes = await resp.content.readline()
        if not line_bytes:
            break
        if len(line_bytes) > _MAX_LINE_BYTES:
            raise ValueError("SSE line longer than 4 MiB")
        line = line_bytes.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            continue
        if "error" in chunk:
            result.status = "error"
            result.error = _error_text(chunk)
            break
        if chunk.get("kv_transfer_params") is not None:
            result.kv_params_returned = True
        _apply_usage(result, chunk.get("usage"))
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
            if first_output and result.ttft_ms is None and isinstance(delta, dict):
                result.ttft_ms = (time.perf_counter() - started) * 1000.0
            if isinstance(delta, dict):
                thought = delta.get("reasoning") or delta.get("reasoning_content")
                if isinstance(thought, str) and thought:
                    reasoning.append(thought)
                _merge_tool_deltas(calls, delta.get("tool_calls"))
            if content:
                parts.append(content)
                result.chunks += 1
                if result.first_chunk_tokens == 0:
                    if result.ttft_ms is None:
                        result.ttft_ms = (time.perf_counter() - started) * 1000.0
                    result.first_chunk_tokens = max(len(content.split()), 1)
                    if disconnect_after_first:
                        # Drop the connection as an impatient client does: the server sees a disconnect.
                        resp.close()
                        result.status = "disconnected"
                        result.text = "".join(parts)
                        return
    result.text = "".join(parts)
    result.reasoning = "".join(reasoning)
    result.tool_calls = [calls[i] for i in sorted(calls)]
    if result.finish_reason == "error" and result.status == "ok":
        result.status = "error"
        result.error = "finish_reason=error"
    if result.ttft_ms is None and result.status == "ok":
        result.ttft_ms = (time.perf_counter() - started) * 1000.0
