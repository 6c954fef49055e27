"""The tree shows the data path: imports run with the flow (emit -> collect -> correlate -> show), no module
grows past 800 lines, and code and docs name only files that exist in this repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What each subpackage may import besides itself. schema is the shared vocabulary; monitoring is the one
# configuration of the dashboards and the alert rules. Emitters (sim, router, instrumentation) hand their
# records to the collectors (exporters). The correlators (diagnostics, check) read what was emitted as files
# and scrapes, never the emitters' code. cli and demo sit on top and may use everything.
ALLOWED: dict[str, frozenset[str]] = {
    "schema": frozenset(),
    "monitoring": frozenset({"schema"}),
    "exporters": frozenset({"schema"}),
    "sim": frozenset({"schema", "exporters"}),
    "router": frozenset({"schema", "exporters"}),
    "instrumentation": frozenset({"schema", "exporters"}),
    "diagnostics": frozenset({"schema"}),
    "check": frozenset({"schema"}),
    "dashboards": frozenset({"schema", "monitoring"}),
    "alerts": frozenset({"schema", "monitoring"}),
    "demo": frozenset({"schema", "sim", "router", "exporters", "diagnostics"}),
    "cli": frozenset({"schema", "sim", "router", "exporters", "diagnostics", "check", "dashboards", "alerts",
                      "monitoring", "demo"}),
}
MAX_LINES = 800


def kvdiag_imports(source: str) -> list[tuple[int, str]]:
    """(line, subpackage) of every ``kvdiag.<subpackage>`` import in ``source``, lazy ones included."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "kvdiag" else [f"kvdiag.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        out += [(node.lineno, n.split(".")[1]) for n in names if n.startswith("kvdiag.")]
    return out


def flow_violations(package: str, source: str) -> list[str]:
    """The imports in one module of ``package`` that run against the flow."""
    allowed = ALLOWED[package] | {package}
    return [f"line {line}: kvdiag.{target}" for line, target in kvdiag_imports(source)
            if target in ALLOWED and target not in allowed]


def _modules() -> list[Path]:
    return sorted(p for package in ALLOWED for p in (ROOT / package).rglob("*.py"))


def test_every_top_level_package_has_a_place_in_the_flow() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages - {"tests", "benchmarks"} == set(ALLOWED), "add the new folder to ALLOWED (its place in the flow)"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_run_with_the_flow(package: str) -> None:
    bad = {str(p.relative_to(ROOT)): v for p in (ROOT / package).rglob("*.py")
           if (v := flow_violations(package, p.read_text()))}
    assert bad == {}, f"imports against emit -> collect -> correlate -> show: {bad}"


def test_the_flow_check_catches_a_back_edge() -> None:
    # Negative control: each edge the layout removed would be caught, a lazy import inside a function too.
    assert flow_violations("sim", "from kvdiag.instrumentation.connector import X\n") == [
        "line 1: kvdiag.instrumentation"]
    assert flow_violations("diagnostics", "def f():\n    from kvdiag.exporters import parquet\n") == [
        "line 2: kvdiag.exporters"]
    assert flow_violations("alerts", "import kvdiag.dashboards.build\n") == ["line 1: kvdiag.dashboards"]
    assert flow_violations("schema", "from kvdiag import sim\n") == ["line 1: kvdiag.sim"]
    assert flow_violations("router", "from kvdiag.router.store import X\nfrom kvdiag.schema import y\n") == []


def test_nothing_imports_the_code_that_runs_inside_vllm() -> None:
    users = [str(p.relative_to(ROOT)) for p in _modules() if not p.is_relative_to(ROOT / "instrumentation")
             and any(t == "instrumentation" for _, t in kvdiag_imports(p.read_text()))]
    assert users == []


def test_no_module_over_800_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in [*_modules(), *(ROOT / "benchmarks").glob("*.py")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by concern: {long}"


def test_no_two_modules_share_a_file_name_across_packages() -> None:
    # One name, one job: the same stem in two packages (vllm_log.py written by the sim, parsed by
    # diagnostics) hid opposite jobs behind one word.
    # Allowed twice: the package's own entry points and options, the same job for each package.
    seen: dict[str, list[str]] = {}
    for p in _modules():
        if p.name not in {"__init__.py", "__main__.py", "config.py", "build.py", "run.py"}:
            seen.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}


# Files named in code and docs: a path ending in a known extension, optionally inside backticks.
_FILE_REF = re.compile(r"(?<![\w/.-])((?:\.\./)*(?:[\w.-]+/)*[\w-]+\.(?:md|py|yaml|json|txt))\b")
_OUTSIDE = re.compile(r"\b(?:vllm|routers|vllm-bidir-observed|observability|style|article)\.md\b|shared/reference")


def test_nothing_cites_a_note_outside_the_repository() -> None:
    texts = [*_modules(), *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "docs").glob("*.md"),
             ROOT / "README.md", ROOT / "BENCHMARKS.md"]
    cites = [f"{p.relative_to(ROOT)}:{i}" for p in texts for i, line in enumerate(p.read_text().splitlines(), 1)
             if _OUTSIDE.search(line)]
    assert cites == [], f"put the fact into docs/ and cite that instead: {cites}"


def _repo_file_exists(ref: str, page: Path) -> bool:
    candidates = [page.parent / ref, ROOT / ref, ROOT / "docs" / ref]
    if ref.startswith("kvdiag/"):
        candidates.append(ROOT / ref.removeprefix("kvdiag/"))
    return any(c.exists() for c in candidates)


# Files of other projects the docs talk about (vLLM's proxy, benchmark client and tests, Helm values, ...):
# they live in those projects, which the text names beside them.
_THIRD_PARTY = re.compile(r"disagg_proxy|benchmark_serving|vllm/|tests/v1/|distributed/|values\.yaml|kustomization|"
                          r"prometheus\.yml|docker-compose|config\.json|tokenizer|chat_template|setup\.py|"
                          r"^(?:__init__|__main__|conftest)\.py$")


_OUTPUT_OPTION = re.compile(r"--(?:out|csv|json|html|parquet|output)[ =]\S+")


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: p.name)
def test_docs_name_only_files_that_exist(page: Path) -> None:
    # Paths given to an output option are files the command writes, not references.
    text = _OUTPUT_OPTION.sub("", page.read_text())
    missing = sorted({ref for ref in _FILE_REF.findall(text)
                      if "/" in ref or ref.endswith(".md")
                      if not _THIRD_PARTY.search(ref) and not _repo_file_exists(ref, page)})
    assert missing == [], f"{page.relative_to(ROOT)} names files that are not in the repository: {missing}"


def test_the_file_check_catches_a_missing_file(tmp_path: Path) -> None:
    assert not _repo_file_exists("docs/no-such-page.md", ROOT / "README.md")
    assert _repo_file_exists("docs/design.md", ROOT / "README.md")
    assert _FILE_REF.findall("see `diagnostics/rules.py` and elsewhere.md") == ["diagnostics/rules.py", "elsewhere.md"]
