"""OpenTelemetry tracing for the router: one ``kvdiag.turn`` span with two leg spans per turn.

Tracing is off unless an OTLP endpoint (or, in tests, an exporter) is given; then
:func:`setup_tracing` returns None and the router skips span code entirely. With it on, the turn
span continues the client's W3C ``traceparent`` and each leg's context is injected into the
request to P or D, so vLLM's ``llm_request`` spans join the same trace.

Usage::

    tracing = setup_tracing("http://collector:4318", service_name="kvdiag-router")
    with tracing.turn_span(request.headers, conversation="3f2a...") as span:
        with tracing.leg_span("kvdiag.prefill_leg", span, headers) as leg:  # headers get traceparent
            ...
    tracing.shutdown()
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any, Final
from urllib.parse import urlparse

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_logger = logging.getLogger(__name__)

TURN_SPAN: Final = "kvdiag.turn"
PREFILL_SPAN: Final = "kvdiag.prefill_leg"
DECODE_SPAN: Final = "kvdiag.decode_leg"
TRACE_HEADERS: Final = ("traceparent", "tracestate")  # vLLM's TRACE_HEADERS

_PROPAGATOR: Final = TraceContextTextMapPropagator()


def otlp_traces_url(endpoint: str) -> str:
    """``http://host:4318`` → ``http://host:4318/v1/traces``; a URL with a path is kept as is."""
    parsed = urlparse(endpoint)
    if not parsed.scheme or not parsed.netloc:
        raise ValueError(f"--otlp-endpoint {endpoint!r}: expected a URL like http://collector:4318")
    if parsed.path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


def trace_id_of(span: Span) -> str | None:
    """The span's trace id as 32 hex digits, or None for a non-recording span."""
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


class Tracing:
    """A tracer provider of its own (the global one is left alone) and the router's span helpers."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("kvdiag.router")

    @contextmanager
    def turn_span(self, headers: Mapping[str, str], attributes: dict[str, Any] | None = None) -> Iterator[Span]:
        """The turn span, child of the client's traceparent when it sent one."""
        parent = _PROPAGATOR.extract(carrier=dict(headers))
        with self.tracer.start_as_current_span(TURN_SPAN, context=parent, kind=SpanKind.SERVER,
                                               attributes=attributes, record_exception=False,
                                               set_status_on_exception=False) as span:
            yield span

    @contextmanager
    def leg_span(self, name: str, parent: Span, carrier: MutableMapping[str, str],
                 attributes: dict[str, Any] | None = None) -> Iterator[Span]:
        """A leg span under ``parent``; its context is written into ``carrier`` (the upstream headers)."""
        ctx = trace.set_span_in_context(parent)
        with self.tracer.start_as_current_span(name, context=ctx, kind=SpanKind.CLIENT, attributes=attributes,
                                               record_exception=False, set_status_on_exception=False) as span:
            _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
            yield span

    @contextmanager
    def prefill_span(self, parent: Span, carrier: MutableMapping[str, str],
                     attributes: dict[str, Any] | None = None) -> Iterator[Span]:
        """The ``kvdiag.prefill_leg`` span (one per attempt)."""
        with self.leg_span(PREFILL_SPAN, parent, carrier, attributes) as span:
            yield span

    @contextmanager
    def decode_span(self, parent: Span, carrier: MutableMapping[str, str],
                    attributes: dict[str, Any] | None = None) -> Iterator[Span]:
        """The ``kvdiag.decode_leg`` span."""
        with self.leg_span(DECODE_SPAN, parent, carrier, attributes) as span:
            yield span

    @staticmethod
    def trace_id(span: Span) -> str | None:
        """The span's trace id as 32 hex digits."""
        return trace_id_of(span)

    @staticmethod
    def set_error(span: Span, message: str) -> None:
        """Mark a span failed."""
        span.set_status(Status(StatusCode.ERROR, message))

    def shutdown(self) -> None:
        """Flush and stop the exporter; errors are logged, never raised."""
        try:
            self.provider.shutdown()
        except Exception:  # telemetry never crashes the host
            _logger.exception("tracer shutdown failed")


def setup_tracing(endpoint: str | None, *, service_name: str = "kvdiag-router",
                  exporter: SpanExporter | None = None) -> Tracing | None:
    """Tracing to an OTLP/HTTP endpoint (batched) or to ``exporter`` (synchronous, for tests); None if neither."""
    if endpoint is None and exporter is None:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if endpoint is not None:
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_traces_url(endpoint)),
                                                       max_queue_size=8192))
    return Tracing(provider)
