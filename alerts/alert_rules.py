"""kvdiag's Prometheus alert rules as data: one function per alert, each a function of the MixinConfig.

Every alert has a rate floor (so a handful of turns cannot page anyone), a ``for:``, a severity
(``critical``: reuse is off entirely; ``warning``: a share of turns loses reuse or a setting is
wrong; ``info``: reuse works but does not pay), a summary, a description and a ``runbook_url``
into docs/runbooks.md. tests/promtool/ holds a firing and a not-yet-firing case for each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvdiag.monitoring.config import ELIGIBLE_OUTCOMES_RE, MixinConfig
from kvdiag.schema.verdicts import ELIGIBLE_VERDICTS, FIXABLE_TRIM_REASONS, Verdict

Severity = Literal["critical", "warning", "info"]

# Later turns on which P should have attempted a D->P read: eligible, minus the verdicts where
# P legitimately did not read (its own cache had it, or the remainder was below the threshold).
READ_EXPECTED_OUTCOMES_RE = "|".join(sorted(
    v.value for v in ELIGIBLE_VERDICTS if v not in (Verdict.LOCAL_HIT, Verdict.BELOW_THRESHOLD)))


@dataclass(frozen=True)
class AlertRule:
    """One Prometheus alerting rule."""

    name: str
    group: str
    expr: str
    for_: str
    severity: Severity
    summary: str
    description: str

    def to_dict(self, config: MixinConfig) -> dict[str, Any]:
        """The rule as it appears in a Prometheus rule file."""
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {"summary": self.summary, "description": self.description,
                            "runbook_url": config.runbook_url(self.name)},
        }


def _sel(config: MixinConfig, *matchers: str) -> str:
    return "{" + ", ".join([config.router_selector, *matchers]) + "}"


def _rate(config: MixinConfig, series: str, by: str, *matchers: str) -> str:
    return f"sum by ({by}) (rate({series}{_sel(config, *matchers)}[{config.rate_window}]))"


def expired_remote_read_ratio_high(c: MixinConfig) -> AlertRule:
    """D->P reads find D's blocks expired: the router TTL or the inter-turn gaps are too close to D's TTL."""
    reads = _rate(c, "kvdiag_remote_reads_total", "job, model")
    return AlertRule(
        "KVDiagExpiredRemoteReadRatioHigh", "kvdiag-reuse",
        f"({_rate(c, 'kvdiag_expired_remote_reads_total', 'job, model')} / {reads}) "
        f"> {c.expired_read_ratio_warning} and {reads} > {c.min_remote_read_rate}",
        c.for_ratio, "warning",
        "D->P KV reads are expiring for model {{ $labels.model }}.",
        "{{ $value | humanizePercentage }} of D->P reads for model {{ $labels.model }} (job {{ $labels.job }}) "
        f"found the decode node's blocks released or about to expire over the last {c.rate_window} "
        f"(threshold {c.expired_read_ratio_warning:.0%}). Those turns recompute their history on P. vLLM "
        "counts these declines in vllm:nixl_num_kv_expired_reqs on P, apart from vllm:nixl_num_failed_transfers.",
    )


def missing_metadata_ratio_high(c: MixinConfig) -> AlertRule:
    """Decode responses come back without kv_transfer_params, so the next turn has nothing to hand P."""
    eligible = _rate(c, "kvdiag_turns_total", "job, model", f'outcome=~"{ELIGIBLE_OUTCOMES_RE}"')
    return AlertRule(
        "KVDiagMissingMetadataRatioHigh", "kvdiag-reuse",
        f"({_rate(c, 'kvdiag_missing_metadata_total', 'job, model')} / {eligible}) "
        f"> {c.missing_metadata_ratio_warning} and {eligible} > {c.min_eligible_turn_rate}",
        c.for_ratio, "warning",
        "Decode responses lack kv_transfer_params for model {{ $labels.model }}.",
        "{{ $value | humanizePercentage }} of eligible turns for model {{ $labels.model }} "
        "(job {{ $labels.job }}) had no kv_transfer_params from the previous decode response over the last "
        f"{c.rate_window} (threshold {c.missing_metadata_ratio_warning:.0%}). The reason label of "
        "kvdiag_missing_metadata_total says why.",
    )


def bidirectional_reuse_off(c: MixinConfig) -> AlertRule:
    """Multi-turn traffic flows but P never reads from D: the feature is silently off somewhere."""
    later = _rate(c, "kvdiag_turns_total", "job, model", f'outcome=~"{READ_EXPECTED_OUTCOMES_RE}"')
    reads = _rate(c, "kvdiag_remote_reads_total", "job, model")
    return AlertRule(
        "KVDiagBidirectionalReuseOff", "kvdiag-reuse",
        f"{later} > {c.min_eligible_turn_rate} unless {reads} > 0",
        c.for_silent, "critical",
        "Multi-turn traffic but no D->P KV reads for model {{ $labels.model }}.",
        "Model {{ $labels.model }} (job {{ $labels.job }}) serves {{ $value | humanize }} later turns per "
        f"second that should read KV back from the decode node, but P attempted no D->P read for {c.for_silent}. "
        "Bidirectional KV transfer is silently off: conversation ids, bidirectional_kv_xfer on P and D, "
        "streamed kv_transfer_params or the router state.",
    )


def router_ttl_not_below_decode_ttl(c: MixinConfig) -> AlertRule:
    """The router keeps handles longer than D keeps the blocks (minus P's decline margin)."""
    traffic = _rate(c, "kvdiag_turns_total", "job, instance")
    return AlertRule(
        "KVDiagRouterTTLNotBelowDecodeTTL", "kvdiag-reuse",
        f"max by (job, instance) (kvdiag_router_entry_ttl_seconds{_sel(c)}) "
        f"> on (job, instance) (max by (job, instance) (kvdiag_decoder_kv_blocks_ttl_seconds{_sel(c)}) "
        f"- {c.ttl_margin_seconds:g}) and on (job, instance) {traffic} > 0",
        c.for_config, "warning",
        "Router TTL is not below the decode block TTL on {{ $labels.instance }}.",
        "Router {{ $labels.instance }} (job {{ $labels.job }}) keeps handles for {{ $value | humanizeDuration }}, "
        f"more than decoder_kv_blocks_ttl minus {c.ttl_margin_seconds:g} s. Turns arriving in between are handed "
        "to P with blocks D has released or is about to release: expired remote reads.",
    )


def transfer_failure_ratio_high(c: MixinConfig) -> AlertRule:
    """D->P NIXL reads fail for reasons other than expiry."""
    reads = _rate(c, "kvdiag_remote_reads_total", "job, model")
    return AlertRule(
        "KVDiagTransferFailureRatioHigh", "kvdiag-transfer",
        f"({_rate(c, 'kvdiag_transfer_failures_total', 'job, model')} / {reads}) "
        f"> {c.transfer_failure_ratio_warning} and {reads} > {c.min_remote_read_rate}",
        c.for_ratio, "warning",
        "D->P KV transfers are failing for model {{ $labels.model }}.",
        "{{ $value | humanizePercentage }} of D->P reads for model {{ $labels.model }} (job {{ $labels.job }}) "
        f"failed for a reason other than expiry over the last {c.rate_window} "
        f"(threshold {c.transfer_failure_ratio_warning:.0%}). See failure_type on kvdiag_transfer_failures_total.",
    )


def transfer_slower_than_recompute(c: MixinConfig) -> AlertRule:
    """A token read from D costs more time than a token P computes: the transfer does not pay."""
    read_tokens = _rate(c, "kvdiag_prompt_tokens_total", "job, model", 'source="remote_read"')
    computed_tokens = _rate(c, "kvdiag_prompt_tokens_total", "job, model", 'source="computed"')
    read_seconds = _rate(c, "kvdiag_transfer_seconds_sum", "job, model")
    prefill_seconds = _rate(c, "kvdiag_prefill_leg_seconds_sum", "job, model")
    transfer_cost = f"{read_seconds} / {read_tokens}"
    # Prefill-leg time minus read time, per computed token: an upper bound on compute cost per
    # token (it also holds queueing and network), so the alert errs towards staying quiet.
    compute_cost = f"({prefill_seconds} - {read_seconds}) / {computed_tokens}"
    reads = _rate(c, "kvdiag_remote_reads_total", "job, model")
    return AlertRule(
        "KVDiagTransferSlowerThanRecompute", "kvdiag-transfer",
        f"({transfer_cost}) > ({compute_cost}) and {reads} > {c.min_remote_read_rate}",
        c.for_ratio, "info",
        "D->P KV transfer is slower than recomputing for model {{ $labels.model }}.",
        "Reading a token's KV from the decode node takes {{ $value | humanizeDuration }} for model "
        "{{ $labels.model }} (job {{ $labels.job }}), more than P spends computing a prompt token "
        f"over the last {c.rate_window}. Bidirectional reuse costs latency instead of saving it.",
    )


FIXABLE_TRIM_REASONS_RE = "|".join(sorted(r.value for r in FIXABLE_TRIM_REASONS))


def handles_mostly_trimmed(c: MixinConfig) -> AlertRule:
    """Most stored handles are cut for a reason a client or template setting could remove."""
    decisions = _rate(c, "kvdiag_reuse_decisions_total", "job, model")
    cut = _rate(c, "kvdiag_reuse_trimmed_turns_total", "job, model, reason", f'reason=~"{FIXABLE_TRIM_REASONS_RE}"')
    return AlertRule(
        "KVDiagHandlesMostlyTrimmed", "kvdiag-reuse",
        f"({cut} / on (job, model) group_left () {decisions}) > {c.trimmed_share_warning} "
        f"and on (job, model) {decisions} > {c.min_eligible_turn_rate}",
        c.for_ratio, "warning",
        "Most KV handles for model {{ $labels.model }} are cut: {{ $labels.reason }}.",
        "{{ $value | humanizePercentage }} of the turns that found a stored handle for model {{ $labels.model }} "
        "(job {{ $labels.job }}) had it cut or dropped for reason {{ $labels.reason }} over the last "
        f"{c.rate_window} (threshold {c.trimmed_share_warning:.0%}): P recomputes D's reply tokens the "
        "prompt does not reproduce. The runbook names the client or template change for each reason.",
    )


def router_store_near_capacity(c: MixinConfig) -> AlertRule:
    """The router's handle store is nearly full: LRU eviction will drop live conversations."""
    traffic = _rate(c, "kvdiag_turns_total", "job, instance")
    return AlertRule(
        "KVDiagRouterStoreNearCapacity", "kvdiag-router",
        f"(max by (job, instance) (kvdiag_store_entries{_sel(c)}) / on (job, instance) "
        f"max by (job, instance) (kvdiag_store_capacity{_sel(c)})) > {c.store_fill_ratio_warning} "
        f"and on (job, instance) {traffic} > {c.min_eligible_turn_rate}",
        c.for_ratio, "warning",
        "Router store on {{ $labels.instance }} is near capacity.",
        "The conversation store of router {{ $labels.instance }} (job {{ $labels.job }}) is "
        "{{ $value | humanizePercentage }} full (threshold "
        f"{c.store_fill_ratio_warning:.0%}). New handles evict the least recently used conversations, "
        "whose next turns then recompute (verdict router_state_lost).",
    )


ALERTS = (
    expired_remote_read_ratio_high,
    missing_metadata_ratio_high,
    bidirectional_reuse_off,
    router_ttl_not_below_decode_ttl,
    transfer_failure_ratio_high,
    transfer_slower_than_recompute,
    handles_mostly_trimmed,
    router_store_near_capacity,
)


def alert_rules(config: MixinConfig) -> list[AlertRule]:
    """Every kvdiag alert for ``config``."""
    return [make(config) for make in ALERTS]


def rule_file(config: MixinConfig) -> dict[str, Any]:
    """The Prometheus rule file content (``groups:``), groups and rules in a stable order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for rule in alert_rules(config):
        groups.setdefault(rule.group, []).append(rule.to_dict(config))
    return {"groups": [{"name": name, "rules": rules} for name, rules in groups.items()]}
