"""Token choice from fp32 logits: greedy argmax, or temperature / top-k / top-p sampling driven by each
request's own generator (one uniform draw per token), so a request's tokens depend on its seed and its own
logits only, never on what else is in the batch."""

from __future__ import annotations

from typing import Sequence

import torch

from .params import SamplingParams

__all__ = ["sample"]


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """logits fp32 [R, vocab] (row r for params[r]) -> R token ids."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits: expected float32 [{len(params)}, vocab], got {logits.dtype} {list(logits.shape)}")
    tokens = logits.argmax(-1).tolist()
    for row, (p, generator) in enumerate(zip(params, generators)):
        if not p.greedy:
            tokens[row] = _sample_row(logits[row].cpu(), p, generator)
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """Inverse-CDF sampling over the kept tokens, in descending probability order (ties by token id)."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)  # [V]
    probs, order = torch.sort(probs, descending=True, stable=True)
    keep = probs.shape[0] if p.top_k == 0 else min(p.top_k, probs.shape[0])
    if p.top_p < 1:
        before = torch.cumsum(probs, 0) - probs  # mass of the more likely tokens
        keep = min(keep, int((before < p.top_p).sum()))
    cdf = torch.cumsum(probs[:keep], 0)
    u = torch.rand((), dtype=torch.float64, generator=generator).item() * cdf[-1].item()
    index = min(int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype))), keep - 1)
    return int(order[index])
