"""vLLM 0.33's OpenAI API as both testbed servers speak it: the emulated engines and the real-vLLM backend.

The HTTP plumbing (errors, the JSON body, the model check, server-sent events, the routes every
engine serves) and the response bodies and stream chunks, field for field, as vLLM's pydantic
models serialize them.

Full responses are ``model_dump()`` (every field, nulls included; ``tool_calls`` dropped from a
message when empty). Chat stream chunks are ``model_dump_json(exclude_unset=True)``: a field the
server set explicitly appears even when null, so every token chunk carries ``"token_ids": null``
and ``"kv_transfer_params": null`` (the final chunk carries the params), and the first chunk
``"prompt_token_ids"`` and ``"prompt_text"``. The usage chunk (empty ``choices``) drops nulls.
With ``return_token_ids`` the prompt ids come at the top of the chat body (in the choice for
completions), the output ids in the choice; streamed, the prompt ids ride on the first chunk and
each chunk carries its own output ids. ``include_reasoning: false`` on a server with a parser
(reasoning or tool) also hides the output ids.

Usage::

    app = openai_app(model="Qwen/Qwen3-32B", completion=handler, metrics=lambda: generate_latest(registry))
    # handler(request, "chat" | "completion") raises ApiError (or BadRequest) for a 4xx/5xx answer
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvdiag.schema.errors import KVDiagError
from kvdiag.sim.output_parser import ParsedMessage

DONE: Final = b"data: [DONE]\n\n"
Handler = Callable[[web.Request, str], Awaitable[web.StreamResponse]]


class ApiError(KVDiagError):
    """A request the server answers with an OpenAI error object (``status``, ``kind``) instead of a completion."""

    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


class BadRequest(ApiError, ValueError):
    """A request body vLLM would reject (HTTP 400)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 400, "BadRequestError")


def bool_field(body: Any, key: str, default: bool) -> bool:
    """A request body's boolean option (absent or null: ``default``); anything else is a 400 as in vLLM."""
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be true or false")
    return value


def error_object(message: str, status: int, kind: str) -> dict[str, Any]:
    """vLLM's ``ErrorResponse.error``."""
    return {"message": message, "type": kind, "param": None, "code": status}


def error_response(message: str, status: int, kind: str = "BadRequestError") -> web.Response:
    """An OpenAI error body with its HTTP status."""
    return web.json_response({"error": error_object(message, status, kind)}, status=status)


async def json_body(request: web.Request) -> Any:
    """The request's JSON body; BadRequest when it is not JSON."""
    try:
        return await request.json()
    except ValueError:
        raise BadRequest("request body is not valid JSON") from None


def check_model(body: Any, served: str) -> None:
    """vLLM answers 404 for a ``model`` it does not serve (no ``model`` means the served one)."""
    model = body.get("model") if isinstance(body, dict) else None
    if model is not None and model != served:
        raise ApiError(f"The model `{model}` does not exist.", 404, "NotFoundError")


async def start_sse(request: web.Request) -> web.StreamResponse:
    """Open a server-sent events response (HTTP 200, headers sent)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def send_sse(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    """One ``data: {...}`` event, compact JSON as vLLM writes it."""
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


async def send_error_chunk(resp: web.StreamResponse, error: dict[str, Any]) -> None:
    """vLLM's answer to an error inside a stream that already sent 200: the error object as a chunk, then [DONE]."""
    await send_sse(resp, error)
    await resp.write(DONE)


def openai_app(*, model: str, completion: Handler, metrics: Callable[[], bytes], max_body_bytes: int
               ) -> web.Application:
    """The routes every testbed engine serves: chat and completions, /health, /v1/models, /metrics.

    ``completion`` may raise ApiError; it becomes the OpenAI error response.
    """
    def endpoint(kind: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                return await completion(request, kind)
            except ApiError as exc:
                return error_response(str(exc), exc.status, exc.kind)
        return handle

    async def health(_request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "vllm",
                                                              "root": model}]})

    async def exposition(_request: web.Request) -> web.Response:
        return web.Response(body=metrics(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(client_max_size=max_body_bytes)
    app.router.add_post("/v1/chat/completions", endpoint("chat"))
    app.router.add_post("/v1/completions", endpoint("completion"))
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", exposition)
    return app


async def listen(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (0: a free port); return the runner and the port bound."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = getattr(site._server, "sockets", None) or []
    return runner, int(sockets[0].getsockname()[1]) if sockets else port


# --- bodies and chunks --------------------------------------------------------------------------

CHAT_CHUNK = "chat.completion.chunk"
COMPLETION = "text_completion"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int | None,
          full: bool) -> dict[str, Any]:
    """``usage``; ``full`` keeps the nulls of a full response (a usage chunk drops them)."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                           "completion_tokens": completion_tokens}
    details: dict[str, Any] = {"cached_tokens": cached_tokens}
    if full:
        details.update(created_cache_tokens=None, multimodal_tokens=None)
    out["prompt_tokens_details"] = details
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    elif full:
        out["completion_tokens_details"] = None
    return out


def text_message(text: str) -> ParsedMessage:
    """A reply that is plain content (no reasoning, no tool calls)."""
    return ParsedMessage(reasoning=None, content=text, tool_calls=[], reasoning_tokens=0)


def chat_message(parsed: ParsedMessage, reasoning_field: str) -> dict[str, Any]:
    """The assistant ``message`` of a full chat response."""
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content, "refusal": None, "annotations": None,
                           "audio": None, "function_call": None}
    if parsed.tool_calls:
        msg["tool_calls"] = parsed.tool_calls
    msg[reasoning_field] = parsed.reasoning
    return msg


def chat_body(*, request_id: str, model: str, message: dict[str, Any], finish_reason: str | None,
              token_ids: list[int] | None, prompt_token_ids: list[int] | None, usage_obj: dict[str, Any],
              params: dict[str, Any] | None) -> dict[str, Any]:
    """A full ``chat.completion`` response."""
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
              "token_ids": token_ids, "routed_experts": None, "weight_versions": None}
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "service_tier": None, "system_fingerprint": None, "usage": usage_obj,
            "prompt_logprobs": None, "prompt_token_ids": prompt_token_ids, "prompt_text": None,
            "kv_transfer_params": params, "ec_transfer_params": None, "metrics": None}


def completion_body(*, request_id: str, model: str, text: str, finish_reason: str | None,
                    token_ids: list[int] | None, prompt_token_ids: list[int] | None, usage_obj: dict[str, Any],
                    params: dict[str, Any] | None) -> dict[str, Any]:
    """A full ``text_completion`` response."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
              "token_ids": token_ids, "prompt_logprobs": None, "prompt_token_ids": prompt_token_ids,
              "routed_experts": None, "weight_versions": None}
    return {"id": request_id, "object": COMPLETION, "created": int(time.time()), "model": model, "choices": [choice],
            "service_tier": None, "system_fingerprint": None, "usage": usage_obj, "kv_transfer_params": params,
            "ec_transfer_params": None, "metrics": None}


def chat_role_chunk(request_id: str, model: str, created: int, prompt_token_ids: list[int] | None) -> dict[str, Any]:
    """The first chat chunk: the role, and the prompt ids when asked."""
    return {"id": request_id, "object": CHAT_CHUNK, "created": created, "model": model,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}],
            "prompt_token_ids": prompt_token_ids, "prompt_text": None}


def chat_chunk(request_id: str, model: str, created: int, delta: dict[str, Any], token_ids: list[int] | None,
               finish_reason: str | None, params: dict[str, Any] | None, with_params: bool) -> dict[str, Any]:
    """A chat token chunk; with ``finish_reason`` the final one (``stop_reason``, ``weight_versions``)."""
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = None
    choice["token_ids"] = token_ids
    if finish_reason is not None:
        choice["weight_versions"] = None
    chunk: dict[str, Any] = {"id": request_id, "object": CHAT_CHUNK, "created": created, "model": model,
                             "choices": [choice]}
    if with_params:
        chunk["kv_transfer_params"] = params
    return chunk


def completion_chunk(request_id: str, model: str, created: int, text: str, token_ids: list[int] | None,
                     prompt_token_ids: list[int] | None, finish_reason: str | None, params: dict[str, Any] | None,
                     with_params: bool) -> dict[str, Any]:
    """A completions stream chunk (vLLM writes every choice field, nulls included)."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
              "prompt_token_ids": prompt_token_ids, "token_ids": token_ids, "weight_versions": None}
    chunk: dict[str, Any] = {"id": request_id, "object": COMPLETION, "created": created, "model": model,
                             "choices": [choice]}
    if with_params:
        chunk["kv_transfer_params"] = params
    return chunk


def usage_chunk(request_id: str, model: str, created: int, kind: str, usage_obj: dict[str, Any]) -> dict[str, Any]:
    """The trailing usage chunk (``stream_options.include_usage``)."""
    return {"id": request_id, "object": CHAT_CHUNK if kind == "chat" else COMPLETION, "created": created,
            "model": model, "choices": [], "usage": usage_obj}
