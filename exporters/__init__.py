"""Exporters: Prometheus registries from the catalog, OpenTelemetry spans, JSON-lines and Parquet sinks."""
