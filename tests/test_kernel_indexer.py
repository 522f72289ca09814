"""Triton indexer scores (`kernels.indexer.indexer_scores_paged`) against the reference: `ops.indexer.indexer_scores`
over keys decoded by `layout.read`, masked to -inf past each row's visible count as `indexer_topk` does.

Small cases run under Triton's interpreter on the CPU (or on the GPU where there is one); the V4-Flash /
V4-Pro shaped cases need a CUDA device. q and the keys are bf16 values, so the MMA's products are exact and
only the fp32 summation order differs: scores must agree within ROW_TOL of the row's largest |score| and
within TERM_TOL of the size of their own terms (sum_h |w_h| sum_d |q_hd K_jd| / sqrt(D)).
"""


import pytest
import torch
from schedules import admit, random_steps

from dsv4kv import CacheManager, ModelGeometry
from dsv4kv.kernels import indexer as kernel_mod
from dsv4kv.kernels.common import interpreted
from dsv4kv.kernels.indexer import indexer_scores_paged
from dsv4kv.layout import indexer_layout, main_layout
from dsv4kv.ops.common import entry_slots, step_rows
from dsv4kv.ops.indexer import indexer_query, indexer_scores

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TINY = ModelGeometry.preset("tiny")  # index_n_heads 4, index_head_dim 64; layer 1: CSA m=4
PAGE = 128
M = TINY.layers[1].ratio
FORMATS = ("mxfp4", "fp8", "bf16")
# |kernel - reference| relative to the row's max |score| and to the score's own terms (measured: see report)
ROW_TOL, TERM_TOL = 1e-4, 2e-6  # row-max measure: 1.6e-5 seen on the H200 where a score nearly cancels


# --- helpers ----------------------------------------------------------------------------------------
def gen(seed, device="cpu"):
    return torch.Generator(device).manual_seed(seed)


def make_cache(geometry, indexer_format, *, page_tokens, **kw):
    cache = CacheManager(geometry, kv_format="bf16", indexer_format=indexer_format, page_tokens=page_tokens,
                         device=DEVICE, poison=True, **kw)
    layer = next(i for i, spec in enumerate(cache.spec.layers) if spec.index is not None)
    return cache, cache.spec.layers[layer].index, cache.pools.layers[layer].index_keys


def write_all_keys(cache, rid, layout, pool, keys, ratio, page_tokens):
    """Write keys[j] at entry j of request rid for every entry complete at its current length."""
    count = cache.length(rid) // ratio
    index = torch.arange(count, device=DEVICE)
    blocks = torch.tensor(cache.blocks(rid), device=DEVICE)[index * ratio // page_tokens]
    per_page = page_tokens // ratio
    layout.write(pool, per_page, blocks * per_page + index % per_page, keys[:count])


def make_query(layout, rows, heads, seed, padding_from=None):
    """Indexer queries in the keys' numerics and weights (* H^-0.5); rows >= padding_from are NaN."""
    g = gen(seed, DEVICE)
    q = indexer_query(torch.randn(rows, heads, layout.dim, generator=g, device=DEVICE).to(torch.bfloat16), layout)
    w = torch.randn(rows, heads, generator=g, device=DEVICE) * heads ** -0.5
    if padding_from is not None:
        q[padding_from:], w[padding_from:] = float("nan"), float("nan")
    return q, w


def reference(plan, pool, layout, q, w, entries, *, ratio, page_tokens):
    """-> (want, size) fp32 [R, entries]: the reference scores of every real row, -inf past visible and on
    padding rows; and the size of the terms they sum, sum_h |w_h| sum_d |q_hd K_jd| / sqrt(D) (0 where masked)."""
    rows = step_rows(plan)
    want = torch.full((q.shape[0], entries), float("-inf"), device=q.device)
    size = torch.zeros_like(want)
    for b, (lo, hi) in enumerate(zip(rows.host_query_start[:-1], rows.host_query_start[1:])):
        count = min(rows.host_seq_lens[b] // ratio, entries)
        if hi == lo or count == 0:
            continue
        index = torch.arange(count, device=q.device)
        slots = entry_slots(plan, rows, torch.full_like(index, b), index, ratio=ratio, page_tokens=page_tokens)
        keys = layout.read(pool, page_tokens // ratio, slots)
        visible = (rows.positions[lo:hi] + 1) // ratio
        for r0 in range(lo, hi, 64):  # bounded [rows, H, J] intermediates at V4 shapes
            r1 = min(hi, r0 + 64)
            hidden = index >= visible[r0 - lo:r1 - lo, None]
            scores = indexer_scores(q[r0:r1], w[r0:r1], keys)
            want[r0:r1, :count] = scores.masked_fill(hidden, float("-inf"))
            terms = indexer_scores(q[r0:r1].abs(), w[r0:r1].abs(), keys.abs())
            size[r0:r1, :count] = terms.masked_fill(hidden, 0.0)
    return want, size


def score_error(got, reference_and_size):
    """-> (error / row max, error / term size): max over visible scores of |got - want| relative to the row's
    largest |want|, and to the size of the score's own terms (what bounds an fp32 summation's error).
    -inf, NaN and finite positions must agree exactly."""
    want, size = reference_and_size
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "-inf (not visible) positions differ"
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN positions differ"
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    diff = torch.where(finite, (got - want).abs(), 0.0)
    row = torch.where(finite, want.abs(), 0.0).amax(1, keepdim=True)
    by_row = diff.div(row.clamp(min=1e-30)).max()
    by_terms = torch.where(finite & (diff > 0), diff / size, 0.0).max()
    return float(by_row), float(by_terms)


def assert_close_scores(got, reference_and_size):
    by_row, by_terms = score_error(got, reference_and_size)
    assert by_row <= ROW_TOL and by_terms <= TERM_TOL, (by_row, by_terms)


# --- interpreter-sized cases ------------------------------------------------------------------------------
@pytest.mark.parametrize("indexer_format", FORMATS)
def test_scores_over_random_chunked_schedule(indexer_format):
    """Three requests at odd lengths on interleaved blocks, fed in random chunks through padded persistent
    plans; NaN-poisoned pool, NaN q / weights on padding rows, NaN-prefilled out; widths J past every visible
    count (the default, 71) and below some (37)."""
    cache, layout, pool = make_cache(TINY, indexer_format, page_tokens=PAGE, max_requests=4, max_tokens=700)
    lengths = [171, 37, 96]
    rids = admit(cache, 3)
    buffers = cache.step_buffers(max_tokens=36, max_requests=4)  # at most 34 real rows
    g = gen(11)
    dim, heads = layout.dim, TINY.index_n_heads
    # per-key magnitudes over 2^-12 .. 2^12 exercise the scales
    bank = [(torch.randn(n // M, dim, generator=g) * 2.0 ** torch.randint(-12, 13, (n // M, 1), generator=g)
             ).to(DEVICE) for n in lengths]
    default_entries = cache.block_table.shape[1] * (PAGE // M)
    assert default_entries > max(lengths) // M
    worst = (0.0, 0.0)
    for k, step in enumerate(random_steps(12, lengths, (1, 5, 17, 29))):
        plan = cache.plan_step([(rids[i], n) for i, n in step], buffers=buffers)
        for i, _ in step:
            write_all_keys(cache, rids[i], layout, pool, bank[i], M, PAGE)
        rows = plan.positions.shape[0]
        q, w = make_query(layout, rows, heads, seed=100 + k, padding_from=plan.num_tokens)
        mode = k % 3
        if mode == 0:  # preallocated out, default width, every element must be written
            out = torch.full((rows, default_entries), float("nan"), device=DEVICE)
            got = indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, out=out)
            assert got.data_ptr() == out.data_ptr()
        elif mode == 1:  # an odd width past every visible count
            got = indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, max_entries=71)
        else:  # a width below some visible counts: scores are cut at J
            out = torch.full((rows, 37), float("nan"), device=DEVICE)
            got = indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, out=out)
        want = reference(plan, pool, layout, q, w, got.shape[1], ratio=M, page_tokens=PAGE)
        worst = tuple(map(max, worst, score_error(got, want)))
        assert torch.isneginf(got[plan.num_tokens:]).all()
    assert worst[0] <= ROW_TOL and worst[1] <= TERM_TOL, worst


@pytest.mark.parametrize("indexer_format", FORMATS)
def test_chunk_boundaries(indexer_format, monkeypatch):
    """Small tiles (BLOCK_J 16, 2 per program): visible(t) inside a tile, on a tile boundary, in a second chunk,
    and a J that is not a multiple of the tile."""
    monkeypatch.setattr(kernel_mod, "_config", lambda rows, entries, device: (16, 2, 4))
    cache, layout, pool = make_cache(TINY, indexer_format, page_tokens=PAGE, max_requests=4, max_tokens=500)
    rids = admit(cache, 3)
    cache.plan_step([(rids[0], 150), (rids[2], 31)])
    plan = cache.plan_step([(rids[0], 2), (rids[1], 70), (rids[2], 1)])
    g = gen(21)
    for rid in rids:
        write_all_keys(cache, rid, layout, pool, torch.randn(200, layout.dim, generator=g).to(DEVICE), M, PAGE)
    q, w = make_query(layout, plan.positions.shape[0], TINY.index_n_heads, seed=22)
    out = torch.full((plan.positions.shape[0], 45), float("nan"), device=DEVICE)
    indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, out=out)
    assert_close_scores(out, reference(plan, pool, layout, q, w, 45, ratio=M, page_tokens=PAGE))


@pytest.mark.parametrize("indexer_format", ["mxfp4", "fp8"])
def test_hand_written_key_bytes(indexer_format):
    """Every e2m1 / e4m3 code and extreme scales written straight into the pages: ue8m0 0x00 (2^-127) and
    0xFF (NaN), fp32 scales 2^-100 .. 2^40 and NaN. The error relative to each score's own terms checks tiny
    scales as closely as large ones; a key with a NaN scale scores NaN, and only in its own column."""
    cache, layout, pool = make_cache(TINY, indexer_format, page_tokens=PAGE, max_requests=2, max_tokens=256)
    rid = cache.admit()
    plan = cache.plan_step([(rid, 200)])
    per_page, count = PAGE // M, 200 // M
    g = gen(31)
    data_rows, scale_rows = layout.page_views(pool, per_page)
    slots = torch.tensor([cache.blocks(rid)[j * M // PAGE] * per_page + j % per_page for j in range(count)])
    page, off = slots // per_page, slots % per_page
    data = torch.randint(0, 256, (count, layout.data_bytes), generator=g, dtype=torch.uint8)
    if indexer_format == "mxfp4":
        codes = torch.tensor([0x00, 0x01, 0x40, 0x70, 0x7F, 0x85, 0xA0, 0xFF], dtype=torch.uint8)
        scales = codes[torch.randint(0, len(codes), (count, layout.scale_bytes), generator=g)]
        scales[3] = 0xFF  # NaN in every block
    else:
        if interpreted():  # the interpreter decodes e4m3 NaN bytes as +-480 (the GPU gives NaN): leave them out
            data = torch.where((data & 0x7F) == 0x7F, data ^ 1, data)
        else:
            data[5, 7] = 0x7F
        exps = torch.randint(-100, 41, (count,), generator=g).float()
        scales = (2.0 ** exps).view(torch.uint8).view(count, 4)
        scales[3] = torch.tensor([float("nan")]).view(torch.uint8)
    data_rows[page.to(DEVICE), off.to(DEVICE)] = data.to(DEVICE)
    scale_rows[page.to(DEVICE), off.to(DEVICE)] = scales.to(DEVICE)
    q, w = make_query(layout, plan.positions.shape[0], TINY.index_n_heads, seed=32)
    q = q * 2.0 ** 60  # still bf16 values; keeps the products of 2^-127-scaled keys normal fp32 numbers
    got = indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE)
    assert_close_scores(got, reference(plan, pool, layout, q, w, got.shape[1], ratio=M, page_tokens=PAGE))
    visible = (plan.positions.long() + 1) // M
    assert torch.isnan(got[:, 3]).sum() == (visible > 3).sum()  # the NaN-scale key, only where it is visible
    if indexer_format == "fp8" and not interpreted():
        assert torch.isnan(got[visible > 5, 5]).all()


@pytest.mark.parametrize("indexer_format", ["mxfp4", "fp8"])
def test_query_and_keys_are_bf16_values(indexer_format):
    """The claim behind exact MMA products: rotated + round-tripped queries and stored keys are bf16 values,
    over 60 binades of magnitudes."""
    layout = indexer_layout(indexer_format, 128)
    g = gen(41)
    x = torch.randn(4096, 128, generator=g) * 2.0 ** torch.randint(-30, 31, (4096, 1), generator=g)
    for values in (indexer_query(x.view(64, 64, 128), layout), layout.round_trip(x)):
        assert torch.equal(values.to(torch.bfloat16).float(), values)


def test_fp32_query_is_rounded_to_bf16():
    """A q that is not bf16-valued is rounded to bf16 (nearest even) before the dot: the scores equal the
    reference at the rounded q, and differ from the fp32 one by bf16 rounding of q."""
    cache, layout, pool = make_cache(TINY, "bf16", page_tokens=PAGE, max_requests=2, max_tokens=256)
    rid = cache.admit()
    plan = cache.plan_step([(rid, 203)])
    write_all_keys(cache, rid, layout, pool, torch.randn(64, layout.dim, generator=gen(51)).to(DEVICE), M, PAGE)
    g = gen(52, DEVICE)
    q = torch.randn(203, TINY.index_n_heads, layout.dim, generator=g, device=DEVICE)
    # exact ties (to even: down, up, down) and a value just past a tie, in a row that sees entries
    q[-1, 0, :4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -8 + 2 ** -20])
    w = torch.rand(203, TINY.index_n_heads, generator=g, device=DEVICE)
    got = indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE)
    rounded = q.to(torch.bfloat16).float()
    assert_close_scores(got, reference(plan, pool, layout, rounded, w, got.shape[1], ratio=M, page_tokens=PAGE))
    # against the fp32 q: off by the bf16 rounding of q, at most 2^-9 of each term
    _, by_terms = score_error(got, reference(plan, pool, layout, q, w, got.shape[1], ratio=M, page_tokens=PAGE))
    assert 1e-5 < by_terms <= 2 ** -9, by_terms


def test_rejects_bad_input():
    cache, layout, pool = make_cache(TINY, "mxfp4", page_tokens=PAGE, max_requests=2, max_tokens=256)
    buffers = cache.step_buffers(max_tokens=8, max_requests=2)
    plan = cache.plan_step([(cache.admit(), 5)], buffers=buffers)
    q, w = make_query(layout, 8, TINY.index_n_heads, seed=61)

    def run(q=q, w=w, pool=pool, layout=layout, **kw):
        return indexer_scores_paged(q, w, plan, pool, layout, **{"ratio": M, "page_tokens": PAGE, **kw})

    with pytest.raises(ValueError, match=r"q: expected torch.float32 \[8, \*, 64\], got torch.bfloat16"):
        run(q=q.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"q: expected torch.float32 \[8, \*, 64\], got torch.float32 \[5, 4, 64\]"):
        run(q=q[:5])  # the real rows only: kernels run over the padded rows
    with pytest.raises(ValueError, match=r"q: expected torch.float32 \[8, \*, 64\]"):
        run(q=q[:, :, :32])
    with pytest.raises(ValueError, match=r"q: must be contiguous"):
        run(q=q.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match=r"q: on meta"):
        run(q=q.to("meta"))
    with pytest.raises(ValueError, match=r"weights: expected torch.float32 \[8, 4\]"):
        run(w=w[:, :3])
    with pytest.raises(ValueError, match=r"weights: expected torch.float32"):
        run(w=w.double())
    with pytest.raises(ValueError, match=r"key_pool: expected torch.uint8 \[\*, 1088\]"):
        run(pool=pool[:, :-4])
    with pytest.raises(ValueError, match=r"key_pool: expected torch.uint8"):
        run(pool=pool.view(torch.int8))
    with pytest.raises(ValueError, match=r"key_pool: must be contiguous"):
        run(pool=pool.t().contiguous().t())
    with pytest.raises(ValueError, match=r"layout: the kernel needs a power-of-two dim"):
        run(layout=indexer_layout("bf16", 48))
    with pytest.raises(ValueError, match=r"layout: expected an indexer layout"):
        run(layout=main_layout("fp8", 128, 64))
    with pytest.raises(ValueError, match=r"plan: expected a StepPlan, got dict"):
        indexer_scores_paged(q, w, {"positions": plan.positions}, pool, layout, ratio=M, page_tokens=PAGE)
    with pytest.raises(ValueError, match=r"ratio: expected a positive int"):
        run(ratio=0)
    with pytest.raises(ValueError, match=r"page_tokens: expected a positive multiple of ratio 4"):
        run(page_tokens=130)
    with pytest.raises(ValueError, match=r"out: expected torch.float32 \[8, \*\]"):
        run(out=torch.empty(5, 40, device=DEVICE))
    with pytest.raises(ValueError, match=r"out: expected torch.float32"):
        run(out=torch.empty(8, 40, device=DEVICE, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"out: must be contiguous"):
        run(out=torch.empty(40, 8, device=DEVICE).t())
    with pytest.raises(ValueError, match=r"max_entries: 41 disagrees with out's 40 columns"):
        run(out=torch.empty(8, 40, device=DEVICE), max_entries=41)
    with pytest.raises(ValueError, match=r"max_entries: expected a non-negative int"):
        run(max_entries=-1)
    assert run(max_entries=0).shape == (8, 0)


# --- V4 shapes, on the GPU ------------------------------------------------------------------------------
V4_PAGE = 256


def v4_case(geometry_name, indexer_format, history, step, *, max_tokens, buffer_tokens, seed):
    """Requests of the named geometry with `history` tokens already planned (0 = fresh), then one step of
    (request number, new tokens) planned into persistent buffers; every complete entry holds a random key.
    -> (cache, layout, pool, plan, buffers, rids, heads)."""
    geometry = ModelGeometry.preset(geometry_name)
    assert 4 in geometry.ratios  # the CSA ratio
    cache, layout, pool = make_cache(geometry, indexer_format, page_tokens=V4_PAGE, max_requests=len(history) + 1,
                                     max_tokens=max_tokens, max_seq_len=1 << 18)
    rids = admit(cache, len(history))
    for rid, n in zip(rids, history):
        if n:
            cache.plan_step([(rid, n)])
    buffers = cache.step_buffers(max_tokens=buffer_tokens, max_requests=len(history) + 1)
    plan = cache.plan_step([(rids[i], n) for i, n in step], buffers=buffers)
    g = gen(seed, DEVICE)
    for rid in rids:
        keys = torch.randn(cache.length(rid) // 4 + 8, layout.dim, generator=g, device=DEVICE)
        write_all_keys(cache, rid, layout, pool, keys, 4, V4_PAGE)
    return cache, layout, pool, plan, buffers, rids, geometry.index_n_heads


@needs_cuda
@pytest.mark.parametrize("indexer_format", FORMATS)
def test_v4_decode_one_request_65536_entries(indexer_format):
    _, layout, pool, plan, _, _, heads = v4_case("flash", indexer_format, [262143], [(0, 1)],
                                                 max_tokens=262144 + 512, buffer_tokens=1, seed=1)
    assert (heads, layout.dim) == (64, 128) and int(plan.positions[0]) == 262143
    q, w = make_query(layout, 1, heads, seed=1)
    got = indexer_scores_paged(q, w, plan, pool, layout, ratio=4, page_tokens=V4_PAGE)
    assert got.shape == (1, 65536) and torch.isfinite(got).all()
    assert_close_scores(got, reference(plan, pool, layout, q, w, 65536, ratio=4, page_tokens=V4_PAGE))


@needs_cuda
@pytest.mark.parametrize("geometry_name", ["flash", "pro"])
@pytest.mark.parametrize("indexer_format", FORMATS)
def test_v4_decode_mixed_lengths_and_graph_replay(geometry_name, indexer_format):
    """Eight requests decoding at lengths 1 .. ~200K in a padded plan; then a CUDA graph captured over that
    plan replays the next decode step, planned into the same buffers, with new keys, q and weights."""
    history = [0, 2, 3, 128, 4097, 30001, 65535, 199998]
    step = [(i, 1) for i in range(8)]
    cache, layout, pool, plan, buffers, rids, heads = v4_case(geometry_name, indexer_format, history, step,
                                                              max_tokens=310_000, buffer_tokens=11, seed=2)
    entries = cache.block_table.shape[1] * V4_PAGE // 4
    q, w = make_query(layout, 11, heads, seed=2, padding_from=8)
    out = torch.full((11, entries), float("nan"), device=DEVICE)
    indexer_scores_paged(q, w, plan, pool, layout, ratio=4, page_tokens=V4_PAGE, out=out)
    assert_close_scores(out, reference(plan, pool, layout, q, w, entries, ratio=4, page_tokens=V4_PAGE))

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        indexer_scores_paged(q, w, plan, pool, layout, ratio=4, page_tokens=V4_PAGE, out=out)
    plan = cache.plan_step([(rids[i], n) for i, n in step], buffers=buffers)
    g = gen(3, DEVICE)
    for rid in rids:  # every key rewritten in place: the replay must read the pool as it is now
        write_all_keys(cache, rid, layout, pool, torch.randn(cache.length(rid) // 4 + 8, layout.dim, generator=g,
                                                             device=DEVICE), 4, V4_PAGE)
    q2, w2 = make_query(layout, 11, heads, seed=4, padding_from=8)
    q.copy_(q2)
    w.copy_(w2)
    out.fill_(float("nan"))
    graph.replay()
    assert_close_scores(out, reference(plan, pool, layout, q, w, entries, ratio=4, page_tokens=V4_PAGE))


@needs_cuda
@pytest.mark.parametrize("indexer_format", FORMATS)
def test_v4_prefill_512_rows(indexer_format):
    """A 512-token chunk at 20001 tokens of history beside a decode, in a padded plan."""
    cache, layout, pool, plan, _, _, heads = v4_case("flash", indexer_format, [20001, 700], [(0, 512), (1, 1)],
                                                     max_tokens=30_000, buffer_tokens=520, seed=5)
    q, w = make_query(layout, 520, heads, seed=5, padding_from=513)
    entries = cache.block_table.shape[1] * V4_PAGE // 4
    out = torch.full((520, entries), float("nan"), device=DEVICE)
    indexer_scores_paged(q, w, plan, pool, layout, ratio=4, page_tokens=V4_PAGE, out=out)
    assert_close_scores(out, reference(plan, pool, layout, q, w, entries, ratio=4, page_tokens=V4_PAGE))
