"""Kubernetes artefacts: the PrometheusRule and dashboard ConfigMap exports, and the deploy/ examples.

Every object is validated against tests/k8s_schemas/kubernetes.schema.json (JSON Schema 2020-12,
closed objects: a misspelt field fails) with the real ``jsonschema`` package; each rule has a
negative control showing the validation fails on the mistake it exists for. The PrometheusRule's
groups are extracted and checked by the real promtool (rules and unit tests). The deploy examples
are also checked for what a schema cannot see: selectors that select, port names that exist, the
job labels the alerts and dashboards select, router and check arguments kvdiag's own CLI accepts,
and vLLM arguments vLLM's own parser accepts.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from click.testing import CliRunner
from jsonschema import Draft202012Validator

from kvdiag.alerts.alert_rules import alert_rules, rule_file
from kvdiag.alerts.prometheus_rule import prometheus_rule, rule_groups
from kvdiag.cli.main import cli
from kvdiag.dashboards import build
from kvdiag.dashboards.configmaps import APPLY_ANNOTATION_LIMIT_BYTES, configmaps
from kvdiag.monitoring.config import DEFAULT_CONFIG, MonitoringConfigError
from kvdiag.monitoring.k8s_objects import parse_labels

REPO = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((REPO / "tests" / "k8s_schemas" / "kubernetes.schema.json").read_text())
DEPLOY = sorted((REPO / "deploy").glob("*.yaml"))
RUNBOOK_URL = DEFAULT_CONFIG.runbook_base_url


def schema_errors(doc: Any) -> list[str]:
    """Every schema violation of one object, as ``path: message``."""
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if kind not in SCHEMA["$defs"] or not kind[0].isupper():
        return [f"kind {kind!r} has no schema here"]
    validator = Draft202012Validator({**SCHEMA, "$ref": f"#/$defs/{kind}"})
    return sorted(f"{'/'.join(map(str, e.absolute_path)) or '.'}: {e.message}" for e in validator.iter_errors(doc))


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not found: `make sysdeps` (apt-get install prometheus) installs it"
    return path


def test_the_schema_is_a_valid_json_schema() -> None:
    Draft202012Validator.check_schema(SCHEMA)


# --- PrometheusRule ---------------------------------------------------------------------------------

def _export_rule(tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "rule.yaml"
    result = CliRunner().invoke(cli, ["alerts", "export", "--format", "prometheusrule", "--out", str(out),
                                      "--runbook-base-url", RUNBOOK_URL, *extra])
    assert result.exit_code == 0, result.output
    docs = load_all(out)
    assert len(docs) == 1
    return docs[0]


def test_prometheusrule_export_validates_and_wraps_the_same_groups(tmp_path: Path) -> None:
    doc = _export_rule(tmp_path, "--namespace", "monitoring", "--label", "release=prometheus")
    assert schema_errors(doc) == []
    assert doc["metadata"]["namespace"] == "monitoring" and doc["metadata"]["labels"]["release"] == "prometheus"
    assert rule_groups(doc) == rule_file(DEFAULT_CONFIG)
    assert schema_errors(_export_rule(tmp_path)) == []


def test_prometheusrule_groups_pass_promtool_check_and_unit_tests(tmp_path: Path) -> None:
    doc = _export_rule(tmp_path)
    extracted = tmp_path / "alerts" / "kvdiag-alerts.yaml"
    extracted.parent.mkdir()
    extracted.write_text(yaml.safe_dump(rule_groups(doc), sort_keys=False, width=100_000))
    proc = subprocess.run([_promtool(), "check", "rules", str(extracted)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alert_rules(DEFAULT_CONFIG))} rules found" in proc.stdout
    # The committed promtool unit tests, pointed at the groups taken out of the PrometheusRule.
    source = REPO / "tests" / "promtool" / "kvdiag-alerts-test.yaml"
    unit = tmp_path / "unit.yaml"
    unit.write_text(source.read_text().replace("../../alerts/kvdiag-alerts.yaml", str(extracted)))
    proc = subprocess.run([_promtool(), "test", "rules", str(unit)], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _rule(doc: dict[str, Any]) -> dict[str, Any]:
    rule: dict[str, Any] = doc["spec"]["groups"][0]["rules"][0]
    return rule


RULE_MISTAKES = [
    ("rule without expr", lambda d: _rule(d).pop("expr"), "'expr' is a required property"),
    ("for in words", lambda d: _rule(d).__setitem__("for", "10 minutes"), "spec/groups/0/rules/0/for"),
    ("label value with a space", lambda d: d["metadata"]["labels"].__setitem__("release", "kube prometheus"),
     "metadata/labels/release"),
    ("upper-case name", lambda d: d["metadata"].__setitem__("name", "KVDiag_Alerts"), "metadata/name"),
    ("misspelt group field", lambda d: d["spec"]["groups"][0].__setitem__("rule", []), "'rule' was unexpected"),
    ("alert and record", lambda d: _rule(d).__setitem__("record", "x:y"), "spec/groups/0/rules/0"),
    ("annotation not a string", lambda d: _rule(d)["annotations"].__setitem__("runbook_url", 1),
     "runbook_url: 1 is not of type 'string'"),
    ("wrong apiVersion", lambda d: d.__setitem__("apiVersion", "monitoring.coreos.com/v1beta1"), "apiVersion"),
]


@pytest.mark.parametrize(("name", "mutate", "expected"), RULE_MISTAKES, ids=[m[0] for m in RULE_MISTAKES])
def test_prometheusrule_validation_catches(name: str, mutate: Any, expected: str) -> None:
    doc = copy.deepcopy(prometheus_rule(DEFAULT_CONFIG, namespace="monitoring", labels={"release": "p"}))
    assert schema_errors(doc) == []
    mutate(doc)
    errors = schema_errors(doc)
    assert any(expected in e for e in errors), errors


def test_export_options_are_validated_before_writing(tmp_path: Path) -> None:
    out = tmp_path / "x.yaml"
    for bad, phrase in ((["--label", "release"], "KEY=VALUE"), (["--label", "a b=c"], "label key"),
                        (["--namespace", "Monitoring"], "not a namespace name"), (["--name", "KV"], "object name")):
        result = CliRunner().invoke(cli, ["alerts", "export", "--format", "prometheusrule", "--out", str(out),
                                          "--runbook-base-url", RUNBOOK_URL, *bad])
        assert result.exit_code == 1 and phrase in result.output, result.output
    assert not out.exists()
    with pytest.raises(MonitoringConfigError):
        parse_labels(["grafana_dashboard=not ok"])


def test_runbook_links_need_a_base_url_and_the_shipped_runbooks_have_each_anchor(tmp_path: Path) -> None:
    missing = CliRunner().invoke(cli, ["alerts", "export", "--format", "prometheusrule", "--out", "-"])
    assert missing.exit_code == 2 and "--runbook-base-url" in missing.output
    out = tmp_path / "runbooks.md"
    result = CliRunner().invoke(cli, ["alerts", "runbooks", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text() == (REPO / "docs" / "runbooks.md").read_text()
    anchors = {h.strip().lower() for h in re.findall(r"^## (.+)$", out.read_text(), flags=re.MULTILINE)}
    doc = _export_rule(tmp_path)
    for group in doc["spec"]["groups"]:
        for rule in group["rules"]:
            url = rule["annotations"]["runbook_url"]
            assert url.startswith(RUNBOOK_URL + "#") and url.split("#", 1)[1] in anchors, url


# --- dashboard ConfigMaps -------------------------------------------------------------------------

def _export_configmaps(tmp_path: Path, *extra: str) -> list[dict[str, Any]]:
    out = tmp_path / "dashboards.yaml"
    result = CliRunner().invoke(cli, ["dashboards", "export", "--format", "configmap", "--out", str(out), *extra])
    assert result.exit_code == 0, result.output
    return load_all(out)


def test_configmap_export_validates_and_holds_the_dashboards(tmp_path: Path) -> None:
    docs = _export_configmaps(tmp_path, "--namespace", "monitoring", "--folder", "LLM serving")
    rendered = build.render()
    assert sorted(k for d in docs for k in d["data"]) == sorted(rendered)
    for doc in docs:
        assert schema_errors(doc) == [], doc["metadata"]["name"]
        assert doc["metadata"]["labels"]["grafana_dashboard"] == "1"     # a string: the sidecar compares text
        assert doc["metadata"]["annotations"]["grafana_folder"] == "LLM serving"
        (name, body), = doc["data"].items()
        assert json.loads(body) == rendered[name]
        assert body == build.dumps(rendered[name])                     # byte-identical to the JSON export
        assert len(yaml.safe_dump(doc).encode()) < APPLY_ANNOTATION_LIMIT_BYTES
    custom = _export_configmaps(tmp_path, "--sidecar-label", "grafana_dashboard=kvdiag", "--label", "team=llm")
    assert all(d["metadata"]["labels"]["grafana_dashboard"] == "kvdiag" for d in custom)
    assert all(d["metadata"]["labels"]["team"] == "llm" for d in custom)


CONFIGMAP_MISTAKES = [
    ("sidecar label as a YAML number", lambda d: d["metadata"]["labels"].__setitem__("grafana_dashboard", 1),
     "grafana_dashboard: 1 is not of type 'string'"),
    ("dashboard as a YAML object", lambda d: d["data"].__setitem__("kv-reuse.json", {"panels": []}),
     "is not of type 'string'"),
    ("data key with a slash", lambda d: d["data"].__setitem__("dash/x.json", "{}"), "data"),
    ("misspelt data", lambda d: d.__setitem__("dat", d.pop("data")), "'dat' was unexpected"),
]


@pytest.mark.parametrize(("name", "mutate", "expected"), CONFIGMAP_MISTAKES, ids=[m[0] for m in CONFIGMAP_MISTAKES])
def test_configmap_validation_catches(name: str, mutate: Any, expected: str) -> None:
    doc = copy.deepcopy(configmaps(DEFAULT_CONFIG)[0])
    assert schema_errors(doc) == []
    mutate(doc)
    errors = schema_errors(doc)
    assert any(expected in e for e in errors), errors


# --- deploy/ examples -------------------------------------------------------------------------------

def _deploy_docs() -> list[dict[str, Any]]:
    return [d for path in DEPLOY for d in load_all(path)]


@pytest.mark.parametrize("path", DEPLOY, ids=[p.name for p in DEPLOY])
def test_deploy_manifests_validate(path: Path) -> None:
    docs = load_all(path)
    assert docs
    for doc in docs:
        assert schema_errors(doc) == [], f"{path.name}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}"


def test_deploy_validation_catches_a_misspelt_field() -> None:
    doc = copy.deepcopy(next(d for d in _deploy_docs() if d["kind"] == "Deployment"))
    spec = doc["spec"]["template"]["spec"]
    spec["contianers"] = spec.pop("containers")
    assert any("'contianers' was unexpected" in e for e in schema_errors(doc))


def _workloads(docs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    return (d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job"))


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _container_ports(workload: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in workload["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", []) if "name" in p}


def _job_of(selector: str) -> str:
    found = re.fullmatch(r'job="([^"]+)"', selector)
    assert found, selector
    return found.group(1)


def _router_args(docs: list[dict[str, Any]]) -> list[str]:
    router = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvdiag-router")
    args: list[str] = router["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def cross_errors(docs: list[dict[str, Any]]) -> list[str]:
    """What a schema cannot see: references between the objects of the deploy example."""
    errors: list[str] = []
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    workloads = list(_workloads(docs))
    for w in workloads:
        labels = w["spec"]["template"]["metadata"].get("labels", {})
        selector = w["spec"].get("selector", {}).get("matchLabels")
        if selector is not None and not _matches(selector, labels):
            errors.append(f"{w['metadata']['name']}: selector {selector} does not match its pod labels {labels}")
        for c in w["spec"]["template"]["spec"]["containers"]:
            for probe in (c.get("readinessProbe"), c.get("livenessProbe")):
                port = (probe or {}).get("httpGet", {}).get("port")
                if isinstance(port, str) and port not in _container_ports(w):
                    errors.append(f"{w['metadata']['name']}: probe port {port!r} is not a container port")
        if w["kind"] == "StatefulSet":
            svc = services.get(w["spec"]["serviceName"])
            if svc is None or svc["spec"].get("clusterIP") != "None":
                errors.append(f"{w['metadata']['name']}: serviceName {w['spec']['serviceName']} is no headless Service")
    for name, svc in services.items():
        backends = [w for w in workloads if _matches(svc["spec"].get("selector", {}),
                                                       w["spec"]["template"]["metadata"].get("labels", {}))]
        if not backends:
            errors.append(f"Service {name}: its selector matches no pod template")
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort")
            if isinstance(target, str) and not any(target in _container_ports(w) for w in backends):
                errors.append(f"Service {name}: targetPort {target!r} is not a port of its pods")
    for mon in (d for d in docs if d["kind"] == "ServiceMonitor"):
        chosen = [s for s in services.values() if _matches(mon["spec"]["selector"]["matchLabels"],
                                                             s["metadata"].get("labels", {}))]
        if not chosen:
            errors.append(f"ServiceMonitor {mon['metadata']['name']}: selects no Service")
        for ep in mon["spec"]["endpoints"]:
            if not any(ep["port"] == p.get("name") for s in chosen for p in s["spec"]["ports"]):
                errors.append(f"ServiceMonitor {mon['metadata']['name']}: port {ep['port']!r} is on no selected "
                              "Service")
        if "jobLabel" not in mon["spec"] and _job_of(DEFAULT_CONFIG.router_selector) not in {
                s["metadata"]["name"] for s in chosen}:
            errors.append(f"ServiceMonitor {mon['metadata']['name']}: job (the Service name) is not "
                          f"{DEFAULT_CONFIG.router_selector}, which the alerts and dashboards select")
    for mon in (d for d in docs if d["kind"] == "PodMonitor"):
        pods = [w for w in workloads if _matches(mon["spec"]["selector"]["matchLabels"],
                                                 w["spec"]["template"]["metadata"].get("labels", {}))]
        if not pods:
            errors.append(f"PodMonitor {mon['metadata']['name']}: selects no pods")
        for ep in mon["spec"]["podMetricsEndpoints"]:
            if not pods or not all(ep["port"] in _container_ports(w) for w in pods):
                errors.append(f"PodMonitor {mon['metadata']['name']}: port {ep['port']!r} is not on every pod")
            jobs = [r.get("replacement") for r in ep.get("relabelings", []) if r.get("targetLabel") == "job"]
            if jobs != [_job_of(DEFAULT_CONFIG.vllm_selector)]:
                errors.append(f"PodMonitor {mon['metadata']['name']}: job is {jobs}, the dashboards select "
                              f"{DEFAULT_CONFIG.vllm_selector}")
    errors += _router_reference_errors(docs, services)
    return errors


def _router_reference_errors(docs: list[dict[str, Any]], services: dict[str, dict[str, Any]]) -> list[str]:
    errors = []
    args = dict(a.removeprefix("--").split("=", 1) for a in _router_args(docs) if a.startswith("--") and "=" in a)
    state = re.fullmatch(r"redis://([^:/]+):(\d+)/\d+", args.get("state", ""))
    if state is None or state.group(1) not in services or int(state.group(2)) not in {
            p["port"] for p in services[state.group(1)]["spec"]["ports"]}:
        errors.append(f"router --state {args.get('state')!r} is not a Redis Service of the example")
    sets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    for role in ("prefiller", "decoder"):
        host, port = args.get(f"{role}-hosts", ""), int(args.get(f"{role}-ports", "0"))
        pod = re.fullmatch(r"([a-z0-9-]+)-(\d+)\.([a-z0-9-]+)", host)
        sts = sets.get(pod.group(1)) if pod else None
        if pod is None or sts is None or sts["spec"]["serviceName"] != pod.group(3) or int(pod.group(2)) >= sts[
                "spec"].get("replicas", 1) or port not in _container_ports(sts).values():
            errors.append(f"router --{role}-hosts {host}:{port} is not a pod of the example's StatefulSets")
    return errors


def test_deploy_example_references_resolve() -> None:
    assert cross_errors(_deploy_docs()) == []


CROSS_MISTAKES = [
    ("ServiceMonitor port that no Service has",
     lambda ds: next(d for d in ds if d["kind"] == "ServiceMonitor")["spec"]["endpoints"][0].__setitem__("port",
                                                                                                         "metrics"),
     "port 'metrics' is on no selected Service"),
    ("router Service renamed (job label)",
     lambda ds: next(d for d in ds if d["kind"] == "Service" and d["metadata"]["name"] == "kvdiag-router")[
         "metadata"].__setitem__("name", "router"), "job (the Service name)"),
    ("router pointing at a P pod that does not exist",
     lambda ds: _router_args(ds).__setitem__(_router_args(ds).index("--prefiller-hosts=vllm-prefill-0.vllm-prefill"),
                                             "--prefiller-hosts=vllm-prefill-1.vllm-prefill"),
     "--prefiller-hosts vllm-prefill-1"),
    ("PodMonitor without the job relabeling",
     lambda ds: next(d for d in ds if d["kind"] == "PodMonitor")["spec"]["podMetricsEndpoints"][0].pop(
         "relabelings"), 'the dashboards select job="vllm"'),
    ("Deployment selector that misses its pods",
     lambda ds: next(d for d in ds if d["kind"] == "Deployment")["spec"]["selector"]["matchLabels"].__setitem__(
         "app.kubernetes.io/name", "other"), "does not match its pod labels"),
]


@pytest.mark.parametrize(("name", "mutate", "expected"), CROSS_MISTAKES, ids=[m[0] for m in CROSS_MISTAKES])
def test_deploy_cross_checks_catch(name: str, mutate: Any, expected: str) -> None:
    docs = copy.deepcopy(_deploy_docs())
    mutate(docs)
    errors = cross_errors(docs)
    assert any(expected in e for e in errors), errors


def test_deploy_kvdiag_arguments_parse_with_kvdiag_itself() -> None:
    docs = _deploy_docs()
    for doc in _workloads(docs):
        for container in doc["spec"]["template"]["spec"]["containers"]:
            if "kvdiag" not in container["image"]:
                continue
            name, *args = container["args"]
            ctx = click.Context(cli)
            command = cli.get_command(ctx, name)
            assert command is not None, name
            parsed = command.make_context(name, list(args))   # raises on an unknown or malformed option
            assert parsed.params
    bad = [*_router_args(docs)[1:], "--prefiller-hostz=x"]
    with pytest.raises(click.UsageError):
        cli.get_command(click.Context(cli), "router").make_context("router", bad)  # type: ignore[union-attr]


_PARSE_WITH_VLLM = """
import json, sys
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
out = []
for args in json.loads(sys.argv[1]):
    try:
        ns = parser.parse_args(args)
    except SystemExit as exc:
        out.append({"error": exc.code})
        continue
    kv = ns.kv_transfer_config
    out.append({"model": ns.model_tag, "connector": kv.kv_connector, "extra": kv.kv_connector_extra_config,
                "prompt_tokens_details": ns.enable_prompt_tokens_details, "prefix_caching": ns.enable_prefix_caching})
print(json.dumps(out))
"""


@pytest.mark.vllm
def test_deploy_vllm_arguments_parse_with_vllm_itself() -> None:
    engines = [d for d in _deploy_docs() if d["kind"] == "StatefulSet"]
    assert {d["metadata"]["name"] for d in engines} == {"vllm-prefill", "vllm-decode"}
    containers = [sts["spec"]["template"]["spec"]["containers"][0] for sts in engines]
    assert all(c["command"] == ["vllm", "serve"] for c in containers)
    cases = [c["args"] for c in containers] + [["Qwen/Qwen3-32B", "--enable-prefx-caching"]]  # negative control
    # vLLM is imported in a child process (its import warns, and this suite turns warnings into errors).
    proc = subprocess.run([sys.executable, "-c", _PARSE_WITH_VLLM, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300, check=False, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    *parsed, bad = json.loads(proc.stdout.strip().splitlines()[-1])
    for ns in parsed:
        assert ns["model"] == "Qwen/Qwen3-32B" and ns["connector"] == "NixlConnector"
        assert ns["extra"]["bidirectional_kv_xfer"] is True
        assert ns["prompt_tokens_details"] is True  # cached_tokens in usage: the router and kvdiag check read it
    assert bad == {"error": 2}
