"""PromQL for the dashboards: one function per query, each a function of the MixinConfig.

Router series are filtered by ``$instance`` (and ``$model`` where the metric has a model label);
engine series by ``$vllm_instance`` and ``model_name=~"$model"``. Rates use ``$__rate_interval``.
"""

from __future__ import annotations

from kvdiag.monitoring.config import ELIGIBLE_OUTCOMES_RE, REUSED_OUTCOMES_RE, MixinConfig

RATE = "$__rate_interval"


def router(config: MixinConfig, *matchers: str, model: bool = True) -> str:
    """Selector body for a router series: job selector, ``$instance``, optionally ``$model``, extras."""
    parts = [config.router_selector, 'instance=~"$instance"']
    if model:
        parts.append('model=~"$model"')
    parts.extend(matchers)
    return "{" + ", ".join(parts) + "}"


def engine(config: MixinConfig, *matchers: str) -> str:
    """Selector body for a vLLM engine series."""
    parts = [config.vllm_selector, 'instance=~"$vllm_instance"', 'model_name=~"$model"', *matchers]
    return "{" + ", ".join(parts) + "}"


def quantile(q: float, series: str, by: str = "") -> str:
    """``histogram_quantile`` over a ``*_bucket`` selector, keeping the ``by`` labels."""
    labels = ", ".join(["le", *[b.strip() for b in by.split(",") if b.strip()]])
    return f"histogram_quantile({q}, sum by ({labels}) (rate({series}[{RATE}])))"


def mean(name: str, selector: str, by: str = "") -> str:
    """Mean of a histogram: rate of ``_sum`` over rate of ``_count``."""
    grouping = f" by ({by})" if by else ""
    return (f"sum{grouping} (rate({name}_sum{selector}[{RATE}])) / "
            f"sum{grouping} (rate({name}_count{selector}[{RATE}]))")


# --- KV reuse ---

def turn_rate_by_outcome(c: MixinConfig) -> str:
    """Turns per second by reuse verdict."""
    return f"sum by (outcome) (rate(kvdiag_turns_total{router(c)}[{RATE}]))"


def reuse_ratio(c: MixinConfig, by: str = "") -> str:
    """Share of eligible turns that reused KV (remote or local hit), optionally by a label."""
    grouping = f" by ({by})" if by else ""
    reused = router(c, f'outcome=~"{REUSED_OUTCOMES_RE}"')
    eligible = router(c, f'outcome=~"{ELIGIBLE_OUTCOMES_RE}"')
    return (f"sum{grouping} (rate(kvdiag_turns_total{reused}[{RATE}])) / "
            f"sum{grouping} (rate(kvdiag_turns_total{eligible}[{RATE}]))")


def ttft_quantile(c: MixinConfig, q: float) -> str:
    """Router-observed TTFT quantile, reused vs recomputed turns."""
    return quantile(q, f"kvdiag_ttft_seconds_bucket{router(c)}", by="reused")


def expired_read_ratio(c: MixinConfig) -> str:
    """Share of attempted D->P reads that found D's blocks expired or were declined as expiring."""
    return (f"sum(rate(kvdiag_expired_remote_reads_total{router(c)}[{RATE}])) / "
            f"sum(rate(kvdiag_remote_reads_total{router(c)}[{RATE}]))")


def missing_metadata_ratio_by_reason(c: MixinConfig) -> str:
    """Missing-``kv_transfer_params`` turns per eligible turn, by reason."""
    eligible = router(c, f'outcome=~"{ELIGIBLE_OUTCOMES_RE}"')
    return (f"sum by (reason) (rate(kvdiag_missing_metadata_total{router(c)}[{RATE}])) / on () group_left () "
            f"sum(rate(kvdiag_turns_total{eligible}[{RATE}]))")


def miss_share_by_outcome(c: MixinConfig) -> str:
    """Share of eligible turns per non-reuse verdict (the reasons turns miss)."""
    eligible = router(c, f'outcome=~"{ELIGIBLE_OUTCOMES_RE}"')
    misses = router(c, f'outcome=~"{ELIGIBLE_OUTCOMES_RE}"', f'outcome!~"{REUSED_OUTCOMES_RE}"')
    return (f"sum by (outcome) (rate(kvdiag_turns_total{misses}[{RATE}])) / on () group_left () "
            f"sum(rate(kvdiag_turns_total{eligible}[{RATE}]))")


def trimmed_tokens_by_reason(c: MixinConfig) -> str:
    """Tokens of D's handles per second the router did not let P read, by trim reason."""
    return f"sum by (reason) (rate(kvdiag_reuse_trimmed_tokens_total{router(c)}[{RATE}]))"


def offered_tokens_rate(c: MixinConfig) -> str:
    """Tokens of D's handles per second the router let P read."""
    return f"sum(rate(kvdiag_reuse_offered_tokens_total{router(c)}[{RATE}]))"


def trimmed_share_by_reason(c: MixinConfig) -> str:
    """Per trim reason, its share of the turns that found a stored handle."""
    return (f"sum by (reason) (rate(kvdiag_reuse_trimmed_turns_total{router(c)}[{RATE}])) / on () group_left () "
            f"sum(rate(kvdiag_reuse_decisions_total{router(c)}[{RATE}]))")


def inter_turn_gap_quantile(c: MixinConfig, q: float) -> str:
    """Quantile of the gap between a turn's end and the conversation's next turn."""
    return quantile(q, f"kvdiag_inter_turn_gap_seconds_bucket{router(c)}")


def decode_ttl(c: MixinConfig) -> str:
    """D's block retention (decoder_kv_blocks_ttl) as the router was configured."""
    return f"max(kvdiag_decoder_kv_blocks_ttl_seconds{router(c, model=False)})"


def router_ttl(c: MixinConfig) -> str:
    """The router's handle TTL."""
    return f"max(kvdiag_router_entry_ttl_seconds{router(c, model=False)})"


def entry_age_quantile(c: MixinConfig, q: float) -> str:
    """Quantile of the stored handle's age when a later turn used it."""
    return quantile(q, f"kvdiag_entry_age_seconds_bucket{router(c)}")


def store_entries(c: MixinConfig) -> str:
    """Handles held by the router's store, per router instance."""
    return f"sum by (instance) (kvdiag_store_entries{router(c, model=False)})"


def store_capacity(c: MixinConfig) -> str:
    """The store's LRU capacity, per router instance."""
    return f"max by (instance) (kvdiag_store_capacity{router(c, model=False)})"


def store_evictions(c: MixinConfig) -> str:
    """Handles dropped by the store per second, by reason."""
    return f"sum by (reason) (rate(kvdiag_store_evictions_total{router(c, model=False)}[{RATE}]))"


# --- KV transfer ---

def transfer_bytes_quantile(c: MixinConfig, q: float) -> str:
    """Quantile of D->P bytes per turn (P's report)."""
    return quantile(q, f"kvdiag_transfer_bytes_bucket{router(c)}")


def transfer_bytes_mean(c: MixinConfig) -> str:
    """Mean D->P bytes per turn."""
    return mean("kvdiag_transfer_bytes", router(c))


def transfer_seconds_quantile(c: MixinConfig, q: float) -> str:
    """Quantile of D->P read seconds per turn."""
    return quantile(q, f"kvdiag_transfer_seconds_bucket{router(c)}")


def effective_bandwidth(c: MixinConfig) -> str:
    """Bytes moved per second of D->P read time (not per wall-clock second)."""
    return (f"sum(rate(kvdiag_transfer_bytes_sum{router(c)}[{RATE}])) / "
            f"sum(rate(kvdiag_transfer_seconds_sum{router(c)}[{RATE}]))")


def transfer_failures_by_type(c: MixinConfig) -> str:
    """D->P read failures per second by failure_type."""
    return f"sum by (failure_type) (rate(kvdiag_transfer_failures_total{router(c)}[{RATE}]))"


def expired_reads_rate(c: MixinConfig) -> str:
    """Expired D->P reads per second."""
    return f"sum(rate(kvdiag_expired_remote_reads_total{router(c)}[{RATE}]))"


def prompt_tokens_by_source(c: MixinConfig) -> str:
    """Prompt tokens per second by how P obtained them (router's view of P's report)."""
    return f"sum by (source) (rate(kvdiag_prompt_tokens_total{router(c)}[{RATE}]))"


def vllm_xfer_time_quantile(c: MixinConfig, q: float) -> str:
    """vLLM NIXL transfer time quantile (rank-level transfers)."""
    return quantile(q, f"vllm:nixl_xfer_time_seconds_bucket{engine(c)}", by="instance")


def vllm_bytes_per_transfer(c: MixinConfig) -> str:
    """vLLM NIXL mean bytes per rank-level transfer."""
    return mean("vllm:nixl_bytes_transferred", engine(c), by="instance")


def vllm_nixl_failures(c: MixinConfig) -> str:
    """vLLM NIXL transport failures per second, per engine (reads, handshakes and notifications; no expiry)."""
    return f"sum by (instance) (rate(vllm:nixl_num_failed_transfers_total{engine(c)}[{RATE}]))"


def vllm_nixl_failed_notifications(c: MixinConfig) -> str:
    """vLLM NIXL failed notifications per second, per engine (a part of the failed transfers)."""
    return f"sum by (instance) (rate(vllm:nixl_num_failed_notifications_total{engine(c)}[{RATE}]))"


def vllm_nixl_expired(c: MixinConfig) -> str:
    """vLLM's expired-KV request counter per second, per engine (P: declined reads; D: held blocks at TTL)."""
    return f"sum by (instance) (rate(vllm:nixl_num_kv_expired_reqs_total{engine(c)}[{RATE}]))"


def vllm_nixl_notifications_after_expiry(c: MixinConfig) -> str:
    """vLLM's read-completion notifications for requests no longer held, per second and engine."""
    return f"sum by (instance) (rate(vllm:nixl_num_notifications_after_expiry_total{engine(c)}[{RATE}]))"


def vllm_prompt_tokens_by_source(c: MixinConfig) -> str:
    """vLLM's prompt tokens per second by source, per engine."""
    return f"sum by (instance, source) (rate(vllm:prompt_tokens_by_source_total{engine(c)}[{RATE}]))"


def vllm_external_hit_ratio(c: MixinConfig) -> str:
    """vLLM's external (connector) prefix-cache hit ratio, per engine."""
    return (f"sum by (instance) (rate(vllm:external_prefix_cache_hits_total{engine(c)}[{RATE}])) / "
            f"sum by (instance) (rate(vllm:external_prefix_cache_queries_total{engine(c)}[{RATE}]))")


# --- Router health ---

# Scrapes and health checks are counted too; the traffic panels leave them out.
_NOT_MONITORING = 'endpoint!~"metrics|health"'


def request_rate_by_code(c: MixinConfig) -> str:
    """Client requests per second by HTTP status code (without /metrics and /health)."""
    return f"sum by (code) (rate(kvdiag_router_requests_total{router(c, _NOT_MONITORING, model=False)}[{RATE}]))"


def error_ratio(c: MixinConfig) -> str:
    """Share of client requests answered with a 5xx."""
    errors = router(c, _NOT_MONITORING, 'code=~"5.."', model=False)
    return (f"sum(rate(kvdiag_router_requests_total{errors}[{RATE}])) / "
            f"sum(rate(kvdiag_router_requests_total{router(c, _NOT_MONITORING, model=False)}[{RATE}]))")


def upstream_errors(c: MixinConfig) -> str:
    """Errors talking to P or D per second, by leg and kind."""
    return f"sum by (leg, kind) (rate(kvdiag_upstream_errors_total{router(c, model=False)}[{RATE}]))"


def overhead_quantile(c: MixinConfig, q: float) -> str:
    """Quantile of the time the router adds outside the two upstream legs."""
    return quantile(q, f"kvdiag_router_overhead_seconds_bucket{router(c)}")


def prefill_leg_quantile(c: MixinConfig, q: float) -> str:
    """Quantile of the prefill leg, reused vs recomputed."""
    return quantile(q, f"kvdiag_prefill_leg_seconds_bucket{router(c)}", by="reused")


def decode_leg_quantile(c: MixinConfig, q: float) -> str:
    """Quantile of the decode leg."""
    return quantile(q, f"kvdiag_decode_leg_seconds_bucket{router(c)}")


def placement_rate_by_reason(c: MixinConfig) -> str:
    """Placement decisions per second, by leg and the reason the instance was chosen."""
    return f"sum by (leg, reason) (rate(kvdiag_placement_decisions_total{router(c, model=False)}[{RATE}]))"


def upstream_healthy(c: MixinConfig) -> str:
    """1 while a P or D instance is admitted, 0 while ejected (the lowest over router replicas), by leg and index."""
    return f"min by (leg, index) (kvdiag_upstream_healthy{router(c, model=False)})"


def upstream_in_flight(c: MixinConfig) -> str:
    """Requests in flight on each P and D instance, summed over router replicas."""
    return f"sum by (leg, index) (kvdiag_upstream_in_flight{router(c, model=False)})"


def in_flight_turns(c: MixinConfig) -> str:
    """Turns being routed right now."""
    return f"sum by (instance) (kvdiag_in_flight_turns{router(c, model=False)})"


def concurrent_turn_rate(c: MixinConfig) -> str:
    """Turns per second that arrived while the conversation had another turn in flight."""
    return f"sum(rate(kvdiag_concurrent_turns_total{router(c, model=False)}[{RATE}]))"


def disconnect_rate(c: MixinConfig) -> str:
    """Client disconnects per second."""
    return f"sum(rate(kvdiag_client_disconnects_total{router(c, model=False)}[{RATE}]))"


def lookups_by_result(c: MixinConfig) -> str:
    """Handle lookups per second by result."""
    return f"sum by (result) (rate(kvdiag_lookups_total{router(c, model=False)}[{RATE}]))"



# --- kvdiag connector (instrumented engines, on vLLM's /metrics) ---

def connector_retained(c: MixinConfig) -> str:
    """Finished requests whose blocks D holds for the next turn, per engine."""
    return f"sum by (instance) (kvdiag_connector_retained_requests{engine(c)})"


def vllm_kv_cache_usage(c: MixinConfig) -> str:
    """vLLM's KV-cache usage per engine (1 = full)."""
    return f"max by (instance) (vllm:kv_cache_usage_perc{engine(c)})"


def connector_released(c: MixinConfig) -> str:
    """Retained handles D released per second, by reason (read, expired, evicted, ...)."""
    return f"sum by (reason) (rate(kvdiag_connector_released_total{engine(c)}[{RATE}]))"


def connector_requests(c: MixinConfig) -> str:
    """Requests seen by the instrumented connector per second, by role and outcome."""
    return f"sum by (role, outcome) (rate(kvdiag_connector_requests_total{engine(c)}[{RATE}]))"
