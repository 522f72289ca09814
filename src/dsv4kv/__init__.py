"""dsv4kv: paged, quantized, compressed KV cache and attention substrate for DeepSeek-V4.

The pipeline, by folder (each imports only from the ones above it):

    geometry.py, checks.py   the model's attention geometry; the one argument-checking helper
    cache/                   byte layouts and quantizers, the cache spec, block allocator, pools, prefix cache, swap,
                             memory planner, step plans (`StepPlan`), tentative steps' rollback, a request's state
                             moved (export / import, files, torch.distributed), and `CacheManager` (request lifecycle)
    ops/<op>/                each operation's PyTorch reference beside its Triton kernel (`ops.kernels` lists them)
    model/                   `DSV4Attention` over its own pages: the attention plan built once per step and layer
                             kind, the kernel path's schedules, weights, streams, captured decode steps
    engine/                  `Engine`: a DeepSeek-V4 model served over the cache (scheduler, runner, sampler,
                             speculative decoding, cache files, prefill / decode roles)
    tools/                   the command line (`dsv4kv plan | demo | bench`), the demo and the benchmarks
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
