"""``kvdiag explain``: why each turn of a conversation did or did not reuse KV (thin CLI over diagnostics)."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from typing import Any

import click
from rich.console import Console, Group

from kvdiag.diagnostics.records import ConversationRecord, ConversationSummary, TurnRecord
from kvdiag.diagnostics.terminal import explain_all_renderables, explain_renderables
from kvdiag.diagnostics.terminal_safe import printable, safe_console
from kvdiag.diagnostics.turn_loader import (
    ConversationNotFoundError,
    LineStats,
    UnreadableLogError,
    explain_conversation,
    load_turns,
    summarize_conversations,
)

PROGRESS_MIN_BYTES = 64 * 1024 * 1024  # a bar only when the run is long enough to need one


def _turn_json(t: TurnRecord) -> dict[str, Any]:
    return t.to_json_dict()


def output_console(width: int | None, wide: bool) -> Console:
    """stdout's console: ``--width``, else the terminal's; piped, COLUMNS or a page wide enough for the view."""
    if width is None and not sys.stdout.isatty():
        width = int(os.environ["COLUMNS"]) if os.environ.get("COLUMNS", "").isdigit() else (200 if wide else 120)
    # (no ":name:" emoji codes: nothing kvdiag prints means one, and their table costs a one-conversation run 3 ms)
    return safe_console(width=width, emoji=False) if width else safe_console(emoji=False)


def _progress_fn(console: Console, enabled: bool) -> tuple[Any, Any]:
    if not enabled:
        return None, None
    # (imported here: a run without a bar, piped or --no-progress, does not pay for rich.progress)
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn  # noqa: PLC0415

    bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                   TimeRemainingColumn(), console=console, transient=True)
    task = bar.add_task("reading logs", total=None)

    def update(done: int, total: int) -> None:
        if total >= PROGRESS_MIN_BYTES:
            bar.update(task, completed=done, total=total)

    return bar, update


def _note_corrupt(stats: LineStats) -> None:
    if stats.corrupt:
        first = f" (first: {stats.notes[0]})" if stats.notes else ""
        click.echo(f"note: skipped {stats.corrupt} corrupt line(s){printable(first)}", err=True)


def _note_unrecognised(stats: LineStats) -> None:
    names = stats.unrecognised_files
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        click.echo(f"note: ignored {len(names)} file(s) in no known log format (client, router/proxy, vLLM, "
                   f"kvdiag events): {printable(shown)}", err=True)


@click.command("explain")
@click.argument("logs", nargs=-1, required=True)
@click.option("--conversation-id", "--conversation", "conversation_id", help="Explain this conversation's turns.")
@click.option("--all", "all_conversations", is_flag=True, help="Every conversation, worst first, with counts.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--no-progress", is_flag=True, help="Never show a progress bar.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, writable=True),
              help="Also draw the conversation(s) as a swimlane timeline in this self-contained HTML file.")
@click.option("--decoder-ttl", type=float, help="decoder_kv_blocks_ttl (s) to draw on the timeline.")
@click.option("--wide", is_flag=True, help="One full table with every field as a column (reason and fix included).")
@click.option("--width", type=click.IntRange(min=40), metavar="COLUMNS",
              help="Render for this many columns [default: the terminal's; piped: $COLUMNS, else 120].")
def explain(logs: tuple[str, ...], conversation_id: str | None, all_conversations: bool, as_json: bool,
            no_progress: bool, html_path: str | None, decoder_ttl: float | None, wide: bool,
            width: int | None) -> None:
    """Explain KV reuse per turn from client, router/proxy, prefill and decode LOGS (globs, folders, .gz).

    Exit codes: 0 success, 2 conversation (or, with --all, any conversation) not found, 1 unreadable input.
    """
    if bool(conversation_id) == all_conversations:
        raise click.UsageError("give exactly one of --conversation-id ID or --all")
    err = safe_console(stderr=True)
    bar, update = _progress_fn(err, not no_progress and sys.stderr.isatty())
    stats = LineStats()
    convs: list[ConversationRecord] = []
    summaries: list[ConversationSummary] = []
    try:
        if bar is not None:
            bar.start()
        try:
            if conversation_id:
                convs = [explain_conversation(logs, conversation_id, progress=update, stats=stats)]
            elif as_json or html_path:
                convs = load_turns(logs, progress=update, stats=stats)
                summaries = [c.summary() for c in convs]
            else:  # the list needs each turn's verdict only: no record, reason or evidence is built
                summaries = summarize_conversations(logs, progress=update, stats=stats)
        finally:
            if bar is not None:
                bar.stop()
    except ConversationNotFoundError as exc:
        _note_corrupt(stats)
        _note_unrecognised(stats)
        click.echo(f"Error: {printable(str(exc))}. Check the id, or add the client/router logs that carry it.",
                   err=True)
        sys.exit(2)
    except UnreadableLogError as exc:
        raise click.ClickException(f"{printable(str(exc))}. Fix the path or permissions, or leave the file out."
                                   ) from None
    _note_corrupt(stats)
    _note_unrecognised(stats)
    if not conversation_id and not summaries:
        click.echo("Error: no conversations found in the logs given. Pass the client, router/proxy, prefill and "
                   "decode logs (files, globs or a folder); docs/verdicts.md lists the formats read.", err=True)
        sys.exit(2)
    if html_path:
        from kvdiag.diagnostics.html_timeline import render_conversations_html  # noqa: PLC0415 - only with --html

        try:
            written = render_conversations_html(convs, html_path, decoder_ttl=decoder_ttl,
                                                title=f"kvdiag explain: {conversation_id or 'all conversations'}")
        except OSError as exc:
            raise click.ClickException(f"cannot write {html_path}: {exc}. Pick a writable path.") from None
        click.echo(f"timeline: {written}", err=True)
    if conversation_id:
        conv = convs[0]
        if as_json:
            click.echo(json.dumps(conv.to_json_dict(), indent=2))
            return
        out = output_console(width, wide)
        # (one print: each costs rich a pass over the environment and the render hooks, 0.2 ms a part)
        out.print(Group(*explain_renderables(conv, width=out.width, wide=wide)))
        return
    if as_json:
        counts = Counter(t.verdict.value for c in convs for t in c.turns)
        click.echo(json.dumps({"verdict_counts": dict(counts.most_common()),
                               "conversations": [c.to_json_dict() for c in convs]}, indent=2))
        return
    out = output_console(width, wide)
    for part in explain_all_renderables(summaries, wide=wide):
        out.print(part)


COMMANDS = (explain,)
