"""Engine: token ids in, token ids out, for many requests at once over one paged cache.

    engine = Engine.from_transformers(model, max_requests=8, max_tokens=65536)
    outputs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=32))

or online: `add_request(prompt, params) -> id`, `step() -> [StepOutput(id, new tokens, finished)]`,
`abort(id)`, `output(id) -> RequestOutput`. `save(id, path)` writes a request's cache to a file and
`add_request(prompt, params, cache_file=path)` starts a request from one (engine/cache_files.py). Each step the
scheduler picks the work, the runner computes the logits of each request's last new token, and the sampler picks the
tokens. `next_token_logits(prompts)` returns the logits themselves: what this engine (its formats, kernels and step
budget) computes after each prompt.

With speculative decoding (`speculative=`, docs/speculative-decoding.md) a drafter proposes tokens before each step,
each decoding request feeds its newest token and its drafts as a tentative step, and the engine keeps the drafts the
model's own tokens confirm (`speculative_sampling`), accepting them in the cache (`CacheManager.accept`).
"""

from __future__ import annotations

import numbers
import os
import secrets
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..checks import positive_int
from ..cache.layout import IndexerFormat, KVFormat
from ..cache.manager import CacheManager, RequestError
from ..cache.files import save_request
from ..cache.transfer import RequestState
from ..cache.spec import DEFAULT_PAGE_TOKENS
from .cache_files import checked_for_prompt, request_state, state_for_prompt, state_to_save
from .model import DSV4Model
from .params import SamplingParams
from .request import Request, RequestOutput, Status, StepOutput
from .drafters import Drafter, ObservedRows
from .runner import ModelRunner, default_graph_sizes
from .sampler import sample_with_logprobs
from .scheduler import Scheduler
from .speculative import Speculator
from .speculative_sampling import accepted_prefix, advance, peek_uniforms

__all__ = ["Engine", "EngineStats"]


@dataclass
class EngineStats:
    """Counters since the engine was made. Prefill tokens include recomputed ones (after a preemption by recompute)."""

    steps: int = 0
    decode_steps: int = 0  # steps that only decoded (one token per request, or with speculation a verify)
    graph_steps: int = 0  # decode steps served by a DecodeStepGraph (replayed on CUDA)
    prefill_tokens: int = 0
    # tokens decoding requests emitted: one per plain decode, a verify's accepted drafts and the model's own token up to
    # a stop token, max_new_tokens or max_seq_len (those it kept in its cache past a stop token are not counted), so
    # the same as plain decoding's for the same tokens
    decode_tokens: int = 0
    preemptions: int = 0  # of both kinds: swap_preemptions + recompute_preemptions
    swap_preemptions: int = 0  # swapped out to host memory (CacheManager.swap_out)
    recompute_preemptions: int = 0  # released, recomputed on readmission (a swap refused by the host budget included)
    swap_ins: int = 0  # swapped requests brought back
    swap_bytes: int = 0  # bytes copied to host memory and back (each swap counts both ways)
    prefill_seconds: float = 0.0  # wall time of steps holding any prefill chunk
    decode_seconds: float = 0.0  # wall time of decode-only steps
    tokens_in_prefill_steps: int = 0  # every token of those steps, decode tokens riding along included
    # prefix caching (all 0 with it off): admissions with a cache lookup (readmissions after a preemption
    # included), their tokens, those that hit, the tokens served from the cache (not prefilled), and evictions
    prefix_queries: int = 0
    prefix_query_tokens: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    prefix_evicted_blocks: int = 0
    # speculative decoding (all 0 with it off): draft tokens fed to verify steps, the tokens verifies emitted beyond
    # their first (the decode steps they saved; a verify whose first token stops its request saved none, whatever it
    # accepted), requests verified (one request's drafts checked in one step) and steps holding any verify
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verifies: int = 0
    verify_steps: int = 0
    verify_seconds: float = 0.0  # wall time of the steps holding any verify (counted in decode_seconds too)
    tokens_in_verify_steps: int = 0  # decode tokens (as decode_tokens) those steps emitted, plain decodes included

    @property
    def acceptance_length(self) -> float:
        """Tokens a verify emits on average: 1 + accepted_tokens / verifies (0.0 with no verify)."""
        return 1 + self.accepted_tokens / self.verifies if self.verifies else 0.0

    @property
    def acceptance_rate(self) -> float:
        """accepted_tokens over draft_tokens (0.0 with none proposed)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Tokens served from the prefix cache over tokens offered at admission (0.0 with caching off)."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


@dataclass(eq=False)
class _Work:
    """One request's part of a step."""

    request: Request
    n: int  # tokens it feeds
    tokens: list[int]  # those tokens: its pending ones, then (a verify) its drafts
    drafts: list[int]  # the drafts among them (empty: not a verify)
    rows: int  # logits rows asked for: a verify's every row, else its last
    ready: bool  # it gets tokens in this step
    kept: int  # tokens its cache keeps (a verify: set once its drafts are checked)
    decoding: bool  # it feeds its one pending token (and, a verify, drafts after it)
    row: int = 0  # its first row in the step's sampler batch
    emit: int = 0  # tokens it emits

    @classmethod
    def of(cls, request: Request, n: int, drafts: Sequence[int]) -> "_Work":
        c = request.num_computed
        if request.pending == 1 and n > 1:
            drafts = list(drafts)[:n - 1]
            return cls(request, n, request.tokens[c:] + drafts, drafts, n, True, n, True)
        return cls(request, n, request.tokens[c:c + n], [], 1, request.pending == n, n, request.pending == 1)


class Engine:
    """Serves a `DSV4Model` over a `CacheManager` made for it.

    Args:
        model: the model (see `from_transformers`, `from_pretrained`).
        max_requests, max_tokens, kv_format, indexer_format, page_tokens: the cache (`CacheManager`).
        device: default the model's; the model is moved there (its per-token modules with it).
        step_tokens: token budget of one step: decode tokens first, then prefill chunks.
        max_seq_len: longest request (prompt + generated); default min(max_tokens, the model's positions), and
            never more than the cache's blocks hold.
        decode_graph_sizes: decode batch sizes served by a padded `DecodeStepGraph`; default: powers of two
            up to max_requests when the attention runs on the Triton kernels on CUDA (then captured as CUDA
            graphs), none otherwise. Given on a CPU, the padded steps run eagerly.
        prefix_caching: serve leading prompt blocks already in the cache (docs/prefix-caching.md): admission
            maps the longest cached prefix in and only the rest is prefilled; `RequestOutput.cached_tokens` and
            the `stats.prefix_*` counters report the hits. Needs the model's window <= page_tokens. Default off.
        prefix_snapshots: boundary snapshots the prefix cache keeps (default max_requests; needs prefix_caching).
        preemption: how a request is preempted when the cache runs out of blocks: "recompute" (default: release
            it, recompute prompt + generated tokens on readmission), "swap" (its cache state to host memory and
            back, bit for bit: `CacheManager.swap_out` / `swap_in`) or "auto" (recompute when at most page_tokens
            of its tokens would be prefilled again, swap otherwise). A swap the host budget cannot take recomputes.
        swap_bytes: host memory swapped-out requests may hold (default: no limit; needs a preemption that swaps).
        speculative: speculative decoding (docs/speculative-decoding.md): None (default, off), "ngram" (prompt
            lookup), "mtp" (the checkpoint's MTP layer: `from_pretrained` only) or a `Drafter`. Each decode step of
            a request then feeds its newest token and up to `draft_tokens` drafts, and keeps the drafts the model
            itself would have generated: greedy tokens are those of plain decoding, sampled ones follow the same
            distribution (with a seed, the same tokens). `stats` counts drafts proposed and accepted.
        draft_tokens: the most drafts a request feeds per step, k >= 0 (default 3; 1 + k within step_tokens and
            within what the cache can roll back, `CacheManager.max_tentative_tokens`: 8 for V4's CSA layers).
    """

    def __init__(self, model: DSV4Model, *, max_requests: int, max_tokens: int,
                 kv_format: KVFormat | str = KVFormat.FP8, indexer_format: IndexerFormat | str = IndexerFormat.MXFP4,
                 device: torch.device | str | None = None, page_tokens: int | None = None, step_tokens: int = 1024,
                 max_seq_len: int | None = None, decode_graph_sizes: Sequence[int] | None = None,
                 prefix_caching: bool = False, prefix_snapshots: int | None = None, preemption: str = "recompute",
                 swap_bytes: int | None = None, speculative: str | Drafter | None = None,
                 draft_tokens: int | None = None):
        if not isinstance(model, DSV4Model):
            raise TypeError(f"model: expected a DSV4Model, got {type(model).__name__}")
        draft_tokens = Speculator.check(speculative, draft_tokens, step_tokens)
        drafter = Speculator.drafter_for(speculative) if speculative is not None else None
        if device is not None:
            model.to(device)
        self.model = model
        geometry = model.geometry
        max_tokens = positive_int("max_tokens", max_tokens)
        max_seq_len = min(max_tokens, geometry.max_position) if max_seq_len is None else max_seq_len
        if swap_bytes is not None and preemption == "recompute":
            raise ValueError("swap_bytes: given with preemption='recompute' (nothing is swapped)")
        self.cache = CacheManager(geometry, max_requests=max_requests, max_tokens=max_tokens, kv_format=kv_format,
                                  indexer_format=indexer_format, device=model.device,
                                  page_tokens=page_tokens or DEFAULT_PAGE_TOKENS, max_seq_len=max_seq_len,
                                  prefix_caching=prefix_caching, prefix_snapshots=prefix_snapshots,
                                  swap_bytes=swap_bytes)
        self.prefix_caching = prefix_caching
        # the longest request: what the cache's positions and all of its blocks can hold (so a request alone
        # always fits, and the scheduler can always make progress with the oldest one)
        self.max_seq_len = min(self.cache.max_seq_len, self.cache.num_blocks * self.cache.spec.page_tokens)
        self.scheduler = Scheduler(self.cache, step_tokens=step_tokens, preemption=preemption)
        kernels = all(layer.resolved_backend(self.cache.device) == "triton" for layer in model.attention_layers)
        capture = self.cache.device.type == "cuda" and kernels
        if decode_graph_sizes is None:
            decode_graph_sizes = default_graph_sizes(self.cache.max_requests) if capture else ()
        sizes = [positive_int("decode_graph_sizes", b) for b in decode_graph_sizes]
        if any(b > self.cache.max_requests for b in sizes):
            raise ValueError(f"decode_graph_sizes: {sizes} exceed max_requests {self.cache.max_requests}")
        if 1 + draft_tokens > self.cache.max_tentative_tokens and drafter is not None:
            raise ValueError(f"draft_tokens: a verify step feeds 1 + {draft_tokens} tokens per request; the cache "
                             f"rolls back at most {self.cache.max_tentative_tokens} (its smallest ring: "
                             f"CacheManager.max_tentative_tokens)")
        if drafter is not None:
            drafter.bind(model, self.cache)
        self._speculator = Speculator(drafter, draft_tokens, model.vocab_size) if drafter is not None else None
        self.runner = ModelRunner(model, self.cache, graph_sizes=sizes, capture=capture and bool(sizes),
                                  max_seq_len=self.max_seq_len, verify_width=1 + draft_tokens if drafter else 0,
                                  streams=drafter is not None and drafter.needs_streams)
        if capture and sizes:  # every decode and verify graph captured now: no served step compiles or captures
            self.runner.warm_up()
        self.backend = "Triton kernels" if kernels else "PyTorch reference"
        self.stats = EngineStats()
        self._requests: dict[int, Request] = {}
        self._next_id = 0

    # --- construction -------------------------------------------------------------------------------
    @classmethod
    def from_transformers(cls, model, *, max_requests: int, max_tokens: int, kv_format="fp8",
                          indexer_format="mxfp4", device=None, page_tokens=None, step_tokens: int = 1024,
                          prefix_caching: bool = False, **kwargs) -> "Engine":
        """An engine over transformers' `DeepseekV4ForCausalLM`: its per-token modules are shared (not copied),
        its attention layers are copied into `DSV4Attention` layers over the engine's cache."""
        return cls(DSV4Model.from_transformers(model), max_requests=max_requests, max_tokens=max_tokens,
                   kv_format=kv_format, indexer_format=indexer_format, device=device, page_tokens=page_tokens,
                   step_tokens=step_tokens, prefix_caching=prefix_caching, **kwargs)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, max_requests: int, max_tokens: int,
                        dtype: torch.dtype = torch.bfloat16, device=None, **kwargs) -> "Engine":
        """An engine over a checkpoint folder (config.json + *.safetensors; transformers or official DeepSeek
        names; FP8 128x128 block weights dequantized). Weights load in `dtype` (norms, hyper-connections, sinks
        and biases in fp32), on `device` (default: CUDA when available). speculative="mtp" also reads the
        checkpoint's MTP layer (`mtp.*`; a checkpoint without one raises ValueError)."""
        from .checkpoint import load_pretrained, load_pretrained_mtp

        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if kwargs.get("speculative") != "mtp":
            model = load_pretrained(path, dtype=dtype, device=device)
            return cls(model, max_requests=max_requests, max_tokens=max_tokens, **kwargs)
        from .mtp import MTPDrafter

        model, layer = load_pretrained_mtp(path, dtype=dtype, device=device)
        if layer is None:
            raise ValueError(f"speculative='mtp': the checkpoint at {os.fspath(path)!r} has no MTP layer (no mtp.* "
                             "weights); use speculative='ngram', or a checkpoint that ships its MTP layer")
        return cls(model, max_requests=max_requests, max_tokens=max_tokens,
                   **{**kwargs, "speculative": MTPDrafter(layer)})

    # --- online API ---------------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None, *,
                    cache_file: str | os.PathLike | None = None, cache_state: RequestState | None = None,
                    keep_cache: bool = False) -> int:
        """Queue a request; returns its id. A bad prompt or params raise ValueError / TypeError and change nothing.

        cache_file: a file `save` wrote (this engine's cache geometry and formats) whose token ids are a prefix of
            `prompt`, shorter than it: the request starts from the file's cache and only the rest of the prompt is
            prefilled (`RequestOutput.cached_tokens` counts the file's tokens). Read and checked in full here; an
            unreadable, corrupted, mismatched or non-prefix file raises ValueError and changes nothing.
        cache_state: the same from a `RequestState` in memory (`export`, or received from another process:
            `cache.distributed`), checked the same way; not with cache_file.
        keep_cache: when the request finishes, keep a host copy of its cache so that `save` works until its
            output is read (a finished request's blocks are released at once otherwise).
        """
        prompt, params = self._check_prompt(prompt), self._check_params(params)
        if not isinstance(keep_cache, bool):
            raise TypeError(f"keep_cache: expected a bool, got {type(keep_cache).__name__}")
        if cache_file is not None and cache_state is not None:
            raise ValueError("cache_file and cache_state: give one of them")
        if cache_state is not None and not isinstance(cache_state, RequestState):
            raise TypeError(f"cache_state: expected a RequestState, got {type(cache_state).__name__}")
        state = state_for_prompt(self.cache, cache_file, prompt) if cache_file is not None else \
            checked_for_prompt(self.cache, cache_state, prompt, "cache_state") if cache_state is not None else None
        request_id = self._add(prompt, params)
        self._requests[request_id].cache_state, self._requests[request_id].keep_cache = state, keep_cache
        return request_id

    def save(self, request_id: int, path: str | os.PathLike) -> None:
        """Write the request's cache (the tokens it holds: prompt and generated tokens but the last) to a
        safetensors file at `path`, for `add_request(..., cache_file=path)` here or in another engine of the same
        cache geometry and formats. A running request is saved as it is between steps; a finished one only if it was
        added with keep_cache=True and its output not read yet. RequestError for an unknown id or a request
        holding nothing to save (waiting, swapped out, finished without keep_cache)."""
        save_request(self.export(request_id), path)

    def export(self, request_id: int) -> RequestState:
        """What `save` writes, in memory: a host copy of the request's cache state with the ids of the tokens it holds,
        for `add_request(..., cache_state=)` here or in another engine of the same cache geometry and formats. The
        same requests as `save`, the same errors."""
        return state_to_save(self.cache, self._request(request_id))

    def cache_request_id(self, request_id: int) -> int:
        """The `CacheManager` id of a running request (its pages: `export_request`, `cache.distributed`'s sender).
        RequestError for an unknown id or a request holding no cache now (waiting, swapped out or finished)."""
        request = self._request(request_id)
        if request.status is not Status.RUNNING or request.cache_id is None:
            raise RequestError(f"request {request_id} holds no cache now ({request.status.name.lower()})")
        return request.cache_id

    def step(self) -> list[StepOutput]:
        """Run one step; returns the requests that got tokens in it (several for a speculative step's accepted
        drafts)."""
        start = time.perf_counter()  # the step's time includes its drafter's
        # with speculation, drafts first (checked: a drafter's bug raises before anything is scheduled); the
        # scheduler gives each decode its drafts where the budget and the free blocks allow
        drafts = self._speculator.propose(self.scheduler.running, self.max_seq_len) if self._speculator else {}
        scheduled = self.scheduler.schedule({r: len(d) for r, d in drafts.items()} if drafts else None)
        s = self.stats
        s.preemptions += len(scheduled.preempted)
        s.swap_preemptions += len(scheduled.swapped_out)
        s.recompute_preemptions += len(scheduled.preempted) - len(scheduled.swapped_out)
        s.swap_ins += len(scheduled.swapped_in)
        s.swap_bytes += scheduled.swap_bytes
        if self._speculator:
            for request in scheduled.preempted:  # it comes back from another position (or another cache slot)
                self._speculator.drafter.release(request.id)
        if not scheduled.batch:
            return []
        work = [_Work.of(request, n, drafts.get(request, ())) for request, n in scheduled.batch]
        tentative = any(w.drafts for w in work)
        if tentative and self.prefix_caching:  # the cache needs the id of every token it is fed
            for w in work:
                if w.drafts:
                    self.cache.append_tokens(w.request.cache_id, w.drafts)
        try:
            result = self.runner.run([(w.request.cache_id, w.tokens) for w in work],
                                     decode=scheduled.is_decode or scheduled.is_verify, rows=[w.rows for w in work],
                                     tentative=tentative)
            sampled = self._sample(work, result.logits)
        except BaseException:
            if tentative:  # else the cache would refuse every later step while the verify awaits its accepts
                self._reject_step(work)
            raise
        if tentative:  # each verify keeps its newest token and its accepted drafts, any other request all it fed
            for w in work:
                self.cache.accept(w.request.cache_id, w.kept)
        for w in work:
            if not w.decoding:
                s.prefill_tokens += w.n
            w.request.num_computed += w.kept
        now = time.perf_counter()
        outputs, observed = [], []
        streams = self._speculator is not None and self._speculator.drafter.needs_streams
        offset = 0  # the request's first row in the step's streams
        decoded = 0
        for w in work:
            request = w.request
            if w.emit:
                outputs.append(self._emit(request, sampled, w.row, w.emit, now))
                emitted = len(outputs[-1].new_token_ids)
                if w.decoding:  # what it emitted: a verify keeps the tokens past a stop token, but never emits them
                    decoded += emitted
                if w.drafts:
                    s.verifies += 1
                    s.draft_tokens += len(w.drafts)
                    s.accepted_tokens += emitted - 1
            if streams and not request.finished:
                begin = request.num_computed - w.kept  # the step's first position
                observed.append(ObservedRows(request.id, begin, request.tokens[begin + 1:begin + w.kept + 1],
                                             result.streams[offset:offset + w.kept], request.pending == 1))
            offset += w.n
        s.decode_tokens += decoded
        if observed:
            self._speculator.drafter.observe(observed)
        if tentative:
            s.verify_steps += 1
            s.verify_seconds += now - start
            s.tokens_in_verify_steps += decoded
        self._count_step(scheduled, now - start)
        return outputs

    def _reject_step(self, work: list[_Work]) -> None:
        """A verify step that failed before its accepts (the runner or the sampler raised): every request keeps none of
        its tokens, which leaves the cache as it was before the step (`CacheManager.accept`; a prefill chunk, kept
        all or none, keeps none), so the engine can go on from the requests' unchanged state. Keeping 0 also drops
        the ids of the tokens a request fed (its pending ones, not only its drafts): with prefix caching they are
        given back. A step that failed before its plan (nothing awaits accept) only forgets the drafts' ids (prefix
        caching recorded them before the step)."""
        awaiting = set(self.cache.awaiting_accept())
        for rid in awaiting:
            self.cache.accept(rid, 0)
        if self.prefix_caching:
            for w in work:
                if w.request.cache_id in awaiting:
                    self.cache.append_tokens(w.request.cache_id, w.request.tokens[w.request.num_computed:])
                elif w.drafts:
                    self.cache.forget_tokens(w.request.cache_id, len(w.request.tokens))

    def _sample(self, work: list[_Work], logits: torch.Tensor):
        """The tokens of every request that gets any (a verify's every row; another request's last row once its last
        pending token is in), in one sampler batch; sets each one's `row` and `emit`, and a verify's `kept`.
        logits: fp32 [sum(w.rows), vocab]. Returns the sampler's `Sampled` (None when no request gets a token)."""
        picked, params, generators, uniforms = [], [], [], []
        first = 0
        for w in work:
            if w.ready:
                w.row = len(picked)
                picked.extend(range(first, first + w.rows))
                params += [w.request.params] * w.rows
                generators += [w.request.generator] * w.rows
                # a sampled request's rows take its next draws; it spends only those of the tokens it emits
                uniforms += (peek_uniforms(w.request.generator, w.rows) if w.request.generator is not None
                             else [None] * w.rows)
                if w.request.keep_logits:  # a copy: the row is a view of the step's (or a decode graph's) logits
                    w.request.logits = logits[first + w.rows - 1].clone()
            first += w.rows
        if not picked:
            return None
        # read now: the logits may be a decode graph's buffer, which the next step overwrites. A decode or verify step
        # samples every row it asked for, in order (no gather); else the rows' index is copied without waiting for
        # the device (indexing by a list would copy it blocking, waiting for the step's kernels)
        if len(picked) != logits.shape[0] or picked[-1] != len(picked) - 1:
            index = torch.from_numpy(np.asarray(picked, dtype=np.int64))
            logits = logits[index.to(logits.device, non_blocking=True)]
        sampled = sample_with_logprobs(logits, params, generators, uniforms)
        for w in work:
            if w.ready:
                accepted = accepted_prefix(sampled.tokens[w.row:w.row + w.rows], w.drafts) if w.drafts else 0
                w.emit = accepted + 1
                if w.drafts:
                    w.kept = 1 + accepted
        return sampled

    def _emit(self, request: Request, sampled, row: int, count: int, now: float) -> StepOutput:
        """Append a request's new tokens (sampled rows row .. row + count - 1) one by one, as plain decoding would
        have generated them: it stops at a stop token, max_new_tokens or max_seq_len."""
        new = []
        for i in range(row, row + count):
            token = sampled.tokens[i]
            request.tokens.append(token)
            new.append(token)
            if request.params.logprobs:
                request.logprobs.append(sampled.logprobs[i])
                request.token_logprobs.append(sampled.token_logprobs[i])
            request.token_times.append(now)
            reason = self._finish_reason(request, token)
            if reason is not None:
                self._finish(request, reason)
                break
        if request.generator is not None:
            advance(request.generator, len(new))
        if not request.finished and self.prefix_caching:  # the cache needs the id of every token it is fed
            self.cache.append_tokens(request.cache_id, [new[-1]])
        return StepOutput(request.id, tuple(new), request.finished)

    def abort(self, request_id: int) -> None:
        """Stop a request now (finish reason "abort"), releasing its cache. Aborting a finished request does nothing;
        an unknown id raises RequestError."""
        request = self._request(request_id)
        if not request.finished:
            self._finish(request, "abort")

    def output(self, request_id: int) -> RequestOutput:
        """A request's output so far. Reading a finished request's output forgets the request."""
        request = self._request(request_id)
        if request.finished:
            del self._requests[request_id]
        return request.output()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # --- offline API --------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Serve every prompt to completion (with any requests already queued); outputs in prompt order. `params`:
        one SamplingParams for every prompt, or a list of one per prompt (None: the defaults). Every prompt and params
        is checked before any is queued."""
        prompts = self._check_prompts(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif isinstance(params, (str, bytes)) or not isinstance(params, Sequence):  # a dict included
            raise TypeError(f"params: expected a SamplingParams (or a list of them), got {type(params).__name__}")
        elif len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} SamplingParams for {len(prompts)} prompts")
        params = [self._check_params(q, f"params[{i}]") for i, q in enumerate(params)]
        ids = [self._add(prompt, q) for prompt, q in zip(prompts, params)]
        while not all(self._requests[i].finished for i in ids):
            self.step()
        return [self.output(i) for i in ids]

    def next_token_logits(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Teacher-forced: the fp32 logits [len(prompts), vocab] this engine computes for the token after each
        prompt, on the engine's device. Each prompt is served as a request of one greedy token through the
        scheduler, so its prefill takes the engine's path (its formats, kernels, step budget, chunks; with prefix
        caching on, its hits) and counts in `stats`; the requests are finished and forgotten on return. Refused
        (RuntimeError) while other requests are in flight: they would share the steps, and their step outputs would
        be consumed here. Prompts are checked as `generate` checks them, before any is queued."""
        prompts = self._check_prompts(prompts)
        if self.has_unfinished:
            raise RuntimeError("next_token_logits: other requests are in flight; finish or abort them first")
        params = SamplingParams(max_new_tokens=1)
        ids = [self._add(prompt, params, keep_logits=True) for prompt in prompts]
        while self.has_unfinished:
            self.step()
        rows = [self._requests.pop(i).logits for i in ids]
        return torch.stack(rows) if rows else torch.empty(0, self.model.vocab_size, device=self.cache.device)

    # --- internals ----------------------------------------------------------------------------------
    def _add(self, prompt: tuple[int, ...], params: SamplingParams, keep_logits: bool = False) -> int:
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            generator = torch.Generator().manual_seed(seed)
        request = Request(self._next_id, prompt, params, generator, keep_logits=keep_logits)
        self._next_id += 1
        self._requests[request.id] = request
        self.scheduler.add(request)
        return request.id

    def _finish(self, request: Request, reason: str) -> None:
        if request.keep_cache and request.status is Status.RUNNING:  # before its blocks are released
            request.kept_state = request_state(self.cache, request)
        self.scheduler.finish(request, reason)
        if self._speculator:
            self._speculator.drafter.release(request.id)

    def _finish_reason(self, request: Request, token: int) -> str | None:
        if token in request.params.stop_token_ids:
            return "stop"
        if request.num_generated >= request.params.max_new_tokens or request.num_tokens > self.max_seq_len:
            return "length"  # the cache cannot take the next token past max_seq_len
        return None

    def _count_step(self, scheduled, seconds: float) -> None:
        s = self.stats
        s.steps += 1
        prefix = self.cache.prefix_stats
        if prefix is not None:
            s.prefix_queries, s.prefix_query_tokens = prefix.queries, prefix.query_tokens
            s.prefix_hits, s.prefix_hit_tokens = prefix.hits, prefix.hit_tokens
            s.prefix_evicted_blocks = prefix.evicted_blocks
        if scheduled.is_decode or scheduled.is_verify:
            s.decode_steps += 1
            s.decode_seconds += seconds
            s.graph_steps += self.runner.last_graph
        else:
            s.prefill_seconds += seconds
            s.tokens_in_prefill_steps += scheduled.num_tokens

    def _request(self, request_id) -> Request:
        request = self._requests.get(request_id) if isinstance(request_id, numbers.Integral) else None
        if request is None:
            raise RequestError(f"unknown request id {request_id!r} (never added, or its finished output was read)")
        return request

    def _check_params(self, params, name: str = "params") -> SamplingParams:
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"{name}: expected a SamplingParams, got {type(params).__name__}")
        vocab = self.model.vocab_size  # SamplingParams checked the ids are ints >= 0; the engine knows the vocabulary
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"{name}.stop_token_ids: {len(bad)} outside the vocabulary [0, {vocab}), first {bad[0]}")
        return params

    def _check_prompts(self, prompts) -> list[tuple[int, ...]]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts: expected a list of token id lists, got {type(prompts).__name__}")
        return [self._check_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]

    def _check_prompt(self, prompt, name: str = "prompt") -> tuple[int, ...]:
        if isinstance(prompt, (torch.Tensor, np.ndarray)):  # 1-D integer arrays
            tensor = torch.as_tensor(prompt)
            if tensor.dim() != 1 or tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
                raise ValueError(f"{name}: expected a 1-D integer tensor, got {tensor.dtype} {list(tensor.shape)}")
            prompt = tensor.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise TypeError(f"{name}: expected a sequence of token ids, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError(f"{name}: empty prompt")
        vocab = self.model.embed_tokens.num_embeddings
        not_ints = [(i, t) for i, t in enumerate(prompt) if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if not_ints:  # a float (even 2.0) or a bool is not a token id
            i, t = not_ints[0]
            more = f" ({len(not_ints)} entries are not ints)" if len(not_ints) > 1 else ""
            raise ValueError(f"{name}: token ids must be ints in the vocabulary [0, {vocab}), got {t!r} "
                             f"(a {type(t).__name__}) at {i}{more}")
        bad = [(i, t) for i, t in enumerate(prompt) if not 0 <= t < vocab]
        if bad:
            i, t = bad[0]
            raise ValueError(f"{name}: {len(bad)} token ids outside the vocabulary [0, {vocab}), first {t!r} at {i}")
        if len(prompt) > self.max_seq_len:
            raise ValueError(f"{name}: {len(prompt)} tokens, the cache holds at most {self.max_seq_len} per request")
        return tuple(int(t) for t in prompt)
