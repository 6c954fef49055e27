"""What stock logs add to the turns kvdiag events decide, in DuckDB: the mixed inputs of report's fast path.

An instrumented turn's verdict comes from its events; the stock logs beside them still fill numbers and
reasons (classify.py): the client statistics give the TTFT, tokens and latency no event states and the
gap to the previous reply (``_Turn._numbers``, ``_client_gap``); the proxy log gives the prefill time and
the entry age; P's and D's failure lines and the proxy's failed legs say why a turn the client did not
get failed (``_failed``), and P's failed first attempt extends an answered turn's reason. Proxy lines are
matched with the proxy parser's own regexes (RE2 reads Python's syntax); vLLM lines are selected by
DuckDB and the few that can fail a turn are parsed by vllm_log.py. A shape these rules do not model
raises Decline, and the caller parses instead: the table must not differ (tests/test_report_stock.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import duckdb
import pandas as pd

from kvdiag.diagnostics.classify import FAILURE_KINDS, PROXY_FAILURE_KINDS, proxy_failure, record_failure
from kvdiag.diagnostics.correlate import PREFILL_KINDS, record_rids
from kvdiag.diagnostics.detect import LogFile, open_binary
from kvdiag.diagnostics.explain import VLLM_KEYWORDS, is_json_document
from kvdiag.diagnostics.proxy_log import CLASSIFIERS as PROXY_CLASSIFIERS
from kvdiag.diagnostics.proxy_log import PROXY_RE
from kvdiag.diagnostics.scan import grep_lines
from kvdiag.diagnostics.vllm_log import VllmRecord, classify_message, header_request_id, parse_vllm_numbered

STOCK_FORMATS: Final = frozenset({"client_stats", "proxy", "vllm"})
_GROUPS: Final = {"prefill": 0, "decode": 1}  # classify._failed reads P's lines, then D's, then the rest


class Decline(Exception):
    """The stock logs have a shape only explain's parser models; the message says which."""


def _sql_str(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


_CSV_LINES: Final = ("columns = {'line': 'VARCHAR'}, header = false, delim = '\\x01', quote = '', escape = '', "
                     "strict_mode = false, max_line_size = 1000000")


def _check_compression(files: Sequence[LogFile]) -> None:
    for f in files:
        if f.path.endswith(".gz"):
            continue
        with open(f.path, "rb") as fh:
            if fh.read(2) == b"\x1f\x8b":  # gzip without the suffix DuckDB detects it by
                raise Decline(f"{f.path}: gzip data without a .gz suffix")


# ---------------------------------------------------------------------------------------------
# Client statistics (vLLM's multi-turn benchmark RequestStats, JSON lines).

_STAT_KEYS: Final = ("conversation_id", "ttft_ms", "latency_ms", "start_time_ms", "input_num_turns",
                     "input_num_tokens", "output_num_tokens", "turn", "request_id", "v", "event", "source")
_NUMBER_TYPES: Final = "('BIGINT', 'UBIGINT', 'DOUBLE')"


def _num(key: str) -> str:
    # json_logs._num: a JSON int or float (never a bool or a string).
    return f"CASE WHEN json_type({key}) IN {_NUMBER_TYPES} THEN CAST({key} AS DOUBLE) END"


def _int(key: str) -> str:
    # json_logs._int: int(float(x)), which truncates (a SQL cast would round).
    return f"CAST(trunc({_num(key)}) AS BIGINT)"


def load_client_stats(con: duckdb.DuckDBPyConnection, files: Sequence[LogFile]) -> None:
    """Create ``stats``: one row per benchmark record, ranked within its conversation (correlate's order)."""
    if not files:
        con.execute("CREATE TEMP TABLE stats (conversation_id VARCHAR, k BIGINT, ttft_ms DOUBLE, latency_ms DOUBLE, "
                    "start_time_ms DOUBLE, input_num_tokens BIGINT, output_num_tokens BIGINT)")
        return
    # JSON lines, or one JSON array (--stats-json-output; explain reads the same two shapes)
    layouts: dict[str, list[str]] = {"newline_delimited": [], "array": []}
    for f in files:
        layouts["array" if is_json_document(f) else "newline_delimited"].append(f.path)
    if layouts["newline_delimited"] and con.sql(
            f"SELECT count(*) FROM read_csv($p, {_CSV_LINES}) WHERE starts_with(ltrim(line), '[')",
            params={"p": layouts["newline_delimited"]}).fetchall()[0][0]:
        raise Decline("a JSON array on one line among JSON lines (explain reads each element)")
    cols = ", ".join(f"{k}: 'JSON'" for k in _STAT_KEYS)
    scans = " UNION ALL ".join(f"SELECT * FROM read_json(${fmt}, format = '{fmt}', columns = {{{cols}}}, "
                               "ignore_errors = true)" for fmt, paths in layouts.items() if paths)
    con.execute(f"CREATE TEMP TABLE st_raw AS {scans}", {fmt: paths for fmt, paths in layouts.items() if paths})
    odd = con.sql("""SELECT count(*) FROM st_raw WHERE v IS NOT NULL OR event IS NOT NULL OR source IS NOT NULL
        OR turn IS NOT NULL OR request_id IS NOT NULL
        OR (conversation_id IS NOT NULL AND json_type(conversation_id) NOT IN ('VARCHAR', 'BIGINT', 'UBIGINT'))
        """).fetchall()[0][0]
    if odd:  # event lines among the stats, explicit turns or request ids, odd ids: correlate's other rules
        raise Decline("client statistics with events, explicit turns or request ids")
    con.execute(f"""CREATE TEMP TABLE stats AS
        WITH s AS (SELECT CASE WHEN json_type(conversation_id) = 'VARCHAR' THEN conversation_id ->> '$'
                               ELSE CAST(conversation_id AS VARCHAR) END AS conversation_id,
          {_num('ttft_ms')} AS ttft_ms, {_num('latency_ms')} AS latency_ms, {_num('start_time_ms')} AS start_time_ms,
          coalesce({_int('input_num_turns')}, 0) AS nturns, {_int('input_num_tokens')} AS input_num_tokens,
          {_int('output_num_tokens')} AS output_num_tokens
          FROM st_raw WHERE conversation_id IS NOT NULL)
        SELECT *, row_number() OVER (PARTITION BY conversation_id ORDER BY nturns, coalesce(start_time_ms, 0.0))
          AS k FROM s""")
    ties = con.sql("SELECT count(*) - count(DISTINCT (conversation_id, nturns, coalesce(start_time_ms, 0.0))) "
                   "FROM stats").fetchall()[0][0]
    if ties:  # the file order would decide which record is which turn
        raise Decline("client statistics with equal message counts and start times")


# ---------------------------------------------------------------------------------------------
# The proxy log (vLLM's disagg_proxy_multiturn.py format; kvdiag router --proxy-log).

# The kinds the table needs, each with a literal its pattern implies (no_conversation_id, cached and
# ready lines change only stock verdicts).
_MARKERS: Final[dict[str, str | tuple[str, ...]]] = {
    "stale": ": stale cache entry (age=", "hit": ": cache HIT (age=",
    "sending": ": sending D's cached blocks to P (remote_request_id=", "miss": ("] conv=", ": cache MISS"),
    "no_handle": ": no D-to-P handle offered", "prefill_done": "] Prefill done in ",
    "prefill_failed": "] Prefill request failed: ", "decode_failed": "] Decode request failed: ",
}
_CANDIDATE: Final = (" conv=", "] Prefill ", "] Decode request failed: ")  # every kind's line has one
_PROXY_FIELDS: Final = ("rid", "conv", "age", "ms", "detail")


def _literals(marker: str | tuple[str, ...]) -> tuple[str, ...]:
    return (marker,) if isinstance(marker, str) else marker


def _between(start: str, end: str | None) -> str:
    # The text after the first ``start`` in msg, up to the first ``end`` after it (or the line's end).
    after = f"substr(msg, strpos(msg, {_sql_str(start)}) + {len(start)})"
    return after if end is None else f"left({after}, strpos({after}, {_sql_str(end)}) - 1)"


# Each group of a matched line, by string position: the regex (matched without captures, which RE2 runs
# several times faster) proves the shape, and each group then ends at the first character its class
# excludes: a space for conversation ids, "]" for request ids, a letter for numbers.
_RID: Final = _between("[", "]")
_FIELD_SQL: Final[dict[str, dict[str, str]]] = {
    "stale": {"conv": _between("conv=", ": stale cache entry (age="),
              "age": _between(": stale cache entry (age=", "s")},
    "hit": {"conv": _between("conv=", ": cache HIT (age="), "age": _between(": cache HIT (age=", "s")},
    "sending": {"rid": _RID, "conv": _between("] conv=", ": sending D's cached blocks to P (")},
    "miss": {"rid": _RID, "conv": _between("] conv=", ": cache MISS")},
    "no_handle": {"rid": _RID, "conv": _between("] conv=", ": no D-to-P handle offered")},
    "prefill_done": {"rid": _RID, "ms": _between("] Prefill done in ", "m")},
    "prefill_failed": {"rid": _RID, "detail": _between("] Prefill request failed: ", None)},
    "decode_failed": {"rid": _RID, "detail": _between("] Decode request failed: ", None)},
}
# PROXY_RE up to its message group: a kind's pattern takes the message's place.
_PROXY_HEAD: Final = PROXY_RE.pattern.removesuffix("(?P<msg>.*)$")
if _PROXY_HEAD == PROXY_RE.pattern:  # the parser's pattern changed shape: fail loudly, not differ silently
    raise ImportError("proxy_log.PROXY_RE no longer ends with its message group")


def parse_proxy_lines(con: duckdb.DuckDBPyConnection, paths: Sequence[str]) -> None:
    """Create ``proxy_lines``: the kind and groups proxy_log gives each line of _MARKERS' kinds, in file
    order (f, n). load_proxy has declined files with a lone CR, where explain's reader (bytes.splitlines)
    and DuckDB's may split lines differently."""
    # A kind is guessed from a literal its pattern contains, then the line is matched once against the
    # proxy's line pattern with that kind's message pattern in place of the message (_FIELD_SQL then
    # cuts the groups out). A proxy line its guess's pattern rejects declines (the parser might match
    # another pattern), so the kinds equal proxy_log.classify_proxy_message's.
    # (a later proxy revision logs "conv=C: cache MISS (request history changed)" without a request id:
    # a kind the table does not need, so "miss" needs both of its literals)
    guess = " ".join(f"WHEN {' AND '.join(f'contains(line, {_sql_str(x)})' for x in _literals(m))} THEN '{k}'"
                     for k, m in _MARKERS.items())
    candidate = " OR ".join(f"contains(line, {_sql_str(c)})" for c in _CANDIDATE)
    # A parallel insert keeps each file's line order (DuckDB's preserve_insertion_order), so the kept
    # lines' rowid orders them, files one after the other, without a single-threaded window.
    con.execute("CREATE TEMP TABLE proxy_kept (f INTEGER, line VARCHAR, kind VARCHAR)")
    for i, path in enumerate(paths):
        con.execute(f"INSERT INTO proxy_kept SELECT {i}, line, kind FROM (SELECT line, CASE {guess} END AS kind "
                    f"FROM read_csv($p, {_CSV_LINES}) WHERE {candidate}) WHERE kind IS NOT NULL", {"p": path})
    con.execute("CREATE TEMP TABLE proxy_msgs AS SELECT f, rowid AS n, line, kind FROM proxy_kept")
    parts = []
    for kind, regex in PROXY_CLASSIFIERS:
        if kind not in _MARKERS:
            continue
        pattern = _sql_str(_PROXY_HEAD + regex.pattern[1:])
        cols = ", ".join(f"{_FIELD_SQL[kind].get(c, 'NULL')} AS {c}" for c in _PROXY_FIELDS)
        parts.append(f"SELECT f, n, kind, ok, CASE WHEN NOT ok THEN line END AS line, "
                     f"{cols} FROM (SELECT *, regexp_matches(line, {pattern}) AS ok, "
                     f"substr(line, strpos(line, ': ') + 2) AS msg FROM proxy_msgs WHERE kind = '{kind}')")
    con.execute("CREATE TEMP TABLE proxy_lines AS " + " UNION ALL ".join(parts))
    if con.sql(f"SELECT count(*) FROM proxy_lines WHERE NOT ok AND regexp_matches(line, {_sql_str(PROXY_RE.pattern)})"
               ).fetchall()[0][0]:
        raise Decline("a proxy line its kind's pattern rejects")
    con.execute("DELETE FROM proxy_lines WHERE NOT ok")  # lines in no proxy format: the parser skips them too


def _has_lone_cr(path: str) -> bool:
    """True when the file has a CR not followed by LF. Explain's reader splits a line there; DuckDB's
    reader may too, or, in a file it sniffed as CRLF, eat the next byte with it."""
    with open_binary(path) as fh:
        prev_cr = False  # the previous block ended in CR: its LF, if any, starts this block
        while block := fh.read(8 << 20):
            if prev_cr and not block.startswith(b"\n"):
                return True
            body = block[:-1] if block.endswith(b"\r") else block
            if body.count(b"\r") != body.count(b"\r\n"):
                return True
            prev_cr = block.endswith(b"\r")
        return prev_cr


def load_proxy(con: duckdb.DuckDBPyConnection, files: Sequence[LogFile]) -> None:
    """Create ``proxy_req`` (per request id: prefill time, entry age) and ``proxy_fail`` (failed legs)."""
    if not files:
        con.execute("CREATE TEMP TABLE proxy_req (request_id VARCHAR, conv VARCHAR, prefill_ms DOUBLE, "
                    "entry_age_s DOUBLE)")
        con.execute("CREATE TEMP TABLE proxy_fail (request_id VARCHAR, why VARCHAR)")
        con.execute("CREATE TEMP TABLE proxy_lines (conv VARCHAR)")
        return
    lone_cr = next((f.path for f in files if _has_lone_cr(f.path)), None)
    if lone_cr is not None:
        raise Decline(f"{lone_cr}: a carriage return inside a line")
    parse_proxy_lines(con, [f.path for f in files])
    if con.sql("""SELECT count(*) FROM proxy_lines WHERE (kind IN ('hit', 'stale') AND TRY_CAST(age AS DOUBLE) IS NULL)
                  OR (kind = 'prefill_done' AND TRY_CAST(ms AS DOUBLE) IS NULL)""").fetchall()[0][0]:
        raise Decline("a proxy line with a number Python's float() may read otherwise")
    # Requests: a "[rid] conv=" line (sending/miss/no_handle) names the conversation and takes the
    # hit/stale line logged just before it for that conversation (correlate._proxy_requests' pending).
    many = con.sql("SELECT count(*) FROM (SELECT rid FROM proxy_lines WHERE kind IN ('sending', 'miss', "
                   "'no_handle') GROUP BY rid HAVING count(*) > 1)").fetchall()[0][0]
    if many:
        raise Decline("a proxy request id looked up twice")
    con.execute("""CREATE TEMP TABLE proxy_req AS
        WITH s AS (SELECT f, n, kind, rid, conv, lag(kind) OVER w AS head_kind, lag(age) OVER w AS head_age
                   FROM proxy_lines WHERE kind IN ('hit', 'stale', 'sending', 'miss', 'no_handle')
                   WINDOW w AS (PARTITION BY conv ORDER BY f, n)),
        looked AS (SELECT rid, conv, CASE WHEN head_kind IN ('hit', 'stale') THEN CAST(head_age AS DOUBLE) END
                     AS entry_age_s FROM s WHERE kind IN ('sending', 'miss', 'no_handle')),
        done AS (SELECT rid, arg_min(CAST(ms AS DOUBLE), (f, n)) AS prefill_ms FROM proxy_lines
                 WHERE kind = 'prefill_done' GROUP BY rid)
        SELECT looked.rid AS request_id, conv, prefill_ms, entry_age_s FROM looked LEFT JOIN done USING (rid)""")
    # A failed leg's line (rare) is worded by classify's own rule: the first per request, in file order.
    failed: dict[str, str] = {}
    kinds = ", ".join(map(_sql_str, sorted(PROXY_FAILURE_KINDS)))
    for rid, kind, detail in con.sql(f"SELECT rid, kind, detail FROM proxy_lines WHERE kind IN ({kinds}) "
                                     "AND rid IN (SELECT request_id FROM proxy_req) ORDER BY f, n").fetchall():
        why = proxy_failure(kind, detail)
        if why is not None:
            failed.setdefault(rid, why)
    _register(con, "proxy_fail", pd.DataFrame({"request_id": list(failed), "why": list(failed.values())},
                                              dtype="str"))


def _register(con: duckdb.DuckDBPyConnection, name: str, frame: pd.DataFrame) -> None:
    con.register(f"{name}_rows", frame)
    con.execute(f"CREATE TEMP TABLE {name} AS SELECT * FROM {name}_rows")
    con.unregister(f"{name}_rows")


# ---------------------------------------------------------------------------------------------
# vLLM logs: only lines that can fail a turn (or tell a file's role) reach the parser.


def _wanted(line: bytes, role_known: bool) -> bool:
    # Lines that can fail a turn (classify.FAILURE_KINDS) or hang one (declined), in vllm_log's words,
    # that explain's keyword prefilter keeps too (it drops e.g. "Request x failed: ..."); and, in a file
    # whose name tells no role, the lines that make it P's (correlate.infer_file_roles).
    if not any(k in line for k in VLLM_KEYWORDS):
        return False
    if b"due to KV load failure" in line or (b"Request " in line and b" failed" in line) \
            or b"WAITING_FOR_REMOTE_KVS" in line:
        return True
    if b"Generated response" in line and (b"finish_reason: error" in line or b"finish_reason: abort" in line
                                          or b"finish_reason: " not in line):
        return True
    return not role_known and (b"Declining expired" in line or b"Skipping remote pull" in line)


def failure_records(f: LogFile) -> list[VllmRecord]:
    """The records of one vLLM log that can fail (or hang) a turn, or tell its role; Decline when unsure."""
    # grep splits lines as explain's prefilter does (on LF only); the CR needle finds the lines vllm_log
    # joins to the next one (a line ending in CR), where explain's records may differ from these.
    needles = [b"fail", b"WAITING_FOR_REMOTE_KVS", b"Generated response", b"\r"]
    if f.role is None:
        needles += [b"Declining expired", b"Skipping remote pull"]
    continued: set[int] = set()
    kept: list[tuple[int, bytes | str]] = []
    for lineno, line in grep_lines(f.path, needles):
        if line.rstrip(b"\n").endswith(b"\r"):
            continued.add(lineno)
        if _wanted(line, f.role is not None):
            if lineno - 1 in continued:
                raise Decline(f"{f.path}:{lineno}: a vLLM line continuing the one before it (CR)")
            kept.append((lineno, line))
    out = []
    for rec in parse_vllm_numbered(kept, f.path):
        if rec.kind in FAILURE_KINDS and "\n" in rec.msg and \
                classify_message(rec.msg.split("\n", 1)[0])[0] != rec.kind:
            raise Decline(f"{f.path}:{rec.lineno}: a failure line whose kind only its continuation lines give")
        if rec.kind == "waiting_remote_kvs":
            raise Decline(f"{f.path}: WAITING_FOR_REMOTE_KVS lines (the hang rule is the parser's)")
        if rec.kind is None and rec.msg.startswith("Generated response"):
            raise Decline(f"{f.path}:{rec.lineno}: a generated response without its finish_reason on the line")
        out.append(rec)
    return out


def load_engine_failures(con: duckdb.DuckDBPyConnection, files: Sequence[LogFile],
                         per_file: Sequence[list[VllmRecord]]) -> None:
    """Create ``engine_fail`` from failure_records of each vLLM log: per failure line, the header ids it
    names, its order (P's lines, then D's, then the rest), and why."""
    rows: list[tuple[int, int, str, int, str, bool]] = []  # record, position, header id, order, why, retried
    if files:
        records = [(fi, rec) for fi, recs in enumerate(per_file) for rec in recs]
        roles = [f.role for f in files]
        for fi, rec in records:  # correlate.infer_file_roles
            if roles[fi] is None and rec.kind in PREFILL_KINDS:
                roles[fi] = "prefill"
        order = 0
        for fi, rec in sorted(records, key=lambda r: (_GROUPS.get(roles[r[0]] or "", 2), r[0], r[1].lineno)):
            why = record_failure(rec) if rec.kind in FAILURE_KINDS else None
            retried = rec.kind == "kv_load_failed" and roles[fi] == "prefill"
            if why is None and not retried:
                continue
            order += 1
            for pos, rid in enumerate(record_rids(rec)):
                rows.append((order, pos, header_request_id(rid), order, why or "", retried))
    frame = pd.DataFrame(rows, columns=["rec", "pos", "hrid", "ord", "why", "retried"])
    _register(con, "engine_fail", frame.astype({"rec": "int64", "pos": "int64", "hrid": "str", "ord": "int64",
                                                "why": "str", "retried": "bool"}))


# Per turn request id: the first failure line's why (P's, then D's, then other engines', then the
# proxy's failed legs: classify._failed's order) and whether P failed a first attempt on a KV load
# failure (classify._with_failure's retry). Reads ``turns``.
STOCK_FAILURES_SQL: Final = """
WITH attached AS (SELECT e.*, row_number() OVER (PARTITION BY e.rec ORDER BY e.pos) AS k
                  FROM engine_fail e JOIN (SELECT request_id FROM turns) t ON e.hrid = t.request_id),
eng AS (SELECT hrid AS request_id, arg_min(why, ord) FILTER (WHERE why <> '') AS why, bool_or(retried) AS retried
        FROM attached WHERE k = 1 GROUP BY hrid)
SELECT coalesce(eng.request_id, prx.request_id) AS request_id, coalesce(eng.why, prx.why) AS stock_why,
       coalesce(eng.retried, false) AS retried
FROM eng FULL OUTER JOIN proxy_fail prx ON eng.request_id = prx.request_id
"""


def load_stock(con: duckdb.DuckDBPyConnection, files: Sequence[LogFile],
               engine_records: Callable[[], Sequence[list[VllmRecord]]]) -> None:
    """Create the stock-fact tables (``stats``, ``proxy_req``, ``proxy_fail``, ``engine_fail``).

    ``engine_records`` returns failure_records of each vLLM log among ``files`` (in order): the caller
    may have started those scans (grep children) to run beside DuckDB's."""
    _check_compression([f for f in files if f.fmt in STOCK_FORMATS])
    load_client_stats(con, [f for f in files if f.fmt == "client_stats"])
    load_proxy(con, [f for f in files if f.fmt == "proxy"])
    load_engine_failures(con, [f for f in files if f.fmt == "vllm"], engine_records())
