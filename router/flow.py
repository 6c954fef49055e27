"""One turn through the router: claim → prefill leg → decode leg → pass-through → store.

The handle for the next turn is stored (and the conversation's claim released) *before* the
client receives the end of the stream, so a client that sends its next turn the moment it sees
``[DONE]`` always finds it (and is never mistaken for a concurrent turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import aiohttp
from aiohttp import web

from kvdiag.exporters.tracecontext import trace_id_from_traceparent
from kvdiag.router.config import RouterConfig
from kvdiag.router.leg_messages import (
    MISS_PARAMS,
    TRACE_HEADERS,
    annotate_usage,
    finish_reason,
    generation_error,
    handle_params,
    int_or_none,
    mime_type,
    openai_error,
    prefill_body,
    report_from,
    report_in,
    sse_error_event,
)
from kvdiag.router.placement import Placed, Placement
from kvdiag.router.reply import Observed, drop_token_ids, observe_body
from kvdiag.router.reuse import Injection, ReuseGuard
from kvdiag.router.reuse_rule import Coverage, PromptView, Reuse, prompt_view, unsupported_shape
from kvdiag.router.security import earlier_turns, hash_conversation_id, loggable_as_is, store_key, tenant_of
from kvdiag.router.sse import PARAMS_KEY, SSECapture, TokenIdStripper
from kvdiag.router.store import Claim, Handle, LastTurn, Store, StoreError
from kvdiag.router.telemetry import RouterTelemetry
from kvdiag.router.turns import HIT, PREFIX_MISMATCH, TurnState, decide_lookup, prefill_verdict
from kvdiag.router.upstream import LegError, Upstreams, check_json_response
from kvdiag.router.usage import HEADER as REUSE_HEADER
from kvdiag.router.usage import PrefillReuse, client_stream_filter, prefill_reuse, reuse_header, rewrite_usage
from kvdiag.schema.events import REPORT_KEY
from kvdiag.schema.verdicts import TrimReason, Verdict

if TYPE_CHECKING:  # opentelemetry is only imported when tracing is on (the otel extra)
    from opentelemetry.trace import Span

    from kvdiag.exporters.otel import Tracing

_logger = logging.getLogger(__name__)

MAX_CONVERSATION_ID: Final = 1024
_RETRY_SAME_P_KINDS: Final = frozenset({"http_5xx", "timeout", "stream_broken"})


class ClientRequestError(Exception):
    """The client's request cannot be routed (400)."""


@dataclass
class _Turn:
    """Mutable per-turn context the flow threads through its steps."""

    state: TurnState
    conv_log: str | None = None  # the conversation id as logs show it (hashed with --hash-ids or when unsafe)
    key: str | None = None
    claim: Claim | None = None
    body: dict[str, Any] | None = None
    view: PromptView | None = None  # the prompt as the reuse rule sees it (None: a shape it cannot check)
    decision: Any = None  # the reuse rule's Decision for the claimed handle
    coverage: Coverage | None = None  # the claimed handle's coverage with a learned prefix count (None: as stored)
    inject: dict[str, Any] | None = None  # D's params as P gets them (cut when the handle is trimmed)
    order: list[int] | None = None  # the P instances to try, in order
    placed: Placed | None = None  # where the turn's P and D run, and why (router/placement.py)
    body_bytes: int = 0
    tokenized: list[int] | None = None  # --verify-tokens: P's /tokenize of this prompt
    strip_ids: bool = False  # --verify-tokens asked D for token ids the client did not ask for
    handle: Handle | None = None  # the handle injected into P's request
    handle_reached_p: bool = False  # P may have read it: never give it back
    reached_decode: bool = False
    store_done: bool = False
    delivered: bool = False  # the client has been sent the whole stream, [DONE] included
    prefill_reuse: PrefillReuse | None = None  # what P did not compute, for the client's usage and header


class TurnFlow:
    """Runs turns; shared by the chat and completions handlers."""

    def __init__(self, config: RouterConfig, store: Store, telemetry: RouterTelemetry, upstreams: Upstreams,
                 tracing: Tracing | None) -> None:
        self.config = config
        self.store = store
        self.telemetry = telemetry
        self.upstreams = upstreams
        self.tracing = tracing
        self._background: set[asyncio.Task[None]] = set()
        self._reporting_prefill: set[int] = set()  # P instances seen sending kvdiag reports (instrumented)
        self.reuse = ReuseGuard(config)
        self.placement = Placement(config, upstreams, telemetry.metrics)
        self._env_auth = f"Bearer {os.environ['OPENAI_API_KEY']}" if os.environ.get("OPENAI_API_KEY") else None

    async def drain(self) -> None:
        """Wait for bookkeeping tasks started by cancelled turns."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # ------------------------------------------------------------------ entry point
    async def handle(self, request: web.Request, endpoint: str, path: str) -> web.StreamResponse:
        """Route one client request to P then D."""
        state = TurnState(request_id=uuid.uuid4().hex, endpoint=endpoint, started=time.perf_counter())
        turn = _Turn(state)
        tel = self.telemetry
        tel.in_flight.inc()
        cancelled = False
        try:
            if self.tracing is None:
                state.trace_id = trace_id_from_traceparent(request.headers.get("traceparent"))
                return await self._run(request, turn, path, None)
            with self.tracing.turn_span(request.headers) as span:
                state.trace_id = self.tracing.trace_id(span)
                try:
                    return await self._run(request, turn, path, span)
                finally:
                    self._finish_span(span, turn)
        except asyncio.CancelledError:
            cancelled = True  # aiohttp cancels the handler when the client disconnects
            self._client_gone(turn)
            raise
        finally:
            tel.in_flight.dec()
            if cancelled:
                # The handler is being cancelled: finish the bookkeeping in its own task.
                task = asyncio.get_running_loop().create_task(self._close_turn(turn))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            else:
                await self._close_turn(turn)

    async def _close_turn(self, turn: _Turn) -> None:
        state = turn.state
        if not turn.store_done:
            await self._store_result(turn, None)
        state.duration_ms = (time.perf_counter() - state.started) * 1000.0
        self.placement.finish(turn.placed, state.reuse_attrs)
        self.telemetry.request(state.endpoint, state.http_status)
        if state.lookup is not None:
            self.telemetry.turn(state)

    # ------------------------------------------------------------------ the turn
    async def _run(self, request: web.Request, turn: _Turn, path: str, span: Span | None) -> web.StreamResponse:
        state = turn.state
        try:
            body = await self._read_body(request, turn)
        except ClientRequestError as exc:
            state.status, state.http_status, state.error = "error", 400, str(exc)
            return openai_error(str(exc), 400, "invalid_request_error")
        headers = self._upstream_headers(request, state.request_id)
        await self._lookup(body, turn, headers)
        proxy_log = self.telemetry.proxy_log
        lookup = state.lookup
        assert lookup is not None
        if proxy_log is not None:
            self._log_lookup(turn)
        if span is not None:
            span.set_attribute("kvdiag.turn", lookup.turn)
            span.set_attribute("kvdiag.lookup", lookup.result)
            if state.conversation_id is not None:
                span.set_attribute("kvdiag.conversation", hash_conversation_id(state.conversation_id)
                                   if not state.id_hashed else state.conversation_id)
        # --- prefill leg
        try:
            p_params, p_index = await self._prefill_leg(path, body, headers, turn, span)
        except LegError as exc:
            return self._prefill_failed(turn, exc)
        if proxy_log is not None:
            proxy_log.prefill_done(state.request_id, state.prefill_ms or 0.0)
        # --- decode leg
        decode_body = dict(body)
        decode_body[PARAMS_KEY] = p_params
        if self.config.verify_tokens and turn.view is not None:
            turn.strip_ids = not body.get("return_token_ids")
            decode_body["return_token_ids"] = True  # D's prompt and output ids: its sequence, for the next turn
        if p_params is not None and "remote_host" in p_params:
            p_params["remote_host"] = self.upstreams.prefill[p_index].host  # as the example proxy does
        payload = json.dumps(decode_body, separators=(",", ":")).encode()
        if state.stream:
            return await self._decode_streaming(request, path, payload, headers, turn, span)
        return await self._decode_json(path, payload, headers, turn, span)

    async def _read_body(self, request: web.Request, turn: _Turn) -> dict[str, Any]:
        state = turn.state
        raw = await request.read()
        turn.body_bytes = len(raw)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ClientRequestError(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ClientRequestError("request body must be a JSON object")
        conv = body.pop("conversation_id", None)
        if conv is None:
            conv = request.headers.get("X-Conversation-Id")
        if isinstance(conv, bool) or (conv is not None and not isinstance(conv, str | int)):
            raise ClientRequestError("conversation_id must be a string")
        if conv is not None:
            conv = str(conv)
            if len(conv) > MAX_CONVERSATION_ID:
                raise ClientRequestError(f"conversation_id is longer than {MAX_CONVERSATION_ID} characters")
            if not conv:
                conv = None
        if body.pop(PARAMS_KEY, None) is not None:
            # Never trust client-supplied params: they could name another tenant's blocks.
            state.client_params_dropped = True
            self.telemetry.client_params_dropped()
        state.stream = bool(body.get("stream", False))
        state.model = body.get("model") if isinstance(body.get("model"), str) else None
        state.tenant = tenant_of(request.headers.get("Authorization"))
        if conv is not None:
            turn.key = store_key(state.tenant, conv)
            state.id_hashed = self.config.hash_ids
            state.conversation_id = hash_conversation_id(conv) if self.config.hash_ids else conv
            # (the text log never carries a client's line break or escape sequence)
            log_id = state.conversation_id
            turn.conv_log = log_id if loggable_as_is(log_id) else hash_conversation_id(conv)
        return body

    async def _lookup(self, body: dict[str, Any], turn: _Turn, headers: dict[str, str]) -> None:
        state = turn.state
        store_error = None
        claim = None
        if turn.key is not None:
            try:
                claim = await self.store.claim(turn.key)
            except StoreError as exc:
                store_error = str(exc)
                self.telemetry.store_error("claim")
                _logger.warning("store claim failed: %s", exc)
        turn.claim = claim
        turn.body = body
        handle = claim.handle if claim is not None and claim.acquired else None
        coverage = handle.coverage if handle is not None else None
        if turn.key is not None:  # without a conversation id nothing is stored: no view needed
            turn.view = prompt_view(body, coverage.lengths() if coverage is not None else ())
        turn.placed = await self.placement.prefill(turn.key, claim, turn.body_bytes)
        turn.order = turn.placed.prefill.order
        injection = None
        if handle is not None:
            ids = None
            if self.config.verify_tokens and coverage is not None and coverage.tokens is not None \
                    and turn.view is not None:
                started = time.perf_counter()
                try:
                    ids = await self.reuse.tokenize(self.upstreams, (turn.order or [0])[0], body, headers)
                    if ids is None:
                        state.reuse_attrs["verify"] = "the request renders differently from /tokenize"
                except LegError as exc:
                    self.telemetry.upstream_error("prefill", exc.kind)
                    state.reuse_attrs["verify"] = str(exc)[:200]
                state.reuse_attrs["tokenize_ms"] = round((time.perf_counter() - started) * 1000.0, 3)
                turn.tokenized = ids
            if ids is not None and coverage is not None and coverage.tokens is not None:
                matched = coverage.tokens.matched(ids)
                state.reuse_attrs["verified_tokens"] = matched
                injection = self.reuse.inject(handle, turn.view, matched, len(ids))
            else:
                injection = self.reuse.inject(handle, turn.view)
                if self.config.tokenize_shared_prefix:
                    injection = await self._learn_prefix(handle, injection, body, headers, turn)
        decision = injection.decision if injection is not None else None
        turn.decision = decision
        self.placement.expect(turn.placed, decision, coverage)
        lookup = decide_lookup(has_id=turn.key is not None, claim=claim, decision=decision,
                               earlier_turns=earlier_turns(body), now=time.time(), entry_ttl=self.config.handle_ttl,
                               store_error=store_error)
        state.lookup = lookup
        if lookup.verdict is not None:
            state.verdict, state.reason = lookup.verdict, lookup.reason
        turn.handle = lookup.handle
        state.trim_reason = lookup.trim_reason
        if injection is not None:
            turn.inject = injection.params if lookup.result == HIT else None
            state.handle_tokens = injection.handle_tokens
            state.reuse_limit_tokens = decision.limit_tokens if decision is not None and turn.inject else 0
            if decision is not None and decision.reuse is not Reuse.FULL and decision.detail:
                state.reuse_attrs["reuse_detail"] = decision.detail[:300]

    async def _learn_prefix(self, handle: Handle, injection: Injection, body: dict[str, Any], headers: dict[str, str],
                            turn: _Turn) -> Injection:
        """A prompt diverging at a boundary without a token count: P's /tokenize of the shared messages."""
        started = time.perf_counter()
        learned = await self.reuse.learn(self.upstreams, (turn.order or [0])[0], handle, turn.view, injection, body,
                                         headers, turn.state.tenant or "anonymous")
        if learned is None:
            return injection
        turn.coverage = learned.coverage
        attrs = turn.state.reuse_attrs
        attrs["shared_prefix"] = learned.outcome
        attrs["shared_prefix_ms"] = round((time.perf_counter() - started) * 1000.0, 3)
        try:
            self.telemetry.metrics.labels("kvdiag_reuse_shared_prefix_counts", outcome=learned.outcome).inc()
        except Exception:  # telemetry never breaks a turn
            self.telemetry.emit_error()
        return learned.injection

    def _log_lookup(self, turn: _Turn) -> None:
        log = self.telemetry.proxy_log
        state, lookup = turn.state, turn.state.lookup
        if log is None or lookup is None:
            return
        if turn.key is None:
            log.no_conversation_id(state.request_id)
            return
        conv = turn.conv_log or ""
        if lookup.result == "expired" and lookup.entry_age_s is not None:
            log.stale(conv, lookup.entry_age_s, self.config.handle_ttl)
        if lookup.result == PREFIX_MISMATCH and lookup.trim_reason is TrimReason.HISTORY_EDITED:
            log.history_changed(conv)
        if lookup.result == HIT and turn.handle is not None:
            log.hit(conv, lookup.entry_age_s or 0.0)
            log.sending(state.request_id, conv, turn.handle.params.get("remote_request_id"))
        else:
            log.miss(state.request_id, conv)

    def auth_header(self, request: web.Request) -> dict[str, str]:
        """The Authorization P and D get for ``request``: the client's, else ``$OPENAI_API_KEY``'s (none without)."""
        auth = request.headers.get("Authorization") or self._env_auth
        return {"Authorization": auth} if auth else {}

    def _upstream_headers(self, request: web.Request, request_id: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id, **self.auth_header(request)}
        if self.tracing is None:
            # Tracing off: still carry the client's trace context to P and D.
            for name in TRACE_HEADERS:
                value = request.headers.get(name)
                if value:
                    headers[name] = value
        return headers

    # ------------------------------------------------------------------ prefill
    async def _prefill_leg(self, path: str, body: dict[str, Any], headers: dict[str, str], turn: _Turn,
                           span: Span | None) -> tuple[dict[str, Any] | None, int]:
        """Run the prefill leg with retries; return P's params for D and the P index that answered."""
        state = turn.state
        order = turn.order or self.upstreams.prefill_order()
        handle = turn.handle if turn.inject is not None else None
        first_params = handle_params(turn.inject) if turn.inject is not None else dict(MISS_PARAMS)
        attempts: list[tuple[int, dict[str, Any], bool]] = [(order[0], first_params, handle is not None)]
        attempts += [(i, dict(MISS_PARAMS), False) for i in order[1:]]
        started = time.perf_counter()
        last_error: LegError | None = None
        try:
            while attempts:
                index, params, with_handle = attempts.pop(0)
                state.prefill_attempts += 1
                p_body = prefill_body(body, params)
                if with_handle:
                    turn.handle_reached_p = True  # until P is known not to have received it
                try:
                    obj = await self._post_prefill(index, path, p_body, headers, span, with_handle)
                except LegError as exc:
                    self.telemetry.upstream_error("prefill", exc.kind)
                    last_error = exc
                    if with_handle:
                        turn.handle_reached_p = exc.reached
                        self._handle_failed(turn, exc, index)
                        if exc.kind in _RETRY_SAME_P_KINDS:
                            # The failure may be the handle's (expired or failed read): same P, fresh params.
                            attempts.insert(0, (index, dict(MISS_PARAMS), False))
                    if exc.kind == "http_4xx":
                        raise
                    continue
                return self._prefill_succeeded(obj, index, with_handle, turn), index
        finally:
            state.prefill_ms = (time.perf_counter() - started) * 1000.0
            self.placement.prefill_done(turn.placed, state.prefill_index)
        assert last_error is not None
        raise last_error

    async def _post_prefill(self, index: int, path: str, body: dict[str, Any], headers: dict[str, str],
                            span: Span | None, with_handle: bool = False) -> dict[str, Any]:
        payload = json.dumps(body, separators=(",", ":")).encode()
        tokens = max(len(payload) // 4, 1)  # counted in flight on P until it answers
        if span is None or self.tracing is None:
            obj = await self.upstreams.post_prefill(index, path, payload, headers, load_tokens=tokens,
                                                    with_handle=with_handle)
        else:
            leg_headers = dict(headers)
            with self.tracing.prefill_span(span, leg_headers, {"kvdiag.prefill_index": index}) as leg:
                try:
                    obj = await self.upstreams.post_prefill(index, path, payload, leg_headers, load_tokens=tokens,
                                                            with_handle=with_handle)
                except LegError as exc:
                    self.tracing.set_error(leg, f"{exc.kind}: {exc}")
                    raise
                annotate_usage(leg, obj)
        if finish_reason(obj) == "error":
            # A server that answers a KV load failure with HTTP 200, finish_reason "error" (vLLM 0.33 answers 500).
            raise LegError("prefill", "http_5xx", "P finished the prefill with an error (KV load failure?)",
                           status=200, payload=obj)
        return obj

    def _handle_failed(self, turn: _Turn, exc: LegError, index: int) -> None:
        """P failed a request that carried D's handle: the verdict is the reuse cause (or not)."""
        state = turn.state
        report = report_from(report_in(exc.payload), self.telemetry) if exc.payload else None
        if report is not None:
            state.report = report
            self._reporting_prefill.add(index)
        elif exc.kind == "http_5xx" and exc.status is not None and exc.status >= 500 \
                and index in self._reporting_prefill and not generation_error(exc.payload):
            # An instrumented P reports every KV failure it can; vLLM 0.33 answers a KV load failure with its
            # GenerationError 500, which carries no params (so no report): that one is inferred below.
            state.verdict, state.reason = Verdict.REQUEST_FAILED, f"P failed the request: {exc}"
            return
        lookup = state.lookup
        verdict, reason = prefill_verdict(report=report, cached_tokens=None, failed=True,
                                          entry_age_s=lookup.entry_age_s if lookup else None,
                                          decoder_ttl=self.config.decoder_kv_blocks_ttl)
        state.verdict, state.reason = verdict, f"{reason}; retried without the handle"

    def _prefill_succeeded(self, obj: dict[str, Any], index: int, with_handle: bool,
                           turn: _Turn) -> dict[str, Any] | None:
        state = turn.state
        state.prefill_index = index
        usage = obj.get("usage")
        if isinstance(usage, dict):
            state.prompt_tokens = int_or_none(usage.get("prompt_tokens"))
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                state.cached_tokens = int_or_none(details.get("cached_tokens"))
        raw_params = obj.get(PARAMS_KEY)
        params = dict(raw_params) if isinstance(raw_params, dict) else None
        self.reuse.observe(params)
        report = None
        if params is not None and REPORT_KEY in params:
            report = report_from(params.pop(REPORT_KEY), self.telemetry)
            if report is not None:
                self._reporting_prefill.add(index)
        if with_handle:
            state.report = report
            verdict, reason = prefill_verdict(report=report, cached_tokens=state.cached_tokens, failed=False,
                                              entry_age_s=None, decoder_ttl=self.config.decoder_kv_blocks_ttl)
            state.verdict, state.reason = verdict, reason
        elif report is not None and state.report is None:
            state.report = report  # P's accounting of a turn without a handle (tokens, engine ids)
        turn.prefill_reuse = prefill_reuse(report, usage, params)
        return params

    def _prefill_failed(self, turn: _Turn, exc: LegError) -> web.Response:
        state = turn.state
        state.status = "timeout" if exc.kind == "timeout" else "error"
        state.error = str(exc)
        if turn.handle is None or state.verdict in (Verdict.FIRST_TURN, Verdict.UNKNOWN):
            state.verdict, state.reason = Verdict.REQUEST_FAILED, f"prefill failed: {exc}"
        if exc.kind == "http_4xx" and exc.status is not None:
            # The client's request was bad: pass P's answer through unchanged.
            state.http_status = exc.status
            return web.Response(body=exc.body, status=exc.status, content_type=mime_type(exc.content_type))
        state.http_status = 502
        state.missing_reason = "prefill_failed"
        return openai_error(f"prefill failed on every instance: {exc}", 502)

    # ------------------------------------------------------------------ decode
    async def _open_decode(self, path: str, payload: bytes, headers: dict[str, str],
                           turn: _Turn) -> tuple[aiohttp.ClientResponse, int, float]:
        """Open the decode response on the placed D, trying the next D only when one is unreachable."""
        last: LegError | None = None
        placed = turn.placed
        order = self.placement.decode_order(placed) if placed is not None else self.upstreams.decode_order()
        for index in order:
            started = time.perf_counter()
            try:
                resp = await self.upstreams.open_decode(index, path, payload, headers)
            except LegError as exc:
                self.telemetry.upstream_error("decode", exc.kind)
                last = exc
                if exc.kind == "connect":
                    continue
                raise
            turn.state.decode_index = index
            self.placement.decode_started(placed, index)
            return resp, index, started
        assert last is not None
        raise last

    def _decode_failed_before_body(self, turn: _Turn, exc: LegError) -> web.Response:
        state = turn.state
        state.status = "timeout" if exc.kind == "timeout" else "error"
        state.error = str(exc)
        state.missing_reason = "decode_failed"
        self._mark_request_failed(state, f"decode failed: {exc}")
        if exc.kind == "http_4xx" and exc.status is not None:
            state.http_status = exc.status
            return web.Response(body=exc.body, status=exc.status, content_type=mime_type(exc.content_type))
        state.http_status = 502
        return openai_error(f"decode failed: {exc}", 502)

    async def _decode_streaming(self, request: web.Request, path: str, payload: bytes, headers: dict[str, str],
                                turn: _Turn, span: Span | None) -> web.StreamResponse:
        state = turn.state
        turn.reached_decode = True
        leg_cm = (self.tracing.decode_span(span, headers) if span is not None and self.tracing
                  else contextlib.nullcontext(None))
        with leg_cm as leg:
            try:
                resp, d_index, started = await self._open_decode(path, payload, headers, turn)
            except LegError as exc:
                if leg is not None and self.tracing is not None:
                    self.tracing.set_error(leg, str(exc))
                return self._decode_failed_before_body(turn, exc)
            out = web.StreamResponse(status=200, headers={
                "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache", "X-Request-Id": state.request_id, REUSE_HEADER: self._reuse_header(turn)})
            body = turn.body or {}
            n = body.get("n")
            capture = SSECapture(max_record_bytes=self.config.max_reply_bytes, chat=state.endpoint == "chat",
                                 single_choice=not (isinstance(n, int) and n > 1) and not body.get("use_beam_search"),
                                 token_ids=self.config.verify_tokens)
            # The client's stream: token ids it did not ask for removed, the final usage chunk rewritten.
            stripper = client_stream_filter(TokenIdStripper() if turn.strip_ids else None, body, turn.prefill_reuse)
            failure: LegError | None = None
            client_gone = False
            try:
                await out.prepare(request)
                first = True
                async for chunk in resp.content.iter_any():
                    if first:
                        state.ttft_ms = (time.perf_counter() - state.started) * 1000.0
                        first = False
                    capture.feed(chunk)
                    if capture.done and not turn.store_done:
                        # Store before the client sees [DONE]: its next turn must find the handle.
                        await self._store_from_capture(turn, capture, d_index)
                    try:
                        await out.write(stripper.feed(chunk) if stripper is not None else chunk)
                        if capture.done and stripper is not None:
                            await out.write(stripper.flush())
                    except ConnectionResetError:
                        client_gone = not turn.delivered
                        break
                    if capture.done:
                        turn.delivered = True
            except ConnectionResetError:
                client_gone = True  # the client went away before the headers were sent
            except TimeoutError:
                failure = LegError("decode", "timeout", f"decode stream idle for {self.config.decode_timeout:g}s")
            except aiohttp.ClientPayloadError as exc:
                failure = LegError("decode", "stream_broken", f"decode stream broke: {exc}")
            except aiohttp.ClientError as exc:
                failure = LegError("decode", "stream_broken", f"decode stream broke: {type(exc).__name__}: {exc}")
            finally:
                if capture.done and not client_gone:
                    resp.release()
                else:
                    resp.close()  # cancels the upstream request (client gone or stream failed)
                state.decode_ms = (time.perf_counter() - started) * 1000.0
            capture.close()
            state.completion_tokens = int_or_none((capture.usage or {}).get("completion_tokens"))
            if client_gone:
                self._client_gone(turn)
                await self._store_result(turn, None)
                return out
            if failure is None and capture.malformed is not None:
                failure = LegError("decode", "malformed", capture.malformed)
            if failure is None and not capture.done and capture.error is None:
                failure = LegError("decode", "stream_broken", "decode stream ended without [DONE]")
            if failure is not None or capture.error is not None:
                message = str(failure) if failure is not None else f"decode sent an error event: {capture.error}"
                if failure is not None:
                    self.telemetry.upstream_error("decode", failure.kind)
                state.status, state.error = "error", message
                state.missing_reason = "decode_failed"
                self._mark_request_failed(state, message)
                if leg is not None and self.tracing is not None:
                    self.tracing.set_error(leg, message)
                await self._store_result(turn, None)  # nothing stored, claim released
                if failure is not None:
                    with contextlib.suppress(ConnectionResetError):
                        await out.write(sse_error_event(message))
            elif not turn.store_done:
                await self._store_from_capture(turn, capture, d_index)
            if leg is not None:
                leg.set_attribute("gen_ai.usage.completion_tokens", state.completion_tokens or 0)
        with contextlib.suppress(ConnectionResetError):
            await out.write_eof()
        return out

    def _client_gone(self, turn: _Turn) -> None:
        if turn.delivered:
            return  # a client that closes after [DONE] had the whole reply: not a disconnect
        state = turn.state
        state.status, state.http_status = "disconnected", 499
        if state.missing_reason is None and not turn.store_done:
            state.missing_reason = "client_disconnected"
        self.telemetry.metrics.counter("kvdiag_client_disconnects").inc()

    async def _decode_json(self, path: str, payload: bytes, headers: dict[str, str], turn: _Turn,
                           span: Span | None) -> web.StreamResponse:
        state = turn.state
        turn.reached_decode = True
        leg_cm = (self.tracing.decode_span(span, headers) if span is not None and self.tracing
                  else contextlib.nullcontext(None))
        with leg_cm as leg:
            started = time.perf_counter()
            try:
                resp, d_index, started = await self._open_decode(path, payload, headers, turn)
                try:
                    raw = await resp.read()
                finally:
                    resp.release()
                obj = check_json_response("decode", str(resp.url), resp.status, raw,
                                          resp.headers.get("Content-Type", ""))
            except LegError as exc:
                state.decode_ms = (time.perf_counter() - started) * 1000.0
                if exc.kind == "malformed":
                    self.telemetry.upstream_error("decode", exc.kind)
                if leg is not None and self.tracing is not None:
                    self.tracing.set_error(leg, str(exc))
                return self._decode_failed_before_body(turn, exc)
            except (aiohttp.ClientError, TimeoutError) as exc:
                state.decode_ms = (time.perf_counter() - started) * 1000.0
                kind = "timeout" if isinstance(exc, TimeoutError) else "stream_broken"
                self.telemetry.upstream_error("decode", kind)
                return self._decode_failed_before_body(turn, LegError("decode", kind, f"decode failed: {exc}"))
            state.decode_ms = (time.perf_counter() - started) * 1000.0
            usage = obj.get("usage")
            if isinstance(usage, dict):
                state.completion_tokens = int_or_none(usage.get("completion_tokens"))
            params = obj.pop(PARAMS_KEY, None)
            observed = observe_body(obj)
            if turn.strip_ids:
                drop_token_ids(obj)
            if isinstance(params, dict):
                await self._store_result(turn, self._handle_from(params, d_index, turn, observed))
            else:
                reason = "aborted" if finish_reason(obj) == "abort" else "bidirectional_off_on_decode"
                state.missing_reason = reason
                await self._store_result(turn, None)
            if leg is not None:
                leg.set_attribute("gen_ai.usage.completion_tokens", state.completion_tokens or 0)
        if turn.prefill_reuse is not None and turn.prefill_reuse.cached_tokens is not None:
            rewrite_usage(obj.get("usage"), turn.prefill_reuse.cached_tokens)
        return web.Response(body=json.dumps(obj, separators=(",", ":")).encode(), status=200,
                            content_type="application/json",
                            headers={"X-Request-Id": state.request_id, REUSE_HEADER: self._reuse_header(turn)})

    @staticmethod
    def _reuse_header(turn: _Turn) -> str:
        state = turn.state
        return reuse_header(state.verdict, turn.prefill_reuse, state.handle_tokens, state.reuse_limit_tokens,
                            state.trim_reason)

    @staticmethod
    def _mark_request_failed(state: TurnState, message: str) -> None:
        prefill_outcome = state.verdict.value
        state.verdict = Verdict.REQUEST_FAILED
        state.reason = f"{message} (prefill verdict: {prefill_outcome})"

    # ------------------------------------------------------------------ store
    def _handle_from(self, params: dict[str, Any], d_index: int, turn: _Turn,
                     observed: Observed | None) -> Handle | None:
        """The handle to store for the next turn; None when the request's shape cannot be checked later."""
        state = turn.state
        params = dict(params)
        if "remote_host" in params:
            params["remote_host"] = self.upstreams.decode[d_index].host  # as the example proxy does
        lookup = state.lookup
        view = turn.view
        if view is None:
            self.reuse.observe(params)
            if turn.key is None or turn.claim is None or not turn.claim.acquired:
                return None  # nothing is stored for this turn anyway
            state.not_kept = f"unsupported request shape: {unsupported_shape(turn.body or {})}"
            return None
        previous = turn.coverage or (turn.claim.handle.coverage if turn.claim is not None and turn.claim.handle
                                     is not None else None)
        try:
            coverage = self.reuse.coverage(body=turn.body or {}, view=view, previous=previous,
                                           decision=turn.decision, prompt_tokens=state.prompt_tokens,
                                           observed=observed, d_params=params)
        except Exception:  # recording never breaks a turn: keep the handle without coverage (never injected)
            self.telemetry.emit_error()
            _logger.warning("recording the reply for the reuse rule failed", exc_info=True)
            coverage = None
        if coverage is not None and coverage.reply is not None:
            blockers = coverage.reply.blockers()
            if blockers:
                state.reply_blockers = [b.value for b in blockers]
        if not self.reuse.same_tokens(turn.tokenized, observed, state.reuse_limit_tokens):
            state.reuse_attrs["verify_mismatch_after_read"] = True
            self.telemetry.emit_error()
        return Handle(params=params, stored_at=time.time(), turn=lookup.turn if lookup else 1,
                      request_id=state.request_id, coverage=coverage)

    async def _store_from_capture(self, turn: _Turn, capture: SSECapture, d_index: int) -> None:
        state = turn.state
        if capture.params is not None and capture.error is None and capture.malformed is None:
            await self._store_result(turn, self._handle_from(capture.params, d_index, turn, capture.observed))
            return
        if capture.error is not None or capture.malformed is not None:
            state.missing_reason = "decode_failed"
        elif capture.finish_reason == "abort":
            state.missing_reason = "aborted"
        elif capture.params_present:
            state.missing_reason = "bidirectional_off_on_decode"  # the key is there, D sent null
        else:
            state.missing_reason = "not_streamed"  # stock vLLM without PR #40186
        await self._store_result(turn, None)

    async def _store_result(self, turn: _Turn, handle: Handle | None) -> None:
        """End the conversation's claim once: store the new handle or record why there is none."""
        if turn.store_done:
            return
        turn.store_done = True
        state, claim, key = turn.state, turn.claim, turn.key
        if claim is None or key is None or claim.token is None:
            return
        lookup = state.lookup
        try:
            if not turn.reached_decode and not turn.handle_reached_p:
                # P never read the handle: give it back for the next turn.
                await self.store.release(key, claim.token, turn.handle)
                return
            not_kept = state.not_kept if handle is None else None
            missing = None if handle is not None or not_kept else (state.missing_reason or "unknown")
            last = LastTurn(turn=lookup.turn if lookup else 1, ended_at=time.time(), stored=handle is not None,
                            request_id=state.request_id, missing_reason=missing, not_kept=not_kept,
                            prefill=self.upstreams.address("prefill", state.prefill_index),
                            decode=self.upstreams.address("decode", state.decode_index))
            stored = await self.store.complete(key, claim.token, handle, last)
            state.stored = stored and handle is not None
        except StoreError as exc:
            self.telemetry.store_error("release" if not turn.reached_decode else "complete")
            _logger.warning("store update failed: %s", exc)
            return
        log = self.telemetry.proxy_log
        if log is not None and handle is None and state.not_kept is not None:
            log.unsupported_shape(turn.conv_log or "")
        if state.stored and handle is not None and log is not None:
            if state.reply_blockers:
                log.not_validated(turn.conv_log or "")
            blocks = handle.params.get("remote_block_ids")
            first = blocks[0] if isinstance(blocks, list) and blocks and isinstance(blocks[0], list) else []
            log.cached(turn.conv_log or "", handle.params.get("remote_request_id"), len(first))

    def _finish_span(self, span: Span, turn: _Turn) -> None:
        state = turn.state
        try:
            span.set_attribute("kvdiag.verdict", state.verdict.value)
            span.set_attribute("kvdiag.request_id", state.request_id)
            span.set_attribute("http.response.status_code", state.http_status)
            if state.prompt_tokens is not None:
                span.set_attribute("gen_ai.usage.prompt_tokens", state.prompt_tokens)
            if state.report is not None:
                span.set_attribute("kvdiag.transfer_bytes", state.report.transfer_bytes)
                span.set_attribute("kvdiag.remote_read_tokens", state.report.remote_read_tokens)
            if state.status != "ok" and self.tracing is not None:
                self.tracing.set_error(span, state.error or state.status)
        except Exception:  # telemetry never breaks a turn
            self.telemetry.emit_error()
