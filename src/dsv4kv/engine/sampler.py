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
    rows = [row for row, p in enumerate(params) if not p.greedy]
    if rows:
        drawn = _sample_rows(logits[rows], [params[r] for r in rows], [generators[r] for r in rows])
        for row, token in zip(rows, drawn):
            tokens[row] = token
    return tokens


def _sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator]) -> list[int]:
    """Inverse-CDF sampling over each row's kept tokens, in descending probability order (ties by token id), on the
    logits' device for all rows at once: every operation is along a row, so a row's token does not depend on the
    others. Each row takes one uniform draw from its request's generator (on the host)."""
    device, vocab = logits.device, logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float64, device=device)
    probs = torch.softmax(logits.double() / temperature[:, None], dim=-1)
    probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cdf = torch.cumsum(probs, dim=-1)
    keep = torch.tensor([p.top_k if p.top_k else vocab for p in params], device=device).clamp(max=vocab)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device)
    nucleus = ((cdf - probs) < top_p[:, None]).sum(-1)  # tokens whose more likely ones hold less than top_p
    keep = torch.where(top_p < 1, torch.minimum(keep, nucleus), keep)
    total = cdf.gather(1, (keep - 1)[:, None])  # the kept mass
    u = torch.tensor([torch.rand((), dtype=torch.float64, generator=g).item() for g in generators],
                     dtype=torch.float64, device=device)[:, None] * total
    index = torch.minimum(torch.searchsorted(cdf, u), (keep - 1)[:, None])
    return order.gather(1, index)[:, 0].tolist()
