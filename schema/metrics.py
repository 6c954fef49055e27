"""The metric catalog: every kvdiag metric, declared once.

The router's and the connector's Prometheus registries, docs/metrics.md, the dashboards and the
alert rules all read this module. Names are ``kvdiag_*`` with the unit in the name; labels are
bounded enumerations and never carry a conversation or request id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from kvdiag.schema.verdicts import TrimReason, Verdict

MetricType = Literal["counter", "gauge", "histogram", "info"]

TURN_BUCKETS: Final = ("1", "2", "3", "4-7", "8+")
PROMPT_BUCKETS: Final = ("<2k", "2-8k", "8-16k", "16-32k", "32k+")
_PROMPT_EDGES: Final = (2048, 8192, 16384, 32768)

LATENCY_BUCKETS: Final = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                          5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
OVERHEAD_BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
AGE_BUCKETS: Final = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 240.0, 360.0, 420.0, 450.0, 480.0, 600.0, 900.0,
                      1800.0, 3600.0)
BYTES_BUCKETS: Final = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
TRANSFER_BUCKETS: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
TOKEN_BUCKETS: Final = (16.0, 64.0, 256.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0, 65536.0,
                        131072.0)


@dataclass(frozen=True)
class MetricSpec:
    """One metric: exposition name (without ``_total`` for counters), type, unit, labels, help."""

    name: str
    type: MetricType
    help: str
    unit: str = ""
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    component: Literal["router", "connector", "both"] = "router"
    label_values: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def exposed_names(self) -> tuple[str, ...]:
        """Series names as Prometheus shows them."""
        if self.type == "counter":
            return (self.name + "_total",)
        if self.type == "histogram":
            return (self.name + "_bucket", self.name + "_sum", self.name + "_count")
        if self.type == "info":
            return (self.name + "_info",)
        return (self.name,)


_OUTCOMES: Final = tuple(v.value for v in Verdict)
TRIM_REASONS: Final = tuple(r.value for r in TrimReason)
# How the router got the token count of the messages a diverging prompt shares with the previous one.
SHARED_PREFIX_OUTCOMES: Final = ("cached", "tokenized", "failed", "timeout", "unrenderable", "inconsistent")
MISSING_METADATA_REASONS: Final = ("not_streamed", "bidirectional_off_on_decode", "aborted",
                                   "client_disconnected", "decode_failed", "prefill_failed", "unknown")
UPSTREAM_LEGS: Final = ("prefill", "decode")
UPSTREAM_ERROR_KINDS: Final = ("connect", "timeout", "http_5xx", "http_4xx", "malformed", "stream_broken")
EVICTION_REASONS: Final = ("capacity", "ttl")
LOOKUP_RESULTS: Final = ("hit", "miss", "expired", "no_id", "concurrent", "prefix_mismatch", "lost")
# Placement and upstream health (router/placement.py, router/health.py). ``index`` is the instance's
# position in --prefiller-hosts/--decoder-hosts (bounded by the configuration, never a host name).
PLACEMENT_REASONS: Final = ("round_robin", "affinity", "locality", "branch", "least_loaded", "overloaded",
                            "fallback_unhealthy")
EJECTION_REASONS: Final = ("connect", "timeout", "http_5xx", "probe")
READMISSION_TRIGGERS: Final = ("timer", "probe")

CATALOG: Final[tuple[MetricSpec, ...]] = (
    # --- per-turn outcomes (router) ---
    MetricSpec("kvdiag_turns", "counter", "Turns routed, by reuse verdict, turn index and prompt-length bucket.",
               labels=("model", "outcome", "turn_bucket", "prompt_bucket"),
               label_values=(("outcome", _OUTCOMES), ("turn_bucket", TURN_BUCKETS),
                             ("prompt_bucket", PROMPT_BUCKETS))),
    MetricSpec("kvdiag_missing_metadata", "counter",
               "Turns whose decode response carried no kv_transfer_params, by reason.",
               labels=("model", "reason"), label_values=(("reason", MISSING_METADATA_REASONS),)),
    MetricSpec("kvdiag_expired_remote_reads", "counter",
               "Turns whose D->P read was declined or found D's blocks released (expired).",
               labels=("model",)),
    MetricSpec("kvdiag_remote_reads", "counter", "Turns for which P attempted a D->P read.",
               labels=("model",)),
    MetricSpec("kvdiag_transfer_failures", "counter", "D->P NIXL read failures other than expiry, by type.",
               labels=("model", "failure_type")),
    MetricSpec("kvdiag_ttft_seconds", "histogram", "Router-observed time to first token, reused vs recomputed.",
               unit="seconds", labels=("model", "reused"), buckets=LATENCY_BUCKETS,
               label_values=(("reused", ("true", "false")),)),
    MetricSpec("kvdiag_prefill_leg_seconds", "histogram", "Duration of the prefill leg (router to P and back).",
               unit="seconds", labels=("model", "reused"), buckets=LATENCY_BUCKETS),
    MetricSpec("kvdiag_decode_leg_seconds", "histogram", "Duration of the decode leg until the last byte.",
               unit="seconds", labels=("model",), buckets=LATENCY_BUCKETS),
    MetricSpec("kvdiag_router_overhead_seconds", "histogram",
               "Time the router adds to a turn outside the two upstream legs.",
               unit="seconds", labels=("model",), buckets=OVERHEAD_BUCKETS),
    MetricSpec("kvdiag_entry_age_seconds", "histogram", "Age of the stored handle when a later turn used it.",
               unit="seconds", labels=("model",), buckets=AGE_BUCKETS),
    MetricSpec("kvdiag_inter_turn_gap_seconds", "histogram",
               "Time from the end of a turn to the start of the conversation's next turn.",
               unit="seconds", labels=("model",), buckets=AGE_BUCKETS),
    MetricSpec("kvdiag_transfer_bytes", "histogram", "Bytes P read back from D per turn (reported by P).",
               unit="bytes", labels=("model",), buckets=BYTES_BUCKETS),
    MetricSpec("kvdiag_transfer_seconds", "histogram", "Duration of P's D->P read per turn (reported by P).",
               unit="seconds", labels=("model",), buckets=TRANSFER_BUCKETS),
    MetricSpec("kvdiag_prompt_tokens", "counter", "Prompt tokens by how P obtained them.",
               unit="tokens", labels=("model", "source"),
               label_values=(("source", ("local_cache_hit", "remote_read", "computed")),)),
    MetricSpec("kvdiag_reuse_trimmed_tokens", "counter",
               "Tokens of D's handle the router did not let P read (partial reuse), by why.",
               unit="tokens", labels=("model", "reason"), label_values=(("reason", TRIM_REASONS),)),
    MetricSpec("kvdiag_reuse_trimmed_turns", "counter",
               "Turns whose handle the router trimmed to the tokens the prompt is proven to reproduce, by why.",
               labels=("model", "reason"), label_values=(("reason", TRIM_REASONS),)),
    MetricSpec("kvdiag_reuse_decisions", "counter",
               "Turns that found a stored handle, by what the router injected: the full handle, a cut one, "
               "or none.", labels=("model", "reuse"), label_values=(("reuse", ("full", "trimmed", "none")),)),
    MetricSpec("kvdiag_reuse_offered_tokens", "counter",
               "Tokens of D's handles the router let P read (after trimming).",
               unit="tokens", labels=("model",)),
    MetricSpec("kvdiag_reuse_shared_prefix_counts", "counter",
               "Turns diverging from the previous prompt at a message boundary without a token count, by how "
               "the router got the count of the shared messages: cached, tokenized (P's /tokenize), or not "
               "(failed, timeout, unrenderable, inconsistent: reuse fell back to the turn boundaries).",
               labels=("outcome",), label_values=(("outcome", SHARED_PREFIX_OUTCOMES),)),
    MetricSpec("kvdiag_lookups", "counter", "Router handle lookups by result.",
               labels=("result",), label_values=(("result", LOOKUP_RESULTS),)),
    # --- router health ---
    MetricSpec("kvdiag_router_requests", "counter", "Client requests handled by the router.",
               labels=("endpoint", "code")),
    MetricSpec("kvdiag_upstream_errors", "counter", "Errors talking to P or D, by leg and kind.",
               labels=("leg", "kind"),
               label_values=(("leg", UPSTREAM_LEGS), ("kind", UPSTREAM_ERROR_KINDS))),
    # --- placement and upstream health ---
    MetricSpec("kvdiag_placement_decisions", "counter",
               "Where turns were placed: per leg, the reason the instance was chosen and its index.",
               labels=("leg", "reason", "index"),
               label_values=(("leg", UPSTREAM_LEGS), ("reason", PLACEMENT_REASONS))),
    MetricSpec("kvdiag_placement_expected_local_tokens", "counter",
               "Prompt tokens the chosen P or D was expected to hold already (its prefix cache), per leg.",
               unit="tokens", labels=("leg",), label_values=(("leg", UPSTREAM_LEGS),)),
    MetricSpec("kvdiag_upstream_healthy", "gauge",
               "1 while a P or D instance is admitted, 0 while it is ejected after failures.",
               labels=("leg", "index"), label_values=(("leg", UPSTREAM_LEGS),)),
    MetricSpec("kvdiag_upstream_ejections", "counter",
               "Instances ejected after consecutive failures, by leg, index and the last failure's kind.",
               labels=("leg", "index", "reason"),
               label_values=(("leg", UPSTREAM_LEGS), ("reason", EJECTION_REASONS))),
    MetricSpec("kvdiag_upstream_readmissions", "counter",
               "Ejected instances taken back, by leg, index and trigger (ejection time over, or a passing probe).",
               labels=("leg", "index", "trigger"),
               label_values=(("leg", UPSTREAM_LEGS), ("trigger", READMISSION_TRIGGERS))),
    MetricSpec("kvdiag_upstream_in_flight", "gauge", "Requests in flight on each P and D instance.",
               labels=("leg", "index"), label_values=(("leg", UPSTREAM_LEGS),)),
    MetricSpec("kvdiag_upstream_in_flight_prompt_tokens", "gauge",
               "Estimated prompt tokens of the prefill requests in flight on each P instance.",
               unit="tokens", labels=("index",)),
    MetricSpec("kvdiag_concurrent_turns", "counter",
               "Turns that arrived while another turn of the same conversation was in flight."),
    MetricSpec("kvdiag_client_disconnects", "counter", "Client disconnects before the response completed."),
    MetricSpec("kvdiag_in_flight_turns", "gauge", "Turns currently being routed."),
    MetricSpec("kvdiag_store_entries", "gauge", "Handles held by the router's conversation store."),
    MetricSpec("kvdiag_store_capacity", "gauge", "Maximum handles the store holds before LRU eviction."),
    MetricSpec("kvdiag_store_evictions", "counter", "Handles dropped by the store, by reason.",
               labels=("reason",), label_values=(("reason", EVICTION_REASONS),)),
    MetricSpec("kvdiag_store_errors", "counter",
               "Conversation-store operations that failed (the turn went on without reuse), by operation.",
               labels=("op",), label_values=(("op", ("claim", "complete", "release", "size")),)),
    MetricSpec("kvdiag_client_params_dropped", "counter",
               "Requests whose client-supplied kv_transfer_params the router dropped (never trusted)."),
    MetricSpec("kvdiag_router_entry_ttl_seconds", "gauge", "The router's handle TTL.", unit="seconds"),
    MetricSpec("kvdiag_decoder_kv_blocks_ttl_seconds", "gauge",
               "decoder_kv_blocks_ttl the router was configured with (D's block retention).", unit="seconds"),
    MetricSpec("kvdiag_emit_errors", "counter", "Telemetry emit failures (caught; the host is unaffected).",
               labels=("component",), component="both"),
    # --- connector (appear on vLLM's /metrics with model_name and engine) ---
    MetricSpec("kvdiag_connector_requests", "counter", "Requests seen by the instrumented connector, by outcome.",
               labels=("model_name", "engine", "role", "outcome"), component="connector"),
    MetricSpec("kvdiag_connector_remote_read_tokens", "counter", "Tokens P read back from D.",
               unit="tokens", labels=("model_name", "engine"), component="connector"),
    MetricSpec("kvdiag_connector_threshold_skips", "counter",
               "D->P pulls skipped because the remainder was below kv_recompute_threshold.",
               labels=("model_name", "engine"), component="connector"),
    MetricSpec("kvdiag_connector_mismatch_tokens", "counter",
               "Tokens D offered that P's block-hash check found not matching the prompt (not read).",
               unit="tokens", labels=("model_name", "engine"), component="connector"),
    MetricSpec("kvdiag_connector_retained_requests", "gauge", "Finished requests whose blocks D is holding.",
               labels=("model_name", "engine"), component="connector"),
    MetricSpec("kvdiag_connector_released", "counter", "Retained handles released by D, by reason.",
               labels=("model_name", "engine", "reason"), component="connector"),
)

CATALOG_BY_NAME: Final[dict[str, MetricSpec]] = {m.name: m for m in CATALOG}


def metric(name: str) -> MetricSpec:
    """Return the catalog entry ``name``; raise KeyError naming the known metrics."""
    try:
        return CATALOG_BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name!r} is not in the metric catalog (kvdiag.schema.metrics)") from None


def all_exposed_names() -> frozenset[str]:
    """Every series name kvdiag exposes (for PromQL name checks)."""
    return frozenset(n for m in CATALOG for n in m.exposed_names)


def turn_bucket(turn: int) -> str:
    """Map a 1-based turn index to its bounded label value."""
    if turn <= 3:
        return str(max(turn, 1))
    return "4-7" if turn <= 7 else "8+"


def prompt_bucket(tokens: int) -> str:
    """Map a prompt length in tokens to its bounded label value."""
    for edge, label in zip(_PROMPT_EDGES, PROMPT_BUCKETS, strict=False):
        if tokens < edge:
            return label
    return PROMPT_BUCKETS[-1]
