"""Verifying draft tokens so that the tokens kept follow the target model's distribution exactly.

A verify step gives the target's logits at k + 1 rows of one request: row j predicts the token after the request's
newest token and drafts 1 .. j. Speculative (rejection) sampling keeps draft j + 1 with probability
min(1, p_j(d) / q_j(d)), where p_j is the distribution the sampler draws from at row j and q_j the distribution the
draft was drawn from; at the first rejection it draws from normalize(max(p_j - q_j, 0)) instead and stops; when every
draft is kept it draws one more token from p_k. Each kept or drawn token is then distributed as p_j at its position.

Drafts without a distribution (every drafter here: n-gram lookup, MTP's argmax) have q_j one-hot at d. Then the test
"keep d with probability p_j(d), else draw from p_j without d" is exactly "draw t from p_j; keep d iff t = d, else
emit t": `accepted_prefix` verifies that way, drawing each row's token with the request's next uniform just as plain
sampling would (`sampler.sample_with_logprobs(..., uniforms=)`). So one uniform is spent per emitted token, in order,
and a seeded request gets the very tokens of plain decoding, greedy or sampled, with or without speculation (up to the
rounding of the verify step's logits against a decode step's). `rejection_sample` is the general rule, for drafts
drawn from a distribution q.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .sampler import uniform

__all__ = ["accepted_prefix", "peek_uniforms", "advance", "rejection_sample"]


def accepted_prefix(targets: Sequence[int], drafts: Sequence[int]) -> int:
    """How many leading drafts the target's own tokens accept: targets[j] is the token drawn at row j (after drafts
    1 .. j; len(targets) = len(drafts) + 1), and draft j + 1 is kept iff it equals targets[j]. The tokens emitted are
    targets[:accepted + 1]: the kept drafts and then the target's token at the first row that disagreed (or after the
    last draft)."""
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"targets: expected {len(drafts) + 1} rows for {len(drafts)} drafts, got {len(targets)}")
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return accepted


def peek_uniforms(generator: torch.Generator, n: int) -> list[float]:
    """The next n draws of `generator` (`sampler.uniform`), leaving it where it was: a verify step draws its rows'
    tokens with them, then `advance`s the generator by the tokens it emits."""
    state = generator.get_state()
    values = [uniform(generator) for _ in range(n)]
    generator.set_state(state)
    return values


def advance(generator: torch.Generator, n: int) -> None:
    """Spend n draws of `generator`, as emitting n sampled tokens does."""
    for _ in range(n):
        uniform(generator)


def rejection_sample(target: torch.Tensor, drafts: Sequence[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator) -> list[int]:
    """Speculative sampling of one request's verify rows.

    target: float64 [k + 1, vocab], row j the target's distribution after drafts 1 .. j (`sampler.probabilities`);
    drafts: the k draft ids; draft_probs: float64 [k, vocab], row j the distribution draft j + 1 was drawn from
    (None: one-hot at each draft). Returns the emitted tokens: the kept drafts, then one token drawn from the residual
    at the first rejection, or from target[k] when every draft is kept. Draws come from `generator` (CPU): one per
    draft tested, one per token drawn."""
    k = len(drafts)
    if target.dim() != 2 or target.shape[0] != k + 1:
        raise ValueError(f"target: expected [{k + 1}, vocab] for {k} drafts, got {list(target.shape)}")
    vocab = target.shape[1]
    if draft_probs is not None and tuple(draft_probs.shape) != (k, vocab):
        raise ValueError(f"draft_probs: expected [{k}, {vocab}], got {list(draft_probs.shape)}")
    bad = [d for d in drafts if not 0 <= d < vocab]
    if bad:
        raise ValueError(f"drafts: {bad[0]} is outside the vocabulary [0, {vocab})")
    target = target.double().cpu()
    q_all = draft_probs.double().cpu() if draft_probs is not None else None
    out: list[int] = []
    for j, d in enumerate(drafts):
        p = target[j]
        q = q_all[j] if q_all is not None else torch.nn.functional.one_hot(torch.tensor(d), vocab).double()
        if q[d] <= 0:
            raise ValueError(f"drafts[{j}] = {d} has probability 0 under its own draft distribution")
        if uniform(generator) * float(q[d]) < float(p[d]):  # kept with probability min(1, p(d) / q(d))
            out.append(int(d))
            continue
        residual = (p - q).clamp(min=0)
        out.append(_draw(residual if residual.sum() > 0 else p, generator))
        return out
    out.append(_draw(target[k], generator))
    return out


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """A token drawn from `weights` (float64 [vocab], not necessarily normalized) by inverse CDF, one uniform."""
    cdf = torch.cumsum(weights, dim=0)
    index = int(torch.searchsorted(cdf, torch.tensor([uniform(generator) * float(cdf[-1])], dtype=cdf.dtype),
                                   right=True))
    return min(index, weights.shape[0] - 1)
