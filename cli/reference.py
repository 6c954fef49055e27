"""Generate docs/cli.md from the commands' own ``--help`` (a test regenerates and diffs it)."""

from __future__ import annotations

import argparse
from pathlib import Path

import click
from click.testing import CliRunner

from kvdiag.cli.main import cli


def _walk(group: click.Group, prefix: list[str]) -> list[list[str]]:
    ctx = click.Context(group)
    paths: list[list[str]] = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is None or command.hidden:
            continue
        paths.append([*prefix, name])
        if isinstance(command, click.Group):
            paths.extend(_walk(command, [*prefix, name]))
    return paths


def render_cli_reference() -> str:
    """Return the Markdown reference of every command, as its --help prints it."""
    runner = CliRunner()
    parts = ["# CLI reference", "", "Generated from each command's `--help` by `python -m kvdiag.cli.reference`; "
             "do not edit by hand.", ""]
    for path in [[], *_walk(cli, [])]:
        result = runner.invoke(cli, [*path, "--help"], prog_name="kvdiag", terminal_width=100)
        if result.exit_code != 0:
            raise RuntimeError(f"kvdiag {' '.join(path)} --help failed: {result.output}")
        parts += [f"## kvdiag {' '.join(path)}".rstrip(), "", "```text", result.output.rstrip(), "```", ""]
    return "\n".join(parts)


def main() -> None:
    """Write the reference to --out."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/cli.md"))
    args = parser.parse_args()
    args.out.write_text(render_cli_reference())


if __name__ == "__main__":
    main()
