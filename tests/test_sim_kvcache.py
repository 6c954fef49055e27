"""KV blocks: chained hashes, LRU prefix cache, holds with deadlines."""

from __future__ import annotations

import pytest

from kvdiag.sim.kvcache import BlockPool, Hold, OutOfBlocks, blocks_for, chain_hashes


def test_chained_hashes_identify_prefixes() -> None:
    a = chain_hashes(list(range(40)), 16)
    b = chain_hashes([*range(32), 99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89, 88, 87, 86, 85, 84], 16)
    assert len(a) == 2 and a == b[:2]  # only full blocks are hashed
    c = chain_hashes([7, *range(1, 32)], 16)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later hash


def test_prefix_cache_hits_and_lru_eviction() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    first = pool.allocate(2)
    pool.commit(first, ["h1", "h2"])
    pool.release(first)
    assert pool.match(["h1", "h2", "h3"]) == first
    other = pool.allocate(2)  # the two never-used blocks
    assert set(other).isdisjoint(first)
    pool.release(other)
    third = pool.allocate(1)  # never-cached free blocks go first
    assert third[0] in other
    more = pool.allocate(2)  # the last free block, then the least recently used cached block (h1)
    assert first[0] in more and pool.match(["h1"]) == [] and pool.match(["h2"]) == [first[1]]
    assert pool.used_blocks == 3 and blocks_for(5, 2) == 3


def test_exhausted_pool_raises() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    pool.allocate(2)
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)


def test_holds_expire_and_free_blocks() -> None:
    pool = BlockPool(num_blocks=8, block_size=4, prefix_caching=False)
    blocks = pool.allocate(3)
    pool.hold(Hold("r1", blocks, 12, deadline=10.0, ttl_s=5.0, hashes=[], kind="ttl"))
    assert pool.expired_holds(now=9.0) == []
    done = pool.expired_holds(now=10.0)
    assert [h.request_id for h in done] == ["r1"] and pool.used_blocks == 0
    assert pool.take_hold("r1") is None


def test_disabled_prefix_caching_never_hits() -> None:
    pool = BlockPool(num_blocks=4, block_size=2, prefix_caching=False)
    blocks = pool.allocate(1)
    pool.commit(blocks, ["h"])
    pool.release(blocks)
    assert pool.match(["h"]) == []
