"""Times tile / variant choices of the kernels on the GPU (the figures behind each default, docs/performance.md).

    python scripts/bench_variants.py [indexer] [indexer_waves] [attention] [insert] [topk]  > variants.txt

(`attention` also times the kernel before split-KV when .base/attention_before.py holds it; `topk` times the current
kernel in its four- and one-launch forms, and a previous kernels/topk.py when TOPK_BEFORE names a copy of it, e.g.
`git show c499d52:src/dsv4kv/kernels/topk.py > .old/topk.py`, the kernel before issue 12.)

Each variant is checked against the default's output before it is timed (a variant that disagrees is
reported as such, never timed)."""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

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


def indexer_decode_case(batch: int, history: int) -> SimpleNamespace:
    """A CSA decode step of `batch` requests after `history` tokens each (`csa_plan`) and its indexer's inputs, as the
    scores kernel takes them: cache, plan, layout, q (in the MXFP4 keys' numerics), w (head weights * H^-0.5), q_fp8
    (the FP8 MMA operand of q, made once per row by the layer's query kernel, so not timed with the scores), out (fp32
    scores [batch, entries]), pool (the CSA layer's key pool), page_tokens."""
    import dsv4kv.kernels.indexer as K

    cache, plan = csa_plan(batch, history, 1)
    layout = cache.spec.layers[CSA].index
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = indexer_query(torch.randn(batch, G.index_n_heads, G.index_head_dim, generator=gen, device=DEVICE)
                      .bfloat16(), layout).contiguous()
    w = torch.randn(batch, G.index_n_heads, generator=gen, device=DEVICE) * G.index_n_heads ** -0.5
    return SimpleNamespace(cache=cache, plan=plan, layout=layout, q=q, w=w, q_fp8=K.indexer_query_fp8(q),
                           out=torch.empty(batch, (history + 1) // 4, device=DEVICE),
                           pool=cache.pools.layers[CSA].index_keys, page_tokens=cache.spec.page_tokens)


def hot_plan(plan, pages: int = 8):
    """`plan` with every allocated block-table entry pointing at one of request 0's first `pages` pages: the same
    tiles and addresses arithmetic, every key read from L2 (a timing probe: the scores are not the request's)."""
    bt = plan.block_table
    cycle = bt[0, :pages].repeat(bt.shape[1] // pages + 1)[: bt.shape[1]]
    return dataclasses.replace(plan, block_table=torch.where(bt >= 0, cycle[None, :].expand_as(bt), bt).contiguous())


def variants(name: str, run, settings, apply, reference=None, row_tolerance: float | None = None):
    """Times run() under each setting, after checking its output against the first setting's: floats within 1e-4
    (or, with row_tolerance, within that fraction of each row's largest |value|: attention's bf16 probabilities),
    encoded bytes <= 0.1% apart."""
    base = None
    for setting in settings:
        apply(setting)
        out = run()
        torch.cuda.synchronize()
        got = out.clone() if isinstance(out, torch.Tensor) else None
        if base is None:
            base = got
        if got is None or base is None:
            agree = True
        elif got.is_floating_point() and row_tolerance is not None:
            rows = base.reshape(-1, base.shape[-1])
            scale = rows.abs().amax(dim=-1, keepdim=True)
            agree = bool(((got.reshape(rows.shape) - rows).abs() <= row_tolerance * scale).all())
        elif got.is_floating_point():  # summation order differs between tilings
            agree = torch.allclose(got, base, rtol=1e-4, atol=1e-4, equal_nan=True)
        else:  # encoded bytes: a pooled value may land one e4m3 / e2m1 step apart (compress tolerance)
            agree = float((got != base).float().mean()) <= 1e-3
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
        settings = [dict(K._ROW_TILES), {"block_j": 128, "max_iters": 16, "num_warps": 8, "num_stages": 1},
                    {"block_j": 64, "max_iters": 8, "num_warps": 4, "num_stages": 1},
                    {"block_j": 64, "max_iters": 16, "num_warps": 4, "num_stages": 3}]
        variants(label + " row tiles", run, settings, lambda v: setattr(K, "_ROW_TILES", v))
    else:
        settings = [dict(K._STACK_TILES), {"block_t": 4, "block_j": 128, "max_iters": 32, "num_warps": 8,
                                           "num_stages": 3},
                    {"block_t": 2, "block_j": 64, "max_iters": 64, "num_warps": 4, "num_stages": 3},
                    {"block_t": 4, "block_j": 64, "max_iters": 64, "num_warps": 8, "num_stages": 2}]
        variants(label + " stack tiles", run, settings, lambda v: setattr(K, "_STACK_TILES", v))


def indexer_waves():
    """The row (decode) kernel's grid and path: programs per SM (`_GRID_WAVES`: more programs, fewer tiles each) x
    the FP8 MMA path or the bf16 path forced (`FP8_MIN_PROGRAMS_PER_SM`), the latter with its MXFP4 decode by bit
    moves or through fp32 (`BF16_BITS`), at 1 stage (and 2 for the bit moves), at batch 1 / 1M, 8 / 128K and
    64 / 128K. Scores are checked against the default's first (the paths agree up to summation order)."""
    import dsv4kv.kernels.indexer as K

    defaults = K._GRID_WAVES, K.FP8_MIN_PROGRAMS_PER_SM, dict(K._ROW_TILES), K.BF16_BITS
    for batch, history in ((1, (1 << 20) - 1), (8, 131071), (64, 131071)):
        c = indexer_decode_case(batch, history)
        out = c.out

        def run():
            return K.indexer_scores_paged(c.q, c.w, c.plan, c.pool, c.layout, ratio=4, page_tokens=c.page_tokens,
                                          out=out, q_fp8=c.q_fp8)

        def apply(setting):
            waves, path, stages = setting
            K._GRID_WAVES = waves
            K.FP8_MIN_PROGRAMS_PER_SM = 0 if path == "fp8" else 10 ** 9
            K.BF16_BITS = path == "bits"  # the bf16 path's decode by bit moves ("bits") or through fp32 ("bf16")
            K._ROW_TILES = {**defaults[2], "num_stages": stages}

        label = f"indexer-waves batch {batch} ctx {history + 1} ({batch * out.shape[1] * 68 / 1e6:.1f} MB)"
        settings = [(waves, path, 1) for path in ("fp8", "bits", "bf16") for waves in (3, 4, 6)]
        settings += [(3, "bits", 2), (4, "bits", 2)]
        variants(label, run, settings, apply)
        K._GRID_WAVES, K.FP8_MIN_PROGRAMS_PER_SM, K._ROW_TILES, K.BF16_BITS = defaults
        del c, out
        torch.cuda.empty_cache()


def attention():
    for kind, batch, history in (("CSA", 1, (1 << 20) - 1), ("CSA", 64, 131071), ("HCA", 1, (1 << 20) - 1),
                                 ("HCA", 64, 131071), ("CSA", 1, 65536 - 1)):
        _attention_case(kind, batch, history)
        torch.cuda.empty_cache()


def _load_base_attention():
    """The kernel file as committed before split-KV (.base/attention.py), for a before / after figure."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", ".base", "attention_before.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("dsv4kv.kernels._attention_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _attention_case(kind: str, batch: int, history: int, settings: list[dict] | None = None):
    import dsv4kv.kernels.attention as A
    from dsv4kv.kernels import kv_insert

    index = next(i for i, layer in enumerate(G.layers) if layer.kind.short == kind)
    spec = G.layers[index]
    cache = CacheManager(G, max_requests=batch, max_tokens=batch * (history + 1), device=DEVICE)
    rids = [cache.admit() for _ in range(batch)]
    for rid in rids:
        cache.plan_step([(rid, history)])
    fill_layer(cache.pools.layers[index], window=G.window, seed=2)
    plan = cache.plan_step([(rid, 1) for rid in rids])
    lc, ls = cache.pools.layers[index], cache.spec.layers[index]
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    q = torch.randn(batch, G.num_heads, G.head_dim, generator=gen, device=DEVICE).bfloat16()
    step_kv = torch.empty(1, ls.main.page_bytes(batch), dtype=torch.uint8, device=DEVICE)
    kv_insert(torch.randn(batch, G.head_dim, generator=gen, device=DEVICE).bfloat16(), plan.positions, spec.rope,
              ls.main, step_kv, batch, torch.arange(batch, dtype=torch.int32, device=DEVICE))
    visible = (history + 1) // spec.ratio
    picks = None
    if kind == "CSA":
        picks = torch.rand(batch, visible, generator=gen, device=DEVICE).topk(G.index_topk).indices.int().contiguous()
    sinks = torch.randn(G.num_heads, generator=gen, device=DEVICE)
    out = torch.empty(batch, G.num_heads, G.head_dim, device=DEVICE)
    args = dict(sinks=sinks, scale=G.head_dim ** -0.5, layout=ls.main, window=G.window, window_pool=lc.window,
                step_kv=step_kv, entry_pool=lc.entries, ratio=spec.ratio, page_tokens=cache.spec.page_tokens,
                picks=picks, out=out)
    keys = batch * (G.window + (G.index_topk if kind == "CSA" else visible))
    label = f"attention {kind} batch {batch} ctx {history + 1} ({keys * 584 / 1e6:.1f} MB of keys)"
    before = _load_base_attention()
    if before is not None:
        variants(label + " before split-KV", lambda: before.sparse_attention_paged(q, plan, **args), [None],
                 lambda v: None)
    chosen = {}
    default_h, default_stages = A.BLOCK_H, A.NUM_STAGES  # {} below is the module's own configuration

    def run():
        return A.sparse_attention_paged(q, plan, max_entries=visible, splits=chosen.get("splits"), **args)

    def apply(setting):
        chosen.clear()
        chosen.update(setting)
        A.BLOCK_H = setting.get("block_h", default_h)
        A.NUM_STAGES = setting.get("stages", default_stages)

    print(label, "auto config:", A._config(batch, G.num_heads, G.window + (G.index_topk if kind == "CSA" else visible),
                                           DEVICE), flush=True)
    variants(label, run, settings or [{}, {"splits": 1}, {"block_h": 16}, {"block_h": 16, "splits": 1}, {"stages": 2},
                                      {"splits": 32}], apply, row_tolerance=8e-3)  # two runs each within 4e-3


def insert():
    """kv_insert and compress_insert tiles over 65536 rows / an 8192-row CSA chunk (the bench's insert sizes)."""
    import dsv4kv.kernels.compress as C
    import dsv4kv.kernels.window as W
    from dsv4kv.ops.rope import rope_cos_sin

    spec = G.layers[CSA]
    cache, plan = csa_plan(1, 0, 8192)
    ls, lc = cache.spec.layers[CSA], cache.pools.layers[CSA]
    n = 65536
    pool = torch.zeros(n // ls.entries_per_page, ls.entry_page_bytes, dtype=torch.uint8, device=DEVICE)
    kv = torch.randn(n, G.head_dim, device=DEVICE).bfloat16()
    positions = torch.randint(0, 1 << 20, (n,), device=DEVICE, dtype=torch.int32)
    slots = torch.randperm(n, device=DEVICE).int()
    cos_sin = rope_cos_sin(spec.rope, positions)
    variants("kv_insert 65536 rows (122 MB)", lambda: W.kv_insert(kv, positions, spec.rope, ls.main, pool,
                                                                   ls.entries_per_page, slots, cos_sin=cos_sin) or pool,
             [W.KV_INSERT_TILE, (8, 4), (32, 8), (8, 2)], lambda v: setattr(W, "KV_INSERT_TILE", v))
    entry_cos_sin = rope_cos_sin(spec.rope, plan.entries[4].index * 4)
    for key, main, layout, pool, d, state in (("csa_main", True, ls.main, lc.entries, G.head_dim,
                                               (lc.state_kv, lc.state_score)),
                                              ("csa_index", False, ls.index, lc.index_keys, G.index_head_dim,
                                               (lc.index_state_kv, lc.index_state_score))):
        rows = torch.randn(8192, 2 * d, device=DEVICE), torch.randn(8192, 2 * d, device=DEVICE)
        norm = torch.ones(d, device=DEVICE)

        def run():
            C.compress_insert(*state, plan, *rows, ratio=4, overlap=True, norm_weight=norm, eps=1e-6, rope=spec.rope,
                              out_dtype=torch.bfloat16, layout=layout, pool=pool, page_tokens=cache.spec.page_tokens,
                              main=main, cos_sin=entry_cos_sin)
            return pool
        base = dict(C.COMPRESS_TILES)
        settings = [base[key], (1, 8, 8), (2, 8, 4), (4, 8, 8)] if main else [base[key], (1, 8, 4), (8, 8, 8), (2, 8, 4)]

        def apply(v, key=key, base=base):
            C.COMPRESS_TILES = {**base, key: v}
        variants(f"compress_insert 8192 rows {key}", run, settings, apply)


TOPK_SHAPES = ((1, 262144, 512), (1, 1 << 20, 512), (64, 32768, 512), (8, 262144, 512),
               (1, 262144, 1024))  # the three targets, a mid batch, V4-Pro's k


def topk():
    """top-k, the split kernel in four launches: programs per SM and phase (S chunks per row) x columns per tile
    (`SPLIT_TILING`, forced for every shape), on randn scores and on scores that rise with the column (the top-k
    clustered in the row's last chunks, which then buffer nearly every pick). Each variant's index sets must equal a
    stable sort's before it is timed; the kernel before a change can join as "before" (TOPK_BEFORE names a copy of
    its topk.py). Prints one line per variant, then `TOPK` summary lines."""
    import dsv4kv.kernels.topk as T
    from dsv4kv.ops.indexer import topk_picks

    import importlib.util
    import os

    old = None
    if os.environ.get("TOPK_BEFORE"):  # a previous kernels/topk.py, imported inside the package (relative imports)
        spec = importlib.util.spec_from_file_location("dsv4kv.kernels._topk_before", os.environ["TOPK_BEFORE"])
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    defaults = dict(T.SPLIT_TILING)
    row_limits = T.ROW_MAX_COLS, T.ROW_MAX_COLS_MANY
    T.ROW_MAX_COLS = T.ROW_MAX_COLS_MANY = 0  # these variants are the split kernel's: no row goes to the row kernel
    grid = [(per_sm, block) for per_sm in (2, 4, 8) for block in (512, 1024, 2048)]
    if os.environ.get("TOPK_GRID"):  # e.g. "2:1024,4:2048"
        grid = [tuple(int(v) for v in pair.split(":")) for pair in os.environ["TOPK_GRID"].split(",")]
    summary = []
    try:
        for rows, cols, k in TOPK_SHAPES:
            for kind in ("randn", "rising"):
                g = torch.Generator(device=DEVICE).manual_seed(rows * cols + k)
                scores = torch.randn(rows, cols, generator=g, device=DEVICE)
                if kind == "rising":
                    scores += torch.linspace(0, 8, cols, device=DEVICE)
                lengths = torch.full((rows,), cols, dtype=torch.int32, device=DEVICE)
                want = topk_picks(scores, k).sort(dim=1).values.int()
                out = torch.empty(rows, k, dtype=torch.int32, device=DEVICE)
                old_ws = old.topk_workspace(rows, cols, k, DEVICE) if old is not None else None
                new_ws = {}

                def new(per_sm: int, block: int):
                    def run():
                        T.SPLIT_TILING = {"small": (per_sm, block), "big": (per_sm, block)}
                        if (per_sm, block) not in new_ws:  # S, so the workspace's width, depends on both
                            new_ws[per_sm, block] = T.topk_workspace(rows, cols, k, DEVICE)
                        return T.topk_indices(scores, lengths, k, out=out, workspace=new_ws[per_sm, block])
                    return run

                runs = {f"{per_sm}/SM,{block}": new(per_sm, block) for per_sm, block in grid}
                if old is not None:
                    runs = {"before": lambda: old.topk_indices(scores, lengths, k, out=out, workspace=old_ws), **runs}
                label = f"topk {rows} x {cols} k={k} {kind}"
                times = {}
                for name, run in runs.items():
                    out.fill_(-7)
                    run()
                    torch.cuda.synchronize()
                    if not torch.equal(out, want):
                        print(f"{label} {name}: DIFFERS from a stable sort, not timed", flush=True)
                        times[name] = "DIFFERS"
                        continue
                    t = time_cuda(run, device=DEVICE, runs=30)
                    times[name] = f"{t.median_us:.1f}"
                    print(f"{label} {name}: {t.median_us:.1f} us (p10 {t.p10_us:.1f}, p90 {t.p90_us:.1f})", flush=True)
                summary.append(f"TOPK {rows:>5} x {cols:>7} k={k:<4} {kind:<6} " + "  ".join(
                    f"{name} {value}" for name, value in times.items()))
                del scores, out, new_ws, old_ws
                torch.cuda.empty_cache()
    finally:  # the module's settings back, whatever a variant raised
        T.SPLIT_TILING = dict(defaults)
        T.ROW_MAX_COLS, T.ROW_MAX_COLS_MANY = row_limits
    print("\n".join(summary), flush=True)


if __name__ == "__main__":
    chosen = sys.argv[1:] or ["indexer"]
    for name in chosen:
        globals()[name]()
