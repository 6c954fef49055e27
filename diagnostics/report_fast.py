"""The turn table with DuckDB, from kvdiag event files and the stock logs beside them: report's fast path.

The per-turn facts are stated by the router (outcome merged with P's report), the client (TTFT,
duration) and P's connector: DuckDB scans them at its own speed instead of Python parsing each line.
The rules are the classifier's instrumented path (kvdiag.diagnostics.classify): per field the first
event stating it (client, router, P), the router's outcome unless it is missing or only inferred while P
states one, the client's status, and the reason built as the classifier builds it. Stock logs beside
the events (client statistics, the proxy log, vLLM's failure lines) add what they add to those turns
(report_stock.py). Where the inputs have a shape only explain's correlator joins, the fast path raises
Decline inside and returns None rather than differ. tests/test_report_fast.py and
tests/test_report_stock.py check that both paths give the same table (``DataFrame.equals``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from kvdiag.diagnostics.classify import FAILED_STATUSES, retried_reason
from kvdiag.diagnostics.correlate import HASH_PREFIX_LENGTHS
from kvdiag.diagnostics.detect import LogFile, detect
from kvdiag.diagnostics.report_stock import STOCK_FAILURES_SQL, STOCK_FORMATS, Decline, failure_records, load_stock
from kvdiag.diagnostics.vllm_log import VllmRecord
from kvdiag.schema.events import EVENTS_BY_SOURCE, NON_NEGATIVE, SCHEMA_VERSION, STATUSES
from kvdiag.schema.metrics import MISSING_METADATA_REASONS, PROMPT_BUCKETS
from kvdiag.schema.verdicts import ELIGIBLE_VERDICTS, REUSED_VERDICTS, VERDICT_INFO, TrimReason, Verdict

log = logging.getLogger(__name__)
_VERDICT_NAMES: Final = frozenset(v.value for v in Verdict)
_TRIM_NAMES: Final = frozenset(r.value for r in TrimReason)
_PROMPT_EDGES: Final = (2048, 8192, 16384, 32768)  # kvdiag.schema.metrics' prompt_bucket edges
_COLUMNS: Final = {
    "v": "BIGINT", "ts": "DOUBLE", "source": "VARCHAR", "event": "VARCHAR", "conversation_id": "VARCHAR",
    "turn": "BIGINT", "request_id": "VARCHAR", "engine_request_id": "VARCHAR", "model": "VARCHAR",
    "prompt_tokens": "BIGINT", "completion_tokens": "BIGINT",
    "local_hit_tokens": "BIGINT", "remote_offered_tokens": "BIGINT", "remote_read_tokens": "BIGINT",
    "computed_tokens": "BIGINT", "transfer_bytes": "BIGINT", "transfer_ms": "DOUBLE", "ttft_ms": "DOUBLE",
    "duration_ms": "DOUBLE", "prefill_ms": "DOUBLE", "gap_s": "DOUBLE", "entry_age_s": "DOUBLE",
    "outcome": "VARCHAR", "reason": "VARCHAR", "failure_type": "VARCHAR", "status": "VARCHAR", "http_status": "BIGINT",
    "handle_tokens": "BIGINT", "reuse_limit_tokens": "BIGINT", "trimmed_tokens": "BIGINT", "trim_reason": "VARCHAR",
    "wrong_kv_tokens": "BIGINT", "mismatch_tokens": "BIGINT",
}
# Fields taken from the first event stating them: client, router, then P (the classifier's order).
_FIELDS: Final = ("model", "prompt_tokens", "completion_tokens", "local_hit_tokens", "remote_offered_tokens",
                  "computed_tokens", "transfer_bytes", "transfer_ms", "prefill_ms", "gap_s", "entry_age_s",
                  "failure_type", "handle_tokens", "reuse_limit_tokens", "trimmed_tokens", "trim_reason",
                  "wrong_kv_tokens", "mismatch_tokens")


# What the user saw comes from the client first (classify._Turn._numbers): its events, its statistics,
# then the router and P.
_CLIENT_FIRST: Final = ("ttft_ms", "prompt_tokens", "completion_tokens", "duration_ms")
_CLIENT_COLS: Final = ("c_ttft_ms", "c_prompt_tokens", "c_completion_tokens", "c_latency_ms")

_RENAME: Final = {"ts": "start_ts", "duration_ms": "latency_ms", "remote_read_tokens": "remote_tokens",
                  "outcome": "verdict"}


_NUMBERS_CHECKED: Final = tuple(c for c in _COLUMNS if c in NON_NEGATIVE and c != "v")
# One pass over the scanned events: the counts the checks need, and what event_from_dict checks by value.
_PROFILE_SQL: Final = f"""SELECT
    count(*) FILTER (WHERE event IN ('client_turn', 'router_turn') AND (conversation_id IS NULL OR turn IS NULL
                                                                     OR request_id IS NULL OR ts IS NULL)),
    count(*) FILTER (WHERE event = 'router_turn'), count(*) FILTER (WHERE event = 'client_turn'),
    count(*) FILTER (WHERE source IN ('prefill', 'decode')),
    count(*) FILTER (WHERE v IS DISTINCT FROM {SCHEMA_VERSION} OR source IS NULL OR event IS NULL),
    list(DISTINCT source || '/' || event) FILTER (WHERE source IS NOT NULL AND event IS NOT NULL),
    list(DISTINCT outcome) FILTER (WHERE outcome IS NOT NULL),
    list(DISTINCT status) FILTER (WHERE status IS NOT NULL),
    list(DISTINCT trim_reason) FILTER (WHERE trim_reason IS NOT NULL), min(turn),
    least({', '.join(f"min({c})" for c in _NUMBERS_CHECKED)})
FROM raw"""
_EVENT_PAIRS: Final = frozenset(f"{src}/{e}" for src, evs in EVENTS_BY_SOURCE.items() for e in evs)


def _rejected_by_value(bad_version: int, pairs: list[str], outcomes: list[str], statuses: list[str],
                       trim_reasons: list[str], min_turn: int | None, min_number: float | None) -> bool:
    """True when some scanned event is one event_from_dict rejects (explain counts it as a corrupt line):
    no or another schema version, an event name foreign to its source, a turn below 1, a negative count
    or duration, an unknown outcome, status or trim reason. (Values of the wrong JSON type DuckDB coerces;
    docs/report.md says so.)"""
    return bool(bad_version or not set(pairs or ()) <= _EVENT_PAIRS or not set(outcomes or ()) <= _VERDICT_NAMES
                or not set(statuses or ()) <= set(STATUSES) or not set(trim_reasons or ()) <= _TRIM_NAMES
                or (min_turn is not None and min_turn < 1)
                or (min_number is not None and min_number < 0))


def _scan_sql() -> str:
    cols = ", ".join(f"{k}: '{v}'" for k, v in _COLUMNS.items())
    # Engine (prefill/decode) events and turn events without ids are kept for the checks only.
    return (f"SELECT * FROM read_json($files, "
            f"format = 'newline_delimited', columns = {{{cols}}}, ignore_errors = true) "
            "WHERE event IN ('client_turn', 'router_turn') OR source IN ('prefill', 'decode') "
            "OR conversation_id IS NOT NULL")  # the last: a client-statistics line the parser would read


_TURN_EVENTS: Final = ("SELECT * FROM raw WHERE event IN ('client_turn', 'router_turn') "
                       "AND conversation_id IS NOT NULL AND turn IS NOT NULL")


_FAILED: Final = ", ".join(f"'{s}'" for s in FAILED_STATUSES)


def _why_failed(side: str) -> str:
    # classify._failed's text for a failed status: "status=X" plus ", HTTP n" when stated.
    return (f"'status=' || {side}.status || CASE WHEN coalesce({side}.http_status, 0) <> 0 "
            f"THEN ', HTTP ' || {side}.http_status ELSE '' END")


def _id_hash(expr: str) -> str:
    # 64-bit stand-ins for the request ids the repeat check compares: integers export and count faster
    # than strings; a collision can only make it decline.
    return f"CASE WHEN {expr} IS NOT NULL THEN hash({expr}) END"


_P_FIELDS: Final = (*_FIELDS, "ts", "ttft_ms", "duration_ms", "remote_read_tokens", "conversation_id", "turn")


def _prefill_sql(ordered: bool) -> str:
    """P's prefill_request events folded to one row per request id, as classify reads them in file order:
    each field from the first event stating it, the last failed status and the first status, and the
    first event with a known outcome (obs_) and with any outcome (grp_). ``ordered``: from p_events
    (several per request, ``ord`` = file order); else straight from raw (one per request)."""
    if not ordered:
        known = f"outcome IN ({_KNOWN})"
        return f"""SELECT request_id, {', '.join(_P_FIELDS)},
  CASE WHEN status <> 'ok' THEN status END AS status_bad, status AS status_first,
  CASE WHEN {known} THEN outcome END AS obs_outcome, CASE WHEN {known} THEN reason END AS obs_reason,
  CASE WHEN {known} THEN failure_type END AS obs_failure_type,
  outcome AS grp_outcome, reason AS grp_reason, failure_type AS grp_failure_type
FROM raw WHERE event = 'prefill_request' AND request_id IS NOT NULL"""
    firsts = ", ".join(f"arg_min({f}, ord) FILTER (WHERE {f} IS NOT NULL) AS {f}" for f in _P_FIELDS)
    return f"""WITH a AS (SELECT request_id, {firsts},
    arg_max(status, ord) FILTER (WHERE status IS NOT NULL AND status <> 'ok') AS status_bad,
    arg_min(status, ord) FILTER (WHERE status IS NOT NULL) AS status_first,
    min(ord) FILTER (WHERE outcome IN ({_KNOWN})) AS obs_ord, min(ord) FILTER (WHERE outcome IS NOT NULL) AS grp_ord
  FROM p_events GROUP BY request_id)
SELECT a.* EXCLUDE (obs_ord, grp_ord), o.outcome AS obs_outcome, o.reason AS obs_reason,
  o.failure_type AS obs_failure_type, g.outcome AS grp_outcome, g.reason AS grp_reason,
  g.failure_type AS grp_failure_type
FROM a LEFT JOIN p_events o ON o.ord = a.obs_ord LEFT JOIN p_events g ON g.ord = a.grp_ord"""


def _turns_sql(sides: tuple[str, ...], prefill: bool) -> str:
    """One row per turn from router (r) and/or client (c) events, at most one of each per turn, and P's
    prefill_request event (p) for the turn's request id when ``prefill``.

    The classifier's instrumented path in SQL (classify._Turn._numbers, _instrumented): per field the
    first event stating it, client then router then P; the status of the client, else the router's
    unless P's says it failed; the deciding event: the router's outcome unless it is missing, unknown or
    only inferred while P states one, then P's, then the client's; and the parts the reason is built
    from (the deciding event's reason and failure_type, the failed status)."""
    have = (*sides, "p") if prefill else sides

    def col(side: str, name: str) -> str:
        return f"{side}.{name}" if side in have else "NULL"

    def first(name: str) -> str:
        return f"coalesce({col('c', name)}, {col('r', name)}, {col('p', name)})"

    picks = ",\n  ".join(f"{first(f)} AS {_RENAME.get(f, f)}"
                          for f in (*_FIELDS, "ts", "ttft_ms", "duration_ms", "remote_read_tokens"))
    # the client's own values: client statistics come before the router's and P's (_CLIENT_FIRST)
    picks += ",\n  " + ", ".join(f"{col('c', f)} AS c_{_RENAME.get(f, f)}" for f in _CLIENT_FIRST)
    # Which event decides, in classify._instrumented's order: P's first event with a known outcome
    # ("obs_") where the router only inferred its own; P's first event with any outcome ("grp_") in P's turn.
    deciders = [(f"{col('r', 'outcome')} IS NOT NULL AND starts_with(coalesce({col('r', 'reason')}, ''), 'inferred') "
                 f"AND {col('p', 'obs_outcome')} IS NOT NULL", "p", "obs_"),
                (f"{col('r', 'outcome')} IN ({_KNOWN})", "r", ""),
                (f"{col('p', 'grp_outcome')} IN ({_KNOWN})", "p", "grp_"),
                (f"{col('c', 'outcome')} IN ({_KNOWN})", "c", "")]
    deciders = [d for d in deciders if d[1] in have]

    def decided(name: str, default: str = "NULL") -> str:
        whens = " ".join(f"WHEN {cond} THEN {side}.{prefix}{name}" for cond, side, prefix in deciders)
        return f"CASE {whens} ELSE {default} END"

    fail = [f"WHEN {col('c', 'status')} IN ({_FAILED}) THEN {_why_failed('c') if 'c' in sides else 'NULL'}"]
    if "r" in sides:  # the router's failure counts only when the client did not get its answer
        answered = f"coalesce({col('c', 'status')} = 'ok', false)"
        fail.append(f"WHEN NOT {answered} AND r.status IN ({_FAILED}) THEN {_why_failed('r')}")
    # _numbers' status loop (client, router, P's events in order) then the client's own: the client's,
    # else P's last failed one, else the router's, else P's first.
    status = (f"coalesce({col('c', 'status')}, {col('p', 'status_bad')}, {col('r', 'status')}, "
              f"{col('p', 'status_first')})")
    if sides == ("r", "c"):
        source = ("r FULL OUTER JOIN c ON r.conversation_id = c.conversation_id AND r.turn = c.turn")
        with_ = ("WITH r AS (SELECT * FROM scanned WHERE source = 'router'), "
                 "c AS (SELECT * FROM scanned WHERE source = 'client')")
    else:
        source, with_ = f"scanned AS {sides[0]}", ""
    if prefill:  # p_prefill: one row per request id (_prefill_sql)
        rid = f"coalesce({col('r', 'request_id')}, {col('c', 'request_id')})"
        source = f"{source} LEFT JOIN p_prefill p ON p.request_id = {rid}"
    return f"""{with_}
SELECT {first('conversation_id')} AS conversation_id, {first('turn')} AS turn,
  coalesce({col('r', 'request_id')}, {col('c', 'request_id')}) AS request_id,
  {picks},
  {decided('outcome', "'unknown'")} AS verdict,
  {col('r', 'outcome')} AS router_outcome,
  {decided('reason')} AS decided_reason,
  {decided('failure_type')} AS decided_ft,
  CASE {' '.join(fail)} END AS failed_why,
  {status} AS status,
  {col('c', 'status')} AS client_status,
  {_id_hash(col('r', 'request_id'))} AS r_rid, {_id_hash(col('c', 'request_id'))} AS c_rid
FROM {source}
"""


_KNOWN: Final = ", ".join(f"'{v.value}'" for v in Verdict if v is not Verdict.UNKNOWN)


def _in(verdicts: frozenset[Verdict]) -> str:
    return ", ".join(f"'{v.value}'" for v in sorted(verdicts))


def _final_sql(gap_window: bool) -> str:
    # Every derived column of report.build_turn_table, vectorized in DuckDB (strings stay Arrow).
    # A CASE, not greatest(0.0, x): DuckDB's greatest skips NULLs, so a turn whose start or the previous
    # turn's end is unknown got a 0 s gap instead of none (build_turn_table leaves it unknown).
    since = "start_ts - lag(start_ts + latency_ms / 1000.0) OVER (PARTITION BY conversation_id ORDER BY turn)"
    gap = (f"coalesce(gap_s, CASE WHEN turn > 1 THEN CASE WHEN {since} < 0 THEN 0.0 ELSE {since} END END)"
           if gap_window else "gap_s")
    edges = " ".join(f"WHEN prompt_tokens < {e} THEN '{b}'" for e, b in zip(_PROMPT_EDGES, PROMPT_BUCKETS,
                                                                                strict=False))
    reasons = " ".join(f"WHEN contains(reason, '{n}') THEN '{n}'" for n in MISSING_METADATA_REASONS)
    summaries = " ".join(f"WHEN '{v.value}' THEN '{VERDICT_INFO[v].summary.replace(chr(39), chr(39) * 2)}'"
                         for v in Verdict)
    # classify._instrumented's reason: the deciding event's (else the verdict's summary), its failure_type,
    # and the failed status (classify._with_failure) unless the verdict already is request_failed.
    # One step per CTE: each part is computed once, not once per mention.
    return f"""
WITH b AS (SELECT *, CASE WHEN decided_reason IS NULL OR decided_reason = '' THEN CASE verdict {summaries} END
                          ELSE decided_reason END AS base FROM turns_final),
ty AS (SELECT *, CASE WHEN coalesce(decided_ft, '') <> '' AND NOT contains(base, decided_ft)
                      THEN base || ' (failure_type=' || decided_ft || ')' ELSE base END AS typed FROM b),
t AS (SELECT * EXCLUDE (base, typed), CASE WHEN failed_why IS NOT NULL AND verdict <> '{Verdict.REQUEST_FAILED.value}'
  THEN rtrim(typed, '.') || '; the turn failed (' || failed_why || ')' ELSE typed END AS reason FROM ty)
SELECT * EXCLUDE (gap_s, verdict, router_outcome, decided_reason, decided_ft, failed_why, client_status),
  CASE WHEN verdict IN ({_KNOWN}) THEN verdict ELSE 'unknown' END AS verdict,
  {gap} AS gap_s,
  start_ts + latency_ms / 1000.0 AS end_ts,
  CASE WHEN turn <= 1 THEN '1' WHEN turn = 2 THEN '2' WHEN turn = 3 THEN '3' WHEN turn <= 7 THEN '4-7'
       ELSE '8+' END AS turn_bucket,
  CASE WHEN prompt_tokens IS NULL THEN NULL {edges} ELSE '{PROMPT_BUCKETS[-1]}' END AS prompt_bucket,
  verdict IN ({_in(REUSED_VERDICTS)}) AS reused,
  verdict IN ({_in(ELIGIBLE_VERDICTS)}) AS eligible,
  CASE WHEN starts_with(coalesce(decided_reason, ''), 'inferred') THEN 'inferred' ELSE 'confirmed' END
    AS confidence,
  CASE WHEN verdict <> '{Verdict.METADATA_NOT_RETURNED.value}' THEN NULL {reasons} ELSE 'unknown' END
    AS metadata_reason
FROM t
"""


def _ids_sql(stock: bool) -> tuple[str, str]:
    # The conversation ids correlate knows (events, client statistics) and all it reads (+ the proxy's).
    known = "SELECT conversation_id FROM scanned" + (" UNION ALL SELECT conversation_id FROM stats" if stock else "")
    logged = known + (" UNION ALL SELECT conv FROM proxy_lines WHERE conv IS NOT NULL" if stock else "")
    return known, logged


# What a hashed tag looks like (correlate.id_tags: a sha256 hex prefix of these lengths).
_TAG_RE: Final = "|".join(f"[0-9a-f]{{{n}}}" for n in HASH_PREFIX_LENGTHS)


def _tag_candidates_sql(stock: bool) -> str:
    # Hashing every id is the dear part: only ids shaped like a tag can be one.
    lengths = ", ".join(map(str, HASH_PREFIX_LENGTHS))
    return (f"SELECT count(*) FROM ({_ids_sql(stock)[1]}) WHERE length(conversation_id) IN ({lengths}) "
            f"AND regexp_full_match(conversation_id, '{_TAG_RE}')")


def _tag_map_sql(stock: bool) -> str:
    """The logged ids that are a known id's hashed tag (router --hash-ids), with that id: correlate's
    tag_to_conv, restricted to the tags that occur."""
    known, logged = _ids_sql(stock)
    # Equi-joins (a UNION per tag length): an OR join condition would compare every pair of ids.
    tags = " UNION ALL ".join(f"SELECT id, left(d, {n}) AS tag FROM h" for n in HASH_PREFIX_LENGTHS)
    return f"""
WITH h AS (SELECT id, sha256(id) AS d FROM (SELECT DISTINCT conversation_id AS id FROM ({known}))),
ids AS (SELECT DISTINCT conversation_id FROM ({logged}) WHERE regexp_full_match(conversation_id, '{_TAG_RE}'))
SELECT DISTINCT a.conversation_id AS tag, b.id AS conv FROM ids a JOIN ({tags}) b
  ON a.conversation_id = b.tag AND a.conversation_id <> b.id"""


def _map_hashed_tags(con: duckdb.DuckDBPyConnection, stock: bool) -> None:
    """Rewrite hashed tags to the ids they hash, where correlate does: in the events and the proxy lines
    (not in client statistics, which it reads as logged)."""
    con.execute("CREATE TEMP TABLE tag_map AS " + _tag_map_sql(stock))
    if con.sql("SELECT count(*) - count(DISTINCT tag) FROM tag_map").fetchall()[0][0]:
        raise Decline("a hashed tag that two conversation ids share")  # correlate's pick would be arbitrary
    con.execute("UPDATE raw SET conversation_id = m.conv FROM tag_map m WHERE raw.conversation_id = m.tag")
    if stock:
        # One conversation under both its id and its tag in the proxy log: correlate pairs those lines
        # (its pending HIT rule) across the two spellings, proxy_req did not.
        if con.sql("SELECT count(*) FROM tag_map WHERE tag IN (SELECT conv FROM proxy_lines) "
                   "AND conv IN (SELECT conv FROM proxy_lines)").fetchall()[0][0]:
            raise Decline("a conversation logged both by its id and by its hashed tag in the proxy log")
        con.execute("UPDATE proxy_lines SET conv = m.conv FROM tag_map m WHERE proxy_lines.conv = m.tag")


def _engine_events_sql() -> str:
    """Count the engine events correlate could join where the SQL does not: one no turn's request id
    names but that names some request (by a header id or its engine id) or a conversation and turn (an
    engine_start names none). Reads ``turns``."""
    return """
WITH p AS (SELECT * FROM raw WHERE source IN ('prefill', 'decode'))
SELECT (SELECT count(*) FROM p LEFT JOIN turns t ON p.request_id = t.request_id
        WHERE t.request_id IS NULL AND (p.request_id IS NOT NULL OR p.engine_request_id IS NOT NULL
                                        OR (p.conversation_id IS NOT NULL AND p.turn IS NOT NULL)))
"""


# On the finished table (one row per joined turn): a turn key on two rows (a repeated event), or a
# request id on two turns (correlate joins by request id first: it would merge them). A client's id
# that differs from the router's on the same turn is the one the correlator merges by turn ("lone").
_REPEATS_SQL: Final = """
SELECT (SELECT count(*) - count(DISTINCT hash(conversation_id, turn)) FROM result)
     + (SELECT count(*) - count(DISTINCT rid) FROM (SELECT r_rid AS rid FROM result WHERE r_rid IS NOT NULL
          UNION ALL SELECT c_rid FROM result WHERE c_rid IS NOT NULL AND c_rid IS DISTINCT FROM r_rid))
"""


# The stock facts joined to each turn (classify._Turn._numbers, _client_gap, _failed): numbers no event
# states come from the k-th client statistic of the conversation and the proxy's request, gaps from the
# client's clock, and a turn the client did not get takes the stock failure lines' why.
_STOCK_JOIN_SQL: Final = f"""
WITH t AS (SELECT *, row_number() OVER (PARTITION BY conversation_id ORDER BY turn) AS k FROM turns),
j AS (SELECT t.*, s.ttft_ms AS s_ttft, s.latency_ms AS s_latency, s.start_time_ms AS s_start,
        s.input_num_tokens AS s_prompt, s.output_num_tokens AS s_completion, p.prefill_ms AS p_prefill,
        p.entry_age_s AS p_age, f.stock_why, coalesce(f.retried, false) AS retried,
        coalesce(t.client_status = 'ok', false) AS answered
      FROM t LEFT JOIN stats s ON s.conversation_id = t.conversation_id AND s.k = t.k
      LEFT JOIN proxy_req p ON p.request_id = t.request_id
      LEFT JOIN stock_fail f ON f.request_id = t.request_id),
g AS (SELECT *, (s_start - lag(s_start) OVER w - lag(s_latency) OVER w) / 1000.0 AS client_gap
      FROM j WINDOW w AS (PARTITION BY conversation_id ORDER BY turn))
SELECT * EXCLUDE (k, s_ttft, s_latency, s_start, s_prompt, s_completion, p_prefill, p_age, stock_why, retried,
                  answered, client_gap, {", ".join(_CLIENT_COLS)})
  REPLACE (coalesce(c_ttft_ms, s_ttft, ttft_ms) AS ttft_ms, coalesce(c_prompt_tokens, s_prompt, prompt_tokens)
             AS prompt_tokens,
           coalesce(c_completion_tokens, s_completion, completion_tokens) AS completion_tokens,
           coalesce(c_latency_ms, s_latency, latency_ms) AS latency_ms, coalesce(prefill_ms, p_prefill) AS prefill_ms,
           coalesce(entry_age_s, p_age) AS entry_age_s,
           coalesce(gap_s, CASE WHEN client_gap >= 0 THEN client_gap END) AS gap_s,
           coalesce(failed_why, CASE WHEN NOT answered THEN stock_why END) AS failed_why),
  gap_s IS NULL AND client_gap >= 0 AS _round_gap,
  answered AND retried AND verdict <> '{Verdict.REQUEST_FAILED.value}' AS _retried
FROM g
"""


def _stock_declines(con: duckdb.DuckDBPyConnection) -> str | None:
    """Why the stock facts cannot be joined as _STOCK_JOIN_SQL does (correlate would make other turns)."""
    orphan_stats = con.sql("""SELECT count(*) FROM stats s LEFT JOIN (SELECT conversation_id, row_number() OVER
        (PARTITION BY conversation_id ORDER BY turn) AS k FROM turns) t USING (conversation_id, k)
        WHERE t.k IS NULL""").fetchall()[0][0]
    if orphan_stats:
        return "client statistics for turns no event names"
    if con.sql("SELECT count(*) FROM proxy_req WHERE request_id NOT IN (SELECT request_id FROM turns "
               "WHERE request_id IS NOT NULL)").fetchall()[0][0]:
        return "proxy requests no event names"
    return None


def fast_turn_table(files: Sequence[str], columns: Sequence[str] | None = None) -> pd.DataFrame | None:
    """The turn table (report.TABLE_COLUMNS) computed in DuckDB, from event files and the stock logs beside them.

    None when there are no event files, or a shape only explain's correlator decides (anonymous or repeated
    turn events, engine events it cannot join by request id, stock lines the SQL does not model; Decline):
    the caller then parses them (the table must not differ). ``columns``: the order to give the table
    (report.TABLE_COLUMNS: normalize_table then copies nothing)."""
    detected = detect(files)
    events = [f.path for f in detected if f.fmt == "events"]
    stock = [f for f in detected if f.fmt in STOCK_FORMATS]
    if not events:
        return None
    con = duckdb.connect()
    # pandas' str dtype is Arrow large_string: exported as such, strings need no conversion copy.
    con.execute("SET arrow_large_buffer_size = true")
    try:
        return _fast_turn_table(con, events, stock, columns)
    except Decline as why:
        log.debug("report: parsing the logs (the DuckDB path declined: %s)", why)
        return None
    except (duckdb.InvalidInputException, duckdb.ConversionException) as exc:
        # a line DuckDB cannot read (invalid UTF-8, an oversized line): the parser counts and skips it
        log.debug("report: parsing the logs (DuckDB could not read them: %s)", exc)
        return None
    finally:
        con.close()


def _fast_turn_table(con: duckdb.DuckDBPyConnection, events: list[str], stock: list[LogFile],
                     columns: Sequence[str] | None) -> pd.DataFrame:
    engine_logs = [f for f in stock if f.fmt == "vllm"]
    with ThreadPoolExecutor(max_workers=max(1, min(len(engine_logs), 2))) as pool:
        # The vLLM logs' grep (children, mostly) runs beside DuckDB's scans, as explain's prefilter does.
        scans = [pool.submit(failure_records, f) for f in engine_logs]
        try:
            return _build(con, events, stock, lambda: [s.result() for s in scans], columns)
        finally:
            for s in scans:
                s.cancel()


def _fold_prefill_events(con: duckdb.DuckDBPyConnection, events: list[str]) -> None:
    """Create ``p_prefill``. A request P ran twice (the router retried it) needs the events' file order:
    the event files are read again for those requests only, numbered in order (DuckDB keeps it)."""
    retried = con.sql("SELECT count(*) FROM (SELECT request_id FROM raw WHERE event = 'prefill_request' "
                      "AND request_id IS NOT NULL GROUP BY request_id HAVING count(*) > 1)").fetchall()[0][0]
    if retried:
        con.execute(f"""CREATE TEMP TABLE p_events AS SELECT row_number() OVER () AS ord, * FROM ({_scan_sql()})
            WHERE event = 'prefill_request' AND request_id IN (SELECT request_id FROM raw
              WHERE event = 'prefill_request' GROUP BY request_id HAVING count(*) > 1)""", {"files": events})
        con.execute(f"""CREATE TEMP TABLE p_prefill AS {_prefill_sql(True)} UNION ALL BY NAME
            {_prefill_sql(False)} AND request_id NOT IN (SELECT request_id FROM p_events)""")
    else:
        con.execute(f"CREATE TEMP VIEW p_prefill AS {_prefill_sql(False)}")


def _build(con: duckdb.DuckDBPyConnection, events: list[str], stock: list[LogFile],
           engine_records: Callable[[], Sequence[list[VllmRecord]]], columns: Sequence[str] | None) -> pd.DataFrame:
    # Materialized once inside DuckDB (no Arrow round trip); the checks and the join read it.
    con.execute("CREATE TEMP TABLE raw AS " + _scan_sql(), {"files": events})
    con.execute("CREATE TEMP VIEW scanned AS " + _TURN_EVENTS)
    anonymous, routers, clients, engine, *values = con.sql(_PROFILE_SQL).fetchall()[0]
    if anonymous:  # joined through request ids (a request sent without a conversation id): correlate's call
        raise Decline("turn events without a conversation, turn, request id or time")
    if _rejected_by_value(*values):
        raise Decline("event lines explain rejects as corrupt")
    if not routers and not clients:
        raise Decline("no turn events")
    sides = ("r", "c") if routers and clients else ("r",) if routers else ("c",)
    if stock:
        load_stock(con, stock, engine_records)
    # A table only when a later step reads it too; else the join streams into the result.
    materialize = bool(engine) or bool(stock)
    if con.sql(_tag_candidates_sql(bool(stock))).fetchall()[0][0]:
        _map_hashed_tags(con, bool(stock))
    if engine:
        _fold_prefill_events(con, events)
    con.execute(f"CREATE TEMP {'TABLE' if materialize else 'VIEW'} turns AS " + _turns_sql(sides, bool(engine)))
    if engine and con.sql(_engine_events_sql()).fetchall()[0][0]:
        raise Decline("engine events only the correlator joins (by an engine or header id, or conversation and turn)")
    if stock:
        why = _stock_declines(con)
        if why is not None:
            raise Decline(why)
        con.execute("CREATE TEMP TABLE stock_fail AS " + STOCK_FAILURES_SQL)
        con.execute("CREATE TEMP TABLE turns_final AS " + _STOCK_JOIN_SQL)
    else:
        con.execute(f"CREATE TEMP VIEW turns_final AS SELECT * EXCLUDE ({', '.join(_CLIENT_COLS)}) FROM turns")
    # Client statistics leave some gaps unknown (a negative one is no gap): then the window is needed anyway.
    result = con.sql(_final_sql(bool(stock))).to_arrow_table()
    if not stock and pc.any(pc.and_(pc.greater(result["turn"], 1), pc.is_null(result["gap_s"]))).as_py():
        # The router states each later turn's gap; only when some is missing pay for the window.
        result = con.sql(_final_sql(True)).to_arrow_table()
    con.register("result", result)
    if con.sql(_REPEATS_SQL).fetchall()[0][0]:
        raise Decline("repeated turn events, or a request id on two turns")
    if pc.any(pc.equal(result["verdict"], Verdict.UNKNOWN.value)).as_py():
        raise Decline("a turn no event decides: the stock rules (explain) say what it was")
    # Nullable integers straight from Arrow (no float round trip for normalize_table to undo).
    result = result.drop_columns(["r_rid", "c_rid"])
    if columns is not None:  # Arrow reorders without copying; pandas would copy every column
        result = result.select([*columns, *(c for c in result.column_names if c not in columns)])
    df = result.to_pandas(types_mapper={pa.int64(): pd.Int64Dtype()}.get)
    df["reason"] = df["reason"].fillna("")
    if "_round_gap" in df.columns:
        # classify._client_gap rounds with Python's round (a SQL round may differ in the last digit)
        rounded = df["_round_gap"].fillna(False).astype(bool)
        df.loc[rounded, "gap_s"] = [round(float(g), 3) for g in df.loc[rounded, "gap_s"]]
        retried = df["_retried"].fillna(False).astype(bool)
        df.loc[retried, "reason"] = [retried_reason(r) for r in df.loc[retried, "reason"]]
        df = df.drop(columns=["_round_gap", "_retried"])
    return df
