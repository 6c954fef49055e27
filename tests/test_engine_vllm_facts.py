"""vl_facts built for the kinds the lines hold equals vl_facts built for every kind (a fact only absent kinds
give is NULL, or false, either way), on the real vLLM fixture runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdiag.diagnostics import verdict_engine as ve
from kvdiag.diagnostics.detect import detect
from kvdiag.diagnostics.engine_facts import facts_sql, required_kinds
from kvdiag.diagnostics.engine_join import join_sql

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "logs"
RUNS = sorted(p for p in FIXTURES.iterdir() if p.is_dir() and p.name != "__pycache__")


def _vl_facts(run: ve.Run, kinds: list[str] | None) -> list[tuple[object, ...]]:
    vl_facts = next(q for q in facts_sql(kinds) if "TABLE vl_facts" in q)
    run.con.execute("DROP TABLE IF EXISTS vl_facts")
    run.con.execute(vl_facts)
    types = run.con.execute("SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = 'vl_facts' "
                            "ORDER BY column_index").fetchall()
    return [tuple(types), *run.con.execute("SELECT * FROM vl_facts ORDER BY sid").fetchall()]


def _prepared(path: Path) -> tuple[ve.Run, list[str]]:
    run = ve.new_run(detect(sorted(str(p) for p in path.iterdir() if p.suffix in (".log", ".json", ".jsonl"))))
    ve.load_files(run)
    ve.parse(run)
    for q in (*join_sql(None), *facts_sql()):
        if "TABLE vl_facts" in q:
            break
        run.con.execute(q)
    kinds = [k for (k,) in run.con.execute("SELECT DISTINCT kind FROM vl WHERE kind IS NOT NULL").fetchall()]
    return run, kinds


@pytest.mark.parametrize("path", RUNS, ids=[p.name for p in RUNS])
def test_facts_for_the_present_kinds_equal_all_facts(path: Path) -> None:
    run, kinds = _prepared(path)
    try:
        assert len(_vl_facts(run, None)) > 1
        assert _vl_facts(run, kinds) == _vl_facts(run, None)
    finally:
        run.con.close()


def test_leaving_out_a_present_kind_is_caught() -> None:
    """Negative control: the comparison sees a fact lost when a kind the lines hold is taken for absent."""
    run, kinds = _prepared(FIXTURES / "real_vllm_batch_failure")
    try:
        assert "kv_load_failed" in kinds
        assert _vl_facts(run, [k for k in kinds if k != "kv_load_failed"]) != _vl_facts(run, None)
    finally:
        run.con.close()


def test_required_kinds_reads_the_conjunction() -> None:
    assert required_kinds("grp = 'p' AND kind = 'x_y'") == {"x_y"}
    assert required_kinds("grp = 'p' AND kind IN ('a', 'b') AND n > 1") == {"a", "b"}
    assert required_kinds("grp = 'p'") is None
    assert required_kinds("kind = 'a' OR grp = 'p'") is None
