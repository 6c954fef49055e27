"""The emulated NIXL side channel: handshake and block reads between engines over real TCP.

Each engine listens on its side-channel port (``remote_host``/``remote_port`` in
kv_transfer_params, as in vLLM). A reader first handshakes (``POST /nixl/handshake``), learning the
peer's engine id and its ``time.perf_counter()`` reading, from which it derives the clock offset
used to compare ``remote_blocks_expiry_time`` (PR #47021). It then reads blocks
(``POST /nixl/read``) and notifies the owner (``POST /nixl/notify``, notify-only after a threshold
skip); the owner frees its held blocks on the notification, as vLLM does after a READ completes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import aiohttp
from aiohttp import web

NIXL_CONNECTOR_VERSION: Final = 5
_HTTP_TIMEOUT_S: Final = 5.0  # vLLM's zmq RCVTIMEO is 5 s
_MAX_PEERS: Final = 256


class NixlFailure(Exception):
    """A failed handshake or read; ``failure_type`` is vLLM's name for it."""

    def __init__(self, failure_type: str, message: str, exc_line: str | None = None) -> None:
        super().__init__(message)
        self.failure_type = failure_type
        self.exc_line = exc_line


class NixlPeer(Protocol):
    """What the side channel asks of the engine that owns it."""

    def nixl_handshake(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def nixl_read(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def nixl_notify(self, body: dict[str, Any]) -> dict[str, Any]: ...


def side_channel_app(peer: NixlPeer) -> web.Application:
    """The aiohttp app serving one engine's side channel."""
    app = web.Application(client_max_size=8 * 1024 * 1024)

    def route(fn: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            try:
                body = await request.json()
            except ValueError:
                return web.json_response({"error": "body must be JSON"}, status=400)
            if not isinstance(body, dict):
                return web.json_response({"error": "body must be a JSON object"}, status=400)
            return web.json_response(fn(body))
        return handler

    app.router.add_post("/nixl/handshake", route(peer.nixl_handshake))
    app.router.add_post("/nixl/read", route(peer.nixl_read))
    app.router.add_post("/nixl/notify", route(peer.nixl_notify))
    return app


@dataclass
class RemoteAgent:
    """A peer known from a handshake."""

    engine_id: str
    host: str
    port: int
    clock_offset: float  # peer perf_counter - local perf_counter
    last_used: float


class NixlClient:
    """The reader side: handshakes (cached per remote engine) and reads."""

    def __init__(self, local_engine_id: str) -> None:
        self.local_engine_id = local_engine_id
        self.agents: OrderedDict[str, RemoteAgent] = OrderedDict()
        self._session: aiohttp.ClientSession | None = None

    async def _post(self, host: str, port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_HTTP_TIMEOUT_S))
        url = f"http://{host}:{port}{path}"
        async with self._session.post(url, json=body) as resp:
            data = await resp.json(content_type=None)
            if resp.status != 200 or not isinstance(data, dict):
                raise RuntimeError(f"side channel {url} answered HTTP {resp.status}")
            return data

    def forget(self) -> None:
        """Drop every known peer (engine restart)."""
        self.agents.clear()

    async def handshake(self, engine_id: str, host: str, port: int) -> RemoteAgent:
        """Handshake with the peer that params name; raise NixlFailure('handshake_failed')."""
        known = self.agents.get(engine_id)
        if known is not None and (known.host, known.port) == (host, port):
            known.last_used = time.monotonic()
            self.agents.move_to_end(engine_id)
            return known
        t0 = time.perf_counter()
        try:
            data = await self._post(host, port, "/nixl/handshake",
                                    {"engine_id": engine_id, "reader_engine_id": self.local_engine_id,
                                     "version": NIXL_CONNECTOR_VERSION})
        except (TimeoutError, aiohttp.ClientError, RuntimeError, ValueError) as exc:
            raise NixlFailure("handshake_failed", str(exc),
                              "zmq.error.Again: Resource temporarily unavailable") from None
        t1 = time.perf_counter()
        remote_id = data.get("engine_id")
        if remote_id != engine_id:
            msg = f"Remote NIXL agent engine ID mismatch. Expected {engine_id},received {remote_id}."
            raise NixlFailure("handshake_failed", msg, f"RuntimeError: {msg}")
        offset = float(data.get("perf_counter", 0.0)) - (t0 + t1) / 2.0
        agent = RemoteAgent(engine_id, host, port, offset, time.monotonic())
        self.agents[engine_id] = agent
        while len(self.agents) > _MAX_PEERS:
            self.agents.popitem(last=False)
        return agent

    async def read(self, agent: RemoteAgent, remote_request_id: str, block_ids: list[int],
                   reader_request_id: str, notify: bool) -> dict[str, Any]:
        """Read ``block_ids`` of ``remote_request_id`` (and notify); raise NixlFailure('transfer_failed')."""
        try:
            data = await self._post(agent.host, agent.port, "/nixl/read", {
                "engine_id": agent.engine_id, "remote_request_id": remote_request_id, "block_ids": block_ids,
                "reader_engine_id": self.local_engine_id, "reader_request_id": reader_request_id,
                "notify": notify})
        except (TimeoutError, aiohttp.ClientError, RuntimeError, ValueError) as exc:
            self.agents.pop(agent.engine_id, None)
            raise NixlFailure("transfer_failed", str(exc)) from None
        if data.get("engine_mismatch"):
            # The peer restarted under a new engine id: the old agent's memory is gone.
            self.agents.pop(agent.engine_id, None)
            raise NixlFailure("transfer_failed", "remote agent memory registration is gone")
        return data

    async def notify(self, agent: RemoteAgent, remote_request_id: str) -> None:
        """Notify-only: tell the owner its blocks are no longer needed; raise NixlFailure('notification_failed')."""
        try:
            await self._post(agent.host, agent.port, "/nixl/notify",
                             {"engine_id": agent.engine_id, "remote_request_id": remote_request_id,
                              "reader_engine_id": self.local_engine_id})
        except (TimeoutError, aiohttp.ClientError, RuntimeError, ValueError) as exc:
            raise NixlFailure("notification_failed", str(exc)) from None

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None
