"""``kvdiag report``: thin CLI over kvdiag.diagnostics.report."""

from __future__ import annotations

from pathlib import Path

import click
from rich.text import Text

from kvdiag.cli.cmd_explain import output_console
from kvdiag.cli.main import single_thread_blas
from kvdiag.cli.report_inputs import PATH, cache_options, load_table, writing


@click.command("report")
@click.argument("logs", nargs=-1, required=True)
@click.option("--csv", "csv_path", type=PATH, help="Write the per-turn table as CSV.")
@click.option("--parquet", "parquet_path", type=PATH, help="Write the per-turn table as Parquet.")
@click.option("--json", "json_path", type=PATH, help="Write the aggregated report as JSON (docs/report.md).")
@click.option("--html", "html_path", type=PATH, help="Write the self-contained HTML report with plots.")
@click.option("--decoder-ttl", type=click.FloatRange(min=0, min_open=True),
              help="D's decoder_kv_blocks_ttl in seconds, when D's startup log line is not among LOGS.")
@click.option("--wide", is_flag=True, help="Every column of every section, unabbreviated (the JSON names).")
@click.option("--width", type=click.IntRange(min=40), metavar="COLUMNS",
              help="Render for this many columns [default: the terminal's; piped: $COLUMNS, else 120].")
@cache_options
def report(logs: tuple[str, ...], csv_path: Path | None, parquet_path: Path | None, json_path: Path | None,
           html_path: Path | None, decoder_ttl: float | None, wide: bool, width: int | None, cache_dir: Path,
           no_cache: bool, no_progress: bool, events_only: bool) -> None:
    """Outcome mix, TTFT reused vs recomputed, transfers and gaps, by turn and prompt length, from LOGS."""
    # (imported here: ``kvdiag report --help`` does not load pyarrow and DuckDB)
    with single_thread_blas():
        from kvdiag.diagnostics.report import ReportError, build_report, write_outputs  # noqa: PLC0415
        from kvdiag.diagnostics.terminal_report import report_renderables  # noqa: PLC0415

    table, cfg = load_table(logs, cache_dir, no_cache, no_progress, events_only)
    ttl = float(cfg.decoder_ttl.value) if cfg.decoder_ttl is not None else decoder_ttl
    try:
        rep = build_report(table, ttl)
    except ReportError as exc:
        raise click.ClickException(str(exc)) from None
    console = output_console(width, wide)
    for part in report_renderables(rep, wide=wide):
        console.print(part)
    with writing():
        for path in write_outputs(rep, csv=csv_path, parquet_path=parquet_path, json_path=json_path):
            console.print(Text(f"wrote {path}"))
        if html_path is not None:
            from kvdiag.diagnostics.html_report import write_html_report  # noqa: PLC0415 - only with --html

            console.print(Text(f"wrote {write_html_report(table, html_path, decoder_ttl=ttl)}"))


COMMANDS = (report,)
