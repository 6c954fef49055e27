"""Round-robin vs KV-aware placement on an emulated xPyD fleet, with the agent workload profiles.

For each case (an agent profile of ``kvdiag workload``, a turn count, P prefix caching on or off)
this starts an emulated fleet (``kvdiag sim fleet``, 4P+4D by default, the calibrated Qwen3-32B time
model at ``--time-scale``), puts ``kvdiag router`` in front of it once per policy (a fresh fleet each
time, so no cache is shared between the two runs) and runs the same seeded conversations through it.
Per turn it joins the client's record (TTFT as the agent sees it) with the router's ``router_turn``
event (the placement decision), P's ``prefill_request`` (D->P read) and D's ``decode_request``
(P->D read, D's local hit); D's memory held is sampled from every D's ``vllm:kv_cache_usage_perc``.

Figures per policy: TTFT p50/p99 by turn group (measured at the client, and modelled from the
events with the same time model), P->D and D->P bytes per later turn, D memory held (mean and peak
over the run, all Ds), and the KV-aware / round-robin ratios, measured in one run.

    .venv/bin/python benchmarks/fleet_bench.py [--conversations 24] [--turns 20] [--time-scale 3] [--json out.json]

``run_case(..., in_process=True)`` runs the fleet and the router inside the caller's event loop
(tests/test_sim_fleet.py uses it at time scale 0 and compares the modelled figures).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvdiag.router.app import start_router
from kvdiag.router.config import RouterConfig, Upstream
from kvdiag.schema.events import TurnEvent, read_events
from kvdiag.sim.agent_client import run_agent_workload
from kvdiag.sim.agent_plan import REASONING_PROFILES, AgentSpec
from kvdiag.sim.config import EngineConfig
from kvdiag.sim.fleet import FleetSpec, start_fleet
from kvdiag.sim.timemodel import DEFAULT_PROFILE, get_profile
from kvdiag.sim.workload_plan import WorkloadConfig

POLICIES = ("round-robin", "kv-aware")
BLOCK_SIZE = 16
TURN_GROUPS = ((1, 1), (2, 5), (6, 10), (11, 15), (16, 20), (21, 50))
KVDIAG = str(Path(sys.executable).parent / "kvdiag")
_USAGE = re.compile(rb"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.eE+-]+)$", re.M)


@dataclass(frozen=True)
class Case:
    """One workload and fleet shape."""

    profile: str = "coding-agent"
    turns: int = 20
    conversations: int = 24
    scale: float = 1.0
    prefill: int = 4
    decode: int = 4
    p_prefix_caching: bool = True
    num_blocks: int = 16_384
    time_scale: float = 3.0
    seed: int = 1

    @property
    def label(self) -> str:
        """``profile, N turns, xPyD, P cache on|off``."""
        return (f"{self.profile}, {self.turns or 'own'} turns, {self.prefill}P+{self.decode}D, "
                f"P prefix cache {'on' if self.p_prefix_caching else 'off'}")


@dataclass
class TurnRow:
    """One request, joined across the client, the router, P and D."""

    conversation: str
    turn: int
    request_id: str
    status: str
    ttft_ms: float | None = None  # the client's, in the model's ms (wall time divided by the time scale)
    router_ttft_ms: float | None = None  # the router's (arrival to D's first byte), model ms
    router_prefill_ms: float | None = None  # the router's prefill leg, model ms
    prompt_tokens: int = 0
    p_local: int = 0
    d2p_tokens: int = 0
    d2p_bytes: int = 0
    p_computed: int = 0
    d_local: int = 0
    p2d_tokens: int = 0
    p2d_bytes: int = 0
    modelled_ttft_ms: float | None = None
    outcome: str | None = None
    error: str | None = None  # the client's, for a failed request
    p_reason: str | None = None
    d_reason: str | None = None
    d_expected: int | None = None


@dataclass
class PolicyResult:
    """One policy's run of one case."""

    case: str
    policy: str
    rows: list[TurnRow] = field(default_factory=list)
    d_memory: list[float] = field(default_factory=list)  # bytes held by every D together, per sample
    elapsed_s: float = 0.0
    wrong_kv_tokens: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds of the fleet and router processes

    def later(self) -> list[TurnRow]:
        """Answered turns after the first."""
        return [r for r in self.rows if r.turn >= 2 and r.status == "ok"]


# ---------------------------------------------------------------------------------------------- the fleet
def _engine_args(case: Case) -> list[str]:
    args = ["--time-scale", str(case.time_scale), "--mode", "instrumented", "--block-size", str(BLOCK_SIZE),
            "--num-blocks", str(case.num_blocks), "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
            "--seed", str(case.seed), "--log-stats-interval", "3600"]
    if case.profile in REASONING_PROFILES:
        args += ["--reasoning-parser", "qwen3"]
    if not case.p_prefix_caching:
        args.append("--no-prefill-prefix-caching")
    return args


def _engine_config(role: str, case: Case) -> EngineConfig:
    parsers: dict[str, Any] = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}
    if case.profile in REASONING_PROFILES:
        parsers["reasoning_parser"] = "qwen3"
    return EngineConfig(role=role, time_scale=case.time_scale, mode="instrumented", block_size=BLOCK_SIZE,
                        num_blocks=case.num_blocks, prefix_caching=role == "decode" or case.p_prefix_caching,
                        seed=case.seed, log_stats_interval_s=3600.0, **parsers)


async def _wait_file(path: Path, proc: asyncio.subprocess.Process | None, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc is not None and proc.returncode is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before writing {path}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {timeout:g} s")
        await asyncio.sleep(0.05)
    data: dict[str, Any] = json.loads(path.read_text())
    return data


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 20)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.asynccontextmanager
async def _bed(case: Case, policy: str, workdir: Path, in_process: bool,
               cpu: dict[str, float]) -> AsyncIterator[tuple[str, list[str]]]:
    """A fresh fleet and a router with ``policy``; yields the router URL and the Ds' metrics URLs."""
    events = workdir / "engines"
    router_events = workdir / "router-events.jsonl"
    if in_process:
        fleet = await start_fleet(_engine_config("prefill", case), _engine_config("decode", case),
                                  FleetSpec(case.prefill, case.decode, events_dir=events))
        try:
            router = await start_router(RouterConfig(
                prefill=tuple(Upstream("127.0.0.1", h.port) for h in fleet.prefill),
                decode=tuple(Upstream("127.0.0.1", h.port) for h in fleet.decode), host="127.0.0.1", port=0,
                events_file=router_events, policy=policy, prefill_locality=case.p_prefix_caching))
            try:
                yield router.url, [h.url + "/metrics" for h in fleet.decode]
            finally:
                await router.close()
        finally:
            await fleet.close()
        return
    fleet_ready, router_ready = workdir / "fleet.ready", workdir / "router.ready"
    fleet_err, router_err = (workdir / "fleet.err").open("wb"), (workdir / "router.err").open("wb")
    fleet_proc = await asyncio.create_subprocess_exec(
        KVDIAG, "sim", "fleet", "--prefill", str(case.prefill), "--decode", str(case.decode), "--events-dir",
        str(events), "--ready-file", str(fleet_ready), *_engine_args(case),
        stdout=asyncio.subprocess.DEVNULL, stderr=fleet_err)
    try:
        info = await _wait_file(fleet_ready, fleet_proc)
        locality = "--prefill-locality" if case.p_prefix_caching else "--no-prefill-locality"
        router_proc = await asyncio.create_subprocess_exec(
            KVDIAG, "router", "--host", "127.0.0.1", "--port", "0", "--policy", policy, locality, "--events-file",
            str(router_events), "--ready-file", str(router_ready), *info["router_args"],
            stdout=asyncio.subprocess.DEVNULL, stderr=router_err)
        try:
            router_info = await _wait_file(router_ready, router_proc)
            before = {"fleet": _cpu_seconds(fleet_proc.pid), "router": _cpu_seconds(router_proc.pid)}
            yield f"http://127.0.0.1:{router_info['port']}", [d["url"] + "/metrics" for d in info["decode"]]
            cpu["fleet"] = round(_cpu_seconds(fleet_proc.pid) - before["fleet"], 1)
            cpu["router"] = round(_cpu_seconds(router_proc.pid) - before["router"], 1)
        finally:
            await _stop(router_proc)
    finally:
        await _stop(fleet_proc)
        fleet_err.close()
        router_err.close()


async def _sample_memory(urls: list[str], per_d_bytes: float, out: list[float], stop: asyncio.Event) -> None:
    """Every 0.25 s: the bytes of KV every D holds (running requests and retained handles), summed."""
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            total = 0.0
            for url in urls:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                        match = _USAGE.search(await resp.read())
                        if match:
                            total += float(match.group(1)) * per_d_bytes
            out.append(total)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)


# ---------------------------------------------------------------------------------------------- one run
async def run_case(case: Case, policy: str, workdir: Path, *, in_process: bool = False) -> PolicyResult:
    """Run ``case`` behind a router with ``policy`` on a fresh fleet; return every turn's figures."""
    workdir.mkdir(parents=True, exist_ok=True)
    profile = get_profile(DEFAULT_PROFILE)
    result = PolicyResult(case.label, policy)
    started = time.perf_counter()
    spec = AgentSpec(profile=case.profile, conversations=case.conversations, seed=case.seed, turns=case.turns,
                     scale=case.scale, prefix="fleet")
    async with _bed(case, policy, workdir, in_process, result.cpu_s) as (url, d_metrics):
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample_memory(
            d_metrics, case.num_blocks * BLOCK_SIZE * profile.kv_bytes_per_token, result.d_memory, stop))
        try:
            config = WorkloadConfig(url=url, conversations=case.conversations,
                                    concurrency=min(case.conversations * 4, 1024), seed=case.seed,
                                    duration_limit=3600.0, request_timeout=600.0)
            workload = await run_agent_workload(config, spec)
        finally:
            stop.set()
            await sampler
        await asyncio.sleep(0.3)  # the router's and engines' event writers flush every 50 ms
    result.elapsed_s = round(time.perf_counter() - started, 1)
    router = {e.request_id: e for e in _events(workdir / "router-events.jsonl") if e.request_id}
    p_events: dict[str, TurnEvent] = {}
    d_events: dict[str, TurnEvent] = {}
    for path in sorted((workdir / "engines").glob("*-events.jsonl")):
        for e in _events(path):
            if e.event == "prefill_request" and e.request_id:
                p_events[e.request_id] = e
                result.wrong_kv_tokens += e.wrong_kv_tokens or 0
            elif e.event == "decode_request" and e.request_id:
                d_events[e.request_id] = e
    for record in workload.records:
        ev = record.event
        rid = ev.request_id or ""
        row = TurnRow(ev.conversation_id or "", ev.turn or 0, rid, ev.status or "?", _unscale(ev.ttft_ms, case))
        if ev.status != "ok":
            row.error = f"HTTP {ev.http_status}: {ev.attrs.get('error')}"
        r, p, d = router.get(rid), p_events.get(rid), d_events.get(rid)
        if r is not None:
            row.router_ttft_ms, row.router_prefill_ms = _unscale(r.ttft_ms, case), _unscale(r.prefill_ms, case)
            placement = r.attrs.get("placement") or {}
            row.outcome = r.outcome
            row.p_reason = (placement.get("prefill") or {}).get("reason")
            row.d_reason = (placement.get("decode") or {}).get("reason")
            row.d_expected = (placement.get("decode") or {}).get("expected_local_tokens")
        if p is not None and d is not None:
            row.prompt_tokens = p.prompt_tokens or 0
            row.p_local, row.d2p_tokens = p.local_hit_tokens or 0, p.remote_read_tokens or 0
            row.d2p_bytes, row.p_computed = p.transfer_bytes or 0, p.computed_tokens or 0
            row.d_local, row.p2d_tokens = d.local_hit_tokens or 0, d.remote_read_tokens or 0
            row.p2d_bytes = d.transfer_bytes or 0
            d_computed = max(row.prompt_tokens - row.d_local - row.p2d_tokens, 1)
            row.modelled_ttft_ms = round(
                (p.transfer_ms or 0.0) + profile.prefill_ms(row.p_computed, row.p_local + row.d2p_tokens)
                + (d.transfer_ms or 0.0) + profile.prefill_ms(d_computed, row.prompt_tokens - d_computed)
                + profile.decode_step_ms, 3)
        result.rows.append(row)
    return result


def _unscale(ms: float | None, case: Case) -> float | None:
    # Every modelled duration is slept time_scale times: wall ms / time_scale are the model's ms.
    if ms is None:
        return None
    return round(ms / case.time_scale, 3) if case.time_scale > 0 else ms


def _events(path: Path) -> list[TurnEvent]:
    return list(read_events(path)) if path.exists() else []


# ---------------------------------------------------------------------------------------------- figures
def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summary(result: PolicyResult) -> dict[str, Any]:
    """The figures of one policy run."""
    later = result.later()
    out: dict[str, Any] = {"policy": result.policy, "requests": len(result.rows), "later_turns": len(later),
                           "statuses": dict(Counter(r.status for r in result.rows)),
                           "outcomes": dict(Counter(r.outcome or "?" for r in result.rows)),
                           "prefill_reasons": dict(Counter(r.p_reason or "?" for r in later)),
                           "decode_reasons": dict(Counter(r.d_reason or "?" for r in later)),
                           "wrong_kv_tokens": result.wrong_kv_tokens, "elapsed_s": result.elapsed_s,
                           "cpu_s": result.cpu_s}
    groups = {}
    for lo, hi in ((*g,) for g in TURN_GROUPS):
        rows = [r for r in result.rows if lo <= r.turn <= hi and r.status == "ok"]
        if rows:
            groups[f"{lo}" if lo == hi else f"{lo}-{hi}"] = _ttft(rows)
    groups["later"] = _ttft(later)
    out["ttft"] = groups
    n = max(len(later), 1)
    out["p2d_bytes_per_turn"] = sum(r.p2d_bytes for r in later) / n
    out["d2p_bytes_per_turn"] = sum(r.d2p_bytes for r in later) / n
    out["prompt_tokens_per_turn"] = sum(r.prompt_tokens for r in later) / n
    out["d_local_share"] = sum(r.d_local for r in later) / max(sum(r.prompt_tokens for r in later), 1)
    expected = [(r.d_expected, r.d_local) for r in later if r.d_expected]
    out["d_expected_vs_local"] = (sum(local for _, local in expected) / sum(e for e, _ in expected)
                                  if expected else None)
    mem = result.d_memory
    out["d_memory_mean_bytes"] = statistics.fmean(mem) if mem else 0.0
    out["d_memory_peak_bytes"] = max(mem) if mem else 0.0
    return out


def _ttft(rows: list[TurnRow]) -> dict[str, Any]:
    measured = [r.ttft_ms for r in rows if r.ttft_ms is not None]
    modelled = [r.modelled_ttft_ms for r in rows if r.modelled_ttft_ms is not None]
    return {"n": len(rows), "p50": _pct(measured, 0.5), "p99": _pct(measured, 0.99),
            "model_p50": _pct(modelled, 0.5), "model_p99": _pct(modelled, 0.99)}


def ratios(rr: dict[str, Any], kv: dict[str, Any]) -> dict[str, Any]:
    """KV-aware against round-robin (the targets: P->D >= 5x fewer bytes, later TTFT p50 >= 20% lower, p99 no rise)."""
    def cut(key: str, group: str = "later") -> float | None:
        a, b = rr["ttft"][group].get(key), kv["ttft"][group].get(key)
        return 1.0 - b / a if a and b is not None else None
    p2d = rr["p2d_bytes_per_turn"] / kv["p2d_bytes_per_turn"] if kv["p2d_bytes_per_turn"] else float("inf")
    return {"p2d_bytes_cut_x": p2d, "ttft_p50_cut": cut("p50"), "ttft_p99_cut": cut("p99"),
            "model_ttft_p50_cut": cut("model_p50"), "model_ttft_p99_cut": cut("model_p99"),
            "d2p_bytes_ratio": (kv["d2p_bytes_per_turn"] / rr["d2p_bytes_per_turn"]
                                if rr["d2p_bytes_per_turn"] else None),
            "d_memory_mean_ratio": (kv["d_memory_mean_bytes"] / rr["d_memory_mean_bytes"]
                                    if rr["d_memory_mean_bytes"] else None)}


def _ms(v: float | None) -> str:
    return f"{v:,.0f}" if v is not None else "–"


def _gb(v: float) -> str:
    return f"{v / 1e9:,.2f}"


def table(case: str, rr: dict[str, Any], kv: dict[str, Any]) -> str:
    """The BENCHMARKS.md tables of one case."""
    r = ratios(rr, kv)
    lines = [f"**{case}**", "",
             "| turns | n | TTFT p50 RR | TTFT p50 KV | TTFT p99 RR | TTFT p99 KV | modelled p50 RR "
             "| modelled p50 KV |",
             "|---|---|---|---|---|---|---|---|"]
    for group, a in rr["ttft"].items():
        b = kv["ttft"].get(group, {})
        lines.append(f"| {group} | {a['n']} | {_ms(a['p50'])} | {_ms(b.get('p50'))} | {_ms(a['p99'])} | "
                     f"{_ms(b.get('p99'))} | {_ms(a['model_p50'])} | {_ms(b.get('model_p50'))} |")
    lines += ["", "| per later turn | round-robin | kv-aware | ratio |", "|---|---|---|---|",
              f"| P→D bytes | {_gb(rr['p2d_bytes_per_turn'])} GB | {_gb(kv['p2d_bytes_per_turn'])} GB | "
              f"{_fewer(1 / r['p2d_bytes_cut_x'] if r['p2d_bytes_cut_x'] else None)} |",
              f"| D→P bytes | {_gb(rr['d2p_bytes_per_turn'])} GB | {_gb(kv['d2p_bytes_per_turn'])} GB | "
              f"{_fewer(r['d2p_bytes_ratio'])} |",
              f"| D's local hit (share of the prompt) | {rr['d_local_share']:.1%} | {kv['d_local_share']:.1%} | |",
              f"| D memory held, mean (all Ds) | {_gb(rr['d_memory_mean_bytes'])} GB | "
              f"{_gb(kv['d_memory_mean_bytes'])} GB | {_x(r['d_memory_mean_ratio'])} (kv-aware / round-robin) |",
              f"| D memory held, peak | {_gb(rr['d_memory_peak_bytes'])} GB | {_gb(kv['d_memory_peak_bytes'])} GB | |",
              f"| later-turn TTFT p50 / p99 (measured) | {_ms(rr['ttft']['later']['p50'])} / "
              f"{_ms(rr['ttft']['later']['p99'])} ms | {_ms(kv['ttft']['later']['p50'])} / "
              f"{_ms(kv['ttft']['later']['p99'])} ms | {_pc(r['ttft_p50_cut'])} / {_pc(r['ttft_p99_cut'])} lower |",
              f"| wrong KV tokens (oracle) | {rr['wrong_kv_tokens']} | {kv['wrong_kv_tokens']} | |"]
    return "\n".join(lines)


def _fewer(kv_over_rr: float | None) -> str:
    if kv_over_rr is None:
        return "–"
    if kv_over_rr <= 0:
        return "none left"
    if kv_over_rr < 0.01:
        return "over 100× fewer"
    return f"{1 / kv_over_rr:.1f}× fewer" if kv_over_rr < 1 else f"{kv_over_rr:.2f}× more"


def _x(v: float | None) -> str:
    return f"{v:.2f}×" if v is not None else "–"


def _pc(v: float | None) -> str:
    return f"{v:.0%}" if v is not None else "–"


async def run_all(cases: list[Case], workdir: Path, in_process: bool = False,
                  rows_dir: Path | None = None) -> list[dict[str, Any]]:
    """Every case, round-robin then KV-aware, each on a fresh fleet."""
    out = []
    for i, case in enumerate(cases):
        summaries, results = {}, {}
        for policy in POLICIES:
            res = results[policy] = await run_case(case, policy, workdir / f"case{i}-{policy}", in_process=in_process)
            summaries[policy] = summary(res)
            s = summaries[policy]
            print(f"{case.label} [{policy}]: {s['requests']} requests in {s['elapsed_s']} s, later TTFT p50 "
                  f"{_ms(s['ttft']['later']['p50'])} ms, P->D {_gb(s['p2d_bytes_per_turn'])} GB/turn, "
                  f"statuses {s['statuses']}, CPU {s['cpu_s']}", file=sys.stderr, flush=True)
        rr, kv = summaries["round-robin"], summaries["kv-aware"]
        out.append({"case": asdict(case), "label": case.label, "round_robin": rr, "kv_aware": kv,
                    "ratios": ratios(rr, kv)})
        if rows_dir is not None:
            for policy, res in results.items():
                (rows_dir / f"case{i}-{policy}.json").write_text(json.dumps([asdict(r) for r in res.rows]))
                for name in ("router-events.jsonl", "router.err", "fleet.err"):
                    source = workdir / f"case{i}-{policy}" / name
                    if source.exists():
                        shutil.copy(source, rows_dir / f"case{i}-{policy}-{name}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", default="coding-agent", help="comma-separated agent profiles")
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=20, help="turns per conversation (0: the profile's own)")
    parser.add_argument("--scale", type=float, default=1.0, help="message and tool-output sizes times this")
    parser.add_argument("--prefill", type=int, default=4)
    parser.add_argument("--decode", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=16_384, help="KV blocks per engine (16 tokens each)")
    parser.add_argument("--time-scale", type=float, default=3.0,
                        help="modelled durations slept this many times (TTFT is shown divided by it); a larger "
                             "scale keeps the engines' CPU and the machine's scheduling out of the figures")
    parser.add_argument("--p-cache", default="on", help="P prefix caching: on, off or on,off")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--rows", type=Path, default=None, help="write every turn's joined record here (a directory)")
    args = parser.parse_args()
    cases = [Case(profile=p, turns=args.turns, conversations=args.conversations, scale=args.scale,
                  prefill=args.prefill, decode=args.decode, p_prefix_caching=cache == "on",
                  num_blocks=args.num_blocks, time_scale=args.time_scale, seed=args.seed)
             for p in args.profiles.split(",") for cache in args.p_cache.split(",")]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.rows is not None:
            args.rows.mkdir(parents=True, exist_ok=True)
        results = asyncio.run(run_all(cases, Path(tmp), rows_dir=args.rows))
    for res in results:
        print(table(res["label"], res["round_robin"], res["kv_aware"]) + "\n")
    print(f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, "
          f"time scale {args.time_scale:g}, {time.perf_counter() - started:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
