"""Log text on a terminal: an escape sequence or control character in a conversation id, a reason, an evidence
line or a file name is shown, never obeyed; kvdiag's own styles still reach the terminal."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console
from rich.text import Text

from kvdiag.check import run as check_run
from kvdiag.cli import cmd_check
from kvdiag.cli.main import cli
from kvdiag.diagnostics.records import ConversationRecord, Evidence, TurnRecord
from kvdiag.diagnostics.terminal import explain_all_renderables, explain_renderables, render_text
from kvdiag.diagnostics.terminal_safe import SHOWN_AS, printable, safe_console
from kvdiag.schema.verdicts import Confidence, Verdict

FIXTURE = Path(__file__).parent / "fixtures" / "logs" / "real_vllm_info"
# set the window title, clear the screen, CSI by its C1 form, a carriage return over the line, a bell
HOSTILE = "\x1b]0;PWNED\x07\x1b[2J\x9b31m\rX\x08"
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _conversation() -> ConversationRecord:
    conv = ConversationRecord(conversation_id=f"agent{HOSTILE}")
    conv.turns.append(TurnRecord(
        conversation_id=conv.conversation_id, turn=1, request_id=f"req{HOSTILE}", start_ts=1_796_121_215.0,
        verdict=Verdict.FIRST_TURN, confidence=Confidence.CONFIRMED, reason=f"said {HOSTILE} by P", fix="none",
        evidence=[Evidence(f"/logs/p{HOSTILE}.log:7", f"Received request chatcmpl-1{HOSTILE}: params")]))
    return conv


def _plain_rich(renderables: list[object], width: int) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False, legacy_windows=False)
    for r in renderables:
        console.print(r)
    return buf.getvalue()


def test_printable_shows_every_control_but_tab_and_newline() -> None:
    assert printable("a\tb\nc") == "a\tb\nc"
    assert printable(HOSTILE) == HOSTILE.translate({ord(c): SHOWN_AS for c in HOSTILE if CONTROL.match(c)})
    assert not CONTROL.search(printable("".join(map(chr, range(0x100)))))


def test_explain_output_holds_no_control_character() -> None:
    conv = _conversation()
    for width in (80, 120):
        for renderables in (explain_renderables(conv, width=width), explain_renderables(conv, width=width, wide=True),
                            explain_all_renderables([conv.summary()])):
            text = render_text(renderables, width)
            assert not CONTROL.search(text), repr(text)
            assert SHOWN_AS in text and "PWNED" in text  # (shown, not dropped)
            # the control: rich alone passes the escape sequences through
            assert "\x1b" in _plain_rich(list(renderables), width)


def test_kvdiag_styles_still_reach_a_terminal() -> None:
    buf = io.StringIO()
    console = safe_console(file=buf, width=80, force_terminal=True, color_system="standard")
    console.print(Text("ok", style="red"), Text(f"x{HOSTILE}y"))
    out = buf.getvalue()
    assert "\x1b[31mok" in out  # kvdiag's own style
    assert "\x1b[2J" not in out and "\x1b]0;" not in out and "\x9b" not in out and "\r" not in out


def test_the_cli_shows_a_hostile_conversation_id(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    shutil.copytree(FIXTURE, logs)
    conv_id = "agent-a" + HOSTILE.replace("\r", "")  # (a CR would end the log line)
    proxy = logs / "proxy.log"
    proxy.write_text(proxy.read_text(encoding="utf-8").replace("conv=agent-a:", f"conv={conv_id}:"), encoding="utf-8")
    exe = Path(sys.executable).with_name("kvdiag")
    run = subprocess.run([str(exe), "explain", str(logs), "--conversation", conv_id, "--no-progress"],
                         capture_output=True, text=True, check=True)
    assert "agent-a" in run.stdout and SHOWN_AS in run.stdout
    assert not CONTROL.search(run.stdout + run.stderr), repr(run.stdout[:300])
    # --json keeps the id exactly (JSON escapes it)
    as_json = subprocess.run([str(exe), "explain", str(logs), "--conversation", conv_id, "--json"],
                             capture_output=True, text=True, check=True).stdout
    assert '"conversation_id": "agent-a\\u001b]0;PWNED\\u0007' in as_json


def test_kvdiag_check_shows_what_a_server_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvdiag check quotes the servers' answers in its findings: a hostile answer is shown, not obeyed."""
    class _Report:
        def exit_code(self, strict: bool) -> int:
            return 0

    async def fake_run(options: object) -> _Report:
        return _Report()

    monkeypatch.setattr(check_run, "run_check", fake_run)
    monkeypatch.setattr(cmd_check, "render_text", lambda report, **kw: f"model: m{HOSTILE}\nok\n")
    result = CliRunner().invoke(cli, ["check", "--router", "http://127.0.0.1:9", "--passive"])
    assert result.exit_code == 0, result.output
    assert "model: m" in result.output and "\nok\n" in result.output
    assert not CONTROL.search(result.output), repr(result.output)
