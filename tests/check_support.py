"""Helpers for the live-check tests: the emulated cluster on loopback, and a gateway that misbehaves.

The cluster is the real emulated engines (kvdiag.sim) and the real router, started in the test's
event loop. ``Gateway`` is a small reverse proxy put in front of the router to reproduce what an
API gateway or ingress can do to a deployment: drop the body's ``conversation_id``, or answer with
a skewed ``Date`` header (a node whose clock is off).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any

import aiohttp
from aiohttp import web

from kvdiag.router.app import RouterHandle, start_router
from kvdiag.router.config import RouterConfig, Upstream
from kvdiag.sim.config import EngineConfig
from kvdiag.sim.server import EngineHandle, start_engine


@dataclass
class Cluster:
    """P, D and the router of one test."""

    p: EngineHandle
    d: EngineHandle
    router: RouterHandle

    @property
    def urls(self) -> dict[str, str]:
        """The check's targets."""
        return {"router": self.router.url, "prefill": self.p.url, "decode": self.d.url}


@contextlib.asynccontextmanager
async def sim_cluster(p: dict[str, Any] | None = None, d: dict[str, Any] | None = None,
                      router: dict[str, Any] | None = None) -> AsyncIterator[Cluster]:
    """Start P, D (no modelled sleeps) and the router on 127.0.0.1; stop them afterwards."""
    pe = await start_engine(EngineConfig(**{"role": "prefill", "time_scale": 0, **(p or {})}))
    de = await start_engine(EngineConfig(**{"role": "decode", "time_scale": 0, **(d or {})}))
    config = RouterConfig(prefill=(Upstream("127.0.0.1", pe.port),), decode=(Upstream("127.0.0.1", de.port),),
                          host="127.0.0.1", port=0, **(router or {}))
    rh = await start_router(config)
    try:
        yield Cluster(pe, de, rh)
    finally:
        await rh.close()
        await pe.close()
        await de.close()


@dataclass
class Gateway:
    """A reverse proxy in front of ``upstream``: optionally drops conversation_id, optionally skews Date."""

    upstream: str
    drop_conversation_id: bool = False
    clock_offset_s: float = 0.0
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        """The gateway's base URL."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Gateway:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self.runner.addresses[0][1])
        self._session = aiohttp.ClientSession()
        return self

    async def close(self) -> None:
        await self._session.close()
        if self.runner is not None:
            await self.runner.cleanup()

    def _date(self) -> str:
        import time

        return formatdate(time.time() + self.clock_offset_s, usegmt=True)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if body and self.drop_conversation_id:
            obj = json.loads(body)
            obj.pop("conversation_id", None)
            body = json.dumps(obj).encode()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with self._session.request(request.method, self.upstream + request.path_qs, data=body or None,
                                         headers=headers) as resp:
            out = web.StreamResponse(status=resp.status)
            for name, value in resp.headers.items():
                if name.lower() not in ("content-length", "transfer-encoding", "date", "server", "connection"):
                    out.headers[name] = value
            out.headers["Date"] = self._date()
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out


@contextlib.asynccontextmanager
async def gateway(upstream: str, **kw: Any) -> AsyncIterator[Gateway]:
    """A running Gateway in front of ``upstream``."""
    gw = await Gateway(upstream, **kw).start()
    try:
        yield gw
    finally:
        await gw.close()


@contextlib.contextmanager
def cluster_in_thread(**kw: Any) -> Iterator[dict[str, str]]:
    """The emulated cluster in a background event loop, for tests that run the CLI (which has its own loop)."""
    loop = asyncio.new_event_loop()
    ready: asyncio.Future[dict[str, str]] = loop.create_future()
    stop = asyncio.Event()

    async def main() -> None:
        try:
            async with sim_cluster(**kw) as cluster:
                ready.set_result(cluster.urls)
                await stop.wait()
        except BaseException as exc:  # surface start-up failures to the test thread
            if not ready.done():
                ready.set_exception(exc)
            raise

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    try:
        yield asyncio.run_coroutine_threadsafe(asyncio.wait_for(asyncio.shield(ready), 30), loop).result(35)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()
