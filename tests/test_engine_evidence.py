"""The evidence texts (engine_evidence): each cited line's first text by the tables' precedence, whichever tables
hold the files' lines; a window's line after the log's; nothing for a line no table has a text of."""

from __future__ import annotations

import duckdb
import pytest

from kvdiag.diagnostics.engine_evidence import evidence_texts_sql


def ref(f: int, n: int) -> int:
    return (f << 40) + n


def _con() -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    for sql in ("CREATE TABLE files (f INTEGER, path VARCHAR)",
                "CREATE TABLE ev (f INTEGER, n BIGINT, text VARCHAR)",
                "CREATE TABLE cs (f INTEGER, n BIGINT, text VARCHAR, sub INTEGER)",
                "CREATE TABLE vl_head (f INTEGER, n BIGINT, level VARCHAR, ts VARCHAR, fileinfo VARCHAR, msg VARCHAR, "
                "pid VARCHAR, proc VARCHAR)",
                "CREATE TABLE lines_json (f INTEGER, n BIGINT, line VARCHAR)",
                "CREATE TABLE lines_proxy (f INTEGER, n BIGINT, line VARCHAR)",
                "CREATE TABLE wtext (ref BIGINT, source VARCHAR, text VARCHAR)",
                "CREATE TABLE refs (ref BIGINT)"):
        con.execute(sql)
    con.executemany("INSERT INTO files VALUES (?, ?)", [(0, "ev.jsonl"), (1, "cs.jsonl"), (2, "p.log"),
                                                        (3, "proxy.log"), (4, "other.log")])
    return con


def _texts(con: duckdb.DuckDBPyConnection, refs: list[int]) -> list[tuple[int, str, str]]:
    con.execute("DELETE FROM refs")
    if refs:
        con.executemany("INSERT INTO refs VALUES (?)", [(r,) for r in refs])
    return sorted(con.execute(evidence_texts_sql(con, "refs")).fetchall())


def _logs(con: duckdb.DuckDBPyConnection) -> None:
    con.executemany("INSERT INTO lines_json VALUES (?, ?, ?)", [
        (0, 1, '{"event": 1}'), (0, 2, '  {"event": 2} \t'), (0, 3, "x" * 400), (1, 1, '[{"a": 1}, {"a": 2}]'),
        (1, 2, '{"b": 1}'), (0, 5, None)])
    con.executemany("INSERT INTO vl_head VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [
        (2, 7, "INFO", "12-01 10:00:00", "s.py:1", "Finished", "12", "EngineCore"),
        (2, 8, "INFO", "12-01 10:00:01", "s.py:2", "Got", None, ""),
        (2, 9, "INFO", None, "s.py:3", "no clock", "1", "P")])
    con.executemany("INSERT INTO lines_proxy VALUES (?, ?, ?)", [(3, 4, "Ready: x\r"), (3, 5, "[r1] Prefill done")])


def test_each_table_answers_for_its_own_files() -> None:
    con = _con()
    _logs(con)
    got = _texts(con, [ref(0, 1), ref(0, 2), ref(0, 3), ref(0, 1), ref(1, 1), ref(2, 7), ref(2, 8), ref(2, 9),
                       ref(3, 4), ref(0, 4), ref(0, 5), ref(4, 1)])
    assert got == [
        (ref(0, 1), "ev.jsonl:1", '{"event": 1}'), (ref(0, 2), "ev.jsonl:2", '{"event": 2}'),
        (ref(0, 3), "ev.jsonl:3", "x" * 300), (ref(1, 1), "cs.jsonl:1", '[{"a": 1}, {"a": 2}]'),
        (ref(2, 7), "p.log:7", "(EngineCore pid=12) INFO 12-01 10:00:00 [s.py:1] Finished"),
        (ref(2, 8), "p.log:8", "INFO 12-01 10:00:01 [s.py:2] Got"), (ref(3, 4), "proxy.log:4", "Ready: x")]


def test_an_event_s_or_statistic_s_own_text_comes_before_its_line() -> None:
    con = _con()
    _logs(con)
    con.executemany("INSERT INTO ev VALUES (?, ?, ?)", [(0, 1, "event one"), (0, 2, None)])
    # (a line's statistics: the last one's text)
    con.executemany("INSERT INTO cs VALUES (?, ?, ?, ?)", [(1, 1, "first", 0), (1, 1, "second", 1), (1, 2, None, 0)])
    got = _texts(con, [ref(0, 1), ref(0, 2), ref(1, 1), ref(1, 2)])
    assert got == [(ref(0, 1), "ev.jsonl:1", "event one"), (ref(0, 2), "ev.jsonl:2", '{"event": 2}'),
                   (ref(1, 1), "cs.jsonl:1", "second"), (ref(1, 2), "cs.jsonl:2", '{"b": 1}')]


@pytest.mark.parametrize("cited_only", [False, True])
def test_a_window_s_line_comes_after_the_log_s(cited_only: bool) -> None:
    con = _con()
    _logs(con)
    con.executemany("INSERT INTO wtext VALUES (?, ?, ?)", [(ref(2, 7), "P:7", "window seven"),
                                                           (ref(2, 20), "P:20", "w" * 320)])
    cited = [ref(2, 20)] if cited_only else [ref(2, 7), ref(2, 20), ref(3, 5)]
    got = _texts(con, cited)
    log = [] if cited_only else [(ref(2, 7), "p.log:7", "(EngineCore pid=12) INFO 12-01 10:00:00 [s.py:1] Finished"),
                                 (ref(3, 5), "proxy.log:5", "[r1] Prefill done")]
    assert [t for t in got if t[0] in cited] == sorted([*log, (ref(2, 20), "P:20", "w" * 300)])


def test_no_ref_no_text() -> None:
    con = _con()
    _logs(con)
    assert _texts(con, []) == []
    assert _texts(con, [ref(4, 1)]) == []
