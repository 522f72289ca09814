"""Block allocator: ids, reference counts and a free queue. Knows nothing about tensors.

Blocks are handed out from the front of the free queue (initially 0, 1, 2, ...). A freed block goes to
the back by default, so a just-freed block is the last to be reused: with prefix caching, unreferenced
cached blocks wait in the queue in least-recently-used order and the front one is evicted first. Blocks
whose contents are worth nothing go to the front (`free(..., front=True)`, `to_front`). `take` pulls
specific free blocks out of the queue (a prefix hit on cached blocks nobody references). Every operation
is O(1) per block. `peek` names the blocks the next `allocate` would hand out without taking them (a
tentative step writes into them and takes them only for its accepted tokens). Running out is an expected outcome (`allocate` returns None and changes nothing);
misuse (double free, unknown id, taking a used block) raises.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Iterable

from ..checks import positive_int

__all__ = ["BlockAllocator", "AllocatorError"]


class AllocatorError(RuntimeError):
    """Misuse of the allocator: double free, sharing a free block, unknown block id."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = positive_int("num_blocks", num_blocks)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))  # front = next out
        self._refs = [0] * self.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        self._check(block)
        return self._refs[block]

    def free_order(self) -> list[int]:
        """The free queue, next-out first (for tests and debugging: O(free blocks))."""
        return list(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n blocks from the front of the free queue (refcount 1), or None if fewer than n are free (nothing is taken)."""
        if n < 0:
            raise ValueError(f"allocate: n must be >= 0, got {n}")
        if n > len(self._free):
            return None
        blocks = [self._free.popitem(last=False)[0] for _ in range(n)]
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def peek(self, n: int) -> list[int] | None:
        """The n blocks `allocate(n)` would hand out now, in order, without taking them; None if fewer are free."""
        if n < 0:
            raise ValueError(f"peek: n must be >= 0, got {n}")
        if n > len(self._free):
            return None
        return list(itertools.islice(self._free, n))

    def take(self, blocks: Iterable[int]) -> None:
        """Take these free blocks out of the queue with refcount 1 (a hit on cached blocks nobody references).
        Validates all blocks first, so a bad call changes nothing."""
        blocks = list(blocks)
        for block in blocks:
            self._check(block)
            if self._refs[block] != 0:
                raise AllocatorError(f"take: block {block} is in use (refcount {self._refs[block]})")
        if len(set(blocks)) != len(blocks):
            raise AllocatorError(f"take: a block appears twice in {blocks}")
        for block in blocks:
            del self._free[block]
            self._refs[block] = 1

    def share(self, blocks: Iterable[int]) -> None:
        """Add a reference to each (live) block, e.g. when a second request maps it."""
        blocks = list(blocks)
        for block in blocks:
            self._check(block)
            if self._refs[block] == 0:
                raise AllocatorError(f"share: block {block} is free")
        for block in blocks:
            self._refs[block] += 1

    def free(self, blocks: Iterable[int], *, front: bool = False) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue, at the back in the
        order given (reused last), or with `front` at the front (reused first).

        Validates all blocks first, so a bad call changes nothing.
        """
        blocks = list(blocks)
        drops: dict[int, int] = {}
        for block in blocks:
            self._check(block)
            drops[block] = drops.get(block, 0) + 1
            if drops[block] > self._refs[block]:
                raise AllocatorError(f"free: block {block} freed more often than referenced (double free)")
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                if front:
                    self._free.move_to_end(block, last=False)

    def to_front(self, blocks: Iterable[int]) -> None:
        """Move free blocks to the front of the queue (their cached contents were dropped: reuse them first)."""
        blocks = list(blocks)
        for block in blocks:
            self._check(block)
            if self._refs[block] != 0:
                raise AllocatorError(f"to_front: block {block} is in use (refcount {self._refs[block]})")
        for block in blocks:
            self._free.move_to_end(block, last=False)

    def _check(self, block: int) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise AllocatorError(f"block id {block!r} outside [0, {self.num_blocks})")
