"""The router against the real emulated vLLM engines (kvdiag.sim) over real sockets: every verdict the
router reports, the failure paths, Redis-backed restarts and replicas, and the openai SDK as a client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from router_support import free_port, read_jsonl, redis_server, wait_for

from kvdiag.router.app import RouterHandle, start_router
from kvdiag.router.config import RouterConfig, Upstream
from kvdiag.schema.events import read_events
from kvdiag.sim.config import EngineConfig
from kvdiag.sim.server import EngineHandle, start_engine

MODEL = "Qwen/Qwen3-32B"
CHAT = "/v1/chat/completions"
LONG = "Please review the following design notes carefully and summarise the trade-offs. " * 12


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@dataclass
class Bed:
    """P and D engines plus a router, and the conversation helpers the tests use."""

    tmp: Path
    ps: list[EngineHandle]
    ds: list[EngineHandle]
    router: RouterHandle | None = None
    router_kw: dict[str, Any] = field(default_factory=dict)
    session: aiohttp.ClientSession | None = None

    async def start_router(self, **kw: Any) -> RouterHandle:
        merged = {**self.router_kw, **kw}
        prefill_ports = merged.pop("prefill_ports", [p.port for p in self.ps])
        config = RouterConfig(prefill=tuple(Upstream("127.0.0.1", port) for port in prefill_ports),
                              decode=tuple(Upstream("127.0.0.1", d.port) for d in self.ds), host="127.0.0.1",
                              port=0, events_file=self.tmp / "router-events.jsonl", **merged)
        self.router = await start_router(config)
        return self.router

    async def stop_router(self) -> None:
        if self.router is not None:
            await self.router.close()
            self.router = None

    def events(self) -> list[dict[str, Any]]:
        path = self.tmp / "router-events.jsonl"
        if path.exists():
            for event in read_events(path):  # every record follows the schema (raises otherwise)
                assert event.source == "router" and event.event == "router_turn"
        return read_jsonl(path)

    async def event(self, n: int) -> dict[str, Any]:
        """The n-th event (1-based), waiting for the writer thread."""
        await wait_for(lambda: len(self.events()) >= n)
        return self.events()[n - 1]

    async def turn(self, messages: list[dict[str, Any]], conv: str | None = "c1", *, stream: bool = True,
                   max_tokens: int = 24, headers: dict[str, str] | None = None, url: str | None = None,
                   **extra: Any) -> tuple[int, str, bytes]:
        """Send one turn; return (HTTP status, reply text, raw body)."""
        assert self.session is not None
        body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": stream,
                                **extra}
        if conv is not None:
            body["conversation_id"] = conv
        base = url or (self.router.url if self.router else "")
        async with self.session.post(base + CHAT, json=body, headers=headers or {}) as resp:
            raw = await resp.read()
            status = resp.status
        return status, _reply(raw, stream), raw


def _reply(raw: bytes, stream: bool) -> str:
    if not stream:
        try:
            return str(json.loads(raw)["choices"][0]["message"]["content"])
        except (ValueError, KeyError, IndexError):
            return ""
    text = ""
    for frame in raw.split(b"\n\n"):
        if frame.startswith(b"data: {"):
            obj = json.loads(frame[6:])
            for choice in obj.get("choices", []):
                text += (choice.get("delta") or {}).get("content") or ""
    return text


def _next(messages: list[dict[str, Any]], reply: str, user: str) -> list[dict[str, Any]]:
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": user}]


@contextlib.asynccontextmanager
async def sim_bed(tmp: Path, *, n_prefill: int = 1, p: dict[str, Any] | None = None, d: dict[str, Any] | None = None,
                  router: dict[str, Any] | None = None, start: bool = True) -> AsyncIterator[Bed]:
    tmp.mkdir(parents=True, exist_ok=True)
    ps = [await start_engine(EngineConfig(**{"role": "prefill", "time_scale": 0, "mode": "instrumented", **(p or {})}))
          for _ in range(n_prefill)]
    ds = [await start_engine(EngineConfig(**{"role": "decode", "time_scale": 0, "mode": "instrumented", **(d or {})}))]
    bed = Bed(tmp, ps, ds, router_kw=router or {})
    try:
        async with aiohttp.ClientSession() as session:
            bed.session = session
            if start:
                await bed.start_router()
            yield bed
    finally:
        await bed.stop_router()
        for engine in ps + ds:
            await engine.close()


async def _two_turns(bed: Bed, conv: str = "c1", **kw: Any) -> tuple[list[dict[str, Any]], str]:
    m1 = [{"role": "user", "content": LONG}]
    status, reply, _ = await bed.turn(m1, conv, **kw)
    assert status == 200 and reply
    m2 = _next(m1, reply, "And what about failure handling?")
    status, reply2, _ = await bed.turn(m2, conv, **kw)
    assert status == 200
    return m2, reply2


async def test_remote_hit_then_every_later_turn(tmp_path: Path) -> None:
    async with sim_bed(tmp_path, p={"prefix_caching": False}) as bed:
        m2, reply2 = await _two_turns(bed)
        await bed.turn(_next(m2, reply2, "third"))
        ev1, ev2, ev3 = (await bed.event(1)), (await bed.event(2)), (await bed.event(3))
        assert ev1["outcome"] == "first_turn" and ev1["turn"] == 1
        for ev, turn in ((ev2, 2), (ev3, 3)):
            assert ev["outcome"] == "remote_hit" and ev["turn"] == turn and ev["lookup"] == "hit"
            assert ev["remote_read_tokens"] > 0 and ev["transfer_bytes"] > 0
            assert ev["engine_request_id"].startswith(f"chatcmpl-{ev['request_id']}-")
        assert ev2["remote_request_id"].startswith(f"chatcmpl-{ev1['request_id']}-")


async def test_local_hit_when_a_turn_is_sent_again(tmp_path: Path) -> None:
    async with sim_bed(tmp_path, p={"prefix_caching": True}) as bed:
        m1 = [{"role": "user", "content": LONG}]
        await bed.turn(m1)
        await bed.turn(m1)  # a regenerate: P's prefix cache already holds the prompt
        assert (await bed.event(2))["outcome"] == "local_hit"


async def test_below_threshold_with_a_short_reply(tmp_path: Path) -> None:
    async with sim_bed(tmp_path, p={"prefix_caching": True}) as bed:
        m1 = [{"role": "user", "content": LONG}]
        _, reply, _ = await bed.turn(m1, max_tokens=4)
        await bed.turn(_next(m1, reply, "ok"), max_tokens=4)
        assert (await bed.event(2))["outcome"] == "below_threshold"


async def test_router_decided_verdicts(tmp_path: Path) -> None:
    async with sim_bed(tmp_path, p={"prefix_caching": False}) as bed:
        m1 = [{"role": "user", "content": LONG}]
        _, reply, _ = await bed.turn(m1, conv=None)
        await bed.turn(_next(m1, reply, "next"), conv=None)
        assert (await bed.event(1))["outcome"] == "first_turn"
        assert (await bed.event(2))["outcome"] == "no_conversation_id"
        # prefix mismatch: the client strips part of the history it sent before
        _, reply, _ = await bed.turn(m1, conv="pm")
        edited = [{"role": "user", "content": LONG[:200]}]
        await bed.turn(_next(edited, reply, "next"), conv="pm")
        ev = await bed.event(4)
        assert ev["outcome"] == "prefix_mismatch" and ev["attrs"]["prefill_attempts"] == 1
        assert ev["remote_offered_tokens"] == 0  # P was never offered D's blocks


async def test_metadata_not_returned_reasons(tmp_path: Path) -> None:
    async with sim_bed(tmp_path, p={"prefix_caching": False}) as bed:
        d = bed.ds[0].engine
        d.faults.update({"stream_kv_params": False})
        await _two_turns(bed, "a")
        d.faults.update({"stream_kv_params": True, "bidirectional_kv_xfer": False})
        await _two_turns(bed, "b")
        ev_a, ev_b = await bed.event(2), await bed.event(4)
        assert ev_a["outcome"] == "metadata_not_returned" and "not_streamed" in ev_a["reason"]
        assert ev_b["outcome"] == "metadata_not_returned" and "bidirectional_off_on_decode" in ev_b["reason"]


async def test_feature_disabled_on_prefill_and_transfer_failed(tmp_path: Path) -> None:
    async with sim_bed(tmp_path, p={"prefix_caching": False}) as bed:
        p = bed.ps[0].engine
        p.faults.update({"bidirectional_kv_xfer": False})
        await _two_turns(bed, "a")
        p.faults.update({"bidirectional_kv_xfer": True, "fail_transfers": {"handshake_failed": 1.0}})
        await _two_turns(bed, "b")
        assert (await bed.event(2))["outcome"] == "feature_disabled_on_prefill"
        ev = await bed.event(4)
        # Under vLLM's default policy "fail" P fails the turn; the router retries it without the handle.
        assert ev["outcome"] == "transfer_failed" and ev["failure_type"] == "handshake_failed"
        assert ev["status"] == "ok" and ev["attrs"]["prefill_attempts"] == 2
        # An HTTP 500 unrelated to the handle (P reports every KV failure, and sent no report): request_failed.
        p.faults.update({"fail_transfers": {}})
        m1 = [{"role": "user", "content": LONG}]
        _, reply, _ = await bed.turn(m1, "c")
        p.faults.update({"fail_requests": 1.0})
        status, _, _ = await bed.turn(_next(m1, reply, "next"), "c")
        ev = await bed.event(6)
        assert status == 502 and ev["outcome"] == "request_failed" and ev["lookup"] == "hit"


async def test_expired_remote_read_and_router_entry_expired(tmp_path: Path) -> None:
    # D holds blocks 3 s and P declines reads within 2 s of D's deadline; the router's TTL is 2.8 s:
    # a turn 1.0-2.8 s after the previous one finds a valid router entry that P declines. The windows
    # are wide so a loaded CI machine still lands each turn inside its own.
    async with sim_bed(tmp_path, p={"prefix_caching": False, "expiry_safety_margin_s": 2.0},
                       d={"decoder_kv_blocks_ttl": 3.0},
                       router={"decoder_kv_blocks_ttl": 3.0, "entry_ttl": 2.8}) as bed:
        m1 = [{"role": "user", "content": LONG}]
        _, reply, _ = await bed.turn(m1, "a")
        await asyncio.sleep(1.3)  # router entry still valid, D's deadline within P's margin
        status, _, _ = await bed.turn(_next(m1, reply, "next"), "a")
        assert status == 200
        ev = await bed.event(2)
        assert ev["outcome"] == "expired_remote_read" and ev["lookup"] == "hit"
        _, reply, _ = await bed.turn(m1, "b")
        await asyncio.sleep(2.9)  # past the router's TTL
        await bed.turn(_next(m1, reply, "next"), "b")
        ev = await bed.event(4)
        assert ev["outcome"] == "router_entry_expired" and ev["lookup"] == "expired" and ev["entry_age_s"] >= 2.8


async def test_concurrent_turns_never_double_read(tmp_path: Path) -> None:
    async with sim_bed(tmp_path, p={"prefix_caching": False}, d={"time_scale": 0.2}) as bed:
        m1 = [{"role": "user", "content": LONG}]
        _, reply, _ = await bed.turn(m1, max_tokens=4)
        m2 = _next(m1, reply, "next")
        results = await asyncio.gather(*(bed.turn(m2, max_tokens=16) for _ in range(3)))
        assert all(status == 200 for status, _, _ in results)
        await wait_for(lambda: len(bed.events()) >= 4)
        later = bed.events()[1:]
        outcomes = sorted(e["outcome"] for e in later)
        assert outcomes.count("concurrent_turn") == 2 and outcomes.count("remote_hit") == 1, outcomes
        offered = [e for e in later if e["lookup"] == "hit"]
        assert len(offered) == 1  # one read of D's handle, never two


async def test_router_restart_loses_memory_state_but_not_redis_state(tmp_path: Path, redis_url: str) -> None:
    async with sim_bed(tmp_path, p={"prefix_caching": False}, start=False) as bed:
        await bed.start_router()
        m1 = [{"role": "user", "content": LONG}]
        _, reply, _ = await bed.turn(m1, "mem")
        await bed.stop_router()
        await bed.start_router()
        await bed.turn(_next(m1, reply, "next"), "mem")
        assert (await bed.event(2))["outcome"] == "router_state_lost"
        await bed.stop_router()
        conv = f"redis-{time.monotonic_ns()}"
        await bed.start_router(state=redis_url)
        _, reply, _ = await bed.turn(m1, conv)
        await bed.stop_router()  # "kill" the router: a new process on the same Redis must still reuse
        await bed.start_router(state=redis_url)
        await bed.turn(_next(m1, reply, "next"), conv)
        ev = await bed.event(4)
        assert ev["outcome"] == "remote_hit" and ev["turn"] == 2


async def test_two_replicas_share_redis(tmp_path: Path, redis_url: str) -> None:
    async with sim_bed(tmp_path, p={"prefix_caching": False}, d={"time_scale": 0.2}, start=False) as bed:
        a = await bed.start_router(state=redis_url)
        b_config = RouterConfig(prefill=(Upstream("127.0.0.1", bed.ps[0].port),),
                                decode=(Upstream("127.0.0.1", bed.ds[0].port),), host="127.0.0.1", port=0,
                                state=redis_url, events_file=tmp_path / "b-events.jsonl")
        b = await start_router(b_config)
        try:
            conv = f"rep-{time.monotonic_ns()}"
            m1 = [{"role": "user", "content": LONG}]
            _, reply, _ = await bed.turn(m1, conv, url=a.url, max_tokens=4)
            m2 = _next(m1, reply, "next")
            status, reply2, _ = await bed.turn(m2, conv, url=b.url, max_tokens=4)
            assert status == 200
            await wait_for(lambda: len(read_jsonl(tmp_path / "b-events.jsonl")) >= 1)
            assert read_jsonl(tmp_path / "b-events.jsonl")[0]["outcome"] == "remote_hit"
            # The same turn sent to both replicas at once: one reads the handle, the other is concurrent.
            m3 = _next(m2, reply2, "third")
            await asyncio.gather(bed.turn(m3, conv, url=a.url, max_tokens=16),
                                 bed.turn(m3, conv, url=b.url, max_tokens=16))
            await wait_for(lambda: len(bed.events()) >= 2 and len(read_jsonl(tmp_path / "b-events.jsonl")) >= 2)
            last = [bed.events()[-1], read_jsonl(tmp_path / "b-events.jsonl")[-1]]
            assert sorted(e["outcome"] for e in last) == ["concurrent_turn", "remote_hit"]
        finally:
            await b.close()


async def test_tenant_isolation_and_dropped_client_params(tmp_path: Path) -> None:
    async with sim_bed(tmp_path, p={"prefix_caching": False}) as bed:
        m1 = [{"role": "user", "content": LONG}]
        _, reply, raw = await bed.turn(m1, "shared", headers={"Authorization": "Bearer alice"})
        stolen = json.loads(next(f for f in raw.split(b"\n\n") if b'"kv_transfer_params":{' in f)[6:])
        handle = stolen["kv_transfer_params"]
        m2 = _next(m1, reply, "next")
        # Mallory uses Alice's conversation id and even pastes Alice's handle: neither reaches P.
        await bed.turn(m2, "shared", headers={"Authorization": "Bearer mallory"}, kv_transfer_params=handle)
        ev = await bed.event(2)
        assert ev["outcome"] == "router_state_lost" and ev["remote_offered_tokens"] == 0
        assert ev["attrs"]["client_kv_transfer_params_dropped"] is True
        await bed.turn(m2, "shared", headers={"Authorization": "Bearer alice"})
        assert (await bed.event(3))["outcome"] == "remote_hit"  # Alice's handle was never touched


async def test_prefill_failover_timeout_and_502(tmp_path: Path) -> None:
    dead = free_port()
    async with sim_bed(tmp_path, n_prefill=2, p={"prefix_caching": False},
                       router={"prefill_timeout": 0.5}, start=False) as bed:
        # P0 unreachable: every turn still works through P1 (fresh params).
        await bed.start_router(prefill_ports=[dead, bed.ps[1].port])
        await _two_turns(bed, "a")
        assert all(e["status"] == "ok" for e in [await bed.event(1), await bed.event(2)])
        await bed.stop_router()
        # Both P fail with HTTP 500: a 502 with an OpenAI error body.
        for p in bed.ps:
            p.engine.faults.update({"fail_requests": 1.0})
        await bed.start_router()
        status, _, raw = await bed.turn([{"role": "user", "content": "hi"}], "b")
        assert status == 502 and json.loads(raw)["error"]["code"] == 502
        assert (await bed.event(3))["outcome"] == "request_failed"
        # P hangs (vLLM 0.33's recompute hang) on the handle: the leg times out and is retried without it.
        for p in bed.ps:
            p.engine.faults.update({"fail_requests": 0.0, "kv_load_failure_policy": "recompute",
                                    "hang_on_recompute": True, "fail_transfers": {"transfer_failed": 1.0}})
        m1 = [{"role": "user", "content": LONG}]
        _, reply, _ = await bed.turn(m1, "c")
        status, _, _ = await bed.turn(_next(m1, reply, "next"), "c")
        ev = await bed.event(5)
        assert status == 200 and ev["outcome"] in ("transfer_failed", "expired_remote_read"), ev
        assert ev["attrs"]["prefill_attempts"] >= 2 and ev["prefill_ms"] >= 500


async def test_client_disconnect_with_real_engines(tmp_path: Path) -> None:
    async with sim_bed(tmp_path, p={"prefix_caching": False}, d={"time_scale": 0.2}) as bed:
        assert bed.router is not None and bed.session is not None
        m1 = [{"role": "user", "content": LONG}]
        resp = await bed.session.post(bed.router.url + CHAT, json={"model": MODEL, "messages": m1, "max_tokens": 200,
                                                                   "stream": True, "conversation_id": "dc"})
        await resp.content.readany()
        resp.close()
        ev = await bed.event(1)
        assert ev["status"] == "disconnected"
        await bed.turn(_next(m1, "partial", "next"), "dc", max_tokens=4)
        ev2 = await bed.event(2)
        assert ev2["outcome"] == "metadata_not_returned" and "client_disconnected" in ev2["reason"]


async def test_openai_sdk_streaming_and_not(tmp_path: Path) -> None:
    async with sim_bed(tmp_path, p={"prefix_caching": False}) as bed:
        assert bed.router is not None
        async with openai.AsyncOpenAI(base_url=bed.router.url + "/v1", api_key="sk-test", max_retries=0) as client:
            m1: list[Any] = [{"role": "user", "content": LONG}]
            stream = await client.chat.completions.create(model=MODEL, messages=m1, max_tokens=16, stream=True,
                                                          extra_body={"conversation_id": "sdk"})
            reply = ""
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    reply += chunk.choices[0].delta.content
            assert reply
            m2 = _next(m1, reply, "next")
            done = await client.chat.completions.create(model=MODEL, messages=m2, max_tokens=16,
                                                        extra_body={"conversation_id": "sdk"})
            assert done.choices[0].message.content and done.usage is not None
            text = await client.completions.create(model=MODEL, prompt=LONG, max_tokens=8,
                                                   extra_body={"conversation_id": "sdk-cmpl"})
            assert text.choices[0].text
        ev1, ev2, ev3 = await bed.event(1), await bed.event(2), await bed.event(3)
        assert ev1["outcome"] == "first_turn" and ev2["outcome"] == "remote_hit" and not ev2["attrs"]["stream"]
        assert ev3["attrs"]["endpoint"] == "completions" and ev3["outcome"] == "first_turn"


async def test_model_list_and_healthcheck_as_clients_ask_for_them(tmp_path: Path) -> None:
    # OpenAI clients (and `vllm bench serve` without --model) list the models first; the one-way example proxy
    # calls its health route /healthcheck
    async with sim_bed(tmp_path) as bed:
        assert bed.router is not None and bed.session is not None
        async with bed.session.get(f"http://127.0.0.1:{bed.ds[0].port}/v1/models") as resp:
            from_d = await resp.json()
        async with bed.session.get(bed.router.url + "/v1/models") as resp:
            assert resp.status == 200 and await resp.json() == from_d
        async with openai.AsyncOpenAI(base_url=bed.router.url + "/v1", api_key="sk-test", max_retries=0) as client:
            assert [m.id async for m in client.models.list()] == [MODEL]
        for route in ("/health", "/healthcheck"):
            async with bed.session.get(bed.router.url + route) as resp:
                assert resp.status == 200 and set(await resp.json()) == {"status", "cached_conversations",
                                                                         "evicted_stale"}
        samples = bed.router.app.telemetry.registry.get_sample_value
        assert samples("kvdiag_router_requests_total", {"endpoint": "models", "code": "200"}) == 2
        # D gone: P lists them; both gone: a 502 in OpenAI's error shape that says what failed
        p_port, gone = bed.ps[0].port, free_port()
        for prefill, want in ((p_port, 200), (free_port(), 502)):
            router = await start_router(RouterConfig(prefill=(Upstream("127.0.0.1", prefill),),
                                                     decode=(Upstream("127.0.0.1", gone),), host="127.0.0.1",
                                                     port=0, connect_timeout=2))
            try:
                async with bed.session.get(router.url + "/v1/models") as resp:
                    body = await resp.json()
                    assert resp.status == want, body
                    if want == 200:
                        assert body == from_d
                    else:
                        assert body["error"]["code"] == 502 and str(gone) in body["error"]["message"]
            finally:
                await router.close()


async def test_decode_engine_killed_mid_stream_and_decode_5xx(tmp_path: Path) -> None:
    ready = tmp_path / "d.ready"
    d_proc = subprocess.Popen([str(Path(sys.executable).parent / "kvdiag"), "sim", "decode", "--port", "0",
                               "--ready-file", str(ready), "--time-scale", "0.2", "--mode", "instrumented"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await wait_for(ready.exists, timeout=20)
        d_port = json.loads(ready.read_text())["port"]
        p = await start_engine(EngineConfig(role="prefill", time_scale=0, mode="instrumented", prefix_caching=False))
        events = tmp_path / "events.jsonl"
        router = await start_router(RouterConfig(prefill=(Upstream("127.0.0.1", p.port),),
                                                 decode=(Upstream("127.0.0.1", d_port),), host="127.0.0.1", port=0,
                                                 events_file=events))
        try:
            body = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 200,
                    "stream": True, "conversation_id": "dies"}
            async with aiohttp.ClientSession() as session, session.post(router.url + CHAT, json=body) as resp:
                assert (await resp.content.readany()).startswith(b"data: ")
                d_proc.send_signal(signal.SIGKILL)  # D dies while streaming
                rest = await resp.read()
            assert b'"error"' in rest and rest.endswith(b"data: [DONE]\n\n")
            await wait_for(lambda: len(read_jsonl(events)) >= 1)
            ev = read_jsonl(events)[0]
            assert ev["status"] == "error" and ev["outcome"] == "request_failed"
            assert ev["attrs"]["missing_metadata_reason"] == "decode_failed" and ev["attrs"]["stored"] is False
        finally:
            await router.close()
            await p.close()
    finally:
        d_proc.kill()
        d_proc.wait()
    async with sim_bed(tmp_path / "5xx", p={"prefix_caching": False}, d={"fail_requests": 1.0}) as bed:
        status, _, raw = await bed.turn([{"role": "user", "content": "hi"}], "d5")
        assert status == 502 and "decode failed" in json.loads(raw)["error"]["message"]
