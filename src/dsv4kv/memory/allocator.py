"""Block allocator: ids, reference counts and a FIFO free list. Knows nothing about tensors.

Blocks are handed out in free-list order (initially 0, 1, 2, ...) and a freed block goes to the back,
so a just-freed block is the last to be reused (stale contents stay put longest, which later prefix
caching can exploit). Every operation is O(1) per block. Running out is an expected outcome
(`allocate` returns None and changes nothing); misuse (double free, unknown id) raises.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from ..checks import positive_int

__all__ = ["BlockAllocator", "AllocatorError"]


class AllocatorError(RuntimeError):
    """Misuse of the allocator: double free, sharing a free block, unknown block id."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = positive_int("num_blocks", num_blocks)
        self._free: deque[int] = deque(range(self.num_blocks))
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

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (refcount 1), or None if fewer than n are free (nothing is taken)."""
        if n < 0:
            raise ValueError(f"allocate: n must be >= 0, got {n}")
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Add a reference to each (live) block, e.g. when a second request maps it."""
        blocks = list(blocks)
        for block in blocks:
            self._check(block)
            if self._refs[block] == 0:
                raise AllocatorError(f"share: block {block} is free")
        for block in blocks:
            self._refs[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero return to the back of the free list.

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
                self._free.append(block)

    def _check(self, block: int) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise AllocatorError(f"block id {block!r} outside [0, {self.num_blocks})")
