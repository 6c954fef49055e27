"""The ``kvdiag`` command group. Subcommands register themselves from their own modules."""

from __future__ import annotations

import importlib

import click

from kvdiag import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvdiag")
def cli() -> None:
    """kvdiag: see, explain and tune KV reuse across turns in vLLM P/D serving."""


def _register() -> None:
    # Each command module is optional at import time so one broken extra never hides the rest.
    for name in ("sim", "workload", "router", "demo", "explain", "report", "dashboards", "alerts"):
        try:
            module = importlib.import_module(f"kvdiag.cli.cmd_{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"kvdiag.cli.cmd_{name}":
                continue
            raise
        for command in getattr(module, "COMMANDS", ()):
            cli.add_command(command)


_register()
