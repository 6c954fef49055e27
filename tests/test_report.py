"""kvdiag report: the per-turn table, its aggregations, the Parquet cache and the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest
from click.testing import CliRunner

from kvdiag.cli.main import cli
from kvdiag.diagnostics import report as report_mod
from kvdiag.diagnostics import report_cache
from kvdiag.diagnostics.records import ConversationRecord, TurnRecord
from kvdiag.diagnostics.report import ReportError, build_report, build_turn_table
from kvdiag.diagnostics.report_sections import TurnTable, outcome_mix_section
from kvdiag.diagnostics.report_synth import SynthParams, synthetic_conversations, write_router_events
from kvdiag.schema.verdicts import Verdict


def _turn(conv: str, turn: int, verdict: Verdict, prompt: int, ttft: float, start: float, latency: float = 1000.0,
          **kw: object) -> TurnRecord:
    return TurnRecord(conversation_id=conv, turn=turn, verdict=verdict, prompt_tokens=prompt, ttft_ms=ttft,
                      start_ts=start, latency_ms=latency, **kw)  # type: ignore[arg-type]


def _small() -> list[ConversationRecord]:
    # conv a: gaps 10 s and 500 s (end of a turn = start + latency); conv b: gap 20 s given explicitly.
    a = ConversationRecord("a", [
        _turn("a", 1, Verdict.FIRST_TURN, 1000, 100.0, 0.0),
        _turn("a", 2, Verdict.REMOTE_HIT, 3000, 50.0, 11.0, transfer_bytes=1000, transfer_ms=5.0, remote_tokens=900),
        _turn("a", 3, Verdict.EXPIRED_REMOTE_READ, 5000, 300.0, 512.0),
    ])
    b = ConversationRecord("b", [
        _turn("b", 1, Verdict.FIRST_TURN, 500, 90.0, 0.0),
        _turn("b", 2, Verdict.METADATA_NOT_RETURNED, 2500, 200.0, 21.0, gap_s=20.0,
              reason="previous decode response had no kv_transfer_params (not_streamed)"),
    ])
    return [a, b]


def test_turn_table_derives_buckets_and_gaps() -> None:
    df = build_turn_table(_small())
    assert len(df) == 5
    row = df.set_index(["conversation_id", "turn"])
    assert row.loc[("a", 2), "gap_s"] == pytest.approx(10.0)
    assert row.loc[("a", 3), "gap_s"] == pytest.approx(500.0)
    assert row.loc[("b", 2), "gap_s"] == pytest.approx(20.0)
    assert pd.isna(row.loc[("a", 1), "gap_s"])
    assert row.loc[("a", 3), "prompt_bucket"] == "2-8k"
    assert row.loc[("b", 2), "metadata_reason"] == "not_streamed"
    assert bool(row.loc[("a", 2), "reused"]) and not bool(row.loc[("a", 3), "reused"])


def test_outcome_mix_counts_per_bucket() -> None:
    df = build_turn_table(_small())
    rep = build_report(df)
    by_turn = rep.by_turn
    assert by_turn.loc["1", "first_turn"] == 2
    assert by_turn.loc["2", "remote_hit"] == 1 and by_turn.loc["2", "metadata_not_returned"] == 1
    assert by_turn.loc["3", "expired_remote_read"] == 1
    assert by_turn.loc["2", "reused_share"] == pytest.approx(0.5)
    assert by_turn.loc["8+", "turns"] == 0
    by_prompt = rep.by_prompt
    assert by_prompt.loc["<2k", "turns"] == 2 and by_prompt.loc["2-8k", "turns"] == 3
    tt = TurnTable(pa.Table.from_pandas(df, preserve_index=False))
    try:
        with pytest.raises(ValueError, match="turn_bucket or prompt_bucket"):
            outcome_mix_section(tt, "model")
    finally:
        tt.close()


def test_ttft_reused_vs_recomputed_per_bucket() -> None:
    ttft = build_report(build_turn_table(_small())).ttft
    row = ttft.loc["2-8k"]
    assert row["reused_n"] == 1 and row["reused_p50_ms"] == pytest.approx(50.0)
    assert row["recomputed_n"] == 2 and row["recomputed_p50_ms"] == pytest.approx(250.0)
    assert row["speedup_p50"] == pytest.approx(5.0)
    assert ttft.loc["<2k", "reused_n"] == 0  # first turns are not in the reused/recomputed comparison


def test_a_failed_turn_is_not_a_recomputed_one_in_the_ttft_table() -> None:
    # its TTFT is the time to the error: as a recomputed turn it would make recomputing look fast
    convs = _small()
    convs[1].turns.append(_turn("b", 3, Verdict.REQUEST_FAILED, 3500, 3.0, 40.0))
    row = build_report(build_turn_table(convs)).ttft.loc["2-8k"]
    assert row["recomputed_n"] == 2 and row["recomputed_p50_ms"] == pytest.approx(250.0)


def test_gap_summary_against_ttl() -> None:
    g = build_report(build_turn_table(_small()), 480.0).gaps
    assert g.later_turns == 3 and g.gaps_known == 3
    assert g.share_over_ttl == pytest.approx(1 / 3, abs=1e-4)
    assert g.expired_ratio == pytest.approx(1 / 3, abs=1e-4)
    assert g.missing_metadata_ratio == pytest.approx(1 / 3, abs=1e-4)
    assert g.missing_metadata_reasons == {"not_streamed": 1}
    assert sum(g.histogram_counts) == 3 and g.histogram_edges_s[-1] >= 500.0
    unknown = build_report(build_turn_table(_small()), None).gaps
    assert unknown.share_over_ttl is None and unknown.quantiles_s["p50"] == pytest.approx(20.0)


def test_report_json_has_no_nan_and_empty_input_is_an_error() -> None:
    doc = build_report(build_turn_table(_small()), 480.0).to_json_dict()
    text = json.dumps(doc, allow_nan=False)  # raises on NaN/inf
    assert json.loads(text)["turns"] == 5
    with pytest.raises(ReportError, match="no turns"):
        build_report(build_turn_table([]))


def test_parquet_cache_hits_and_misses_on_change(tmp_path: Path) -> None:
    log = tmp_path / "router-events.jsonl"
    log.write_text("{}\n")
    cache = tmp_path / "cache"
    df = build_turn_table(_small())
    assert report_cache.load_cached_table([log], cache, 1) is None
    stored = report_cache.store_cached_table(df, [log], cache, 1)
    assert stored is not None and stored.exists()
    back = report_cache.load_cached_table([log], cache, 1)
    assert back is not None
    pd.testing.assert_frame_equal(report_mod.table_frame(back), df)
    assert report_cache.load_cached_table([log], cache, 2) is None  # table version is part of the key
    os.utime(log, ns=(0, 10**9))
    assert report_cache.load_cached_table([log], cache, 1) is None  # mtime changed: miss
    report_cache.store_cached_table(df, [log], cache, 1)
    report_cache.cache_path([log], cache, 1).write_bytes(b"not parquet")
    assert report_cache.load_cached_table([log], cache, 1) is None  # torn cache file: a miss, not a crash


@pytest.fixture()
def events_dir(tmp_path: Path) -> Path:
    d = tmp_path / "logs"
    d.mkdir()
    write_router_events(synthetic_conversations(SynthParams(conversations=40, seed=3)), d / "router-events.jsonl")
    return d


def test_cli_report_writes_every_format_and_reuses_the_cache(events_dir: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    cache = tmp_path / "cache"
    args = ["report", str(events_dir), "--decoder-ttl", "480", "--cache-dir", str(cache), "--no-progress",
            "--csv", str(out / "t.csv"), "--parquet", str(out / "t.parquet"), "--json", str(out / "r.json"),
            "--html", str(out / "r.html")]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert "Outcome mix by turn index" in res.output
    expected = build_report(build_turn_table(synthetic_conversations(SynthParams(conversations=40, seed=3))), 480.0)
    table = pd.read_csv(out / "t.csv")
    assert len(table) == len(expected.table)
    assert len(pd.read_parquet(out / "t.parquet")) == len(expected.table)
    doc = json.loads((out / "r.json").read_text())
    assert doc["gaps"]["share_over_ttl"] == pytest.approx(expected.gaps.share_over_ttl)
    assert doc["conversations"] == 40
    assert (out / "r.html").read_text().startswith("<!DOCTYPE html>")
    assert len(list(cache.glob("turns-*.parquet"))) == 1

    def no_parse(*_a: object, **_k: object) -> pa.Table:
        raise AssertionError("the second run must come from the cache")

    monkeypatch.setattr(report_mod, "engine_table", no_parse)
    again = CliRunner().invoke(cli, [*args[:6], "--no-progress", "--json", str(out / "r2.json")])
    assert again.exit_code == 0, again.output
    assert json.loads((out / "r2.json").read_text())["turns"] == doc["turns"]


def test_cli_report_names_a_missing_input(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["report", str(tmp_path / "nope.log"), "--no-cache"])
    assert res.exit_code == 1
    assert "nope.log" in res.output and "Hint" in res.output


@pytest.mark.parametrize("option", ["--csv", "--parquet", "--json", "--html"])
def test_cli_report_output_in_a_missing_folder_is_a_one_line_error(events_dir: Path, tmp_path: Path,
                                                                    option: str) -> None:
    target = tmp_path / "no-such-dir" / "out.file"
    res = CliRunner().invoke(cli, ["report", str(events_dir), "--no-cache", "--no-progress", option, str(target)])
    assert res.exit_code == 1, res.output
    assert isinstance(res.exception, SystemExit), res.exception  # a raw OSError would be a traceback
    assert "Error: cannot write" in res.output and "Pick a writable path" in res.output


def test_quantiles_match_pandas_on_synthetic_traffic() -> None:
    df = build_turn_table(synthetic_conversations(SynthParams(conversations=60, seed=5)))
    ttft = build_report(df).ttft
    later = df[(df["turn"] > 1) & (df["prompt_bucket"] == "8-16k")]
    p95 = later.loc[later["reused"], "ttft_ms"].quantile(0.95)
    assert ttft.loc["8-16k", "reused_p95_ms"] == p95  # pandas' own interpolation, to the last bit
