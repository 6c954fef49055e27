"""Log lines into record tables, in DuckDB: the verdict engine's parsers (SQL over every line).

Every input arrives as lines ``(f, n, line)``: ``f`` the file's place in reading order, ``n`` its line
number (counted by ``\\n``, as grep and editors count). Whole files are read by DuckDB itself
(``read_lines_sql``); lines a prefilter kept (grep), compressed files and files DuckDB cannot read
line for line (a carriage return inside a line, invalid UTF-8) arrive from Python (``lines_arrow``).
Four record tables come out, one row per record, each with ``f``, ``n`` and the evidence ``text``:

* ``ev``: kvdiag TurnEvents (the schema's fields; checked as ``event_from_dict`` checks them),
* ``cs``: client statistics (vLLM's benchmark RequestStats, generic ``conversation_id`` lines),
* ``pl``: the proxy's lines (``proxy_log.CLASSIFIERS``' kinds and groups),
* ``vl``: vLLM's lines (``vllm_log``'s kinds, the fields the rules read).

The line patterns are the Python parsers' own (``proxy_log.CLASSIFIERS``, ``vllm_log._CLASSIFIERS``,
``HEADER_RE``; RE2 reads them as Python does). A JSON line these checks cannot vouch for (not an
object, a key or value the schema rejects, a value of the wrong type) goes through ``json_logs``
itself, which yields the record or the corrupt-line note explain prints.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Final

from kvdiag.diagnostics import vllm_log_parser as vllm_log
from kvdiag.diagnostics.linestats import MAX_LINE_CHARS, LineStats, decode_line
from kvdiag.schema.events import (
    EVENTS_BY_SOURCE,
    FIELD_NAMES,
    FLOAT_FIELDS,
    INT_FIELDS,
    NON_NEGATIVE,
    RELEASE_REASONS,
    SCHEMA_VERSION,
    STATUSES,
)
from kvdiag.schema.verdicts import TrimReason, Verdict

if TYPE_CHECKING:
    import duckdb
    import pyarrow as pa

# One column per line: the delimiter is the byte 0x01 (chr(1); the text '\x01' in SQL would be a four-character
# delimiter, and a line holding that text would be cut there), which a file read this way does not hold.
CSV_LINES: Final = ("columns = {'line': 'VARCHAR'}, header = false, delim = chr(1), quote = '', escape = '', "
                    f"strict_mode = false, auto_detect = false, max_line_size = {4 * MAX_LINE_CHARS}")
# rg's "N<0x01>line" output: the number and the line as two columns (strict: a line holding 0x01 is an error, and
# Python reads the file instead; an empty line is NULL)
CSV_NUMBERED_LINES: Final = ("columns = {'n': 'BIGINT', 'line': 'VARCHAR'}, header = false, delim = chr(1), "
                             "quote = '', escape = '', strict_mode = true, auto_detect = false, "
                             f"max_line_size = {4 * MAX_LINE_CHARS}")
_WS: Final = "' \t\r\n\x0b\x0c'"  # what Python's str.strip() removes from a JSON line (ASCII)


def sql_str(text: str) -> str:
    """A SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def _in(values: Iterable[str]) -> str:
    return ", ".join(sql_str(v) for v in sorted(set(values)))


def create_line_tables(con: duckdb.DuckDBPyConnection) -> None:
    """One lines table per format: lines_json (events and statistics), lines_proxy, lines_vllm."""
    for name in ("lines_json", "lines_proxy", "lines_vllm"):
        con.execute(f"CREATE TEMP TABLE {name} (f INTEGER, n BIGINT, line VARCHAR)")
    con.execute("CREATE TEMP TABLE notes (f INTEGER, n BIGINT, what VARCHAR)")


def read_lines_sql(table: str, f: int, path: str) -> str:
    """INSERT every line of a plain file (no carriage return: DuckDB splits lines at a lone CR too)."""
    return (f"INSERT INTO {table} SELECT {f}, row_number() OVER (), line "
            f"FROM read_csv({sql_str(path)}, {CSV_LINES})")


def decoded_lines(f: int, numbered: Iterable[tuple[int, bytes | str]], stats: LineStats, path: str,
                  *, json: bool = False) -> tuple[list[int], list[str], list[tuple[int, int, str]]]:
    """Lines read by Python as (line numbers, texts), and the notes for lines that are not valid UTF-8 (or
    are oversized): those are kept, decoded with replacement characters, as the parsers keep them;
    a JSON line among them is corrupt (``json`` drops it)."""
    ns: list[int] = []
    texts: list[str] = []
    notes: list[tuple[int, int, str]] = []
    why = "not a JSON object" if json else "invalid UTF-8 or oversized line"
    for lineno, raw in numbered:
        text, ok = decode_line(raw)
        if not ok:
            stats.corrupt += 1
            stats.note(path, lineno, why)
            notes.append((f, lineno, why))
            if json:
                continue
        ns.append(lineno)
        texts.append(text.rstrip("\n"))
    return ns, texts, notes


def lines_arrow(f: int, numbered: Iterable[tuple[int, bytes | str]], stats: LineStats, path: str,
                *, json: bool = False) -> tuple[pa.Table, list[tuple[int, int, str]]]:
    """decoded_lines as a lines table (f, n, line), and the notes."""
    ns, texts, notes = decoded_lines(f, numbered, stats, path, json=json)
    import pyarrow as pa  # noqa: PLC0415  (not at import: one conversation's few lines never need it)

    schema = pa.schema([("f", pa.int32()), ("n", pa.int64()), ("line", pa.string())])
    table = pa.table({"f": pa.array([f] * len(ns), pa.int32()), "n": pa.array(ns, pa.int64()),
                      "line": pa.array(texts, pa.string())}, schema=schema)
    return table, notes


# ---------------------------------------------------------------------------------------------
# JSON: TurnEvents and client statistics.

def _event_type(name: str) -> str:
    if name in INT_FIELDS:
        return "BIGINT"
    if name in FLOAT_FIELDS:
        return "DOUBLE"
    return "JSON" if name == "attrs" else "VARCHAR"


EVENT_FIELDS: Final = tuple(n for n in FIELD_NAMES if n != "attrs")
_STAT_KEYS: Final = ("conversation_id", "ttft_ms", "latency_ms", "start_time_ms", "input_num_turns",
                     "input_num_tokens", "output_num_tokens", "turn", "request_id")
_STAT_SCHEMA: Final = "{" + ", ".join(f'"{k}": "JSON"' for k in _STAT_KEYS) + "}"
# what ev carries besides the event fields (the attrs' fields the rules read are typed apart)
_EV_EXTRA: Final = {"sub": "INTEGER", "text": "VARCHAR", "cconv": "VARCHAR", "attr_bidir": "BOOLEAN",
                    "attr_block_size": "BIGINT", "attr_ttl": "DOUBLE"}
# fields every vouched-for event has (the required keys) or ev_t keeps whatever the lines hold (cconv's source)
_EV_ALWAYS: Final = ("v", "ts", "source", "event", "conversation_id")


def ev_column_type(name: str) -> str:
    """The SQL type of a column of ev."""
    return _EV_EXTRA.get(name) or _event_type(name)


def _event_ok(fields: Collection[str]) -> str:
    """event_from_dict's rules, on the typed values (DuckDB coerces a quoted number; docs/design.md); a field
    no line has is NULL everywhere, which every rule but the required ones lets pass."""
    checks = [f"j.v = {SCHEMA_VERSION}", "j.ts IS NOT NULL", "j.source IS NOT NULL", "j.event IS NOT NULL",
              # (per source, not the pair's text: an IN over many strings is a join)
              "CASE j.source " + " ".join(f"WHEN {sql_str(src)} THEN j.event IN ({_in(evs)})"
                                         for src, evs in EVENTS_BY_SOURCE.items()) + " ELSE false END",
              "isfinite(j.ts)"]
    for col, values in (("outcome", (v.value for v in Verdict)), ("status", STATUSES),
                        ("trim_reason", (r.value for r in TrimReason)), ("release_reason", RELEASE_REASONS)):
        checks += [f"coalesce(j.{col} IN ({_in(values)}), true)"] if col in fields else []
    checks += ["coalesce(j.turn >= 1, true)"] if "turn" in fields else []
    checks += ["coalesce(json_type(j.attrs) = 'OBJECT', true)"] if "attrs" in fields else []
    checks += [f"coalesce(j.{c} >= 0, true)" for c in sorted(NON_NEGATIVE) if c in fields and c != "v"]
    checks += [f"coalesce(isfinite(j.{c}), true)" for c in sorted(FLOAT_FIELDS) if c != "ts" and c in fields]
    return " AND ".join(checks)


def _num(key: str) -> str:
    # json_logs._num: a JSON number (never a bool or a string). A value's JSON text is a number's unless it opens
    # a string, bool, object or array (null is NULL), and a number's text casts as DuckDB's JSON cast reads it:
    # json_type and the JSON cast parse the value twice more
    return (f"CASE WHEN left(s.{key}, 1) NOT IN ('\"', 't', 'f', '{{', '[') "
            f"THEN CAST(s.{key}::VARCHAR AS DOUBLE) END")


def _int(key: str) -> str:
    # json_logs._int: int(float(x)), which truncates; NULL where no 64-bit integer holds it (or it is not finite)
    return f"TRY_CAST(trunc({_num(key)}) AS BIGINT)"


def _json_str(col: str) -> str:
    # a JSON string's value: its text between the quotes unless the text escapes a character (->> parses it again)
    return f"CASE WHEN contains({col}, chr(92)) THEN {col} ->> '$' ELSE substr({col}, 2, length({col}) - 2) END"


def _trimmed(col: str) -> str:
    # str.strip() of a JSON line: only lines that do not start with "{" and end with "}" pay for it
    return f"CASE WHEN starts_with({col}, '{{') AND ends_with({col}, '}}') THEN {col} ELSE trim({col}, {_WS}) END"


# A line's trailing CR (a CRLF file read by Python keeps it): only such lines pay for the trim.
_RTRIM_CR: Final = "CASE WHEN ends_with({0}, chr(13)) THEN rtrim({0}, chr(13)) ELSE {0} END"
_RTRIM_EOL: Final = ("CASE WHEN ends_with(line, chr(13)) OR ends_with(line, chr(10)) "
                     "THEN rtrim(line, chr(13) || chr(10)) ELSE line END")


# (in parentheses: "NOT a OR NOT <this>" would otherwise read as "NOT a OR (NOT x AND y AND z)")
_HAS_EVENT_KEYS: Final = "(list_contains({0}, 'v') AND list_contains({0}, 'source') AND list_contains({0}, 'event'))"
_STAT_COLUMNS: Final = f"""NULL::VARCHAR AS text,
              CASE WHEN left(s.conversation_id, 1) = '"' THEN {_json_str('s.conversation_id')}
                   ELSE CAST(s.conversation_id AS VARCHAR) END AS conversation_id,
              {_num('ttft_ms')} AS ttft_ms, {_num('latency_ms')} AS latency_ms,
              {_num('start_time_ms')} AS start_time_ms, {_int('input_num_turns')} AS input_num_turns,
              {_int('input_num_tokens')} AS input_num_tokens, {_int('output_num_tokens')} AS output_num_tokens,
              CASE WHEN {_int('turn')} >= 1 THEN {_int('turn')} END AS turn,
              CASE WHEN left(s.request_id, 1) = '"' THEN {_json_str('s.request_id')} END AS request_id, 0 AS sub"""
_STAT_ROW: Final = "(left(s.conversation_id, 1) = '\"' OR json_type(s.conversation_id) IN ('BIGINT', 'UBIGINT'))"
_LINES: Final = f"(SELECT f, n, {_trimmed('line')} AS t FROM lines_json WHERE line IS NOT NULL) WHERE t <> ''"


def parse_json_sql(*, stats: bool = True) -> list[str]:
    """Statements: each JSON line's key list (``jl``: its hash ``k``, NULL for a line that is no JSON object) and
    the key lists themselves (``jk``, one row each). With ``stats`` (some input is a client statistics file) a
    line whose keys are no event's is typed as a statistic in the same pass. Then ``parse_events_sql``."""
    # (a key list is kept as its 64-bit hash: a list or its JSON text per line costs as much as the parse; a
    # NULL hash is a line that is no JSON object (TRY), one json_logs must read)
    if stats:
        # (a stock run's lines are mostly statistics: they never meet the event schema nor carry its columns)
        # (one parse per statistic: only a line whose text names "v", "source" and "event" (or escapes a
        # character) can have an event's keys, and only it pays for its key list; another object's key list is
        # never read, its k is 0, and a line no object (from_json fails as json_keys does) has none)
        jl = f"""CREATE TEMP TABLE jl AS SELECT f, n, CASE WHEN kl IS NOT NULL THEN hash(kl)
              WHEN NOT maybe AND s IS NOT NULL THEN 0::UBIGINT END AS k, s
            FROM (SELECT f, n, maybe, kl, CASE WHEN starts_with(t, '{{') AND (NOT maybe OR NOT
                      {_HAS_EVENT_KEYS.format('kl')}) THEN TRY(from_json(t, '{_STAT_SCHEMA}')) END AS s
                  FROM (SELECT f, n, t, maybe, CASE WHEN maybe AND starts_with(t, '{{') THEN TRY(json_keys(t)) END AS kl
                        FROM (SELECT f, n, t, contains(t, chr(92)) OR (contains(t, '"v"') AND contains(t, '"source"')
                                AND contains(t, '"event"')) AS maybe FROM {_LINES})))"""
    else:  # (the hash of the list in one TRY: a list column in between costs a third more)
        jl = f"""CREATE TEMP TABLE jl AS SELECT f, n,
              CASE WHEN starts_with(t, '{{') THEN TRY(hash(json_keys(t))) END AS k FROM {_LINES}"""
    return [
        jl,
        # the key lists are few: each is checked once, on the first line that has it
        f"""CREATE TEMP TABLE jk AS SELECT k, kl, {_HAS_EVENT_KEYS.format('kl')} AS is_event,
              list_has_all([{_in(FIELD_NAMES)}], kl) AS known
            FROM (SELECT r.k, json_keys({_trimmed('l.line')}) AS kl FROM (SELECT k, min((f::BIGINT << 40) + n) AS ref
                  FROM jl WHERE k IS NOT NULL GROUP BY k) r
                  JOIN lines_json l ON l.f = (r.ref >> 40)::INTEGER AND l.n = r.ref & ((1::BIGINT << 40) - 1))""",
    ]


def event_fields(con: duckdb.DuckDBPyConnection) -> list[str]:
    """The event fields some vouched-for event line (keys in ``jk``) has, in the schema's order."""
    have = {k for (k,) in con.execute("SELECT DISTINCT unnest(kl) FROM jk WHERE is_event AND known").fetchall()}
    return [c for c in FIELD_NAMES if c in have or c in _EV_ALWAYS]


def _event_value(name: str) -> str:
    """An event field's value from its JSON text ``r.<name>`` (as DuckDB writes a parsed value back: a string
    quoted, a number with "." or "e" where it has a fraction or exponent), typed as event_from_dict types it:
    NULL where the value is of another JSON type (which makes the line json_logs' to read)."""
    x = f"r.{name}::VARCHAR"
    if name in INT_FIELDS:  # (an integer no 64-bit word holds fails the cast)
        return (f"CASE WHEN strpos({x}, '.') = 0 AND strpos({x}, 'e') = 0 AND strpos({x}, 'E') = 0 "
                f"THEN TRY_CAST({x} AS BIGINT) END")
    if name in FLOAT_FIELDS:
        return f"CASE WHEN left({x}, 1) NOT IN ('\"', 't', 'f', '{{', '[') THEN TRY_CAST({x} AS DOUBLE) END"
    return f"CASE WHEN left({x}, 1) = '\"' THEN {_json_str(x)} END"


def parse_events_sql(fields: Collection[str], *, stats: bool = True) -> list[str]:
    """Statements (after parse_json_sql): ``ev`` (a view of ``ev_t``, which holds the columns of ``fields``, the
    ones some line has: the others are NULL in every row), ``cs`` from lines_json, and ``json_odd``: the lines
    json_logs must read. Only the lines of an event's known key list are typed as events."""
    # (every field read as its JSON text in one parse, then typed: from_json's own typing would read "5" or true
    # as an integer and 7 or ["x"] as a string, where json_logs counts the line corrupt and names the field)
    schema = "{" + ", ".join(f'"{c}": "JSON"' for c in FIELD_NAMES if c in fields) + "}"
    attrs = ("""CASE WHEN json_type(j.attrs, '$.bidirectional_kv_xfer') = 'BOOLEAN'
                   THEN CAST(j.attrs ->> '$.bidirectional_kv_xfer' AS BOOLEAN) END AS attr_bidir,
              CASE WHEN json_type(j.attrs, '$.block_size') IN ('BIGINT', 'UBIGINT')
                   THEN TRY_CAST(j.attrs ->> '$.block_size' AS BIGINT) END AS attr_block_size,
              CASE WHEN json_type(j.attrs, '$.decoder_kv_blocks_ttl') IN ('BIGINT', 'UBIGINT', 'DOUBLE')
                   THEN TRY_CAST(j.attrs ->> '$.decoder_kv_blocks_ttl' AS DOUBLE) END AS attr_ttl,"""
             if "attrs" in fields else "")
    typed_fields = [c for c in EVENT_FIELDS if c in fields]
    typed = ", ".join(f"j.{c} AS {c}" for c in typed_fields)
    values = ", ".join(f"{_event_value(c)} AS {c}" for c in typed_fields)
    # a value of the wrong JSON type: present (JSON null is no value), yet no typed value
    wrong = " OR ".join(f"(r.{c} IS NOT NULL AND {_event_value(c)} IS NULL)" for c in typed_fields) or "false"
    if stats:
        stat_rows = f"SELECT f, n, {_STAT_COLUMNS} FROM jl WHERE {_STAT_ROW}"
    else:
        # (the CASE on the joined side keeps the parse after the join: the filter on its result was pushed below
        # it, onto every line)
        stat_rows = f"""SELECT f, n, {_STAT_COLUMNS}
            FROM (SELECT l.f, l.n, from_json(CASE WHEN NOT jk.is_event THEN {_trimmed('l.line')} END, '{_STAT_SCHEMA}')
                    AS s FROM lines_json l JOIN jl USING (f, n) JOIN jk USING (k) WHERE NOT jk.is_event)
            WHERE {_STAT_ROW}"""
    return [
        # the events' lines typed, the schema narrowed to the fields some line has (the CASE on the joined side
        # keeps the parse after the join)
        f"""CREATE TEMP TABLE ev_t AS SELECT f, n, NULL::VARCHAR AS text, {typed}, j.conversation_id AS cconv,
              {attrs} NOT j.wrong AND {_event_ok(fields)} AS ok
            FROM (SELECT f, n, {values}{', r.attrs AS attrs' if 'attrs' in fields else ''}, {wrong} AS wrong
                  FROM (SELECT l.f, l.n, from_json(CASE WHEN jk.known THEN {_trimmed('l.line')} END, '{schema}') AS r
                        FROM lines_json l JOIN jl USING (f, n) JOIN jk USING (k) WHERE jk.is_event AND jk.known)) j""",
        # everything else json_logs reads itself: the lines that are no JSON object, the events with a key the
        # schema does not know and those the checks reject (the few such lines are looked up, not the many good
        # ones anti-joined)
        """CREATE TEMP TABLE json_odd AS SELECT l.f, l.n, l.line FROM lines_json l JOIN (
              SELECT f, n FROM jl WHERE k IS NULL
              UNION ALL SELECT f, n FROM jl JOIN jk USING (k) WHERE jk.is_event AND NOT jk.known
              UNION ALL SELECT f, n FROM ev_t WHERE NOT ok) b USING (f, n)""",
        # the other objects' lines as client statistics
        f"CREATE TEMP TABLE cs AS {stat_rows}",
        # what stays is the events the checks vouch for (a NULL check keeps its row, as before)
        "DELETE FROM ev_t WHERE NOT ok",
        "ALTER TABLE ev_t DROP COLUMN ok",
        "DROP TABLE jl",
        ev_view_sql([*fields, "text", "cconv", *(("attr_bidir", "attr_block_size", "attr_ttl") if "attrs" in fields
                                                 else ())]),
    ]


# ``sub``: an event's place among those of a line json_logs read as a JSON array (0 for every other event)
# An event's place in an order as one number: ``{order}`` (a BIGINT) then ``{sub}``; where the order's low 54
# bits are the event's line ref, ``EVENT_ORDER_LINE`` gives the ref back.
EVENT_ORDER: Final = "((({order})::HUGEINT << 32) + {sub})"
EVENT_ORDER_BASE: Final = "(({x}) >> 32)::BIGINT"  # the ``{order}`` of an EVENT_ORDER value
EVENT_ORDER_LINE: Final = EVENT_ORDER_BASE + " & ((1::BIGINT << 54) - 1)"
EV_ROW_COLUMNS: Final = ("f", "n", "sub", "text", *EVENT_FIELDS, "cconv", "attr_bidir", "attr_block_size", "attr_ttl")


def ev_view_sql(columns: Collection[str]) -> str:
    """``ev``: every column of EV_ROW_COLUMNS, from ``ev_t``'s ``columns`` (the others NULL)."""
    return "CREATE OR REPLACE TEMP VIEW ev AS SELECT " + ", ".join(
        c if c in columns or c in ("f", "n") else "0 AS sub" if c == "sub" else f"NULL::{ev_column_type(c)} AS {c}"
        for c in EV_ROW_COLUMNS) + " FROM ev_t"


CS_ROW_COLUMNS: Final = ("f", "n", "text", "conversation_id", "ttft_ms", "latency_ms", "start_time_ms",
                         "input_num_turns", "input_num_tokens", "output_num_tokens", "turn", "request_id", "sub")


# ---------------------------------------------------------------------------------------------
# The proxy log (engine_proxy) and the patterns' reading, which the vLLM statements share.


def parse_proxy_sql(lines: Iterable[str] | None = None, *, all_ascii: bool = False, cr: bool = True,
                    merged: bool = False) -> list[str]:
    """Statements: ``pl`` from lines_proxy (engine_proxy.parse_proxy_sql); ``lines``: every line of lines_proxy,
    when they are few (only the classifiers one of them can match are compiled, in their ASCII forms where every
    line is ASCII). Without ``lines``: ``all_ascii``, every line of lines_proxy is ASCII; ``cr``, a line may end
    with a carriage return. ``merged``: lines_proxy holds several proxy logs."""
    from kvdiag.diagnostics import engine_proxy  # noqa: PLC0415  (it reads this module's helpers)

    if lines is None:
        return engine_proxy.parse_proxy_sql(all_ascii=all_ascii, cr=cr, merged=merged)
    texts = list(lines)
    return engine_proxy.parse_proxy_sql(engine_proxy.kinds_present(texts), all_ascii=all(t.isascii() for t in texts),
                                        cr=any(t.endswith("\r") for t in texts), merged=merged)


# What Python's \s reads in a str pattern (str.isspace: the ASCII separators \x1c-\x1f and \v too), in RE2's
# syntax; RE2's own \s is [\t\n\f\r ] alone
PY_SPACE: Final = ("\\t-\\r\\x1c-\\x20\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}"
                   "\\x{205f}\\x{3000}")
PY_ASCII_SPACE: Final = "\\t-\\r\\x1c-\\x20"
# Python's class escapes as RE2 reads them: (outside a class, inside one); None where RE2 has no way
_UNICODE_CLASSES: Final = {
    "\\w": ("[\\pL\\pN_]", "\\pL\\pN_"), "\\W": ("[^\\pL\\pN_]", None),
    "\\d": ("\\p{Nd}", "\\p{Nd}"), "\\D": ("\\P{Nd}", "\\P{Nd}"),
    "\\s": (f"[{PY_SPACE}]", PY_SPACE), "\\S": (f"[^{PY_SPACE}]", None),
    "\\b": (None, None), "\\B": (None, None),
}
# on ASCII text RE2's \w, \d and their negations are Python's; \s and \S are not (\v, \x1c-\x1f)
_ASCII_CLASSES: Final = {"\\s": (f"[{PY_ASCII_SPACE}]", PY_ASCII_SPACE), "\\S": (f"[^{PY_ASCII_SPACE}]", None),
                         "\\b": (None, None), "\\B": (None, None)}


def _re2(pattern: re.Pattern[str]) -> str:
    """A Python pattern as RE2 reads it the same way on any text: ``\\w``, ``\\d``, ``\\s`` and their negations
    made Unicode-aware as Python's are (RE2's are ASCII)."""
    return _translated(pattern, _UNICODE_CLASSES)


def ascii_form(pattern: re.Pattern[str]) -> str:
    """A Python pattern as RE2 reads it the same way on ASCII text (faster than :func:`_re2`'s form)."""
    return _translated(pattern, _ASCII_CLASSES)


def _translated(pattern: re.Pattern[str], classes: dict[str, tuple[str | None, str | None]]) -> str:
    out, in_class, i, src = [], False, 0, pattern.pattern
    while i < len(src):
        ch = src[i]
        if ch == "\\" and i + 1 < len(src):
            pair = src[i:i + 2]
            if pair in classes:
                form = classes[pair][1 if in_class else 0]
                if form is None:
                    raise ValueError(f"pattern {pattern.pattern!r}: RE2 cannot read {pair} as Python does here")
                out.append(form)
            else:
                out.append(pair)
            i += 2
            continue
        if ch == "[" and not in_class:
            in_class = True
        elif ch == "]" and in_class and out and out[-1] != "[":
            in_class = False
        out.append(ch)
        i += 1
    return ("(?s)" if pattern.flags & re.DOTALL else "") + "".join(out)


ASCII: Final = "strlen({0}) = length({0})"  # bytes = characters: the text is ASCII


def _rx(fn: str, col: str, regex: re.Pattern[str], *args: str, ascii_flag: str | None = None,
        ascii_branch: bool = True) -> str:
    """``fn(col, pattern, args...)`` for a Python pattern, read by RE2 as Python reads it. An ASCII text takes
    its ASCII form (``ascii_form``: on ASCII, RE2's ``\\w`` and ``\\d`` are Python's, and several times faster
    than the Unicode classes); any other text its Unicode-aware form (``_re2``). ``ascii_flag``: a
    column that already says whether ``col`` is ASCII; without ``ascii_branch`` every text takes the
    Unicode-aware form (one pattern to compile instead of two)."""
    rest = "".join(f", {a}" for a in args)
    uni = f"{fn}({col}, {sql_str(_re2(regex))}{rest})"
    ascii_pattern = ascii_form(regex)
    if not ascii_branch or ascii_pattern == _re2(regex):
        return uni
    flag = ascii_flag or ASCII.format(col)
    return f"CASE WHEN {flag} THEN {fn}({col}, {sql_str(ascii_pattern)}{rest}) ELSE {uni} END"


def _vllm_rx(fn: str, col: str, regex: re.Pattern[str], *args: str, ascii_flag: str | None = None,
             ascii_branch: bool = True, all_ascii: bool = False) -> str:
    """_rx for the vLLM statements; with ``all_ascii`` (every line read is ASCII) the pattern as written alone (no
    Unicode-aware form to compile, no test per line)."""
    if not all_ascii:
        return _rx(fn, col, regex, *args, ascii_flag=ascii_flag, ascii_branch=ascii_branch)
    rest = "".join(f", {a}" for a in args)
    return f"{fn}({col}, {sql_str(('(?s)' if regex.flags & re.DOTALL else '') + regex.pattern)}{rest})"


def _in_ordered(values: list[str]) -> str:
    return ", ".join(sql_str(v) for v in values)


def _group_list(regex: re.Pattern[str]) -> str:
    """regexp_extract's list of names for the pattern's groups, in order (g1, g2, ...)."""
    return "[" + _in_ordered([f"g{g}" for g in range(1, regex.groups + 1)]) + "]"


# ---------------------------------------------------------------------------------------------
# vLLM logs.

# What the rules read from each kind, by the pattern's groups (vllm_log's converters' fields).
_I = "TRY_CAST(nullif(x.g{}, '') AS BIGINT)"
_S = "nullif(x.g{}, '')"
_VLLM_FIELDS: Final[dict[str, dict[str, str]]] = {
    "bidir_enabled": {"threshold": _I.format(1), "ttl_s": _I.format(2)},
    "declining_expired": {"request_id": _S.format(1)},
    "releasing_expired": {"request_id": _S.format(1)},
    "invalid_unrecognized": {"request_id": _S.format(1)},
    "nixl_failure": {"failure_type": _S.format(1),
                     "ctx_request_id": "nullif(regexp_extract(x.g3, '''request_id'': ''([^'']*)''', 1), '')",
                     "ctx_remote_request_id":
                         "nullif(regexp_extract(x.g3, '''remote_request_id'': ''([^'']*)''', 1), '')"},
    "kv_load_failed": {"request_ids": "CASE WHEN len(regexp_extract_all(x.g4, '''([^'']+)''', 1)) > 0 "
                                      "THEN regexp_extract_all(x.g4, '''([^'']+)''', 1) ELSE regexp_extract_all("
                                      f"x.g4, {sql_str(_re2(vllm_log.IDS_IN_TEXT_RE))}) END"},
    "kv_load_recovered": {},
    "skip_post_processing": {"request_id": _S.format(1)},
    "skip_remote_pull": {"request_id": _S.format(1), "remote_tokens": _I.format(2), "threshold": _I.format(3)},
    "matched_tokens": {},
    "start_load_kv": {"request_id": _S.format(1), "local_blocks": _I.format(3), "remote_blocks": _I.format(4)},
    "read_blocks": {"block_size": _I.format(2), "request_id": _S.format(3)},
    "finished_recving": {"request_id": _S.format(1)},
    "finished_sending": {"request_id": _S.format(1)},
    "request_finished_wait": {"request_id": _S.format(1)},
    "request_finished_status": {"request_id": _S.format(1)},
    "waiting_remote_kvs": {"request_id": _S.format(1)},
    "invalid_params": {
        "remote_request_id": "nullif(regexp_extract(x.g1, '''remote_request_id'': ''([^'']*)''', 1), '')"},
    "no_connector": {},
    "received_request": {"request_id": _S.format(1)},
    "generated_response": {"request_id": _S.format(1), "finish_reason": _S.format(2)},
    "added_request": {"request_id": _S.format(1)},
    "request_failed": {"request_id": _S.format(1)},
}
VLLM_COLUMNS: Final = {"request_id": "VARCHAR", "request_ids": "VARCHAR[]", "failure_type": "VARCHAR",
                        "ctx_request_id": "VARCHAR", "ctx_remote_request_id": "VARCHAR", "threshold": "BIGINT",
                        "ttl_s": "BIGINT", "remote_tokens": "BIGINT", "local_blocks": "BIGINT",
                        "remote_blocks": "BIGINT", "block_size": "BIGINT", "finish_reason": "VARCHAR",
                        "remote_request_id": "VARCHAR", "why": "VARCHAR"}
VL_COLUMNS: Final = ("f", "n", "text", "level", "ts", "kind", *VLLM_COLUMNS)
# vllm_log.VllmRecord.text: the record's first line as the operator would grep it (no colours, no prefix)
# (uncut: VLLM_LINE; one concat, not a chain of ||, which copies the growing string at each step; the CASE keeps
# ||'s NULL)
VLLM_LINE_OK: Final = ("h.level IS NOT NULL AND h.ts IS NOT NULL AND h.fileinfo IS NOT NULL AND h.msg IS NOT NULL "
                       "AND (h.pid IS NOT NULL OR coalesce(h.proc, '') = '')")  # (VLLM_LINE is not NULL)
VLLM_LINE: Final = (f"CASE WHEN {VLLM_LINE_OK} "
                    "THEN concat(CASE WHEN h.proc <> '' THEN concat('(', h.proc, ' pid=', h.pid, ') ') END, "
                    "h.level, ' ', h.ts, ' [', h.fileinfo, '] ', h.msg) END")
VLLM_TEXT: Final = f"left({VLLM_LINE}, 500)"


def kind_case(named: Iterable[tuple[int, str]], kinds: Iterable[str]) -> str:
    """The kind column from a classifier's number ``k``: each (number, kind) of ``named``, as an ENUM of every kind
    of ``kinds``, so the later statements' many tests of a line's kind compare integers, not strings (a test
    against a name outside it is false, as for a string)."""
    whens = " ".join(f"WHEN {i} THEN '{kind}'" for i, kind in named)
    return f"CASE k {whens} END::ENUM({', '.join(sql_str(k) for k in dict.fromkeys(kinds))})"


def _classifiers() -> list[tuple[int, str, vllm_log.DeferredPattern, str | None]]:
    """(index, kind, pattern, first word or None) in the order classify_message tries them."""
    by_word = [(i, k, p, vllm_log._first_word(p.pattern)) for i, (k, p, _c) in enumerate(vllm_log._CLASSIFIERS)]
    return [c for c in by_word if c[3] is not None] + [c for c in by_word if c[3] is None]


def _field(i: int, kind: str, regex: re.Pattern[str], col: str) -> str | None:
    """The SQL for field ``col`` of classifier ``i`` (two patterns each say request_failed and aborted)."""
    if kind == "request_failed" and col == "why":
        if "internal error" in regex.pattern:
            return "'internal error, HTTP 500'"
        return "coalesce(nullif(x.g2, ''), 'error')"
    if kind == "aborted" and col == "request_ids":
        if regex.pattern.startswith("^Aborted"):
            # (the parser splits at Python's \s: PY_SPACE)
            return (f"list_filter(list_transform(regexp_split_to_array(x.g1, '[,{PY_SPACE}]+'), "
                    "lambda s: trim(s, ' ''\"[]{}')), lambda s: s <> '')")
        return "[x.g1]"
    return _VLLM_FIELDS.get(kind, {}).get(col)


# The first group of the common vLLM kinds is cut out of the whole match by position: RE2 finds a match's
# bounds several times faster than its groups. The kind's pattern is "^literal(group)..." and the group ends
# where the match's last literal starts (when the group is last) or at the first character after it (a literal
# its class excludes).
_CUT_BODIES: Final = ("[\\w.:-]+", "\\d+", "\\w+", "[\\w]+", ".*")
_META: Final = "\\^$.|?*+()[]{}"


def _literal(src: str) -> str | None:
    """The text a pattern without metacharacters matches (escaped punctuation as itself), or None."""
    out, i = [], 0
    while i < len(src):
        if src[i] == "\\" and i + 1 < len(src) and not src[i + 1].isalnum():
            out.append(src[i + 1])
            i += 2
        elif src[i] in _META:
            return None
        else:
            out.append(src[i])
            i += 1
    return "".join(out)


def _first_group_cut(regex: re.Pattern[str], col: str, text: str) -> str | None:
    """The pattern's first group in ``col`` (the whole match, which starts ``text``) by position, or None when its
    shape allows none. The group is cut from ``text``, a stored column: DuckDB cuts a column it knows to be ASCII
    by byte position, and counts a computed string's characters from its start."""
    m = re.fullmatch(r"\^((?:\\[^A-Za-z0-9]|[^\\^$.|?*+()\[\]{}])+)\(([^()]*)\)(.*)", regex.pattern, re.DOTALL)
    if m is None or m.group(2) not in _CUT_BODIES:
        return None
    start = len(_literal(m.group(1)) or "") + 1
    rest = m.group(3)[:-1] if m.group(3).endswith("$") and not m.group(3).endswith("\\$") else m.group(3)
    tail = _literal(rest)
    if tail is not None:  # the group is the last: it ends where the match's final literal starts
        return f"substr({text}, {start}, length({col}) - {start - 1 + len(tail)})"
    after = _literal(rest[:2] if rest.startswith("\\") else rest[:1])
    if (not after or rest[len(after) + rest.startswith("\\"):][:1] in ("?", "*", "+", "{")
            or m.group(2) == ".*" or re.fullmatch(m.group(2)[:-1], after)):
        return None
    # (the first `after` past the group is the match's: the group's characters cannot spell it)
    return f"substr({text}, {start}, strpos(substr({text}, {start}), {sql_str(after)}) - 1)"


_REST: Final = "(.*)$"


def rest_prefix(regex: re.Pattern[str]) -> re.Pattern[str] | None:
    """The pattern without its last group when that group is ``(.*)$`` over the whole text (DOTALL), the group
    numbers as they were: the rest always matches, so the whole pattern matches where this prefix does, and the
    group is the text after the prefix's match. None for any other shape (or a prefix whose match could end
    differently on the text cut after it: an end anchor or a word boundary)."""
    src = regex.pattern
    if not (regex.flags & re.DOTALL and src.endswith(_REST) and not src.endswith("\\" + _REST)):
        return None
    prefix = re.compile(src[:-len(_REST)], regex.flags)
    if prefix.groups != regex.groups - 1 or re.search(r"\\[bBzZA]|\$", prefix.pattern):
        return None
    return prefix


# vLLM's own header shape (HEADER_RE without VLLM_LOGGING_PREFIX), which vl_head cuts by position
STD_HEADER_RE: Final = re.compile(r"^(?:\([\w.-]+ pid=\d+\) )?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) +"
                                  r"\d\d-\d\d \d\d:\d\d:\d\d \[[^\]]{1,300}:\d+\]")


HEADER_GROUPS: Final = "['proc', 'pid', 'prefix', 'lvl', 'ts', 'file', 'line', 'msg']"


# a message's first word (up to a space or "("), as classify reads it (one pattern: split_part splits the whole text)
VLLM_WORD: Final = "regexp_extract(msg, '^[^ (]*')"
# Below this many vLLM lines (one conversation's) a pattern's compile costs more than running it: the
# Unicode-aware patterns alone, no ASCII branch.
ASCII_BRANCH_MIN_LINES: Final = 5000


def parse_vllm_sql(words: Collection[str] | None = None, *, ascii_branch: bool = True,
                   all_ascii: bool = False) -> list[str]:
    """Statements: ``vl`` from lines_vllm: the header, the message's kind and the fields the rules read.

    Each line is read alone (a traceback or a CR-continued line is not folded into the record before it,
    as vllm_log's parser folds them): a record is its first line. ``words``: the messages' first words
    (VLLM_WORD over vl_head), when known: classifiers of other words cannot match and are left out. ``all_ascii``:
    every line in lines_vllm is ASCII (each pattern is then taken as written)."""
    return [*vllm_head_sql(ascii_branch=ascii_branch, all_ascii=all_ascii),
            vllm_records_sql(words, ascii_branch=ascii_branch, all_ascii=all_ascii)]


def vllm_head_sql(*, ascii_branch: bool = True, all_ascii: bool = False) -> list[str]:
    """Statements: ``vl_clean`` (lines with a vLLM header, colours removed) and ``vl_head`` (the header's parts,
    the message and its first word ``w``: VLLM_WORD, which the kinds' choice and the words present both read)."""
    clean, own_cut, full, others = _vllm_head_parts(ascii_branch=ascii_branch, all_ascii=all_ascii)
    return [f"{clean}\n            WHERE std OR {full}", f"{own_cut}{others})"]


def vllm_own_shape_sql(*, ascii_branch: bool = True, all_ascii: bool = False) -> list[str]:
    """vllm_head_sql's statements as if every line had vLLM's own header shape: ``vl_clean`` keeps every line,
    with ``std`` set where it has that shape, and ``vl_head`` cuts those alone (the full pattern is not in them)."""
    clean, own_cut, _full, _others = _vllm_head_parts(ascii_branch=ascii_branch, all_ascii=all_ascii)
    return [clean, f"{own_cut})"]


def vllm_head_few_lines(con: duckdb.DuckDBPyConnection, run_sql: Callable[[str], object], *, ascii_branch: bool,
                        all_ascii: bool) -> None:
    """``vl_clean`` and ``vl_head`` for a few lines (``run_sql`` runs a statement on ``con``): the full header
    pattern is compiled only if a line lacks vLLM's own header shape (16 ms of compiling otherwise)."""
    clean, own_head = vllm_own_shape_sql(ascii_branch=ascii_branch, all_ascii=all_ascii)
    run_sql(clean)
    if con.execute("SELECT bool_and(std) FROM vl_clean").fetchall()[0][0] is not False:
        run_sql(own_head)
        return
    _clean, own_cut, full, others = _vllm_head_parts(ascii_branch=ascii_branch, all_ascii=all_ascii)
    run_sql(f"DELETE FROM vl_clean WHERE NOT std AND NOT {full}")
    run_sql(f"{own_cut}{others})")


def _vllm_head_parts(*, ascii_branch: bool, all_ascii: bool) -> tuple[str, str, str, str]:
    """The pieces of vllm_head_sql's statements: ``vl_clean`` with ``std`` and no filter yet, ``vl_head``'s cut of
    vLLM's own shape (its parenthesis left open), the full header pattern's test, and ``vl_head``'s branch for the
    lines of any other shape."""
    def rx(fn: str, col: str, regex: re.Pattern[str], *args: str) -> str:
        return _vllm_rx(fn, col, regex, *args, ascii_branch=ascii_branch, all_ascii=all_ascii)

    ansi = sql_str(vllm_log.ANSI_RE.pattern)
    clean = f"""CREATE TEMP TABLE vl_clean AS SELECT f, n, t, std FROM (
              SELECT f, n, t, {rx('regexp_matches', 't', STD_HEADER_RE)} AS std FROM (
                SELECT f, n, CASE WHEN contains(t0, chr(27)) THEN regexp_replace(t0, {ansi}, '', 'g') ELSE t0 END AS t
                FROM (SELECT f, n, {_RTRIM_EOL} AS t0 FROM lines_vllm WHERE line IS NOT NULL))
              WHERE strlen(t) < {MAX_LINE_CHARS} OR length(t) < {MAX_LINE_CHARS})  -- bytes first: no count"""
    # vLLM's own shape: "(proc pid=N) LEVEL MM-DD HH:MM:SS [file:line] msg", cut by position: the header
    # check proved that the first "[" opens the file part (no earlier part has one), the first "]" closes it
    # (the file part has none), the time stamp is the 14 characters before " [" and the level ends at the
    # spaces before it; only the message is copied out of the line. Any other prefix (VLLM_LOGGING_PREFIX)
    # goes through the full pattern.
    own_cut = f"""CREATE TEMP TABLE vl_head AS SELECT *, {VLLM_WORD} AS w FROM (
            WITH s AS (SELECT f, n, t, starts_with(t, '(') AS has_proc, strpos(t, '[') AS b, strpos(t, ']') AS c
                       FROM vl_clean WHERE std),
            p AS (SELECT *, CASE WHEN has_proc THEN strpos(t, ' pid=') END AS q,
                    CASE WHEN has_proc THEN strpos(t, ') ') + 2 ELSE 1 END AS e FROM s)
            SELECT f, n, CASE WHEN has_proc THEN substr(t, 2, q - 2) ELSE '' END AS proc,
              CASE WHEN has_proc THEN substr(t, q + 5, e - q - 7) ELSE '' END AS pid,
              rtrim(substr(t, e, b - 15 - e)) AS level, substr(t, b - 15, 14) AS ts,
              substr(t, b + 1, c - b - 1) AS fileinfo,
              substr(t, CASE WHEN substr(t, c + 1, 1) = ' ' THEN c + 2 ELSE c + 1 END) AS msg
            FROM p"""
    others = f"""
            UNION ALL SELECT f, n, h.proc, h.pid, h.lvl, h.ts, h.file || ':' || h.line, h.msg
            FROM (SELECT f, n, {rx('regexp_extract', 't', vllm_log.HEADER_RE, HEADER_GROUPS)} AS h
                  FROM vl_clean WHERE NOT std)"""
    return clean, own_cut, rx("regexp_matches", "t", vllm_log.HEADER_RE), others


def vllm_records_sql(words: Collection[str] | None = None, *, ascii_branch: bool = True, fast: bool = True,
                     all_ascii: bool = False) -> str:
    """The statement that makes ``vl`` from vl_head (see parse_vllm_sql); without ``fast`` every kind is matched
    and its groups read by its whole pattern (no group cut by position: the forms the tests compare)."""
    classes = [(i, kind, regex.compiled, first) for i, kind, regex, first in _classifiers()
               if (kind in _VLLM_FIELDS or kind == "aborted") and (words is None or first is None or first in words)]

    def rx(fn: str, regex: re.Pattern[str], *args: str) -> str:
        return _vllm_rx(fn, "msg", regex, *args, ascii_flag="a", ascii_branch=ascii_branch, all_ascii=all_ascii)

    def rx_of(col: str, regex: re.Pattern[str], *args: str) -> str:  # col: a part of msg (ASCII where msg is)
        return _vllm_rx("regexp_extract", col, regex, *args, ascii_flag="a", ascii_branch=ascii_branch,
                        all_ascii=all_ascii)

    # the groups each kind's fields read; a kind whose fields read only its first group (and that has a first
    # word) gets its match ``m<i>``, and the group is cut out of it
    used = {i: {int(g) for col in VLLM_COLUMNS for g in re.findall(r"x\.g(\d+)", _field(i, kind, regex, col) or "")}
            for i, kind, regex, _first in classes}
    cuts = {i: cut for i, _kind, regex, first in classes if first is not None and used[i] <= {1}
            and (cut := _first_group_cut(regex, f"m{i}", "msg")) is not None} if fast else {}
    # a kind whose pattern ends in "(.*)$" is matched by its prefix alone (which RE2 stops at, instead of running
    # the rest to the end of the line): the last group is the text after that match, the others are read from it
    rests = {i: prefix for i, _kind, regex, first in classes if fast and first is not None and i not in cuts
             and used[i] and (prefix := rest_prefix(regex)) is not None}
    whens = []
    for i, _kind, regex, first in classes:
        if i in cuts or i in rests:
            whens.append(f"WHEN m{i} <> '' THEN {i}")
        else:
            cond = rx("regexp_matches", regex)
            whens.append(f"WHEN w = {sql_str(first)} AND {cond} THEN {i}" if first is not None
                         else f"WHEN {cond} THEN {i}")
    fields = []
    for col, ctype in VLLM_COLUMNS.items():
        picks = []
        for i, kind, regex, _first in classes:
            expr = _field(i, kind, regex, col)
            if expr is not None:
                picks.append(f"WHEN {i} THEN {expr.replace('x.', f'x{i}.')}")
        fields.append(f"CAST(CASE k {' '.join(picks)} END AS {ctype}) AS {col}" if picks
                      else f"CAST(NULL AS {ctype}) AS {col}")
    matches = "".join(f", CASE WHEN w = {sql_str(first)} THEN {rx('regexp_extract', rests.get(i, regex))} END AS m{i}"
                      for i, _kind, regex, first in classes if (i in cuts or i in rests) and first is not None)
    structs = ""
    for i, _kind, regex, _first in classes:
        if i in rests:
            head = "".join(f"g{g} := {rx_of(f'm{i}', rests[i], str(g))}, " for g in sorted(used[i] - {regex.groups}))
            groups = f"struct_pack({head}g{regex.groups} := substr(msg, length(m{i}) + 1))"
        elif i in cuts:
            groups = f"struct_pack(g1 := {cuts[i]})"
        elif used[i]:
            groups = rx("regexp_extract", regex, _group_list(regex))
        else:
            continue
        structs += f", CASE WHEN k = {i} THEN {groups} END AS x{i}"
    kind = f"CASE {' '.join(whens)} END" if whens else "NULL::INTEGER"
    kind_name = (kind_case(((i, k) for i, k, _r, _f in classes), (c[1] for c in _classifiers())) if classes
                 else "NULL::VARCHAR")
    ascii_col = f", {ASCII.format('msg')} AS a" if ascii_branch and not all_ascii else ""
    return f"""CREATE TEMP TABLE vl AS SELECT f, n,
              NULL::VARCHAR AS text, level, ts, {kind_name} AS kind, {', '.join(fields)}
            FROM (SELECT *{structs} FROM (SELECT *, {kind} AS k FROM (SELECT *{matches}
                  FROM (SELECT *{ascii_col} FROM vl_head))))"""
