"""explain at INFO: P's stats windows against the reads the proxy offered (diagnostics/windows.py).

The fixture tests/fixtures/logs/real_vllm_info/ is an INFO run as vLLM 0.33 writes it: its own
LoggingStatLogger made the ``Engine 000`` and ``KV Transfer metrics`` lines from each interval's counts
(tests/fixtures/logs/make_real_vllm_info.py; test_fixture_is_what_vllm_writes regenerates it), the
reference proxy's lines and the benchmark's RequestStats around them. P runs without prefix caching
(the article's setup). ``real_vllm_info.truth.json`` says what happened to every turn.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvdiag.cli.main import cli
from kvdiag.diagnostics.records import ConversationRecord
from kvdiag.diagnostics.turn_loader import explain_conversation, load_turns
from kvdiag.diagnostics.vllm_log_parser import classify_message
from kvdiag.diagnostics.windows import vllm_wall_clock

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
RUN = FIXTURES / "real_vllm_info"
TRUTH = {(t["conversation_id"], t["turn"]): t["verdict"]
         for t in json.loads((FIXTURES / "real_vllm_info.truth.json").read_text())}
FILES = ("prefill.log", "decode.log", "proxy.log", "client-stats.json")


def _copy(tmp: Path, **edits: Any) -> Path:
    """The fixture in ``tmp``, each named file passed through its edit function (text -> text)."""
    out = tmp / "run"
    shutil.copytree(RUN, out)
    for name, edit in edits.items():
        path = out / name.replace("_", ".", 1)
        path.write_text(edit(path.read_text()))
    return out


def _verdicts(convs: list[ConversationRecord]) -> dict[tuple[str, int], tuple[str, str, str]]:
    return {(c.conversation_id, t.turn): (t.verdict.value, t.confidence.value, t.reason) for c in convs
            for t in c.turns}


def _wrong(got: dict[tuple[str, int], tuple[str, str, str]]) -> list[str]:
    """Turns whose verdict is not the truth; an unknown where the truth is known counts as not wrong."""
    out = []
    for key, want in TRUTH.items():
        verdict, conf, reason = got[key]
        if verdict == want or (verdict == "unknown" and conf == "inferred"):
            continue
        if want.startswith("unknown") and verdict == "unknown":
            continue
        out.append(f"{key}: want {want}, got {verdict} ({conf}): {reason}")
    return out


def test_every_turn_of_the_info_run_is_decided_as_it_happened() -> None:
    got = _verdicts(load_turns([str(RUN)]))
    assert set(got) == set(TRUTH)
    for key, want in TRUTH.items():
        verdict, conf, reason = got[key]
        if want.startswith("unknown"):
            assert verdict == "unknown", (key, verdict, reason)
        else:
            assert verdict == want, (key, verdict, reason)
    # a window never confirms anything: it is evidence about a set of reads, not about one request
    for key, (verdict, conf, _) in got.items():
        if verdict in ("remote_hit", "below_threshold"):
            assert conf == "inferred", key
    # every successful D->P read is a remote_hit: none left unknown
    assert [k for k, v in TRUTH.items() if v == "remote_hit" and got[k][0] != "remote_hit"] == []


def test_the_undecided_turn_names_the_read_it_shares_the_window_with_and_what_decides() -> None:
    got = _verdicts(load_turns([str(RUN)]))
    reason = got[("agent-f", 2)][2]
    e2 = json.loads((FIXTURES / "real_vllm_info.truth.json").read_text())
    e2_rid = next(t["request_id"] for t in e2 if (t["conversation_id"], t["turn"]) == ("agent-e", 2))
    assert f"{e2_rid} (agent-e)" in reason and "ending 11-29 10:01:40 count 1 successful" in reason
    assert "VLLM_LOGGING_LEVEL=DEBUG" in reason and "prefill events" in reason


def test_window_evidence_is_the_stat_line_and_the_offer() -> None:
    convs = {c.conversation_id: c for c in load_turns([str(RUN)])}
    hit = convs["agent-b"].turns[1]
    texts = [e.text for e in hit.evidence]
    assert "sending D's cached blocks to P" in texts[0]
    assert any("KV Transfer metrics: Num successful transfers=2," in t for t in texts)
    for ev in hit.evidence:  # cited where it is
        path, _, lineno = ev.source.rpartition(":")
        assert ev.text[:60] in Path(path).read_text().splitlines()[int(lineno) - 1]
    assert "exactly the 2 read(s)" in hit.reason
    # no window (P's stat lines stop), yet the client's own counts: P without prefix caching must pull
    # at least the threshold, and it logged no decline or failure
    late = convs["agent-l"].turns[1]
    assert late.verdict.value == "remote_hit" and "without prefix caching" in late.reason
    assert "not below kv_recompute_threshold 64" in late.reason
    assert any("Initializing a V1 LLM engine (v0.33.0) with config:" in e.text for e in late.evidence)
    below = convs["agent-i"].turns[1]
    assert below.verdict.value == "below_threshold" and "count no successful D→P transfer" in below.reason


def test_one_conversation_is_explained_as_the_all_pass_explains_it() -> None:
    every = {c.conversation_id: c for c in load_turns([str(RUN)])}
    for conv_id, conv in every.items():
        one = explain_conversation([str(RUN)], conv_id)
        assert [t.to_json_dict() for t in one.turns] == [t.to_json_dict() for t in conv.turns], conv_id


def test_a_window_short_of_one_transfer_decides_neither_read(tmp_path: Path) -> None:
    # Negative control: b and c shared the window with 2 transfers; with 1, either read may be the one
    run = _copy(tmp_path, prefill_log=lambda t: t.replace(
        "KV Transfer metrics: Num successful transfers=2,", "KV Transfer metrics: Num successful transfers=1,"))
    got = _verdicts(load_turns([str(run)]))
    assert got[("agent-b", 2)][0] == got[("agent-c", 2)][0] == "unknown"
    assert not _wrong(got)


def test_transfers_no_offered_read_explains_stop_every_window_decision(tmp_path: Path) -> None:
    # Negative control: P counted a transfer where the proxy offered no read (another router feeds P,
    # or part of the proxy log is missing): counts can no longer be trusted anywhere.
    lines = (RUN / "prefill.log").read_text().splitlines(keepends=True)
    k = next(i for i, ln in enumerate(lines) if "10:00:30 [loggers.py" in ln)
    extra = lines[k].replace("Engine 000:", "Engine 000:")  # the tick's Engine line, then a KV line for it
    kv = next(ln for ln in lines if "KV Transfer metrics: Num successful transfers=1," in ln)
    lines.insert(k + 1, kv.replace("10:00:20", "10:00:30"))
    assert extra
    run = _copy(tmp_path)
    (run / "prefill.log").write_text("".join(lines))
    got = _verdicts(load_turns([str(run)]))
    assert got[("agent-a", 2)][0] == got[("agent-b", 2)][0] == "unknown"
    assert "another router feeds P" in got[("agent-b", 2)][2]
    assert not _wrong(got)


def test_no_read_is_inferred_when_another_prefill_instance_may_have_served_it(tmp_path: Path) -> None:
    # Negative control: the proxy round-robins over two prefill instances and only one log is given:
    # a window that counts nothing proves nothing about a read the other P may have served.
    run = _copy(tmp_path, proxy_log=lambda t: t.replace("Ready: 1 prefill", "Ready: 2 prefill"))
    got = _verdicts(load_turns([str(run)]))
    assert got[("agent-i", 2)][0] == "unknown"
    assert got[("agent-a", 2)][0] == "remote_hit"  # a window that accounts for every read still does
    assert not _wrong(got)


def test_prefix_caching_on_leaves_local_hit_and_threshold_undecided(tmp_path: Path) -> None:
    # With prefix caching on, a read that made no transfer may be a local hit or a threshold skip.
    run = _copy(tmp_path, prefill_log=lambda t: t.replace("enable_prefix_caching=False", "enable_prefix_caching=True")
                .replace("CPU KV cache usage: 1.2%,", "CPU KV cache usage: 1.2%, Prefix cache hit rate: 3.1%,"))
    got = _verdicts(load_turns([str(run)]))
    assert got[("agent-i", 2)][0] == "unknown" and "local_hit or below_threshold" in got[("agent-i", 2)][2]
    assert got[("agent-l", 2)][0] == "unknown"  # the token counts bound nothing when P may hold a prefix
    assert got[("agent-a", 2)][0] == "remote_hit"
    assert not _wrong(got)


def test_without_a_transfer_plan_line_counts_are_not_matched_to_reads(tmp_path: Path) -> None:
    run = _copy(tmp_path, prefill_log=lambda t: "".join(
        ln for ln in t.splitlines(keepends=True) if "Transfer plan:" not in ln))
    got = _verdicts(load_turns([str(run)]))
    assert got[("agent-b", 2)][0] == "unknown" and "Transfer plan" in got[("agent-b", 2)][2]
    assert got[("agent-i", 2)][0] == "below_threshold"  # a window with no transfer needs no count per read
    assert not _wrong(got)


def test_two_transfers_per_read_halve_the_count(tmp_path: Path) -> None:
    # P at TP 2: each read makes two transfers, so one transfer per read is a count that cannot add up
    run = _copy(tmp_path, prefill_log=lambda t: t.replace("local_tp=1", "local_tp=2"))
    got = _verdicts(load_turns([str(run)]))
    assert got[("agent-b", 2)][0] == "unknown"
    assert not _wrong(got)


# the count of agent-b's and agent-c's shared window, written right after its tick's Engine line
SHARED_COUNT = "10:01:00 [metrics.py:108] KV Transfer metrics: Num successful transfers=2,"


def test_a_count_written_seconds_after_its_engine_line_still_counts_in_that_window(tmp_path: Path) -> None:
    # A loaded host stalls the API server between the two writes of one stats call (seen on the
    # real-vLLM testbed: the KV line two seconds after its Engine line); the next tick comes an interval
    # after the call returns, so the count is still that tick's.
    want = _verdicts(load_turns([str(RUN)]))
    for late in ("10:01:01", "10:01:03"):
        run = _copy(tmp_path / late.replace(":", ""), prefill_log=lambda t, late=late: t.replace(
            SHARED_COUNT, SHARED_COUNT.replace("10:01:00", late)))
        got = _verdicts(load_turns([str(run)]))
        assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in want.items()}, late
        assert got[("agent-b", 2)][0] == got[("agent-c", 2)][0] == "remote_hit"
        one = explain_conversation([str(run)], "agent-b")
        assert one.turns[1].verdict.value == "remote_hit"
        assert f"ending 11-29 {late} counts 2 successful D→P transfer(s), exactly the 2 read(s)" in one.turns[1].reason


def test_a_count_without_its_engine_line_widens_the_window_before_it(tmp_path: Path) -> None:
    # The tick's Engine line lost (a filtered or dropped line): the count belongs to the span from the
    # earlier window's start to its own second, and no read there is decided wrong.
    run = _copy(tmp_path, prefill_log=lambda t: "".join(
        ln for ln in t.splitlines(keepends=True) if "10:01:00 [loggers.py" not in ln))
    got = _verdicts(load_turns([str(run)]))
    assert not _wrong(got)
    for conv in ("agent-b", "agent-c"):
        verdict, _, reason = got[(conv, 2)]
        assert verdict == "remote_hit" and "ending 11-29 10:01:00 counts 2 successful" in reason, reason
    # Negative control: one transfer short in that widened window, and neither read is decided
    short = _copy(tmp_path / "short", prefill_log=lambda t: "".join(
        ln.replace("transfers=2,", "transfers=1,") for ln in t.splitlines(keepends=True)
        if "10:01:00 [loggers.py" not in ln))
    got = _verdicts(load_turns([str(short)]))
    assert got[("agent-b", 2)][0] == got[("agent-c", 2)][0] == "unknown"
    assert not _wrong(got)


def test_a_count_that_follows_no_engine_line_of_its_own_leaves_the_log_undecided(tmp_path: Path) -> None:
    # Two counts for one tick: one of them belongs to no window, so no window of the file is complete.
    run = _copy(tmp_path, prefill_log=lambda t: "".join(
        ln + ln.replace("10:01:00", "10:01:02") if SHARED_COUNT in ln else ln for ln in t.splitlines(keepends=True)))
    got = _verdicts(load_turns([str(run)]))
    verdict, _, reason = got[("agent-i", 2)]  # below_threshold by its windows in the unedited log
    assert verdict == "unknown" and "hold a KV Transfer metrics line that follows no Engine line" in reason
    assert not [k for k, v in got.items() if "stats window" in v[2] and v[0] != "unknown"]
    # agent-e's read succeeded (its window, shared with agent-f's skip, could not say so): the client's
    # counts now decide it without windows
    assert got[("agent-e", 2)][0] == "remote_hit" and "by the client's counts" in got[("agent-e", 2)][2]
    assert [w for w in _wrong(got) if not w.startswith("('agent-e', 2)")] == []


def _shift_p_clock(text: str, seconds: int) -> str:
    def shift(m: re.Match[str]) -> str:
        import time
        t = vllm_wall_clock(m.group(2), 1_795_946_400.0)
        assert t is not None
        return m.group(1) + time.strftime("%m-%d %H:%M:%S", time.gmtime(t + seconds))
    return re.sub(r"((?:INFO|WARNING|ERROR|DEBUG) )(\d\d-\d\d \d\d:\d\d:\d\d)", shift, text)


def _with_request_logging(text: str) -> str:
    """P's log as with --enable-log-requests: vLLM's ``Added request <id>.`` as each offered request arrives."""
    import time
    lines = text.splitlines(keepends=True)
    added = []
    for t in json.loads((FIXTURES / "real_vllm_info.truth.json").read_text()):
        sent = next((ln for ln in (RUN / "proxy.log").read_text().splitlines()
                     if f"[{t['request_id']}] conv=" in ln), None)
        if sent is None:
            continue
        stamp = time.strftime("%m-%d %H:%M:%S", time.strptime(sent[:19], "%Y-%m-%d %H:%M:%S"))
        added.append(f"(APIServer pid=31790) INFO {stamp} [async_llm.py:587] Added request "
                     f"chatcmpl-{t['request_id']}-0000abcd.\n")
    stamp_of = re.compile(r"\) \w+ (\d\d-\d\d \d\d:\d\d:\d\d) ")
    merged = sorted([*lines, *added], key=lambda ln: m.group(1) if (m := stamp_of.search(ln)) else "")
    return "".join(merged)


def test_a_skewed_p_clock_is_measured_on_the_lines_that_name_requests(tmp_path: Path) -> None:
    # P's clock 25 s ahead of the proxy's; with request logging, P's "Added request" lines (they name
    # requests the proxy sent at known times) give the offset, and the windows line up again.
    run = _copy(tmp_path, prefill_log=lambda t: _shift_p_clock(_with_request_logging(t), 25))
    got = _verdicts(load_turns([str(run)]))
    assert not _wrong(got)
    assert got[("agent-b", 2)][0] == "remote_hit" and got[("agent-i", 2)][0] == "below_threshold"


def test_a_skewed_p_clock_the_lines_cannot_measure_decides_nothing(tmp_path: Path) -> None:
    # Without request logging the only line naming a request is the decline, which bounds the offset
    # loosely; the windows then count transfers where no read was offered, and nothing is decided.
    run = _copy(tmp_path, prefill_log=lambda t: _shift_p_clock(t, 25))
    got = _verdicts(load_turns([str(run)]))
    assert not _wrong(got)
    assert got[("agent-b", 2)][0] == "unknown" and "clock" in got[("agent-b", 2)][2]


@pytest.mark.parametrize("seconds", [25, 3600, -7200])
def test_one_conversation_reads_a_skewed_p_log_at_p_s_own_times(tmp_path: Path, seconds: int) -> None:
    # P an hour or two off the proxy (another time zone): one conversation's explain measures the offset on its
    # own requests' P lines and reads P's stat lines at P's times, as explain --all does with every request's
    # lines. Read at the proxy's times, the windows found were the wrong minutes': agent-i's below_threshold and
    # six window-decided remote_hits came out otherwise.
    run = _copy(tmp_path, prefill_log=lambda t: _shift_p_clock(_with_request_logging(t), seconds))
    every = {c.conversation_id: c for c in load_turns([str(run)])}
    assert not _wrong(_verdicts(list(every.values())))
    assert every["agent-i"].turns[1].verdict.value == "below_threshold"
    for conv_id, conv in every.items():
        one = explain_conversation([str(run)], conv_id)
        assert [t.to_json_dict() for t in one.turns] == [t.to_json_dict() for t in conv.turns], conv_id


def test_a_skewed_p_clock_without_request_lines_gives_no_wrong_verdict(tmp_path: Path) -> None:
    def edit(text: str) -> str:
        text = "".join(ln for ln in text.splitlines(keepends=True)
                       if "Declining" not in ln and "Failing" not in ln and "Skipping KV" not in ln)
        return _shift_p_clock(text, 25)
    run = _copy(tmp_path, prefill_log=edit)
    got = _verdicts(load_turns([str(run)]))
    del got[("agent-d", 2)]  # its decline lines were removed with the rest: its truth is gone with them
    assert not [w for w in _wrong({k: got.get(k, ("unknown", "inferred", "")) for k in TRUTH})
                if not w.startswith("('agent-d', 2)")]


def test_stat_lines_parse_as_vllm_writes_them() -> None:
    lines = (RUN / "prefill.log").read_text().splitlines()
    eng = next(ln for ln in lines if "Engine 000: Avg prompt throughput: 77.4" in ln)
    kind, fields = classify_message(eng.split("] ", 1)[1])
    assert kind == "engine_stats" and fields["prefix_hit_rate"] is None and fields["external_hit_rate"] == 34.8
    kv = next(ln for ln in lines if "Num KV expired reqs=1" in ln)
    kind, fields = classify_message(kv.split("] ", 1)[1])
    assert kind == "kv_metrics" and fields["Num successful transfers"] == "0" and fields["Num failed transfers"] == "0"
    plan = next(ln for ln in lines if "Transfer plan:" in ln)
    assert classify_message(plan.split("] ", 1)[1]) == ("transfer_plan", {
        "tp_ratio": 1, "num_kv_heads": 8, "local_tp": 1, "remote_tp": 1, "remote_pp": 0, "local_dcp": 1,
        "remote_dcp": 1, "local_rank": 0, "remote_block_len": 131072})
    cfg = next(ln for ln in lines if "with config:" in ln)
    kind, fields = classify_message(cfg.split("] ", 1)[1])
    assert kind == "engine_config" and fields["prefix_caching"] is False and fields["version"] == "0.33.0"


def test_the_cli_prints_window_verdicts() -> None:
    res = CliRunner().invoke(cli, ["explain", "--all", "--json", "--no-progress", *(str(RUN / f) for f in FILES)])
    assert res.exit_code == 0, res.output
    counts = json.loads(res.stdout)["verdict_counts"]
    assert counts["remote_hit"] == sum(1 for v in TRUTH.values() if v == "remote_hit")


@pytest.mark.vllm
def test_fixture_is_what_vllm_writes(tmp_path: Path) -> None:
    """The committed fixture equals what the generator makes with the installed vLLM."""
    subprocess.run([sys.executable, str(FIXTURES / "make_real_vllm_info.py"), str(tmp_path / "real_vllm_info")],
                   check=True, capture_output=True, timeout=300)
    for name in (*FILES, "bench.console.log"):
        assert (tmp_path / "real_vllm_info" / name).read_text() == (RUN / name).read_text(), name
    assert (tmp_path / "real_vllm_info.truth.json").read_text() == (FIXTURES / "real_vllm_info.truth.json").read_text()


def test_the_probe_bisects_a_large_log_to_the_minute_around_a_read(tmp_path: Path) -> None:
    import time

    from kvdiag.diagnostics.window_load import PROBE_RADIUS_S, _periodic, _probe

    t0 = 1_795_946_400.0
    lines = []
    for i in range(60_000):  # 6 lines a second for 10,000 s: ~9 MB
        t = t0 + i / 6
        stamp = time.strftime("%m-%d %H:%M:%S", time.gmtime(t))
        lines.append(f"(APIServer pid=7) INFO {stamp} [launcher.py:46] request {i}\n")
        if i % 60 == 0:
            lines.append(f"(APIServer pid=7) INFO {stamp} [loggers.py:335] Engine 000: Avg prompt throughput: "
                         "1.0 tokens/s, Avg generation throughput: 1.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs\n")
    path = tmp_path / "prefill.log"
    path.write_text("".join(lines))
    center = t0 + 5_000.0
    got = _probe(str(path), center)
    stamps = {ln.split(b" INFO ")[1][:14].decode() for ln in got}
    # the Engine lines of the minute around the read (one every 10 s), and no other line
    want = {time.strftime("%m-%d %H:%M:%S", time.gmtime(t0 + i / 6)) for i in range(0, 60_000, 60)
            if abs(t0 + i / 6 - center) <= PROBE_RADIUS_S - 10}
    assert len(want) >= 4 and want <= stamps and len(got) < (2 * PROBE_RADIUS_S + 120) / 10  # (bisected to 64 KB)
    assert all(b"Engine 000: Avg prompt" in ln for ln in got)
    assert _periodic(got)
    # several Engine lines a second: not periodic
    dense = tmp_path / "dense.log"
    dense.write_text("".join(ln for ln in lines for _ in range(3 if "Engine 000" in ln else 1)))
    assert not _periodic(_probe(str(dense), center))


def _probe_line_by_line(path: Path, center: float) -> list[bytes]:
    """The probe read line by line: from the bisected start, the Engine stat lines, each line's first stamp read
    in turn (the reference for the form that jumps from one such line to the next)."""
    from kvdiag.diagnostics.window_load import _STAMP, PROBE_BYTES, PROBE_RADIUS_S, _probe_start
    from kvdiag.diagnostics.windows import vllm_wall_clock

    data = path.read_bytes()
    start = _probe_start(data, center, lambda stamp: vllm_wall_clock(stamp.decode(), center))
    out = []
    for line in data[start:min(len(data), start + PROBE_BYTES)].split(b"\n"):
        if b": Avg prompt" not in line:
            continue
        m = _STAMP.search(line)
        t = vllm_wall_clock(m.group(1).decode(), center) if m else None
        if t is not None and t > center + PROBE_RADIUS_S:
            break
        out.append(line)
    return out


def test_the_probe_keeps_the_lines_a_line_by_line_reading_keeps(tmp_path: Path) -> None:
    """The probe jumps from one Engine stat line to the next: the same lines as reading each line's first stamp,
    on logs with lines without a stamp, two stamps in a line, colours, out-of-order writers, a year's turn and
    an unterminated last line."""
    import time

    from kvdiag.diagnostics.window_load import _periodic, _probe

    rng = random.Random(13)
    t0 = 1_798_761_000.0  # (shortly before a new year: stamps carry no year)
    checked = periodic = 0
    for trial in range(40):
        lines = []
        t = t0
        for _ in range(rng.randint(0, 4000)):
            t += rng.choice((0.0, 0.0, 0.1, 0.5, 1.0, 7.0))
            stamp = time.strftime("%m-%d %H:%M:%S", time.gmtime(t + rng.choice((0, 0, 0, -3, 2))))
            other = time.strftime("%m-%d %H:%M:%S", time.gmtime(t + 400))
            colour = rng.choice(("", "\x1b[32m", "\x1b[1;0m"))
            lines.append(rng.choice((
                f"(APIServer pid=7) {colour}INFO{colour} {stamp} [x.py:1] request",
                f"(EngineCore pid=8) DEBUG  {colour}{stamp} [x.py:2] msg then INFO {other} [y.py:3] again",
                "a continuation line without a stamp", "",
                f"(APIServer pid=7) WARNING {stamp} [z.py:9] Engine 000: Avg prompt throughput: 1.0",
                f"(APIServer pid=7) INFO {stamp} [z.py:9] Engine 00{rng.randint(0, 1)}: Avg prompt throughput: 1.0",
                f"(APIServer pid=7) INFO {stamp} [z.py:9\nbroken] Engine 000: Avg prompt throughput: 1.0",
                f"(A pid=7) INFO {stamp} [z.py:9] Engine 000: Avg prompt x INFO {stamp} [z.py:9] Engine 000: "
                "Avg prompt")))
        path = tmp_path / f"p{trial}.log"
        path.write_text("\n".join(lines) + rng.choice(("", "\n")))
        for center in (t0 + rng.uniform(-100, (t - t0) + 100) for _ in range(3)):
            want = _probe_line_by_line(path, center)
            assert _probe(str(path), center) == want
            checked += len(want) > 1
            periodic += _periodic(want)
    assert checked > 60 and 0 < periodic < checked  # periodic and not, both met


def test_a_probe_that_ignores_a_stamp_past_the_minute_is_caught(tmp_path: Path) -> None:
    """Negative control: the reference keeps fewer lines than the whole slice when a stamp past the minute
    follows (so the equality above would catch a probe that kept reading)."""
    import time

    t0 = 1_798_000_000.0
    path = tmp_path / "p.log"
    path.write_text("".join(f"(A pid=1) INFO {time.strftime('%m-%d %H:%M:%S', time.gmtime(t0 + i))} [x.py:1] "
                            "Engine 000: Avg prompt throughput: 1.0\n" for i in range(200)))
    assert 0 < len(_probe_line_by_line(path, t0 + 100)) < 200


def test_coloured_vllm_logs_give_the_same_windows(tmp_path: Path) -> None:
    # vLLM colours its lines when its output is a terminal (a `script` or `tee` capture keeps them)
    def colour(text: str) -> str:
        def one(m: re.Match[str]) -> str:
            return (f"\x1b[0;36m{m.group(1)}\x1b[0;0m \x1b[32m{m.group(2)}\x1b[0m \x1b[90m{m.group(3)}\x1b[0m "
                    f"\x1b[90m[{m.group(4)}]\x1b[0m ")
        return re.sub(r"^(\(\w+ pid=\d+\)) (INFO|WARNING|ERROR|DEBUG) (\d\d-\d\d \d\d:\d\d:\d\d) \[([^\]]+)\] ", one,
                      text, flags=re.M)
    run = _copy(tmp_path, prefill_log=colour)
    assert "\x1b[32mINFO" in (run / "prefill.log").read_text()
    plain = {k: v[0] for k, v in _verdicts(load_turns([str(RUN)])).items()}
    assert {k: v[0] for k, v in _verdicts(load_turns([str(run)])).items()} == plain
    for conv_id in ("agent-b", "agent-i", "agent-j"):
        one = explain_conversation([str(run)], conv_id)
        assert [(conv_id, t.turn, t.verdict.value) for t in one.turns] == [
            (conv_id, t, plain[(conv_id, t)]) for t in range(1, len(one.turns) + 1)]


def test_a_handle_p_rejected_is_no_threshold_skip(tmp_path: Path) -> None:
    # Negative control for below_threshold: P logged that it could not use the params at all
    # (pull_scheduler's WARNING names the handle, not the request): nothing was read, but no threshold
    # or cache explains it.
    truth = json.loads((FIXTURES / "real_vllm_info.truth.json").read_text())
    i1 = next(t["request_id"] for t in truth if (t["conversation_id"], t["turn"]) == ("agent-i", 1))
    d_id = re.search(rf"remote_request_id=(chatcmpl-{i1}-\w+)", (RUN / "proxy.log").read_text())
    assert d_id is not None
    warning = ("(EngineCore_DP0 pid=31807) WARNING 11-29 10:02:32 [pull_scheduler.py:179] Got invalid "
               f"KVTransferParams: {{'do_remote_prefill': False, 'do_remote_decode': True, 'remote_block_ids': "
               f"[[1, 2]], 'remote_request_id': '{d_id.group(1)}', 'remote_host': '10.0.0.2'}}. This request will "
               "not utilize KVTransfer\n")
    run = _copy(tmp_path, prefill_log=lambda t: t + warning)
    got = _verdicts(load_turns([str(run)]))
    assert got[("agent-i", 2)][0] == "unknown" and "Got invalid KVTransferParams" in got[("agent-i", 2)][2]
    one = explain_conversation([str(run)], "agent-i").turns[1]
    assert one.verdict.value == "unknown"


def _p_log(rng: random.Random, t0: float, lines: int, disorder: float) -> bytes:
    """A P log written in time order (each line up to ``disorder`` seconds late), with stampless stretches."""
    import time

    out: list[str] = []
    t = t0
    for i in range(lines):
        t += rng.choice((0.0, 0.05, 0.5, 2.0))
        stamp = time.strftime("%m-%d %H:%M:%S", time.gmtime(t - rng.uniform(0, disorder)))
        colour = rng.choice(("", "", "\x1b[32m"))
        out.append(rng.choice((
            f"(APIServer pid=7) {colour}INFO{colour} {stamp} [loggers.py:335] Engine 000: Avg prompt throughput: 1.0",
            f"(APIServer pid=7) INFO {stamp} [metrics.py:108] KV Transfer metrics: Num successful transfers=1",
            f"(EngineCore pid=8) INFO {stamp} [logger.py:45] Received request chatcmpl-{i:x}-0f0f0f0f: params\r",
            f'(APIServer pid=7) INFO:     10.0.0.1:4242 - "POST /v1/chat/completions HTTP/1.1" 200 OK {stamp}',
            f"(EngineCore pid=8) WARNING {stamp} [x.py:1] Declining expired remote read for chatcmpl-{i:x}-1",
        )))
        if i % 500 == 499:  # a traceback: no stamp for a while
            out.extend(f'  File "x.py", line {k}, in f \xff' for k in range(rng.randint(1, 3000)))
    return "\n".join(out).encode("utf-8", errors="surrogateescape") + b"\n"


@pytest.mark.parametrize("seed", range(6))
def test_the_spans_read_by_bisection_are_the_lines_a_whole_search_finds(tmp_path: Path, seed: int) -> None:
    """One conversation reads P's lines around its reads from the bytes that can hold them (bisected on the
    stamps): the same lines, numbered the same, as searching the whole file, in a log written in time order
    with lines up to a few seconds late and long stretches without a stamp."""
    from kvdiag.diagnostics.scan import grep_ere
    from kvdiag.diagnostics.window_load import _span_lines, span_patterns

    rng = random.Random(seed)
    t0 = 1_798_700_000.0 + seed * 1000
    path = tmp_path / "prefill.log"
    path.write_bytes(_p_log(rng, t0, 20_000, disorder=5.0))
    for _ in range(4):
        a = t0 + rng.uniform(-300, 9000)
        spans = sorted([(a, a + rng.uniform(0, 400)), (a + 900, a + 950)][:rng.randint(1, 2)])
        _proxy_ere, vllm_ere = span_patterns(spans)
        whole = list(grep_ere(str(path), vllm_ere, rg_reads_it=True))
        assert _span_lines(str(path), spans, vllm_ere) == whole


def _spans_and_known(rng: random.Random, t0: float, path: Path) -> tuple[list[tuple[float, float]], str, list[Any]]:
    """Spans as a conversation's reads give them, and a few of its own P lines in them, numbered by a whole
    search (as the conversation's search of P's log numbers them)."""
    from kvdiag.diagnostics.linestats import LineStats
    from kvdiag.diagnostics.scan import grep_ere
    from kvdiag.diagnostics.vllm_log_parser import parse_vllm_numbered
    from kvdiag.diagnostics.window_load import span_patterns

    a = t0 + rng.uniform(0, 8000)
    spans = sorted([(a, a + rng.uniform(0, 400)), (a + 900, a + 950)][:rng.randint(1, 2)])
    vllm_ere = span_patterns(spans)[1]
    own = [ln for ln in grep_ere(str(path), vllm_ere, rg_reads_it=True) if b"chatcmpl-" in ln[1]]
    return spans, vllm_ere, list(parse_vllm_numbered(rng.sample(own, min(3, len(own))), str(path), LineStats()))


@pytest.mark.parametrize("seed", range(4))
def test_the_spans_numbered_off_the_conversation_s_own_lines_are_numbered_as_a_whole_search(
        tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bisected bytes are numbered off one of the conversation's own lines found in them, not by counting
    every line before them: the same numbers as searching the whole file."""
    from kvdiag.diagnostics import window_load
    from kvdiag.diagnostics.scan import grep_ere

    counted: list[int] = []
    count = window_load.count_newlines
    monkeypatch.setattr(window_load, "count_newlines", lambda mm, a, b: counted.append(b - a) or count(mm, a, b))
    rng = random.Random(seed)
    t0 = 1_798_700_000.0 + seed * 1000
    path = tmp_path / "prefill.log"
    path.write_bytes(_p_log(rng, t0, 20_000, disorder=5.0))
    for _ in range(4):
        spans, vllm_ere, known = _spans_and_known(rng, t0, path)
        whole = list(grep_ere(str(path), vllm_ere, rg_reads_it=True))
        assert known and window_load._span_lines(str(path), spans, vllm_ere, known) == whole
    assert counted == []  # (every time, a line of the conversation's numbered the bytes)
    # negative control: a record numbered one line off numbers every line one off (the test sees the anchor)
    spans, vllm_ere, known = _spans_and_known(rng, t0, path)
    off = [dataclasses.replace(known[0], lineno=known[0].lineno + 1)]
    whole = list(grep_ere(str(path), vllm_ere, rg_reads_it=True))
    assert window_load._span_lines(str(path), spans, vllm_ere, off) == [(n + 1, ln) for n, ln in whole]
    # two records with one stamp and text cannot tell which line is which: the lines before are counted
    twin = [known[0], dataclasses.replace(known[0], lineno=known[0].lineno + 7)]
    assert window_load._span_lines(str(path), spans, vllm_ere, twin) == whole and counted


def test_lines_later_than_the_slack_are_what_bisection_can_miss(tmp_path: Path) -> None:
    """Negative control: the bisected read relies on P's log being written in time order; a line stamped long
    before its neighbours (beyond SPAN_SLACK_S) is found by a whole search but not by the bisected one."""
    import time

    from kvdiag.diagnostics.scan import grep_ere
    from kvdiag.diagnostics.window_load import SPAN_SLACK_S, _span_lines, span_patterns

    t0 = 1_798_700_000.0
    lines = [f"(A pid=1) INFO {time.strftime('%m-%d %H:%M:%S', time.gmtime(t0 + i))} [x.py:1] Received request r{i}"
             for i in range(20_000)]
    late = time.strftime("%m-%d %H:%M:%S", time.gmtime(t0 + 100))
    lines.insert(15_000, f"(A pid=1) INFO {late} [x.py:1] Received request written {SPAN_SLACK_S * 10:.0f} s late")
    path = tmp_path / "prefill.log"
    path.write_text("\n".join(lines) + "\n")
    spans = [(t0 + 90, t0 + 110)]
    _proxy_ere, vllm_ere = span_patterns(spans)
    whole = list(grep_ere(str(path), vllm_ere))
    bisected = _span_lines(str(path), spans, vllm_ere)
    assert len(whole) == len(bisected) + 1 and set(bisected) < set(whole)


def test_one_repeated_stat_line_leaves_the_windows_and_every_path_agreeing(tmp_path: Path) -> None:
    """A log shipper that writes one Engine stat line twice (a retry): the minute's probe still reads P's stat
    lines as periodic, so explain --all decides the turns only the windows decide as one conversation's explain
    does (the probe of --all looks at the minute around the middle offer, one conversation's at its own reads)."""
    shutil.copytree(RUN, tmp_path / "run")
    paths = sorted(str(p) for p in (tmp_path / "run").iterdir())
    before = {c.conversation_id: [(t.turn, t.verdict) for t in c.turns] for c in load_turns(paths)}
    prefill = tmp_path / "run" / "prefill.log"
    lines = prefill.read_text(encoding="utf-8").splitlines(keepends=True)
    ticks = [i for i, ln in enumerate(lines) if "Engine 000: Avg prompt throughput" in ln]
    i = ticks[len(ticks) // 2]
    prefill.write_text("".join([*lines[:i + 1], lines[i], *lines[i + 1:]]), encoding="utf-8")
    every = load_turns(paths)
    assert {c.conversation_id: [(t.turn, t.verdict) for t in c.turns] for c in every} == before
    for conv in every:
        one = explain_conversation(paths, conv.conversation_id)
        assert [t.__dict__ for t in one.turns] == [t.__dict__ for t in conv.turns], conv.conversation_id
    # control: the same line three times more (several a second) marks the minute not periodic
    from kvdiag.diagnostics.window_load import _periodic

    minute = [ln.encode() for ln in lines if "Engine 000: Avg prompt throughput" in ln][:8]
    assert _periodic([*minute, minute[3]])
    assert not _periodic([*minute, minute[3], minute[3], minute[5]])
