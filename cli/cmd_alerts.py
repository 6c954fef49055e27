"""``kvdiag alerts export`` and ``kvdiag alerts runbooks``: the rules (plain or a PrometheusRule), their runbooks."""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

import click

from kvdiag.alerts.build import dumps as dumps_rule_file
from kvdiag.alerts.prometheus_rule import DEFAULT_NAME, prometheus_rule
from kvdiag.alerts.prometheus_rule import dumps as dumps_prometheus_rule
from kvdiag.monitoring.config import DEFAULT_CONFIG, MixinConfig, MonitoringConfigError
from kvdiag.monitoring.k8s_objects import parse_labels

RUNBOOKS = "docs/runbooks.md"


def _write(out: str, text: str) -> None:
    if out == "-":
        click.echo(text, nl=False)
        return
    path = Path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise click.ClickException(f"cannot write {out}: {exc.strerror}; pick a writable --out") from None
    click.echo(str(path), err=True)


@click.group("alerts")
def alerts() -> None:
    """Prometheus alert rules for KV reuse, KV transfer and the router."""


@alerts.command("export")
@click.option("--out", "-o", "out", required=True, metavar="FILE",
              help="File to write ('-' for stdout).")
@click.option("--format", "fmt", type=click.Choice(("rules", "prometheusrule")), default="rules", show_default=True,
              help="rules: a Prometheus rule file (rule_files: in prometheus.yml); prometheusrule: a "
                   "monitoring.coreos.com/v1 PrometheusRule for the Prometheus Operator.")
@click.option("--runbook-base-url", required=True, metavar="URL",
              help="Where the runbooks are published (`kvdiag alerts runbooks` writes them); each alert links to "
                   "URL#<alert name, lower case>.")
@click.option("--router-selector", default=DEFAULT_CONFIG.router_selector, show_default=True,
              help="PromQL label matchers selecting the router's scrape job.")
@click.option("--name", default=DEFAULT_NAME, show_default=True, help="PrometheusRule: metadata.name.")
@click.option("--namespace", default=None, help="PrometheusRule: metadata.namespace (default: kubectl's).")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="PrometheusRule: an extra label, e.g. release=prometheus for kube-prometheus-stack's "
                   "ruleSelector (repeatable).")
def export(out: str, fmt: str, runbook_base_url: str, router_selector: str, name: str, namespace: str | None,
           labels: tuple[str, ...]) -> None:
    """Write kvdiag's alert rules (check a rule file with `promtool check rules FILE`).

    \b
    Examples:
      kvdiag alerts runbooks --out runbooks.md      # publish it, then:
      kvdiag alerts export --out /etc/prometheus/rules/kvdiag.yaml \\
          --runbook-base-url https://wiki.example.com/kvdiag/runbooks.md
      kvdiag alerts export --format prometheusrule --namespace monitoring --label release=prometheus \\
          --runbook-base-url https://wiki.example.com/kvdiag/runbooks.md --out - | kubectl apply -f -
    """
    try:
        config = MixinConfig(router_selector=router_selector, vllm_selector=DEFAULT_CONFIG.vllm_selector,
                             runbook_base_url=runbook_base_url)
        if fmt == "rules":
            text = dumps_rule_file(config)
        else:
            text = dumps_prometheus_rule(prometheus_rule(config, name=name, namespace=namespace,
                                                         labels=parse_labels(labels)))
    except MonitoringConfigError as exc:
        raise click.ClickException(str(exc)) from None
    _write(out, text)


@alerts.command("runbooks")
@click.option("--out", "-o", "out", required=True, metavar="FILE", help="File to write ('-' for stdout).")
def runbooks(out: str) -> None:
    """Write the runbooks shipped with kvdiag (one heading per alert), to publish where --runbook-base-url points.

    \b
    Example:
      kvdiag alerts runbooks --out site/kvdiag/runbooks.md
    """
    source = resources.files("kvdiag").joinpath(RUNBOOKS)
    try:
        text = source.read_text(encoding="utf-8")
    except (FileNotFoundError, OSError):
        raise click.ClickException(f"{RUNBOOKS} is missing from this kvdiag install; reinstall kvdiag") from None
    _write(out, text)
    if out != "-" and sys.stderr.isatty():
        click.echo("publish it, then pass its URL as --runbook-base-url", err=True)


COMMANDS = (alerts,)
