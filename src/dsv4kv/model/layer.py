"""DSV4Attention: one DeepSeek-V4 attention layer computed over the paged cache (the PyTorch reference).

    layer(hidden_states [N, hidden], plan, cache) -> [N, hidden]

for the N tokens of a step in plan order, any mix of prefill chunks and decode tokens. Per step:
q path -> kv path -> compress-and-insert (main, then the indexer's keys) -> indexer top-k (CSA) ->
gather (window and compressed keys) -> sparse attention with sink -> append (window ring, compressor
state) -> inverse RoPE -> grouped output projection. Reads come before append because append may
overwrite ring rows the step's own earlier tokens still need.

Numerics follow the cache's formats (`docs/numerics.md`): the kv the step attends to and the entries it
stores are exactly what the cache's format holds, so how a sequence is split into steps changes a
token's output only by the rounding of differently shaped GEMMs. Projections run in the weights' dtype;
norms, RoPE, the compressor (as the official model), the indexer scores and attention run in fp32. The kernel path
(`project`) runs the compressors' projections as one bf16 tensor-core GEMM with fp32 products and sums (exact
products, as the fp32 GEMM's) and its norms as kernels that sum in their own order (docs/numerics.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from ..geometry import LayerKind, ModelGeometry
from ..cache.manager import CacheManager
from ..ops.compress.reference import append_state, compressor_logits
from ..ops.window.reference import append_window
from ..ops.attention.reference import sparse_attention
from ..ops.shared.rows import StepRows, step_rows
from ..checks import require
from ..ops.compress.reference import compress_and_insert
from ..ops.attention.gather import gather_entries, gather_window, visible_entries
from ..ops.indexer.reference import indexer_topk
from ..ops.projection.reference import rms_norm, unit_rms_norm
from ..ops.shared.backend import kernels_can_run
from ..ops.rope.reference import apply_rope, rope_cos_sin
from ..cache.plan import StepPlan
from .weights import check_state_keys, layer_state_dict

__all__ = ["DSV4Attention", "Projected", "RMSNorm", "init_random_weights", "BACKENDS"]

# "torch": the PyTorch reference ops; "triton": the kernels (CUDA, or CPU under TRITON_INTERPRET=1);
# "auto": the kernels for bf16 activations on CUDA, else the reference.
BACKENDS = ("auto", "torch", "triton")
# The kernel path's window-ring append beside attention on the side stream when each request has one row in the
# step (`DSV4Attention.attention_core`); False: after attention on the main stream, as every other step does. Read at
# each call.
WINDOW_APPEND_BESIDE = True
# The CSA layer's indexer query and indexer compress as a pair on the main stream: the first lets the second launch
# beside it, the second waits for the first, last (`launch_next` / `wait_late`); False: one after the other, plain
# PDL. H100, 2026-11-26 (docs/performance.md), CSA decode core, the query on the side stream / the pair (query
# first): batch 1 at 4K 34.6 / 32.5 us, at 16K 36.0 / 32.0, at 1M 54.3 / 54.5; batch 64 at 128K 213.2 / 212.6. Read
# at each call.
INDEXER_PAIR = True
# The pair's first kernel: the indexer compress, the longer of the two at decode (batch 1: 4.5-5.1 us against the
# query's 3.1-3.2), started first so that the pair ends sooner (1M: the scores start at 5.7 us instead of 6.6); as the
# first it launches even where no entry completes (`compress_insert(launch_next=True)`); False: the query. H100,
# 2026-11-26 (docs/performance.md), CSA decode core, query / compress first: batch 1 at 4K 31.6 / 31.5 us, at 16K
# 32.0 / 31.1, at 1M 54.1 / 52.1; batch 8 at 128K 64.9 / 64.5; batch 64 212.5 / 212.5. Read at each call.
COMPRESS_FIRST = True
# A window layer's q RoPE lets its kv insert launch beside it on the main stream, the kv insert waiting for it before
# it exits, so attention waits for no event; False: the q RoPE on the side stream. H100, 2026-11-26
# (docs/performance.md), window decode core, side stream / this: batch 1 at 4K 16.7 / 15.5 us, at 16K 17.2 / 15.6;
# batch 8 at 128K 19.0 / 19.0; batch 64 40.3 / 39.0. HCA's q RoPE, kv insert and pooling so were 0.6-1.1 us slower
# from 16K at batch 1 to batch 8 and equal at batch 64, so HCA keeps the side stream. Read at each call.
ROPE_LAUNCHES_KV_INSERT = True
# Layer kinds whose q RoPE writes only the rope dims (`rope_rows(out=[R, H, rope_dim])`, 64 of 512 a head) and whose
# attention reads the other dims from the unroped q (`sparse_attention_paged(q_rope_dims=)`); the others rope a whole
# copy of q. H100, 2026-11-26 (docs/performance.md), whole copy / rope dims only: an 8192-token prefill chunk's q RoPE
# 378 / 52 us; window decode core at batch 64 / 128K 37.0 / 35.5 us, batch 128 / 32K 35.0 / 32.5; HCA 99.8 / 98.7
# and 93.5 / 89.4; batch 1 and 8 within 0.3 us. CSA lost at batch 64 (212.0 / 222.0) and 128 (179.9 / 183.7), its
# attention unchanged, also with the side stream joined before the indexer scores (H200); the cause is not settled.
# Read at each call.
Q_ROPE_DIMS_ONLY = frozenset({LayerKind.WINDOW, LayerKind.HCA})

# The kernel path's projections that the query chain (q_a, its norm, q_b, q's norm, the indexer's q_b) does not read
# (kv and its norm, the compressors' GEMM and split, the indexer's head weights) run on the side stream beside it, and
# the main stream waits for them at the end of `project`; False: all in order on the main stream. H200, 2026-11-26
# (docs/performance.md), in order / beside, bytes equal: whole decode layers at batch 1 / 16K CSA 145.7 / 123.3 us,
# HCA 115.1 / 102.0, window 101.3 / 94.9; CSA at batch 64 / 128K 328.3 / 310.9; an 8192-row chunk's projections
# within 2% either way. Read at each call.
PROJECT_BESIDE = True

# The kernel path's projections of up to `kernels.gemv.MAX_ROWS` rows (q_a, q_b, the indexer's q_b, the grouped o_a
# and o_b) through `kernels.gemv_rows`; more rows, or False: torch's GEMMs. The kv, head-weight and compressor
# projections stay torch's: they run on the side stream, beside these. H100, 2026-11-27 (docs/performance.md), torch /
# gemv_rows, whole layers at batch 1: CSA at 16K 139.8 / 138.0 us, at 1M 158.7 / 153.9; HCA 113.3 / 109.4 and
# 134.5 / 131.1; window 107.0 / 101.6. Read at each call.
SMALL_BATCH_GEMV = True

# Geometry fields one layer's weights and computation depend on; the layer's own LayerSpec is compared too.
_LAYER_FIELDS = ("hidden_size", "num_heads", "head_dim", "rope_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                 "window", "index_n_heads", "index_head_dim", "index_topk", "rms_norm_eps")


class RMSNorm(nn.Module):  # its weight is one of weights.FP32_PARAMETERS
    """Weighted RMSNorm computed in fp32 (fp32 weight), returned in the input dtype (transformers' and the official rule)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _Scorer(nn.Module):
    def __init__(self, g: ModelGeometry, **kw):
        super().__init__()
        self.weights_proj = nn.Linear(g.hidden_size, g.index_n_heads, bias=False, **kw)


class _Compressor(nn.Module):
    """Projections of a compressor: width 2*dim with overlap (CSA), dim without (HCA)."""

    def __init__(self, g: ModelGeometry, dim: int, ratio: int, overlap: bool, **kw):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.kv_proj = nn.Linear(g.hidden_size, width, bias=False, **kw)
        self.gate_proj = nn.Linear(g.hidden_size, width, bias=False, **kw)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32, device=kw["device"]))
        self.kv_norm = RMSNorm(dim, g.rms_norm_eps, **kw)

    def rows(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's state rows, in fp32 like the official compressor: kv [N, width], logits (gate + bias) [N, width].
        The fp32 copies of the weights are kept between steps (a decode step would otherwise cast 2 x 16 MB of weights
        per CSA layer before its GEMMs)."""
        x32 = x.float()
        kv_weight, gate_weight = _weight_copy(self, "_fp32", (self.kv_proj.weight, self.gate_proj.weight),
                                              lambda ws: tuple(w.float() for w in ws))
        kv = torch.nn.functional.linear(x32, kv_weight)
        gate = torch.nn.functional.linear(x32, gate_weight)
        return kv, compressor_logits(gate, self.position_bias, positions)


# torch.mm(..., out_dtype=) (bf16 in, fp32 out on CUDA): torch >= 2.8; older versions take the fp32 GEMM
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


def _takes_gemv(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether x's projections by `weights` go through `kernels.gemv_rows`: its row count, and the operands it takes
    (contiguous bf16; anything else keeps torch's GEMM rather than being refused mid-step)."""
    from ..ops.projection.gemv import MAX_ROWS
    return (SMALL_BATCH_GEMV and x.shape[0] <= MAX_ROWS and
            all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in (x, *weights)))


def _project_rows(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """linear(x) on the kernel path (no bias): `kernels.gemv_rows` for one row, else torch's GEMM."""
    from ..ops import kernels
    return kernels.gemv_rows(x, linear.weight) if _takes_gemv(x, linear.weight) else linear(x)


def _weight_copy(owner: nn.Module, name: str, weights: tuple[torch.Tensor, ...], make):
    """`make(weights)` (detached), kept on `owner` under `name` between steps and made again when a weight is replaced,
    moved or changed in place through autograd-visible ops (its `_version`). Not seen: writes through `.data`, and a
    captured CUDA graph, which keeps reading the copy it captured."""
    key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in weights)
    if getattr(owner, name + "_key", None) != key:
        setattr(owner, name, make(tuple(w.detach() for w in weights)))
        setattr(owner, name + "_key", key)
    return getattr(owner, name)


class _Indexer(_Compressor):
    def __init__(self, g: ModelGeometry, ratio: int, **kw):
        super().__init__(g, g.index_head_dim, ratio, overlap=True, **kw)
        self.q_b_proj = nn.Linear(g.q_lora_rank, g.index_n_heads * g.index_head_dim, bias=False, **kw)
        self.scorer = _Scorer(g, **kw)


class _MainCompressor(_Compressor):
    def __init__(self, g: ModelGeometry, ratio: int, csa: bool, **kw):
        super().__init__(g, g.head_dim, ratio, overlap=csa, **kw)
        if csa:
            self.indexer = _Indexer(g, ratio, **kw)

    def _parts(self) -> list[_Compressor]:
        """This compressor, then its indexer's (CSA): the order of `projected_rows`' GEMM columns and outputs."""
        return [self, self.indexer] if hasattr(self, "indexer") else [self]

    def row_buffers(self, rows: int, device: torch.device
                    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Empty outputs of `projected_rows` for `rows` rows: the GEMM's fp32 [rows, sum of 2 w], and each compressor's
        (kv, logits) fp32 [rows, w] (for a caller that allocates on one stream and computes on another)."""
        widths = [part.kv_proj.weight.shape[0] for part in self._parts()]
        def empty(w):
            return torch.empty(rows, w, dtype=torch.float32, device=device)
        return empty(2 * sum(widths)), [(empty(w), empty(w)) for w in widths]

    def projected_rows(self, x: torch.Tensor, positions: torch.Tensor, buffers=None
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The kernel path's state rows (`rows`) of this compressor, then of its indexer's (CSA), from one GEMM of
        bf16 x with all their projections stacked, and one launch that splits it (`kernels.compressor_rows`).

        bf16 x and weights on a GPU: the GEMM runs on tensor cores with fp32 products and sums
        (`torch.mm(out_dtype=float32)`). The products of bf16 values are exact in fp32, as in `rows`' fp32 GEMM; only
        how the sums round differs (H200, docs/performance.md: 8192 rows 3,512 -> 230 us, one row 32.2 -> 15.1 us;
        mean relative error 4.1e-6 against fp32's 4.1e-7). Elsewhere an fp32 GEMM. The stacked copy of the weights
        (21 MB for a V4-Flash CSA layer) is kept as `rows`' fp32 copies are. buffers: `row_buffers`' outputs."""
        from ..ops import kernels
        parts = self._parts()
        weights = tuple(w for part in parts for w in (part.kv_proj.weight, part.gate_proj.weight))
        tensor_cores = (x.is_cuda and x.dtype == torch.bfloat16 and all(w.dtype == torch.bfloat16 for w in weights)
                        and _MM_OUT_DTYPE)
        dtype = torch.bfloat16 if tensor_cores else torch.float32
        stacked = _weight_copy(self, f"_stacked_{str(dtype)[6:]}", weights,
                               lambda ws: torch.cat([w.to(dtype) for w in ws]).t())  # [hidden, sum of widths]
        y, out = buffers if buffers is not None else self.row_buffers(x.shape[0], x.device)
        if tensor_cores:
            torch.mm(x, stacked, out_dtype=torch.float32, out=y)
        else:
            torch.mm(x.float(), stacked, out=y)
        return kernels.compressor_rows(y, positions, [part.position_bias for part in parts], out=out)


@dataclass
class Projected:
    """What a layer's input projections give its attention core, per padded row (`DSV4Attention.project`)."""

    q: torch.Tensor  # bf16 [R, heads, head_dim]: normed (unweighted), not yet roped
    kv: torch.Tensor  # bf16 [R, head_dim]: normed, not yet roped
    state: tuple[torch.Tensor, torch.Tensor] | None = None  # compressor rows: fp32 kv, logits [R, width]
    index_state: tuple[torch.Tensor, torch.Tensor] | None = None  # the indexer compressor's rows (CSA)
    index_q: torch.Tensor | None = None  # bf16 [R, index_heads, index_head_dim], not yet roped (CSA)
    index_weights: torch.Tensor | None = None  # bf16 [R, index_heads]: the scorer's projection (CSA)


class DSV4Attention(nn.Module):
    """Layer `layer_index` of `geometry`. Parameter names are transformers' `DeepseekV4Attention` names."""

    def __init__(self, geometry: ModelGeometry, layer_index: int, *, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None, backend: str = "auto"):
        super().__init__()
        self.backend = backend
        if not isinstance(geometry, ModelGeometry):
            raise TypeError(f"geometry: expected a ModelGeometry, got {type(geometry).__name__}")
        if not (isinstance(layer_index, int) and 0 <= layer_index < geometry.num_layers):
            raise ValueError(f"layer_index: expected 0..{geometry.num_layers - 1}, got {layer_index!r}")
        g = self.geometry = geometry
        self.layer_index = layer_index
        self.spec = g.layers[layer_index]
        kw = {"dtype": dtype, "device": device}
        self.q_a_proj = nn.Linear(g.hidden_size, g.q_lora_rank, bias=False, **kw)
        self.q_a_norm = RMSNorm(g.q_lora_rank, g.rms_norm_eps, **kw)
        self.q_b_proj = nn.Linear(g.q_lora_rank, g.num_heads * g.head_dim, bias=False, **kw)
        self.kv_proj = nn.Linear(g.hidden_size, g.head_dim, bias=False, **kw)
        self.kv_norm = RMSNorm(g.head_dim, g.rms_norm_eps, **kw)
        # grouped output projection: o_a maps each group's heads (num_heads*head_dim/o_groups) to o_lora_rank
        self.o_a_proj = nn.Linear(g.num_heads * g.head_dim // g.o_groups, g.o_groups * g.o_lora_rank, bias=False, **kw)
        self.o_b_proj = nn.Linear(g.o_groups * g.o_lora_rank, g.hidden_size, bias=False, **kw)
        self.sinks = nn.Parameter(torch.zeros(g.num_heads, dtype=torch.float32, device=device))
        if self.spec.compressed:
            self.compressor = _MainCompressor(g, self.spec.ratio, self.spec.kind is LayerKind.CSA, **kw)

    # --- construction -----------------------------------------------------------------------------
    @classmethod
    def from_transformers(cls, module: nn.Module) -> "DSV4Attention":
        """A copy of transformers' `DeepseekV4Attention` (weights, dtype, device; geometry from its config)."""
        config, layer_index = getattr(module, "config", None), getattr(module, "layer_idx", None)
        if config is None or layer_index is None:
            raise TypeError(f"from_transformers: expected a transformers DeepseekV4Attention, got {type(module).__name__}")
        weight = module.q_a_proj.weight
        layer = cls(ModelGeometry.from_hf_config(config), layer_index, dtype=weight.dtype, device=weight.device)
        layer.load_state_dict(module.state_dict(), strict=True)
        return layer

    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor], geometry: ModelGeometry, layer_index: int, *,
                        dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> "DSV4Attention":
        """Layer `layer_index` from a checkpoint state dict: transformers or official names, FP8 block weights
        dequantized (see `dsv4kv.weights`). Missing or unexpected weights raise `WeightError`."""
        layer = cls(geometry, layer_index, dtype=dtype, device=device)
        weights = layer_state_dict(state, layer_index, dtype)
        check_state_keys(layer.state_dict(), weights, f"layer {layer_index}")
        layer.load_state_dict(weights, strict=True)
        return layer

    # --- forward ----------------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        if value not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {value!r}")
        self._backend = value

    def resolved_backend(self, device: torch.device) -> str:
        """The backend a forward on `device` uses."""
        if self._backend != "auto":
            return self._backend
        usable = device.type == "cuda" and self.q_a_proj.weight.dtype == torch.bfloat16 and kernels_can_run(device)
        return "triton" if usable else "torch"

    @torch.no_grad()  # an inference path: the cache must never join an autograd graph
    def forward(self, hidden_states: torch.Tensor, plan: StepPlan, cache: CacheManager) -> torch.Tensor:
        """The layer over one step: hidden_states [N, hidden_size] in plan order, the weights' dtype and the
        cache's device -> [N, hidden_size]. N is plan.num_tokens, or the plan's padded row count
        (plan.positions.shape[0], for a captured graph); outputs of padding rows are unspecified. Each layer
        runs once per plan, in any layer order."""
        backend = self.resolved_backend(hidden_states.device if isinstance(hidden_states, torch.Tensor)
                                        else cache.device)
        self._check(hidden_states, plan, cache, backend)
        cache.mark_layer_run(self.layer_index)
        if backend == "triton":
            return self._forward_kernels(hidden_states, plan, cache)
        n = plan.num_tokens
        if hidden_states.shape[0] == n:
            return self._forward_reference(hidden_states, plan, cache)
        out = self._forward_reference(hidden_states[:n], plan, cache)
        return torch.cat((out, out.new_zeros(hidden_states.shape[0] - n, out.shape[1])))

    def _forward_reference(self, hidden_states: torch.Tensor, plan: StepPlan, cache: CacheManager) -> torch.Tensor:
        g, spec = self.geometry, self.spec
        layer_cache, cache_spec = cache.pools.layers[self.layer_index], cache.spec.layers[self.layer_index]
        page_tokens = cache.spec.page_tokens
        rows = step_rows(plan)
        x, n, positions = hidden_states, rows.num_tokens, rows.positions

        qr = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(qr).view(n, g.num_heads, g.head_dim)
        q = unit_rms_norm(q, g.rms_norm_eps)
        q = apply_rope(q, positions, spec.rope)
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), positions, spec.rope)
        stored_kv = cache_spec.main.round_trip(kv)  # what the window ring will hold

        keys, valid = gather_window(layer_cache.window, cache_spec.main, g.window, plan, stored_kv, rows)
        state_rows = []
        if spec.compressed:
            entries, entry_valid, state_rows = self._compressed_keys(x, qr, plan, rows, layer_cache, cache_spec,
                                                                     page_tokens)
            keys, valid = torch.cat((keys, entries), dim=1), torch.cat((valid, entry_valid), dim=1)
        out = sparse_attention(q, keys, valid, self.sinks, g.head_dim ** -0.5)

        append_window(layer_cache.window, cache_spec.main, g.window, plan, kv)
        for state_kv, state_logits, kv_rows, logit_rows in state_rows:
            append_state(state_kv, state_logits, plan, kv_rows, logit_rows, rows)
        if plan.snapshots is not None:  # prefix caching: rows of boundaries inside the step
            cache.capture_boundaries(self.layer_index, plan, kv=kv, state_rows=state_rows)

        out = apply_rope(out, positions, spec.rope, inverse=True).to(x.dtype)
        return self.o_b_proj(self._grouped_o_a(out))

    def _compressed_keys(self, x, qr, plan, rows: StepRows, layer_cache, cache_spec, page_tokens):
        """Compress-and-insert this step's completed entries, then gather each token's compressed keys.

        Returns (keys, valid, state rows for append_state after attention)."""
        g, spec, comp = self.geometry, self.spec, self.compressor
        csa = spec.kind is LayerKind.CSA
        insert = dict(plan=plan, ratio=spec.ratio, overlap=csa, eps=g.rms_norm_eps, rope=spec.rope,
                      out_dtype=x.dtype, page_tokens=page_tokens, rows=rows)
        kv_rows, logit_rows = comp.rows(x, rows.positions)
        compress_and_insert(layer_cache.state_kv, layer_cache.state_score, kv_rows=kv_rows, logit_rows=logit_rows,
                            norm_weight=comp.kv_norm.weight, layout=cache_spec.main, pool=layer_cache.entries, **insert)
        state_rows = [(layer_cache.state_kv, layer_cache.state_score, kv_rows, logit_rows)]
        if not csa:
            picks = visible_entries(plan, ratio=spec.ratio, rows=rows)
        else:
            idx = comp.indexer
            index_rows, index_logits = idx.rows(x, rows.positions)
            compress_and_insert(layer_cache.index_state_kv, layer_cache.index_state_score, kv_rows=index_rows,
                                logit_rows=index_logits, norm_weight=idx.kv_norm.weight, layout=cache_spec.index,
                                pool=layer_cache.index_keys, **insert)
            state_rows.append((layer_cache.index_state_kv, layer_cache.index_state_score, index_rows, index_logits))
            q_index = idx.q_b_proj(qr).view(rows.num_tokens, g.index_n_heads, g.index_head_dim)
            q_index = apply_rope(q_index, rows.positions, spec.rope)
            weights = idx.scorer.weights_proj(x).float() * g.index_n_heads ** -0.5
            picks = indexer_topk(q_index, weights, plan, layer_cache.index_keys, cache_spec.index, ratio=spec.ratio,
                                 topk=g.index_topk, page_tokens=page_tokens, rows=rows)
        keys, valid = gather_entries(layer_cache.entries, cache_spec.main, plan, picks, ratio=spec.ratio,
                                     page_tokens=page_tokens, rows=rows)
        return keys, valid, state_rows

    def _forward_kernels(self, x: torch.Tensor, plan: StepPlan, cache: CacheManager) -> torch.Tensor:
        """The same step through the Triton kernels, over every row of the plan's buffers (padding included):
        no host sync, no data-dependent shape, so a CUDA graph can capture it."""
        rows, given = plan.positions.shape[0], x.shape[0]
        if given < rows:  # an eager call on persistent buffers: run the padding rows too
            x = torch.cat((x, x.new_zeros(rows - given, x.shape[1])))
        out = self.attention_core(self.project(x, plan.positions), plan, cache)
        return self.output_projection(out)[:given]

    @torch.no_grad()  # an inference path (the GEMMs write into given outputs: out=)
    def output_projection(self, out: torch.Tensor) -> torch.Tensor:
        """The kernel path's o_b(grouped o_a(out)): bf16 [N, heads, head_dim] -> [N, hidden]."""
        from ..ops import kernels
        if not _takes_gemv(out, self.o_a_proj.weight, self.o_b_proj.weight):
            return self.o_b_proj(self._grouped_o_a(out))
        rows = kernels.gemv_rows(out.reshape(out.shape[0], -1), self.o_a_proj.weight, groups=self.geometry.o_groups)
        return kernels.gemv_rows(rows, self.o_b_proj.weight)

    @torch.no_grad()  # an inference path, also when called directly (the GEMMs write into given outputs: out=)
    def project(self, x: torch.Tensor, positions: torch.Tensor) -> "Projected":
        """The input projections of the kernel path (bf16 GEMMs, `kernels.gemv_rows` for q_a, q_b and the indexer's q_b
        of one row; the q_a, q and kv norms as `kernels.rms_norm_rows`; the compressors' rows from one GEMM with fp32
        output, `_MainCompressor.projected_rows`): everything `attention_core` reads that is a function of x alone."""
        from ..ops import kernels
        from .streams import StepStreams
        g, spec, n = self.geometry, self.spec, x.shape[0]
        csa = spec.kind is LayerKind.CSA
        streams = StepStreams(x.device, concurrent=PROJECT_BESIDE)
        # what the side stream writes is allocated here, on the main stream, before the fork (streams.py)
        kv_raw = torch.empty(n, g.head_dim, dtype=x.dtype, device=x.device)
        kv = torch.empty_like(kv_raw)
        buffers = self.compressor.row_buffers(n, x.device) if spec.compressed else None
        weights = torch.empty(n, g.index_n_heads, dtype=x.dtype, device=x.device) if csa else None
        state_rows = [None, None]
        streams.fork()
        with streams.on_side():  # what the query chain does not read
            torch.mm(x, self.kv_proj.weight.t(), out=kv_raw)
            kernels.rms_norm_rows(kv_raw, self.kv_norm.weight, self.kv_norm.eps, out=kv)
            if spec.compressed:
                state_rows = self.compressor.projected_rows(x, positions, buffers) + [None]
            if csa:
                torch.mm(x, self.compressor.indexer.scorer.weights_proj.weight.t(), out=weights)
        qr = kernels.rms_norm_rows(_project_rows(x, self.q_a_proj), self.q_a_norm.weight, self.q_a_norm.eps)
        q = _project_rows(qr, self.q_b_proj).view(n, g.num_heads, g.head_dim)
        kernels.rms_norm_rows(q, None, g.rms_norm_eps, out=q)  # unweighted, in place
        index_q = (_project_rows(qr, self.compressor.indexer.q_b_proj).view(n, g.index_n_heads, g.index_head_dim)
                   if csa else None)
        streams.join()
        return Projected(q=q, kv=kv, state=state_rows[0], index_state=state_rows[1], index_q=index_q,
                         index_weights=weights)

    def indexer_takes_fp8(self, plan: StepPlan, cache: CacheManager) -> bool:
        """Whether this layer's indexer scores over `plan` take an FP8 MMA path in `attention_core` (the host's
        choice: CSA, MXFP4 keys, the row kernel's path for decode rows or the stacked kernel's for prefill; a row
        whose query fails the path's exactness check still takes the bf16 path)."""
        from ..ops.indexer.kernel import fp8_query_wanted
        return self.spec.kind is LayerKind.CSA and fp8_query_wanted(
            plan, cache.spec.layers[self.layer_index].index, _score_columns(plan, self.spec.ratio))

    def indexer_counts_topk_digit(self, plan: StepPlan, cache: CacheManager) -> bool:
        """Whether this layer's indexer scores over `plan` count the top-k's first digit in `attention_core`, so that
        top-k runs three launches instead of four (host facts: CSA, the scores' row kernel, the split top-k)."""
        from ..ops.indexer.kernel import counts_digits
        from ..ops.topk.kernel import takes_first_digit_counts
        return (self.spec.kind is LayerKind.CSA and counts_digits(plan)
                and takes_first_digit_counts(plan.positions.shape[0], _score_columns(plan, self.spec.ratio)))

    def attention_core(self, p: "Projected", plan: StepPlan, cache: CacheManager) -> torch.Tensor:
        """The attention core on the kernels, over the plan's padded rows: kv insert, compress-and-insert (main,
        then the indexer's keys), indexer scores and top-k (CSA), sparse attention, appends, inverse RoPE ->
        bf16 [R, heads, head_dim], ready for the output projection. No checks: `forward` makes them.

        The step's kv is encoded once into a step page; attention reads its own window keys from there and
        older ones from the ring, which is updated (a byte copy) after attention, or beside it when each request
        has one row in the step (no row's window holds an entry the append overwrites).

        On CUDA the longest chain to attention stays on the current stream: CSA's indexer query and compress, one
        beside the other, then scores and top-k; HCA's main compress; a window layer's q RoPE and kv insert, one beside
        the other. The other kernels attention reads (CSA's and HCA's q RoPE and kv insert, CSA's main compress) and
        CSA's state appends run beside the chain on a side stream (`streams.StepStreams`); HCA's state append and,
        with one row per request, the window append run there beside attention. Elsewhere everything runs in the
        order written, one of the orders the events allow."""
        from ..ops import kernels
        from ..ops.topk.kernel import first_digit_counts, topk_workspace
        from .streams import StepStreams
        g, spec = self.geometry, self.spec
        layer_cache, cache_spec = cache.pools.layers[self.layer_index], cache.spec.layers[self.layer_index]
        page_tokens, main = cache.spec.page_tokens, cache_spec.main
        positions = plan.positions
        rows = positions.shape[0]
        device = p.q.device
        csa = spec.kind is LayerKind.CSA
        # everything the side stream touches is allocated here, on the main stream, before the fork (streams.py)
        cos_sin = plan.derived(("rope", spec.rope), lambda: rope_cos_sin(spec.rope, positions))
        row_slots = plan.derived("rows", lambda: torch.arange(rows, dtype=torch.int32, device=device))
        # the q RoPE's output: each head's rope dims (attention reads the others from p.q), or the whole roped head
        rope_only = spec.kind in Q_ROPE_DIMS_ONLY and spec.rope.dim < g.head_dim
        q_roped = torch.empty((*p.q.shape[:2], spec.rope.dim if rope_only else p.q.shape[2]), dtype=torch.bfloat16,
                              device=device)
        step_kv = torch.empty((1, main.page_bytes(rows)), dtype=torch.uint8, device=device)
        state_rows, picks = [], None
        entries = max(plan.max_seq_len // spec.ratio, 1) if spec.compressed else None  # per-row bound, host-known
        columns = _score_columns(plan, spec.ratio) if spec.compressed else None
        if spec.compressed:
            entry_cos_sin = plan.derived(("entry rope", spec.rope, spec.ratio),
                                         lambda: rope_cos_sin(spec.rope, plan.entries[spec.ratio].index * spec.ratio))
            insert = dict(ratio=spec.ratio, overlap=csa, eps=g.rms_norm_eps, rope=spec.rope, out_dtype=q_roped.dtype,
                          page_tokens=page_tokens, cos_sin=entry_cos_sin)
            state_rows.append((layer_cache.state_kv, layer_cache.state_score, *p.state))
        if csa:
            idx, index_layout = self.compressor.indexer, cache_spec.index
            state_rows.append((layer_cache.index_state_kv, layer_cache.index_state_score, *p.index_state))
            q_index = torch.empty(p.index_q.shape, dtype=torch.float32, device=device)
            weights = torch.empty(p.index_weights.shape, dtype=torch.float32, device=device)
            # MXFP4 keys: the query's FP8 MMA operand too, made once per row by the query kernel for the scores
            # kernel (a host decision, the scores wrapper's own)
            q_fp8 = (torch.empty(p.index_q.shape, dtype=torch.uint8, device=device),
                     torch.empty(p.index_weights.shape, dtype=torch.float32, device=device)
                     ) if self.indexer_takes_fp8(plan, cache) else None

        def insert_kv(**launch):
            kernels.kv_insert(p.kv, positions, spec.rope, main, step_kv, rows, row_slots, cos_sin=cos_sin, **launch)

        def append(state):  # a compressor's step rows into its state ring, after the step's last read of the ring
            ring_kv, ring_logits, kv_rows, logit_rows = state
            kernels.append_state(ring_kv, ring_logits, plan, kv_rows, logit_rows)

        def compress_main():
            kernels.compress_insert(layer_cache.state_kv, layer_cache.state_score, plan, *p.state,
                            norm_weight=self.compressor.kv_norm.weight, layout=main, pool=layer_cache.entries,
                            main=True, **insert)

        # the main stream keeps the longest chain to attention: the indexer chain (CSA), the main compress (HCA) or
        # the q RoPE and kv insert (window layers); the rest goes to the side stream
        streams = StepStreams(device)
        # With one row per request (every decode step: counts are >= 1), the ring entry a row's append overwrites,
        # position p - window, is outside that row's window (p - window + 1 .. p), and no other row reads that
        # request's ring: the append may then run before attention, beside the chain, instead of after it on the
        # main stream. A host fact of the plan; a graph captured over a decode plan replays decode plans only
        # (`DecodeGraph.step` checks one token per request).
        window_first = WINDOW_APPEND_BESIDE and plan.num_tokens == plan.num_requests
        # a window layer's whole chain: the q RoPE and the kv insert side by side (they share no tensor)
        window_chain = ROPE_LAUNCHES_KV_INSERT and not spec.compressed
        streams.fork()
        try:  # the side stream is joined whatever happens: no tensor it uses is freed under it
            if window_chain:
                kernels.rope_rows(p.q, *cos_sin, out=q_roped, launch_next=True)
                insert_kv(wait_late=True)
            else:
                with streams.on_side():
                    kernels.rope_rows(p.q, *cos_sin, out=q_roped)
                    if spec.compressed:
                        insert_kv()
                    if csa:
                        compress_main()
                        append(state_rows[0])  # no later kernel of the step reads the main state ring
                if not spec.compressed:
                    insert_kv()
                elif not csa:
                    compress_main()
            if csa:
                # RoPE, Hadamard rotation, MXFP4 / FP8 round trip and head weights in one kernel (bit for bit the
                # torch path's query), and the indexer compress: a pair (they share no tensor), the first letting the
                # second launch at once, the second waiting for the first, last, so the scores kernel after them sees
                # both complete
                def query(**pair_end):
                    kernels.indexer_query_and_weights(p.index_q, p.index_weights, *cos_sin, index_layout,
                                              scale=g.index_n_heads ** -0.5, out=q_index, weights_out=weights,
                                              fp8_out=q_fp8, **pair_end)

                def compress(**pair_end):
                    kernels.compress_insert(layer_cache.index_state_kv, layer_cache.index_state_score, plan, *p.index_state,
                                    norm_weight=idx.kv_norm.weight, layout=index_layout, pool=layer_cache.index_keys,
                                    main=False, **insert, **pair_end)

                first, second = (compress, query) if COMPRESS_FIRST else (query, compress)
                first(launch_next=INDEXER_PAIR)
                second(wait_late=INDEXER_PAIR)
                streams.side_waits(streams.main_mark())
                with streams.on_side():
                    append(state_rows[1])
                # top-k leaves its workspace zeroed, so one serves every CSA layer of the step. Made before the
                # scores kernel counts into it: a graph replays the zeroing where it was captured, the first use
                workspace = plan.derived(("topk workspace", columns, g.index_topk),
                                         lambda: topk_workspace(rows, columns, g.index_topk, device))
                # decode: the scores kernel counts the split top-k's first digit as it writes them, and top-k skips
                # that pass (phase A)
                counts = first_digit_counts(workspace) if self.indexer_counts_topk_digit(plan, cache) else None
                scores = kernels.indexer_scores_paged(q_index, weights, plan, layer_cache.index_keys, index_layout,
                                              ratio=spec.ratio, page_tokens=page_tokens, max_entries=columns,
                                              q_fp8=q_fp8, digit_counts=counts)
                visible = plan.derived(("visible", spec.ratio),
                                       lambda: torch.clamp((positions + 1) // spec.ratio, min=0).to(torch.int32))
                picks = kernels.topk_indices(scores, visible, g.index_topk, workspace=workspace,
                                     first_digit_counted=counts is not None)
            if window_first:
                if not spec.compressed:  # the step page: a window layer's kv insert runs on main
                    streams.side_waits(streams.main_mark())
                # nothing on the side stream feeds a window chain's attention
                attention_inputs = None if window_chain else streams.side_mark()
                with streams.on_side():
                    kernels.append_window(layer_cache.window, main, g.window, plan, step_kv)
                streams.main_waits(attention_inputs)
            else:
                streams.join()
            if spec.compressed and not csa:
                # HCA's state append, after its compress's read of the ring: beside attention, which never reads
                # the ring, rather than on the chain before it
                streams.side_waits(streams.main_mark())
                with streams.on_side():
                    append(state_rows[0])
            out = kernels.sparse_attention_paged(p.q if rope_only else q_roped, plan,
                                         q_rope_dims=q_roped if rope_only else None, sinks=self.sinks,
                                         scale=g.head_dim ** -0.5, layout=main,
                                         window=g.window, window_pool=layer_cache.window, step_kv=step_kv,
                                         entry_pool=layer_cache.entries if spec.compressed else None,
                                         ratio=spec.ratio if spec.compressed else 0, page_tokens=page_tokens,
                                         picks=picks, max_entries=entries,
                                         inverse_rope=cos_sin)  # the output's inverse RoPE too
        finally:
            streams.join()
        if not window_first:
            kernels.append_window(layer_cache.window, main, g.window, plan, step_kv)
        if plan.snapshots is not None:  # prefix caching: rows of boundaries inside the step
            cache.capture_boundaries(self.layer_index, plan, step_kv=step_kv, state_rows=state_rows)
        return out

    def _grouped_o_a(self, out: torch.Tensor) -> torch.Tensor:
        """[N, heads, head_dim] -> [N, o_groups * o_lora_rank]: each contiguous head group through its own block."""
        g = self.geometry
        groups = out.reshape(out.shape[0], g.o_groups, -1).transpose(0, 1)  # [G, N, in]
        weight = self.o_a_proj.weight.view(g.o_groups, g.o_lora_rank, -1).transpose(1, 2)  # [G, in, r]
        # written straight into o_b's row layout [N, G, r] (no copy of [G, N, r]: 128 MB for an 8192-row chunk; H100,
        # docs/performance.md: the output side at batch 64 72.4 -> 68.6 us, equal bytes)
        rows = torch.empty(out.shape[0], g.o_groups, g.o_lora_rank, dtype=out.dtype, device=out.device)
        with torch.no_grad():  # an inference path (`forward` is no_grad too); out= takes no autograd
            torch.bmm(groups, weight, out=rows.transpose(0, 1))
        return rows.view(out.shape[0], -1)

    def _check(self, x: torch.Tensor, plan: StepPlan, cache: CacheManager, backend: str) -> None:
        """Everything the step needs, checked before anything is written."""
        if not isinstance(cache, CacheManager):
            raise TypeError(f"cache: expected a CacheManager, got {type(cache).__name__}")
        if not isinstance(plan, StepPlan):
            raise TypeError(f"plan: expected a StepPlan from CacheManager.plan_step, got {type(plan).__name__}")
        require(plan.cache_id == cache.cache_id, "plan: made by another CacheManager than `cache`")
        require(plan.step == cache.steps_planned, f"plan: step {plan.step} is stale, the cache has planned step "
                                                  f"{cache.steps_planned}; run every layer over the latest plan")
        require(not cache.layer_has_run(self.layer_index),
                f"layer {self.layer_index} already ran over plan step {plan.step}: plan the next step first")
        released = [rid for rid in plan.request_ids if not cache.is_live(rid)]
        require(not released, f"plan: requests {released} were released after the plan was made")
        g, cg = self.geometry, cache.geometry
        mismatch = [f for f in _LAYER_FIELDS if getattr(g, f) != getattr(cg, f)]
        if self.layer_index >= cg.num_layers or cg.layers[self.layer_index] != self.spec:
            mismatch.append(f"layers[{self.layer_index}]")
        require(not mismatch, f"layer {self.layer_index}: geometry differs from the cache's in {mismatch}")
        weight = self.q_a_proj.weight
        require(isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] == g.hidden_size,
                f"hidden_states: expected [N, {g.hidden_size}], got "
                f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        require(x.shape[0] in (plan.num_tokens, plan.positions.shape[0]),
                f"hidden_states: {x.shape[0]} rows, the plan has {plan.num_tokens} tokens "
                f"({plan.positions.shape[0]} rows with padding)")
        require(x.dtype == weight.dtype, f"hidden_states: dtype {x.dtype}, the layer's weights are {weight.dtype}")
        require(x.device == weight.device == cache.device,
                f"hidden_states on {x.device}, weights on {weight.device}, cache on {cache.device}")
        if backend == "triton":
            require(kernels_can_run(x.device), f"backend 'triton': the kernels need a CUDA device (or "
                                               f"TRITON_INTERPRET=1 on the CPU), the layer is on {x.device}")
            require(x.dtype == torch.bfloat16, f"backend 'triton': the kernels take bf16 activations, got {x.dtype}")


def _score_columns(plan: StepPlan, ratio: int) -> int:
    """The width of a step's indexer score rows: the per-row entry bound rounded up to a multiple of 16, so the
    indexer and top-k kernels see the same alignment class at every step (Triton compiles a variant per class of an
    int argument; the eager steps' bound moves)."""
    return -(-max(plan.max_seq_len // ratio, 1) // 16) * 16


def init_random_weights(module: nn.Module, seed: int = 0) -> nn.Module:
    """Fill a DSV4Attention or a transformers DeepseekV4Attention (same names) with reproducible random weights
    of realistic scale: linear N(0, 1/fan_in), norm weights 1 + N(0, 0.1), positional biases N(0, 0.5),
    sinks N(0, 1). Values are drawn in fp32 on the parameters' device, then cast: the same seed gives the same
    weights for every dtype on one device."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            if param.device not in generators:
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            g, shape = generators[param.device], param.shape
            randn = functools.partial(torch.randn, device=param.device)
            if name.endswith("norm.weight"):
                value = 1 + 0.1 * randn(shape, generator=g)
            elif name.endswith("position_bias"):
                value = 0.5 * randn(shape, generator=g)
            elif name.endswith("sinks"):
                value = randn(shape, generator=g)
            else:
                value = randn(shape, generator=g) * shape[-1] ** -0.5
            param.copy_(value.to(param.dtype))
    return module
