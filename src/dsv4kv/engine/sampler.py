"""Token choice from fp32 logits: greedy argmax, or temperature / top-k / top-p sampling driven by each
request's own generator (one uniform draw per token), so a request's tokens depend on its seed and its own
logits only, never on what else is in the batch. Rows whose request asks for log-probabilities also get them
(`SamplingParams.logprobs`): one log_softmax and top-k over those rows, on the logits' device, read back with
the tokens in one copy."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from .params import SamplingParams

__all__ = ["sample", "sample_with_logprobs", "Sampled", "uniform", "probabilities"]

TopLogprobs = tuple[tuple[int, float], ...]  # (token id, logprob) pairs, best first


class Sampled(NamedTuple):
    """One sampler batch, row by row: the tokens, and where the row's request asked (`SamplingParams.logprobs`
    > 0) its top logprobs and the token's own logprob (None where it did not)."""

    tokens: list[int]
    logprobs: list[TopLogprobs | None]
    token_logprobs: list[float | None]


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """logits fp32 [R, vocab] (row r for params[r]) -> R token ids."""
    return sample_with_logprobs(logits, params, generators).tokens


def uniform(generator: torch.Generator) -> float:
    """One draw of a request's generator: the uniform in [0, 1) that picks one sampled token."""
    return torch.rand((), dtype=torch.float64, generator=generator).item()


def sample_with_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams],
                         generators: Sequence[torch.Generator | None],
                         uniforms: Sequence[float | None] | None = None) -> Sampled:
    """logits fp32 [R, vocab] (row r for params[r]) -> the R tokens, and the logprobs of the rows that ask for them:
    log_softmax of their fp32 logits (before temperature, top-k, top-p), the top params[r].logprobs (at most the
    vocabulary) and the sampled token's. Everything is computed on the logits' device and read back in one copy;
    rows that do not ask add nothing. `logits` may be a view of a decode graph's buffer: it is read here, before the
    next step. `uniforms`: each sampled row's draw given instead of taken from its generator (a speculative step's
    rows, `speculative_sampling`); greedy rows ignore theirs."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits: expected float32 [{len(params)}, vocab], got {logits.dtype} {list(logits.shape)}")
    if uniforms is not None and len(uniforms) != len(params):
        raise ValueError(f"uniforms: {len(uniforms)} for {len(params)} rows")
    count, vocab = len(params), logits.shape[1]
    tokens = logits.argmax(-1)  # [R] on the logits' device
    rows = [row for row, p in enumerate(params) if not p.greedy]
    if rows:
        draws = [uniforms[r] if uniforms is not None else uniform(generators[r]) for r in rows]
        drawn = _sample_rows(logits[rows], [params[r] for r in rows], draws)
        tokens[torch.tensor(rows, device=tokens.device)] = drawn
    asking = [row for row, p in enumerate(params) if p.logprobs]
    if not asking:
        return Sampled(tokens.tolist(), [None] * count, [None] * count)
    n = min(max(params[r].logprobs for r in asking), vocab)
    index = None if len(asking) == count else torch.tensor(asking, device=logits.device)
    logprobs = torch.log_softmax(logits if index is None else logits[index], dim=-1)  # [A, vocab]
    top = logprobs.topk(n, dim=-1)  # sorted, best first
    chosen = logprobs.gather(1, (tokens if index is None else tokens[index])[:, None])[:, 0]
    # one copy to the host: float64 holds the token ids (< 2**53) and the fp32 logprobs exactly
    packed = torch.cat([tokens.double(), chosen.double(), top.values.double().flatten(),
                        top.indices.double().flatten()]).tolist()
    a = len(asking)
    token_ids = [int(t) for t in packed[:count]]
    own = packed[count:count + a]
    values = packed[count + a:count + a + a * n]
    ids = packed[count + a + a * n:]
    out_top: list[TopLogprobs | None] = [None] * count
    out_own: list[float | None] = [None] * count
    for i, row in enumerate(asking):
        k = min(params[row].logprobs, vocab)
        out_top[row] = tuple((int(ids[i * n + j]), values[i * n + j]) for j in range(k))
        out_own[row] = own[i]
    return Sampled(token_ids, out_top, out_own)


def probabilities(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """float64 [R, vocab]: the distribution each row's token is drawn from (temperature, then top-k and top-p, the
    kept mass renormalized; a greedy row is one-hot at its argmax), on the logits' device."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits: expected float32 [{len(params)}, vocab], got {logits.dtype} {list(logits.shape)}")
    out = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device)
    greedy = [row for row, p in enumerate(params) if p.greedy]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        out[rows, logits[rows].argmax(-1)] = 1.0
    rows = [row for row, p in enumerate(params) if not p.greedy]
    if rows:
        probs, order, cdf, keep = _kept(logits[rows], [params[r] for r in rows])
        kept = torch.arange(logits.shape[1], device=logits.device)[None] < keep[:, None]
        mass = torch.where(kept, probs, 0.0) / cdf.gather(1, (keep - 1)[:, None])
        out[torch.tensor(rows, device=logits.device)] = torch.zeros_like(mass).scatter(1, order, mass)
    return out


def _kept(logits: torch.Tensor, params: Sequence[SamplingParams]):
    """Each row's probabilities after temperature in descending order (ties by token id): (probs, order, cdf, keep),
    keep = how many lead tokens top-k and top-p keep."""
    device, vocab = logits.device, logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float64, device=device)
    probs = torch.softmax(logits.double() / temperature[:, None], dim=-1)
    probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cdf = torch.cumsum(probs, dim=-1)
    keep = torch.tensor([p.top_k if p.top_k else vocab for p in params], device=device).clamp(max=vocab)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device)
    nucleus = ((cdf - probs) < top_p[:, None]).sum(-1)  # tokens whose more likely ones hold less than top_p
    keep = torch.where(top_p < 1, torch.minimum(keep, nucleus), keep)
    return probs, order, cdf, keep


def _sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], draws: Sequence[float]) -> torch.Tensor:
    """Inverse-CDF sampling over each row's kept tokens, in descending probability order (ties by token id), on the
    logits' device for all rows at once: every operation is along a row, so a row's token does not depend on the
    others. Each row takes one uniform draw (`uniform` of its request's generator, on the host). Returns the tokens
    [R] (int64) on the logits' device."""
    _, order, cdf, keep = _kept(logits, params)
    total = cdf.gather(1, (keep - 1)[:, None])  # the kept mass
    u = torch.tensor(list(draws), dtype=torch.float64, device=logits.device)[:, None] * total
    index = torch.minimum(torch.searchsorted(cdf, u), (keep - 1)[:, None])
    return order.gather(1, index)[:, 0]
