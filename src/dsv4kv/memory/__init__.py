"""Memory: block allocator (ids, refcounts), cache spec (byte counts), pools (tensors), planner (reports)."""

from .allocator import AllocatorError, BlockAllocator
from .planner import MemoryPlan, parse_bytes
from .pools import CachePools, LayerCache
from .spec import DEFAULT_PAGE_TOKENS, CacheSpec, LayerCacheSpec

__all__ = ["AllocatorError", "BlockAllocator", "CachePools", "LayerCache", "CacheSpec", "LayerCacheSpec",
           "DEFAULT_PAGE_TOKENS", "MemoryPlan", "parse_bytes"]
