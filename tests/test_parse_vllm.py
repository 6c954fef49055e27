"""The stock vLLM log parser against real lines (docs/vllm-reference.md; vLLM 0.33 and public bug reports)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdiag.diagnostics.linestats import LineStats
from kvdiag.diagnostics.verdict_engine import VLLM_MESSAGE_STARTS
from kvdiag.diagnostics.vllm_log_parser import classify_message, parse_vllm_log
from kvdiag.schema.request_ids import external_id, header_request_id

FIXTURE = Path(__file__).parent / "fixtures" / "logs" / "vllm_real_lines.log"
VLLM_KEYWORDS = tuple(s.encode() for s in VLLM_MESSAGE_STARTS)  # the message starts the engine's prefilter keeps


@pytest.fixture(scope="module")
def records() -> dict[int, object]:
    with FIXTURE.open("rb") as fh:
        return {r.lineno: r for r in parse_vllm_log(fh, str(FIXTURE))}


def test_aws_do_eks_sample_lines(records: dict[int, object]) -> None:
    inv, rel = records[1], records[2]
    assert (inv.level, inv.ts, inv.fileinfo, inv.kind) == ("ERROR", "08-16 08:09:28", "worker.py:3004",
                                                           "invalid_unrecognized")
    assert inv.fields == {"request_id": "8f07dfc0-...-a2f0e657"}
    assert rel.kind == "releasing_expired" and rel.fields == {"request_id": "8f07dfc0-...", "count": 0}


def test_process_prefix_debug_path_and_ansi(records: dict[int, object]) -> None:
    assert records[3].fileinfo == "distributed/.../v1/nixl_connector.py:630" and records[3].proc is None
    assert (records[4].proc, records[4].pid) == ("Worker_TP2", 54584)
    ansi = records[6]
    assert (ansi.proc, ansi.pid, ansi.level, ansi.fileinfo) == ("EngineCore_DP0", 279, "INFO", "core.py:93")
    assert ansi.msg == "Initializing a V1 LLM engine"


def test_uvicorn_access_line_is_not_a_record(records: dict[int, object]) -> None:
    assert 5 not in records
    stats = LineStats()
    with FIXTURE.open("rb") as fh:
        n = sum(1 for _ in parse_vllm_log(fh, str(FIXTURE), stats))
    assert stats.other == 1 and stats.records == n and stats.corrupt == 0


def test_bidirectional_startup_line_with_missing_space(records: dict[int, object]) -> None:
    assert records[8].kind == "bidir_enabled" and records[8].fields == {"threshold": 64, "ttl_s": 2}
    kind, fields = classify_message("Bidirectional KV transfer is enabled and the kv recompute threshold is set "
                                    "to 32 tokens")
    assert kind == "bidir_enabled" and fields == {"threshold": 32, "ttl_s": None}


def test_expiry_decline_and_failing(records: dict[int, object]) -> None:
    assert records[9].fields["request_id"] == "cmpl-84a2d3ebd7e34a2da27da6524603c95c-0"
    assert records[10].kind == "declining_expired"
    assert records[10].fields == {"request_id": "cmpl-b8404411f99f42c1971e39371cd97420-0",
                                  "engine_id": "d695e402-ef6c-4155-82d0-bfca3da4e06f"}
    assert records[11].kind == "kv_load_failed"
    assert records[11].fields["request_ids"] == ["cmpl-b8404411f99f42c1971e39371cd97420-0"]
    assert records[11].fields["tokens"] == 139 and records[11].fields["policy"] == "fail"


def test_threshold_skip(records: dict[int, object]) -> None:
    assert records[12].fields == {"request_id": "cmpl-55278d67283b4375bb3bb7756282a15a-0", "remote_tokens": 13,
                                  "threshold": 64}


def test_nixl_failure_context_and_cr_continuation_folded(records: dict[int, object]) -> None:
    rec = records[13]
    assert rec.kind == "nixl_failure" and rec.fields["failure_type"] == "handshake_failed"
    assert rec.fields["context"]["request_id"] == "cmpl-8265fbbe-0"
    assert rec.fields["context"]["remote_port"] == 5999
    assert 14 not in records and "engine ID mismatch" in rec.msg


def test_debug_transfer_lines(records: dict[int, object]) -> None:
    assert records[15].kind == "read_blocks" and records[15].fields["block_size"] == 32
    assert records[16].kind == "finished_recving" and records[16].fields["request_id"] == "cmpl-d8421ed2-0"
    assert records[17].fields == {"request_id": "cmpl-871395d3-0", "seconds": 480}
    assert records[18].kind == "waiting_remote_kvs"


def test_request_logging_lines(records: dict[int, object]) -> None:
    assert records[19].fields["request_ids"] == ["chatcmpl-abc-12345678", "chatcmpl-def-87654321"]
    assert records[20].kind == "request_failed" and records[20].fields["why"] == "engine dead"


def test_old_release_wording(records: dict[int, object]) -> None:
    assert records[21].kind == "releasing_expired" and records[21].fields["count"] == 0


def test_kv_metrics_line(records: dict[int, object]) -> None:
    assert records[22].fields["Num successful transfers"] == "4"


def test_traceback_lines_fold_into_previous_record() -> None:
    lines = [b"ERROR 11-29 06:57:32 [base_worker.py:1435] NIXL transfer failure: handshake_setup_failed | "
             b"Context: {'failure_type': 'handshake_setup_failed', 'request_id': None}\n",
             b"Traceback (most recent call last):\n", b'  File "x.py", line 1, in <module>\n',
             b"zmq.error.Again: Resource temporarily unavailable\n",
             b"INFO 11-29 06:57:33 [core.py:1] next\n"]
    recs = list(parse_vllm_log(lines))
    assert len(recs) == 2 and recs[0].msg.count("\n") == 3 and recs[1].msg == "next"
    assert recs[0].fields["context"] == {"failure_type": "handshake_setup_failed", "request_id": None}


def test_logging_prefix_is_accepted() -> None:
    (rec,) = parse_vllm_log([b"[myhost] WARNING 11-29 06:55:40 [pull_worker.py:161] Declining expired remote "
                             b"read for chatcmpl-r1-aaaaaaaa from engine e1.\n"])
    assert rec.kind == "declining_expired" and rec.fields["request_id"] == "chatcmpl-r1-aaaaaaaa"


@pytest.mark.parametrize(("internal", "ext", "rid"), [
    ("chatcmpl-87b7b96b8c2e104b-aa5dcbb6", "chatcmpl-87b7b96b8c2e104b", "87b7b96b8c2e104b"),
    ("cmpl-84a2d3ebd7e34a2da27da6524603c95c-0", "cmpl-84a2d3ebd7e34a2da27da6524603c95c-0",
     "84a2d3ebd7e34a2da27da6524603c95c-0"),
    ("chatcmpl-0b7e4c1a-1d2e-4f3a-8b9c-0d1e2f3a4b5c", "chatcmpl-0b7e4c1a-1d2e-4f3a-8b9c-0d1e2f3a4b5c",
     "0b7e4c1a-1d2e-4f3a-8b9c-0d1e2f3a4b5c"),
])
def test_request_id_forms(internal: str, ext: str, rid: str) -> None:
    assert external_id(internal) == ext
    assert header_request_id(internal) == rid


def test_every_classified_line_passes_the_all_prefilter() -> None:
    raw = FIXTURE.read_bytes().splitlines()
    with FIXTURE.open("rb") as fh:
        kinds = {r.lineno: r.kind for r in parse_vllm_log(fh, str(FIXTURE)) if r.kind and r.kind != "kv_metrics"}
    assert len(kinds) > 15
    for lineno in kinds:
        assert any(k in raw[lineno - 1] for k in VLLM_KEYWORDS), raw[lineno - 1]


def test_api_server_internal_error_line() -> None:
    # vLLM 0.33's API server when a request finished with an error (it answers HTTP 500), e.g. P's
    # request failed on a KV load failure: entrypoints/generate/base/serving.py
    line = (b"(APIServer pid=31790) ERROR 11-29 10:01:12 [serving.py:203] Request "
            b"chatcmpl-4f1da133-0009-4009-a009-1e2f3a4bb5e6 failed with an internal error during generation\n")
    rec = next(parse_vllm_log([line], "prefill.log"))
    assert rec.kind == "request_failed" and rec.fields["request_id"] == "chatcmpl-4f1da133-0009-4009-a009-1e2f3a4bb5e6"
    assert "HTTP 500" in rec.fields["why"] and any(k in line for k in VLLM_KEYWORDS)
