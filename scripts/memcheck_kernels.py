"""Every Triton kernel once (prefill chunk and decode step, every cache format) on V4-Flash-shaped layers, for
`compute-sanitizer --tool memcheck` (run on the GPU: `compute-sanitizer --tool memcheck python scripts/memcheck_kernels.py`). Prints each call so the log shows coverage."""

import contextlib
import functools
from dataclasses import replace

import torch

import dsv4kv.ops.kernels as kernels
from dsv4kv import CacheManager, ModelGeometry
from dsv4kv.model.layer import DSV4Attention, init_random_weights
from dsv4kv.ops.indexer.tuning import tuning_for


@contextlib.contextmanager
def scores_tuning(**changes):
    """The layers' indexer scores (`ops.kernels.indexer_scores_paged`, the entry they call) with the GPU's config
    changed."""
    entry = kernels.indexer_scores_paged
    tuning = replace(tuning_for(torch.device("cuda")), **changes)
    kernels.indexer_scores_paged = functools.partial(entry, tuning=tuning)
    try:
        yield
    finally:
        kernels.indexer_scores_paged = entry


geometry = ModelGeometry.preset("flash")
layers = [init_random_weights(DSV4Attention(geometry, i, device="cuda", backend="triton"), i) for i in (0, 2, 3)]
gen = torch.Generator(device="cuda").manual_seed(0)
# MXFP4 three times: the indexer's row and stacked kernels on their FP8 MMA paths with one scale per key (the
# defaults), with the exact per-block scaling (`IndexerTuning.fp8_key_scale`), then on their bf16 paths
# (`IndexerTuning.fp8_mma`)
for kv_format, indexer_format, fp8, key_scale in (("fp8", "mxfp4", True, True), ("fp8", "mxfp4", True, False),
                                                  ("fp8", "mxfp4", False, True), ("fp8", "fp8", True, True),
                                                  ("bf16", "bf16", True, True)):
    path = f" (FP8 MMAs {fp8}, key scale {key_scale})" if indexer_format == "mxfp4" else ""
    cache = CacheManager(geometry, max_requests=3, max_tokens=3 * 2560, kv_format=kv_format,
                         indexer_format=indexer_format, page_tokens=256, poison=True, device="cuda",
                         max_seq_len=2560)
    a, b = cache.admit(), cache.admit()
    buffers = cache.step_buffers(max_tokens=2304, max_requests=3, max_seq_len=2560)
    for step in ([(a, 2200)], [(a, 1), (b, 300)], [(a, 1), (b, 1)]):  # prefill, mixed, decode (padded rows)
        plan = cache.plan_step(step, buffers=buffers)
        x = torch.randn(plan.num_tokens, geometry.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        for layer in layers:
            with scores_tuning(fp8_mma=fp8, fp8_key_scale=key_scale):
                out = layer(x, plan, cache)
            torch.cuda.synchronize()
            print(f"{kv_format}/{indexer_format}{path} layer {layer.layer_index} ({layer.spec.kind.short}) step {step}: "
                  f"finite={bool(torch.isfinite(out[:plan.num_tokens]).all())}", flush=True)
    # unpadded decode: attention's split-KV path and its merge; one row: the projections through gemv_rows
    for step, what in (([(a, 1), (b, 1)], "unpadded decode"), ([(a, 1)], "one-row decode")):
        plan = cache.plan_step(step)
        x = torch.randn(len(step), geometry.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        for layer in layers:
            with scores_tuning(fp8_mma=fp8, fp8_key_scale=key_scale):
                out = layer(x, plan, cache)
            torch.cuda.synchronize()
            print(f"{kv_format}/{indexer_format}{path} layer {layer.layer_index} {what}: "
                  f"finite={bool(torch.isfinite(out).all())}", flush=True)
# a CSA decode step past the top-k row kernel's 4096 candidates (20K tokens: 5000 columns): the indexer counts the
# split top-k's first digit (`digit_counts`) and top-k runs its other three launches; random valid cache bytes
from dsv4kv.tools.bench.synthetic import fill_layer  # noqa: E402

cache = CacheManager(geometry, max_requests=2, max_tokens=2 * 20480, page_tokens=256, device="cuda", max_seq_len=20480)
rid = cache.admit()
cache.plan_step([(rid, 20000)])
fill_layer(cache.pools.layers[2], window=geometry.window, seed=2)
buffers = cache.step_buffers(max_tokens=2, max_requests=2, max_seq_len=20480)
for scratch_above in (tuning_for(torch.device("cuda")).digit_count_scratch_above, 0):  # straight, then via scratch
    plan = cache.plan_step([(rid, 1)], buffers=buffers)
    with scores_tuning(digit_count_scratch_above=scratch_above):
        out = layers[1](torch.randn(1, geometry.hidden_size, generator=gen, device="cuda").to(torch.bfloat16), plan,
                        cache)
    torch.cuda.synchronize()
    print(f"layer 2 (CSA) decode at {cache.length(rid)} tokens, digits counted by the indexer "
          f"({'via scratch rows' if scratch_above == 0 else 'straight'}): finite={bool(torch.isfinite(out).all())}",
          flush=True)
# top-k's kernels directly, at sizes the layers above do not reach: the split radix select (one long row; many rows
# with phase D's select in registers, looped over its buffer (integer scores: a full row buffers ~1300 keys, past
# SELECT = 1024), and over the row when the buffer overflows), the row kernel; NaN past each row's length. Each
# checked against a stable sort of the length-masked scores.
import dsv4kv.ops.topk.kernel as topk_kernels  # noqa: E402
from dsv4kv.ops.topk.tuning import tuning_for as topk_tuning_for  # noqa: E402
from dsv4kv.ops.topk.reference import topk_picks  # noqa: E402

TOPK_CASES = ((1, 262144, 512, None, 0), (64, 32768, 512, None, 0), (64, 32768, 512, 4096, 2), (64, 32768, 512, 0, 2),
              (64, 16384, 512, None, 0))
for rows, cols, k, capacity, integer_scale in TOPK_CASES:
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
    kernel = "row" if topk_kernels._by_row(rows, cols, topk_tuning_for(torch.device("cuda"))) else "split"
    print(f"top-k {rows} x {cols} k={k} {kernel} capacity={capacity} integers x{integer_scale}: "
          f"picks {int(out.ge(0).sum())}, equal to a stable sort: {equal}", flush=True)
print("memcheck script done")
