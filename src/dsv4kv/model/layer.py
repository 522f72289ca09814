"""DSV4Attention: one DeepSeek-V4 attention layer computed over the paged cache.

    layer(hidden_states [N, hidden], plan, cache) -> [N, hidden]       the public call: checks, then `run`
    layer.run(hidden_states, plan, pages) -> [N, hidden]               the step itself, over the layer's own pages

for the N tokens of a step in plan order, any mix of prefill chunks and decode tokens. Per step:
q path -> kv path -> compress-and-insert (main, then the indexer's keys) -> indexer top-k (CSA) ->
gather (window and compressed keys) -> sparse attention with sink -> append (window ring, compressor
state) -> inverse RoPE -> grouped output projection. Reads come before append because append may
overwrite ring rows the step's own earlier tokens still need.

A layer sees its step through two objects: the step's plan, with the attention plan of its kind built once per
step (`attention_plan.py`), and its own pages (`cache.pools.LayerCache`): it never calls the cache manager. What the
prefix cache needs from a step (boundary snapshots) the plan describes, and the layer writes into its own pages.

Numerics follow the cache's formats (`docs/numerics.md`): the kv the step attends to and the entries it
stores are exactly what the cache's format holds, so how a sequence is split into steps changes a
token's output only by the rounding of differently shaped GEMMs. Projections run in the weights' dtype;
norms, RoPE, the compressor (as the official model), the indexer scores and attention run in fp32. The kernel path
(`project`) runs the compressors' projections as one bf16 tensor-core GEMM with fp32 products and sums (exact
products, as the fp32 GEMM's) and its norms as kernels that sum in their own order (docs/numerics.md).
"""

from __future__ import annotations

import functools
from typing import Mapping

import torch
from torch import nn

from ..backend import kernels_can_run
from ..cache.plan import StepPlan
from ..cache.pools import LayerCache
from ..checks import require
from ..geometry import LayerKind, ModelGeometry
from ..ops.attention.gather import gather_entries, gather_window, visible_entries
from ..ops.attention.reference import sparse_attention
from ..ops.compress.reference import append_state, compress_and_insert
from ..ops.indexer.reference import indexer_topk
from ..ops.projection.reference import unit_rms_norm
from ..ops.rope.reference import apply_rope
from ..ops.shared.rows import StepRows
from ..ops.window.reference import append_window
from .attention_plan import AttentionPlan, attention_plan
from .compressor import MainCompressor, RMSNorm
from .schedules import Projected, Schedule, attention_core
from .weights import check_state_keys, layer_state_dict

__all__ = ["DSV4Attention", "RMSNorm", "init_random_weights", "BACKENDS"]

# "torch": the PyTorch reference ops; "triton": the kernels (CUDA, or CPU under TRITON_INTERPRET=1);
# "auto": the kernels for bf16 activations on CUDA, else the reference.
BACKENDS = ("auto", "torch", "triton")

# Geometry fields one layer's weights and computation depend on; the layer's own LayerSpec is compared too.
_LAYER_FIELDS = ("hidden_size", "num_heads", "head_dim", "rope_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                 "window", "index_n_heads", "index_head_dim", "index_topk", "rms_norm_eps")


def _takes_gemv(x: torch.Tensor, schedule: Schedule, *weights: torch.Tensor) -> bool:
    """Whether x's projections by `weights` go through `kernels.gemv_rows`: its row count, and the operands it takes
    (contiguous bf16; anything else keeps torch's GEMM rather than being refused mid-step)."""
    return (x.shape[0] <= schedule.gemv_rows and
            all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in (x, *weights)))


def _project_rows(x: torch.Tensor, linear: nn.Linear, schedule: Schedule) -> torch.Tensor:
    """linear(x) on the kernel path (no bias): `kernels.gemv_rows` for few rows, else torch's GEMM."""
    from ..ops import kernels
    return kernels.gemv_rows(x, linear.weight) if _takes_gemv(x, schedule, linear.weight) else linear(x)


class DSV4Attention(nn.Module):
    """Layer `layer_index` of `geometry`. Parameter names are transformers' `DeepseekV4Attention` names."""

    def __init__(self, geometry: ModelGeometry, layer_index: int, *, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None, backend: str = "auto",
                 schedule: Schedule | None = None):
        super().__init__()
        self.backend = backend
        # how the kernel path schedules a step (`schedules.Schedule`): replace it to compare schedules
        self.schedule = schedule if schedule is not None else Schedule()
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
            self.compressor = MainCompressor(g, self.spec.ratio, self.spec.kind is LayerKind.CSA, **kw)

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
        dequantized (see `dsv4kv.model.weights`). Missing or unexpected weights raise `WeightError`."""
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
    def forward(self, hidden_states: torch.Tensor, plan: StepPlan, cache) -> torch.Tensor:
        """The layer over one step: hidden_states [N, hidden_size] in plan order, the weights' dtype and the
        cache's device -> [N, hidden_size]. N is plan.num_tokens, or the plan's padded row count
        (plan.positions.shape[0], for a captured graph); outputs of padding rows are unspecified. `cache`: the
        `CacheManager` that made the plan. Each layer runs once per plan, in any layer order; everything is checked
        before anything is written."""
        backend = self.resolved_backend(hidden_states.device if isinstance(hidden_states, torch.Tensor)
                                        else getattr(cache, "device", torch.device("cpu")))
        self._check(hidden_states, plan, cache, backend)
        return self.run(hidden_states, plan, cache.pages(self.layer_index), backend=backend)

    @torch.no_grad()
    def run(self, hidden_states: torch.Tensor, plan: StepPlan, pages: LayerCache, *,
            backend: str | None = None) -> torch.Tensor:
        """The step itself, over this layer's own `pages` (the plan's, for this layer), with no checks: `forward`
        makes them, then calls this."""
        backend = backend or self.resolved_backend(hidden_states.device)
        plan.status.layers_run.add(self.layer_index)
        attn = self.attention_plan(plan, pages, backend)
        if backend == "triton":
            return self._forward_kernels(hidden_states, attn, pages)
        n = plan.num_tokens
        if hidden_states.shape[0] == n:
            return self._forward_reference(hidden_states, attn, pages)
        out = self._forward_reference(hidden_states[:n], attn, pages)
        return torch.cat((out, out.new_zeros(hidden_states.shape[0] - n, out.shape[1])))

    def attention_plan(self, plan: StepPlan, pages: LayerCache, backend: str | None = None) -> AttentionPlan:
        """The attention plan of this layer's kind over `plan` (built by the first layer of the kind to ask)."""
        backend = backend or self.resolved_backend(pages.window.device)
        return attention_plan(plan, pages.spec, self.geometry, backend)

    def _forward_reference(self, hidden_states: torch.Tensor, attn: AttentionPlan, pages: LayerCache) -> torch.Tensor:
        g, spec, plan = self.geometry, self.spec, attn.step
        layer_cache, cache_spec = pages, pages.spec
        page_tokens = cache_spec.page_tokens
        rows = attn.rows
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
        layer_cache.write_boundaries(plan.snapshots, kv=kv, state_rows=state_rows)  # prefix caching

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

    def _forward_kernels(self, x: torch.Tensor, attn: AttentionPlan, pages: LayerCache) -> torch.Tensor:
        """The same step through the Triton kernels, over every row of the plan's buffers (padding included):
        no host sync, no data-dependent shape, so a CUDA graph can capture it."""
        rows, given = attn.step.positions.shape[0], x.shape[0]
        if given < rows:  # an eager call on persistent buffers: run the padding rows too
            x = torch.cat((x, x.new_zeros(rows - given, x.shape[1])))
        out = self.attention_core(self.project(x, attn.step.positions), attn, pages)
        return self.output_projection(out)[:given]

    def attention_core(self, p: Projected, attn: AttentionPlan, pages: LayerCache) -> torch.Tensor:
        """The attention core on the kernels (`schedules.attention_core`): bf16 [R, heads, head_dim], ready for the
        output projection."""
        return attention_core(self, p, attn, pages)

    @torch.no_grad()  # an inference path (the GEMMs write into given outputs: out=)
    def output_projection(self, out: torch.Tensor) -> torch.Tensor:
        """The kernel path's o_b(grouped o_a(out)): bf16 [N, heads, head_dim] -> [N, hidden]."""
        from ..ops import kernels
        if not _takes_gemv(out, self.schedule, self.o_a_proj.weight, self.o_b_proj.weight):
            return self.o_b_proj(self._grouped_o_a(out))
        rows = kernels.gemv_rows(out.reshape(out.shape[0], -1), self.o_a_proj.weight, groups=self.geometry.o_groups)
        return kernels.gemv_rows(rows, self.o_b_proj.weight)

    @torch.no_grad()  # an inference path, also when called directly (the GEMMs write into given outputs: out=)
    def project(self, x: torch.Tensor, positions: torch.Tensor) -> Projected:
        """The input projections of the kernel path (bf16 GEMMs, `kernels.gemv_rows` for q_a, q_b and the indexer's q_b
        of one row; the q_a, q and kv norms as `kernels.rms_norm_rows`; the compressors' rows from one GEMM with fp32
        output, `MainCompressor.projected_rows`): everything `attention_core` reads that is a function of x alone."""
        from ..ops import kernels
        from .streams import StepStreams
        g, spec, n = self.geometry, self.spec, x.shape[0]
        csa = spec.kind is LayerKind.CSA
        streams = StepStreams(x.device, concurrent=self.schedule.side_stream)
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
        qr = kernels.rms_norm_rows(_project_rows(x, self.q_a_proj, self.schedule), self.q_a_norm.weight, self.q_a_norm.eps)
        q = _project_rows(qr, self.q_b_proj, self.schedule).view(n, g.num_heads, g.head_dim)
        kernels.rms_norm_rows(q, None, g.rms_norm_eps, out=q)  # unweighted, in place
        index_q = (_project_rows(qr, self.compressor.indexer.q_b_proj, self.schedule).view(n, g.index_n_heads, g.index_head_dim)
                   if csa else None)
        streams.join()
        return Projected(q=q, kv=kv, state=state_rows[0], index_state=state_rows[1], index_q=index_q,
                         index_weights=weights)

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

    def _check(self, x: torch.Tensor, plan: StepPlan, cache, backend: str) -> None:
        """Everything the step needs, checked before anything is written. `cache` is read for what it says of the
        plan and of the layer's pages, never written."""
        if not callable(getattr(cache, "pages", None)) or not hasattr(cache, "cache_id"):
            raise TypeError(f"cache: expected a CacheManager, got {type(cache).__name__}")
        if not isinstance(plan, StepPlan):
            raise TypeError(f"plan: expected a StepPlan from CacheManager.plan_step, got {type(plan).__name__}")
        require(plan.cache_id == cache.cache_id, "plan: made by another CacheManager than `cache`")
        require(plan.status.current, f"plan: step {plan.step} is stale, the cache has planned step "
                                     f"{cache.steps_planned}; run every layer over the latest plan")
        require(self.layer_index not in plan.status.layers_run,
                f"layer {self.layer_index} already ran over plan step {plan.step}: plan the next step first")
        left = [rid for rid in plan.request_ids if rid in plan.status.left]
        require(not left, f"plan: requests {left} were released after the plan was made")
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
