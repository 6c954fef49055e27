"""The ``kvdiag`` command group.

Commands live in ``kvdiag.cli.cmd_<module>`` and are imported only when invoked, so starting an
engine or the router never pays for pandas or the dashboards SDK.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator

import click

from kvdiag import __version__

# Every command, with what ``kvdiag --help`` lists for it. Listing the commands' own help would import every
# command's module, and with them pandas, the simulator and the dashboards SDK: 2.7 s for a help screen. Each line
# fits 80 columns beside the names.
SUMMARIES: dict[str, str] = {
    "advise": "Recommend the decode TTL and kv_recompute_threshold from logs.",
    "alerts": "Prometheus alert rules for KV reuse, KV transfer and the router.",
    "check": "Probe a live P/D deployment and report what blocks KV reuse.",
    "dashboards": "Grafana dashboards for KV reuse, KV transfer and router health.",
    "demo": "Run P, D and the router on loopback and produce every verdict.",
    "explain": "Explain KV reuse per turn (or for one conversation) from logs.",
    "report": "Outcome mix, TTFT reused vs recomputed, transfers and gaps.",
    "router": "Stateful P/D router that carries D's KV handle between turns.",
    "sim": "Emulated vLLM prefill/decode engines (no GPU, no model).",
    "workload": "Run a multi-turn agent workload and write the client log.",
}
# command name -> module under kvdiag.cli that defines it (in its COMMANDS tuple)
LAZY_COMMANDS: dict[str, str] = {name: f"cmd_{name}" for name in SUMMARIES}


class LazyGroup(click.Group):
    """A click group that imports a subcommand's module on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(LAZY_COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None or cmd_name not in LAZY_COMMANDS:
            return command
        with single_thread_blas():
            module = importlib.import_module(f"kvdiag.cli.{LAZY_COMMANDS[cmd_name]}")
        for candidate in getattr(module, "COMMANDS", ()):
            if candidate.name == cmd_name:
                return candidate  # type: ignore[no-any-return]
        return None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands and their summaries, without importing the commands' modules."""
        rows = []
        for name in self.list_commands(ctx):
            if name in SUMMARIES:
                rows.append((name, SUMMARIES[name]))
            elif (command := self.get_command(ctx, name)) is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(formatter.width)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


BLAS_THREADS_VAR = "OPENBLAS_NUM_THREADS"


@contextlib.contextmanager
def single_thread_blas() -> Iterator[None]:
    """While a command's module is imported, numpy's OpenBLAS (read once, when numpy loads) is told to use
    one thread, unless the user chose a number; the variable is restored afterwards, so the processes a
    command starts (vLLM, the router) inherit the environment as it was."""
    # OpenBLAS starts a thread per core as numpy loads (70 ms of CPU on 2 cores, more on big hosts); nothing
    # in kvdiag does linear algebra.
    if BLAS_THREADS_VAR in os.environ:
        yield
        return
    os.environ[BLAS_THREADS_VAR] = "1"
    try:
        yield
    finally:
        os.environ.pop(BLAS_THREADS_VAR, None)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvdiag")
def cli() -> None:
    """kvdiag: see, explain and tune KV reuse across turns in vLLM P/D serving."""


if __name__ == "__main__":
    cli()
