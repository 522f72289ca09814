"""ModelRunner: one step's token ids -> fp32 logits of each request's last new token(s), over one step plan.

Mixed and prefill steps run eagerly with a plan of their own size. Pure decode steps of up to
`max(graph_sizes)` requests run through a `DecodeStepGraph` of the smallest size that holds them: the
plan goes into that graph's persistent buffers (rows past the batch are padding: position -1, token 0,
harmless and discarded), and on CUDA the whole model step, embedding to logits, is captured once as a
CUDA graph and replayed. On a CPU the same padded path runs eagerly (nothing is captured), which is what
the CPU tests check.

Speculative decoding adds verify steps: every request feeds its newest token and up to k drafts, as a tentative
step (`CacheManager.plan_step(..., tentative=True)`; the engine then `accept`s each request's kept prefix), and the
logits of every one of those rows are returned. Such steps of up to `max(graph_sizes)` requests run through a
verify `DecodeStepGraph` of width 1 + k: a fixed capacity of batch x (1 + k) rows, each request's rows contiguous
and the padding after the last, so a step whose requests feed different numbers of drafts replays the same graph. The
runner can also return the last hidden streams of every row (`keep_streams`: the MTP drafter reads them).

The MoE runs as transformers' "batched_mm" experts inside a decode graph: its default loop over the
experts that were hit reads the routing back to the host, which a CUDA graph cannot hold.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Sequence

import numpy as np
import torch

from ..cache.manager import CacheManager
from ..cache.plan import OutOfBlocks
from ..model.graph import CapturedStep
from .model import DSV4Model

__all__ = ["ModelRunner", "DecodeStepGraph", "StepLogits", "default_graph_sizes", "final_streams", "head"]


def default_graph_sizes(max_requests: int) -> tuple[int, ...]:
    """Powers of two below max_requests, and max_requests itself."""
    sizes, b = [], 1
    while b < max_requests:
        sizes.append(b)
        b *= 2
    return tuple(sizes + [max_requests])


def _expert_configs(model: DSV4Model) -> dict:
    """The configs the MoEs of `model` read their experts implementation from (found once: a walk over every
    module costs a decode step ~1 ms of host time)."""
    return {id(m.config): m.config for m in model.modules()
            if hasattr(m, "gate_up_proj") and hasattr(getattr(m, "config", None), "_experts_implementation")}


@contextlib.contextmanager
def _experts_implementation(configs: dict, name: str):
    """Every MoE reading one of `configs` (`_expert_configs`) dispatches to transformers' `name` experts
    implementation inside the block."""
    saved = {key: config._experts_implementation for key, config in configs.items()}
    try:
        for config in configs.values():
            config._experts_implementation = name
        yield
    finally:
        for key, config in configs.items():
            config._experts_implementation = saved[key]


class StepLogits(NamedTuple):
    """What a step gives back: the logits of the rows asked for, and (a runner made with streams=True) every row's
    last hidden streams. Both may be views of a graph's buffers: read them before the next step."""

    logits: torch.Tensor  # fp32 [sum(rows), vocab]: each request's last rows[b] rows, in batch order
    streams: torch.Tensor | None  # [N, hc_mult, hidden]: every token row, before the final hyper-head


@torch.no_grad()
def final_streams(model: DSV4Model, input_ids: torch.Tensor, plan, cache: CacheManager) -> torch.Tensor:
    """`DSV4Model.forward` up to its last block: the streams [N, hc_mult, hidden] the final hyper-head collapses."""
    ids = input_ids[None]  # [1, N]
    streams = model.embed_tokens(ids).unsqueeze(2).expand(-1, -1, model.hc_mult, -1).contiguous()
    for block in model.blocks:
        streams = block(streams, ids, plan, cache)
    return streams[0]


@torch.no_grad()
def head(model: DSV4Model, streams: torch.Tensor) -> torch.Tensor:
    """The final hyper-head and norm of `DSV4Model.forward`: streams [R, hc_mult, hidden] -> hidden [R, hidden]."""
    return model.norm(model.hc_head(streams[None]))[0]


class DecodeStepGraph:
    """A decode step (width 1: one token per request) or a verify step (width 1 + k: each request its newest token
    and up to k drafts, planned tentative) of up to `batch` requests, through the whole model. streams=True: the step
    also returns every row's last hidden streams.

    capture=True (CUDA, every attention layer on the Triton kernels): the first step runs eagerly
    (compiling the kernels), the second is captured, later steps replay (a verify graph counts only full steps, each
    request feeding `width` tokens, until it is captured). capture=False: every step runs the same padded computation
    eagerly."""

    def __init__(self, model: DSV4Model, cache: CacheManager, batch: int, *, max_seq_len: int, capture: bool,
                 width: int = 1, streams: bool = False):
        self.model, self.cache, self.batch, self.width, self.streams = model, cache, batch, width, streams
        rows = batch * width
        self.buffers = cache.step_buffers(max_tokens=rows, max_requests=batch, max_seq_len=max_seq_len)
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=cache.device)
        # the step's token ids are staged in pinned memory and copied without a host sync (padding rows: 0)
        pinned = cache.device.type == "cuda"
        self._host_ids = torch.zeros(rows, dtype=torch.long, pin_memory=pinned)
        self._copied = torch.cuda.Event() if pinned else None
        self._expert_configs = _expert_configs(model)
        self._layer_indices = [layer.layer_index for layer in model.attention_layers]
        self.captured = CapturedStep(capture)

    @property
    def capture(self) -> bool:
        """Whether this step is captured as a CUDA graph (else every step runs eagerly)."""
        return self.captured.capture

    def run(self, batch: Sequence[tuple[int, Sequence[int]]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """batch: (cache request id, token ids) pairs, 1 token each (width 1) or 1 .. width (a verify step; at least
        one request feeds more than one) -> (fp32 logits [T, vocab], streams [T, hc_mult, hidden] or None) of the
        T = total tokens rows, each request's rows contiguous in batch order (views: use them before the next step)."""
        counts = [len(tokens) for _, tokens in batch]
        if self.width == 1:
            plan = self.cache.plan_step([(rid, 1) for rid, _ in batch], buffers=self.buffers)
        else:  # a decode step's plan has one row per request: the graph is captured for verify plans only
            plan = self.cache.plan_step([(rid, n) for (rid, _), n in zip(batch, counts)], buffers=self.buffers,
                                        tentative=True)
        if isinstance(plan, OutOfBlocks):
            raise RuntimeError(f"{'decode' if self.width == 1 else 'verify'} step: {plan} (the scheduler counted "
                               "them free)")
        total = sum(counts)
        self._stage([token for _, tokens in batch for token in tokens])
        if self.capture and self.captured.graph is None and any(n != self.width for n in counts):
            # the kernels take their paths from the plan's shape when captured (the indexer stacks the rows of a
            # request that brings several): a verify graph is captured over a full step only, every request feeding
            # `width` tokens (`warm_up` runs one before the first served step), and serves every verify step after
            logits, streams = self._forward(plan)
        else:
            logits, streams = self.captured.run(lambda: self._forward(plan), plan, self._layer_indices)
        return logits[:total], (streams[:total] if streams is not None else None)

    def warm_up(self, rids: Sequence[int]) -> None:
        """Compile this step's kernels and capture its graph (capture=True; else run it eagerly) before any served
        step: `rids` are `batch` live requests the cache holds nothing for and no other plan awaits; each feeds
        `width` tokens of id 0 as a tentative step, accepted with none kept, twice (the eager step, then the capture),
        which leaves every byte, block and table of the cache as it was (cache/rollback.py)."""
        if len(rids) != self.batch:
            raise ValueError(f"warm_up: {len(rids)} requests for a graph of {self.batch}")
        while self.captured.graph is None and self.captured.steps < 2:
            plan = self.cache.plan_step([(rid, self.width) for rid in rids], buffers=self.buffers, tentative=True)
            if isinstance(plan, OutOfBlocks):
                return  # too few blocks for a full step: the graph is captured over the first full served step
            try:
                self._stage([0] * (self.batch * self.width))
                self.captured.run(lambda: self._forward(plan), plan, self._layer_indices)
            finally:
                for rid in rids:
                    self.cache.accept(rid, 0)
            if not self.capture:
                return

    def _stage(self, tokens: list[int]) -> None:
        """The step's token ids into the graph's input (padding rows 0), staged in pinned memory on CUDA."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy may still read the staging buffer
        host = self._host_ids.numpy()
        host[:len(tokens)] = tokens
        host[len(tokens):] = 0
        self.input_ids.copy_(self._host_ids, non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()

    def _forward(self, plan) -> tuple[torch.Tensor, torch.Tensor | None]:
        with _experts_implementation(self._expert_configs, "batched_mm"):  # set only where Python runs: not a replay
            if not self.streams:
                return self.model.logits(self.model(self.input_ids, plan, self.cache)), None
            streams = final_streams(self.model, self.input_ids, plan, self.cache)
            return self.model.logits(head(self.model, streams)), streams


class ModelRunner:
    """Runs steps of `model` over `cache`. `graph_sizes`: decode batch sizes served by a `DecodeStepGraph`
    (empty: every step eager); `capture`: whether those graphs are captured (CUDA only); `max_seq_len`: the
    longest request, the graphs' fixed context bound (default the cache's). `verify_width` (1 + the most drafts a
    request feeds; 0: no speculation): verify steps of those batch sizes are served by verify graphs of that width.
    `streams`: every step also returns the last hidden streams (`StepLogits.streams`)."""

    def __init__(self, model: DSV4Model, cache: CacheManager, *, graph_sizes: Sequence[int] = (),
                 capture: bool = False, max_seq_len: int | None = None, verify_width: int = 0,
                 streams: bool = False):
        if capture and cache.device.type != "cuda":
            raise ValueError(f"capture: CUDA graphs need a CUDA cache, got one on {cache.device}")
        if capture:
            slow = [layer.layer_index for layer in model.attention_layers
                    if layer.resolved_backend(cache.device) != "triton"]
            if slow:
                raise ValueError(f"capture: layers {slow} run the PyTorch reference, which reads the plan back to "
                                 "the host; a captured step needs the Triton kernels (bf16 weights on CUDA)")
        self.model, self.cache, self.streams = model, cache, streams
        self.last_graph = False  # whether the latest step ran through a graph
        max_seq_len = max_seq_len or cache.max_seq_len
        sizes = sorted(set(graph_sizes))
        self.graphs = {b: DecodeStepGraph(model, cache, b, max_seq_len=max_seq_len, capture=capture, streams=streams)
                       for b in sizes}
        self.verify_graphs = {b: DecodeStepGraph(model, cache, b, max_seq_len=max_seq_len, capture=capture,
                                                 width=verify_width, streams=streams)
                              for b in (sizes if verify_width > 1 else ())}

    def warm_up(self) -> None:
        """Compile every graph's kernels and capture its CUDA graph (capture=False: run each once, eagerly) before
        any served step, so that no served step compiles or captures: each graph runs full steps over scratch
        requests (`DecodeStepGraph.warm_up`), admitted into every free slot and then released in the same order, so
        the cache is left as it was (its request ids go on past the scratch ones). A graph larger than the free slots,
        or than the free blocks take, is left to be captured over its first full served step."""
        graphs = [*self.graphs.values(), *self.verify_graphs.values()]
        if not graphs:
            return
        rids = []
        try:
            while (rid := self.cache.admit()) is not None:
                rids.append(rid)
            for graph in graphs:
                if graph.batch <= len(rids):
                    graph.warm_up(rids[:graph.batch])
        finally:
            for rid in rids:
                self.cache.release(rid)

    def graph_for(self, num_requests: int, width: int = 1) -> DecodeStepGraph | None:
        """The graph serving a decode step (width 1) or a verify step whose requests feed at most `width` tokens."""
        graphs = self.graphs if width == 1 else self.verify_graphs
        return next((g for b, g in graphs.items() if b >= num_requests and g.width >= width), None)

    def run(self, batch: Sequence[tuple[int, Sequence[int]]], *, decode: bool, rows: Sequence[int] | None = None,
            tentative: bool = False) -> StepLogits:
        """batch: (cache request id, new token ids) in plan order -> the fp32 logits of each request's last rows[b]
        new tokens (default 1 each), in batch order. decode: every request feeds its newest token and, in a verify
        step, drafts after it (a graph may serve the step); tentative: plan a verify step (the caller then accepts
        each request's kept tokens)."""
        counts = [len(tokens) for _, tokens in batch]
        rows = [1] * len(batch) if rows is None else list(rows)
        width = max(counts)
        graph = self.graph_for(len(batch), width) if decode and (width > 1) == tentative else None
        self.last_graph = graph is not None
        if graph is not None:
            logits, streams = graph.run(batch)
            # a decode or verify step asks for every row it feeds (a verify's drafts and a plain decode's one token)
            return StepLogits(logits if rows == counts else logits[self._last_rows(counts, rows, logits.device)],
                              streams)
        plan = self.cache.plan_step([(rid, n) for (rid, _), n in zip(batch, counts)], tentative=tentative)
        if isinstance(plan, OutOfBlocks):
            raise RuntimeError(f"step: {plan} (the scheduler counted them free)")
        flat = [token for _, tokens in batch for token in tokens]
        input_ids = torch.tensor(flat, dtype=torch.long).to(self.cache.device, non_blocking=True)
        index = None if rows == counts else self._last_rows(counts, rows, self.cache.device)
        if not self.streams:
            hidden = self.model(input_ids, plan, self.cache)  # [N, hidden]
            return StepLogits(self.model.logits(hidden if index is None else hidden[index]), None)
        streams = final_streams(self.model, input_ids, plan, self.cache)  # [N, hc, hidden]
        return StepLogits(self.model.logits(head(self.model, streams if index is None else streams[index])), streams)

    @staticmethod
    def _last_rows(counts: Sequence[int], rows: Sequence[int], device) -> torch.Tensor:
        """The indices of each request's last rows[b] token rows (requests' rows contiguous, in order), built on the
        host and copied without waiting for the device (a blocking copy would wait for the step's kernels)."""
        ends = np.cumsum(counts)
        index = np.concatenate([np.arange(end - r, end) for end, r in zip(ends.tolist(), rows)])
        return torch.from_numpy(index).to(device, non_blocking=True)
