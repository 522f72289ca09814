"""Memory: block allocator (ids, refcounts), cache spec (byte counts), pools (tensors), planner (reports),
prefix cache index (which blocks hold which prefix), swap records, tentative steps' rollback (`rollback`), a request's
state exported, saved and sent to another process (`transfer`, `files`, `distributed`)."""

from .allocator import AllocatorError, BlockAllocator
from .planner import MemoryPlan, parse_bytes
from .pools import CachePools, LayerCache
from .prefix import CachedBlock, PrefixCache, PrefixStats
from .spec import DEFAULT_PAGE_TOKENS, CacheSpec, LayerCacheSpec
from .swap import NoRoom
from .transfer import RequestState
from .files import load_request, save_request

__all__ = ["AllocatorError", "BlockAllocator", "CachePools", "LayerCache", "CacheSpec", "LayerCacheSpec",
           "DEFAULT_PAGE_TOKENS", "MemoryPlan", "parse_bytes", "CachedBlock", "PrefixCache", "PrefixStats",
           "NoRoom", "RequestState", "save_request", "load_request"]
