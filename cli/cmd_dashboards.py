"""``kvdiag dashboards export``: write the Grafana dashboards as JSON files."""

from __future__ import annotations

import importlib
from pathlib import Path

import click

from kvdiag.dashboards.config import DEFAULT_CONFIG, ConfigError, MixinConfig


@click.group("dashboards")
def dashboards() -> None:
    """Grafana dashboards for KV reuse, KV transfer and router health."""


@dashboards.command("export")
@click.option("--out", "-o", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory to write the dashboard JSON files into (created if missing).")
@click.option("--router-selector", default=DEFAULT_CONFIG.router_selector, show_default=True,
              help="PromQL label matchers selecting the router's scrape job.")
@click.option("--vllm-selector", default=DEFAULT_CONFIG.vllm_selector, show_default=True,
              help="PromQL label matchers selecting the vLLM engines' scrape job.")
def export(out_dir: Path, router_selector: str, vllm_selector: str) -> None:
    """Write kv-reuse.json, kv-transfer.json and router-health.json into OUT.

    \b
    Example:
      kvdiag dashboards export --out /var/lib/grafana/dashboards/kvdiag
    """
    try:
        # grafana-foundation-sdk is the optional [dashboards] extra: import it only when needed.
        build = importlib.import_module("kvdiag.dashboards.build")
    except ModuleNotFoundError as exc:
        if exc.name != "grafana_foundation_sdk":
            raise
        raise click.ClickException(
            "grafana-foundation-sdk is not installed: pip install 'kvdiag[dashboards]'") from None
    try:
        config = MixinConfig(router_selector=router_selector, vllm_selector=vllm_selector,
                             runbook_base_url=DEFAULT_CONFIG.runbook_base_url)
        paths = build.write(out_dir, config)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot write to {out_dir}: {exc.strerror}; pick a writable --out") from None
    for path in paths:
        click.echo(str(path))


COMMANDS = (dashboards,)
