"""Proxy-log, client-stats and event parsing, format detection, and fuzzing of every parser."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdiag.diagnostics.detect import LogReadError, detect, expand_paths, sniff_format
from kvdiag.diagnostics.json_logs import ClientStat, EventRecord, parse_json_document, parse_json_lines
from kvdiag.diagnostics.linestats import MAX_LINE_CHARS, LineStats
from kvdiag.diagnostics.proxy_log_parser import parse_proxy_log
from kvdiag.diagnostics.vllm_log_parser import parse_vllm_log
from kvdiag.schema.events import TurnEvent

STOCK = Path(__file__).parent / "fixtures" / "logs" / "stock_run"


def test_proxy_lines_parse_to_records() -> None:
    with (STOCK / "proxy.log").open("rb") as fh:
        recs = list(parse_proxy_log(fh, "proxy.log"))
    kinds = [r.kind for r in recs]
    assert kinds[:4] == ["ready", "miss", "prefill_done", "cached"]
    assert recs[1].fields == {"rid": "0f6a4c2e9b1d4e7a8c3b2a1908f7e6d5", "conv": "CONV_ID_1"}
    assert recs[3].fields["remote"] == "chatcmpl-0f6a4c2e9b1d4e7a8c3b2a1908f7e6d5-5b1c9e2a"
    assert recs[3].fields["blocks"] == "5"
    assert recs[7].kind == "no_conversation_id" and recs[7].fields["rid"] == "2b3c4d5e6f7a48b9c0d1e2f3a4b5c6d7"
    hit = recs[8]
    assert hit.kind == "hit" and hit.fields == {"conv": "CONV_ID_1", "age": "35.2"}
    stale = next(r for r in recs if r.kind == "stale")
    assert stale.fields == {"conv": "CONV_ID_3", "age": "512.0", "ttl": "450.0"}
    assert recs[2].fields["ms"] == "95" and recs[2].lineno == 3


def test_benchmark_stats_document_and_lines() -> None:
    doc = (STOCK / "client-stats.json").read_bytes()
    stats = list(parse_json_document(doc, "client-stats.json"))
    assert [(s.conversation_id, s.input_num_turns, s.ttft_ms) for s in stats] == [
        ("CONV_ID_1", 1, 160.5), ("CONV_ID_2", 1, 150.1), ("CONV_ID_1", 3, 171.0)]
    line = json.dumps({"conversation_id": "c9", "ttft_ms": 12.5, "input_num_tokens": 7})
    (rec,) = parse_json_lines([line.encode()], "generic.jsonl")
    assert isinstance(rec, ClientStat) and rec.ttft_ms == 12.5 and rec.input_num_tokens == 7


def test_events_parse_and_bad_event_is_counted() -> None:
    good = TurnEvent(ts=1.0, source="router", event="router_turn", conversation_id="c1", turn=2,
                     outcome="remote_hit").to_json()
    bad = json.dumps({"v": 1, "ts": 1.0, "source": "router", "event": "router_turn", "outcome": "nope"})
    stats = LineStats()
    recs = list(parse_json_lines([good, "{not json", bad, "", good], "ev.jsonl", stats))
    assert [type(r) for r in recs] == [EventRecord, EventRecord]
    assert recs[1].lineno == 5 and recs[0].event.outcome == "remote_hit"
    assert stats.corrupt == 2 and any("ev.jsonl:3" in n and "outcome" in n for n in stats.notes)


def test_detect_formats_gz_and_rotation_order(tmp_path: Path) -> None:
    (tmp_path / "proxy.log.1").write_bytes((STOCK / "proxy.log").read_bytes())
    (tmp_path / "proxy.log").write_bytes(b"")
    with gzip.open(tmp_path / "prefill.log.2.gz", "wb") as fh:
        fh.write((STOCK / "prefill.log").read_bytes())
    (tmp_path / "prefill.log").write_bytes((STOCK / "prefill.log").read_bytes())
    (tmp_path / "ev.jsonl").write_text(TurnEvent(ts=1.0, source="client", event="client_turn").to_json() + "\n")
    files = {Path(f.path).name: f for f in detect([str(tmp_path)])}
    assert files["prefill.log.2.gz"].fmt == "vllm" and files["prefill.log.2.gz"].role == "prefill"
    assert files["proxy.log.1"].fmt == "proxy" and files["ev.jsonl"].fmt == "events"
    order = [Path(p).name for p in expand_paths([str(tmp_path / "*")])]
    assert order.index("prefill.log.2.gz") < order.index("prefill.log")
    assert order.index("proxy.log.1") < order.index("proxy.log")


def test_missing_input_is_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.log")
    try:
        detect([missing])
    except LogReadError as exc:
        assert missing in str(exc)
    else:
        raise AssertionError("a missing file must raise")
    assert sniff_format(b"hello\nworld\n") == "unknown"


_lines = st.lists(st.one_of(st.binary(max_size=300), st.text(max_size=300).map(lambda s: s.encode()),
                            st.sampled_from([
                                b"(EngineCore pid=1) WARNING 11-29 06:55:40 [pull_worker.py:161] Declining expired "
                                b"remote read for ",
                                b"ERROR 11-29 06:57:32 [b.py:1] NIXL transfer failure: x | Context: {'a': ",
                                b"2026-11-29 06:55:01 [INFO] disagg_proxy: [r] conv=",
                                b'{"v": 1, "ts": 1, "source": "router", "event": "router_turn", "turn": ',
                                b"\xff\xfe\x00\r", b"\x1b[31m"])),
                  max_size=30)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_lines)
def test_fuzz_parsers_never_crash(lines: list[bytes]) -> None:
    for parse in (parse_vllm_log, parse_proxy_log, parse_json_lines):
        stats = LineStats()
        out = list(parse([ln + b"\n" for ln in lines], "fuzz.log", stats))
        assert len(out) <= max(stats.records, 0) + len(lines)
        assert stats.lines <= len(lines)


@settings(max_examples=30, deadline=None)
@given(st.binary(max_size=2000))
def test_fuzz_truncated_real_lines(cut: bytes) -> None:
    real = (Path(__file__).parent / "fixtures" / "logs" / "vllm_real_lines.log").read_bytes()
    mangled = real[: len(cut) % len(real)] + cut
    stats = LineStats()
    list(parse_vllm_log(mangled.splitlines(keepends=True), "m.log", stats))
    assert stats.records + stats.other <= stats.lines


def test_huge_and_invalid_lines_are_counted_and_rest_parsed() -> None:
    good = (b"WARNING 11-29 06:55:40 [pull_worker.py:161] Declining expired remote read for chatcmpl-a-12345678 "
            b"from engine e.\n")
    huge = b"INFO 11-29 06:55:40 [x.py:1] " + b"A" * (MAX_LINE_CHARS + 10) + b"\n"
    stats = LineStats()
    recs = list(parse_vllm_log([huge, b"\xff\xfe bad\n", good], "h.log", stats))
    assert recs[-1].kind == "declining_expired"
    assert stats.corrupt == 2 and "h.log:1" in stats.notes[0]


def test_prefilter_system_grep_and_python_fallback_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvdiag.diagnostics import scan

    lines = [f"INFO 11-29 06:55:{i % 60:02d} [x.py:1] Added request chatcmpl-r{i}.x-{i:08d}.\n" for i in range(3000)]
    lines[1500] = "no id here cmpl- but r7.x nothing\n"
    log = tmp_path / "e.log"
    log.write_text("".join(lines))
    with gzip.open(tmp_path / "e.log.gz", "wb") as fh:
        fh.write(log.read_bytes())
    needles = [b"r7.x", b"r2999.x", b"r1500.x"]
    fast = list(scan.grep_prefixed(str(log), b"cmpl-", needles))
    fixed = list(scan.grep_lines(str(log), needles))
    monkeypatch.setattr(scan, "GREP", None)
    slow = list(scan.grep_prefixed(str(log), b"cmpl-", needles))
    gz = list(scan.grep_prefixed(str(tmp_path / "e.log.gz"), b"cmpl-", needles))
    py_fixed = list(scan.grep_lines(str(log), needles))
    assert [n for n, _ in fast] == [8, 3000] and fast == slow == gz
    assert fixed == py_fixed and [n for n, _ in fixed] == [8, 1501, 3000]
    assert fast[0][1] == lines[7].encode()


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=4000), st.sampled_from(["prefill.log", "proxy.log", "ev.jsonl", "stats.json", "x.gz"]))
def test_fuzz_whole_pipeline_on_garbage_files(tmp_path: Path, data: bytes, name: str) -> None:
    from kvdiag.diagnostics.turn_loader import UnreadableLogError, load_turns

    real = (Path(__file__).parent / "fixtures" / "logs" / "vllm_real_lines.log").read_bytes()
    path = tmp_path / name
    path.write_bytes(data + real[: len(data)] + data[::-1])
    try:
        convs = load_turns([str(path)])
    except UnreadableLogError as exc:  # only a broken .gz may be unreadable, and it is named
        assert name == "x.gz" and name in str(exc)
    else:
        assert all(t.turn >= 1 for c in convs for t in c.turns)


def test_reference_proxy_history_lines() -> None:
    # Later revisions of disagg_proxy_multiturn.py check the request's history before offering a handle
    # and the reply's before storing one, and say so.
    rid = "4f1e5192-000f-400f-a00f-1e2f3a4bf18c"
    lines = [
        "2026-11-29 10:01:52 [INFO] disagg_proxy: conv=agent-g: cache MISS (request history changed)",
        f"2026-11-29 10:01:52 [INFO] disagg_proxy: [{rid}] conv=agent-g: cache MISS (request history changed)",
        f"2026-11-29 10:01:52 [INFO] disagg_proxy: [{rid}] conv=agent-g: cache MISS",
        "2026-11-29 10:02:02 [INFO] disagg_proxy: conv=agent-h: not caching D blocks because response history "
        "cannot be validated",
        f"2026-11-29 10:02:02 [INFO] disagg_proxy: [{rid}] not caching D blocks because response history cannot "
        "be validated",
    ]
    recs = list(parse_proxy_log(lines, "proxy.log"))
    assert [r.kind for r in recs] == ["miss_head", "miss", "miss", "not_cached", "not_cached"]
    assert recs[0].fields == {"conv": "agent-g", "why": "request history changed"}
    assert recs[1].fields == {"rid": rid, "conv": "agent-g", "why": "request history changed"}
    assert recs[2].fields == {"rid": rid, "conv": "agent-g"}
    assert recs[3].fields["conv"] == "agent-h" and "cannot be validated" in recs[3].fields["why"]
    assert recs[4].fields["rid"] == rid


def test_benchmark_console_output_is_not_client_statistics() -> None:
    console = (STOCK.parent / "real_vllm_info" / "bench.console.log").read_bytes()
    assert console.startswith(b"[transformers] ") and sniff_format(console) == "unknown"
    pretty = (STOCK.parent / "real_vllm_info" / "client-stats.json").read_bytes()
    assert pretty.startswith(b"[\n  {") and sniff_format(pretty) == "client_stats"
    assert sniff_format(pretty[:40]) == "client_stats"  # an element cut by the sniffed head is still JSON
