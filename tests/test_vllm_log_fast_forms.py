"""The vLLM kinds' fast forms (a group cut by position out of a match, a pattern ending in "(.*)$" matched by
its prefix) give ``vl`` row for row as the whole patterns do: on every fixture vLLM log (lines real vLLM code
wrote included) and on generated lines with odd ids, details and contexts."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
from engine_lines_support import insert_lines
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdiag.diagnostics import engine_parse as ep
from kvdiag.diagnostics import vllm_log_parser as vllm_log

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "logs"
VLLM_LOGS = sorted(p for p in FIXTURES.rglob("*.log") if "proxy" not in p.name and "console" not in p.name)


def _con(lines: list[bytes], *, all_ascii: bool = False) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    ep.create_line_tables(con)
    insert_lines(con, "lines_vllm", list(enumerate(lines, start=1)), "x.log")
    for q in ep.vllm_head_sql(all_ascii=all_ascii):
        con.execute(q)
    return con


def _vl(con: duckdb.DuckDBPyConnection, sql: str) -> list[tuple[object, ...]]:
    con.execute("DROP TABLE IF EXISTS vl")
    con.execute(sql)
    return con.execute("SELECT * FROM vl ORDER BY f, n").fetchall()


def _differences(lines: list[bytes], fast_sql: str | None = None) -> list[tuple[object, object]]:
    con = _con(lines)
    out = []
    for ascii_branch in (True, False):
        slow = _vl(con, ep.vllm_records_sql(ascii_branch=ascii_branch, fast=False))
        fast = _vl(con, fast_sql or ep.vllm_records_sql(ascii_branch=ascii_branch))
        out += [(a, b) for a, b in zip(slow, fast, strict=True) if a != b]
    return out


def test_fast_forms_are_in_use() -> None:
    sql = ep.vllm_records_sql()
    assert sql != ep.vllm_records_sql(fast=False)
    kinds = {k for k, regex, _c in vllm_log._CLASSIFIERS if ep.rest_prefix(regex.compiled) is not None}
    assert {"nixl_failure", "kv_load_failed"} <= kinds


def test_fixture_logs_give_the_same_rows() -> None:
    lines = [line for path in VLLM_LOGS for line in path.read_bytes().split(b"\n")]
    kinds = {k for (k,) in _con(lines).execute(ep.vllm_records_sql(fast=False) + "; SELECT kind FROM vl").fetchall()}
    assert {"nixl_failure", "kv_load_failed", "declining_expired"} <= kinds
    assert _differences(lines) == []


_TEXT = st.lists(st.sampled_from([*"ab9_-.:'é ", ". ", " | Context: ", "Request IDs: ", "{'", "'}", "\r", "(s)"]),
                 max_size=8).map("".join)
_TEMPLATES = [
    "NIXL transfer failure: {w}. {t} | Context: {{'request_id': '{t}', 'remote_request_id': '{w}'}}{t}",
    "NIXL transfer failure: {w} | Context: {t}", "NIXL transfer failure: {w}{t} | Context: {t}",
    "NIXL transfer failure: {t}", "Failing {d} request(s) due to KV load failure (failure_policy={w}, {d} tokens "
    "affected). Request IDs: {t}", "Failing {d} request(s) due to KV load failure (failure_policy={w}, {d} tokens "
    "affected). Request IDs: {{'{t}', '{w}'}}", "Failing {t} request(s) due to KV load failure",
    "Received request {w}: {t}", "Received request {t}:", "Declining expired remote read for {w} from engine {t}",
    "Releasing expired KV blocks for request {w} which were retrieved by {d} {t}",
]


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(_TEMPLATES), _TEXT, st.text(st.sampled_from("ab9_é-"), min_size=1,
                                                                        max_size=5), st.integers(0, 99)),
                min_size=1, max_size=12))
def test_generated_lines_give_the_same_rows(rows: list[tuple[str, str, str, int]]) -> None:
    lines = [f"(EngineCore_DP0 pid=1) ERROR 11-29 06:54:50 [x.py:1] {tpl.format(t=t, w=w, d=d)}".encode()
             for tpl, t, w, d in rows]
    assert _differences(lines) == []


def test_a_wrong_rest_cut_is_caught() -> None:
    """Negative control: the comparison sees the rest group cut one character late."""
    lines = [b"(EngineCore_DP0 pid=1) ERROR 11-29 06:54:50 [x.py:1] Failing 1 request(s) due to KV load failure "
             b"(failure_policy=fail, 9 tokens affected). Request IDs: 'ab'"]
    fast = ep.vllm_records_sql()
    wrong = re.sub(r"substr\(msg, length\((m\d+)\) \+ 1\)", r"substr(msg, length(\1) + 2)", fast)
    assert wrong != fast
    assert _differences(lines) == []
    assert _differences(lines, wrong) != []


def _heads_and_rows(lines: list[bytes], *, all_ascii: bool) -> tuple[list[tuple[object, ...]], ...]:
    con = _con(lines, all_ascii=all_ascii)
    head = con.execute("SELECT * FROM vl_head ORDER BY f, n").fetchall()
    return head, _vl(con, ep.vllm_records_sql(all_ascii=all_ascii))


def test_ascii_lines_read_with_the_patterns_as_written_give_the_same_rows() -> None:
    """Every line ASCII: the patterns as written alone (no Unicode-aware form) give vl_head and vl unchanged."""
    lines = [line for path in VLLM_LOGS for line in path.read_bytes().split(b"\n") if line.isascii()]
    lines += [f"(EngineCore_DP0 pid=1) ERROR 11-29 06:54:50 [x.py:1] {tpl.format(t='a. b | Context: x', w='w_1', d=3)}"
              .encode() for tpl in _TEMPLATES]
    assert _heads_and_rows(lines, all_ascii=True) == _heads_and_rows(lines, all_ascii=False)


def test_a_non_ascii_line_needs_the_unicode_forms() -> None:
    """Negative control: on a line with a non-ASCII process name the patterns as written read another header."""
    lines = ["(EngineCore_\u00e9 pid=1) INFO 11-29 06:54:50 [x.py:1] Received request a:".encode()]
    assert _heads_and_rows(lines, all_ascii=True) != _heads_and_rows(lines, all_ascii=False)
