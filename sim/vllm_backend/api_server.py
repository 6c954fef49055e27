"""The real-vLLM backend's HTTP face: vLLM's OpenAI API (the emulated engines' own, kvdiag.sim.openai_api)
over one real-vLLM engine's step loop.

It serves what the emulated engines serve (docs/design.md, Contract 1): chat and completions,
streaming or not, ``kv_transfer_params`` in and out (the final chunk carries them), vLLM's
``X-Request-Id`` ids, ``/health``, ``/v1/models`` and ``/metrics`` (NIXL's and kvdiag's connector
series through vLLM's own ``KVConnectorProm``). The log file gets vLLM's own log lines; the events
file the connector's TurnEvents. Only the model forward (a known pattern written into the KV
blocks) and the sampler (the sim tokenizer's deterministic replies) are stood in.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from kvdiag.schema.process import wait_for_stop_signal, write_ready_file
from kvdiag.schema.request_ids import vllm_request_ids
from kvdiag.sim import openai_api as api
from kvdiag.sim.tokenizer import detokenize, render_chat, token_text, tokenize
from kvdiag.sim.vllm_backend.options import MAX_NEW_TOKENS, MAX_PROMPT_TOKENS, Options, parse_args
from kvdiag.sim.vllm_backend.step_loop import Pending, VllmBackend

_BACKEND: web.AppKey[VllmBackend] = web.AppKey("backend", VllmBackend)


def _parse(body: Any, kind: str) -> tuple[list[int], int, dict[str, Any] | None, bool, int]:
    if not isinstance(body, dict):
        raise api.BadRequest("request body must be a JSON object")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise api.BadRequest("'messages' must be a list of message objects")
        prompt = render_chat(messages)
    else:
        raw = body.get("prompt")
        if isinstance(raw, str):
            prompt = tokenize(raw)
        elif isinstance(raw, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            prompt = list(raw)
        else:
            raise api.BadRequest("'prompt' must be a string or a list of token ids")
    if not prompt or len(prompt) > MAX_PROMPT_TOKENS:
        raise api.BadRequest(f"the prompt must have 1..{MAX_PROMPT_TOKENS} tokens (this CPU engine's model length)")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_NEW_TOKENS:
        raise api.BadRequest(f"max_tokens must be an integer between 1 and {MAX_NEW_TOKENS}")
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise api.BadRequest("kv_transfer_params must be an object or null")
    seed = body.get("seed")
    return prompt, max_tokens, params, bool(body.get("stream", False)), seed if isinstance(seed, int) else 0


def _chunk(kind: str, rid: str, model: str, created: int, text: str, finish: str | None,
           params: dict[str, Any] | None) -> dict[str, Any]:
    if kind == "chat":
        return api.chat_chunk(rid, model, created, {"content": text}, None, finish, params, True)
    return api.completion_chunk(rid, model, created, text, None, None, finish, params, True)


async def _completion(request: web.Request, kind: str) -> web.StreamResponse:
    backend = request.app[_BACKEND]
    body = await api.json_body(request)
    prompt, max_tokens, params, stream, seed = _parse(body, kind)
    api.check_model(body, backend.opts.model)
    if isinstance(params, dict) and params.get("do_remote_decode"):
        max_tokens = 1  # the P leg: prefill only, as the proxies ask
    external, internal = vllm_request_ids(request.headers.get("X-Request-Id"), kind)
    pending = Pending(engine_id=internal, kind=kind, prompt=prompt)
    backend.submit(pending, max_tokens, params, seed)
    model, created = backend.opts.model, int(time.time())
    resp = await api.start_sse(request) if stream else None
    tokens: list[int] = []
    first = True
    while True:
        out = await pending.queue.get()
        if out is None:
            return await _step_failed(resp)
        if resp is not None and first and kind == "chat":  # vLLM's first chat chunk: the role
            await api.send_sse(resp, api.chat_role_chunk(external, model, created, None))
        first = False
        tokens.extend(out.new_token_ids)
        finish = str(out.finish_reason) if out.finish_reason is not None else None
        if finish == "error":
            return await _generation_error(resp, external)
        if finish is not None:
            break
        if resp is not None and out.new_token_ids:
            await api.send_sse(resp, _chunk(kind, external, model, created,
                                            "".join(token_text(t) for t in out.new_token_ids), None, None))
    cached = int(getattr(pending.request, "num_cached_tokens", 0) or 0)
    out_params = out.kv_transfer_params
    if resp is None:
        usage = api.usage(len(prompt), len(tokens), cached, None, True)
        text = detokenize(tokens)
        if kind == "chat":
            return web.json_response(api.chat_body(
                request_id=external, model=model, message=api.chat_message(api.text_message(text), "reasoning"),
                finish_reason=finish, token_ids=None, prompt_token_ids=None, usage_obj=usage, params=out_params))
        return web.json_response(api.completion_body(
            request_id=external, model=model, text=text, finish_reason=finish, token_ids=None, prompt_token_ids=None,
            usage_obj=usage, params=out_params))
    with contextlib.suppress(ConnectionError):
        await api.send_sse(resp, _chunk(kind, external, model, created,
                                        "".join(token_text(t) for t in out.new_token_ids), finish, out_params))
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            await api.send_sse(resp, api.usage_chunk(external, model, created, kind,
                                                     api.usage(len(prompt), len(tokens), cached, None, False)))
        await resp.write(api.DONE)
    return resp


async def _step_failed(resp: web.StreamResponse | None) -> web.StreamResponse:
    error = api.error_object("Internal server error: engine step failed", 500, "InternalServerError")
    if resp is None:
        return web.json_response({"error": error}, status=500)
    with contextlib.suppress(ConnectionError):
        await api.send_error_chunk(resp, {"error": error})
    return resp


async def _generation_error(resp: web.StreamResponse | None, external: str) -> web.StreamResponse:
    """vLLM's serving layer on ``finish_reason`` error (a KV load failure under policy ``fail``): its own
    ``_raise_if_error`` logs the request and raises GenerationError, answered with vLLM's error object:
    HTTP 500 for a full response; in a stream (already 200) the object as the next chunk, then ``[DONE]``."""
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing  # noqa: PLC0415 - imports vLLM
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response  # noqa: PLC0415
    from vllm.exceptions import GenerationError  # noqa: PLC0415

    try:
        GenerateBaseServing._raise_if_error(None, "error", external)  # type: ignore[arg-type]
        raise GenerationError("Internal server error")  # not reached: the line above raises
    except GenerationError as exc:
        error = create_error_response(exc)
    if resp is None:
        return web.json_response(error.model_dump(), status=int(error.error.code))
    with contextlib.suppress(ConnectionError):
        await api.send_error_chunk(resp, error.model_dump())
    return resp


def make_app(backend: VllmBackend) -> web.Application:
    """The aiohttp app over ``backend``."""
    app = api.openai_app(model=backend.opts.model, completion=_completion, metrics=backend.metrics.exposition,
                         max_body_bytes=8 * 1024 * 1024)
    app[_BACKEND] = backend
    return app


def _configure_logging(opts: Options) -> None:
    from vllm.config import LoggingConfig  # noqa: PLC0415 (see VllmBackend.__init__)
    from vllm.logger import configure_logging, set_vllm_process_name  # noqa: PLC0415

    if opts.log_file:
        # vLLM's handlers write to stdout/stderr: send both to the log file, as a redirected engine would.
        fd = os.open(opts.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    configure_logging(LoggingConfig(log_level=opts.log_level))
    set_vllm_process_name("EngineCore")


async def serve(opts: Options) -> None:
    """Run one engine until SIGTERM/SIGINT (the ready file appears once it listens)."""
    # (the engine's scratch folder, its process group's rendezvous file in it, goes when the engine stops: each
    # start left one behind before)
    with tempfile.TemporaryDirectory(prefix=f"kvdiag-vllm-{opts.role}-", ignore_cleanup_errors=True) as scratch:
        backend = VllmBackend(opts, Path(scratch))
        runner, port = await api.listen(make_app(backend), opts.host, opts.port)
        if opts.ready_file:
            write_ready_file(opts.ready_file, {"port": port, "side_channel_port": backend.engine.side_channel_port,
                                               "engine_id": backend.engine_id})
        tasks = [asyncio.create_task(backend.run()), asyncio.create_task(backend.log_stats())]
        await wait_for_stop_signal()
        backend.close()
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await runner.cleanup()


def run(opts: Options) -> None:
    """Configure vLLM's logging and serve until SIGTERM/SIGINT (the CLI entry for one engine)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    _configure_logging(opts)
    asyncio.run(serve(opts))


def main(argv: list[str] | None = None) -> int:
    """``python -m kvdiag.sim.vllm_backend ROLE [options]``."""
    run(parse_args(sys.argv[1:] if argv is None else argv))
    return 0
