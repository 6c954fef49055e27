"""``kvdiag check``: probe a live deployment and say, per fact, whether KV reuse across turns can work."""

from __future__ import annotations

import json
import shutil
import sys

import click

from kvdiag.check.findings import EXIT_USAGE
from kvdiag.check.render import render_text
from kvdiag.diagnostics.terminal_safe import printable


@click.command("check")
@click.option("--router", "-r", metavar="URL", help="The router's base URL (kvdiag router), e.g. http://router:8000.")
@click.option("--prefill", "-p", metavar="URL", help="P's OpenAI API base URL (one pod, not a load-balanced Service).")
@click.option("--decode", "-d", metavar="URL", help="D's OpenAI API base URL (one pod).")
@click.option("--model", "-m", help="Served model name to probe (default: the one P and D have in common).")
@click.option("--api-key", envvar="OPENAI_API_KEY", show_envvar=True, help="Bearer token for the router and engines.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report instead of text.")
@click.option("--passive", is_flag=True,
              help="Send no completion traffic: reachability, models, block sizes (when exposed), the router's TTL "
                   "gauges and clocks only. For readiness probes.")
@click.option("--strict", is_flag=True, help="Exit 1 on warnings and 'cannot tell' results too.")
@click.option("--verbose", "-v", is_flag=True, help="Show the evidence of every check and the skipped ones.")
@click.option("--reply-tokens", default=96, show_default=True, type=int,
              help="Tokens D generates per probe turn; keep it above P's kv_recompute_threshold (64).")
@click.option("--timeout", default=60.0, show_default=True, type=float, help="Seconds allowed per request.")
@click.option("--max-clock-skew", default=2.0, show_default=True, type=float,
              help="Largest wall-clock difference (s) between this machine and each component.")
def check(router: str | None, prefill: str | None, decode: str | None, model: str | None, api_key: str | None,
          as_json: bool, passive: bool, strict: bool, verbose: bool, reply_tokens: int, timeout: float,
          max_clock_skew: float) -> None:
    """Probe a live P/D deployment with a short synthetic conversation and report what blocks KV reuse.

    Give the router, or P and D directly, or all three (most complete). With P and D the check plays
    the router for two turns and reads P's and D's /metrics; with the router it sends three turns
    with a conversation id and reads the router's counters. Each check passes, fails with the fix,
    or says "cannot tell" when the fact is not visible from outside.

    \b
    Exit codes:
      0  nothing failed (with --strict: nothing warned or was undecided either)
      1  a check failed: a misconfiguration was found
      2  bad usage
      3  a component did not answer
    \b
    Examples:
      kvdiag check --router http://router:8000 \\
          --prefill http://p-0.p:8000 --decode http://d-0.d:8000
      kvdiag check --router http://localhost:8000 --passive   # no traffic
    """
    # (the probes and their HTTP client load only for a run: `--help` stays quick)
    import asyncio  # noqa: PLC0415

    from kvdiag.check import run as check_run  # noqa: PLC0415

    try:
        options = check_run.CheckOptions(router=router, prefill=prefill, decode=decode, model=model,
                                         api_key=api_key, timeout=timeout, reply_tokens=reply_tokens,
                                         max_clock_skew=max_clock_skew, passive=passive).validate()
    except check_run.OptionsError as exc:
        click.echo(f"Error: {exc}. See `kvdiag check --help`.", err=True)
        sys.exit(EXIT_USAGE)
    report = asyncio.run(check_run.run_check(options))
    if as_json:
        click.echo(json.dumps(report.to_json_dict(strict), indent=2))
    else:
        width = min(shutil.get_terminal_size((80, 24)).columns, 120)
        # (findings quote what the servers answered: shown, never obeyed by the terminal)
        click.echo(printable(render_text(report, width=width, verbose=verbose, strict=strict)), nl=False)
    sys.exit(report.exit_code(strict))


COMMANDS = (check,)
