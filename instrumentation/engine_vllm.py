"""The real-engine backend of the testbed: the sim's HTTP API over vLLM's own Scheduler and NIXL (CPU).

    python -m kvdiag.instrumentation.engine_vllm prefill --port 0 --ready-file p.json --events-file p.jsonl
    python -m kvdiag.instrumentation.engine_vllm decode  --port 0 --ready-file d.json --events-file d.jsonl

(``kvdiag sim prefill|decode --engine vllm`` is meant to dispatch here.) One process per role runs
vLLM 0.33.0's real v1 Scheduler, ``KVDiagNixlConnector`` in the scheduler and worker roles, a real
NIXL/UCX agent, CPU KV tensors and the real ZMQ side channel
(kvdiag.instrumentation.vllm_engine); only the model forward (a known pattern written into the
KV blocks) and the sampler (the sim tokenizer's deterministic replies) are stood in. It serves the
sim engines' API (docs/design.md Contract 1): ``/v1/chat/completions`` and ``/v1/completions``
(streaming or not, ``kv_transfer_params`` in and out, vLLM's ``X-Request-Id`` ids), ``/health``,
``/v1/models`` and ``/metrics`` (NIXL's and kvdiag's connector series through vLLM's own
``KVConnectorProm``). The log file gets vLLM's own log lines; the events file the connector's
TurnEvents. The step loop runs on the event loop between requests, as EngineCore's busy loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import prometheus_client
from aiohttp import web

from kvdiag.schema.process import wait_for_stop_signal, write_ready_file
from kvdiag.sim.tokenizer import detokenize, generate_reply, render_chat, token_text, tokenize

_logger = logging.getLogger(__name__)

MAX_PROMPT_TOKENS = 1800      # below the OPT-shaped model's 2048 positions, leaving room to decode
MAX_NEW_TOKENS = 200


@dataclass
class Options:
    """One engine's settings (the names follow ``kvdiag sim`` where they exist)."""

    role: str
    host: str = "127.0.0.1"
    port: int = 0
    side_channel_port: int = 0
    model: str = "Qwen/Qwen3-32B"
    engine_id: str | None = None
    bidirectional: bool = True
    kv_recompute_threshold: int | None = None
    decoder_kv_blocks_ttl: float = 480.0
    kv_lease_duration: float = 30.0
    prefix_caching: bool = True
    kv_load_failure_policy: str = "fail"
    num_blocks: int = 512
    events_file: str | None = None
    log_file: str | None = None
    log_level: str = "INFO"
    ready_file: str | None = None
    pull_matching_prefix: bool = True     # the connector's exact mode (kvdiag_pull_matching_prefix)
    prefix_digest: bool = True            # D returns kvdiag_digest (kvdiag_digest)
    seed: int = 0
    log_stats_interval: float | None = None   # seconds between stat lines; None: VLLM_LOG_STATS_INTERVAL (10)
    connector: str = "kvdiag"             # "kvdiag": KVDiagNixlConnector; "nixl": vLLM's own NixlConnector


@dataclass
class _Pending:
    """One request between the HTTP handler and the step loop."""

    engine_id: str
    kind: str
    prompt: list[int]
    request: Any = None
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)


class VllmBackend:
    """The real-vLLM engine and its step loop; HTTP handlers submit requests and await outputs."""

    def __init__(self, opts: Options, work_dir: Path) -> None:
        # vLLM is imported on first use (VLLM_TARGET_DEVICE must be set before its platform resolves,
        # and --help should not pay its ~5 s import).
        from kvdiag.instrumentation.vllm_engine import Engine, write_model_dir  # noqa: PLC0415

        affinity = os.sched_getaffinity(0)
        self.opts = opts
        extra: dict[str, Any] = {"bidirectional_kv_xfer": opts.bidirectional,
                                 "decoder_kv_blocks_ttl": opts.decoder_kv_blocks_ttl,
                                 "kv_lease_duration": opts.kv_lease_duration, "kvdiag_role": opts.role,
                                 "kvdiag_pull_matching_prefix": opts.pull_matching_prefix,
                                 "kvdiag_digest": opts.prefix_digest}
        if opts.kv_recompute_threshold is not None:
            extra["kv_recompute_threshold"] = opts.kv_recompute_threshold
        if opts.events_file:
            extra["kvdiag_events_file"] = opts.events_file
        connector: dict[str, Any] = {}
        if opts.connector == "nixl":  # stock vLLM: its NixlConnector, none of kvdiag's keys
            extra = {k: v for k, v in extra.items() if not k.startswith("kvdiag_")}
            connector["connector"] = "NixlConnector"
        # vLLM's NIXL compatibility hash covers the model path: P and D share one model directory.
        model_dir = write_model_dir(Path(tempfile.gettempdir()) / "kvdiag-vllm-cpu-model")
        self.engine = Engine("P" if opts.role == "prefill" else "D", model_dir, work_dir,
                             writer_tag=1 if opts.role == "prefill" else 2, num_blocks=opts.num_blocks, extra=extra,
                             prefix_caching=opts.prefix_caching, engine_id=opts.engine_id,
                             served_model_name=opts.model, side_channel_port=opts.side_channel_port or None,
                             kv_load_failure_policy=opts.kv_load_failure_policy, **connector)
        os.sched_setaffinity(0, affinity)  # vLLM's CPU platform pinned us to one core
        self.engine.on_output = self._on_output
        self.pending: dict[str, _Pending] = {}
        self._wake = asyncio.Event()
        self._closed = False
        self.metrics = _Metrics(self.engine)
        self.stat_log = _StatLog(self.engine)
        self.engine.on_stats = self.stat_log.record

    @property
    def engine_id(self) -> str:
        return str(self.engine.engine_id)

    def submit(self, pending: _Pending, max_tokens: int, params: dict[str, Any] | None, seed: int) -> None:
        """Add the request to vLLM's scheduler (the sampler's reply planned from the prompt)."""
        self.engine.reply_plans[pending.engine_id] = generate_reply(seed, pending.prompt, max_tokens)
        pending.request = self.engine.add(pending.engine_id, pending.prompt, max_tokens=max_tokens,
                                          kv_transfer_params=params)
        self.pending[pending.engine_id] = pending
        self._wake.set()

    def _on_output(self, out: Any) -> None:
        pending = self.pending.get(out.request_id)
        if pending is None:
            return
        pending.queue.put_nowait(out)
        if out.finish_reason is not None:
            self.pending.pop(out.request_id, None)
            self.engine.reply_plans.pop(out.request_id, None)

    async def run(self) -> None:
        """EngineCore's busy loop: step while anything is scheduled or held, else idle-poll (leases)."""
        while not self._closed:
            if self.engine.scheduler.has_requests():
                try:
                    self.engine.step()
                except Exception:  # a broken step must not wedge the server silently
                    _logger.exception("engine step failed")
                    for pending in list(self.pending.values()):
                        pending.queue.put_nowait(None)
                    self.pending.clear()
                self.metrics.observe()
                await asyncio.sleep(0)
            else:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.05)

    async def log_stats(self) -> None:
        """The API server's ``_force_log`` loop: vLLM's stat lines every interval."""
        interval = self.stat_log.interval(self.opts.log_stats_interval)
        while not self._closed:
            await asyncio.sleep(interval)
            try:
                self.stat_log.log()
            except Exception:  # a stats bug must not stop the server
                _logger.exception("stat logging failed")

    def close(self) -> None:
        self._closed = True
        self.engine.shutdown()


class _StatLog:
    """vLLM 0.33's ``LoggingStatLogger``, fed as AsyncLLM's output handler feeds it.

    Every engine step hands over the scheduler's ``SchedulerStats`` (with the connector's stats) and
    the step's outputs, which become an ``IterationStats`` through vLLM's own ``update_from_output``
    (prompt tokens computed, generation tokens). ``log()`` writes the ``Engine 000: …`` line and NIXL's
    ``KV Transfer metrics: …`` line exactly as ``vllm serve`` does, as the API server process.
    """

    _API_LOGGERS: Final = ("vllm.v1.metrics.loggers", "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
                           "vllm.entrypoints.generate.base.serving")
    MAX_TRACKED: Final = 65536

    def __init__(self, engine: Any) -> None:
        from vllm.v1.metrics.loggers import LoggingStatLogger  # noqa: PLC0415 (see VllmBackend.__init__)
        from vllm.v1.metrics.stats import LoRARequestStates  # noqa: PLC0415

        self.logger = LoggingStatLogger(engine.vllm_config, 0)
        self.lora = LoRARequestStates(log_stats=True)
        self.requests: dict[str, Any] = {}  # request id -> RequestStateStats, until it finishes
        for name in self._API_LOGGERS:
            logging.getLogger(name).addFilter(_as_api_server)

    @staticmethod
    def interval(option: float | None) -> float:
        """The option, else vLLM's ``VLLM_LOG_STATS_INTERVAL`` (10 s; non-positive values mean 10)."""
        if option is not None and option > 0:
            return float(option)
        import vllm.envs as envs  # noqa: PLC0415

        return float(envs.VLLM_LOG_STATS_INTERVAL)

    def record(self, stats: Any, outputs: list[Any], timestamp: float) -> None:
        from vllm.v1.metrics.stats import IterationStats, RequestStateStats  # noqa: PLC0415

        iteration = IterationStats() if outputs else None
        for out in outputs:
            assert iteration is not None
            req = self.requests.get(out.request_id)
            prefilling = req is None
            if req is None:
                if len(self.requests) >= self.MAX_TRACKED:
                    del self.requests[next(iter(self.requests))]
                req = self.requests[out.request_id] = RequestStateStats(arrival_time=time.time())
            iteration.update_from_output(out, timestamp, prefilling, req, self.lora, None)
            if out.finish_reason is not None:
                self.requests.pop(out.request_id, None)
        self.logger.record(scheduler_stats=stats, iteration_stats=iteration)

    def log(self) -> None:
        self.logger.log()


def _as_api_server(record: logging.LogRecord) -> bool:
    """vLLM writes its stat and serving lines in the API server process: name them so here."""
    record.vllm_process_name = "APIServer"
    return True


class _Metrics:
    """vLLM's KVConnectorProm (NIXL's and kvdiag's connector series) in a private registry."""

    def __init__(self, engine: Any) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm  # noqa: PLC0415

        self.registry = prometheus_client.CollectorRegistry()
        bound = {kind: _bind(getattr(prometheus_client, kind), self.registry)
                 for kind in ("Gauge", "Counter", "Histogram")}
        prom_cls = type("_Prom", (KVConnectorProm,), {"_gauge_cls": bound["Gauge"], "_counter_cls": bound["Counter"],
                                                     "_histogram_cls": bound["Histogram"]})
        model = engine.vllm_config.model_config.served_model_name
        self.prom = prom_cls(engine.vllm_config, ["model_name", "engine"], {0: [str(model), "0"]})
        self.engine = engine

    def observe(self) -> None:
        for payload in self.engine.stats:
            self.prom.observe(payload, 0)
        self.engine.stats.clear()

    def exposition(self) -> bytes:
        data: bytes = prometheus_client.generate_latest(self.registry)
        return data


def _bind(base: Any, registry: Any) -> Any:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("registry", registry)
        base.__init__(self, *args, **kwargs)

    return type(f"Bound{base.__name__}", (base,), {"__init__": init})


# --- HTTP ---------------------------------------------------------------------------------------

_BACKEND: web.AppKey[VllmBackend] = web.AppKey("backend", VllmBackend)


class BadRequest(ValueError):
    """A body the OpenAI API would reject (HTTP 400)."""


def _error(message: str, status: int, kind: str = "BadRequestError") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                             status=status)


def _parse(body: Any, kind: str) -> tuple[list[int], int, dict[str, Any] | None, bool, int]:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("'messages' must be a list of message objects")
        prompt = render_chat(messages)
    else:
        raw = body.get("prompt")
        if isinstance(raw, str):
            prompt = tokenize(raw)
        elif isinstance(raw, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            prompt = list(raw)
        else:
            raise BadRequest("'prompt' must be a string or a list of token ids")
    if not prompt or len(prompt) > MAX_PROMPT_TOKENS:
        raise BadRequest(f"the prompt must have 1..{MAX_PROMPT_TOKENS} tokens (this CPU engine's model length)")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_NEW_TOKENS:
        raise BadRequest(f"max_tokens must be an integer between 1 and {MAX_NEW_TOKENS}")
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise BadRequest("kv_transfer_params must be an object or null")
    seed = body.get("seed")
    return prompt, max_tokens, params, bool(body.get("stream", False)), seed if isinstance(seed, int) else 0


def _ids(header: str | None, kind: str) -> tuple[str, str]:
    """vLLM's external id (``chatcmpl-<X-Request-Id>``) and internal id (``<external>-<8 hex>``)."""
    base = header if header and len(header) <= 256 else secrets.token_hex(16)
    external = ("chatcmpl-" if kind == "chat" else "cmpl-") + base
    return external, f"{external}-{secrets.token_hex(4)}"


def _choice(kind: str, text: str, finish: str | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": text, "tool_calls": [], "reasoning_content": None}
    else:
        choice["text"] = text
    return choice


async def _completion(request: web.Request, kind: str) -> web.StreamResponse:
    backend = request.app[_BACKEND]
    try:
        body = await request.json()
    except ValueError:
        return _error("request body is not valid JSON", 400)
    try:
        prompt, max_tokens, params, stream, seed = _parse(body, kind)
    except BadRequest as exc:
        return _error(str(exc), 400)
    if body.get("model") not in (None, backend.opts.model):
        return _error(f"The model `{body.get('model')}` does not exist.", 404, "NotFoundError")
    if isinstance(params, dict) and params.get("do_remote_decode"):
        max_tokens = 1  # the P leg: prefill only, as the proxies ask
    external, internal = _ids(request.headers.get("X-Request-Id"), kind)
    pending = _Pending(engine_id=internal, kind=kind, prompt=prompt)
    backend.submit(pending, max_tokens, params, seed)
    resp: web.StreamResponse | None = None
    if stream:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
    tokens: list[int] = []
    first = True
    while True:
        out = await pending.queue.get()
        if out is None:
            return _error("Internal server error: engine step failed", 500, "InternalServerError")
        if resp is not None and first and kind == "chat":  # vLLM's first chat chunk: the role
            await _sse(resp, {"id": external, "object": "chat.completion.chunk", "created": int(time.time()),
                              "model": backend.opts.model, "choices": [
                                  {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}]})
        first = False
        tokens.extend(out.new_token_ids)
        finish = str(out.finish_reason) if out.finish_reason is not None else None
        if finish == "error":
            return await _generation_error(request, resp, external)
        if resp is not None and out.new_token_ids and finish is None:
            delta = "".join(token_text(t) for t in out.new_token_ids)
            await _sse(resp, {"id": external, "object": "chat.completion.chunk", "created": int(time.time()),
                              "model": backend.opts.model, "choices": [_delta(kind, delta, None)]})
        if finish is not None:
            break
    text = detokenize(tokens)
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(tokens), "total_tokens": len(prompt) + len(tokens),
             "prompt_tokens_details": {"cached_tokens": int(getattr(pending.request, "num_cached_tokens", 0) or 0)}}
    out_params = out.kv_transfer_params
    if resp is None:
        return web.json_response({
            "id": external, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": backend.opts.model, "choices": [_choice(kind, text, finish)],
            "usage": usage, "kv_transfer_params": out_params})
    last_delta = "".join(token_text(t) for t in out.new_token_ids)
    final = {"id": external, "object": "chat.completion.chunk", "created": int(time.time()),
             "model": backend.opts.model, "choices": [_delta(kind, last_delta, finish)], "usage": usage,
             "kv_transfer_params": out_params}  # vLLM PR #40186: the final chunk carries the params
    with contextlib.suppress(ConnectionError):
        await _sse(resp, final)
        await resp.write(b"data: [DONE]\n\n")
    return resp


async def _generation_error(request: web.Request, resp: web.StreamResponse | None, external: str
                            ) -> web.StreamResponse:
    """vLLM's serving layer on ``finish_reason`` error (a KV load failure under policy ``fail``): its own
    ``_raise_if_error`` logs the request and raises GenerationError, answered with vLLM's error object:
    HTTP 500 for a full response; in a stream (already 200) the object as the next chunk, then ``[DONE]``."""
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing  # noqa: PLC0415
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
        await resp.write(b"data: " + error.model_dump_json().encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
    return resp


def _delta(kind: str, text: str, finish: str | None) -> dict[str, Any]:
    if kind == "chat":
        return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


async def _sse(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "completion")


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _models(request: web.Request) -> web.Response:
    model = request.app[_BACKEND].opts.model
    return web.json_response({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "vllm"}]})


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[_BACKEND].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def make_app(backend: VllmBackend) -> web.Application:
    """The aiohttp app over ``backend``."""
    app = web.Application(client_max_size=8 * 1024 * 1024)
    app[_BACKEND] = backend
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
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
    work = Path(tempfile.mkdtemp(prefix=f"kvdiag-vllm-{opts.role}-"))
    backend = VllmBackend(opts, work)
    runner = web.AppRunner(make_app(backend), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, opts.host, opts.port)
    await site.start()
    port = runner.addresses[0][1]
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


CPU_MAX_BLOCKS = 2048   # 2,048 x 196,608 B = 384 MiB of KV per engine: plenty for the testbed's prompts


def options_from_sim(role: str, opts: dict[str, Any]) -> Options:
    """Map ``kvdiag sim prefill|decode`` options onto this backend (for ``--engine vllm``).

    ``--pull-matching-prefix`` and ``--prefix-digest`` map onto the connector's
    ``kvdiag_pull_matching_prefix`` and ``kvdiag_digest``. The time model, fault injection, stream
    switches, reasoning and tool-call parsers of the emulated engines do not apply: the
    real engine's behaviour is vLLM's own. ``--block-size`` is fixed at 32 (vLLM's CPU attention)
    and ``--num-blocks`` is capped at 2,048 (CPU memory).
    """
    return Options(role=role, host=opts.get("host", "127.0.0.1"), port=opts.get("port", 0),
                   side_channel_port=opts.get("side_channel_port", 0), model=opts.get("model", "Qwen/Qwen3-32B"),
                   engine_id=opts.get("engine_id"), bidirectional=not opts.get("no_bidirectional", False),
                   kv_recompute_threshold=opts.get("kv_recompute_threshold"),
                   decoder_kv_blocks_ttl=opts.get("decoder_kv_blocks_ttl", 480.0),
                   kv_lease_duration=opts.get("kv_lease_duration", 30.0),
                   prefix_caching=not opts.get("no_prefix_caching", False),
                   kv_load_failure_policy=opts.get("kv_load_failure_policy", "fail"),
                   num_blocks=min(int(opts.get("num_blocks") or 512), CPU_MAX_BLOCKS),
                   events_file=opts.get("events_file"), log_file=opts.get("log_file"),
                   log_level=str(opts.get("log_level", "INFO")).upper(), ready_file=opts.get("ready_file"),
                   pull_matching_prefix=bool(opts.get("pull_matching_prefix", True)),
                   prefix_digest=bool(opts.get("prefix_digest", True)),
                   log_stats_interval=opts.get("log_stats_interval"))


def run(opts: Options) -> None:
    """Configure vLLM's logging and serve until SIGTERM/SIGINT (the CLI entry for one engine)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    _configure_logging(opts)
    asyncio.run(serve(opts))


def parse_args(argv: list[str]) -> Options:
    """Command-line options (the names of ``kvdiag sim prefill|decode``)."""
    p = argparse.ArgumentParser(prog="python -m kvdiag.instrumentation.engine_vllm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=("prefill", "decode"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--side-channel-port", type=int, default=0)
    p.add_argument("--model", default="Qwen/Qwen3-32B")
    p.add_argument("--engine-id", default=None)
    p.add_argument("--no-bidirectional", action="store_true")
    p.add_argument("--kv-recompute-threshold", type=int, default=None)
    p.add_argument("--decoder-kv-blocks-ttl", type=float, default=480.0)
    p.add_argument("--kv-lease-duration", type=float, default=30.0)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-load-failure-policy", choices=("fail", "recompute"), default="fail")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--events-file", default=None)
    p.add_argument("--log-file", default=None)
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.add_argument("--ready-file", default=None)
    p.add_argument("--pull-matching-prefix", action=argparse.BooleanOptionalAction, default=True,
                   help="exact mode: P reads only the prefix D's block-hash digest proves equal to its prompt")
    p.add_argument("--prefix-digest", action=argparse.BooleanOptionalAction, default=True,
                   help="D returns kvdiag_digest, its sequence's block hashes")
    p.add_argument("--connector", choices=("kvdiag", "nixl"), default="kvdiag",
                   help="kvdiag's instrumented connector, or vLLM's own NixlConnector (the stock side of a comparison)")
    p.add_argument("--log-stats-interval", type=float, default=None,
                   help="seconds between vLLM's stat lines (default: VLLM_LOG_STATS_INTERVAL, else 10)")
    a = p.parse_args(argv)
    return Options(role=a.role, host=a.host, port=a.port, side_channel_port=a.side_channel_port, model=a.model,
                   engine_id=a.engine_id, bidirectional=not a.no_bidirectional,
                   kv_recompute_threshold=a.kv_recompute_threshold, decoder_kv_blocks_ttl=a.decoder_kv_blocks_ttl,
                   kv_lease_duration=a.kv_lease_duration, prefix_caching=not a.no_prefix_caching,
                   kv_load_failure_policy=a.kv_load_failure_policy, num_blocks=a.num_blocks,
                   events_file=a.events_file, log_file=a.log_file, log_level=a.log_level, ready_file=a.ready_file,
                   pull_matching_prefix=a.pull_matching_prefix, prefix_digest=a.prefix_digest,
                   log_stats_interval=a.log_stats_interval, connector=a.connector)


def main(argv: list[str] | None = None) -> int:
    run(parse_args(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
