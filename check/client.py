"""HTTP to the components under check: JSON calls, SSE streams, scrapes, and the clock each answer shows.

Every answer's ``Date`` header is kept with the local time before and after the call, so the
clocks check needs no extra traffic.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp

from kvdiag.check.findings import Unreachable
from kvdiag.check.scrape import Scrape, ScrapeError

MAX_BODY_BYTES = 16 << 20


@dataclass
class ClockSample:
    """A component's wall clock (Date header, 1 s resolution) against ours around the call."""

    component: str
    local_before: float
    local_after: float
    remote: float


@dataclass
class Reply:
    """A JSON (or text) answer."""

    status: int
    body: Any
    text: str
    headers: dict[str, str]  # lower-case names


@dataclass
class StreamReply:
    """What an SSE completion stream carried: the text, and whether the final chunk had kv_transfer_params."""

    status: int
    headers: dict[str, str]
    content: str = ""
    frames: int = 0
    params_present: bool = False
    params: Any = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    done: bool = False
    response_id: str | None = None
    error_body: str = ""
    received_at: float = 0.0


@dataclass
class Client:
    """One aiohttp session for the whole check."""

    session: aiohttp.ClientSession
    api_key: str | None = None
    clocks: list[ClockSample] = field(default_factory=list)

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        headers.update(extra or {})
        return headers

    def _clock(self, component: str, before: float, headers: Any) -> None:
        raw = headers.get("Date")
        if not raw:
            return
        try:
            remote = parsedate_to_datetime(raw).timestamp()
        except (TypeError, ValueError):
            return
        self.clocks.append(ClockSample(component, before, time.time(), remote))

    async def get(self, component: str, url: str) -> Reply:
        """GET ``url``; raise Unreachable if nothing answers."""
        before = time.time()
        try:
            async with self.session.get(url, headers=self._headers()) as resp:
                text = (await resp.content.read(MAX_BODY_BYTES)).decode("utf-8", "replace")
                self._clock(component, before, resp.headers)
                return Reply(resp.status, _json_or_none(text), text, _headers(resp.headers))
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise Unreachable(component, url, _why(exc)) from None

    async def scrape(self, component: str, base: str) -> Scrape | None:
        """GET ``base``/metrics as a Scrape; None when the endpoint is missing or not Prometheus text."""
        reply = await self.get(component, base + "/metrics")
        if reply.status != 200:
            return None
        try:
            return Scrape.parse(reply.text)
        except ScrapeError:
            return None

    async def post_json(self, component: str, url: str, body: dict[str, Any],
                        headers: dict[str, str] | None = None) -> Reply:
        """POST a JSON body, read a JSON answer; raise Unreachable if nothing answers."""
        before = time.time()
        try:
            async with self.session.post(url, json=body, headers=self._headers(headers)) as resp:
                text = (await resp.content.read(MAX_BODY_BYTES)).decode("utf-8", "replace")
                self._clock(component, before, resp.headers)
                return Reply(resp.status, _json_or_none(text), text, _headers(resp.headers))
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise Unreachable(component, url, _why(exc)) from None

    async def post_stream(self, component: str, url: str, body: dict[str, Any],
                          headers: dict[str, str] | None = None) -> StreamReply:
        """POST a streaming completion and read the SSE stream to its end."""
        before = time.time()
        try:
            async with self.session.post(url, json=body, headers=self._headers(headers)) as resp:
                self._clock(component, before, resp.headers)
                out = StreamReply(resp.status, _headers(resp.headers))
                if resp.status != 200:
                    out.error_body = (await resp.content.read(64 * 1024)).decode("utf-8", "replace")
                    return out
                buffer = b""
                async for chunk in resp.content.iter_any():
                    buffer += chunk
                    while b"\n\n" in buffer:
                        frame, buffer = buffer.split(b"\n\n", 1)
                        _take_frame(out, frame)
                if buffer.strip():
                    _take_frame(out, buffer)
                out.received_at = time.perf_counter()
                return out
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise Unreachable(component, url, _why(exc)) from None


def _take_frame(out: StreamReply, frame: bytes) -> None:
    for line in frame.splitlines():
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            out.done = True
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            out.error = out.error or f"malformed SSE frame: {data[:80]!r}"
            continue
        if not isinstance(obj, dict):
            continue
        out.frames += 1
        if "error" in obj:
            err = obj["error"]
            out.error = str(err.get("message") if isinstance(err, dict) else err)
        out.response_id = out.response_id or (obj.get("id") if isinstance(obj.get("id"), str) else None)
        if "kv_transfer_params" in obj:
            out.params_present = True
            out.params = obj["kv_transfer_params"]
        if isinstance(obj.get("usage"), dict):
            out.usage = obj["usage"]
        for choice in obj.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                out.content += delta["content"]
            elif isinstance(choice.get("text"), str):
                out.content += choice["text"]
            if choice.get("finish_reason"):
                out.finish_reason = str(choice["finish_reason"])


def _headers(headers: Any) -> dict[str, str]:
    """Response headers with lower-case names (HTTP header names are case-insensitive)."""
    return {str(k).lower(): str(v) for k, v in headers.items()}


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return text[:200]


def error_message(reply: Reply) -> str:
    """The OpenAI-style error message of a failed answer, or its start."""
    body = reply.body
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message") or body["error"])[:200]
    return reply.text[:200] or f"HTTP {reply.status}"
