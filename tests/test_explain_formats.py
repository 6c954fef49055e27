"""explain on the formats as real components write them: findings from runs with vLLM's reference proxy
and its multi-turn benchmark client, each on real-format inputs (real vLLM 0.33 lines, the proxy's
templates, the benchmark's RequestStats with ``time.perf_counter()`` start times and its console output).
"""

from __future__ import annotations

import calendar
import json
import shutil
from pathlib import Path

import pandas as pd
from click.testing import CliRunner

from kvdiag.cli.main import cli
from kvdiag.diagnostics.detect import sniff_format
from kvdiag.diagnostics.linestats import LineStats
from kvdiag.diagnostics.report import build_turn_table, load_turn_table, normalize_table
from kvdiag.diagnostics.turn_loader import explain_conversation, load_turns

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
REAL = FIXTURES / "real_vllm_0.33"
INFO_RUN = FIXTURES / "real_vllm_info"
CONSOLE = (INFO_RUN / "bench.console.log").read_text()
PROXY = "2026-11-29 {t} [INFO] disagg_proxy: {msg}\n"
RID1, RID2 = "5d1f0c2a-8b3e-4f6a-9c7d-2e1b0a9f8e7d", "6e2a1d3b-9c4f-4a7b-8d8e-3f2c1b0a9f8e"
D1 = f"chatcmpl-{RID1}-1a2b3c4d"


def _startup(path: Path) -> list[str]:
    """A real vLLM 0.33 log up to and including its 'Bidirectional KV transfer is enabled' line."""
    lines = path.read_text().splitlines(keepends=True)
    end = next(i for i, ln in enumerate(lines) if "Bidirectional KV transfer is enabled" in ln)
    return lines[:end + 1]


def _proxy(*rows: tuple[str, str]) -> str:
    return "".join(PROXY.format(t=t, msg=m) for t, m in rows)


TWO_TURNS = _proxy(
    ("09:30:00", "Ready: 1 prefill, 1 decode instances"),
    ("09:30:01", f"[{RID1}] conv=conv-1: cache MISS"),
    ("09:30:01", f"[{RID1}] Prefill done in 88ms"),
    ("09:30:02", f"conv=conv-1: cached D blocks (remote_request_id={D1}, blocks=5)"),
    ("09:30:12", "conv=conv-1: cache HIT (age=9.8s)"),
    ("09:30:12", f"[{RID2}] conv=conv-1: sending D's cached blocks to P (remote_request_id={D1})"),
    ("09:30:12", f"[{RID2}] Prefill done in 41ms"),
)


def _stats(*records: dict[str, object]) -> str:
    """RequestStats as the benchmark writes them (json.dump(..., indent=2))."""
    base = {"ttft_ms": 0.0, "tpot_ms": 9.5, "latency_ms": 0.0, "start_time_ms": 0.0, "input_num_turns": 1,
            "input_num_tokens": 0, "output_num_tokens": 40, "output_num_chunks": 39,
            "output_num_first_chunk_tokens": 1, "approx_cached_percent": 0.0, "conversation_id": "conv-1",
            "client_id": 0}
    return json.dumps([{**base, **r} for r in records], indent=2)


# Two turns measured by the benchmark: its clock is time.perf_counter() (~57 minutes after boot).
STATS = _stats({"ttft_ms": 151.2, "latency_ms": 610.4, "start_time_ms": 3_456_789.125, "input_num_tokens": 120},
               {"ttft_ms": 98.7, "latency_ms": 402.2, "start_time_ms": 3_467_801.5, "input_num_turns": 3,
                "input_num_tokens": 201, "approx_cached_percent": 59.7})


def _run(tmp: Path, prefill: list[str] | None = None, **files: str) -> Path:
    out = tmp / "run"
    out.mkdir()
    (out / "prefill.log").write_text("".join(prefill if prefill is not None else _startup(REAL / "prefill.log")))
    (out / "decode.log").write_text((REAL / "decode.log").read_text())  # D's log goes on after its startup
    for name, text in files.items():
        (out / name.replace("_", ".").replace("client.stats", "client-stats")).write_text(text)
    return out


def test_a_log_that_fits_the_first_read_keeps_its_last_line(tmp_path: Path) -> None:
    # P's whole log is its startup, ending with the 'Bidirectional KV transfer is enabled' line. The head
    # reader dropped a file's last line unconditionally, so the one-conversation path decided
    # feature_disabled_on_prefill while --all on the same folder did not.
    run = _run(tmp_path, proxy_log=TWO_TURNS)
    one = explain_conversation([str(run)], "conv-1")
    every = {c.conversation_id: c for c in load_turns([str(run)])}["conv-1"]
    assert [t.to_json_dict() for t in one.turns] == [t.to_json_dict() for t in every.turns]
    assert one.turns[1].verdict.value != "feature_disabled_on_prefill"
    # the same without a newline after the last line
    text = (run / "prefill.log").read_text().rstrip("\n")
    (run / "prefill.log").write_text(text)
    assert explain_conversation([str(run)], "conv-1").turns[1].verdict.value != "feature_disabled_on_prefill"


def test_console_output_starting_with_a_bracket_is_no_client_statistics(tmp_path: Path) -> None:
    # The benchmark's console output opens with "[transformers] PyTorch was not found...": a leading
    # "[" was taken for a JSON array of statistics, and its lines reported as corrupt.
    assert CONSOLE.startswith("[transformers]")
    assert sniff_format(CONSOLE.encode()) == "unknown"
    assert sniff_format(STATS.encode()) == "client_stats"
    assert sniff_format(b"[]") == "client_stats"
    run = _run(tmp_path, proxy_log=TWO_TURNS, client_stats_json=STATS, bench_console_log=CONSOLE)
    stats = LineStats()
    convs = load_turns([str(run)], stats=stats)
    assert stats.corrupt == 0 and stats.unrecognised_files == [str(run / "bench.console.log")]
    assert convs[0].turns[0].verdict.value == "first_turn"


def test_one_conversation_without_request_ids_still_reads_the_engine_logs(tmp_path: Path) -> None:
    # Only client statistics name the conversation (no proxy log): no request id is found, and the
    # engine logs were then never read, so both were reported missing although both were given.
    run = _run(tmp_path, client_stats_json=STATS)
    one = explain_conversation([str(run)], "conv-1")
    assert "prefill" not in one.missing_sources and "decode" not in one.missing_sources
    assert one.missing_sources == {c.conversation_id: c for c in load_turns([str(run)])}["conv-1"].missing_sources


def test_perf_counter_start_times_are_no_dates(tmp_path: Path) -> None:
    # The benchmark's start_time_ms comes from time.perf_counter(): read as epoch milliseconds it put
    # every turn in January 1970. With the proxy log, the proxy's arrival line dates the turn; the
    # benchmark's own clock still measures the gap.
    run = _run(tmp_path, proxy_log=TWO_TURNS, client_stats_json=STATS)
    conv = explain_conversation([str(run)], "conv-1")
    starts = [t.start_ts for t in conv.turns]
    # 2026-11-29 09:30:01 and :12, as the proxy wrote them
    assert starts == [calendar.timegm((2026, 11, 29, 9, 30, s, 0, 0, 0)) for s in (1, 12)]
    assert conv.turns[1].gap_s == round((3_467_801.5 - 3_456_789.125 - 610.4) / 1000, 3)
    res = CliRunner().invoke(cli, ["explain", "--conversation-id", "conv-1", "--no-progress", str(run)])
    assert res.exit_code == 0 and "11-29 09:30:01" in res.output and "01-01" not in res.output
    # statistics alone: no date at all, rather than a wrong one
    (run / "proxy.log").unlink()
    alone = explain_conversation([str(run)], "conv-1")
    assert [t.start_ts for t in alone.turns] == [None, None] and alone.turns[1].gap_s == conv.turns[1].gap_s


def _router_events(with_ids: bool) -> str:
    lines = []
    for turn, rid, outcome in ((1, RID1, "first_turn"), (2, RID2, "remote_hit")):
        ev = {"v": 1, "ts": 1_795_858_200.0 + 11 * turn, "source": "router", "event": "router_turn",
              "request_id": rid, "outcome": outcome, "ttft_ms": 401.0 + turn, "prompt_tokens": 900 + turn}
        if with_ids:
            ev.update(conversation_id="conv-1", turn=turn)
        lines.append(json.dumps(ev))
    return "\n".join(lines) + "\n"


def test_ttft_and_prompt_tokens_come_from_the_client_whatever_the_id_setting(tmp_path: Path) -> None:
    # With conversation ids the router's events join the turns and their TTFT and prompt tokens won;
    # without, the client's did: prompt buckets moved with the id setting. The client comes first.
    for with_ids in (True, False):
        run = tmp_path / f"ids-{with_ids}"
        run.mkdir()
        (run / "client-stats.json").write_text(STATS)
        (run / "router-events.jsonl").write_text(_router_events(with_ids))
        conv = {c.conversation_id: c for c in load_turns([str(run)])}["conv-1"]
        assert [(t.ttft_ms, t.prompt_tokens) for t in conv.turns] == [(151.2, 120), (98.7, 201)], with_ids
    # report's DuckDB path follows the same precedence
    run = tmp_path / "ids-True"
    files = [str(p) for p in run.iterdir()]
    fast = load_turn_table(files)
    if fast is not None:
        key = ["conversation_id", "turn"]
        pd.testing.assert_frame_equal(normalize_table(fast).sort_values(key).reset_index(drop=True),
                                      build_turn_table(load_turns(files)).sort_values(key).reset_index(drop=True))


def test_an_answered_turn_after_a_declined_read_is_not_called_failed(tmp_path: Path) -> None:
    # P declined the read and failed its request (failure_policy=fail) but answered the proxy with no
    # kv_transfer_params; the reference proxy then sent D its own handle back and D answered: the proxy
    # stored a new handle and the benchmark recorded the turn. The reason said the turn failed.
    p_id = f"chatcmpl-{RID2}-7d6c5b4a"
    decline = (REAL / "prefill.log").read_text().splitlines(keepends=True)
    lines = [ln.replace("chatcmpl-36b722057b344d248e7f5e591a7363bb-52f335c7", p_id).replace("11-29 09:29:34",
             "11-29 09:30:12") for ln in decline if "36b722057b344d248e7f5e591a7363bb-52f335c7" in ln
             and ("Declining" in ln or "Skipping KV post" in ln or "Failing 1 request" in ln)]
    assert len(lines) == 3
    proxy = TWO_TURNS + _proxy(("09:30:13", f"conv=conv-1: cached D blocks (remote_request_id=chatcmpl-{RID2}-"
                                            "0f0e0d0c, blocks=8)"))
    run = _run(tmp_path, prefill=_startup(REAL / "prefill.log") + lines, proxy_log=proxy, client_stats_json=STATS)
    turn = explain_conversation([str(run)], "conv-1").turns[1]
    assert turn.verdict.value == "expired_remote_read" and turn.confidence.value == "confirmed"
    assert "the turn failed" not in turn.reason and "yet the client got its answer" in turn.reason
    # control: without the benchmark's record and the stored handle, nothing says the client got it
    (run / "client-stats.json").unlink()
    (run / "proxy.log").write_text(TWO_TURNS)
    failed = explain_conversation([str(run)], "conv-1").turns[1]
    assert "the turn failed" in failed.reason


def test_a_table_cell_keeps_square_brackets(tmp_path: Path) -> None:
    # A reason quoting "[id] No conversation_id provided" lost "[id]" in the table (rich markup).
    run = _run(tmp_path, proxy_log=_proxy(("09:30:00", "Ready: 1 prefill, 1 decode instances")),
               client_stats_json=STATS)
    res = CliRunner().invoke(cli, ["explain", "--conversation-id", "conv-1", "--no-progress", str(run)],
                             terminal_width=400)
    assert res.exit_code == 0, res.output
    # a cell folds long text over lines: compare without the table's layout
    flat = " ".join(ln.strip(" │┃") for ln in res.output.splitlines())
    assert "[id]" in res.output and "'[id] No conversation_id" in " ".join(flat.split())
    doc = CliRunner().invoke(cli, ["explain", "--conversation-id", "conv-1", "--json", str(run)])
    assert "'[id] No conversation_id provided'" in json.loads(doc.stdout)["turns"][1]["reason"]


def test_the_benchmark_warmup_turn_is_not_joined_to_the_first_measured_record(tmp_path: Path) -> None:
    # With --warmup-step the first turn of every conversation goes through the proxy unmeasured: the
    # first record (input_num_turns 3) is the proxy's second request, not its first.
    warm = _stats({"ttft_ms": 98.7, "latency_ms": 402.2, "start_time_ms": 3_467_801.5, "input_num_turns": 3,
                   "input_num_tokens": 201})
    run = _run(tmp_path, proxy_log=TWO_TURNS, client_stats_json=warm)
    conv = explain_conversation([str(run)], "conv-1")
    assert [(t.turn, t.ttft_ms) for t in conv.turns] == [(1, None), (2, 98.7)]
    assert conv.turns[0].verdict.value == "first_turn" and conv.turns[0].confidence.value == "inferred"


def test_the_fixture_run_folder_is_read_whole(tmp_path: Path) -> None:
    # the INFO run's folder as a user hands it over: console output included
    shutil.copytree(INFO_RUN, tmp_path / "run")
    res = CliRunner().invoke(cli, ["explain", "--all", "--json", "--no-progress", str(tmp_path / "run")])
    assert res.exit_code == 0 and "corrupt" not in res.stderr
    assert "bench.console.log" in res.stderr  # named as skipped


def test_router_events_and_benchmark_records_give_one_table_in_both_report_paths(tmp_path: Path) -> None:
    # Router events beside the benchmark's records and P's failed first attempt (the router retried P
    # without the handle): the record is no extra proof of an answer where kvdiag's events state the
    # outcome, so the parser's reasons equal the DuckDB path's.
    p_id = f"chatcmpl-{RID2}-7d6c5b4a"
    failing = (f"(EngineCore_DP0 pid=26967) ERROR 11-29 09:30:12 [scheduler.py:3764] Failing 1 request(s) due to "
               f"KV load failure (failure_policy=fail, 139 tokens affected). Request IDs: {{'{p_id}'}}\n")
    run = _run(tmp_path, prefill=[*_startup(REAL / "prefill.log"), failing], client_stats_json=STATS,
               router_events_jsonl=_router_events(True))
    files = [str(p) for p in run.iterdir()]
    fast = load_turn_table(files)
    key = ["conversation_id", "turn"]
    slow = build_turn_table(load_turns(files)).sort_values(key).reset_index(drop=True)
    pd.testing.assert_frame_equal(normalize_table(fast).sort_values(key).reset_index(drop=True), slow)
