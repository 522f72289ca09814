"""Decode steps replayed from CUDA graphs: `CapturedStep` (the mechanism the engine's model step uses too) and
`DecodeGraph`, one decode step through a stack of attention layers.

    graph = DecodeGraph(layers, cache, batch=8)
    out = graph.step([(rid, 1), ...], hidden_states)   # [n, hidden], n <= batch

Each step the host plans into the graph's persistent `StepBuffers` (allocating any block the step fills,
before replay) and copies the inputs into a static tensor; the replay then runs every layer's kernels with
no allocation, no host sync and no compilation. The first step runs eagerly (compiling the kernels and
initialising cuBLAS), the second is captured, and every later step replays. Rows past n are padding: their
positions are -1, so the kernels write nothing for them and attend to nothing.

The layers are chained as a residual stream, h <- h + layer(h), the attention half of a transformer block;
an engine would capture its MLPs and norms in the same graph.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..cache.manager import CacheManager
from ..cache.plan import OutOfBlocks, StepPlan
from ..checks import require
from .layer import DSV4Attention

__all__ = ["CapturedStep", "DecodeGraph"]


class CapturedStep:
    """A step over persistent buffers, run eagerly the first time (compiling the kernels outside the capture), captured
    as a CUDA graph the second, replayed from then on. capture=False: every step runs eagerly (the CPU)."""

    def __init__(self, capture: bool = True):
        self.capture = capture
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None
        self.steps = 0  # steps run: 0 -> eager warm-up next, 1 -> capture next, then replays

    def run(self, forward: Callable[[], torch.Tensor], plan: StepPlan, layer_indices: Sequence[int]) -> torch.Tensor:
        """forward() over `plan` (written into the buffers the graph reads) -> its output tensor (the graph's static
        output once captured). A replay records in the plan the layers that ran, as their forward would have."""
        if not self.capture or self.steps == 0:
            self.output = forward()
        elif self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # records the step; the replay below runs it
                self.output = forward()
            self.graph.replay()
        else:
            plan.status.layers_run.update(layer_indices)
            self.graph.replay()
        self.steps += 1
        return self.output


class DecodeGraph:
    """A captured decode step for up to `batch` requests over `layers` (any subset of a geometry's layers, in
    order) and `cache`. `max_seq_len` bounds the requests' lengths (default: the cache's); it sizes the
    indexer's per-row work, so a tight bound makes each step cheaper."""

    def __init__(self, layers: Sequence[DSV4Attention], cache: CacheManager, *, batch: int,
                 max_seq_len: int | None = None):
        layers = list(layers)
        require(len(layers) > 0 and all(isinstance(layer, DSV4Attention) for layer in layers),
                "layers: expected a non-empty sequence of DSV4Attention")
        require(isinstance(batch, int) and batch > 0, f"batch: expected a positive int, got {batch!r}")
        require(cache.device.type == "cuda", f"DecodeGraph needs a CUDA cache, got one on {cache.device}")
        weight = layers[0].q_a_proj.weight
        for layer in layers:
            require(layer.resolved_backend(cache.device) == "triton",
                    f"layer {layer.layer_index}: a captured step needs the Triton backend (bf16 on CUDA), "
                    f"its backend resolves to {layer.resolved_backend(cache.device)!r}")
        self.layers, self.cache, self.batch = layers, cache, batch
        self.buffers = cache.step_buffers(max_tokens=batch, max_requests=batch, max_seq_len=max_seq_len)
        self.input = torch.zeros(batch, cache.geometry.hidden_size, dtype=weight.dtype, device=cache.device)
        self.captured = CapturedStep()
        self.last_plan = None

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        return self.captured.graph

    @property
    def steps(self) -> int:
        return self.captured.steps

    def _chain(self, plan) -> torch.Tensor:
        h = self.input
        for layer in self.layers:
            h = h + layer(h, plan, self.cache)
        return h

    def step(self, batch: Sequence[tuple[int, int]], hidden_states: torch.Tensor) -> torch.Tensor:
        """Decode one token for each (request id, 1) of `batch`: hidden_states [n, hidden] in batch order ->
        [n, hidden] (a view of the graph's static output: copy it before the next step). Raises `RuntimeError`
        when the step needs more blocks than are free (nothing changed)."""
        n = len(batch)
        require(0 < n <= self.batch, f"batch: {n} requests, the graph holds 1..{self.batch}")
        require(all(count == 1 for _, count in batch), "batch: a decode step takes exactly 1 token per request")
        require(isinstance(hidden_states, torch.Tensor) and hidden_states.shape == (n, self.input.shape[1])
                and hidden_states.dtype == self.input.dtype and hidden_states.device == self.input.device,
                f"hidden_states: expected {self.input.dtype} [{n}, {self.input.shape[1]}] on {self.input.device}")
        plan = self.cache.plan_step(batch, buffers=self.buffers)
        if isinstance(plan, OutOfBlocks):
            raise RuntimeError(str(plan))
        self.last_plan = plan
        self.input[:n].copy_(hidden_states)
        self.input[n:].zero_()
        output = self.captured.run(lambda: self._chain(plan), plan, [layer.layer_index for layer in self.layers])
        return output[:n]
