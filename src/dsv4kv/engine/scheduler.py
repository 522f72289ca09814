"""Scheduler: which requests run in the next step, and how many tokens each. It touches no tensor.

Continuous batching under a token budget (`step_tokens`) per step:

1. every running request with one pending token (a decode) gets it, in admission order; with speculative
   decoding, each then also gets its draft tokens (`lookahead`) while the budget and the free blocks last;
2. running requests with several pending tokens (prompt, or recompute after preemption) get prefill
   chunks in arrival order, while the budget lasts;
3. waiting requests are admitted in arrival order while a cache slot is free, the budget is not spent
   and the blocks for all their tokens are free (less a prefix hit's blocks that live requests hold), and get
   a first chunk. A request added with a cache file is admitted by importing the file's state
   (`CacheManager.import_request`) and is fed only the tokens past it.

When a running request's tokens need more blocks than are free, the most recently admitted request is
preempted, by recompute or by swap (`preemption`):

- recompute: its slot and blocks go back to the cache, it returns to the waiting queue (by arrival), and when
  readmitted its prompt and generated tokens are recomputed, so its output is unchanged;
- swap: `CacheManager.swap_out` copies its blocks, window ring and compressor state to host memory and frees
  them; it keeps its cache id and its computed tokens, and `swap_in` brings it back bit for bit;
- auto: recompute when at most `page_tokens` of its tokens would be prefilled again (a short request, or one
  whose tokens are cached but for the last partial block), swap otherwise.

A swap the host budget (`swap_bytes`) cannot take falls back to recompute. Swapped requests come back, oldest
first, before any waiting request is admitted, each once a slot and the blocks for all its tokens are free. A
prefill chunk shrinks to the blocks that are free before it preempts anyone.

With prefix caching, admission maps the longest cached prefix of the request's tokens (whole blocks) into its
cache and only the rest is fed; a preempted request readmitted so hits its own published blocks, so its
recompute is mostly served from the cache.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from ..checks import positive_int
from ..cache.manager import CacheManager
from ..cache.swap import NoRoom
from .request import Request, Status

__all__ = ["Scheduler", "ScheduledStep", "PREEMPTION"]

PREEMPTION = ("recompute", "swap", "auto")


@dataclass
class ScheduledStep:
    batch: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens), decodes first
    preempted: list[Request] = field(default_factory=list)  # by either kind
    swapped_out: list[Request] = field(default_factory=list)  # those of `preempted` swapped to host memory
    swapped_in: list[Request] = field(default_factory=list)  # swapped requests brought back in this step
    swap_bytes: int = 0  # bytes copied to and from host memory in this step
    is_decode: bool = False  # every request feeds exactly its one pending token (a pure decode step)
    # every request is decoding, some with drafts after their pending token (speculative decoding's verify step)
    is_verify: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.batch)


class Scheduler:
    """Queues and the step decision over `cache`'s slots and blocks (asked through its integer API)."""

    def __init__(self, cache: CacheManager, *, step_tokens: int, preemption: str = "recompute"):
        if preemption not in PREEMPTION:
            raise ValueError(f"preemption: expected one of {', '.join(PREEMPTION)}, got {preemption!r}")
        self.cache = cache
        self.step_tokens = positive_int("step_tokens", step_tokens)
        self.preemption = preemption
        self.waiting: deque[Request] = deque()  # by arrival (request id)
        self.running: list[Request] = []  # by admission
        self.swapped: list[Request] = []  # in host memory, by arrival (request id)

    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        # preempted requests go back to their arrival place, ahead of later arrivals
        index = bisect.bisect([r.id for r in self.waiting], request.id)
        self.waiting.insert(index, request)

    def finish(self, request: Request, reason: str) -> None:
        """Take a request out (finished or aborted): its cache slot and blocks (or its host copy) are released."""
        if request.status is Status.RUNNING:
            self.cache.release(request.cache_id)
            self.running.remove(request)
        elif request.status is Status.SWAPPED:
            self.cache.release(request.cache_id)  # drops the host copy
            self.swapped.remove(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        request.cache_id = None
        request.status = Status.FINISHED
        request.finish_reason = reason

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self, lookahead: Mapping[Request, int] | None = None) -> ScheduledStep:
        """The next step's work. lookahead: speculative decoding's drafts per decoding request: after every decode's
        token, a decode also takes up to that many draft tokens while the budget and the free blocks last (a draft
        never preempts anyone, nor displaces a decode), before any prefill chunk."""
        step = ScheduledStep()
        chosen: dict[Request, int] = {}
        budget, free = self.step_tokens, self.cache.num_free_blocks
        decodes = [r for r in self.running if r.pending == 1]
        prefills = sorted((r for r in self.running if r.pending > 1), key=lambda r: r.id)
        for group in (decodes, prefills):
            for request in group:
                if budget == 0:
                    break
                if request.status is not Status.RUNNING:  # preempted earlier in this loop
                    continue
                want = min(request.pending, budget)
                while True:
                    n = self._fit(request, want, free)
                    if n == want or (n > 0 and request.pending > 1):
                        break
                    victim = self.running[-1]
                    free += self._need(victim, chosen.get(victim, 0))
                    budget += chosen.pop(victim, 0)
                    before = self.cache.num_free_blocks
                    self._preempt(victim, step)
                    free += self.cache.num_free_blocks - before  # its blocks, less those other requests share
                    if victim is request:
                        break
                if request.status is Status.RUNNING:
                    chosen[request] = n
                    budget -= n
                    free -= self._need(request, n)
            if group is decodes and lookahead:
                for request in decodes:
                    drafts = lookahead.get(request, 0)
                    if drafts <= 0 or chosen.get(request) != 1 or budget == 0:
                        continue
                    own = self._need(request, 1)  # the blocks its token already counted
                    n = self._fit(request, 1 + min(drafts, budget), free + own)
                    chosen[request] = n
                    budget -= n - 1
                    free += own - self._need(request, n)
        # swapped requests come back first, oldest first; none is admitted while one of them waits for room
        while self.swapped and budget > 0 and len(self.running) < self.cache.max_requests:
            request = self.swapped[0]
            spec = self.cache.spec
            taken = self.cache.swap_in_blocks(request.cache_id)
            if taken + spec.blocks_for(request.num_tokens) - spec.blocks_for(request.num_computed) > free:
                break
            before = self.cache.num_free_blocks
            moved = self.cache.swap_in(request.cache_id)
            if not moved:  # NoRoom: every slot is held outside this scheduler
                break
            free += self.cache.num_free_blocks - before
            self.swapped.pop(0)
            request.status = Status.RUNNING
            self.running.append(request)
            step.swapped_in.append(request)
            step.swap_bytes += moved
            n = min(request.pending, budget)
            chosen[request] = n
            budget -= n
            free -= self._need(request, n)
        while not self.swapped and self.waiting and budget > 0 and len(self.running) < self.cache.max_requests:
            request = self.waiting[0]
            if request.cache_state is not None:
                need = self.cache.spec.blocks_for(request.num_tokens)
            else:
                need = self.cache.admission_blocks(request.tokens)
            if need > free:
                break
            before = self.cache.num_free_blocks
            cache_id = self._admit(request)
            if cache_id is None:  # every slot is held outside this scheduler
                break
            free += self.cache.num_free_blocks - before  # a hit takes unreferenced cached blocks out of the free ones
            self.waiting.popleft()
            request.cache_id, request.status = cache_id, Status.RUNNING
            self.running.append(request)
            n = min(request.pending, budget)
            chosen[request] = n
            budget -= n
            free -= self._need(request, n)
        step.batch = list(chosen.items())
        step.is_decode = bool(step.batch) and all(n == 1 and r.pending == 1 for r, n in step.batch)
        step.is_verify = (bool(step.batch) and all(r.pending == 1 for r, _ in step.batch)
                          and any(n > 1 for _, n in step.batch))
        return step

    def _admit(self, request: Request) -> int | None:
        """The request's cache id, with `num_computed` and `cached_tokens` set, or None when no slot is free."""
        state = request.cache_state
        if state is None:
            # with prefix caching the longest cached prefix of prompt + generated tokens is mapped in (a
            # preempted request hits its own published blocks)
            cache_id = self.cache.admit(request.tokens if self.cache.prefix is not None else None)
            if cache_id is not None:
                request.num_computed = request.cached_tokens = self.cache.cached_tokens(cache_id)
            return cache_id
        cache_id = self.cache.import_request(state)  # checked when the request was added
        if isinstance(cache_id, NoRoom):
            return None
        if self.cache.prefix is not None:  # the state holds the ids of its own tokens; the rest are fed
            self.cache.append_tokens(cache_id, request.tokens[state.length:])
        request.cache_state = None  # in the cache now; a preemption by recompute recomputes every token
        request.num_computed = request.cached_tokens = state.length
        return cache_id

    # --- block arithmetic (the manager holds ceil(length / page_tokens) blocks per request) -------
    def _held(self, request: Request) -> int:
        return len(self.cache.blocks(request.cache_id))

    def _need(self, request: Request, n: int) -> int:
        """New blocks `request` takes to hold n more tokens."""
        if n == 0:
            return 0
        return self.cache.spec.blocks_for(request.num_computed + n) - self._held(request)

    def _fit(self, request: Request, n: int, free: int) -> int:
        """The most tokens, up to n, whose new blocks fit in `free`."""
        room = (self._held(request) + free) * self.cache.spec.page_tokens - request.num_computed
        return max(0, min(n, room))

    def _preempt(self, request: Request, step: ScheduledStep) -> None:
        self.running.remove(request)
        request.preemptions += 1
        step.preempted.append(request)
        if self._swaps(request):
            moved = self.cache.swap_out(request.cache_id)
            if moved:  # not NoRoom (host budget short): then recompute
                request.status = Status.SWAPPED
                bisect.insort(self.swapped, request, key=lambda r: r.id)
                step.swapped_out.append(request)
                step.swap_bytes += moved
                return
        self.cache.release(request.cache_id)
        request.cache_id, request.num_computed = None, 0
        self.add(request)

    def _swaps(self, request: Request) -> bool:
        """Whether the policy swaps `request` out rather than recomputing it later."""
        if self.preemption != "auto":
            return self.preemption == "swap"
        cached = self.cache.lookup(request.tokens) if self.cache.prefix is not None else 0
        return request.num_tokens - cached > self.cache.spec.page_tokens
