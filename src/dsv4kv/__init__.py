"""dsv4kv: paged, quantized, compressed KV cache and attention substrate for DeepSeek-V4.

Layers of the package: geometry -> layout / quant -> memory (allocator, spec, pools, planner)
-> plan + manager (request lifecycle, step plans) -> cli.
"""

from .geometry import GeometryError, LayerKind, LayerSpec, ModelGeometry, RopeSpec, YarnScaling
from .layout import EntryLayout, IndexerFormat, KVFormat, indexer_layout, main_layout
from .manager import CacheManager, RequestError
from .memory import AllocatorError, BlockAllocator, CacheSpec, MemoryPlan
from .plan import EntryWrites, OutOfBlocks, StepBuffers, StepPlan

__all__ = [
    "ModelGeometry", "LayerSpec", "LayerKind", "RopeSpec", "YarnScaling", "GeometryError",
    "KVFormat", "IndexerFormat", "EntryLayout", "main_layout", "indexer_layout",
    "BlockAllocator", "AllocatorError", "CacheSpec", "MemoryPlan",
    "CacheManager", "RequestError", "StepPlan", "EntryWrites", "StepBuffers", "OutOfBlocks",
]
__version__ = "0.1.0"
