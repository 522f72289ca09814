"""The lightning indexer of CSA layers: scores of every visible compressed key, and an exact top-k.

    score[t, j] = sum_h w[t, h] * ReLU(q[t, h] . K[j]) * index_head_dim^-0.5      (fp32)

with w = weights_proj(x) * index_n_heads^-0.5. Query t sees key j iff (j + 1) * m <= t + 1.

Numerics follow the key format: keys stored Hadamard-rotated and quantized (MXFP4, FP8) are met by a
query rotated and round-tripped through the same format, as the official model does (its MXFP4 path);
bf16 keys (exact mode) meet the plain fp32 query, as transformers computes.

Top-k order: higher score first, ties to the lower entry index (a stable sort), so the index set is a
function of the scores alone. Picks past the visible count are -1.
"""

from __future__ import annotations

import torch

from ...cache import quant
from ...cache.layout import EntryLayout, IndexerFP8Layout, IndexerMXFP4Layout
from ...cache.plan import StepPlan
from ...checks import check_float, require
from ..shared.rows import StepRows, entry_slots, step_rows
from ..topk.reference import topk_picks

__all__ = ["indexer_query", "indexer_scores", "topk_picks", "indexer_topk"]


def indexer_query(q: torch.Tensor, layout: EntryLayout) -> torch.Tensor:
    """q [N, H, dim] (roped) -> fp32 [N, H, dim] in the keys' numerics: rotated and round-tripped through
    MXFP4 (32-blocks) or FP8 (one pow2 scale per head row) for those formats, unchanged for bf16."""
    if not layout.rotated:
        return q.float()
    rotated = quant.hadamard_rotate(q).to(torch.bfloat16)
    if isinstance(layout, IndexerMXFP4Layout):
        packed, scale = quant.quantize_mxfp4(rotated, 32)
        return quant.dequantize_mxfp4(packed, scale, 32)
    if isinstance(layout, IndexerFP8Layout):
        values, scale = quant.quantize_fp8(rotated, layout.dim)
        return quant.dequantize_fp8(values, scale, layout.dim)
    raise ValueError(f"indexer_query: no query numerics for rotated layout {layout.name!r}")


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q fp32 [n, H, dim], weights fp32 [n, H] (already * H^-0.5), keys fp32 [J, dim] -> scores fp32 [n, J]."""
    dots = torch.matmul(q, keys.t())  # [n, H, J]
    return (torch.relu(dots) * q.shape[-1] ** -0.5 * weights.unsqueeze(-1)).sum(dim=1)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, plan: StepPlan, key_pool: torch.Tensor,
                 layout: EntryLayout, *, ratio: int, topk: int, page_tokens: int,
                 rows: StepRows | None = None) -> torch.Tensor:
    """Top-k visible compressed entries of every token -> int64 [N, topk] entry indices, -1 for missing picks.

    q: [N, H, dim] roped indexer queries (any float dtype); weights: fp32 [N, H] head weights * H^-0.5;
    key_pool: the layer's indexer-key pool (this step's keys already inserted).
    """
    rows = rows if rows is not None else step_rows(plan)
    n = rows.num_tokens
    check_float("q", q, (n, None, layout.dim), key_pool.device)
    check_float("weights", weights, (n, q.shape[1]), key_pool.device)
    require(topk > 0, f"indexer_topk: topk must be positive, got {topk}")
    query = indexer_query(q, layout)
    out = torch.full((n, topk), -1, dtype=torch.long, device=q.device)
    for b, (lo, hi) in enumerate(zip(rows.host_query_start[:-1], rows.host_query_start[1:])):
        count = rows.host_seq_lens[b] // ratio  # entries complete after this step
        if hi == lo or count == 0:
            continue
        index = torch.arange(count, device=q.device)
        request = torch.full_like(index, b)
        slots = entry_slots(plan, rows, request, index, ratio=ratio, page_tokens=page_tokens)
        keys = layout.read(key_pool, page_tokens // ratio, slots)
        scores = indexer_scores(query[lo:hi], weights[lo:hi].float(), keys)
        visible = (rows.positions[lo:hi] + 1) // ratio
        scores = scores.masked_fill(index >= visible.unsqueeze(1), float("-inf"))
        out[lo:hi] = topk_picks(scores, topk)
    return out
