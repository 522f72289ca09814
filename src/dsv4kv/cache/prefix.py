"""Prefix cache index: which full blocks hold which token prefix, and which boundaries have a snapshot.

Knows nothing about tensors or attention (as vLLM v1's block pool): the manager asks it questions and
moves the bytes. docs/prefix-caching.md has the design; in short:

- A full block of `page_tokens` tokens is a `CachedBlock` node, keyed by a hash chained over token ids
  (`block_hash(parent's hash, the block's tokens)`). A lookup compares the tokens and the parent node,
  never trusts the hash alone: a collision is a miss, not a wrong hit.
- Nodes form a tree: a node's bytes were computed on top of exactly its parent's bytes. When a node is
  evicted, its whole subtree leaves the index (descendants keyed under a dead parent could otherwise be
  reached again through an equal hash chain, on top of different bytes).
- The boundary state after a node (window ring, CSA compressor rows) is a snapshot with its own id; a hit
  ends at the deepest matched node that has one. Snapshots are evicted least-recently-used, apart from
  blocks: a node without a snapshot still serves longer prefixes.
- Unreferenced cached blocks wait in the allocator's free queue (LRU); this index drops a node when the
  allocator hands its block out again (`evict`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

__all__ = ["CachedBlock", "PrefixCache", "PrefixStats", "block_hash", "ROOT_HASH"]

ROOT_HASH = 0  # the chain's seed: the parent hash of every first block


def block_hash(parent: int, tokens: np.ndarray) -> int:
    """Chain hash of one full block: its parent's hash and its token ids (int64). In-process only (Python's
    bytes hash is salted per process); equality is always confirmed by comparing tokens."""
    return hash((parent, tokens.tobytes()))


@dataclass(eq=False)
class CachedBlock:
    """A full block in the index: tokens [depth * P, (depth + 1) * P) of every prefix through it."""

    block: int
    hash: int
    tokens: np.ndarray  # int64 [page_tokens], read-only
    parent: CachedBlock | None
    depth: int
    children: list[CachedBlock] = field(default_factory=list)
    snapshot: int | None = None  # boundary state at (depth + 1) * P, if kept
    alive: bool = True

    def __repr__(self) -> str:
        return f"CachedBlock(block={self.block}, depth={self.depth}, snapshot={self.snapshot}, alive={self.alive})"


@dataclass
class PrefixStats:
    """Counters since the cache was made. Tokens are prompt tokens offered at admission and those served from
    the cache; `hit_rate` = hit_tokens / query_tokens."""

    queries: int = 0  # admissions with token ids
    query_tokens: int = 0
    hits: int = 0  # admissions that reused at least one block
    hit_tokens: int = 0
    published_blocks: int = 0
    duplicate_blocks: int = 0  # full blocks already cached by another computation: kept private
    evicted_blocks: int = 0
    snapshots_taken: int = 0
    snapshots_evicted: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "hit_rate": self.hit_rate}


class PrefixCache:
    """The index of cached blocks and boundary snapshots for one cache of `page_tokens`-token blocks."""

    def __init__(self, page_tokens: int, num_snapshots: int):
        self.page_tokens = page_tokens
        self.num_snapshots = num_snapshots
        self._buckets: dict[int, list[CachedBlock]] = {}
        self._by_block: dict[int, CachedBlock] = {}
        self._free_snapshots: deque[int] = deque(range(num_snapshots))
        self._snapshot_lru: OrderedDict[int, CachedBlock] = OrderedDict()  # attached snapshots, least recent first
        self.stats = PrefixStats()

    # --- lookups ---------------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_block)

    @property
    def num_snapshots_held(self) -> int:
        """Snapshots attached to cached blocks."""
        return len(self._snapshot_lru)

    def cached(self, block: int) -> CachedBlock | None:
        return self._by_block.get(block)

    def cached_blocks(self) -> list[CachedBlock]:
        return list(self._by_block.values())

    def child(self, parent: CachedBlock | None, tokens: np.ndarray) -> CachedBlock | None:
        """The cached block holding `tokens` right after `parent` (None: the first block), or None."""
        h = block_hash(parent.hash if parent is not None else ROOT_HASH, tokens)
        for node in self._buckets.get(h, ()):
            if node.parent is parent and np.array_equal(node.tokens, tokens):
                return node
        return None

    def match(self, tokens: np.ndarray, max_blocks: int) -> list[CachedBlock]:
        """The longest chain of cached blocks spelling tokens[:k * P], k <= max_blocks."""
        chain: list[CachedBlock] = []
        parent, page = None, self.page_tokens
        for i in range(max_blocks):
            node = self.child(parent, tokens[i * page:(i + 1) * page])
            if node is None:
                break
            chain.append(node)
            parent = node
        return chain

    @staticmethod
    def hit_depth(chain: list[CachedBlock]) -> int:
        """Blocks a hit can reuse: up to and including the deepest node of the chain that has a snapshot."""
        for i in range(len(chain) - 1, -1, -1):
            if chain[i].snapshot is not None:
                return i + 1
        return 0

    # --- changes ---------------------------------------------------------------------------------
    def insert(self, parent: CachedBlock | None, block: int, tokens: np.ndarray, snapshot: int | None) -> CachedBlock:
        """Publish `block` as the child of `parent` (which must be alive and must not have this child yet)."""
        if parent is not None and not parent.alive:
            raise ValueError(f"insert: parent {parent} was evicted")
        if block in self._by_block:
            raise ValueError(f"insert: block {block} is already cached")
        tokens = np.array(tokens, dtype=np.int64)
        tokens.setflags(write=False)
        h = block_hash(parent.hash if parent is not None else ROOT_HASH, tokens)
        node = CachedBlock(block=block, hash=h, tokens=tokens, parent=parent,
                           depth=parent.depth + 1 if parent is not None else 0)
        self._buckets.setdefault(h, []).append(node)
        self._by_block[block] = node
        if parent is not None:
            parent.children.append(node)
        if snapshot is not None:
            self.attach_snapshot(node, snapshot)
        self.stats.published_blocks += 1
        return node

    def evict(self, block: int) -> list[CachedBlock]:
        """Drop the node of `block` (if cached) and its whole subtree; returns the nodes dropped (their snapshots
        are free again). The caller owns the blocks: it must move the descendants' blocks where it wants them."""
        node = self._by_block.get(block)
        if node is None:
            return []
        if node.parent is not None:
            node.parent.children.remove(node)
        dropped, stack = [], [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children)
            n.children = []
            n.alive = False
            bucket = self._buckets[n.hash]
            bucket.remove(n)
            if not bucket:
                del self._buckets[n.hash]
            del self._by_block[n.block]
            if n.snapshot is not None:
                self._snapshot_lru.pop(n.snapshot)
                self._free_snapshots.append(n.snapshot)
                n.snapshot = None
            dropped.append(n)
        self.stats.evicted_blocks += len(dropped)
        return dropped

    def take_snapshot(self, taken: list | None = None) -> int | None:
        """A snapshot id for a boundary about to be captured: a free one, else the least recently used one
        (detached from its node); None when there are none (num_snapshots = 0). `taken`, if given, gets
        (id, the node it was detached from or None) for `untake_snapshot`."""
        if self._free_snapshots:
            snapshot, node = self._free_snapshots.popleft(), None
        elif self._snapshot_lru:
            snapshot, node = self._snapshot_lru.popitem(last=False)
            node.snapshot = None
            self.stats.snapshots_evicted += 1
        else:
            return None
        if taken is not None:
            taken.append((snapshot, node))
        return snapshot

    def untake_snapshot(self, snapshot: int, node: CachedBlock | None) -> None:
        """Undo the latest `take_snapshot` not yet undone ((id, node) as it recorded them; undo several in reverse
        order): a free id goes back to the front of the free ids, a detached one back on its (live) node as the least
        recently used."""
        if node is None:
            self._free_snapshots.appendleft(snapshot)
            return
        if not node.alive or node.snapshot is not None:
            raise ValueError(f"untake_snapshot: {node} cannot take snapshot {snapshot} back")
        node.snapshot = snapshot
        self._snapshot_lru[snapshot] = node
        self._snapshot_lru.move_to_end(snapshot, last=False)
        self.stats.snapshots_evicted -= 1

    def return_snapshot(self, snapshot: int) -> None:
        """Give back an id from `take_snapshot` that was not attached (its capture was dropped)."""
        self._free_snapshots.appendleft(snapshot)

    def attach_snapshot(self, node: CachedBlock, snapshot: int) -> None:
        if node.snapshot is not None:
            raise ValueError(f"attach_snapshot: {node} already has one")
        node.snapshot = snapshot
        self._snapshot_lru[snapshot] = node
        self.stats.snapshots_taken += 1

    def touch(self, node: CachedBlock) -> None:
        """Mark the node's snapshot as just used (a hit)."""
        if node.snapshot is not None:
            self._snapshot_lru.move_to_end(node.snapshot)

    def check(self) -> None:
        """Internal consistency (for tests): every index agrees with every other."""
        nodes = list(self._by_block.values())
        assert sum(len(b) for b in self._buckets.values()) == len(nodes)
        for node in nodes:
            assert node.alive and node in self._buckets[node.hash]
            assert node.parent is None or (node.parent.alive and node in node.parent.children)
            assert all(c.alive and c.parent is node for c in node.children)
            if node.snapshot is not None:
                assert self._snapshot_lru[node.snapshot] is node
        held = set(self._snapshot_lru)
        assert len(held) == len(self._snapshot_lru) and not held & set(self._free_snapshots)
