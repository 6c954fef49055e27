"""One conversation goes through the engine without Arrow tables built from Python (pyarrow would import
pandas: 0.25 s, more than the engine takes on a few dozen lines); the records are the same either way."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.diagnostics import turn_loader
from kvdiag.diagnostics import verdict_engine as engine
from kvdiag.diagnostics.detect import detect
from kvdiag.diagnostics.linestats import MAX_LINE_CHARS

FIXTURES = Path(__file__).parent / "fixtures" / "logs"


@pytest.mark.parametrize("json_lines", [False, True])
def test_small_inserts_equal_the_arrow_inserts(tmp_path: Path, json_lines: bool) -> None:
    # a list of lines goes in as list parameters, any other iterable through an Arrow table: the same rows,
    # counts and notes either way
    numbered: list[tuple[int, bytes | str]] = [
        (1, b'{"a": 1}\n'), (2, b"caf\xc3\xa9 ok\n"), (3, b"bad \xff byte\n"), (4, b"x" * (MAX_LINE_CHARS + 5)),
        (5, "already text\n"), (9, b"")]
    path = tmp_path / ("c.jsonl" if json_lines else "p.log")
    path.write_text("", encoding="utf-8")
    got = []
    for lines in (numbered, iter(numbered)):
        files = [dataclasses.replace(detect([str(path)])[0], fmt="events" if json_lines else "vllm")]
        with engine.opened(files) as run:
            engine.add_lines(run, 0, lines)
            table = "lines_json" if json_lines else "lines_vllm"
            got.append((run.con.execute(f"SELECT f, n, line FROM {table} ORDER BY n").fetchall(),
                        run.con.execute("SELECT * FROM notes ORDER BY n").fetchall(), run.stats.corrupt))
    assert got[0] == got[1]
    assert got[0][2] == 2 and len(got[0][0]) == (4 if json_lines else 6)


def test_records_from_lists_equal_records_from_arrow(monkeypatch: pytest.MonkeyPatch) -> None:
    files = detect([str(FIXTURES / "real_vllm_info")])
    run = turn_loader.run_all(files)
    try:
        few = turn_loader.records(run)
        monkeypatch.setattr(turn_loader, "FEW_TURNS", 0)
        many = turn_loader.records(run)
    finally:
        run.con.close()
    assert sum(len(c.turns) for c in few) == 25
    assert any(t.evidence for c in few for t in c.turns)
    assert [c.to_json_dict() for c in few] == [c.to_json_dict() for c in many]


def test_one_conversation_does_not_import_pandas_pyarrow_or_numpy(tmp_path: Path) -> None:
    folder = FIXTURES / "real_vllm_info"
    conv = turn_loader.load_turns([str(folder)])[0].conversation_id
    code = ("import sys, json; from kvdiag.diagnostics.turn_loader import explain_conversation; "
            f"c = explain_conversation([{str(folder)!r}], {conv!r}); "
            "print(json.dumps([len(c.turns), sorted(m for m in ('pandas', 'pyarrow', 'numpy') if m in sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    turns, loaded = json.loads(out)
    assert turns >= 1 and loaded == []


def test_the_explain_command_imports_the_engine_only_when_it_runs() -> None:
    # (so one conversation imports duckdb and pyarrow on a second thread while its greps run)
    code = ("import sys; import kvdiag.cli.cmd_explain; "
            "print(sorted(m for m in ('duckdb', 'pyarrow', 'numpy', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.replace("'", '"')) == []
