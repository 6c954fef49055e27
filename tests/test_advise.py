"""kvdiag advise: TTL share and cost, the transfer/prefill fits, configuration checks, JSON schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvdiag.cli.main import cli
from kvdiag.diagnostics.advise import SCHEMA, advise, retained_byte_seconds
from kvdiag.diagnostics.advise_config import scan_config
from kvdiag.diagnostics.records import ConversationRecord, TurnRecord
from kvdiag.diagnostics.report import build_turn_table
from kvdiag.diagnostics.report_synth import SynthParams, synthetic_conversations, write_router_events
from kvdiag.schema.verdicts import Verdict
from kvdiag.sim.timemodel import get_profile

QWEN = get_profile("qwen3-32b")
# Ground truth: the sim's qwen3-32b time-model profile, 20 % of gaps beyond the decode TTL.
KNOWN = SynthParams(conversations=400, share_over_ttl=0.2, decoder_ttl_s=480.0, router_ttl_s=450.0,
                    transfer_overhead_ms=QWEN.xfer_overhead_ms, bandwidth_gbps=QWEN.bandwidth_gbps,
                    bytes_per_token=QWEN.kv_bytes_per_token, prefill_base_ms=QWEN.step_overhead_ms,
                    prefill_ms_per_token=QWEN.per_token_ms, attention_ms=QWEN.attention_ms, seed=11)

STARTUP = ("(EngineCore_DP0 pid=22165) INFO 11-29 06:54:50 [base_scheduler.py:188] Bidirectional KV transfer is "
           "enabled and the kv recompute threshold is set to 64 tokens.KV blocks on D are released after a TTL of "
           "{ttl} seconds.\n")


def test_known_parameters_are_recovered() -> None:
    adv = advise(synthetic_conversations(KNOWN), 480.0)
    assert adv.ttl.share_after_expiry is not None
    assert abs(adv.ttl.share_after_expiry - 0.20) <= 0.02
    t = adv.threshold
    assert t.transfer_overhead_ms == pytest.approx(QWEN.xfer_overhead_ms, rel=0.10)
    assert t.bandwidth_gbps == pytest.approx(QWEN.bandwidth_gbps, rel=0.10)
    assert t.prefill_ms_per_token == pytest.approx(QWEN.per_token_ms, rel=0.10)
    # break-even r: overhead + r·bytes/bw = r·per_token + (attention/2)·r² (the sim's model, no prefix cache)
    xfer = QWEN.kv_bytes_per_token / (QWEN.bandwidth_gbps * 1e6)
    r = QWEN.xfer_overhead_ms / (QWEN.per_token_ms - xfer)
    assert t.recommended_tokens is not None and t.recommended_tokens == pytest.approx(r, rel=0.15)


def test_recommended_ttls_cover_their_percentile_and_cost_more() -> None:
    adv = advise(synthetic_conversations(KNOWN), 480.0)
    ttl = adv.ttl
    assert ttl.recommended_s["p90"] is not None and ttl.recommended_s["p99"] is not None
    assert ttl.recommended_s["p90"] <= ttl.recommended_s["p95"] <= ttl.recommended_s["p99"]  # type: ignore[operator]
    for key, q in (("p90", 0.90), ("p95", 0.95), ("p99", 0.99)):
        assert ttl.share_after_expiry_at[key] <= 1 - q + 0.005  # type: ignore[operator]
    costs = [ttl.retained_gib_seconds[k] for k in ("current", "p90", "p95", "p99")]
    assert all(c is not None for c in costs)
    assert costs == sorted(costs)  # longer retention holds more memory
    assert "GiB" in ttl.summary and "p95" in ttl.summary


def test_retained_cost_model_by_hand() -> None:
    # One conversation: turn 1 (100+10 tokens) read back after 30 s; turn 2 (200+20) is the last turn.
    conv = ConversationRecord("c", [
        TurnRecord("c", 1, prompt_tokens=100, completion_tokens=10, start_ts=0.0, end_ts=1.0),
        TurnRecord("c", 2, prompt_tokens=200, completion_tokens=20, start_ts=31.0, end_ts=32.0, gap_s=30.0),
    ])
    total, span = retained_byte_seconds(build_turn_table([conv]), 100.0, 2.0)
    assert total == pytest.approx(110 * 2 * 30 + 220 * 2 * 100)
    assert span == pytest.approx(32.0 + 100.0)
    # Under a 20 s TTL the 30 s gap expires: D holds turn 1 for the whole TTL.
    total, _ = retained_byte_seconds(build_turn_table([conv]), 20.0, 2.0)
    assert total == pytest.approx(110 * 2 * 20 + 220 * 2 * 20)


def test_no_advice_without_data() -> None:
    convs = [ConversationRecord(f"c{i}", [TurnRecord(f"c{i}", 1, verdict=Verdict.FIRST_TURN, prompt_tokens=100)])
             for i in range(3)]
    adv = advise(convs)
    assert adv.ttl.current_s is None and adv.ttl.share_after_expiry is None
    assert adv.ttl.recommended_s == {"p90": None, "p95": None, "p99": None}
    assert any("decode TTL" in m for m in adv.ttl.missing)
    assert adv.threshold.recommended_tokens is None and adv.threshold.bandwidth_gbps is None
    assert adv.threshold.summary.startswith("No threshold recommendation")
    assert {c.id: c.severity for c in adv.checks}["decoder_ttl"] == "missing_data"


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_config_from_stock_logs_and_router_ttl_check(tmp_path: Path) -> None:
    _write(tmp_path / "decode.log", STARTUP.format(ttl=300))
    _write(tmp_path / "prefill.log", STARTUP.format(ttl=300) +
           "(EngineCore_DP0 pid=23070) ERROR 11-29 06:57:32 [scheduler.py:3764] Failing 1 request(s) due to KV load "
           "failure (failure_policy=fail, 139 tokens affected). Request IDs: {'cmpl-8265fbbe-0'}\n")
    _write(tmp_path / "proxy.log", "2026-11-29 06:55:40 [INFO] disagg_proxy: conv=c1: stale cache entry "
           "(age=460.2s > ttl=450.0s), discarding\n")
    cfg = scan_config([str(tmp_path)])
    assert cfg.decoder_ttl is not None and cfg.decoder_ttl.value == 300.0
    assert cfg.decoder_ttl.source.endswith("decode.log:1")
    assert cfg.router_ttl is not None and cfg.router_ttl.value == 450.0
    assert cfg.recompute_threshold is not None and cfg.recompute_threshold.value == 64
    assert cfg.failure_policy is not None and cfg.failure_policy.value == "fail"
    assert cfg.bidirectional_prefill is not None and cfg.bidirectional_decode is not None
    adv = advise(synthetic_conversations(SynthParams(conversations=30)), 480.0, config=cfg)
    checks = {c.id: c for c in adv.checks}
    assert checks["router_ttl"].severity == "error" and "295" in checks["router_ttl"].fix
    assert checks["kv_load_failure_policy"].message.startswith("kv_load_failure_policy=fail")
    assert adv.ttl.current_s == 300.0  # the log wins over the option ...
    assert checks["decoder_ttl_option"].severity == "info"  # ... and the clash is reported
    assert adv.threshold.current_tokens == 64


def test_recompute_hang_and_misconfigurations_are_errors(tmp_path: Path) -> None:
    _write(tmp_path / "prefill.log", "(EngineCore_DP0 pid=1) DEBUG 11-29 06:56:00 [v1/core/sched/scheduler.py:3526] "
           "cmpl-6bb2965f-0 is still in WAITING_FOR_REMOTE_KVS state.\n")
    convs = synthetic_conversations(SynthParams(conversations=20, missing_metadata_share=0.3))
    convs[0].turns[1].verdict = Verdict.FEATURE_DISABLED_ON_PREFILL
    convs[1].turns[0].verdict = Verdict.NO_CONVERSATION_ID
    adv = advise(convs, 480.0, config=scan_config([str(tmp_path)]), router_ttl=478.0)
    sev = {c.id: c.severity for c in adv.checks}
    assert sev["kv_load_failure_policy"] == "error"
    assert sev["bidirectional_prefill"] == "error"
    assert sev["streaming_params"] == "error"
    assert sev["conversation_ids"] == "warning"
    assert sev["router_ttl"] == "error"  # 478 > 480 − 5


def test_ttl_of_five_seconds_or_less_never_works() -> None:
    adv = advise(synthetic_conversations(SynthParams(conversations=10)), 5.0)
    assert {c.id: c.severity for c in adv.checks}["decoder_ttl"] == "error"


def test_cli_advise_json_schema_from_event_logs(tmp_path: Path) -> None:
    write_router_events(synthetic_conversations(KNOWN), tmp_path / "router-events.jsonl", router_ttl_s=450.0)
    res = CliRunner().invoke(cli, ["advise", str(tmp_path), "--json", "--decoder-ttl", "480", "--no-cache",
                                   "--no-progress"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["schema"] == SCHEMA
    ttl, thr = doc["ttl"], doc["threshold"]
    assert 0.0 <= ttl["share_after_expiry"] <= 1.0 and abs(ttl["share_after_expiry"] - 0.20) <= 0.02
    assert ttl["current_s"] == 480.0 and set(ttl["recommended_s"]) == {"p90", "p95", "p99"}
    assert isinstance(ttl["retained_gib_seconds"]["current"], float)
    assert thr["transfer_overhead_ms"] == pytest.approx(QWEN.xfer_overhead_ms, rel=0.10)
    assert thr["bandwidth_gbps"] == pytest.approx(QWEN.bandwidth_gbps, rel=0.10)
    assert isinstance(thr["recommended_tokens"], int)
    checks = {c["id"]: c for c in doc["checks"]}
    assert checks["router_ttl"]["severity"] == "ok"  # 450 s read from the router events' ttl_s
    assert all({"id", "severity", "message", "fix", "data"} <= c.keys() for c in doc["checks"])


def test_cli_advise_text_output(tmp_path: Path) -> None:
    write_router_events(synthetic_conversations(SynthParams(conversations=30)), tmp_path / "router-events.jsonl")
    res = CliRunner().invoke(cli, ["advise", str(tmp_path / "router-events.jsonl"), "--no-cache", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "No TTL recommendation" in res.output and "--decoder-ttl" in res.output
    assert "kv_recompute_threshold" in res.output


def test_config_cache_hits_and_misses_on_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvdiag.diagnostics import advise_config

    log = _write(tmp_path / "decode.log", STARTUP.format(ttl=300))
    cache = tmp_path / "cache"
    first = advise_config.scan_config_cached([str(log)], cache)
    assert first.decoder_ttl is not None and first.decoder_ttl.value == 300.0
    calls: list[object] = []
    real = advise_config.scan_config
    monkeypatch.setattr(advise_config, "scan_config", lambda paths: calls.append(paths) or real(paths))
    again = advise_config.scan_config_cached([str(log)], cache)
    assert again == first and calls == []  # from the cache
    _write(log, STARTUP.format(ttl=900) + "\n")
    changed = advise_config.scan_config_cached([str(log)], cache)
    assert changed.decoder_ttl is not None and changed.decoder_ttl.value == 900.0 and len(calls) == 1


@pytest.mark.parametrize("shape", ["document", "batched"])
def test_config_from_engine_start_events_in_a_json_array(tmp_path: Path, shape: str) -> None:
    # the engines' configuration events written as one pretty-printed array, or two to a line: both are read
    start = {"v": 1, "ts": 1764400000.0, "source": "decode", "event": "engine_start",
             "attrs": {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 300,
                       "kv_load_failure_policy": "recompute"}}
    retained = {"v": 1, "ts": 1764400001.0, "source": "decode", "event": "kv_retained", "conversation_id": "c",
                "turn": 1, "request_id": "r1", "ttl_s": 300}
    path = tmp_path / "decode-events.jsonl"
    if shape == "document":
        path.write_text(json.dumps([start, retained], indent=2) + "\n", encoding="utf-8")
    else:
        path.write_text(json.dumps([start, retained]) + "\n" + json.dumps({**retained, "turn": 2}) + "\n",
                        encoding="utf-8")
    cfg = scan_config([path])
    assert cfg.decoder_ttl is not None and cfg.decoder_ttl.value == 300
    assert cfg.bidirectional_decode is not None and cfg.bidirectional_decode.value is True
    assert cfg.failure_policy is not None and cfg.failure_policy.value == "recompute"
    where = cfg.bidirectional_decode.source
    assert where == f"{path}:{2 if shape == 'document' else 1}", where
