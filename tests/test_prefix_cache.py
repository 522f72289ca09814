"""PrefixCache, the index of cached blocks (no tensors, no manager): chain lookups compare tokens and parents,
eviction takes subtrees, snapshots are handed out free-first then least recently used."""

import numpy as np
import pytest

from dsv4kv.cache.prefix import PrefixCache, block_hash

P = 4


def blocks_of(*rows):
    return [np.array(r, dtype=np.int64) for r in rows]


def chain(cache, token_blocks, first_block=0, snapshots=()):
    parent, nodes = None, []
    for i, tokens in enumerate(token_blocks):
        parent = cache.insert(parent, first_block + i, tokens, snapshots[i] if i < len(snapshots) else None)
        nodes.append(parent)
    return nodes


def test_match_follows_the_chain_and_stops_at_the_first_miss():
    cache = PrefixCache(P, num_snapshots=4)
    a, b, c = blocks_of([1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9])
    nodes = chain(cache, [a, b, c])
    assert cache.match(np.concatenate([a, b, c, [1]]), 3) == nodes
    assert cache.match(np.concatenate([a, b, c]), 2) == nodes[:2]  # max_blocks bounds it
    assert cache.match(np.concatenate([a, c, b]), 3) == nodes[:1]  # c is not the child of a
    assert cache.match(np.concatenate([b, a]), 2) == []
    assert [n.depth for n in nodes] == [0, 1, 2] and nodes[2].hash == block_hash(nodes[1].hash, c)
    cache.check()


def test_equal_hashes_are_told_apart_by_tokens_and_parent(monkeypatch):
    import dsv4kv.cache.prefix as prefix
    monkeypatch.setattr(prefix, "block_hash", lambda parent, tokens: 42)
    cache = PrefixCache(P, num_snapshots=0)
    a, b = blocks_of([1, 1, 1, 1], [2, 2, 2, 2])
    first = chain(cache, [a, b])
    other = cache.insert(None, 7, b, None)  # block b as a *first* block: same hash, other parent
    assert cache.child(None, b) is other and cache.child(first[0], b) is first[1]
    assert cache.child(None, np.array([3, 3, 3, 3])) is None
    assert cache.match(np.concatenate([b, b]), 2) == [other]
    cache.check()


def test_evict_takes_the_subtree_and_frees_its_snapshots():
    cache = PrefixCache(P, num_snapshots=3)
    s = [cache.take_snapshot() for _ in range(3)]
    a, b, c = blocks_of([1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9])
    nodes = chain(cache, [a, b, c], snapshots=s)
    side = cache.insert(nodes[0], 9, c, None)  # a second child of the root
    dropped = cache.evict(nodes[1].block)
    assert dropped == [nodes[1], nodes[2]] and not nodes[1].alive and not nodes[2].alive
    assert nodes[0].children == [side] and cache.num_cached_blocks == 2
    assert cache.num_snapshots_held == 1 and sorted(cache._free_snapshots) == sorted(s[1:])
    assert cache.evict(123) == []  # not cached: nothing
    assert cache.stats.evicted_blocks == 2
    cache.check()


def test_snapshots_free_first_then_least_recently_used():
    cache = PrefixCache(P, num_snapshots=2)
    a, b = blocks_of([1, 2, 3, 4], [5, 6, 7, 8])
    x = cache.insert(None, 0, a, cache.take_snapshot())
    y = cache.insert(x, 1, b, cache.take_snapshot())
    cache.touch(x)  # y is now the least recently used
    s = cache.take_snapshot()
    assert y.snapshot is None and x.snapshot is not None and s not in (x.snapshot,)
    assert cache.stats.snapshots_evicted == 1
    assert PrefixCache.hit_depth([x, y]) == 1  # a hit ends at the deepest node with a snapshot
    cache.return_snapshot(s)
    assert cache.take_snapshot() == s
    assert PrefixCache(P, num_snapshots=0).take_snapshot() is None


def test_misuse_raises():
    cache = PrefixCache(P, num_snapshots=1)
    a, b = blocks_of([1, 2, 3, 4], [5, 6, 7, 8])
    x = cache.insert(None, 0, a, None)
    with pytest.raises(ValueError, match="already cached"):
        cache.insert(None, 0, b, None)
    cache.evict(0)
    with pytest.raises(ValueError, match="was evicted"):
        cache.insert(x, 1, b, None)
    y = cache.insert(None, 2, b, cache.take_snapshot())
    with pytest.raises(ValueError, match="already has one"):
        cache.attach_snapshot(y, 0)
