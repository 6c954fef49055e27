"""A real Prometheus scrapes the router and the emulated engines; every dashboard query must return data.

Two tests, both against the real ``prometheus`` binary on loopback:

* the expired-remote-read alert (from the generated rules) goes pending, then firing, while a
  catalog registry counts expiring reads (fast, no kvdiag processes);
* the full testbed: sim prefill + decode and the router as subprocesses, driven by the demo's
  workload phases (every verdict, runtime faults, short TTLs so reads expire), scraped every second.
  Then every dashboard query and template variable is evaluated through the HTTP API and must
  return data, and the expired-read alert must go pending -> firing.

Test-only rules: the production rules use 10 m windows and 10-15 m ``for:``. The test renders the
*same* rule functions (kvdiag.alerts.alert_rules) with a MixinConfig whose windows are 30 s, ``for:`` 5 s
and rate floors 0 (:func:`fast_rule_config`); thresholds, expressions and annotations are unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_server import PrometheusServer

from kvdiag.alerts.alert_rules import rule_file
from kvdiag.dashboards import build
from kvdiag.dashboards.promql import expand_template_vars
from kvdiag.exporters.prometheus import CatalogMetrics
from kvdiag.monitoring.config import DEFAULT_CONFIG, MixinConfig

ALERT = "KVDiagExpiredRemoteReadRatioHigh"
MODEL = "Qwen/Qwen3-32B"


def fast_rule_config() -> MixinConfig:
    """The production config with windows short enough for a test (see the module docstring)."""
    return dataclasses.replace(DEFAULT_CONFIG, rate_window="30s", for_ratio="5s", for_silent="5s", for_config="5s",
                               min_eligible_turn_rate=0.0, min_remote_read_rate=0.0)


def write_fast_rules(directory: Path) -> Path:
    """Write the test-only rule file derived from the real rules."""
    path = directory / "kvdiag-alerts-fast.yaml"
    path.write_text(yaml.safe_dump(rule_file(fast_rule_config()), sort_keys=True, width=100_000))
    return path


def wait_for_alert_states(prom: PrometheusServer, alertname: str, timeout: float) -> list[str]:
    """Poll the alerts API until ``alertname`` fires; return the distinct states in the order seen."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for state in sorted(prom.alert_states(alertname)):
            if state not in seen:
                seen.append(state)
        if "firing" in seen:
            break
        time.sleep(0.25)
    return seen


def test_expired_read_alert_goes_pending_then_firing(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    metrics = CatalogMetrics(registry, component="router")
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    stop = threading.Event()

    def traffic() -> None:
        # 2 attempted reads per tick, 1 of them expired: a 50% ratio once the series exist.
        reads = metrics.labels("kvdiag_remote_reads", model=MODEL)
        expired = metrics.labels("kvdiag_expired_remote_reads", model=MODEL)
        while not stop.wait(0.2):
            reads.inc(2)
            expired.inc()

    worker = threading.Thread(target=traffic, daemon=True)
    try:
        with PrometheusServer(tmp_path, {"kvdiag-router": [f"127.0.0.1:{server.server_port}"]},
                              rule_files=[write_fast_rules(tmp_path)]) as prom:
            prom.wait_for_targets_up()
            worker.start()
            seen = wait_for_alert_states(prom, ALERT, timeout=30)
            assert seen == ["pending", "firing"], seen
            (alert,) = [a for a in prom.api("alerts")["alerts"] if a["labels"]["alertname"] == ALERT]
            assert alert["labels"]["model"] == MODEL and alert["labels"]["severity"] == "warning"
            assert alert["annotations"]["runbook_url"].endswith("#kvdiagexpiredremotereadratiohigh")
            assert alert["annotations"]["description"].startswith("50% of D->P reads")
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


# --- the full testbed ---------------------------------------------------------------------------


def _dashboard_targets() -> list[tuple[str, str, str]]:
    return [(name, panel["title"], target["expr"]) for name, model in build.render().items()
            for panel in model["panels"] for target in panel.get("targets", [])]


def _variable_queries() -> list[tuple[str, str, str]]:
    out = []
    for name, model in build.render().items():
        for var in model["templating"]["list"]:
            if var["type"] == "query":
                match, label = var["query"].removeprefix("label_values(").removesuffix(")").rsplit(",", 1)
                out.append((name, match.strip(), label.strip()))
    return out


@pytest.mark.slow
def test_every_dashboard_query_returns_data_from_a_live_testbed(tmp_path: Path) -> None:
    from kvdiag.demo.processes import Component
    from kvdiag.demo.run import BLOCK_SIZE, FAULT_STEPS, LONG_REPLY, NEW_TOKENS, SHORT_REPLY, THRESHOLD, TIME_SCALE
    from kvdiag.demo.scenarios import DemoTimings, PhaseContext, phase1_plans, run_fault_step
    from kvdiag.sim.workload import WorkloadRunner
    from kvdiag.sim.workload_plan import ConversationPlan, TurnPlan, WorkloadConfig

    # D keeps blocks 8 s; the router keeps handles 7.5 s (> 8 - 5: the misconfiguration the alert is
    # about), so a 4 s gap reaches P with D's deadline inside P's 5 s margin: an expired remote read.
    timings = DemoTimings(decode_ttl=8.0, router_ttl=7.5, expired_read_gap=4.0, router_expired_gap=7.8)
    out = tmp_path / "bed"
    out.mkdir()

    def engine(role: str) -> list[str]:
        return ["sim", role, "--host", "127.0.0.1", "--port", "0", "--model", MODEL, "--mode", "instrumented",
                "--time-scale", str(TIME_SCALE), "--block-size", str(BLOCK_SIZE),
                "--kv-recompute-threshold", str(THRESHOLD), "--decoder-kv-blocks-ttl", f"{timings.decode_ttl:g}",
                "--log-file", str(out / f"{role}.log"), "--events-file", str(out / f"{role}-events.jsonl")]

    components: list[Component] = []
    try:
        prefill = Component.start("prefill", engine("prefill"), out)
        components.append(prefill)
        decode = Component.start("decode", engine("decode"), out)
        components.append(decode)
        router = Component.start("router", [
            "router", "--host", "127.0.0.1", "--port", "0",
            "--prefiller-host", "127.0.0.1", "--prefiller-port", str(prefill.port),
            "--decoder-host", "127.0.0.1", "--decoder-port", str(decode.port),
            "--decoder-kv-blocks-ttl", f"{timings.decode_ttl:g}", "--entry-ttl", f"{timings.router_ttl:g}"], out)
        components.append(router)
        jobs = {"kvdiag-router": [f"127.0.0.1:{router.port}"],
                "vllm": [f"127.0.0.1:{prefill.port}", f"127.0.0.1:{decode.port}"]}
        with PrometheusServer(tmp_path / "prom", jobs, rule_files=[write_fast_rules(tmp_path)]) as prom:
            prom.wait_for_targets_up()

            async def drive() -> None:
                config = WorkloadConfig(url=router.url, model=MODEL, new_tokens=NEW_TOKENS, max_tokens=SHORT_REPLY,
                                        concurrency=16, request_timeout=30.0)
                ctx = PhaseContext(prefill_url=prefill.url, decode_url=decode.url, restart_router=_no_restart,
                                   timings=timings)
                async with aiohttp.ClientSession() as session:
                    runner = WorkloadRunner(config, session)
                    plans = phase1_plans(timings, long_reply=LONG_REPLY, short_reply=SHORT_REPLY)
                    # Expiring conversations started 2 s apart, so the expired counter keeps rising after
                    # its series exists (rate() cannot see a series' first sample).
                    expiring = (TurnPlan(), TurnPlan(gap_s=timings.expired_read_gap, long_gap=True))
                    late = [ConversationPlan(conversation_id=f"late-{i}", max_tokens=LONG_REPLY, turns=expiring)
                            for i in range(5)]

                    async def run_later(plan: ConversationPlan, index: int, delay: float) -> None:
                        await asyncio.sleep(delay)
                        await runner.run_conversation(runner.new_conversation(plan, index))

                    await asyncio.gather(
                        *(run_later(p, i, 0.0) for i, p in enumerate(plans)),
                        *(run_later(p, len(plans) + i, 2.0 * i) for i, p in enumerate(late)))
                    for index, step in enumerate(FAULT_STEPS):
                        await run_fault_step(runner, ctx, step, index, LONG_REPLY)

            driver = threading.Thread(target=lambda: asyncio.run(drive()), daemon=True)
            driver.start()
            seen = wait_for_alert_states(prom, ALERT, timeout=45)
            driver.join(timeout=60)
            assert not driver.is_alive(), "the workload did not finish"
            assert seen[:1] == ["pending"] and "firing" in seen, f"{ALERT} states seen: {seen}"
            time.sleep(2)  # two more scrapes so the last turns' counters are in

            missing = []
            for name, title, expr in _dashboard_targets():
                result = prom.query(expand_template_vars(expr, {"__rate_interval": "5m"}))
                if not result:
                    missing.append(f"{name} / {title}: {expr}")
            for name, match, label in _variable_queries():
                if not prom.label_values(label, match):
                    missing.append(f"{name} variable label_values({match}, {label})")
            assert not missing, "queries without data:\n" + "\n".join(missing)
    finally:
        for comp in reversed(components):
            comp.stop()


async def _no_restart() -> str:
    raise AssertionError("this test does not restart the router")
