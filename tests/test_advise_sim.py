"""Acceptance: advise on a real sim run with known parameters.

Real processes on loopback: the emulated prefill and decode engines (instrumented, the qwen3-32b
time-model profile), the router and the workload client. The workload's plan (seeded) puts exactly
20 % of the gaps past the decode TTL; advise must report that share within ±2 points and recover the
profile's transfer overhead and bandwidth within 10 %, from the run's logs alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdiag.demo.processes import Component
from kvdiag.diagnostics.advise import advise
from kvdiag.diagnostics.advise_config import scan_config
from kvdiag.diagnostics.report import load_turn_table
from kvdiag.sim.timemodel import get_profile
from kvdiag.sim.workload import run_workload
from kvdiag.sim.workload_plan import WorkloadConfig, make_plans

DECODE_TTL = 6.0  # vLLM declines reads within 5 s of expiry, so the smallest TTL that works at all
LONG_GAP = 6.2
SEED = 607  # a plan with 18 long gaps in 90 later turns (20 %), at most one per conversation (a short run)
PROFILE = get_profile("qwen3-32b")


def _engine(role: str, out: Path) -> list[str]:
    return ["sim", role, "--host", "127.0.0.1", "--port", "0", "--mode", "instrumented", "--time-scale", "0.02",
            "--profile", PROFILE.name, "--decoder-kv-blocks-ttl", f"{DECODE_TTL:g}", "--no-prefix-caching",
            "--log-file", str(out / f"{role}.log"), "--events-file", str(out / f"{role}-events.jsonl")]


@pytest.mark.slow
async def test_advise_on_a_sim_run_with_known_parameters(tmp_path: Path) -> None:
    components: list[Component] = []
    try:
        prefill = Component.launch("prefill", _engine("prefill", tmp_path), tmp_path)
        components.append(prefill)
        decode = Component.launch("decode", _engine("decode", tmp_path), tmp_path)
        components.append(decode)
        prefill.wait_ready()
        decode.wait_ready()
        router = Component.start("router", [
            "router", "--host", "127.0.0.1", "--port", "0", "--prefiller-host", "127.0.0.1", "--prefiller-port",
            str(prefill.port), "--decoder-host", "127.0.0.1", "--decoder-port", str(decode.port),
            "--decoder-kv-blocks-ttl", f"{DECODE_TTL:g}", "--entry-ttl", "1",
            "--events-file", str(tmp_path / "router-events.jsonl"), "--proxy-log", str(tmp_path / "proxy.log")],
            tmp_path)
        components.append(router)
        config = WorkloadConfig(url=router.url, model="Qwen/Qwen3-32B", conversations=30, turns=4, concurrency=30,
                                gap_dist="fixed", gap_mean=0.1, long_gap_share=0.2, long_gap=LONG_GAP,
                                new_tokens=300, max_tokens=64, seed=SEED)
        plans = make_plans(config)
        result = await run_workload(config, plans, client_log=tmp_path / "client.jsonl")
    finally:
        for comp in reversed(components):
            comp.stop()
    assert len(result.records) == 120
    long_gaps = sum(t.long_gap for p in plans for t in p.turns)
    later = sum(len(p.turns) - 1 for p in plans)
    expected_share = long_gaps / later
    assert expected_share == pytest.approx(0.2)
    logs = [str(tmp_path)]
    adv = advise(load_turn_table(logs), config=scan_config(logs))
    assert adv.ttl.turns_considered == later
    assert adv.ttl.current_s == DECODE_TTL  # read from D's startup line, no option given
    assert adv.ttl.share_after_expiry is not None
    assert abs(adv.ttl.share_after_expiry - expected_share) <= 0.02, adv.ttl
    t = adv.threshold
    assert t.transfer_overhead_ms == pytest.approx(PROFILE.xfer_overhead_ms, rel=0.10), t
    assert t.bandwidth_gbps == pytest.approx(PROFILE.bandwidth_gbps, rel=0.10), t
