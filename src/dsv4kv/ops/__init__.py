"""Operations of the attention path, as PyTorch references (the definition later kernels must equal)."""

from .append import append_state, append_window, compressor_logits
from .attention import sparse_attention
from .compress import compress_and_insert, pool_entries
from .gather import gather_entries, gather_window, visible_entries
from .indexer import indexer_query, indexer_scores, indexer_topk, topk_picks
from .rope import apply_rope, inv_freq, rope_cos_sin

__all__ = [
    "apply_rope", "inv_freq", "rope_cos_sin", "compressor_logits", "append_window", "append_state",
    "pool_entries", "compress_and_insert", "indexer_query", "indexer_scores", "topk_picks", "indexer_topk",
    "gather_window", "visible_entries", "gather_entries", "sparse_attention",
]
