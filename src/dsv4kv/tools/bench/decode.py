"""The kernel workloads: the machine's peaks, top-k, insert / compress-and-insert, and a decode step of one layer.

Long contexts are planned (every block allocated) and filled with random valid bytes (`synthetic.fill_layer`)
instead of being prefilled; each figure is checked against the PyTorch reference in the same run.
"""

from __future__ import annotations

import torch

from ...cache.manager import CacheManager
from ...cache.spec import CacheSpec
from ...geometry import LayerKind, ModelGeometry
from ...model.layer import DSV4Attention, init_random_weights
from .common import MODEL_NAMES, Context, check_layer, free_cuda, kernel_stage, layer_index, model_geometry
from .report import Result
from .synthetic import fill_layer
from .timing import copy_bandwidth, gemm_rate, profile_kernels, time_cuda

__all__ = ["machine", "topk", "insert", "decode", "core_bytes"]


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
    """kv insert (RoPE, FP8 encode, scatter) of rows at random slots, and compress-and-insert over a prefill chunk."""
    for n in ([65536] if ctx.quick else [64, 4096, 65536]):
        _kv_insert(ctx, n)
        free_cuda()
    for n in ([8192] if ctx.quick else [1024, 8192, 32768]):
        _compress_insert(ctx, n)
        free_cuda()


def _kv_insert(ctx: Context, n: int) -> None:
    from ...ops.rope.reference import apply_rope, rope_cos_sin
    from ...ops.window.kernel import kv_insert

    g = ctx.geometry
    i_csa = layer_index(g, "csa")
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


def _compress_insert(ctx: Context, n: int) -> None:
    """Compress-and-insert over a prefill chunk of n rows: CSA main entries and indexer keys, every entry completing."""
    from ...ops.compress.kernel import compress_insert
    from ...ops.compress.reference import compress_and_insert
    from ...ops.rope.reference import rope_cos_sin
    from ...ops.shared.rows import step_rows

    g = ctx.geometry
    i_csa = layer_index(g, "csa")
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


# --- decode --------------------------------------------------------------------------------------------------
def _decode_grid(quick: bool) -> list[tuple[str, int, int, tuple[str, ...], str]]:
    """(model, context, batch, kinds, indexer key format) configurations: V4-Flash with MXFP4 keys (the official
    format) everywhere and FP8 keys at the indexer's target points (at the same fractions of their own bytes), and
    V4-Pro (128 heads, 1024 picks) at the core targets' points."""
    if quick:
        grid = [(16384, 1, ("csa",)), (1 << 20, 1, ("csa",)), (131072, 64, ("csa",))]
        fp8 = [(1 << 20, 1), (131072, 64)]
        pro = [(1 << 20, 1, ("csa",))]
    else:
        grid = [(4096, 1, ("window", "csa", "hca")), (16384, 1, ("window", "csa", "hca")), (65536, 1, ("csa",)),
                (131072, 1, ("csa", "hca")), (262144, 1, ("csa",)), (1 << 20, 1, ("csa", "hca")),
                (131072, 8, ("csa",)), (131072, 32, ("csa",)), (131072, 64, ("window", "csa", "hca"))]
        fp8 = [(1 << 20, 1), (131072, 8), (131072, 64)]
        pro = [(1 << 20, 1, ("csa", "hca")), (131072, 8, ("csa",)), (131072, 64, ("csa", "hca"))]
    return ([("flash", *config, "mxfp4") for config in grid]
            + [("flash", context, batch, ("csa",), "fp8") for context, batch in fp8]
            + [("pro", *config, "mxfp4") for config in pro])


def core_bytes(g: ModelGeometry, spec: CacheSpec, layer_index: int, context: int, batch: int) -> dict[str, int]:
    """Bytes one decode step's attention core must move, per part, for `batch` requests at `context` tokens
    (the step's own token included): the keys it reads, the compressor state it pools when an entry completes,
    q in and the output out. Scores written by the indexer and read by top-k are the implementation's, not
    counted."""
    ls = spec.layers[layer_index]
    spec = g.layers[layer_index]
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


def decode(ctx: Context) -> None:
    for model, context, batch, kinds, indexer_format in _decode_grid(ctx.quick):
        g = model_geometry(model)
        ctx.log(f"decode: {MODEL_NAMES[model]}, context {context}, batch {batch}, {'/'.join(kinds)}, {indexer_format} "
                f"indexer keys")
        cache = CacheManager(g, max_requests=batch, max_tokens=batch * context, device=ctx.device,
                             indexer_format=indexer_format)
        rids = [cache.admit() for _ in range(batch)]
        for rid in rids:
            cache.plan_step([(rid, context - 1)])  # the history: blocks allocated, contents filled below
        indices = [layer_index(g, kind) for kind in kinds]
        for i in indices:
            fill_layer(cache.pools.layers[i], window=g.window, seed=i)
        buffers = cache.step_buffers(max_tokens=batch, max_requests=batch, max_seq_len=context)
        plan = cache.plan_step([(rid, 1) for rid in rids], buffers=buffers)
        x = torch.randn(batch, g.hidden_size, generator=torch.Generator(device=ctx.device).manual_seed(batch),
                        device=ctx.device).bfloat16()
        for kind, i in zip(kinds, indices):
            layer = init_random_weights(DSV4Attention(g, i, device=ctx.device), seed=i)
            _decode_layer(ctx, model, cache, layer, plan, x, kind, context, batch)
            del layer
            free_cuda()
        del cache, plan, buffers
        free_cuda()


def _decode_layer(ctx: Context, model: str, cache: CacheManager, layer: DSV4Attention, plan, x, kind: str,
                  context: int, batch: int) -> None:
    from ...ops.shared.launch import launch_options

    g = model_geometry(model)
    check, passed = check_layer(layer, x, plan, cache, "layer vs reference")
    projected = layer.project(x, plan.positions)
    keys = cache.spec.indexer_format.value  # MXFP4 (the official format) unless the grid asks for FP8 keys
    params = {"model": model, "kind": kind, "context": context, "batch": batch, "indexer_format": keys}
    at = (f"ctx {context}, batch {batch}" + ("" if keys == "mxfp4" or kind != "csa" else f", {keys} indexer keys")
          + ("" if model == "flash" else f", {MODEL_NAMES[model]}"))
    parts = core_bytes(g, cache.spec, layer.layer_index, context, batch)
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
        by_stage.setdefault(kernel_stage(name), []).append(us)
    stage_bytes = {"indexer scores": parts.get("indexer keys"), "attention": parts.get("window keys", 0)
                   + parts.get("picked entries", 0) + parts.get("entries", 0)}
    ctx.log("    kernels: " + ", ".join(f"{name[:16]} {us:.1f}" for name, us in kernels))
    for stage, times in by_stage.items():
        ctx.report.add(Result("decode", f"  {kind} {stage} ({len(times)} kernels), {at}",
                              params, sum(times), bytes=stage_bytes.get(stage) or None, check=check, passed=passed,
                              extra={"stage": stage, "kernels": len(times)}))
