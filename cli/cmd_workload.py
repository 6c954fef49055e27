"""``kvdiag workload``: the multi-turn agent client (options in, summary out)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from kvdiag.sim.workload import run_workload
from kvdiag.sim.workload_plan import GAP_DISTRIBUTIONS, WorkloadConfig, WorkloadConfigError

_SHARE = click.FloatRange(0.0, 1.0)


@click.command("workload")
@click.option("--url", "-u", default="http://127.0.0.1:8000", show_default=True,
              help="Router (or engine) base URL; posts to {url}/v1/chat/completions.")
@click.option("--model", "-m", default="Qwen/Qwen3-32B", show_default=True,
              help="Served model name sent in each request (the sim's default).")
@click.option("--conversations", "-n", default=4, show_default=True, type=int, help="Number of conversations.")
@click.option("--turns", "-t", default=4, show_default=True, type=int, help="Turns per conversation.")
@click.option("--concurrency", "-c", default=4, show_default=True, type=int, help="Requests in flight at most.")
@click.option("--stream/--no-stream", default=True, show_default=True, help="Stream replies (SSE).")
@click.option("--send-conversation-id/--no-send-conversation-id", default=True, show_default=True,
              help="Send a top-level conversation_id (the router keys reuse on it).")
@click.option("--no-id-share", default=0.0, type=_SHARE, show_default=True,
              help="Share of conversations sent without a conversation_id (-> no_conversation_id).")
@click.option("--gap-mean", default=0.2, show_default=True, type=float, help="Mean inter-turn gap, seconds.")
@click.option("--gap-dist", default="exp", show_default=True, type=click.Choice(GAP_DISTRIBUTIONS),
              help="Inter-turn gap distribution.")
@click.option("--long-gap-share", default=0.0, type=_SHARE, show_default=True,
              help="Share of gaps replaced by --long-gap (e.g. beyond the TTL).")
@click.option("--long-gap", default=0.0, type=float, show_default=True, help="Long gap length, seconds.")
@click.option("--new-tokens", default=48, show_default=True, type=int,
              help="Tokens in each appended user message or tool result.")
@click.option("--max-tokens", default=16, show_default=True, type=int, help="Reply length in tokens.")
@click.option("--tool-share", default=0.5, type=_SHARE, show_default=True,
              help="Share of later turns that append a tool result instead of a user message.")
@click.option("--regenerate-share", default=0.0, type=_SHARE, show_default=True,
              help="Share of later turns that re-send the previous prompt (-> local_hit).")
@click.option("--duplicate-share", default=0.0, type=_SHARE, show_default=True,
              help="Share of later turns sent twice at once (-> concurrent_turn).")
@click.option("--edit-share", default=0.0, type=_SHARE, show_default=True,
              help="Share of later turns that first strip an earlier assistant message (-> prefix_mismatch).")
@click.option("--disconnect-share", default=0.0, type=_SHARE, show_default=True,
              help="Share of later turns dropped after the first token (next turn -> metadata_not_returned).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for plans, text and sampling.")
@click.option("--duration-limit", default=300.0, show_default=True, type=float,
              help="Stop the whole run after this many seconds.")
@click.option("--request-timeout", default=60.0, show_default=True, type=float, help="Per-request timeout, s.")
@click.option("--output", "-o", "client_log", default="client.jsonl", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path), help="Client log (client_turn JSON lines), appended.")
@click.option("--stats-json-output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write vLLM multi-turn benchmark RequestStats records (JSON array).")
def workload(client_log: Path, stats_json_output: Path | None, **options: object) -> None:
    """Run a multi-turn agent workload and write the client log."""
    try:
        config = WorkloadConfig(**options)  # type: ignore[arg-type]
        config.validate()
    except WorkloadConfigError as exc:
        raise click.ClickException(f"{exc}. See `kvdiag workload --help`.") from None
    result = asyncio.run(run_workload(config, client_log=client_log, stats_json=stats_json_output))
    counts = ", ".join(f"{k}={v}" for k, v in sorted(result.status_counts().items())) or "none"
    click.echo(f"{len(result.records)} requests in {result.elapsed_s:.1f} s ({counts})"
               + (" - stopped at --duration-limit" if result.truncated else ""))
    for turn, p50 in result.ttft_p50_by_turn().items():
        click.echo(f"  turn {turn}: TTFT p50 {p50:.1f} ms")
    click.echo(f"client log: {client_log}")
    if stats_json_output is not None:
        click.echo(f"request stats: {stats_json_output}")
    if result.records and all(r.event.status != "ok" for r in result.records):
        first = result.records[0].event
        error = first.attrs.get("error") or "no reply"
        if first.http_status is None:  # nothing answered at all
            raise click.ClickException(f"every request failed ({error}); is a server listening at {config.url}? "
                                       "Start one with `kvdiag sim prefill` or `kvdiag router`.")
        raise click.ClickException(f"every request failed: HTTP {first.http_status} {error}; check --model "
                                   "(the served model name) and the server's log.")


COMMANDS = (workload,)
