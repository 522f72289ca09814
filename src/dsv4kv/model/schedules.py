"""The attention core on the kernels: one straight-line schedule per layer kind, a short list of launches on two
streams.

Each schedule turns a layer's projections (`Projected`) into the bf16 attention output [R, heads, head_dim] (inverse
RoPE applied), over every padded row of the step, reading and writing only the layer's own pages:

- the step's kv is encoded once into a step page; attention reads the step's own window keys from there and older
  ones from the ring, which takes the step page's rows (a byte copy) after attention, or beside it on a decode step
  (one row per request: no row's window holds the ring entry its append overwrites);
- on CUDA the longest chain to attention stays on the current stream (CSA: the indexer compress and query as a
  pair, then scores and top-k; HCA: the main compress; window layers: the q RoPE and the kv insert as a pair), the
  other kernels attention reads and the state appends run beside it on a side stream (`streams.StepStreams`); on the
  CPU the launches run in the order written, one of the orders the events allow.

How a step is scheduled changes no byte of what it computes (tests/test_kernel_layer.py compares the side stream on
and off, and `Schedule.rope_dims_only` across every kind).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache.pools import LayerCache
from ..checks import require
from ..geometry import LayerKind
from .attention_plan import AttentionPlan
from .streams import StepStreams

__all__ = ["Schedule", "Projected", "attention_core"]


@dataclass(frozen=True)
class Schedule:
    """How a layer's step runs on the GPU (none of it changes a byte)."""

    # kernels off the longest chain to attention run on a side stream beside it (CUDA only)
    side_stream: bool = True
    # kinds whose q RoPE writes only the rope dims, attention reading the others from the unroped q: it saves a copy
    # of q (an 8192-row chunk's RoPE ~7x faster); CSA's decode core lost a few percent at batch >= 64 with it
    rope_dims_only: frozenset[LayerKind] = field(default_factory=lambda: frozenset({LayerKind.WINDOW, LayerKind.HCA}))
    # projections of at most this many rows take the one-row GEMV kernel (`gemv_rows`); more rows take torch's GEMMs
    gemv_rows: int = 1


@dataclass
class Projected:
    """What a layer's input projections give its attention core, per padded row (`DSV4Attention.project`)."""

    q: torch.Tensor  # bf16 [R, heads, head_dim]: normed (unweighted), not yet roped
    kv: torch.Tensor  # bf16 [R, head_dim]: normed, not yet roped
    state: tuple[torch.Tensor, torch.Tensor] | None = None  # compressor rows: fp32 kv, logits [R, width]
    index_state: tuple[torch.Tensor, torch.Tensor] | None = None  # the indexer compressor's rows (CSA)
    index_q: torch.Tensor | None = None  # bf16 [R, index_heads, index_head_dim], not yet roped (CSA)
    index_weights: torch.Tensor | None = None  # bf16 [R, index_heads]: the scorer's projection (CSA)


def attention_core(layer, p: Projected, plan: AttentionPlan, pages: LayerCache) -> torch.Tensor:
    """`layer`'s attention core over `plan` and its `pages` on the kernels -> bf16 [R, heads, head_dim]."""
    require(plan.backend == "triton" and plan.kind is layer.spec.kind,
            f"attention_core: a {plan.backend} plan of {plan.kind} layers for layer {layer.layer_index} "
            f"({layer.spec.kind})")
    step = _Step(layer, p, plan, pages)
    schedule = {LayerKind.WINDOW: _window, LayerKind.CSA: _csa, LayerKind.HCA: _hca}[plan.kind]
    step.streams.fork()
    try:  # the side stream is joined whatever happens: no tensor it uses is freed under it
        out = schedule(step)
    finally:
        step.streams.join()
    if not plan.decode:
        step.append_window()
    pages.write_boundaries(plan.step.snapshots, step_kv=step.step_kv, state_rows=step.state_rows)
    return out


def _window(s: "_Step") -> torch.Tensor:
    # the q RoPE lets the kv insert launch beside it; the insert waits for it before it exits (no event needed)
    s.rope_q(launch_next=True)
    s.insert_kv(wait_late=True)
    if s.plan.decode:
        s.streams.side_waits(s.streams.main_mark())  # the append copies the step page the insert wrote
        with s.streams.on_side():
            s.append_window()
    else:
        s.streams.join()
    return s.attend()


def _csa(s: "_Step") -> torch.Tensor:
    with s.streams.on_side():
        s.rope_q()
        s.insert_kv()
        s.compress(main=True)
        s.append_state(0)  # no later kernel of the step reads the main state ring
    # the indexer compress (the longer at decode) lets the query launch beside it; the query waits for it last, so
    # the scores kernel after them sees both complete
    s.compress(main=False, launch_next=True)
    s.index_query(wait_late=True)
    s.streams.side_waits(s.streams.main_mark())
    with s.streams.on_side():
        s.append_state(1)
    picks = s.pick()
    s.meet_before_attention()
    return s.attend(picks)


def _hca(s: "_Step") -> torch.Tensor:
    with s.streams.on_side():
        s.rope_q()
        s.insert_kv()
    s.compress(main=True)
    s.meet_before_attention()
    # the state append after the compress's read of the ring, beside attention (which never reads the ring)
    s.streams.side_waits(s.streams.main_mark())
    with s.streams.on_side():
        s.append_state(0)
    return s.attend()


class _Step:
    """One layer step's launches, each with its arguments; the schedules above order them. Everything the side
    stream touches is allocated here, on the main stream, before the fork (streams.py)."""

    def __init__(self, layer, p: Projected, plan: AttentionPlan, pages: LayerCache):
        from ..ops import kernels
        self.k, self.layer, self.p, self.plan, self.pages = kernels, layer, p, plan, pages
        g, spec = layer.geometry, layer.spec
        rows, device = plan.step.positions.shape[0], p.q.device
        self.main, self.page_tokens = pages.spec.main, pages.spec.page_tokens
        self.streams = StepStreams(device, concurrent=layer.schedule.side_stream)
        # the q RoPE's output: each head's rope dims (attention reads the others from p.q), or the whole roped head
        self.rope_only = spec.kind in layer.schedule.rope_dims_only and spec.rope.dim < g.head_dim
        self.q_roped = torch.empty((*p.q.shape[:2], spec.rope.dim if self.rope_only else p.q.shape[2]),
                                   dtype=torch.bfloat16, device=device)
        self.step_kv = torch.empty((1, self.main.page_bytes(rows)), dtype=torch.uint8, device=device)
        self.state_rows = []  # (ring kv, ring logits, kv rows, logit rows): main, then the indexer's (CSA)
        if spec.compressed:
            self.state_rows.append((pages.state_kv, pages.state_score, *p.state))
        if spec.kind is LayerKind.CSA:
            self.state_rows.append((pages.index_state_kv, pages.index_state_score, *p.index_state))
            self.q_index = torch.empty(p.index_q.shape, dtype=torch.float32, device=device)
            self.weights = torch.empty(p.index_weights.shape, dtype=torch.float32, device=device)
            # MXFP4 keys on the FP8-MMA path: the query's FP8 operand, made once per row by the query kernel
            self.q_fp8 = (torch.empty(p.index_q.shape, dtype=torch.uint8, device=device),
                          torch.empty(p.index_weights.shape, dtype=torch.float32, device=device)
                          ) if plan.indexer_fp8 else None

    def rope_q(self, **launch) -> None:
        self.k.rope_rows(self.p.q, *self.plan.cos_sin, out=self.q_roped, **launch)

    def insert_kv(self, **launch) -> None:
        rows = self.plan.step.positions.shape[0]
        self.k.kv_insert(self.p.kv, self.plan.step.positions, self.layer.spec.rope, self.main, self.step_kv, rows,
                         self.plan.row_slots, cos_sin=self.plan.cos_sin, **launch)

    def compress(self, *, main: bool, **launch) -> None:
        """Compress-and-insert the entries completing in the step: the main ones, or the indexer's keys (CSA)."""
        g, spec, pages, compressor = self.layer.geometry, self.layer.spec, self.pages, self.layer.compressor
        ring_kv, ring_logits, kv_rows, logit_rows = self.state_rows[0 if main else 1]
        norm = compressor.kv_norm if main else compressor.indexer.kv_norm
        self.k.compress_insert(ring_kv, ring_logits, self.plan.step, kv_rows, logit_rows, norm_weight=norm.weight,
                               layout=self.main if main else pages.spec.index,
                               pool=pages.entries if main else pages.index_keys, main=main, ratio=spec.ratio,
                               overlap=spec.kind is LayerKind.CSA, eps=g.rms_norm_eps, rope=spec.rope,
                               out_dtype=self.q_roped.dtype, page_tokens=self.page_tokens,
                               cos_sin=self.plan.entry_cos_sin, **launch)

    def index_query(self, **launch) -> None:
        """RoPE, Hadamard rotation, MXFP4 / FP8 round trip and head weights in one kernel (bit for bit the
        reference's indexer query)."""
        g = self.layer.geometry
        self.k.indexer_query_and_weights(self.p.index_q, self.p.index_weights, *self.plan.cos_sin,
                                         self.pages.spec.index, scale=g.index_n_heads ** -0.5, out=self.q_index,
                                         weights_out=self.weights, fp8_out=self.q_fp8, **launch)

    def pick(self) -> torch.Tensor:
        """The indexer's scores over the layer's keys, then the exact top-k of each row."""
        from ..ops.topk.kernel import first_digit_counts
        plan, g = self.plan, self.layer.geometry
        counts = first_digit_counts(plan.topk_workspace) if plan.counts_digit else None
        scores = self.k.indexer_scores_paged(self.q_index, self.weights, plan.step, self.pages.index_keys,
                                             self.pages.spec.index, ratio=self.layer.spec.ratio,
                                             page_tokens=self.page_tokens, max_entries=plan.score_columns,
                                             q_fp8=self.q_fp8, digit_counts=counts)
        return self.k.topk_indices(scores, plan.visible, g.index_topk, workspace=plan.topk_workspace,
                                   first_digit_counted=counts is not None)

    def append_state(self, which: int) -> None:
        """A compressor's step rows into its state ring, after the step's last read of the ring."""
        ring_kv, ring_logits, kv_rows, logit_rows = self.state_rows[which]
        self.k.append_state(ring_kv, ring_logits, self.plan.step, kv_rows, logit_rows)

    def append_window(self) -> None:
        self.k.append_window(self.pages.window, self.main, self.layer.geometry.window, self.plan.step, self.step_kv)

    def meet_before_attention(self) -> None:
        """Compressed layers: attention waits for the side stream's kernels; on a decode step the window append then
        runs there beside attention."""
        if not self.plan.decode:
            self.streams.join()
            return
        inputs = self.streams.side_mark()
        with self.streams.on_side():
            self.append_window()
        self.streams.main_waits(inputs)

    def attend(self, picks: torch.Tensor | None = None) -> torch.Tensor:
        """Sparse attention with sink over the window and the compressed entries, and the output's inverse RoPE."""
        g, spec, pages = self.layer.geometry, self.layer.spec, self.pages
        return self.k.sparse_attention_paged(
            self.p.q if self.rope_only else self.q_roped, self.plan.step,
            q_rope_dims=self.q_roped if self.rope_only else None, sinks=self.layer.sinks,
            scale=g.head_dim ** -0.5, layout=self.main, window=g.window, window_pool=pages.window,
            step_kv=self.step_kv, entry_pool=pages.entries if spec.compressed else None,
            ratio=spec.ratio if spec.compressed else 0, page_tokens=self.page_tokens, picks=picks,
            max_entries=self.plan.max_entries, inverse_rope=self.plan.cos_sin)
