"""Generate a mixed log data set of a given size for explain/report benchmarks (stock + instrumented).

Writes, under ``--out`` (default ``benchmarks/data/<size>``): ``client-stats.jsonl`` (benchmark
RequestStats records), ``client.jsonl`` / ``router-events.jsonl`` / ``prefill-events.jsonl`` (TurnEvents),
``proxy.log`` (disagg_proxy lines), ``prefill.log`` / ``decode.log`` (stock vLLM lines, INFO plus request
logging, uvicorn access lines and periodic stat lines as bulk). Conversations are ``CONV_ID_<n>``; each
later turn gets one of the stock-visible outcomes (remote hit, expiry, transfer failure, stale entry).

    .venv/bin/python benchmarks/gen_logs.py --size 1GB
    .venv/bin/python benchmarks/gen_logs.py --size 50MB --out /tmp/bench
    .venv/bin/python benchmarks/gen_logs.py --size 1GB --stat-interval 10 --out /tmp/bench-periodic
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
import uuid
from pathlib import Path
from typing import IO

OUTCOMES = ("remote_hit", "remote_hit", "remote_hit", "expired_remote_read", "transfer_failed",
            "router_entry_expired")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?)B?", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 50MB or 1GB")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)])


def _ts(t: float) -> str:
    return time.strftime("%m-%d %H:%M:%S", time.gmtime(t))


def _proxy_ts(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


class Writer:
    """All output files of one data set."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        names = ("client-stats.jsonl", "client.jsonl", "router-events.jsonl", "prefill-events.jsonl", "proxy.log",
                 "prefill.log", "decode.log")
        self.fh: dict[str, IO[str]] = {n: (out / n).open("w", encoding="utf-8", buffering=1 << 20) for n in names}
        self.out = out

    def w(self, name: str, line: str) -> None:
        self.fh[name].write(line + "\n")

    def size(self) -> int:
        return sum(fh.tell() for fh in self.fh.values())

    def close(self) -> None:
        for fh in self.fh.values():
            fh.close()


def _stat_line(pid: int, t: float, rng: random.Random) -> str:
    return (f"(APIServer pid={pid}) INFO {_ts(t)} [loggers.py:335] Engine 000: Avg prompt throughput: "
            f"{rng.uniform(10, 9000):.1f} tokens/s, Avg generation throughput: {rng.uniform(1, 900):.1f} tokens/s,"
            f" Running: {rng.randint(0, 40)} reqs, Waiting: 0 reqs, GPU KV cache usage: "
            f"{rng.uniform(0, 90):.1f}%, Prefix cache hit rate: {rng.uniform(0, 90):.1f}%")


def _noise(w: Writer, t: float, rng: random.Random, n: int, stats: bool = True) -> None:
    """Bulk lines a real engine writes that explain must skip: access lines, stats (unless ``stats`` is off:
    written per interval instead), request logging."""
    for _ in range(n):
        role = rng.choice(("prefill.log", "decode.log"))
        rid = uuid.UUID(int=rng.getrandbits(128)).hex
        pid = 1 if role == "prefill.log" else 2
        w.w(role, f'(APIServer pid={pid}) INFO:     10.0.0.{rng.randint(1, 254)}:{rng.randint(1024, 65000)} - '
                  '"POST /v1/chat/completions HTTP/1.1" 200 OK')
        w.w(role, _stat_line(pid, t, rng) if stats else
            f'(APIServer pid={pid}) INFO:     10.0.0.{rng.randint(1, 254)}:{rng.randint(1024, 65000)} - '
            '"GET /metrics HTTP/1.1" 200 OK')
        w.w(role, f"(EngineCore_DP0 pid={pid + 10}) INFO {_ts(t)} [core.py:93] Step {rng.randint(1, 10**9)} "
                  f"scheduled {rng.randint(1, 64)} seqs for request batch {rid}")


class StatWindows:
    """vLLM's periodic stat logging (every ``interval`` seconds): each engine's ``Engine 000`` line, and P's
    ``KV Transfer metrics`` line for an interval that saw a D->P read succeed or fail."""

    def __init__(self, w: Writer, t0: float, interval: float, rng: random.Random) -> None:
        self.w, self.interval, self.rng = w, interval, rng
        self.next = t0 + interval
        self.ok = self.failed = self.expired = 0
        self.planned = False

    def read(self, t: float, outcome: str) -> None:
        """A D->P read P tried at ``t``: counted in its interval (P logs its transfer plan at its first)."""
        if self.interval <= 0:
            return
        if not self.planned:
            self.planned = True
            self.w.w("prefill.log", f"(EngineCore_DP0 pid=11) INFO {_ts(t)} [base_worker.py:2525] Transfer plan: "
                     "TransferTopology(tp_ratio=1, num_kv_heads=8, local_tp=1, remote_tp=1, remote_pp=0, "
                     "local_dcp=1, remote_dcp=1, local_rank=0, remote_block_len=65536)")
        if outcome == "expired_remote_read":
            self.expired += 1
        elif outcome == "transfer_failed":
            self.failed += 1
        else:
            self.ok += 1

    def until(self, t: float) -> None:
        """Write the lines of every interval that ended by ``t``."""
        while self.interval > 0 and t >= self.next:
            self.w.w("prefill.log", _stat_line(1, self.next, self.rng))
            if self.ok or self.failed or self.expired:
                xfer = self.rng.uniform(1, 20)
                self.w.w("prefill.log", f"(APIServer pid=1) INFO {_ts(self.next)} [metrics.py:108] KV Transfer "
                         f"metrics: Num successful transfers={self.ok}, Avg xfer time (ms)={xfer:.1f}, P90 xfer time "
                         f"(ms)={xfer * 1.5:.1f}, Avg post time (ms)=0.5, P90 post time (ms)=0.6, Avg MB per "
                         f"transfer=0.9, Throughput (MB/s)=200.0, Avg number of descriptors=12.0, Num failed "
                         f"transfers={self.failed}, Num KV expired reqs={self.expired}, Num notifs after expiry=0")
            self.w.w("decode.log", _stat_line(2, self.next, self.rng))
            self.ok = self.failed = self.expired = 0
            self.next += self.interval


def generate(out: Path, target: int, seed: int = 0, noise_per_turn: int = 12, stat_interval: float = 0.0
             ) -> dict[str, int]:
    """Write the data set; return counts. ``stat_interval`` > 0: the engines' stat lines once per interval, as
    vLLM writes them (with P's transfer counts), instead of in bulk among the noise."""
    rng = random.Random(seed)
    w = Writer(out)
    t0 = 1_764_400_000.0
    windows = StatWindows(w, t0, stat_interval, random.Random(seed + 1))
    w.w("proxy.log", f"{_proxy_ts(t0)} [INFO] disagg_proxy: Ready: 1 prefill, 1 decode instances")
    for role, pid in (("prefill.log", 11), ("decode.log", 12)):
        w.w(role, f"(EngineCore_DP0 pid={pid}) INFO {_ts(t0)} [base_scheduler.py:188] Bidirectional KV transfer is "
                  "enabled and the kv recompute threshold is set to 64 tokens.KV blocks on D are released after a "
                  "TTL of 480 seconds.")
    conv_n = turns_total = 0
    t = t0
    while w.size() < target:
        conv_n += 1
        conv = f"CONV_ID_{conv_n}"
        prev_d: str | None = None
        n_turns = rng.randint(2, 6)
        prompt = rng.randint(200, 4000)
        for turn in range(1, n_turns + 1):
            t += rng.uniform(0.01, 0.2)
            windows.until(t)
            turns_total += 1
            rid = uuid.UUID(int=rng.getrandbits(128)).hex
            p_id, d_id = f"chatcmpl-{rid}-{rng.getrandbits(32):08x}", f"chatcmpl-{rid}-{rng.getrandbits(32):08x}"
            outcome = "first_turn" if turn == 1 else rng.choice(OUTCOMES)
            ttft = rng.uniform(50, 800)
            pt = f"{_proxy_ts(t)} [INFO] disagg_proxy:"
            if outcome == "router_entry_expired":
                w.w("proxy.log", f"{pt} conv={conv}: stale cache entry (age=512.0s > ttl=450.0s), discarding")
            if prev_d and outcome != "router_entry_expired":
                w.w("proxy.log", f"{pt} conv={conv}: cache HIT (age={rng.uniform(1, 400):.1f}s)")
                w.w("proxy.log", f"{pt} [{rid}] conv={conv}: sending D's cached blocks to P (remote_request_id="
                                 f"{prev_d})")
            else:
                w.w("proxy.log", f"{pt} [{rid}] conv={conv}: cache MISS")
            w.w("prefill.log", f"(APIServer pid=1) INFO {_ts(t)} [logger.py:45] Received request {p_id[:-9]}: "
                               f"params: SamplingParams(n=1, temperature=0.0, max_tokens=1), lora_request: None.")
            failed = False
            if outcome == "expired_remote_read" and prev_d:
                w.w("decode.log", f"(EngineCore_DP0 pid=12) WARNING {_ts(t)} [base_worker.py:3370] Releasing expired "
                                  f"KV blocks for request {prev_d} which were retrieved by 0 remote worker(s) before "
                                  "lease expired.")
                w.w("prefill.log", f"(EngineCore_DP0 pid=11) WARNING {_ts(t)} [pull_worker.py:161] Declining "
                                   f"expired remote read for {p_id} from engine d695e402-ef6c-4155-82d0-bfca3da4e06f.")
                failed = True
            elif outcome == "transfer_failed" and prev_d:
                ctx = {"failure_type": "handshake_failed", "request_id": p_id, "engine_id": "e-p",
                       "remote_engine_id": "e-d", "remote_request_id": prev_d}
                w.w("prefill.log", f"(EngineCore_DP0 pid=11) ERROR {_ts(t)} [base_worker.py:1471] NIXL transfer "
                                   f"failure: handshake_failed | Context: {ctx!r}")
                failed = True
            if prev_d and outcome != "router_entry_expired":  # (P read D's blocks, or tried to)
                windows.read(t, outcome)
            if failed:
                w.w("prefill.log", f"(EngineCore_DP0 pid=11) ERROR {_ts(t)} [scheduler.py:3764] Failing 1 "
                                   f"request(s) due to KV load failure (failure_policy=fail, {prompt} tokens "
                                   f"affected). Request IDs: {{'{p_id}'}}")
            else:
                w.w("proxy.log", f"{pt} [{rid}] Prefill done in {rng.uniform(20, 400):.0f}ms")
                w.w("proxy.log", f"{pt} conv={conv}: cached D blocks (remote_request_id={d_id}, blocks="
                                 f"{prompt // 16})")
            # after a failed turn no handle was stored: the stock proxy logs a MISS
            verdict = outcome if turn == 1 or prev_d or outcome == "router_entry_expired" else "metadata_not_returned"
            w.w("client-stats.jsonl", json.dumps({
                "ttft_ms": round(ttft, 2), "tpot_ms": 10.0, "latency_ms": round(ttft + 400, 2),
                "start_time_ms": round(t * 1000, 1), "input_num_turns": 2 * turn - 1, "input_num_tokens": prompt,
                "output_num_tokens": 40, "output_num_chunks": 40, "output_num_first_chunk_tokens": 1,
                "approx_cached_percent": 0.0, "conversation_id": conv, "client_id": conv_n % 8}))
            ev = {"v": 1, "ts": round(t, 3), "conversation_id": conv, "turn": turn, "request_id": rid}
            w.w("client.jsonl", json.dumps({**ev, "source": "client", "event": "client_turn",
                                            "ttft_ms": round(ttft, 2), "prompt_tokens": prompt}))
            w.w("router-events.jsonl", json.dumps({**ev, "source": "router", "event": "router_turn",
                                                   "outcome": verdict, "prompt_tokens": prompt}))
            w.w("prefill-events.jsonl", json.dumps({
                "v": 1, "ts": round(t, 3), "source": "prefill", "event": "prefill_request", "request_id": rid,
                "engine_request_id": p_id, "prompt_tokens": prompt, "outcome": verdict}))
            prev_d = None if failed else d_id
            prompt += rng.randint(60, 600)
            _noise(w, t, rng, noise_per_turn, stats=stat_interval <= 0)
    size = w.size()
    w.close()
    return {"conversations": conv_n, "turns": turns_total, "bytes": size}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("100MB"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stat-interval", type=float, default=0.0, metavar="S",
                    help="Write the engines' stat lines every S seconds as vLLM does (10 is its default), with P's "
                         "transfer counts, so P's stats windows can decide turns; default: in bulk among the noise.")
    args = ap.parse_args(argv)
    out = args.out or Path(__file__).parent / "data" / f"{args.size >> 20}MB"
    t = time.perf_counter()
    counts = generate(out, args.size, args.seed, stat_interval=args.stat_interval)
    print(json.dumps({**counts, "out": str(out), "seconds": round(time.perf_counter() - t, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
