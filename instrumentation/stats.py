"""kvdiag's additions to NIXL's connector stats and Prometheus metrics (imports vLLM).

vLLM carries a connector's stats object from the workers to the scheduler (in
``KVConnectorOutput``) and from the scheduler to the API server (in ``SchedulerStats``), where
``build_kv_connector_stats``/``build_prom_metrics`` turn it into the ``KV Transfer metrics`` log
line and ``/metrics``. kvdiag rides the same channel with extra keys:

* ``kvdiag_xfers`` (worker -> scheduler): one row per request whose D->P read ended,
  ``[req_id, bytes, transfer_s, failure_type]`` (``""`` when it succeeded). The bytes and
  seconds are NIXL's own telemetry for that request's handles.
* ``kvdiag_expired`` (worker -> scheduler): requests whose retained blocks D released at expiry,
  ``[req_id, notifications]`` (the consumer notifications vLLM counted before the lease ran out:
  0 = released unread).
* counters for ``/metrics`` (scheduler -> API server): ``kvdiag_requests`` rows ``[role, outcome]``,
  ``kvdiag_read_tokens``, ``kvdiag_threshold_skips``, ``kvdiag_mismatch_tokens`` (tokens D offered that
  P's block-hash check found not matching), ``kvdiag_released`` (reasons), ``kvdiag_retained`` (gauge
  samples), ``kvdiag_emit_errors``.

NIXL's own keys, its log line and its ``vllm:nixl_*`` metrics are unchanged.
"""

from __future__ import annotations

from typing import Any, Final

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats, PromMetric, PromMetricT
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats, NixlPromMetrics

from kvdiag.schema.events import RELEASE_REASONS
from kvdiag.schema.metrics import metric
from kvdiag.schema.verdicts import Verdict

KVDIAG_KEYS: Final = (
    "kvdiag_xfers", "kvdiag_expired", "kvdiag_requests", "kvdiag_read_tokens", "kvdiag_threshold_skips",
    "kvdiag_released", "kvdiag_retained", "kvdiag_emit_errors", "kvdiag_mismatch_tokens",
)
_ROLES: Final = frozenset({"prefill", "decode"})
_OUTCOMES: Final = frozenset(v.value for v in Verdict)
_REASONS: Final = frozenset(RELEASE_REASONS)
OTHER: Final = "other"


class KVDiagNixlStats(NixlKVConnectorStats):  # type: ignore[misc]
    """NIXL's stats plus kvdiag's per-request rows and counters (see the module docstring)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in KVDIAG_KEYS:
            self.data.setdefault(key, [])

    def reset(self) -> None:
        super().reset()
        for key in KVDIAG_KEYS:
            self.data[key] = []

    def kvdiag_empty(self) -> bool:
        """True when none of kvdiag's keys holds anything."""
        return not any(self.data.get(key) for key in KVDIAG_KEYS)

    def is_empty(self) -> bool:
        return bool(super().is_empty()) and self.kvdiag_empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in KVDIAG_KEYS:
            self.data.setdefault(key, [])
        if not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        # With only kvdiag rows NIXL would log an all-zero "KV Transfer metrics" line that stock vLLM
        # never prints; an empty dict makes vLLM skip the line, so the log stays as stock.
        if super().is_empty():
            return {}
        return dict(super().reduce())


def _bounded(value: object, allowed: frozenset[str]) -> str:
    return value if isinstance(value, str) and value in allowed else OTHER


class KVDiagPromMetrics(NixlPromMetrics):  # type: ignore[misc]
    """NIXL's ``vllm:nixl_*`` metrics plus the catalog's connector metrics (kvdiag_connector_*)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def make(kind: Any, name: str, extra: tuple[str, ...] = ()) -> Any:
            spec = metric(name)
            return kind(name=spec.name, documentation=spec.help, labelnames=[*labelnames, *extra])

        self._requests = make(self._counter_cls, "kvdiag_connector_requests", ("role", "outcome"))
        self._read_tokens = make(self._counter_cls, "kvdiag_connector_remote_read_tokens")
        self._threshold_skips = make(self._counter_cls, "kvdiag_connector_threshold_skips")
        self._mismatch_tokens = make(self._counter_cls, "kvdiag_connector_mismatch_tokens")
        self._retained = make(self._gauge_cls, "kvdiag_connector_retained_requests")
        self._released = make(self._counter_cls, "kvdiag_connector_released", ("reason",))
        errors = metric("kvdiag_emit_errors")
        self._emit_errors = self._counter_cls(name=errors.name, documentation=errors.help,
                                              labelnames=list(errors.labels))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        engine = self.per_engine_labelvalues[engine_idx]
        for row in transfer_stats_data.get("kvdiag_requests", ()):
            if isinstance(row, list | tuple) and len(row) == 2:
                self._requests.labels(*engine, _bounded(row[0], _ROLES), _bounded(row[1], _OUTCOMES)).inc()
        for tokens in transfer_stats_data.get("kvdiag_read_tokens", ()):
            self._read_tokens.labels(*engine).inc(max(float(tokens), 0.0))
        for _ in transfer_stats_data.get("kvdiag_threshold_skips", ()):
            self._threshold_skips.labels(*engine).inc()
        for tokens in transfer_stats_data.get("kvdiag_mismatch_tokens", ()):
            self._mismatch_tokens.labels(*engine).inc(max(float(tokens), 0.0))
        for reason in transfer_stats_data.get("kvdiag_released", ()):
            self._released.labels(*engine, _bounded(reason, _REASONS)).inc()
        retained = transfer_stats_data.get("kvdiag_retained", ())
        if retained:
            self._retained.labels(*engine).set(float(retained[-1]))
        for _ in transfer_stats_data.get("kvdiag_emit_errors", ()):
            self._emit_errors.labels("connector").inc()
