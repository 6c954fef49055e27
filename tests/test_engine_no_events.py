"""Runs without turn events (stock logs) create the tables only events fill from their generated columns instead
of running their statements: the same tables, the same turns, on every fixture without events."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
from gen_logs_support import load_gen_logs

import kvdiag
from kvdiag.diagnostics import engine_join, engine_no_events, verdict_engine
from kvdiag.diagnostics.detect import detect
from kvdiag.diagnostics.engine_no_events import EventsOnly, EventsUnion, generate, render
from kvdiag.diagnostics.event_table_columns import EVENT_TABLE_COLUMNS
from kvdiag.diagnostics.turn_loader import run_all

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "logs"
STOCK_RUNS = sorted(p for p in FIXTURES.iterdir() if p.is_dir() and p.name != "__pycache__")


def test_the_generated_columns_are_current() -> None:
    committed = Path(engine_no_events.__file__).with_name("event_table_columns.py").read_text()
    assert render(generate()) == committed, (
        "regenerate: python -m kvdiag.diagnostics.engine_no_events --out diagnostics/event_table_columns.py")
    assert {"tev", "ev_slot", "ev_facts", "decider"} <= set(EVENT_TABLE_COLUMNS)


def _stock_dirs(tmp_path: Path) -> list[Path]:
    gen = tmp_path / "gen"
    load_gen_logs().generate(gen, 150_000, seed=5, noise_per_turn=1)
    for p in gen.iterdir():
        if p.name.endswith("events.jsonl") or p.name == "client.jsonl":
            p.unlink()  # what an unmodified deployment leaves
    return [*STOCK_RUNS, gen]


def _tables(files: list[str]) -> dict[str, list[tuple[object, ...]]]:
    with pytest.MonkeyPatch.context() as mp:  # (the run drops the tables only its joins read: they are kept here)
        mp.setattr(verdict_engine, "_JOINS_ONLY", ())
        run = run_all(detect(files))
    try:
        assert not run.con.execute("SELECT count(*) FROM ev_t").fetchall()[0][0], "a fixture with events"
        out = {name: run.con.execute(f"DESCRIBE {name}").fetchall() for name in EVENT_TABLE_COLUMNS}
        out["decided"] = run.con.execute("SELECT * FROM decided ORDER BY sid").fetchall()
        return out
    finally:
        run.con.close()


def test_stand_ins_give_the_tables_and_turns_the_statements_give(tmp_path: Path) -> None:
    dirs = _stock_dirs(tmp_path)
    for d in dirs:
        files = sorted(str(p) for p in d.iterdir() if p.is_file())
        fast = (_tables(files), kvdiag.load_turns(files))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(verdict_engine, "stand_in", lambda sql: sql)
            slow = (_tables(files), kvdiag.load_turns(files))
        assert fast[0] == slow[0], d.name
        assert [c.__dict__ for c in fast[1]] == [c.__dict__ for c in slow[1]], d.name
        assert len(fast[0]["decided"]) > 0
        conv = fast[1][0].conversation_id
        one = kvdiag.explain_conversation(files, conv)
        assert [t.__dict__ for t in one.turns] == [t.__dict__ for t in fast[1][0].turns]


def test_a_statement_wrongly_marked_events_only_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: marking the proxy's new requests (not an events-only table) changes the turns of a stock
    run, which the comparison above would catch."""
    files = sorted(str(p) for p in (FIXTURES / "stock_run").iterdir() if p.is_file())
    want = kvdiag.load_turns(files)
    original = engine_join.join_sql

    def marked(only: str | None, *, merged: bool = False) -> list[str]:
        return [EventsOnly(q) if q.lstrip().startswith("CREATE TEMP TABLE px_new AS") else q
                for q in original(only, merged=merged)]

    monkeypatch.setattr(verdict_engine, "join_sql", marked)
    monkeypatch.setattr(engine_no_events, "EVENT_TABLE_COLUMNS", {**EVENT_TABLE_COLUMNS, "px_new": (
        ("rid", "VARCHAR"), ("conv", "VARCHAR"), ("turn", "BIGINT"), ("po", "BIGINT"))})
    got = kvdiag.load_turns(files)
    assert [c.__dict__ for c in got] != [c.__dict__ for c in want]


def test_runs_with_events_run_every_statement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    load_gen_logs().generate(tmp_path, 100_000, seed=6, noise_per_turn=0)
    files = sorted(str(p) for p in tmp_path.iterdir() if p.is_file())
    called: list[str] = []
    monkeypatch.setattr(verdict_engine, "stand_in", lambda sql: called.append(sql) or sql)
    table = kvdiag.load_turn_table(files)
    assert len(table) > 0 and not called
    assert isinstance(table, pd.DataFrame)


def _event_shapes(tmp_path: Path) -> list[list[str]]:
    import test_report_events_table as shapes

    out = []
    for shape in ("plain", "concurrent", "prefill-retried", "inferred", "unattached-engine-event"):
        (tmp_path / shape).mkdir()
        out.append(shapes._demo_like(tmp_path / shape, shape))
    (tmp_path / "gen").mkdir()
    load_gen_logs().generate(tmp_path / "gen", 100_000, seed=7, noise_per_turn=1)  # P's events for every turn
    out.append(sorted(str(p) for p in (tmp_path / "gen").iterdir()))
    return out


def test_one_conversation_inserts_only_the_event_branches_that_give_rows(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """explain of one conversation (few rows) builds ev_facts from its branches that have rows: the same turns as
    the whole union gives explain --all, and both branches are skipped somewhere."""
    ran: list[int] = []
    original = engine_no_events.branch_statements

    def counted(sql: EventsUnion, finds_a_row: Callable[[str], bool]) -> list[str] | None:
        split = original(sql, finds_a_row)
        ran.append(len(split or ()) - 1)
        return split

    monkeypatch.setattr(verdict_engine, "branch_statements", counted)
    for files in _event_shapes(tmp_path):
        before = len(ran)
        records = kvdiag.load_turns(files)
        assert len(ran) == before  # (explain --all runs the union)
        for conv in records[:12]:
            one = kvdiag.explain_conversation(files, conv.conversation_id)
            assert [t.__dict__ for t in one.turns] == [t.__dict__ for t in conv.turns], (files[0], conv.conversation_id)
    assert 1 in ran, ran  # (a branch skipped)


def test_a_probe_that_misses_rows_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a branch skipped although it has rows changes one conversation's turns."""
    files = _event_shapes(tmp_path)[-1]
    conv = kvdiag.load_turns(files)[0]
    original = engine_no_events.branch_statements
    monkeypatch.setattr(verdict_engine, "branch_statements", lambda sql, finds: original(sql, lambda probe: False))
    one = kvdiag.explain_conversation(files, conv.conversation_id)
    assert [t.__dict__ for t in one.turns] != [t.__dict__ for t in conv.turns]
