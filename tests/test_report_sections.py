"""The report's sections, computed without pandas, equal what pandas computes from the same turn table.

The reference below states each section in pandas (groupby, Series.quantile, Series.round, value_counts): the
way the report computed them before it moved to DuckDB and numpy. Random tables (missing values of every kind,
unknown verdicts, ties, empty buckets) must give the same JSON document to the last bit. The controls show the
comparison would see a quantile interpolated another way or shares rounded another way. A last test pins that
``kvdiag report`` prints a report without importing pandas (and, as its control, that ``--csv`` does).
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from kvdiag.diagnostics import report_sections
from kvdiag.diagnostics.report import TABLE_COLUMNS, build_report, normalize_table
from kvdiag.diagnostics.report_synth import SynthParams, synthetic_conversations, write_router_events
from kvdiag.schema.metrics import PROMPT_BUCKETS, TURN_BUCKETS
from kvdiag.schema.verdicts import REUSED_VERDICTS, TRIM_INFO, TrimReason, Verdict

EXPIRED = {Verdict.EXPIRED_REMOTE_READ.value, Verdict.ROUTER_ENTRY_EXPIRED.value}


# ------------------------------------------------------------------------------------------------ reference

def _q(series: pd.Series, q: float) -> float | None:
    s = series.dropna()
    return float(s.quantile(q)) if len(s) else None


def _rows(df: pd.DataFrame) -> list[dict[str, Any]]:
    out = []
    for row in df.reset_index().to_dict(orient="records"):
        out.append({str(k): None if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))
                    else v.item() if hasattr(v, "item") else v for k, v in row.items()})
    return out


def _mix(df: pd.DataFrame, by: str) -> list[dict[str, Any]]:
    order = TURN_BUCKETS if by == "turn_bucket" else PROMPT_BUCKETS
    sub = df[[by, "verdict"]].dropna(subset=[by])
    table = sub.groupby([by, "verdict"]).size().unstack(fill_value=0) if len(sub) else pd.DataFrame()
    table = table.reindex(index=list(order), columns=[v.value for v in Verdict], fill_value=0).fillna(0)
    table = table.astype("int64")
    table = table.loc[:, (table.sum(axis=0) > 0).to_numpy()] if len(sub) else table.iloc[:, :0]
    table.index.name = by
    table.insert(0, "turns", table.sum(axis=1))
    reused = [c for c in table.columns if c in {v.value for v in REUSED_VERDICTS}]
    table["reused_share"] = (table[reused].sum(axis=1) / table["turns"].where(table["turns"] > 0)).round(4)
    return _rows(table)


def _ttft(df: pd.DataFrame) -> list[dict[str, Any]]:
    later = df[(df["turn"] > 1) & df["ttft_ms"].notna() & df["prompt_bucket"].notna()
               & ~df["verdict"].isin(["request_failed", "unknown"])]
    rows = []
    for bucket in PROMPT_BUCKETS:
        row: dict[str, Any] = {"prompt_bucket": bucket}
        for label, reused in (("reused", True), ("recomputed", False)):
            part = later[(later["prompt_bucket"] == bucket) & (later["reused"] == reused)]["ttft_ms"]
            row[f"{label}_n"] = len(part)
            row[f"{label}_p50_ms"] = _q(part, 0.5)
            row[f"{label}_p95_ms"] = _q(part, 0.95)
        p_re, p_rc = row["reused_p50_ms"], row["recomputed_p50_ms"]
        row["speedup_p50"] = round(p_rc / p_re, 2) if p_re and p_rc else None
        rows.append(row)
    return rows


def _transfer(df: pd.DataFrame) -> list[dict[str, Any]]:
    xfer = df[df["transfer_bytes"].notna() & (df["transfer_bytes"] > 0) & df["prompt_bucket"].notna()]
    rows = []
    for bucket in PROMPT_BUCKETS:
        b = xfer[xfer["prompt_bucket"] == bucket]
        rows.append({"prompt_bucket": bucket, "transfers": len(b),
                     "bytes_p50": _q(b["transfer_bytes"].astype("float64"), 0.5),
                     "bytes_total": int(b["transfer_bytes"].sum()) if len(b) else 0,
                     "ms_p50": _q(b["transfer_ms"], 0.5), "ms_p95": _q(b["transfer_ms"], 0.95)})
    return rows


def _first_later(df: pd.DataFrame) -> list[dict[str, Any]]:
    rows = []
    for label, part in (("first", df[df["turn"] == 1]), ("later", df[df["turn"] > 1])):
        n = len(part)
        rows.append({"turns": label, "n": n, "reused_share": round(float(part["reused"].mean()), 4) if n else None,
                     "unknown_share": round(float((part["verdict"].astype(str) == "unknown").mean()), 4) if n else None,
                     "ttft_p50_ms": _q(part["ttft_ms"], 0.5), "ttft_p95_ms": _q(part["ttft_ms"], 0.95),
                     "prompt_tokens_p50": _q(part["prompt_tokens"].astype("float64"), 0.5)})
    return rows


def _gaps(df: pd.DataFrame, ttl: float | None) -> dict[str, Any]:
    later = df[df["turn"] > 1]
    gaps = later["gap_s"].dropna()
    n_later, n_gaps = len(later), len(gaps)
    over = within = None
    if ttl is not None and n_gaps:
        over = round(float((gaps >= ttl).mean()), 4)
        within = round(float((gaps >= ttl - 5.0).mean()), 4)
    verdicts = later["verdict"].astype(str)
    missing = verdicts == Verdict.METADATA_NOT_RETURNED.value
    reasons = later.loc[missing, "metadata_reason"].fillna("unknown").astype(str).value_counts()
    edges, counts = report_sections.gap_histogram(gaps.to_numpy(dtype="float64"), ttl)
    return {"later_turns": n_later, "gaps_known": n_gaps, "decoder_ttl_s": ttl,
            "quantiles_s": {f"p{int(q * 100)}": _q(gaps, q) for q in (0.5, 0.9, 0.95, 0.99)},
            "share_over_ttl": over, "share_within_margin": within,
            "expired_ratio": round(float(verdicts.isin(EXPIRED).mean()), 4) if n_later else None,
            "missing_metadata_ratio": round(float(missing.mean()), 4) if n_later else None,
            "missing_metadata_reasons": {str(k): int(v) for k, v in reasons.items()},
            "histogram_edges_s": edges, "histogram_counts": counts}


def _trims(df: pd.DataFrame) -> dict[str, Any]:
    def total(s: pd.Series) -> int:
        return int(s.fillna(0).sum())

    handled = df[df["handle_tokens"].notna()]
    reasons = handled["trim_reason"]
    trimmed = handled[reasons.notna() & (reasons.astype(str) != "")]
    tokens = total(handled["trimmed_tokens"])
    rows = []
    for reason, part in trimmed.groupby("trim_reason", sort=False):
        info = TRIM_INFO[TrimReason(str(reason))]
        n = total(part["trimmed_tokens"])
        rows.append({"trim_reason": str(reason), "turns": len(part), "trimmed_tokens": n,
                     "share_of_trimmed": round(n / tokens, 4) if tokens else 0.0, "summary": info.summary,
                     "fix": info.fix})
    rows.sort(key=lambda r: (-r["trimmed_tokens"], -r["turns"], r["trim_reason"]))
    dominant = rows[0]["trim_reason"] if rows and rows[0]["share_of_trimmed"] >= 0.5 else None
    wrong, mismatch = df["wrong_kv_tokens"].dropna(), df["mismatch_tokens"].dropna()
    handle = total(handled["handle_tokens"])
    return {"handle_turns": len(handled), "handle_tokens": handle,
            "reuse_limit_tokens": total(handled["reuse_limit_tokens"]),
            "reused_tokens": total(handled["remote_tokens"]), "trimmed_turns": len(trimmed), "trimmed_tokens": tokens,
            "trimmed_share": round(tokens / handle, 4) if handle else None,
            "wrong_kv_tokens": int(wrong.sum()) if len(wrong) else None,
            "mismatch_tokens": int(mismatch.sum()) if len(mismatch) else None, "dominant": dominant,
            "dominant_fix": TRIM_INFO[TrimReason(dominant)].fix if dominant else None, "by_reason": rows}


def reference(df: pd.DataFrame, ttl: float | None) -> dict[str, Any]:
    return {"turns": len(df), "conversations": int(df["conversation_id"].nunique()),
            "outcome_by_turn": _mix(df, "turn_bucket"), "outcome_by_prompt": _mix(df, "prompt_bucket"),
            "ttft_by_prompt": _ttft(df), "transfer_by_prompt": _transfer(df), "first_vs_later": _first_later(df),
            "gaps": _gaps(df, ttl), "trims": _trims(df)}


# ------------------------------------------------------------------------------------------------ random tables

def random_table(rng: random.Random, n: int) -> pd.DataFrame:
    """A turn table with every kind of value the sections meet: NULLs and NaNs, unknown verdicts, turn 0,
    repeated values (quantile ties), empty buckets, empty and unknown metadata reasons."""
    def maybe(value: Any, p: float = 0.15) -> Any:
        return None if rng.random() < p else value

    verdicts = [v.value for v in rng.sample(list(Verdict), rng.randint(1, len(Verdict)))] + ["bogus"]
    buckets = rng.sample(list(PROMPT_BUCKETS), rng.randint(1, len(PROMPT_BUCKETS)))
    pool = [rng.choice([1.0, 2.5, 100.0]) for _ in range(3)]  # a few repeated values: ties
    reasons = [*rng.sample([t.value for t in TrimReason], 3), ""]

    def number(scale: float) -> float | None:
        return maybe(rng.choice(pool) if rng.random() < 0.3 else round(rng.random() * scale, rng.randint(0, 6)))

    cols: dict[str, list[Any]] = {c: [] for c in TABLE_COLUMNS}
    for i in range(n):
        turn = maybe(rng.choice([0, 1, 1, 2, 3, 5, 9]), 0.05)
        verdict = maybe(rng.choice(verdicts), 0.03)
        row = {
            "conversation_id": f"c{rng.randint(0, max(1, n // 3))}", "turn": turn,
            "turn_bucket": maybe(rng.choice(TURN_BUCKETS), 0.05), "prompt_tokens": maybe(rng.randint(1, 40000)),
            "prompt_bucket": maybe(rng.choice(buckets), 0.1), "verdict": verdict,
            "reused": verdict in {v.value for v in REUSED_VERDICTS}, "eligible": rng.random() < 0.5,
            "confidence": "inferred", "request_id": f"r{i}", "start_ts": number(1e9), "end_ts": number(1e9),
            "ttft_ms": number(5000.0), "latency_ms": number(9000.0), "completion_tokens": maybe(rng.randint(0, 900)),
            "local_hit_tokens": None, "remote_offered_tokens": None, "remote_tokens": maybe(rng.randint(0, 30000)),
            "computed_tokens": None, "transfer_bytes": maybe(rng.choice([0, rng.randint(1, 10**10)])),
            "transfer_ms": number(300.0), "prefill_ms": None, "gap_s": number(900.0), "entry_age_s": None,
            "status": "ok", "failure_type": None,
            "metadata_reason": maybe(rng.choice(["not_streamed", "aborted", "", "unknown"]), 0.3),
            "model": "m", "handle_tokens": maybe(rng.randint(0, 30000), 0.5),
            "reuse_limit_tokens": maybe(rng.randint(0, 30000)), "trimmed_tokens": maybe(rng.randint(0, 5000)),
            "trim_reason": maybe(rng.choice(reasons), 0.4), "wrong_kv_tokens": maybe(rng.randint(0, 9), 0.9),
            "mismatch_tokens": maybe(rng.randint(0, 99), 0.8), "reason": "r",
        }
        for c in TABLE_COLUMNS:
            cols[c].append(row[c])
    df = pd.DataFrame(cols)
    if rng.random() < 0.5:  # NaN (not NULL) in float columns, as a pandas user's table may hold
        df.loc[df.sample(frac=0.1, random_state=rng.randint(0, 999)).index, "ttft_ms"] = float("nan")
    return normalize_table(df)


def _differs(seeds: range, n: int) -> int:
    """Random tables whose report differs from the reference's."""
    bad = 0
    for seed in seeds:
        rng = random.Random(seed)
        df = random_table(rng, n)
        ttl = rng.choice([None, 30.0, 480.0])
        if build_report(df, ttl).to_json_dict() != reference(df, ttl):
            bad += 1
    return bad


def test_sections_equal_pandas_on_random_tables() -> None:
    for seed in range(150):
        rng = random.Random(seed)
        df = random_table(rng, rng.choice([1, 2, 7, 40, 300]))
        ttl = rng.choice([None, 30.0, 480.0])
        got = build_report(df, ttl).to_json_dict()
        assert got == reference(df, ttl), f"seed {seed}"
        assert json.loads(json.dumps(got, allow_nan=False)) == got


def _lerp(values: Any, q: float) -> float | None:
    arr = np.sort(np.asarray(values, dtype=np.float64))
    if not len(arr):
        return None
    h = (len(arr) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(arr) - 1)
    return float(arr[lo] + (arr[hi] - arr[lo]) * (h - lo))  # (another linear interpolation: DuckDB's)


def test_control_another_interpolation_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report_sections, "quantile", _lerp)
    assert _differs(range(40), 300) > 0


def test_control_another_rounding_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    # one reused turn in 20,000: 0.00005, which numpy (pandas) rounds to 0.0 and Python's round to 0.0001
    df = normalize_table(pd.DataFrame({c: [None] * 20000 for c in TABLE_COLUMNS}))
    df["turn"] = pd.array([2] * 20000, dtype="Int64")
    df["turn_bucket"] = "2"
    df["verdict"] = [Verdict.REMOTE_HIT.value] + [Verdict.UNKNOWN.value] * 19999
    df["reused"] = [True] + [False] * 19999
    assert build_report(df).to_json_dict() == reference(df, None)
    monkeypatch.setattr(report_sections, "_round4", lambda x: round(x, 4))
    assert build_report(df).to_json_dict() != reference(df, None)


def test_cli_report_never_imports_pandas(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    write_router_events(synthetic_conversations(SynthParams(conversations=30, trim_share=0.3, seed=4)),
                        logs / "router-events.jsonl")
    probe = ("import sys; from kvdiag.cli.main import cli\n"
             "try:\n    cli(sys.argv[1:], standalone_mode=False)\nexcept SystemExit:\n    pass\n"
             "print('pandas' in sys.modules)")

    def pandas_loaded(*extra: str) -> bool:
        out = subprocess.run([sys.executable, "-c", probe, "report", str(logs), "--no-progress", "--cache-dir",
                              str(tmp_path / "cache"), *extra], capture_output=True, text=True, check=True,
                             env={**os.environ, "COLUMNS": "120"}, timeout=120)
        assert "Outcome mix by turn index" in out.stdout
        return out.stdout.strip().splitlines()[-1] == "True"

    assert not pandas_loaded()  # the first run fills the cache
    assert not pandas_loaded()  # the second reads it
    assert pandas_loaded("--csv", str(tmp_path / "t.csv"))  # control: the CSV writer is pandas'
