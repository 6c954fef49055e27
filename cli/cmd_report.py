"""``kvdiag report`` and ``kvdiag advise``: thin CLI over kvdiag.diagnostics.report / advise."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import click
import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
from rich.text import Text

from kvdiag.cli.cmd_explain import output_console
from kvdiag.diagnostics.advise import Advice, advise
from kvdiag.diagnostics.advise_config import DeploymentConfig, scan_config_cached
from kvdiag.diagnostics.detect import LogReadError
from kvdiag.diagnostics.explain import ExplainError
from kvdiag.diagnostics.html_report import write_html_report
from kvdiag.diagnostics.report import ReportError, build_report, load_turn_table, write_outputs
from kvdiag.diagnostics.sources import stage_inputs
from kvdiag.diagnostics.terminal_report import report_renderables
from kvdiag.exporters.parquet import DEFAULT_CACHE_DIR

PROGRESS_MIN_BYTES = 64 * 1024 * 1024
_PATH = click.Path(dir_okay=False, path_type=Path)


@contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    if not enabled:
        yield None
        return
    bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                   console=Console(stderr=True), transient=True)
    task = bar.add_task("reading logs", total=None)

    def update(done: int, total: int) -> None:
        if total >= PROGRESS_MIN_BYTES:
            bar.update(task, completed=done, total=total)

    with bar:
        yield update


def _load(logs: tuple[str, ...], cache_dir: Path, no_cache: bool, no_progress: bool, events_only: bool
          ) -> tuple[pd.DataFrame, DeploymentConfig]:
    cache = None if no_cache else cache_dir
    try:
        with stage_inputs(logs, mirror_dir=cache / "s3" if cache is not None else None) as staged:
            if staged.stats.corrupt:
                first = f" (first: {staged.display(staged.stats.notes[0])})" if staged.stats.notes else ""
                click.echo(f"note: skipped {staged.stats.corrupt} line(s) in no container log format{first}",
                           err=True)
            with _progress(not no_progress and sys.stderr.isatty()) as update:
                df = load_turn_table(staged, cache_dir=cache, progress=update, events_only=events_only)
            return df, scan_config_cached(staged, cache)
    except ReportError as exc:
        raise click.ClickException(str(exc)) from None
    except (LogReadError, ExplainError) as exc:
        raise click.ClickException(f"{exc}\nHint: pass the client, router/proxy, prefill and decode logs "
                                   "(files, globs or a folder).") from None


@contextmanager
def _writing() -> Iterator[None]:
    """Turn an output file that cannot be written into a one-line error naming it."""
    try:
        yield
    except OSError as exc:
        what = f"{exc.filename}: {exc.strerror or exc}" if exc.filename else f"an output file: {exc}"
        raise click.ClickException(f"cannot write {what}. Pick a writable path in an existing folder.") from None


def _console() -> Console:
    # Piped output gets a wide page so the advice lines are not cut to 80 characters.
    return Console() if sys.stdout.isatty() else Console(width=160)


def _cache_option(f: Callable[..., None]) -> Callable[..., None]:
    f = click.option("--no-cache", is_flag=True, help="Parse the logs even if a cached table exists.")(f)
    f = click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_CACHE_DIR,
                     show_default=True, help="Parquet cache of parsed logs, keyed by (path, size, mtime).")(f)
    f = click.option("--events-only", is_flag=True,
                     help="Read only the kvdiag event files among LOGS; the stock logs (and what they add) "
                          "are skipped.")(f)
    return click.option("--no-progress", is_flag=True, help="Never show a progress bar.")(f)


@click.command("report")
@click.argument("logs", nargs=-1, required=True)
@click.option("--csv", "csv_path", type=_PATH, help="Write the per-turn table as CSV.")
@click.option("--parquet", "parquet_path", type=_PATH, help="Write the per-turn table as Parquet.")
@click.option("--json", "json_path", type=_PATH, help="Write the aggregated report as JSON (docs/report.md).")
@click.option("--html", "html_path", type=_PATH, help="Write the self-contained HTML report with plots.")
@click.option("--decoder-ttl", type=click.FloatRange(min=0, min_open=True),
              help="D's decoder_kv_blocks_ttl in seconds, when D's startup log line is not among LOGS.")
@click.option("--wide", is_flag=True, help="Every column of every section, unabbreviated (the JSON names).")
@click.option("--width", type=click.IntRange(min=40), metavar="COLUMNS",
              help="Render for this many columns [default: the terminal's; piped: $COLUMNS, else 120].")
@_cache_option
def report(logs: tuple[str, ...], csv_path: Path | None, parquet_path: Path | None, json_path: Path | None,
           html_path: Path | None, decoder_ttl: float | None, wide: bool, width: int | None, cache_dir: Path,
           no_cache: bool, no_progress: bool, events_only: bool) -> None:
    """Outcome mix, TTFT reused vs recomputed, transfers and gaps, by turn and prompt length, from LOGS."""
    df, cfg = _load(logs, cache_dir, no_cache, no_progress, events_only)
    ttl = float(cfg.decoder_ttl.value) if cfg.decoder_ttl is not None else decoder_ttl
    try:
        rep = build_report(df, ttl)
    except ReportError as exc:
        raise click.ClickException(str(exc)) from None
    console = output_console(width, wide)
    for part in report_renderables(rep, wide=wide):
        console.print(part)
    with _writing():
        for path in write_outputs(rep, csv=csv_path, parquet_path=parquet_path, json_path=json_path):
            console.print(Text(f"wrote {path}"))
        if html_path is not None:
            console.print(Text(f"wrote {write_html_report(df, html_path, decoder_ttl=ttl)}"))


def _print_advice(adv: Advice) -> None:
    console = _console()
    console.print("[bold]Decode TTL[/]")
    console.print(Text(adv.ttl.summary))
    console.print("[bold]kv_recompute_threshold[/]")
    console.print(Text(adv.threshold.summary))
    console.print("[bold]Configuration checks[/]")
    styles = {"ok": "green", "warning": "yellow", "error": "red", "missing_data": "dim", "info": "cyan"}
    for c in adv.checks:
        fix = f"  fix: {c.fix}" if c.fix and c.severity != "ok" else ""
        # messages quote log lines and config keys: escaped, so "[...]" is printed, not read as markup
        console.print(f"[{styles[c.severity]}]{c.severity:>12}[/] {escape(f'{c.id}: {c.message}{fix}')}",
                      highlight=False)


@click.command("advise")
@click.argument("logs", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print the advice as JSON (schema in docs/advise.md).")
@click.option("--html", "html_path", type=_PATH, help="Also write the HTML report with the advice section.")
@click.option("--decoder-ttl", type=click.FloatRange(min=0, min_open=True),
              help="D's decoder_kv_blocks_ttl in seconds, used when D's startup log line is not among LOGS.")
@click.option("--router-ttl", type=click.FloatRange(min=0, min_open=True),
              help="The router's handle TTL in seconds, used when the router's logs do not show it.")
@click.option("--kv-bytes-per-token", type=click.FloatRange(min=0, min_open=True),
              help="KV bytes per token, when the logs hold no D->P transfer sizes.")
@_cache_option
def advise_cmd(logs: tuple[str, ...], as_json: bool, html_path: Path | None, decoder_ttl: float | None,
               router_ttl: float | None, kv_bytes_per_token: float | None, cache_dir: Path, no_cache: bool,
               no_progress: bool, events_only: bool) -> None:
    """Recommend the decode TTL and kv_recompute_threshold, and check the configuration, from LOGS."""
    df, cfg = _load(logs, cache_dir, no_cache, no_progress, events_only)
    if df.empty:
        raise click.ClickException("no turns found in the given logs; check the paths (kvdiag explain --all LOGS "
                                   "names the files it could not recognise)")
    adv = advise(df, decoder_ttl, config=cfg, router_ttl=router_ttl, bytes_per_token=kv_bytes_per_token)
    if as_json:
        click.echo(json.dumps(adv.to_json_dict(), indent=2))
    else:
        _print_advice(adv)
    if html_path is not None:
        with _writing():
            out = write_html_report(df, html_path, advice=adv)
        click.echo(f"wrote {out}", err=as_json)



COMMANDS = (report, advise_cmd)
