"""Triton kernels of the attention path, one beside each reference op of `dsv4kv.ops` (docs/kernels.md).

They read and write the cache's real page formats, run over a plan's padded rows with no host sync (a CUDA
graph can capture them), and equal the references: bit for bit where they move or encode data, within
the tolerance tables of their tests where they sum. `DSV4Attention` uses them on CUDA (backend "auto").
"""

from .attention import sparse_attention_paged
from ..backend import interpreted, kernels_can_run
from .compress import append_state, compress_insert
from .gemv import gemv_rows
from .indexer import indexer_scores_paged
from .projection import compressor_rows, rms_norm_rows
from .query import indexer_query_and_weights, indexer_query_rows, rope_rows
from .topk import topk_indices
from .window import append_window, kv_insert

__all__ = [
    "kv_insert", "append_window", "compress_insert", "append_state", "indexer_scores_paged", "topk_indices",
    "sparse_attention_paged", "rope_rows", "indexer_query_rows", "indexer_query_and_weights", "interpreted",
    "kernels_can_run", "rms_norm_rows", "compressor_rows", "gemv_rows",
]
