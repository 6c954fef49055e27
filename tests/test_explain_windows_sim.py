"""explain at INFO on the testbed: sim P (no prefix caching, the article's setup) + sim D + kvdiag's router
writing the reference proxy's log, P's stat lines every 3 s. The router's events are the truth;
explain reads only the stock files (P at INFO, as production runs it).

* one conversation, turns 4 s apart: every read is alone in its stats windows, so every
  successful D->P read is ``remote_hit`` (inferred), none ``unknown``;
* six conversations at once: reads share windows; still no wrong verdict, and an ``unknown`` names
  the reads it shares its window with.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvdiag.demo.processes import Component
from kvdiag.diagnostics.turn_loader import load_turns
from kvdiag.sim.workload import run_workload
from kvdiag.sim.workload_plan import ConversationPlan, TurnPlan, WorkloadConfig

pytestmark = pytest.mark.slow  # minutes of real servers: `make test-fast` leaves it out

MODEL = "Qwen/Qwen3-32B"
STOCK = ("prefill.log", "decode.log", "proxy.log", "client-stats.json")


def _run(out: Path, plans: tuple[ConversationPlan, ...], concurrency: int, turns: int) -> None:
    comps: dict[str, Component] = {}
    try:
        for role in ("prefill", "decode"):
            extra = ["--no-prefix-caching"] if role == "prefill" else []
            comps[role] = Component.launch(role, [
                "sim", role, "--host", "127.0.0.1", "--port", "0", "--model", MODEL, "--time-scale", "0.05",
                "--block-size", "16", "--kv-recompute-threshold", "64", "--log-stats-interval", "3", *extra,
                "--log-file", str(out / f"{role}.log")], out)
        for comp in comps.values():
            comp.wait_ready()
        comps["router"] = Component.start("router", [
            "router", "--host", "127.0.0.1", "--port", "0", "--prefiller-host", "127.0.0.1", "--prefiller-port",
            str(comps["prefill"].port), "--decoder-host", "127.0.0.1", "--decoder-port", str(comps["decode"].port),
            "--events-file", str(out / "router-events.jsonl"), "--proxy-log", str(out / "proxy.log")], out)
        config = WorkloadConfig(url=comps["router"].url, model=MODEL, conversations=len(plans), turns=turns,
                                concurrency=concurrency, max_tokens=48, new_tokens=80, seed=3)
        result = asyncio.run(run_workload(config, plans, stats_json=out / "client-stats.json"))
        assert result.status_counts() == {"ok": turns * len(plans)}, result.status_counts()
        asyncio.run(asyncio.sleep(7.0))  # P's next stat ticks count the last reads
        # traffic goes on after them: the proxy log outlasts the last reads' windows, as in production
        tail = ConversationPlan("tail", (TurnPlan(),))
        asyncio.run(run_workload(replace(config, conversations=1, turns=1), (tail,)))
    finally:
        for name in ("router", "decode", "prefill"):
            if name in comps:
                comps.pop(name).stop()


def _truth(out: Path) -> dict[str, str]:
    return {ev["request_id"]: ev["outcome"] for ev in map(json.loads, (out / "router-events.jsonl").read_text()
                                                          .splitlines()) if ev.get("event") == "router_turn"}


def _stock(out: Path) -> dict[str, tuple[str, str, str]]:
    convs = load_turns([str(out / f) for f in STOCK])
    return {t.request_id: (t.verdict.value, t.confidence.value, t.reason) for c in convs for t in c.turns
            if t.request_id}


@pytest.fixture(scope="module")
def serial(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("windows-serial")
    plans = (ConversationPlan("serial", (TurnPlan(), *(TurnPlan(gap_s=4.0) for _ in range(4)))),)
    _run(out, plans, concurrency=1, turns=5)
    yield out


@pytest.fixture(scope="module")
def crowded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("windows-crowded")
    plans = tuple(ConversationPlan(f"crowd-{i}", (TurnPlan(), TurnPlan(gap_s=0.2), TurnPlan(gap_s=0.2)))
                  for i in range(6))
    _run(out, plans, concurrency=6, turns=3)
    yield out


def test_every_successful_read_alone_in_its_window_is_a_remote_hit(serial: Path) -> None:
    truth, got = _truth(serial), _stock(serial)
    hits = [rid for rid, v in truth.items() if v == "remote_hit"]
    assert len(hits) == 4, truth
    assert [(got[r][0], got[r][1]) for r in hits] == [("remote_hit", "inferred")] * len(hits), \
        [got[r] for r in hits]
    assert all(got[rid][0] == v for rid, v in truth.items())
    assert "KV Transfer metrics" in (serial / "prefill.log").read_text()
    assert "Prefix cache hit rate" not in (serial / "prefill.log").read_text()


def test_reads_sharing_windows_are_never_decided_wrong(crowded: Path) -> None:
    truth, got = _truth(crowded), _stock(crowded)
    wrong = [(rid, want, got[rid]) for rid, want in truth.items()
             if got[rid][0] != want and got[rid][0] != "unknown"]
    assert not wrong
    unknown = [got[rid][2] for rid, want in truth.items() if got[rid][0] == "unknown"]
    assert all("stats window" in r for r in unknown), unknown
