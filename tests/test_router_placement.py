"""Placement (router/placement.py): round-robin stays the drop-in default, kv-aware follows the conversation's KV.

Unit tests drive the policy with claims and in-flight loads set by hand; the integration tests run
the router in front of an emulated 4P+4D fleet (kvdiag.sim.fleet) over loopback and read where
each turn ran from the router's events and the engines' own events (D's local hit, the P->D pull).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from router_support import read_jsonl, redis_server, wait_for

from kvdiag.exporters.prometheus import CatalogMetrics
from kvdiag.router import reuse as router_reuse
from kvdiag.router import reuse_rule
from kvdiag.router.app import RouterHandle, start_router
from kvdiag.router.config import RouterConfig, RouterConfigError, Upstream
from kvdiag.router.placement import (
    REASON_AFFINITY,
    REASON_BRANCH,
    REASON_LEAST_LOADED,
    REASON_LOCALITY,
    REASON_OVERLOADED,
    REASON_ROUND_ROBIN,
    REASON_UNHEALTHY,
    Placement,
)
from kvdiag.router.store import Claim, LastTurn, MemoryStore, RedisStore
from kvdiag.router.upstream import Upstreams
from kvdiag.schema.events import read_events
from kvdiag.sim.agent_client import AgentOptions, run_agent_workload
from kvdiag.sim.agent_plan import AgentSpec
from kvdiag.sim.config import EngineConfig
from kvdiag.sim.fleet import Fleet, FleetSpec, start_fleet
from kvdiag.sim.workload_plan import WorkloadConfig, synthetic_text

MODEL = "Qwen/Qwen3-32B"
CHAT = "/v1/chat/completions"
LONG = "Please review the following design notes carefully and summarise the trade-offs. " * 40
PARSERS: dict[str, Any] = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True, "reasoning_parser": "qwen3"}


# ---------------------------------------------------------------------------------------------- unit: the policy
def _config(policy: str = "kv-aware", n_p: int = 4, n_d: int = 4, **kw: Any) -> RouterConfig:
    return RouterConfig(prefill=tuple(Upstream("10.0.0.1", 8100 + i) for i in range(n_p)),
                        decode=tuple(Upstream("10.0.0.2", 8200 + i) for i in range(n_d)), policy=policy,
                        **kw).validate()


def _placement(policy: str = "kv-aware", **kw: Any) -> tuple[Placement, Upstreams, CatalogMetrics]:
    config = _config(policy, **kw)
    upstreams = Upstreams(config)
    metrics = CatalogMetrics(CollectorRegistry(), component="router")
    return Placement(config, upstreams, metrics), upstreams, metrics


def _claim(p: int | None, d: int | None, *, acquired: bool = True) -> Claim:
    last = LastTurn(1, time.time(), True, "r1", prefill=None if p is None else f"10.0.0.1:{8100 + p}",
                    decode=None if d is None else f"10.0.0.2:{8200 + d}")
    return Claim("t" if acquired else None, None, last)


async def test_round_robin_is_the_default_and_ignores_the_conversation() -> None:
    assert RouterConfig(prefill=(Upstream("h", 1),), decode=(Upstream("h", 2),)).policy == "round-robin"
    placement, _, _ = _placement("round-robin")
    seen_p, seen_d = [], []
    for _ in range(8):
        placed = await placement.prefill("k", _claim(2, 3), 4000)
        seen_p.append(placed.prefill.index)
        seen_d.append(placement.decode_order(placed)[0])
        assert placed.prefill.reason == placed.decode.reason == REASON_ROUND_ROBIN  # type: ignore[union-attr]
    # Independent cursors, exactly the example proxy's rotation: the last P/D play no part.
    assert seen_p == [0, 1, 2, 3, 0, 1, 2, 3] and seen_d == [0, 1, 2, 3, 0, 1, 2, 3]


async def test_kv_aware_follows_the_last_p_and_d_and_expects_their_cache() -> None:
    placement, _, _ = _placement()
    placed = await placement.prefill("k", _claim(2, 3), 40_000)
    decision = reuse_rule.Decision(reuse_rule.Reuse.FULL, 9_000)
    coverage = reuse_rule.Coverage(reuse_rule.CHAT, (reuse_rule.Rung(3, "x", 8_500),), None)
    placement.expect(placed, decision, coverage)
    order = placement.decode_order(placed)
    assert placed.prefill.index == 2 and placed.prefill.reason == REASON_LOCALITY
    assert order[0] == 3 and placed.decode is not None and placed.decode.reason == REASON_AFFINITY
    assert sorted(order) == [0, 1, 2, 3] and sorted(placed.prefill.order) == [0, 1, 2, 3]
    # D holds its whole sequence the prompt reproduces; P held the previous prompt only.
    assert placed.decode.expected_local_tokens == 9_000 and placed.prefill.expected_local_tokens == 8_500
    attrs: dict[str, Any] = {}
    placement.finish(placed, attrs)
    assert attrs["placement"] == {"policy": "kv-aware",
                                  "prefill": {"index": 2, "reason": "locality", "expected_local_tokens": 8_500},
                                  "decode": {"index": 3, "reason": "affinity", "expected_local_tokens": 9_000}}


async def test_a_new_conversation_goes_to_the_least_loaded() -> None:
    placement, upstreams, _ = _placement()
    upstreams.prefill_tokens[:] = [500, 0, 900, 100]
    upstreams.decode_turns[:] = [3, 2, 0, 1]
    placed = await placement.prefill("k", Claim("t", None, None), 1000)
    order = placement.decode_order(placed)
    assert placed.prefill.order == [1, 3, 0, 2] and placed.prefill.reason == REASON_LEAST_LOADED
    assert order == [2, 3, 1, 0] and placed.decode is not None and placed.decode.reason == REASON_LEAST_LOADED
    assert placed.prefill.expected_local_tokens is None  # nothing known about this conversation


async def test_the_load_bound_breaks_affinity_only_for_a_hot_spot() -> None:
    placement, upstreams, _ = _placement(load_factor=2.0)
    upstreams.decode_turns[:] = [0, 0, 0, 3]  # a few turns are never a hot spot: 3 <= 2 x 4/4 + 1
    placed = await placement.prefill("k", _claim(0, 3), 1000)
    assert placement.decode_order(placed)[0] == 3
    upstreams.decode_turns[:] = [4, 4, 4, 9]  # 9 <= 2 x 22/4 + 1: D3 keeps it
    placed = await placement.prefill("k", _claim(0, 3), 1000)
    assert placement.decode_order(placed)[0] == 3
    upstreams.decode_turns[:] = [1, 0, 1, 9]  # 9 > 2 x 12/4 + 1: D3 is a hot spot
    placed = await placement.prefill("k", _claim(0, 3), 1000)
    order = placement.decode_order(placed)
    assert order[0] == 1 and placed.decode is not None and placed.decode.reason == REASON_OVERLOADED
    assert placed.decode.expected_local_tokens == 0  # the chosen D never held the conversation
    upstreams.prefill_tokens[:] = [90_000, 1_000, 0, 0]  # 90k > 2 x 101k/4 + 10k
    placed = await placement.prefill("k", _claim(0, 3), 40_000)
    assert placed.prefill.reason == REASON_OVERLOADED and placed.prefill.index in (2, 3)


async def test_an_ejected_instance_loses_its_affinity_and_round_robin_skips_it() -> None:
    placement, upstreams, _ = _placement(eject_after=1)
    upstreams.health.failure("decode", 3, "connect")
    upstreams.health.failure("prefill", 2, "http_5xx")
    placed = await placement.prefill("k", _claim(2, 3), 1000)
    order = placement.decode_order(placed)
    assert placed.prefill.reason == REASON_UNHEALTHY and placed.prefill.order[-1] == 2
    assert placed.decode is not None and placed.decode.reason == REASON_UNHEALTHY and order[-1] == 3
    rr, rr_up, _ = _placement("round-robin", eject_after=1)
    rr_up.health.failure("prefill", 0, "connect")
    first = await rr.prefill("k", None, 10)
    assert first.prefill.order == [1, 2, 3, 0] and first.prefill.reason == REASON_UNHEALTHY
    second = await rr.prefill("k", None, 10)
    assert second.prefill.order == [1, 2, 3, 0] and second.prefill.reason == REASON_ROUND_ROBIN


async def test_a_branch_waits_for_its_leader_and_follows_it_to_the_same_p() -> None:
    placement, _, _ = _placement(branch_wait=2.0)
    leader = await placement.prefill("k", _claim(3, 1), 40_000)
    assert leader.prefill.index == 3 and leader.leader is not None
    follower_task = asyncio.create_task(placement.prefill("k", _claim(3, 1, acquired=False), 40_000))
    await asyncio.sleep(0.05)
    assert not follower_task.done()  # waiting for the leader's prefill
    placement.prefill_done(leader)
    follower = await asyncio.wait_for(follower_task, 1.0)
    assert follower.prefill.index == 3 and follower.prefill.reason == REASON_BRANCH
    assert follower.leader is None  # a follower never leads
    # A leader that failed over: its branches follow it to the P that answered.
    leader = await placement.prefill("k", _claim(3, 1), 40_000)
    follower_task = asyncio.create_task(placement.prefill("k", _claim(3, 1, acquired=False), 40_000))
    await asyncio.sleep(0.01)
    placement.prefill_done(leader, 0)
    assert (await asyncio.wait_for(follower_task, 1.0)).prefill.index == 0
    # Without a leader on this router, a concurrent turn goes where the last turn went (another replica leads).
    other = await placement.prefill("k2", _claim(1, 1, acquired=False), 1000)
    assert other.prefill.index == 1 and other.prefill.reason == REASON_LOCALITY
    # The wait is bounded.
    slow, _, _ = _placement(branch_wait=0.1)
    await slow.prefill("k", _claim(0, 0), 10)
    started = time.perf_counter()
    follower = await slow.prefill("k", _claim(0, 0, acquired=False), 10)
    assert follower.prefill.reason == REASON_BRANCH and time.perf_counter() - started < 1.0


async def test_without_prefill_locality_p_is_least_loaded_and_expected_to_hold_nothing() -> None:
    placement, upstreams, _ = _placement(prefill_locality=False)
    upstreams.prefill_tokens[:] = [5, 5, 0, 5]
    placed = await placement.prefill("k", _claim(1, 1), 100)
    placement.decode_order(placed)
    assert placed.prefill.index == 2 and placed.prefill.reason == REASON_LEAST_LOADED
    assert placed.prefill.expected_local_tokens == 0
    assert placed.decode is not None and placed.decode.reason == REASON_AFFINITY


async def test_decisions_are_counted_with_bounded_labels() -> None:
    placement, _, metrics = _placement()
    for _ in range(3):
        placed = await placement.prefill("k", _claim(1, 2), 100)
        placement.expect(placed, reuse_rule.Decision(reuse_rule.Reuse.FULL, 640), None)
        placement.decode_order(placed)
        placement.decode_started(placed, 2)
        placement.finish(placed, {})
        placement.finish(placed, {})  # once per turn
    registry = metrics.registry
    assert registry.get_sample_value("kvdiag_placement_decisions_total",
                                     {"leg": "decode", "reason": "affinity", "index": "2"}) == 3
    assert registry.get_sample_value("kvdiag_placement_decisions_total",
                                     {"leg": "prefill", "reason": "locality", "index": "1"}) == 3
    assert registry.get_sample_value("kvdiag_placement_expected_local_tokens_total", {"leg": "decode"}) == 1920
    assert registry.get_sample_value("kvdiag_upstream_in_flight", {"leg": "decode", "index": "2"}) == 0
    labels = {s.labels.get("index") for m in registry.collect() for s in m.samples if "index" in s.labels}
    assert labels <= {"0", "1", "2", "3"}  # instance positions, never hosts


def test_config_rejects_bad_placement_options() -> None:
    for kw, word in (({"policy": "random"}, "--policy"), ({"load_factor": 0.5}, "--load-factor"),
                     ({"eject_after": -1}, "--eject-after"), ({"eject_seconds": 0}, "--eject-seconds"),
                     ({"health_check_interval": -1}, "--health-check-interval")):
        with pytest.raises(RouterConfigError, match=word):
            _config(**kw)


async def test_the_last_turn_record_keeps_p_and_d_in_memory_and_redis(tmp_path: Path) -> None:
    last = LastTurn(3, time.time(), True, "r", prefill="10.0.0.1:8101", decode="[::1]:8200")
    assert LastTurn.from_json(last.to_json()) == last
    bare = LastTurn(3, 1.0, False, "r", "not_streamed")
    assert "prefill" not in bare.to_json() and LastTurn.from_json(bare.to_json()) == bare
    memory = MemoryStore(capacity=10, entry_ttl=60, last_turn_ttl=600, lock_ttl=60)
    claim = await memory.claim("k")
    await memory.complete("k", claim.token or "", None, last)
    assert (await memory.claim("k")).last == last
    with redis_server(tmp_path) as url:
        redis = RedisStore(url, capacity=10, entry_ttl=60, last_turn_ttl=600, lock_ttl=60)
        try:
            claim = await redis.claim("k")
            await redis.complete("k", claim.token or "", None, last)
            assert (await redis.claim("k")).last == last
        finally:
            await redis.close()


# ---------------------------------------------------------------------------------------------- against a fleet
@contextlib.asynccontextmanager
async def _fleet(tmp: Path, *, p: dict[str, Any] | None = None, d: dict[str, Any] | None = None,
                 n: int = 4, parsers: bool = False) -> AsyncIterator[Fleet]:
    base = {"time_scale": 0.0, "mode": "instrumented", **(PARSERS if parsers else {})}
    fleet = await start_fleet(EngineConfig(role="prefill", **{**base, **(p or {})}),
                              EngineConfig(role="decode", **{**base, **(d or {})}),
                              FleetSpec(n, n, events_dir=tmp / "engines"))
    try:
        yield fleet
    finally:
        await fleet.close()


async def _router(fleet: Fleet, events: Path, **kw: Any) -> RouterHandle:
    return await start_router(RouterConfig(prefill=tuple(Upstream("127.0.0.1", h.port) for h in fleet.prefill),
                                           decode=tuple(Upstream("127.0.0.1", h.port) for h in fleet.decode),
                                           host="127.0.0.1", port=0, events_file=events, **kw))


def _engine_events(tmp: Path, event: str) -> dict[str, Any]:
    out = {}
    for path in (tmp / "engines").glob("*-events.jsonl"):
        for e in read_events(path):
            if e.event == event and e.request_id:
                out[e.request_id] = e
    return out


async def _chat(session: aiohttp.ClientSession, url: str, messages: list[dict[str, Any]], conv: str,
                max_tokens: int = 24) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": False,
            "conversation_id": conv}
    async with session.post(url + CHAT, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return str((await resp.json())["choices"][0]["message"]["content"])


async def _conversation(session: aiohttp.ClientSession, url: str, conv: str, turns: int) -> None:
    rng = random.Random(conv)  # every conversation its own text: no prefix shared between them
    messages: list[dict[str, Any]] = [{"role": "user", "content": synthetic_text(rng, 600)}]
    for _ in range(turns):
        reply = await _chat(session, url, messages, conv)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": synthetic_text(rng, 60)}]


async def test_kv_aware_keeps_conversations_on_their_d_and_p_and_moves_only_new_tokens(tmp_path: Path) -> None:
    pulled: dict[str, int] = {}
    for policy in ("round-robin", "kv-aware"):
        work = tmp_path / policy
        async with _fleet(work) as fleet:
            events = work / "router.jsonl"
            router = await _router(fleet, events, policy=policy)
            try:
                async with aiohttp.ClientSession() as session:
                    # Five conversations at once (not a multiple of the fleet's size).
                    convs = [f"{policy}-c{i}" for i in range(5)]
                    await asyncio.gather(*(_conversation(session, router.url, c, 5) for c in convs))
            finally:
                await router.close()
        await wait_for(lambda path=events: len(read_jsonl(path)) >= 25)  # type: ignore[misc]
        turns = read_jsonl(events)
        decode = _engine_events(work, "decode_request")
        later = [e for e in turns if e["turn"] >= 2]
        assert len(later) == 20 and all(e["status"] == "ok" for e in turns)
        pulled[policy] = sum(decode[e["request_id"]].remote_read_tokens or 0 for e in later)
        if policy == "kv-aware":
            by_conv: dict[str, set[tuple[int, int]]] = {}
            for e in turns:
                by_conv.setdefault(e["conversation_id"], set()).add(
                    (e["attrs"]["prefill_index"], e["attrs"]["decode_index"]))
            assert all(len(pairs) == 1 for pairs in by_conv.values()), by_conv  # one P and one D each
            for e in later:
                placement = e["attrs"]["placement"]
                assert placement["decode"]["reason"] == "affinity" and placement["prefill"]["reason"] == "locality"
                d = decode[e["request_id"]]
                # D held what the router expected (its whole previous sequence, reply included).
                expected = placement["decode"]["expected_local_tokens"]
                assert expected > 0 and abs((d.local_hit_tokens or 0) - expected) < 16
                assert e["outcome"] in ("local_hit", "below_threshold")  # P already held the history
        else:
            assert {e["attrs"]["placement"]["decode"]["reason"] for e in turns} == {"round_robin"}
    assert pulled["kv-aware"] * 3 < pulled["round-robin"], pulled


async def test_branches_follow_the_leader_to_its_p_and_hit_its_cache(tmp_path: Path) -> None:
    # P's prefill takes modelled time (scaled), so three copies of a turn are in flight together.
    async with _fleet(tmp_path, p={"time_scale": 0.5, "prefix_caching": True}) as fleet:
        events = tmp_path / "router.jsonl"
        router = await _router(fleet, events, policy="kv-aware", branch_wait=5.0)
        try:
            async with aiohttp.ClientSession() as session:
                m1 = [{"role": "user", "content": LONG}]
                reply = await _chat(session, router.url, m1, "b")
                m2 = [*m1, {"role": "assistant", "content": reply}, {"role": "user", "content": LONG + " more"}]
                await asyncio.gather(*(_chat(session, router.url, m2, "b") for _ in range(3)))
        finally:
            await router.close()
    await wait_for(lambda: len(read_jsonl(events)) >= 4)
    later = read_jsonl(events)[1:]
    prefill = _engine_events(tmp_path, "prefill_request")
    leader = [e for e in later if e["lookup"] == "hit"]
    branches = [e for e in later if e["lookup"] == "concurrent"]
    assert len(leader) == 1 and len(branches) == 2
    p_index = leader[0]["attrs"]["prefill_index"]
    for e in branches:
        assert e["attrs"]["placement"]["prefill"]["reason"] == "branch" and e["attrs"]["prefill_index"] == p_index
        report = prefill[e["request_id"]]
        # The history the leader read is in that P's prefix cache: the branch computes only its tail.
        assert (report.local_hit_tokens or 0) >= (report.prompt_tokens or 0) - 64, report


async def test_round_robin_branches_recompute_the_history(tmp_path: Path) -> None:
    # The negative control of the branch test: without placement the copies land on other Ps, cold.
    async with _fleet(tmp_path, p={"time_scale": 0.5, "prefix_caching": True}) as fleet:
        events = tmp_path / "router.jsonl"
        router = await _router(fleet, events)
        try:
            async with aiohttp.ClientSession() as session:
                m1 = [{"role": "user", "content": LONG}]
                reply = await _chat(session, router.url, m1, "b")
                m2 = [*m1, {"role": "assistant", "content": reply}, {"role": "user", "content": LONG + " more"}]
                await asyncio.gather(*(_chat(session, router.url, m2, "b") for _ in range(3)))
        finally:
            await router.close()
    await wait_for(lambda: len(read_jsonl(events)) >= 4)
    prefill = _engine_events(tmp_path, "prefill_request")
    branches = [e for e in read_jsonl(events)[1:] if e["lookup"] == "concurrent"]
    assert len(branches) == 2
    assert all((prefill[e["request_id"]].local_hit_tokens or 0) == 0 for e in branches)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


async def test_replicas_sharing_redis_place_a_conversation_alike(tmp_path: Path, redis_url: str) -> None:
    async with _fleet(tmp_path) as fleet:
        d_ports = [h.port for h in fleet.decode]
        conv = f"rep-{time.monotonic_ns()}"
        a = await _router(fleet, tmp_path / "a.jsonl", policy="kv-aware", state=redis_url)
        # Replica b lists the instances in another order: the record names them by host:port.
        b = await start_router(RouterConfig(
            prefill=tuple(Upstream("127.0.0.1", h.port) for h in reversed(fleet.prefill)),
            decode=tuple(Upstream("127.0.0.1", h.port) for h in reversed(fleet.decode)), host="127.0.0.1", port=0,
            events_file=tmp_path / "b.jsonl", policy="kv-aware", state=redis_url))
        try:
            async with aiohttp.ClientSession() as session:
                messages: list[dict[str, Any]] = [{"role": "user", "content": LONG}]
                for t in range(4):
                    reply = await _chat(session, (a if t % 2 == 0 else b).url, messages, conv)
                    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"next {t}"}]
        finally:
            await a.close()
            await b.close()
    await wait_for(lambda: len(read_jsonl(tmp_path / "a.jsonl")) >= 2 and len(read_jsonl(tmp_path / "b.jsonl")) >= 2)
    ports = set()
    for name, listed in (("a", d_ports), ("b", d_ports[::-1])):
        for e in read_jsonl(tmp_path / f"{name}.jsonl"):
            ports.add(listed[e["attrs"]["decode_index"]])
            if e["turn"] > 1:
                assert e["attrs"]["placement"]["decode"]["reason"] == "affinity"
    assert len(ports) == 1  # every turn on one D, whichever replica routed it


async def test_placement_never_loads_wrong_kv(tmp_path: Path) -> None:
    # The reuse rule decides what P may read; kv-aware only moves where. With P's exact mode off (a stock
    # P) the oracle counts every token of KV P loaded for other ids: none under the rule, many without it.
    spec = AgentSpec(profile="reasoning-chat", conversations=3, seed=2, turns=5, scale=0.3, prefix="wrong")
    wrong: dict[str, int] = {}
    for label in ("rule", "full-handle"):
        async with _fleet(tmp_path / label, p={"prefix_caching": False, "pull_matching_prefix": False},
                          parsers=True) as fleet:
            router = await _router(fleet, tmp_path / label / "router.jsonl", policy="kv-aware")
            original = router_reuse.decide
            if label == "full-handle":
                router_reuse.decide = _always_full  # type: ignore[assignment]
            try:
                config = WorkloadConfig(url=router.url, conversations=3, concurrency=8, seed=2)
                await run_agent_workload(config, spec, options=AgentOptions())
            finally:
                router_reuse.decide = original  # type: ignore[assignment]
                await router.close()
            wrong[label] = sum(h.engine.wrong_kv_tokens for h in fleet.prefill)
    assert wrong["rule"] == 0 and wrong["full-handle"] > 0, wrong


def _always_full(coverage: Any, view: Any, *, handle_tokens: int, block_size: Any, margin: int = 8) -> Any:
    return reuse_rule.Decision(reuse_rule.Reuse.FULL, handle_tokens)
