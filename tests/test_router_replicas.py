"""Router replicas as real processes sharing a real Redis Cluster (and one Redis): replicas die, Redis dies.

Three ``kvdiag router`` processes share ``--state redis+cluster://`` on a 3-master cluster started here;
a client spreads every conversation's turns over them (turn k of conversation i goes to replica
(i + k) mod 3, the next one when that one fails), two tenants use the same conversation ids, and every
reply is sent back verbatim, so every later turn can reuse D's whole handle.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from redis.crc import key_slot
from redis_cluster_support import Cluster, Node, cluster, single_server
from replica_support import (
    REUSED,
    Conversation,
    RouterProcess,
    TenantStub,
    eligible_turns,
    metric,
    replicas,
    send_turn,
)

from kvdiag.router.security import store_key, tenant_of
from kvdiag.router.store_cluster import ClusterStore

pytestmark = pytest.mark.slow  # minutes of real servers: `make test-fast` leaves it out

TENANTS = ("tenant-a", "tenant-b")


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("cluster"), "redis") as c:
        yield c


def conversations(n: int, prefix: str) -> list[Conversation]:
    # The two tenants use the same conversation ids: the store keeps them apart.
    return [Conversation(i, TENANTS[i % 2], f"{prefix}-{i // 2}") for i in range(n)]


async def run_conversations(session: aiohttp.ClientSession, routers: list[RouterProcess], convs: list[Conversation],
                            turns: int, done: list[int]) -> None:
    async def one(conv: Conversation) -> None:
        while conv.turns_done < turns:
            await send_turn(session, routers, conv, conv.index + conv.turns_done + 1)
            done[0] += 1

    await asyncio.gather(*(one(c) for c in convs))


async def test_kill_9_of_a_replica_under_load_keeps_every_other_turn_s_handle(tmp_path: Path,
                                                                             redis_cluster: Cluster) -> None:
    stub = await TenantStub().start()
    n_convs, n_turns = 90, 8
    try:
        with replicas(tmp_path, 3, stub.port, redis_cluster.url, "--prefill-timeout", "5", "--decode-timeout",
                      "5") as routers:
            convs = conversations(n_convs, "kill")
            done = [0]
            connector = aiohttp.TCPConnector(limit=200)
            async with aiohttp.ClientSession(connector=connector) as session:
                load = asyncio.get_running_loop().create_task(run_conversations(session, routers, convs, n_turns,
                                                                                done))
                while done[0] < n_convs * n_turns // 4 and not load.done():
                    await asyncio.sleep(0.01)
                routers[0].kill()  # SIGKILL under load: turns in flight on it break
                killed_at = time.monotonic()
                await load
                stores_errors = [await metric(session, r.url, "kvdiag_store_errors_total") for r in routers[1:]]
        results = [r for c in convs for r in c.results]
        assert all(c.turns_done == n_turns for c in convs)
        broken = [r for r in results if not r.ok and not r.refused]
        assert broken and all(r.replica == 0 for r in broken), [(r.replica, r.error) for r in broken if r.replica]
        eligible = [r for c in convs for r in eligible_turns(c)]
        after = [r for r in eligible if r.started_at > killed_at]
        # The kill lands once a quarter of the turns are done (polled, so a little later on a loaded machine):
        # well over half of the eligible turns start after it.
        assert len(after) >= len(eligible) // 2, (len(after), len(eligible))
        reused = [r for r in after if r.verdict in REUSED and r.reused > 0]
        assert len(reused) >= 0.99 * len(after), {r.verdict for r in after}
        # Nothing unsafe, on any turn: no handle read twice, none from another tenant or conversation,
        # no position loaded with KV of other tokens.
        assert len(stub.handles_read) == len(set(stub.handles_read)) > len(after)
        assert stub.foreign == []
        assert sum(p.wrong_kv_tokens for p in stub.prefills) == 0
        assert all(not errors for errors in stores_errors)
        print(f"\nreplica kill: {len(results)} attempts, {len(broken)} broken by the kill, {len(eligible)} eligible "
              f"turns ({len(after)} after the kill), {len(reused)}/{len(after)} reused after it, "
              f"{len(stub.handles_read)} handles read once each")
    finally:
        await stub.close()


async def test_negative_control_replicas_without_a_shared_store_lose_the_handles(tmp_path: Path) -> None:
    # The same traffic over replicas that each keep their own memory store: the next turn lands on
    # another replica, which knows nothing. The >= 99% above is what sharing the store buys.
    stub = await TenantStub().start()
    try:
        with replicas(tmp_path, 3, stub.port, "memory") as routers:
            convs = conversations(20, "mem")
            async with aiohttp.ClientSession() as session:
                await run_conversations(session, routers, convs, 4, [0])
        eligible = [r for c in convs for r in eligible_turns(c)]
        assert len(eligible) == 20 * 3
        # Only turn 4 comes back to the replica that served turn 1 (whose handle is still a prefix).
        assert {r.verdict for r in eligible if r.turn < 4} == {"router_state_lost"}
        assert sum(1 for r in eligible if r.verdict in REUSED) <= len(eligible) // 3
    finally:
        await stub.close()


def _events(routers: list[RouterProcess]) -> list[dict[str, object]]:
    return [e for r in routers for e in r.read_events()]


async def _wait_store_back(session: aiohttp.ClientSession, routers: list[RouterProcess]) -> None:
    deadline = time.monotonic() + 30
    for r in routers:
        while True:
            async with session.get(r.url + "/health") as resp:
                if resp.status == 200:
                    break
            if time.monotonic() > deadline:
                raise AssertionError(f"router {r.index} never saw the store again")
            await asyncio.sleep(0.2)


async def _round(session: aiohttp.ClientSession, routers: list[RouterProcess],
                 convs: list[Conversation]) -> list[str]:
    results = await asyncio.gather(*(send_turn(session, routers, c, c.index + c.turns_done + 1) for c in convs))
    assert all(r.ok and r.attempt == 0 for r in results)  # every turn answered by the first replica it tried
    return [r.verdict or "" for r in results]


async def test_a_cluster_master_down_then_restarted_costs_reuse_never_an_answer(tmp_path: Path) -> None:
    stub = await TenantStub().start()
    try:
        with cluster(tmp_path / "c", "redis") as c, \
                replicas(tmp_path, 3, stub.port, c.url, "--prefill-timeout", "5", "--decode-timeout", "5") as routers:
            convs = conversations(36, "down")
            layout = ClusterStore(c.url, capacity=1, entry_ttl=1, last_turn_ttl=1, lock_ttl=1)
            per = 16384 // len(c.nodes)
            victim = 1
            on_victim = {conv.index for conv in convs
                         if min(key_slot(layout.keys(store_key(tenant_of(f"Bearer {conv.tenant}"), conv.cid))[0]
                                         .encode()) // per, 2) == victim}
            await layout.close()
            assert 4 <= len(on_victim) <= 24
            async with aiohttp.ClientSession() as session:
                for _ in range(3):
                    verdicts = await _round(session, routers, convs)
                assert set(verdicts) == {"remote_hit"}
                c.nodes[victim].kill()
                c.wait_down()
                for _ in range(2):  # the cluster is down: every turn goes on, without reuse
                    assert set(await _round(session, routers, convs)) == {"router_state_lost"}
                errors = [await metric(session, r.url, "kvdiag_store_errors_total") for r in routers]
                assert sum(v for e in errors for k, v in e.items() if 'op="claim"' in k) >= 2 * len(convs)
                c.nodes[victim].start()
                c.wait_ok()
                await _wait_store_back(session, routers)
                first = await _round(session, routers, convs)
                # The restarted master lost its keys; the others still hold the handles stored before the
                # outage, which the longer prompts still start with.
                assert [v for i, v in enumerate(first) if i in on_victim] == ["router_state_lost"] * len(on_victim)
                assert {v for i, v in enumerate(first) if i not in on_victim} == {"remote_hit"}
                assert set(await _round(session, routers, convs)) == {"remote_hit"}
            await asyncio.sleep(0.3)  # events are flushed every 50 ms
            reasons = [str(e.get("reason")) for e in _events(routers) if e.get("outcome") == "router_state_lost"]
            assert sum("conversation store unavailable" in r for r in reasons) == 2 * len(convs)
            assert sum("store knows nothing" in r for r in reasons) == len(on_victim)
        assert stub.foreign == [] and sum(p.wrong_kv_tokens for p in stub.prefills) == 0
        assert len(stub.handles_read) == len(set(stub.handles_read))
    finally:
        await stub.close()


async def test_a_single_redis_down_then_restarted_costs_reuse_never_an_answer(tmp_path: Path) -> None:
    stub = await TenantStub().start()
    try:
        with single_server(tmp_path, "redis") as node:
            url = f"redis://127.0.0.1:{node.port}/0"
            with replicas(tmp_path, 2, stub.port, url) as routers:
                convs = conversations(10, "single")
                async with aiohttp.ClientSession() as session:
                    for _ in range(2):
                        verdicts = await _round(session, routers, convs)
                    assert set(verdicts) == {"remote_hit"}
                    node.kill()
                    assert set(await _round(session, routers, convs)) == {"router_state_lost"}
                    errors = [await metric(session, r.url, "kvdiag_store_errors_total") for r in routers]
                    assert sum(v for e in errors for k, v in e.items() if 'op="claim"' in k) == len(convs)
                    _restart(node)
                    await _wait_store_back(session, routers)
                    assert set(await _round(session, routers, convs)) == {"router_state_lost"}  # Redis forgot
                    again = await _round(session, routers, convs)
                    assert set(again) == {"remote_hit"}, [(e.get("outcome"), e.get("reason")) for e in _events(routers)]
                await asyncio.sleep(0.3)
                reasons = [str(e.get("reason")) for e in _events(routers) if e.get("outcome") == "router_state_lost"]
                assert sum("conversation store unavailable" in r for r in reasons) == len(convs)
                assert sum("store knows nothing" in r for r in reasons) == len(convs)
    finally:
        await stub.close()


def _restart(node: Node) -> None:
    node.start()
