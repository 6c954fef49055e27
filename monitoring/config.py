"""Every knob of the kvdiag dashboards and alert rules, in one frozen config both import.

The selectors, windows and thresholds live here and nowhere else: queries, panels and rules are
functions of a :class:`MixinConfig`. Required fields (the two job selectors and the runbook base
URL) have no default, so a config that forgets one fails when it is built, not in production.

Usage::

    config = MixinConfig(router_selector='job="kvdiag-router"', vllm_selector='job="vllm"',
                         runbook_base_url="https://example.org/docs/runbooks.md")
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from kvdiag.schema.errors import KVDiagError
from kvdiag.schema.verdicts import ELIGIBLE_VERDICTS, REUSED_VERDICTS

_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d))+$")


class MonitoringConfigError(KVDiagError, ValueError):
    """A dashboards/alerts setting is invalid (a MixinConfig field, a Kubernetes name or label); the message
    names the field and the fix."""


@dataclass(frozen=True)
class MixinConfig:
    """Selectors, UIDs, alert windows, floors and thresholds for dashboards and rules."""

    # Label matchers (without braces) selecting the router's and the engines' scrape jobs.
    router_selector: str
    vllm_selector: str
    # runbook_url of every alert is ``<runbook_base_url>#<alertname lowercased>``.
    runbook_base_url: str
    dashboard_tag: str = "kvdiag"
    dashboard_refresh: str = "30s"
    dashboard_uid_prefix: str = "kvdiag"
    # Alert evaluation: the rate window and the ``for:`` durations.
    rate_window: str = "10m"
    for_ratio: str = "10m"
    for_silent: str = "15m"
    for_config: str = "5m"
    # Rate floors (per second): below them a ratio is noise and the alert stays quiet.
    min_eligible_turn_rate: float = 0.05
    min_remote_read_rate: float = 0.02
    # Thresholds.
    expired_read_ratio_warning: float = 0.05
    missing_metadata_ratio_warning: float = 0.10
    transfer_failure_ratio_warning: float = 0.05
    store_fill_ratio_warning: float = 0.90
    trimmed_share_warning: float = 0.50
    # P declines a D->P read whose blocks expire within this margin (vLLM pull_worker: 5 s).
    ttl_margin_seconds: float = 5.0

    def __post_init__(self) -> None:
        for name in ("router_selector", "vllm_selector", "runbook_base_url"):
            if not getattr(self, name).strip():
                raise MonitoringConfigError(f"MixinConfig.{name} must not be empty; pass e.g. "
                                  f"{_EXAMPLES[name]!r}")
        for name in ("router_selector", "vllm_selector"):
            value = getattr(self, name)
            if "{" in value or "}" in value:
                raise MonitoringConfigError(f"MixinConfig.{name}={value!r}: give the matchers without braces, "
                                  f"e.g. {_EXAMPLES[name]!r}")
        for name in ("rate_window", "for_ratio", "for_silent", "for_config"):
            if not _DURATION.match(getattr(self, name)):
                raise MonitoringConfigError(f"MixinConfig.{name}={getattr(self, name)!r} is not a Prometheus duration "
                                  "(e.g. '10m', '30s')")
        for name in ("expired_read_ratio_warning", "missing_metadata_ratio_warning",
                     "transfer_failure_ratio_warning", "store_fill_ratio_warning"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise MonitoringConfigError(f"MixinConfig.{name}={getattr(self, name)!r} must be a ratio in (0, 1)")
        for name in ("min_eligible_turn_rate", "min_remote_read_rate", "ttl_margin_seconds"):
            if getattr(self, name) < 0:
                raise MonitoringConfigError(f"MixinConfig.{name} must be >= 0")

    def dashboard_uid(self, file_stem: str) -> str:
        """Stable UID from the dashboard's file name, as the kubernetes-mixin derives it with md5."""
        digest = hashlib.md5(f"{self.dashboard_uid_prefix}/{file_stem}".encode(), usedforsecurity=False)
        return f"{self.dashboard_uid_prefix}-{digest.hexdigest()[:12]}"

    def runbook_url(self, alertname: str) -> str:
        """The runbook anchor for ``alertname`` (docs/runbooks.md has one heading per alert)."""
        return f"{self.runbook_base_url}#{alertname.lower()}"


_EXAMPLES = {
    "router_selector": 'job="kvdiag-router"',
    "vllm_selector": 'job="vllm"',
    # The committed rule file links the runbooks shipped in this repository (docs/runbooks.md);
    # `kvdiag alerts export --runbook-base-url URL` points them at where you publish them.
    "runbook_base_url": "docs/runbooks.md",
}

DEFAULT_CONFIG = MixinConfig(
    router_selector=_EXAMPLES["router_selector"],
    vllm_selector=_EXAMPLES["vllm_selector"],
    runbook_base_url=_EXAMPLES["runbook_base_url"],
)

# Outcomes as PromQL regex alternations, derived from schema/verdicts.py (never restated by hand).
REUSED_OUTCOMES_RE = "|".join(sorted(v.value for v in REUSED_VERDICTS))
ELIGIBLE_OUTCOMES_RE = "|".join(sorted(v.value for v in ELIGIBLE_VERDICTS))
