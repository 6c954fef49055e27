"""The router's aiohttp application and its lifecycle.

Routes (drop-in for vLLM's ``disagg_proxy_multiturn.py``): ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /health`` (also as ``/healthcheck``, the one-way example proxy's name),
``GET /v1/models`` (the engines' list: OpenAI clients and ``vllm bench serve`` without ``--model`` ask for it),
``GET /metrics`` (Prometheus text, or OpenMetrics with exemplars when the scraper asks for it).

Usage::

    handle = await start_router(config)
    ...  # http://127.0.0.1:{handle.port}/v1/chat/completions
    await handle.close()

or, as ``kvdiag router`` does, ``await serve(config, ready_file)`` until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from kvdiag.router.config import RouterConfig
from kvdiag.router.flow import TurnFlow
from kvdiag.router.leg_messages import openai_error
from kvdiag.router.store import MemoryStore, RedisStore, Store, StoreError
from kvdiag.router.store_cluster import CLUSTER_SCHEMES, ClusterStore
from kvdiag.router.telemetry import EVENT_FLUSH_INTERVAL, RouterTelemetry
from kvdiag.router.upstream import LegError, Upstreams
from kvdiag.schema.process import wait_for_stop_signal, write_ready_file

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from kvdiag.exporters.otel import Tracing

_logger = logging.getLogger(__name__)

MODELS_TIMEOUT: Final = 10.0  # seconds one engine gets to list its models
SWEEP_INTERVAL: Final = 5.0  # seconds between store sweeps (expired handles, size gauge)
CLIENT_MAX_SIZE: Final = 256 << 20  # long multi-turn prompts are large JSON bodies


def build_store(config: RouterConfig, telemetry: RouterTelemetry) -> Store:
    """The store ``config.state`` names, wired to the eviction counter."""
    kwargs: dict[str, Any] = {"capacity": config.max_entries, "entry_ttl": config.handle_ttl,
                              "last_turn_ttl": config.last_turn_ttl, "lock_ttl": config.lock_ttl,
                              "on_evict": telemetry.evicted}
    if config.state == "memory":
        return MemoryStore(**kwargs)
    if config.state.startswith(CLUSTER_SCHEMES):
        return ClusterStore(config.state, **kwargs)
    return RedisStore(config.state, **kwargs)


class RouterApp:
    """Handlers and background work of one router process."""

    def __init__(self, config: RouterConfig, *, registry: CollectorRegistry | None = None,
                 span_exporter: SpanExporter | None = None, store: Store | None = None) -> None:
        self.config = config
        self.telemetry = RouterTelemetry(config, registry)
        self.store = store if store is not None else build_store(config, self.telemetry)
        self.upstreams = Upstreams(config)
        self.tracing: Tracing | None = None
        if config.otlp_endpoint is not None or span_exporter is not None:
            from kvdiag.exporters.otel import setup_tracing  # noqa: PLC0415 - the otel extra, only when tracing

            self.tracing = setup_tracing(config.otlp_endpoint, service_name=config.service_name,
                                         exporter=span_exporter)
        self.flow = TurnFlow(config, self.store, self.telemetry, self.upstreams, self.tracing)
        self._tasks: list[asyncio.Task[None]] = []

    def make_app(self) -> web.Application:
        """The aiohttp application with the router's routes and lifecycle hooks."""
        app = web.Application(client_max_size=CLIENT_MAX_SIZE)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/healthcheck", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        if isinstance(self.store, RedisStore | ClusterStore):
            await self.store.ping()
        await self.upstreams.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._sweep_forever()), loop.create_task(self._flush_forever())]
        if self.telemetry.proxy_log is not None:
            self.telemetry.proxy_log.ready(len(self.config.prefill), len(self.config.decode))

    async def _on_cleanup(self, _app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.flow.drain()
        await self.upstreams.close()
        await self.store.close()
        if self.tracing is not None:
            self.tracing.shutdown()
        self.telemetry.close()

    async def _update_size(self) -> int:
        try:
            size = await self.store.size()
        except StoreError as exc:
            self.telemetry.store_error("size")
            _logger.warning("store size failed: %s", exc)
            return -1
        self.telemetry.store_size(size)
        return size

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            await self._update_size()

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(EVENT_FLUSH_INTERVAL)
            self.telemetry.flush_events()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        return await self.flow.handle(request, "chat", "/v1/chat/completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        return await self.flow.handle(request, "completions", "/v1/completions")

    async def health(self, _request: web.Request) -> web.Response:
        """GET /health: the example proxy's body (status, cached_conversations, evicted_stale)."""
        before = self._evicted_ttl()
        size = await self._update_size()
        self.telemetry.request("health", 200 if size >= 0 else 503)
        body = {"status": "ok" if size >= 0 else "store_unavailable", "cached_conversations": max(size, 0),
                "evicted_stale": int(self._evicted_ttl() - before)}
        return web.json_response(body, status=200 if size >= 0 else 503)

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the list of the first D (else P) that answers, as that engine sent it (P and D of one
        deployment serve the same model)."""
        # (the body is passed on as the engine sent it: asked for uncompressed, as the router's client reads it)
        headers = {**self.flow.auth_header(request), "Accept-Encoding": "identity"}
        failures = []
        for leg in ("decode", "prefill"):
            for index in self.upstreams.listing_order(leg):
                try:
                    status, body, content_type = await self.upstreams.get(leg, index, "/v1/models", headers,
                                                                          MODELS_TIMEOUT)
                except LegError as exc:
                    failures.append(str(exc))
                    continue
                if status >= 500:
                    failures.append(f"{leg} {self.upstreams.address(leg, index)} answered HTTP {status}")
                    continue
                self.telemetry.request("models", status)
                return web.Response(body=body, status=status, headers={"Content-Type": content_type})
        self.telemetry.request("models", 502)
        return openai_error("no P or D instance listed its models: " + "; ".join(failures), 502)

    def _evicted_ttl(self) -> float:
        value = self.telemetry.registry.get_sample_value("kvdiag_store_evictions_total", {"reason": "ttl"})
        return value or 0.0

    async def metrics(self, request: web.Request) -> web.Response:
        """GET /metrics: text format, or OpenMetrics (with TTFT exemplars) when asked for."""
        await self._update_size()
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        body = encoder(self.telemetry.registry)
        self.telemetry.request("metrics", 200)
        return web.Response(body=body, headers={"Content-Type": content_type})


@dataclass
class RouterHandle:
    """A running router: its bound port and how to stop it."""

    app: RouterApp
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        """Base URL of the router."""
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        """Stop accepting, finish cleanup (store, pools, event file)."""
        await self.runner.cleanup()


async def start_router(config: RouterConfig, *, registry: CollectorRegistry | None = None,
                       span_exporter: SpanExporter | None = None, store: Store | None = None) -> RouterHandle:
    """Validate ``config``, start the router on its host/port (0 = a free port) and return the handle."""
    config.validate()
    router = RouterApp(config, registry=registry, span_exporter=span_exporter, store=store)
    runner = web.AppRunner(router.make_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, backlog=1024)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    port = config.port
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            port = int(address[1])
            break
    host = "127.0.0.1" if config.host in ("0.0.0.0", "") else config.host
    return RouterHandle(router, runner, host, port)


async def serve(config: RouterConfig, ready_file: Path | None = None,
                on_ready: Callable[[RouterHandle], None] | None = None) -> None:
    """Run the router until SIGTERM/SIGINT (the CLI's main loop); write ``ready_file`` once listening."""
    handle = await start_router(config)
    _freeze_startup_objects()
    try:
        if ready_file is not None:
            write_ready_file(ready_file, {"port": handle.port, "url": handle.url})
        if on_ready is not None:
            on_ready(handle)
        await wait_for_stop_signal()
    finally:
        await handle.close()


def _freeze_startup_objects() -> None:
    # Everything allocated so far lives for the whole run: move it out of the collector's reach, so a
    # full collection scans only per-turn garbage (otherwise its pause shows up in the router's p99).
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, 10_000), gen1, gen2)  # per-turn garbage is acyclic: collect less often
