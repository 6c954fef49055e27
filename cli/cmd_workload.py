"""``kvdiag workload``: the multi-turn agent client (options in, summary out)."""

from __future__ import annotations

from pathlib import Path

import click

from kvdiag.sim.agent_plan import AGENT_PROFILES, AgentSpec, AgentSpecError
from kvdiag.sim.workload_plan import GAP_DISTRIBUTIONS, WorkloadConfig, WorkloadConfigError

_SHARE = click.FloatRange(0.0, 1.0)
_CHAT_ONLY = ("tool_share", "regenerate_share", "duplicate_share", "edit_share", "disconnect_share", "no_id_share",
              "long_gap_share")


@click.command("workload", epilog="""\b
Examples:
  kvdiag workload -u http://127.0.0.1:8000 -n 8 --regenerate-share 0.2
  kvdiag workload --profile coding-agent -n 2   # tool loop past 32k tokens
  kvdiag workload --profile reasoning-chat --hide-reasoning""")
@click.option("--profile", "-p", default="chat", show_default=True, type=click.Choice(("chat", *AGENT_PROFILES)),
              help="chat: the classic user/assistant workload; the others: agent traffic (docs/workload.md).")
@click.option("--url", "-u", default="http://127.0.0.1:8000", show_default=True,
              help="Router (or engine) base URL; posts to {url}/v1/chat/completions.")
@click.option("--model", "-m", default="Qwen/Qwen3-32B", show_default=True,
              help="Served model name sent in each request (the sim's default).")
@click.option("--conversations", "-n", default=4, show_default=True, type=int, help="Number of conversations.")
@click.option("--turns", "-t", default=None, type=int,
              help="Turns per conversation [default: 4; agent profiles: the profile's own range].")
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
              help="Share of later turns that first edit the history from its first message (-> prefix_mismatch).")
@click.option("--disconnect-share", default=0.0, type=_SHARE, show_default=True,
              help="Share of later turns dropped after the first token (next turn -> metadata_not_returned).")
@click.option("--send-reasoning", is_flag=True,
              help="Agent profiles: send the reasoning back as reasoning_content (default: not sent back).")
@click.option("--hide-reasoning", is_flag=True,
              help="Agent profiles: ask for include_reasoning: false (the client never sees the trace).")
@click.option("--no-thinking", is_flag=True,
              help='Agent profiles: chat_template_kwargs {"enable_thinking": false} (Qwen3 answers without a trace).')
@click.option("--size-scale", default=1.0, show_default=True, type=click.FloatRange(0.01, 4.0),
              help="Agent profiles: message and tool-output sizes (and turn ranges, up to 1) times this.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for plans, text and sampling.")
@click.option("--duration-limit", default=300.0, show_default=True, type=float,
              help="Stop the whole run after this many seconds.")
@click.option("--request-timeout", default=60.0, show_default=True, type=float, help="Per-request timeout, s.")
@click.option("--output", "-o", "client_log", default="client.jsonl", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path), help="Client log (client_turn JSON lines), appended.")
@click.option("--stats-json-output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write vLLM multi-turn benchmark RequestStats records (JSON array).")
def workload(client_log: Path, stats_json_output: Path | None, profile: str, turns: int | None, send_reasoning: bool,
             hide_reasoning: bool, no_thinking: bool, size_scale: float, **options: object) -> None:
    """Run a multi-turn agent workload and write the client log."""
    agent = profile != "chat"
    if agent:
        ctx = click.get_current_context()
        given = [f"--{name.replace('_', '-')}" for name in _CHAT_ONLY
                 if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise click.ClickException(f"{', '.join(given)}: chat-profile options; agent profiles plan their own "
                                       "turns (see docs/workload.md)")
    elif send_reasoning or hide_reasoning or no_thinking:
        raise click.ClickException("--send-reasoning/--hide-reasoning/--no-thinking apply to agent profiles: add "
                                   "--profile, e.g. --profile reasoning-chat")
    if send_reasoning and hide_reasoning:
        raise click.ClickException("--send-reasoning and --hide-reasoning exclude each other (hidden reasoning "
                                   "cannot be sent back)")
    try:
        config = WorkloadConfig(turns=turns if turns is not None and not agent else 4, **options)  # type: ignore[arg-type]
        config.validate()
        spec = None
        if agent:
            spec = AgentSpec(profile=profile, conversations=config.conversations, seed=config.seed, turns=turns or 0,
                             scale=size_scale, gap_mean=config.gap_mean, prefix=config.conversation_prefix)
            spec.validate()
    except (WorkloadConfigError, AgentSpecError) as exc:
        raise click.ClickException(f"{exc}. See `kvdiag workload --help`.") from None
    # (the HTTP client loads only for a run: `--help` stays quick)
    import asyncio  # noqa: PLC0415

    from kvdiag.sim.agent_client import AgentOptions, run_agent_workload  # noqa: PLC0415
    from kvdiag.sim.workload import run_workload  # noqa: PLC0415

    if spec is not None:
        agent_options = AgentOptions(send_reasoning=send_reasoning, hide_reasoning=hide_reasoning,
                                     thinking=not no_thinking)
        result = asyncio.run(run_agent_workload(config, spec, options=agent_options, client_log=client_log,
                                                stats_json=stats_json_output))
    else:
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
