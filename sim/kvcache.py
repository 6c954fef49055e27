"""KV blocks for one emulated engine: a fixed pool, chained block hashes, an LRU prefix cache, holds.

A block holds ``block_size`` tokens. Full blocks are identified by a chained hash (each block's
hash covers the previous block's hash and its own token ids), so equal hashes mean equal prefixes,
as in vLLM's prefix caching. Blocks are reference counted; a block whose count drops to zero stays
in the prefix cache (evictable, least recently used first) until the pool needs it.

Each block also records the token ids its KV was computed for (what a real block's K/V tensors
encode), so a reader can tell whether the KV it loaded belongs to its own prompt: the sim's
oracle for wrongly loaded KV. A freed block keeps its contents until it is written again, as GPU
memory does, so a stale read returns whatever the memory holds.

A *hold* keeps a finished request's blocks alive for a reader: D holds them for
``decoder_kv_blocks_ttl`` (bidirectional), P for ``kv_lease_duration`` (P->D). Holds are bounded
by the pool itself: when the pool is exhausted the oldest hold is released ("memory pressure").
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

NONE_HASH = b"kvdiag-sim-root"


class OutOfBlocks(RuntimeError):
    """The pool has no free or evictable block left."""


def chain_hashes(tokens: Sequence[int], block_size: int) -> list[str]:
    """Chained hashes (hex) of every *full* block of ``tokens``."""
    out: list[str] = []
    prev = NONE_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(array("q", tokens[start:start + block_size]).tobytes())
        prev = h.digest()
        out.append(h.hexdigest())
    return out


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed for ``num_tokens`` tokens."""
    return -(-num_tokens // block_size) if num_tokens > 0 else 0


@dataclass
class Hold:
    """A finished request's blocks kept for a remote reader until ``deadline`` (perf_counter)."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    deadline: float
    ttl_s: float
    hashes: list[str]
    kind: str  # "ttl" (D, bidirectional) or "lease" (P, P->D)
    reads: int = 0
    created: float = 0.0
    attrs: dict[str, str] = field(default_factory=dict)


class BlockPool:
    """A pool of ``num_blocks`` blocks (ids 1..num_blocks; 0 is vLLM's null block) with a prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._reset()

    def _reset(self) -> None:
        self._free: list[int] = list(range(self.num_blocks, 0, -1))
        self._ref: dict[int, int] = {}
        self._hash_of: dict[int, str] = {}
        self._by_hash: dict[str, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._content: dict[int, tuple[int, ...]] = {}
        self.holds: OrderedDict[str, Hold] = OrderedDict()

    # --- accounting -------------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        """Blocks referenced by running requests or holds (cached-but-free blocks do not count)."""
        return len(self._ref)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use (vllm:kv_cache_usage_perc)."""
        return self.used_blocks / self.num_blocks

    # --- prefix cache -----------------------------------------------------------------------
    def match(self, hashes: Sequence[str]) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes``; touches them (most recently used)."""
        if not self.prefix_caching:
            return []
        out: list[int] = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            out.append(block)
            if block in self._evictable:
                self._evictable.move_to_end(block)
        return out

    def commit(self, block_ids: Sequence[int], hashes: Sequence[str]) -> None:
        """Register the full blocks ``block_ids[i]`` under ``hashes[i]`` in the prefix cache."""
        if not self.prefix_caching:
            return
        for block, h in zip(block_ids, hashes, strict=False):
            if h in self._by_hash or block in self._hash_of:
                continue
            self._by_hash[h] = block
            self._hash_of[block] = h

    # --- contents ---------------------------------------------------------------------------
    def write(self, block_ids: Sequence[int], tokens: Sequence[int], first_block: int = 0) -> None:
        """Record that ``block_ids[i]`` holds the KV of ``tokens`` block ``first_block + i``."""
        bs = self.block_size
        for i, block in enumerate(block_ids):
            start = (first_block + i) * bs
            chunk = tuple(tokens[start:start + bs])
            if not chunk:
                break
            self._content[block] = chunk

    def content(self, block_id: int) -> tuple[int, ...]:
        """The token ids block ``block_id``'s KV was last computed for (empty: never written)."""
        return self._content.get(block_id, ())

    def clear(self) -> None:
        """Forget every block, hold and cached prefix (engine restart)."""
        self._reset()

    # --- reference counting -----------------------------------------------------------------
    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take a reference on existing blocks (prefix hits)."""
        for b in block_ids:
            self._ref[b] = self._ref.get(b, 0) + 1
            self._evictable.pop(b, None)

    def allocate(self, n: int) -> list[int]:
        """``n`` new blocks (reference 1), evicting least recently used cached blocks; raise OutOfBlocks."""
        out: list[int] = []
        try:
            for _ in range(n):
                out.append(self._take_one())
        except OutOfBlocks:
            self.release(out)
            raise
        return out

    def _take_one(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            h = self._hash_of.pop(block, None)
            if h is not None:
                self._by_hash.pop(h, None)
        else:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        self._ref[block] = 1
        return block

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block; unreferenced blocks become evictable (cached) or free."""
        for b in block_ids:
            count = self._ref.get(b)
            if count is None:
                continue
            if count > 1:
                self._ref[b] = count - 1
                continue
            del self._ref[b]
            if b in self._hash_of:
                self._evictable[b] = None
            else:
                self._free.append(b)

    # --- holds ------------------------------------------------------------------------------
    def hold(self, hold: Hold) -> None:
        """Keep ``hold.block_ids`` referenced for a remote reader (the caller already owns one reference)."""
        self.holds[hold.request_id] = hold

    def take_hold(self, request_id: str) -> Hold | None:
        """Remove and return the hold of ``request_id`` and free its blocks; None if not held."""
        hold = self.holds.pop(request_id, None)
        if hold is not None:
            self.release(hold.block_ids)
        return hold

    def expired_holds(self, now: float) -> list[Hold]:
        """Remove and return every hold whose deadline has passed, releasing its blocks."""
        done = [h for h in self.holds.values() if h.deadline <= now]
        for h in done:
            self.take_hold(h.request_id)
        return done

    def oldest_hold(self, kind: str | None = None) -> Hold | None:
        """The hold created first (of ``kind``), for memory-pressure eviction."""
        for h in self.holds.values():
            if kind is None or h.kind == kind:
                return h
        return None
