"""Router at scale: 10,000 concurrent conversations over several replicas, 1,000,000 handles in Redis Cluster.

Starts a 3-master Redis Cluster (real ``redis-server`` processes), a canned P+D (router_bench's stub, one
process), and ``--replicas`` ``kvdiag router`` processes sharing ``--state redis+cluster://``. It fills the
cluster directly with ``--handles`` stored handles in the router's own layout (JSON handles of realistic
size: agent conversations with 50-500 blocks and a full turn ladder, plus their last-turn records), then
drives real traffic: ``--conversations`` conversations at once, each ``--turns`` streaming turns spread over
the replicas (turn k of conversation i on replica (i + k) mod n), replies sent back verbatim, a random
think time between turns (``--think``: 10,000 conversations thinking up to 60 s offer about 330 turns/s,
what two shared cores sustain with everything on them). A first, small phase on the empty store gives
the same figures for comparison.

Reported per phase: turns, errors, later turns whose handle the router found and injected, client
latency p50/p99, the router's own processing per turn (``router_overhead_ms`` from the events: turn
duration minus the two upstream legs, store calls included) p50/p99, peak in-flight turns; per router:
RSS (start, peak, end) and metric series; for the store: handles held, the bound, evictions, Redis memory.

Usage::

    .venv/bin/python benchmarks/router_scale_bench.py                 # 10k conversations, 1M handles
    .venv/bin/python benchmarks/router_scale_bench.py --json scale.json
    .venv/bin/python benchmarks/router_scale_bench.py --conversations 500 --handles 20000 --replicas 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the real-server launchers the tests use

from redis_cluster_support import Cluster, cluster  # noqa: E402
from replica_support import RouterProcess  # noqa: E402

from kvdiag.router.reuse_rule import Coverage, ReplyRecord, Rung  # noqa: E402
from kvdiag.router.store import Handle, LastTurn  # noqa: E402
from kvdiag.router.store_cluster import ClusterStore  # noqa: E402

CHAT = "/v1/chat/completions"
STUB = ROOT / "benchmarks" / "router_bench.py"
ENTRY_TTL = 450.0


# ---------------------------------------------------------------------------------------------- the fill
def realistic_handle(rng: random.Random, n: int) -> Handle:
    """A handle as an agent conversation leaves it: 50-500 blocks of 16 tokens, a full turn ladder."""
    blocks = rng.randint(50, 500)
    tokens = blocks * 16 - rng.randint(1, 15)
    first = rng.randint(0, 90_000)
    params = {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [
        list(range(first, first + blocks))], "remote_engine_id": "d-engine-7f3a9c",
        "remote_request_id": f"chatcmpl-{n:032x}-{rng.getrandbits(32):08x}", "remote_host": "10.0.3.17",
        "remote_port": 5601, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": tokens,
        "remote_blocks_expiry_time": time.time() + 480, "remote_registration_generation": 1,
        "transfer_mode": "pull"}
    rungs = tuple(Rung(2 * i + 1, f"{rng.getrandbits(128):032x}", tokens * (i + 1) // 9, False, i % 2 == 0)
                  for i in range(8))
    reply = ReplyRecord(f"{rng.getrandbits(256):064x}", rng.randint(50, 4000), frozenset(), frozenset(), "stop",
                        None, True, rng.randint(20, 800), 1)
    coverage = Coverage("messages", rungs, reply, None, 16, None, 15)
    return Handle(params, time.time(), 8, f"{rng.getrandbits(128):032x}", coverage)


def fill(c: Cluster, count: int, capacity: int, seed: int = 1) -> dict[str, Any]:
    """Write ``count`` handles and records straight into the cluster, in the router's key layout."""
    layout = ClusterStore(c.url, capacity=capacity, entry_ttl=ENTRY_TTL, last_turn_ttl=3600, lock_ttl=300)
    rc = redis.RedisCluster(host="127.0.0.1", port=c.nodes[0].port)
    rng = random.Random(seed)
    started = time.perf_counter()
    sizes = 0
    batch = 2000
    try:
        for start in range(0, count, batch):
            pipe = rc.pipeline(transaction=False)
            now = time.time()
            for n in range(start, min(start + batch, count)):
                key = f"{n:032x}"
                h_key, _, t_key, idx = layout.keys(key)
                raw = realistic_handle(rng, n).to_json()
                sizes += len(raw)
                # As if stored over the last 100 s: every handle outlives the fill and the traffic after it.
                ttl_ms = int(ENTRY_TTL * 1000) - rng.randint(0, 100_000)
                pipe.set(h_key, raw, px=ttl_ms)
                pipe.zadd(idx, {h_key: int(now * 1000) + ttl_ms})
                pipe.set(t_key, LastTurn(8, now, True, "r").to_json(), px=3_600_000)
            pipe.execute()
    finally:
        rc.close()
    used = [int(n.client().info("memory")["used_memory"]) for n in c.nodes]
    return {"handles_filled": count, "fill_s": round(time.perf_counter() - started, 1),
            "mean_handle_json_bytes": round(sizes / max(count, 1)), "redis_used_memory_mib": [u >> 20 for u in used]}


# ---------------------------------------------------------------------------------------------- traffic
@dataclass
class Phase:
    name: str
    latencies: list[float] = field(default_factory=list)
    later: int = 0
    later_reused: int = 0
    errors: int = 0
    turns: int = 0
    peak_in_flight: int = 0
    wall_s: float = 0.0


def _contents(raw: bytes) -> str:
    text = []
    for frame in raw.split(b"\n\n"):
        if frame.startswith(b"data: {") and b'"content"' in frame:
            for choice in json.loads(frame[6:]).get("choices", []):
                text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text)


async def conversation(session: aiohttp.ClientSession, urls: list[str], i: int, turns: int, think: float,
                       phase: Phase, tag: str, in_flight: list[int]) -> None:
    cid = f"{tag}-{i}"
    auth = f"Bearer tenant-{i % 4}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Conversation {cid}: plan a trip. " * 3}]
    await asyncio.sleep(random.uniform(0, think))
    for k in range(turns):
        body = {"model": "Qwen/Qwen3-32B", "messages": messages, "stream": True, "conversation_id": cid,
                "max_tokens": 64}
        started = time.perf_counter()
        in_flight[0] += 1
        phase.peak_in_flight = max(phase.peak_in_flight, in_flight[0])
        try:
            async with session.post(urls[(i + k) % len(urls)] + CHAT, json=body,
                                    headers={"Authorization": auth}) as resp:
                header = resp.headers.get("kvdiag-reuse", "")
                raw = await resp.read()
            if resp.status != 200 or not raw.endswith(b"[DONE]\n\n"):
                raise RuntimeError(f"HTTP {resp.status}")
        except (aiohttp.ClientError, RuntimeError, TimeoutError):
            phase.errors += 1
            return
        finally:
            in_flight[0] -= 1
        phase.latencies.append(time.perf_counter() - started)
        phase.turns += 1
        if k > 0:
            phase.later += 1
            # The stub's P computes nothing and reports no cached tokens (so the verdict reads unknown):
            # reuse here is the router finding the handle in Redis and injecting it.
            phase.later_reused += "; handle=full" in header or "; handle=trimmed" in header
        messages = [*messages, {"role": "assistant", "content": _contents(raw)},
                    {"role": "user", "content": f"turn {k + 2}: go on"}]
        if k + 1 < turns:
            await asyncio.sleep(random.uniform(0, think))


async def drive(urls: list[str], n: int, turns: int, think: float, phase: Phase, tag: str) -> None:
    connector = aiohttp.TCPConnector(limit=2000, limit_per_host=1000)
    timeout = aiohttp.ClientTimeout(total=300)
    in_flight = [0]
    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(conversation(session, urls, i, turns, think, phase, tag, in_flight)
                               for i in range(n)))
    phase.wall_s = time.perf_counter() - started


# ---------------------------------------------------------------------------------------------- processes
@contextlib.contextmanager
def stub(tmp: Path) -> Iterator[int]:
    ready = tmp / "stub.ready"
    proc = subprocess.Popen([sys.executable, str(STUB), "--serve-stub", str(ready)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the stub backend did not start")
            time.sleep(0.05)
        yield int(json.loads(ready.read_text())["ports"][0])
    finally:
        proc.terminate()
        proc.wait(10)


class Sampler:
    """RSS of every router, once a second, in the background."""

    def __init__(self, routers: list[RouterProcess]) -> None:
        self.routers = routers
        self.peak = [0] * len(routers)
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            for i, r in enumerate(self.routers):
                with contextlib.suppress(OSError):
                    self.peak[i] = max(self.peak[i], r.rss_kib())
            await asyncio.sleep(1.0)

    def __enter__(self) -> Sampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


async def series(url: str) -> int:
    """Metric series a router exposes (sample lines of /metrics)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


async def sample(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(name))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else float("nan")


def overhead(routers: list[RouterProcess], since: list[int]) -> tuple[list[float], list[int]]:
    out, counts = [], []
    for r, seen in zip(routers, since, strict=True):
        events = r.read_events()
        counts.append(len(events))
        out += [float(e.get("router_overhead_ms") or 0.0) for e in events[seen:]]
    return out, counts


def summary(phase: Phase, router_ms: list[float]) -> dict[str, Any]:
    return {"phase": phase.name, "turns": phase.turns, "errors": phase.errors, "wall_s": round(phase.wall_s, 1),
            "turns_per_s": round(phase.turns / phase.wall_s, 1) if phase.wall_s else None,
            "later_turns": phase.later, "later_turns_reused": phase.later_reused,
            "reuse_ratio": round(phase.later_reused / phase.later, 4) if phase.later else None,
            "client_p50_ms": round(pct(phase.latencies, 0.5) * 1000, 2),
            "client_p99_ms": round(pct(phase.latencies, 0.99) * 1000, 2),
            "router_own_p50_ms": round(pct(router_ms, 0.5), 3), "router_own_p99_ms": round(pct(router_ms, 0.99), 3),
            "peak_in_flight_turns": phase.peak_in_flight}


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"args": vars(args) | {"json": None}}
    with cluster(tmp / "cluster", "redis") as c, stub(tmp) as port:
        flags = ["--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(port), "--decoder-hosts", "127.0.0.1",
                 "--decoder-ports", str(port), "--state", c.url, "--block-size", "16", "--max-entries",
                 str(args.capacity), "--max-connections", "2000"]
        routers = [RouterProcess(i, tmp, flags).start() for i in range(args.replicas)]
        try:
            urls = [r.url for r in routers]
            results["rss_start_kib"] = [r.rss_kib() for r in routers]
            results["series_start"] = [await series(u) for u in urls]
            with Sampler(routers) as sampler:
                warm = Phase("empty store")
                # A tenth of the conversations, a tenth of the think time: the same offered rate.
                await drive(urls, max(args.conversations // 10, 1), args.turns, args.think / 10, warm, "warm")
                await asyncio.sleep(0.5)
                warm_ms, seen = overhead(routers, [0] * len(routers))
                results["phases"] = [summary(warm, warm_ms)]
                results["fill"] = fill(c, args.handles, args.capacity)
                await asyncio.sleep(6)  # a sweep (every 5 s) updates the size gauge
                results["store_after_fill"] = await sample(urls[0], "kvdiag_store_entries")
                main = Phase(f"{args.conversations} conversations, {args.handles} handles stored")
                await drive(urls, args.conversations, args.turns, args.think, main, "main")
                await asyncio.sleep(0.5)
                main_ms, _ = overhead(routers, seen)
                results["phases"].append(summary(main, main_ms))
                results["rss_peak_kib"] = list(sampler.peak)
            results["rss_end_kib"] = [r.rss_kib() for r in routers]
            results["series_end"] = [await series(u) for u in urls]
            await asyncio.sleep(5.5)
            results["store_entries_end"] = await sample(urls[0], "kvdiag_store_entries")
            results["store_bound"] = 256 * -(-args.capacity // 256)
            results["evictions_capacity"] = sum([await sample(u, 'kvdiag_store_evictions_total{reason="capacity"')
                                                 for u in urls])
            results["store_errors"] = sum([await sample(u, "kvdiag_store_errors_total") for u in urls])
            results["redis_used_memory_mib_end"] = [int(n.client().info("memory")["used_memory"]) >> 20
                                                    for n in c.nodes]
        finally:
            for r in routers:
                r.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=10_000)
    parser.add_argument("--handles", type=int, default=1_000_000, help="handles written straight into Redis")
    parser.add_argument("--capacity", type=int, default=1_000_000, help="the routers' --max-entries")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation")
    parser.add_argument("--think", type=float, default=60.0,
                        help="longest think time before a turn (s; uniform): sets the offered rate, about "
                             "conversations / (think / 2) turns/s")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    try:
        import uvloop
        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    with tempfile.TemporaryDirectory(prefix="kvdiag-scale-") as tmp:
        results = runner(run(args, Path(tmp)))
    results["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "arch": platform.machine(),
                          "loadavg_at_end": os.getloadavg()}
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
