"""The router's upstreams: round-robin P and D, one pooled bounded aiohttp session, leg errors.

Each leg error says whether the request may have reached the engine (``reached``): only a request
that never reached P leaves D's handle unread, so only then may the handle be given back.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import aiohttp
from yarl import URL

from kvdiag.router.config import RouterConfig, Upstream


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
    """P and D endpoints with independent round-robin cursors and one shared connection pool."""

    def __init__(self, config: RouterConfig) -> None:
        self.prefill: tuple[Upstream, ...] = config.prefill
        self.decode: tuple[Upstream, ...] = config.decode
        self._config = config
        self._p_cursor = itertools.count()
        self._d_cursor = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[tuple[str, int, str], URL] = {}
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

    @property
    def session(self) -> aiohttp.ClientSession:
        """The shared client session (after :meth:`start`)."""
        if self._session is None:
            raise RuntimeError("Upstreams.start() was not called")
        return self._session

    async def close(self) -> None:
        """Close every pooled connection."""
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
        """Indexes of P to try: the round-robin choice first, then the others in order."""
        return _rotation(next(self._p_cursor), len(self.prefill))

    def decode_order(self) -> list[int]:
        """Indexes of D to try: the round-robin choice first, then the others."""
        return _rotation(next(self._d_cursor), len(self.decode))

    async def post_prefill(self, index: int, path: str, body: bytes, headers: dict[str, str]) -> dict[str, Any]:
        """Send the prefill request to P ``index``; return its JSON body or raise LegError."""
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
