"""The proxy clock read in SQL (the windows' middle offer) equals proxy_log_parser.wall_clock, invalid dates too;
the middle offer is the one at index count // 2 of the offers' times sorted."""

from __future__ import annotations

import duckdb
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.diagnostics.engine_windows import MIDDLE_OFFER_SQL, PROXY_WALL_CLOCK
from kvdiag.diagnostics.proxy_log_parser import wall_clock

_TWO = st.integers(0, 99).map(lambda v: f"{v:02d}")
_STAMP = st.builds(lambda y, m, d, hh, mm, ss, sep: f"{y:04d}-{m}-{d}{sep}{hh}:{mm}:{ss}",
                   st.integers(1, 9999), st.integers(0, 13).map(lambda v: f"{v:02d}"),
                   st.integers(0, 32).map(lambda v: f"{v:02d}"), _TWO, _TWO, _TWO, st.sampled_from([" ", "T"]))

_CON = duckdb.connect()


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.one_of(_STAMP, st.sampled_from(["2024-02-29 23:59:59", "2025-02-29 00:00:00", "2025-04-31 10:00:00",
                                          "1970-01-01 00:00:00"])))
def test_sql_clock_equals_wall_clock(ts: str) -> None:
    got = _CON.execute(f"SELECT {PROXY_WALL_CLOCK} FROM (SELECT ?::VARCHAR AS ts)", [ts]).fetchall()[0][0]
    want = wall_clock(ts)
    assert (None if got is None else float(got)) == want, ts


def test_an_impossible_day_is_no_time() -> None:
    # the control: February 29th exists only in leap years, for both readings
    assert wall_clock("2025-02-29 00:00:00") is None
    assert _CON.execute(f"SELECT {PROXY_WALL_CLOCK} FROM (SELECT '2025-02-29 00:00:00' AS ts)").fetchall() == [(None,)]


def _middle(rows: list[tuple[str, str]]) -> float | None:
    con = duckdb.connect()
    con.execute("CREATE TABLE pl (ts VARCHAR, kind VARCHAR)")
    if rows:
        con.executemany("INSERT INTO pl VALUES (?, ?)", rows)
    got = con.execute(MIDDLE_OFFER_SQL).fetchall()[0][0]
    return None if got is None else float(got)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.one_of(_STAMP, st.just("garbage")), st.sampled_from(["sending", "hit", "cached"])),
                max_size=12))
def test_middle_offer_is_the_sorted_times_middle(rows: list[tuple[str, str]]) -> None:
    times = sorted(t for ts, kind in rows if kind == "sending" and (t := wall_clock(ts)) is not None)
    assert _middle(rows) == (times[len(times) // 2] if times else None), rows


def test_middle_offer_examples() -> None:
    # (controls: an index one lower, or the lines of every kind, would give other times here)
    three = [("2025-01-01 00:00:03", "sending"), ("2025-01-01 00:00:01", "sending"), ("2025-01-01 00:00:02", "sending"),
             ("2025-01-01 00:00:09", "hit")]
    assert _middle(three) == wall_clock("2025-01-01 00:00:02")
    two = [("2025-01-01 00:00:05", "sending"), ("2025-01-01 00:00:04", "sending")]
    assert _middle(two) == wall_clock("2025-01-01 00:00:05")
    assert _middle([("2025-02-30 00:00:00", "sending"), ("2025-01-01 00:00:00", "hit")]) is None
    assert _middle([]) is None
