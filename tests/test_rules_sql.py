"""The SQL generated from the rule table picks the first rule that holds, whatever the conditions' layout, and
binding only the rules a run's turns reach gives the same rows."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from kvdiag.diagnostics import duckdb_api
from kvdiag.diagnostics.detect import detect
from kvdiag.diagnostics.rules import _conjuncts, _pick, decide_sql, pick_sql
from kvdiag.diagnostics.turn_loader import run_all
from kvdiag.diagnostics.verdict_engine import RECORD_COLUMNS


def _first(rules: list[str], row: dict[str, bool | None]) -> int | None:
    """The rule number the generated CASE gives for ``row`` (columns a, b, c)."""
    pick = _pick([(i, _conjuncts(w) or [f"({w})"]) for i, w in enumerate(rules)])
    cols = ", ".join(f"{v if v is not None else 'NULL'}::BOOLEAN AS {k}" for k, v in row.items())
    got = duckdb.execute(f"SELECT CASE {pick} END FROM (SELECT {cols})").fetchone()
    return None if got is None else got[0]


def test_a_condition_over_lines_is_not_taken_for_a_conjunction() -> None:
    # (a AND b) OR c written over two lines: rule 0 holds when c does, even with a false
    rules = ["a AND b\n  OR c", "a AND c", "a"]
    assert _conjuncts(rules[0]) is None
    assert _first(rules, {"a": False, "b": False, "c": True}) == 0
    # negative control: the same condition read as a conjunction (a AND (b OR c)) misses that turn
    wrong = _pick([(0, ["a", "b\n  OR c"]), (1, ["a", "c"]), (2, ["a"])])
    got = duckdb.execute(f"SELECT CASE {wrong} END FROM (SELECT false AS a, false AS b, true AS c)").fetchone()
    assert got is not None and got[0] is None


def test_rules_sharing_a_first_condition_give_the_first_that_holds() -> None:
    rules = ["a AND b", "a\n AND c", "a", "c"]
    assert _conjuncts(rules[1]) == ["a", "c"]
    for a in (True, False, None):
        for b in (True, False, None):
            for c in (True, False, None):
                want = next((i for i, ok in enumerate([a and b, a and c, a, c]) if ok), None)
                assert _first(rules, {"a": a, "b": b, "c": c}) == want, (a, b, c)


# ---- one conversation's run binds only the rules its turns reach: the same table as binding them all

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "logs"
RUNS = sorted(p for p in FIXTURES.iterdir() if p.is_dir() and p.name != "__pycache__")


def _decided(con: duckdb_api.Connection, picked: set[int] | None) -> list[tuple[object, ...]]:
    keep = (*RECORD_COLUMNS, "sid", "px_rid")
    if picked is None:
        sql = decide_sql("tfw", keep)
    else:
        con.execute(f"CREATE OR REPLACE TEMP TABLE tfw_all AS SELECT *, {pick_sql()} AS rule_no FROM tfw")
        sql = decide_sql("tfw_all", keep, picked=picked)
    return con.execute(f"SELECT * FROM ({sql}) ORDER BY sid").fetchall()


@pytest.mark.parametrize("run_dir", RUNS, ids=lambda p: p.name)
def test_binding_only_the_rules_reached_gives_the_same_turns(run_dir: Path) -> None:
    run = run_all(detect([str(run_dir)]), windows=False)
    try:
        full = _decided(run.con, None)
        reached = {r for (r,) in run.con.execute(f"SELECT DISTINCT {pick_sql()} FROM tfw").fetchall()}
        assert full and reached
        assert _decided(run.con, reached) == full
        # negative control: a rule a turn reaches left out changes that turn's row
        assert _decided(run.con, reached - {min(reached)}) != full
    finally:
        run.con.close()
