"""RMS norms of the layer's projections (the references of `kernels.projection.rms_norm_rows`).

- `rms_norm`: with a weight (q_a's and kv's norms, `layer.RMSNorm`): fp32 math, one rounding to x's dtype at the end.
- `unit_rms_norm`: without one (the query's per-head norm), as transformers writes it: the factor
  rsqrt(mean(x^2) + eps) is rounded to x's dtype and the product is taken in that dtype.
"""

from __future__ import annotations

import torch

__all__ = ["rms_norm", "unit_rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim, in fp32, rounded to x's dtype."""
    x32 = x.float()
    return (weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim: x times the factor rounded to x's dtype."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)
