"""vl_head cuts vLLM's own header by position; on any line the header check accepts, the parts equal the
Python parser's HEADER_RE groups (brackets, colons, ") " and " pid=" in the file part or the message, several
spaces after the level, non-ASCII names)."""

from __future__ import annotations

import duckdb
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.diagnostics import engine_parse as ep
from kvdiag.diagnostics.vllm_log_parser import HEADER_RE

_NAME = st.text(st.sampled_from("Ab9_.-é"), min_size=1, max_size=6)
_FILE = st.text(st.sampled_from("ab/._-:[(9) é"), min_size=1, max_size=12)
_MSG = st.lists(st.sampled_from([*"ab9 :[]()=é", ") ", " pid=", "] ", " [", "INFO "]), max_size=12).map("".join)


@st.composite
def _header_line(draw: st.DrawFn) -> str:
    proc = f"({draw(_NAME)} pid={draw(st.integers(0, 99999))}) " if draw(st.booleans()) else ""
    level = draw(st.sampled_from(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]))
    spaces = " " * draw(st.integers(1, 3))
    sep = draw(st.sampled_from([" ", ""]))
    return (f"{proc}{level}{spaces}11-29 06:54:5{draw(st.integers(0, 9))} "
            f"[{draw(_FILE)}:{draw(st.integers(0, 9999))}]{sep}{draw(_MSG)}")


def _heads(lines: list[str], head_sql: str) -> dict[int, tuple[str | None, ...]]:
    con = duckdb.connect()
    ep.create_line_tables(con)
    con.execute("INSERT INTO lines_vllm SELECT 0, unnest(range(1, len($l) + 1)), unnest($l)", {"l": lines})
    clean, _head = ep.vllm_head_sql()
    con.execute(clean)
    con.execute(head_sql)
    return {n: tuple(row) for n, *row in con.execute(
        "SELECT n, nullif(proc, ''), nullif(pid, ''), level, ts, fileinfo, msg FROM vl_head").fetchall()}


def _mismatches(lines: list[str], head_sql: str) -> list[tuple[str, object, object]]:
    got = _heads(lines, head_sql)
    bad = []
    for n, line in enumerate(lines, start=1):
        m = HEADER_RE.match(line)
        assert m is not None and not m.group("prefix"), line  # vLLM's own shape: the position cut's path
        want = (m.group("proc"), m.group("pid"), m.group("lvl"), m.group("ts"),
                f"{m.group('file')}:{m.group('line')}", m.group("msg"))
        if got.get(n) != want:
            bad.append((line, got.get(n), want))
    return bad


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(_header_line(), min_size=1, max_size=20))
def test_header_cut_equals_the_header_pattern(lines: list[str]) -> None:
    assert _mismatches(lines, ep.vllm_head_sql()[1]) == []


def test_a_cut_at_the_last_bracket_is_caught() -> None:
    """Negative control: the comparison finds a cut that ends the file part at the line's last "]"."""
    lines = ["(APIServer pid=1) INFO 11-29 06:54:50 [logger.py:45] Received request x: params [a] ok",
             "INFO  11-29 06:54:50 [a[b:c.py:7]msg"]
    wrong = ep.vllm_head_sql()[1].replace("strpos(t, ']')", "length(t) - strpos(reverse(t), ']') + 1")
    assert wrong != ep.vllm_head_sql()[1]
    assert _mismatches(lines, ep.vllm_head_sql()[1]) == []
    assert len(_mismatches(lines, wrong)) == 1


# ---- a few lines' run: the full header pattern compiled only where a line lacks vLLM's own shape

_OWN = "(EngineCore_DP0 pid=7) INFO 11-29 06:54:50 [scheduler.py:12] Added request r1."
_PREFIXED = "[node-a] INFO 11-29 06:54:51 [scheduler.py:12] Added request r2."  # VLLM_LOGGING_PREFIX="[node-a] "
_NOT_VLLM = "Traceback (most recent call last):"


def _tables(lines: list[str], run: str) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    con = duckdb.connect()
    ep.create_line_tables(con)
    con.execute("INSERT INTO lines_vllm SELECT 0, unnest(range(1, len($l) + 1)), unnest($l)", {"l": lines})
    if run == "bulk":
        for q in ep.vllm_head_sql():
            con.execute(q)
    elif run == "few":
        ep.vllm_head_few_lines(con, con.execute, ascii_branch=False, all_ascii=all(x.isascii() for x in lines))
    else:  # negative control: the own-shape statements alone, whatever the lines
        for q in ep.vllm_own_shape_sql(ascii_branch=False):
            con.execute(q)
    return (con.execute("SELECT f, n, t, std FROM vl_clean ORDER BY n").fetchall(),
            con.execute("SELECT * FROM vl_head ORDER BY n").fetchall())


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.one_of(_header_line(), st.sampled_from([_OWN, _PREFIXED, _NOT_VLLM, "", "é [x:1] y"])),
                min_size=1, max_size=12))
def test_few_lines_statements_equal_the_bulk_ones(lines: list[str]) -> None:
    assert _tables(lines, "few") == _tables(lines, "bulk")


def test_a_line_in_another_shape_needs_the_full_pattern() -> None:
    lines = [_OWN, _PREFIXED, _NOT_VLLM]
    few, bulk = _tables(lines, "few"), _tables(lines, "bulk")
    assert few == bulk and [row[1] for row in bulk[1]] == [1, 2]
    # negative control: without the full pattern the prefixed line is lost and the stray one kept
    assert _tables(lines, "own_only") != bulk
