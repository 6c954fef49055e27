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
import time
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest

from kvdiag.schema.process import wait_for_stop_signal, write_ready_file
from kvdiag.sim import openai_api as api
from kvdiag.sim import vllm_log_writer as vl
from kvdiag.sim.chat_request import ParsedRequest, parse_request
from kvdiag.sim.config import EngineConfig
from kvdiag.sim.emulated_engine import Engine, KVLoadFailed, RequestFailed, RequestState
from kvdiag.sim.nixl import side_channel_app
from kvdiag.sim.output_parser import StreamParser, count_reasoning_tokens, parse_full
from kvdiag.sim.tokenize_api import detokenize_response, tokenize_response
from kvdiag.sim.tokenizer import IM_END, detokenize, token_text

_ENGINE_KEY = web.AppKey("engine", Engine)


def _usage(engine: Engine, state: RequestState, req: ParsedRequest, full: bool) -> dict[str, Any]:
    reasoning = count_reasoning_tokens(state.output) if req.setup.reasoning else None
    if reasoning is not None and not req.setup.thinking:
        reasoning = 0
    return api.usage(len(state.prompt), len(state.output), state.cached_tokens, reasoning, full)


def _finish(state: RequestState, req: ParsedRequest, tool_calls_made: bool) -> str | None:
    """vLLM's chat finish reason: ``tool_calls`` when calls were returned and the model stopped on its own."""
    reason = state.finish_reason
    if req.kind == "chat" and tool_calls_made and reason == "stop" and not req.named_tool:
        return "tool_calls"
    return reason


def _hide_ids(req: ParsedRequest) -> bool:
    return req.setup.active and not req.setup.include_reasoning


def _body(engine: Engine, state: RequestState, req: ParsedRequest, params: dict[str, Any] | None) -> dict[str, Any]:
    ids = req.return_token_ids and not _hide_ids(req)
    out_ids = list(state.output) if ids else None
    prompt_ids = list(state.prompt) if req.return_token_ids else None
    if req.kind != "chat":
        return api.completion_body(request_id=state.external_id, model=engine.config.model,
                                      text=detokenize(t for t in state.output if t != IM_END),
                                      finish_reason=state.finish_reason, token_ids=out_ids,
                                      prompt_token_ids=prompt_ids, usage_obj=_usage(engine, state, req, True),
                                      params=params)
    parsed = parse_full(req.setup, state.output)
    if req.forced_tools and parsed.content is None:
        parsed = replace(parsed, content="")
    return api.chat_body(request_id=state.external_id, model=engine.config.model,
                            message=api.chat_message(parsed, engine.config.reasoning_field),
                            finish_reason=_finish(state, req, bool(parsed.tool_calls)), token_ids=out_ids,
                            prompt_token_ids=prompt_ids, usage_obj=_usage(engine, state, req, True), params=params)


async def _handle_completion(request: web.Request, kind: str) -> web.StreamResponse:
    engine = request.app[_ENGINE_KEY]
    arrival = time.perf_counter()
    body = await api.json_body(request)
    req = parse_request(engine.config, body, kind)
    api.check_model(body, engine.config.model)
    state = engine.new_request(request.headers.get("X-Request-Id"), kind, req.prompt, req.max_tokens, req.params,
                               req.seed, arrival=arrival, plan=req.plan)
    state.disconnected = lambda: request.transport is None or request.transport.is_closing()
    _log_received(engine, state, body)
    try:
        await engine.prefill(state)
    except RequestFailed as exc:
        engine.finish(state)
        if engine.config.enable_log_requests:
            engine.log.log("INFO", "request_failed", vl.MSG_REQUEST_FAILED, state.external_id, process=vl.API)
        return api.error_response(f"Internal server error: {exc}", 500, "InternalServerError")
    except KVLoadFailed:
        state.finish_reason = "error"
        engine.finish(state)
        return await _generation_error(request, engine, state, req)
    if not req.stream:
        async for _ in engine.generate(state):
            pass
        out_params = engine.finish(state)
        _log_generated(engine, state, "")
        return web.json_response(_body(engine, state, req, out_params))
    return await _stream(request, engine, state, req)


async def _generation_error(request: web.Request, engine: Engine, state: RequestState,
                            req: ParsedRequest) -> web.StreamResponse:
    """vLLM 0.33's answer to a request that finished with ``finish_reason`` error (a KV load failure under
    policy ``fail``): its serving layer logs the request and raises GenerationError, so a full response is
    HTTP 500 with the error object, and a stream (already 200) sends the error object as its next chunk
    (after the chat role chunk) and ``[DONE]``. No params, no choices.

    Instrumented, P's report rides in the error object, which a stock proxy never reads (it fails the
    request on the status or the error chunk alike).
    """
    engine.log.log("ERROR", "generation_error", vl.MSG_GENERATION_ERROR, state.external_id, process=vl.API)
    error = api.error_object("Internal server error", 500, "InternalServerError")
    if state.role == "P" and engine.config.instrumented:
        error["kvdiag"] = engine.report(state).to_dict()
    if not req.stream:
        return web.json_response({"error": error}, status=500)
    resp = await api.start_sse(request)
    with contextlib.suppress(ConnectionError):
        if req.kind == "chat":
            prompt_ids = list(state.prompt) if req.return_token_ids else None
            await api.send_sse(resp, api.chat_role_chunk(state.external_id, engine.config.model, int(time.time()),
                                                         prompt_ids))
        await api.send_error_chunk(resp, {"error": error})
    return resp


async def _stream(request: web.Request, engine: Engine, state: RequestState, req: ParsedRequest) -> web.StreamResponse:
    """Stream one token per chunk; the last token's chunk carries the finish reason and D's params."""
    resp = await api.start_sse(request)
    created, model, rid = int(time.time()), engine.config.model, state.external_id
    with_params = engine.faults.stream_kv_params
    ids = req.return_token_ids and not _hide_ids(req)
    parser = StreamParser(req.setup) if req.kind == "chat" else None
    prompt_ids = list(state.prompt) if req.return_token_ids else None
    finished = False
    try:
        async for tok in engine.generate(state):
            last = len(state.output) == len(state.planned)
            if req.kind == "chat" and len(state.output) == 1:  # vLLM sends the role with the first output
                await api.send_sse(resp, api.chat_role_chunk(rid, model, created, prompt_ids))
            out_params = None
            if last:  # the engine finishes the request before the final chunk goes out, as vLLM does
                out_params, finished = engine.finish(state), True
            if parser is None:
                text = "" if tok == IM_END else token_text(tok)
                await api.send_sse(resp, api.completion_chunk(
                    rid, model, created, text, [tok] if ids else None, prompt_ids if len(state.output) == 1 else None,
                    state.finish_reason if last else None, out_params, with_params))
                continue
            delta = parser.step(tok)
            if delta is None:
                if not last and not (ids and not _hide_ids(req)):
                    continue
                delta = {} if req.setup.active else {"content": ""}
            finish = _finish(state, req, parser.tools_streamed) if last else None
            await api.send_sse(resp, api.chat_chunk(rid, model, created, delta, [tok] if ids else None, finish,
                                                out_params, with_params))
    except asyncio.CancelledError:
        if not finished:
            engine.finish(state, aborted=True)
        raise
    except ConnectionError:  # the client went away: vLLM aborts the request (no params, nothing held)
        if not finished:
            engine.finish(state, aborted=True)
        return resp
    with contextlib.suppress(ConnectionError):
        if req.include_usage:
            await api.send_sse(resp, api.usage_chunk(rid, model, created, req.kind, _usage(engine, state, req, False)))
        await resp.write(api.DONE)
    _log_generated(engine, state, " (streaming complete)")
    return resp


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
                       detokenize(t for t in state.output if t != IM_END), state.output, state.finish_reason,
                       process=vl.API)


async def _tokenize(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE_KEY]
    try:
        body = await api.json_body(request)
        api.check_model(body, engine.config.model)
        return web.json_response(tokenize_response(engine.config, body))
    except api.ApiError as exc:
        return api.error_response(str(exc), exc.status, exc.kind)


async def _detokenize(request: web.Request) -> web.Response:
    try:
        return web.json_response(detokenize_response(await api.json_body(request)))
    except api.ApiError as exc:
        return api.error_response(str(exc), exc.status, exc.kind)


def _exposition(engine: Engine) -> bytes:
    m = engine.metrics
    m.kv_cache_usage_perc.set(engine.pool.usage)
    m.num_requests_running.set(engine.running)
    m.num_requests_waiting.set(engine.waiting)
    return bytes(generate_latest(m.registry))


async def _admin_faults(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE_KEY]
    if request.method == "GET":
        return web.json_response(engine.faults.state())
    try:
        changes = await request.json()
        return web.json_response(engine.faults.update(changes))
    except ValueError as exc:
        return api.error_response(str(exc), 400)


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
    app = api.openai_app(model=engine.config.model, completion=_handle_completion,
                         metrics=lambda: _exposition(engine), max_body_bytes=64 * 1024 * 1024)
    app[_ENGINE_KEY] = engine
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
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


async def start_engine(config: EngineConfig) -> EngineHandle:
    """Start an engine's API and side channel on ``config.host``; ports 0 pick free ones."""
    engine = Engine(config)
    side_runner, side_port = await api.listen(side_channel_app(engine), config.host, config.side_channel_port)
    try:
        api_runner, port = await api.listen(api_app(engine), config.host, config.port)
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
