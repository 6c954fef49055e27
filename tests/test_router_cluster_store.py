"""The hash-tagged store on real Redis and Valkey: 3-master clusters and single servers started here.

The same semantics as the single-Redis store (single-use handles, claims, release, expiry), plus what a
cluster adds: every script's keys in one slot, buckets spread over the masters, a capacity bound
without a global key, and a master that dies or restarts costing reuse, never an answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot
from redis_cluster_support import Cluster, Node, cluster, single_server

from kvdiag.router.reuse_rule import Coverage, ReplyRecord, Rung
from kvdiag.router.store import Handle, LastTurn, RedisStore, StoreError
from kvdiag.router.store_cluster import (
    BREAKER_ERRORS,
    BUCKETS,
    ClusterStore,
    bucket_of,
    bucket_tags,
    parse_cluster_url,
    redacted,
)

COVERAGE = Coverage("messages", (Rung(1, "ab" * 16, 30), Rung(3, "cd" * 16, None, True, False)),
                    ReplyRecord("ef" * 32, 11, frozenset(), frozenset({"stop"}), "stop", None, True, 7, 1),
                    None, 16, None, 2)
BACKENDS = ("redis-cluster", "valkey-cluster", "redis-single", "valkey-single")


def handle(turn: int = 1, stored_at: float | None = None, rid: str = "r1") -> Handle:
    return Handle(params={"remote_block_ids": [[1, 2, 3]], "remote_engine_id": "d", "remote_num_tokens": 41,
                          "remote_blocks_expiry_time": 1234.5678, "remote_port": 5601},
                  stored_at=time.time() if stored_at is None else stored_at, turn=turn, request_id=rid,
                  coverage=COVERAGE)


def last(turn: int = 1, stored: bool = True, reason: str | None = None) -> LastTurn:
    return LastTurn(turn=turn, ended_at=time.time(), stored=stored, request_id="r1", missing_reason=reason)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Cluster | Node]]:
    tmp = tmp_path_factory.mktemp("stores")
    with cluster(tmp, "redis") as rc, cluster(tmp, "valkey") as vc, single_server(tmp, "redis") as rs, \
            single_server(tmp, "valkey") as vs:
        yield {"redis-cluster": rc, "valkey-cluster": vc, "redis-single": rs, "valkey-single": vs}


def url_of(server: Cluster | Node) -> str:
    return server.url if isinstance(server, Cluster) else f"redis://127.0.0.1:{server.port}/0"


def make(servers: dict[str, Cluster | Node], backend: str, **overrides: float | int | str) -> ClusterStore:
    kwargs: dict[str, float | int | str] = {"capacity": 1000, "entry_ttl": 60.0, "last_turn_ttl": 600.0,
                                            "lock_ttl": 30.0, "prefix": f"t{time.monotonic_ns()}:"}
    kwargs.update(overrides)
    return ClusterStore(url_of(servers[backend]), **kwargs)  # type: ignore[arg-type]


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest, servers: dict[str, Cluster | Node]) -> AsyncIterator[ClusterStore]:
    s = make(servers, request.param)
    await s.ping()
    yield s
    await s.close()


# ---------------------------------------------------------------------------------------------- semantics
async def test_handle_is_single_use_and_round_trips_exactly(store: ClusterStore) -> None:
    first = await store.claim("k")
    assert first.acquired and first.handle is None and first.last is None
    h = handle()
    assert await store.complete("k", first.token or "", h, last())
    second = await store.claim("k")
    assert second.handle == h and isinstance(second.handle.params["remote_port"], int)
    assert second.last is not None and second.last.stored
    await store.complete("k", second.token or "", None, last(2, stored=False, reason="not_streamed"))
    third = await store.claim("k")
    assert third.handle is None and third.last is not None and third.last.missing_reason == "not_streamed"


async def test_replicas_racing_for_one_conversation_read_its_handle_once(store: ClusterStore,
                                                                       servers: dict[str, Cluster | Node]) -> None:
    # Three router replicas (three clients) claim the same conversation at once, 20 times over.
    replicas = [store] + [ClusterStore(store.url, capacity=1000, entry_ttl=60, last_turn_ttl=600, lock_ttl=30,
                                       prefix=store.prefix) for _ in range(2)]
    try:
        reads = 0
        for round_ in range(20):
            c = await store.claim("race")
            await store.complete("race", c.token or "", handle(rid=f"r{round_}"), last(round_))
            claims = await asyncio.gather(*(r.claim("race") for r in replicas for _ in range(3)))
            winners = [x for x in claims if x.acquired]
            assert len(winners) == 1 and winners[0].handle is not None
            assert all(x.handle is None for x in claims if not x.acquired)
            reads += sum(1 for x in claims if x.handle is not None)
            await store.release("race", winners[0].token or "", None)
        assert reads == 20
    finally:
        for r in replicas[1:]:
            await r.close()


async def test_release_gives_the_handle_back_once(store: ClusterStore) -> None:
    c = await store.claim("k")
    await store.complete("k", c.token or "", handle(), last())
    taken = await store.claim("k")
    assert taken.handle is not None
    await store.release("k", taken.token or "", taken.handle)
    again = await store.claim("k")
    assert again.acquired and again.handle == taken.handle
    await store.release("k", taken.token or "", taken.handle)  # a stale token changes nothing
    assert not (await store.claim("k")).acquired


async def test_release_does_not_give_back_an_expired_handle(store: ClusterStore) -> None:
    c = await store.claim("k")
    await store.release("k", c.token or "", handle(stored_at=time.time() - 120))
    assert (await store.claim("k")).handle is None


async def test_complete_with_a_lost_claim_stores_nothing(store: ClusterStore) -> None:
    await store.claim("k")
    assert not await store.complete("k", "not-the-token", handle(), last())
    assert await store.size() == 0


async def test_size_counts_handles_over_every_bucket(store: ClusterStore) -> None:
    for i in range(40):
        c = await store.claim(f"k{i}")
        await store.complete(f"k{i}", c.token or "", handle(rid=f"r{i}"), last())
    assert await store.size() == 40
    assert len({bucket_of(f"k{i}") for i in range(40)}) > 30  # spread, not one bucket


async def test_last_turn_remembers_a_handle_that_was_not_kept(store: ClusterStore) -> None:
    first = await store.claim("nk")
    record = LastTurn(turn=1, ended_at=time.time(), stored=False, request_id="r1", not_kept="unsupported shape")
    await store.complete("nk", first.token or "", None, record)
    assert (await store.claim("nk")).last == record


@pytest.mark.parametrize("backend", ["redis-cluster", "valkey-single"])
async def test_handles_expire_by_server_ttl(servers: dict[str, Cluster | Node], backend: str) -> None:
    s = make(servers, backend, entry_ttl=0.3)
    try:
        c = await s.claim("k")
        await s.complete("k", c.token or "", handle(), last())
        await asyncio.sleep(0.5)
        got = await s.claim("k")
        assert got.handle is None and got.last is not None and got.last.stored
        assert await s.size() == 0
    finally:
        await s.close()


@pytest.mark.parametrize("backend", ["redis-cluster", "valkey-cluster"])
async def test_capacity_is_bounded_per_bucket_without_a_global_key(servers: dict[str, Cluster | Node],
                                                                   backend: str) -> None:
    evicted: dict[str, int] = {}
    s = make(servers, backend, capacity=2 * BUCKETS)
    s._on_evict = lambda reason, n: evicted.__setitem__(reason, evicted.get(reason, 0) + n)
    stored = 3000
    try:
        await s.ping()
        for start in range(0, stored, 100):
            claims = await asyncio.gather(*(s.claim(f"c{i}") for i in range(start, start + 100)))
            await asyncio.gather(*(s.complete(f"c{i}", c.token or "", handle(rid=f"r{i}"), last())
                                   for i, c in zip(range(start, start + 100), claims, strict=True)))
        size = await s.size()
        assert size <= 2 * BUCKETS
        assert size >= 2 * BUCKETS - 8  # 3000 keys fill nearly every bucket of 2
        assert evicted.get("capacity") == stored - size
        per_bucket = [await _zcard(servers[backend], name) for name in s.index_keys()]
        assert max(per_bucket) <= 2
        # The newest handles survive, the oldest of each bucket went first.
        assert (await s.claim(f"c{stored - 1}")).handle is not None
    finally:
        await s.close()


async def _zcard(server: Cluster | Node, name: str) -> int:
    assert isinstance(server, Cluster)
    rc = redis.RedisCluster(host="127.0.0.1", port=server.nodes[0].port)
    try:
        return int(rc.zcard(name))
    finally:
        rc.close()


# ---------------------------------------------------------------------------------------------- layout
def test_bucket_tags_spread_evenly_over_the_slots() -> None:
    tags = bucket_tags()
    assert len(tags) == BUCKETS == len(set(tags))
    assert [key_slot(t.encode()) // (16384 // BUCKETS) for t in tags] == list(range(BUCKETS))


@pytest.mark.parametrize("backend", ["redis-cluster", "valkey-cluster"])
async def test_every_key_sits_in_its_conversations_slot(servers: dict[str, Cluster | Node], backend: str) -> None:
    server = servers[backend]
    assert isinstance(server, Cluster)
    s = make(servers, backend)
    try:
        for i in range(300):
            c = await s.claim(f"conv{i}")
            await s.complete(f"conv{i}", c.token or "", handle(), last())
        held = [await s.claim(f"conv{i}") for i in range(0, 300, 2)]  # half of them hold a claim
        assert all(c.acquired for c in held)
        owned_by: dict[int, int] = {}
        total = 0
        for n, node in enumerate(server.nodes):
            client = node.client()
            names = [k.decode() for k in client.scan_iter(match=f"{s.prefix}*", count=1000)]
            total += len(names)
            for name in names:
                assert name.startswith(f"{s.prefix}{{b") and "}:" in name  # hash-tagged, never global
                owned_by[key_slot(name.encode())] = n
        for i in range(300):
            slots_of_conv = {key_slot(k.encode()) for k in s.keys(f"conv{i}")}
            assert len(slots_of_conv) == 1  # handle, claim, record and index: one slot, so one script
        # 300 records + 150 handles + 150 claims + the indexes of the buckets in use.
        used = {bucket_of(f"conv{i}") for i in range(300)}
        assert total == 300 + 150 + 150 + len({bucket_of(f"conv{i}") for i in range(1, 300, 2)})
        assert len(used) > 150
        buckets_per_master = [sum(1 for t in bucket_tags() if _master_of(server, key_slot(t.encode())) == n)
                              for n in range(3)]
        assert all(80 <= b <= 91 for b in buckets_per_master), buckets_per_master
    finally:
        await s.close()


def _master_of(server: Cluster, slot: int) -> int:
    per = 16384 // len(server.nodes)
    return min(slot // per, len(server.nodes) - 1)


@pytest.mark.parametrize("backend", ["redis-cluster", "valkey-cluster"])
async def test_negative_control_the_single_server_layout_cannot_run_on_a_cluster(
        servers: dict[str, Cluster | Node], backend: str) -> None:
    server = servers[backend]
    assert isinstance(server, Cluster)
    url = f"redis://127.0.0.1:{server.nodes[0].port}/0"
    legacy = RedisStore(url, capacity=10, entry_ttl=60, last_turn_ttl=600, lock_ttl=30)
    try:
        with pytest.raises(StoreError, match="redis\\+cluster://"):
            await legacy.ping()
        errors = 0
        for i in range(20):  # its global index key shares a slot with no conversation
            try:
                c = await legacy.claim(f"k{i}")
                await legacy.complete(f"k{i}", c.token or "", handle(), last())
            except StoreError as exc:
                assert "CrossSlot" in str(exc) or "MOVED" in str(exc)
                errors += 1
        assert errors == 20
    finally:
        await legacy.close()


async def test_the_single_server_store_runs_on_valkey(servers: dict[str, Cluster | Node]) -> None:
    node = servers["valkey-single"]
    legacy = RedisStore(url_of(node), capacity=3, entry_ttl=60, last_turn_ttl=600, lock_ttl=30,
                        prefix=f"legacy{time.monotonic_ns()}:")
    try:
        await legacy.ping()
        for i in range(5):
            c = await legacy.claim(f"k{i}")
            await legacy.complete(f"k{i}", c.token or "", handle(rid=f"r{i}"), last())
        assert await legacy.size() == 3
        got = (await legacy.claim("k4")).handle
        assert got is not None and got.request_id == "r4" and got.coverage == COVERAGE
        assert (await legacy.claim("k0")).handle is None  # evicted, oldest first
    finally:
        await legacy.close()


def test_cluster_urls_parse_and_redact() -> None:
    kwargs = parse_cluster_url("redis+cluster://alice:s%40cret@10.0.0.1:7000,10.0.0.2:7001/0")
    assert kwargs["username"] == "alice" and kwargs["password"] == "s@cret" and kwargs["ssl"] is False
    assert [(n.host, n.port) for n in kwargs["startup_nodes"]] == [("10.0.0.1", 7000), ("10.0.0.2", 7001)]
    assert parse_cluster_url("rediss+cluster://h:1")["ssl"] is True
    with pytest.raises(StoreError, match="host:port"):
        parse_cluster_url("redis+cluster://h1:7000,h2")
    assert redacted("redis+cluster://alice:secret@h:1") == "redis+cluster://h:1"


async def test_unreachable_cluster_raises_store_error_without_the_password(tmp_path: Path) -> None:
    from redis_cluster_support import free_cluster_port

    port = free_cluster_port()
    s = ClusterStore(f"redis+cluster://u:hunter2@127.0.0.1:{port}", capacity=10, entry_ttl=60, last_turn_ttl=600,
                     lock_ttl=30, timeout=0.5)
    try:
        with pytest.raises(StoreError) as info:
            await s.ping()
        assert f"127.0.0.1:{port}" in str(info.value) and "hunter2" not in str(info.value)
    finally:
        await s.close()


# ---------------------------------------------------------------------------------------------- failures
@pytest.mark.parametrize("kind", ["redis", "valkey"])
async def test_a_master_that_dies_and_restarts_costs_reuse_not_answers(tmp_path: Path, kind: str) -> None:
    with cluster(tmp_path, kind) as c:
        s = ClusterStore(c.url, capacity=10_000, entry_ttl=60, last_turn_ttl=600, lock_ttl=30, timeout=0.5)
        try:
            keys = [f"conv{i}" for i in range(120)]
            for k in keys:
                claim = await s.claim(k)
                await s.complete(k, claim.token or "", handle(), last())
            victim = 1
            on_victim = {k for k in keys if _master_of(c, key_slot(s.keys(k)[0].encode())) == victim}
            assert 20 < len(on_victim) < 70
            c.nodes[victim].kill()
            c.wait_down()  # the survivors see the cluster fail: every call fails, fast once the breaker opens
            started = time.perf_counter()
            errors = 0
            for k in keys:
                try:
                    await s.claim(k)
                except StoreError:
                    errors += 1
            elapsed = time.perf_counter() - started
            assert errors == len(keys)
            # At most BREAKER_ERRORS slow calls (0.5 s each) and a probe or two, then errors at once.
            assert elapsed < (BREAKER_ERRORS + 4) * 0.5 + 1.0, elapsed
            c.nodes[victim].start()
            c.wait_ok()
            deadline = time.monotonic() + 15
            while True:
                try:
                    await s.size()
                    break
                except StoreError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)
            kept = lost = 0
            for k in keys:
                claim = await s.claim(k)
                if k in on_victim:
                    # The restarted master lost its data: no handle and no record (the router says state lost).
                    assert claim.acquired and claim.handle is None and claim.last is None
                    lost += 1
                else:
                    # The others kept theirs; claims taken while the cluster was down were never written.
                    assert claim.handle is not None
                    kept += 1
            assert lost == len(on_victim) and kept == len(keys) - len(on_victim)
        finally:
            await s.close()


async def test_a_cluster_url_on_a_single_server_says_which_url_to_use(servers: dict[str, Cluster | Node]) -> None:
    node = servers["redis-single"]
    assert isinstance(node, Node)
    s = ClusterStore(f"redis+cluster://127.0.0.1:{node.port}", capacity=10, entry_ttl=60, last_turn_ttl=600,
                     lock_ttl=30, timeout=1.0)
    try:
        with pytest.raises(StoreError, match="use redis:// for one server"):
            await s.ping()
    finally:
        await s.close()
