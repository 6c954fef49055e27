"""``kvdiag advise``: thin CLI over kvdiag.diagnostics.advise."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvdiag.cli.cmd_explain import output_console
from kvdiag.cli.main import single_thread_blas
from kvdiag.cli.report_inputs import PATH, cache_options, load_table, writing


@click.command("advise")
@click.argument("logs", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print the advice as JSON (schema in docs/advise.md).")
@click.option("--html", "html_path", type=PATH, help="Also write the HTML report with the advice section.")
@click.option("--decoder-ttl", type=click.FloatRange(min=0, min_open=True),
              help="D's decoder_kv_blocks_ttl in seconds, used when D's startup log line is not among LOGS.")
@click.option("--router-ttl", type=click.FloatRange(min=0, min_open=True),
              help="The router's handle TTL in seconds, used when the router's logs do not show it.")
@click.option("--kv-bytes-per-token", type=click.FloatRange(min=0, min_open=True),
              help="KV bytes per token, when the logs hold no D->P transfer sizes.")
@click.option("--width", type=click.IntRange(min=40), metavar="COLUMNS",
              help="Render for this many columns [default: the terminal's; piped: $COLUMNS, else 120].")
@cache_options
def advise_cmd(logs: tuple[str, ...], as_json: bool, html_path: Path | None, decoder_ttl: float | None,
               router_ttl: float | None, kv_bytes_per_token: float | None, width: int | None, cache_dir: Path,
               no_cache: bool, no_progress: bool, events_only: bool) -> None:
    """Recommend the decode TTL and kv_recompute_threshold, and check the configuration, from LOGS."""
    # (imported here: ``kvdiag advise --help`` does not load pandas, pyarrow and DuckDB)
    with single_thread_blas():
        from kvdiag.diagnostics.advise import advise  # noqa: PLC0415
        from kvdiag.diagnostics.html_report import write_html_report  # noqa: PLC0415
        from kvdiag.diagnostics.terminal_report import advice_renderables  # noqa: PLC0415

    table, cfg = load_table(logs, cache_dir, no_cache, no_progress, events_only)
    if not table.num_rows:
        raise click.ClickException("no turns found in the given logs; check the paths (kvdiag explain --all LOGS "
                                   "names the files it could not recognise)")
    adv = advise(table, decoder_ttl, config=cfg, router_ttl=router_ttl, bytes_per_token=kv_bytes_per_token)
    if as_json:
        click.echo(json.dumps(adv.to_json_dict(), indent=2))
    else:
        console = output_console(width, wide=False)
        for part in advice_renderables(adv):
            console.print(part)
    if html_path is not None:
        with writing():
            out = write_html_report(table, html_path, advice=adv)
        click.echo(f"wrote {out}", err=as_json)


COMMANDS = (advise_cmd,)
