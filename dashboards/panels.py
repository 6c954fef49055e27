"""Panel and variable constructors shared by every kvdiag dashboard (grafana-foundation-sdk builders).

Each constructor requires a description and a unit, so no panel can ship without them.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as common_builder
from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort

from kvdiag.monitoring.config import MixinConfig

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")

# The TP-pooling caveat every panel over vLLM's NIXL histograms repeats (docs/vllm-reference.md, metrics).
TP_POOLING_NOTE = ("Caution: vLLM's NIXL metrics pool the observations of every TP rank, so counts are "
                   "rank-level transfers, not requests, and bytes are not the size of one request "
                   "(vLLM issue #41230). Use the kvdiag per-turn panels above for per-request figures.")


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel and its legend."""

    expr: str
    legend: str = "__auto"
    exemplar: bool = False  # also fetch exemplars (trace ids) of the histogram the query reads


def _queries(targets: list[Target]) -> list[prometheus.Dataquery]:
    queries = []
    for i, t in enumerate(targets):
        query = (prometheus.Dataquery().expr(t.expr).legend_format(t.legend).ref_id(string.ascii_uppercase[i])
                 .datasource(DATASOURCE))
        queries.append(query.exemplar(True) if t.exemplar else query)
    return queries


def timeseries_panel(title: str, description: str, unit: str, targets: list[Target], *, width: int = 12,
                     height: int = 8, stacked: bool = False, min_value: float | None = 0,
                     max_value: float | None = None) -> timeseries.Panel:
    """A time-series panel with a title, description, unit and one or more queries."""
    panel = (timeseries.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
             .span(width).height(height).line_width(1).fill_opacity(10)
             .legend(common_builder.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
                     .placement(common.LegendPlacement.BOTTOM).show_legend(True))
             .tooltip(common_builder.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                      .sort(common.SortOrder.DESCENDING)))
    if stacked:
        panel = panel.stacking(common_builder.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(40)
    if min_value is not None:
        panel = panel.min(min_value)
    if max_value is not None:
        panel = panel.max(max_value)
    for query in _queries(targets):
        panel = panel.with_target(query)
    return panel


def stat_panel(title: str, description: str, unit: str, targets: list[Target], *, width: int = 6,
               height: int = 4) -> stat.Panel:
    """A single-value panel showing the last value of its query."""
    panel = (stat.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
             .span(width).height(height)
             .reduce_options(common_builder.ReduceDataOptions().calcs(["lastNotNull"]))
             .color_mode(common.BigValueColorMode.VALUE).graph_mode(common.BigValueGraphMode.AREA))
    for query in _queries(targets):
        panel = panel.with_target(query)
    return panel


def datasource_variable() -> dashboard.DatasourceVariable:
    """The ``$datasource`` variable every panel queries through."""
    return dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")


def query_variable(name: str, label: str, query: str, description: str) -> dashboard.QueryVariable:
    """A multi-value variable (``All`` = ``.*``) filled from ``label_values(...)``."""
    return (dashboard.QueryVariable(name).label(label).description(description).query(query)
            .datasource(DATASOURCE).refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC).multi(True).include_all(True).all_value(".*"))


def model_variable(config: MixinConfig) -> dashboard.QueryVariable:
    """``$model``: served model names seen by the router."""
    return query_variable("model", "Model", f"label_values(kvdiag_turns_total{{{config.router_selector}}}, model)",
                          "Served model name (router label model; vLLM label model_name).")


def instance_variable(config: MixinConfig) -> dashboard.QueryVariable:
    """``$instance``: router instances."""
    return query_variable("instance", "Router instance",
                          f"label_values(kvdiag_router_requests_total{{{config.router_selector}}}, instance)",
                          "kvdiag router replicas (scrape instance).")


def vllm_instance_variable(config: MixinConfig) -> dashboard.QueryVariable:
    """``$vllm_instance``: engine instances (P and D)."""
    return query_variable("vllm_instance", "Engine instance",
                          f"label_values(vllm:prompt_tokens_total{{{config.vllm_selector}}}, instance)",
                          "vLLM prefill and decode engines (scrape instance).")


def base_dashboard(config: MixinConfig, title: str, file_stem: str, description: str) -> dashboard.Dashboard:
    """A dashboard with the shared settings, tags, stable UID and the datasource/model/instance variables."""
    return (dashboard.Dashboard(title).uid(config.dashboard_uid(file_stem)).description(description)
            .tags([config.dashboard_tag]).refresh(config.dashboard_refresh).time("now-1h", "now")
            .timezone("browser").editable()
            .with_variable(datasource_variable())
            .with_variable(model_variable(config))
            .with_variable(instance_variable(config)))
