"""The named benchmark workloads of `dsv4kv bench` (V4-Flash geometry, FP8 entries, MXFP4 indexer keys).

Each workload checks what it times against the PyTorch reference in the same run (a failed check refuses
the figure) and adds `Result`s to the report. Long contexts are planned (every block allocated) and filled
with random valid bytes (`synthetic.fill_layer`) instead of being prefilled, except where a workload
compares outputs with transformers, which needs a real history.

    machine   copy bandwidth and bf16 GEMM rate (every other figure is a fraction of these)
    topk      top-k (k = 512) over one row of 16K .. 1M candidates and over batches
    insert    kv insert (RoPE, FP8 encode, write) and compress-and-insert at sizes that fill the GPU
    decode    a decode step of a layer: the attention core and the whole layer under CUDA graphs, per-kernel
              times (profiler), against context length (batch 1) and batch (128K context); CSA with FP8 indexer
              keys too at the indexer's target points
    layer     our layer against transformers' DeepseekV4Attention, decode, batch 1, 4K and 16K, each kind
    prefill   a CSA layer over a 64K-token prompt in 8K chunks, against the indexer's FLOP floor
    scale     one request at 2^20 tokens through all 43 layers; the most concurrent 128K requests that fit
    flashmla  our sparse attention beside FlashMLA's on the same pages (skipped without `import flash_mla`)
    chat      the engine over a shared 8K system prompt and 64 different 1K-token questions, prefix caching off and
              on: time to first token, total time, output tokens/s, hit rate (the demo's V4-Flash-geometry model)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import statistics
import json
import time
from dataclasses import dataclass
from importlib import resources
from typing import Callable

import torch

from ...geometry import LayerKind, ModelGeometry
from ...model.layer import DSV4Attention, init_random_weights
from ...cache.manager import CacheManager
from ...cache.planner import MemoryPlan
from ...checks import require
from .picks import explain_rows
from .report import Report, Result
from .synthetic import fill_layer
from .flashmla import flashmla
from .timing import copy_bandwidth, gemm_rate, profile_kernels, time_cuda

__all__ = ["Context", "WORKLOADS", "QUICK"]

ROW_TOL = 2e-2  # kernels against the reference layer: row error / row max (tests/test_kernel_layer.py)
# A CSA row beyond ROW_TOL passes only when its top-k picks explain it (bench/picks.py): each of the kernels' picks
# within TIE_TOL of the score range of the k-th best, by the reference's scores (a near-tie flip) or by the
# reference's scores of the kernels' own inputs (a flip from this step's keys, encoded one grid step apart). The
# kernels and the reference score the same inputs with exact products and another summation order: ~1e-6 of the
# score range; a wrong pick (an invisible or a low-scoring entry) is orders of magnitude further.
TIE_TOL = 1e-4
HF_TOL = 0.05  # exact mode against transformers in fp32, decode rows (tests/test_oracle.py: 0.03 where picks agree)
# CSA in exact mode stores bf16 indexer keys where transformers scores fp32 keys: near-tie picks flip, and a CSA
# row beyond HF_TOL passes only if each of our picks scores, by transformers' fp32 scores, within HF_TIE_TOL of the
# score range of its k-th best (tests/test_oracle.py's TIE_TOL).
HF_TIE_TOL = 0.02


@dataclass
class Context:
    device: torch.device
    report: Report
    quick: bool
    log: Callable[[str], None]
    runs: int = 50

    @property
    def geometry(self) -> ModelGeometry:
        return _flash()


@functools.lru_cache(maxsize=1)
def _flash() -> ModelGeometry:
    return ModelGeometry.from_hf_config("flash")


def _layer_index(g: ModelGeometry, kind: str) -> int:
    return next(i for i, layer in enumerate(g.layers) if layer.kind.short.lower() == kind)


def _row_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row max |out - ref| / max |ref| (inf where a row of out is not finite)."""
    out, ref = out.float(), ref.float()
    err = (out - ref).abs().amax(dim=-1) / ref.abs().amax(dim=-1).clamp_min(1e-30)
    return torch.where(torch.isfinite(out).all(dim=-1), err, float("inf"))


def check_layer(layer: DSV4Attention, x: torch.Tensor, plan, cache: CacheManager, what: str) -> tuple[str, bool]:
    """The layer on the kernels against the reference layer from the same cache state (restored after each),
    row by row: every row within ROW_TOL, or (CSA) a row beyond it explained by its picks, with the indexer's
    inputs within their rounding (bench/picks.py). Returns (check text, passed)."""
    from ...ops.shared.rows import step_rows
    from .picks import CSACapture

    tensors = cache.pools.layers[layer.layer_index].tensors()
    snapshot = [t.clone() for t in tensors]

    def restore():
        for t, s in zip(tensors, snapshot):
            t.copy_(s)

    pages = cache.pages(layer.layer_index)
    with CSACapture() as capture, torch.no_grad():
        ref = layer._forward_reference(x, layer.attention_plan(plan, pages, "torch"), pages)
        restore()
        out = layer._forward_kernels(x, layer.attention_plan(plan, pages, "triton"), pages)
        restore()
    errors = _row_errors(out[:ref.shape[0]], ref)
    del ref, out, snapshot
    spec = layer.spec
    if spec.kind is not LayerKind.CSA:
        verdict = explain_rows(errors, None, None, None, row_tol=ROW_TOL, tie_tol=TIE_TOL)
        return verdict.text(what), verdict.passed
    rows = step_rows(plan)
    new_entries = sum(s // spec.ratio - st // spec.ratio for s, st in zip(rows.host_seq_lens, rows.host_starts))
    verdict, inputs = capture.verdict(errors, row_tol=ROW_TOL, tie_tol=TIE_TOL, new_key_bytes=new_entries
                                      * cache.spec.layers[layer.layer_index].index.entry_bytes)
    return f"{verdict.text(what)}; {inputs.text()}", verdict.passed and inputs.passed


def _row_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst row of max |out - ref| / max |ref| (NaN anywhere counts as infinite)."""
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    err = (out - ref).abs().amax(dim=-1) / ref.abs().amax(dim=-1).clamp_min(1e-30)
    return float(err.max())


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# --- machine -------------------------------------------------------------------------------------------------
def machine(ctx: Context) -> None:
    ctx.log("machine: copy bandwidth and bf16 GEMM rate")
    bw, flops = copy_bandwidth(ctx.device), gemm_rate(ctx.device)
    ctx.report.meta.update(copy_bandwidth_Bps=bw, bf16_gemm_flops=flops)
    ctx.report.add(Result("machine", "copy 1 GiB -> 1 GiB (read + write)", {}, 2 * (1 << 30) / bw * 1e6,
                          bytes=2 << 30, check="torch copy_"))
    ctx.report.add(Result("machine", "bf16 GEMM 8192^3", {}, 2 * 8192 ** 3 / flops * 1e6, flops=2 * 8192 ** 3,
                          check="torch.matmul"))


# --- top-k ---------------------------------------------------------------------------------------------------
def topk(ctx: Context) -> None:
    from ...ops.topk.kernel import topk_indices
    from ...ops.topk.kernel import topk_workspace
    from ...ops.topk.reference import topk_picks

    k = ctx.geometry.index_topk
    shapes = [(1, 65536), (1, 262144), (64, 32768)] if ctx.quick else \
        [(1, 4096), (1, 16384), (1, 65536), (1, 262144), (1, 1 << 20), (8, 262144), (64, 32768), (256, 32768)]
    for rows, cols in shapes:
        g = torch.Generator(device=ctx.device).manual_seed(rows * cols)
        scores = torch.randn(rows, cols, generator=g, device=ctx.device)
        lengths = torch.full((rows,), cols, dtype=torch.int32, device=ctx.device)
        out = torch.empty(rows, k, dtype=torch.int32, device=ctx.device)
        workspace = topk_workspace(rows, cols, k, ctx.device)
        run = lambda: topk_indices(scores, lengths, k, out=out, workspace=workspace)  # noqa: E731
        run()
        want = topk_picks(scores, k).sort(dim=1).values
        passed = torch.equal(out.long().sort(dim=1).values, want)
        timing = time_cuda(run, device=ctx.device, runs=ctx.runs)
        kernels = profile_kernels(run, device=ctx.device)
        ctx.report.add(Result("topk", f"top-{k} of {cols} x {rows} rows", {"rows": rows, "cols": cols, "k": k},
                              timing.median_us, bytes=rows * cols * 4,
                              check=f"index sets {'equal' if passed else 'DIFFER'} (torch stable sort)", passed=passed,
                              extra={**timing.as_dict(), "kernels_us": kernels}))
        ctx.log(f"  topk {rows} x {cols}: {timing.median_us:.1f} us; kernels "
                + ", ".join(f"{name[:12]} {us:.1f}" for name, us in kernels))


# --- insert / compress ---------------------------------------------------------------------------------------
def insert(ctx: Context) -> None:
    from ...ops.compress.kernel import compress_insert
    from ...ops.window.kernel import kv_insert
    from ...ops.shared.rows import step_rows
    from ...ops.compress.reference import compress_and_insert
    from ...ops.rope.reference import apply_rope, rope_cos_sin

    g = ctx.geometry
    i_csa = _layer_index(g, "csa")
    for n in ([65536] if ctx.quick else [64, 4096, 65536]):
        cache = CacheManager(g, max_requests=1, max_tokens=n, device=ctx.device)
        layer_spec = cache.spec.layers[i_csa]
        main, pool_entries = layer_spec.main, layer_spec.entries_per_page
        pool = torch.zeros(-(-n // pool_entries), layer_spec.entry_page_bytes, dtype=torch.uint8, device=ctx.device)
        gen = torch.Generator(device=ctx.device).manual_seed(n)
        kv = torch.randn(n, g.head_dim, generator=gen, device=ctx.device).bfloat16()
        positions = torch.randint(0, g.max_position, (n,), generator=gen, device=ctx.device, dtype=torch.int32)
        slots = torch.randperm(n, generator=gen, device=ctx.device).int()
        rope = g.layers[i_csa].rope
        cos_sin = rope_cos_sin(rope, positions)  # per step, shared by the layers: the kernel alone is timed
        run = lambda: kv_insert(kv, positions, rope, main, pool, pool_entries, slots, cos_sin=cos_sin)  # noqa: E731
        run()
        want = torch.zeros_like(pool)
        main.write(want, pool_entries, slots, apply_rope(kv, positions, rope))
        passed = torch.equal(pool, want)
        timing = time_cuda(run, device=ctx.device, runs=ctx.runs)
        nbytes = n * (2 * g.head_dim + main.entry_bytes + 4 * rope.dim)  # kv bf16, entry, cos + sin fp32
        ctx.report.add(Result("insert", f"kv_insert {n} rows (RoPE, FP8 MODEL1, scatter)", {"rows": n},
                              timing.median_us, bytes=nbytes, check=f"bytes {'equal' if passed else 'DIFFER'}",
                              passed=passed, extra=timing.as_dict()))
        ctx.log(f"  kv_insert {n}: {timing.median_us:.1f} us")
        del cache, pool, want
        _free()

    # compress-and-insert over a prefill chunk: CSA main entries and indexer keys, every entry completing
    for n in ([8192] if ctx.quick else [1024, 8192, 32768]):
        cache = CacheManager(g, max_requests=1, max_tokens=n, device=ctx.device)
        rid = cache.admit()
        plan = cache.plan_step([(rid, n)])
        lc, ls = cache.pools.layers[i_csa], cache.spec.layers[i_csa]
        gen = torch.Generator(device=ctx.device).manual_seed(n + 1)
        spec = g.layers[i_csa]
        for main_entry, layout, pool, state_kv, state_score, d in (
                (True, ls.main, lc.entries, lc.state_kv, lc.state_score, g.head_dim),
                (False, ls.index, lc.index_keys, lc.index_state_kv, lc.index_state_score, g.index_head_dim)):
            kv_rows = torch.randn(n, 2 * d, generator=gen, device=ctx.device)
            logit_rows = torch.randn(n, 2 * d, generator=gen, device=ctx.device)
            norm = 1 + 0.1 * torch.randn(d, generator=gen, device=ctx.device)
            args = dict(ratio=spec.ratio, overlap=True, eps=g.rms_norm_eps, rope=spec.rope, out_dtype=torch.bfloat16,
                        page_tokens=cache.spec.page_tokens, norm_weight=norm, layout=layout)
            cos_sin = rope_cos_sin(spec.rope, plan.entries[spec.ratio].index * spec.ratio)
            want_pool = pool.clone()
            compress_and_insert(state_kv.clone(), state_score.clone(), kv_rows=kv_rows, logit_rows=logit_rows,
                                pool=want_pool, plan=plan, rows=step_rows(plan), **args)
            run = lambda: compress_insert(state_kv, state_score, plan, kv_rows, logit_rows, pool=pool,  # noqa: E731
                                          main=main_entry, cos_sin=cos_sin, **args)
            run()
            entries = n // spec.ratio
            differ = int((pool != want_pool).sum())
            passed = differ <= 0.01 * entries * layout.entry_bytes
            timing = time_cuda(run, device=ctx.device, runs=ctx.runs)
            nbytes = n * 2 * (2 * d) * 4 + entries * layout.entry_bytes  # rows (kv + logits) read once, entries written
            what = "main entries (FP8)" if main_entry else "indexer keys (MXFP4)"
            ctx.report.add(Result("insert", f"compress_insert {n} rows -> {entries} {what}",
                                  {"rows": n, "main": main_entry}, timing.median_us, bytes=nbytes,
                                  check=f"{differ} of {entries * layout.entry_bytes} bytes differ (<= 1% allowed)",
                                  passed=passed, extra=timing.as_dict()))
            ctx.log(f"  compress_insert {n} {what}: {timing.median_us:.1f} us")
        del cache
        _free()


# --- decode --------------------------------------------------------------------------------------------------
def _decode_grid(quick: bool) -> list[tuple[int, int, tuple[str, ...], str]]:
    """(context, batch, kinds, indexer key format) configurations: MXFP4 keys (the official format) everywhere, and
    FP8 keys at the indexer's target points (issue 12: FP8 keys at the same fractions of their own bytes)."""
    if quick:
        grid = [(16384, 1, ("csa",)), (1 << 20, 1, ("csa",)), (131072, 64, ("csa",))]
        fp8 = [(1 << 20, 1), (131072, 64)]
    else:
        grid = [(4096, 1, ("window", "csa", "hca")), (16384, 1, ("window", "csa", "hca")), (65536, 1, ("csa",)),
                (131072, 1, ("csa", "hca")), (262144, 1, ("csa",)), (1 << 20, 1, ("csa", "hca")),
                (131072, 8, ("csa",)), (131072, 32, ("csa",)), (131072, 64, ("window", "csa", "hca"))]
        fp8 = [(1 << 20, 1), (131072, 8), (131072, 64)]
    return [(*config, "mxfp4") for config in grid] + [(context, batch, ("csa",), "fp8") for context, batch in fp8]


def core_bytes(g: ModelGeometry, cache: CacheManager, layer_index: int, context: int, batch: int) -> dict[str, int]:
    """Bytes one decode step's attention core must move, per part, for `batch` requests at `context` tokens
    (the step's own token included): the keys it reads, the compressor state it pools when an entry completes,
    q in and the output out. Scores written by the indexer and read by top-k are the implementation's, not
    counted."""
    spec, ls = g.layers[layer_index], cache.spec.layers[layer_index]
    entry = ls.main.entry_bytes
    parts = {"window keys": min(g.window, context) * entry, "q + out": 2 * 2 * g.num_heads * g.head_dim}
    if spec.compressed:
        visible = context // spec.ratio
        if spec.kind is LayerKind.CSA:
            parts["indexer keys"] = visible * ls.index.entry_bytes
            parts["picked entries"] = min(g.index_topk, visible) * entry
        else:
            parts["entries"] = visible * entry
        if context % spec.ratio == 0:  # this token completes an entry: the state ring is pooled
            # CSA pools half its ring (the previous block's low half, this block's high half); HCA all of it
            state = ls.state_bytes // 2 if spec.kind is LayerKind.CSA else ls.state_bytes
            parts["compressor state"] = state + entry + (ls.index.entry_bytes if ls.index else 0)
    return {k: v * batch for k, v in parts.items()}


# (a key inside the kernel's name, its stage), the first match wins: "_compressor_rows" before "_compress"
_STAGES = (("_kv_insert", "kv insert"), ("_compressor_rows", "compressor rows"), ("_compress", "compress-and-insert"),
           ("_pool_kernel", "compress-and-insert"),
           ("_indexer_scores", "indexer scores"), ("_topk", "top-k"),
           ("_sparse_attention", "attention"), ("_merge_kernel", "attention"), ("_copy_entries", "window append"),
           ("_append_state", "state append"), ("_rope_rows", "RoPE of q"),
           ("_indexer_query", "indexer query"), ("_q_fp8", "indexer query"),
           ("_rms_norm", "projection norms"), ("_gemv_kernel", "one-row projections"))


def _stage(kernel: str) -> str:
    return next((stage for key, stage in _STAGES if key in kernel), "torch kernels")


def decode(ctx: Context) -> None:
    g = ctx.geometry
    for context, batch, kinds, indexer_format in _decode_grid(ctx.quick):
        ctx.log(f"decode: context {context}, batch {batch}, {'/'.join(kinds)}, {indexer_format} indexer keys")
        cache = CacheManager(g, max_requests=batch, max_tokens=batch * context, device=ctx.device,
                             indexer_format=indexer_format)
        rids = [cache.admit() for _ in range(batch)]
        for rid in rids:
            cache.plan_step([(rid, context - 1)])  # the history: blocks allocated, contents filled below
        indices = [_layer_index(g, kind) for kind in kinds]
        for i in indices:
            fill_layer(cache.pools.layers[i], window=g.window, seed=i)
        buffers = cache.step_buffers(max_tokens=batch, max_requests=batch, max_seq_len=context)
        plan = cache.plan_step([(rid, 1) for rid in rids], buffers=buffers)
        x = torch.randn(batch, g.hidden_size, generator=torch.Generator(device=ctx.device).manual_seed(batch),
                        device=ctx.device).bfloat16()
        for kind, i in zip(kinds, indices):
            layer = init_random_weights(DSV4Attention(g, i, device=ctx.device), seed=i)
            _decode_layer(ctx, cache, layer, plan, x, kind, context, batch)
            del layer
            _free()
        del cache, plan, buffers
        _free()


def _decode_layer(ctx: Context, cache: CacheManager, layer: DSV4Attention, plan, x, kind: str, context: int,
                  batch: int) -> None:
    from ...ops.shared.launch import launch_options

    g = ctx.geometry
    check, passed = check_layer(layer, x, plan, cache, "layer vs reference")
    projected = layer.project(x, plan.positions)
    keys = cache.spec.indexer_format.value  # MXFP4 (the official format) unless the grid asks for FP8 keys
    params = {"kind": kind, "context": context, "batch": batch, "indexer_format": keys}
    at = f"ctx {context}, batch {batch}" + ("" if keys == "mxfp4" or kind != "csa" else f", {keys} indexer keys")
    parts = core_bytes(g, cache, layer.layer_index, context, batch)
    pages = cache.pages(layer.layer_index)
    attn = layer.attention_plan(plan, pages, "triton")
    fp8, counted = attn.indexer_fp8, attn.counts_digit

    def cold():  # the step's attention plan (RoPE tables, visible counts, ...) made inside the graph too
        plan.layer_plans.clear()
        return layer.attention_core(projected, layer.attention_plan(plan, pages, "triton"), pages)

    # per layer: the graph holds the layer's own work over the step's attention plan, as every layer but the first
    # of its kind runs it; `cold` adds the attention plan the first layer builds for all of them
    core = time_cuda(lambda: layer.attention_core(projected, attn, pages), device=ctx.device, runs=ctx.runs)
    first = time_cuda(cold, device=ctx.device, runs=ctx.runs)
    plan.layer_plans.clear()  # `cold` left the plan its graph captured: build one outside any graph
    attn = layer.attention_plan(plan, pages, "triton")
    whole = time_cuda(lambda: layer._forward_kernels(x, attn, pages), device=ctx.device, runs=ctx.runs)
    ctx.report.add(Result("decode", f"{kind} core, {at}", params, core.median_us,
                          bytes=sum(parts.values()), check=check, passed=passed,
                          extra={"stage": "core", **core.as_dict(), "bytes_by_part": parts,
                                 "streams": 2 if layer.schedule.side_stream else 1, "indexer_fp8": fp8,
                                 "indexer_counts_topk_digit": counted,
                                 "dependent_launch": bool(launch_options(ctx.device)),
                                 "with_step_tensors_us": first.median_us}))
    ctx.report.add(Result("decode", f"{kind} core + the step's shared tensors, {at}", params,
                          first.median_us, bytes=sum(parts.values()), check=check, passed=passed,
                          extra={"stage": "core+step", **first.as_dict()}))
    ctx.report.add(Result("decode", f"{kind} layer, {at}", params, whole.median_us,
                          check=check, passed=passed, extra={"stage": "layer", **whole.as_dict()}))
    ctx.log(f"  {kind}: core {core.median_us:.1f} us ({first.median_us:.1f} us with the step's shared tensors), "
            f"layer {whole.median_us:.1f} us, {check}")
    if layer.schedule.side_stream:
        ctx.log("    (the core runs on two streams: the kernel times below overlap, their sum exceeds the core's)")
    if not launch_options(ctx.device):
        ctx.log("    (kernels launched without programmatic dependent launch: inside launch.dependent_launch(False))")
    if kind == "csa":
        ctx.log(f"    indexer scores of {keys} keys on {'FP8' if fp8 else 'bf16'} MMAs (the host's choice: the FP8 "
                f"path serves MXFP4 keys; a row whose query fails its exactness check takes bf16)")
        ctx.log("    top-k's first digit " + ("counted by the indexer scores kernel, which the indexer stage's time "
                                             "includes; top-k runs three launches" if counted else
                                             "counted by top-k itself"))
    kernels = profile_kernels(lambda: layer.attention_core(projected, attn, pages), device=ctx.device)
    by_stage: dict[str, list[float]] = {}
    for name, us in kernels:
        by_stage.setdefault(_stage(name), []).append(us)
    stage_bytes = {"indexer scores": parts.get("indexer keys"), "attention": parts.get("window keys", 0)
                   + parts.get("picked entries", 0) + parts.get("entries", 0)}
    ctx.log("    kernels: " + ", ".join(f"{name[:16]} {us:.1f}" for name, us in kernels))
    for stage, times in by_stage.items():
        ctx.report.add(Result("decode", f"  {kind} {stage} ({len(times)} kernels), {at}",
                              params, sum(times), bytes=stage_bytes.get(stage) or None, check=check, passed=passed,
                              extra={"stage": stage, "kernels": len(times)}))


# --- layer vs transformers -------------------------------------------------------------------------------------
def _hf_config():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**json.loads(resources.files("dsv4kv.presets").joinpath("flash.json").read_text()))


class _HFDecoder:
    """transformers' DeepseekV4Attention fed a prompt in chunks, then decode steps, with its own cache and an
    explicit sliding-window causal mask (its incremental path; SPEC section 4). `inputs` builds a call's
    RoPE tables and mask (what a model does once per step for all its layers), `run` is the module call."""

    def __init__(self, hf, config, device):
        from transformers import DynamicCache
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

        self.hf, self.config, self.device = hf, config, device
        self.cache = DynamicCache(config=config)
        self.rotary = DeepseekV4RotaryEmbedding(config).to(device)
        self.length = 0

    def inputs(self, x: torch.Tensor) -> tuple:
        n, window = x.shape[0], self.config.sliding_window
        x = x.to(next(self.hf.parameters()).dtype)
        kept = min(self.length, window - 1)  # window keys the cache holds from before
        positions = torch.arange(self.length, self.length + n, device=self.device)
        key_positions = torch.arange(self.length - kept, self.length + n, device=self.device)
        allowed = (key_positions[None] <= positions[:, None]) & (positions[:, None] - key_positions[None] < window)
        mask = torch.where(allowed, 0.0, float("-inf")).to(x.dtype)[None, None]
        cos_sin = {kind: self.rotary(x[None], positions[None], layer_type=kind) for kind in ("main", "compress")}
        return x[None], cos_sin, positions[None], mask

    def run(self, args: tuple) -> torch.Tensor:
        out = self.hf(*args, past_key_values=self.cache)[0][0]
        self.length += args[0].shape[1]
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self.inputs(x))


def _our_decoder(layer: DSV4Attention, prompt: torch.Tensor, steps: int, kv_format: str, indexer_format: str):
    """Our layer over a cache of the given formats, the prompt prefilled in 8K chunks: (decode graph, request id)."""
    from ...model.graph import DecodeGraph

    g, context = layer.geometry, prompt.shape[0]
    cache = CacheManager(g, max_requests=1, max_tokens=context + steps, device=prompt.device, kv_format=kv_format,
                         indexer_format=indexer_format)
    rid = cache.admit()
    for lo in range(0, context, 8192):
        hi = min(context, lo + 8192)
        layer(prompt[lo:hi], cache.plan_step([(rid, hi - lo)]), cache)
    return DecodeGraph([layer], cache, batch=1, max_seq_len=context + steps), rid


def _hook_indexer(hf) -> dict:
    """Forward hooks on transformers' CSA indexer: after each call, "picks" [k'] and "scores" [T] (fp32) are its last
    row's (batch 1; k' = min(k, T)); "handles" removes the hooks."""
    seen: dict = {}
    indexer = hf.compressor.indexer
    seen["handles"] = [indexer.register_forward_hook(lambda m, i, o: seen.__setitem__("picks", o[0][-1])),
                       indexer.scorer.register_forward_hook(lambda m, i, o: seen.__setitem__("scores", o[0][-1]))]
    return seen


@contextlib.contextmanager
def _kernel_picks(holder: dict | None):
    """While active, `holder["picks"]` is the output of each `kernels.topk_indices` call. Inside a CUDA-graph
    capture that output is the graph's own buffer, which every replay rewrites."""
    import dsv4kv.ops.kernels as kernels

    if holder is None:
        yield
        return
    original = kernels.topk_indices

    def select(*args, **kwargs):
        holder["picks"] = original(*args, **kwargs)
        return holder["picks"]

    kernels.topk_indices = select
    try:
        yield
    finally:
        kernels.topk_indices = original


def layer_vs_transformers(ctx: Context) -> None:
    """Decode steps of one layer: transformers' module (eager bf16) against ours (CUDA graph), same weights and
    inputs. The check: our exact mode (bf16 cache) against transformers in fp32, the project's oracle; the
    official mode (FP8 / MXFP4, the timed one) is checked against our reference in the `decode` workload."""
    try:
        config = _hf_config()
    except ImportError:
        ctx.log("layer: transformers is not installed, skipped")
        return
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    g = ctx.geometry
    steps = 12
    for context in ([16384] if ctx.quick else [4096, 16384]):
        for kind in ("window", "csa", "hca"):
            i = _layer_index(g, kind)
            hf32 = init_random_weights(DeepseekV4Attention(config, i).eval().to(ctx.device), seed=i)
            with torch.no_grad():  # bf16-representable weights: every module here holds the same values
                for param in hf32.parameters():
                    param.copy_(param.bfloat16().float())
            hf16 = _HFDecoder(copy.deepcopy(hf32).to(torch.bfloat16), config, ctx.device)
            oracle = _HFDecoder(hf32, config, ctx.device)
            gen = torch.Generator(device=ctx.device).manual_seed(context + i)
            prompt = torch.randn(context, g.hidden_size, generator=gen, device=ctx.device).bfloat16()
            tokens = torch.randn(steps, g.hidden_size, generator=gen, device=ctx.device).bfloat16()
            seen = _hook_indexer(hf32) if kind == "csa" else None  # transformers' picks and fp32 scores
            with torch.no_grad():
                for lo in range(0, context, 2048):
                    hf16(prompt[lo:lo + 2048])
                    oracle(prompt[lo:lo + 2048])
                ours = {mode: _our_decoder(DSV4Attention.from_transformers(hf16.hf), prompt, steps, *formats)
                        for mode, formats in (("official", ("fp8", "mxfp4")), ("exact", ("bf16", "bf16")))}
                hf_times, walls, errors = [], [], {"official": [], "exact": []}
                picks = {"ours": [], "theirs": [], "scores": []}
                ours_picks: dict = {}  # the exact-mode graph's top-k output (the capture's buffer once captured)
                for s in range(steps):
                    token = tokens[s:s + 1]
                    args = hf16.inputs(token)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    hf16.run(args)
                    end.record()
                    torch.cuda.synchronize()
                    hf_times.append(start.elapsed_time(end) * 1e3)
                    want = oracle(token)
                    for mode, (graph, rid) in ours.items():
                        t0 = time.perf_counter()
                        with _kernel_picks(ours_picks if mode == "exact" and seen is not None else None):
                            got = graph.step([(rid, 1)], token) - token  # the graph's chain adds the residual
                        torch.cuda.synchronize()
                        if mode == "official":
                            walls.append((time.perf_counter() - t0) * 1e6)
                        errors[mode].append(_row_error(got, want))
                    if seen is not None:
                        picks["ours"].append(ours_picks["picks"][0].long().cpu())
                        theirs = seen["picks"].long().cpu()
                        picks["theirs"].append(torch.nn.functional.pad(theirs, (0, g.index_topk - theirs.shape[0]),
                                                                       value=-1))
                        picks["scores"].append(seen["scores"].float().cpu())
                # replays of the last plan: the graph's device time (the step is idempotent over one plan)
                replay = {mode: time_cuda(graph.graph.replay, device=ctx.device, runs=ctx.runs, graph=False, warmup=1)
                          for mode, (graph, _) in ours.items()}
            hf_us = statistics.median(hf_times[2:])
            wall_us = statistics.median(walls[2:])
            official = max(errors["official"])
            if seen is not None:
                for handle in seen["handles"]:
                    handle.remove()
                width = max(row.shape[0] for row in picks["scores"])
                scores = torch.stack([torch.nn.functional.pad(row, (0, width - row.shape[0]), value=float("-inf"))
                                      for row in picks["scores"]])
                verdict = explain_rows(torch.tensor(errors["exact"]), torch.stack(picks["ours"]),
                                       torch.stack(picks["theirs"]), scores, row_tol=HF_TOL, tie_tol=HF_TIE_TOL)
            else:
                verdict = explain_rows(torch.tensor(errors["exact"]), None, None, None, row_tol=HF_TOL,
                                       tie_tol=HF_TIE_TOL)
            passed = verdict.passed
            check = (f"{verdict.text('exact mode vs transformers fp32, decode rows')}; "
                     f"official mode: worst {official:.2e} (FP8/MXFP4 numerics, not gated)")
            params = {"kind": kind, "context": context, "batch": 1}
            ctx.report.add(Result("layer", f"transformers {kind}, ctx {context} (eager bf16)", params, hf_us,
                                  check="the module timed", extra={"module": "DeepseekV4Attention"}))
            for mode, timing in replay.items():
                ctx.report.add(Result("layer", f"dsv4kv {kind}, ctx {context}, {mode} (graph replay)",
                                      {**params, "mode": mode}, timing.median_us, check=check, passed=passed,
                                      extra={**timing.as_dict(), "speedup": hf_us / timing.median_us,
                                             "step_wall_us": wall_us if mode == "official" else None}))
            ctx.log(f"  {kind} {context}: transformers {hf_us:.0f} us, ours {replay['official'].median_us:.1f} us "
                    f"official / {replay['exact'].median_us:.1f} us exact (x{hf_us / replay['official'].median_us:.1f}"
                    f"; a whole step with planning {wall_us:.0f} us), {check}")
            del hf16, oracle, ours, hf32
            _free()


# --- prefill -------------------------------------------------------------------------------------------------
def prefill(ctx: Context) -> None:
    from ...ops.indexer.kernel import indexer_scores_paged
    from ...ops.indexer.query_kernel import indexer_query_and_weights
    from ...ops.rope.reference import rope_cos_sin

    g = ctx.geometry
    i = _layer_index(g, "csa")
    spec = g.layers[i]
    prompt_len, chunk = (32768, 8192) if ctx.quick else (65536, 8192)
    layer = init_random_weights(DSV4Attention(g, i, device=ctx.device), seed=i)
    gen = torch.Generator(device=ctx.device).manual_seed(7)
    x = torch.randn(prompt_len, g.hidden_size, generator=gen, device=ctx.device).bfloat16()
    # the timed chunks' every shape once first: each chunk's score rows are wider, and past 4096 columns top-k's row
    # kernel compiles for the wider block (a first run compiled it inside the timed third chunk: 1.1 s)
    warm = CacheManager(g, max_requests=1, max_tokens=prompt_len, device=ctx.device)
    warm_rid = warm.admit()
    for lo in range(0, prompt_len, chunk):
        layer(x[lo:lo + chunk], warm.plan_step([(warm_rid, chunk)]), warm)
    del warm
    cache = CacheManager(g, max_requests=1, max_tokens=prompt_len, device=ctx.device)
    rid = cache.admit()
    tensors = cache.pools.layers[i].tensors()
    chunk_us, check, passed, kernels = [], "not run", True, []
    for c, lo in enumerate(range(0, prompt_len, chunk)):
        plan = cache.plan_step([(rid, chunk)])
        if lo + chunk == prompt_len:  # the last chunk's kernels, profiled on a copy of the state it starts from
            snapshot = [t.clone() for t in tensors]
            pages = cache.pages(i)
            attn = layer.attention_plan(plan, pages, "triton")
            kernels = profile_kernels(lambda: layer._forward_kernels(x[lo:lo + chunk], attn, pages),
                                      device=ctx.device, graph=False)
            for t, s in zip(tensors, snapshot):
                t.copy_(s)
            snapshot.clear()
        if c == 1:  # check one chunk with history against the reference, then run it for real
            check, passed = check_layer(layer, x[lo:lo + chunk], plan, cache, f"chunk 1 (history {lo}) vs reference")
            _free()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        layer(x[lo:lo + chunk], plan, cache)
        end.record()
        torch.cuda.synchronize()
        chunk_us.append(start.elapsed_time(end) * 1e3)
    # the indexer's arithmetic: 2 * H * D per (row, visible entry)
    visible = sum((t + 1) // spec.ratio for t in range(prompt_len))
    flops = 2 * g.index_n_heads * g.index_head_dim * visible
    total = sum(chunk_us)
    params = {"prompt": prompt_len, "chunk": chunk}
    ctx.report.add(Result("prefill", f"CSA layer, {prompt_len} tokens in {chunk}-token chunks", params, total,
                          flops=flops, check=check, passed=passed,
                          extra={"tokens_per_s": prompt_len / (total * 1e-6), "chunk_us": chunk_us,
                                 "flops_are": "the indexer's alone (the floor)"}))
    by_stage: dict[str, list[float]] = {}
    for name, us in kernels:
        by_stage.setdefault(_stage(name), []).append(us)
    for stage, times in by_stage.items():
        ctx.report.add(Result("prefill", f"  last chunk: {stage} ({len(times)} kernels)", params, sum(times),
                              check=check, passed=passed, extra={"stage": stage, "profiled": "eager, one run"}))
    ctx.log("  last chunk kernels: " + ", ".join(f"{stage} {sum(t) / 1e3:.2f} ms" for stage, t in by_stage.items()))
    # the indexer kernel alone on the last chunk (the plan is reused read-only)
    projected = layer.project(x[-chunk:], plan.positions)
    ls = cache.spec.layers[i]
    q_index, weights = indexer_query_and_weights(projected.index_q, projected.index_weights,
                                                 *rope_cos_sin(spec.rope, plan.positions), ls.index,
                                                 scale=g.index_n_heads ** -0.5)
    last_visible = sum((t + 1) // spec.ratio for t in range(prompt_len - chunk, prompt_len))
    run = lambda: indexer_scores_paged(q_index, weights, plan, cache.pools.layers[i].index_keys,  # noqa
                                       ls.index, ratio=spec.ratio, page_tokens=cache.spec.page_tokens,
                                       max_entries=prompt_len // spec.ratio)
    timing = time_cuda(run, device=ctx.device, runs=max(5, ctx.runs // 5), graph=False)
    ctx.report.add(Result("prefill", f"indexer scores, last chunk ({chunk} rows x <= {prompt_len // 4} keys)", params,
                          timing.median_us, flops=2 * g.index_n_heads * g.index_head_dim * last_visible,
                          bytes=chunk * (prompt_len // spec.ratio) * 4, passed=passed,
                          check=f"the kernel of the layer checked above, not on its own: {check}",
                          extra=timing.as_dict()))
    ctx.log(f"  prefill {prompt_len}: {total / 1e3:.1f} ms ({prompt_len / (total * 1e-6):.0f} tokens/s), "
            f"indexer floor {flops / ctx.report.gemm * 1e3:.2f} ms" if ctx.report.gemm else "")
    _free()


# --- scale ---------------------------------------------------------------------------------------------------
def scale(ctx: Context) -> None:
    from ...model.graph import DecodeGraph

    g = ctx.geometry
    steps = 8
    ctx.log("scale: building all 43 layers (random bf16 weights)")
    layers = [init_random_weights(DSV4Attention(g, i, device=ctx.device), seed=i) for i in range(g.num_layers)]
    weights = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())

    def run(label: str, batch: int, context: int) -> None:
        cache = CacheManager(g, max_requests=batch, max_tokens=batch * context, device=ctx.device,
                             max_seq_len=context)
        allocated_before = torch.cuda.memory_allocated(ctx.device)  # right after the pools were allocated
        rids = [cache.admit() for _ in range(batch)]
        for rid in rids:
            cache.plan_step([(rid, context - steps)])
        for i in range(g.num_layers):
            fill_layer(cache.pools.layers[i], window=g.window, seed=i)
        graph = DecodeGraph(layers, cache, batch=batch, max_seq_len=context)
        x = torch.randn(batch, g.hidden_size, device=ctx.device).bfloat16()
        walls = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = graph.step([(rid, 1) for rid in rids], x)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e6)
        finite = bool(torch.isfinite(out).all())
        replay = time_cuda(graph.graph.replay, device=ctx.device, runs=10, graph=False, warmup=1)
        plan_report = MemoryPlan(cache.spec, context=context).report()
        planned = batch * plan_report["request"]["total_bytes"]
        held = cache.bytes_used
        params = {"batch": batch, "context": context, "layers": g.num_layers}
        ctx.report.add(Result("scale", label, params, replay.median_us, check=f"outputs finite: {finite}",
                              passed=finite,
                              extra={**replay.as_dict(), "step_wall_us": sorted(walls[2:])[len(walls[2:]) // 2],
                                     "tokens_per_s": batch / (replay.median_us * 1e-6),
                                     "held_bytes": held, "planned_bytes": planned, "held_over_planned": held / planned,
                                     # the device tensors of the cache (pools with the allocator's slack blocks,
                                     # windows, states), against the plan: the measured side of the 2% target
                                     "reserved_bytes": cache.bytes_reserved,
                                     "reserved_over_planned": cache.bytes_reserved / planned,
                                     "cuda_allocated_with_cache": allocated_before,  # weights + the cache's tensors
                                     "weights_bytes": weights,
                                     "peak_allocated": torch.cuda.max_memory_allocated(ctx.device)}))
        ctx.log(f"  {label}: step {replay.median_us / 1e3:.2f} ms (graph), held {held / 2**30:.2f} GiB vs planned "
                f"{planned / 2**30:.2f} GiB ({100 * (held / planned - 1):+.2f}%)")
        del cache, graph
        _free()

    run("one request at 2^20 tokens, 43 layers", 1, 1 << 20)
    if not ctx.quick:
        context = 131072
        free, _ = torch.cuda.mem_get_info(ctx.device)
        budget = free - (8 << 30)  # the decode graph's workspace and the allocator's slack
        probe = MemoryPlan(_spec(g), context=context).report()["request"]["total_bytes"]
        batch = int(budget // probe)
        while batch > 1 and _pool_bytes(g, batch, context) > budget:
            batch -= 1
        require(batch >= 1, "scale: not even one 128K request fits")
        ctx.log(f"  {batch} concurrent 128K requests fit in {budget / 2**30:.1f} GiB")
        run(f"{batch} concurrent requests at 131072 tokens, 43 layers", batch, context)


# --- chat: the engine with prefix caching off and on -----------------------------------------------------------
@dataclass(frozen=True)
class ChatSizes:
    shared: int  # system prompt tokens, the same for every request
    suffix: int  # tokens after it, different for each request
    requests: int  # all queued at once
    new_tokens: int  # generated per request, greedy


CHAT = ChatSizes(shared=8192, suffix=1024, requests=64, new_tokens=128)
CHAT_QUICK = ChatSizes(shared=1024, suffix=64, requests=8, new_tokens=16)
CHAT_LOGPROBS = 8  # the timed runs ask for each generated token's top-8 logprobs: the fork gate reads them


def chat(ctx: Context) -> None:
    """Every request is queued at once and served to the end by one engine, with prefix caching off and then on.
    The step budget is the shared prompt: with caching on, the first request computes it in the first step and
    every later admission hits it. On CUDA the model is the demo's (V4-Flash attention geometry, 4 layers, bf16,
    Triton kernels, CUDA-graph decode steps); elsewhere the demo's tiny model in fp32. The timed runs ask for each
    generated token's top-CHAT_LOGPROBS logprobs (one log_softmax and top-k in the sampler batch, negligible against
    the model step): the check reads them.

    The check: greedy outputs with caching on against caching off, request by request. A hit is bit-identical only
    to the same step shapes (tests/test_engine_prefix.py), and here the two runs compute the shared prompt in
    different steps; in fp32 (CPU) they agree anyway, in bf16 the tokens may fork: at a near tie, or where one
    computation makes a one-step excursion (on an H100 every bf16 computation of this model, transformers' included,
    strays by 1-2.6 logits at ~5% of positions, one position at a time: MoE routing flips). A request whose tokens
    differ, first at generated token k, passes only when (`engine.reference.judge_fork`)
      (a) before k the runs' top logprobs agree within `reference.HIT_TOL` at all but a quarter of the positions
          (the same context; a wrong hit would show at every one, an excursion at one);
      (b) each run's token at k is the argmax of its own logprobs;
      (c) the fork is a near tie by the fp32 oracle (within twice the larger of transformers' bf16 error and a cold
          caching-off engine's, teacher-forced to the fork: `engine.reference.fork`), or a one-step excursion:
          teacher-forced to the fork, the hit path (an engine with caching on holding the shared prompt) and the
          cold engine agree within HIT_TOL.
    Any other fork refuses both figures. The judging engines are built after the timed ones are freed, and only when
    some request differs."""
    from ..demo import demo_model
    from ...engine import Engine, SamplingParams
    from ...engine.reference import judge_fork

    sizes = CHAT_QUICK if ctx.quick else CHAT
    cuda = ctx.device.type == "cuda"
    oracle, model = demo_model("flash" if cuda else "tiny", ctx.device, seed=0)
    page_tokens = 1024 if cuda else 128
    require(sizes.shared % page_tokens == 0, f"chat: the shared prompt ({sizes.shared}) is not whole blocks")
    gen = torch.Generator().manual_seed(11)
    vocab = model.config.vocab_size
    system = torch.randint(0, vocab, (sizes.shared,), generator=gen).tolist()
    prompts = [system + torch.randint(0, vocab, (sizes.suffix,), generator=gen).tolist()
               for _ in range(sizes.requests)]
    params = SamplingParams(max_new_tokens=sizes.new_tokens, logprobs=CHAT_LOGPROBS)
    longest = sizes.shared + sizes.suffix + sizes.new_tokens
    options = dict(max_requests=sizes.requests, max_tokens=sizes.requests * longest, max_seq_len=longest,
                   page_tokens=page_tokens, step_tokens=sizes.shared)
    # compile every kernel (prefill, a hit, decode steps) before timing: a few short requests, caching on
    warm = Engine.from_transformers(model, prefix_caching=True, **options)
    warm.generate([system[:page_tokens] + p[-8:] for p in prompts[:2]], SamplingParams(max_new_tokens=4))
    del warm
    runs = {}
    for caching in (False, True):
        ctx.log(f"chat: {sizes.requests} requests of {sizes.shared} shared + {sizes.suffix} tokens, "
                f"{sizes.new_tokens} new, prefix caching {'on' if caching else 'off'}")
        engine = Engine.from_transformers(model, prefix_caching=caching, **options)
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        if cuda:
            torch.cuda.synchronize(ctx.device)
        runs[caching] = (outputs, time.perf_counter() - start, engine.stats)
        del engine
        _free()
    differ = [i for i, (a, b) in enumerate(zip(runs[False][0], runs[True][0])) if a.token_ids != b.token_ids]
    forks = {}
    if differ:
        # a cold engine with caching off (the runs' options and cache formats: the served path's own logit error, not
        # the hit path under test) and a hot one with caching on that holds the shared prompt (the hit path)
        ctx.log(f"chat: {len(differ)} of {sizes.requests} requests differ; judging where they fork")
        cold = Engine.from_transformers(model, prefix_caching=False, **options)
        hot = Engine.from_transformers(model, prefix_caching=True, **options)
        hot.next_token_logits([prompts[0]])  # publishes its full blocks: the shared prompt
        forks = {i: judge_fork(oracle, model, prompts[i], runs[False][0][i], runs[True][0][i], engine=cold, hot=hot)
                 for i in differ}
        del cold, hot
        _free()
    passed, check = _chat_check(sizes.requests, forks)
    params_ = {"shared": sizes.shared, "suffix": sizes.suffix, "requests": sizes.requests,
               "new_tokens": sizes.new_tokens, "page_tokens": page_tokens, "step_tokens": sizes.shared}
    for caching in (False, True):
        outputs, seconds, stats = runs[caching]
        ttfts = sorted(o.ttft for o in outputs)
        generated = sum(len(o.token_ids) for o in outputs)
        extra = {"ttft_mean_ms": 1e3 * statistics.fmean(ttfts), "ttft_p50_ms": 1e3 * _quantile(ttfts, 0.5),
                 "ttft_p90_ms": 1e3 * _quantile(ttfts, 0.9), "total_s": seconds,
                 "tokens_per_s": generated / seconds, "output_tokens": generated,
                 "prefill_tokens": stats.prefill_tokens, "steps": stats.steps, "preemptions": stats.preemptions,
                 "hit_rate": stats.prefix_hit_rate, "cached_tokens": sum(o.cached_tokens for o in outputs),
                 "prefix_hits": stats.prefix_hits, "model": "flash-4-layers bf16" if cuda else "tiny fp32"}
        name = f"prefix caching {'on' if caching else 'off'}: {sizes.requests} x ({sizes.shared} + {sizes.suffix})"
        ctx.report.add(Result("chat", name, {**params_, "prefix_caching": caching}, seconds * 1e6, check=check,
                              passed=passed, extra=extra))
        ctx.log(f"  caching {'on ' if caching else 'off'}: {seconds:.2f} s, TTFT mean {extra['ttft_mean_ms']:.0f} ms"
                f" p50 {extra['ttft_p50_ms']:.0f} p90 {extra['ttft_p90_ms']:.0f}, {extra['tokens_per_s']:.1f} output "
                f"tokens/s, hit rate {extra['hit_rate']:.3f}, {extra['cached_tokens']} cached tokens; {check}")


def _chat_check(requests: int, forks: dict) -> tuple[bool, str]:
    """The chat check's verdict and text from the `ForkCheck`s of the requests whose tokens differ (by request)."""
    check = f"greedy tokens with caching on equal caching off in {requests - len(forks)} of {requests} requests"
    if not forks:
        return True, check
    ties = [f for f in forks.values() if f.passed and f.fork.near_tie]
    excursions = [f for f in forks.values() if f.passed and not f.fork.near_tie]
    failed = {i: f for i, f in forks.items() if not f.passed}
    parts = [f"{len(ties)} near {'tie' if len(ties) == 1 else 'ties'} by the fp32 oracle"]
    if excursions:
        hit = max(f.fork.hit_error for f in excursions)
        apart = sum(f.outliers for f in excursions)
        parts.append(f"{len(excursions)} one-step {'excursion' if len(excursions) == 1 else 'excursions'} (teacher-"
                     f"forced, the hit path and a cold engine within {hit:.3f} there; before "
                     f"{'it' if len(excursions) == 1 else 'them'} the runs apart at {apart} of "
                     f"{sum(f.fork.position for f in excursions)} tokens)")
    if failed:
        parts.append(f"{len(failed)} refused")
    worst = max(forks.values(), key=lambda f: f.before)
    check += (f"; the {len(forks)} {'fork' if len(forks) == 1 else 'forks'}: {', '.join(parts)}; worst before-fork "
              f"difference {worst.before:.3f} (tolerance {worst.tol} at three quarters of the tokens before a fork)")
    if failed:
        reasons = [f"request {i}: " + "; ".join(f.failures(("caching off", "caching on"))) for i, f in failed.items()]
        check += "; refused: " + " | ".join(reasons)
    return not failed, check


def _quantile(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted values, linear between the two nearest."""
    x = q * (len(ordered) - 1)
    lo = int(x)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (x - lo)


def _spec(g: ModelGeometry):
    from ...cache.spec import CacheSpec

    return CacheSpec(g)


def _pool_bytes(g: ModelGeometry, batch: int, context: int) -> int:
    spec = _spec(g)
    return spec.pool_bytes(spec.blocks_for(batch * context) + batch - 1, batch)


WORKLOADS: dict[str, Callable[[Context], None]] = {
    "machine": machine, "topk": topk, "insert": insert, "decode": decode, "layer": layer_vs_transformers,
    "prefill": prefill, "scale": scale, "flashmla": flashmla, "chat": chat,
}
QUICK = ("machine", "topk", "insert", "decode", "layer")
