"""``kvdiag explain`` at INFO on the project's real-vLLM testbed (issue 12's acceptance run).

P and D are ``kvdiag sim prefill|decode --engine vllm`` (vLLM 0.33's real Scheduler, the instrumented
NixlConnector, real NIXL on CPU; P without prefix caching, the article's setup), behind ``kvdiag router
--proxy-log``, at INFO. Their stat lines are vLLM's own ``LoggingStatLogger`` fed each step's
scheduler and connector stats, every 2 s (``--log-stats-interval``), and P logs vLLM's startup config
line. The truth is what the router and P's connector recorded; explain reads only the stock files
(P's and D's logs, the proxy log, the benchmark's client statistics).

* one conversation, turns 4.5 s apart: every read is alone in its stats windows, so every successful
  D->P read is ``remote_hit`` (inferred), none ``unknown``;
* six conversations at once: reads share windows; no wrong verdict, and an ``unknown`` names the
  window it shares;
* negative control: the same logs without P's stat lines (what the testbed wrote before) decide none
  of those reads.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from vllm_harness.testbed import real_vllm_testbed, run_retrying_handshake

from kvdiag.diagnostics.turn_loader import load_turns
from kvdiag.schema.events import read_events
from kvdiag.sim.workload import run_workload
from kvdiag.sim.workload_plan import ConversationPlan, TurnPlan, WorkloadConfig

pytestmark = pytest.mark.vllm

INTERVAL_S = 2.0
STOCK = ("prefill.log", "decode.log", "proxy.log", "client-stats.json")
SERIAL = ConversationPlan("info-serial", (TurnPlan(), *(TurnPlan(gap_s=4.5) for _ in range(4))))
CROWD = tuple(ConversationPlan(f"info-crowd-{i}", (TurnPlan(), TurnPlan(gap_s=0.2), TurnPlan(gap_s=0.2)))
              for i in range(6))
STAT_LINE = re.compile(r"\] (Engine 000: |KV Transfer metrics: )")


def _workload(url: str, out: Path, plans: tuple[ConversationPlan, ...], name: str) -> dict[str, int]:
    config = WorkloadConfig(url=url, conversations=len(plans), turns=len(plans[0].turns), concurrency=len(plans),
                            max_tokens=24, new_tokens=40, seed=11)
    result = asyncio.run(run_workload(config, plans, client_log=out / f"client-{name}.jsonl",
                                      stats_json=out / f"client-stats-{name}.json"))
    return result.status_counts()


def _run(out: Path) -> None:
    flags = ["--log-stats-interval", f"{INTERVAL_S:g}"]
    started = time.monotonic()
    with real_vllm_testbed(out, p_flags=flags, d_flags=flags, router_flags=["--proxy-log", str(out / "proxy.log")],
                           console_suffix=".console.txt") as bed:
        url = bed.router.url
        assert _workload(url, out, (SERIAL,), "serial") == {"ok": 5}
        time.sleep(3 * INTERVAL_S)  # the serial reads' windows close before the crowd arrives
        assert _workload(url, out, CROWD, "crowd") == {"ok": 18}
        time.sleep(3 * INTERVAL_S)
        # traffic goes on after them: the proxy log outlasts the last reads' windows, as in production
        _workload(url, out, (replace(SERIAL, conversation_id="info-tail", turns=(TurnPlan(),)),), "tail")
        time.sleep(INTERVAL_S + 1.0)
    # the benchmark's statistics, as one run of it writes them (one file)
    stats = [rec for name in ("serial", "crowd", "tail") for rec in json.loads(
        (out / f"client-stats-{name}.json").read_text())]
    (out / "client-stats.json").write_text(json.dumps(stats, indent=2))
    (out / "runtime.txt").write_text(f"{time.monotonic() - started:.1f}\n")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_retrying_handshake(lambda: tmp_path_factory.mktemp("real_vllm_info"), _run)


def _truth(out: Path) -> dict[str, tuple[str, int, str]]:
    """request id -> (conversation, turn, outcome): the router's, or P's connector's where the router inferred."""
    p_outcome = {e.request_id: e.outcome for e in read_events(out / "prefill-events.jsonl")
                 if e.event == "prefill_request" and e.outcome not in (None, "unknown")}
    truth = {}
    for e in read_events(out / "router-events.jsonl"):
        if e.event != "router_turn" or e.request_id is None:
            continue
        outcome = e.outcome or "unknown"
        if (e.reason or "").startswith("inferred") and e.request_id in p_outcome:
            outcome = p_outcome[e.request_id] or outcome
        truth[e.request_id] = (str(e.conversation_id), e.turn or 0, outcome)
    return truth


def _explain(paths: list[Path]) -> dict[str, tuple[str, str, str]]:
    convs = load_turns([str(p) for p in paths])
    return {t.request_id: (t.verdict.value, t.confidence.value, t.reason) for c in convs for t in c.turns
            if t.request_id}


def _stock(out: Path) -> dict[str, tuple[str, str, str]]:
    return _explain([out / f for f in STOCK])


def test_the_testbed_writes_vllm_s_stat_and_config_lines(run_dir: Path) -> None:
    p_log = (run_dir / "prefill.log").read_text()
    assert re.search(r"\(EngineCore pid=\d+\) INFO .* \[core\.py:\d+\] Initializing a V1 LLM engine \(v0\.33\.0\) "
                     r"with config: .*enable_prefix_caching=False", p_log)
    engine = re.findall(r"\(APIServer pid=\d+\) INFO .* \[loggers\.py:\d+\] Engine 000: Avg prompt throughput: .*$",
                        p_log, re.M)
    assert engine and all("CPU KV cache usage" in ln and "Prefix cache hit rate" not in ln for ln in engine)
    lines = p_log.splitlines()
    kv = [i for i, ln in enumerate(lines) if "] KV Transfer metrics: Num successful transfers=" in ln]
    assert kv and all("] Engine 000: " in lines[i - 1] for i in kv)  # vLLM writes the Engine line first
    assert "] Transfer plan: TransferTopology(tp_ratio=1, " in p_log
    successes = sum(int(m) for m in re.findall(r"KV Transfer metrics: Num successful transfers=(\d+)", p_log))
    reads = sum(1 for _, _, v in _truth(run_dir).values() if v == "remote_hit")
    assert successes == reads > 0  # one NIXL transfer per D->P read (TP 1 both sides)


def test_every_read_alone_in_its_windows_is_a_remote_hit(run_dir: Path) -> None:
    truth, got = _truth(run_dir), _stock(run_dir)
    serial = sorted((t, rid) for rid, (conv, t, v) in truth.items() if conv == SERIAL.conversation_id)
    assert [truth[rid][2] for _, rid in serial] == ["first_turn"] + ["remote_hit"] * 4, truth
    assert [(got[rid][0], got[rid][1]) for _, rid in serial] == [("first_turn", "confirmed")] + [
        ("remote_hit", "inferred")] * 4, [got[rid] for _, rid in serial]
    assert all("stats window" in got[rid][2] for _, rid in serial[1:])


def test_reads_sharing_windows_are_never_decided_wrong(run_dir: Path) -> None:
    truth, got = _truth(run_dir), _stock(run_dir)
    wrong = [(rid, want, got[rid]) for rid, (_, _, want) in truth.items()
             if got[rid][0] not in (want, "unknown")]
    assert not wrong
    crowd = [rid for rid, (conv, _, v) in truth.items() if conv.startswith("info-crowd") and v == "remote_hit"]
    assert len(crowd) == 12
    unknown = [got[rid][2] for rid in crowd if got[rid][0] == "unknown"]
    assert all("stats window" in r for r in unknown), unknown
    # a successful read is never confirmed from a window
    assert all(got[rid][1] == "inferred" for rid in crowd if got[rid][0] == "remote_hit")
    # the crowd did share windows: some window run accounts for several reads at once
    shared = [int(m.group(1)) for rid in crowd if (m := re.search(r"exactly the (\d+) read", got[rid][2]))]
    assert max(shared, default=0) >= 2 or unknown, [got[rid] for rid in crowd]


def test_without_p_s_stat_lines_the_reads_stay_undecided(run_dir: Path) -> None:
    # negative control: the logs as the testbed wrote them before (no Engine / KV Transfer metrics lines)
    view = run_dir.parent / f"{run_dir.name}-no-stats"
    view.mkdir(exist_ok=True)
    for name in STOCK:
        text = (run_dir / name).read_text()
        if name == "prefill.log":
            text = "".join(ln for ln in text.splitlines(keepends=True) if not STAT_LINE.search(ln))
        (view / name).write_text(text)
    truth, got = _truth(run_dir), _explain([view / f for f in STOCK])
    serial = [rid for rid, (conv, _, v) in sorted(truth.items(), key=lambda kv: kv[1][1])
              if conv == SERIAL.conversation_id and v == "remote_hit"]
    decided = [got[rid] for rid in serial]
    assert serial and all(v != "remote_hit" or "stats window" not in why for v, _, why in decided), decided
    # the first read's history is short: the client's counts do not put its remainder 16 tokens above the
    # threshold, so only P's windows decide it
    assert decided[0][0] == "unknown" and "no stats window" in decided[0][2], decided


def verdict_table(out: Path) -> list[dict[str, Any]]:
    """Per turn: truth vs explain (stock files at INFO), for reports."""
    truth, got = _truth(out), _stock(out)
    return [{"conversation": conv, "turn": turn, "truth": want, "explain": got[rid][0], "confidence": got[rid][1]}
            for rid, (conv, turn, want) in sorted(truth.items(), key=lambda kv: (kv[1][0], kv[1][1]))]
