"""The conversation store: single-use decode handles, in-flight claims and last-turn records.

Per conversation key (see :func:`kvdiag.router.security.store_key`) the store keeps

* the **handle**: D's ``kv_transfer_params`` from the last completed turn, with its prompt digest.
  It lives ``entry_ttl`` seconds and is taken out by exactly one :meth:`Store.claim`;
* the **in-flight claim**: a token held while a turn runs. A second turn arriving meanwhile gets no
  handle (it is a concurrent turn) and the first turn's handle is never read twice;
* the **last-turn record**: how the previous turn ended (params stored or why not), kept longer
  than the handle so the next turn can tell expiry, missing metadata and lost state apart.

Implementations: :class:`MemoryStore` (bounded LRU + TTL, one process) and
:class:`RedisStore` (Redis expiry, Lua scripts for atomic claim/complete/release), which several
router replicas share and which survives a router restart; for Redis Cluster and Valkey Cluster,
:class:`kvdiag.router.store_cluster.ClusterStore` (hash-tagged keys, bounded per bucket).
"""

from __future__ import annotations

import base64
import itertools
import json
import marshal
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import redis.asyncio as redis_asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from kvdiag.router.reuse_rule import (
    CHAT,
    COMPLETION,
    MAX_CHECKPOINTS,
    MAX_RUNGS,
    Coverage,
    ReplyRecord,
    Rung,
    TokenTrace,
)
from kvdiag.schema.errors import KVDiagError

EvictionCallback = Callable[[str, int], None]  # (reason "capacity" | "ttl", count)
# v1 (no "v"): params and a prompt digest only, read as a handle without coverage (never injected);
# v2: coverage without rung flags and last query; v3: with them. An older router reads v3 as unknown.
HANDLE_FORMAT: Final = 3
_READABLE_FORMATS: Final = (2, 3)
MAX_TRACE_BYTES: Final = MAX_CHECKPOINTS * 8


class StoreError(KVDiagError, RuntimeError):
    """The store could not be reached or answered nonsense; the turn goes on without reuse."""


@dataclass(frozen=True)
class Handle:
    """D's kv_transfer_params for a conversation's next turn, and what they are known to cover."""

    params: dict[str, Any]
    stored_at: float  # epoch seconds when the turn that produced it finished
    turn: int
    request_id: str
    coverage: Coverage | None = None  # None: never injected (an older router's handle, or unknown shape)

    def to_json(self) -> str:
        """Serialized form (ints stay ints, floats stay floats)."""
        return json.dumps({"v": HANDLE_FORMAT, "params": self.params, "stored_at": self.stored_at, "turn": self.turn,
                           "request_id": self.request_id, "coverage": coverage_to_obj(self.coverage)},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Handle:
        """Parse a stored handle; raise StoreError when it is not one."""
        try:
            obj = json.loads(raw)
            coverage = coverage_from_obj(obj.get("coverage")) if obj.get("v") in _READABLE_FORMATS else None
            return cls(params=dict(obj["params"]), stored_at=float(obj["stored_at"]), turn=int(obj["turn"]),
                       request_id=str(obj["request_id"]), coverage=coverage)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StoreError(f"corrupt handle in the store: {exc}") from None


def coverage_to_obj(c: Coverage | None) -> Any:
    """The coverage as JSON-compatible builtins (also what the memory store marshals)."""
    if c is None:
        return None
    r = c.reply
    # str(): plain strings (the enum members' values), which marshal and JSON both take.
    reply = None if r is None else [r.content_sha256, r.content_bytes, sorted(map(str, r.parts)),
                                    sorted(map(str, r.options)),
                                    r.finish_reason, r.stop_reason, r.stop_reason_seen, r.completion_tokens, r.choices]
    tokens = None if c.tokens is None else [c.tokens.step, c.tokens.count,
                                            base64.b64encode(c.tokens.checkpoints).decode()]
    return [c.kind, [[g.length, g.digest, g.tokens, int(g.exact) | int(g.query) << 1] for g in c.rungs], reply,
            list(c.continuation) if c.continuation else None, c.block_size, tokens, c.last_query]


def coverage_from_obj(obj: Any) -> Coverage | None:
    """Inverse of :func:`coverage_to_obj`; raises ValueError/TypeError/KeyError on anything else."""
    if obj is None:
        return None
    kind, rungs, reply, cont, block_size, tokens, *rest = obj
    if kind not in (CHAT, COMPLETION) or not isinstance(rungs, list) or len(rungs) > MAX_RUNGS or len(rest) > 1:
        raise ValueError("coverage has an unknown kind or too many rungs")
    ladder = tuple(_rung(*r) for r in rungs)
    last_query = rest[0] if rest else None
    record = None
    if reply is not None:
        sha, size, parts, options, finish, stop, stop_seen, completion, choices = reply
        record = ReplyRecord(None if sha is None else str(sha), _int(size), frozenset(map(str, parts)),
                             frozenset(map(str, options)), finish, stop, bool(stop_seen),
                             None if completion is None else _int(completion), _int(choices))
    trace = None
    if tokens is not None:
        step, count, raw = tokens
        data = base64.b64decode(raw) if isinstance(raw, str) else bytes(raw)
        if len(data) > MAX_TRACE_BYTES or len(data) % 8:
            raise ValueError("token trace too long or not whole checkpoints")
        trace = TokenTrace(_int(step), _int(count), data)
    return Coverage(kind, ladder, record, (_int(cont[0]), str(cont[1])) if cont else None,
                    None if block_size is None else _int(block_size), trace,
                    None if last_query is None else _int(last_query))


def _rung(length: Any, digest: Any, tokens: Any, flags: Any = 0) -> Rung:
    # Format 2 stored three fields; format 3 adds the flags (1: exact, 2: query).
    bits = _int(flags)
    return Rung(_int(length), str(digest), None if tokens is None else _int(tokens), bool(bits & 1), bool(bits & 2))


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class LastTurn:
    """How a conversation's most recent completed turn ended."""

    turn: int
    ended_at: float  # epoch seconds
    stored: bool  # a handle was stored for the next turn
    request_id: str
    missing_reason: str | None = None  # why D's params did not arrive (when not stored)
    not_kept: str | None = None  # why the router did not keep D's params it received (request shape)
    # Placement (router/placement.py): the "host:port" of the P and D that served the turn.
    prefill: str | None = None
    decode: str | None = None

    def to_json(self) -> str:
        """Serialized form (an older router ignores the placement keys)."""
        obj = {"turn": self.turn, "ended_at": self.ended_at, "stored": self.stored, "request_id": self.request_id,
               "missing_reason": self.missing_reason, "not_kept": self.not_kept}
        if self.prefill is not None or self.decode is not None:
            obj.update(prefill=self.prefill, decode=self.decode)
        return json.dumps(obj, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> LastTurn:
        """Parse a stored record; raise StoreError when it is not one."""
        try:
            obj = json.loads(raw)
            return cls(turn=int(obj["turn"]), ended_at=float(obj["ended_at"]), stored=bool(obj["stored"]),
                       request_id=str(obj["request_id"]), missing_reason=obj.get("missing_reason"),
                       not_kept=obj.get("not_kept"), prefill=_address(obj.get("prefill")),
                       decode=_address(obj.get("decode")))
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"corrupt last-turn record in the store: {exc}") from None


def _address(value: Any) -> str | None:
    return value if isinstance(value, str) and len(value) <= 300 else None


@dataclass(frozen=True)
class Claim:
    """The result of claiming a conversation for one turn."""

    token: str | None  # None: another turn holds the conversation (concurrent turn)
    handle: Handle | None
    last: LastTurn | None

    @property
    def acquired(self) -> bool:
        """True when this turn owns the conversation until complete/release."""
        return self.token is not None


class Store(Protocol):
    """What the router needs from a conversation store. Every method is safe to call concurrently."""

    capacity: int

    async def claim(self, key: str) -> Claim:
        """Take the conversation for one turn: the handle (single use) and the last-turn record."""
        ...

    async def complete(self, key: str, token: str, handle: Handle | None, last: LastTurn) -> bool:
        """End the turn: store the new handle (if any) and the record; False if the claim was lost."""
        ...

    async def release(self, key: str, token: str, handle: Handle | None) -> None:
        """End the turn without a result; give ``handle`` back (P never read it) if it is still valid."""
        ...

    async def size(self) -> int:
        """Handles currently held (expired ones swept first)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


def _new_token() -> str:
    return uuid.uuid4().hex


def _pack_handle(handle: Handle) -> bytes:
    # marshal: the fastest exact round trip of JSON-like builtins (ints stay ints); in-process data only.
    coverage = handle.coverage
    packed = None
    if coverage is not None:
        obj = coverage_to_obj(coverage)
        if coverage.tokens is not None:
            obj[5] = [coverage.tokens.step, coverage.tokens.count, coverage.tokens.checkpoints]
        packed = obj
    return marshal.dumps((handle.params, handle.turn, handle.request_id, packed))


def _unpack_handle(stored_at: float, packed: bytes) -> Handle:
    params, turn, request_id, coverage = marshal.loads(packed)
    return Handle(params=params, stored_at=stored_at, turn=turn, request_id=request_id,
                  coverage=coverage_from_obj(coverage))


class MemoryStore:
    """In-process store: at most ``capacity`` handles (LRU), each living ``entry_ttl`` seconds.

    Last-turn records are bounded by the same capacity and live ``last_turn_ttl`` seconds. A lost
    process loses everything (``router_state_lost`` on the next turn); use Redis to avoid that.
    """

    def __init__(self, *, capacity: int, entry_ttl: float, last_turn_ttl: float, lock_ttl: float,
                 on_evict: EvictionCallback | None = None, clock: Callable[[], float] = time.time) -> None:
        self.capacity = capacity
        self.entry_ttl = entry_ttl
        self.last_turn_ttl = last_turn_ttl
        self.lock_ttl = lock_ttl
        self._on_evict = on_evict
        self._clock = clock
        # Entries are kept as (timestamp, JSON) tuples of atomics, which the cyclic garbage collector
        # does not track: 100k stored objects would make every full collection a ~200 ms pause.
        self._handles: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._last: OrderedDict[str, tuple[float, int, bool, str, str | None, str | None, str | None,
                                          str | None]] = OrderedDict()
        self._locks: dict[str, tuple[str, float]] = {}
        # Claim tokens only need to be unique within this process (uuid4 would double a claim's cost).
        self._tokens = itertools.count(1)

    def _evicted(self, reason: str, n: int) -> None:
        if n and self._on_evict is not None:
            self._on_evict(reason, n)

    def _expired(self, stored_at: float, now: float) -> bool:
        return now - stored_at >= self.entry_ttl

    def claim_now(self, key: str) -> Claim:
        """Synchronous :meth:`claim` (the memory store never waits)."""
        now = self._clock()
        last = None
        raw_last = self._last.get(key)
        if raw_last is not None:
            ended_at, turn, stored, request_id, reason, not_kept, p_at, d_at = raw_last
            if now - ended_at >= self.last_turn_ttl:
                del self._last[key]
            else:
                last = LastTurn(turn, ended_at, stored, request_id, reason, not_kept, p_at, d_at)
        held = self._locks.get(key)
        if held is not None and held[1] > now:
            return Claim(None, None, last)
        token = f"m{next(self._tokens)}"
        self._locks[key] = (token, now + self.lock_ttl)
        handle = None
        raw = self._handles.pop(key, None)
        if raw is not None:
            if self._expired(raw[0], now):
                self._evicted("ttl", 1)
            else:
                handle = _unpack_handle(raw[0], raw[1])
        return Claim(token, handle, last)

    def complete_now(self, key: str, token: str, handle: Handle | None, last: LastTurn) -> bool:
        """Synchronous :meth:`complete`."""
        held = self._locks.get(key)
        now = self._clock()
        if held is not None and held[0] != token and held[1] > now:
            return False  # another turn owns the conversation now; keep its state
        self._locks.pop(key, None)
        if handle is not None:
            self.put_handle(key, handle)
        self._last[key] = (last.ended_at, last.turn, last.stored, last.request_id, last.missing_reason, last.not_kept,
                           last.prefill, last.decode)
        self._last.move_to_end(key)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)
        return True

    def put_handle(self, key: str, handle: Handle) -> None:
        """Store ``handle`` for ``key``, evicting the least recently stored handle beyond capacity."""
        try:
            packed = _pack_handle(handle)
        except ValueError as exc:  # params that are not JSON-like builtins
            raise StoreError(f"cannot store the handle: {exc}") from None
        self._handles[key] = (handle.stored_at, packed)
        self._handles.move_to_end(key)
        if len(self._handles) > self.capacity:
            self._handles.popitem(last=False)
            self._evicted("capacity", 1)

    def release_now(self, key: str, token: str, handle: Handle | None) -> None:
        """Synchronous :meth:`release`."""
        held = self._locks.get(key)
        if held is None or held[0] != token:
            return
        del self._locks[key]
        if handle is not None and key not in self._handles and not self._expired(handle.stored_at, self._clock()):
            self.put_handle(key, handle)

    def sweep(self) -> int:
        """Drop expired handles, records and stale claims; return how many handles expired."""
        now = self._clock()
        expired = 0
        # Handles are stored in completion order and share one TTL, so expired ones sit at the front.
        while self._handles:
            key, (stored_at, _) = next(iter(self._handles.items()))
            if not self._expired(stored_at, now):
                break
            del self._handles[key]
            expired += 1
        while self._last:
            key, record = next(iter(self._last.items()))
            if now - record[0] < self.last_turn_ttl:
                break
            del self._last[key]
        for key in [k for k, (_, until) in self._locks.items() if until <= now]:
            del self._locks[key]
        self._evicted("ttl", expired)
        return expired

    def __len__(self) -> int:
        return len(self._handles)

    async def claim(self, key: str) -> Claim:
        """Take the conversation for one turn (see :class:`Store`)."""
        return self.claim_now(key)

    async def complete(self, key: str, token: str, handle: Handle | None, last: LastTurn) -> bool:
        """End the turn (see :class:`Store`)."""
        return self.complete_now(key, token, handle, last)

    async def release(self, key: str, token: str, handle: Handle | None) -> None:
        """End the turn without a result (see :class:`Store`)."""
        self.release_now(key, token, handle)

    async def size(self) -> int:
        """Handles held after sweeping expired ones."""
        self.sweep()
        return len(self._handles)

    async def close(self) -> None:
        """Nothing to release."""


# --- Redis --------------------------------------------------------------------------------------
# Keys: {prefix}h:<key> handle, {prefix}l:<key> in-flight claim, {prefix}t:<key> last turn,
# {prefix}idx sorted set of handle keys scored by expiry (ms) for the capacity bound and size().

# Claim a turn and take its handle in one step (KEYS: handle, claim, last-turn record, index); the
# cluster store runs the same script, its keys hash-tagged into one slot.
CLAIM_LUA = """
local last = redis.call('GET', KEYS[3]) or ''
if not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {0, '', last}
end
local h = redis.call('GET', KEYS[1])
if h then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[4], KEYS[1])
else
  h = ''
end
return {1, h, last}
"""

_COMPLETE_LUA = """
local owner = redis.call('GET', KEYS[2])
if owner and owner ~= ARGV[1] then
  return {0, 0}
end
if owner then redis.call('DEL', KEYS[2]) end
local evicted = 0
if ARGV[2] ~= '' then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  redis.call('ZADD', KEYS[4], tonumber(ARGV[7]) + tonumber(ARGV[3]), KEYS[1])
  local n = redis.call('ZCARD', KEYS[4])
  local max = tonumber(ARGV[6])
  if n > max then
    local victims = redis.call('ZPOPMIN', KEYS[4], n - max)
    for i = 1, #victims, 2 do
      redis.call('DEL', victims[i])
      evicted = evicted + 1
    end
  end
end
redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[5])
return {1, evicted}
"""

# Give back a claim the turn still holds, with the handle it took (unless a newer one is stored by then)
# (KEYS: handle, claim, last-turn record, index); the cluster store runs the same script.
RELEASE_LUA = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[2])
if ARGV[2] ~= '' and tonumber(ARGV[3]) > 0 then
  if redis.call('SET', KEYS[1], ARGV[2], 'NX', 'PX', ARGV[3]) then
    redis.call('ZADD', KEYS[4], tonumber(ARGV[4]) + tonumber(ARGV[3]), KEYS[1])
  end
end
return 1
"""

_SIZE_LUA = """
local gone = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
return {gone, redis.call('ZCARD', KEYS[1])}
"""


def _ms(seconds: float) -> int:
    return max(int(seconds * 1000), 1)


class RedisStore:
    """Redis-backed store shared by router replicas; Redis expiry is the TTL, Lua makes each step atomic."""

    def __init__(self, url: str, *, capacity: int, entry_ttl: float, last_turn_ttl: float, lock_ttl: float,
                 prefix: str = "kvdiag:router:", on_evict: EvictionCallback | None = None,
                 timeout: float = 2.0) -> None:
        self.url = url
        self.capacity = capacity
        self.entry_ttl = entry_ttl
        self.last_turn_ttl = last_turn_ttl
        self.lock_ttl = lock_ttl
        self.prefix = prefix
        self._on_evict = on_evict
        # A restarted server leaves every pooled connection stale: retry once on a connection error (the old
        # server never ran the command), never on a timeout (the script may have run).
        self._client: Any = redis_asyncio.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, health_check_interval=30,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        self._claim = self._client.register_script(CLAIM_LUA)
        self._complete = self._client.register_script(_COMPLETE_LUA)
        self._release = self._client.register_script(RELEASE_LUA)
        self._size = self._client.register_script(_SIZE_LUA)

    def _keys(self, key: str) -> list[str]:
        p = self.prefix
        return [f"{p}h:{key}", f"{p}l:{key}", f"{p}t:{key}", f"{p}idx"]

    def _evicted(self, reason: str, n: int) -> None:
        if n and self._on_evict is not None:
            self._on_evict(reason, n)

    async def _run(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            return await script(keys=keys, args=args)
        except Exception as exc:  # redis raises many types (connection, timeout, response)
            raise StoreError(f"redis store {self.url}: {type(exc).__name__}: {exc}") from exc

    async def ping(self) -> None:
        """Check the connection; raise StoreError with the URL when Redis is unreachable or a cluster node."""
        try:
            await self._client.ping()
        except Exception as exc:
            raise StoreError(f"cannot reach redis at {self.url}: {exc}") from exc
        try:
            info = await self._client.info("cluster")
        except Exception:  # a server or proxy that hides INFO: nothing to check
            return
        if isinstance(info, dict) and str(info.get("cluster_enabled")) == "1":
            # This layout's scripts touch a global index key, which a cluster cannot serve from one slot.
            raise StoreError(f"redis at {self.url} is a cluster node: use --state redis+cluster://host:port")

    async def claim(self, key: str) -> Claim:
        """Take the conversation for one turn (atomic: lock, GETDEL handle, read record)."""
        token = _new_token()
        ok, raw_handle, raw_last = await self._run(self._claim, self._keys(key), [token, _ms(self.lock_ttl)])
        last = LastTurn.from_json(raw_last) if raw_last else None
        if not int(ok):
            return Claim(None, None, last)
        handle = Handle.from_json(raw_handle) if raw_handle else None
        return Claim(token, handle, last)

    async def complete(self, key: str, token: str, handle: Handle | None, last: LastTurn) -> bool:
        """End the turn: store the handle with Redis expiry, bound the index, write the record."""
        now_ms = int(time.time() * 1000)
        ttl_ms = _ms(self.entry_ttl - max(time.time() - handle.stored_at, 0.0)) if handle else 0
        ok, evicted = await self._run(self._complete, self._keys(key), [
            token, handle.to_json() if handle else "", ttl_ms, last.to_json(), _ms(self.last_turn_ttl),
            self.capacity, now_ms])
        self._evicted("capacity", int(evicted))
        return bool(int(ok))

    async def release(self, key: str, token: str, handle: Handle | None) -> None:
        """Give ``handle`` back with its remaining TTL (if any) and drop the claim."""
        remaining = self.entry_ttl - (time.time() - handle.stored_at) if handle else 0.0
        await self._run(self._release, self._keys(key), [
            token, handle.to_json() if handle and remaining > 0 else "", int(remaining * 1000),
            int(time.time() * 1000)])

    async def size(self) -> int:
        """Handles held; index entries whose handle expired are dropped and counted as TTL evictions."""
        gone, card = await self._run(self._size, [f"{self.prefix}idx"], [int(time.time() * 1000)])
        self._evicted("ttl", int(gone))
        return int(card)

    async def close(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()
