"""The "KV transfer" dashboard: D->P reads per turn (kvdiag) beside vLLM's own NIXL metrics."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.models import units

from kvdiag.dashboards import queries as q
from kvdiag.dashboards.panels import TP_POOLING_NOTE, Target, base_dashboard, timeseries_panel, vllm_instance_variable
from kvdiag.monitoring.config import MixinConfig

FILE_STEM = "kv-transfer"
TITLE = "kvdiag / KV transfer"

_PER_TURN = "Reported by P for each turn (kvdiag PrefillReport), so one observation is one request's read."


def build(config: MixinConfig) -> dashboard.Dashboard:
    """Assemble the dashboard; every panel's query lives in queries.py."""
    return (
        base_dashboard(config, TITLE, FILE_STEM, "D->P KV transfer per turn and vLLM's NIXL connector metrics.")
        .with_variable(vllm_instance_variable(config))
        .with_row(dashboard.Row("D->P reads per turn (kvdiag)"))
        .with_panel(timeseries_panel(
            "D->P bytes per turn", "Bytes P read back from D per turn: p50, p95 and mean. " + _PER_TURN,
            units.BytesIEC,
            [Target(q.transfer_bytes_quantile(config, 0.5), "p50"),
             Target(q.transfer_bytes_quantile(config, 0.95), "p95"),
             Target(q.transfer_bytes_mean(config), "mean")], width=8))
        .with_panel(timeseries_panel(
            "D->P seconds per turn", "Duration of P's D->P read per turn: p50 and p95. " + _PER_TURN,
            units.Seconds,
            [Target(q.transfer_seconds_quantile(config, 0.5), "p50"),
             Target(q.transfer_seconds_quantile(config, 0.95), "p95")], width=8))
        .with_panel(timeseries_panel(
            "Effective D->P bandwidth",
            "Bytes moved per second of read time (sum of bytes / sum of read seconds), not per wall-clock "
            "second. Compare with the link's capacity.",
            units.BytesPerSecondIEC, [Target(q.effective_bandwidth(config), "bandwidth")], width=8))
        .with_panel(timeseries_panel(
            "D->P read failures by type",
            "Failed D->P reads per second by failure_type (e.g. handshake_failed), and expired reads. "
            "Under kv_load_failure_policy=fail each fails the turn; under recompute it costs latency.",
            units.OpsPerSecond,
            [Target(q.transfer_failures_by_type(config), "{{failure_type}}"),
             Target(q.expired_reads_rate(config), "expired")], width=12))
        .with_panel(timeseries_panel(
            "Prompt tokens by source (kvdiag)",
            "Prompt tokens per second by how P obtained them: local_cache_hit, remote_read (D->P) or computed.",
            units.Short, [Target(q.prompt_tokens_by_source(config), "{{source}}")], width=12, stacked=True))
        .with_row(dashboard.Row("vLLM engine metrics"))
        .with_panel(timeseries_panel(
            "vLLM NIXL transfer time p50/p95",
            "vllm:nixl_xfer_time_seconds per engine: time from posting a transfer until NIXL reports it "
            "complete. " + TP_POOLING_NOTE,
            units.Seconds,
            [Target(q.vllm_xfer_time_quantile(config, 0.5), "p50 {{instance}}"),
             Target(q.vllm_xfer_time_quantile(config, 0.95), "p95 {{instance}}")], width=12))
        .with_panel(timeseries_panel(
            "vLLM NIXL bytes per transfer",
            "Mean of vllm:nixl_bytes_transferred per engine. " + TP_POOLING_NOTE,
            units.BytesIEC, [Target(q.vllm_bytes_per_transfer(config), "{{instance}}")], width=12))
        .with_panel(timeseries_panel(
            "vLLM NIXL failures and expiries",
            "Per second and engine, as vLLM 0.33 counts them: vllm:nixl_num_failed_transfers (transport "
            "failures of reads, handshakes and notifications; vllm:nixl_num_failed_notifications is the "
            "notification part of it), vllm:nixl_num_kv_expired_reqs (apart from the failures: on P, D->P reads "
            "declined as expiring and P's own held blocks D never read; on D, held blocks released at the TTL, "
            "which every conversation's last turn ends with) and vllm:nixl_num_notifications_after_expiry (a "
            "read finished after the blocks were released: they may have been reused). No reason label: the "
            "kvdiag panel above has failure types. " + TP_POOLING_NOTE,
            units.OpsPerSecond,
            [Target(q.vllm_nixl_failures(config), "failed transfers {{instance}}"),
             Target(q.vllm_nixl_failed_notifications(config), "of which notifications {{instance}}"),
             Target(q.vllm_nixl_expired(config), "expired {{instance}}"),
             Target(q.vllm_nixl_notifications_after_expiry(config), "read after expiry {{instance}}")], width=8))
        .with_panel(timeseries_panel(
            "vLLM prompt tokens by source",
            "vllm:prompt_tokens_by_source per engine: local_compute, local_cache_hit, external_kv_transfer. "
            "On P, D->P pulled tokens count as external_kv_transfer.",
            units.Short, [Target(q.vllm_prompt_tokens_by_source(config), "{{source}} {{instance}}")], width=8))
        .with_panel(timeseries_panel(
            "vLLM external prefix-cache hit ratio",
            "vllm:external_prefix_cache_hits / vllm:external_prefix_cache_queries per engine (tokens): "
            "prompt tokens the KV connector supplied. On P, D->P pulled tokens count here.",
            units.PercentUnit, [Target(q.vllm_external_hit_ratio(config), "{{instance}}")], width=8, max_value=1))
        .with_row(dashboard.Row("Retention on D (kvdiag connector, instrumented engines)"))
        .with_panel(timeseries_panel(
            "Requests D holds for the next turn",
            "kvdiag_connector_retained_requests per engine: finished requests whose blocks D keeps for up to "
            "decoder_kv_blocks_ttl. Retention raises reuse but takes KV memory from new work; read it "
            "together with the KV-cache usage panel.",
            units.Short, [Target(q.connector_retained(config), "{{instance}}")], width=8))
        .with_panel(timeseries_panel(
            "KV-cache usage",
            "vllm:kv_cache_usage_perc per engine (1 = full). High usage on D with many retained requests "
            "means D may release held blocks early (reason evicted).",
            units.PercentUnit, [Target(q.vllm_kv_cache_usage(config), "{{instance}}")], width=8, max_value=1))
        .with_panel(timeseries_panel(
            "Held blocks released by reason",
            "kvdiag_connector_released per second by reason: read (P pulled them, the goal), expired (TTL ran "
            "out before the next turn), evicted (memory pressure), restart, notify_only.",
            units.OpsPerSecond, [Target(q.connector_released(config), "{{reason}}")], width=8, stacked=True))
        .with_panel(timeseries_panel(
            "Connector requests by outcome",
            "kvdiag_connector_requests per second by role (prefill/decode) and P's per-request outcome, "
            "as the instrumented connector saw them.",
            units.OpsPerSecond, [Target(q.connector_requests(config), "{{role}} {{outcome}}")], width=24))
    )
