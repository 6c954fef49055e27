"""explain over stock-format logs (fixtures built from real lines) and the CLI contract."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import traceback
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvdiag.cli.main import cli
from kvdiag.diagnostics.turn_loader import (
    ConversationNotFoundError,
    UnreadableLogError,
    explain_conversation,
    load_turns,
)
from kvdiag.schema.verdicts import Confidence, Verdict

STOCK = Path(__file__).parent / "fixtures" / "logs" / "stock_run"


def _verdicts(conv_id: str, paths: list[str] | None = None) -> list[tuple[int, str, str]]:
    conv = explain_conversation(paths or [str(STOCK)], conv_id)
    return [(t.turn, t.verdict.value, t.confidence.value) for t in conv.turns]


def test_expired_remote_read_confirmed_by_p_decline() -> None:
    conv = explain_conversation([str(STOCK)], "CONV_ID_1")
    t1, t2 = conv.turns
    assert (t1.verdict, t1.confidence) == (Verdict.FIRST_TURN, Confidence.CONFIRMED)
    assert t1.ttft_ms == 160.5 and t1.prompt_tokens == 100
    assert (t2.verdict, t2.confidence) == (Verdict.EXPIRED_REMOTE_READ, Confidence.CONFIRMED)
    assert t2.request_id == "84a2d3ebd7e34a2da27da6524603c95c"
    # P failed the request on the declined read, but the benchmark recorded turn 2 (it writes a
    # RequestStats record only for a valid response): the client got its answer
    assert "the turn failed" not in t2.reason and "yet the client got its answer" in t2.reason
    sources = [e.source for e in t2.evidence]
    assert sources[0].endswith("proxy.log:10") and any(s.endswith("prefill.log:4") for s in sources)
    assert any(s.endswith("decode.log:3") for s in sources)  # D released the handle the turn was given
    assert t2.ttft_ms == 171.0
    # 35 s is far inside D's logged 480 s TTL: the hint points at clocks, not at raising the TTL
    assert t2.gap_s == 35.44
    assert t2.fix.startswith("gap 35 s is well inside decoder_kv_blocks_ttl 480 s: check the clock")


def test_transfer_failed_names_failure_type() -> None:
    conv = explain_conversation([str(STOCK)], "CONV_ID_2")
    t2 = conv.turns[1]
    assert (t2.verdict, t2.confidence, t2.failure_type) == (Verdict.TRANSFER_FAILED, Confidence.CONFIRMED,
                                                            "handshake_failed")


def test_router_entry_expired_from_stale_line() -> None:
    assert _verdicts("CONV_ID_3") == [(1, "router_entry_expired", "confirmed")]


def test_all_matches_single_conversation_path() -> None:
    convs = {c.conversation_id: c for c in load_turns([str(STOCK)])}
    assert set(convs) == {"CONV_ID_1", "CONV_ID_2", "CONV_ID_3"}
    for conv_id, conv in convs.items():
        single = explain_conversation([str(STOCK)], conv_id)
        assert [t.to_json_dict() for t in single.turns] == [t.to_json_dict() for t in conv.turns]


def test_hashed_conversation_ids_join(tmp_path: Path) -> None:
    import hashlib
    shutil.copytree(STOCK, tmp_path / "run")
    proxy = tmp_path / "run" / "proxy.log"
    tag = hashlib.sha256(b"CONV_ID_1").hexdigest()[:16]
    proxy.write_text(proxy.read_text().replace("conv=CONV_ID_1:", f"conv={tag}:"))
    assert _verdicts("CONV_ID_1", [str(tmp_path / "run")])[1][1] == "expired_remote_read"


def test_not_found_lists_closest_ids() -> None:
    with pytest.raises(ConversationNotFoundError) as info:
        explain_conversation([str(STOCK)], "CONV_ID_7")
    assert "CONV_ID_1" in info.value.closest


def test_unreadable_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "prefill.log.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(UnreadableLogError, match=r"prefill\.log\.gz"):
        load_turns([str(bad)])


def test_missing_sources_listed(tmp_path: Path) -> None:
    shutil.copy(STOCK / "proxy.log", tmp_path / "proxy.log")
    conv = explain_conversation([str(tmp_path)], "CONV_ID_1")
    assert conv.missing_sources == ["client", "prefill", "decode"]
    t2 = conv.turns[1]
    assert t2.verdict is Verdict.UNKNOWN and "prefill log" in t2.reason


def test_cli_json_shape_and_exit_codes(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(cli, ["explain", "--json", "--conversation-id", "CONV_ID_1", str(STOCK)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert set(doc) == {"conversation_id", "turns", "missing_sources"}
    turn = doc["turns"][1]
    for key in ("turn", "request_id", "verdict", "confidence", "reason", "evidence", "ttft_ms", "prompt_tokens",
                "local_hit_tokens", "remote_tokens", "transfer_bytes", "transfer_ms"):
        assert key in turn
    assert turn["evidence"][0]["source"].endswith("proxy.log:10")
    res = runner.invoke(cli, ["explain", "--conversation-id", "nope-id", str(STOCK)])
    assert res.exit_code == 2 and "not found" in res.output
    res = runner.invoke(cli, ["explain", "--all", str(tmp_path / "absent.log")])
    assert res.exit_code == 1 and "absent.log" in res.output
    res = runner.invoke(cli, ["explain", "--all", str(STOCK)])
    assert res.exit_code == 0 and "expired_remote_read" in res.output and "verdict counts" in res.output


def test_corrupt_lines_are_counted_skipped_and_reported(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(STOCK, run)
    good = ('{"v":1,"ts":1.0,"source":"router","event":"router_turn","conversation_id":"CONV_ID_2","turn":2,'
            '"request_id":"8265fbbe12ab4cd0a1b2c3d4e5f60718","outcome":"transfer_failed","failure_type":"handshake_failed"}')
    (run / "router-events.jsonl").write_bytes(good.encode() + b'\n{"v":1, "ts": trunc\xff\n')
    res = CliRunner().invoke(cli, ["explain", "--all", "--json", str(run)])
    assert res.exit_code == 0, res.output
    assert "skipped 1 corrupt line(s)" in res.stderr and "router-events.jsonl:2" in res.stderr
    doc = json.loads(res.stdout)
    conv2 = next(c for c in doc["conversations"] if c["conversation_id"] == "CONV_ID_2")
    assert conv2["turns"][1]["evidence"][0]["source"].endswith("router-events.jsonl:1")
    assert doc["verdict_counts"]["transfer_failed"] == 1


@pytest.mark.parametrize("conv_id", ["café ☕ 1", "c1"])
def test_prefilter_finds_escaped_ids_and_only_exact_ones(tmp_path: Path, conv_id: str) -> None:
    lines = []
    for conv in (conv_id, "c10", "c1x"):
        for turn, outcome in ((1, "first_turn"), (2, "remote_hit")):
            lines.append(json.dumps({"v": 1, "ts": float(turn), "source": "router", "event": "router_turn",
                                     "conversation_id": conv, "turn": turn, "request_id": f"{conv}-r{turn}",
                                     "outcome": outcome}))
    (tmp_path / "router-events.jsonl").write_text("\n".join(lines) + "\n")
    conv = explain_conversation([str(tmp_path)], conv_id)
    assert [(t.turn, t.request_id, t.verdict.value) for t in conv.turns] == [
        (1, f"{conv_id}-r1", "first_turn"), (2, f"{conv_id}-r2", "remote_hit")]


def test_rotated_and_gzipped_logs_keep_their_order(tmp_path: Path) -> None:
    import gzip

    lines = (STOCK / "proxy.log").read_bytes().splitlines(keepends=True)
    (tmp_path / "proxy.log.1").write_bytes(b"".join(lines[:5]))  # older half, rotated
    (tmp_path / "proxy.log").write_bytes(b"".join(lines[5:]))
    for name in ("prefill.log", "decode.log"):
        with gzip.open(tmp_path / f"{name}.gz", "wb") as fh:
            fh.write((STOCK / name).read_bytes())
    shutil.copy(STOCK / "client-stats.json", tmp_path)
    want = {c: _verdicts(c) for c in ("CONV_ID_1", "CONV_ID_2")}
    for conv_id, verdicts in want.items():
        assert _verdicts(conv_id, [str(tmp_path / "*")]) == verdicts
    assert {c.conversation_id: [(t.turn, t.verdict.value, t.confidence.value) for t in c.turns]
            for c in load_turns([str(tmp_path)]) if c.conversation_id in want} == want


def test_cli_html_timeline_has_one_mark_per_turn(tmp_path: Path) -> None:
    out = tmp_path / "conv.html"
    res = CliRunner().invoke(cli, ["explain", "--conversation-id", "CONV_ID_1", "--html", str(out), str(STOCK)])
    assert res.exit_code == 0, res.output
    page = out.read_text()
    conv = json.loads(CliRunner().invoke(cli, ["explain", "--json", "--conversation-id", "CONV_ID_1",
                                               str(STOCK)]).output)
    assert page.count('data-turn="') >= len(conv["turns"]) > 0
    # Self-contained: nothing is fetched at view time (the SVG namespace URI is not a fetch).
    assert re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", page) is None


def test_unrecognised_inputs_are_named_and_an_empty_all_exits_2(tmp_path: Path) -> None:
    (tmp_path / "noise.log").write_bytes(b"\x00\xffnot a log\n" * 10)
    (tmp_path / "notes.txt").write_text("hello\n")
    res = CliRunner().invoke(cli, ["explain", "--all", "--no-progress", str(tmp_path)])
    assert res.exit_code == 2, res.output
    assert "ignored 2 file(s) in no known log format" in res.stderr and "noise.log" in res.stderr
    assert "no conversations found" in res.stderr and "Traceback" not in res.output
    res = CliRunner().invoke(cli, ["explain", "--all", "--no-progress", str(tmp_path), str(STOCK)])
    assert res.exit_code == 0 and "notes.txt" in res.stderr and "CONV_ID_1" in res.stdout


def test_truncated_gzip_error_says_so(tmp_path: Path) -> None:
    import gzip
    whole = gzip.compress((STOCK / "proxy.log").read_bytes())
    (tmp_path / "proxy.log.gz").write_bytes(whole[: len(whole) // 2])
    res = CliRunner().invoke(cli, ["explain", "--all", "--no-progress", str(tmp_path)])
    assert res.exit_code == 1 and "proxy.log.gz" in res.output and "truncated or corrupt gzip" in res.output


def test_fix_hint_follows_the_missing_metadata_cause() -> None:
    from kvdiag.diagnostics.fix_hints import FixContext as Context
    from kvdiag.diagnostics.fix_hints import fix_hint as _fix_hint
    from kvdiag.diagnostics.records import TurnRecord

    ctx = Context(decode_ttl_s=10.0)
    cases = {"... carried no kv_transfer_params (not_streamed)": "PR #40186",
             "... bidirectional KV transfer is off on D (bidirectional_off_on_decode)": "bidirectional_kv_xfer: true",
             "turn 2 ended without D's kv_transfer_params (client_disconnected)": "client left",
             "turn 1 failed (status=aborted), so no handle was stored (decode_failed)": "previous turn's failure"}
    for reason, want in cases.items():
        rec = TurnRecord("c", 3, verdict=Verdict.METADATA_NOT_RETURNED, reason=reason, fix="generic")
        _fix_hint(rec, ctx)
        assert want in rec.fix, (reason, rec.fix)
    late = TurnRecord("c", 2, verdict=Verdict.EXPIRED_REMOTE_READ, gap_s=7.0)
    _fix_hint(late, ctx)
    assert late.fix.startswith("gap 7 s vs decoder_kv_blocks_ttl 10 s") and "raise the TTL" in late.fix


def test_a_conversation_whose_lines_are_all_corrupt_is_not_found_and_says_why(tmp_path: Path) -> None:
    # ts is no finite number on each of its lines: every one is skipped, and the error says so
    line = '{"v":1,"source":"client","event":"client_turn","conversation_id":"c9","turn":%d,"ts":Infinity}\n'
    (tmp_path / "client-events.jsonl").write_text("".join(line % t for t in (1, 2)))
    res = CliRunner().invoke(cli, ["explain", "--conversation-id", "c9", str(tmp_path)])
    assert res.exit_code == 2 and "not found" in res.stderr
    assert "skipped 2 corrupt line(s)" in res.stderr and "client-events.jsonl:1: field 'ts'" in res.stderr


def test_a_start_time_no_clock_can_show_is_drawn_as_missing(tmp_path: Path) -> None:
    # a producer's 1e308 (finite, so the schema takes it) must not stop the table from printing
    with (tmp_path / "client-events.jsonl").open("w") as fh:
        for turn, ts in ((1, 1_764_400_000.0), (2, 1e308)):
            fh.write(json.dumps({"v": 1, "source": "client", "event": "client_turn", "conversation_id": "c1",
                                 "turn": turn, "ts": ts}) + "\n")
    for extra in ([], ["--wide"]):
        res = CliRunner().invoke(cli, ["explain", "--conversation-id", "c1", *extra, str(tmp_path)])
        assert res.exit_code == 0, res.output
        rows = [ln.split() for ln in res.stdout.splitlines() if ln.strip().startswith(("1 ", "2 ", "│ 1", "│ 2"))]
        assert len(rows) == 2 and "-" in rows[1][:4], res.stdout


def test_a_turn_after_requests_that_all_failed_that_fails_too_is_request_failed(tmp_path: Path) -> None:
    # F: no request ever answered (no "Prefill done", no handle stored): each turn failed, the later ones too,
    # not "first turn" again; G: turn 1 failed, turn 2 answered: turn 2 is a first turn (nothing to retrieve)
    head = "2026-11-29 06:55:0{} [INFO] disagg_proxy: "
    lines = [head.format(0) + "Ready: 1 prefill, 1 decode instances"]
    for i, rid in enumerate(("f1" * 16, "f2" * 16, "f3" * 16), start=1):
        lines.append(head.format(i) + f"[{rid}] conv=F: cache MISS")
    lines.append(head.format(4) + f"[{'g1' * 16}] conv=G: cache MISS")
    lines.append(head.format(5) + f"[{'g2' * 16}] conv=G: cache MISS")
    lines.append(head.format(5) + f"[{'g2' * 16}] Prefill done in 40ms")
    lines.append(head.format(6) + f"conv=G: cached D blocks (remote_request_id=chatcmpl-{'g2' * 16}-0a0b0c0d, "
                                   "blocks=3)")
    (tmp_path / "proxy.log").write_text("\n".join(lines) + "\n")
    failed = [(n, "request_failed", "inferred") for n in (1, 2, 3)]
    assert _verdicts("F", [str(tmp_path)]) == failed
    assert _verdicts("G", [str(tmp_path)]) == [(1, "request_failed", "inferred"), (2, "first_turn", "inferred")]
    reason = explain_conversation([str(tmp_path)], "F").turns[2].reason
    assert reason.startswith("every earlier request of the conversation failed, and so did this one")


def test_unreadable_file_is_named_for_one_conversation(tmp_path: Path) -> None:
    # the prefilter reads files on worker threads: the error still reaches the caller, naming the file
    for f in STOCK.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    # its head reads (the format is sniffed first), the rest is cut off: only the prefilter's read fails
    body = (tmp_path / "decode.log").read_bytes()
    whole = gzip.compress(body + b"".join(b"INFO 11-29 09:11:06 [loggers.py:123] Engine 000: idle %d\n" % i
                                          for i in range(400_000)))
    (tmp_path / "decode.log").unlink()
    (tmp_path / "decode.log.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UnreadableLogError, match=r"decode\.log\.gz") as info:
        explain_conversation([str(tmp_path)], "CONV_ID_1")
    frames: set[str] = set()
    exc: BaseException | None = info.value
    while exc is not None:
        frames |= {frame.name for frame in traceback.extract_tb(exc.__traceback__)}
        exc = exc.__context__
    assert "_parallel" in frames  # (and not the sniffing of the head)
