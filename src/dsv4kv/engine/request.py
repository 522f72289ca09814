"""A request's state (its token ids, how many the cache holds, its timings) and what the engine reports."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..cache.transfer import RequestState
from .params import SamplingParams

__all__ = ["Status", "Request", "RequestOutput", "StepOutput"]


class Status(enum.Enum):
    WAITING = "waiting"  # not in the cache: new, or preempted (its tokens are recomputed on readmission)
    RUNNING = "running"  # holds a cache slot and blocks
    SWAPPED = "swapped"  # preempted by swap: its cache state is in host memory, its cache id kept
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestOutput:
    """What a request produced. Times are seconds (host clock, `time.perf_counter`)."""

    request_id: int
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # the generated tokens (a stop token included)
    finished: bool
    finish_reason: str | None  # "stop" (a stop token), "length" (max_new_tokens or max_seq_len), "abort"; None while running
    # tokens not prefilled at its (last) admission: served from the prefix cache, or the tokens its cache file held
    # (add_request(..., cache_file=path)); 0 otherwise
    cached_tokens: int
    ttft: float | None  # time to first token, from add_request
    itl: float | None  # mean time between consecutive tokens (None below two tokens)
    preemptions: int  # times the request was preempted (swapped out, or released and recomputed later)
    # with SamplingParams.logprobs > 0 (else None): per generated token, its position's top-`logprobs` (token id,
    # logprob) pairs, best first, and the generated token's own logprob (log_softmax of the fp32 logits)
    logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    token_logprobs: tuple[float, ...] | None = None


class StepOutput(NamedTuple):
    """One request's progress in one `Engine.step`."""

    request_id: int
    new_token_ids: tuple[int, ...]
    finished: bool


@dataclass(eq=False)
class Request:
    id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    generator: torch.Generator | None  # CPU; only sampled (temperature > 0) requests draw from it
    arrival: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)  # prompt + generated: the sequence the cache must hold
    status: Status = Status.WAITING
    cache_id: int | None = None  # CacheManager request id while RUNNING or SWAPPED
    num_computed: int = 0  # leading tokens already in the cache
    cached_tokens: int = 0  # at the last admission: served from the prefix cache (whole blocks) or its cache file
    cache_state: RequestState | None = None  # a checked cache file's state, imported at admission (then dropped)
    keep_cache: bool = False  # keep a host copy of its cache state when it finishes (`Engine.save` after finishing)
    kept_state: RequestState | None = None
    finish_reason: str | None = None
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0
    keep_logits: bool = False  # keep `logits` when the last prompt token goes in (`Engine.next_token_logits`)
    logits: torch.Tensor | None = None  # fp32 [vocab], on the engine's device
    logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)  # per generated token (if asked)
    token_logprobs: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def pending(self) -> int:
        """Tokens to feed before the next one can be sampled: 1 while decoding, more during (re)prefill."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def output(self) -> RequestOutput:
        times = self.token_times
        return RequestOutput(
            request_id=self.id, prompt_token_ids=self.prompt, token_ids=tuple(self.tokens[len(self.prompt):]),
            finished=self.finished, finish_reason=self.finish_reason, cached_tokens=self.cached_tokens,
            ttft=times[0] - self.arrival if times else None,
            itl=(times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
            preemptions=self.preemptions,
            logprobs=tuple(self.logprobs) if self.params.logprobs else None,
            token_logprobs=tuple(self.token_logprobs) if self.params.logprobs else None)
