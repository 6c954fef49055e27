"""``import kvdiag``: a small, pinned, lazy public face, and the README's library snippet runs as written."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import kvdiag

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "logs" / "real_vllm_info"


def test_public_facade_is_pinned() -> None:
    assert set(kvdiag.__all__) == {
        "Confidence", "EventFormatError", "KVDiagError", "PrefillReport", "TurnEvent", "Verdict", "__version__",
        "advise", "build_report", "explain_conversation", "load_turn_table", "load_turns", "parse_event",
        "read_events",
    }
    for name in kvdiag.__all__:
        assert hasattr(kvdiag, name), name
    assert sorted(dir(kvdiag)) == sorted(kvdiag.__all__)


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        kvdiag.no_such_function  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "no_such_function" in str(exc)
    else:
        raise AssertionError("kvdiag.no_such_function did not raise")


def test_import_kvdiag_loads_no_analysis_library() -> None:
    # The functions load their modules on first use: importing the package stays cheap for the CLI and the
    # connector, which run where pandas and DuckDB may be absent or slow to import.
    probe = ("import sys, kvdiag; heavy = [m for m in ('pandas', 'duckdb', 'pyarrow', 'aiohttp') "
             "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    probe_used = "import sys, kvdiag; kvdiag.load_turn_table; print('duckdb' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe_used], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"  # the control: the lazy name really loads the engine


def test_every_domain_error_is_a_kvdiag_error() -> None:
    from kvdiag.diagnostics.detect import LogReadError
    from kvdiag.monitoring.config import MonitoringConfigError
    from kvdiag.router.config import RouterConfigError
    from kvdiag.sim.config import EngineConfigError

    for cls in (LogReadError, MonitoringConfigError, RouterConfigError, EngineConfigError, kvdiag.EventFormatError):
        assert issubclass(cls, kvdiag.KVDiagError), cls


def test_the_readme_library_snippet_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(blocks) == 1, "the README has one library snippet"
    snippet = blocks[0]
    assert len(snippet.strip().splitlines()) <= 4
    # The snippet reads a demo run; point it at a real vLLM 0.33 run kept as a fixture instead.
    code = snippet.replace('"demo-out/"', repr(str(FIXTURE) + "/")).replace('"demo-agent-edits-0-000"', '"agent-a"')
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    printed = out.getvalue()
    assert "(1, 'first_turn'" in printed and "'remote_hit'" in printed


def test_the_facade_reads_only_public_modules() -> None:
    import ast
    import importlib

    packages = [p.parent for p in ROOT.glob("*/__init__.py") if p.parent.name not in ("tests", "benchmarks")]
    internal = sorted(str(p.relative_to(ROOT)) for pkg in packages for p in pkg.rglob("*.py")
                      if (doc := ast.get_docstring(ast.parse(p.read_text()))) and doc.startswith("Internal"))
    assert internal, "internal modules are marked by a docstring starting with 'Internal'"
    for name in ("load_turns", "explain_conversation", "load_turn_table", "build_report", "advise"):
        module = importlib.import_module(getattr(kvdiag, name).__module__)
        assert not (module.__doc__ or "").startswith("Internal"), module.__name__
