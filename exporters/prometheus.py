"""Prometheus metric objects built from the catalog, into an injected registry.

Usage::

    registry = CollectorRegistry()
    metrics = CatalogMetrics(registry, component="router")
    metrics.counter("kvdiag_turns").labels(model="m", outcome="remote_hit", turn_bucket="2",
                                           prompt_bucket="<2k").inc()

Label values are checked against the catalog's bounded enumerations where it declares them, so a
bug can never turn a label into an unbounded set (an unexpected value becomes ``other``).
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.metrics import MetricWrapperBase

from kvdiag.schema.metrics import CATALOG, MetricSpec, metric

_logger = logging.getLogger(__name__)

OTHER = "other"


class CatalogMetrics:
    """The catalog's metrics for one component, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry, component: str = "router",
                 extra_labels: dict[str, str] | None = None) -> None:
        self.registry = registry
        self._metrics: dict[str, MetricWrapperBase] = {}
        self._specs: dict[str, MetricSpec] = {}
        for spec in CATALOG:
            if spec.component not in (component, "both"):
                continue
            self._specs[spec.name] = spec
            self._metrics[spec.name] = _make(spec, registry)
        self._allowed = {
            spec.name: {label: frozenset(values) for label, values in spec.label_values}
            for spec in self._specs.values()
        }

    def _get(self, name: str) -> MetricWrapperBase:
        if name not in self._metrics:
            metric(name)  # raises KeyError naming the catalog if the name is unknown
            raise KeyError(f"{name!r} is not a metric of this component")
        return self._metrics[name]

    def counter(self, name: str) -> Any:
        """The Counter ``name`` (a catalog name, without ``_total``)."""
        return self._get(name)

    def gauge(self, name: str) -> Any:
        """The Gauge ``name``."""
        return self._get(name)

    def histogram(self, name: str) -> Any:
        """The Histogram ``name``."""
        return self._get(name)

    def labels(self, name: str, **labels: str) -> Any:
        """Return the child of ``name`` for ``labels``, with unknown enumerated values mapped to ``other``."""
        allowed = self._allowed.get(name, {})
        clean = {k: (v if k not in allowed or v in allowed[k] else OTHER) for k, v in labels.items()}
        return self._get(name).labels(**clean)


def _make(spec: MetricSpec, registry: CollectorRegistry) -> MetricWrapperBase:
    kwargs: dict[str, Any] = {"registry": registry}
    if spec.labels:
        kwargs["labelnames"] = list(spec.labels)
    if spec.type == "counter":
        return Counter(spec.name, spec.help, **kwargs)
    if spec.type == "gauge":
        return Gauge(spec.name, spec.help, **kwargs)
    if spec.type == "histogram":
        return Histogram(spec.name, spec.help, buckets=list(spec.buckets), **kwargs)
    return Info(spec.name, spec.help, **kwargs)
