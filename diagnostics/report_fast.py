"""The turn table straight from kvdiag event files with DuckDB: the fast path of `kvdiag report`.

When every input is a kvdiag event file (client/router JSON lines), the per-turn facts are already
stated by the router (outcome merged with P's report) and the client (TTFT, duration): DuckDB scans
them at its own speed instead of Python parsing each line. The rules mirror the classifier's
instrumented path (kvdiag.diagnostics.classify): per field the client's value wins over the
router's, the outcome is the router's (else the client's), and a non-ok status wins.
tests/test_report_fast.py checks that both paths give the same table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import duckdb
import pandas as pd

from kvdiag.diagnostics.detect import detect
from kvdiag.schema.metrics import MISSING_METADATA_REASONS, PROMPT_BUCKETS
from kvdiag.schema.verdicts import ELIGIBLE_VERDICTS, REUSED_VERDICTS, Verdict

_PROMPT_EDGES: Final = (2048, 8192, 16384, 32768)  # kvdiag.schema.metrics' prompt_bucket edges
_COLUMNS: Final = {
    "ts": "DOUBLE", "source": "VARCHAR", "event": "VARCHAR", "conversation_id": "VARCHAR", "turn": "BIGINT",
    "request_id": "VARCHAR", "model": "VARCHAR", "prompt_tokens": "BIGINT", "completion_tokens": "BIGINT",
    "local_hit_tokens": "BIGINT", "remote_offered_tokens": "BIGINT", "remote_read_tokens": "BIGINT",
    "computed_tokens": "BIGINT", "transfer_bytes": "BIGINT", "transfer_ms": "DOUBLE", "ttft_ms": "DOUBLE",
    "duration_ms": "DOUBLE", "prefill_ms": "DOUBLE", "gap_s": "DOUBLE", "entry_age_s": "DOUBLE",
    "outcome": "VARCHAR", "reason": "VARCHAR", "failure_type": "VARCHAR", "status": "VARCHAR",
}
# Fields taken client-first, then router (the classifier's order).
_FIELDS: Final = ("model", "prompt_tokens", "completion_tokens", "local_hit_tokens", "remote_offered_tokens",
                  "computed_tokens", "transfer_bytes", "transfer_ms", "prefill_ms", "gap_s", "entry_age_s",
                  "failure_type")


_RENAME: Final = {"ts": "start_ts", "duration_ms": "latency_ms", "remote_read_tokens": "remote_tokens",
                  "outcome": "verdict"}


def _scan_sql() -> str:
    cols = ", ".join(f"{k}: '{v}'" for k, v in _COLUMNS.items())
    # k: a 64-bit key per (source, turn) so the duplicate check is an integer count-distinct.
    return (f"SELECT *, hash(source, conversation_id, turn) AS k FROM read_json($files, "
            f"format = 'newline_delimited', columns = {{{cols}}}, ignore_errors = true) "
            "WHERE event IN ('client_turn', 'router_turn') AND conversation_id IS NOT NULL AND turn IS NOT NULL")


def _pick(name: str) -> str:
    target = _RENAME.get(name, name)
    return (f"coalesce(first({name}) FILTER (WHERE source = 'client' AND {name} IS NOT NULL), "
            f"first({name}) FILTER (WHERE source = 'router' AND {name} IS NOT NULL)) AS {target}")


def _merge_sql() -> str:
    # The general case (client and router events, or repeated events): one row per turn by the
    # classifier's precedence. Costlier than the plain scan, so only used when needed.
    picks = ",\n  ".join(_pick(f) for f in (*_FIELDS, "ts", "ttft_ms", "duration_ms", "remote_read_tokens"))
    return f"""
SELECT conversation_id, turn,
  first(request_id) FILTER (WHERE request_id IS NOT NULL) AS request_id,
  {picks},
  coalesce(first(outcome) FILTER (WHERE source = 'router' AND outcome IN ({_KNOWN})),
           first(outcome) FILTER (WHERE source = 'client' AND outcome IN ({_KNOWN})), 'unknown') AS verdict,
  coalesce(first(reason) FILTER (WHERE source = 'router' AND reason IS NOT NULL),
           first(reason) FILTER (WHERE source = 'client' AND reason IS NOT NULL), '') AS reason,
  coalesce(first(status) FILTER (WHERE status IS NOT NULL AND status <> 'ok'),
           first(status) FILTER (WHERE status IS NOT NULL)) AS status
FROM scanned GROUP BY conversation_id, turn
"""


def _join_sql() -> str:
    # Client and router events, at most one of each per turn: a hash join, much cheaper than
    # per-field filtered aggregates.
    picks = ",\n  ".join(f"coalesce(c.{f}, r.{f}) AS {_RENAME.get(f, f)}"
                          for f in (*_FIELDS, "ts", "ttft_ms", "duration_ms", "remote_read_tokens"))
    return f"""
WITH r AS (SELECT * FROM scanned WHERE source = 'router'), c AS (SELECT * FROM scanned WHERE source = 'client')
SELECT coalesce(r.conversation_id, c.conversation_id) AS conversation_id, coalesce(r.turn, c.turn) AS turn,
  coalesce(r.request_id, c.request_id) AS request_id,
  {picks},
  CASE WHEN r.outcome IN ({_KNOWN}) THEN r.outcome WHEN c.outcome IN ({_KNOWN}) THEN c.outcome
       ELSE 'unknown' END AS verdict,
  CASE WHEN r.outcome IN ({_KNOWN}) THEN coalesce(r.reason, '') ELSE coalesce(c.reason, r.reason, '') END AS reason,
  CASE WHEN c.status IS NOT NULL AND c.status <> 'ok' THEN c.status
       WHEN r.status IS NOT NULL AND r.status <> 'ok' THEN r.status ELSE coalesce(c.status, r.status) END AS status
FROM r FULL OUTER JOIN c ON r.conversation_id = c.conversation_id AND r.turn = c.turn
"""


_KNOWN: Final = ", ".join(f"'{v.value}'" for v in Verdict if v is not Verdict.UNKNOWN)


def _in(verdicts: frozenset[Verdict]) -> str:
    return ", ".join(f"'{v.value}'" for v in sorted(verdicts))


def _final_sql(gap_window: bool) -> str:
    # Every derived column of report.build_turn_table, vectorized in DuckDB (strings stay Arrow).
    gap = ("coalesce(gap_s, CASE WHEN turn > 1 THEN greatest(0.0, start_ts - lag(start_ts + latency_ms / 1000.0) "
           "OVER (PARTITION BY conversation_id ORDER BY turn)) END)" if gap_window else "gap_s")
    edges = " ".join(f"WHEN prompt_tokens < {e} THEN '{b}'" for e, b in zip(_PROMPT_EDGES, PROMPT_BUCKETS,
                                                                                strict=False))
    reasons = " ".join(f"WHEN contains(reason, '{n}') THEN '{n}'" for n in MISSING_METADATA_REASONS)
    return f"""
SELECT * EXCLUDE (gap_s, verdict),
  CASE WHEN verdict IN ({_KNOWN}) THEN verdict ELSE 'unknown' END AS verdict,
  {gap} AS gap_s,
  start_ts + latency_ms / 1000.0 AS end_ts,
  CASE WHEN turn <= 1 THEN '1' WHEN turn = 2 THEN '2' WHEN turn = 3 THEN '3' WHEN turn <= 7 THEN '4-7'
       ELSE '8+' END AS turn_bucket,
  CASE WHEN prompt_tokens IS NULL THEN NULL {edges} ELSE '{PROMPT_BUCKETS[-1]}' END AS prompt_bucket,
  verdict IN ({_in(REUSED_VERDICTS)}) AS reused,
  verdict IN ({_in(ELIGIBLE_VERDICTS)}) AS eligible,
  CASE WHEN verdict IN ({_KNOWN}) THEN 'confirmed' ELSE 'inferred' END AS confidence,
  CASE WHEN verdict <> '{Verdict.METADATA_NOT_RETURNED.value}' THEN NULL {reasons} ELSE 'unknown' END
    AS metadata_reason
FROM turns
"""


def all_events(files: Sequence[str]) -> bool:
    """True when every input is a kvdiag event file (the fast path applies)."""
    return bool(files) and all(f.fmt == "events" for f in detect(files))


def events_turn_table(files: Sequence[str]) -> pd.DataFrame:
    """The turn table (report.TABLE_COLUMNS) from event files, computed in DuckDB."""
    con = duckdb.connect()
    try:
        # Materialized once inside DuckDB (no Arrow round trip); the checks and the join read it.
        con.execute("CREATE TEMP TABLE scanned AS " + _scan_sql(), {"files": list(files)})
        # A hash collision only sends the run down the (exact) merge path.
        dups, sources = con.sql("SELECT count(*) - count(DISTINCT k), count(DISTINCT source) FROM scanned"
                                ).fetchall()[0]
        if dups == 0 and sources <= 1:
            # One event per turn (the router's, usually): the scan already is the table.
            keep = ["conversation_id", "turn", "request_id", "ttft_ms", "reason", "status", *_FIELDS, *_RENAME]
            turns_sql = f"SELECT {', '.join(f'{c} AS {_RENAME.get(c, c)}' for c in keep)} FROM scanned"
        else:
            turns_sql = _join_sql() if dups == 0 else _merge_sql()
        df = con.sql(f"WITH turns AS ({turns_sql}) {_final_sql(False)}").to_arrow_table().to_pandas()
        if bool(((df["turn"] > 1) & df["gap_s"].isna()).any()):
            # The router states each later turn's gap; only when some is missing pay for the window.
            df = con.sql(f"WITH turns AS ({turns_sql}) {_final_sql(True)}").to_arrow_table().to_pandas()
    finally:
        con.close()
    df["reason"] = df["reason"].fillna("")
    return df
