"""ModelRunner: one step's token ids -> fp32 logits of each request's last new token, over one step plan.

Mixed and prefill steps run eagerly with a plan of their own size. Pure decode steps of up to
`max(graph_sizes)` requests run through a `DecodeStepGraph` of the smallest size that holds them: the
plan goes into that graph's persistent buffers (rows past the batch are padding: position -1, token 0,
harmless and discarded), and on CUDA the whole model step, embedding to logits, is captured once as a
CUDA graph and replayed. On a CPU the same padded path runs eagerly (nothing is captured), which is what
the CPU tests check.

The MoE runs as transformers' "batched_mm" experts inside a decode graph: its default loop over the
experts that were hit reads the routing back to the host, which a CUDA graph cannot hold.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from ..cache.manager import CacheManager
from ..cache.plan import OutOfBlocks
from ..model.graph import CapturedStep
from .model import DSV4Model

__all__ = ["ModelRunner", "DecodeStepGraph", "default_graph_sizes"]


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


class DecodeStepGraph:
    """A decode step of up to `batch` requests, one token each, through the whole model.

    capture=True (CUDA, every attention layer on the Triton kernels): the first step runs eagerly
    (compiling the kernels), the second is captured, later steps replay. capture=False: every step runs
    the same padded computation eagerly."""

    def __init__(self, model: DSV4Model, cache: CacheManager, batch: int, *, max_seq_len: int, capture: bool):
        self.model, self.cache, self.batch = model, cache, batch
        self.buffers = cache.step_buffers(max_tokens=batch, max_requests=batch, max_seq_len=max_seq_len)
        self.input_ids = torch.zeros(batch, dtype=torch.long, device=cache.device)
        # the step's token ids are staged in pinned memory and copied without a host sync (padding rows: 0)
        pinned = cache.device.type == "cuda"
        self._host_ids = torch.zeros(batch, dtype=torch.long, pin_memory=pinned)
        self._copied = torch.cuda.Event() if pinned else None
        self._expert_configs = _expert_configs(model)
        self.captured = CapturedStep(capture)

    @property
    def capture(self) -> bool:
        """Whether this step is captured as a CUDA graph (else every step runs eagerly)."""
        return self.captured.capture

    def run(self, batch: Sequence[tuple[int, int]]) -> torch.Tensor:
        """batch: (cache request id, token id) pairs -> fp32 logits [len(batch), vocab] (a view: copy or use it
        before the next step)."""
        n = len(batch)
        plan = self.cache.plan_step([(rid, 1) for rid, _ in batch], buffers=self.buffers)
        if isinstance(plan, OutOfBlocks):
            raise RuntimeError(f"decode step: {plan} (the scheduler counted them free)")
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy may still read the staging buffer
        host = self._host_ids.numpy()
        host[:n] = [token for _, token in batch]
        host[n:] = 0
        self.input_ids.copy_(self._host_ids, non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()
        with _experts_implementation(self._expert_configs, "batched_mm"):
            logits = self.captured.run(lambda: self._forward(plan), plan,
                                       [layer.layer_index for layer in self.model.attention_layers])
        return logits[:n]

    def _forward(self, plan) -> torch.Tensor:
        return self.model.logits(self.model(self.input_ids, plan, self.cache))


class ModelRunner:
    """Runs steps of `model` over `cache`. `graph_sizes`: decode batch sizes served by a `DecodeStepGraph`
    (empty: every step eager); `capture`: whether those graphs are captured (CUDA only); `max_seq_len`: the
    longest request, the graphs' fixed context bound (default the cache's)."""

    def __init__(self, model: DSV4Model, cache: CacheManager, *, graph_sizes: Sequence[int] = (),
                 capture: bool = False, max_seq_len: int | None = None):
        if capture and cache.device.type != "cuda":
            raise ValueError(f"capture: CUDA graphs need a CUDA cache, got one on {cache.device}")
        if capture:
            slow = [layer.layer_index for layer in model.attention_layers
                    if layer.resolved_backend(cache.device) != "triton"]
            if slow:
                raise ValueError(f"capture: layers {slow} run the PyTorch reference, which reads the plan back to "
                                 "the host; a captured step needs the Triton kernels (bf16 weights on CUDA)")
        self.model, self.cache = model, cache
        max_seq_len = max_seq_len or cache.max_seq_len
        self.graphs = {b: DecodeStepGraph(model, cache, b, max_seq_len=max_seq_len, capture=capture)
                       for b in sorted(set(graph_sizes))}

    def graph_for(self, num_requests: int) -> DecodeStepGraph | None:
        return next((g for b, g in self.graphs.items() if b >= num_requests), None)

    def run(self, batch: Sequence[tuple[int, Sequence[int]]], *, decode: bool) -> torch.Tensor:
        """batch: (cache request id, new token ids) in plan order -> fp32 logits [len(batch), vocab] after each
        request's last new token. decode: every request feeds one token (a graph may serve the step)."""
        graph = self.graph_for(len(batch)) if decode else None
        if graph is not None:
            return graph.run([(rid, tokens[0]) for rid, tokens in batch])
        plan = self.cache.plan_step([(rid, len(tokens)) for rid, tokens in batch])
        if isinstance(plan, OutOfBlocks):
            raise RuntimeError(f"step: {plan} (the scheduler counted them free)")
        flat = [token for _, tokens in batch for token in tokens]
        input_ids = torch.tensor(flat, dtype=torch.long).to(self.cache.device)
        hidden = self.model(input_ids, plan, self.cache)  # [N, hidden]
        last = torch.tensor([len(tokens) for _, tokens in batch]).cumsum(0) - 1
        return self.model.logits(hidden[last.to(hidden.device)])
