"""`kvdiag report`: the per-turn table and its aggregations (outcome mix, TTFT, transfers, gaps).

Library first: :func:`build_turn_table` turns ConversationRecords into one pandas row per turn;
every aggregation is a pure function of that table, so the CLI, the HTML report, ``advise`` and
the Parquet cache all share it. Buckets come from kvdiag.schema.metrics (same labels as metrics).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa

from kvdiag.diagnostics import report_cache
from kvdiag.diagnostics.detect import LogReadError, detect
from kvdiag.diagnostics.records import ConversationRecord
from kvdiag.diagnostics.report_trims import TrimSummary, trim_summary
from kvdiag.diagnostics.sources import StagedInputs, stage_inputs
from kvdiag.diagnostics.turn_loader import UnreadableLogError, run_all
from kvdiag.schema.errors import KVDiagError
from kvdiag.schema.metrics import _PROMPT_EDGES, MISSING_METADATA_REASONS, PROMPT_BUCKETS, TURN_BUCKETS
from kvdiag.schema.verdicts import ELIGIBLE_VERDICTS, REUSED_VERDICTS, Verdict

if TYPE_CHECKING:
    from kvdiag.diagnostics.verdict_engine import Run

# Bump when the table's columns (or how a path fills them) change: it is part of the Parquet cache key.
# 2: the DuckDB path's reasons, confidence, statuses and unknown gaps now equal the parser's.
# 3: stock INFO turns decided by P's stats windows; TTFT and tokens client first; answered turns after a
#    failed P attempt.
# 4: partial reuse (handle, reuse limit, trimmed tokens and why) and P's wrong-KV and mismatch counts.
# 5: one verdict engine for every input (stock logs alone included).
TABLE_VERSION: Final = 5

TABLE_COLUMNS: Final = (
    "conversation_id", "turn", "turn_bucket", "prompt_tokens", "prompt_bucket", "verdict", "reused",
    "eligible", "confidence", "request_id", "start_ts", "end_ts", "ttft_ms", "latency_ms",
    "completion_tokens", "local_hit_tokens", "remote_offered_tokens", "remote_tokens", "computed_tokens",
    "transfer_bytes", "transfer_ms", "prefill_ms", "gap_s", "entry_age_s", "status", "failure_type",
    "metadata_reason", "model", "handle_tokens", "reuse_limit_tokens", "trimmed_tokens", "trim_reason",
    "wrong_kv_tokens", "mismatch_tokens", "reason",
)
_FLOAT_COLUMNS: Final = ("start_ts", "end_ts", "ttft_ms", "latency_ms", "transfer_ms", "prefill_ms", "gap_s",
                         "entry_age_s")
_INT_COLUMNS: Final = ("turn", "prompt_tokens", "completion_tokens", "local_hit_tokens", "remote_offered_tokens",
                       "remote_tokens", "computed_tokens", "transfer_bytes", "handle_tokens", "reuse_limit_tokens",
                       "trimmed_tokens", "wrong_kv_tokens", "mismatch_tokens")
_STR_COLUMNS: Final = ("conversation_id", "turn_bucket", "prompt_bucket", "verdict", "confidence", "request_id",
                       "status", "failure_type", "metadata_reason", "model", "trim_reason", "reason")

_TRIM_COLUMNS: Final = ("handle_tokens", "reuse_limit_tokens", "trimmed_tokens", "trim_reason", "wrong_kv_tokens",
                        "mismatch_tokens")
EXPIRED_VERDICTS: Final = frozenset({Verdict.EXPIRED_REMOTE_READ, Verdict.ROUTER_ENTRY_EXPIRED})
# vLLM's _KV_BLOCKS_EXPIRY_SAFETY_MARGIN: P declines a read whose deadline is within 5 s.
EXPIRY_SAFETY_MARGIN_S: Final = 5.0
GAP_HISTOGRAM_BINS: Final = 30


class ReportError(KVDiagError):
    """The inputs cannot produce a report (no turns, unreadable cache); the message says why."""


# The turn's own columns (a TurnRecord's, or the engine's decided row); the rest of TABLE_COLUMNS is derived
# from them by DERIVE_SQL, the same for both.
RAW_COLUMNS: Final = (
    "conversation_id", "turn", "pos", "prompt_tokens", "verdict", "confidence", "request_id", "start_ts", "end_ts",
    "ttft_ms", "latency_ms", "completion_tokens", "local_hit_tokens", "remote_offered_tokens", "remote_tokens",
    "computed_tokens", "transfer_bytes", "transfer_ms", "prefill_ms", "gap_s", "entry_age_s", "status", "failure_type",
    "model", *_TRIM_COLUMNS, "reason")


def _in(verdicts: frozenset[Verdict]) -> str:
    return ", ".join(f"'{v.value}'" for v in sorted(verdicts))


def derive_sql(source: str, key: str | None = None, prev: str | None = None) -> str:
    """TABLE_COLUMNS from RAW_COLUMNS rows in ``source``: the buckets, the reuse flags, the missing-metadata
    cause named in the reason, an end from start and latency, and a gap from the previous turn's end. With
    ``key`` (a column unique per row), the previous turn's end is found on narrow rows and joined back by it;
    with ``prev`` too (a column holding the previous turn's ``key``), by a join on it instead of a window."""
    edges = " ".join(f"WHEN prompt_tokens < {e} THEN '{b}'" for e, b in zip(_PROMPT_EDGES, PROMPT_BUCKETS,
                                                                                strict=False))
    reasons = " ".join(f"WHEN contains(reason, '{n}') THEN '{n}'" for n in MISSING_METADATA_REASONS)
    end = "coalesce(end_ts, start_ts + latency_ms / 1000.0)"
    # the time since the previous turn's end, computed once in a subquery (named twice in gap_s, the window took
    # twice the wall time)
    since = "since_prev"
    window = f"start_ts - lag({end}) OVER (PARTITION BY conversation_id ORDER BY turn, pos) AS since_prev"
    # (the window sorting the wide rows, their reasons included, costs more than a join on the key)
    rows = (f"(SELECT *, {window} FROM {source})" if key is None
            else f"(SELECT * FROM {source} JOIN (SELECT {key}, {window} FROM {source}) USING ({key}))" if prev is None
            # (a hash join on the key the engine gives costs less than the window's sort by conversation)
            else f"""(SELECT s.*, s.start_ts - p.prev_end AS since_prev FROM {source} s LEFT JOIN
                      (SELECT {key} AS prev_key, {end} AS prev_end FROM {source}) p ON p.prev_key = s.{prev})""")
    cols = {
        "turn_bucket": "CASE WHEN turn <= 1 THEN '1' WHEN turn = 2 THEN '2' WHEN turn = 3 THEN '3' WHEN turn <= 7 "
                       "THEN '4-7' ELSE '8+' END",
        "prompt_bucket": f"CASE WHEN prompt_tokens IS NULL THEN NULL {edges} ELSE '{PROMPT_BUCKETS[-1]}' END",
        "reused": f"verdict IN ({_in(REUSED_VERDICTS)})", "eligible": f"verdict IN ({_in(ELIGIBLE_VERDICTS)})",
        "end_ts": end,
        "gap_s": f"coalesce(gap_s, CASE WHEN turn > 1 THEN CASE WHEN {since} < 0 THEN 0.0 ELSE {since} END END)",
        "metadata_reason": f"CASE WHEN verdict <> '{Verdict.METADATA_NOT_RETURNED.value}' THEN NULL {reasons} "
                           "ELSE 'unknown' END",
        "reason": "coalesce(reason, '')",
    }
    select = ", ".join(f"{cols[c]} AS {c}" if c in cols else c for c in TABLE_COLUMNS)
    return f"SELECT {select} FROM {rows} ORDER BY conversation_id, turn, pos"


def _derive(con: duckdb.DuckDBPyConnection, source: str, key: str | None = None, prev: str | None = None
            ) -> pd.DataFrame:
    # nullable integers straight from Arrow (no float round trip for normalize_table to undo)
    table = con.sql(derive_sql(source, key, prev)).to_arrow_table()
    return normalize_table(table.to_pandas(types_mapper={pa.int64(): pd.Int64Dtype()}.get))


def build_turn_table(conversations: Iterable[ConversationRecord]) -> pd.DataFrame:
    """Return one row per turn (columns TABLE_COLUMNS), with gaps filled from start/end times."""
    cols: dict[str, list[Any]] = {name: [] for name in RAW_COLUMNS}
    for conv in conversations:
        for pos, t in enumerate(conv.turns):
            state = t.__dict__
            for name in RAW_COLUMNS:
                cols[name].append(pos if name == "pos" else state[name])
            cols["conversation_id"][-1] = conv.conversation_id
            cols["verdict"][-1] = Verdict(t.verdict).value
            cols["confidence"][-1] = str(t.confidence)
    types = {c: pa.float64() for c in _FLOAT_COLUMNS} | {c: pa.int64() for c in _INT_COLUMNS} | {"pos": pa.int64()}
    raw = pa.table({c: pa.array(v, type=types.get(c, pa.string())) for c, v in cols.items()})
    con = duckdb.connect()
    try:
        con.register("raw_turns", raw)
        return _derive(con, "raw_turns")
    finally:
        con.close()


def normalize_table(df: pd.DataFrame) -> pd.DataFrame:
    """Give the table stable dtypes (nullable ints, floats, strings) whatever its origin."""
    missing = [c for c in TABLE_COLUMNS if c not in df.columns]
    if missing:
        raise ReportError(f"turn table lacks column(s) {', '.join(missing)}; rebuild it (delete the cache)")
    # Column by column, and only where the dtype differs: on a million-row table a blanket copy costs
    # more than the aggregations.
    # Already in order (the engine's table): a shallow copy, so a converted column never touches df.
    out = df.copy(deep=False) if list(df.columns) == list(TABLE_COLUMNS) else df.loc[:, list(TABLE_COLUMNS)]
    for cols, dtype in ((_FLOAT_COLUMNS, "float64"), (_INT_COLUMNS, "Int64"), (_STR_COLUMNS, "str"),
                        (("reused", "eligible"), "bool")):
        for c in cols:
            if str(out[c].dtype) == dtype:
                continue
            if dtype in ("float64", "Int64"):
                out[c] = pd.to_numeric(out[c], errors="coerce").astype(dtype)
            else:
                out[c] = out[c].astype(dtype)
    return out


# --------------------------------------------------------------------------------------------
# Aggregations: pure functions of the turn table.

def _quantile(series: pd.Series, q: float) -> float | None:
    s = series.dropna()
    return float(s.quantile(q)) if len(s) else None


def outcome_mix(df: pd.DataFrame, by: str) -> pd.DataFrame:
    """Turn counts per verdict (columns) for each bucket of ``by`` (turn_bucket or prompt_bucket)."""
    order = TURN_BUCKETS if by == "turn_bucket" else PROMPT_BUCKETS if by == "prompt_bucket" else None
    if order is None:
        raise ValueError(f"outcome_mix groups by turn_bucket or prompt_bucket, not {by!r}")
    verdicts = [v.value for v in Verdict]
    sub = df[[by, "verdict"]].dropna(subset=[by])
    # groupby-size, not crosstab: the same counts in a third of the time on a million-turn table
    table = sub.groupby([by, "verdict"]).size().unstack(fill_value=0) if len(sub) else pd.DataFrame()
    table = table.reindex(index=list(order), columns=verdicts, fill_value=0).fillna(0).astype("int64")
    table = table.loc[:, (table.sum(axis=0) > 0).to_numpy()] if len(sub) else table.iloc[:, :0]
    table.index.name = by
    table.insert(0, "turns", table.sum(axis=1))
    reused = [c for c in table.columns if c in {v.value for v in REUSED_VERDICTS}]
    table["reused_share"] = (table[reused].sum(axis=1) / table["turns"].where(table["turns"] > 0)).round(4)
    return table


def ttft_by_bucket(df: pd.DataFrame) -> pd.DataFrame:
    """TTFT p50/p95 of later turns, reused vs recomputed, per prompt-length bucket (the article's table)."""
    # Narrow the frame before any mask: copying unused (string) columns dominates on big tables.
    cols = df[["turn", "ttft_ms", "prompt_bucket", "reused"]]
    later = cols[(cols["turn"] > 1) & cols["ttft_ms"].notna() & cols["prompt_bucket"].notna()]
    # One grouping pass instead of a string mask per bucket; each group's quantile is Series.quantile.
    groups = {key: part for key, part in later.groupby(["prompt_bucket", "reused"])["ttft_ms"]}
    empty = pd.Series([], dtype="float64")
    rows = []
    for bucket in PROMPT_BUCKETS:
        row: dict[str, Any] = {"prompt_bucket": bucket}
        for label, reused in (("reused", True), ("recomputed", False)):
            part = groups.get((bucket, reused), empty)
            row[f"{label}_n"] = len(part)
            row[f"{label}_p50_ms"] = _quantile(part, 0.5)
            row[f"{label}_p95_ms"] = _quantile(part, 0.95)
        p_re, p_rc = row["reused_p50_ms"], row["recomputed_p50_ms"]
        row["speedup_p50"] = round(p_rc / p_re, 2) if p_re and p_rc else None
        rows.append(row)
    return pd.DataFrame(rows).set_index("prompt_bucket")


def transfer_by_bucket(df: pd.DataFrame) -> pd.DataFrame:
    """D→P transfer bytes and milliseconds per prompt-length bucket (turns that read from D)."""
    cols = df[["transfer_bytes", "transfer_ms", "prompt_bucket"]]
    xfer = cols[cols["transfer_bytes"].notna() & (cols["transfer_bytes"] > 0) & cols["prompt_bucket"].notna()]
    groups = {key: part for key, part in xfer.groupby("prompt_bucket")}
    rows = []
    for bucket in PROMPT_BUCKETS:
        b = groups.get(bucket, xfer.iloc[:0])
        rows.append({
            "prompt_bucket": bucket, "transfers": len(b),
            "bytes_p50": _quantile(b["transfer_bytes"].astype("float64"), 0.5),
            "bytes_total": int(b["transfer_bytes"].sum()) if len(b) else 0,
            "ms_p50": _quantile(b["transfer_ms"], 0.5), "ms_p95": _quantile(b["transfer_ms"], 0.95),
        })
    return pd.DataFrame(rows).set_index("prompt_bucket")


def first_vs_later(df: pd.DataFrame) -> pd.DataFrame:
    """First turns (nothing to retrieve) against later turns: counts, reuse share, TTFT."""
    rows = []
    cols = df[["turn", "reused", "ttft_ms", "prompt_tokens"]]
    for label, part in (("first", cols[cols["turn"] == 1]), ("later", cols[cols["turn"] > 1])):
        n = len(part)
        rows.append({
            "turns": label, "n": n, "reused_share": round(float(part["reused"].mean()), 4) if n else None,
            "ttft_p50_ms": _quantile(part["ttft_ms"], 0.5), "ttft_p95_ms": _quantile(part["ttft_ms"], 0.95),
            "prompt_tokens_p50": _quantile(part["prompt_tokens"].astype("float64"), 0.5),
        })
    return pd.DataFrame(rows).set_index("turns")


@dataclass
class GapSummary:
    """Inter-turn gaps against the decode TTL, and the expired / missing-metadata ratios."""

    later_turns: int
    gaps_known: int
    decoder_ttl_s: float | None
    quantiles_s: dict[str, float | None]
    share_over_ttl: float | None
    share_within_margin: float | None
    expired_ratio: float | None
    missing_metadata_ratio: float | None
    missing_metadata_reasons: dict[str, int]
    histogram_edges_s: list[float] = field(default_factory=list)
    histogram_counts: list[int] = field(default_factory=list)

    def to_json_dict(self) -> dict[str, Any]:
        """JSON form (report --json ``gaps``)."""
        return dict(self.__dict__)


def gap_histogram(gaps: Sequence[float] | np.ndarray, ttl: float | None,
                  bins: int = GAP_HISTOGRAM_BINS) -> tuple[list[float], list[int]]:
    """Equal-width bins from 0 to max(gaps, 1.1 × TTL), so the TTL line always falls inside the plot."""
    values = np.asarray(gaps, dtype="float64")
    if not len(values):
        return [], []
    top = max(float(values.max()), (ttl or 0.0) * 1.1, 1e-9)
    width = top / bins
    idx = np.minimum((values / width).astype("int64"), bins - 1)
    counts = np.bincount(idx, minlength=bins)
    return [round(i * width, 6) for i in range(bins + 1)], [int(c) for c in counts]


def gap_summary(df: pd.DataFrame, decoder_ttl_s: float | None) -> GapSummary:
    """Summarize later turns' gaps against ``decoder_ttl_s`` (None: TTL unknown, shares omitted)."""
    cols = df[["turn", "gap_s", "verdict", "metadata_reason"]]
    later = cols[cols["turn"] > 1]
    gaps = later["gap_s"].dropna()
    n_later, n_gaps = len(later), len(gaps)
    over = within = None
    if decoder_ttl_s is not None and n_gaps:
        over = round(float((gaps >= decoder_ttl_s).mean()), 4)
        within = round(float((gaps >= decoder_ttl_s - EXPIRY_SAFETY_MARGIN_S).mean()), 4)
    verdicts = later["verdict"].astype(str)
    expired = round(float(verdicts.isin({v.value for v in EXPIRED_VERDICTS}).mean()), 4) if n_later else None
    missing = verdicts == Verdict.METADATA_NOT_RETURNED.value
    reasons = later.loc[missing, "metadata_reason"].fillna("unknown").astype(str).value_counts()
    edges, counts = gap_histogram(gaps.to_numpy(dtype="float64"), decoder_ttl_s)
    return GapSummary(
        later_turns=n_later, gaps_known=n_gaps, decoder_ttl_s=decoder_ttl_s,
        quantiles_s={f"p{int(q * 100)}": _quantile(gaps, q) for q in (0.5, 0.9, 0.95, 0.99)},
        share_over_ttl=over, share_within_margin=within, expired_ratio=expired,
        missing_metadata_ratio=round(float(missing.mean()), 4) if n_later else None,
        missing_metadata_reasons={str(k): int(v) for k, v in reasons.items()},
        histogram_edges_s=edges, histogram_counts=counts,
    )


@dataclass
class Report:
    """Everything `kvdiag report` prints and writes, computed from one turn table."""

    table: pd.DataFrame
    by_turn: pd.DataFrame
    by_prompt: pd.DataFrame
    ttft: pd.DataFrame
    transfer: pd.DataFrame
    first_later: pd.DataFrame
    gaps: GapSummary
    trims: TrimSummary

    @property
    def sections(self) -> list[tuple[str, pd.DataFrame]]:
        """The titled tables, in print order."""
        return [
            ("Outcome mix by turn index", self.by_turn),
            ("Outcome mix by prompt length (tokens)", self.by_prompt),
            ("TTFT of later turns: reused vs recomputed (ms)", self.ttft),
            ("D→P transfers by prompt length", self.transfer),
            ("First turn vs later turns", self.first_later),
            ("Partial reuse: D's tokens trimmed, by reason", self.trims.by_reason),
        ]

    def to_json_dict(self) -> dict[str, Any]:
        """The report --json document (see docs/report.md)."""
        def frame(df: pd.DataFrame) -> list[dict[str, Any]]:
            return [_clean_row(r) for r in df.reset_index().to_dict(orient="records")]
        return {
            "turns": len(self.table),
            "conversations": int(self.table["conversation_id"].nunique()),
            "outcome_by_turn": frame(self.by_turn),
            "outcome_by_prompt": frame(self.by_prompt),
            "ttft_by_prompt": frame(self.ttft),
            "transfer_by_prompt": frame(self.transfer),
            "first_vs_later": frame(self.first_later),
            "gaps": self.gaps.to_json_dict(),
            "trims": self.trims.to_json_dict(),
        }


def _clean_row(row: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN: missing statistics become null; numpy scalars become Python numbers.
    out: dict[str, Any] = {}
    for k, v in row.items():
        if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
            out[str(k)] = None
        elif hasattr(v, "item"):
            out[str(k)] = v.item()
        else:
            out[str(k)] = v
    return out


def build_report(df: pd.DataFrame, decoder_ttl_s: float | None = None) -> Report:
    """Compute every report section from the turn table."""
    if df.empty:
        raise ReportError("no turns found in the given logs; check the paths (kvdiag explain --all LOGS names the "
                          "files it could not recognise)")
    return Report(table=df, by_turn=outcome_mix(df, "turn_bucket"), by_prompt=outcome_mix(df, "prompt_bucket"),
                  ttft=ttft_by_bucket(df), transfer=transfer_by_bucket(df), first_later=first_vs_later(df),
                  gaps=gap_summary(df, decoder_ttl_s), trims=trim_summary(df))


def load_turn_table(paths: Sequence[str | Path] | StagedInputs, *, cache_dir: Path | None = None,
                    progress: Callable[[int, int], None] | None = None,
                    events_only: bool = False, config_lines: bool = False) -> pd.DataFrame:
    """Parse and correlate ``paths`` (files, globs, folders, .gz, container log wrappers, ``s3://`` URLs;
    or inputs already staged by kvdiag.diagnostics.sources) into the turn table, through the Parquet
    cache when ``cache_dir`` is set: the verdict engine's table, the same verdicts explain gives. Raises
    explain's LogReadError/ExplainError.

    ``events_only``: use only the event files among the inputs (faster; but turns only stock logs show
    are lost, and the fields and reasons stock lines add to the other turns are missing).
    ``config_lines``: the logs' configuration lines are kept, as they are read, for the next
    kvdiag.diagnostics.advise_config.scan_config of the same files (which then reads them no second time).
    ``s3://`` objects are mirrored under ``cache_dir/s3`` (reused while their ETag holds)."""
    if isinstance(paths, StagedInputs):
        return _load_staged(paths, cache_dir, progress, events_only, config_lines)
    mirror_dir = cache_dir / "s3" if cache_dir is not None else None
    with stage_inputs([str(p) for p in paths], mirror_dir=mirror_dir) as staged:
        return _load_staged(staged, cache_dir, progress, events_only, config_lines)


def _load_staged(staged: StagedInputs, cache_dir: Path | None, progress: Callable[[int, int], None] | None,
                 events_only: bool, config_lines: bool) -> pd.DataFrame:
    # The cache is keyed by the inputs as given (a wrapped log's own path, size and mtime; an object's
    # mirrored copy), so a hit needs no unwrapping; the files read are the staged ones.
    key = list(staged.identity)
    files: list[str] = []
    if events_only:
        files = [f.path for f in detect(staged.paths) if f.fmt == "events"]
        if not files:
            raise ReportError("--events-only: no kvdiag event files among the inputs")
        key = sorted({staged.origin.get(f, f) for f in files})
    if cache_dir is not None:
        cached = report_cache.load_cached_table(key, cache_dir, TABLE_VERSION)
        if cached is not None:
            return normalize_table(cached)
    if not events_only:
        files = staged.paths  # wrapped inputs are unwrapped here, on a miss only
    df = engine_table(files, progress, config_lines=config_lines)
    if staged.renamed and len(df):
        df["reason"] = [staged.display(r) for r in df["reason"]]
    if cache_dir is not None:
        report_cache.store_cached_table(df, key, cache_dir, TABLE_VERSION)
    return df


_ENGINE_RAW: Final = ", ".join(
    "CASE WHEN ev_gap_s IS NULL AND prev_sid IS NOT NULL THEN client_gap ELSE ev_gap_s END AS gap_s" if c == "gap_s"
    else "start_ts + latency_ms / 1000.0 AS end_ts" if c == "end_ts" else c for c in RAW_COLUMNS)


def engine_table(files: Sequence[str], progress: Callable[[int, int], None] | None = None, *,
                 config_lines: bool = False) -> pd.DataFrame:
    """The turn table of ``files`` (local, bare) from the verdict engine (the rules explain applies);
    ``config_lines`` as for load_turn_table."""
    try:
        detected = detect(files)
    except LogReadError as exc:
        raise UnreadableLogError(str(exc)) from None
    run = run_all(detected, progress, evidence=False, config_lines=config_lines)
    try:
        return _engine_run_table(run)
    finally:
        run.con.close()


def _engine_run_table(run: Run) -> pd.DataFrame:
    """The turn table of a run the engine has decided."""
    # the benchmark's own clock gives a gap to 3 decimals as Python rounds it (explain's records do the same);
    # the rounded gaps are joined in by the turn's key (copying a million wide rows to update them costs a second)
    run.con.execute(f"CREATE TEMP VIEW raw_turns_view AS SELECT {_ENGINE_RAW}, sid, prev_sid, ev_gap_s IS NULL AND "
                    "prev_sid IS NOT NULL AND client_gap IS NOT NULL AS client_gap_used FROM decided")
    rounded = run.con.sql("SELECT sid, gap_s FROM raw_turns_view WHERE client_gap_used").to_arrow_table()
    if not rounded.num_rows:
        return _derive(run.con, "raw_turns_view", "sid", "prev_sid")
    gap_fix = rounded.set_column(1, "gap_s", pa.array([None if g is None else round(g, 3)
                                                       for g in rounded.column(1).to_pylist()], pa.float64()))
    run.con.register("gap_fix", gap_fix)
    source = ("(SELECT v.* REPLACE (CASE WHEN v.client_gap_used THEN g.gap_s ELSE v.gap_s END AS gap_s) "
              "FROM raw_turns_view v LEFT JOIN gap_fix g ON g.sid = v.sid)")
    return _derive(run.con, source, "sid", "prev_sid")


def write_outputs(report: Report, *, csv: Path | None = None, parquet_path: Path | None = None,
                  json_path: Path | None = None) -> list[Path]:
    """Write the per-turn table (CSV/Parquet) and the aggregated JSON; return the paths written."""
    written: list[Path] = []
    if csv is not None:
        report.table.to_csv(csv, index=False)
        written.append(csv)
    if parquet_path is not None:
        report_cache.write_table(report.table, parquet_path)
        written.append(parquet_path)
    if json_path is not None:
        json_path.write_text(json.dumps(report.to_json_dict(), indent=2) + "\n", encoding="utf-8")
        written.append(json_path)
    return written
