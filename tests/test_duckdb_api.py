"""One conversation's explain runs on DuckDB's extension module alone (its Python package costs a tenth of the
command); every path that needs the package's Python layer imports it. Checked in fresh interpreters, where
nothing else has imported the package."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import kvdiag

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "logs"
RUN = FIXTURES / "real_vllm_info"

_ONE = """
import json, sys
import kvdiag
conv = kvdiag.explain_conversation([sys.argv[1]], sys.argv[2])
print(json.dumps({"turns": [[t.turn, t.verdict.value, t.reason, [e.text for e in t.evidence]] for t in conv.turns],
                  "package": "duckdb" in sys.modules}))
"""

_ALL = """
import json, sys
from kvdiag.diagnostics import duckdb_api, turn_loader
if sys.argv[2] == "no-layer":
    duckdb_api.with_python_layer = lambda: None
turn_loader.FEW_TURNS = 0  # every run's records through Arrow
records = turn_loader.load_turns([sys.argv[1]])
print(json.dumps([[c.conversation_id, [[t.turn, t.verdict.value] for t in c.turns]] for c in records]))
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def test_one_conversation_never_imports_the_package_and_gives_the_same_turns() -> None:
    conv = kvdiag.load_turns([str(RUN)])[0]
    done = _python(_ONE, str(RUN), conv.conversation_id)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["turns"] == [[t.turn, t.verdict.value, t.reason, [e.text for e in t.evidence]] for t in conv.turns]
    # (where DuckDB has no extension module of its own, the package is the engine's DuckDB)
    assert got["package"] is (importlib.util.find_spec("_duckdb") is None)


def test_paths_through_arrow_import_the_python_layer() -> None:
    want = [[c.conversation_id, [[t.turn, t.verdict.value] for t in c.turns]] for c in kvdiag.load_turns([str(RUN)])]
    done = _python(_ALL, str(RUN), "layer")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == want


def test_an_arrow_path_without_the_python_layer_is_caught() -> None:
    """Negative control: without the import, a connection from the extension has no ``sql``."""
    if importlib.util.find_spec("_duckdb") is None:
        return  # the package is the engine's DuckDB: there is no layer to miss
    done = _python(_ALL, str(RUN), "no-layer")
    assert done.returncode != 0 and "AttributeError" in done.stderr and "'sql'" in done.stderr
