"""The kernel path's entries, one per operation: what `DSV4Attention` launches on the Triton backend.

The layer calls them through this module (`kernels.rope_rows(...)`), so a test or a profiler that wraps one entry
here sees every launch of it."""

from .attention.kernel import sparse_attention_paged
from .compress.kernel import append_state, compress_insert
from .indexer.kernel import indexer_scores_paged
from .indexer.query_kernel import indexer_query_and_weights, indexer_query_rows
from .projection.gemv import gemv_rows
from .projection.kernel import compressor_rows, rms_norm_rows
from .rope.kernel import rope_rows
from ..backend import interpreted, kernels_can_run
from .topk.kernel import topk_indices
from .window.kernel import append_window, kv_insert

__all__ = [
    "kv_insert", "append_window", "compress_insert", "append_state", "indexer_scores_paged", "topk_indices",
    "sparse_attention_paged", "rope_rows", "indexer_query_rows", "indexer_query_and_weights", "interpreted",
    "kernels_can_run", "rms_norm_rows", "compressor_rows", "gemv_rows",
]
