"""The emulated xPyD fleet (kvdiag.sim.fleet, ``kvdiag sim fleet``) and the bounded fleet benchmark.

The fleet's engines are real emulated engines on loopback; D's local hit on the P->D pull is checked
with the minimal P/D driver (kvdiag.sim.pd_driver), and the benchmark (benchmarks/fleet_bench.py) runs
round-robin against kv-aware placement at a small size, at time scale 0, on the modelled figures.
"""

from __future__ import annotations

import importlib.util
import json
import random
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest
from router_support import wait_for

from kvdiag.sim.config import EngineConfig, EngineConfigError
from kvdiag.sim.fleet import FleetSpec, engine_config, start_fleet
from kvdiag.sim.pd_driver import run_turn
from kvdiag.sim.timemodel import get_profile
from kvdiag.sim.workload_plan import synthetic_text

ROOT = Path(__file__).resolve().parents[1]
KVDIAG = str(Path(sys.executable).parent / "kvdiag")


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fleet_bench", ROOT / "benchmarks" / "fleet_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fleet_bench"] = module
    spec.loader.exec_module(module)
    return module


bench = _bench()


async def test_a_fleet_is_distinct_engines_and_the_router_options_name_them(tmp_path: Path) -> None:
    fleet = await start_fleet(EngineConfig(role="prefill", time_scale=0, mode="instrumented"),
                              EngineConfig(role="decode", time_scale=0, mode="instrumented"),
                              FleetSpec(4, 4, log_dir=tmp_path / "logs", events_dir=tmp_path / "events"))
    try:
        engines = fleet.engines
        assert len(fleet.prefill) == len(fleet.decode) == 4
        assert len({h.engine_id for h in engines}) == 8 and len({h.port for h in engines}) == 8
        assert {h.engine.config.role for h in fleet.decode} == {"decode"}
        args = fleet.router_args()
        assert args[:1] == ["--prefiller-hosts"] and args.count("127.0.0.1") == 8
        assert args[args.index("--decoder-ports") + 1:] == [str(h.port) for h in fleet.decode]
        info = fleet.describe()
        assert [d["port"] for d in info["prefill"]] == [h.port for h in fleet.prefill]
        assert fleet.decode[2].engine.config.log_file == str(tmp_path / "logs" / "decode-2.log")
        async with aiohttp.ClientSession() as session:
            for h in engines:
                async with session.get(h.url + "/health") as resp:
                    assert resp.status == 200
    finally:
        await fleet.close()
    assert (tmp_path / "events" / "prefill-3-events.jsonl").exists()


def test_fleet_options_are_checked() -> None:
    with pytest.raises(EngineConfigError, match="--prefill 0"):
        FleetSpec(prefill=0).validate()
    with pytest.raises(EngineConfigError, match="--decode 65"):
        FleetSpec(decode=65).validate()
    stock = engine_config(EngineConfig(role="decode"), FleetSpec(events_dir=Path("/x")), 1)
    assert stock.events_file is None  # stock mode writes no events
    bad = subprocess.run([KVDIAG, "sim", "fleet", "--prefill", "0"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--prefill 0" in bad.stderr and "kvdiag sim fleet --help" in bad.stderr


async def test_d_pulls_only_what_its_prefix_cache_lacks(tmp_path: Path) -> None:
    # The same conversation's second turn on the D that decoded the first, and on a cold D.
    fleet = await start_fleet(EngineConfig(role="prefill", time_scale=0, prefix_caching=False),
                              EngineConfig(role="decode", time_scale=0), FleetSpec(1, 2))
    profile = get_profile("qwen3-32b")
    try:
        p, (warm, cold) = fleet.prefill[0], fleet.decode
        rng = random.Random(3)
        m1 = [{"role": "user", "content": synthetic_text(rng, 800)}]
        async with aiohttp.ClientSession() as session:
            t1 = await run_turn(session, p.url, warm.url, m1, None, "c-t1", max_tokens=20, stream=False)
            m2 = [*m1, {"role": "assistant", "content": t1.reply},
                  {"role": "user", "content": synthetic_text(rng, 100)}]
            before = warm.engine.metrics.prefix_cache_hits._value.get()
            t2 = await run_turn(session, p.url, warm.url, m2, t1.d_params, "c-t2", max_tokens=8, stream=False)
            hit = warm.engine.metrics.prefix_cache_hits._value.get() - before
            t3 = await run_turn(session, p.url, cold.url, m2, None, "c-t3", max_tokens=8, stream=False)
        prompt2 = int(t2.p_body["usage"]["prompt_tokens"])
        sequence1 = int(t1.p_body["usage"]["prompt_tokens"]) + 20 - 1  # what warm D held for the handle
        assert t2.d_body is not None and t3.d_body is not None
        warm_cached = int(t2.d_body["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert hit == (sequence1 // 16) * 16  # D's own cache: every full block of its previous sequence
        pulled = warm_cached - hit
        assert pulled == prompt2 - 1 - hit  # the P->D read: only the rest (the last token is recomputed)
        assert 64 < pulled < 160  # the new message (above kv_recompute_threshold, so D pulls it)
        cold_cached = int(t3.d_body["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cold_cached == prompt2 - 1  # a cold D pulls the whole prompt
        assert profile.transfer_bytes(cold_cached) > 5 * profile.transfer_bytes(pulled)
    finally:
        await fleet.close()


async def test_the_fleet_command_serves_a_router_and_stops_on_sigterm(tmp_path: Path) -> None:
    ready, log = tmp_path / "fleet.json", tmp_path / "fleet.out"
    with log.open("w") as out:
        fleet = subprocess.Popen([KVDIAG, "sim", "fleet", "--prefill", "2", "--decode", "2", "--time-scale", "0",
                                  "--ready-file", str(ready), "--mode", "instrumented", "--events-dir",
                                  str(tmp_path / "ev")], stdout=out, stderr=subprocess.DEVNULL)
    router = None
    try:
        await wait_for(ready.exists, timeout=30)
        info = json.loads(ready.read_text())
        assert len(info["prefill"]) == len(info["decode"]) == 2
        router_ready = tmp_path / "router.json"
        router = subprocess.Popen([KVDIAG, "router", "--host", "127.0.0.1", "--port", "0", "--policy", "kv-aware",
                                   "--ready-file", str(router_ready), *info["router_args"]],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await wait_for(router_ready.exists, timeout=30)
        url = json.loads(router_ready.read_text())["url"]
        body: dict[str, Any] = {"model": "Qwen/Qwen3-32B", "messages": [{"role": "user", "content": "hi " * 200}],
                                "max_tokens": 4, "conversation_id": "cli"}
        async with aiohttp.ClientSession() as session, session.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert (await resp.json())["choices"][0]["message"]["content"]
    finally:
        for proc in (router, fleet):
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
        assert fleet.wait(20) == 0
        if router is not None:
            assert router.wait(20) == 0
    assert "kvdiag router --prefiller-hosts 127.0.0.1 127.0.0.1" in log.read_text()


@pytest.mark.slow
async def test_bounded_fleet_benchmark_kv_aware_against_round_robin(tmp_path: Path) -> None:
    # The bounded version of BENCHMARKS.md's fleet table: fewer, shorter conversations and a D cache sized
    # to keep the same pressure; at time scale 0 the TTFT compared is the time model's, from the events.
    case = bench.Case(conversations=9, turns=12, scale=0.5, num_blocks=4096, time_scale=0.0)
    results = {policy: bench.summary(await bench.run_case(case, policy, tmp_path / policy, in_process=True))
               for policy in bench.POLICIES}
    rr, kv = results["round-robin"], results["kv-aware"]
    for s in (rr, kv):
        assert s["statuses"] == {"ok": 9 * 12} and s["wrong_kv_tokens"] == 0
    assert kv["decode_reasons"] == {"affinity": 9 * 11} and kv["prefill_reasons"] == {"locality": 9 * 11}
    assert set(rr["decode_reasons"]) == {"round_robin"}
    r = bench.ratios(rr, kv)
    # The targets: P->D bytes per turn cut >= 5x, later-turn TTFT p50 >= 20% lower, p99 not higher.
    assert r["p2d_bytes_cut_x"] >= 5.0, r
    assert r["model_ttft_p50_cut"] >= 0.20 and r["model_ttft_p99_cut"] >= 0.0, r
    assert kv["d2p_bytes_per_turn"] < rr["d2p_bytes_per_turn"] / 3  # P holds the history: little to read
    assert 0.95 <= kv["d_expected_vs_local"] <= 1.05  # D held what placement expected it to
