"""Preemption by swap: what a swapped-out request keeps in host memory, and the answer when there is no room.

The bytes themselves move in `CachePools.save` / `CachePools.load`; the manager decides what moves
(`CacheManager.swap_out` / `swap_in`). A swapped-out request keeps its id, length and token ids; its blocks,
window ring and compressor state live in host tensors (pinned on CUDA) until it comes back bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .prefix import CachedBlock

__all__ = ["NoRoom", "Swapped"]


@dataclass(frozen=True)
class NoRoom:
    """`swap_out` / `swap_in`'s answer when a resource is short (host swap bytes, request slots, blocks).
    Nothing was changed. Falsy, like `OutOfBlocks`."""

    resource: str
    needed: int
    free: int

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return f"no room: needs {self.needed} {self.resource}, {self.free} free"


@dataclass
class Swapped:
    """A request in host memory: `request` is the manager's record (slot -1 while out); `saved` the host
    tensors from `CachePools.save`; `block_nodes[i]` the cached node its block i was (None: private), so
    swap_in can share a block that is still cached instead of copying it."""

    request: Any
    saved: list[torch.Tensor]
    block_nodes: list[CachedBlock | None] = field(default_factory=list)
    nbytes: int = 0
