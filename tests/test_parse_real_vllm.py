"""Parser and explain pinned to lines real vLLM 0.33.0 wrote (tests/fixtures/logs/real_vllm_0.33).

The fixture is cut from one run of tests/test_explain_real_vllm.py (real Scheduler + NixlConnector
+ NIXL on CPU, P at DEBUG, D at INFO, ``kvdiag router --proxy-log``): conversation ``real-normal-a``
turns 1–2 (turn 2 reads D's blocks back) and ``real-expired`` turns 1–2 (P declines the read 2.5 s
before D's 6 s TTL runs out). Lines and ids are verbatim; only other requests' lines and all but
three of each request's per-step ``WAITING_FOR_REMOTE_KVS`` lines were left out.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvdiag.diagnostics.turn_loader import explain_conversation
from kvdiag.diagnostics.vllm_log_parser import VllmRecord, parse_vllm_log
from kvdiag.schema.verdicts import Confidence, Verdict

REAL = Path(__file__).parent / "fixtures" / "logs" / "real_vllm_0.33"
HIT_P_ID = "chatcmpl-804d33be36934ef680e60eb7d140224c-123324ee"
DECLINED_P_ID = "chatcmpl-36b722057b344d248e7f5e591a7363bb-52f335c7"
D_ENGINE = "D-0613609b-8202-49ac-8c36-50442ff4b0de"


def _records(name: str) -> dict[int, VllmRecord]:
    with (REAL / name).open("rb") as fh:
        return {r.lineno: r for r in parse_vllm_log(fh, name)}


@pytest.fixture(scope="module")
def p_records() -> dict[int, VllmRecord]:
    return _records("prefill.log")


def test_startup_line_at_debug_and_info(p_records: dict[int, VllmRecord]) -> None:
    d_records = _records("decode.log")
    # the file part is an abbreviated path at DEBUG, the bare file name at INFO
    assert (p_records[16].fileinfo, p_records[16].kind) == ("distributed/.../nixl/base_scheduler.py:188",
                                                            "bidir_enabled")
    assert (d_records[16].fileinfo, d_records[16].kind) == ("base_scheduler.py:188", "bidir_enabled")
    assert p_records[16].fields == d_records[16].fields == {"threshold": 64, "ttl_s": 6}
    assert (p_records[16].proc, p_records[16].pid, p_records[16].ts) == ("EngineCore", 26967, "11-29 09:29:30")
    # NIXL's own format and torch's glog line are not vLLM records
    assert 2 not in p_records and 23 not in p_records


def test_successful_readback_lines(p_records: dict[int, VllmRecord]) -> None:
    start, read, done = p_records[35], p_records[40], p_records[42]
    assert start.kind == "start_load_kv" and start.fields == {
        "request_id": HIT_P_ID, "remote_engine_id": D_ENGINE, "local_blocks": 1, "remote_blocks": 1}
    assert read.kind == "read_blocks" and read.fields == {
        "remote_engine_id": D_ENGINE, "block_size": 32, "request_id": HIT_P_ID}
    assert (done.kind, done.fields) == ("finished_recving", {"request_id": HIT_P_ID})
    # an ordinary read logs the WAITING_FOR_REMOTE_KVS line on every step, then finishes
    assert [p_records[n].kind for n in (36, 37, 41)] == ["waiting_remote_kvs"] * 3
    assert (p_records[43].kind, p_records[43].fields) == (
        "request_finished_status", {"request_id": HIT_P_ID, "status": "FINISHED_LENGTH_CAPPED"})
    assert (p_records[44].kind, p_records[44].fields) == ("request_finished_wait", {"request_id": HIT_P_ID,
                                                                                    "seconds": 30})


def test_declined_expired_read_lines(p_records: dict[int, VllmRecord]) -> None:
    decline, skip, fail = p_records[47], p_records[48], p_records[49]
    assert (decline.level, decline.fileinfo) == ("WARNING", "distributed/.../nixl/pull_worker.py:161")
    assert decline.kind == "declining_expired" and decline.fields == {"request_id": DECLINED_P_ID,
                                                                      "engine_id": D_ENGINE}
    assert (skip.kind, skip.fields) == ("skip_post_processing", {"request_id": DECLINED_P_ID})
    assert fail.level == "ERROR" and fail.kind == "kv_load_failed" and fail.fields == {
        "count": 1, "policy": "fail", "tokens": 74, "request_ids": [DECLINED_P_ID]}
    # real vLLM also reports the declined read as "finished recving", after the failure
    assert (p_records[50].fields["status"], p_records[51].kind) == ("FINISHED_ERROR", "finished_recving")


def test_explain_on_the_real_lines() -> None:
    hit = explain_conversation([str(REAL)], "real-normal-a").turns
    assert [(t.verdict, t.confidence) for t in hit] == [(Verdict.FIRST_TURN, Confidence.INFERRED),
                                                        (Verdict.REMOTE_HIT, Confidence.CONFIRMED)]
    assert "the turn failed" not in hit[1].reason  # the per-step WAITING lines are not a hang
    assert any(e.source.endswith("prefill.log:40") for e in hit[1].evidence)
    expired = explain_conversation([str(REAL)], "real-expired").turns
    assert (expired[1].verdict, expired[1].confidence) == (Verdict.EXPIRED_REMOTE_READ, Confidence.CONFIRMED)
    assert expired[1].request_id == "36b722057b344d248e7f5e591a7363bb"
    assert any(e.source.endswith("prefill.log:47") for e in expired[1].evidence)
    # P failed that attempt, but the proxy stored D's next handle after it: the client got its answer
    # (kvdiag's router retried P without the handle)
    assert "the turn failed" not in expired[1].reason and "yet the client got its answer" in expired[1].reason


def test_request_that_never_leaves_waiting_is_a_hang(tmp_path: Path) -> None:
    """Cut P's log after the last WAITING line of the read: the request never finished (vLLM 0.33 F1)."""
    run = tmp_path / "run"
    shutil.copytree(REAL, run)
    lines = (REAL / "prefill.log").read_text().splitlines(keepends=True)
    (run / "prefill.log").write_text("".join(lines[:41]))
    turn = explain_conversation([str(run)], "real-normal-a").turns[1]
    assert turn.verdict is Verdict.UNKNOWN and "WAITING_FOR_REMOTE_KVS" in turn.reason


_NIXL_STATS_PROBE = r"""
import inspect, json, re
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import stats

def line(record):
    s = stats.NixlKVConnectorStats()
    record(s)
    out = []
    log = KVConnectorLogging.__new__(KVConnectorLogging)
    log.transfer_stats_accumulator = s
    log.log(lambda fmt, *args: out.append(fmt % args))
    return out[0] if out else None

class Telemetry:  # what NIXL's get_xfer_telemetry returns (microseconds, bytes, descriptors)
    xferDuration, postDuration, totalBytes, descCount = 3100.0, 600.0, 458752, 14

print(json.dumps({
    "names": sorted(set(re.findall(r'name="(vllm:nixl_\w+)"', inspect.getsource(stats)))),
    "read": line(lambda s: s.record_transfer(Telemetry())),
    "handshake": line(lambda s: s.record_failed_handshake()),
    "notification": line(lambda s: s.record_failed_notification()),
    "expired": line(lambda s: s.record_kv_expired_req()),
    "after_expiry": line(lambda s: s.record_notification_after_expiry()),
}))
"""


@pytest.mark.vllm
def test_nixl_stats_semantics_of_the_installed_vllm() -> None:
    """The installed vLLM's NIXL stats, as kvdiag's parser, windows and metric catalog read them.

    Since vLLM 0.33 (PR #55854) a failed handshake or notification counts as a failed transfer and KV
    expiry counts apart: an expired (declined) read is not a failed transfer.
    """
    import json
    import subprocess
    import sys

    from kvdiag.dashboards.vllm_metrics import VLLM_METRICS
    from kvdiag.diagnostics.vllm_log_parser import classify_message
    from kvdiag.diagnostics.windows import _successes

    out = subprocess.run([sys.executable, "-c", _NIXL_STATS_PROBE], capture_output=True, text=True, timeout=300,
                         check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(got["names"]) == {n for n, _ in VLLM_METRICS if n.startswith("vllm:nixl_")}
    fields = {}
    for case in ("read", "handshake", "notification", "expired", "after_expiry"):
        kind, f = classify_message(got[case])
        assert kind == "kv_metrics", got[case]
        fields[case] = f
    assert fields["read"]["Num successful transfers"] == "1" and fields["read"]["Avg MB per transfer"] == "0.438"
    assert fields["handshake"]["Num failed transfers"] == "1" == fields["notification"]["Num failed transfers"]
    assert fields["expired"]["Num KV expired reqs"] == "1" and fields["expired"]["Num failed transfers"] == "0"
    assert fields["after_expiry"]["Num notifs after expiry"] == "1"
    # explain's windows count the successes of each line (a failure-only line counts none)
    rec = VllmRecord(path="p", lineno=1, level="INFO", ts="11-29 10:00:00", fileinfo="metrics.py:108", msg="",
                     kind="kv_metrics")
    for case, want in (("read", 1), ("handshake", 0), ("expired", 0)):
        rec.fields = fields[case]
        assert _successes(rec) == want, case
