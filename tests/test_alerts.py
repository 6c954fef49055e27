"""Alert rules: committed YAML matches the generator, promtool checks and unit-tests it, runbooks exist.

promtool is the real binary from Debian's prometheus package (``make sysdeps`` installs it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from kvdiag.alerts import build
from kvdiag.alerts.alert_rules import alert_rules, rule_file
from kvdiag.cli.main import cli
from kvdiag.dashboards.promql import bare_counter_selectors, unknown_metric_names
from kvdiag.monitoring.config import DEFAULT_CONFIG
from kvdiag.schema.metrics import all_exposed_names

REPO = Path(__file__).resolve().parents[1]
RULES_FILE = REPO / "alerts" / "kvdiag-alerts.yaml"
PROMTOOL_TESTS = sorted((REPO / "tests" / "promtool").glob("*.yaml"))
RULES = alert_rules(DEFAULT_CONFIG)


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not found: `make sysdeps` (apt-get install prometheus) installs it"
    return path


def test_committed_rules_match_generator() -> None:
    assert RULES_FILE.read_text(encoding="utf-8") == build.dumps(), (
        "alerts/kvdiag-alerts.yaml is stale: run `python -m kvdiag.alerts.build --out alerts/kvdiag-alerts.yaml`")


def test_promtool_check_rules() -> None:
    proc = subprocess.run([_promtool(), "check", "rules", str(RULES_FILE)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(RULES)} rules found" in proc.stdout


def test_promtool_unit_tests_pass() -> None:
    assert PROMTOOL_TESTS
    proc = subprocess.run([_promtool(), "test", "rules", *map(str, PROMTOOL_TESTS)], capture_output=True,
                          text=True, timeout=120, check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_unit_tests_can_fail(tmp_path: Path) -> None:
    # A wrong expected annotation must make promtool fail, or the suite above proves nothing.
    source = PROMTOOL_TESTS[0]
    broken = source.read_text().replace("is 95% full", "is 94% full")
    assert broken != source.read_text()
    copy = tmp_path / "tests" / "promtool" / source.name
    copy.parent.mkdir(parents=True)
    copy.write_text(broken.replace("../../alerts/kvdiag-alerts.yaml", str(RULES_FILE)))
    proc = subprocess.run([_promtool(), "test", "rules", str(copy)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode != 0
    assert "KVDiagRouterStoreNearCapacity" in proc.stdout + proc.stderr


def _promtool_cases() -> dict[str, list[dict[str, Any]]]:
    cases: dict[str, list[dict[str, Any]]] = {}
    for path in PROMTOOL_TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test["alert_rule_test"]:
                cases.setdefault(case["alertname"], []).append(case)
    return cases


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_every_alert_has_firing_and_not_yet_firing_cases(rule: Any) -> None:
    cases = _promtool_cases().get(rule.name, [])
    assert any(not c.get("exp_alerts") for c in cases), f"{rule.name}: no not-yet-firing case"
    firing = [a for c in cases for a in c.get("exp_alerts") or []]
    assert firing, f"{rule.name}: no firing case"
    for alert in firing:
        assert set(alert["exp_annotations"]) == {"summary", "description", "runbook_url"}
        assert alert["exp_annotations"]["runbook_url"] == DEFAULT_CONFIG.runbook_url(rule.name)
        assert alert["exp_labels"]["severity"] == rule.severity


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_rule_shape(rule: Any) -> None:
    assert re.fullmatch(r"KVDiag(?:[A-Z][a-z]*|TTL)+", rule.name), rule.name
    assert rule.severity in ("critical", "warning", "info")
    assert rule.for_ and rule.summary and len(rule.description) > 60
    assert not unknown_metric_names(rule.expr), rule.expr
    assert not bare_counter_selectors(rule.expr), rule.expr
    # A rate floor: every rule gates on traffic with `and ... >` or `... > floor unless ...`.
    assert " and " in rule.expr or " unless " in rule.expr, rule.expr
    assert set(re.findall(r"\[([^\]]+)\]", rule.expr)) == {DEFAULT_CONFIG.rate_window}


def test_issue_alerts_are_all_present() -> None:
    assert {r.name for r in RULES} == {
        "KVDiagExpiredRemoteReadRatioHigh", "KVDiagMissingMetadataRatioHigh", "KVDiagBidirectionalReuseOff",
        "KVDiagRouterTTLNotBelowDecodeTTL", "KVDiagTransferFailureRatioHigh",
        "KVDiagTransferSlowerThanRecompute", "KVDiagRouterStoreNearCapacity", "KVDiagHandlesMostlyTrimmed"}
    assert all(n.startswith("kvdiag_") for n in all_exposed_names())


def test_runbook_has_a_section_per_alert() -> None:
    text = (REPO / "docs" / "runbooks.md").read_text(encoding="utf-8")
    headings = {h.strip().lower() for h in re.findall(r"^## (.+)$", text, flags=re.MULTILINE)}
    for rule in RULES:
        assert rule.name.lower() in headings, f"docs/runbooks.md lacks '## {rule.name}'"
        section = text.split(f"## {rule.name}\n", 1)[1].split("\n## ", 1)[0]
        assert "Check" in section and "Fix" in section, f"{rule.name}: runbook must say what to check and fix"


def test_rule_file_groups_are_stable_and_unique() -> None:
    content = rule_file(DEFAULT_CONFIG)
    names = [r["alert"] for g in content["groups"] for r in g["rules"]]
    assert len(names) == len(set(names)) == len(RULES)
    assert [g["name"] for g in content["groups"]] == ["kvdiag-reuse", "kvdiag-transfer", "kvdiag-router"]


def test_cli_export(tmp_path: Path) -> None:
    out = tmp_path / "rules" / "kvdiag.yaml"
    missing = CliRunner().invoke(cli, ["alerts", "export", "--out", str(out)])
    assert missing.exit_code == 2 and "--runbook-base-url" in missing.output  # no default link to a missing page
    result = CliRunner().invoke(cli, ["alerts", "export", "--out", str(out), "--runbook-base-url",
                                      DEFAULT_CONFIG.runbook_base_url])
    assert result.exit_code == 0, result.output
    assert out.read_text() == RULES_FILE.read_text()
    custom = CliRunner().invoke(cli, ["alerts", "export", "--out", str(out), "--runbook-base-url",
                                      "https://wiki.example/kv"])
    assert custom.exit_code == 0
    assert "https://wiki.example/kv#kvdiagbidirectionalreuseoff" in out.read_text()
    bad = CliRunner().invoke(cli, ["alerts", "export", "--out", str(out), "--router-selector", "{job='x'}",
                                   "--runbook-base-url", "https://wiki.example/kv"])
    assert bad.exit_code == 1 and "without braces" in bad.output
