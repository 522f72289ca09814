"""Times tile / variant choices of the kernels on the GPU (the figures behind each default, docs/performance.md).

    python scripts/bench_variants.py [indexer] [attention] [insert]  > variants.txt

Each variant is checked against the default's output before it is timed (a variant that disagrees is
reported as such, never timed)."""

from __future__ import annotations

import sys

import torch

from dsv4kv import CacheManager, ModelGeometry
from dsv4kv.bench.synthetic import fill_layer
from dsv4kv.bench.timing import time_cuda
from dsv4kv.ops.indexer import indexer_query

DEVICE = torch.device("cuda")
G = ModelGeometry.from_hf_config("flash")
CSA = next(i for i, layer in enumerate(G.layers) if layer.kind.short == "CSA")


def csa_plan(batch: int, history: int, new: int):
    cache = CacheManager(G, max_requests=batch, max_tokens=batch * (history + new), device=DEVICE)
    rids = [cache.admit() for _ in range(batch)]
    for rid in rids:
        if history:
            cache.plan_step([(rid, history)])
    fill_layer(cache.pools.layers[CSA], window=G.window, seed=1)
    plan = cache.plan_step([(rid, new) for rid in rids])
    return cache, plan


def variants(name: str, run, settings, apply, reference=None):
    base = None
    for setting in settings:
        apply(setting)
        out = run()
        torch.cuda.synchronize()
        got = out.clone() if isinstance(out, torch.Tensor) else None
        if base is None:
            base = got
        agree = base is None or got is None or torch.equal(torch.nan_to_num(got), torch.nan_to_num(base)) or \
            (got.is_floating_point() and torch.allclose(got, base, rtol=1e-5, atol=1e-5, equal_nan=True))
        if not agree:
            print(f"{name} {setting}: DISAGREES with the first variant, not timed", flush=True)
            continue
        t = time_cuda(run, device=DEVICE, runs=30)
        print(f"{name} {setting}: {t.median_us:.1f} us (p10 {t.p10_us:.1f}, p90 {t.p90_us:.1f})", flush=True)
    apply(settings[0])


def indexer():
    for batch, history, new in ((1, (1 << 20) - 1, 1), (64, 131071, 1), (1, 57344, 8192)):
        _indexer_case(batch, history, new)
        torch.cuda.empty_cache()


def _indexer_case(batch: int, history: int, new: int):
    import dsv4kv.kernels.indexer as K

    cache, plan = csa_plan(batch, history, new)
    ls = cache.spec.layers[CSA]
    rows = plan.positions.shape[0]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = indexer_query(torch.randn(rows, G.index_n_heads, G.index_head_dim, generator=gen, device=DEVICE)
                      .bfloat16(), ls.index).contiguous()
    w = torch.randn(rows, G.index_n_heads, generator=gen, device=DEVICE) * G.index_n_heads ** -0.5
    entries = (history + new) // 4
    out = torch.empty(rows, entries, device=DEVICE)
    pool = cache.pools.layers[CSA].index_keys

    def run():
        return K.indexer_scores_paged(q, w, plan, pool, ls.index, ratio=4, page_tokens=cache.spec.page_tokens,
                                      out=out)
    label = f"indexer batch {batch} ctx {history + new} rows {rows}"
    flops = 2 * G.index_n_heads * G.index_head_dim * sum(((p + 1) // 4) for p in range(history, history + new)) * batch
    print(f"{label}: {flops / 1e9:.1f} GFLOP, {batch * entries * 68 / 1e6:.1f} MB of keys", flush=True)
    if new == 1:
        settings = [dict(K._ROW_TILES), {"block_j": 128, "max_iters": 16, "num_warps": 8},
                    {"block_j": 64, "max_iters": 8, "num_warps": 4}, {"block_j": 32, "max_iters": 16, "num_warps": 4}]
        variants(label + " row tiles", run, settings, lambda v: setattr(K, "_ROW_TILES", v))
    else:
        settings = [dict(K._STACK_TILES), {"block_t": 4, "block_j": 128, "max_iters": 32, "num_warps": 8,
                                           "num_stages": 3},
                    {"block_t": 2, "block_j": 64, "max_iters": 64, "num_warps": 4, "num_stages": 3},
                    {"block_t": 4, "block_j": 64, "max_iters": 64, "num_warps": 8, "num_stages": 2}]
        variants(label + " stack tiles", run, settings, lambda v: setattr(K, "_STACK_TILES", v))


if __name__ == "__main__":
    chosen = sys.argv[1:] or ["indexer"]
    for name in chosen:
        globals()[name]()
