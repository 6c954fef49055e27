"""Dashboards: committed JSON matches the Python source, and every panel passes the lint rules we keep.

The rules are Python reimplementations of the dashboard-linter rules the kubernetes-mixin runs
(panel-title-description, panel-units, panel-datasource, template-datasource, target-promql,
target-rate-interval, target-counter-agg), plus kvdiag's own: names only catalog or vLLM metrics.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvdiag.cli.main import cli
from kvdiag.dashboards import build
from kvdiag.dashboards.promql import (
    PromQLError,
    bare_counter_selectors,
    metric_names,
    unknown_metric_names,
)
from kvdiag.dashboards.vllm_metrics import vllm_exposed_names
from kvdiag.monitoring.config import DEFAULT_CONFIG, MixinConfig, MonitoringConfigError
from kvdiag.schema.metrics import all_exposed_names

REPO = Path(__file__).resolve().parents[1]
RENDERED = build.render()


def _panels() -> list[tuple[str, dict[str, Any]]]:
    return [(name, p) for name, model in RENDERED.items() for p in model["panels"] if p["type"] != "row"]


def _targets() -> list[tuple[str, str, str]]:
    return [(name, p["title"], t["expr"]) for name, p in _panels() for t in p["targets"]]


def test_three_dashboards_with_stable_unique_uids() -> None:
    assert sorted(RENDERED) == ["kv-reuse.json", "kv-transfer.json", "router-health.json"]
    uids = [m["uid"] for m in RENDERED.values()]
    assert len(set(uids)) == 3
    assert build.render()["kv-reuse.json"]["uid"] == RENDERED["kv-reuse.json"]["uid"]
    assert all(re.fullmatch(r"kvdiag-[0-9a-f]{12}", u) for u in uids)


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_committed_json_matches_generator(name: str) -> None:
    committed = (REPO / "dashboards" / name).read_text(encoding="utf-8")
    assert committed == build.dumps(RENDERED[name]), (
        f"dashboards/{name} is stale: run `python -m kvdiag.dashboards.build --out dashboards`")


def test_no_stray_committed_dashboards() -> None:
    assert sorted(p.name for p in (REPO / "dashboards").glob("*.json")) == sorted(RENDERED)


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_templated_datasource_model_instance(name: str) -> None:
    variables = {v["name"]: v for v in RENDERED[name]["templating"]["list"]}
    assert {"datasource", "model", "instance"} <= set(variables)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"]["uid"] == "${datasource}"
            assert metric_names(var["query"].removeprefix("label_values(").rsplit(",", 1)[0]) <= (
                all_exposed_names() | vllm_exposed_names())


def test_every_panel_has_title_description_unit_datasource() -> None:
    panels = _panels()
    assert len(panels) >= 25
    for name, panel in panels:
        where = f"{name}: {panel.get('title')!r}"
        assert panel["title"].strip(), where
        assert len(panel.get("description", "")) >= 30, f"{where} needs a description"
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{where} needs a unit"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert panel["targets"], f"{where} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", where
    titles = [(n, p["title"]) for n, p in panels]
    assert len(titles) == len(set(titles)), "panel titles must be unique per dashboard"


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_panel_ids_are_unique(name: str) -> None:
    ids = [p["id"] for p in RENDERED[name]["panels"]]
    assert ids == list(range(1, len(ids) + 1))


@pytest.mark.parametrize(("name", "title", "expr"), _targets())
def test_expression_parses_and_names_only_known_metrics(name: str, title: str, expr: str) -> None:
    assert metric_names(expr), f"{name} {title!r}: no metric in {expr}"
    assert not unknown_metric_names(expr), f"{name} {title!r}: unknown metric(s) in {expr}"
    assert not bare_counter_selectors(expr), f"{name} {title!r}: counter outside rate() in {expr}"
    if "rate(" in expr or "increase(" in expr:
        windows = set(re.findall(r"\[([^\]]+)\]", expr))
        assert windows == {"$__rate_interval"}, f"{name} {title!r}: use [$__rate_interval], got {windows}"


def test_router_queries_use_the_configured_selector_and_variables() -> None:
    for name, title, expr in _targets():
        on_engine = "vllm:" in expr or "kvdiag_connector_" in expr  # connector series live on vLLM's /metrics
        if on_engine:
            assert 'job="vllm"' in expr and 'model_name=~"$model"' in expr, (name, title)
            assert 'instance=~"$vllm_instance"' in expr and 'job="kvdiag-router"' not in expr, (name, title)
        else:
            assert 'job="kvdiag-router"' in expr and 'instance=~"$instance"' in expr, (name, title)


def test_issue_panels_are_present() -> None:
    reuse = {p["title"] for p in RENDERED["kv-reuse.json"]["panels"]}
    assert {"Turn outcomes by verdict", "Reuse ratio of eligible turns", "Reuse ratio by turn index",
            "Reuse ratio by prompt length", "TTFT p50/p95: reused vs recomputed", "Expired-read ratio",
            "Missing-metadata ratio by reason", "Inter-turn gap vs decode TTL", "Store size",
            "Handle age at use vs TTLs", "Store evictions"} <= reuse
    transfer_exprs = " ".join(t["expr"] for p in RENDERED["kv-transfer.json"]["panels"] for t in p.get("targets", []))
    for metric in ("vllm:nixl_xfer_time_seconds_bucket", "vllm:nixl_bytes_transferred_sum",
                   "vllm:prompt_tokens_by_source_total", "vllm:external_prefix_cache_hits_total",
                   "kvdiag_transfer_bytes_bucket", "kvdiag_transfer_failures_total"):
        assert metric in transfer_exprs
    health = {p["title"] for p in RENDERED["router-health.json"]["panels"]}
    assert {"Request rate by status", "Upstream errors by leg", "Added latency (router overhead)",
            "Turns in flight", "Client disconnects"} <= health


def test_ttft_panel_shows_trace_exemplars() -> None:
    # The router attaches trace ids to kvdiag_ttft_seconds as exemplars; the panel must ask for them.
    (panel,) = [p for p in RENDERED["kv-reuse.json"]["panels"] if p["title"] == "TTFT p50/p95: reused vs recomputed"]
    assert [t.get("exemplar", False) for t in panel["targets"]] == [False, True]
    assert "kvdiag_ttft_seconds_bucket" in panel["targets"][1]["expr"] and "kvdiag explain" in panel["description"]
    others = [t for _, p in _panels() if p is not panel for t in p["targets"]]
    assert not any(t.get("exemplar") for t in others)


def test_nixl_panels_warn_about_tp_pooling() -> None:
    for panel in RENDERED["kv-transfer.json"]["panels"]:
        exprs = " ".join(t["expr"] for t in panel.get("targets", []))
        if "vllm:nixl_" in exprs:
            assert "TP rank" in panel["description"], panel["title"]


def test_unknown_metric_names_catches_typos_and_unparsable_queries() -> None:
    assert unknown_metric_names('sum(rate(kvdiag_turn_total{model=~"$model"}[$__rate_interval]))') == {
        "kvdiag_turn_total"}
    assert unknown_metric_names("vllm_e2e_request_latency_seconds_count") == {"vllm_e2e_request_latency_seconds_count"}
    assert unknown_metric_names('{__name__="vllm:nixl_num_failed_transfers_total"}') == frozenset()
    with pytest.raises(PromQLError, match="does not parse"):
        metric_names("sum(rate(kvdiag_turns_total[5m])")
    with pytest.raises(PromQLError, match="without a literal metric name"):
        metric_names('{__name__=~"kvdiag_.*"}')


def test_config_rejects_missing_or_malformed_values() -> None:
    with pytest.raises(MonitoringConfigError, match="router_selector must not be empty"):
        MixinConfig(router_selector="", vllm_selector='job="vllm"', runbook_base_url="http://x")
    with pytest.raises(MonitoringConfigError, match="without braces"):
        MixinConfig(router_selector='{job="r"}', vllm_selector='job="vllm"', runbook_base_url="http://x")
    with pytest.raises(MonitoringConfigError, match="rate_window"):
        MixinConfig(router_selector='job="r"', vllm_selector='job="v"', runbook_base_url="u", rate_window="ten")
    with pytest.raises(TypeError):
        MixinConfig()  # type: ignore[call-arg]


def test_selectors_flow_into_every_query() -> None:
    config = MixinConfig(router_selector='job="edge-router"', vllm_selector='namespace="llm"',
                         runbook_base_url=DEFAULT_CONFIG.runbook_base_url)
    rendered = build.render(config)
    exprs = [t["expr"] for m in rendered.values() for p in m["panels"] for t in p.get("targets", [])]
    assert all('job="edge-router"' in e or 'namespace="llm"' in e for e in exprs)
    assert not any('job="kvdiag-router"' in e for e in exprs)


def test_cli_export_writes_the_committed_files(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["dashboards", "export", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    for name in RENDERED:
        assert (tmp_path / "out" / name).read_text() == (REPO / "dashboards" / name).read_text()
    bad = CliRunner().invoke(cli, ["dashboards", "export", "--out", str(tmp_path), "--router-selector", ""])
    assert bad.exit_code == 1 and "must not be empty" in bad.output
    assert json.loads((tmp_path / "out" / "kv-reuse.json").read_text())["title"] == "kvdiag / KV reuse"
