"""Router replicas as real ``kvdiag router`` processes, and a client that spreads each conversation's turns.

``TenantStub`` is router_support.VllmStub (P and D with vLLM 0.33's API, token-exact KV accounting) that
also records which tenant and conversation every D sequence belongs to, so a test can say whether P
was ever handed a handle from another tenant's or another conversation's sequence, or the same handle
twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from router_support import VllmStub

KVDIAG = str(Path(sys.executable).parent / "kvdiag")
REUSED = frozenset({"remote_hit", "local_hit"})


class TenantStub(VllmStub):
    """VllmStub that checks every handle P receives against the tenant and conversation of its sequence.

    Its P counts cached tokens as vLLM 0.33 does: the tokens read from D in ``usage.prompt_tokens_details``
    and in the ``remote_prefill_cached_tokens`` it hands D.
    """

    async def start(self) -> TenantStub:
        self.owner: dict[str, tuple[str, str]] = {}  # router request id -> (Authorization, first user message)
        self.handles_read: list[str] = []
        self.foreign: list[str] = []  # handles from another tenant's or conversation's sequence
        await super().start()
        return self

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = request.headers.get("X-Request-Id", "x")
        first = next((m.get("content") for m in body.get("messages", []) if m.get("role") == "user"), "")
        self.owner[rid] = (request.headers.get("Authorization", ""), str(first))
        params = body.get("kv_transfer_params") or {}
        remote = params.get("remote_request_id")
        if params.get("do_remote_decode") and isinstance(remote, str) and remote in self.sequences:
            self.handles_read.append(remote)
            d_rid = remote[len("chatcmpl-"):remote.rindex("-d")]
            if self.owner.get(d_rid) != self.owner[rid]:
                self.foreign.append(remote)
        return await super()._handle(request)  # aiohttp keeps the body: the stub reads it again

    def _prefill(self, body: dict[str, Any], params: dict[str, Any], prompt: list[int], rid: str,
                 chat: bool) -> dict[str, Any]:
        out = super()._prefill(body, params, prompt, rid, chat)
        cached = self.prefills[-1].read_tokens
        out["kv_transfer_params"]["remote_prefill_cached_tokens"] = cached
        out["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
        return out


@dataclass
class RouterProcess:
    """One ``kvdiag router`` replica."""

    index: int
    folder: Path
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None
    url: str = ""

    @property
    def events(self) -> Path:
        return self.folder / f"router{self.index}-events.jsonl"

    def start(self, timeout: float = 30.0) -> RouterProcess:
        ready = self.folder / f"router{self.index}.ready"
        ready.unlink(missing_ok=True)
        log = (self.folder / f"router{self.index}.log").open("ab")
        self.proc = subprocess.Popen([KVDIAG, "router", "--host", "127.0.0.1", "--port", "0", "--ready-file",
                                      str(ready), "--events-file", str(self.events), *self.args],
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"router {self.index} did not start: "
                                   f"{(self.folder / f'router{self.index}.log').read_text()[-2000:]}")
            time.sleep(0.05)
        self.url = json.loads(ready.read_text())["url"]
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no cleanup, claims it held stay until they expire."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.alive and self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def rss_kib(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def read_events(self) -> list[dict[str, Any]]:
        if not self.events.exists():
            return []
        return [json.loads(line) for line in self.events.read_text().splitlines() if line.strip()]


@contextlib.contextmanager
def replicas(folder: Path, n: int, backend_port: int, state: str, *extra: str) -> Iterator[list[RouterProcess]]:
    """``n`` router processes sharing ``state``, in front of one P+D stub."""
    args = ["--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(backend_port), "--decoder-hosts",
            "127.0.0.1", "--decoder-ports", str(backend_port), "--state", state, "--block-size", "16", *extra]
    procs = [RouterProcess(i, folder, args) for i in range(n)]
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.stop()


async def metric(session: aiohttp.ClientSession, url: str, name: str) -> dict[str, float]:
    """Every sample of ``name`` on a router's /metrics, by its label text."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name):
            key, _, value = line.rpartition(" ")
            out[key[len(name):]] = float(value)
    return out


@dataclass
class TurnResult:
    conversation: int
    turn: int
    replica: int
    attempt: int
    ok: bool
    verdict: str | None = None
    reused: int = 0
    header: str = ""
    started_at: float = 0.0
    finished_at: float = 0.0
    error: str = ""
    refused: bool = False  # the replica was down: the turn never reached a router


@dataclass
class Conversation:
    """A multi-turn chat sent back verbatim (every later turn can reuse D's whole handle)."""

    index: int
    tenant: str
    cid: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns_done: int = 0
    results: list[TurnResult] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [{"role": "user", "content": f"conversation {self.cid} of {self.tenant}: tell me a story "
                                                     "about a router that never forgets a handle."}]


def header_params(header: str) -> dict[str, str]:
    verdict, *rest = header.split("; ") if header else ("",)
    return {"verdict": verdict, **dict(p.split("=", 1) for p in rest if "=" in p)}


async def send_turn(session: aiohttp.ClientSession, routers: list[RouterProcess], conv: Conversation,
                    first_choice: int, timeout: float = 30.0) -> TurnResult:
    """One turn, streamed; a replica that refuses or breaks the turn is followed by the next (a load balancer)."""
    turn = conv.turns_done + 1
    body = {"model": "Qwen/Qwen3-32B", "messages": conv.messages, "stream": True, "conversation_id": conv.cid}
    headers = {"Authorization": f"Bearer {conv.tenant}"}
    for attempt in range(len(routers) * 2):
        replica = (first_choice + attempt) % len(routers)
        router = routers[replica]
        result = TurnResult(conv.index, turn, replica, attempt, ok=False, started_at=time.monotonic())
        try:
            async with session.post(router.url + "/v1/chat/completions", json=body, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                result.header = resp.headers.get("kvdiag-reuse", "")
                raw = await resp.read()
            if resp.status != 200 or not raw.endswith(b"data: [DONE]\n\n") or b'"error"' in raw:
                raise RuntimeError(f"HTTP {resp.status}: {raw[-200:]!r}")
        except (TimeoutError, aiohttp.ClientError, RuntimeError, ConnectionError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:200]
            result.refused = isinstance(exc, aiohttp.ClientConnectorError)
            conv.results.append(result)
            await asyncio.sleep(0.05)
            continue
        params = header_params(result.header)
        result.ok, result.verdict = True, params["verdict"]
        result.reused = int(params.get("reused", "0"))
        result.finished_at = time.monotonic()
        text = "".join(_contents(raw))
        conv.messages = [*conv.messages, {"role": "assistant", "content": text},
                         {"role": "user", "content": f"turn {turn + 1}: and then?"}]
        conv.turns_done = turn
        conv.results.append(result)
        return result
    raise RuntimeError(f"conversation {conv.index} turn {turn}: every replica failed: {conv.results[-1].error}")


def _contents(raw: bytes) -> Iterator[str]:
    for frame in raw.split(b"\n\n"):
        if frame.startswith(b"data: {"):
            for choice in json.loads(frame[6:]).get("choices", []):
                yield (choice.get("delta") or {}).get("content") or ""


def eligible_turns(conv: Conversation) -> list[TurnResult]:
    """Later turns sent once whose previous turn was sent once, completed, and owned the conversation.

    A turn that broke on a killed replica leaves its claim until it expires: its retry and the turns
    after it are concurrent turns, which by design get no handle, so they are not eligible. A turn
    refused by a dead replica never reached a router and only moves on to the next one.
    """
    out = []
    ok = [r for r in conv.results if r.ok]
    by_turn = {r.turn: r for r in ok}
    attempts: dict[int, int] = {}
    for r in conv.results:
        if not r.refused:
            attempts[r.turn] = attempts.get(r.turn, 0) + 1
    disturbed = False
    for t in sorted(by_turn):
        r = by_turn[t]
        if attempts[t] > 1:
            disturbed = True
        if t == 1 or disturbed:
            continue
        prev = by_turn.get(t - 1)
        if prev is not None and attempts[t - 1] == 1 and prev.verdict not in ("concurrent_turn", "request_failed"):
            out.append(r)
    return out
