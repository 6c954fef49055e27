"""``kvdiag demo``: run the loopback P/D testbed, print the summary and where the logs are."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("demo")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for every component's logs (default: a new folder under ./demo-out/).")
@click.option("--keep-going", is_flag=True,
              help="Skip a phase that fails (e.g. an admin switch) instead of stopping the demo.")
def demo(out_dir: Path | None, keep_going: bool) -> None:
    """Start P, D and the router on loopback, produce every verdict, stop everything, summarize."""
    # (the testbed loads only for a run: `--help` stays quick)
    from kvdiag.demo.run import DemoError, default_out_dir, run_demo  # noqa: PLC0415
    from kvdiag.demo.scenarios import produced_by  # noqa: PLC0415
    from kvdiag.diagnostics.terminal_safe import safe_console  # noqa: PLC0415

    out = out_dir or default_out_dir()
    console = safe_console()
    console.print("kvdiag demo: emulated vLLM prefill + decode and the router on 127.0.0.1 ...")
    try:
        result = run_demo(out, keep_going=keep_going)
    except DemoError as exc:
        raise click.ClickException(str(exc)) from None
    result.summary.render(console, how=produced_by(result.timings))
    result.agents.render(console)
    for note in result.notes:
        console.print(f"[yellow]note: {note}[/yellow]")
    console.print(f"Done in {result.elapsed_s:.1f} s; every process stopped. Logs: {result.out_dir}/")
    if result.report_path is not None:
        console.print(f"HTML report: {result.report_path}")
    console.print(f"Next: kvdiag explain {result.out_dir} --conversation-id demo-late")
    if result.summary.missing and not keep_going:
        raise click.ClickException("the demo did not produce every verdict (see the red line above); "
                                   f"inspect the logs in {result.out_dir}/ or rerun with --keep-going")
    if result.agents.engine_wrong_kv_tokens and not keep_going:
        raise click.ClickException("P loaded KV computed for other tokens behind the router (see the red line "
                                   f"above); inspect {result.out_dir}/agent-router-events.jsonl")


COMMANDS = (demo,)
