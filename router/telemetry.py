"""The router's telemetry: catalog metrics, the ``router_turn`` event file and the stock proxy log.

Every method catches its own errors and counts them in ``kvdiag_emit_errors_total``: telemetry
never fails or slows a turn. Labels come from bounded sets; the ``model`` label keeps the first
``max_model_labels`` names seen and folds the rest into ``other``.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry

from kvdiag.exporters.jsonl import EventSink
from kvdiag.exporters.prometheus import OTHER, CatalogMetrics
from kvdiag.router.config import RouterConfig
from kvdiag.router.proxy_log_writer import ProxyLog
from kvdiag.router.turns import TurnState
from kvdiag.schema.metrics import prompt_bucket, turn_bucket
from kvdiag.schema.verdicts import Verdict

_logger = logging.getLogger(__name__)

MAX_PENDING_EVENTS = 50_000  # turns waiting for the next flush (bounded; beyond it events are dropped, counted)
EVENT_FLUSH_INTERVAL = 0.05  # seconds

_READ_VERDICTS = frozenset({Verdict.REMOTE_HIT, Verdict.EXPIRED_REMOTE_READ, Verdict.TRANSFER_FAILED})


class RouterTelemetry:
    """Metrics, events and proxy-log lines for one router process."""

    def __init__(self, config: RouterConfig, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = CatalogMetrics(self.registry, component="router")
        self._max_models = config.max_model_labels
        self._models: set[str] = set()
        m = self.metrics
        m.gauge("kvdiag_router_entry_ttl_seconds").set(config.handle_ttl)
        m.gauge("kvdiag_decoder_kv_blocks_ttl_seconds").set(config.decoder_kv_blocks_ttl)
        m.gauge("kvdiag_store_capacity").set(config.max_entries)
        self._emit_errors = m.labels("kvdiag_emit_errors", component="router")
        self.sink = EventSink(config.events_file, on_error=self._emit_errors.inc) if config.events_file else None
        self.proxy_log = ProxyLog(config.proxy_log, on_drop=self._emit_errors.inc) if config.proxy_log else None
        self.in_flight = m.gauge("kvdiag_in_flight_turns")
        self._children: dict[tuple[str, ...], Any] = {}
        self._pending: list[TurnState] = []

    def _labels(self, name: str, **labels: str) -> Any:
        # Label children are cached: label sets are bounded, and labels() costs a lock and a dict per call.
        key = (name, *labels.values())
        child = self._children.get(key)
        if child is None:
            child = self.metrics.labels(name, **labels)
            if len(self._children) < 50_000:
                self._children[key] = child
        return child

    def emit_error(self) -> None:
        """Count one telemetry failure."""
        self._emit_errors.inc()

    def model_label(self, model: Any) -> str:
        """A bounded label value for the request's ``model``."""
        if not isinstance(model, str) or not model:
            return "unknown"
        if model in self._models:
            return model
        if len(self._models) < self._max_models and len(model) <= 128:
            self._models.add(model)
            return model
        return OTHER

    def request(self, endpoint: str, code: int) -> None:
        """Count one client request by route and status."""
        try:
            self._labels("kvdiag_router_requests", endpoint=endpoint, code=str(code)).inc()
        except Exception:
            self._failed("request counter")

    def upstream_error(self, leg: str, kind: str) -> None:
        """Count one error talking to P or D."""
        try:
            self._labels("kvdiag_upstream_errors", leg=leg, kind=kind).inc()
        except Exception:
            self._failed("upstream error counter")

    def store_error(self, op: str) -> None:
        """Count one failed store operation."""
        try:
            self.metrics.labels("kvdiag_store_errors", op=op).inc()
        except Exception:
            self._failed("store error counter")

    def evicted(self, reason: str, count: int) -> None:
        """Store callback: ``count`` handles dropped for ``reason``."""
        try:
            self.metrics.labels("kvdiag_store_evictions", reason=reason).inc(count)
        except Exception:
            self._failed("eviction counter")

    def store_size(self, size: int) -> None:
        """Set the store-size gauge."""
        self.metrics.gauge("kvdiag_store_entries").set(size)

    def client_params_dropped(self) -> None:
        """Count a request whose client-sent kv_transfer_params were dropped."""
        self.metrics.counter("kvdiag_client_params_dropped").inc()

    def turn(self, state: TurnState) -> None:
        """Record a finished turn: metrics now, the event at the next :meth:`flush_events`."""
        try:
            self._turn_metrics(state)
        except Exception:
            self._failed("turn metrics")
        if self.sink is not None:
            if len(self._pending) < MAX_PENDING_EVENTS:
                self._pending.append(state)
            else:
                self._emit_errors.inc()  # dropped: the writer is far behind

    def flush_events(self) -> None:
        """Hand the turns recorded since the last flush to the event sink.

        Batching matters: one hand-over per flush wakes the writer thread once, instead of once
        per turn (each wake-up costs a GIL hand-off on the event loop's thread).
        """
        if self.sink is None or not self._pending:
            return
        pending, self._pending = self._pending, []
        for state in pending:
            try:
                self.sink.emit(state.to_event())
            except Exception:
                self._failed("turn event")

    def _turn_metrics(self, s: TurnState) -> None:
        m = self.metrics
        model = self.model_label(s.model)
        lookup = s.lookup
        turn = lookup.turn if lookup else 1
        prompt = s.report.prompt_tokens if s.report else (s.prompt_tokens or 0)
        self._labels("kvdiag_turns", model=model, outcome=s.verdict.value, turn_bucket=turn_bucket(turn),
                 prompt_bucket=prompt_bucket(prompt)).inc()
        if lookup is not None:
            self._labels("kvdiag_lookups", result=lookup.result).inc()
            if lookup.result == "concurrent":
                m.counter("kvdiag_concurrent_turns").inc()
            if lookup.result == "hit" and lookup.entry_age_s is not None:
                self._labels("kvdiag_entry_age_seconds", model=model).observe(lookup.entry_age_s)
            if lookup.gap_s is not None:
                self._labels("kvdiag_inter_turn_gap_seconds", model=model).observe(lookup.gap_s)
        if s.missing_reason is not None:
            self._labels("kvdiag_missing_metadata", model=model, reason=s.missing_reason).inc()
        if s.verdict is Verdict.EXPIRED_REMOTE_READ:
            self._labels("kvdiag_expired_remote_reads", model=model).inc()
        if s.verdict in _READ_VERDICTS:
            self._labels("kvdiag_remote_reads", model=model).inc()
        if s.verdict is Verdict.TRANSFER_FAILED:
            failure = s.failure_type or (s.report.failure_type if s.report else None) or "unknown"
            self._labels("kvdiag_transfer_failures", model=model, failure_type=_bounded_failure(failure)).inc()
        reused = "true" if s.reused else "false"
        if s.ttft_ms is not None:
            hist = self._labels("kvdiag_ttft_seconds", model=model, reused=reused)
            if s.trace_id:
                hist.observe(s.ttft_ms / 1000.0, exemplar={"trace_id": s.trace_id})
            else:
                hist.observe(s.ttft_ms / 1000.0)
        if s.prefill_ms is not None:
            self._labels("kvdiag_prefill_leg_seconds", model=model, reused=reused).observe(s.prefill_ms / 1000.0)
        if s.decode_ms is not None:
            self._labels("kvdiag_decode_leg_seconds", model=model).observe(s.decode_ms / 1000.0)
        overhead = s.overhead_ms
        if overhead is not None:
            self._labels("kvdiag_router_overhead_seconds", model=model).observe(overhead / 1000.0)
        if s.handle_tokens is not None:
            decided = "full" if s.trim_reason is None else ("trimmed" if s.reuse_limit_tokens else "none")
            self._labels("kvdiag_reuse_decisions", model=model, reuse=decided).inc()
            if s.reuse_limit_tokens:
                self._labels("kvdiag_reuse_offered_tokens", model=model).inc(s.reuse_limit_tokens)
            if s.trim_reason is not None:
                reason = s.trim_reason.value
                self._labels("kvdiag_reuse_trimmed_turns", model=model, reason=reason).inc()
                if s.trimmed_tokens:
                    self._labels("kvdiag_reuse_trimmed_tokens", model=model, reason=reason).inc(s.trimmed_tokens)
        report = s.report
        if report is not None:
            if report.transfer_bytes:
                self._labels("kvdiag_transfer_bytes", model=model).observe(report.transfer_bytes)
            if report.transfer_ms:
                self._labels("kvdiag_transfer_seconds", model=model).observe(report.transfer_ms / 1000.0)
            for source, tokens in (("local_cache_hit", report.local_hit_tokens),
                                   ("remote_read", report.remote_read_tokens), ("computed", report.computed_tokens)):
                if tokens:
                    self._labels("kvdiag_prompt_tokens", model=model, source=source).inc(tokens)

    def _failed(self, what: str) -> None:
        self._emit_errors.inc()
        _logger.warning("router telemetry: %s failed", what, exc_info=True)

    def close(self) -> None:
        """Flush the event file and the proxy log."""
        self.flush_events()
        if self.sink is not None:
            self.sink.close()
        if self.proxy_log is not None:
            self.proxy_log.close()


_FAILURE_TYPES = frozenset({"handshake_setup_failed", "handshake_failed", "transfer_failed", "transfer_exception",
                            "transfer_setup_failed", "notification_failed", "expired_declined", "unknown"})


def _bounded_failure(value: str) -> str:
    # failure_type comes from P's report: keep vLLM's names, fold anything else.
    return value if value in _FAILURE_TYPES else OTHER
