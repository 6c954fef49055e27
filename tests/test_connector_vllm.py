"""KVDiagNixlConnector on real vLLM 0.33.0: v1 Scheduler, NixlConnector worker, NIXL/UCX READs on CPU.

All scenarios run once, in one subprocess (tests/vllm_harness/scenarios.py): vLLM imports once and
its import side effects (CPU affinity, logging) stay out of pytest. The tests assert on what that
process recorded: kv_transfer_params, per-block sha256 of sender and receiver, NIXL's own stats,
the event files, and vLLM's own log lines parsed with kvdiag's parser.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvdiag.diagnostics.vllm_log_parser import parse_vllm_log
from kvdiag.schema.events import PrefillReport, TurnEvent, read_events

pytestmark = pytest.mark.vllm

TESTS = Path(__file__).parent
PAGE_BYTES = 98_304      # one layer's block: 2 x 32 tokens x 12 heads x 64 x fp16
LAYERS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("vllm-scenarios")
    try:
        proc = subprocess.run([sys.executable, "-m", "vllm_harness.scenarios", str(out)], cwd=TESTS, timeout=400,
                              capture_output=True, text=True, check=False)
    except subprocess.TimeoutExpired:
        partial = out / "results.partial.json"
        done = partial.read_text()[-2000:] if partial.exists() else "-"
        pytest.fail(f"the scenario process hung; done so far: {done}"
                    f"\nlog tail:\n{(out / 'engine.log').read_text(errors='replace')[-8000:]}")
    results_file = out / "results.json"
    assert proc.returncode == 0 and results_file.exists(), (proc.stdout[-3000:], proc.stderr[-3000:],
                                                            (out / "engine.log").read_text()[-5000:])
    results: dict[str, Any] = json.loads(results_file.read_text())
    results["_out"] = str(out)
    return results


def scenario(run: dict[str, Any], name: str) -> dict[str, Any]:
    rec: dict[str, Any] = run[name]
    assert "error" not in rec, rec["error"]
    return rec


def events(rec: dict[str, Any], side: str) -> list[TurnEvent]:
    return list(read_events(Path(rec["dir"]) / f"{side}-events.jsonl"))


def one(evs: list[TurnEvent], event: str, engine_request_id: str) -> TurnEvent:
    found = [e for e in evs if e.event == event and e.engine_request_id == engine_request_id]
    assert len(found) == 1, (event, engine_request_id, evs)
    return found[0]


def log_records(run: dict[str, Any], kind: str) -> list[Any]:
    with open(Path(run["_out"]) / "engine.log", encoding="utf-8", errors="replace") as fh:
        return [r for r in parse_vllm_log(fh) if r.kind == kind]


def test_two_turn_bidirectional_reads_d_blocks_back_byte_exact(run: dict[str, Any]) -> None:
    rec = scenario(run, "s1_two_turn")
    # turn 1, P->D: D received exactly P's blocks
    assert rec["t1_d_recv_sha"] == rec["t1_p_sha"] and len(rec["t1_p_sha"]) == 4
    # turn 2, D->P: P received exactly the blocks D held (P's and D's writes both came back)
    assert rec["t2_p_recv_sha"] == rec["t1_d_held_sha"] and len(rec["t2_p_recv_sha"]) == 5
    assert rec["t2_p_recv_writers"] == {"1": 99, "2": 40}


def test_prefill_report_matches_nixl_stats(run: dict[str, Any]) -> None:
    rec = scenario(run, "s1_two_turn")
    report = PrefillReport.from_dict(rec["t2_p_params"]["kvdiag"])
    assert report.outcome == "remote_hit"
    assert (report.remote_offered_tokens, report.remote_read_tokens, report.computed_tokens) == (139, 139, 31)
    # the bytes and milliseconds are NIXL's own telemetry for this read
    assert rec["p_stats"]["bytes_transferred"] == [report.transfer_bytes] == [5 * LAYERS * PAGE_BYTES]
    assert report.transfer_ms == pytest.approx(rec["p_stats"]["transfer_duration"][0] * 1000, abs=0.001)
    assert report.remote_engine_id == rec["d_engine_id"] and report.remote_request_id == rec["ids"]["t1-d"]
    assert report.mismatch_tokens == 0   # exact mode checked D's digest, end checkpoint included: all 139 match
    # turn 1 had no D handle: the router decides first_turn
    first = PrefillReport.from_dict(rec["t1_p_params"]["kvdiag"])
    assert (first.outcome, first.reason) == ("unknown", "no D handle offered")


def test_two_turn_events_on_both_sides(run: dict[str, Any]) -> None:
    rec = scenario(run, "s1_two_turn")
    ids = rec["ids"]
    p_ev, d_ev = events(rec, "prefill"), events(rec, "decode")
    t2 = one(p_ev, "prefill_request", ids["t2-p"])
    report = rec["t2_p_params"]["kvdiag"]
    for key in ("prompt_tokens", "local_hit_tokens", "remote_offered_tokens", "remote_read_tokens",
                "computed_tokens", "transfer_bytes", "transfer_ms", "outcome", "remote_request_id"):
        assert getattr(t2, key) == report[key], key
    assert t2.status == "ok" and t2.source == "prefill"
    retained = one(d_ev, "kv_retained", ids["t1-d"])
    assert retained.retained_blocks == 5 and retained.ttl_s == 480.0
    released = one(d_ev, "kv_released", ids["t1-d"])
    assert released.release_reason == "read" and released.attrs["notified"] is True
    d1 = one(d_ev, "decode_request", ids["t1-d"])
    assert d1.transfer_bytes == 4 * LAYERS * PAGE_BYTES and d1.remote_read_tokens == 100
    assert d1.remote_request_id == ids["t1-p"] and d1.status == "ok"
    # D's turn-1 params carry the digest of the 4 full blocks it holds and the 11 tokens after them
    digest = rec["t1_d_params"]["kvdiag_digest"]
    assert (digest["blocks"], digest["stride"], len(digest["h"]), digest["tail"]["n"]) == (4, 1, 4, 11)


def test_expired_read_is_declined_and_reported(run: dict[str, Any]) -> None:
    rec = scenario(run, "s2_expired")
    ids = rec["ids"]
    # policy fail: vLLM fails P's request and returns no params; the event still carries the cause
    assert rec["t2_p_params"] is None and rec["t2_p_finish"] == "error"
    t2 = one(events(rec, "prefill"), "prefill_request", ids["t2-p"])
    assert (t2.outcome, t2.failure_type, t2.status) == ("expired_remote_read", "expired_declined", "error")
    assert rec["p_stats"]["num_kv_expired_reqs"] == [1] and rec["p_stats"]["bytes_transferred"] == []
    released = one(events(rec, "decode"), "kv_released", ids["t1-d"])
    # P declined, so it never notified D: the lease ran out on blocks nobody read
    assert released.release_reason == "expired"
    assert (released.attrs["unread"], released.attrs["notifications"]) == (True, 0)


def test_recompute_policy_hang_is_reported_while_the_request_is_stuck(run: dict[str, Any]) -> None:
    rec = scenario(run, "s9_recompute_hang")
    # vLLM 0.33 (F1): after the declined read, P's request never leaves WAITING_FOR_REMOTE_KVS
    assert rec["t2_p_finished"] is False and rec["t2_p_status"] == "WAITING_FOR_REMOTE_KVS"
    # ... and kvdiag reports it at once, without waiting for a finish that never comes
    t2 = one(events(rec, "prefill"), "prefill_request", rec["ids"]["t2-p"])
    assert (t2.status, t2.outcome, t2.failure_type) == ("hung", "expired_remote_read", "expired_declined")
    assert t2.attrs["stuck_waiting_for_remote_kvs"] is True and t2.attrs["rematched_tokens"] == 139
    assert t2.attrs["finish_status"] == "WAITING_FOR_REMOTE_KVS"
    with open(Path(run["_out"]) / "engine.log", encoding="utf-8", errors="replace") as fh:
        warned = [r for r in parse_vllm_log(fh) if r.level == "WARNING" and "WAITING_FOR_REMOTE_KVS" in r.msg]
    assert any(t2.engine_request_id in r.msg for r in warned)


def test_threshold_skip(run: dict[str, Any]) -> None:
    rec = scenario(run, "s3_threshold")
    report = PrefillReport.from_dict(rec["t2_p_params"]["kvdiag"])
    assert (report.outcome, report.remote_read_tokens, report.computed_tokens) == ("below_threshold", 0, 170)
    assert report.reason == "139 remote tokens < threshold 512"
    assert rec["p_stats"]["bytes_transferred"] == []
    t2 = one(events(rec, "prefill"), "prefill_request", rec["ids"]["t2-p"])
    assert t2.attrs.get("threshold_skipped") is True
    # P's notify-only frees D's blocks at once. D's NIXL sees the same notification as after a READ,
    # so D reports it "read"; P's event for the same handle says nothing was read (released unread).
    released = one(events(rec, "decode"), "kv_released", rec["ids"]["t1-d"])
    assert released.release_reason == "read" and released.attrs["notified"] is True
    assert t2.remote_request_id == released.engine_request_id and t2.remote_read_tokens == 0


def test_bidirectional_off_on_decode(run: dict[str, Any]) -> None:
    rec = scenario(run, "s4_bidir_off")
    assert rec["t1_d_params"] is None
    d_ev = events(rec, "decode")
    assert [e.event for e in d_ev] == ["engine_start", "decode_request"]
    assert d_ev[1].attrs["returned_handle"] is False and d_ev[0].attrs["bidirectional_kv_xfer"] is False


def test_edited_history_with_exact_mode_off_reads_all_blocks(run: dict[str, Any]) -> None:
    rec = scenario(run, "s5_mismatch")
    report = PrefillReport.from_dict(rec["t2_p_params"]["kvdiag"])
    assert report.outcome == "prefix_mismatch"
    assert report.reason == "prompt diverges from D's sequence at block 2"
    # kvdiag_pull_matching_prefix false: vLLM's transfer is unchanged (all 5 of D's blocks read), the
    # 75 tokens from block 2 on that do not match are reported
    assert rec["t2_p_read_blocks"] == 5 and rec["p_stats"]["bytes_transferred"] == [5 * LAYERS * PAGE_BYTES]
    assert report.mismatch_tokens == 75


def test_exact_mode_by_default_reads_only_matching_blocks(run: dict[str, Any]) -> None:
    rec = scenario(run, "s6_mismatch_partial")
    report = PrefillReport.from_dict(rec["t2_p_params"]["kvdiag"])
    assert (report.outcome, report.remote_read_tokens, report.computed_tokens) == ("prefix_mismatch", 64, 106)
    assert report.mismatch_tokens == 75 and report.remote_offered_tokens == 139
    assert rec["t2_p_read_blocks"] == 2
    assert rec["p_stats"]["bytes_transferred"] == [2 * LAYERS * PAGE_BYTES] == [report.transfer_bytes]
    assert rec["t2_p_recv_sha"] == rec["t1_d_held_sha"][:2]
    t2 = one(events(rec, "prefill"), "prefill_request", rec["ids"]["t2-p"])
    assert t2.mismatch_tokens == 75 and t2.attrs["pulled_matching_prefix"] is True and t2.attrs["proven_tokens"] == 64
    labels = 'engine="0",model_name="opt-test"'
    assert f"kvdiag_connector_mismatch_tokens_total{{{labels}}} 75.0" in rec["p_exposition"]["metrics"]


def test_handshake_failure_is_transfer_failed_by_type(run: dict[str, Any]) -> None:
    rec = scenario(run, "s7_handshake_failed")
    assert rec["t2_p_params"] is None and rec["t2_p_finish"] == "error"  # vLLM's policy fail
    t2 = one(events(rec, "prefill"), "prefill_request", rec["ids"]["t2-p"])
    assert (t2.outcome, t2.failure_type, t2.status) == ("transfer_failed", "handshake_failed", "error")
    assert rec["p_stats"]["num_failed_handshakes"] == [1]
    failures = [r.fields for r in log_records(run, "nixl_failure") if r.fields["failure_type"] == "handshake_failed"]
    assert any(f["context"].get("request_id") == t2.engine_request_id for f in failures)


def test_an_error_inside_the_observer_never_fails_the_request(run: dict[str, Any]) -> None:
    rec = scenario(run, "s8_observer_error")
    # the report could not be built: vLLM's own params pass through untouched, D still decodes
    assert "kvdiag" not in rec["t1_p_params"] and rec["t1_p_params"]["do_remote_prefill"] is True
    assert rec["t1_d_recv_sha"] == rec["t1_p_sha"] and rec["d_finish"] == "length"
    assert rec["guard_errors"] == 1 and rec["p_emit_errors"] == 1   # counted, shipped as kvdiag_emit_errors
    with open(Path(run["_out"]) / "engine.log", encoding="utf-8") as fh:
        assert any("kvdiag instrumentation error in connector" in r.msg and r.level == "WARNING"
                   for r in parse_vllm_log(fh))


def test_vllm_log_lines_parse_to_the_event_facts(run: dict[str, Any]) -> None:
    s1, s2, s3 = scenario(run, "s1_two_turn"), scenario(run, "s2_expired"), scenario(run, "s3_threshold")
    declined = {r.fields["request_id"]: r.fields for r in log_records(run, "declining_expired")}
    t2 = one(events(s2, "prefill"), "prefill_request", s2["ids"]["t2-p"])
    assert declined[t2.engine_request_id]["engine_id"] == t2.remote_engine_id
    assert t2.outcome == "expired_remote_read"
    failing = [r.fields for r in log_records(run, "kv_load_failed")]
    assert any(t2.engine_request_id in f["request_ids"] and f["tokens"] == t2.remote_offered_tokens for f in failing)
    releasing = {r.fields["request_id"]: r.fields["count"] for r in log_records(run, "releasing_expired")}
    expired = {e.engine_request_id: e.attrs["notifications"] for e in events(s2, "decode")
               if e.release_reason == "expired"}
    assert list(expired) == [s2["ids"]["t1-d"]] and expired.items() <= releasing.items()
    skips = {r.fields["request_id"]: r.fields for r in log_records(run, "skip_remote_pull")}
    t3 = one(events(s3, "prefill"), "prefill_request", s3["ids"]["t2-p"])
    assert skips[t3.engine_request_id]["remote_tokens"] == t3.remote_offered_tokens - t3.local_hit_tokens
    assert t3.outcome == "below_threshold" and skips[t3.engine_request_id]["threshold"] == 512
    recv = {r.fields["request_id"] for r in log_records(run, "finished_recving")}
    sent = {r.fields["request_id"] for r in log_records(run, "finished_sending")}
    waits = {r.fields["request_id"]: r.fields["seconds"] for r in log_records(run, "request_finished_wait")}
    hit = one(events(s1, "prefill"), "prefill_request", s1["ids"]["t2-p"])
    assert hit.outcome == "remote_hit" and hit.engine_request_id in recv
    released = one(events(s1, "decode"), "kv_released", s1["ids"]["t1-d"])
    retained = one(events(s1, "decode"), "kv_retained", s1["ids"]["t1-d"])
    assert released.engine_request_id in sent and waits[retained.engine_request_id] == retained.ttl_s


def test_metrics_appear_through_vllms_own_connector_hooks(run: dict[str, Any]) -> None:
    rec = scenario(run, "s1_two_turn")
    p, d = rec["p_exposition"], rec["d_exposition"]
    assert p["connector_class"] == d["connector_class"] == "KVDiagPromMetrics"
    labels = 'engine="0",model_name="opt-test"'
    assert f'kvdiag_connector_requests_total{{{labels},outcome="remote_hit",role="prefill"}} 1.0' in p["metrics"]
    assert f"kvdiag_connector_remote_read_tokens_total{{{labels}}} 139.0" in p["metrics"]
    assert f'kvdiag_connector_released_total{{{labels},reason="read"}} 1.0' in d["metrics"]
    # NIXL's own series are untouched
    assert f"vllm:nixl_bytes_transferred_count{{{labels}}} 1.0" in p["metrics"]
    # vLLM's stat log line is exactly NIXL's: one per payload with transfers, none for kvdiag-only payloads
    from kvdiag.diagnostics.vllm_log_parser import classify_message

    assert len(p["stat_lines"]) == 1
    kind, fields = classify_message(p["stat_lines"][0])
    assert kind == "kv_metrics" and fields["Num successful transfers"] == "1"
    assert float(fields["Avg MB per transfer"]) == round(rec["p_stats"]["bytes_transferred"][0] / 2**20, 3)


# Fields only the emulated engine can know: it runs the "model", so it times prefill and the first
# token; the real connector sees the scheduler, not the forward pass. Its KV blocks also record the
# token ids they hold, so it alone can count KV loaded for other ids (wrong_kv_tokens, the oracle).
SIM_ONLY_TIMING = {"ttft_ms", "prefill_ms", "wrong_kv_tokens"}


async def _sim_two_turns(tmp: Path) -> list[TurnEvent]:
    import aiohttp

    from kvdiag.sim.config import EngineConfig
    from kvdiag.sim.pd_driver import run_turn
    from kvdiag.sim.server import start_engine
    from kvdiag.sim.tokenizer import generate_text

    handles = [await start_engine(EngineConfig(role=role, time_scale=0.0, mode="instrumented", prefix_caching=False,
                                               events_file=str(tmp / f"{role}-events.jsonl")))
               for role in ("prefill", "decode")]
    p, d = handles
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            msgs = [{"role": "user", "content": generate_text(7, 120)}]
            t1 = await run_turn(session, p.url, d.url, msgs, None, "c-t1", max_tokens=40)
            msgs2 = [*msgs, {"role": "assistant", "content": t1.reply}, {"role": "user", "content": "next"}]
            t2 = await run_turn(session, p.url, d.url, msgs2, t1.d_params, "c-t2", max_tokens=40)
            assert t2.report is not None and t2.report["outcome"] == "remote_hit"
    finally:
        for h in handles:
            assert h.engine.sink is not None and h.engine.sink.flush()
            await h.close()
    return [e for role in ("prefill", "decode") for e in read_events(tmp / f"{role}-events.jsonl")]


def _shape(evs: list[TurnEvent]) -> dict[tuple[str, str], dict[str, type]]:
    shape: dict[tuple[str, str], dict[str, type]] = {}
    for e in evs:
        fields = shape.setdefault((e.source, e.event), {})
        for key, value in e.to_dict().items():
            fields[key] = type(value)
    return shape


async def test_sim_and_real_connector_events_are_field_compatible(run: dict[str, Any], tmp_path: Path) -> None:
    rec = scenario(run, "s1_two_turn")
    real = _shape(events(rec, "prefill") + events(rec, "decode"))
    sim_events = await _sim_two_turns(tmp_path)
    sim = _shape(sim_events)
    assert set(sim) == set(real)  # the same (source, event) kinds on both sides
    for kind, sim_fields in sim.items():
        real_fields = real[kind]
        assert set(sim_fields) - SIM_ONLY_TIMING <= set(real_fields), (kind, set(sim_fields) - set(real_fields))
        for key in set(sim_fields) & set(real_fields):
            assert sim_fields[key] is real_fields[key], (kind, key)
    # the per-request report under kv_transfer_params["kvdiag"]: the same keys and the same outcome
    sim_report = next(e for e in sim_events if e.event == "prefill_request" and e.outcome == "remote_hit")
    real_report = rec["t2_p_params"]["kvdiag"]
    assert real_report["outcome"] == sim_report.outcome
    for e in (sim_report, one(events(rec, "prefill"), "prefill_request", rec["ids"]["t2-p"])):
        assert e.request_id is not None and not e.request_id.startswith(("cmpl-", "chatcmpl-"))
