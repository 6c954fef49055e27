"""The conversation store on Redis Cluster or Valkey Cluster (or one server), with hash-tagged keys.

Every conversation key falls into one of :data:`BUCKETS` buckets. A bucket's keys share a hash tag,
so the handle, the in-flight claim, the last-turn record and the bucket's bounded index sit in one
cluster slot and each step (claim, complete, release) is one Lua script on one node::

    kvdiag:router:{<tag>}:h:<key>    handle (PX = what is left of the entry TTL)
    kvdiag:router:{<tag>}:l:<key>    in-flight claim (PX = lock TTL)
    kvdiag:router:{<tag>}:t:<key>    last-turn record (PX = last-turn TTL)
    kvdiag:router:{<tag>}:idx        sorted set of the bucket's handle keys, scored by expiry (ms)

The 256 tags are chosen so that bucket ``i`` hashes into slots ``[64 i, 64 i + 64)``: buckets spread
evenly over the masters whatever the slot ranges, and move with their slots on a reshard. There is
no global key: the capacity bound is per bucket (``ceil(capacity / 256)`` handles each, oldest
expiry evicted first), so the store never holds more than ``256 * ceil(capacity / 256)`` handles.
The bucket count is part of the key layout (never derived from options), so replicas configured
with different bounds still find each other's handles.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable
from typing import Any, Final, cast
from urllib.parse import unquote

import redis.asyncio as redis_asyncio
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError

from kvdiag.router.store import CLAIM_LUA, RELEASE_LUA, Claim, EvictionCallback, Handle, LastTurn, StoreError

BUCKETS: Final = 256
SLOTS: Final = 16384
# A store that failed this many calls in a row is skipped (claims fail at once, without reuse) and
# probed by one claim every BREAKER_PROBE_S seconds; completes and releases are always attempted.
BREAKER_ERRORS: Final = 5
BREAKER_PROBE_S: Final = 0.5
CLUSTER_SCHEMES: Final = ("redis+cluster://", "rediss+cluster://")

# Victims popped from the index are keys of the same bucket, so of the same slot. An index entry
# whose handle already expired is dropped without counting as a capacity eviction.
_COMPLETE_LUA = """
local owner = redis.call('GET', KEYS[2])
if owner and owner ~= ARGV[1] then
  return {0, 0, 0}
end
if owner then redis.call('DEL', KEYS[2]) end
local evicted, expired = 0, 0
if ARGV[2] ~= '' then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  redis.call('ZADD', KEYS[4], tonumber(ARGV[7]) + tonumber(ARGV[3]), KEYS[1])
  local n = redis.call('ZCARD', KEYS[4])
  local max = tonumber(ARGV[6])
  if n > max then
    local victims = redis.call('ZPOPMIN', KEYS[4], n - max)
    for i = 1, #victims, 2 do
      if redis.call('DEL', victims[i]) == 1 then evicted = evicted + 1 else expired = expired + 1 end
    end
  end
end
redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[5])
return {1, evicted, expired}
"""


@functools.cache
def bucket_tags() -> tuple[str, ...]:
    """Tag ``i`` hashes (CRC16, as cluster slots do) into slots ``[64 i, 64 i + 64)``."""
    width = SLOTS // BUCKETS
    tags: list[str | None] = [None] * BUCKETS
    missing = BUCKETS
    n = 0
    while missing:
        candidate = f"b{n:x}"
        slot = key_slot(candidate.encode())
        i = slot // width
        if tags[i] is None:
            tags[i] = candidate
            missing -= 1
        n += 1
    return tuple(t for t in tags if t is not None)


def bucket_of(key: str) -> int:
    """The bucket a conversation key falls into (stable across processes and versions)."""
    return zlib.crc32(key.encode()) % BUCKETS


def parse_cluster_url(url: str) -> dict[str, Any]:
    """``redis+cluster://[user:password@]host:port[,host:port...][/0]`` as RedisCluster arguments."""
    scheme, sep, rest = url.partition("://")
    if not sep or f"{scheme}://" not in CLUSTER_SCHEMES:
        raise StoreError(f"{url!r} is not a cluster URL: use redis+cluster://host:port[,host:port...]")
    kwargs: dict[str, Any] = {"ssl": scheme == "rediss+cluster"}
    rest = rest.split("/", 1)[0].split("?", 1)[0]
    userinfo, at, hosts = rest.rpartition("@")
    if at:
        user, colon, password = userinfo.partition(":")
        if user:
            kwargs["username"] = unquote(user)
        if colon:
            kwargs["password"] = unquote(password)
    nodes = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon or not port.isdigit() or not host:
            raise StoreError(f"{url!r}: {item!r} is not host:port (redis+cluster://host:port[,host:port...])")
        nodes.append(ClusterNode(host.strip("[]"), int(port)))
    kwargs["startup_nodes"] = nodes
    return kwargs


def redacted(url: str) -> str:
    """The URL without its password (for errors and logs)."""
    scheme, sep, rest = url.partition("://")
    _, at, hosts = rest.rpartition("@")
    return f"{scheme}{sep}{hosts}" if at else url


def _ms(seconds: float) -> int:
    return max(int(seconds * 1000), 1)


class ClusterStore:
    """Conversation store for Redis Cluster / Valkey Cluster: hash-tagged keys, per-bucket bounds.

    ``url`` is a cluster URL (:data:`CLUSTER_SCHEMES`); any other Redis URL uses one server with the
    same layout (the tests run both). Each call gives up after ``timeout`` seconds with
    :class:`StoreError`, so a node that is down costs a turn its reuse, never its answer; after
    :data:`BREAKER_ERRORS` failures in a row, claims fail at once until a probe succeeds (a client
    that meets a cluster that is down closes its connections and waits a quarter second per call).
    """

    def __init__(self, url: str, *, capacity: int, entry_ttl: float, last_turn_ttl: float, lock_ttl: float,
                 prefix: str = "kvdiag:router:", on_evict: EvictionCallback | None = None,
                 timeout: float = 2.0) -> None:
        self.url = url
        self.capacity = capacity
        self.bucket_capacity = max(math.ceil(capacity / BUCKETS), 1)
        self.entry_ttl = entry_ttl
        self.last_turn_ttl = last_turn_ttl
        self.lock_ttl = lock_ttl
        self.prefix = prefix
        self.timeout = timeout
        self.cluster = url.startswith(CLUSTER_SCHEMES)
        self._on_evict = on_evict
        self._failures = 0  # calls failed in a row
        self._last_error = ""
        self._probe_at = 0.0  # monotonic time of the next probe while the breaker is open
        self._ready = not self.cluster  # a cluster client learns the slot map once, before the first call
        self._init_lock = asyncio.Lock()
        self._tags = tuple(f"{prefix}{{{tag}}}:" for tag in bucket_tags())
        self._client: Any
        if self.cluster:
            # One attempt per call (a retried claim would run twice): the next turn tries again.
            self._client = RedisCluster(**parse_cluster_url(url), socket_timeout=timeout,
                                        socket_connect_timeout=timeout,
                                        retry=cast(Any, Retry(NoBackoff(), 0)))  # the stubs name the sync class
        else:
            # Stale pooled connections after a restart: one retry on a connection error, none on a timeout.
            self._client = redis_asyncio.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                                  health_check_interval=30,
                                                  retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        self._claim = self._client.register_script(CLAIM_LUA)
        self._complete = self._client.register_script(_COMPLETE_LUA)
        self._release = self._client.register_script(RELEASE_LUA)

    def keys(self, key: str) -> list[str]:
        """The handle, claim, record and index keys of conversation ``key`` (one slot)."""
        base = self._tags[bucket_of(key)]
        return [f"{base}h:{key}", f"{base}l:{key}", f"{base}t:{key}", f"{base}idx"]

    def index_keys(self) -> list[str]:
        """The bounded index of every bucket."""
        return [f"{base}idx" for base in self._tags]

    def _evicted(self, reason: str, n: int) -> None:
        if n and self._on_evict is not None:
            self._on_evict(reason, n)

    def _skip(self) -> bool:
        """True while the breaker is open and this call is not the probe."""
        if self._failures < BREAKER_ERRORS:
            return False
        now = time.monotonic()
        if now < self._probe_at:
            return True
        self._probe_at = now + BREAKER_PROBE_S  # this call is the probe
        return False

    async def _call(self, call: Callable[[], Awaitable[Any]], *, guarded: bool = False) -> Any:
        if guarded and self._skip():
            raise StoreError(f"redis store {redacted(self.url)} skipped after {self._failures} failed calls in a "
                             f"row (last: {self._last_error})")
        try:
            if not self._ready:
                await asyncio.wait_for(self._initialize(), self.timeout)
            result = await asyncio.wait_for(call(), self.timeout)
        except TimeoutError:
            self._failed(f"no answer within {self.timeout:g}s")
            raise StoreError(f"redis store {redacted(self.url)}: no answer within {self.timeout:g}s") from None
        except Exception as exc:  # redis raises many types (connection, cluster down, moved, response)
            self._failed(f"{type(exc).__name__}: {exc}"[:200])
            raise StoreError(f"redis store {redacted(self.url)}: {type(exc).__name__}: {exc}") from exc
        self._failures = 0
        return result

    async def _initialize(self) -> None:
        # Concurrent first calls on a client that has not mapped the slots yet close each other's
        # connections: map them once, under a lock.
        async with self._init_lock:
            if not self._ready:
                await self._client.initialize()
                self._ready = True

    def _failed(self, error: str) -> None:
        self._failures += 1
        self._last_error = error
        if self._failures == BREAKER_ERRORS:
            self._probe_at = time.monotonic() + BREAKER_PROBE_S

    async def ping(self) -> None:
        """Check every node (cluster) or the server; raise StoreError naming the URL and the fix."""
        try:
            await self._call(self._client.ping)
        except StoreError as exc:
            hint = ("is it a cluster? (use redis:// for one server)" if self.cluster
                    else "use redis+cluster:// for a cluster")
            raise StoreError(f"cannot use the store at {redacted(self.url)}: {exc.__cause__ or exc}; {hint}") \
                from None

    async def claim(self, key: str) -> Claim:
        """Take the conversation for one turn (atomic on its node: lock, take the handle, read the record)."""
        token = uuid.uuid4().hex
        ok, raw_handle, raw_last = await self._call(
            lambda: self._claim(keys=self.keys(key), args=[token, _ms(self.lock_ttl)]), guarded=True)
        last = LastTurn.from_json(raw_last) if raw_last else None
        if not int(ok):
            return Claim(None, None, last)
        return Claim(token, Handle.from_json(raw_handle) if raw_handle else None, last)

    async def complete(self, key: str, token: str, handle: Handle | None, last: LastTurn) -> bool:
        """End the turn: store the handle with its expiry, bound the bucket, write the record."""
        now = time.time()
        ttl_ms = _ms(self.entry_ttl - max(now - handle.stored_at, 0.0)) if handle else 0
        ok, evicted, expired = await self._call(lambda: self._complete(keys=self.keys(key), args=[
            token, handle.to_json() if handle else "", ttl_ms, last.to_json(), _ms(self.last_turn_ttl),
            self.bucket_capacity, int(now * 1000)]))
        self._evicted("capacity", int(evicted))
        self._evicted("ttl", int(expired))
        return bool(int(ok))

    async def release(self, key: str, token: str, handle: Handle | None) -> None:
        """Give ``handle`` back with its remaining TTL (if any) and drop the claim."""
        now = time.time()
        remaining = self.entry_ttl - (now - handle.stored_at) if handle else 0.0
        await self._call(lambda: self._release(keys=self.keys(key), args=[
            token, handle.to_json() if handle and remaining > 0 else "", int(remaining * 1000), int(now * 1000)]))

    async def size(self) -> int:
        """Handles held over all buckets; index entries of expired handles are dropped (TTL evictions)."""
        now_ms = int(time.time() * 1000)
        pipe = self._client.pipeline(transaction=False)
        for name in self.index_keys():
            pipe.zremrangebyscore(name, "-inf", now_ms)
            pipe.zcard(name)
        replies = await self._call(pipe.execute, guarded=True)
        self._evicted("ttl", sum(int(r) for r in replies[0::2]))
        return sum(int(r) for r in replies[1::2])

    async def close(self) -> None:
        """Close the connection pools."""
        try:
            await self._client.aclose()
        except Exception:  # closing a client whose nodes are gone must not fail shutdown
            return
