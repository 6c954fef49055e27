"""JSON records Python reads into the engine's tables: the lines the SQL checks did not vouch for, and files that
are one JSON document (client statistics, or events spread over many lines), read whole."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvdiag.diagnostics.detect import LogReadError, open_binary
from kvdiag.diagnostics.engine_parse import CS_ROW_COLUMNS, EV_ROW_COLUMNS, EVENT_FIELDS, ev_column_type, ev_view_sql
from kvdiag.diagnostics.json_logs import (
    ClientStat,
    EventRecord,
    json_double,
    parse_event_document,
    parse_json_document,
    parse_json_numbered,
)
from kvdiag.diagnostics.linestats import LineStats
from kvdiag.schema.events import INT64_MAX, INT64_MIN

if TYPE_CHECKING:
    import duckdb

    from kvdiag.diagnostics.verdict_engine import Run


def read_odd_json(con: duckdb.DuckDBPyConnection, paths: dict[int, str], stats: LineStats) -> list[str]:
    """The JSON lines the SQL checks did not vouch for, read by json_logs: records go into ev / cs,
    corrupt lines into the counts and notes. Returns the event columns they set that no SQL-read line had."""
    odd = con.execute("SELECT f, n, line FROM json_odd ORDER BY f, n").fetchall()
    if not odd:
        return []
    events: list[tuple[object, ...]] = []
    stats_rows: list[tuple[object, ...]] = []
    by_file: dict[int, list[tuple[int, str]]] = {}
    for f, n, line in odd:
        by_file.setdefault(f, []).append((n, line))
    for f, numbered in by_file.items():
        record_rows(f, parse_json_numbered(numbered, paths[f], stats), events, stats_rows)
    _append_rows(con, "cs", CS_ROW_COLUMNS, stats_rows)
    return append_events(con, events)


def record_rows(f: int, records: Iterable[EventRecord | ClientStat], events: list[tuple[object, ...]],
                stats_rows: list[tuple[object, ...]]) -> None:
    """json_logs' records of file ``f`` as rows: events (EV_ROW_COLUMNS) and client statistics (CS_ROW_COLUMNS).
    Several records of one line (a JSON array on it) are told apart by ``sub``."""
    seen: dict[int, int] = {}
    for rec in records:
        sub = seen.get(rec.lineno, 0)
        seen[rec.lineno] = sub + 1
        if isinstance(rec, EventRecord):
            e = rec.event
            attrs = e.attrs
            bidir = attrs.get("bidirectional_kv_xfer")
            block = attrs.get("block_size")
            ttl = attrs.get("decoder_kv_blocks_ttl")
            events.append((f, rec.lineno, sub, rec.text, *(getattr(e, c) for c in EVENT_FIELDS), e.conversation_id,
                           bidir if isinstance(bidir, bool) else None, _attr_int(block), json_double(ttl)))
        else:
            stats_rows.append((f, rec.lineno, rec.text, rec.conversation_id, rec.ttft_ms, rec.latency_ms,
                               rec.start_time_ms, rec.input_num_turns, rec.input_num_tokens,
                               rec.output_num_tokens, rec.turn, rec.request_id, sub))


def _attr_int(value: object) -> int | None:
    """An attrs integer as the SQL read types it: a JSON integer a 64-bit word holds, else none."""
    return value if isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX else None


def append_events(con: duckdb.DuckDBPyConnection, rows: list[tuple[object, ...]]) -> list[str]:
    """Rows of EV_ROW_COLUMNS into ev_t, which gets the columns they set that no SQL-read line had (returned)."""
    if not rows:
        return []
    have = [c for (c,) in con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = 'ev_t' "
                                      "ORDER BY column_index").fetchall()]
    # (``sub`` only where some line held several events: ev reads 0 for it otherwise, and so do the rows before)
    new = [c for i, c in enumerate(EV_ROW_COLUMNS) if c not in have
           and (any(r[i] for r in rows) if c == "sub" else any(r[i] is not None for r in rows))]
    for c in new:
        con.execute(f"ALTER TABLE ev_t ADD COLUMN {c} {ev_column_type(c)}{' DEFAULT 0' if c == 'sub' else ''}")
    if new:
        con.execute(ev_view_sql([*have, *new]))
    keep = [i for i, c in enumerate(EV_ROW_COLUMNS) if c in have or c in new]
    _append_rows(con, "ev_t", tuple(EV_ROW_COLUMNS[i] for i in keep), [tuple(r[i] for i in keep) for r in rows])
    return new


def _append_rows(con: duckdb.DuckDBPyConnection, table: str, columns: tuple[str, ...],
                 rows: list[tuple[object, ...]]) -> None:
    if not rows:
        return
    placeholders = ", ".join("?" for _ in columns)
    con.executemany(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({placeholders})", rows)


def add_document(run: Run, f: int) -> None:
    """A client-statistics file that is one JSON document (json_logs reads it whole). Written compact, all its
    records are on line 1: ``sub`` tells them apart."""
    path = run.files[f].path
    rows: list[tuple[object, ...]] = []
    record_rows(f, parse_json_document(_whole(path), path, run.stats), [], rows)
    _add_document_stats(run, rows)


def add_event_document(run: Run, f: int) -> bool:
    """An event file that is one JSON array over many lines (json_logs reads it whole; parse adds its events);
    False when it is no valid JSON array: it is then read as lines, and nothing was counted."""
    path = run.files[f].path
    stats = LineStats()
    records = parse_event_document(_whole(path), path, stats)
    if records is None:
        return False
    run.stats.merge(stats)
    stat_rows: list[tuple[object, ...]] = []
    record_rows(f, records, run.document_events, stat_rows)
    _add_document_stats(run, stat_rows)
    return True


def _whole(path: str) -> bytes:
    try:
        with open_binary(path) as fh:
            return fh.read()
    except (OSError, EOFError) as exc:
        raise LogReadError(f"cannot read {path}: {exc}") from None


def _add_document_stats(run: Run, rows: list[tuple[object, ...]]) -> None:
    """Client statistics read from a whole document (rows of CS_ROW_COLUMNS) into cs_doc, which parse adds to cs."""
    run.con.execute("CREATE TEMP TABLE IF NOT EXISTS cs_doc AS SELECT * FROM (SELECT NULL::INTEGER AS f, "
                    "NULL::BIGINT AS n, NULL::VARCHAR AS text, NULL::VARCHAR AS conversation_id, NULL::DOUBLE AS "
                    "ttft_ms, NULL::DOUBLE AS latency_ms, NULL::DOUBLE AS start_time_ms, NULL::BIGINT AS "
                    "input_num_turns, NULL::BIGINT AS input_num_tokens, NULL::BIGINT AS output_num_tokens, "
                    "NULL::BIGINT AS turn, NULL::VARCHAR AS request_id, 0 AS sub) WHERE false")
    run.documents = True
    if rows:
        run.con.executemany("INSERT INTO cs_doc VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
