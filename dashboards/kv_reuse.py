"""The "KV reuse" dashboard: did later turns reuse D's KV, and if not, why."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.models import units

from kvdiag.dashboards import queries as q
from kvdiag.dashboards.panels import Target, base_dashboard, stat_panel, timeseries_panel
from kvdiag.monitoring.config import MixinConfig

FILE_STEM = "kv-reuse"
TITLE = "kvdiag / KV reuse"

_ELIGIBLE = ("Eligible turns are later turns that could have reused D's KV had everything worked "
             "(schema/verdicts.py: every verdict but first_turn, request_failed and unknown).")


def build(config: MixinConfig) -> dashboard.Dashboard:
    """Assemble the dashboard; every panel's query lives in queries.py."""
    return (
        base_dashboard(config, TITLE, FILE_STEM,
                       "Cross-turn KV reuse in vLLM P/D with bidirectional D->P transfer, per the kvdiag router.")
        .with_row(dashboard.Row("Turn outcomes"))
        .with_panel(stat_panel(
            "Reuse ratio (eligible turns)",
            "Share of eligible turns that reused KV (remote_hit or local_hit). " + _ELIGIBLE,
            units.PercentUnit, [Target(q.reuse_ratio(config), "reuse ratio")]))
        .with_panel(stat_panel(
            "Expired remote reads",
            "Share of attempted D->P reads that found D's blocks released or were declined as expiring "
            "(verdict expired_remote_read). Alert KVDiagExpiredRemoteReadRatioHigh watches this.",
            units.PercentUnit, [Target(q.expired_read_ratio(config), "expired / attempted")]))
        .with_panel(timeseries_panel(
            "Turn outcomes by verdict",
            "Turns per second by reuse verdict (outcome label). remote_hit and local_hit reused KV; "
            "first_turn had nothing to reuse; every other verdict names why a later turn recomputed.",
            units.RequestsPerSecond, [Target(q.turn_rate_by_outcome(config), "{{outcome}}")],
            stacked=True, width=12))
        .with_row(dashboard.Row("Reuse by turn and prompt length"))
        .with_panel(timeseries_panel(
            "Reuse ratio of eligible turns", "Share of eligible turns that reused KV over time. " + _ELIGIBLE,
            units.PercentUnit, [Target(q.reuse_ratio(config), "reuse ratio")], width=8, max_value=1))
        .with_panel(timeseries_panel(
            "Reuse ratio by turn index",
            "Reuse ratio of eligible turns per turn index bucket (2, 3, 4-7, 8+). The article asks to "
            "look at reuse by conversation turn, not only as an aggregate.",
            units.PercentUnit, [Target(q.reuse_ratio(config, by="turn_bucket"), "turn {{turn_bucket}}")],
            width=8, max_value=1))
        .with_panel(timeseries_panel(
            "Reuse ratio by prompt length",
            "Reuse ratio of eligible turns per prompt-length bucket (tokens). Short prompts gain "
            "little from a D->P read; long ones gain the most.",
            units.PercentUnit, [Target(q.reuse_ratio(config, by="prompt_bucket"), "{{prompt_bucket}}")],
            width=8, max_value=1))
        .with_panel(timeseries_panel(
            "TTFT p50/p95: reused vs recomputed",
            "Router-observed time to first token, split by whether the turn reused KV (reused=true) "
            "or recomputed the history (reused=false). The dots are exemplars: the trace id of a turn in "
            "that bucket (link it to your tracing data source); the router_turn event with that trace_id "
            "names the conversation for `kvdiag explain LOGS --conversation-id ID`.",
            units.Seconds,
            [Target(q.ttft_quantile(config, 0.5), "p50 reused={{reused}}"),
             Target(q.ttft_quantile(config, 0.95), "p95 reused={{reused}}", exemplar=True)], width=24))
        .with_row(dashboard.Row("Why turns miss"))
        .with_panel(timeseries_panel(
            "Expired-read ratio",
            "Expired D->P reads per attempted read. P declines a read when D's blocks expire within "
            "5 s; rising values mean the router TTL is too close to decoder_kv_blocks_ttl or gaps are long.",
            units.PercentUnit, [Target(q.expired_read_ratio(config), "expired / attempted")], width=8))
        .with_panel(timeseries_panel(
            "Missing-metadata ratio by reason",
            "Turns whose previous decode response carried no kv_transfer_params, per eligible turn, "
            "by reason (not_streamed, bidirectional_off_on_decode, aborted, client_disconnected, ...).",
            units.PercentUnit, [Target(q.missing_metadata_ratio_by_reason(config), "{{reason}}")], width=8))
        .with_panel(timeseries_panel(
            "Misses by verdict (share of eligible turns)",
            "For each verdict that did not reuse KV, its share of eligible turns. " + _ELIGIBLE,
            units.PercentUnit, [Target(q.miss_share_by_outcome(config), "{{outcome}}")], width=8,
            stacked=True))
        .with_row(dashboard.Row("Partial reuse (what the prompt is proven to reproduce)"))
        .with_panel(timeseries_panel(
            "Handles cut, by reason (share of turns with a handle)",
            "For each trim reason, the share of turns that found a stored handle and got it cut to the "
            "tokens the prompt is proven to reproduce (or got none). reasoning_stripped, reasoning_hidden "
            "and reply_absent are expected for reasoning models and regenerates; a large share of "
            "tool_call_rerendered, reply_edited, history_reasoning, unverifiable or token_mismatch is a "
            "client or template setup worth fixing (alert KVDiagHandlesMostlyTrimmed).",
            units.PercentUnit, [Target(q.trimmed_share_by_reason(config), "{{reason}}")], width=12,
            stacked=True))
        .with_panel(timeseries_panel(
            "Handle tokens read vs cut",
            "Tokens of D's handles per second the router let P read (offered), and the tokens it cut by "
            "reason: the reply tokens P recomputes because the next prompt does not reproduce them.",
            units.Short,
            [Target(q.offered_tokens_rate(config), "offered to P"),
             Target(q.trimmed_tokens_by_reason(config), "cut: {{reason}}")], width=12))
        .with_row(dashboard.Row("Timing against the TTLs"))
        .with_panel(timeseries_panel(
            "Inter-turn gap vs decode TTL",
            "Quantiles of the gap between a turn's end and the next turn, against D's block TTL "
            "(decoder_kv_blocks_ttl) and the router TTL. Gaps above the decode TTL cannot reuse KV.",
            units.Seconds,
            [Target(q.inter_turn_gap_quantile(config, 0.5), "gap p50"),
             Target(q.inter_turn_gap_quantile(config, 0.95), "gap p95"),
             Target(q.decode_ttl(config), "decoder_kv_blocks_ttl"),
             Target(q.router_ttl(config), "router TTL")], width=12))
        .with_panel(timeseries_panel(
            "Handle age at use vs TTLs",
            "Age of the stored handle when a later turn used it (p50, p95), against the router and decode TTLs.",
            units.Seconds,
            [Target(q.entry_age_quantile(config, 0.5), "age p50"),
             Target(q.entry_age_quantile(config, 0.95), "age p95"),
             Target(q.decode_ttl(config), "decoder_kv_blocks_ttl"),
             Target(q.router_ttl(config), "router TTL")], width=12))
        .with_row(dashboard.Row("Router store"))
        .with_panel(timeseries_panel(
            "Store size",
            "Handles held by the router's conversation store and its LRU capacity, per router instance.",
            units.Short,
            [Target(q.store_entries(config), "entries {{instance}}"),
             Target(q.store_capacity(config), "capacity {{instance}}")], width=12))
        .with_panel(timeseries_panel(
            "Store evictions",
            "Handles dropped per second by reason: capacity (LRU) or ttl (older than the router TTL).",
            units.OpsPerSecond, [Target(q.store_evictions(config), "{{reason}}")], width=12))
    )
