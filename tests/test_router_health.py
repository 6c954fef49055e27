"""Upstream health (router/health.py): passive ejection, timed re-admission, the /health probe.

Unit tests drive the state machine on a fake clock; the integration tests put the router in front
of emulated engines that are closed, SIGKILLed (a real process), restarted on the same port, or made
to answer HTTP 500, and read the router's events and /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from router_support import read_jsonl, wait_for

from kvdiag.exporters.prometheus import CatalogMetrics
from kvdiag.router.app import RouterHandle, start_router
from kvdiag.router.config import RouterConfig, Upstream
from kvdiag.router.health import UpstreamHealth
from kvdiag.router.upstream import LegError, Upstreams
from kvdiag.sim.config import EngineConfig
from kvdiag.sim.server import EngineHandle, start_engine

MODEL = "Qwen/Qwen3-32B"
CHAT = "/v1/chat/completions"
LONG = "Please review the following design notes carefully and summarise the trade-offs. " * 12


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _health(**kw: Any) -> tuple[UpstreamHealth, Clock, CollectorRegistry]:
    clock = Clock()
    args = {"eject_after": 3, "eject_seconds": 10.0, "max_eject_seconds": 35.0, **kw}
    health = UpstreamHealth({"prefill": 2, "decode": 3}, clock=clock, **args)
    registry = CollectorRegistry()
    health.bind_metrics(CatalogMetrics(registry, component="router"))
    return health, clock, registry


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


# ---------------------------------------------------------------------------------------------- unit
def test_consecutive_failures_eject_and_successes_or_4xx_reset() -> None:
    health, _, registry = _health()
    for kind in ("connect", "timeout"):
        assert not health.failure("decode", 1, kind)
    health.success("decode", 1)  # a success in between: the count starts over
    for kind in ("http_4xx", "malformed", "stream_broken"):
        assert not health.failure("decode", 1, kind)  # not the instance's fault (or not a failed answer)
    assert not health.failure("decode", 1, "http_5xx") and not health.failure("decode", 1, "http_5xx")
    assert health.admitted("decode", 1)
    assert health.failure("decode", 1, "http_5xx")  # the third in a row
    assert not health.admitted("decode", 1) and health.ejected("decode") == [1]
    assert _value(registry, "kvdiag_upstream_healthy", leg="decode", index="1") == 0
    assert _value(registry, "kvdiag_upstream_healthy", leg="decode", index="0") == 1
    assert _value(registry, "kvdiag_upstream_ejections_total", leg="decode", index="1", reason="http_5xx") == 1
    assert health.order("decode", [1, 2, 0]) == [2, 0, 1]


def test_timed_readmission_on_probation_with_backoff() -> None:
    health, clock, registry = _health()
    for _ in range(3):
        health.failure("prefill", 0, "connect")
    clock.now += 9.9
    assert not health.admitted("prefill", 0)
    clock.now += 0.2
    assert health.admitted("prefill", 0)  # 10 s are over
    assert _value(registry, "kvdiag_upstream_readmissions_total", leg="prefill", index="0", trigger="timer") == 1
    assert _value(registry, "kvdiag_upstream_healthy", leg="prefill", index="0") == 1
    # On probation: one more failure ejects again, for twice as long.
    assert health.failure("prefill", 0, "connect")
    clock.now += 19.0
    assert not health.admitted("prefill", 0)
    clock.now += 1.1
    assert health.admitted("prefill", 0)
    assert health.failure("prefill", 0, "connect")
    clock.now += 35.1  # 40 s capped at max_eject_seconds (35)
    assert health.admitted("prefill", 0)
    health.success("prefill", 0)  # a success clears the record: three failures needed again
    assert not health.failure("prefill", 0, "connect") and not health.failure("prefill", 0, "connect")
    assert health.failure("prefill", 0, "connect")
    clock.now += 10.1  # and the backoff starts over
    assert health.admitted("prefill", 0)


def test_every_instance_ejected_still_yields_an_order() -> None:
    health, clock, _ = _health(eject_after=1)
    health.failure("prefill", 0, "connect")
    clock.now += 5
    health.failure("prefill", 1, "connect")
    assert health.order("prefill", [1, 0]) == [0, 1]  # soonest back first; never nothing to try


def test_probe_failures_eject_and_a_passing_probe_readmits_at_once() -> None:
    health, _, registry = _health(eject_after=2)
    health.probe_result("decode", 2, False)
    health.probe_result("decode", 2, False)
    assert not health.admitted("decode", 2)
    assert _value(registry, "kvdiag_upstream_ejections_total", leg="decode", index="2", reason="probe") == 1
    health.probe_result("decode", 2, True)
    assert health.admitted("decode", 2)
    assert _value(registry, "kvdiag_upstream_readmissions_total", leg="decode", index="2", trigger="probe") == 1
    health.failure("decode", 2, "connect")
    assert health.admitted("decode", 2)  # the probe cleared the record: not on probation


def test_ejection_off() -> None:
    health, _, _ = _health(eject_after=0)
    for _ in range(100):
        assert not health.failure("prefill", 0, "connect")
    assert health.admitted("prefill", 0)


def test_a_5xx_on_a_request_with_d_s_handle_does_not_count() -> None:
    config = RouterConfig(prefill=(Upstream("h", 1),), decode=(Upstream("h", 2),), eject_after=1).validate()
    upstreams = Upstreams(config)
    error = LegError("prefill", "http_5xx", "KV load failed", status=500)
    upstreams._outcome("prefill", 0, error, with_handle=True)
    assert upstreams.health.admitted("prefill", 0)  # the handle's failure (expired or restarted D), not P's
    upstreams._outcome("prefill", 0, error, with_handle=False)
    assert not upstreams.health.admitted("prefill", 0)  # the negative control: the same 5xx without a handle


# ---------------------------------------------------------------------------------------------- integration
def _engine(role: str, **kw: Any) -> EngineConfig:
    return EngineConfig(role=role, time_scale=0.0, mode="instrumented", prefix_caching=False, **kw)


async def _router(ps: list[int], ds: list[int], events: Path, **kw: Any) -> RouterHandle:
    return await start_router(RouterConfig(prefill=tuple(Upstream("127.0.0.1", p) for p in ps),
                                           decode=tuple(Upstream("127.0.0.1", d) for d in ds), host="127.0.0.1",
                                           port=0, events_file=events, **kw))


async def _turn(session: aiohttp.ClientSession, router: RouterHandle, conv: str, n: int) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"{LONG} {n}"}], "max_tokens": 8,
            "stream": True, "conversation_id": f"{conv}-{n}"}
    async with session.post(router.url + CHAT, json=body) as resp:
        await resp.read()
        return resp.status


def _metric(router: RouterHandle, name: str, **labels: str) -> float:
    return router.app.telemetry.registry.get_sample_value(name, labels) or 0.0


@contextlib.asynccontextmanager
async def _engines(*configs: EngineConfig) -> AsyncIterator[list[EngineHandle]]:
    handles = [await start_engine(c) for c in configs]
    try:
        yield handles
    finally:
        for h in handles:
            with contextlib.suppress(Exception):
                await h.close()


async def test_a_closed_p_is_ejected_then_readmitted_when_it_is_back(tmp_path: Path) -> None:
    async with _engines(_engine("prefill"), _engine("prefill"), _engine("decode")) as (p0, p1, d):
        port0 = p0.port
        events = tmp_path / "router.jsonl"
        router = await _router([p0.port, p1.port], [d.port], events, eject_after=2, eject_seconds=0.6)
        try:
            await p0.close()  # P0 goes away: connection refused
            async with aiohttp.ClientSession() as session:
                statuses = [await _turn(session, router, "a", i) for i in range(6)]
                assert statuses == [200] * 6  # every turn answered through P1
                await wait_for(lambda: len(read_jsonl(events)) >= 6)
                attempts = [e["attrs"]["prefill_attempts"] for e in read_jsonl(events)]
                # Round-robin puts P0 first on turns 0, 2, 4: it is tried (and fails) twice, then skipped.
                assert attempts == [2, 1, 2, 1, 1, 1], attempts
                assert _metric(router, "kvdiag_upstream_healthy", leg="prefill", index="0") == 0
                assert _metric(router, "kvdiag_upstream_ejections_total", leg="prefill", index="0",
                               reason="connect") == 1
                assert _metric(router, "kvdiag_upstream_errors_total", leg="prefill", kind="connect") == 2
                reasons = [e["attrs"]["placement"]["prefill"]["reason"] for e in read_jsonl(events)]
                assert reasons[4] == "fallback_unhealthy"
                # P0 comes back on its port; after the ejection time it gets traffic again.
                back = await start_engine(_engine("prefill", port=port0))
                try:
                    await asyncio.sleep(0.7)
                    statuses = [await _turn(session, router, "b", i) for i in range(4)]
                    assert statuses == [200] * 4
                    await wait_for(lambda: len(read_jsonl(events)) >= 10)
                    served = [e["attrs"]["prefill_index"] for e in read_jsonl(events)[6:]]
                    assert 0 in served and all(e["attrs"]["prefill_attempts"] == 1 for e in read_jsonl(events)[6:])
                    assert _metric(router, "kvdiag_upstream_healthy", leg="prefill", index="0") == 1
                    assert _metric(router, "kvdiag_upstream_readmissions_total", leg="prefill", index="0",
                                   trigger="timer") == 1
                finally:
                    await back.close()
        finally:
            await router.close()


@pytest.fixture
def d_process(tmp_path: Path) -> Iterator[Any]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(port: int = 0) -> subprocess.Popen[bytes]:
        ready = tmp_path / f"d-{len(procs)}.ready"
        proc = subprocess.Popen([str(Path(sys.executable).parent / "kvdiag"), "sim", "decode", "--port", str(port),
                                 "--ready-file", str(ready), "--time-scale", "0", "--mode", "instrumented"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


async def _ready_port(tmp_path: Path, n: int) -> int:
    ready = tmp_path / f"d-{n}.ready"
    await wait_for(ready.exists, timeout=30)
    return int(json.loads(ready.read_text())["port"])


async def test_a_killed_d_is_found_by_the_probe_and_back_when_it_restarts(tmp_path: Path, d_process: Any) -> None:
    proc = d_process()
    d1_port = await _ready_port(tmp_path, 0)
    async with _engines(_engine("prefill"), _engine("decode")) as (p, d0):
        events = tmp_path / "router.jsonl"
        router = await _router([p.port], [d0.port, d1_port], events, eject_after=2, eject_seconds=60,
                               health_check_interval=0.1, health_check_timeout=0.5)
        try:
            async with aiohttp.ClientSession() as session:
                assert [await _turn(session, router, "a", i) for i in range(2)] == [200, 200]
                proc.send_signal(signal.SIGKILL)  # D1 dies; no turn needs to hit it for the router to know
                proc.wait()
                await wait_for(lambda: _metric(router, "kvdiag_upstream_healthy", leg="decode", index="1") == 0,
                               timeout=5)
                assert _metric(router, "kvdiag_upstream_ejections_total", leg="decode", index="1",
                               reason="probe") == 1
                errors = _metric(router, "kvdiag_upstream_errors_total", leg="decode", kind="connect")
                assert [await _turn(session, router, "b", i) for i in range(4)] == [200] * 4
                assert _metric(router, "kvdiag_upstream_errors_total", leg="decode", kind="connect") == errors
                await wait_for(lambda: len(read_jsonl(events)) >= 6)
                assert {e["attrs"]["decode_index"] for e in read_jsonl(events)[2:]} == {0}
                # D1 restarts on the same port: the probe takes it back long before the 60 s ejection ends.
                d_process(d1_port)
                await _ready_port(tmp_path, 1)
                await wait_for(lambda: _metric(router, "kvdiag_upstream_healthy", leg="decode", index="1") == 1,
                               timeout=5)
                assert _metric(router, "kvdiag_upstream_readmissions_total", leg="decode", index="1",
                               trigger="probe") == 1
                assert [await _turn(session, router, "c", i) for i in range(4)] == [200] * 4
                await wait_for(lambda: len(read_jsonl(events)) >= 10)
                assert {e["attrs"]["decode_index"] for e in read_jsonl(events)[6:]} == {0, 1}
        finally:
            await router.close()


async def test_a_d_answering_500_is_ejected_and_recovers(tmp_path: Path) -> None:
    async with _engines(_engine("prefill"), _engine("decode"), _engine("decode")) as (p, d0, d1):
        events = tmp_path / "router.jsonl"
        router = await _router([p.port], [d0.port, d1.port], events, eject_after=2, eject_seconds=0.5)
        try:
            d1.engine.faults.update({"fail_requests": 1.0})
            async with aiohttp.ClientSession() as session:
                statuses = [await _turn(session, router, "a", i) for i in range(8)]
                # D1 (every other turn) fails twice with HTTP 500 (the client gets 502), then is ejected.
                assert statuses == [200, 502, 200, 502, 200, 200, 200, 200], statuses
                assert _metric(router, "kvdiag_upstream_ejections_total", leg="decode", index="1",
                               reason="http_5xx") == 1
                d1.engine.faults.update({"fail_requests": 0.0})  # D1 recovers
                await asyncio.sleep(0.6)
                statuses = [await _turn(session, router, "b", i) for i in range(4)]
                assert statuses == [200] * 4
                await wait_for(lambda: len(read_jsonl(events)) >= 12)
                assert 1 in {e["attrs"]["decode_index"] for e in read_jsonl(events)[8:]}
                assert _metric(router, "kvdiag_upstream_healthy", leg="decode", index="1") == 1
        finally:
            await router.close()


async def test_failed_d_to_p_reads_never_eject_p_but_its_own_500s_do(tmp_path: Path) -> None:
    async with _engines(_engine("prefill"), _engine("decode")) as (p, d):
        events = tmp_path / "router.jsonl"
        router = await _router([p.port], [d.port], events, eject_after=1, eject_seconds=60)
        try:
            p.engine.faults.update({"fail_transfers": {"transfer_failed": 1.0}})  # every D->P read fails (500)
            async with aiohttp.ClientSession() as session:
                for i in range(3):
                    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{LONG} {i}"}]
                    for turn in range(2):
                        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": False,
                                "conversation_id": f"x{i}"}
                        async with session.post(router.url + CHAT, json=body) as resp:
                            assert resp.status == 200
                            reply = (await resp.json())["choices"][0]["message"]["content"]
                        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"t{turn}"}]
                await wait_for(lambda: len(read_jsonl(events)) >= 6)
                later = [e for e in read_jsonl(events) if e["turn"] == 2]
                assert all(e["outcome"] == "transfer_failed" and e["attrs"]["prefill_attempts"] == 2 for e in later)
                assert _metric(router, "kvdiag_upstream_healthy", leg="prefill", index="0") == 1
                # The negative control: P failing a request that carries no handle is P's own failure.
                p.engine.faults.update({"fail_transfers": {}, "fail_requests": 1.0})
                assert await _turn(session, router, "y", 0) == 502
                assert _metric(router, "kvdiag_upstream_healthy", leg="prefill", index="0") == 0
        finally:
            await router.close()
