"""SamplingParams: how one request's tokens are chosen and when it stops."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

__all__ = ["SamplingParams", "MAX_LOGPROBS"]

MAX_LOGPROBS = 64  # the most top tokens a request may ask log-probabilities of, per generated token


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings.

    Args:
        max_new_tokens: tokens to generate at most (the request also stops when the cache's
            `max_seq_len` is reached: finish reason "length").
        temperature: 0 is greedy (argmax of the fp32 logits); > 0 samples from softmax(logits / temperature).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1 = all).
        top_k: keep the k most likely tokens (0 = all).
        seed: seeds this request's own generator, so the same seed gives the same tokens whatever else
            runs in the batch; None draws a fresh seed when the request is added.
        stop_token_ids: generation stops after emitting one of these (it is kept in the output). Ints >= 0 here;
            the engine, which knows the vocabulary, refuses ids outside it.
        logprobs: 0 (default) or up to MAX_LOGPROBS: with each generated token, the log-probabilities of that
            position's `logprobs` most likely tokens (at most the vocabulary), best first, and the sampled token's
            own (`RequestOutput.logprobs`, `token_logprobs`). They are log_softmax of the model's fp32 logits, before
            temperature, top-k or top-p (vLLM's default); asking for them does not change the tokens.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0

    def __post_init__(self):
        if not _is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens: expected a positive int, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: expected a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0 (0 = no limit), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2 ** 63):
            raise ValueError(f"seed: expected None or an int in [0, 2**63), got {self.seed!r}")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__"):
            raise ValueError(f"stop_token_ids: expected a sequence of token ids, got {stops!r}")
        stops = tuple(stops)
        if not all(_is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"stop_token_ids: expected int token ids >= 0 (a float or bool is not a token id), "
                             f"got {stops!r}")
        if not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs: expected an int in [0, {MAX_LOGPROBS}] (0 = none), got {self.logprobs!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "logprobs", int(self.logprobs))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
