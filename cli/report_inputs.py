"""Internal: the LOGS inputs ``kvdiag report`` and ``kvdiag advise`` share: staging, the cache, progress, errors."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import click

from kvdiag.diagnostics.report_cache import DEFAULT_CACHE_DIR
from kvdiag.diagnostics.terminal_safe import printable, safe_console

if TYPE_CHECKING:
    import pyarrow as pa

    from kvdiag.diagnostics.advise_config import DeploymentConfig

PROGRESS_MIN_BYTES = 64 * 1024 * 1024
PATH = click.Path(dir_okay=False, path_type=Path)


@contextmanager
def progress_bar(enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A bytes-read progress bar on stderr for inputs of 64 MiB or more (None when disabled)."""
    if not enabled:
        yield None
        return
    # (imported here: a piped run, or one with --no-progress, does not pay for rich.progress)
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn  # noqa: PLC0415

    bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                   console=safe_console(stderr=True), transient=True)
    task = bar.add_task("reading logs", total=None)

    def update(done: int, total: int) -> None:
        if total >= PROGRESS_MIN_BYTES:
            bar.update(task, completed=done, total=total)

    with bar:
        yield update


def load_table(logs: tuple[str, ...], cache_dir: Path, no_cache: bool, no_progress: bool, events_only: bool
               ) -> tuple[pa.Table, DeploymentConfig]:
    """The turn table (Arrow) and the deployment's settings from LOGS, or a ClickException with the fix."""
    # (imported here, with pyarrow and DuckDB behind them: ``--help`` needs none of them; the commands have
    # loaded numpy by now, as single_thread_blas has it)
    from kvdiag.diagnostics.advise_config import scan_config_cached  # noqa: PLC0415
    from kvdiag.diagnostics.detect import LogReadError  # noqa: PLC0415
    from kvdiag.diagnostics.report import ReportError, load_turn_arrow  # noqa: PLC0415
    from kvdiag.diagnostics.sources import stage_inputs  # noqa: PLC0415
    from kvdiag.diagnostics.turn_loader import ExplainError  # noqa: PLC0415

    cache = None if no_cache else cache_dir
    try:
        with stage_inputs(logs, mirror_dir=cache / "s3" if cache is not None else None) as staged:
            if staged.stats.corrupt:
                first = f" (first: {staged.display(staged.stats.notes[0])})" if staged.stats.notes else ""
                click.echo(f"note: skipped {staged.stats.corrupt} line(s) in no container log format"
                           f"{printable(first)}", err=True)
            with progress_bar(not no_progress and sys.stderr.isatty()) as update:
                table = load_turn_arrow(staged, cache_dir=cache, progress=update, events_only=events_only,
                                        config_lines=True)
            return table, scan_config_cached(staged, cache)
    except ReportError as exc:
        raise click.ClickException(printable(str(exc))) from None
    except (LogReadError, ExplainError) as exc:
        raise click.ClickException(f"{printable(str(exc))}\nHint: pass the client, router/proxy, prefill and "
                                   "decode logs (files, globs or a folder).") from None


@contextmanager
def writing() -> Iterator[None]:
    """Turn an output file that cannot be written into a one-line error naming it."""
    try:
        yield
    except OSError as exc:
        what = f"{exc.filename}: {exc.strerror or exc}" if exc.filename else f"an output file: {exc}"
        raise click.ClickException(f"cannot write {what}. Pick a writable path in an existing folder.") from None


def cache_options(f: Callable[..., None]) -> Callable[..., None]:
    """The cache, events-only and progress options report and advise share."""
    f = click.option("--no-cache", is_flag=True, help="Parse the logs even if a cached table exists.")(f)
    f = click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_CACHE_DIR,
                     show_default=True, help="Parquet cache of parsed logs, keyed by (path, size, mtime).")(f)
    f = click.option("--events-only", is_flag=True,
                     help="Read only the kvdiag event files among LOGS; the stock logs (and what they add) "
                          "are skipped.")(f)
    return click.option("--no-progress", is_flag=True, help="Never show a progress bar.")(f)
