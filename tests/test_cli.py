"""The CLI surface: every command loads lazily, has help text, and the public facade stays small."""

from __future__ import annotations

import os
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from kvdiag.cli.main import LAZY_COMMANDS, SUMMARIES, cli


@pytest.mark.parametrize("name", sorted(LAZY_COMMANDS))
def test_every_command_loads_and_has_help(name: str) -> None:
    ctx = click.Context(cli)
    command = cli.get_command(ctx, name)
    assert command is not None, f"{name} is not defined by kvdiag.cli.{LAZY_COMMANDS[name]}"
    assert command.help, f"{name} has no help text"
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_every_command_has_a_summary_that_fits_80_columns() -> None:
    assert set(SUMMARIES) == set(LAZY_COMMANDS)
    width = max(map(len, SUMMARIES))
    for name, summary in SUMMARIES.items():
        assert 2 + width + 2 + len(summary) <= 80, f"{name}'s summary overflows 80 columns: {summary!r}"


_HELP_PROBE = """
import contextlib, io, sys, click
from kvdiag.cli.main import cli
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        cli(["--help"])
    except SystemExit:
        pass
loaded = sorted(m for m in sys.modules if m.startswith("kvdiag.cli.cmd_"))
cli.get_command(click.Context(cli), "report")  # (control: the probe sees a command's import)
print(out.getvalue())
print("LOADED", ",".join(loaded), "cmd_report" in ",".join(m for m in sys.modules if m.startswith("kvdiag.cli.")))
"""


def test_top_level_help_lists_every_command_without_importing_them() -> None:
    out = subprocess.run([sys.executable, "-c", _HELP_PROBE], capture_output=True, text=True, check=True).stdout
    listing, _, probe = out.rpartition("LOADED ")
    loaded, control = probe.split()[:-1], probe.split()[-1]
    assert loaded == [], f"kvdiag --help imported {loaded}"
    assert control == "True", "the probe cannot see a command module's import: the check above proves nothing"
    for name, summary in SUMMARIES.items():
        assert f"  {name}" in listing and summary in listing, f"{name} missing from kvdiag --help"


_COMMAND_HELP_PROBE = """
import contextlib, importlib, io, sys
from kvdiag.cli.main import cli
heavy = ("pandas", "pyarrow", "duckdb", "_duckdb", "aiohttp", "redis", "numpy")
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        cli([*sys.argv[1:], "--help"])
    except SystemExit:
        pass
loaded = [m for m in heavy if m in sys.modules]
for module in ("kvdiag.diagnostics.report", "pandas", "kvdiag.sim.server", "kvdiag.router.store"):
    importlib.import_module(module)  # (control: the probe sees what a run imports)
print("Usage:" in out.getvalue(), ",".join(loaded) or "-", all(m in sys.modules for m in heavy))
"""


@pytest.mark.parametrize("args", [[name] for name in SUMMARIES] + [["sim", "prefill"], ["sim", "fleet"]],
                         ids=lambda a: "-".join(a))
def test_command_help_loads_no_heavy_library(args: list[str]) -> None:
    # `--help` of a command is read while deciding what to type: it loads no table, HTTP or Redis library
    out = subprocess.run([sys.executable, "-c", _COMMAND_HELP_PROBE, *args], capture_output=True, text=True,
                         check=True).stdout.split()
    name = " ".join(args)
    assert out[0] == "True", f"kvdiag {name} --help printed no usage"
    assert out[1] == "-", f"kvdiag {name} --help imported {out[1]}: its command module should import them lazily"
    assert out[2] == "True", "the probe cannot see those libraries being imported: the check above proves nothing"


def test_unknown_command_is_a_usage_error() -> None:
    result = CliRunner().invoke(cli, ["no-such-command"])
    assert result.exit_code == 2
    assert "No such command" in result.output


def test_cli_import_does_not_pull_heavy_dependencies() -> None:
    heavy = "('pandas', 'duckdb', 'grafana_foundation_sdk')"
    code = f"import sys, kvdiag.cli.main; print(','.join(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


_BLAS_PROBE = """
import os, sys, click
from kvdiag.cli.main import cli
before = os.environ.get("OPENBLAS_NUM_THREADS")
try:  # (the command loads its libraries as it runs: a missing log fails after that)
    cli(["report", "/nonexistent/kvdiag-blas-probe.log", "--no-cache", "--no-progress"], standalone_mode=False)
except click.ClickException:
    pass
assert "numpy" in sys.modules, "report no longer loads numpy: this probe measures nothing"
# OpenBLAS's workers carry the process's name (pyarrow's jemalloc thread has its own)
names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
print(names.count(open("/proc/self/comm").read()), os.environ.get("OPENBLAS_NUM_THREADS") == before)
"""


def _blas_probe(env_value: str | None) -> tuple[int, bool]:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if env_value is not None:
        env["OPENBLAS_NUM_THREADS"] = env_value
    out = subprocess.run([sys.executable, "-c", _BLAS_PROBE], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    return int(out[0]), out[1] == "True"


def test_command_import_starts_no_blas_threads_and_restores_the_environment() -> None:
    threads, restored = _blas_probe(None)
    assert threads == 1, f"{threads} threads after loading report: numpy's OpenBLAS started its pool"
    assert restored, "OPENBLAS_NUM_THREADS leaked into the environment the command's children inherit"
    # a user's own setting is kept; and on two or more cores it shows the probe can see OpenBLAS's pool
    threads, restored = _blas_probe("2")
    assert restored
    if (os.cpu_count() or 1) >= 2:
        assert threads > 1, "the probe cannot see OpenBLAS's threads: the check above proves nothing"


def test_cli_reference_doc_is_current() -> None:
    from pathlib import Path

    from kvdiag.cli.reference import render_cli_reference

    doc = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
    assert doc.read_text() == render_cli_reference(), (
        "docs/cli.md is stale: run `.venv/bin/python -m kvdiag.cli.reference --out docs/cli.md`")
