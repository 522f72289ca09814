"""Sparse attention with a sink: one softmax per (token, head) over the token's gathered keys (window and
compressed alike, no dedup), with the head's learned sink adding exp(sink) to the denominator only.
K = V (the full head_dim). Rows are independent, so prefill rows and decode rows mix freely.
"""

from __future__ import annotations

import torch

from ...checks import check_float, require

__all__ = ["sparse_attention"]


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [N, H, D] (any float), keys fp32 [N, K, D], valid bool [N, K], sinks [H] -> fp32 [N, H, D].

    out[t, h] = sum_k p[t, h, k] * keys[t, k] with p = exp(l - M) / (sum_k exp(l - M) + exp(sink_h - M)),
    l = scale * q . k over the valid keys only (invalid keys are ignored even when they hold NaN).
    A row with no valid key returns zeros (the sink takes all the weight).
    """
    require(isinstance(q, torch.Tensor) and isinstance(keys, torch.Tensor) and isinstance(valid, torch.Tensor)
            and isinstance(sinks, torch.Tensor), "sparse_attention: q, keys, valid and sinks must be tensors")
    n, heads, dim = q.shape if q.dim() == 3 else (-1, -1, -1)
    check_float("q", q, (n, heads, dim), keys.device)
    check_float("keys", keys, (n, None, dim), keys.device)
    require(valid.dtype == torch.bool and valid.shape == keys.shape[:2],
            f"sparse_attention: valid must be bool {list(keys.shape[:2])}, got {valid.dtype} {list(valid.shape)}")
    check_float("sinks", sinks, (heads,), keys.device)
    values = torch.where(valid.unsqueeze(-1), keys.float(), torch.zeros((), device=keys.device))
    logits = torch.einsum("nhd,nkd->nhk", q.float(), values) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink = sinks.float().view(1, heads, 1).expand(n, heads, 1)
    top = torch.maximum(logits.amax(dim=-1, keepdim=True), sink)
    weights = torch.exp(logits - top)
    denominator = weights.sum(dim=-1, keepdim=True) + torch.exp(sink - top)
    return torch.einsum("nhk,nkd->nhd", weights / denominator, values)
