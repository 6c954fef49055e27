"""Conversation store semantics, in memory and on a real redis-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from router_support import redis_server

from kvdiag.router.reuse_rule import Coverage, ReplyRecord, Rung, token_trace
from kvdiag.router.store import Handle, LastTurn, MemoryStore, RedisStore, Store, StoreError

COVERAGE = Coverage("messages", (Rung(1, "ab" * 16, 30), Rung(3, "cd" * 16, None)),
                    ReplyRecord("ef" * 32, 11, frozenset({"reasoning"}), frozenset({"stop"}), "stop", "###", True, 7,
                                1),
                    None, 16, token_trace(list(range(100)), 90, 16))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _handle(turn: int = 1, stored_at: float | None = None, rid: str = "r1") -> Handle:
    return Handle(params={"remote_block_ids": [[1, 2, 3]], "remote_engine_id": "d", "remote_num_tokens": 41,
                          "remote_blocks_expiry_time": 1234.5678, "remote_port": 5601},
                  stored_at=time.time() if stored_at is None else stored_at, turn=turn, request_id=rid,
                  coverage=COVERAGE)


def _last(turn: int = 1, stored: bool = True, reason: str | None = None) -> LastTurn:
    return LastTurn(turn=turn, ended_at=time.time(), stored=stored, request_id="r1", missing_reason=reason)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[Store]:
    kwargs = {"capacity": 100, "entry_ttl": 60.0, "last_turn_ttl": 600.0, "lock_ttl": 30.0}
    s: Store
    if request.param == "memory":
        s = MemoryStore(**kwargs)
    else:
        s = RedisStore(redis_url, prefix=f"t{time.monotonic_ns()}:", **kwargs)
    yield s
    await s.close()


async def test_handle_is_single_use_and_round_trips_exactly(store: Store) -> None:
    first = await store.claim("k")
    assert first.acquired and first.handle is None and first.last is None
    h = _handle()
    assert await store.complete("k", first.token or "", h, _last())
    second = await store.claim("k")
    assert second.handle == h  # ints stay ints, floats stay floats, the coverage is kept whole
    assert isinstance(second.handle.params["remote_port"], int)
    assert second.last is not None and second.last.turn == 1 and second.last.stored
    await store.complete("k", second.token or "", None, _last(2, stored=False, reason="not_streamed"))
    third = await store.claim("k")
    assert third.handle is None  # never read twice
    assert third.last is not None and third.last.missing_reason == "not_streamed"


async def test_second_claim_while_in_flight_is_concurrent_and_gets_no_handle(store: Store) -> None:
    c = await store.claim("k")
    await store.complete("k", c.token or "", _handle(), _last())
    a, b = await asyncio.gather(store.claim("k"), store.claim("k"))
    winners = [x for x in (a, b) if x.acquired]
    losers = [x for x in (a, b) if not x.acquired]
    assert len(winners) == 1 and len(losers) == 1
    assert winners[0].handle is not None and losers[0].handle is None
    assert losers[0].last is not None  # the concurrent turn still sees the record


async def test_release_gives_the_handle_back_once(store: Store) -> None:
    c = await store.claim("k")
    await store.complete("k", c.token or "", _handle(), _last())
    taken = await store.claim("k")
    assert taken.handle is not None
    await store.release("k", taken.token or "", taken.handle)
    again = await store.claim("k")
    assert again.acquired and again.handle == taken.handle
    # A stale token cannot release or overwrite the new owner's claim.
    await store.release("k", taken.token or "", taken.handle)
    assert not (await store.claim("k")).acquired


async def test_release_does_not_give_back_an_expired_handle(store: Store) -> None:
    c = await store.claim("k")
    old = _handle(stored_at=time.time() - 120)  # older than the 60 s TTL
    await store.release("k", c.token or "", old)
    assert (await store.claim("k")).handle is None


async def test_complete_with_a_lost_claim_stores_nothing(store: Store) -> None:
    await store.claim("k")
    assert not await store.complete("k", "not-the-token", _handle(), _last())
    assert await store.size() == 0


async def test_size_counts_handles(store: Store) -> None:
    for i in range(5):
        c = await store.claim(f"k{i}")
        await store.complete(f"k{i}", c.token or "", _handle(rid=f"r{i}"), _last())
    assert await store.size() == 5


def test_memory_store_expires_handles_and_records_by_ttl() -> None:
    clock = FakeClock()
    evicted: list[tuple[str, int]] = []
    s = MemoryStore(capacity=10, entry_ttl=60, last_turn_ttl=300, lock_ttl=30, clock=clock,
                    on_evict=lambda reason, n: evicted.append((reason, n)))
    c = s.claim_now("k")
    s.complete_now("k", c.token or "", _handle(stored_at=clock.now), LastTurn(1, clock.now, True, "r"))
    clock.now += 61
    c2 = s.claim_now("k")
    assert c2.handle is None and c2.last is not None  # the record outlives the handle
    assert ("ttl", 1) in evicted
    s.release_now("k", c2.token or "", None)
    clock.now += 300
    assert s.claim_now("k").last is None


def test_memory_store_sweep_drops_expired_handles() -> None:
    clock = FakeClock()
    s = MemoryStore(capacity=100, entry_ttl=60, last_turn_ttl=300, lock_ttl=30, clock=clock)
    for i in range(10):
        c = s.claim_now(f"k{i}")
        s.complete_now(f"k{i}", c.token or "", _handle(stored_at=clock.now), LastTurn(1, clock.now, True, "r"))
        clock.now += 10
    assert s.sweep() == 5  # stored at t-100 .. t-10 with a 60 s TTL
    assert len(s) == 5


def test_memory_store_stale_lock_expires() -> None:
    clock = FakeClock()
    s = MemoryStore(capacity=10, entry_ttl=60, last_turn_ttl=300, lock_ttl=30, clock=clock)
    assert s.claim_now("k").acquired
    assert not s.claim_now("k").acquired
    clock.now += 31  # the owner died mid-turn
    assert s.claim_now("k").acquired


def test_one_million_conversation_ids_stay_within_the_bound() -> None:
    evictions = {"capacity": 0}

    def on_evict(reason: str, n: int) -> None:
        evictions[reason] = evictions.get(reason, 0) + n

    s = MemoryStore(capacity=10_000, entry_ttl=450, last_turn_ttl=3600, lock_ttl=300, on_evict=on_evict)
    h = _handle()
    last = _last()
    started = time.perf_counter()
    for i in range(1_000_000):
        key = f"{i:032x}"
        c = s.claim_now(key)
        s.complete_now(key, c.token or "", h, last)
    elapsed = time.perf_counter() - started
    assert len(s) == 10_000
    assert len(s._last) == 10_000 and not s._locks
    assert evictions["capacity"] == 990_000
    assert elapsed < 60, f"1M claims+completes took {elapsed:.1f}s"


async def test_redis_capacity_bound_evicts_oldest(redis_url: str) -> None:
    evicted: list[int] = []
    s = RedisStore(redis_url, capacity=3, entry_ttl=60, last_turn_ttl=600, lock_ttl=30,
                   prefix=f"cap{time.monotonic_ns()}:", on_evict=lambda _r, n: evicted.append(n))
    try:
        for i in range(5):
            c = await s.claim(f"k{i}")
            await s.complete(f"k{i}", c.token or "", _handle(rid=f"r{i}"), _last())
        assert await s.size() == 3 and sum(evicted) == 2
        assert (await s.claim("k0")).handle is None
        assert (await s.claim("k4")).handle is not None
    finally:
        await s.close()


async def test_redis_handles_expire_by_redis_ttl(redis_url: str) -> None:
    s = RedisStore(redis_url, capacity=10, entry_ttl=0.3, last_turn_ttl=60, lock_ttl=30,
                   prefix=f"ttl{time.monotonic_ns()}:")
    try:
        c = await s.claim("k")
        await s.complete("k", c.token or "", _handle(), _last())
        await asyncio.sleep(0.5)
        got = await s.claim("k")
        assert got.handle is None and got.last is not None and got.last.stored
        assert await s.size() == 0
    finally:
        await s.close()


async def test_redis_state_survives_a_new_client(redis_url: str) -> None:
    prefix = f"restart{time.monotonic_ns()}:"
    a = RedisStore(redis_url, capacity=10, entry_ttl=60, last_turn_ttl=600, lock_ttl=30, prefix=prefix)
    c = await a.claim("k")
    await a.complete("k", c.token or "", _handle(), _last())
    await a.close()
    b = RedisStore(redis_url, capacity=10, entry_ttl=60, last_turn_ttl=600, lock_ttl=30, prefix=prefix)
    try:
        assert (await b.claim("k")).handle is not None
    finally:
        await b.close()


async def test_unreachable_redis_raises_store_error_naming_the_url(tmp_path: Path) -> None:
    from router_support import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    s = RedisStore(url, capacity=10, entry_ttl=60, last_turn_ttl=600, lock_ttl=30, timeout=0.5)
    try:
        with pytest.raises(StoreError, match=url.split("//")[1].split("/", maxsplit=1)[0]):
            await s.claim("k")
    finally:
        await s.close()


def test_memory_store_entries_are_invisible_to_the_garbage_collector() -> None:
    import gc

    s = MemoryStore(capacity=100, entry_ttl=60, last_turn_ttl=600, lock_ttl=30)
    c = s.claim_now("k")
    s.complete_now("k", c.token or "", _handle(), _last())
    gc.collect()
    # Stored as tuples of atomics: a full collection never walks 100k stored handles (a ~200 ms pause).
    assert not gc.is_tracked(s._handles["k"]) and not gc.is_tracked(s._last["k"])


async def test_last_turn_remembers_a_handle_that_was_not_kept(store: Store) -> None:
    first = await store.claim("nk")
    last = LastTurn(turn=1, ended_at=time.time(), stored=False, request_id="r1", not_kept="unsupported request shape")
    await store.complete("nk", first.token or "", None, last)
    again = await store.claim("nk")
    assert again.last == last


def test_handle_format_is_versioned_and_bounded() -> None:
    import json

    h = _handle()
    assert Handle.from_json(h.to_json()) == h
    # A handle stored by an older router (v1: a prompt digest, no coverage) is read, never trusted.
    v1 = json.dumps({"params": h.params, "stored_at": 1.0, "turn": 2, "request_id": "r",
                     "prefix": {"kind": "messages", "length": 3, "digest": "ab" * 32}})
    old = Handle.from_json(v1)
    assert old.coverage is None and old.params == h.params and old.turn == 2
    obj = json.loads(h.to_json())
    obj["coverage"][1] = [[i, "ab", 1] for i in range(100)]  # more rungs than a router ever keeps
    with pytest.raises(StoreError, match="corrupt handle"):
        Handle.from_json(json.dumps(obj))
    obj = json.loads(h.to_json())
    obj["coverage"][5][2] = "A" * 4000  # a token trace beyond the bound (2 KiB)
    with pytest.raises(StoreError, match="corrupt handle"):
        Handle.from_json(json.dumps(obj))
