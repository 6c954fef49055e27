"""Internal: what the router sends on a leg and reads back: P's request body and params, P's report, vLLM's error
shapes, and the errors the client gets in vLLM's own format."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web

from kvdiag.router.sse import PARAMS_KEY
from kvdiag.router.telemetry import RouterTelemetry
from kvdiag.schema.events import REPORT_KEY, EventFormatError, PrefillReport

if TYPE_CHECKING:
    from opentelemetry.trace import Span

_logger = logging.getLogger("kvdiag.router.flow")

TRACE_HEADERS: Final = ("traceparent", "tracestate")  # vLLM's TRACE_HEADERS (W3C)

# What P gets on a miss: the example proxy's params (P computes the prompt and holds its blocks for D).
MISS_PARAMS: Final = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                      "remote_block_ids": None, "remote_host": None, "remote_port": None}


def openai_error(message: str, status: int, err_type: str = "upstream_error") -> web.Response:
    """An OpenAI-style JSON error response."""
    body = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return web.json_response(body, status=status)


def sse_error_event(message: str, status: int = 502) -> bytes:
    """An SSE error event as vLLM streams one, then ``[DONE]``."""
    body = {"error": {"message": message, "type": "upstream_error", "param": None, "code": status}}
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


def handle_params(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored handle as P's params: read D's blocks, then hold P's own for D."""
    params = dict(stored)
    params["do_remote_decode"] = True
    params["do_remote_prefill"] = False
    return params


def prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The client's body as P's one-token, non-streamed prefill request carrying ``params``."""
    out = dict(body)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in ("min_tokens", "min_completion_tokens", "stream_options"):
        out.pop(key, None)
    out[PARAMS_KEY] = params
    return out


def report_from(raw: Any, telemetry: RouterTelemetry) -> PrefillReport | None:
    """Parse P's report; a malformed one is counted, logged and ignored."""
    if raw is None:
        return None
    try:
        return PrefillReport.from_dict(raw)
    except EventFormatError as exc:
        telemetry.emit_error()
        _logger.warning("ignoring a malformed kvdiag report from P: %s", exc)
        return None


def report_in(payload: dict[str, Any]) -> Any:
    """Where a failed P response may carry the report: its params, or its error object."""
    for holder in (payload.get(PARAMS_KEY), payload.get("error"), payload):
        if isinstance(holder, dict) and isinstance(holder.get(REPORT_KEY), dict):
            return holder[REPORT_KEY]
    return None


def generation_error(payload: dict[str, Any] | None) -> bool:
    """vLLM's answer to a request that finished with finish_reason error (on P: a KV load failure)."""
    error = payload.get("error") if isinstance(payload, dict) else None
    return isinstance(error, dict) and error.get("message") == "Internal server error" \
        and error.get("type") == "InternalServerError"


def finish_reason(obj: dict[str, Any]) -> str | None:
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        reason = choices[0].get("finish_reason")
        return reason if isinstance(reason, str) else None
    return None


def annotate_usage(span: Span, obj: dict[str, Any]) -> None:
    usage = obj.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        span.set_attribute("gen_ai.usage.prompt_tokens", usage["prompt_tokens"])


def int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def mime_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip() or "application/json"
