"""The router's upstreams: P and D instances, one pooled bounded aiohttp session, leg errors, health and load.

Each leg error says whether the request may have reached the engine (``reached``): only a request
that never reached P leaves D's handle unread, so only then may the handle be given back.
Every request's outcome feeds the instances' health (router/health.py), and the requests in
flight on each instance are counted here (estimated prompt tokens on P, turns on D): what the
placement policies (router/placement.py) balance.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from typing import Any

import aiohttp
from yarl import URL

from kvdiag.exporters.prometheus import CatalogMetrics
from kvdiag.router.config import RouterConfig, Upstream
from kvdiag.router.health import UpstreamHealth, index_label, probe_forever


class LegError(Exception):
    """A prefill or decode leg failed; ``kind`` is one of the catalog's UPSTREAM_ERROR_KINDS."""

    def __init__(self, leg: str, kind: str, message: str, *, status: int | None = None, body: bytes = b"",
                 reached: bool = True, content_type: str = "application/json",
                 payload: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.leg = leg
        self.kind = kind
        self.status = status
        self.body = body
        self.reached = reached
        self.content_type = content_type
        self.payload = payload  # the parsed JSON error body, when there was one


class Upstreams:
    """P and D endpoints with independent round-robin cursors, health, load and one shared connection pool."""

    def __init__(self, config: RouterConfig) -> None:
        self.prefill: tuple[Upstream, ...] = config.prefill
        self.decode: tuple[Upstream, ...] = config.decode
        self._config = config
        self._p_cursor = itertools.count()
        self._d_cursor = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[tuple[str, int, str], URL] = {}
        self.health = UpstreamHealth({"prefill": len(self.prefill), "decode": len(self.decode)},
                                     eject_after=config.eject_after, eject_seconds=config.eject_seconds,
                                     max_eject_seconds=config.max_eject_seconds)
        # What is in flight per instance: estimated prompt tokens and requests on P, turns on D.
        self.prefill_tokens = [0] * len(self.prefill)
        self.prefill_requests = [0] * len(self.prefill)
        self.decode_turns = [0] * len(self.decode)
        # An instance's identity across router replicas (stored with a conversation's last turn).
        self._index_of = {"prefill": {up.address: i for i, up in enumerate(self.prefill)},
                          "decode": {up.address: i for i, up in enumerate(self.decode)}}
        self._metrics: CatalogMetrics | None = None
        self._probe: asyncio.Task[None] | None = None
        self.prefill_timeout = aiohttp.ClientTimeout(total=config.prefill_timeout, sock_connect=config.connect_timeout)
        # The decode stream may run long: bound connect and the wait between two reads, not the total.
        self.decode_timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout,
                                                    sock_read=config.decode_timeout)

    async def start(self) -> None:
        """Open the pooled session (limits from the config; keep-alive on)."""
        connector = aiohttp.TCPConnector(limit=self._config.max_connections,
                                         limit_per_host=self._config.max_connections_per_host,
                                         keepalive_timeout=30.0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                              skip_auto_headers=("User-Agent",))
        if self._config.health_check_interval > 0:
            urls = {"prefill": [self._url("prefill", i, "/health") for i in range(len(self.prefill))],
                    "decode": [self._url("decode", i, "/health") for i in range(len(self.decode))]}
            self._probe = asyncio.get_running_loop().create_task(probe_forever(
                self.health, self._session, urls, interval=self._config.health_check_interval,
                timeout=self._config.health_check_timeout))

    def bind_metrics(self, metrics: CatalogMetrics) -> None:
        """Export health and in-flight gauges through ``metrics``."""
        self._metrics = metrics
        self.health.bind_metrics(metrics)
        for leg, n in (("prefill", len(self.prefill)), ("decode", len(self.decode))):
            for index in range(n):
                self._in_flight_gauge(leg, index, 0)

    @property
    def session(self) -> aiohttp.ClientSession:
        """The shared client session (after :meth:`start`)."""
        if self._session is None:
            raise RuntimeError("Upstreams.start() was not called")
        return self._session

    async def close(self) -> None:
        """Stop the probe and close every pooled connection."""
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
            self._probe = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _url(self, role: str, index: int, path: str) -> URL:
        # Parsed once per upstream and route: building a URL per request is a measurable share of a turn.
        key = (role, index, path)
        url = self._urls.get(key)
        if url is None:
            base = self.prefill[index] if role == "prefill" else self.decode[index]
            url = self._urls[key] = URL(base.base_url + path)
        return url

    def prefill_order(self) -> list[int]:
        """Indexes of P to try: the round-robin choice first, then the others in order (ejected ones last)."""
        return self.health.order("prefill", _rotation(next(self._p_cursor), len(self.prefill)))

    def decode_order(self) -> list[int]:
        """Indexes of D to try: the round-robin choice first, then the others (ejected ones last)."""
        return self.health.order("decode", _rotation(next(self._d_cursor), len(self.decode)))

    def rotation(self, leg: str) -> list[int]:
        """The next round-robin order of ``leg`` (health not applied)."""
        n = len(self.prefill if leg == "prefill" else self.decode)
        return _rotation(self.next_cursor(leg), n)

    def next_cursor(self, leg: str) -> int:
        """Advance ``leg``'s round-robin cursor (placement breaks ties with it)."""
        return next(self._p_cursor if leg == "prefill" else self._d_cursor)

    def index_of(self, leg: str, address: str | None) -> int | None:
        """The index of the instance at ``address`` (``host:port``), None when this router has no such one."""
        return self._index_of[leg].get(address) if address is not None else None

    def address(self, leg: str, index: int | None) -> str | None:
        """``host:port`` of instance ``index``."""
        if index is None:
            return None
        return (self.prefill if leg == "prefill" else self.decode)[index].address

    def _in_flight_gauge(self, leg: str, index: int, requests: int) -> None:
        if self._metrics is None:
            return
        try:
            label = index_label(index)
            self._metrics.labels("kvdiag_upstream_in_flight", leg=leg, index=label).set(requests)
            if leg == "prefill":
                self._metrics.labels("kvdiag_upstream_in_flight_prompt_tokens", index=label).set(
                    self.prefill_tokens[index])
        except Exception:  # telemetry never breaks a turn
            pass

    def decode_started(self, index: int) -> None:
        """A turn's decode leg opened on D ``index`` (ended by :meth:`decode_done`)."""
        self.decode_turns[index] += 1
        self._in_flight_gauge("decode", index, self.decode_turns[index])

    def decode_done(self, index: int) -> None:
        """A turn's decode leg on D ``index`` ended."""
        self.decode_turns[index] = max(self.decode_turns[index] - 1, 0)
        self._in_flight_gauge("decode", index, self.decode_turns[index])

    def _outcome(self, leg: str, index: int, error: LegError | None, with_handle: bool = False) -> None:
        if error is None or error.kind == "http_4xx":
            self.health.success(leg, index)  # it answered
        elif not (with_handle and error.kind == "http_5xx"):
            # A 5xx on a request that carried D's handle is the handle's failure (vLLM fails a bad read with 500).
            self.health.failure(leg, index, error.kind)

    async def post_prefill(self, index: int, path: str, body: bytes, headers: dict[str, str], *,
                           load_tokens: int = 0, with_handle: bool = False) -> dict[str, Any]:
        """Send the prefill request to P ``index``; return its JSON body or raise LegError.

        ``load_tokens`` (the prompt's estimated tokens) count as in flight on P until it answers.
        """
        self.prefill_tokens[index] += load_tokens
        self.prefill_requests[index] += 1
        self._in_flight_gauge("prefill", index, self.prefill_requests[index])
        try:
            obj = await self._post_prefill(index, path, body, headers)
        except LegError as exc:
            self._outcome("prefill", index, exc, with_handle)
            raise
        finally:
            self.prefill_tokens[index] -= load_tokens
            self.prefill_requests[index] -= 1
            self._in_flight_gauge("prefill", index, self.prefill_requests[index])
        self._outcome("prefill", index, None)
        return obj

    async def _post_prefill(self, index: int, path: str, body: bytes, headers: dict[str, str]) -> dict[str, Any]:
        url = self._url("prefill", index, path)
        try:
            async with self.session.post(url, data=body, headers=headers, timeout=self.prefill_timeout) as resp:
                raw = await resp.read()
                status = resp.status
                content_type = resp.headers.get("Content-Type", "application/json")
        except aiohttp.ConnectionTimeoutError as exc:
            raise LegError("prefill", "connect", f"connect to {url} timed out: {exc}", reached=False) from None
        except TimeoutError:
            raise LegError("prefill", "timeout",
                           f"prefill at {url} took longer than {self.prefill_timeout.total:g}s") from None
        except aiohttp.ClientConnectorError as exc:
            raise LegError("prefill", "connect", f"cannot connect to {url}: {exc}", reached=False) from None
        except aiohttp.ClientError as exc:
            raise LegError("prefill", "stream_broken", f"prefill at {url} broke: {type(exc).__name__}: {exc}") \
                from None
        return check_json_response("prefill", str(url), status, raw, content_type)

    def listing_order(self, leg: str) -> list[int]:
        """Indexes of ``leg`` for a request no turn rides on (healthy ones first; the round-robin cursor, which
        places turns, does not move)."""
        return self.health.order(leg, list(range(len(self.prefill if leg == "prefill" else self.decode))))

    async def get(self, leg: str, index: int, path: str, headers: dict[str, str], timeout: float
                  ) -> tuple[int, bytes, str]:
        """``GET path`` of one instance: its status, body and content type; LegError when it does not answer."""
        url = self._url(leg, index, path)
        try:
            async with self.session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(
                    total=timeout, sock_connect=self._config.connect_timeout)) as resp:
                return resp.status, await resp.read(), resp.headers.get("Content-Type", "application/json")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise LegError(leg, "connect", f"GET {url} failed: {type(exc).__name__}: {exc}", reached=False) from None

    async def tokenize(self, index: int, body: bytes, headers: dict[str, str], timeout: float) -> list[int]:
        """P ``index``'s ``/tokenize`` of a prompt; raise LegError when it cannot answer."""
        url = self._url("prefill", index, "/tokenize")
        try:
            async with self.session.post(url, data=body, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                raw = await resp.read()
                status = resp.status
                content_type = resp.headers.get("Content-Type", "application/json")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise LegError("prefill", "connect", f"tokenize at {url} failed: {type(exc).__name__}: {exc}") from None
        obj = check_json_response("prefill", str(url), status, raw, content_type)
        ids = obj.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise LegError("prefill", "malformed", f"tokenize at {url} sent no token list")
        return ids

    async def open_decode(self, index: int, path: str, body: bytes,
                          headers: dict[str, str]) -> aiohttp.ClientResponse:
        """Send the decode request to D ``index``; return the open 200 response or raise LegError."""
        try:
            resp = await self._open_decode(index, path, body, headers)
        except LegError as exc:
            self._outcome("decode", index, exc)
            raise
        self._outcome("decode", index, None)
        return resp

    async def _open_decode(self, index: int, path: str, body: bytes,
                           headers: dict[str, str]) -> aiohttp.ClientResponse:
        url = self._url("decode", index, path)
        try:
            resp = await self.session.post(url, data=body, headers=headers, timeout=self.decode_timeout)
        except aiohttp.ConnectionTimeoutError as exc:
            raise LegError("decode", "connect", f"connect to {url} timed out: {exc}", reached=False) from None
        except TimeoutError:
            raise LegError("decode", "timeout", f"decode at {url} sent no headers within "
                                                f"{self.decode_timeout.sock_read:g}s") from None
        except aiohttp.ClientConnectorError as exc:
            raise LegError("decode", "connect", f"cannot connect to {url}: {exc}", reached=False) from None
        except aiohttp.ClientError as exc:
            raise LegError("decode", "stream_broken", f"decode at {url} broke: {type(exc).__name__}: {exc}") \
                from None
        if resp.status != 200:
            try:
                raw = await resp.read()
            except (aiohttp.ClientError, TimeoutError):
                raw = b""
            finally:
                resp.release()
            check_json_response("decode", str(url), resp.status, raw, resp.headers.get("Content-Type", ""))
        return resp


def check_json_response(leg: str, url: str, status: int, raw: bytes, content_type: str) -> dict[str, Any]:
    """Parse an upstream JSON body; raise LegError for HTTP errors and malformed bodies."""
    if status >= 400:
        payload = _maybe_json(raw)
        kind = "http_5xx" if status >= 500 else "http_4xx"
        raise LegError(leg, kind, f"{leg} at {url} answered HTTP {status}: {_snippet(raw)}", status=status,
                       body=raw, reached=status >= 500, content_type=content_type or "application/json",
                       payload=payload)
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise LegError(leg, "malformed", f"{leg} at {url} sent a body that is not JSON ({exc}): "
                                         f"{_snippet(raw)}") from None
    if not isinstance(obj, dict):
        raise LegError(leg, "malformed", f"{leg} at {url} sent JSON that is not an object: {_snippet(raw)}")
    return obj


def _maybe_json(raw: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def _snippet(raw: bytes, limit: int = 200) -> str:
    text = raw[:limit].decode("utf-8", "replace")
    return text + ("..." if len(raw) > limit else "")


def _rotation(start: int, n: int) -> list[int]:
    first = start % n
    return [(first + i) % n for i in range(n)]
