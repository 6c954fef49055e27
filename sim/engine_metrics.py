"""The ``vllm:`` Prometheus metrics an emulated engine exposes (vLLM's names, types and buckets), plus the oracle."""

from __future__ import annotations

from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvdiag.exporters.prometheus import CatalogMetrics

TTFT_BUCKETS: Final = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_LATENCY_BUCKETS: Final = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                  120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS: Final = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
XFER_TIME_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
POST_TIME_BUCKETS: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
BYTES_BUCKETS: Final = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
DESCRIPTOR_BUCKETS: Final = (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000)
FINISHED_REASONS: Final = ("stop", "length", "abort", "error")
PROMPT_SOURCES: Final = ("local_compute", "local_cache_hit", "external_kv_transfer")
WRONG_KV_SOURCES: Final = ("remote_read", "local_hit")
WRONG_KV_METRIC: Final = "kvdiag_sim_wrong_kv_tokens"


class VllmMetrics:
    """One engine's ``vllm:`` series (labels ``model_name``, ``engine``), plus kvdiag's connector series."""

    def __init__(self, model_name: str, instrumented: bool, engine: str = "0") -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self._lv = {"model_name": model_name, "engine": engine}
        r = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(name, doc, labels + list(extra), registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(**self._lv)

        lv = self._lv
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number "
                                            "of queried tokens.").labels(**lv)
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of "
                                         "cached tokens.").labels(**lv)
        self.external_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance "
            "cache sharing, in terms of number of queried tokens.").labels(**lv)
        self.external_prefix_cache_hits = counter(
            "vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache "
            "sharing, in terms of number of cached tokens.").labels(**lv)
        by_source = counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ("source",))
        self.prompt_tokens_by_source = {s: by_source.labels(source=s, **lv) for s in PROMPT_SOURCES}
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(**lv)
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed."
                                         ).labels(**lv)
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens "
                                            "(local prefix cache + external KV transfer).").labels(**lv)
        self.prompt_tokens_recomputed = counter("vllm:prompt_tokens_recomputed", "Number of cached tokens that were "
                                                "recomputed.").labels(**lv)
        success = counter("vllm:request_success", "Count of successfully processed requests.", ("finished_reason",))
        self.request_success = {f: success.labels(finished_reason=f, **lv) for f in FINISHED_REASONS}
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine."
                                       ).labels(**lv)
        self.kv_cache_usage_perc = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                         labels, registry=r).labels(**lv)
        self.num_requests_running = Gauge("vllm:num_requests_running", "Number of requests in model execution "
                                          "batches.", labels, registry=r).labels(**lv)
        self.num_requests_waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                          labels, registry=r).labels(**lv)
        self.request_prefill_kv_computed_tokens = hist(
            "vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed during prefill "
            "(excluding cached tokens).", TOKEN_BUCKETS)
        self.time_to_first_token = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in "
                                        "seconds.", TTFT_BUCKETS)
        self.e2e_request_latency = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in "
                                        "seconds.", REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = hist("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL "
                                         "phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = hist("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE "
                                        "phase for request.", REQUEST_LATENCY_BUCKETS)
        self.nixl_xfer_time = hist("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV "
                                   "Cache transfers.", XFER_TIME_BUCKETS)
        self.nixl_post_time = hist("vllm:nixl_post_time_seconds", "Histogram of transfer post time for NIXL KV "
                                   "Cache transfers.", POST_TIME_BUCKETS)
        self.nixl_bytes_transferred = hist("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL "
                                           "KV Cache transfers.", BYTES_BUCKETS)
        self.nixl_num_descriptors = hist("vllm:nixl_num_descriptors", "Histogram of number of descriptors per NIXL  "
                                         "KV Cache transfers.", DESCRIPTOR_BUCKETS)
        # vLLM 0.33: handshake and notification failures count as failed transfers too; expiry apart.
        self.nixl_num_failed_transfers = counter(
            "vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers, including handshake and "
            "notification failures. NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs."
            ).labels(**lv)
        self.nixl_num_failed_notifications = counter(
            "vllm:nixl_num_failed_notifications", "Number of failed NIXL KV Cache notifications. Retained for "
            "compatibility; these failures are also included in vllm:nixl_num_failed_transfers.").labels(**lv)
        self.nixl_num_kv_expired_reqs = counter("vllm:nixl_num_kv_expired_reqs", "Number of requests that had their "
                                                "KV expire. NOTE: This metric is tracked on the P instance."
                                                ).labels(**lv)
        self.nixl_num_notifications_after_expiry = counter(
            "vllm:nixl_num_notifications_after_expiry", "Number of completion notifications for requests that were "
            "no longer tracked, usually because their KV lease expired. The KV blocks may have been reused before "
            "the transfer finished. Counted per notification (one per remote rank), not per request.").labels(**lv)
        # The testbed's oracle (both modes; not a vLLM series): prompt positions whose loaded KV was
        # computed for other token ids, from a remote read or from prefix-cache blocks loaded wrong earlier.
        wrong = counter(WRONG_KV_METRIC, "Sim oracle: prompt tokens whose loaded KV was computed for other token "
                        "ids (must stay 0).", ("source",))
        self.wrong_kv_tokens = {s: wrong.labels(source=s, **lv) for s in WRONG_KV_SOURCES}
        self.catalog: CatalogMetrics | None = (
            CatalogMetrics(self.registry, component="connector") if instrumented else None)

    def connector(self, name: str, **labels: str) -> Any:
        """A kvdiag connector series (instrumented mode), or None in stock mode."""
        if self.catalog is None:
            return None
        return self.catalog.labels(name, model_name=self._lv["model_name"], engine=self._lv["engine"], **labels)
