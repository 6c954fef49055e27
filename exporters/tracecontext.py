"""W3C trace-context parsing with no OpenTelemetry import (the router uses it with tracing off too)."""

from __future__ import annotations


def trace_id_from_traceparent(value: str | None) -> str | None:
    """The trace id of a W3C ``traceparent`` header (``00-<32 hex>-<16 hex>-<2 hex>``), if well formed."""
    if not value:
        return None
    parts = value.strip().split("-")
    if len(parts) != 4 or len(parts[1]) != 32:
        return None
    try:
        if int(parts[1], 16) == 0:
            return None
    except ValueError:
        return None
    return parts[1].lower()
