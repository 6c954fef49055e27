"""A number of thousands of digits, or JSON nested thousands deep, in a log line is one corrupt line, not a crash.

Python's ``json.loads`` raises ValueError (not JSONDecodeError) for an integer past 4300 digits, and ``int()``
of such a digit string does too; deep nesting raises RecursionError. Every reader of log lines catches both: the
line is counted and skipped (or read without that value), and the rest of the file is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdiag.diagnostics import verdict_engine as engine
from kvdiag.diagnostics.detect import LogFile, detect, sniff_format
from kvdiag.diagnostics.json_logs import ClientStat, EventRecord, parse_json_numbered
from kvdiag.diagnostics.linestats import LineStats
from kvdiag.diagnostics.vllm_log_parser import parse_vllm_numbered
from kvdiag.schema.events import EventFormatError, parse_event

HUGE = "9" * 5000
DEEP = "[" * 100_000 + "]" * 100_000
EVENT = {"v": 1, "ts": 1764400000.5, "source": "client", "event": "client_turn", "conversation_id": "c", "turn": 1,
         "request_id": "r"}


def test_the_inputs_are_what_python_refuses() -> None:
    # control: each hostile line does make json.loads raise what a JSONDecodeError handler would miss
    with pytest.raises(ValueError) as huge:
        json.loads('{"ttft_ms": ' + HUGE + "}")
    assert not isinstance(huge.value, json.JSONDecodeError)
    with pytest.raises(RecursionError):
        json.loads(DEEP)


@pytest.mark.parametrize("bad", ['{"conversation_id": "c", "ttft_ms": ' + HUGE + "}", DEEP])
def test_json_logs_counts_the_line_corrupt_and_reads_on(bad: str) -> None:
    good = json.dumps({"conversation_id": "c", "ttft_ms": 5.0})
    stats = LineStats()
    records = list(parse_json_numbered([(1, bad.encode()), (2, good.encode())], "x", stats))
    assert [(r.lineno, r.ttft_ms) for r in records if isinstance(r, ClientStat)] == [(2, 5.0)]
    assert stats.corrupt == 1


def test_parse_event_names_the_line() -> None:
    with pytest.raises(EventFormatError, match="not valid JSON") as exc:
        parse_event('{"v": 1, "turn": ' + HUGE + "}", path="e.jsonl", lineno=7)
    assert "e.jsonl" in str(exc.value) and "7" in str(exc.value)


def test_the_engine_reads_an_event_file_holding_one(tmp_path: Path) -> None:
    # the wrongly typed line goes to json_logs, which meets the huge number there
    path = tmp_path / "client.jsonl"
    bad = json.dumps({**EVENT, "turn": "2"})[:-1] + ', "prompt_tokens": ' + HUGE + "}"
    path.write_text(json.dumps(EVENT) + "\n" + bad + "\n" + DEEP + "\n", encoding="utf-8")
    assert [f.fmt for f in detect([str(path)])] == ["events"]
    run = engine.new_run([LogFile(str(path), "events", "client")])
    try:
        engine.load_files(run)
        engine.parse(run)
        assert run.con.execute("SELECT n, conversation_id, turn FROM ev").fetchall() == [(1, "c", 1)]
        assert run.stats.corrupt == 2
    finally:
        run.con.close()


def test_a_file_opening_with_one_is_still_recognised() -> None:
    head = ('{"conversation_id": "c", "ttft_ms": ' + HUGE + "}\n" + json.dumps(EVENT) + "\n").encode()
    assert sniff_format(head) == "events"
    assert sniff_format(("[" + '{"a": ' + HUGE + "}]").encode()) != ""  # (no crash sniffing a JSON array)


def test_a_vllm_line_with_a_huge_pid_is_read() -> None:
    line = f"(EngineCore_DP0 pid={HUGE}) INFO 11-29 06:56:01 [scheduler.py:3764] hello\n"
    (rec,) = parse_vllm_numbered([(1, line.encode())], "p.log")
    assert (rec.proc, rec.pid, rec.msg) == ("EngineCore_DP0", None, "hello")
    assert not isinstance(rec, EventRecord)
