"""``kvdiag explain``: why each turn of a conversation did or did not reuse KV (thin CLI over diagnostics)."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from kvdiag.diagnostics.explain import (
    ConversationNotFoundError,
    LineStats,
    UnreadableLogError,
    explain_conversation,
    load_turns,
)
from kvdiag.diagnostics.html_timeline import render_conversations_html
from kvdiag.diagnostics.records import ConversationRecord, TurnRecord

PROGRESS_MIN_BYTES = 64 * 1024 * 1024  # a bar only when the run is long enough to need one


def _start(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%m-%d %H:%M:%S", time.gmtime(ts))


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def _turn_table(conv: ConversationRecord) -> Table:
    table = Table(title=Text(f"conversation {conv.conversation_id}"), show_lines=False)
    for col in ("turn", "start", "TTFT ms", "prompt", "local", "remote", "bytes", "xfer ms", "verdict",
                "reason", "fix"):
        table.add_column(col, overflow="fold")
    for t in conv.turns:
        # Text, not markup: reasons quote log lines, and "[id]" would be read as a style tag.
        table.add_row(str(t.turn), _start(t.start_ts), _fmt(t.ttft_ms, ".1f"), _fmt(t.prompt_tokens),
                      _fmt(t.local_hit_tokens), _fmt(t.remote_tokens), _fmt(t.transfer_bytes),
                      _fmt(t.transfer_ms, ".1f"), f"{t.verdict.value} ({t.confidence.value})", Text(t.reason),
                      Text(t.fix))
    return table


def _turn_json(t: TurnRecord) -> dict[str, Any]:
    return t.to_json_dict()


def _progress_fn(console: Console, enabled: bool) -> tuple[Progress | None, Any]:
    if not enabled:
        return None, None
    bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                   TimeRemainingColumn(), console=console, transient=True)
    task = bar.add_task("reading logs", total=None)

    def update(done: int, total: int) -> None:
        if total >= PROGRESS_MIN_BYTES:
            bar.update(task, completed=done, total=total)

    return bar, update


def _note_unrecognised(stats: LineStats) -> None:
    names = stats.unrecognised_files
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        click.echo(f"note: ignored {len(names)} file(s) in no known log format (client, router/proxy, vLLM, "
                   f"kvdiag events): {shown}", err=True)


@click.command("explain")
@click.argument("logs", nargs=-1, required=True)
@click.option("--conversation-id", "--conversation", "conversation_id", help="Explain this conversation's turns.")
@click.option("--all", "all_conversations", is_flag=True, help="Every conversation, worst first, with counts.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--no-progress", is_flag=True, help="Never show a progress bar.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, writable=True),
              help="Also draw the conversation(s) as a swimlane timeline in this self-contained HTML file.")
@click.option("--decoder-ttl", type=float, help="decoder_kv_blocks_ttl (s) to draw on the timeline.")
def explain(logs: tuple[str, ...], conversation_id: str | None, all_conversations: bool, as_json: bool,
            no_progress: bool, html_path: str | None, decoder_ttl: float | None) -> None:
    """Explain KV reuse per turn from client, router/proxy, prefill and decode LOGS (globs, folders, .gz).

    Exit codes: 0 success, 2 conversation (or, with --all, any conversation) not found, 1 unreadable input.
    """
    if bool(conversation_id) == all_conversations:
        raise click.UsageError("give exactly one of --conversation-id ID or --all")
    err = Console(stderr=True)
    bar, update = _progress_fn(err, not no_progress and sys.stderr.isatty())
    stats = LineStats()
    try:
        if bar is not None:
            bar.start()
        try:
            if conversation_id:
                convs = [explain_conversation(logs, conversation_id, progress=update, stats=stats)]
            else:
                convs = load_turns(logs, progress=update, stats=stats)
        finally:
            if bar is not None:
                bar.stop()
    except ConversationNotFoundError as exc:
        _note_unrecognised(stats)
        click.echo(f"Error: {exc}. Check the id, or add the client/router logs that carry it.", err=True)
        sys.exit(2)
    except UnreadableLogError as exc:
        raise click.ClickException(f"{exc}. Fix the path or permissions, or leave the file out.") from None
    if stats.corrupt:
        first = f" (first: {stats.notes[0]})" if stats.notes else ""
        click.echo(f"note: skipped {stats.corrupt} corrupt line(s){first}", err=True)
    _note_unrecognised(stats)
    if not conversation_id and not convs:
        click.echo("Error: no conversations found in the logs given. Pass the client, router/proxy, prefill and "
                   "decode logs (files, globs or a folder); docs/verdicts.md lists the formats read.", err=True)
        sys.exit(2)
    if html_path:
        try:
            written = render_conversations_html(convs, html_path, decoder_ttl=decoder_ttl,
                                                title=f"kvdiag explain: {conversation_id or 'all conversations'}")
        except OSError as exc:
            raise click.ClickException(f"cannot write {html_path}: {exc}. Pick a writable path.") from None
        click.echo(f"timeline: {written}", err=True)
    out = Console(width=200) if not sys.stdout.isatty() else Console()
    if conversation_id:
        conv = convs[0]
        if as_json:
            click.echo(json.dumps(conv.to_json_dict(), indent=2))
            return
        out.print(_turn_table(conv))
        if conv.missing_sources:
            out.print(Text(f"missing log sources: {', '.join(conv.missing_sources)}"))
        return
    counts = Counter(t.verdict.value for c in convs for t in c.turns)
    if as_json:
        click.echo(json.dumps({"verdict_counts": dict(counts.most_common()),
                               "conversations": [c.to_json_dict() for c in convs]}, indent=2))
        return
    summary = Table(title="verdict counts")
    summary.add_column("verdict")
    summary.add_column("turns", justify="right")
    for name, n in counts.most_common():
        summary.add_row(name, str(n))
    out.print(summary)
    table = Table(title=f"{len(convs)} conversations, worst first")
    for col in ("conversation", "turns", "verdicts"):
        table.add_column(col, overflow="fold")
    for c in convs:
        table.add_row(Text(c.conversation_id), str(len(c.turns)),
                      " ".join(f"{t.turn}:{t.verdict.value}" for t in c.turns))
    out.print(table)


COMMANDS = (explain,)
