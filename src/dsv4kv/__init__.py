"""dsv4kv: paged, quantized, compressed KV cache and attention substrate for DeepSeek-V4.

Layers of the package: geometry -> layout / quant -> memory (allocator, spec, pools, planner)
-> plan + manager (request lifecycle, step plans) -> ops (PyTorch references) -> layer (DSV4Attention)
-> cli (plan, demo).
"""

from .geometry import GeometryError, LayerKind, LayerSpec, ModelGeometry, RopeSpec, YarnScaling
from .model.layer import DSV4Attention, init_random_weights
from .cache.layout import EntryLayout, IndexerFormat, KVFormat, indexer_layout, main_layout
from .cache.manager import CacheManager, RequestError
from .cache import AllocatorError, BlockAllocator, CacheSpec, MemoryPlan, NoRoom, PrefixStats
from .cache.plan import EntryWrites, OutOfBlocks, SnapshotWrites, StepBuffers, StepPlan
from .model.weights import WeightError

__all__ = [
    "ModelGeometry", "LayerSpec", "LayerKind", "RopeSpec", "YarnScaling", "GeometryError",
    "KVFormat", "IndexerFormat", "EntryLayout", "main_layout", "indexer_layout",
    "BlockAllocator", "AllocatorError", "CacheSpec", "MemoryPlan",
    "CacheManager", "RequestError", "StepPlan", "EntryWrites", "StepBuffers", "OutOfBlocks", "SnapshotWrites",
    "NoRoom", "PrefixStats",
    "DSV4Attention", "init_random_weights", "WeightError",
]
__version__ = "0.1.0"
