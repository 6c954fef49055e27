"""Child processes of the demo: start a kvdiag component, wait for its ready file, stop its whole group.

Each component runs in its own session (process group), so stopping it reaches any process it
started too: SIGTERM to the group, then SIGKILL after a grace period, then a /proc scan that proves
nothing of the group is left.

Usage::

    proc = Component.start("prefill", ["sim", "prefill", "--port", "0"], out_dir)
    port = proc.ready["port"]
    proc.stop()
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

from kvdiag.schema.errors import KVDiagError

# Runs the kvdiag CLI with the interpreter running the demo (no reliance on PATH or the venv script).
_CLI_BOOTSTRAP: Final = "from kvdiag.cli.main import cli; cli(prog_name='kvdiag')"
READY_TIMEOUT_S: Final = 20.0
STOP_GRACE_S: Final = 5.0


class ComponentError(KVDiagError, RuntimeError):
    """A component did not start (or stop) as it should; the message carries its console output."""


def kvdiag_command(args: list[str]) -> list[str]:
    """argv that runs ``kvdiag <args>`` with this interpreter."""
    return [sys.executable, "-c", _CLI_BOOTSTRAP, *args]


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is ``pgid``, from /proc."""
    members: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # fields after the ")" that ends the command name: state ppid pgrp ...
        rest = stat[stat.rfind(")") + 2:].split()
        if len(rest) >= 3 and int(rest[2]) == pgid and rest[0] != "Z":
            members.append(int(entry.name))
    return members


@dataclass
class Component:
    """One running kvdiag component (engine or router) in its own process group."""

    name: str
    argv: list[str]
    process: subprocess.Popen[bytes]
    console: Path
    ready_file: Path
    ready: dict[str, Any] = field(default_factory=dict)
    _console_fh: IO[bytes] | None = None

    @classmethod
    def start(cls, name: str, args: list[str], out_dir: Path, *, ready_timeout: float = READY_TIMEOUT_S,
              env: dict[str, str] | None = None, console_name: str | None = None) -> Component:
        """Start ``kvdiag <args> --ready-file <out>/.<name>.ready`` and wait until it is serving."""
        comp = cls.launch(name, args, out_dir, env=env, console_name=console_name)
        comp.wait_ready(ready_timeout)
        return comp

    @classmethod
    def launch(cls, name: str, args: list[str], out_dir: Path, *, env: dict[str, str] | None = None,
               console_name: str | None = None) -> Component:
        """Start the process without waiting (several can boot at once); then call :meth:`wait_ready`.

        Its output goes to ``<out>/<name>.console.log`` unless ``console_name`` names another file.
        """
        ready_file = out_dir / f".{name}.ready"
        ready_file.unlink(missing_ok=True)
        console = out_dir / (console_name or f"{name}.console.log")
        argv = kvdiag_command([*args, "--ready-file", str(ready_file)])
        fh = console.open("ab")
        try:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                       start_new_session=True, env={**os.environ, **(env or {})})
        except OSError:
            fh.close()
            raise
        return cls(name=name, argv=argv, process=process, console=console, ready_file=ready_file, _console_fh=fh)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait for the ready file; on failure stop the process and raise ComponentError."""
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ComponentError(f"{self.name} exited with code {self.process.returncode} before it was "
                                     f"ready; its output ({self.console}):\n{_tail(self.console)}")
            try:
                data = json.loads(self.ready_file.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                time.sleep(0.05)
                continue
            if isinstance(data, dict) and isinstance(data.get("port"), int):
                self.ready = data
                return
            time.sleep(0.05)
        raise ComponentError(f"{self.name} wrote no ready file within {timeout:.0f} s; its output "
                             f"({self.console}):\n{_tail(self.console)}")

    @property
    def port(self) -> int:
        """The HTTP port from the ready file."""
        return int(self.ready["port"])

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``grace``; raise if anything survives."""
        pgid = self.process.pid  # start_new_session: the child leads its own group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=grace)
        deadline = time.monotonic() + grace
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if group_members(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=grace)
        if self._console_fh is not None:
            self._console_fh.close()
            self._console_fh = None
        self.ready_file.unlink(missing_ok=True)
        for _ in range(40):
            if not group_members(pgid):
                return
            time.sleep(0.05)
        raise ComponentError(f"{self.name}: processes {group_members(pgid)} survived SIGKILL")
