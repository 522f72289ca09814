"""Lightning-indexer scores over the paged indexer-key pool (Triton), the kernel of
`ops.indexer.reference.indexer_scores`.

    out[t, j] = sum_h w[t, h] * ReLU(q[t, h] . K_j) * D^-0.5     for j < visible(t) = (positions[t] + 1) // ratio
    out[t, j] = -inf (fill=True) or left as it was (fill=False)   for j >= visible(t) and for padding rows

K_j is entry j of row t's request, decoded in the kernel straight from the pool bytes (no dequantized
copy): MXFP4 (packed e2m1, element 2i in the low nibble, one ue8m0 scale per 32 values; 0xFF = NaN,
0x00 = 2^-127), FP8 (e4m3 values, one fp32 scale per key) or bf16. Never-written or unallocated entries
are never loaded (masked loads), so a NaN-poisoned pool cannot leak into visible scores.

Numerics. The query arrives already in the keys' numerics (`ops.indexer.reference.indexer_query`): for MXFP4 and
FP8 every q and K value is a 2- or 4-bit-mantissa float times a power of two, hence exactly a bf16
value; bf16 keys are bf16 by definition and the exact-mode query is a bf16-valued fp32. So the bf16
`tl.dot` with fp32 accumulation forms every product q_d * K_d exactly (8 x 8 significant bits fit in
fp32) and the score differs from the fp32 torch reference only in summation order (and in where the
D^-0.5 rounding happens): measured <= 1.3e-7 of the size of the score's terms (sum_h |w_h| sum_d |q K|
/ sqrt(D)), <= ~5e-7 of the row's largest |score| (a few 1e-6 where a score cancels). The FP8 key scale
(a power of two) multiplies the dot product after the MMA, which is exact. A q that is NOT bf16-valued (an arbitrary
fp32 caller) is rounded to bf16 (round to nearest even) before the dot: the scores are then exactly
those of the reference evaluated with `q.to(torch.bfloat16)`, i.e. off by up to ~2^-9 relative per
product from the fp32 result. Keys with a NaN scale (a non-finite entry) score NaN, as in the reference.
Under Triton's interpreter an e4m3 NaN byte (0x7F / 0xFF) decodes to +-480 rather than NaN; the GPU
conversion gives NaN, and the quantizer never writes such a byte under a finite scale. On the bf16 path the
MXFP4 decode is bit arithmetic and exact multiplies by powers of two: in the row kernel on a Hopper GPU straight to
bf16 (`_e2m1_bf16`, inline PTX), else through fp32 (`_e2m1_pair`, the stacked kernel and the interpreter); either
gives the value `layout.read` does. The FP8 path (below) forms the same products.

Two kernels compute the same function (their key decoding and products are `keys.py`'s); the wrapper picks one from
host facts only (`plan.num_tokens`, the request count; `stack_rows=` overrides), so a captured CUDA graph replays
either correctly over any later plan. On their bf16 paths both split each MMA into two K = D/2 halves (a byte's low
/ high nibbles for MXFP4).

Row kernel (decode: about one row per request). Grid (row, chunk of BLOCK_J * iters entries): a program
loads q[t] ([H, D] = [64, 128] for V4, as bf16 q^T) and the head weights once, then per iteration decodes
[BLOCK_J, D] keys in registers and runs a [BLOCK_J, D] x [D, H] MMA (the keys are the A operand so the
decoded registers feed it directly). Decode (R small, J up to 2^18) gets its parallelism from the chunks.

MXFP4 keys on FP8 MMAs, exact per-block path (row kernel and, below, stacked kernel; D <= 128;
`IndexerTuning.fp8_mma`, with `fp8_key_scale=False`). A packed byte becomes two e4m3 bytes by moving bits
(`_e2m1_e4m3`: e2m1 * 2^-6 exactly, five ALU ops per eight values instead of ~6 per value). The query's operand is
made once per row, not per program (`fp8_query_operand`: by the layer's query kernel, or by `indexer_query_fp8`
here): each head of q is shifted by its own power of two 2^-c
into e4m3, and 2^c goes into that head's weight (ReLU commutes with a positive power of two, and the products
are exact, so this moves no rounding). Each 32-value scale block is one K = 32 FP8 MMA from a zero accumulator: its
32 products of e2m1 pairs are multiples of 1/4 and sum below 2^11 (times the scales and shifts), so the sum needs
13 significant bits and is exact within the ~14 that Hopper's FP8 accumulation keeps; the key's ue8m0 scale
(times 2^6, undoing the keys' shift) then scales it and fp32 adds the blocks in order. The products are the
reference's and only the fp32 summation order differs, as on the bf16 path (on V4 shapes the two paths' scores are
bit-equal: MXFP4 dot products are mostly exact in fp32 either way). Where a page holds whole tiles (P % BLOCK_J == 0,
as the 256 entries of a default 1024-token CSA page do) a tile is addressed from its page, and its block id and
scale words are read a tile ahead (`IndexerTuning.page_tiles`); elsewhere each entry reads its own block id.
A row with a head whose query is not MXFP4-valued and exact in e4m3 after its shift takes the bf16 path. Edges that
differ from the reference, both from the shifts: a block sum is the reference's times 2^-c (q's largest value
scaled to ~2^8): up to 32 * 384 * 6 = 2^16.2 times its key scale, and D / 32 such sums add up. So from key scales of
2^110 (ue8m0 0xED) at D = 128, 2^111 at D = 64, the sums can overflow where a small query keeps the reference's finite
(`test_large_key_scales_with_a_small_query` shows both sides at D = 64); and a partial sum that leaves fp32's normal
range only under the shifts rounds differently. The quantizers write keys that large only for inputs near fp32's
limits.

MXFP4 keys under one scale per key (the default FP8 path on Hopper; `IndexerTuning.fp8_key_scale`, False = the
exact per-block path above). The per-block path pays D/32 MMAs and D/32 scaled fp32 adds per (key, row, head) on
the CUDA cores, which bound it. This path re-expresses each key under its largest block scale S = 2^(smax - 127):
a block d = smax - s_b binades below holds its e2m1 values v as e4m3 codes of v * 2^(6 - d), by a table lookup per
nibble (`keys.mxfp4_key_scale_keys`: one PRMT per four values, the table per (key, block) from d). A tile is then
one K = D FP8 MMA against q's operand (the same per-head shifts), ReLU and the head weights, and one multiply per
(key, row) by S * 2^-6 after the sum over heads (ReLU commutes with a positive power of two). Scores are not bit for
bit the reference's. Their error, for a score with terms of size T = sum_h |w_h| sum_d |q_hd K_jd| / sqrt(D):
- key values: exact while d <= 14 (two significant bits of v * 2^(6 - d) stay on e4m3's grid, whose subnormal step
  is 2^-9); further down rounded to nearest even, so a value moves by at most 2^-10 * 2^-6 * S = 2^-16 S (all zero
  from d = 19), and the score by at most 2^-16 S sum_h |w_h| sum_{d in those blocks} |q_hd| / sqrt(D). Quantized
  Hadamard-rotated keys have their block scales within a binade or two of each other; d >= 15 needs hand-made bytes
  or a block 2^14 below its key's largest.
- accumulation: the products are exact (e4m3 x e4m3), and each 32-value k step of the MMA sums exactly (one block
  of one key against one q block: a common quantum, under 2^13 of them, as on the exact path). Hopper adds each
  step into an accumulator of ~13 significant bits (DeepSeek-V3's report: ~14 bits; SageAttention2: FP22, 13
  mantissa bits), so each of the D/32 - 1 adds errs by under 2^-12 of a partial sum (<= sum_d |q_hd K_jd|):
  |error| < (D/32 - 1) 2^-12 T, under 2^-10 T at D = 128. Under the interpreter the sums are fp32 (~1e-7 T).
- the epilogue: fp32, as on the exact path (~1e-7 T).
Tolerance: 2^-10 T, plus the key bound where d >= 15. Against the row's largest |score| (the measure top-k is judged
by): V4's rotated MXFP4 queries and keys keep the partial sums within 13 significant bits, so their scores come out
as the exact path's but for fp32 rounding; unrotated data with blocks up to 8 binades apart, under a model of the
accumulator that truncates to 13 bits, errs by 2^-10.8 of the row max at most (2^-12.8 T). The tests hold both paths
to 2^-10 of the row's largest |score| at V4 shapes; a pick that differs from the reference's is then a near tie,
within 2^-9 of the row's largest |score| by the reference's scores. Edges: the sum over heads runs before the key's
scale, so it can overflow where |w_h| 2^c_h (q's magnitude, `fp8_query_operand`) reaches ~2^103, and a score whose
key scale is below 2^-126 (ue8m0 codes < 7) is rounded once more as a subnormal product; the large-key edge of the
exact path (block sums near 2^128) does not arise (the sum is taken at the keys' own scale, <= 384 a value).

Stacked kernel (prefill: many consecutive rows of a request). Grid (block of BLOCK_T consecutive rows,
chunk of entries). A block's rows of one request (a segment) share every decoded key tile: q of the
segment's rows is stacked in the MMA's N dimension, [BLOCK_J, D] x [D, BLOCK_T * H] (other rows' columns
are zero), and ReLU, the head weights and the sum over heads are applied per row on a [BLOCK_J, BLOCK_T, H]
view of the accumulator. Rows are in request order, so a block holds one request except at a chunk
boundary; a block holding k requests runs k segments in a device-side loop (no host sync; any row order
works), each over the entries its rows see. Per key value the decode (~6 CUDA-core ops) is shared by
BLOCK_T * H MMA columns instead of H, and q is loaded once per segment for up to BLOCK_T x BLOCK_J * iters
(row, entry) pairs. The products and their fp32 accumulation are those of the row kernel (equal results
up to summation order: bit-identical in most scores under the interpreter). MXFP4 keys take FP8 MMAs there too
(per segment whose rows' queries all pass `fp8_query_operand`'s check, else bf16): the row kernel's per-block MMAs
and scalings (`mxfp4_fp8_dot`) over q's operands stacked in N, 2 rows of 64 heads. Each (key, row, head) then costs
four scaled fp32 adds on the CUDA cores where the bf16 path has none, a little less than the halved MMA time saves.
With one scale per key (the default) a tile is one K = D MMA over 4 rows of 64 heads (N = 256, one accumulator, as the
bf16 path; `IndexerTuning.stacked_key_scale`): a speculative verify step (2-8 rows a request, which the automatic
choice sends here) decodes each key tile once for all its request's rows and pays no per-block work per row.

Top-k's first digit (`digit_counts`, decode). After its tiles a row-kernel program reads back the scores it stored
(after a CTA barrier, 1024 a tile so no lane is replicated) and counts their top-k digit 1 by warp into the row's
histogram in the top-k workspace (`topk.keys.count_first_digits`), so the top-k skips its first pass.

Columns past visible(t). Top-k (`topk_indices(scores, visible, k)`) never reads a row past its visible count,
so by default nothing is written there: a graph captured for a large J (max_seq_len // ratio) pays nothing for
the columns nobody sees, where a fill wrote R x J x 4 B per CSA layer (1 MB per row at 1M). Score tiles still
store -inf past visible(t) up to the end of the tile. `fill=True` writes -inf to every other column too (padding
rows included) with wide streaming stores (16-B vectors, `.cs`, so they do not evict scores from L2), for a
caller that reads whole rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...cache.layout import EntryLayout, IndexerMXFP4Layout
from ...cache.plan import StepPlan
from ...checks import check_tensor, require
from ..shared.common import check_pool, hopper_or_later, interpreted, padded_rows, sm_count
from ..shared.encode import round_bf16
from ..shared.launch import launch_options, wait_for_prior_grids
from ..topk.keys import count_first_digits
from .keys import (KEYS_BF16, KEYS_MXFP4, fp8_dot, fp8_query_operand, key_dot, key_format, mxfp4_fp8_dot,
                   mxfp4_fp8_scores, mxfp4_key_scale_keys, mxfp4_tile, q8_blocks, q8_operand, q_dims, relu)
from .tuning import IndexerTuning, Tiles, tuning_for

__all__ = ["indexer_scores_paged", "indexer_query_fp8", "fp8_query_wanted", "counts_digits"]

@triton.jit
def _q_fp8_kernel(q_ptr, q8_ptr, scale_ptr, H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr):
    """Row i_t, heads i_h * BLOCK_H ..: `fp8_query_operand` of q (fp32 or bf16 [R, H, D]) -> q8 uint8 [R, H, D],
    scale fp32 [R, H]."""
    wait_for_prior_grids()
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    offs = i_t.to(tl.int64) * (H * D) + o_h[:, None] * D + tl.arange(0, D)[None, :]
    b_q = tl.load(q_ptr + offs, mask=m_h[:, None], other=0.0).to(tl.float32)
    codes, scale = fp8_query_operand(tl.reshape(b_q, (BLOCK_H, D // 32, 32)))
    tl.store(q8_ptr + offs, tl.reshape(codes, (BLOCK_H, D)), mask=m_h[:, None])
    tl.store(scale_ptr + i_t * H + o_h, scale, mask=m_h)


@triton.jit
def _indexer_scores_kernel(
    q_ptr,  # fp32 or bf16 [R, H, D]
    w_ptr,  # fp32 [R, H]
    positions_ptr, token_request_ptr, request_slots_ptr,  # int32 [R], [R], [B]
    block_table_ptr,  # int32 [max_requests, table_stride]
    pool_ptr,  # uint8 [pages, PAGE_BYTES]
    out_ptr,  # fp32 [R, num_entries]
    q8_ptr, q8_scale_ptr,  # MMA8: uint8 [R, H, D], fp32 [R, H] (`fp8_query_operand`); unread otherwise
    counts_ptr, counts_stride,  # COUNT: int32 [R, 256] rows `counts_stride` apart (`digit_counts`); unread otherwise
    scratch_ptr,  # COUNT and SCRATCH: int32 [programs, 256], a row per program; unread otherwise
    num_heads, num_entries, table_stride, score_scale, chunk,
    FORMAT: tl.constexpr, RATIO: tl.constexpr, D: tl.constexpr, P: tl.constexpr, PAGE_BYTES: tl.constexpr,
    DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr, FILL_J: tl.constexpr, DOT: tl.constexpr,
    FILL: tl.constexpr, MMA8: tl.constexpr, ASM: tl.constexpr, BITS: tl.constexpr, PAGE_TILES: tl.constexpr,
    COUNT: tl.constexpr, SCRATCH: tl.constexpr, COUNT_BLOCK: tl.constexpr, KEY_SCALE: tl.constexpr = False,
):
    """The row kernel: one token row, one chunk of `chunk` entries (a multiple of BLOCK_J). MMA8: MXFP4 keys on FP8
    MMAs (`mxfp4_fp8_scores`; KEY_SCALE: one scale per key) when every head of the row's query passed
    `fp8_query_operand`'s check, else the bf16 path. COUNT: then the top-k's digit 1 of the chunk's scores into the
    row's histogram (`count_first_digits`)."""
    wait_for_prior_grids()
    i_t, i_c = tl.program_id(0), tl.program_id(1)
    t = i_t.to(tl.int64)
    position = tl.load(positions_ptr + i_t)
    request = tl.load(token_request_ptr + i_t)
    slot = tl.load(request_slots_ptr + request, mask=request >= 0, other=-1)
    visible = tl.where((position >= 0) & (slot >= 0), (position + 1) // RATIO, 0)
    visible = tl.minimum(visible, num_entries)
    chunk_lo = i_c * chunk
    chunk_hi = tl.minimum(chunk_lo + chunk, num_entries)
    p_out = out_ptr + t * num_entries

    if chunk_lo < visible:  # chunks wholly past visible(t) (and padding rows) never load q
        o_h = tl.arange(0, BLOCK_H)
        m_h = o_h < num_heads
        # D^-0.5 folded into the head weights; padded heads get weight 0 (and a zero query column)
        b_w = tl.load(w_ptr + t * num_heads + o_h, mask=m_h, other=0.0) * score_scale
        p_q = q_ptr + t * num_heads * D + o_h[None, :] * D
        p_table = block_table_ptr + slot.to(tl.int64) * table_stride
        exact = False
        if MMA8:
            # q's FP8 operand, made once per row (`fp8_query_operand`); 2^c per head goes into the head weights
            # (ReLU commutes with a positive power of two), a scale of 0 sends the row to the bf16 path
            q_scale = tl.load(q8_scale_ptr + t * num_heads + o_h, mask=m_h, other=1.0)
            exact = tl.min(q_scale, axis=0) > 0
            if exact:
                p_q8 = q8_ptr + t * num_heads * D + o_h[None, :] * D
                if KEY_SCALE:
                    b_q8_0 = q8_operand(p_q8, m_h, D)
                    b_q8_1, b_q8_2, b_q8_3 = b_q8_0, b_q8_0, b_q8_0  # unread
                else:
                    b_q8_0, b_q8_1, b_q8_2, b_q8_3 = q8_blocks(p_q8, m_h, D)
                mxfp4_fp8_scores(pool_ptr, p_table, p_out, chunk_lo, tl.minimum(chunk_hi, visible), visible,
                                  num_entries, b_w * q_scale, b_q8_0, b_q8_1, b_q8_2, b_q8_3, D, P, PAGE_BYTES,
                                  DATA_BYTES, SCALE_BYTES, BLOCK_J, BLOCK_H, ASM, PAGE_TILES, KEY_SCALE)
        if not exact:
            o_d0, o_d1 = q_dims(FORMAT, D)
            # [D/2, BLOCK_H]
            b_q0 = round_bf16(tl.load(p_q + o_d0[:, None], mask=m_h[None, :], other=0.0).to(tl.float32)).to(DOT)
            b_q1 = round_bf16(tl.load(p_q + o_d1[:, None], mask=m_h[None, :], other=0.0).to(tl.float32)).to(DOT)
            for j0 in range(chunk_lo, tl.minimum(chunk_hi, visible), BLOCK_J):
                o_j = j0 + tl.arange(0, BLOCK_J)
                b_dot = key_dot(pool_ptr, p_table, o_j, o_j < visible, b_q0, b_q1, FORMAT, D, P, PAGE_BYTES,
                                 DATA_BYTES, SCALE_BYTES, BLOCK_J, DOT, BITS)  # [BLOCK_J, BLOCK_H]
                b_s = tl.sum(relu(b_dot) * b_w[None, :], axis=1)
                tl.store(p_out + o_j, tl.where(o_j < visible, b_s, float("-inf")), mask=o_j < num_entries)
        if COUNT:  # read back from this program's own stores, in a layout with no replicated lanes
            tl.debug_barrier()
            p_scratch = scratch_ptr + (t * tl.num_programs(1) + i_c) * 256
            count_first_digits(p_out, chunk_lo, tl.minimum(chunk_hi, visible), counts_ptr + t * counts_stride,
                               p_scratch, ASM, COUNT_BLOCK, SCRATCH)

    if FILL:  # the rest of the chunk is past visible(t): one wide streaming store (FILL_J = the chunk)
        fill_lo = tl.maximum(chunk_lo, tl.cdiv(visible, BLOCK_J) * BLOCK_J)
        o_f = chunk_lo + tl.arange(0, FILL_J)
        tl.store(p_out + o_f, tl.full((FILL_J,), float("-inf"), tl.float32),
                 mask=(o_f >= fill_lo) & (o_f < chunk_hi), cache_modifier=".cs")


@triton.jit
def _store_stacked(b_dot, b_w, o_j, visible, p_out, seg, num_entries, BLOCK_J: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_H: tl.constexpr, b_ks=None):
    """The stacked kernel's epilogue: ReLU of the dots [BLOCK_J, BLOCK_T * BLOCK_H], the head weights b_w
    [BLOCK_T, BLOCK_H] (D^-0.5 folded in), the sum over heads, times the keys' scales b_ks [BLOCK_J] where given (the
    per-key-scale path), -inf past each row's visible count; stored for the segment's rows."""
    b_dot = tl.reshape(relu(b_dot), (BLOCK_J, BLOCK_T, BLOCK_H))
    b_s = tl.sum(b_dot * b_w[None, :, :], axis=2)  # [BLOCK_J, BLOCK_T]
    if b_ks is not None:
        b_s = b_s * b_ks[:, None]
    b_s = tl.where(o_j[:, None] < visible[None, :], b_s, float("-inf"))
    tl.store(p_out[None, :] + o_j[:, None], b_s, mask=seg[None, :] & (o_j < num_entries)[:, None])


@triton.jit(do_not_specialize=["num_rows"])  # a step's token count: one compilation for all
def _indexer_scores_stacked_kernel(
    q_ptr,  # fp32 or bf16 [R, H, D]
    w_ptr,  # fp32 [R, H]
    positions_ptr, token_request_ptr, request_slots_ptr,  # int32 [R], [R], [B]
    block_table_ptr,  # int32 [max_requests, table_stride]
    pool_ptr,  # uint8 [pages, PAGE_BYTES]
    out_ptr,  # fp32 [R, num_entries]
    q8_ptr, q8_scale_ptr,  # MMA8: uint8 [R, H, D], fp32 [R, H] (`fp8_query_operand`); unread otherwise
    num_rows, num_heads, num_entries, table_stride, score_scale, chunk,
    FORMAT: tl.constexpr, RATIO: tl.constexpr, D: tl.constexpr, P: tl.constexpr, PAGE_BYTES: tl.constexpr,
    DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr, FILL_J: tl.constexpr, DOT: tl.constexpr,
    FILL: tl.constexpr, MMA8: tl.constexpr = False, ASM: tl.constexpr = False, KEY_SCALE: tl.constexpr = False,
):
    """The stacked kernel: BLOCK_T consecutive token rows, one chunk of `chunk` entries (a multiple of BLOCK_J).
    MMA8: a segment whose rows' queries all passed `fp8_query_operand`'s check runs MXFP4 keys on FP8 MMAs
    (`mxfp4_fp8_dot`, or with KEY_SCALE one scale per key, `mxfp4_key_scale_keys`; q's operand stacked in N as on the
    bf16 path); any other segment takes the bf16 path."""
    wait_for_prior_grids()
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    o_t = i_b * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < num_rows
    position = tl.load(positions_ptr + o_t, mask=m_t, other=-1)
    request = tl.load(token_request_ptr + o_t, mask=m_t, other=-1)
    slot = tl.load(request_slots_ptr + request, mask=request >= 0, other=-1)
    visible = tl.where((position >= 0) & (slot >= 0), (position + 1) // RATIO, 0)
    visible = tl.minimum(visible, num_entries)  # [BLOCK_T]
    chunk_lo = i_c * chunk
    chunk_hi = tl.minimum(chunk_lo + chunk, num_entries)
    p_out = out_ptr + o_t.to(tl.int64) * num_entries  # [BLOCK_T]

    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < num_heads
    p_q = q_ptr + o_t.to(tl.int64)[None, :, None] * (num_heads * D) + o_h[None, None, :] * D  # [1, BLOCK_T, BLOCK_H]
    p_w = w_ptr + o_t.to(tl.int64)[:, None] * num_heads + o_h[None, :]  # [BLOCK_T, BLOCK_H]

    todo = visible > chunk_lo  # rows with scores in this chunk; the others (and padding rows) are only filled
    # first column of the chunk that row t's score tiles leave unwritten: the end of the last tile its segment
    # scores (computed here, not carried out of the loop below, so the compiler can see its alignment)
    same = (request[:, None] == request[None, :]) & todo[None, :]  # [BLOCK_T, BLOCK_T]
    seg_visible = tl.minimum(tl.max(tl.where(same, visible[None, :], 0), axis=1), chunk_hi)
    # (tl.where inside the cdiv: a select of the products would hide their alignment from the compiler)
    fill_from = chunk_lo + tl.cdiv(tl.where(todo, seg_visible, chunk_lo) - chunk_lo, BLOCK_J) * BLOCK_J
    while tl.sum(todo.to(tl.int32), axis=0) > 0:
        # a segment: the todo rows of the lowest request among them (one block table row, one key stream)
        seg_request = tl.min(tl.where(todo, request, 2147483647), axis=0)
        seg = todo & (request == seg_request)
        todo = todo & (request != seg_request)
        seg_slot = tl.max(tl.where(seg, slot, -1), axis=0)
        seg_hi = tl.minimum(tl.max(tl.where(seg, visible, 0), axis=0), chunk_hi)

        m_w = seg[:, None] & m_h[None, :]
        p_table = block_table_ptr + seg_slot.to(tl.int64) * table_stride
        exact = False
        if MMA8:
            # q's FP8 operand (`fp8_query_operand`, made per row before the launch); 2^c per (row, head) goes into
            # the head weights. A row whose scale is 0 failed the check: the segment takes the bf16 path
            p_q8s = q8_scale_ptr + o_t.to(tl.int64)[:, None] * num_heads + o_h[None, :]  # [BLOCK_T, BLOCK_H]
            exact = tl.min(tl.min(tl.load(p_q8s, mask=m_w, other=1.0), axis=1), axis=0) > 0
            if exact:
                o_n = tl.reshape(o_t.to(tl.int64)[:, None] * (num_heads * D) + o_h[None, :] * D,
                                 (1, BLOCK_T * BLOCK_H))
                m_n = tl.reshape(m_w, (BLOCK_T * BLOCK_H,))
                if KEY_SCALE:
                    b_q8 = q8_operand(q8_ptr + o_n, m_n, D)  # [D, BLOCK_T * BLOCK_H]
                    for j0 in range(chunk_lo, seg_hi, BLOCK_J):
                        o_j = j0 + tl.arange(0, BLOCK_J)
                        k0, k1, k2, k3, s0, s1, s2, s3 = mxfp4_tile(pool_ptr, p_table, o_j, o_j < seg_hi, D, P,
                                                                     PAGE_BYTES, DATA_BYTES, SCALE_BYTES)
                        b_k, b_ks = mxfp4_key_scale_keys(k0, k1, k2, k3, s0, s1, s2, s3, D, BLOCK_J, ASM)
                        acc = fp8_dot(b_k, b_q8, ASM)
                        b_w = tl.load(p_w, mask=m_w, other=0.0) * score_scale * tl.load(p_q8s, mask=m_w, other=0.0)
                        _store_stacked(acc, b_w, o_j, visible, p_out, seg, num_entries, BLOCK_J, BLOCK_T, BLOCK_H,
                                       b_ks)
                else:
                    b_q8_0, b_q8_1, b_q8_2, b_q8_3 = q8_blocks(q8_ptr + o_n, m_n, D)
                    for j0 in range(chunk_lo, seg_hi, BLOCK_J):
                        o_j = j0 + tl.arange(0, BLOCK_J)
                        k0, k1, k2, k3, s0, s1, s2, s3 = mxfp4_tile(pool_ptr, p_table, o_j, o_j < seg_hi, D, P,
                                                                     PAGE_BYTES, DATA_BYTES, SCALE_BYTES)
                        acc = mxfp4_fp8_dot(k0, k1, k2, k3, s0, s1, s2, s3, b_q8_0, b_q8_1, b_q8_2, b_q8_3,
                                             BLOCK_T * BLOCK_H, D, BLOCK_J, ASM)
                        b_w = tl.load(p_w, mask=m_w, other=0.0) * score_scale * tl.load(p_q8s, mask=m_w, other=0.0)
                        _store_stacked(acc, b_w, o_j, visible, p_out, seg, num_entries, BLOCK_J, BLOCK_T, BLOCK_H)
        if not exact:
            # q^T of the segment's rows stacked in N: column t * BLOCK_H + h; other rows and padded heads are zero
            m_q = seg[None, :, None] & m_h[None, None, :]
            o_d0, o_d1 = q_dims(FORMAT, D)
            # [D/2, BLOCK_T, BLOCK_H]
            b_q0 = round_bf16(tl.load(p_q + o_d0[:, None, None], mask=m_q, other=0.0).to(tl.float32))
            b_q0 = tl.reshape(b_q0, (D // 2, BLOCK_T * BLOCK_H)).to(DOT)
            b_q1 = round_bf16(tl.load(p_q + o_d1[:, None, None], mask=m_q, other=0.0).to(tl.float32))
            b_q1 = tl.reshape(b_q1, (D // 2, BLOCK_T * BLOCK_H)).to(DOT)
            for j0 in range(chunk_lo, seg_hi, BLOCK_J):
                o_j = j0 + tl.arange(0, BLOCK_J)
                b_dot = key_dot(pool_ptr, p_table, o_j, o_j < seg_hi, b_q0, b_q1, FORMAT, D, P, PAGE_BYTES,
                                 DATA_BYTES, SCALE_BYTES, BLOCK_J, DOT)  # [BLOCK_J, BLOCK_T * BLOCK_H]
                # the head weights are (re)loaded per tile (L1 hits): held across the loop they would take 64
                # registers per thread at N = 256, as many as half the accumulator; D^-0.5 folded in
                b_w = tl.load(p_w, mask=m_w, other=0.0) * score_scale  # [BLOCK_T, BLOCK_H]
                _store_stacked(b_dot, b_w, o_j, visible, p_out, seg, num_entries, BLOCK_J, BLOCK_T, BLOCK_H)

    if FILL:
        # -inf for the rest of each row's chunk (16-B vector stores when J is a multiple of 4: the masks change
        # only at multiples of BLOCK_J; the lower bound, a multiple too, is written as such for the compiler)
        for j0 in range(tl.min(fill_from, axis=0) // BLOCK_J * BLOCK_J, chunk_hi, FILL_J):
            o_f = j0 + tl.arange(0, FILL_J)
            tl.store(p_out[:, None] + o_f[None, :], tl.full((BLOCK_T, FILL_J), float("-inf"), tl.float32),
                     mask=m_t[:, None] & (o_f[None, :] >= fill_from[:, None]) & (o_f < chunk_hi)[None, :],
                     cache_modifier=".cs")


def _row_takes_fp8(fmt: int, dim: int, device: torch.device, tuning: IndexerTuning) -> bool:
    """The row kernel's host choice of the FP8 MMA path: MXFP4 keys that the FP8 paths serve, unless the config turns
    them off. Host facts only, so a captured graph keeps its choice; the wrapper's launch and `fp8_query_wanted` both
    ask here."""
    return tuning.fp8_mma and _fp8_mma_keys(fmt, dim, device)


def _iters(programs_per_chunk: int, tiles: int, device: torch.device, max_iters: int, waves: int) -> int:
    """Tiles per program: grow (q is loaded once per program) while the grid still gives every SM `waves` programs
    (latency hiding: a program's tiles run one after another)."""
    target = 1 if device.type != "cuda" else waves * sm_count(device)
    iters = 1
    while iters < max_iters and programs_per_chunk * triton.cdiv(tiles, 2 * iters) >= target:
        iters *= 2
    return iters


def _config(rows: int, entries: int, device: torch.device, tuning: IndexerTuning) -> tuple[int, int, int]:
    """Row kernel tiles: (BLOCK_J, ITERS, num_warps)."""
    t = tuning.row
    return t.block_j, _iters(rows, triton.cdiv(entries, t.block_j), device, t.max_iters, tuning.grid_waves), t.num_warps


def _fp8_mma_keys(fmt: int, dim: int, device: torch.device) -> bool:
    """Keys the FP8 MMA paths serve: MXFP4 with D <= 128, on a Hopper or later GPU (the tested target) or under the
    interpreter."""
    return fmt == KEYS_MXFP4 and dim <= 128 and (device.type != "cuda" or hopper_or_later(device))


def _stack_takes_fp8(fmt: int, dim: int, device: torch.device, tuning: IndexerTuning) -> bool:
    """The stacked kernel's host choice of the FP8 MMA path, as the row kernel's."""
    return tuning.fp8_mma and _fp8_mma_keys(fmt, dim, device)


def _stack_config(rows: int, entries: int, block_h: int, device: torch.device, tiles: Tiles,
                  waves: int) -> tuple[int, int, int, int, int]:
    """Stacked kernel tiles: (BLOCK_T, BLOCK_J, ITERS, num_warps, num_stages); BLOCK_T * block_h <= 256."""
    block_t = min(tiles.block_t, max(1, 256 // block_h))
    iters = _iters(triton.cdiv(rows, block_t), triton.cdiv(entries, tiles.block_j), device, tiles.max_iters, waves)
    return block_t, tiles.block_j, iters, tiles.num_warps, tiles.num_stages


def _stacked(plan: StepPlan, tuning: IndexerTuning) -> bool:
    """The stacked kernel when requests average at least `stack_min_rows_per_request` rows: a decode row in it costs
    an MMA and an epilogue BLOCK_T times wider than in the row kernel, a chunk's rows share their key tiles. Host
    facts only (`plan.num_tokens`, `plan.request_ids`), so the choice never reads the device."""
    return plan.num_tokens >= tuning.stack_min_rows_per_request * max(len(plan.request_ids), 1)


def counts_digits(plan: StepPlan, tuning: IndexerTuning | None = None) -> bool:
    """Whether `indexer_scores_paged` over `plan` (the automatic kernel choice, with `tuning`, default the device's)
    takes the row kernel, which can count the top-k's first digit as it writes the scores (`digit_counts=`). A host
    fact, as the wrapper's own choice."""
    return not _stacked(plan, tuning if tuning is not None else tuning_for(plan.positions.device))


def fp8_query_wanted(plan: StepPlan, layout: EntryLayout, entries: int, tuning: IndexerTuning | None = None) -> bool:
    """Whether `indexer_scores_paged` over `plan` with `entries` score columns (the automatic kernel choice, with
    `tuning`, default the device's) runs an FP8 MMA path (the row kernel's, or the stacked kernel's for prefill
    steps), which reads q's FP8 operand (`q_fp8=`). Host facts only, as the wrapper's own choice, so a caller makes
    the operand only where it is read."""
    if not isinstance(layout, IndexerMXFP4Layout) or entries <= 0:
        return False
    device = plan.positions.device
    tuning = tuning if tuning is not None else tuning_for(device)
    if _stacked(plan, tuning):
        return _stack_takes_fp8(KEYS_MXFP4, layout.dim, device, tuning)
    return _row_takes_fp8(KEYS_MXFP4, layout.dim, device, tuning)


def _q8_args(q: torch.Tensor, q_fp8: tuple[torch.Tensor, torch.Tensor] | None, mma8: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (codes, scales) an FP8 path reads: the caller's, else made here (one more launch); without the path, q twice
    as unread stand-ins."""
    if not mma8:
        return q, q
    return q_fp8 if q_fp8 is not None else indexer_query_fp8(q)


def indexer_query_fp8(q: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 MMA operand of an indexer query in MXFP4 numerics (`fp8_query_operand`, per head): fp32 or bf16 q
    [R, H, D] (D a power of two >= 32) -> (uint8 [R, H, D] e4m3 codes of q * 2^-c, fp32 [R, H] 2^c, or 0 where the
    head's values are not MXFP4-valued and exact in e4m3 after the shift: such a row takes the bf16 path)."""
    require(isinstance(q, torch.Tensor), f"q: expected a tensor, got {type(q).__name__}")
    check_tensor("q", q, dtype=(torch.float32, torch.bfloat16), shape=(None, None, None), device=q.device)
    rows, heads, dim = q.shape
    require(dim >= 32 and dim & (dim - 1) == 0, f"q: the operand needs a power-of-two dim >= 32, got {dim}")
    codes, scales = out if out is not None else (torch.empty(q.shape, dtype=torch.uint8, device=q.device),
                                                 torch.empty((rows, heads), dtype=torch.float32, device=q.device))
    check_tensor("out codes", codes, dtype=torch.uint8, shape=tuple(q.shape), device=q.device)
    check_tensor("out scales", scales, dtype=torch.float32, shape=(rows, heads), device=q.device)
    if q.numel():
        block_h = min(16, triton.next_power_of_2(heads))
        _q_fp8_kernel[(rows, triton.cdiv(heads, block_h))](q, codes, scales, H=heads, D=dim, BLOCK_H=block_h,
                                                             num_warps=4, **launch_options(q.device))
    return codes, scales


def indexer_scores_paged(q: torch.Tensor, weights: torch.Tensor, plan, key_pool: torch.Tensor, layout: EntryLayout,
                         *, ratio: int, page_tokens: int, out: torch.Tensor | None = None,
                         max_entries: int | None = None, stack_rows: bool | None = None,
                         fill: bool = False, q_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
                         digit_counts: torch.Tensor | None = None, tuning: IndexerTuning | None = None
                         ) -> torch.Tensor:
    """Indexer scores of every plan row against its request's compressed keys -> fp32 [R, J].

    Args:
        q: fp32 or bf16 [R, H, D] contiguous, R = plan.positions.shape[0] (padding rows included): the roped
            indexer query already in the keys' numerics (`ops.indexer.reference.indexer_query(q_raw, layout)`,
            whose values are bf16 values, so either dtype gives the same scores).
        weights: fp32 [R, H] contiguous, head weights already multiplied by H^-0.5.
        plan: the step's `StepPlan` (positions, token_request, request_slots, block_table are read).
        key_pool: uint8 [pages, layout.page_bytes(page_tokens // ratio)] contiguous: the CSA layer's keys, its first
            byte aligned to the widest word the kernels load (a key's scales, at most 4 bytes; 2 for bf16 keys).
        layout: `dsv4kv.cache.layout.indexer_layout("mxfp4" | "fp8" | "bf16", D)`.
        ratio: the layer's compression ratio; page_tokens: original tokens per block (a multiple of ratio).
        out: optional fp32 [R, J] contiguous, overwritten entirely (for CUDA-graph capture).
        max_entries: J when `out` is not given; default block_table.shape[1] * page_tokens // ratio. Triton
            specializes the kernels on J (== 1, a multiple of 16): a caller whose J changes from call to call keeps
            one compiled kernel by rounding it up to a multiple of 16 (the columns past visible(t) cost nothing).
        stack_rows: True = the stacked (prefill) kernel, False = the row (decode) kernel, None = the stacked
            one when the plan's requests average at least two rows (`IndexerTuning.stack_min_rows_per_request`;
            `plan.num_tokens`, `plan.request_ids`: host facts, so a captured graph replays correctly whatever the
            later plans hold).
        fill: also write -inf to every column j >= visible(t) and to padding rows. By default those columns
            are left as they were (beyond the -inf a score tile stores up to its end): top-k never reads them.

        q_fp8: `indexer_query_fp8(q)` (uint8 [R, H, D], fp32 [R, H]) when the caller already has it (the layer's
            query kernel writes it); computed here (one more launch) when the FP8 path runs without it.
        digit_counts: int32 [R, 256], rows any stride apart (`topk.first_digit_counts` of the top-k's workspace):
            each program adds the digit-1 counts of the scores it wrote (columns < visible(t) other than -inf), so
            `topk_indices(out, visible, k, first_digit_counted=True)` skips its first pass. Row kernel only
            (`counts_digits`); each warp adds its counts of a digit in one reduction, straight to the row's histogram,
            or, for scores wider than `IndexerTuning.digit_count_scratch_above` columns, to a scratch row per
            program first (allocated here).
        tuning: tiles and path choices (default: the device's, `tuning_for`).

    MXFP4 keys run on FP8 MMAs (`IndexerTuning.fp8_mma`) in the row kernel when every head of the row's q is
    MXFP4-valued (`fp8_query_operand`), and in the stacked kernel for each segment whose rows all are: by default
    under one scale per key (`IndexerTuning.fp8_key_scale`), within the tolerance the module docstring derives (2^-10
    of the size of a score's terms); with `fp8_key_scale=False` exact per scale block, the bf16 path's scores up to
    summation order.

    Returns `out`: scores for j < visible(t); -inf elsewhere with fill=True, else unspecified there.
    """
    require(isinstance(plan, StepPlan), f"plan: expected a StepPlan, got {type(plan).__name__}")
    require(tuning is None or isinstance(tuning, IndexerTuning),
            f"tuning: expected an IndexerTuning, got {type(tuning).__name__}")
    device = _check_inputs(q, weights, plan, key_pool, layout, ratio, page_tokens, stack_rows, fill, q_fp8)
    rows, heads, per_page = padded_rows(plan), q.shape[1], page_tokens // ratio
    tuning = tuning if tuning is not None else tuning_for(device)
    stacked = _stacked(plan, tuning) if stack_rows is None else stack_rows
    if digit_counts is not None:
        check_tensor("digit_counts", digit_counts, dtype=torch.int32, shape=(rows, 256), device=device,
                     contiguous=False)
        require(digit_counts.stride(1) == 1, "digit_counts: expected each row's 256 counts contiguous")
        require(not stacked, "digit_counts: only the row (decode) kernel counts digits; this call takes the stacked "
                             "kernel (see counts_digits)")
    out = _scores_out(out, max_entries, plan, rows, per_page, device)
    if rows == 0 or out.shape[1] == 0:
        return out
    meta = {"FORMAT": key_format(layout), "RATIO": ratio, "D": layout.dim, "P": per_page,
            "PAGE_BYTES": key_pool.shape[1], "DATA_BYTES": layout.data_bytes, "SCALE_BYTES": layout.scale_bytes,
            "BLOCK_H": max(16, triton.next_power_of_2(heads)),
            # Triton's interpreter multiplies the bit patterns of bf16 dot operands (triton-lang/triton#11584):
            # there the same bf16 values go through an fp32 dot, which forms the same exact products
            "DOT": tl.float32 if interpreted() else tl.bfloat16, "FILL": fill}
    args = (q, weights, plan.positions, plan.token_request, plan.request_slots, plan.block_table, key_pool, out)
    if stacked:
        _launch_stacked(args, meta, q_fp8, plan, tuning)
    else:
        _launch_row(args, meta, q_fp8, plan, digit_counts, tuning)
    return out


def _check_inputs(q, weights, plan: StepPlan, key_pool, layout: EntryLayout, ratio, page_tokens, stack_rows, fill,
                  q_fp8) -> torch.device:
    """`indexer_scores_paged`'s argument checks (but `digit_counts`, `out`, `tuning`) -> the pool's device."""
    fmt = key_format(layout)
    dim = layout.dim
    require(isinstance(ratio, int) and ratio > 0, f"ratio: expected a positive int, got {ratio!r}")
    require(isinstance(page_tokens, int) and page_tokens > 0 and page_tokens % ratio == 0,
            f"page_tokens: expected a positive multiple of ratio {ratio}, got {page_tokens!r}")
    require(dim >= 32 and dim & (dim - 1) == 0, f"layout: the kernel needs a power-of-two dim >= 32, got {dim}")
    device = key_pool.device if isinstance(key_pool, torch.Tensor) else None
    check_pool("key_pool", key_pool, layout, page_tokens // ratio, device)
    align = 2 if fmt == KEYS_BF16 else min(layout.scale_bytes, 4)  # the widest word a kernel loads from the pool
    require(key_pool.data_ptr() % align == 0,
            f"key_pool: its first byte must be aligned to {align} bytes (the kernels load a key's scales, or its bf16 "
            f"values, as words), got an address of {key_pool.data_ptr() % align} mod {align}")
    rows = padded_rows(plan)
    check_tensor("q", q, dtype=(torch.float32, torch.bfloat16), shape=(rows, None, dim), device=device)
    heads = q.shape[1]
    require(heads > 0, "q: expected at least one head")
    check_tensor("weights", weights, dtype=torch.float32, shape=(rows, heads), device=device)
    check_tensor("plan.positions", plan.positions, dtype=torch.int32, shape=(rows,), device=device)
    check_tensor("plan.token_request", plan.token_request, dtype=torch.int32, shape=(rows,), device=device)
    check_tensor("plan.request_slots", plan.request_slots, dtype=torch.int32, shape=(None,), device=device)
    check_tensor("plan.block_table", plan.block_table, dtype=torch.int32, shape=(None, None), device=device)
    require(stack_rows is None or isinstance(stack_rows, bool),
            f"stack_rows: expected True, False or None, got {stack_rows!r}")
    require(isinstance(fill, bool), f"fill: expected a bool, got {fill!r}")
    if q_fp8 is not None:
        require(isinstance(q_fp8, tuple) and len(q_fp8) == 2, "q_fp8: expected (codes, scales) from indexer_query_fp8")
        check_tensor("q_fp8 codes", q_fp8[0], dtype=torch.uint8, shape=tuple(q.shape), device=device)
        check_tensor("q_fp8 scales", q_fp8[1], dtype=torch.float32, shape=(rows, heads), device=device)
    return device


def _scores_out(out, max_entries, plan: StepPlan, rows: int, per_page: int, device: torch.device) -> torch.Tensor:
    """The caller's `out` fp32 [rows, J] (checked), or a new one of J = max_entries (default: the block table's)."""
    if out is not None:
        check_tensor("out", out, dtype=torch.float32, shape=(rows, None), device=device)
        require(max_entries is None or max_entries == out.shape[1],
                f"max_entries: {max_entries} disagrees with out's {out.shape[1]} columns")
        return out
    if max_entries is None:
        max_entries = plan.block_table.shape[1] * per_page
    require(isinstance(max_entries, int) and max_entries >= 0,
            f"max_entries: expected a non-negative int, got {max_entries!r}")
    return torch.empty((rows, max_entries), dtype=torch.float32, device=device)


def _launch_stacked(args: tuple, meta: dict, q_fp8, plan: StepPlan, tuning: IndexerTuning) -> None:
    """The stacked kernel over `args` (q, weights, the plan's tensors, the pool, out) with the shared `meta`."""
    q, out = args[0], args[-1]
    (rows, entries), heads, device = out.shape, q.shape[1], out.device
    mma8 = _stack_takes_fp8(meta["FORMAT"], meta["D"], device, tuning)
    key_scale = mma8 and tuning.fp8_key_scale
    tiles = tuning.stacked_key_scale if key_scale else tuning.stacked_fp8 if mma8 else tuning.stacked
    block_t, block_j, iters, num_warps, num_stages = _stack_config(rows, entries, meta["BLOCK_H"], device, tiles,
                                                                   tuning.grid_waves)
    chunk = block_j * iters  # a runtime int (a multiple of 16 for Triton): no compilation per chunk size
    grid = (triton.cdiv(rows, block_t), triton.cdiv(entries, chunk))
    q8, q8_scale = _q8_args(q, q_fp8, mma8)
    fill_j = min(chunk, max(block_j, tuning.fill_elems // block_t)) if meta["FILL"] else block_j
    _indexer_scores_stacked_kernel[grid](
        *args, q8, q8_scale, rows, heads, entries, plan.block_table.stride(0), meta["D"] ** -0.5, chunk, **meta,
        BLOCK_T=block_t, BLOCK_J=block_j, FILL_J=fill_j, MMA8=mma8, ASM=not interpreted(), KEY_SCALE=key_scale,
        num_warps=num_warps, num_stages=num_stages, **launch_options(device))


def _launch_row(args: tuple, meta: dict, q_fp8, plan: StepPlan, digit_counts, tuning: IndexerTuning) -> None:
    """The row kernel over `args` (as `_launch_stacked`'s), counting the top-k's first digit into `digit_counts`."""
    q, out = args[0], args[-1]
    (rows, entries), heads, device = out.shape, q.shape[1], out.device
    block_j, iters, num_warps = _config(rows, entries, device, tuning)
    chunk = block_j * iters
    grid = (rows, triton.cdiv(entries, chunk))
    mma8 = _row_takes_fp8(meta["FORMAT"], meta["D"], device, tuning)
    q8, q8_scale = _q8_args(q, q_fp8, mma8)
    cap = {"maxnreg": tuning.fp8_max_registers} if mma8 and not interpreted() else {}
    bits = device.type == "cuda" and hopper_or_later(device) and not interpreted()  # bf16x2 multiplies: sm_90
    require(digit_counts is None or tuning.count_block >= 32 * num_warps,
            f"digit_counts: a {tuning.count_block}-score tile over {num_warps} warps would replicate lanes, "
            "which the warp counts would count twice (IndexerTuning.count_block)")
    count = digit_counts is not None
    scratch = count and entries > tuning.digit_count_scratch_above
    counts = (digit_counts if count else out, digit_counts.stride(0) if count else 0,  # `out`: unread stand-ins
              torch.empty(grid[0] * grid[1] * 256, dtype=torch.int32, device=device) if scratch else out)
    # FILL_J (the chunk, a tile shape) matters only with fill: without, one kernel serves every chunk size
    _indexer_scores_kernel[grid](
        *args, q8, q8_scale, *counts, heads, entries, plan.block_table.stride(0), meta["D"] ** -0.5, chunk, **meta,
        BLOCK_J=block_j, FILL_J=chunk if meta["FILL"] else block_j, MMA8=mma8, ASM=not interpreted(), BITS=bits,
        PAGE_TILES=mma8 and tuning.page_tiles and meta["P"] % block_j == 0, COUNT=count, SCRATCH=scratch,
        COUNT_BLOCK=tuning.count_block, KEY_SCALE=mma8 and tuning.fp8_key_scale, num_warps=num_warps,
        num_stages=tuning.row.num_stages, **cap, **launch_options(device))
