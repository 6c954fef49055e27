"""Reuse the client can see: ``usage.prompt_tokens_details.cached_tokens`` and the ``kvdiag-reuse`` header.

The client talks to the router and gets D's answer, whose usage describes D: D received the whole
prompt from P, so its cached count says nothing about the history P did not recompute. The router
knows P's count (P's report, the ``remote_prefill_cached_tokens`` P hands to D, or P's own usage) and
writes it into the usage the client receives: the non-streamed body's ``usage`` and, in a stream, only
the final usage chunk (``"choices": []``, sent when the client asked for ``stream_options.include_usage``).

The header carries this turn's prefill outcome, known before D streams::

    kvdiag-reuse: remote_hit; prompt=2048; reused=2016; remote=2016; local=0; handle=full
    kvdiag-reuse: prefix_mismatch; prompt=900; reused=0; handle=none; trim=history_edited

It is an RFC 8941 item: the verdict as a token, then integer or token parameters, each present only
when known. Every value comes from a closed set or is a count, so the header is bounded and carries no
id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final, Protocol

from kvdiag.schema.events import PrefillReport
from kvdiag.schema.verdicts import TrimReason, Verdict

HEADER: Final = "kvdiag-reuse"
_USAGE_KEY: Final = b'"usage"'
_FRAME_END: Final = b"\n\n"


class ByteFilter(Protocol):
    """A per-read rewrite of the client's stream."""

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to forward for this read."""
        ...

    def flush(self) -> bytes:
        """Whatever is left at the end of the stream."""
        ...


@dataclass(frozen=True, slots=True)
class PrefillReuse:
    """How P covered the prompt of the attempt that answered: tokens it did not compute, and where from."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # local + remote: what the client's usage reports
    remote_tokens: int | None = None  # read from D (known from P's report only)
    local_tokens: int | None = None  # P's prefix cache (known from P's report only)


def prefill_reuse(report: PrefillReport | None, usage: Any, params: dict[str, Any] | None) -> PrefillReuse:
    """P's count, best source first: its report, the count vLLM hands D in its params, its usage."""
    prompt = _int(usage.get("prompt_tokens")) if isinstance(usage, dict) else None
    if report is not None:
        local, remote = max(report.local_hit_tokens, 0), max(report.remote_read_tokens, 0)
        return PrefillReuse(report.prompt_tokens or prompt, local + remote, remote, local)
    cached = _int(params.get("remote_prefill_cached_tokens")) if params is not None else None
    if cached is None and isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            cached = _int(details.get("cached_tokens"))
    return PrefillReuse(prompt, cached)


def reuse_header(verdict: Verdict, reuse: PrefillReuse | None, handle_tokens: int | None,
                 reuse_limit_tokens: int | None, trim_reason: TrimReason | None) -> str:
    """The ``kvdiag-reuse`` header value for one turn (see the module docstring)."""
    parts = [verdict.value]
    if reuse is not None:
        for name, value in (("prompt", reuse.prompt_tokens), ("reused", reuse.cached_tokens),
                            ("remote", reuse.remote_tokens), ("local", reuse.local_tokens)):
            if value is not None:
                parts.append(f"{name}={value}")
    if handle_tokens is not None:
        parts.append("handle=" + ("full" if trim_reason is None else "trimmed" if reuse_limit_tokens else "none"))
    if trim_reason is not None:
        parts.append(f"trim={trim_reason.value}")
    return "; ".join(parts)


def rewrite_usage(usage: Any, cached_tokens: int) -> bool:
    """Set ``usage.prompt_tokens_details.cached_tokens`` in place; False when ``usage`` is no usage object."""
    if not isinstance(usage, dict):
        return False
    prompt = _int(usage.get("prompt_tokens"))
    if prompt is not None:
        cached_tokens = min(cached_tokens, prompt)
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        details["cached_tokens"] = cached_tokens
    else:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return True


def asked_for_usage(body: dict[str, Any]) -> bool:
    """The client asked for the final usage chunk of a stream."""
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


class UsageRewriter:
    """Rewrites the final usage chunk of an SSE stream; every other byte passes through as it came.

    Per read: one search for the last frame end and one for ``"usage"`` (C code). A frame cut by the
    read is held until it completes; only a frame with a usage object and empty ``choices`` is
    parsed and rewritten, after which the rest passes through untouched.
    """

    __slots__ = ("_cached", "_done", "_tail")

    def __init__(self, cached_tokens: int) -> None:
        self._cached = cached_tokens
        self._done = False
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to forward for this read."""
        if self._done:
            return chunk
        data = self._tail + chunk if self._tail else chunk
        cut = data.rfind(_FRAME_END)
        if cut < 0:
            self._tail = data
            return b""
        end = cut + 2
        if end == len(data):
            self._tail, whole = b"", data
        else:
            self._tail, whole = data[end:], data[:end]
        pos = whole.find(_USAGE_KEY)
        if pos < 0:
            return whole
        out = self._rewrite(whole, pos)
        if self._done and self._tail:  # from here on bytes pass through: release the held part
            out, self._tail = out + self._tail, b""
        return out

    def flush(self) -> bytes:
        """Whatever is left at the end of the stream."""
        rest, self._tail = self._tail, b""
        return rest

    def _rewrite(self, data: bytes, pos: int) -> bytes:
        while pos >= 0:
            start = data.rfind(_FRAME_END, 0, pos)
            start = 0 if start < 0 else start + 2
            end = data.find(_FRAME_END, pos)
            end = len(data) if end < 0 else end + 2
            frame = data[start:end]
            new = self._final_usage(frame)
            if new is not None:
                self._done = True
                return data[:start] + new + data[end:]
            pos = data.find(_USAGE_KEY, end)
        return data

    def _final_usage(self, frame: bytes) -> bytes | None:
        line = frame.strip()
        if not line.startswith(b"data:"):
            return None
        try:
            obj = json.loads(line[5:])
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("choices") != [] or not rewrite_usage(obj.get("usage"), self._cached):
            return None  # a token frame with continuous usage stats, or not a usage chunk at all
        return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + _FRAME_END


class StreamFilters:
    """Two per-read filters in a row (token-id stripping, then the usage rewrite)."""

    __slots__ = ("_first", "_second")

    def __init__(self, first: ByteFilter, second: ByteFilter) -> None:
        self._first, self._second = first, second

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to forward for this read."""
        return self._second.feed(self._first.feed(chunk))

    def flush(self) -> bytes:
        """Whatever is left at the end of the stream."""
        return self._second.feed(self._first.flush()) + self._second.flush()


def client_stream_filter(strip_ids: ByteFilter | None, body: dict[str, Any],
                         reuse: PrefillReuse | None) -> ByteFilter | None:
    """The filter the client's stream goes through: None (bytes as D sent them), one, or both in a row."""
    rewriter = UsageRewriter(reuse.cached_tokens) \
        if reuse is not None and reuse.cached_tokens is not None and asked_for_usage(body) else None
    if strip_ids is None or rewriter is None:
        return strip_ids if rewriter is None else rewriter
    return StreamFilters(strip_ids, rewriter)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
