"""Triton indexer scores (`ops.indexer.kernel.indexer_scores_paged`) against the reference:
`ops.indexer.reference.indexer_scores`
over keys decoded by `layout.read`, masked to -inf past each row's visible count as `indexer_topk` does (the
kernel's `fill=True`; without it, the layer's default, columns past visible(t) are left unwritten and top-k never
picks them). Both kernels (row: decode; stacked: rows of a request share key tiles) are checked, each forced with
`stack_rows`, and against each other.

Small cases run under Triton's interpreter on the CPU (or on the GPU where there is one); the V4-Flash /
V4-Pro shaped cases need a CUDA device. q and the keys are bf16 values, so the MMA's products are exact and
only the fp32 summation order differs: scores must agree within ROW_TOL of the row's largest |score| and
within TERM_TOL of the size of their own terms (sum_h |w_h| sum_d |q_hd K_jd| / sqrt(D)). MXFP4 keys on the
per-key-scale FP8 path (the default on Hopper) are held to that path's stated tolerance on a GPU (KEY_SCALE_TOL,
`tolerance`); under the interpreter its sums are fp32 and the tight bounds hold but where key values are rounded.
"""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from schedules import admit, random_steps

from dsv4kv import CacheManager, ModelGeometry
from dsv4kv.cache import quant
from dsv4kv.ops.indexer import kernel as kernel_mod
from dsv4kv.ops.indexer import keys as keys_mod
from dsv4kv.ops.shared.common import hopper_or_later, interpreted
from dsv4kv.ops.shared.encode import e4m3_grid_code
from dsv4kv.ops.indexer.kernel import indexer_query_fp8, indexer_scores_paged
from dsv4kv.cache.layout import indexer_layout, main_layout
from dsv4kv.ops.shared.rows import entry_slots, step_rows
from dsv4kv.ops.indexer.reference import indexer_query, indexer_scores
from dsv4kv.ops.indexer.tuning import TUNING, Tiles, tuning_for

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TINY = ModelGeometry.preset("tiny")  # index_n_heads 4, index_head_dim 64; layer 1: CSA m=4
PAGE = 128
M = TINY.layers[1].ratio
FORMATS = ("mxfp4", "fp8", "bf16")
# |kernel - reference| relative to the row's max |score| and to the score's own terms (measured: see report)
ROW_TOL, TERM_TOL = 1e-4, 2e-6  # row-max measure: 1.6e-5 seen on the H200 where a score nearly cancels
# MXFP4 keys on the per-key-scale FP8 path (`IndexerTuning.fp8_key_scale`, the default) on a GPU: ops/indexer/
# kernel.py's tolerance, 2^-10 of the terms (the FP8 MMA's ~13-bit accumulation) and of the row's largest |score|.
# Under the interpreter that path's sums are fp32, and ROW_TOL / TERM_TOL hold (where no key value is rounded)
KEY_SCALE_TOL = 2.0 ** -10
# Stacked kernel tiles small enough that interpreter-sized cases cross every boundary: 4-row blocks, 16-entry tiles,
# 32-entry chunks, 16-column -inf stores (fill_elems // block_t)
SMALL_STACK = Tiles(block_t=4, block_j=16, max_iters=2, num_warps=4, num_stages=1)
SMALL_STACKED = dict(stacked=SMALL_STACK, fill_elems=64)
# Row kernel tiles of 16 entries, 2 a program (32-entry chunks) on any device (no fewer for a fuller grid)
SMALL_ROW = dict(row=Tiles(block_j=16, max_iters=2, num_warps=4, num_stages=1), grid_waves=0)


def tuned(**changes):
    """The device's config with `changes` (`dataclasses.replace`)."""
    return dataclasses.replace(tuning_for(DEVICE), **changes)


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


def entry_rows(cache, rid, layout, pool, count, page_tokens):
    """Where request rid's first `count` entries live: (data rows, scale rows, page index, row in page) for writing
    their bytes straight into the pool (`layout.page_views`)."""
    per_page = page_tokens // M
    data_rows, scale_rows = layout.page_views(pool, per_page)
    slots = torch.tensor([cache.blocks(rid)[j * M // page_tokens] * per_page + j % per_page for j in range(count)])
    return data_rows, scale_rows, (slots // per_page).to(DEVICE), (slots % per_page).to(DEVICE)


def skip_unless_fp8_path():
    """On a CUDA GPU before sm_90 the row kernel never takes the FP8 MMA path (`common.hopper_or_later`), so a test
    of that path has nothing to run there; `test_pre_hopper_gpus_take_the_plain_paths` checks that choice on the
    host."""
    if DEVICE.type == "cuda" and not hopper_or_later(DEVICE):
        pytest.skip("the FP8 MMA path is taken on sm_90 and later only")


def make_query(layout, rows, heads, seed, padding_from=None, host=False):
    """Indexer queries in the keys' numerics and weights (* H^-0.5); rows >= padding_from are NaN. host: drawn and
    quantized on the CPU, so every device gets the same values (a CUDA generator draws others)."""
    device = "cpu" if host else DEVICE
    g = gen(seed, device)
    q = indexer_query(torch.randn(rows, heads, layout.dim, generator=g, device=device).to(torch.bfloat16), layout)
    q, w = q.to(DEVICE), (torch.randn(rows, heads, generator=g, device=device) * heads ** -0.5).to(DEVICE)
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


def tolerance(key_scale=False):
    """(row, terms) tolerance of a case: KEY_SCALE_TOL where MXFP4 keys take the per-key-scale FP8 path on a GPU
    (key_scale: the case's keys are MXFP4 and its tuning leaves `fp8_key_scale` on), else ROW_TOL, TERM_TOL."""
    return (KEY_SCALE_TOL, KEY_SCALE_TOL) if key_scale and DEVICE.type == "cuda" else (ROW_TOL, TERM_TOL)


def assert_close_scores(got, reference_and_size, key_scale=False):
    by_row, by_terms = score_error(got, reference_and_size)
    row_tol, term_tol = tolerance(key_scale)
    assert by_row <= row_tol and by_terms <= term_tol, (by_row, by_terms)


def assert_paths_agree(got, other, reference_and_size, key_scale=False):
    """Two kernels' scores: the same -inf and NaN positions, and within TERM_TOL of each score's terms of each
    other (they differ only in fp32 summation order; key_scale: twice `tolerance`'s, each within it of the reference).
    -> the largest difference relative to the terms."""
    _, size = reference_and_size
    assert torch.equal(torch.isneginf(got), torch.isneginf(other)) and torch.equal(torch.isnan(got), torch.isnan(other))
    finite = torch.isfinite(got)
    diff = torch.where(finite, (got - other).abs(), 0.0)
    by_terms = float(torch.where(finite & (diff > 0), diff / size, 0.0).max()) if got.numel() else 0.0
    assert by_terms <= (2 * tolerance(True)[1] if key_scale else TERM_TOL), by_terms
    return by_terms


def nan_operand(q, scales=None):
    """An FP8 query operand (`q_fp8=`) of e4m3 NaN codes for q [R, H, D], with `scales` [R, H] (default 1): where a
    kernel reads it, its scores turn NaN on a GPU (the interpreter decodes the bytes as +-480: wrong, not NaN)."""
    return (torch.full(q.shape, 0x7F, dtype=torch.uint8, device=q.device),
            torch.ones(q.shape[:2], device=q.device) if scales is None else scales)


def count_calls(monkeypatch, name):
    """Under Triton's interpreter, a list that grows by one at each call of the jitted helper keys_mod.<name> (a
    path's observable trace there); on a GPU the helper is compiled in and the list stays empty."""
    calls = []
    if interpreted():
        helper = getattr(keys_mod, name)
        monkeypatch.setattr(keys_mod, name, lambda *a, **k: calls.append(1) or helper(*a, **k))
    return calls


class LaunchSpy:
    """Stands in for a jitted kernel and counts its launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def spy_kernels(monkeypatch):
    row = LaunchSpy(kernel_mod._indexer_scores_kernel)
    stacked = LaunchSpy(kernel_mod._indexer_scores_stacked_kernel)
    monkeypatch.setattr(kernel_mod, "_indexer_scores_kernel", row)
    monkeypatch.setattr(kernel_mod, "_indexer_scores_stacked_kernel", stacked)
    return row, stacked


# --- interpreter-sized cases ------------------------------------------------------------------------------
@pytest.mark.parametrize("indexer_format,fp8", [("mxfp4", True), ("mxfp4", False), ("fp8", True), ("bf16", True)],
                         ids=["mxfp4-fp8-path", "mxfp4-bf16-path", "fp8", "bf16"])
def test_scores_over_random_chunked_schedule(indexer_format, fp8):
    """Three requests at odd lengths on interleaved blocks, fed in random chunks through padded persistent
    plans; NaN-poisoned pool, NaN q / weights on padding rows, NaN-prefilled out; widths J past every visible
    count (the default, 71) and below some (37). MXFP4 keys on each path of the row kernel."""
    tuning = tuned(fp8_mma=fp8)
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
            got = indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, out=out, fill=True,
                                       tuning=tuning)
            assert got.data_ptr() == out.data_ptr()
        elif mode == 1:  # an odd width past every visible count
            got = indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, max_entries=71, fill=True,
                                       tuning=tuning)
        else:  # a width below some visible counts: scores are cut at J
            out = torch.full((rows, 37), float("nan"), device=DEVICE)
            got = indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, out=out, fill=True,
                                       tuning=tuning)
        want = reference(plan, pool, layout, q, w, got.shape[1], ratio=M, page_tokens=PAGE)
        worst = tuple(map(max, worst, score_error(got, want)))
        assert torch.isneginf(got[plan.num_tokens:]).all()
    row_tol, term_tol = tolerance(indexer_format == "mxfp4" and fp8)
    assert worst[0] <= row_tol and worst[1] <= term_tol, worst


@pytest.mark.parametrize("stack_rows", [False, True], ids=["row", "stacked"])
@pytest.mark.parametrize("indexer_format", FORMATS)
def test_chunk_boundaries(indexer_format, stack_rows):
    """Small tiles (BLOCK_J 16, 2 per program; stacked: 4-row blocks): visible(t) inside a tile, on a tile boundary,
    in a second chunk, and a J that is not a multiple of the tile."""
    tuning = tuned(**SMALL_ROW, **SMALL_STACKED)
    cache, layout, pool = make_cache(TINY, indexer_format, page_tokens=PAGE, max_requests=4, max_tokens=500)
    rids = admit(cache, 3)
    cache.plan_step([(rids[0], 150), (rids[2], 31)])
    plan = cache.plan_step([(rids[0], 2), (rids[1], 70), (rids[2], 1)])
    g = gen(21)
    for rid in rids:
        write_all_keys(cache, rid, layout, pool, torch.randn(200, layout.dim, generator=g).to(DEVICE), M, PAGE)
    q, w = make_query(layout, plan.positions.shape[0], TINY.index_n_heads, seed=22)
    out = torch.full((plan.positions.shape[0], 45), float("nan"), device=DEVICE)
    indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, out=out, stack_rows=stack_rows, fill=True,
                         tuning=tuning)
    assert_close_scores(out, reference(plan, pool, layout, q, w, 45, ratio=M, page_tokens=PAGE),
                        key_scale=indexer_format == "mxfp4")


@pytest.mark.parametrize("indexer_format", FORMATS)
def test_stacked_rows_over_random_chunked_schedule(indexer_format):
    """The stacked kernel, forced, with small tiles: four requests at odd lengths fed in random chunks of 3..23
    rows (not multiples of the 4-row block, so request boundaries fall inside blocks and several requests share
    one) through padded persistent plans; NaN-poisoned pool, NaN q / weights on padding rows, NaN-prefilled out,
    widths past every visible count (two 32-entry chunks, both with scores) and below some."""
    tuning = tuned(**SMALL_STACKED)
    cache, layout, pool = make_cache(TINY, indexer_format, page_tokens=PAGE, max_requests=5, max_tokens=600)
    lengths = [171, 45, 70, 19]
    rids = admit(cache, 4)
    buffers = cache.step_buffers(max_tokens=38, max_requests=5)  # at most 36 real rows: padding in every step
    g = gen(71)
    dim, heads = layout.dim, TINY.index_n_heads
    bank = [(torch.randn(n // M, dim, generator=g) * 2.0 ** torch.randint(-12, 13, (n // M, 1), generator=g)
             ).to(DEVICE) for n in lengths]
    worst = (0.0, 0.0)
    for k, step in enumerate(random_steps(82, lengths, (3, 7, 13, 23), cap=36)):  # 15 steps, up to 4 requests
        plan = cache.plan_step([(rids[i], n) for i, n in step], buffers=buffers)
        for i, _ in step:
            write_all_keys(cache, rids[i], layout, pool, bank[i], M, PAGE)
        rows = plan.positions.shape[0]
        q, w = make_query(layout, rows, heads, seed=200 + k, padding_from=plan.num_tokens)
        width = (45, 37)[k % 2]  # 45: past every visible count (42); 37: cuts some rows
        out = torch.full((rows, width), float("nan"), device=DEVICE)
        indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, out=out, stack_rows=True, fill=True,
                             tuning=tuning)
        worst = tuple(map(max, worst, score_error(out, reference(plan, pool, layout, q, w, width, ratio=M,
                                                                 page_tokens=PAGE))))
        assert torch.isneginf(out[plan.num_tokens:]).all()
    row_tol, term_tol = tolerance(indexer_format == "mxfp4")
    assert worst[0] <= row_tol and worst[1] <= term_tol, worst


def check_unfilled(got, filled, plan, ratio, poison):
    """fill=False against fill=True on the same inputs: the visible columns are the same bits; a column past a
    row's visible count holds -inf (inside the row's last score tile) or the poison it had (nothing wrote it);
    padding rows keep the poison whole. -> the visible counts [R]."""
    rows = plan.positions.shape[0]
    visible = torch.clamp((plan.positions.long() + 1) // ratio, min=0)
    visible[plan.num_tokens:] = 0
    cols = torch.arange(got.shape[1], device=got.device)
    seen = cols < visible[:, None]
    assert torch.equal(torch.where(seen, got, 0.0).view(torch.int32), torch.where(seen, filled, 0.0).view(torch.int32))
    past = got[~seen]
    assert (torch.isneginf(past) | (past.view(torch.int32) == poison.view(torch.int32))).all()
    assert (past.view(torch.int32) == poison.view(torch.int32)).any(), "no column past visible was left unwritten"
    assert (got[plan.num_tokens:rows].view(torch.int32) == poison.view(torch.int32)).all()
    return visible


@pytest.mark.parametrize("stack_rows", [False, True], ids=["row", "stacked"])
def test_unfilled_columns_are_never_picked(stack_rows):
    """Without the -inf fill (the layer's default), columns past a row's visible count keep whatever the buffer
    held (+inf here, which would win any top-k that read it); top-k over the visible counts picks exactly what it
    picks from the filled scores, and never a column at or past visible(t)."""
    from dsv4kv.ops.topk.kernel import topk_indices

    tuning = tuned(**SMALL_ROW, **SMALL_STACKED)
    cache, layout, pool = make_cache(TINY, "mxfp4", page_tokens=PAGE, max_requests=4, max_tokens=500)
    rids = admit(cache, 3)
    cache.plan_step([(rids[0], 150), (rids[1], 50), (rids[2], 31)])
    buffers = cache.step_buffers(max_tokens=16, max_requests=4)
    plan = cache.plan_step([(rids[0], 2), (rids[1], 9), (rids[2], 1)], buffers=buffers)  # 4 padding rows
    g = gen(23)
    for rid in rids:
        write_all_keys(cache, rid, layout, pool, torch.randn(200, layout.dim, generator=g).to(DEVICE), M, PAGE)
    rows = plan.positions.shape[0]
    q, w = make_query(layout, rows, TINY.index_n_heads, seed=24, padding_from=plan.num_tokens)
    poison = torch.tensor(float("inf"), device=DEVICE)
    filled = indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, max_entries=64,
                                  stack_rows=stack_rows, fill=True, tuning=tuning)
    got = torch.full((rows, 64), float("inf"), device=DEVICE)
    indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, out=got, stack_rows=stack_rows,
                         tuning=tuning)
    visible = check_unfilled(got, filled, plan, M, poison)
    lengths = visible.to(torch.int32)
    picks = topk_indices(got, lengths, 8)
    assert torch.equal(picks, topk_indices(filled, lengths, 8))
    assert ((picks < lengths[:, None]) | (picks == -1)).all() and (picks[plan.num_tokens:] == -1).all()
    assert (picks >= 0).sum(1).tolist() == torch.clamp(visible, max=8).tolist()


@pytest.mark.parametrize("scratch", [False, True], ids=["straight", "scratch"])
@pytest.mark.parametrize("indexer_format,fp8", [("mxfp4", True), ("mxfp4", False), ("fp8", True), ("bf16", True)],
                         ids=["mxfp4-fp8-path", "mxfp4-bf16-path", "fp8", "bf16"])
def test_row_kernel_counts_topk_first_digit(indexer_format, fp8, scratch):
    """`digit_counts`: each program adds the top-k's digit-1 counts of the scores it wrote (columns < visible(t)) to
    its row's histogram in the top-k workspace, two calls adding up; top-k with `first_digit_counted` then picks what
    it picks counting itself. Rows span several programs (32-entry chunks); padding rows count nothing; the columns
    past visible hold +inf (never written, never counted). The stacked kernel refuses the argument."""
    from dsv4kv.ops.topk import kernel as topk_mod
    from dsv4kv.ops.topk.tuning import tuning_for as topk_tuning_for
    from test_kernel_topk import first_digit_histograms

    tuning = tuned(**SMALL_ROW, fp8_mma=fp8, digit_count_scratch_above=0 if scratch else 1 << 30)
    split = dataclasses.replace(topk_tuning_for(DEVICE), row_max_cols=0, row_max_cols_many=0)
    cache, layout, pool = make_cache(TINY, indexer_format, page_tokens=PAGE, max_requests=4, max_tokens=700)
    rids = admit(cache, 3)
    cache.plan_step([(rids[0], 250), (rids[1], 50), (rids[2], 3)])
    buffers = cache.step_buffers(max_tokens=5, max_requests=4)
    plan = cache.plan_step([(rid, 1) for rid in rids], buffers=buffers)  # a decode step: 2 padding rows
    assert kernel_mod.counts_digits(plan, tuning)
    g = gen(31)
    for rid in rids:
        write_all_keys(cache, rid, layout, pool, torch.randn(200, layout.dim, generator=g).to(DEVICE), M, PAGE)
    rows, entries = plan.positions.shape[0], 80
    q, w = make_query(layout, rows, TINY.index_n_heads, seed=32, padding_from=plan.num_tokens)
    ws = topk_mod.topk_workspace(rows, entries, 8, DEVICE, tuning=split)
    counts = topk_mod.first_digit_counts(ws)
    got = torch.full((rows, entries), float("inf"), device=DEVICE)
    indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, out=got, digit_counts=counts,
                         tuning=tuning)
    visible = torch.clamp((plan.positions + 1) // M, min=0).to(torch.int32)
    assert visible.tolist() == [62, 12, 1, 0, 0]
    assert_close_scores(torch.where(torch.arange(entries, device=DEVICE) < visible[:, None], got, float("-inf")),
                        reference(plan, pool, layout, q, w, entries, ratio=M, page_tokens=PAGE),
                        key_scale=indexer_format == "mxfp4" and fp8)
    want = first_digit_histograms(got, visible)
    assert want.sum(1).tolist() == visible.tolist() and torch.equal(counts, want)
    indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, out=got, digit_counts=counts,
                         tuning=tuning)
    assert torch.equal(counts, 2 * want)  # added, not stored
    counts -= want
    picks = topk_mod.topk_indices(got, visible, 8, workspace=ws, first_digit_counted=True, tuning=split)
    assert torch.equal(picks, topk_mod.topk_indices(got, visible, 8, tuning=split)) and counts.eq(0).all()
    with pytest.raises(ValueError, match="stacked kernel"):
        indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, out=got, digit_counts=counts,
                             stack_rows=True, tuning=tuning)
    with pytest.raises(ValueError, match="digit_counts: expected torch.int32"):
        indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, out=got,
                             digit_counts=counts.float(), tuning=tuning)


def test_stacked_rows_in_any_order():
    """Rows of several requests interleaved inside blocks (a plan's rows are in request order, but the stacked
    kernel does not rely on it): row for row the reference's scores, and the row kernel's on the ordered plan."""
    tuning = tuned(**SMALL_STACKED)
    cache, layout, pool = make_cache(TINY, "mxfp4", page_tokens=PAGE, max_requests=4, max_tokens=500)
    rids = admit(cache, 3)
    cache.plan_step([(rids[0], 90), (rids[2], 33)])
    plan = cache.plan_step([(rids[0], 9), (rids[1], 70), (rids[2], 1)])
    g = gen(81)
    for rid in rids:
        write_all_keys(cache, rid, layout, pool, torch.randn(200, layout.dim, generator=g).to(DEVICE), M, PAGE)
    q, w = make_query(layout, plan.positions.shape[0], TINY.index_n_heads, seed=82)
    by_row = indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, max_entries=41,
                                  stack_rows=False, fill=True, tuning=tuning)
    want, size = reference(plan, pool, layout, q, w, 41, ratio=M, page_tokens=PAGE)
    perm = torch.randperm(plan.positions.shape[0], generator=gen(83)).to(DEVICE)
    shuffled = dataclasses.replace(plan, positions=plan.positions[perm].contiguous(),
                                   token_request=plan.token_request[perm].contiguous())
    got = indexer_scores_paged(q[perm].contiguous(), w[perm].contiguous(), shuffled, pool, layout, ratio=M,
                               page_tokens=PAGE, max_entries=41, stack_rows=True, fill=True, tuning=tuning)
    assert_close_scores(got, (want[perm], size[perm]), key_scale=True)
    assert_paths_agree(got, by_row[perm], (want[perm], size[perm]), key_scale=True)


def test_kernel_choice(monkeypatch):
    """Automatic choice from host facts: the row kernel for decode steps (and mixes averaging under two rows
    per request), the stacked one for prefill chunks; `stack_rows` overrides either way."""
    cache, layout, pool = make_cache(TINY, "mxfp4", page_tokens=PAGE, max_requests=8, max_tokens=600)
    rids = admit(cache, 6)
    for rid in rids:
        cache.plan_step([(rid, 41)])
    row, stacked = spy_kernels(monkeypatch)
    cases = [([(rid, 1) for rid in rids], None, "row"),  # decode: 6 rows, 6 requests
             ([(rids[0], 3)] + [(rid, 1) for rid in rids[1:]], None, "row"),  # 8 rows, 6 requests
             ([(rids[0], 9), (rids[1], 1), (rids[2], 2)], None, "stacked"),  # 12 rows, 3 requests
             ([(rids[3], 2)], None, "stacked"),
             ([(rids[4], 5)], False, "row"),
             ([(rids[5], 1)], True, "stacked")]
    for step, stack_rows, want in cases:
        plan = cache.plan_step(step)
        q, w = make_query(layout, plan.positions.shape[0], TINY.index_n_heads, seed=91)
        before = (row.launches, stacked.launches)
        indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, max_entries=16,
                             stack_rows=stack_rows, fill=True)
        ran = "row" if row.launches > before[0] else "stacked"
        assert ran == want and row.launches + stacked.launches == sum(before) + 1, (step, stack_rows)


@pytest.mark.parametrize("indexer_format,stack_rows,page_tokens", [
    ("mxfp4", False, PAGE), ("mxfp4", True, PAGE), ("fp8", False, PAGE), ("fp8", True, PAGE), ("mxfp4", False, 256)],
    ids=["mxfp4-row", "mxfp4-stacked", "fp8-row", "fp8-stacked", "mxfp4-row-tiles-within-pages"])
def test_hand_written_key_bytes(indexer_format, stack_rows, page_tokens):
    """Every e2m1 / e4m3 code and extreme scales written straight into the pages: ue8m0 0x00 (2^-127) and
    0xFF (NaN), fp32 scales 2^-100 .. 2^40 and NaN. The error relative to each score's own terms checks tiny
    scales as closely as large ones; a key with a NaN scale scores NaN, and only in its own column. Both
    kernels (they share the key decode); at 256-token pages the FP8 path addresses its tiles by page. MXFP4 keys on
    the exact per-block FP8 path (`fp8_key_scale=False`): these keys' blocks lie up to 255 binades apart, which the
    per-key path rounds (`test_key_scale_wide_block_spreads`)."""
    cache, layout, pool = make_cache(TINY, indexer_format, page_tokens=page_tokens, max_requests=2, max_tokens=256)
    rid = cache.admit()
    plan = cache.plan_step([(rid, 200)])
    count = 200 // M
    g = gen(31)
    data_rows, scale_rows, page, off = entry_rows(cache, rid, layout, pool, count, page_tokens)
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
    data_rows[page, off] = data.to(DEVICE)
    scale_rows[page, off] = scales.to(DEVICE)
    q, w = make_query(layout, plan.positions.shape[0], TINY.index_n_heads, seed=32)
    q = q * 2.0 ** 60  # still bf16 values; keeps the products of 2^-127-scaled keys normal fp32 numbers
    got = indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=page_tokens, stack_rows=stack_rows,
                               fill=True, tuning=tuned(fp8_key_scale=False))
    assert_close_scores(got, reference(plan, pool, layout, q, w, got.shape[1], ratio=M, page_tokens=page_tokens))
    visible = (plan.positions.long() + 1) // M
    assert torch.isnan(got[:, 3]).sum() == (visible > 3).sum()  # the NaN-scale key, only where it is visible
    if indexer_format == "fp8" and not interpreted():
        assert torch.isnan(got[visible > 5, 5]).all()


@pytest.mark.parametrize("fp8_path,key_scale", [(True, False), (True, True), (False, False)],
                         ids=["fp8-exact", "fp8-key-scale", "bf16"])
def test_large_key_scales_with_a_small_query(fp8_path, key_scale):
    """Random keys at ue8m0 codes 0xE0 .. 0xEC (block scales 2^97 .. 2^109) against a query of ~2^-100: scores of up
    to ~2^10, finite and the reference's on every path. The exact FP8 path's block sums are the reference's times
    2^-c (~2^8 / |q|), which bounds it (the edge in ops/indexer/kernel.py). Its worst case, keys of 6.0 and a query of
    6 * 2^-110 in every value (one block sums to 32 * 384 * 6 = 2^16.2 of its scale), is exact at code 0xED and
    overflows at 0xEE (2^111, D = 64), where the bf16 path, the per-key-scale path (its sums at the keys' own scale)
    and the reference stay finite."""
    if fp8_path:
        skip_unless_fp8_path()
    cache, layout, pool = make_cache(TINY, "mxfp4", page_tokens=PAGE, max_requests=2, max_tokens=256)
    rid = cache.admit()
    plan = cache.plan_step([(rid, 120)])
    count = 120 // M
    g = gen(33)
    data_rows, scale_rows, page, off = entry_rows(cache, rid, layout, pool, count, PAGE)
    q, w = make_query(layout, plan.positions.shape[0], TINY.index_n_heads, seed=34)
    tuning = tuned(fp8_mma=fp8_path, fp8_key_scale=key_scale)
    visible = torch.arange(count, device=DEVICE) < ((plan.positions.long() + 1) // M)[:, None]

    def run(data, codes, q_small):
        data_rows[page, off] = data.to(DEVICE)
        scale_rows[page, off] = codes.to(DEVICE)
        assert bool((indexer_query_fp8(q_small)[1] > 0).all())  # every row's query allows the FP8 path
        got = indexer_scores_paged(q_small, w, plan, pool, layout, ratio=M, page_tokens=PAGE, max_entries=count,
                                   stack_rows=False, fill=True, tuning=tuning)
        want = reference(plan, pool, layout, q_small, w, count, ratio=M, page_tokens=PAGE)
        assert torch.isfinite(want[0][visible]).all()
        return got, want

    got, want = run(torch.randint(0, 256, (count, layout.data_bytes), generator=g, dtype=torch.uint8),
                    torch.randint(0xE0, 0xED, (count, layout.scale_bytes), generator=g, dtype=torch.uint8),
                    q * 2.0 ** -100)
    assert want[0][visible].abs().max() > 2.0 ** 6
    assert_close_scores(got, want, key_scale)
    sixes = torch.full((count, layout.data_bytes), 0x77, dtype=torch.uint8)
    q_sixes = torch.full_like(q, 6.0 * 2.0 ** -110)
    for code in (0xED, 0xEE):
        got, want = run(sixes, torch.full((count, layout.scale_bytes), code, dtype=torch.uint8), q_sixes)
        if fp8_path and not key_scale and code == 0xEE:  # each head's sum overflows to +inf; signed weights make NaN
            assert not torch.isfinite(got[visible]).any()
        else:
            assert_close_scores(got, want, key_scale)


@triton.jit
def _e4m3_of_bytes(byte_ptr, lo_ptr, hi_ptr, ASM: tl.constexpr):
    o = tl.arange(0, 256)
    lo, hi = keys_mod._e2m1_e4m3(tl.load(byte_ptr + o), ASM)
    tl.store(lo_ptr + o, lo)
    tl.store(hi_ptr + o, hi)


@triton.jit
def _bf16_of_bytes(byte_ptr, code_ptr, lo_ptr, hi_ptr, CODES: tl.constexpr):
    """Every byte (columns) under every scale code (rows) through `_e2m1_bf16`, as bf16 bits."""
    o_c, o_b = tl.arange(0, CODES), tl.arange(0, 256)
    scale = keys_mod._ue8m0_bf16(tl.load(code_ptr + o_c))[:, None]
    byte = tl.broadcast_to(tl.load(byte_ptr + o_b)[None, :], (CODES, 256))
    lo, hi = keys_mod._e2m1_bf16(byte, tl.broadcast_to(scale, (CODES, 256)))
    offs = o_c[:, None] * 256 + o_b[None, :]
    tl.store(lo_ptr + offs, lo.to(tl.int16, bitcast=True))
    tl.store(hi_ptr + offs, hi.to(tl.int16, bitcast=True))


@needs_cuda
def test_e2m1_bf16_every_byte_and_scale():
    """The bf16 path's decode by bit moves (`_e2m1_bf16`, inline PTX: GPU only) equals the fp32 decode
    (`_e2m1_pair` times `_ue8m0`, as the reference and the interpreter decode) rounded to bf16, for all 256 bytes
    under scale codes 0 (2^-127: subnormal products), 1, 100, 127, 200, 253, 254 (6 * 2^127 overflows to inf in both)
    and 255 (NaN): bit for bit, NaN as NaN."""
    codes = torch.tensor([0, 1, 100, 127, 200, 253, 254, 255, 127, 127, 127, 127, 127, 127, 127, 127],
                         dtype=torch.int32, device=DEVICE)
    byte = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    lo = torch.empty(16, 256, dtype=torch.int16, device=DEVICE)
    hi = torch.empty_like(lo)
    _bf16_of_bytes[(1,)](byte, codes, lo, hi, CODES=16)
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    scale = torch.where(codes.cpu() == 0, 2.0 ** -127, torch.where(codes.cpu() == 255, float("nan"),
                                                                   2.0 ** (codes.cpu().double() - 127).float()))
    for got, nibble in ((lo, byte.cpu().long() & 15), (hi, byte.cpu().long() >> 4)):
        want = (e2m1[nibble][None, :] * scale[:, None]).to(torch.bfloat16)
        got = got.cpu().view(torch.bfloat16)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        finite = ~torch.isnan(want)
        assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
    assert torch.isinf(lo.cpu().view(torch.bfloat16)[6, 7]) and lo.cpu().view(torch.bfloat16)[0, 1] == 2.0 ** -128


@triton.jit
def _grid_codes(x_ptr, code_ptr):
    o = tl.arange(0, 256)
    tl.store(code_ptr + o, e4m3_grid_code(tl.load(x_ptr + o)))


def test_e4m3_grid_code_every_code():
    """`e4m3_grid_code` (bit moves, no cast) gives back every finite float8_e4m3fn code from its value, -0 included."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = (codes & 0x7F) != 0x7F
    values = codes.view(torch.float8_e4m3fn).float().to(DEVICE)
    got = torch.empty(256, dtype=torch.int32, device=DEVICE)
    _grid_codes[(1,)](values, got)
    assert torch.equal(got.cpu()[finite], codes[finite].int())


def test_fp8_query_check():
    """`indexer_query_fp8`'s verdict per head: MXFP4 heads (any magnitude, zeros included) get 2^c and e4m3 codes of
    q * 2^-c exactly; a head with more significant bits (FP8 numerics), values beyond e4m3's range below the head's
    largest, or a NaN gets 0, and its row takes the bf16 path."""
    heads, dim = 16, 64
    mx, fp8 = indexer_layout("mxfp4", dim), indexer_layout("fp8", dim)
    raw = torch.randn(8, heads, dim, generator=gen(81)).to(torch.bfloat16)
    rows = [indexer_query(raw[0:1], mx), indexer_query(raw[1:2], mx) * 2.0 ** 100, torch.zeros(1, heads, dim),
            indexer_query(raw[2:3] * 2.0 ** -90, mx), indexer_query(raw[3:4], fp8)]
    spread = raw[4:5].float().clone()
    spread[:, 0] *= 2.0 ** 10  # heads 2^20 apart: each head has its own shift, so this row passes
    spread[:, 1] *= 2.0 ** -10
    rows.append(indexer_query(spread.to(torch.bfloat16), mx))
    spread = indexer_query(raw[6:7], mx)
    spread[:, 2, 32:] *= 2.0 ** -22  # a block ~2^-24 below its head's largest: past e4m3's ~2^-17 (still MXFP4)
    rows.append(spread)
    nan = indexer_query(raw[5:6], mx)
    nan[0, 3, 7] = float("nan")
    rows.append(nan)
    wide = indexer_query(raw[7:8], mx)
    wide[:, 4, :32] *= 2.0 ** 100
    wide[:, 4, 32:] *= 2.0 ** -60  # under the head's shift these values underflow fp32 to 0: not exact
    rows.append(wide)
    q = torch.cat(rows).contiguous().to(DEVICE)
    codes, scales = indexer_query_fp8(q)
    exact = scales > 0
    assert exact.all(dim=1).tolist() == [True, True, True, True, False, True, False, False, False]
    assert exact[8].tolist() == [h != 4 for h in range(heads)]
    assert exact[4].sum() == 0 and exact[6].tolist() == [h != 2 for h in range(heads)]
    assert exact[7].tolist() == [h != 3 for h in range(heads)]
    decoded = codes.cpu().view(torch.float8_e4m3fn).float() * scales.cpu()[:, :, None]
    assert torch.equal(decoded[exact.cpu()], q.cpu().float()[exact.cpu()])
    bf16_codes, bf16_scales = indexer_query_fp8(q.to(torch.bfloat16))  # MXFP4 values are bf16 values
    assert torch.equal(bf16_codes, codes) and torch.equal(bf16_scales, scales)


def test_pre_hopper_gpus_take_the_plain_paths(monkeypatch):
    """On a GPU older than sm_90 (faked through the device properties' cache) neither the row kernel nor the stacked
    kernel takes its FP8 path and kernels launch without PDL; on sm_90 all are on, unless `dependent_launch(False)`.
    Host decisions only: nothing runs on the fake device."""
    from dsv4kv.ops.shared import common, launch

    cuda = torch.device("cuda", 0)
    for major, hopper in ((8, False), (9, True), (10, True)):
        monkeypatch.setattr(common, "_properties", lambda index, major=major: (132, major))
        assert common.hopper_or_later(cuda) is hopper and common.sm_count(cuda) == 132
        tuning = TUNING["sm90"]
        assert kernel_mod._row_takes_fp8(keys_mod.KEYS_MXFP4, 128, cuda, tuning) is hopper
        assert kernel_mod._stack_takes_fp8(keys_mod.KEYS_MXFP4, 128, cuda, tuning) is hopper
        assert bool(launch.launch_options(cuda)) is hopper
        with launch.dependent_launch(False):
            assert launch.launch_options(cuda) == {}


def test_fp8_query_wanted():
    """`fp8_query_wanted` (whether a caller should make q's FP8 operand) follows the wrapper's own choice: decode
    rows with MXFP4 keys take the row kernel's FP8 path, a prefill step the stacked kernel's; FP8 keys, an empty score
    row or the FP8 paths turned off (`IndexerTuning.fp8_mma`) do not. The wrapper reads the
    operand exactly then: a poisoned one (e4m3 NaN codes) turns the scores NaN where it is wanted and changes
    nothing where it is not."""
    skip_unless_fp8_path()
    cache, layout, pool = make_cache(TINY, "mxfp4", page_tokens=PAGE, max_requests=2, max_tokens=256)
    rid = cache.admit()
    prefill = cache.plan_step([(rid, 150)])
    write_all_keys(cache, rid, layout, pool, torch.randn(40, layout.dim, generator=gen(65)).to(DEVICE), M, PAGE)
    decode = cache.plan_step([(rid, 1)])
    off = tuned(fp8_mma=False)
    assert kernel_mod.fp8_query_wanted(prefill, layout, 48)
    assert not kernel_mod.fp8_query_wanted(prefill, layout, 48, off)
    q_pre, w_pre = make_query(layout, 150, TINY.index_n_heads, seed=67)
    pre_poisoned = nan_operand(q_pre)
    plain = indexer_scores_paged(q_pre, w_pre, prefill, pool, layout, ratio=M, page_tokens=PAGE, fill=True,
                                 tuning=off)
    assert torch.equal(indexer_scores_paged(q_pre, w_pre, prefill, pool, layout, ratio=M, page_tokens=PAGE, fill=True,
                                            q_fp8=pre_poisoned, tuning=off), plain)
    read = indexer_scores_paged(q_pre, w_pre, prefill, pool, layout, ratio=M, page_tokens=PAGE, fill=True,
                                q_fp8=pre_poisoned)
    seen = torch.arange(read.shape[1], device=DEVICE) < (prefill.positions[:, None] + 1) // M
    if interpreted():
        assert not torch.equal(read, plain)
    else:
        assert torch.isnan(read[seen]).all()
    assert kernel_mod.fp8_query_wanted(decode, layout, 48)
    assert not kernel_mod.fp8_query_wanted(decode, indexer_layout("fp8", layout.dim), 48)
    assert not kernel_mod.fp8_query_wanted(decode, layout, 0)
    q, w = make_query(layout, 1, TINY.index_n_heads, seed=66)
    poisoned = nan_operand(q)
    visible = (int(decode.positions[0]) + 1) // M
    read = indexer_scores_paged(q, w, decode, pool, layout, ratio=M, page_tokens=PAGE, fill=True, q_fp8=poisoned)
    if interpreted():  # the interpreter decodes an e4m3 NaN byte as +-480 (ops/indexer/kernel.py): wrong, not NaN
        assert not torch.equal(read, indexer_scores_paged(q, w, decode, pool, layout, ratio=M, page_tokens=PAGE,
                                                          fill=True))
    else:
        assert torch.isnan(read[0, :visible]).all()
    assert not kernel_mod.fp8_query_wanted(decode, layout, 48, off)
    want = indexer_scores_paged(q, w, decode, pool, layout, ratio=M, page_tokens=PAGE, fill=True, tuning=off)
    got = indexer_scores_paged(q, w, decode, pool, layout, ratio=M, page_tokens=PAGE, fill=True, q_fp8=poisoned,
                               tuning=off)
    assert torch.equal(got, want)


def test_e2m1_to_e4m3_every_byte():
    """Every packed MXFP4 byte -> its two nibbles as e4m3 bytes of value * 2^-6, bit for bit (signed zeros too): the
    plain form, which the interpreter runs."""
    check_e2m1_to_e4m3(asm=False)


@needs_cuda
def test_e2m1_to_e4m3_every_byte_inline_ptx():
    """The same for the inline-PTX form the GPU runs (Triton's interpreter runs no PTX)."""
    check_e2m1_to_e4m3(asm=True)


def check_e2m1_to_e4m3(asm):
    byte = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    lo, hi = torch.empty_like(byte), torch.empty_like(byte)
    _e4m3_of_bytes[(1,)](byte, lo, hi, ASM=asm)
    for got, code in ((lo, byte & 15), (hi, byte >> 4)):
        want = quant.e2m1_decode(code.cpu()) * 2.0 ** -6
        assert torch.equal(got.cpu().view(torch.float8_e4m3fn).float(), want)
        assert torch.equal(got.cpu() >> 7, (code.cpu() >> 3))  # the sign bit, -0.0 included


@pytest.mark.parametrize("dim,block_j,page", [(64, 32, 256), (128, 64, 256), (64, 32, 384)],
                         ids=["D64-two-tiles-a-page", "D128-one-tile-a-page", "D64-chunks-from-mid-page"])
def test_fp8_path_tiles_within_pages(dim, block_j, page):
    """Where a page holds whole tiles the FP8 path addresses each tile from its page and reads its block id and scale
    words a tile ahead (`IndexerTuning.page_tiles`; 16-bit scale words at D = 64, 32-bit at 128). Three requests at odd
    lengths decode and prefill in small steps, each program's tiles crossing page boundaries (from mid-page with
    96-entry pages): the scores equal those of the per-entry addressing bit for bit, and the reference's within
    tolerance. A page unallocated mid-row (block id -1) scores 0 on both, and leaves every other score as it was."""
    skip_unless_fp8_path()
    geometry = dataclasses.replace(TINY, index_head_dim=dim)
    per_page = page // M  # 64 or 96 entries
    # chunks of 128 entries on the GPU too (no fewer tiles per program for a fuller grid): a program's tiles cross
    # a page boundary, and with 96-entry pages chunks start mid-page
    row = dataclasses.replace(tuning_for(DEVICE).row, block_j=block_j, max_iters=128 // block_j)
    tuning = tuned(grid_waves=0, row=row)
    cache, layout, pool = make_cache(geometry, "mxfp4", page_tokens=page, max_requests=4, max_tokens=2400)
    rids = admit(cache, 3)
    g = gen(71)
    for rid, n in zip(rids, (1017, 298, 700)):
        cache.plan_step([(rid, n)])
    bank = [torch.randn(1040 // M, dim, generator=g) * 2.0 ** torch.randint(-12, 13, (1040 // M, 1), generator=g)
            for _ in rids]
    heads, entries = geometry.index_n_heads, 270

    def scores(plan, q, w, tiles):
        return indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=page, max_entries=entries,
                                    stack_rows=False, fill=True, tuning=dataclasses.replace(tuning, page_tiles=tiles))

    for k, step in enumerate([[(0, 3), (1, 1), (2, 2)], [(0, 1), (2, 5)], [(0, 2), (1, 4)]]):
        plan = cache.plan_step([(rids[i], n) for i, n in step])
        for rid, keys in zip(rids, bank):
            write_all_keys(cache, rid, layout, pool, keys.to(DEVICE), M, page)
        q, w = make_query(layout, plan.positions.shape[0], heads, seed=200 + k)
        assert bool((indexer_query_fp8(q)[1] > 0).all())  # every row takes the FP8 path
        got = scores(plan, q, w, True)
        assert torch.equal(got, scores(plan, q, w, False))
        assert_close_scores(got, reference(plan, pool, layout, q, w, entries, ratio=M, page_tokens=page),
                            key_scale=True)
    # request 0 (the first row's) with its second page unallocated: its visible entries score 0, the rest as before
    slot = int(plan.request_slots[plan.token_request[0]])
    kept = plan.block_table[slot, 1].item()
    plan.block_table[slot, 1] = -1
    hole = scores(plan, q, w, True)
    assert torch.equal(hole, scores(plan, q, w, False))
    page_cols = torch.zeros_like(got, dtype=torch.bool)
    page_cols[plan.token_request == plan.token_request[0], per_page:2 * per_page] = True
    in_hole = page_cols & torch.isfinite(got)
    assert in_hole.sum() >= per_page and torch.equal(hole[in_hole], torch.zeros_like(hole[in_hole]))
    assert torch.equal(hole[~in_hole], got[~in_hole])
    plan.block_table[slot, 1] = kept


@pytest.mark.parametrize("key_scale", [False, True], ids=["exact", "key-scale"])
def test_stacked_kernel_fp8_segments_and_fallback(monkeypatch, key_scale):
    """The stacked kernel's FP8 path (`IndexerTuning.fp8_mma`) over three requests prefilling and decoding at odd
    lengths, blocks of 4 rows holding two requests' segments, each (row, head) of q at its own power of two (so each has
    its own shift 2^c): the scores equal the bf16 path's bit for bit on the exact path (MXFP4 dot products sum exactly
    in fp32 at these sizes), within the per-key path's tolerance on that path, and the reference's within tolerance.
    A request whose query has a head beyond the FP8 check (a block 2^-22 below its head's largest) takes the bf16 path
    for its segments while the others stay on FP8 MMAs. Which path ran is
    observed on every device: given an operand of e4m3 NaN codes, the FP8 segments score NaN (the interpreter decodes
    those bytes as +-480: wrong, not NaN) and the bf16 ones the reference's scores."""
    skip_unless_fp8_path()
    tuning = tuned(**SMALL_STACKED, stacked_fp8=SMALL_STACK, stacked_key_scale=SMALL_STACK, fp8_key_scale=key_scale)
    cache, layout, pool = make_cache(TINY, "mxfp4", page_tokens=PAGE, max_requests=4, max_tokens=1200)
    rids = admit(cache, 3)
    g = gen(97)
    for rid, n in zip(rids, (301, 97, 250)):
        cache.plan_step([(rid, n)])
    bank = [torch.randn(320 // M, layout.dim, generator=g) * 2.0 ** torch.randint(-8, 9, (320 // M, 1), generator=g)
            for _ in rids]
    calls = count_calls(monkeypatch, "_shifted_block" if key_scale else "_mxfp4_block_mma")

    def scores(plan, q, w, fp8, q_fp8=None):
        return indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, max_entries=80,
                                    stack_rows=True, fill=True, q_fp8=q_fp8,
                                    tuning=dataclasses.replace(tuning, fp8_mma=fp8))

    plan = cache.plan_step([(rids[0], 3), (rids[1], 6), (rids[2], 2)])
    for rid, keys in zip(rids, bank):
        write_all_keys(cache, rid, layout, pool, keys.to(DEVICE), M, PAGE)
    q, w = make_query(layout, plan.positions.shape[0], TINY.index_n_heads, seed=98)
    q = q * 2.0 ** torch.randint(-20, 21, q.shape[:2], generator=gen(99)).to(DEVICE)[:, :, None]
    got = scores(plan, q, w, True)
    assert not interpreted() or len(calls) > 0
    want = reference(plan, pool, layout, q, w, 80, ratio=M, page_tokens=PAGE)
    assert_close_scores(got, want, key_scale)
    if key_scale:
        assert_paths_agree(got, scores(plan, q, w, False), want, key_scale=True)
    else:
        assert torch.equal(got, scores(plan, q, w, False))

    odd = q.clone()
    failing = plan.token_request == plan.token_request[3]  # the second request's rows
    odd[failing, 1, 32:] *= 2.0 ** -22
    _, scales = indexer_query_fp8(odd)
    assert bool((scales[failing] == 0).any(dim=1).all()) and bool((scales[~failing] > 0).all())
    want = reference(plan, pool, layout, odd, w, 80, ratio=M, page_tokens=PAGE)
    got = scores(plan, odd, w, True)
    assert_close_scores(got, want, key_scale)
    poisoned = scores(plan, odd, w, True, nan_operand(odd, scales))
    assert torch.equal(poisoned[failing], got[failing])  # bf16 segments: the operand is never read
    seen = torch.isfinite(want[0]) & ~failing[:, None]
    if interpreted():
        assert not torch.equal(poisoned[seen], got[seen])
    else:
        assert bool(torch.isnan(poisoned[seen]).all())


@pytest.mark.parametrize("key_scale", [False, True], ids=["exact", "key-scale"])
def test_fp8_mma_path_and_its_fallback(monkeypatch, key_scale):
    """MXFP4 keys take the FP8 MMA path (exact per block, or one scale per key) when every head of the row's query
    passes `fp8_query_operand`'s check, and the bf16 path when one does not (two blocks of a head 2^22 apart): both
    give the reference's scores. Under the interpreter the path is observed by counting calls of the per-block MMA or
    the per-key decode; on the GPU through the check's verdict."""
    cache, layout, pool = make_cache(TINY, "mxfp4", page_tokens=PAGE, max_requests=2, max_tokens=256)
    rid = cache.admit()
    plan = cache.plan_step([(rid, 150)])
    write_all_keys(cache, rid, layout, pool, torch.randn(40, layout.dim, generator=gen(61)).to(DEVICE), M, PAGE)
    calls = count_calls(monkeypatch, "_shifted_block" if key_scale else "_mxfp4_block_mma")
    q, w = make_query(layout, 150, TINY.index_n_heads, seed=62)
    for tiny_head, path_calls in ((False, lambda n: n > 0), (True, lambda n: n == 0)):
        calls.clear()
        if tiny_head:
            q = q.clone()
            q[:, 1, 32:] *= 2.0 ** -22  # a block 2^-22 and more below its head's largest: beyond e4m3's 2^-17
        assert bool((indexer_query_fp8(q)[1] > 0).all(dim=1).all()) != tiny_head
        got = indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, stack_rows=False, fill=True,
                                   tuning=tuned(fp8_key_scale=key_scale))
        assert_close_scores(got, reference(plan, pool, layout, q, w, got.shape[1], ratio=M, page_tokens=PAGE),
                            key_scale)
        if interpreted():
            assert path_calls(len(calls)), (tiny_head, len(calls))


@pytest.mark.parametrize("fp8_path,key_scale", [(True, False), (True, True), (False, False)],
                         ids=["fp8-exact", "fp8-key-scale", "bf16"])
def test_a_block_sum_of_13_significant_bits_is_exact(fp8_path, key_scale):
    """The FP8 paths rest on a scale block's 32 products summing within the ~14 significant bits of Hopper's FP8
    accumulation. The worst case, 31 products of 6 x 6 and one of 0.5 x 0.5 = 1116.25 (13 bits, from 2^10 to 2^-2),
    must come out exact on every path: every score is 1116.25 * D^-0.5, bit for bit."""
    cache, layout, pool = make_cache(TINY, "mxfp4", page_tokens=PAGE, max_requests=2, max_tokens=256)
    rid = cache.admit()
    plan = cache.plan_step([(rid, 200)])
    count = 200 // M
    data_rows, scale_rows, blocks, offsets = entry_rows(cache, rid, layout, pool, count, PAGE)
    data = torch.zeros(count, layout.data_bytes, dtype=torch.uint8, device=DEVICE)
    data[:, :16] = 0x77  # scale block 0: every value e2m1 code 7 = 6.0 ...
    data[:, 0] = 0x71  # ... but dim 0 (the low nibble of byte 0): code 1 = 0.5; block 1 stays zero
    data_rows[blocks, offsets] = data
    scale_rows[blocks, offsets] = 127  # ue8m0 2^0
    q = torch.zeros(200, TINY.index_n_heads, layout.dim, device=DEVICE)
    q[:, 0, :32] = 6.0
    q[:, 0, 0] = 0.5
    w = torch.zeros(200, TINY.index_n_heads, device=DEVICE)
    w[:, 0] = 1.0
    got = indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, stack_rows=False, fill=True,
                               tuning=tuned(fp8_mma=fp8_path, fp8_key_scale=key_scale))
    visible = (plan.positions.long() + 1) // M
    seen = torch.arange(got.shape[1], device=DEVICE) < visible[:, None]
    assert seen.any() and torch.equal(got[seen], torch.full_like(got[seen], 1116.25 * layout.dim ** -0.5))


# --- the per-key-scale FP8 path ---------------------------------------------------------------------------------
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# block shifts d: the fast tables' range (0 .. 11), the exact ones' subnormal and flushed range, and far beyond
SHIFTS = list(range(48)) + [60, 100, 126, 127, 128, 200, 250, 251, 252, 253, 254, 255, 40, 41, 42, 43]


@triton.jit
def _shifted_of_bytes(byte_ptr, d_ptr, lo_ptr, hi_ptr, table_ptr, N: tl.constexpr, ASM: tl.constexpr):
    """Every byte (columns) under every shift d (rows): the exact and the fast tables, and `_e2m1_e4m3_shifted`."""
    o_s, o_b = tl.arange(0, N), tl.arange(0, 256)
    d = tl.load(d_ptr + o_s)
    t_lo, t_hi = keys_mod._shift_tables_exact(d)
    f_lo, f_hi = keys_mod._shift_tables(d)
    tl.store(table_ptr + o_s * 4, t_lo)
    tl.store(table_ptr + o_s * 4 + 1, t_hi)
    tl.store(table_ptr + o_s * 4 + 2, f_lo)
    tl.store(table_ptr + o_s * 4 + 3, f_hi)
    byte = tl.broadcast_to(tl.load(byte_ptr + o_b)[None, :], (N, 256))
    lo, hi = keys_mod._e2m1_e4m3_shifted(byte, tl.broadcast_to(t_lo[:, None], (N, 256)),
                                         tl.broadcast_to(t_hi[:, None], (N, 256)), ASM)
    offs = o_s[:, None] * 256 + o_b[None, :]
    tl.store(lo_ptr + offs, lo)
    tl.store(hi_ptr + offs, hi)


def check_shifted_bytes(asm):
    d = torch.tensor(SHIFTS, dtype=torch.int32)
    byte = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    lo = torch.empty(len(SHIFTS), 256, dtype=torch.uint8, device=DEVICE)
    hi, tables = torch.empty_like(lo), torch.empty(len(SHIFTS), 4, dtype=torch.int32, device=DEVICE)
    _shifted_of_bytes[(1,)](byte, d.to(DEVICE), lo, hi, tables, N=len(SHIFTS), ASM=asm)
    # each magnitude times 2^(6 - d), rounded by torch's cast (nearest even, subnormals included)
    want = (E2M1[None, :].double() * 2.0 ** (6 - d.double())[:, None]).float().to(torch.float8_e4m3fn)
    want = want.view(torch.uint8).int()  # [shifts, 8]
    words = tables.cpu().view(torch.uint8).view(len(SHIFTS), 4, 4).int()  # little-endian: byte c of a word = code c
    assert torch.equal(torch.cat([words[:, 0], words[:, 1]], 1), want)
    fast = d <= 11
    assert torch.equal(words[fast, 2:], words[fast, :2])
    assert (want[d <= 14] != 0)[:, 1:].all() and (want[d >= 19] == 0).all()  # exact to 14, all flushed from 19
    for got, nibble in ((lo, byte.cpu().int() & 15), (hi, byte.cpu().int() >> 4)):
        code = want[:, nibble & 7] | ((nibble & 8) << 4)[None, :]  # the sign bit moved to e4m3's, -0 included
        assert torch.equal(got.cpu().int(), code)


def test_key_scale_tables_every_shift_and_byte():
    """The per-key path's key decode: for block shifts d = 0 .. 47 and far beyond (up to 255, a NaN scale's), the
    exact tables hold e4m3 codes of each e2m1 magnitude times 2^(6 - d) as torch's cast rounds them (nearest even:
    exact to d = 14, subnormal and rounded to 18, zero from 19); the fast tables equal them for d <= 11; and the
    lookup gives every one of the 256 packed bytes' two nibbles their code, sign included (the plain form, which the
    interpreter runs)."""
    check_shifted_bytes(asm=False)


@needs_cuda
def test_key_scale_tables_every_shift_and_byte_inline_ptx():
    """The same for the inline-PTX lookup (PRMT) the GPU runs."""
    check_shifted_bytes(asm=True)


def spread_keys(cache, rid, layout, pool, count, page_tokens, shifts, g):
    """Random bytes for request rid's first `count` entries, each key's block codes its largest code (100 .. 150) less
    a shift drawn from `shifts` (block 0 or another at shift 0) -> (the per-key path's bound on each key's rounding:
    fp32 [count, D] 2^-16 S on the dims of blocks 15 or more binades below the key's largest (S = its scale), else 0;
    on the host, float64 [count, D]: the keys as `layout.read` decodes them, and as the per-key path rounds them, each
    value under S * 2^-6 cast to e4m3 by torch (nearest even, subnormals kept: the path's tables,
    `test_key_scale_tables_every_shift_and_byte`))."""
    data_rows, scale_rows, page, off = entry_rows(cache, rid, layout, pool, count, page_tokens)
    blocks = layout.dim // 32
    smax = torch.randint(100, 151, (count, 1), generator=g)
    d = torch.tensor(shifts)[torch.randint(0, len(shifts), (count, blocks), generator=g)]
    d[torch.arange(count), torch.randint(0, blocks, (count,), generator=g)] = 0
    data_rows[page, off] = torch.randint(0, 256, (count, layout.data_bytes), generator=g, dtype=torch.uint8).to(DEVICE)
    scale_rows[page, off] = (smax - d).to(torch.uint8).to(DEVICE)
    moved = (d >= 15).float().repeat_interleave(32, dim=1)
    keys = layout.read(pool, page_tokens // M, page * (page_tokens // M) + off).cpu().double()
    unit = 2.0 ** (smax.double() - 127 - 6)  # S * 2^-6: v / unit is e2m1 v * 2^(6 - d), exact in fp32 here
    rounded = (keys / unit).float().to(torch.float8_e4m3fn).double() * unit
    return (moved * 2.0 ** (smax.double() - 127 - 16)).float().to(DEVICE), keys, rounded


@pytest.mark.parametrize("stack_rows", [False, True], ids=["row", "stacked"])
def test_key_scale_wide_block_spreads(stack_rows):
    """Keys of random bytes whose blocks lie 0 .. 60 binades below their key's largest (D = 128, four blocks), on
    the per-key path of either kernel: the scores stay within the stated bound, |error| <= tol * T + sum_h |w_h|
    sum_d |q_hd| bound_d / sqrt(D) (bound_d = 2^-16 S on blocks 15 or more binades down, `spread_keys`), T the size of
    the score's terms; keys no block of which is that far down keep the plain tolerance. The data use the rounding:
    the keys as the per-key path rounds them score (float64, on the host) beyond the plain tolerance of the exact
    keys' scores somewhere, and the kernel's scores lie within tol of those rounded keys' scores. q and w are drawn on
    the host, so both platforms score the same data (how far the rounding moves a score depends on the query: 1.3 to
    3.5e-6 of T over five query seeds)."""
    geometry = dataclasses.replace(TINY, index_head_dim=128)
    cache, layout, pool = make_cache(geometry, "mxfp4", page_tokens=PAGE, max_requests=2, max_tokens=512)
    rid = cache.admit()
    cache.plan_step([(rid, 301)])
    buffers = cache.step_buffers(max_tokens=8, max_requests=2)
    plan = cache.plan_step([(rid, 5)], buffers=buffers)  # 3 padding rows
    count = 306 // M
    bound, keys, rounded = spread_keys(cache, rid, layout, pool, count, PAGE,
                                       [0, 1, 3, 11, 12, 13, 14, 15, 16, 17, 18, 19, 25, 60], gen(101))
    rows, heads = plan.positions.shape[0], geometry.index_n_heads
    q, w = make_query(layout, rows, heads, seed=102, padding_from=plan.num_tokens, host=True)
    tuning = tuned(**SMALL_ROW, **SMALL_STACKED, stacked_key_scale=SMALL_STACK)
    got = indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, max_entries=80,
                               stack_rows=stack_rows, fill=True, tuning=tuning)
    want, size = reference(plan, pool, layout, q, w, 80, ratio=M, page_tokens=PAGE)
    score_error(got, (want, size))  # the same -inf, NaN and finite positions
    n = plan.num_tokens
    rounding = torch.zeros_like(want)
    rounding[:n, :count] = torch.einsum("rhd,jd,rh->rj", q[:n].abs(), bound, w[:n].abs()) * layout.dim ** -0.5
    finite = torch.isfinite(want)
    err = torch.where(finite, (got - want).abs(), 0.0)
    _, term_tol = tolerance(True)
    assert bool((err <= term_tol * size + rounding).all()), float(((err - term_tol * size) / rounding).max())
    moved = finite & (rounding > 0)
    assert moved.any() and bool((err[~moved] <= term_tol * size[~moved]).all())
    # the same scores in float64 on the host, of the exact keys and of the keys as the path rounds them
    q64, w64, seen = q[:n].cpu().double(), w[:n].cpu().double(), finite[:n, :count].cpu()
    exact, by_path = indexer_scores(q64, w64, keys), indexer_scores(q64, w64, rounded)
    exact_size, path_size = (indexer_scores(q64.abs(), w64.abs(), k.abs()) for k in (keys, rounded))
    assert bool(((by_path - exact).abs() > TERM_TOL * exact_size)[seen].any())
    kernel = got[:n, :count].cpu().double()
    assert bool(((kernel - by_path).abs() <= term_tol * path_size)[seen].all()), \
        float(((kernel - by_path).abs() / path_size)[seen].max())


class KwargSpy:
    """Stands in for a jitted kernel and records each launch's keyword arguments."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_verify_step_takes_the_stacked_key_scale_path(monkeypatch):
    """A speculative verify step (five requests of 4 rows and one of 3, at odd lengths, padding rows after) goes to
    the stacked kernel by host facts, on its per-key-scale FP8 path over 4 rows a program (each block of rows one
    request's, so its rows share each decoded key tile): the scores are the reference's within tolerance, and the
    top-k picks, where they differ from the reference's, are near ties of the reference's scores."""
    from dsv4kv.ops.topk.kernel import topk_indices
    from dsv4kv.tools.bench.picks import pick_gaps

    cache, layout, pool = make_cache(TINY, "mxfp4", page_tokens=PAGE, max_requests=7, max_tokens=1600)
    rids = admit(cache, 6)
    g = gen(111)
    for rid, n in zip(rids, (17, 130, 201, 64, 333, 90)):
        cache.plan_step([(rid, n)])
    buffers = cache.step_buffers(max_tokens=28, max_requests=7)
    plan = cache.plan_step([(rid, 4) for rid in rids[:5]] + [(rids[5], 3)], buffers=buffers)
    for rid in rids:
        write_all_keys(cache, rid, layout, pool, torch.randn(90, layout.dim, generator=g).to(DEVICE), M, PAGE)
    assert not kernel_mod.counts_digits(plan)  # the stacked kernel, by the automatic choice
    spy = KwargSpy(kernel_mod._indexer_scores_stacked_kernel)
    monkeypatch.setattr(kernel_mod, "_indexer_scores_stacked_kernel", spy)
    rows = plan.positions.shape[0]
    q, w = make_query(layout, rows, TINY.index_n_heads, seed=112, padding_from=plan.num_tokens)
    got = indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, max_entries=96, fill=True)
    (launch,) = spy.launches
    on_gpu_or_interpreter = DEVICE.type != "cuda" or hopper_or_later(DEVICE)
    assert launch["KEY_SCALE"] is on_gpu_or_interpreter and launch["MMA8"] is on_gpu_or_interpreter
    assert launch["BLOCK_T"] == tuning_for(DEVICE).stacked_key_scale.block_t == 4
    want = reference(plan, pool, layout, q, w, 96, ratio=M, page_tokens=PAGE)
    assert_close_scores(got, want, key_scale=True)
    visible = torch.clamp((plan.positions + 1) // M, min=0).to(torch.int32)
    visible[plan.num_tokens:] = 0
    picks = topk_indices(got, visible, 16)
    gaps = pick_gaps(picks[:plan.num_tokens], want[0][:plan.num_tokens])
    assert float(gaps.max()) <= 2 * tolerance(True)[0], gaps


def compile_for_sm90a():
    """Compile the row and the stacked kernel's per-key-scale FP8 variants (inline PTX, FP8 wgmma) for sm_90a with
    Triton's own ptxas, at V4 shapes; print each cubin's resource use. Run without TRITON_INTERPRET (no GPU needed)."""
    import os
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointers = dict(q_ptr="*fp32", w_ptr="*fp32", positions_ptr="*i32", token_request_ptr="*i32",
                    request_slots_ptr="*i32", block_table_ptr="*i32", pool_ptr="*u8", out_ptr="*fp32", q8_ptr="*u8",
                    q8_scale_ptr="*fp32", counts_ptr="*i32", scratch_ptr="*i32", num_rows="i32", num_heads="i32",
                    num_entries="i32", table_stride="i32", score_scale="fp32", chunk="i32", counts_stride="i32")
    shared = dict(FORMAT=keys_mod.KEYS_MXFP4, RATIO=4, D=128, P=256, PAGE_BYTES=256 * 68, DATA_BYTES=64, SCALE_BYTES=4,
                  BLOCK_H=64, DOT=tl.bfloat16, FILL=False, MMA8=True, ASM=True, KEY_SCALE=True)
    row = dict(shared, BLOCK_J=64, FILL_J=64, BITS=True, PAGE_TILES=True, COUNT=True, SCRATCH=False, COUNT_BLOCK=1024)
    t = TUNING["sm90"]
    stacked = dict(shared, BLOCK_T=4, BLOCK_J=t.stacked_key_scale.block_j, FILL_J=t.stacked_key_scale.block_j)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    for name, kernel, constants, options in (
            ("row", kernel_mod._indexer_scores_kernel, row,
             dict(num_warps=t.row.num_warps, num_stages=t.row.num_stages, maxnreg=t.fp8_max_registers)),
            ("stacked", kernel_mod._indexer_scores_stacked_kernel, stacked,
             dict(num_warps=t.stacked_key_scale.num_warps, num_stages=t.stacked_key_scale.num_stages))):
        signature = {a: pointers[a] if a in pointers else "constexpr" for a in kernel.arg_names}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature,
                                            constexprs={a: constants[a] for a in kernel.arg_names if a in constants}),
                                  target=GPUTarget("cuda", 90, 32), options=options)
        ptx = compiled.asm["ptx"]
        assert "wgmma.mma_async" in ptx and ".e4m3.e4m3" in ptx and "prmt.b32" in ptx, name
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                   check=True).stdout
        print(name, usage.strip().splitlines()[-1].strip())


def test_key_scale_kernels_compile_for_sm90a():
    """The per-key path's GPU-only parts (its PTX lookup, FP8 wgmma from a K = 128 tile, the 4-row stacked variant) are
    compiled for sm_90a by Triton's own ptxas in a fresh process without the interpreter, so CI without a GPU
    catches a compile error: FP8 wgmma and PRMT in the PTX, and no local-memory spills in either cubin."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", "import test_kernel_indexer as t; t.compile_for_sm90a()"], cwd=here,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("row", "stacked"))]
    assert len(lines) == 2 and all("LOCAL:0" in line for line in lines), done.stdout


@pytest.mark.parametrize("indexer_format", ["mxfp4", "fp8"])
def test_query_and_keys_are_bf16_values(indexer_format):
    """The claim behind exact MMA products: rotated + round-tripped queries and stored keys are bf16 values,
    over 60 binades of magnitudes."""
    layout = indexer_layout(indexer_format, 128)
    g = gen(41)
    x = torch.randn(4096, 128, generator=g) * 2.0 ** torch.randint(-30, 31, (4096, 1), generator=g)
    for values in (indexer_query(x.view(64, 64, 128), layout), layout.round_trip(x)):
        assert torch.equal(values.to(torch.bfloat16).float(), values)


@pytest.mark.parametrize("stack_rows", [False, True], ids=["row", "stacked"])
def test_bf16_query_gives_the_fp32_querys_scores(stack_rows):
    """The query's values are bf16 values, so passing it as bf16 changes no score (the same bits)."""
    cache, layout, pool = make_cache(TINY, "mxfp4", page_tokens=PAGE, max_requests=2, max_tokens=256)
    rid = cache.admit()
    plan = cache.plan_step([(rid, 131)])
    write_all_keys(cache, rid, layout, pool, torch.randn(32, layout.dim, generator=gen(71)).to(DEVICE), M, PAGE)
    q, w = make_query(layout, 131, TINY.index_n_heads, seed=72)
    got = [indexer_scores_paged(x, w, plan, pool, layout, ratio=M, page_tokens=PAGE, stack_rows=stack_rows, fill=True)
           for x in (q, q.to(torch.bfloat16))]
    assert torch.equal(got[0], got[1])


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
    got = indexer_scores_paged(q, w, plan, pool, layout, ratio=M, page_tokens=PAGE, fill=True)
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

    with pytest.raises(ValueError, match=r"q: expected torch.float32/torch.bfloat16 \[8, \*, 64\], got torch.float16"):
        run(q=q.to(torch.float16))
    with pytest.raises(ValueError,
                       match=r"q: expected torch.float32/torch.bfloat16 \[8, \*, 64\], got torch.float32 \[5, 4, 64\]"):
        run(q=q[:5])  # the real rows only: kernels run over the padded rows
    with pytest.raises(ValueError, match=r"q: expected torch.float32/torch.bfloat16 \[8, \*, 64\]"):
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
    shifted = torch.zeros(pool.numel() + 2, dtype=torch.uint8, device=DEVICE)[1:-1].view(pool.shape)
    with pytest.raises(ValueError, match=r"key_pool: its first byte must be aligned to 2 bytes .* got an address of "
                                         r"1 mod 2"):
        run(pool=shifted)
    with pytest.raises(ValueError, match=r"layout: the kernel needs a power-of-two dim >= 32, got 48"):
        run(layout=indexer_layout("bf16", 48))
    with pytest.raises(ValueError, match=r"layout: the kernel needs a power-of-two dim >= 32, got 16"):
        run(layout=indexer_layout("bf16", 16))
    with pytest.raises(ValueError, match=r"stack_rows: expected True, False or None, got 1"):
        run(stack_rows=1)
    with pytest.raises(ValueError, match=r"layout: expected an indexer layout"):
        run(layout=main_layout("fp8", 128, 64))
    with pytest.raises(ValueError, match=r"plan: expected a StepPlan, got dict"):
        indexer_scores_paged(q, w, {"positions": plan.positions}, pool, layout, ratio=M, page_tokens=PAGE, fill=True)
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
    codes, scales = indexer_query_fp8(q)
    with pytest.raises(ValueError, match=r"q_fp8: expected \(codes, scales\)"):
        run(q_fp8=[codes, scales])
    with pytest.raises(ValueError, match=r"q_fp8 codes: expected torch.uint8 \[8, 4, 64\]"):
        run(q_fp8=(codes[:5], scales))
    with pytest.raises(ValueError, match=r"q_fp8 scales: expected torch.float32 \[8, 4\]"):
        run(q_fp8=(codes, scales.double()))
    with pytest.raises(ValueError, match=r"q: the operand needs a power-of-two dim >= 32, got 48"):
        indexer_query_fp8(torch.zeros(2, 4, 48, device=DEVICE))
    with pytest.raises(ValueError, match=r"out scales: expected torch.float32 \[8, 4\]"):
        indexer_query_fp8(q, out=(codes, scales[:3]))


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


def replay_over_new_inputs(graph, plan, cache, rids, layout, pool, q, w, out, entries, *, seed, padding_from,
                           key_scale=False):
    """Rewrite every key in place and load a new query into the captured q / w, then replay: the scores must be the
    reference's for the pool and inputs as they are now (keys from `gen(seed)`, the query from seed + 1)."""
    g = gen(seed, DEVICE)
    for rid in rids:
        write_all_keys(cache, rid, layout, pool, torch.randn(cache.length(rid) // 4 + 8, layout.dim, generator=g,
                                                             device=DEVICE), 4, V4_PAGE)
    q2, w2 = make_query(layout, q.shape[0], q.shape[1], seed=seed + 1, padding_from=padding_from)
    q.copy_(q2)
    w.copy_(w2)
    out.fill_(float("nan"))
    graph.replay()
    assert_close_scores(out, reference(plan, pool, layout, q, w, entries, ratio=4, page_tokens=V4_PAGE), key_scale)


@needs_cuda
@pytest.mark.parametrize("indexer_format", FORMATS)
def test_v4_decode_one_request_65536_entries(indexer_format):
    """Also every MXFP4 path of the row kernel: FP8 MMAs with one scale per key (the default), exact per block, and
    bf16; the exact ones agree within fp32 summation order, the per-key one within its tolerance."""
    _, layout, pool, plan, _, _, heads = v4_case("flash", indexer_format, [262143], [(0, 1)],
                                                 max_tokens=262144 + 512, buffer_tokens=1, seed=1)
    assert (heads, layout.dim) == (64, 128) and int(plan.positions[0]) == 262143
    q, w = make_query(layout, 1, heads, seed=1)
    want = reference(plan, pool, layout, q, w, 65536, ratio=4, page_tokens=V4_PAGE)
    outs = []
    for fp8, key_scale in ((True, False), (False, False), (True, True)):
        got = indexer_scores_paged(q, w, plan, pool, layout, ratio=4, page_tokens=V4_PAGE, fill=True,
                                   tuning=tuned(fp8_mma=fp8, fp8_key_scale=key_scale))
        assert got.shape == (1, 65536) and torch.isfinite(got).all()
        assert_close_scores(got, want, key_scale and indexer_format == "mxfp4")
        outs.append(got)
    assert_paths_agree(outs[0], outs[1], want)
    assert_paths_agree(outs[2], outs[1], want, key_scale=indexer_format == "mxfp4")


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
    indexer_scores_paged(q, w, plan, pool, layout, ratio=4, page_tokens=V4_PAGE, out=out, fill=True)
    key_scale = indexer_format == "mxfp4"
    assert_close_scores(out, reference(plan, pool, layout, q, w, entries, ratio=4, page_tokens=V4_PAGE), key_scale)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        indexer_scores_paged(q, w, plan, pool, layout, ratio=4, page_tokens=V4_PAGE, out=out, fill=True)
    plan = cache.plan_step([(rids[i], n) for i, n in step], buffers=buffers)
    replay_over_new_inputs(graph, plan, cache, rids, layout, pool, q, w, out, entries, seed=3, padding_from=8,
                           key_scale=key_scale)


@needs_cuda
@pytest.mark.parametrize("stack_rows", [False, True], ids=["row", "stacked"])
def test_v4_unfilled_columns_are_never_picked(stack_rows):
    """V4-Flash, MXFP4: eight requests at lengths 1 .. ~200K in a padded plan over the full width (a graph captured
    for the longest request): without the fill, columns past visible keep the +inf poison, and the top-512 over the
    visible counts equals the top-512 of the filled scores, never past visible(t)."""
    from dsv4kv.ops.topk.kernel import topk_indices

    history = [0, 2, 3, 128, 4097, 30001, 65535, 199998]
    cache, layout, pool, plan, _, _, heads = v4_case("flash", "mxfp4", history, [(i, 1) for i in range(8)],
                                                     max_tokens=310_000, buffer_tokens=11, seed=7)
    entries = cache.block_table.shape[1] * V4_PAGE // 4
    q, w = make_query(layout, 11, heads, seed=7, padding_from=8)
    filled = indexer_scores_paged(q, w, plan, pool, layout, ratio=4, page_tokens=V4_PAGE, max_entries=entries,
                                  stack_rows=stack_rows, fill=True)
    got = torch.full((11, entries), float("inf"), device=DEVICE)
    indexer_scores_paged(q, w, plan, pool, layout, ratio=4, page_tokens=V4_PAGE, out=got, stack_rows=stack_rows)
    lengths = check_unfilled(got, filled, plan, 4, torch.tensor(float("inf"), device=DEVICE)).to(torch.int32)
    picks = topk_indices(got, lengths, 512)
    assert torch.equal(picks, topk_indices(filled, lengths, 512))
    assert ((picks < lengths[:, None]) | (picks == -1)).all()


@needs_cuda
@pytest.mark.parametrize("indexer_format", FORMATS)
def test_v4_prefill_512_rows(indexer_format):
    """A 512-token chunk at 20001 tokens of history beside a decode, in a padded plan."""
    cache, layout, pool, plan, _, _, heads = v4_case("flash", indexer_format, [20001, 700], [(0, 512), (1, 1)],
                                                     max_tokens=30_000, buffer_tokens=520, seed=5)
    q, w = make_query(layout, 520, heads, seed=5, padding_from=513)
    entries = cache.block_table.shape[1] * V4_PAGE // 4
    out = torch.full((520, entries), float("nan"), device=DEVICE)
    indexer_scores_paged(q, w, plan, pool, layout, ratio=4, page_tokens=V4_PAGE, out=out, fill=True)
    assert_close_scores(out, reference(plan, pool, layout, q, w, entries, ratio=4, page_tokens=V4_PAGE),
                        indexer_format == "mxfp4")


@needs_cuda
@pytest.mark.parametrize("indexer_format", FORMATS)
def test_v4_prefill_2048_rows_after_6k_stacked(indexer_format, monkeypatch):
    """V4-Flash prefill: one request, a 2048-row chunk after 6144 tokens of history (64 heads x 128), in a padded
    plan, over the default width (65536 columns: the -inf fill). The automatic choice runs the stacked kernel;
    it matches the reference and the row kernel."""
    cache, layout, pool, plan, _, _, heads = v4_case("flash", indexer_format, [6144], [(0, 2048)],
                                                     max_tokens=8192 + 256, buffer_tokens=2053, seed=7)
    assert (heads, layout.dim) == (64, 128)
    entries = cache.block_table.shape[1] * V4_PAGE // 4
    q, w = make_query(layout, 2053, heads, seed=7, padding_from=2048)
    row, stacked = spy_kernels(monkeypatch)
    out = torch.full((2053, entries), float("nan"), device=DEVICE)
    indexer_scores_paged(q, w, plan, pool, layout, ratio=4, page_tokens=V4_PAGE, out=out, fill=True)
    assert (row.launches, stacked.launches) == (0, 1)
    want = reference(plan, pool, layout, q, w, entries, ratio=4, page_tokens=V4_PAGE)
    key_scale = indexer_format == "mxfp4"
    assert_close_scores(out, want, key_scale)
    by_row = indexer_scores_paged(q, w, plan, pool, layout, ratio=4, page_tokens=V4_PAGE, max_entries=entries,
                                  stack_rows=False, fill=True)
    assert_paths_agree(out, by_row, want, key_scale)


@needs_cuda
@pytest.mark.parametrize("indexer_format", ["mxfp4", "fp8"])
def test_v4_prefill_graph_replay_stacked(indexer_format, monkeypatch):
    """A CUDA graph captured over a prefill step (the stacked kernel: chunks of 700, 300, 13 and 1 rows) replays
    a different step planned into the same buffers (1, 777, 250 and 64 rows: other row blocks, other request
    boundaries) with new keys, q and weights."""
    history, step = [6000, 3001, 0, 0], [(0, 700), (1, 300), (2, 13), (3, 1)]
    cache, layout, pool, plan, buffers, rids, heads = v4_case("flash", indexer_format, history, step,
                                                              max_tokens=12_000, buffer_tokens=1100, seed=8)
    entries = cache.block_table.shape[1] * V4_PAGE // 4
    q, w = make_query(layout, 1100, heads, seed=8, padding_from=1014)
    out = torch.full((1100, entries), float("nan"), device=DEVICE)
    row, stacked = spy_kernels(monkeypatch)
    indexer_scores_paged(q, w, plan, pool, layout, ratio=4, page_tokens=V4_PAGE, out=out, fill=True)
    key_scale = indexer_format == "mxfp4"
    assert_close_scores(out, reference(plan, pool, layout, q, w, entries, ratio=4, page_tokens=V4_PAGE), key_scale)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        indexer_scores_paged(q, w, plan, pool, layout, ratio=4, page_tokens=V4_PAGE, out=out, fill=True)
    assert (row.launches, stacked.launches) == (0, 2)
    plan = cache.plan_step([(rids[0], 1), (rids[1], 777), (rids[2], 250), (rids[3], 64)], buffers=buffers)
    replay_over_new_inputs(graph, plan, cache, rids, layout, pool, q, w, out, entries, seed=9, padding_from=1092,
                           key_scale=key_scale)


@needs_cuda
def test_v4_verify_step_16_requests_4_rows():
    """V4-Flash, MXFP4 keys: a speculative verify step, 16 requests of 4 rows at lengths 1 .. ~40K in a padded plan,
    on the automatic choice (the stacked kernel's per-key-scale path, 4 rows a program): within the per-key tolerance
    of the reference and of the exact row kernel; its top-512 picks differ from the reference's only at near ties of
    the reference's scores; a CUDA graph captured over it replays the next verify step with new keys and query."""
    from dsv4kv.ops.topk.kernel import topk_indices
    from dsv4kv.tools.bench.picks import pick_gaps

    history = [1, 3, 130, 1021, 4097, 9000, 12345, 17000, 20001, 23456, 27000, 30001, 33333, 36000, 38000, 40001]
    step = [(i, 4) for i in range(16)]
    cache, layout, pool, plan, buffers, rids, heads = v4_case("flash", "mxfp4", history, step, max_tokens=420_000,
                                                              buffer_tokens=70, seed=12)
    assert not kernel_mod.counts_digits(plan)
    entries = cache.block_table.shape[1] * V4_PAGE // 4
    q, w = make_query(layout, 70, heads, seed=12, padding_from=64)
    out = torch.full((70, entries), float("nan"), device=DEVICE)
    indexer_scores_paged(q, w, plan, pool, layout, ratio=4, page_tokens=V4_PAGE, out=out, fill=True)
    want = reference(plan, pool, layout, q, w, entries, ratio=4, page_tokens=V4_PAGE)
    assert_close_scores(out, want, key_scale=True)
    exact = indexer_scores_paged(q, w, plan, pool, layout, ratio=4, page_tokens=V4_PAGE, max_entries=entries,
                                 stack_rows=False, fill=True, tuning=tuned(fp8_key_scale=False))
    assert_paths_agree(out, exact, want, key_scale=True)
    visible = torch.clamp((plan.positions + 1) // 4, min=0).to(torch.int32)
    visible[64:] = 0
    gaps = pick_gaps(topk_indices(out, visible, 512)[:64], want[0][:64])
    assert float(gaps.max()) <= 2 * KEY_SCALE_TOL, gaps

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        indexer_scores_paged(q, w, plan, pool, layout, ratio=4, page_tokens=V4_PAGE, out=out, fill=True)
    plan = cache.plan_step([(rids[i], 4) for i in range(16)], buffers=buffers)
    replay_over_new_inputs(graph, plan, cache, rids, layout, pool, q, w, out, entries, seed=13, padding_from=64,
                           key_scale=True)
