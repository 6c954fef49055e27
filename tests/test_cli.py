"""The CLI surface: every command loads lazily, has help text, and the public facade stays small."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from kvdiag.cli.main import LAZY_COMMANDS, cli


@pytest.mark.parametrize("name", sorted(LAZY_COMMANDS))
def test_every_command_loads_and_has_help(name: str) -> None:
    ctx = click.Context(cli)
    command = cli.get_command(ctx, name)
    assert command is not None, f"{name} is not defined by kvdiag.cli.{LAZY_COMMANDS[name]}"
    assert command.help, f"{name} has no help text"
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_unknown_command_is_a_usage_error() -> None:
    result = CliRunner().invoke(cli, ["no-such-command"])
    assert result.exit_code == 2
    assert "No such command" in result.output


def test_cli_import_does_not_pull_heavy_dependencies() -> None:
    heavy = "('pandas', 'duckdb', 'grafana_foundation_sdk')"
    code = f"import sys, kvdiag.cli.main; print(','.join(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_cli_reference_doc_is_current() -> None:
    from pathlib import Path

    from kvdiag.cli.reference import render_cli_reference

    doc = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
    assert doc.read_text() == render_cli_reference(), (
        "docs/cli.md is stale: run `.venv/bin/python -m kvdiag.cli.reference --out docs/cli.md`")
