"""The "Router health" dashboard: traffic, errors, added latency and in-flight turns of the kvdiag router."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.models import units

from kvdiag.dashboards import queries as q
from kvdiag.dashboards.panels import Target, base_dashboard, timeseries_panel
from kvdiag.monitoring.config import MixinConfig

FILE_STEM = "router-health"
TITLE = "kvdiag / Router health"


def build(config: MixinConfig) -> dashboard.Dashboard:
    """Assemble the dashboard; every panel's query lives in queries.py."""
    return (
        base_dashboard(config, TITLE, FILE_STEM, "The kvdiag P/D router: traffic, errors, latency it adds.")
        .with_row(dashboard.Row("Traffic and errors"))
        .with_panel(timeseries_panel(
            "Request rate by status", "Client requests per second handled by the router, by HTTP status code.",
            units.RequestsPerSecond, [Target(q.request_rate_by_code(config), "{{code}}")], width=8, stacked=True))
        .with_panel(timeseries_panel(
            "Error ratio (5xx)", "Share of client requests the router answered with a 5xx status.",
            units.PercentUnit, [Target(q.error_ratio(config), "5xx / all")], width=8))
        .with_panel(timeseries_panel(
            "Upstream errors by leg",
            "Errors talking to P (prefill leg) or D (decode leg) per second, by kind: connect, timeout, "
            "http_5xx, http_4xx, malformed, stream_broken.",
            units.OpsPerSecond, [Target(q.upstream_errors(config), "{{leg}} {{kind}}")], width=8))
        .with_row(dashboard.Row("Latency"))
        .with_panel(timeseries_panel(
            "Added latency (router overhead)",
            "Time the router adds to a turn outside the prefill and decode legs (lookup, params merge, "
            "bookkeeping): p50, p95, p99.",
            units.Seconds,
            [Target(q.overhead_quantile(config, 0.5), "p50"), Target(q.overhead_quantile(config, 0.95), "p95"),
             Target(q.overhead_quantile(config, 0.99), "p99")], width=12))
        .with_panel(timeseries_panel(
            "Upstream leg durations p95",
            "p95 of the prefill leg (router to P and back, by reused) and of the decode leg until the last byte.",
            units.Seconds,
            [Target(q.prefill_leg_quantile(config, 0.95), "prefill reused={{reused}}"),
             Target(q.decode_leg_quantile(config, 0.95), "decode")], width=12))
        .with_row(dashboard.Row("Placement and upstream health"))
        .with_panel(timeseries_panel(
            "Placement decisions by reason",
            "Where turns went, per second, by leg and why that instance: round_robin (the default policy), "
            "affinity (the D that served the conversation's last turn), locality (the P that did), branch "
            "(a concurrent turn follows its sibling's P), least_loaded, overloaded or fallback_unhealthy "
            "(the preferred instance was over the load bound or ejected).",
            units.OpsPerSecond, [Target(q.placement_rate_by_reason(config), "{{leg}} {{reason}}")], width=8,
            stacked=True))
        .with_panel(timeseries_panel(
            "Upstream health (1 admitted, 0 ejected)",
            "Each P and D instance by index: ejected after consecutive connect errors, timeouts or 5xx, "
            "taken back after the ejection time or a passing /health probe. The lowest value across router "
            "replicas.", units.Short, [Target(q.upstream_healthy(config), "{{leg}} {{index}}")], width=8,
            max_value=1))
        .with_panel(timeseries_panel(
            "Requests in flight per instance",
            "Requests the routers have in flight on each P and D instance (the load that placement balances).",
            units.Short, [Target(q.upstream_in_flight(config), "{{leg}} {{index}}")], width=8))
        .with_row(dashboard.Row("Turns and clients"))
        .with_panel(timeseries_panel(
            "Turns in flight", "Turns being routed right now, per router instance.",
            units.Short, [Target(q.in_flight_turns(config), "{{instance}}")], width=6))
        .with_panel(timeseries_panel(
            "Concurrent turns",
            "Turns per second that arrived while another turn of the same conversation was in flight; "
            "they run without reuse (verdict concurrent_turn).",
            units.OpsPerSecond, [Target(q.concurrent_turn_rate(config), "concurrent")], width=6))
        .with_panel(timeseries_panel(
            "Client disconnects",
            "Clients that disconnected before the response completed, per second. The aborted turn "
            "returns no kv_transfer_params, so the next turn cannot reuse KV.",
            units.OpsPerSecond, [Target(q.disconnect_rate(config), "disconnects")], width=6))
        .with_panel(timeseries_panel(
            "Handle lookups by result",
            "Router store lookups per second: hit, miss, expired, no_id, concurrent, prefix_mismatch, lost.",
            units.OpsPerSecond, [Target(q.lookups_by_result(config), "{{result}}")], width=6, stacked=True))
    )
