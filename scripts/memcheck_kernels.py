"""Every Triton kernel once (prefill chunk and decode step, every cache format) on V4-Flash-shaped layers, for
`compute-sanitizer --tool memcheck` (run on the GPU: `compute-sanitizer --tool memcheck python scripts/memcheck_kernels.py`). Prints each call so the log shows coverage."""

import torch

import dsv4kv.ops.indexer.kernel as indexer_kernels
from dsv4kv import CacheManager, ModelGeometry
from dsv4kv.model.layer import DSV4Attention, init_random_weights

geometry = ModelGeometry.preset("flash")
layers = [init_random_weights(DSV4Attention(geometry, i, device="cuda", backend="triton"), i) for i in (0, 2, 3)]
gen = torch.Generator(device="cuda").manual_seed(0)
# MXFP4 twice: the indexer's row and stacked kernels on their FP8 MMA paths (the defaults), then both forced onto
# their bf16 paths
default_fp8_from = indexer_kernels.FP8_MIN_PROGRAMS_PER_SM
for kv_format, indexer_format, fp8_from in (("fp8", "mxfp4", 0), ("fp8", "mxfp4", 1 << 30),
                                            ("fp8", "fp8", default_fp8_from), ("bf16", "bf16", default_fp8_from)):
    indexer_kernels.FP8_MIN_PROGRAMS_PER_SM = fp8_from
    indexer_kernels.STACK_FP8 = fp8_from == 0
    path = (f" (FP8 MMA from {fp8_from} programs per SM, stacked FP8 {indexer_kernels.STACK_FP8})"
            if indexer_format == "mxfp4" else "")
    cache = CacheManager(geometry, max_requests=3, max_tokens=3 * 2560, kv_format=kv_format,
                         indexer_format=indexer_format, page_tokens=256, poison=True, device="cuda",
                         max_seq_len=2560)
    a, b = cache.admit(), cache.admit()
    buffers = cache.step_buffers(max_tokens=2304, max_requests=3, max_seq_len=2560)
    for step in ([(a, 2200)], [(a, 1), (b, 300)], [(a, 1), (b, 1)]):  # prefill, mixed, decode (padded rows)
        plan = cache.plan_step(step, buffers=buffers)
        x = torch.randn(plan.num_tokens, geometry.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        for layer in layers:
            out = layer(x, plan, cache)
            torch.cuda.synchronize()
            print(f"{kv_format}/{indexer_format}{path} layer {layer.layer_index} ({layer.spec.kind.short}) step {step}: "
                  f"finite={bool(torch.isfinite(out[:plan.num_tokens]).all())}", flush=True)
    # unpadded decode: attention's split-KV path and its merge; one row: the projections through gemv_rows
    for step, what in (([(a, 1), (b, 1)], "unpadded decode"), ([(a, 1)], "one-row decode")):
        plan = cache.plan_step(step)
        x = torch.randn(len(step), geometry.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        for layer in layers:
            out = layer(x, plan, cache)
            torch.cuda.synchronize()
            print(f"{kv_format}/{indexer_format} layer {layer.layer_index} {what}: "
                  f"finite={bool(torch.isfinite(out).all())}", flush=True)
# a CSA decode step past the top-k row kernel's 4096 candidates (20K tokens: 5000 columns): the indexer counts the
# split top-k's first digit (`digit_counts`) and top-k runs its other three launches; random valid cache bytes
from dsv4kv.tools.bench.synthetic import fill_layer  # noqa: E402

indexer_kernels.FP8_MIN_PROGRAMS_PER_SM = default_fp8_from
indexer_kernels.STACK_FP8 = True
cache = CacheManager(geometry, max_requests=2, max_tokens=2 * 20480, page_tokens=256, device="cuda", max_seq_len=20480)
rid = cache.admit()
cache.plan_step([(rid, 20000)])
fill_layer(cache.pools.layers[2], window=geometry.window, seed=2)
buffers = cache.step_buffers(max_tokens=2, max_requests=2, max_seq_len=20480)
for scratch_above in (indexer_kernels.DIGIT_COUNT_SCRATCH_ABOVE, 0):  # straight to the histogram, then via scratch
    indexer_kernels.DIGIT_COUNT_SCRATCH_ABOVE = scratch_above
    plan = cache.plan_step([(rid, 1)], buffers=buffers)
    out = layers[1](torch.randn(1, geometry.hidden_size, generator=gen, device="cuda").to(torch.bfloat16), plan, cache)
    torch.cuda.synchronize()
    print(f"layer 2 (CSA) decode at {cache.length(rid)} tokens, digits counted by the indexer "
          f"({'via scratch rows' if scratch_above == 0 else 'straight'}): finite={bool(torch.isfinite(out).all())}",
          flush=True)
# top-k's kernels directly, at sizes the layers above do not reach: the split radix select (one long row in four
# launches and in one; many rows with phase D's select in registers, looped over its buffer (integer scores: a full
# row buffers ~1300 keys, past SELECT = 1024), and over the row when the buffer overflows), the row kernel; NaN past
# each row's length. Each checked against a stable sort of the length-masked scores.
import dsv4kv.ops.topk.kernel as topk_kernels  # noqa: E402
from dsv4kv.ops.topk.reference import topk_picks  # noqa: E402

TOPK_CASES = ((1, 262144, 512, False, None, 0), (1, 262144, 512, True, None, 0), (64, 32768, 512, False, None, 0),
              (64, 32768, 512, False, 4096, 2), (64, 32768, 512, False, 0, 2), (64, 16384, 512, False, None, 0))
for rows, cols, k, fused, capacity, integer_scale in TOPK_CASES:
    topk_kernels.FUSED = fused
    scores = torch.randn(rows, cols, generator=gen, device="cuda")
    if integer_scale:  # ties: the threshold's value fills the buffer
        scores = (scores * integer_scale).round()
    lengths = torch.randint(0, cols + 1, (rows,), generator=gen, device="cuda", dtype=torch.int32)
    past = torch.arange(cols, device="cuda") >= lengths[:, None]
    scores.masked_fill_(past, float("nan"))
    ws = topk_kernels.topk_workspace(rows, cols, k, "cuda", capacity=capacity)
    out = topk_kernels.topk_indices(scores, lengths, k, workspace=ws)
    want = topk_picks(scores.masked_fill(past, float("-inf")), k)
    equal = torch.equal(torch.where(out < 0, cols, out).long().sort(dim=1).values,
                        torch.where(want < 0, cols, want).sort(dim=1).values)
    kernel = "row" if topk_kernels._by_row(rows, cols) else "split"
    print(f"top-k {rows} x {cols} k={k} {kernel} fused={fused} capacity={capacity} integers x{integer_scale}: "
          f"picks {int(out.ge(0).sum())}, equal to a stable sort: {equal}", flush=True)
topk_kernels.FUSED = False
print("memcheck script done")
