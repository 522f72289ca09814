"""Drafters: what proposes the draft tokens a speculative step verifies (docs/speculative-decoding.md).

    drafter.propose([DraftRequest(id, tokens, max_drafts), ...]) -> [[draft ids], ...]   before each step
    drafter.observe([ObservedRows(...), ...])                                            after each step
    drafter.release(id)                                                                  when a request leaves

A drafter only proposes: the engine verifies every draft against the target model, so whatever a drafter proposes,
the engine's tokens are those of plain decoding (greedy), or drawn from the same distribution (sampling). A drafter
that guesses well only makes decoding faster.

`NgramDrafter` (prompt lookup) needs no weights: it finds the latest earlier occurrence of the request's last n tokens
(n from max_n down to min_n) and proposes the tokens that followed it. The model's own MTP layer is `mtp.MTPDrafter`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from ..checks import positive_int

__all__ = ["DraftRequest", "ObservedRows", "Drafter", "NgramDrafter"]


class DraftRequest(NamedTuple):
    """One request asking for drafts: `tokens` are its prompt and generated tokens (the last one is the token the
    next step feeds first, not yet in the cache; the request's own list: read it, never change it); propose at most
    `max_drafts` ids to follow it."""

    request_id: int  # the engine's id: stable across preemption
    tokens: Sequence[int]
    max_drafts: int


@dataclass(frozen=True)
class ObservedRows:
    """What one step kept of a request (`Drafter.observe`): the target model ran positions start .. start + n - 1
    and the cache kept them; `next_tokens[i]` is the token at position start + i + 1 (every one is known: the next
    prompt token, an accepted draft, or the token just generated) and `streams[i]` the target's last hidden streams
    at position start + i ([n, hc_mult, hidden], before the final hyper-head; a view of the step's buffers, read it
    during the call). `final`: the request's next step decodes (its last row is the newest token's position - 1)."""

    request_id: int
    start: int
    next_tokens: Sequence[int]
    streams: torch.Tensor | None
    final: bool


class Drafter(ABC):
    """The interface the engine drives (a subclass defines `propose`). `needs_streams`: `observe` reads the target's last hidden streams (the
    runner then keeps them). A drafter holds per-request state only through `observe` / `release`."""

    name = "drafter"
    needs_streams = False

    def bind(self, model, cache) -> None:
        """Called once by the engine that uses this drafter, with its model (`DSV4Model`) and `CacheManager`, before
        any other call: a drafter with a cache of its own sizes it here."""

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """At most `max_drafts` draft ids per request, in order (fewer, or none, when it has no guess)."""

    def observe(self, rows: Sequence[ObservedRows]) -> None:
        """The rows each request kept in the step just run (accepted drafts included, rejected ones not)."""

    def release(self, request_id: int) -> None:
        """Forget a request (finished, aborted, or preempted: it may come back, from any position)."""


class NgramDrafter(Drafter):
    """Prompt lookup: the latest earlier occurrence of the last n tokens, for n = max_n down to min_n, proposes the
    tokens that followed it (up to max_drafts; where they reach the last token, the match repeats with its period:
    the last n tokens occurring `period` tokens earlier too). Per request it keeps, for each n, the latest end of every
    n-gram seen (a dict updated with the tokens added since the last call), so a proposal costs O(new tokens), not
    O(context)."""

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n = positive_int("max_n", max_n)
        self.min_n = positive_int("min_n", min_n)
        if self.min_n > self.max_n:
            raise ValueError(f"min_n: {self.min_n} exceeds max_n {self.max_n}")
        self._index: dict[int, _NgramIndex] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self._propose_one(r) for r in requests]

    def release(self, request_id: int) -> None:
        self._index.pop(request_id, None)

    def _propose_one(self, request: DraftRequest) -> list[int]:
        tokens, k = request.tokens, request.max_drafts
        if k <= 0:
            return []
        if not tokens:
            return []
        index = self._index.get(request.request_id)
        if index is None or index.length > len(tokens) or (index.length and index.last != tokens[index.length - 1]):
            index = self._index[request.request_id] = _NgramIndex(self.min_n, self.max_n)  # a new or changed request
        index.extend(tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = index.ends[n].get(tuple(tokens[length - n:]))
            if end is not None:  # what followed; past the last token the match's period repeats (an n-gram at end
                period = length - end  # and at length: tokens[end + j] = tokens[end + j - period])
                return [int(tokens[end + j % period]) for j in range(k)]
        return []


class _NgramIndex:
    """For each n, the latest end e (exclusive) of every n-gram tokens[e - n:e] with e <= length - 1: the last token's
    own n-grams are left out, so a lookup finds an earlier occurrence with at least one token after it."""

    def __init__(self, min_n: int, max_n: int):
        self.ends: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.length = 0  # tokens seen
        self.last = None  # tokens[length - 1], to notice a request whose tokens were replaced

    def extend(self, tokens: Sequence[int]) -> None:
        length = len(tokens)
        for end in range(max(self.length, 1), length):  # ends up to length - 1, in order: the latest one wins
            for n, ends in self.ends.items():
                if end >= n:
                    ends[tuple(tokens[end - n:end])] = end
        self.length, self.last = length, tokens[length - 1]
