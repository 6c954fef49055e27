"""Helpers for the router tests: a real redis-server on a free port, and a tiny scriptable P/D backend.

The backend speaks just enough of vLLM's OpenAI API for the router's flow tests (failures that the
emulated engines do not produce: mid-stream breaks, malformed SSE, frames split at odd places).
Integration tests against the real emulated engines live in test_router_sim.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[str]:
    """Run the real ``redis-server`` binary on a free port; yield its URL; stop it afterwards."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: run `make sysdeps` (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp), "--protected-mode", "no"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"redis-server did not start on port {port}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def d_params(request_id: str, blocks: int = 3) -> dict[str, Any]:
    """What a bidirectional D returns at finish (Contract 1)."""
    return {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [list(range(blocks))],
            "remote_engine_id": "d-engine-1", "remote_request_id": f"chatcmpl-{request_id}-abcd1234",
            "remote_host": "localhost", "remote_port": 5601, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": 41, "remote_blocks_expiry_time": 123456.789,
            "remote_registration_generation": 1, "transfer_mode": "pull"}


def p_params(request_id: str) -> dict[str, Any]:
    """What P returns for D (Contract 1)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[7, 8]],
            "remote_engine_id": "p-engine-1", "remote_request_id": f"chatcmpl-{request_id}-11112222",
            "remote_host": "localhost", "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 30,
            "remote_blocks_expiry_time": None}


@dataclass
class FakeBackend:
    """A scriptable P+D: set the ``p_*`` / ``d_*`` attributes to change what the next request gets."""

    role: str
    p_status: int = 200
    p_finish: str = "length"
    p_cached_tokens: int = 0
    p_report: dict[str, Any] | None = None
    p_delay: float = 0.0
    p_malformed: bool = False  # answer HTTP 200 with a body that is not JSON
    d_mode: str = "ok"  # ok, no_key, null_params, error_event, break, malformed, no_done, split, hang, status
    d_status: int = 200
    d_chunks: int = 3
    d_delay: float = 0.0
    d_linger: float = 0.0  # seconds D keeps the stream open after [DONE] (a slow upstream close)
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    aborted: int = 0
    port: int = 0
    runner: web.AppRunner | None = None

    async def start(self) -> FakeBackend:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self.runner.addresses[0][1])
        return self

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append({k.title().replace("Id", "ID"): v for k, v in request.headers.items()})
        rid = request.headers.get("X-Request-Id", "none")
        if self.role == "prefill":
            return await self._prefill(rid)
        return await self._decode(request, rid, body)

    async def _prefill(self, rid: str) -> web.Response:
        if self.p_delay:
            await asyncio.sleep(self.p_delay)
        if self.p_malformed:
            return web.Response(body=b'{"id": "chatcmpl-x", "choices": [', content_type="application/json")
        if self.p_status != 200:
            return web.json_response({"error": {"message": "boom", "type": "InternalServerError", "code":
                                                self.p_status}}, status=self.p_status)
        params: dict[str, Any] | None = p_params(rid) if self.p_finish != "error" else None
        if self.p_report is not None:
            params = dict(params or {})
            params["kvdiag"] = self.p_report
        body = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                             "finish_reason": self.p_finish}],
                "usage": {"prompt_tokens": 30, "completion_tokens": 1, "total_tokens": 31,
                          "prompt_tokens_details": {"cached_tokens": self.p_cached_tokens}},
                "kv_transfer_params": params}
        return web.json_response(body)

    async def _decode(self, request: web.Request, rid: str, body: dict[str, Any]) -> web.StreamResponse:
        mode = self.d_mode
        if mode == "status":
            return web.json_response({"error": {"message": "decode boom", "code": self.d_status}},
                                     status=self.d_status)
        if not body.get("stream"):
            out = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "model": "m",
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello world"},
                                "finish_reason": "length"}],
                   "usage": {"prompt_tokens": 30, "completion_tokens": 2, "total_tokens": 32},
                   "kv_transfer_params": None if mode == "null_params" else d_params(rid)}
            if mode == "malformed":
                return web.Response(body=b"{not json", content_type="application/json")
            return web.json_response(out)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(self.d_chunks):
                delta = {"role": "assistant", "content": ""} if i == 0 else {"content": f"tok{i} "}
                await resp.write(_frame({"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk",
                                         "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}))
                if self.d_delay:
                    await asyncio.sleep(self.d_delay)
            if mode == "hang":
                await asyncio.sleep(3600)
            if mode == "break":
                assert request.transport is not None
                request.transport.close()
                return resp
            if mode == "error_event":
                await resp.write(_frame({"error": {"message": "engine died", "type": "InternalServerError",
                                                   "code": 500}}))
                await resp.write(b"data: [DONE]\n\n")
                return resp
            if mode == "malformed":
                await resp.write(b'data: {"choices": [], "kv_transfer_params": {oops\n\n')
                await resp.write(b"data: [DONE]\n\n")
                return resp
            final: dict[str, Any] = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk",
                                     "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "length"}]}
            if mode in ("ok", "split", "no_done"):
                final["kv_transfer_params"] = d_params(rid)
            elif mode == "null_params":
                final["kv_transfer_params"] = None
            data = _frame(final) + (b"" if mode == "no_done" else b"data: [DONE]\n\n")
            if mode == "split":
                # Split inside the key and inside the blank line that ends the frame.
                cut1 = data.index(b"kv_transfer") + 5
                cut2 = data.index(b"\n\n") + 1
                for piece in (data[:cut1], data[cut1:cut2], data[cut2:]):
                    await resp.write(piece)
                    await asyncio.sleep(0.01)
            else:
                await resp.write(data)
            if self.d_linger:
                await asyncio.sleep(self.d_linger)
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted += 1
            raise
        return resp


def _frame(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@contextlib.asynccontextmanager
async def fake_backends(n_prefill: int = 1, n_decode: int = 1) -> AsyncIterator[tuple[list[FakeBackend],
                                                                                    list[FakeBackend]]]:
    """Start ``n_prefill`` fake P and ``n_decode`` fake D; close them afterwards."""
    ps = [await FakeBackend("prefill").start() for _ in range(n_prefill)]
    ds = [await FakeBackend("decode").start() for _ in range(n_decode)]
    try:
        yield ps, ds
    finally:
        for b in ps + ds:
            await b.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every JSON line of ``path``."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    """Poll ``predicate()`` until true (events are written by a background thread)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)
