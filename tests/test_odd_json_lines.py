"""JSON lines that are odd but legal, or hostile, are read or counted, never a crash.

A number of thousands of digits, or JSON nested thousands deep: Python's ``json.loads`` raises ValueError (not
JSONDecodeError) for an integer past 4300 digits, and ``int()`` of such a digit string does too; deep nesting
raises RecursionError. Every reader of log lines catches both: the line is counted and skipped (or read without
that value), and the rest of the file is read. A JSON lines file whose first line is a whole array is JSON lines,
not one document.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pytest
from gen_logs_support import load_gen_logs

import kvdiag
from kvdiag.diagnostics import verdict_engine as engine
from kvdiag.diagnostics.detect import LogFile, detect, sniff_format
from kvdiag.diagnostics.json_logs import ClientStat, EventRecord, parse_json_numbered
from kvdiag.diagnostics.linestats import LineStats
from kvdiag.diagnostics.records import ConversationRecord
from kvdiag.diagnostics.scan import is_json_document
from kvdiag.diagnostics.turn_loader import summarize_conversations
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


def test_json_lines_whose_first_line_is_an_array_are_not_one_document(tmp_path: Path) -> None:
    # records written a batch to a line: the first line is a whole array and more lines follow. It was taken for
    # one --stats-json-output document, which it is not, and the whole file was one corrupt line
    path = tmp_path / "decode-events.jsonl"
    first = {**EVENT, "source": "decode", "event": "decode_request"}
    path.write_text(json.dumps([first, {**first, "turn": 2}]) + "\n" + json.dumps({**first, "turn": 3}) + "\n",
                    encoding="utf-8")
    assert not is_json_document(str(path))
    (f,) = detect([str(path)])
    run = engine.new_run([f])
    try:
        engine.load_files(run)
        engine.parse(run)
        assert run.con.execute("SELECT turn FROM ev ORDER BY n, turn").fetchall() == [(1,), (2,), (3,)]
        assert run.stats.corrupt == 0
    finally:
        run.con.close()
    # documents stay documents: pretty-printed, on one line, and one whose first line is longer than the sniff
    stat = {"conversation_id": "c", "ttft_ms": 5.0}
    for text in (json.dumps([stat, stat], indent=2), json.dumps([stat, stat]), json.dumps([stat] * 500) + "\n"):
        path.write_text(text, encoding="utf-8")
        assert is_json_document(str(path)), text[:40]


@pytest.mark.parametrize("name", ["proxy.log", "client.jsonl"])
def test_one_conversation_reads_a_file_whose_first_line_opens_a_bracket(tmp_path: Path, name: str) -> None:
    # A proxy log or event file whose first line starts with "[" and is no JSON value (a broken line, a bracketed
    # banner) is still lines: the one-conversation path reads it as explain --all does. Only a client-statistics
    # file can be one JSON document.
    load_gen_logs().generate(tmp_path, 60_000, seed=3, noise_per_turn=1)
    target = tmp_path / name
    assert target.exists(), f"the generated logs have no {name}"
    target.write_text("[a broken first line\n" + target.read_text(encoding="utf-8"), encoding="utf-8")
    assert is_json_document(str(target))  # (the case: the document sniff alone takes it for one)
    paths = sorted(str(p) for p in tmp_path.iterdir() if p.is_file())
    every = kvdiag.load_turns(paths)
    assert len(every) >= 3
    for conv in every[:6]:
        one = kvdiag.explain_conversation(paths, conv.conversation_id)
        assert [t.__dict__ for t in one.turns] == [t.__dict__ for t in conv.turns], conv.conversation_id


def test_router_events_batched_on_one_line_make_the_turns_they_make_apart(tmp_path: Path) -> None:
    load_gen_logs().generate(tmp_path, 60_000, seed=3, noise_per_turn=1)
    paths = sorted(str(p) for p in tmp_path.iterdir() if p.is_file())
    apart = {c.conversation_id: [(t.turn, t.verdict) for t in c.turns] for c in kvdiag.load_turns(paths)}
    router = tmp_path / "router-events.jsonl"
    lines = router.read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    # two router events of one conversation, next to each other, written as one array line
    i = next(k for k in range(len(records) - 1)
             if records[k]["conversation_id"] == records[k + 1]["conversation_id"])
    lines[i:i + 2] = [json.dumps(records[i:i + 2])]
    router.write_text("\n".join(lines) + "\n", encoding="utf-8")
    batched = {c.conversation_id: [(t.turn, t.verdict) for t in c.turns] for c in kvdiag.load_turns(paths)}
    conv = records[i]["conversation_id"]
    assert batched[conv] == apart[conv]


_EVENT_FILES = ("router-events.jsonl", "client.jsonl", "prefill-events.jsonl")


def _turns_by_file(convs: list[ConversationRecord]) -> dict[str, list[dict[str, object]]]:
    """Each conversation's turns, their evidence as the files it cites (the lines differ when records that were
    one to a line are gathered into an array)."""
    return {c.conversation_id: [{**t.__dict__, "evidence": sorted(Path(e.source.split(":")[0]).name
                                                                    for e in t.evidence)}
                                for t in c.turns] for c in convs}


def _generated(tmp_path: Path, seed: int, *, stock: bool = False
               ) -> tuple[list[str], dict[str, list[dict[str, object]]], pa.Table]:
    """A generated log set (``stock``: without the event files), its turns (_turns_by_file) and its turn table."""
    load_gen_logs().generate(tmp_path, 60_000, seed=seed, noise_per_turn=1)
    for name in _EVENT_FILES if stock else ():
        (tmp_path / name).unlink()
    paths = sorted(str(p) for p in tmp_path.iterdir() if p.is_file())
    return paths, _turns_by_file(kvdiag.load_turns(paths)), kvdiag.load_turn_table(paths)


def _records(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _one_conversation_agrees(paths: list[str], every: list[ConversationRecord]) -> None:
    """One conversation's explain gives the records ``every`` (explain --all) gives, each line cited once."""
    for conv in every[:4]:
        one = kvdiag.explain_conversation(paths, conv.conversation_id)
        assert [t.__dict__ for t in one.turns] == [t.__dict__ for t in conv.turns]
        for t in one.turns:
            cited = [e.source for e in t.evidence]
            assert len(cited) == len(set(cited)), cited


@pytest.mark.parametrize("seed", [1, 2])
def test_every_event_file_batched_into_arrays_gives_the_turns_and_table_of_one_event_per_line(
        tmp_path: Path, seed: int) -> None:
    paths, apart, table_apart = _generated(tmp_path, seed)
    rng = random.Random(seed)
    batched_lines = 0
    for name in _EVENT_FILES:
        f = tmp_path / name
        records = _records(f)
        out, i = [], 0
        while i < len(records):
            k = rng.randint(1, 4)
            out.append(json.dumps(records[i:i + k]) if k > 1 else json.dumps(records[i]))
            batched_lines += k > 1 and i + 1 < len(records)
            i += k
        f.write_text("\n".join(out) + "\n", encoding="utf-8")
    assert batched_lines > 10
    batched = kvdiag.load_turns(paths)
    assert _turns_by_file(batched) == apart
    assert kvdiag.load_turn_table(paths).equals(table_apart)
    _one_conversation_agrees(paths, batched)


@pytest.mark.parametrize("seed", [1, 2])
def test_event_files_pretty_printed_as_one_json_array_give_the_turns_of_one_event_per_line(
        tmp_path: Path, seed: int) -> None:
    # json.dump(events, f, indent=2): an export, or a shipper writing one document. Before, its lines were read
    # one by one, each counted corrupt, and the turns its events make were lost.
    paths, apart, table_apart = _generated(tmp_path, seed)
    summaries_apart = [(s.conversation_id, s.verdicts) for s in summarize_conversations(paths)]
    starts: dict[str, list[int]] = {}
    for name in _EVENT_FILES:
        records = _records(tmp_path / name)
        text = json.dumps(records, indent=2)
        (tmp_path / name).write_text(text + "\n", encoding="utf-8")
        starts[name] = [n for n, line in enumerate(text.splitlines(), start=1) if line == "  {"]
        assert len(starts[name]) == len(records)
    stats = LineStats()
    every = kvdiag.load_turns(paths, stats=stats)
    assert _turns_by_file(every) == apart
    assert stats.corrupt == 0
    assert kvdiag.load_turn_table(paths).equals(table_apart)
    assert [(s.conversation_id, s.verdicts) for s in summarize_conversations(paths)] == summaries_apart
    # each event cited at the line its element opens on
    cited = {(Path(p).name, int(n)) for c in every for t in c.turns for e in t.evidence
             for p, n in [e.source.rsplit(":", 1)] if Path(p).name in starts}
    assert cited and all(n in starts[name] for name, n in cited)
    _one_conversation_agrees(paths, every)


def test_an_event_document_that_is_no_valid_json_is_read_as_lines(tmp_path: Path) -> None:
    # a pretty-printed array cut short (a file still being written): its whole lines are read as lines, so the
    # events written one to a line after it are not lost, and the fragments are counted
    events = [{**EVENT, "turn": k, "request_id": f"r{k}"} for k in (1, 2)]
    path = tmp_path / "client.jsonl"
    path.write_text(json.dumps(events, indent=2)[:-5] + "\n" + json.dumps({**EVENT, "turn": 3, "request_id": "r3"})
                    + "\n", encoding="utf-8")
    files = detect([str(path)])
    assert files[0].fmt == "events"
    stats = LineStats()
    convs = kvdiag.load_turns([str(path)], stats=stats)
    assert [t.turn for c in convs for t in c.turns] == [3]
    assert stats.corrupt > 0


@pytest.mark.parametrize("indent", [None, 2])
def test_client_statistics_as_one_json_document_give_the_turns_of_json_lines(tmp_path: Path, indent: int | None
                                                                              ) -> None:
    # vLLM's --stats-json-output is one document; written compact, every record is on line 1, and they must not
    # be taken for each other (each is known by its line and its place in it)
    # (stock: the statistics alone say what each turn's client saw)
    paths, apart, table_apart = _generated(tmp_path, 4, stock=True)
    stats_file = tmp_path / "client-stats.jsonl"
    stats_file.write_text(json.dumps(_records(stats_file), indent=indent) + "\n", encoding="utf-8")
    assert is_json_document(str(stats_file))
    every = kvdiag.load_turns(paths)
    assert _turns_by_file(every) == apart
    assert kvdiag.load_turn_table(paths).equals(table_apart)
    _one_conversation_agrees(paths, every)
