"""Top-k picks over score rows: the reference the top-k kernel equals (index sets, ties to the lower index)."""

from __future__ import annotations

import torch

__all__ = ["topk_picks"]


def topk_picks(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores fp32 [n, J] (-inf = not a candidate) -> long [n, topk]: column indices by score descending, ties to
    the lower index (a stable sort), -1 where fewer than topk candidates exist."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :topk]
    picked = torch.gather(scores, 1, order)
    order = torch.where(picked > float("-inf"), order, torch.full_like(order, -1))
    return torch.nn.functional.pad(order, (0, topk - order.shape[1]), value=-1)


