"""``kvdiag dashboards export``: the Grafana dashboards as JSON files or as ConfigMaps for Grafana's sidecar."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import click

from kvdiag.dashboards.configmaps import configmaps, dumps_all
from kvdiag.monitoring.config import DEFAULT_CONFIG, MixinConfig, MonitoringConfigError
from kvdiag.monitoring.k8s_objects import parse_labels


@click.group("dashboards")
def dashboards() -> None:
    """Grafana dashboards for KV reuse, KV transfer and router health."""


def _import(name: str) -> ModuleType:
    try:
        # grafana-foundation-sdk is the optional [dashboards] extra: import it only when needed.
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != "grafana_foundation_sdk":
            raise
        raise click.ClickException(
            "grafana-foundation-sdk is not installed: pip install 'kvdiag[dashboards]'") from None


@dashboards.command("export")
@click.option("--out", "-o", "out", required=True, metavar="PATH",
              help="json: a directory for the JSON files (created if missing); configmap: a YAML file, '-' for stdout.")
@click.option("--format", "fmt", type=click.Choice(("json", "configmap")), default="json", show_default=True,
              help="json: Grafana dashboard files; configmap: one v1 ConfigMap per dashboard, labelled for Grafana's "
                   "dashboard sidecar.")
@click.option("--router-selector", default=DEFAULT_CONFIG.router_selector, show_default=True,
              help="PromQL label matchers selecting the router's scrape job.")
@click.option("--vllm-selector", default=DEFAULT_CONFIG.vllm_selector, show_default=True,
              help="PromQL label matchers selecting the vLLM engines' scrape job.")
@click.option("--namespace", default=None,
              help="configmap: metadata.namespace (Grafana's, or one its sidecar watches).")
@click.option("--folder", default="kvdiag", show_default=True,
              help="configmap: Grafana folder (the grafana_folder annotation; the chart's folderAnnotation).")
@click.option("--sidecar-label", default="grafana_dashboard=1", show_default=True, metavar="KEY=VALUE",
              help="configmap: the label the sidecar watches (Helm values sidecar.dashboards.label/labelValue).")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="configmap: an extra label (repeatable).")
def export(out: str, fmt: str, router_selector: str, vllm_selector: str, namespace: str | None, folder: str,
           sidecar_label: str, labels: tuple[str, ...]) -> None:
    """Write kv-reuse, kv-transfer and router-health (JSON files into OUT, or ConfigMaps into one YAML file).

    \b
    Examples:
      kvdiag dashboards export --out /var/lib/grafana/dashboards/kvdiag
      kvdiag dashboards export --format configmap --namespace monitoring --out - | kubectl apply -f -
    """
    build = _import("kvdiag.dashboards.build")
    try:
        config = MixinConfig(router_selector=router_selector, vllm_selector=vllm_selector,
                             runbook_base_url=DEFAULT_CONFIG.runbook_base_url)
        if fmt == "json":
            for path in build.write(Path(out), config):
                click.echo(str(path))
            return
        sidecar = next(iter(parse_labels([sidecar_label]).items()))
        text = dumps_all(configmaps(config, namespace=namespace, folder=folder or None, labels=parse_labels(labels),
                                    sidecar_label=sidecar))
    except MonitoringConfigError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot write to {out}: {exc.strerror}; pick a writable --out") from None
    if out == "-":
        click.echo(text, nl=False)
        return
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise click.ClickException(f"cannot write {out}: {exc.strerror}; pick a writable --out") from None
    click.echo(out)


COMMANDS = (dashboards,)
