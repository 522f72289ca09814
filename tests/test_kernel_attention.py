"""Sparse attention kernel (ops/attention/kernel.py) against the reference: `ops.attention.gather` (window ring + the
step's own kv, compressed entries by index) then `ops.attention.reference.sparse_attention`, on NaN-poisoned caches.

Interpreter tests use the tiny geometry (H 8, D 128, window 16, CSA m 4, HCA m 16) with 128-token pages,
padded plans, several requests on non-contiguous blocks, and chunks that take their window partly from the
ring and partly from the step; where CUDA exists they run compiled on the GPU instead. GPU-only tests run the
V4-Flash / V4-Pro shapes (decode of 1 and 8 rows at a few thousand tokens, a 256-row prefill chunk, a decode at
~2^20 tokens), V4-Flash split-KV decodes (batch 1 and 64; CSA with 512 picks, HCA up to ~2^20 tokens) and
CUDA-graph replays (single pass, split path with its workspace allocated under capture or given).

Split-KV: each scenario runs the single pass and a forced split count (2, 3 or 7; on a GPU also the automatic
choice) into a NaN-filled `out` and a NaN-filled workspace (the merge must read only what the splits wrote),
against the same reference; CSA rows take 40 picks, so their entries span two key blocks, and a tile variant with
16-key blocks splits HCA rows inside their entries. Rows with fewer key blocks than splits, padding rows and the
host-side split choice (`_config`) have their own tests. Splits change only the summation order: same tolerance.

Error measure: per (row, head), max |out - ref| / max |ref| (the row's largest output). The kernel takes q and the
softmax weights of w . V in bf16 (rounded to nearest on the GPU and, explicitly, under the interpreter), as
FlashMLA does: one tolerance of 4e-3 (docs/numerics.md; 2.5e-3..3.7e-3 measured here, with keys of std 2). The GPU
tests print their errors (pytest -s).

CSA picks may repeat an entry: a repeated pick counts once per occurrence, as in the reference (no dedup);
the indexer never repeats one.
"""

from dataclasses import replace

import pytest
import torch

from dsv4kv import CacheManager, ModelGeometry
from dsv4kv.geometry import LayerKind
from dsv4kv.ops.attention import kernel as attention
from dsv4kv.ops.attention.kernel import sparse_attention_paged
from dsv4kv.ops.attention.tuning import TUNING, tuning_for
from dsv4kv.ops.rope.kernel import rope_rows
from dsv4kv.cache.layout import indexer_layout, main_layout
from dsv4kv.ops.window.reference import append_window
from dsv4kv.ops.attention.reference import sparse_attention
from dsv4kv.ops.shared.rows import step_rows
from dsv4kv.ops.attention.gather import gather_entries, gather_window, visible_entries
from dsv4kv.ops.rope.reference import rope_cos_sin

TINY = ModelGeometry.preset("tiny")  # layers: 0 window, 1 CSA m=4, 2 HCA m=16
# the small tests run under the interpreter on the CPU, or compiled where a GPU exists
DEVICE = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
PAGE = 128
TOL = 4e-3  # max |out - ref| / max |ref| per (row, head): bf16 q and weights (docs/numerics.md)
LAYER = {"window": 0, "csa": 1, "hca": 2}
AUTO = (None,) if torch.cuda.is_available() else ()  # the automatic split count (always 1 off CUDA)
CSA_PICKS = 40  # picks per CSA row in the scenario: 2 key blocks of 32 after the window's one


# --- helpers ----------------------------------------------------------------------------------------------
def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, g, dtype=torch.float32, device=DEVICE, std=1.0):
    """Random normals drawn on the CPU (the same values on every device), then moved."""
    return (torch.randn(*shape, generator=g) * std).to(dtype).to(device)


def rel_error(got, want):
    """Largest per-(row, head) error relative to the row's max |ref|."""
    got, want = got.double(), want.double()
    scale = want.abs().amax(-1).clamp(min=1e-300)  # fp64: keys of fp32 subnormals keep their own scale
    return float(((got - want).abs().amax(-1) / scale).max()) if want.numel() else 0.0


def encode_step_kv(layout, rows, kv):
    """This step's kv [N, D] encoded as one page of `rows` entries; the padding entries stay NaN (0xFF)."""
    step_kv = torch.full((1, layout.page_bytes(rows)), 0xFF, dtype=torch.uint8, device=kv.device)
    layout.write(step_kv, rows, torch.arange(kv.shape[0], device=kv.device), kv)
    return step_kv


def poison(pool, layout, entries, slots):
    """Overwrite entries with NaN (every format decodes 0xFF as NaN): reading one turns the output NaN."""
    slots = torch.as_tensor(slots, dtype=torch.long, device=pool.device)
    layout.write(pool, entries, slots, torch.full((slots.numel(), layout.dim), float("nan"), device=pool.device))


def random_picks(plan, ratio, k, g, *, avoid=None):
    """Picks [R, K] int32: real rows pick visible entries in random order, with repeats and -1 holes (and never
    an index in `avoid`, entries poisoned as unreadable); padding rows get garbage that must be ignored."""
    positions = plan.positions.cpu().long()
    rows = positions.shape[0]
    visible = ((positions + 1) // ratio).clamp(min=0)
    picks = (torch.rand(rows, k, generator=g) * visible[:, None]).long()
    if avoid is not None:
        picks = torch.where(avoid(picks), torch.zeros_like(picks), picks)  # entry 0 is never poisoned
    holes = (torch.rand(rows, k, generator=g) < 0.25) | (visible[:, None] == 0)
    picks = torch.where(holes, torch.full_like(picks, -1), picks)
    garbage = torch.randint(0, 10**6, (rows, k), generator=g)
    return torch.where((positions < 0)[:, None], garbage, picks).to(torch.int32).to(plan.positions.device)


def reference(q, plan, layout, window, window_pool, kv, *, entry_pool=None, ratio=0, page_tokens=0, picks=None):
    """The reference path of the layer: gathered keys, then sparse_attention -> fp32 [N, H, D] (real rows)."""
    rows = step_rows(plan)
    n = rows.num_tokens
    keys, valid = gather_window(window_pool, layout, window, plan, layout.round_trip(kv), rows)
    if entry_pool is not None:
        index = picks[:n].long() if picks is not None else visible_entries(plan, ratio=ratio, rows=rows)
        entries, entry_valid = gather_entries(entry_pool, layout, plan, index, ratio=ratio,
                                              page_tokens=page_tokens, rows=rows)
        keys, valid = torch.cat((keys, entries), dim=1), torch.cat((valid, entry_valid), dim=1)
    return sparse_attention(q[:n], keys, valid, sinks_of(q), q.shape[-1] ** -0.5)


_SINKS = {}


def sinks_of(q):
    """Fixed sinks per (heads, device): one large positive (dominates), the rest spread."""
    key = (q.shape[1], q.device)
    if key not in _SINKS:
        s = torch.randn(q.shape[1], generator=gen(99)) * 2
        s[0] = 6.0
        _SINKS[key] = s.to(q.device)
    return _SINKS[key]


# --- the scenario: three requests, slots 1..3, interleaved blocks --------------------------------------------
WARMUP = [[(0, 16), (1, 16)]] * 9  # 144 tokens each, alternating blocks: requests span non-contiguous blocks
CHECKED = [
    [(0, 1), (1, 23), (2, 5)],  # decode; a chunk whose window is partly ring, partly step; a fresh request
    [(2, 30), (0, 1)],  # a chunk longer than the window (later rows read only the step); decode
    [(1, 1), (0, 1), (2, 1)],  # a decode batch in a 32-row plan: 29 padding rows
]
MAX_ROWS = 32


def attend(q, plan, layout, window, window_pool, step_kv, splits, **kw):
    """The kernel into a NaN-filled out (and, for a forced split count > 1, a NaN-filled workspace)."""
    rows, heads, dim = q.shape
    out = torch.full((rows, heads, dim), float("nan"), device=q.device)
    if splits is not None and splits > 1:
        kw["workspace"] = torch.full((rows, splits, heads, dim + 2), float("nan"), device=q.device)
    got = sparse_attention_paged(q, plan, sinks=sinks_of(q), scale=dim ** -0.5, layout=layout, window=window,
                                 window_pool=window_pool, step_kv=step_kv, out=out, splits=splits, **kw)
    assert got is out
    return got


def run_scenario(kv_format, kind, q_dtype, seed, splits=(None,)):
    """Feed WARMUP then CHECKED through the cache (entries written as plans complete them, the ring appended
    after attention, as the layer does), and compare the kernel with the reference on each CHECKED step, once
    per split count. Returns {splits: max error}."""
    cache = CacheManager(TINY, max_requests=4, max_tokens=600, kv_format=kv_format, indexer_format="bf16",
                         page_tokens=PAGE, device=DEVICE, poison=True)
    layer = LAYER[kind]
    spec, lc = TINY.layers[layer], cache.pools.layers[layer]
    layout, window, ratio = cache.spec.layers[layer].main, TINY.window, spec.ratio
    per_page = PAGE // ratio if ratio else 0
    dummy = cache.admit()  # slot 0 stays unused
    rids = [cache.admit() for _ in range(3)]
    cache.release(dummy)
    buffers = cache.step_buffers(max_tokens=MAX_ROWS, max_requests=4)
    g = gen(seed)
    heads, dim = TINY.num_heads, TINY.head_dim
    unreadable = (lambda j: j % 3 == 1) if kind == "csa" else None  # CSA entries no pick may read
    errors = {s: [] for s in splits}
    for step_index, step in enumerate(WARMUP + CHECKED):
        plan = cache.plan_step([(rids[i], n) for i, n in step], buffers=buffers)
        n, rows = plan.num_tokens, plan.positions.shape[0]
        kv = randn(n, dim, g=g, std=2, dtype=torch.bfloat16)
        kw = {}
        if ratio:  # compress-and-insert runs before attention: this step's completed entries are readable
            writes = plan.entries[ratio]
            slots, index = writes.slots[:writes.count], writes.index[:writes.count]
            layout.write(lc.entries, per_page, slots, randn(writes.count, dim, g=g, dtype=torch.bfloat16))
            if unreadable is not None:
                poison(lc.entries, layout, per_page, slots[unreadable(index)])
            kw = dict(entry_pool=lc.entries, ratio=ratio, page_tokens=PAGE)
            if kind == "csa":
                kw["picks"] = random_picks(plan, ratio, CSA_PICKS, g, avoid=unreadable)
        if step_index >= len(WARMUP):
            # the ring entry at start % window holds position start - window: in no row's window
            stale = [cache.slot(rids[i]) * window + (cache.length(rids[i]) - c) % window for i, c in step]
            poison(lc.window, layout, window, stale)
            q = randn(rows, heads, dim, g=g, dtype=q_dtype)
            q[n:] = float("nan")  # padding rows must give zeros whatever their q holds
            step_kv = encode_step_kv(layout, rows, kv)
            want = reference(q, plan, layout, window, lc.window, kv, **kw)
            assert torch.isfinite(want).all()
            for count in splits:
                got = attend(q, plan, layout, window, lc.window, step_kv, count, **kw)
                assert torch.isfinite(got).all(), f"{count} splits"
                assert torch.equal(got[n:], torch.zeros_like(got[n:])), f"{count} splits: padding rows must be zeros"
                errors[count].append(rel_error(got[:n], want))
        append_window(lc.window, layout, window, plan, kv)
    return {count: max(e) for count, e in errors.items()}


# one forced split count per case beside the single pass (the interpreter pays per key block, and splitting only
# moves blocks between programs); with the tile variants below, 2, 3 and 7 each meet HCA and CSA, fp8 and bf16
# entries, and 7 is more than any row's blocks. On a GPU every case also runs the automatic choice (None).
CASES = {
    "fp8-window": ("fp8", "window", torch.bfloat16, (1, 3)),
    "bf16-window": ("bf16", "window", torch.bfloat16, (1, 7)),
    "fp8-hca": ("fp8", "hca", torch.bfloat16, (1, 7)),
    "bf16-hca": ("bf16", "hca", torch.bfloat16, (1, 2)),
    "fp8-csa": ("fp8", "csa", torch.bfloat16, (1, 7)),
    "bf16-csa-q32": ("bf16", "csa", torch.float32, (1, 3)),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_over_chunked_steps(case):
    kv_format, kind, q_dtype, splits = CASES[case]
    errors = run_scenario(kv_format, kind, q_dtype, seed=7, splits=splits + AUTO)
    print(f"{case}: " + ", ".join(f"{s} splits {e:.2e}" for s, e in errors.items()))
    assert max(errors.values()) < TOL, errors


@pytest.mark.parametrize("kv_format,kind,block_h,block_n,splits", [
    ("fp8", "hca", 16, 16, (3,)), ("fp8", "csa", 16, 32, (2,)), ("bf16", "hca", 64, 32, (7,)),
])
def test_tile_variants_match_reference(monkeypatch, kv_format, kind, block_h, block_n, splits):
    """Other tiles `_config` may choose (the lead times variants by overriding it): 16-key blocks split HCA rows
    (up to 19 entries) inside their entries; 16 heads (the previous default); 64 heads mask most of the 8 tiny heads
    off."""
    choose = attention._config
    monkeypatch.setattr(attention, "_config", lambda *a: choose(*a)._replace(block_h=block_h, block_n=block_n))
    errors = run_scenario(kv_format, kind, torch.bfloat16, seed=5, splits=splits)
    assert max(errors.values()) < TOL, errors


@pytest.mark.parametrize("kv_format,kind,splits", [("fp8", "csa", (1, 3)), ("bf16", "hca", (1,))])
def test_logits_through_the_scratch_row_match_reference(monkeypatch, kv_format, kind, splits):
    """64-head programs (8 warps, whose logits pass through a scratch row; the tiny model's heads would pick 16):
    the reference's outputs within the tolerance, split or not."""
    choose = attention._config
    monkeypatch.setattr(attention, "_config", lambda *a: choose(*a)._replace(block_h=64, num_warps=8))
    errors = run_scenario(kv_format, kind, torch.bfloat16, seed=9, splits=splits)
    assert max(errors.values()) < TOL, errors


def test_padding_only_and_keyless_rows_are_zeros_and_out_is_optional():
    """A fresh request's first token (window of one key) next to rows of padding; without `out=` the op allocates."""
    cache = CacheManager(TINY, max_requests=2, max_tokens=300, kv_format="fp8", indexer_format="bf16",
                         page_tokens=PAGE, device=DEVICE, poison=True)
    layout, lc = cache.spec.layers[2].main, cache.pools.layers[2]
    plan = cache.plan_step([(cache.admit(), 1)], buffers=cache.step_buffers(max_tokens=5, max_requests=2))
    g = gen(3)
    kv = randn(1, TINY.head_dim, g=g)
    q = randn(5, TINY.num_heads, TINY.head_dim, g=g, dtype=torch.bfloat16)
    step_kv = encode_step_kv(layout, 5, kv)
    got = sparse_attention_paged(q, plan, sinks=sinks_of(q), scale=0.1, layout=layout, window=TINY.window,
                                 window_pool=lc.window, step_kv=step_kv, entry_pool=lc.entries, ratio=16,
                                 page_tokens=PAGE)
    assert got.dtype == torch.float32 and got.shape == (5, TINY.num_heads, TINY.head_dim)
    assert torch.equal(got[1:], torch.zeros_like(got[1:]))
    # one key: out = w * key with w = 1 / (1 + exp(sink - logit))
    key = layout.round_trip(kv)[0]
    logit = 0.1 * (q[0].float() @ key)
    want = torch.sigmoid(logit - sinks_of(q))[:, None] * key
    assert rel_error(got[:1], want[None]) < TOL


@pytest.mark.parametrize("splits", [2, 5, "auto-3"])
def test_empty_splits_and_padding_rows(monkeypatch, splits):
    """More splits than key blocks: a fresh request's first token (one key, one block) and a decode with a full
    window and 5 HCA entries (two blocks) leave the splits past their blocks empty, padding rows leave all empty.
    Empty splits write nothing (their workspace rows stay NaN) and the merge reads none of them: exact zeros for
    padding rows, the single pass's output for the others. "auto-3": the automatic path (workspace allocated
    inside) where `_config` chooses 3 splits."""
    cache = CacheManager(TINY, max_requests=3, max_tokens=300, kv_format="fp8", indexer_format="bf16",
                         page_tokens=PAGE, device=DEVICE, poison=True)
    layout, lc = cache.spec.layers[2].main, cache.pools.layers[2]
    old, fresh = cache.admit(), cache.admit()
    g = gen(4)
    history = cache.plan_step([(old, 90)])
    writes = history.entries[16]
    layout.write(lc.entries, PAGE // 16, writes.slots[:writes.count], randn(writes.count, TINY.head_dim, g=g))
    append_window(lc.window, layout, TINY.window, history, randn(90, TINY.head_dim, g=g))
    plan = cache.plan_step([(fresh, 1), (old, 1)], buffers=cache.step_buffers(max_tokens=6, max_requests=3))
    kv = randn(2, TINY.head_dim, g=g)
    q = randn(6, TINY.num_heads, TINY.head_dim, g=g, dtype=torch.bfloat16)
    q[2:] = float("nan")
    args = dict(sinks=sinks_of(q), scale=TINY.head_dim ** -0.5, layout=layout, window=TINY.window,
                window_pool=lc.window, step_kv=encode_step_kv(layout, 6, kv), entry_pool=lc.entries, ratio=16,
                page_tokens=PAGE)
    single = sparse_attention_paged(q, plan, splits=1, **args)
    out = torch.full((6, TINY.num_heads, TINY.head_dim), float("nan"), device=DEVICE)
    if splits == "auto-3":
        choose = attention._config
        monkeypatch.setattr(attention, "_config", lambda *a: choose(*a)._replace(splits=3))
        got = sparse_attention_paged(q, plan, out=out, **args)
    else:
        workspace = torch.full((6, splits, TINY.num_heads, TINY.head_dim + 2), float("nan"), device=DEVICE)
        got = sparse_attention_paged(q, plan, out=out, workspace=workspace, **args)
        used = [1, 2]  # blocks of rows 0 and 1, one per split
        for row, n in enumerate(used):
            assert not torch.isnan(workspace[row, :n]).any() and torch.isnan(workspace[row, n:]).all()
        assert torch.isnan(workspace[2:]).all()
    assert got is out
    assert torch.equal(got[2:], torch.zeros_like(got[2:]))
    assert rel_error(got[:2], single[:2]) < TOL
    assert rel_error(got[:2], reference(q, plan, layout, TINY.window, lc.window, kv, entry_pool=lc.entries, ratio=16,
                                        page_tokens=PAGE)) < TOL


def hca_decode_case(history: int, new: int, rows: int, seed: int):
    """TINY's HCA layer (2) with `history` tokens of random window keys and entries, then one step of `new` tokens
    padded to `rows` rows -> (q, plan, sparse_attention_paged's arguments but splits, the step's RoPE tables)."""
    cache = CacheManager(TINY, max_requests=3, max_tokens=300, kv_format="fp8", indexer_format="bf16",
                         page_tokens=PAGE, device=DEVICE, poison=True)
    spec = TINY.layers[2]
    layout, lc = cache.spec.layers[2].main, cache.pools.layers[2]
    rid = cache.admit()
    g = gen(seed)
    prior = cache.plan_step([(rid, history)])
    writes = prior.entries[16]
    layout.write(lc.entries, PAGE // 16, writes.slots[:writes.count], randn(writes.count, TINY.head_dim, g=g))
    append_window(lc.window, layout, TINY.window, prior, randn(history, TINY.head_dim, g=g))
    plan = cache.plan_step([(rid, new)], buffers=cache.step_buffers(max_tokens=rows, max_requests=3))
    q = randn(rows, TINY.num_heads, TINY.head_dim, g=g, dtype=torch.bfloat16)
    args = dict(sinks=sinks_of(q), scale=TINY.head_dim ** -0.5, layout=layout, window=TINY.window,
                window_pool=lc.window, step_kv=encode_step_kv(layout, rows, randn(new, TINY.head_dim, g=g)),
                entry_pool=lc.entries, ratio=16, page_tokens=PAGE)
    return q, plan, args, rope_cos_sin(spec.rope, plan.positions)


@pytest.mark.parametrize("splits", [1, 3])
def test_inverse_rope_output_is_rope_rows_of_the_output(splits):
    """inverse_rope: the bf16 output is bit for bit `rope_rows(fp32 output, cos, sin, inverse=True)`, whether the
    merge applies it (3 splits) or the single pass's epilogue; padding rows stay zeros."""
    q, plan, args, cos_sin = hca_decode_case(90, 3, 5, seed=14)
    args["splits"] = splits
    want = rope_rows(sparse_attention_paged(q, plan, **args), *cos_sin, inverse=True)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = sparse_attention_paged(q, plan, out=out, inverse_rope=cos_sin, **args)
    assert got is out and got.dtype == torch.bfloat16
    assert torch.equal(got, want) and torch.equal(got[3:], torch.zeros_like(got[3:]))
    with pytest.raises(ValueError, match="out: expected torch.bfloat16"):
        sparse_attention_paged(q, plan, out=torch.empty(q.shape, device=DEVICE), inverse_rope=cos_sin, **args)
    with pytest.raises(ValueError, match="inverse_rope: expected"):
        sparse_attention_paged(q, plan, inverse_rope=list(cos_sin), **args)
    with pytest.raises(ValueError, match=r"cos: expected torch.float32 \[5, \*\]"):
        sparse_attention_paged(q, plan, inverse_rope=(cos_sin[0][:2], cos_sin[1]), **args)


@pytest.mark.parametrize("splits", [1, 3])
def test_q_rope_dims_replace_the_last_dims_of_q(splits):
    """q_rope_dims: attention reads each head's last rope_dim dims from it and the others from q, bit for bit the
    attention of the whole roped q, whether q's own last dims are roped, unroped or NaN (never read)."""
    q, plan, args, cos_sin = hca_decode_case(90, 3, 5, seed=16)
    args["splits"] = splits
    rope_dim = 2 * cos_sin[0].shape[1]
    roped = rope_rows(q, *cos_sin)
    dims = torch.full((*q.shape[:2], rope_dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    assert rope_rows(q, *cos_sin, out=dims) is dims and torch.equal(dims, roped[..., -rope_dim:])
    poisoned = q.clone()
    poisoned[..., -rope_dim:] = float("nan")
    for inverse in (None, cos_sin):
        want = sparse_attention_paged(roped, plan, inverse_rope=inverse, **args)
        for given in (q, roped, poisoned):
            got = sparse_attention_paged(given, plan, inverse_rope=inverse, q_rope_dims=dims, **args)
            assert torch.equal(got, want)
    with pytest.raises(ValueError, match="out: overlaps x"):  # a rope-dims out over x's own bytes
        rope_rows(q, *cos_sin, out=q.view(-1)[:dims.numel()].view(dims.shape))
    with pytest.raises(ValueError, match="q_rope_dims: q must be bf16"):
        sparse_attention_paged(q.float(), plan, q_rope_dims=dims, **args)
    with pytest.raises(ValueError, match=r"q_rope_dims: expected torch.bfloat16 \[5, 8, \*\]"):
        sparse_attention_paged(q, plan, q_rope_dims=dims[:, :4].contiguous(), **args)
    with pytest.raises(ValueError, match="q_rope_dims: expected 1..127 dims a head, got 128"):
        sparse_attention_paged(q, plan, q_rope_dims=roped, **args)


def test_merge_tile_sets_only_the_order_of_the_sums():
    """The merge's tile (`_merge_tile`: splits read at once, head dims and warps per program) changes only the order
    of fp32 sums over the splits (here 3 in use, read 2 or 8 at a time, over all 128 dims or 32 a program, on 2 or 4
    warps: on a GPU the reduction's layout follows the tile), with and without the inverse RoPE, whose pairs then
    fall in two programs; for a launch of 2 splits it changes no byte (a sum of two terms and zeros is one rounding
    in any order). Padding rows stay zeros."""
    def tile(splits, dim):
        return attention._merge_tile(splits, dim, TUNING["sm90"])

    assert tile(2, 512) == (2, 512, 2) and tile(3, 512) == tile(16, 512) == (16, 512, 4)
    assert tile(20, 512) == (32, 256, 4) and tile(65, 512) == (128, 64, 4)
    assert tile(130, 512) == tile(300, 512) == (256, 32, 4) and tile(3, 64) == (16, 64, 2)
    small_blocks = replace(tuning_for(DEVICE), block_n=16, large_block_n=16)
    q, plan, args, cos_sin = hca_decode_case(290, 2, 4, seed=15)  # 3 key blocks of 16 a row
    dim = q.shape[2]

    def merged(splits, chunk, dims):
        # `chunk` splits at once over `dims` dims, on the rule's warps for this tile (2 or 4: both counts run)
        tuning = replace(small_blocks, merge_chunks=(chunk,), merge_elems=chunk * dims)
        assert attention._merge_tile(splits, dim, tuning)[:2] == (chunk, dims)
        return (sparse_attention_paged(q, plan, splits=splits, tuning=tuning, **args),
                sparse_attention_paged(q, plan, splits=splits, inverse_rope=cos_sin, tuning=tuning, **args))

    for splits, chunks in ((2, (2, 16)), (5, (8, 2))):
        outs = {(chunk, dims): merged(splits, chunk, dims) for chunk in chunks for dims in (dim, 32)}
        want = outs[(chunks[0], dim)]
        assert torch.isfinite(want[0][:2]).all() and torch.isfinite(want[1][:2].float()).all()
        for (chunk, dims), got in outs.items():
            for g_, w_ in zip(got, want):
                assert torch.equal(g_[2:], torch.zeros_like(g_[2:]))
                if splits == 2:
                    assert torch.equal(g_, w_), (chunk, dims)
                else:  # another order of the same fp32 sums
                    torch.testing.assert_close(g_.float(), w_.float(), rtol=2e-6 if g_.dtype == torch.float32
                                               else 8e-3, atol=1e-6)
        if splits == 5:  # some order differs: the tolerance above is not vacuous
            assert any(not torch.equal(got[0], want[0]) for got in outs.values())


def test_config_splits_only_grids_that_leave_the_gpu_idle(monkeypatch):
    """`_config` on a 132-SM device (V4-Flash decode shapes: 64 heads, window 128 + 512 picks, or + 8192 HCA entries
    at 1M): small batches split (with 16-head blocks and splits of one key block where even the split grid leaves
    half the SMs idle), a batch that fills half the SMs does not, a batch filling a third takes 64-key blocks; the
    interpreter never splits."""
    monkeypatch.setattr(attention, "sm_count", lambda device: 132)
    tuning = replace(TUNING["sm90"], block_h=64, small_block_h=16, block_n=32, large_block_n=64, min_split_blocks=2,
                     small_min_split_blocks=1)  # whatever the defaults are now
    cuda = torch.device("cuda", 0)

    def tiles(rows, keys, heads=64, device=cuda):
        config = attention._config(rows, heads, keys, device, tuning)
        return config.block_h, config.block_n, config.splits, config.num_warps

    assert tiles(1, 128 + 512) == (16, 32, 20, 4)  # 1 x 10 programs at 64 heads: 4 x 20 at 16 heads, a block each
    assert tiles(1, 128 + 8192) == (64, 32, 130, 8) and tiles(1, 128 + 4096) == (64, 32, 66, 8)  # 2 blocks a split
    assert tiles(8, 128 + 512) == (64, 32, 10, 8) and tiles(8, 128 + 8192) == (64, 32, 16, 8)
    assert tiles(64, 128 + 512) == (64, 64, 2, 8)  # 64 rows fill a third of the SMs: 64-key blocks
    assert tiles(67, 128 + 512) == (64, 64, 1, 8) and tiles(128, 128 + 8192) == (64, 64, 1, 8)
    assert tiles(1, 16) == (16, 32, 1, 4)  # too few keys to split
    assert tiles(4, 128 + 512, heads=128) == (64, 32, 10, 8)  # V4-Pro: 2 head blocks per row
    assert tiles(1, 128 + 8192, heads=8) == (16, 32, 130, 4)  # fewer heads than a tensor-core M: 16
    assert tiles(1, 128 + 8192, device=torch.device("cpu")) == (64, 32, 1, 8)


def test_dequantizes_raw_fp8_bytes():
    """Single-key rows over hand-made MODEL1 bytes: every finite e4m3 code, scale codes 0 (2^-127: keys in fp32
    subnormals, kept, not flushed), 100 and 135, and 0xFF (NaN), which turns its row NaN as in the reference."""
    cache = CacheManager(TINY, max_requests=4, max_tokens=300, kv_format="fp8", indexer_format="bf16",
                         page_tokens=PAGE, device=DEVICE, poison=True)
    layout, lc = cache.spec.layers[0].main, cache.pools.layers[0]
    rids = [cache.admit() for _ in range(4)]
    plan = cache.plan_step([(r, 1) for r in rids], buffers=cache.step_buffers(max_tokens=5, max_requests=4))
    g = gen(11)
    data = torch.randint(0, 256, (4, layout.data_bytes), generator=g, dtype=torch.uint8)
    nope = data[:, :layout.nope_dim]
    nope[(nope & 0x7F) == 0x7F] = 0x3C  # e4m3 NaN codes -> 1.5
    data[:, layout.nope_dim:] = (torch.randn(4, layout.rope_dim, generator=g) * 3).to(torch.bfloat16).view(torch.uint8)
    scales = torch.zeros(4, layout.scale_bytes, dtype=torch.uint8)
    scales[:, 0] = torch.tensor([0, 100, 135, 0xFF], dtype=torch.uint8)  # the tiny head has one 64-dim block
    step_kv = torch.full((1, layout.page_bytes(5)), 0xFF, dtype=torch.uint8)
    data_rows, scale_rows = layout.page_views(step_kv, 5)
    data_rows[0, :4], scale_rows[0, :4] = data, scales
    q = randn(5, TINY.num_heads, TINY.head_dim, g=g, dtype=torch.bfloat16)
    got = sparse_attention_paged(q, plan, sinks=sinks_of(q), scale=0.05, layout=layout, window=TINY.window,
                                 window_pool=lc.window, step_kv=step_kv.to(DEVICE)).cpu()
    keys = layout.decode(data, scales)  # [4, D] fp32
    weight = torch.sigmoid(0.05 * (q[:4].cpu().float() @ keys[:, :, None])[..., 0] - sinks_of(q).cpu())
    want = weight[..., None] * keys[:, None]  # [4, H, D]
    assert torch.isnan(keys[3]).any() and torch.isnan(got[3]).all()
    assert rel_error(got[:3], want[:3]) < TOL
    nope = slice(0, layout.nope_dim)  # the 2^-127 row on its own scale: bf16 subnormals round at 2^-133
    assert rel_error(got[0, :, nope], want[0, :, nope]) < 1e-2
    assert torch.equal(got[4], torch.zeros_like(got[4]))


def test_rejects_bad_input():
    cache = CacheManager(TINY, max_requests=2, max_tokens=300, kv_format="fp8", indexer_format="bf16",
                         page_tokens=PAGE, device=DEVICE, poison=True)
    layout, lc = cache.spec.layers[1].main, cache.pools.layers[1]
    plan = cache.plan_step([(cache.admit(), 3)])
    heads, dim = TINY.num_heads, TINY.head_dim

    def zeros(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=DEVICE)

    q = zeros(3, heads, dim, dtype=torch.bfloat16)
    good = dict(sinks=zeros(heads), scale=dim ** -0.5, layout=layout, window=TINY.window, window_pool=lc.window,
                step_kv=encode_step_kv(layout, 3, zeros(3, dim)), entry_pool=lc.entries, ratio=4,
                page_tokens=PAGE, picks=zeros(3, 8, dtype=torch.int32))
    sparse_attention_paged(q, plan, **good)  # the good call runs
    sparse_attention_paged(q, plan, **good, splits=2, max_entries=5, workspace=zeros(3, 2, heads, dim + 2))

    def bad(match, q=q, **change):
        with pytest.raises(ValueError, match=match):
            sparse_attention_paged(q, plan, **{**good, **change})

    bad(r"q: expected torch.bfloat16/torch.float32 \[3, \*, 128\], got torch.float16", q=q.half())
    bad(r"q: expected .* got torch.bfloat16 \[4, 8, 128\]", q=zeros(4, heads, dim, dtype=torch.bfloat16))
    bad(r"q: expected .* got torch.bfloat16 \[3, 8, 64\]", q=q[..., :64].contiguous())
    bad(r"q: must be contiguous", q=q.transpose(0, 1).contiguous().transpose(0, 1))
    bad(r"q: on meta", q=q.to("meta"))
    buf = zeros(3 * heads * dim)  # an fp32 out over the bytes of a bf16 q
    bad("out: overlaps q", q=buf.view(torch.bfloat16)[:3 * heads * dim].view(3, heads, dim),
        out=buf.view(3, heads, dim))
    bad(r"sinks: expected torch.float32 \[8\]", sinks=zeros(heads, dtype=torch.bfloat16))
    bad(r"sinks: expected torch.float32 \[8\]", sinks=zeros(heads + 1))
    bad(r"sinks: on meta", sinks=zeros(heads).to("meta"))
    bad(r"scale: expected a positive finite float", scale=float("nan"))
    bad(r"window: expected a positive int", window=0)
    bad(rf"window_pool: expected torch.uint8 \[\*, {layout.page_bytes(8)}\]", window=8)  # a ring of another length
    bad(r"window_pool: must be contiguous", window_pool=zeros(2, 2 * lc.window.shape[1], dtype=torch.uint8)[:, ::2])
    bad(r"window_pool: 3 request slots, the block table has 2", window_pool=zeros(3, lc.window.shape[1],
                                                                                  dtype=torch.uint8))
    bad(rf"step_kv: expected torch.uint8 \[1, {layout.page_bytes(3)}\]", step_kv=zeros(1, 576, dtype=torch.uint8))
    bad(rf"entry_pool: expected torch.uint8 \[\*, {layout.page_bytes(PAGE // 16)}\]", ratio=16)  # another ratio
    bad(r"entry_pool: must be contiguous",
        entry_pool=zeros(lc.entries.shape[0], 2 * lc.entries.shape[1], dtype=torch.uint8)[:, ::2])
    bad(r"entry_pool: on meta", entry_pool=lc.entries.to("meta"))
    bad(r"ratio / page_tokens", ratio=0)
    bad(r"ratio / page_tokens", page_tokens=130)
    bad(r"picks: given without an entry_pool", entry_pool=None)
    bad(r"picks: expected torch.int32/torch.int64 \[3, \*\]", picks=zeros(3, 8))
    bad(r"picks: expected .* got torch.int32 \[2, 8\]", picks=zeros(2, 8, dtype=torch.int32))
    bad(r"out: expected torch.float32 \[3, 8, 128\]", out=zeros(3, heads, dim, dtype=torch.bfloat16))
    bad(r"out: expected torch.float32 \[3, 8, 128\]", out=zeros(3, heads, dim + 1))
    bad(r"splits: expected an int in 1..65535", splits=0)
    bad(r"splits: expected an int in 1..65535", splits=65536)
    bad(r"splits: expected an int in 1..65535", splits=True)
    bad(r"splits: expected an int in 1..65535", splits=2.0)
    bad(r"max_entries: expected a non-negative int", max_entries=-1)
    bad(r"max_entries: expected a non-negative int", max_entries=True)
    ws = zeros(3, 2, heads, dim + 2)
    bad(r"workspace: expected torch.float32 \[3, \*, 8, 130\], got torch.bfloat16", workspace=ws.bfloat16())
    bad(r"workspace: expected torch.float32 \[3, \*, 8, 130\], got torch.float32 \[3, 2, 8, 128\]",
        workspace=zeros(3, 2, heads, dim))
    bad(r"workspace: expected torch.float32 \[3, 3, 8, 130\], got torch.float32 \[3, 2, 8, 130\]", workspace=ws,
        splits=3)
    bad(r"workspace: must be contiguous", workspace=zeros(2, 3, heads, dim + 2).transpose(0, 1))
    bad(r"workspace: on meta", workspace=ws.to("meta"))
    bad(r"layout: expected a main-entry layout", layout=indexer_layout("fp8", dim))
    bad(r"window_pool: expected torch.uint8 \[\*, 4096\]", layout=main_layout("bf16", dim, 64))
    bad(r"layout: head_dim must be a power of two", layout=main_layout("fp8", 192, 64),
        q=zeros(3, heads, 192, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"plan: expected a StepPlan"):
        sparse_attention_paged(q, "plan", **good)


# --- GPU: V4-Flash and V4-Pro shapes ------------------------------------------------------------------------
CONTEXTS = [3000 + 137 * i for i in range(8)]  # a few thousand tokens per request
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gpu_case(preset, kv_format, kind, batch, seed=0):
    """Eight requests with CONTEXTS of history, then one step in a padded plan: a decode of 1 or 8 rows, or a
    256-row prefill chunk next to two decode rows. Returns the error against the reference."""
    geometry = ModelGeometry.preset(preset)
    want_kind = LayerKind.CSA if kind == "csa" else LayerKind.HCA
    layer = next(i for i, spec in enumerate(geometry.layers) if spec.kind is want_kind)
    cache = CacheManager(geometry, max_requests=8, max_tokens=sum(CONTEXTS) + 512, kv_format=kv_format,
                         indexer_format="fp8", page_tokens=256, device="cuda", poison=True)
    lc, layout = cache.pools.layers[layer], cache.spec.layers[layer].main
    window, ratio, heads, dim = geometry.window, geometry.layers[layer].ratio, geometry.num_heads, geometry.head_dim
    g = gen(seed)
    rids = [cache.admit() for _ in CONTEXTS]

    def feed(plan):
        """The step's kv, and its completed entries written (before attention, like compress-and-insert)."""
        writes = plan.entries[ratio]
        layout.write(lc.entries, 256 // ratio, writes.slots[:writes.count],
                     randn(writes.count, dim, g=g, dtype=torch.bfloat16, device="cuda"))
        return randn(plan.num_tokens, dim, g=g, dtype=torch.bfloat16, device="cuda")

    history = cache.plan_step(list(zip(rids, CONTEXTS)))
    append_window(lc.window, layout, window, history, feed(history))
    step = {"decode1": [(rids[0], 1)], "decode8": [(r, 1) for r in rids],
            "prefill256": [(rids[0], 1), (rids[3], 256), (rids[5], 1)]}[batch]  # a chunk between two decodes
    buffers = cache.step_buffers(max_tokens=264 if batch == "prefill256" else 16, max_requests=8)
    plan = cache.plan_step(step, buffers=buffers)
    kv = feed(plan)
    rows, n = plan.positions.shape[0], plan.num_tokens
    kw = dict(entry_pool=lc.entries, ratio=ratio, page_tokens=256)
    if kind == "csa":
        kw["picks"] = random_picks(plan, ratio, geometry.index_topk, g)
    q = randn(rows, heads, dim, g=g, dtype=torch.bfloat16, device="cuda")
    out = torch.full((rows, heads, dim), float("nan"), device="cuda")
    got = sparse_attention_paged(q, plan, sinks=sinks_of(q), scale=dim ** -0.5, layout=layout, window=window,
                                 window_pool=lc.window, step_kv=encode_step_kv(layout, rows, kv), out=out, **kw)
    want = reference(q, plan, layout, window, lc.window, kv, **kw)
    assert torch.isfinite(got).all()
    assert torch.equal(got[n:], torch.zeros_like(got[n:]))
    return rel_error(got[:n], want)


@needs_cuda
@pytest.mark.parametrize("batch", ["decode1", "decode8", "prefill256"])
@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("kv_format", ["fp8", "bf16"])
@pytest.mark.parametrize("preset", ["flash", "pro"])
def test_gpu_model_shapes(preset, kv_format, kind, batch):
    error = _gpu_case(preset, kv_format, kind, batch)
    print(f"{preset} {kv_format} {kind} {batch}: max error / row max = {error:.2e}")
    assert error < TOL


@needs_cuda
@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("kv_format", ["fp8", "bf16"])
@pytest.mark.parametrize("preset", ["flash", "pro"])
def test_gpu_decode_at_one_million_tokens(preset, kv_format, kind):
    """One request at ~2^20 tokens: HCA attends to its 8191 visible entries, CSA picks top-k of 262143. The
    history is written directly (every entry, the ring's last `window` positions), not prefilled."""
    geometry = ModelGeometry.preset(preset)
    context = min(geometry.max_position, 2**20) - 1
    want_kind = LayerKind.CSA if kind == "csa" else LayerKind.HCA
    layer = next(i for i, spec in enumerate(geometry.layers) if spec.kind is want_kind)
    cache = CacheManager(geometry, max_requests=2, max_tokens=context + 1, kv_format=kv_format, indexer_format="fp8",
                         page_tokens=256, device="cuda", poison=True)
    lc, layout = cache.pools.layers[layer], cache.spec.layers[layer].main
    window, ratio, heads, dim = geometry.window, geometry.layers[layer].ratio, geometry.num_heads, geometry.head_dim
    g = torch.Generator("cuda").manual_seed(1)
    rid = cache.admit()
    history = cache.plan_step([(rid, context)])
    writes = history.entries[ratio]
    layout.write(lc.entries, 256 // ratio, writes.slots[:writes.count],
                 torch.randn(writes.count, dim, generator=g, device="cuda"))
    last = torch.arange(context - window, context, device="cuda")
    layout.write(lc.window, window, cache.slot(rid) * window + last % window,
                 torch.randn(window, dim, generator=g, device="cuda"))
    plan = cache.plan_step([(rid, 1)], buffers=cache.step_buffers(max_tokens=4, max_requests=2))
    writes = plan.entries[ratio]
    layout.write(lc.entries, 256 // ratio, writes.slots[:writes.count],
                 torch.randn(writes.count, dim, generator=g, device="cuda"))
    kv = torch.randn(1, dim, generator=g, device="cuda")
    kw = dict(entry_pool=lc.entries, ratio=ratio, page_tokens=256)
    if kind == "csa":
        kw["picks"] = random_picks(plan, ratio, geometry.index_topk, gen(2))
    q = torch.randn(4, heads, dim, generator=g, device="cuda").to(torch.bfloat16)
    got = sparse_attention_paged(q, plan, sinks=sinks_of(q), scale=dim ** -0.5, layout=layout, window=window,
                                 window_pool=lc.window, step_kv=encode_step_kv(layout, 4, kv), **kw)
    want = reference(q, plan, layout, window, lc.window, kv, **kw)
    error = rel_error(got[:1], want)
    print(f"{preset} {kv_format} {kind} decode at {context + 1} tokens: max error / row max = {error:.2e}")
    assert error < TOL
    assert torch.equal(got[1:], torch.zeros_like(got[1:]))


def _flash_decode(kind, contexts, seed=0):
    """V4-Flash, fp8 cache: requests with `contexts` tokens of history (written directly: every entry, the ring's
    last `window` positions), then one decode row each (a plan of exactly that many rows, as a decode graph of that
    batch has). Returns (q, plan, kernel args, reference output)."""
    geometry = ModelGeometry.preset("flash")
    want_kind = LayerKind.CSA if kind == "csa" else LayerKind.HCA
    layer = next(i for i, spec in enumerate(geometry.layers) if spec.kind is want_kind)
    batch = len(contexts)
    cache = CacheManager(geometry, max_requests=batch, max_tokens=sum(contexts) + batch, kv_format="fp8",
                         indexer_format="fp8", page_tokens=256, device="cuda", poison=True)
    lc, layout = cache.pools.layers[layer], cache.spec.layers[layer].main
    window, ratio, heads, dim = geometry.window, geometry.layers[layer].ratio, geometry.num_heads, geometry.head_dim
    g = torch.Generator("cuda").manual_seed(seed)

    def write_entries(plan):
        writes = plan.entries[ratio]
        layout.write(lc.entries, 256 // ratio, writes.slots[:writes.count],
                     torch.randn(writes.count, dim, generator=g, device="cuda"))

    rids = [cache.admit() for _ in contexts]
    write_entries(cache.plan_step(list(zip(rids, contexts))))
    for rid, n in zip(rids, contexts):
        last = torch.arange(max(n - window, 0), n, device="cuda")
        layout.write(lc.window, window, cache.slot(rid) * window + last % window,
                     torch.randn(last.numel(), dim, generator=g, device="cuda"))
    plan = cache.plan_step([(r, 1) for r in rids], buffers=cache.step_buffers(max_tokens=batch, max_requests=batch))
    write_entries(plan)
    kv = torch.randn(batch, dim, generator=g, device="cuda")
    kw = dict(entry_pool=lc.entries, ratio=ratio, page_tokens=256)
    if kind == "csa":
        kw["picks"] = random_picks(plan, ratio, geometry.index_topk, gen(seed + 1))
    q = torch.randn(batch, heads, dim, generator=g, device="cuda").to(torch.bfloat16)
    want = reference(q, plan, layout, window, lc.window, kv, **kw)
    if kind == "hca":
        kw["max_entries"] = cache.max_seq_len // ratio  # as the layer would pass plan.max_seq_len // ratio
    args = dict(sinks=sinks_of(q), scale=dim ** -0.5, layout=layout, window=window, window_pool=lc.window,
                step_kv=encode_step_kv(layout, batch, kv), **kw)
    return q, plan, args, want


@needs_cuda
@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("splits", [1, None])
def test_gpu_flash_rope_in_attention(kind, splits):
    """V4-Flash decode at batch 8 (64-head, 8-warp programs with the logits' scratch rows), single pass and split:
    the inverse RoPE of the output (epilogue or merge) is bit for bit `rope_rows` of the fp32 output, and q's rope dims
    from `q_rope_dims` (q's own NaN) give the attention of the whole roped q, bit for bit. The interpreter ignores
    the kernel's compile without FMA contraction, so only a GPU checks the rounding of the rotation's products."""
    q, plan, args, _ = _flash_decode(kind, [5000 + 301 * i for i in range(8)])
    rope = ModelGeometry.preset("flash").layers[0].rope
    cos_sin = rope_cos_sin(rope, plan.positions)
    args["splits"] = splits
    fp32 = sparse_attention_paged(q, plan, **args)
    assert torch.equal(sparse_attention_paged(q, plan, inverse_rope=cos_sin, **args),
                       rope_rows(fp32, *cos_sin, inverse=True))
    roped = rope_rows(q, *cos_sin)
    dims = rope_rows(q, *cos_sin, out=torch.empty((*q.shape[:2], rope.dim), dtype=torch.bfloat16, device="cuda"))
    poisoned = q.clone()
    poisoned[..., -rope.dim:] = float("nan")
    assert torch.equal(sparse_attention_paged(poisoned, plan, q_rope_dims=dims, inverse_rope=cos_sin, **args),
                       sparse_attention_paged(roped, plan, inverse_rope=cos_sin, **args))


@needs_cuda
@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_split_decode_flash(monkeypatch, kind, batch):
    """V4-Flash decode: batch 1 (CSA: 512 picks at 2^17 tokens; HCA: 8191 entries at ~2^20) splits automatically,
    batch 64 (20K..26K tokens each) into 2 with 64-key blocks (`_config`). Forced split counts (1, 4, 33; at batch
    1 also 100, more than a CSA row's 20 key blocks) agree with the automatic choice and the reference."""
    contexts = [(2**20 - 1) if kind == "hca" else 2**17] if batch == 1 else [20000 + 97 * i for i in range(64)]
    q, plan, args, want = _flash_decode(kind, contexts)
    choose, seen = attention._config, []
    monkeypatch.setattr(attention, "_config", lambda *a: seen.append(choose(*a)) or seen[-1])
    auto = sparse_attention_paged(q, plan, **args)
    assert seen[-1].splits > 1 and (seen[-1].block_n == 64) == (batch == 64), seen[-1]
    errors = {f"auto ({seen[-1].splits})": rel_error(auto, want)}
    for splits in (1, 4, 33) + ((100,) if batch == 1 else ()):
        got = sparse_attention_paged(q, plan, splits=splits, **args)
        errors[splits] = rel_error(got, want)
        assert rel_error(got, auto) < TOL
    print(f"flash fp8 {kind} decode batch {batch}: " + ", ".join(f"{k} splits {e:.2e}" for k, e in errors.items()))
    assert torch.isfinite(auto).all() and max(errors.values()) < TOL


@needs_cuda
@pytest.mark.parametrize("splits,preallocated", [(None, False), (3, False), (3, True)],
                         ids=["auto", "split3", "split3-workspace"])
def test_gpu_cuda_graph_replays_over_new_plans(splits, preallocated):
    """Captured once with out=, replayed over plans rebuilt into the same StepBuffers with new q / step_kv / picks;
    the split path with its workspace allocated under capture (torch's graph pool) or given."""
    cache = CacheManager(TINY, max_requests=4, max_tokens=2000, kv_format="fp8", indexer_format="bf16",
                         page_tokens=PAGE, device="cuda", poison=True)
    layout, lc, ratio = cache.spec.layers[1].main, cache.pools.layers[1], 4
    rids = [cache.admit() for _ in range(3)]
    buffers = cache.step_buffers(max_tokens=32, max_requests=4)
    rows, heads, dim = 32, TINY.num_heads, TINY.head_dim
    g = gen(5)
    q = torch.zeros(rows, heads, dim, dtype=torch.bfloat16, device="cuda")
    picks = torch.full((rows, TINY.index_topk), -1, dtype=torch.int32, device="cuda")
    step_kv = torch.zeros(1, layout.page_bytes(rows), dtype=torch.uint8, device="cuda")
    out = torch.zeros(rows, heads, dim, device="cuda")
    args = dict(sinks=sinks_of(q), scale=dim ** -0.5, layout=layout, window=TINY.window, window_pool=lc.window,
                step_kv=step_kv, entry_pool=lc.entries, ratio=ratio, page_tokens=PAGE, picks=picks, out=out,
                splits=splits)
    if preallocated:
        args["workspace"] = torch.zeros(rows, splits, heads, dim + 2, device="cuda")
    graph = None
    for step in ([(0, 30)], [(0, 2), (1, 20), (2, 3)], [(0, 1), (1, 1), (2, 1)], [(2, 25), (1, 1)]):
        plan = cache.plan_step([(rids[i], n) for i, n in step], buffers=buffers)
        kv = randn(plan.num_tokens, dim, g=g, device="cuda")
        writes = plan.entries[ratio]
        entries = randn(writes.count, dim, g=g, device="cuda")
        layout.write(lc.entries, PAGE // ratio, writes.slots[:writes.count], entries)
        q.copy_(randn(rows, heads, dim, g=g, device="cuda"))
        picks.copy_(random_picks(plan, ratio, TINY.index_topk, g))
        step_kv.copy_(encode_step_kv(layout, rows, kv))
        if graph is None:
            sparse_attention_paged(q, plan, **args)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                sparse_attention_paged(q, plan, **args)
        out.fill_(float("nan"))
        graph.replay()
        want = reference(q, plan, layout, TINY.window, lc.window, kv, entry_pool=lc.entries, ratio=ratio,
                         page_tokens=PAGE, picks=picks)
        assert rel_error(out[:plan.num_tokens], want) < TOL
        assert torch.equal(out[plan.num_tokens:], torch.zeros_like(out[plan.num_tokens:]))
        append_window(lc.window, layout, TINY.window, plan, kv)
