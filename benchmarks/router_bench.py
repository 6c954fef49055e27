"""Router overhead benchmark: direct P/D calls vs the same turns through ``kvdiag router``, in one run.

Starts an emulated P and D with zero model delay (``kvdiag sim ... --time-scale 0``) and the router
(``kvdiag router``, uvloop, events file on) as subprocesses, then drives multi-turn conversations
with aiohttp. Conversations take turns among three stream kinds (``--streams``): plain content,
a reasoning trace then content (reasoning deltas, as vLLM 0.33 with a reasoning parser streams
them), and a tool call (tool_calls deltas, the agent sending the call and its result back). The
*direct* client does what the example proxy does (P non-streaming with the previous turn's D
handle, then D streaming, capture D's handle); the *router* client sends one
streaming request with a ``conversation_id``. Direct and routed turns are interleaved so both see
the same machine load. Added latency = routed percentile − direct percentile (turn start to the
last byte). CPU per turn is the router process's user+system time over the phase ÷ turns.

Usage::

    .venv/bin/python benchmarks/router_bench.py            # all phases, ~1-2 min
    .venv/bin/python benchmarks/router_bench.py --quick    # shorter phases
    .venv/bin/python benchmarks/router_bench.py --json out.json
    .venv/bin/python benchmarks/router_bench.py --streams plain   # the earlier, content-only traffic
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

VENV_BIN = Path(sys.executable).parent
KVDIAG = str(VENV_BIN / "kvdiag")
CHAT = "/v1/chat/completions"
MISS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None}
MAX_TOKENS = 16  # content (and reasoning, and tool-argument) frames per kind of reply
TURNS_PER_CONVERSATION = 5
STREAM_KINDS = ("plain", "reasoning", "tool")
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a term up.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
# The emulated engines' request hint (vLLM ignores unknown fields): what the model writes per kind.
SIM_HINTS = {"plain": None, "reasoning": {"reasoning_tokens": MAX_TOKENS, "content_tokens": MAX_TOKENS},
             "tool": {"tool_calls": 1, "tool_arg_tokens": MAX_TOKENS}}
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------- stub backend
def _stub_frame(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _stub_prompt_tokens(body: dict[str, Any]) -> int:
    return 40 * (1 + len(body.get("messages", [])))


def _stub_deltas(kind: str) -> list[dict[str, Any]]:
    """The deltas vLLM 0.33 streams for one reply of ``kind`` (reasoning parser, hermes tool parser)."""
    if kind == "reasoning":
        return [{"reasoning": f" r{i}"} for i in range(MAX_TOKENS)] + [{"content": f" t{i}"} for i in range(MAX_TOKENS)]
    if kind == "tool":
        # vLLM's hermes parser sets content explicitly (null) beside every tool-call delta.
        start = {"content": None, "tool_calls": [{"id": "chatcmpl-tool-0123456789abcdef", "type": "function",
                                                  "index": 0, "function": {"name": "lookup"}}]}
        args = ['{"q": "'] + [f"w{i} " for i in range(MAX_TOKENS - 2)] + ['"}']
        return [start] + [{"content": None, "tool_calls": [{"index": 0, "function": {"arguments": a}}]}
                          for a in args]
    return [{"content": f" t{i}"} for i in range(MAX_TOKENS)]


async def _serve_stub(ready: Path) -> None:
    """A canned P+D (one process): what vLLM sends, at almost no CPU cost, to isolate the router's cost."""
    from aiohttp import web

    counter = {"n": 0}

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = request.headers.get("X-Request-Id", "x")
        counter["n"] += 1
        if request.path == "/tokenize":
            n = _stub_prompt_tokens(body)
            return web.json_response({"count": n, "max_model_len": 131072, "tokens": list(range(n)),
                                      "token_strs": None})
        if not body.get("stream"):
            prompt = _stub_prompt_tokens(body)
            params = {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_block_ids": [list(range(-(-prompt // 16)))], "remote_engine_id": "stub-p",
                      "remote_request_id": f"chatcmpl-{rid}-00000000", "remote_host": "127.0.0.1", "remote_port": 1,
                      "tp_size": 1, "remote_num_tokens": prompt}
            return web.json_response({"id": f"chatcmpl-{rid}", "object": "chat.completion", "model": "m",
                                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"},
                                                   "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": prompt, "completion_tokens": 1,
                                                "total_tokens": prompt + 1,
                                                "prompt_tokens_details": {"cached_tokens": 0}},
                                      "kv_transfer_params": params})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        # vLLM 0.33's layout: every token frame names finish_reason, token_ids and kv_transfer_params (null).
        head = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": 1733000000,
                "model": "Qwen/Qwen3-32B"}
        prompt = _stub_prompt_tokens(body)
        ids = bool(body.get("return_token_ids"))
        await resp.write(_stub_frame({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                          "logprobs": None, "finish_reason": None}],
                                      "prompt_token_ids": list(range(prompt)) if ids else None, "prompt_text": None}))
        kind = body.get("kvdiag_bench_kind", "plain")
        deltas = _stub_deltas(kind)
        for i, delta in enumerate(deltas):
            await resp.write(_stub_frame({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                              "finish_reason": None,
                                                              "token_ids": [900_000 + i] if ids else None}],
                                          "kv_transfer_params": None}))
        num = prompt + len(deltas)  # D holds KV for every output token but the last
        final = {**head, "choices": [{"index": 0, "delta": {"content": ""}, "logprobs": None,
                                      "finish_reason": "tool_calls" if kind == "tool" else "stop", "stop_reason": None,
                                      "token_ids": [999_999] if ids else None, "weight_versions": None}],
                 "kv_transfer_params": {"do_remote_prefill": False, "do_remote_decode": True,
                                        "remote_block_ids": [list(range(-(-num // 16)))], "remote_engine_id": "stub-d",
                                        "remote_request_id": f"chatcmpl-{rid}-11111111", "remote_host": "127.0.0.1",
                                        "remote_port": 2, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
                                        "remote_num_tokens": num, "remote_blocks_expiry_time": 1e9,
                                        "remote_registration_generation": 1, "transfer_mode": "pull"}}
        await resp.write(_stub_frame(final))
        if (body.get("stream_options") or {}).get("include_usage"):
            # vLLM's final usage chunk; D's cached count is its own (the whole prompt came from P).
            await resp.write(_stub_frame({**head, "choices": [], "usage": {
                "prompt_tokens": prompt, "total_tokens": prompt + len(deltas) + 1, "completion_tokens": len(deltas) + 1,
                "prompt_tokens_details": {"cached_tokens": prompt - 1}}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post(CHAT, handle)
    app.router.add_post("/tokenize", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    ports = []
    for _ in range(2):  # one port as P, one as D (same process)
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
    for address in runner.addresses:
        ports.append(int(address[1]))
    tmp = ready.with_suffix(".tmp")
    tmp.write_text(json.dumps({"ports": ports}))
    tmp.replace(ready)
    await asyncio.Event().wait()


# ---------------------------------------------------------------------------------------------- processes
def _spawn(args: list[str], ready: Path, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    fh = log.open("wb")
    proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 30
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{' '.join(args)} did not start; see {log}")
        time.sleep(0.05)
    return proc


@contextlib.contextmanager
def processes(tmp: Path, backend: str, router_flags: list[str],
              router_path: str | None = None) -> Iterator[dict[str, Any]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        info: dict[str, Any] = {}
        if backend == "sim":
            for role in ("prefill", "decode"):
                ready = tmp / f"{role}.ready"
                procs.append(_spawn([KVDIAG, "sim", role, "--port", "0", "--ready-file", str(ready), "--time-scale",
                                     "0", "--mode", "instrumented", "--no-prefix-caching", "--num-blocks", "200000",
                                     "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                                     "--enable-auto-tool-choice"],
                                    ready, tmp / f"{role}.out"))
                info[role] = json.loads(ready.read_text())
        else:
            ready = tmp / "stub.ready"
            procs.append(_spawn([sys.executable, __file__, "--serve-stub", str(ready)], ready, tmp / "stub.out"))
            ports = json.loads(ready.read_text())["ports"]
            info["prefill"], info["decode"] = {"port": ports[0]}, {"port": ports[1]}
        ready = tmp / "router.ready"
        router = _spawn([KVDIAG, "router", "--host", "127.0.0.1", "--port", "0", "--ready-file", str(ready),
                         "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(info["prefill"]["port"]),
                         "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(info["decode"]["port"]),
                         "--events-file", str(tmp / "router-events.jsonl"), *router_flags], ready, tmp / "router.out",
                        env={**os.environ, "PYTHONPATH": router_path} if router_path else None)
        procs.append(router)
        info["router"] = json.loads(ready.read_text())
        info["router_pid"] = router.pid
        info["events"] = tmp / "router-events.jsonl"
        yield info
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


# ---------------------------------------------------------------------------------------------- clients
STREAMS = list(STREAM_KINDS)  # set from --streams
INCLUDE_USAGE = [False]  # set from --include-usage


@dataclass
class Conversation:
    cid: str
    messages: list[dict[str, Any]]
    kind: str = "plain"
    handle: dict[str, Any] | None = None
    turns: int = 0


def _new_conversation(n: int) -> Conversation:
    return Conversation(f"bench-{n}-{random.getrandbits(32):08x}",
                        [{"role": "user", "content": f"Conversation {n}: summarise the design of a router. " * 4}],
                        STREAMS[n % len(STREAMS)])


def _advance(conv: Conversation, reply: dict[str, Any]) -> None:
    conv.turns += 1
    if conv.turns >= TURNS_PER_CONVERSATION:
        fresh = _new_conversation(random.getrandbits(20))
        conv.messages, conv.kind, conv.handle, conv.turns = fresh.messages, fresh.kind, None, 0
        conv.cid = f"bench-{random.getrandbits(48):012x}"
        return
    # What an agent sends back: the content (reasoning dropped), or the tool call and its result.
    message: dict[str, Any] = {"role": "assistant", "content": reply["content"]}
    if reply["tool_calls"]:
        message["content"] = reply["content"] or None
        message["tool_calls"] = reply["tool_calls"]
        follow = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "lookup result " * 8}
    else:
        follow = {"role": "user", "content": f"turn {conv.turns + 1}: go on"}
    conv.messages = [*conv.messages, message, follow]


def _body(conv: Conversation, backend: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "Qwen/Qwen3-32B", "messages": conv.messages, "stream": True,
                            "max_tokens": 4 * MAX_TOKENS}
    if INCLUDE_USAGE[0]:
        body["stream_options"] = {"include_usage": True}
    if conv.kind == "tool":
        body["tools"] = TOOLS
        body["tool_choice"] = "auto"
    if backend == "sim":
        if SIM_HINTS[conv.kind] is not None:
            body["kvdiag_sim"] = SIM_HINTS[conv.kind]
        else:
            body["max_tokens"] = MAX_TOKENS
    else:
        body["kvdiag_bench_kind"] = conv.kind
    return body


def _parse_stream(raw: bytes) -> tuple[dict[str, Any], dict[str, Any] | None]:
    text, params, calls = "", None, {}
    for frame in raw.split(b"\n\n"):
        if not frame.startswith(b"data: {"):
            continue
        obj = json.loads(frame[6:])
        if obj.get("kv_transfer_params"):
            params = obj["kv_transfer_params"]
        for ch in obj.get("choices", []):
            delta = ch.get("delta") or {}
            text += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                slot = calls.setdefault(tc.get("index", 0), {"id": None, "type": "function",
                                                             "function": {"name": "", "arguments": ""}})
                slot["id"] = slot["id"] or tc.get("id")
                fn = tc.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
    return {"content": text, "tool_calls": [calls[i] for i in sorted(calls)]}, params


async def direct_turn(session: aiohttp.ClientSession, p_url: str, d_url: str, conv: Conversation,
                      backend: str) -> float:
    """The example proxy's work done by the client: P then D, carrying D's handle. Returns seconds."""
    started = time.perf_counter()
    rid = os.urandom(16).hex()
    params = dict(conv.handle, do_remote_decode=True, do_remote_prefill=False) if conv.handle else dict(MISS)
    body = {**_body(conv, backend), "max_tokens": 1, "stream": False, "kv_transfer_params": params}
    async with session.post(p_url + CHAT, json=body, headers={"X-Request-Id": rid}) as resp:
        p_body = await resp.json()
    p_params = dict(p_body.get("kv_transfer_params") or {})
    p_params.pop("kvdiag", None)
    body = {**_body(conv, backend), "kv_transfer_params": p_params}
    async with session.post(d_url + CHAT, json=body, headers={"X-Request-Id": rid}) as resp:
        raw = await resp.read()
    elapsed = time.perf_counter() - started
    reply, conv.handle = _parse_stream(raw)
    _advance(conv, reply)
    return elapsed


async def router_turn(session: aiohttp.ClientSession, r_url: str, conv: Conversation, backend: str) -> float:
    """One streaming turn through the router. Returns seconds."""
    started = time.perf_counter()
    body = {**_body(conv, backend), "conversation_id": conv.cid}
    async with session.post(r_url + CHAT, json=body) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"router answered {resp.status}: {raw[:200]!r}")
    elapsed = time.perf_counter() - started
    reply, _ = _parse_stream(raw)
    _advance(conv, reply)
    return elapsed


@dataclass
class Phase:
    name: str
    direct: list[float] = field(default_factory=list)
    routed: list[float] = field(default_factory=list)
    errors: int = 0
    router_cpu_s: float = 0.0
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float:
            xs = sorted(xs)
            return xs[min(int(q * len(xs)), len(xs) - 1)] * 1000 if xs else float("nan")

        out: dict[str, Any] = {"phase": self.name, "turns_direct": len(self.direct), "turns_routed": len(self.routed),
                               "errors": self.errors, "wall_s": round(self.wall_s, 2)}
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            if self.direct:
                out[f"direct_{label}_ms"] = round(pct(self.direct, q), 3)
            if self.routed:
                out[f"router_{label}_ms"] = round(pct(self.routed, q), 3)
            if self.direct and self.routed:
                out[f"added_{label}_ms"] = round(pct(self.routed, q) - pct(self.direct, q), 3)
        if self.routed:
            out["router_cpu_ms_per_turn"] = round(self.router_cpu_s / len(self.routed) * 1000, 3)
            out["routed_turns_per_s"] = round(len(self.routed) / self.wall_s, 1) if self.wall_s else None
        return out


SLICE_S = 1.0  # direct and routed traffic alternate in slices of this length, so both see the same load


async def open_loop(phase: Phase, rate: float, seconds: float, run_direct: Callable[[Conversation], Awaitable[float]],
                    run_routed: Callable[[Conversation], Awaitable[float]], pid: int) -> None:
    """``rate`` turns/s for ``seconds``: alternating 1 s slices of direct and routed turns (``seconds`` each)."""
    idle: dict[str, list[Conversation]] = {"d": [], "r": []}
    tasks: set[asyncio.Task[None]] = set()
    counter = 0
    cpu = 0.0

    async def one(kind: str) -> None:
        nonlocal counter
        pool = idle[kind]
        if pool:
            conv = pool.pop()
        else:
            counter += 1
            conv = _new_conversation(counter)
        try:
            if kind == "d":
                phase.direct.append(await run_direct(conv))
            else:
                phase.routed.append(await run_routed(conv))
        except Exception:
            phase.errors += 1
        pool.append(conv)

    interval = 1.0 / rate
    per_slice = max(int(rate * SLICE_S), 1)
    routed_wall = 0.0
    for n_slice in range(int(2 * seconds / SLICE_S)):
        kind = "d" if n_slice % 2 == 0 else "r"
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        for i in range(per_slice):
            delay = t0 + i * interval - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.get_running_loop().create_task(one(kind))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks:
            await asyncio.gather(*list(tasks))
        if kind == "r":
            cpu += cpu_seconds(pid) - cpu0
            routed_wall += time.perf_counter() - t0
    phase.wall_s = routed_wall
    phase.router_cpu_s = cpu


async def closed_loop(phase: Phase, workers: int, seconds: float,
                      run: Callable[[Conversation], Awaitable[float]], sink: list[float], pid: int) -> None:
    """``workers`` concurrent clients, each sending its next turn as soon as the last one ends."""
    stop_at = time.perf_counter() + seconds

    async def worker(n: int) -> None:
        conv = _new_conversation(n)
        while time.perf_counter() < stop_at:
            try:
                sink.append(await run(conv))
            except Exception:
                phase.errors += 1

    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(workers)))
    phase.wall_s = time.perf_counter() - t0
    phase.router_cpu_s = cpu_seconds(pid) - cpu0


async def bench(args: argparse.Namespace, info: dict[str, Any], backend: str) -> list[dict[str, Any]]:
    p_url = f"http://127.0.0.1:{info['prefill']['port']}"
    d_url = f"http://127.0.0.1:{info['decode']['port']}"
    r_url = info["router"]["url"]
    pid = info["router_pid"]
    scale = 0.5 if args.quick else 1.0
    connector = aiohttp.TCPConnector(limit=2000, limit_per_host=1000)
    results = []
    events: Path = info["events"]
    seen = {"lines": 0}

    async def report_async(summary: dict[str, Any]) -> None:
        # The router's own view of the phase: router_overhead_ms of the turns it logged meanwhile.
        await asyncio.sleep(0.3)  # events are flushed every 50 ms by a writer thread
        lines = events.read_text().splitlines() if events.exists() else []
        new, seen["lines"] = lines[seen["lines"]:], len(lines)
        turns = [json.loads(line) for line in new]
        overhead = sorted(e.get("router_overhead_ms", 0.0) for e in turns)
        if overhead:
            summary["router_logged_overhead_p50_ms"] = overhead[len(overhead) // 2]
            summary["router_logged_overhead_p99_ms"] = overhead[min(int(0.99 * len(overhead)), len(overhead) - 1)]
        # What the reuse rule did meanwhile: handles injected whole or cut, and why.
        later = [e for e in turns if e.get("handle_tokens") is not None]
        if later:
            summary["reuse_full"] = sum(1 for e in later if e.get("trimmed_tokens") == 0)
            reasons: dict[str, int] = {}
            for e in later:
                if e.get("trim_reason"):
                    reasons[e["trim_reason"]] = reasons.get(e["trim_reason"], 0) + 1
            summary["reuse_trimmed_by_reason"] = reasons
        tokenize = sorted(e["attrs"]["tokenize_ms"] for e in turns if "tokenize_ms" in e.get("attrs", {}))
        if tokenize:
            summary["tokenize_p50_ms"] = tokenize[len(tokenize) // 2]
        report(summary)

    def report(summary: dict[str, Any]) -> None:
        summary["backend"] = backend
        results.append(summary)
        print(json.dumps(summary), flush=True)

    async with aiohttp.ClientSession(connector=connector) as session:
        def run_direct(conv: Conversation) -> Awaitable[float]:
            return direct_turn(session, p_url, d_url, conv, backend)

        def run_routed(conv: Conversation) -> Awaitable[float]:
            return router_turn(session, r_url, conv, backend)

        await open_loop(Phase("warmup"), 50, 2 * scale, run_direct, run_routed, pid)
        await asyncio.sleep(0.3)
        seen["lines"] = len(events.read_text().splitlines()) if events.exists() else 0
        for rate in (50, 200):
            phase = Phase(f"open loop {rate} turns/s")
            await open_loop(phase, rate, 6 * scale, run_direct, run_routed, pid)
            await report_async(phase.summary())
        phase = Phase("100 concurrent streams")
        for _ in range(2):  # alternate, so both see the same conditions
            direct = Phase("direct slice")
            await closed_loop(direct, 100, 2 * scale, run_direct, phase.direct, pid)
            routed = Phase("routed slice")
            await closed_loop(routed, 100, 2 * scale, run_routed, phase.routed, pid)
            phase.errors += direct.errors + routed.errors
            phase.router_cpu_s += routed.router_cpu_s
            phase.wall_s += routed.wall_s
        await report_async(phase.summary())
        for kind, run in (("direct", run_direct), ("router", run_routed)):
            phase = Phase(f"saturation {kind} (64 clients)")
            sink = phase.direct if kind == "direct" else phase.routed
            await closed_loop(phase, 64, 4 * scale, run, sink, pid)
            summary = phase.summary()
            summary["turns_per_s"] = round(len(sink) / phase.wall_s, 1)
            await report_async(summary)
    return results


def micro() -> list[dict[str, Any]]:
    """In-process costs per turn of recording and deciding (no sockets): what the router adds to a turn's CPU."""
    from kvdiag.router.config import RouterConfig, Upstream
    from kvdiag.router.reply import parse_stream
    from kvdiag.router.reuse import ReuseGuard
    from kvdiag.router.reuse_rule import prompt_view, token_trace
    from kvdiag.router.sse import SSECapture, strip_token_ids
    from kvdiag.router.store import Handle, _pack_handle, _unpack_handle

    def per_call(fn: Callable[[], Any], n: int = 2000) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return round((time.perf_counter() - t0) / n * 1e6, 1)

    head = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1733000000, "model": "Qwen/Qwen3-32B"}
    out: list[dict[str, Any]] = []
    streams: dict[str, list[bytes]] = {}
    for kind in STREAM_KINDS:
        frames = [_stub_frame({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})]
        frames += [_stub_frame({**head, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": None,
                                                     "token_ids": None}], "kv_transfer_params": None})
                   for d in _stub_deltas(kind)]
        frames += [_stub_frame({**head, "choices": [{"index": 0, "delta": {"content": ""}, "logprobs": None,
                                                     "finish_reason": "stop", "stop_reason": None}],
                                "kv_transfer_params": {"remote_num_tokens": 300, "remote_engine_id": "d",
                                                       "remote_block_ids": [list(range(19))]}}),
                   b"data: [DONE]\n\n"]
        streams[kind] = frames

        def record(frames: list[bytes] = frames) -> None:
            capture = SSECapture()
            for frame in frames:
                capture.feed(frame)

        out.append({"micro": f"record a {kind} stream ({len(frames)} frames, one read each)", "us": per_call(record)})
    ups = (Upstream("127.0.0.1", 1),)
    guard = ReuseGuard(RouterConfig(prefill=ups, decode=ups))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Summarise the design of a router. " * 4}]
    for i in range(4):
        messages += [{"role": "assistant", "content": " ".join(f"t{j}" for j in range(16))},
                     {"role": "user", "content": f"turn {i + 2}: go on"}]
    body = {"model": "Qwen/Qwen3-32B", "messages": messages}
    capture = SSECapture()
    capture.feed(b"".join(streams["plain"]))
    view = prompt_view(body)
    assert view is not None and capture.params is not None and capture.observed is not None
    params = {**capture.params, "remote_request_id": "r"}
    coverage = guard.coverage(body=body, view=view, previous=None, decision=None, prompt_tokens=280,
                              observed=capture.observed, d_params=params)
    handle = Handle(params, time.time(), 1, "r", coverage)
    following = {"model": "Qwen/Qwen3-32B", "messages": [
        *messages, {"role": "assistant", "content": capture.observed.content}, {"role": "user", "content": "more"}]}
    out.append({"micro": "digest an 11-message prompt at its turn boundaries",
                "us": per_call(lambda: prompt_view(following, coverage.lengths()))})
    nxt = prompt_view(following, coverage.lengths())
    assert nxt is not None and guard.inject(handle, nxt).decision.reuse == "full"
    out.append({"micro": "decide (the full handle: the reply came back verbatim)",
                "us": per_call(lambda: guard.inject(handle, nxt))})
    out.append({"micro": "build the coverage", "us": per_call(lambda: guard.coverage(
        body=body, view=view, previous=None, decision=None, prompt_tokens=280, observed=capture.observed,
        d_params=params))})
    out.append({"micro": "store round trip of the handle (memory store)",
                "us": per_call(lambda: _unpack_handle(1.0, _pack_handle(handle)))})
    from kvdiag.router.usage import UsageRewriter

    usage_frame = _stub_frame({**head, "choices": [], "usage": {"prompt_tokens": 280, "total_tokens": 297,
                                                                 "completion_tokens": 17}})
    with_usage = [*streams["plain"][:-1], usage_frame, streams["plain"][-1]]

    def rewrite(frames: list[bytes] = with_usage) -> None:
        rewriter = UsageRewriter(256)
        for frame in frames:
            rewriter.feed(frame)

    out.append({"micro": f"rewrite the final usage chunk of a plain stream ({len(with_usage)} frames, one read each)",
                "us": per_call(rewrite)})
    for n in (2000, 32000):
        ids = [random.randrange(150_000) for _ in range(n)]
        answer = json.dumps({"count": n, "max_model_len": 131072, "tokens": ids}).encode()
        first = (b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
                 b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
                 b'"prompt_token_ids":' + json.dumps(ids, separators=(",", ":")).encode() + b"}\n\n")
        trace = token_trace(ids, n - 1, 16)
        costs = {"read /tokenize's answer": per_call(lambda answer=answer: json.loads(answer), 50),
                 "match it against D's trace": per_call(lambda trace=trace, ids=ids: trace.matched(ids), 50),
                 "strip D's prompt ids from the client's stream": per_call(
                     lambda first=first: strip_token_ids(first), 50),
                 "read D's prompt ids": per_call(
                     lambda first=first: parse_stream(first + b"data: [DONE]\n\n", token_ids=True), 50),
                 "build the trace": per_call(lambda ids=ids, n=n: token_trace(ids, n - 1, 16), 50)}
        for what, us in costs.items():
            out.append({"micro": f"--verify-tokens, {n}-token prompt: {what}", "us": us})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="halve every phase")
    parser.add_argument("--backend", choices=("sim", "stub", "both"), default="both",
                        help="sim: the emulated engines (zero delay); stub: canned P/D to isolate the router")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--verify-tokens", action="store_true", help="run the router with --verify-tokens")
    parser.add_argument("--router-pythonpath", default=None,
                        help="A/B runs: a directory holding another checkout as 'kvdiag', for the router only")
    parser.add_argument("--micro", action="store_true",
                        help="only the in-process costs of recording replies and deciding reuse (no processes)")
    parser.add_argument("--include-usage", action="store_true",
                        help="clients ask for stream_options.include_usage (the router rewrites the usage chunk)")
    parser.add_argument("--streams", default=",".join(STREAM_KINDS),
                        help="reply kinds, comma-separated, taken in turn by the conversations: plain, reasoning, tool")
    parser.add_argument("--serve-stub", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        import uvloop
        runner: Callable[[Any], Any] = uvloop.run
    except ImportError:
        runner = asyncio.run
    if args.serve_stub is not None:
        runner(_serve_stub(args.serve_stub))
        return
    if args.micro:
        for row in micro():
            print(json.dumps(row), flush=True)
        return
    kinds = [k.strip() for k in args.streams.split(",") if k.strip()]
    if not kinds or any(k not in STREAM_KINDS for k in kinds):
        parser.error(f"--streams: use some of {', '.join(STREAM_KINDS)}")
    STREAMS[:] = kinds
    INCLUDE_USAGE[0] = args.include_usage
    results: list[dict[str, Any]] = []
    backends = ("sim", "stub") if args.backend == "both" else (args.backend,)
    for backend in backends:
        flags = ["--verify-tokens"] if args.verify_tokens else []
        with tempfile.TemporaryDirectory(prefix="kvdiag-router-bench-") as tmp, \
                processes(Path(tmp), backend, flags, args.router_pythonpath) as info:
            results += runner(bench(args, info, backend))
    cpu = [r["router_cpu_ms_per_turn"] for r in results if r.get("router_cpu_ms_per_turn")]
    meta = {"streams": kinds, "verify_tokens": args.verify_tokens, "include_usage": args.include_usage,
            "cpus": os.cpu_count(),
            "python": platform.python_version(), "machine": platform.machine(),
            "loadavg_at_end": os.getloadavg(), "median_router_cpu_ms_per_turn": statistics.median(cpu) if cpu else None}
    print(json.dumps(meta))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
