"""The engine's two spellings of the header request id (every line's, a few rows') are Python's own function."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.diagnostics import duckdb_api
from kvdiag.diagnostics.engine_join import MACROS, BulkOnly, FewRowsOnly
from kvdiag.schema.request_ids import header_request_id

EDGES = [
    "", "-", "abc", "cmpl-", "chatcmpl-", "cmpl-12345678", "chatcmpl-12345678", "chatcmpl--12345678",
    "-12345678", "x-12345678", "cmpl-abc-12345678", "chatcmpl-abc-1234567", "chatcmpl-abc-1234567_",
    "chatcmpl-abc-12345678-abcdefgh", "cmpl-cmpl-abc", "chatcmpl-cmpl-x-abcdefgh", "ab\ncd-12345678",
    "chatcmpl-a\n-12345678", "é-12345678", "cmpl-ü-ABCDEFGH", "chatcmpl-abc-1234567é", "CMPL-abc",
    "cmpl-3f2a-9b1c-12ab34cd", "0123456789abcdef0123456789abcdef-0a1b2c3d",
]


def _spellings() -> dict[str, list[str]]:
    ext_id = [m for m in MACROS if not isinstance(m, (BulkOnly, FewRowsOnly))]
    return {"bulk": [*ext_id, *(m for m in MACROS if isinstance(m, BulkOnly))],
            "few_rows": [*ext_id, *(m for m in MACROS if isinstance(m, FewRowsOnly))]}


@pytest.fixture(scope="module")
def hrid() -> dict[str, duckdb_api.Connection]:
    out = {}
    for name, statements in _spellings().items():
        con = duckdb_api.connect()
        for sql in statements:
            con.execute(sql)
        out[name] = con
    return out


def _engine(con: duckdb_api.Connection, ids: list[str]) -> list[str]:
    rows = con.execute("SELECT hrid(x) FROM unnest($ids::VARCHAR[]) WITH ORDINALITY AS t(x, i) ORDER BY i",
                       {"ids": ids}).fetchall()
    return [r for (r,) in rows]


@pytest.mark.parametrize("spelling", ["bulk", "few_rows"])
def test_edges_equal_python(hrid: dict[str, duckdb_api.Connection], spelling: str) -> None:
    assert _engine(hrid[spelling], EDGES) == [header_request_id(x) for x in EDGES]


@pytest.mark.parametrize("spelling", ["bulk", "few_rows"])
@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.text(alphabet=st.sampled_from("ab0Z-é\nchatcmpl"), max_size=30), min_size=1, max_size=20))
def test_random_ids_equal_python(hrid: dict[str, duckdb_api.Connection], spelling: str, ids: list[str]) -> None:
    assert _engine(hrid[spelling], ids) == [header_request_id(x) for x in ids]


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.text(alphabet=st.sampled_from("ab0Z-\nchatcmpl"), max_size=30), min_size=1, max_size=20))
def test_stored_ascii_ids_equal_python(hrid: dict[str, duckdb_api.Connection], ids: list[str]) -> None:
    """Ids in a table column DuckDB knows to be ASCII, which it cuts by byte position (the engine's case)."""
    con = hrid["bulk"]
    ascii_ids = [x for x in EDGES if x.isascii()] + ids
    con.execute("CREATE OR REPLACE TEMP TABLE stored AS SELECT x, i FROM unnest($ids::VARCHAR[]) WITH ORDINALITY "
                "AS t(x, i)", {"ids": ascii_ids})
    assert con.execute("SELECT stats(x) FROM stored LIMIT 1").fetchall()[0][0]["has_unicode"] is False
    got = [r for (r,) in con.execute("SELECT hrid(x) FROM stored ORDER BY i").fetchall()]
    assert got == [header_request_id(x) for x in ascii_ids]


def test_a_wrong_spelling_is_caught(hrid: dict[str, duckdb_api.Connection]) -> None:
    # negative control: the prefix dropped before the suffix (the order the two steps must not take)
    con = duckdb_api.connect()
    con.execute(r"""CREATE MACRO hrid(x) AS regexp_replace(regexp_replace(x, '^(?:chatcmpl-|cmpl-)', ''),
        '(?s)^(.+)-[0-9a-zA-Z]{8}$', '\1')""")
    assert _engine(con, EDGES) != [header_request_id(x) for x in EDGES]


def test_null_stays_null(hrid: dict[str, duckdb_api.Connection]) -> None:
    for con in hrid.values():
        assert con.execute("SELECT hrid(NULL::VARCHAR)").fetchall() == [(None,)]
