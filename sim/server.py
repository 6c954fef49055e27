"""The HTTP face of an emulated engine: vLLM's OpenAI endpoints, /health, /metrics, testbed admin.

Library use (tests, other components' integration tests)::

    handle = await start_engine(EngineConfig(role="decode", time_scale=0.01))
    url = handle.url                      # http://127.0.0.1:<port>
    ...
    await handle.close()

``serve()`` runs one engine until SIGTERM/SIGINT and writes the ready file the demo waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvdiag.schema.process import wait_for_stop_signal, write_ready_file
from kvdiag.sim import vllm_log as vl
from kvdiag.sim.config import EngineConfig
from kvdiag.sim.engine import Engine, KVLoadFailed, RequestFailed, RequestState
from kvdiag.sim.nixl import side_channel_app
from kvdiag.sim.tokenizer import detokenize, render_chat, token_text, tokenize

_ENGINE_KEY = web.AppKey("engine", Engine)
_MAX_PROMPT_TOKENS = 1_000_000


class BadRequest(ValueError):
    """A request body the OpenAI API would reject (HTTP 400)."""


def _error(message: str, status: int, kind: str = "BadRequestError") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                             status=status)


def _parse(engine: Engine, body: Any, kind: str) -> tuple[list[int], int, dict[str, Any] | None, bool, bool, int]:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("'messages' must be a list of message objects")
        prompt = render_chat(messages)
    else:
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
            raw = raw[0]
        if isinstance(raw, str):
            prompt = tokenize(raw)
        elif isinstance(raw, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            prompt = list(raw)
        else:
            raise BadRequest("'prompt' must be a string or a list of token ids")
    if not prompt or len(prompt) > _MAX_PROMPT_TOKENS:
        raise BadRequest(f"the prompt must have 1..{_MAX_PROMPT_TOKENS} tokens")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or engine.config.default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= 100_000:
        raise BadRequest("max_tokens must be an integer between 1 and 100000")
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise BadRequest("kv_transfer_params must be an object or null")
    stream = bool(body.get("stream", False))
    opts = body.get("stream_options")
    include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
    seed = body.get("seed")
    return prompt, max_tokens, params, stream, include_usage, seed if isinstance(seed, int) else 0


def _usage(state: RequestState) -> dict[str, Any]:
    return {"prompt_tokens": len(state.prompt), "total_tokens": len(state.prompt) + len(state.output),
            "completion_tokens": len(state.output),
            "prompt_tokens_details": {"cached_tokens": state.cached_tokens}}


def _body(engine: Engine, state: RequestState, kind: str, params: dict[str, Any] | None) -> dict[str, Any]:
    text = detokenize(state.output)
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": state.finish_reason, "stop_reason": None}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                             "audio": None, "function_call": None, "tool_calls": [], "reasoning_content": None}
    else:
        choice["text"] = text
        choice["prompt_logprobs"] = None
    return {"id": state.external_id, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": engine.config.model, "choices": [choice],
            "service_tier": None, "system_fingerprint": None, "usage": _usage(state), "prompt_logprobs": None,
            "prompt_token_ids": None, "kv_transfer_params": params}


def _chunk(engine: Engine, state: RequestState, kind: str, delta: str | None, finish: str | None,
           role: bool = False) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
    if kind == "chat":
        d: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if delta is not None:
            d["content"] = delta
        choice["delta"] = d
    else:
        choice["text"] = delta or ""
    return {"id": state.external_id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": engine.config.model, "choices": [choice]}


async def _handle_completion(request: web.Request, kind: str) -> web.StreamResponse:
    engine = request.app[_ENGINE_KEY]
    arrival = time.perf_counter()
    try:
        body = await request.json()
    except ValueError:
        return _error("request body is not valid JSON", 400)
    try:
        prompt, max_tokens, params, stream, include_usage, seed = _parse(engine, body, kind)
    except BadRequest as exc:
        return _error(str(exc), 400)
    model = body.get("model")
    if model is not None and model != engine.config.model:
        return _error(f"The model `{model}` does not exist.", 404, "NotFoundError")
    state = engine.new_request(request.headers.get("X-Request-Id"), kind, prompt, max_tokens, params, seed,
                               arrival=arrival)
    state.disconnected = lambda: request.transport is None or request.transport.is_closing()
    _log_received(engine, state, body)
    try:
        await engine.prefill(state)
    except RequestFailed as exc:
        engine.finish(state)
        if engine.config.enable_log_requests:
            engine.log.log("INFO", "request_failed", vl.MSG_REQUEST_FAILED, state.external_id, process=vl.API)
        return _error(f"Internal server error: {exc}", 500, "InternalServerError")
    except KVLoadFailed:
        state.finish_reason = "error"
        out_params = engine.finish(state)
        _log_generated(engine, state, "")
        if not stream:
            return web.json_response(_body(engine, state, kind, out_params))
        resp = await _start_sse(request)
        with contextlib.suppress(ConnectionError):
            await _send(resp, _chunk(engine, state, kind, None, "error", role=True))
            await resp.write(b"data: [DONE]\n\n")
        return resp
    if not stream:
        async for _ in engine.generate(state):
            pass
        out_params = engine.finish(state)
        _log_generated(engine, state, "")
        return web.json_response(_body(engine, state, kind, out_params))
    resp = await _start_sse(request)
    try:
        first = True
        async for tok in engine.generate(state):
            await _send(resp, _chunk(engine, state, kind, token_text(tok), None, role=first))
            first = False
    except asyncio.CancelledError:
        engine.finish(state, aborted=True)
        raise
    except ConnectionError:  # the client went away: vLLM aborts the request (no params, nothing held)
        engine.finish(state, aborted=True)
        return resp
    out_params = engine.finish(state)
    final = _chunk(engine, state, kind, "", state.finish_reason)
    if engine.faults.stream_kv_params:
        final["kv_transfer_params"] = out_params  # vLLM PR #40186: only the final chunk carries them
    with contextlib.suppress(ConnectionError):
        await _send(resp, final)
        if include_usage:
            usage_chunk = _chunk(engine, state, kind, None, None)
            usage_chunk["choices"] = []
            usage_chunk["usage"] = _usage(state)
            await _send(resp, usage_chunk)
        await resp.write(b"data: [DONE]\n\n")
    _log_generated(engine, state, " (streaming complete)")
    return resp


async def _start_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _send(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


def _log_received(engine: Engine, state: RequestState, body: dict[str, Any]) -> None:
    if not engine.config.enable_log_requests:
        return
    params = (f"SamplingParams(n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, "
              f"temperature={body.get('temperature', 1.0)}, top_p=1.0, top_k=0, min_p=0.0, seed={body.get('seed')}, "
              f"stop=[], stop_token_ids=[], bad_words=[], include_stop_str_in_output=False, ignore_eos=False, "
              f"max_tokens={state.max_tokens}, min_tokens={body.get('min_tokens', 0)}, logprobs=None, "
              f"prompt_logprobs=None, skip_special_tokens=True, spaces_between_special_tokens=True, "
              f"truncate_prompt_tokens=None, structured_outputs=None, "
              f"extra_args={{'kv_transfer_params': {state.params!r}}})")
    engine.log.log("INFO", "received_request", vl.MSG_RECEIVED_REQUEST, state.external_id, params, None,
                   process=vl.API)
    engine.log.log("INFO", "added_request", vl.MSG_ADDED_REQUEST, state.external_id, process=vl.API)


def _log_generated(engine: Engine, state: RequestState, suffix: str) -> None:
    if engine.config.enable_log_requests:
        engine.log.log("INFO", "generated_response", vl.MSG_GENERATED_RESPONSE, state.external_id, suffix,
                       detokenize(state.output), state.output, state.finish_reason, process=vl.API)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _handle_completion(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _handle_completion(request, "completion")


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _models(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE_KEY]
    return web.json_response({"object": "list", "data": [{"id": engine.config.model, "object": "model",
                                                          "owned_by": "vllm", "root": engine.config.model}]})


async def _metrics(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE_KEY]
    m = engine.metrics
    m.kv_cache_usage_perc.set(engine.pool.usage)
    m.num_requests_running.set(engine.running)
    m.num_requests_waiting.set(engine.waiting)
    return web.Response(body=generate_latest(m.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _admin_faults(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE_KEY]
    if request.method == "GET":
        return web.json_response(engine.faults.state())
    try:
        changes = await request.json()
        return web.json_response(engine.faults.update(changes))
    except ValueError as exc:
        return _error(str(exc), 400)


async def _admin_restart(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE_KEY]
    return web.json_response({"engine_id": engine.restart()})


async def _admin_evict(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE_KEY]
    count = None
    if request.can_read_body:
        with contextlib.suppress(ValueError):
            body = await request.json()
            if isinstance(body, dict) and isinstance(body.get("count"), int):
                count = body["count"]
    return web.json_response({"evicted": engine.evict_retained(count)})


def api_app(engine: Engine) -> web.Application:
    """The OpenAI-compatible app of ``engine``."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[_ENGINE_KEY] = engine
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    app.router.add_route("*", "/kvdiag/admin/faults", _admin_faults)
    app.router.add_post("/kvdiag/admin/restart", _admin_restart)
    app.router.add_post("/kvdiag/admin/evict", _admin_evict)
    return app


@dataclass
class EngineHandle:
    """A running engine: its ports, the Engine object, and close()."""

    engine: Engine
    port: int
    side_channel_port: int
    _runners: tuple[web.AppRunner, web.AppRunner]
    _background: asyncio.Task[None]

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API."""
        return f"http://{self.engine.config.host}:{self.port}"

    @property
    def engine_id(self) -> str:
        """The current engine id (changes on restart)."""
        return self.engine.engine_id

    async def close(self) -> None:
        """Stop serving and release everything."""
        await self.engine.close()
        self._background.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._background
        for runner in self._runners:
            await runner.cleanup()


async def _listen(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    return runner, int(sockets[0].getsockname()[1]) if sockets else port


async def start_engine(config: EngineConfig) -> EngineHandle:
    """Start an engine's API and side channel on ``config.host``; ports 0 pick free ones."""
    engine = Engine(config)
    side_runner, side_port = await _listen(side_channel_app(engine), config.host, config.side_channel_port)
    try:
        api_runner, port = await _listen(api_app(engine), config.host, config.port)
    except OSError:
        await side_runner.cleanup()
        raise
    engine.side_channel_port = side_port
    engine.announce()
    background = asyncio.create_task(engine.run_background())
    return EngineHandle(engine, port, side_port, (api_runner, side_runner), background)


async def serve(config: EngineConfig, ready_file: str | None = None) -> None:
    """Run one engine until SIGTERM/SIGINT; write ``ready_file`` once listening."""
    handle = await start_engine(config)
    if ready_file:
        write_ready_file(ready_file, {"port": handle.port, "side_channel_port": handle.side_channel_port,
                                      "engine_id": handle.engine_id})
    print(f"kvdiag sim {config.role}: serving on {handle.url} (side channel {handle.side_channel_port}, "
          f"engine_id {handle.engine_id})", flush=True)
    try:
        await wait_for_stop_signal()
    finally:
        await handle.close()
