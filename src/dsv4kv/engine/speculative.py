"""Speculative decoding's side of the engine (docs/speculative-decoding.md): which drafter, how many drafts each
decoding request may take, and the drafts checked before a step is scheduled.

A request may take k' = min(k, max_new_tokens - generated - 1, max_seq_len - tokens) drafts: a verify step feeds its
newest token and the k' drafts and emits at most k' + 1 tokens, so no draft reaches past what plain decoding would
generate or past what the cache holds. The scheduler may cut k' further (step budget, free blocks).
"""

from __future__ import annotations

import numbers
from typing import Sequence

from .drafters import DraftRequest, Drafter, NgramDrafter
from .request import Request

__all__ = ["Speculator", "SPECULATIVE", "DEFAULT_DRAFT_TOKENS"]

SPECULATIVE = ("ngram", "mtp")  # the drafters named by Engine(speculative=...)
DEFAULT_DRAFT_TOKENS = 3


class Speculator:
    """A drafter and the most drafts a request feeds per step (`draft_tokens`, k)."""

    def __init__(self, drafter: Drafter, draft_tokens: int, vocab_size: int):
        self.drafter, self.draft_tokens, self.vocab_size = drafter, draft_tokens, vocab_size

    @staticmethod
    def drafter_for(speculative) -> Drafter:
        """The drafter `speculative` names (a Drafter is itself). "mtp" needs the checkpoint's MTP layer, which
        only `Engine.from_pretrained` reads: here it raises, saying so."""
        if isinstance(speculative, Drafter):
            return speculative
        if speculative == "ngram":
            return NgramDrafter()
        raise ValueError("speculative='mtp': the MTP drafter needs the checkpoint's MTP layer (its mtp.* weights, "
                         "which transformers drops): load the checkpoint with Engine.from_pretrained(path, "
                         "speculative='mtp'), or pass speculative=MTPDrafter(layer) (engine.mtp)")

    @staticmethod
    def check(speculative, draft_tokens, step_tokens: int) -> int:
        """draft_tokens checked against `speculative` and the step budget: the k to use (DEFAULT_DRAFT_TOKENS when
        None). Raises on an unknown drafter name, k < 0, or 1 + k beyond step_tokens (a verify step would not fit)."""
        if speculative is None:
            if draft_tokens is not None:
                raise ValueError("draft_tokens: given without speculative (speculative decoding is off)")
            return 0
        if isinstance(speculative, str):
            if speculative not in SPECULATIVE:
                raise ValueError(f"speculative: expected None, one of {', '.join(map(repr, SPECULATIVE))} or a "
                                 f"Drafter, got {speculative!r}")
        elif not isinstance(speculative, Drafter):
            raise TypeError(f"speculative: expected None, a drafter name or a Drafter, got "
                            f"{type(speculative).__name__}")
        k = DEFAULT_DRAFT_TOKENS if draft_tokens is None else draft_tokens
        if not isinstance(k, numbers.Integral) or isinstance(k, bool) or k < 0:
            raise ValueError(f"draft_tokens: expected an int >= 0, got {draft_tokens!r}")
        if 1 + k > step_tokens:
            raise ValueError(f"draft_tokens: a verify step feeds 1 + {k} tokens per request, beyond the step budget "
                             f"step_tokens={step_tokens}")
        return int(k)

    def propose(self, running: Sequence[Request], max_seq_len: int) -> dict[Request, list[int]]:
        """Drafts for every running request that decodes next, checked: a drafter's bug (more drafts than asked,
        an id that is not an int in the vocabulary) raises ValueError before anything is scheduled."""
        asking = []
        for request in running:
            if request.pending != 1:
                continue
            k = min(self.draft_tokens, request.params.max_new_tokens - request.num_generated - 1,
                    max_seq_len - request.num_tokens)
            if k > 0:
                asking.append((request, k))
        if not asking:
            return {}
        proposals = self.drafter.propose([DraftRequest(r.id, r.tokens, k) for r, k in asking])
        if not isinstance(proposals, Sequence) or len(proposals) != len(asking):
            raise ValueError(f"drafter {self.drafter.name!r}: expected {len(asking)} draft lists, got "
                             f"{len(proposals) if isinstance(proposals, Sequence) else type(proposals).__name__}")
        drafts = {}
        for (request, k), proposal in zip(asking, proposals):
            proposal = list(proposal)
            if len(proposal) > k:
                raise ValueError(f"drafter {self.drafter.name!r}: {len(proposal)} drafts for request {request.id}, "
                                 f"at most {k} were asked")
            bad = [t for t in proposal if not isinstance(t, numbers.Integral) or isinstance(t, bool)
                   or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"drafter {self.drafter.name!r}: draft {bad[0]!r} for request {request.id} is not a "
                                 f"token id in the vocabulary [0, {self.vocab_size})")
            if proposal:
                drafts[request] = [int(t) for t in proposal]
        return drafts
