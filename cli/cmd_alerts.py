"""``kvdiag alerts export``: write the Prometheus alert rule file."""

from __future__ import annotations

from pathlib import Path

import click

from kvdiag.alerts.build import write
from kvdiag.dashboards.config import DEFAULT_CONFIG, ConfigError, MixinConfig


@click.group("alerts")
def alerts() -> None:
    """Prometheus alert rules for KV reuse, KV transfer and the router."""


@alerts.command("export")
@click.option("--out", "-o", "out_file", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Rule file to write (YAML; load it with rule_files: in prometheus.yml).")
@click.option("--router-selector", default=DEFAULT_CONFIG.router_selector, show_default=True,
              help="PromQL label matchers selecting the router's scrape job.")
@click.option("--runbook-base-url", default=DEFAULT_CONFIG.runbook_base_url, show_default=True,
              help="Where docs/runbooks.md is published; each alert links to its heading there.")
def export(out_file: Path, router_selector: str, runbook_base_url: str) -> None:
    """Write kvdiag's alert rules to OUT (check it with `promtool check rules OUT`).

    \b
    Example:
      kvdiag alerts export --out /etc/prometheus/rules/kvdiag.yaml
    """
    try:
        config = MixinConfig(router_selector=router_selector, vllm_selector=DEFAULT_CONFIG.vllm_selector,
                             runbook_base_url=runbook_base_url)
        path = write(out_file, config)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot write {out_file}: {exc.strerror}; pick a writable --out") from None
    click.echo(str(path))


COMMANDS = (alerts,)
