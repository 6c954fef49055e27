"""vLLM's own Prometheus metrics that kvdiag dashboards may chart (docs/vllm-reference.md, metrics).

Only names listed here (or in the kvdiag catalog) may appear in a dashboard or rule expression;
tests/test_dashboards.py fails on any other name, which catches typos and upstream renames.
"""

from __future__ import annotations

from typing import Final, Literal

VllmType = Literal["counter", "gauge", "histogram"]

# (base name, type). prometheus_client adds ``_total`` to counters; histograms expose
# ``_bucket``/``_sum``/``_count``. All carry the labels ``model_name`` and ``engine``.
VLLM_METRICS: Final[tuple[tuple[str, VllmType], ...]] = (
    ("vllm:prefix_cache_queries", "counter"),
    ("vllm:prefix_cache_hits", "counter"),
    ("vllm:external_prefix_cache_queries", "counter"),
    ("vllm:external_prefix_cache_hits", "counter"),
    ("vllm:prompt_tokens_by_source", "counter"),
    ("vllm:prompt_tokens_cached", "counter"),
    ("vllm:prompt_tokens_recomputed", "counter"),
    ("vllm:prompt_tokens", "counter"),
    ("vllm:generation_tokens", "counter"),
    ("vllm:request_prefill_kv_computed_tokens", "histogram"),
    ("vllm:kv_cache_usage_perc", "gauge"),
    ("vllm:num_requests_running", "gauge"),
    ("vllm:num_requests_waiting", "gauge"),
    ("vllm:num_preemptions", "counter"),
    ("vllm:request_success", "counter"),
    ("vllm:time_to_first_token_seconds", "histogram"),
    ("vllm:inter_token_latency_seconds", "histogram"),
    ("vllm:request_time_per_output_token_seconds", "histogram"),
    ("vllm:e2e_request_latency_seconds", "histogram"),
    ("vllm:request_queue_time_seconds", "histogram"),
    ("vllm:request_inference_time_seconds", "histogram"),
    ("vllm:request_prefill_time_seconds", "histogram"),
    ("vllm:request_decode_time_seconds", "histogram"),
    # NIXL connector (nixl/stats.py, NixlPromMetrics). Observations pool every TP rank.
    ("vllm:nixl_xfer_time_seconds", "histogram"),
    ("vllm:nixl_post_time_seconds", "histogram"),
    ("vllm:nixl_bytes_transferred", "histogram"),
    ("vllm:nixl_num_descriptors", "histogram"),
    # Since vLLM 0.33 (PR #55854): failed transfers count transport failures of reads, handshakes and
    # notifications (so failed notifications are a part of them); KV expiry counts apart, on the engine
    # whose held blocks expired or whose read was declined as expiring.
    ("vllm:nixl_num_failed_transfers", "counter"),
    ("vllm:nixl_num_failed_notifications", "counter"),
    ("vllm:nixl_num_kv_expired_reqs", "counter"),
    ("vllm:nixl_num_notifications_after_expiry", "counter"),
)


def vllm_exposed_names() -> frozenset[str]:
    """Every series name the vLLM metrics above expose."""
    names: set[str] = set()
    for name, kind in VLLM_METRICS:
        if kind == "counter":
            names.add(name + "_total")
        elif kind == "histogram":
            names.update((name + "_bucket", name + "_sum", name + "_count"))
        else:
            names.add(name)
    return frozenset(names)
