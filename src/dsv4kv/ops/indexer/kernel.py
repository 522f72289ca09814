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

Two kernels compute the same function; the wrapper picks one from host facts only (`plan.num_tokens`,
the request count; `stack_rows=` overrides), so a captured CUDA graph replays either correctly over any
later plan. On their bf16 paths both split each MMA into two K = D/2 halves (a byte's low / high nibbles for
MXFP4).

Row kernel (decode: about one row per request). Grid (row, chunk of BLOCK_J * iters entries): a program
loads q[t] ([H, D] = [64, 128] for V4, as bf16 q^T) and the head weights once, then per iteration decodes
[BLOCK_J, D] keys in registers and runs a [BLOCK_J, D] x [D, H] MMA (the keys are the A operand so the
decoded registers feed it directly). Decode (R small, J up to 2^18) gets its parallelism from the chunks.

MXFP4 keys on FP8 MMAs (row kernel and, below, stacked kernel; D <= 128; `IndexerTuning.fp8_mma`).
A packed byte becomes two e4m3 bytes by moving bits (`_e2m1_e4m3`: e2m1 * 2^-6 exactly, five ALU ops per eight
values instead of ~6 per value). The query's operand is made once per row, not per program (`fp8_query_operand`:
by the layer's query kernel, or by `indexer_query_fp8` here): each head of q is shifted by its own power of two 2^-c
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
and scalings (`_mxfp4_fp8_dot`) over q's operands stacked in N, 2 rows of 64 heads. Each (key, row, head) then costs
four scaled fp32 adds on the CUDA cores where the bf16 path has none, a little less than the halved MMA time saves.

Top-k's first digit (`digit_counts`, decode). After its tiles a row-kernel program reads back the scores it stored
(after a CTA barrier, 1024 a tile so no lane is replicated) and counts their top-k digit 1 by warp into the row's
histogram in the top-k workspace (`topk.count_first_digits`), so the top-k skips its first pass.

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

from ...cache.layout import EntryLayout, IndexerFP8Layout, IndexerMXFP4Layout
from ...checks import require
from ...cache.plan import StepPlan
from ..shared.common import check_pool, hopper_or_later, interpreted, padded_rows, sm_count
from ...checks import check_tensor
from ..shared.encode import e4m3_grid_code, e4m3_round, round_bf16
from ..shared.launch import launch_options, wait_for_prior_grids
from ..topk.kernel import count_first_digits
from .tuning import IndexerTuning, Tiles, tuning_for

__all__ = ["indexer_scores_paged", "indexer_query_fp8", "fp8_query_wanted", "counts_digits"]

KEYS_BF16, KEYS_FP8, KEYS_MXFP4 = 0, 1, 2
_SIGN = tl.constexpr(-(2 ** 31))  # fp32 sign bit as an int32 constant
_E2M1_MAG = tl.constexpr(0x01C00000)  # fp32 bits 22..24
_TWO_126 = tl.constexpr(2.0 ** 126)


@triton.jit
def _ue8m0(code):
    """E8M0 byte (int32) -> fp32 2^(code - 127); 0x00 -> 2^-127 (subnormal), 0xFF -> NaN."""
    bits = tl.where(code == 0, 0x00400000, tl.where(code == 0xFF, 0x7FC00000, code << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_pair(byte):
    """Packed MXFP4 byte (int32, 0..255) -> (low nibble, high nibble) as fp32 e2m1 values, exactly.

    A code's sign to fp32 bit 31 and its 3 magnitude bits to bits 22..24 make the fp32 number value * 2^-126
    (code 1 = 0.5 lands on the subnormal 2^-127, codes >= 2 on normals), so one exact multiply by 2^126
    finishes the decode: two shifts and one and-or per value instead of a chain of selects."""
    lo = ((byte << 28) & _SIGN) | ((byte << 22) & _E2M1_MAG)
    hi = ((byte << 24) & _SIGN) | ((byte << 18) & _E2M1_MAG)
    return lo.to(tl.float32, bitcast=True) * _TWO_126, hi.to(tl.float32, bitcast=True) * _TWO_126


# `_e2m1_e4m3`'s PTX, four packed bytes per 32-bit register: sign (bit 3 -> 7) and magnitude (bits 0..2 -> 2..4) of
# the low nibbles into $0, of the high nibbles into $1
_E2M1_E4M3_ASM = tl.constexpr("""{
            .reg .b32 t0, t1;
            shl.b32 t0, $2, 4;
            and.b32 t0, t0, 0x80808080;
            shl.b32 t1, $2, 2;
            and.b32 t1, t1, 0x1C1C1C1C;
            or.b32 $0, t0, t1;
            shr.b32 t0, $2, 2;
            and.b32 t0, t0, 0x1C1C1C1C;
            and.b32 t1, $2, 0x80808080;
            or.b32 $1, t0, t1;
            }""")


@triton.jit
def _e2m1_e4m3(byte, ASM: tl.constexpr):
    """Packed MXFP4 bytes (uint8) -> (low nibble, high nibble) as e4m3 bytes (uint8) holding value * 2^-6, exactly.

    A code's bits (s e1 e0 m) move to e4m3's sign, low exponent bits and top mantissa bit: exponent field e1e0 with
    e4m3's bias 7 against e2m1's 1 is the 2^-6, and code 1 (0.5) lands on the subnormal 2^-7 as code 0 on zero.
    ASM: four bytes per 32-bit register (five ALU ops per 8 values); else the same bit moves per element (the
    interpreter runs no inline PTX)."""
    if ASM:
        return tl.inline_asm_elementwise(asm=_E2M1_E4M3_ASM, constraints="=r,=r,r", args=[byte],
                                         dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    else:
        b = byte.to(tl.int32)
        return (((b & 0x08) << 4) | ((b & 0x07) << 2)).to(tl.uint8), ((b & 0x80) | ((b & 0x70) >> 2)).to(tl.uint8)


@triton.jit
def _ue8m0_times_64(code):
    """E8M0 code (int32) -> fp32 2^(code - 127) * 2^6, as `_ue8m0(code) * 64.0` gives it (0x00 -> 2^-121, codes
    from 249 up overflow to inf, 0xFF -> NaN) in three integer ops and a select."""
    bits = tl.minimum(code + 6, 255) << 23
    return tl.where(code == 0xFF, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0_bf16(code):
    """E8M0 code (int32) -> bf16 2^(code - 127), the bits `_ue8m0` gives in fp32 (bf16 shares fp32's exponent)."""
    bits = tl.where(code == 0, 0x0040, tl.where(code == 0xFF, 0x7FC0, code << 7))
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


def _e2m1_bf16_asm() -> str:
    """`_e2m1_bf16`'s PTX: per byte pair (PRMT selector, output registers, scale register) and per nibble (mask of its
    two lanes, the multiplier that shifts its magnitude to bits 6..8 and its sign to bit 15 at once)."""
    lines = [".reg .b32 u, t, c;", "mov.b32 c, 0x7E807E80;"]  # bf16x2 2^126
    for select, (lo, hi), scale in (("0x4140", ("$0", "$2"), "$5"), ("0x4342", ("$1", "$3"), "$6")):
        lines.append(f"prmt.b32 u, $4, 0, {select};")  # two bytes to the low byte of two 16-bit lanes
        for out, mask, shift in ((lo, "0x000F000F", "0x1040"), (hi, "0x00F000F0", "0x104")):
            lines += [f"and.b32 t, u, {mask};", f"mul.lo.u32 t, t, {shift};", "and.b32 t, t, 0x81C081C0;",
                      "mul.rn.bf16x2 t, t, c;", f"mul.rn.bf16x2 {out}, t, {scale};"]
    return "{\n" + "\n".join(lines) + "\n}"


_E2M1_BF16_ASM = tl.constexpr(_e2m1_bf16_asm())


@triton.jit
def _e2m1_bf16(byte, scale):
    """Packed MXFP4 bytes (uint8) and their ue8m0 scales as bf16 (`_ue8m0_bf16`, broadcast) -> (low nibble, high
    nibble) * scale as bf16, exactly: the value of `_e2m1_pair` times the scale, with no rounding (bf16x2 multiplies
    need sm_90).

    Per two bytes, one PRMT spreads them to 16-bit lanes; per nibble pair an and, a multiply (two shifts at once:
    magnitude to bits 6..8, sign to bit 15, the lanes 16 bits apart) and an and make bf16 bits worth value * 2^-126
    (code 1 a subnormal, as in `_e2m1_pair`); two bf16x2 multiplies by 2^126 and by the scale finish it (powers of
    two: exact, or inf where fp32 overflows too). About 2.75 instructions per value against ~7 through fp32."""
    return tl.inline_asm_elementwise(asm=_E2M1_BF16_ASM, constraints="=r,=r,=r,=r,r,r,r", args=[byte, scale],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def fp8_query_operand(q):
    """An MXFP4-valued query's heads as FP8 MMA operands: q fp32 [BLOCK_H, NB, 32] (heads, 32-value scale blocks) ->
    (e4m3 codes uint8 [BLOCK_H, NB, 32] of q * 2^-c, per head 2^c fp32 [BLOCK_H], or 0 where the head breaks the FP8
    path's exactness). 2^c = 2^(e - 8), e the exponent of the head's largest |q|: the largest e2m1 value (1.5 * 2^e)
    becomes 384 <= 448 and values down to ~2^(e - 17) stay on the e4m3 grid.
    Exact means each nonzero value a normal number of at most 2 significant bits and at least 1/12 of its block's
    largest (so a block's 32 products with e2m1 keys share a quantum and sum within 13 bits), and q * 2^-c on the e4m3
    grid (no rounding, no underflow; inf and NaN fail)."""
    mag = tl.abs(q)
    block_max = tl.max(mag, axis=2)  # [BLOCK_H, NB]
    biased = (tl.max(block_max, axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF
    biased = tl.minimum(tl.maximum(biased, 9), 254)  # 2^-c and 2^c stay normal fp32 numbers
    shift = ((262 - biased) << 23).to(tl.float32, bitcast=True)  # 2^-c = 2^(135 - biased)
    two_c = ((biased - 8) << 23).to(tl.float32, bitcast=True)
    y = q * shift[:, None, None]
    bits = q.to(tl.int32, bitcast=True)
    normal_2bit = ((bits & 0x7F800000) != 0) & ((bits & 0x003FFFFF) == 0)
    mxfp4 = (q == 0) | (normal_2bit & (mag * 12 >= block_max[:, :, None]))
    # on the e4m3 grid, and back to q exactly (a value that underflowed fp32 under the shift is not)
    ok = mxfp4 & (tl.abs(y) <= 448.0) & (e4m3_round(y) == y) & (y * two_c[:, None, None] == q)
    exact = tl.min(tl.min(ok.to(tl.int32), axis=2), axis=1) == 1
    return e4m3_grid_code(tl.where(ok, y, 0.0)).to(tl.uint8), tl.where(exact, two_c, 0.0)


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
def _q8_blocks(p_q8, m_h, D: tl.constexpr):
    """q's FP8 MMA operand (`fp8_query_operand`'s codes at p_q8 [1, BLOCK_H] head pointers) -> q^T per 32-dim scale
    block [32, BLOCK_H] as e4m3, even dims first (the keys' order), x 4 (blocks past D/32 repeat block 0, unused)."""
    o_k = (tl.arange(0, 32) % 16) * 2 + tl.arange(0, 32) // 16  # even dims of a block, then odd
    o_k1, o_k2, o_k3 = o_k + 32 * (D >= 64), o_k + 64 * (D >= 128), o_k + 96 * (D >= 128)  # past D: block 0 again
    b_q0 = tl.load(p_q8 + o_k[:, None], mask=m_h[None, :], other=0).to(tl.float8e4nv, bitcast=True)
    b_q1 = tl.load(p_q8 + o_k1[:, None], mask=m_h[None, :], other=0).to(tl.float8e4nv, bitcast=True)
    b_q2 = tl.load(p_q8 + o_k2[:, None], mask=m_h[None, :], other=0).to(tl.float8e4nv, bitcast=True)
    b_q3 = tl.load(p_q8 + o_k3[:, None], mask=m_h[None, :], other=0).to(tl.float8e4nv, bitcast=True)
    return b_q0, b_q1, b_q2, b_q3


@triton.jit
def _page_base(pool_ptr, block, PAGE_BYTES: tl.constexpr):
    """The first byte of page `block` (-1 where unallocated: never dereferenced, its loads are masked)."""
    return pool_ptr + block.to(tl.int64) * PAGE_BYTES


@triton.jit
def _entry_addresses(pool_ptr, p_table, o_j, m_j, P: tl.constexpr, PAGE_BYTES: tl.constexpr):
    """Entries o_j of the request whose block-table row is p_table -> (mask: wanted and allocated, the first byte of
    each entry's page, each entry's row in its page)."""
    block = tl.load(p_table + o_j // P, mask=m_j, other=-1)
    return m_j & (block >= 0), _page_base(pool_ptr, block, PAGE_BYTES), o_j % P


@triton.jit
def _mxfp4_values(p_page, o_row, m_j, D: tl.constexpr, DATA_BYTES: tl.constexpr):
    """The packed values of the entries at rows o_row [BLOCK_J] of their pages p_page (one page, or one per entry):
    per 32-dim scale block [BLOCK_J, 16] uint8 (blocks past D/32 repeat block 0, unused; masked entries zeros)."""
    p_data = (p_page + o_row * DATA_BYTES)[:, None] + tl.arange(0, 16)[None, :]
    k0 = tl.load(p_data, mask=m_j[:, None], other=0)
    k1, k2, k3 = k0, k0, k0
    if D >= 64:
        k1 = tl.load(p_data + 16, mask=m_j[:, None], other=0)
    if D >= 128:
        k2 = tl.load(p_data + 32, mask=m_j[:, None], other=0)
        k3 = tl.load(p_data + 48, mask=m_j[:, None], other=0)
    return k0, k1, k2, k3


@triton.jit
def _scale_words(p_page, o_row, m_j, P: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """The ue8m0 codes of the entries at rows o_row of their pages p_page as one int32 word per key, byte b block
    b's code (masked entries 127: scale 2^0). The scale rows follow the P data rows and SCALE_BYTES (1, 2 or 4)
    divides both offsets, so with the pool's base aligned to SCALE_BYTES (`indexer_scores_paged` checks it) the
    loads are aligned. (The pointer is cast before the row is added: a byte offset per entry made the FP8 path
    spill where p_page is one page.)"""
    p_rows = p_page + P * DATA_BYTES
    if SCALE_BYTES == 4:
        word = tl.load(p_rows.to(tl.pointer_type(tl.int32)) + o_row, mask=m_j, other=0x7F7F7F7F)
    elif SCALE_BYTES == 2:
        word = tl.load(p_rows.to(tl.pointer_type(tl.int16)) + o_row, mask=m_j, other=0x7F7F).to(tl.int32)
    else:
        word = tl.load(p_rows + o_row, mask=m_j, other=127).to(tl.int32)
    return word


@triton.jit
def _scale_codes(words, D: tl.constexpr):
    """`_scale_words` -> the code of each 32-dim scale block (int32; blocks past D/32 repeat block 0, unused)."""
    s0 = words & 0xFF
    s1, s2, s3 = s0, s0, s0
    if D >= 64:
        s1 = (words >> 8) & 0xFF
    if D >= 128:
        s2 = (words >> 16) & 0xFF
        s3 = (words >> 24) & 0xFF
    return s0, s1, s2, s3


@triton.jit
def _mxfp4_tile(pool_ptr, p_table, o_j, m_j, D: tl.constexpr, P: tl.constexpr, PAGE_BYTES: tl.constexpr,
                DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """The MXFP4 bytes of entries o_j, each reading its block id: `_mxfp4_values` and `_scale_codes`. Masked or
    unallocated entries: zeros, scale 2^0."""
    m_j, p_page, o_row = _entry_addresses(pool_ptr, p_table, o_j, m_j, P, PAGE_BYTES)
    k0, k1, k2, k3 = _mxfp4_values(p_page, o_row, m_j, D, DATA_BYTES)
    s0, s1, s2, s3 = _scale_codes(_scale_words(p_page, o_row, m_j, P, DATA_BYTES, SCALE_BYTES), D)
    return k0, k1, k2, k3, s0, s1, s2, s3


@triton.jit
def _page_tile_mask(block, o_page, m_j):
    """m_j, and false where the page is unallocated (block -1)."""
    return m_j & (o_page * 0 + block >= 0)  # a tensor compare (under the interpreter a scalar's & gives no bool)


@triton.jit
def _mxfp4_page_data(pool_ptr, block, o_page, m_j, D: tl.constexpr, PAGE_BYTES: tl.constexpr,
                     DATA_BYTES: tl.constexpr):
    """`_mxfp4_values` of entries o_page (rows within one page, int32) of page `block` (a scalar, -1 where
    unallocated): one 64-bit page address per tile instead of one block-table read per entry."""
    return _mxfp4_values(_page_base(pool_ptr, block, PAGE_BYTES), o_page, _page_tile_mask(block, o_page, m_j), D,
                         DATA_BYTES)


@triton.jit
def _mxfp4_page_scales(pool_ptr, block, o_page, m_j, P: tl.constexpr, PAGE_BYTES: tl.constexpr,
                       DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """`_scale_words` of entries o_page of page `block`."""
    return _scale_words(_page_base(pool_ptr, block, PAGE_BYTES), o_page, _page_tile_mask(block, o_page, m_j), P,
                        DATA_BYTES, SCALE_BYTES)


@triton.jit
def _mxfp4_block_mma(b_byte, code, b_q8, acc, BLOCK_J: tl.constexpr, ASM: tl.constexpr):
    """acc + (one scale block of the keys, as e4m3 values * 2^-6) x (that block of q's operand) * (the keys' ue8m0
    scales * 2^6): one K = 32 FP8 MMA from a zero accumulator, then one exact power-of-two scaling added in
    fp32 (terms at the reference's magnitude times each head's 2^-c, which its weight undoes). The 32 products of
    e2m1 pairs are multiples of 1/4 of their common scale (q's block scale and the shifts) and sum below 2^11 of it:
    13 significant bits, exact within the ~14 that Hopper's FP8 accumulation keeps (each MMA starts from zero, so no
    other block's sum passes through it)."""
    b_lo, b_hi = _e2m1_e4m3(b_byte, ASM)
    # dims in `_q8_blocks`'s order: the block's low nibbles (even dims), then its high nibbles (odd dims); the
    # natural order would interleave bytes (a PRMT per pair of values)
    b_k = tl.reshape(tl.permute(tl.join(b_lo, b_hi), (0, 2, 1)), (BLOCK_J, 32)).to(tl.float8e4nv, bitcast=True)
    b_sc = _ue8m0_times_64(code.to(tl.int32))
    if ASM:
        part = tl.dot(b_k, b_q8)
    else:  # the interpreter: the same exact products and sums through an fp32 dot
        part = tl.dot(b_k.to(tl.float32), b_q8.to(tl.float32))
    return acc + part * b_sc[:, None]


@triton.jit
def _mxfp4_fp8_dot(k0, k1, k2, k3, s0, s1, s2, s3, b_q0, b_q1, b_q2, b_q3, N: tl.constexpr, D: tl.constexpr,
                   BLOCK_J: tl.constexpr, ASM: tl.constexpr):
    """A tile's MXFP4 keys (`_mxfp4_tile`'s bytes and codes per scale block) times q's FP8 operand [32, N] per block
    -> fp32 [BLOCK_J, N]: the sum over scale blocks, in block order, of exact per-block MMAs (`_mxfp4_block_mma`)."""
    acc = _mxfp4_block_mma(k0, s0, b_q0, tl.zeros((BLOCK_J, N), dtype=tl.float32), BLOCK_J, ASM)
    if D >= 64:
        acc = _mxfp4_block_mma(k1, s1, b_q1, acc, BLOCK_J, ASM)
    if D >= 128:
        acc = _mxfp4_block_mma(k2, s2, b_q2, acc, BLOCK_J, ASM)
        acc = _mxfp4_block_mma(k3, s3, b_q3, acc, BLOCK_J, ASM)
    return acc


@triton.jit
def _mxfp4_fp8_scores(pool_ptr, p_table, p_out, chunk_lo, hi, visible, num_entries, b_w, b_q0, b_q1, b_q2, b_q3,
                      D: tl.constexpr, P: tl.constexpr, PAGE_BYTES: tl.constexpr, DATA_BYTES: tl.constexpr,
                      SCALE_BYTES: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr, ASM: tl.constexpr,
                      PAGE_TILES: tl.constexpr):
    """Scores of entries chunk_lo..hi-1 of one row against MXFP4 keys on FP8 MMAs: per tile, the sum over scale
    blocks, in block order, of exact per-block MMAs (`_mxfp4_block_mma`), then ReLU and the head weights.
    PAGE_TILES (every tile within one page, P % BLOCK_J == 0): a tile is addressed from its page, its block id read
    one tile before its bytes and its scale words one tile before their use (a scalar and a word per key row a thread
    holds). Its values are loaded in their own iteration: held a tile ahead in registers they would spill under the
    register cap (`IndexerTuning.fp8_max_registers`)."""
    o_b = tl.arange(0, BLOCK_J)
    if PAGE_TILES:
        block = tl.load(p_table + chunk_lo // P)
        words = _mxfp4_page_scales(pool_ptr, block, chunk_lo % P + o_b, chunk_lo + o_b < hi, P, PAGE_BYTES,
                                   DATA_BYTES, SCALE_BYTES)
        block_next = tl.load(p_table + tl.minimum(chunk_lo + BLOCK_J, hi - 1) // P)
    for j0 in range(chunk_lo, hi, BLOCK_J):
        o_j = j0 + o_b
        if PAGE_TILES:
            k0, k1, k2, k3 = _mxfp4_page_data(pool_ptr, block, j0 % P + o_b, o_j < hi, D, PAGE_BYTES, DATA_BYTES)
            s0, s1, s2, s3 = _scale_codes(words, D)
            j1 = j0 + BLOCK_J  # the next tile: its scale words now, the block id of the one after it
            words = _mxfp4_page_scales(pool_ptr, block_next, j1 % P + o_b, j1 + o_b < hi, P, PAGE_BYTES, DATA_BYTES,
                                       SCALE_BYTES)
            block = block_next
            block_next = tl.load(p_table + tl.minimum(j1 + BLOCK_J, hi - 1) // P)
        else:
            k0, k1, k2, k3, s0, s1, s2, s3 = _mxfp4_tile(pool_ptr, p_table, o_j, o_j < hi, D, P, PAGE_BYTES,
                                                         DATA_BYTES, SCALE_BYTES)
        acc = _mxfp4_fp8_dot(k0, k1, k2, k3, s0, s1, s2, s3, b_q0, b_q1, b_q2, b_q3, BLOCK_H, D, BLOCK_J, ASM)
        b_s = tl.sum(_relu(acc) * b_w[None, :], axis=1)
        tl.store(p_out + o_j, tl.where(o_j < visible, b_s, float("-inf")), mask=o_j < num_entries)


@triton.jit
def _key_dot(pool_ptr, p_table, o_j, m_j, b_q0, b_q1,
             FORMAT: tl.constexpr, D: tl.constexpr, P: tl.constexpr, PAGE_BYTES: tl.constexpr,
             DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, BLOCK_J: tl.constexpr, DOT: tl.constexpr,
             BITS: tl.constexpr = False):
    """Keys of entries o_j [BLOCK_J] of the request whose block-table row is p_table, decoded in registers,
    times the query -> fp32 [BLOCK_J, N]. b_q0 / b_q1: bf16 q^T [D/2, N] at the dims `_q_dims` gives (two
    K = D/2 MMAs). Masked or unallocated entries decode to 0 and are never loaded."""
    m_j, p_page, o_row = _entry_addresses(pool_ptr, p_table, o_j, m_j, P, PAGE_BYTES)
    p_data, p_scale = p_page + o_row * DATA_BYTES, p_page + P * DATA_BYTES + o_row * SCALE_BYTES
    if FORMAT == 2:
        # [BLOCK_J, D/32 scale blocks, 16 bytes = 32 values]
        o_nb = tl.arange(0, D // 32)
        o_nib = tl.arange(0, 16)
        b_byte = tl.load(p_data[:, None, None] + o_nb[None, :, None] * 16 + o_nib[None, None, :],
                         mask=m_j[:, None, None], other=0)
        b_code = tl.load(p_scale[:, None] + o_nb[None, :], mask=m_j[:, None], other=127).to(tl.int32)
        if BITS:  # straight to bf16 by bit moves (DOT is bf16 on the GPU)
            b_lo, b_hi = _e2m1_bf16(b_byte, tl.broadcast_to(_ue8m0_bf16(b_code)[:, :, None], (BLOCK_J, D // 32, 16)))
            b_lo = tl.reshape(b_lo, (BLOCK_J, D // 2))
            b_hi = tl.reshape(b_hi, (BLOCK_J, D // 2))
        else:
            b_sc = _ue8m0(b_code)[:, :, None]
            b_lo, b_hi = _e2m1_pair(b_byte.to(tl.int32))
            # e2m1 times a power of two: exact in fp32 (or inf / NaN, as in the reference) and in bf16
            b_lo = tl.reshape(b_lo * b_sc, (BLOCK_J, D // 2)).to(DOT)
            b_hi = tl.reshape(b_hi * b_sc, (BLOCK_J, D // 2)).to(DOT)
        b_dot = tl.dot(b_lo, b_q0)
        b_dot = tl.dot(b_hi, b_q1, b_dot)
    elif FORMAT == 1:
        p_k = p_data[:, None] + tl.arange(0, D // 2)[None, :]
        b_k0 = tl.load(p_k, mask=m_j[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(DOT)
        b_k1 = tl.load(p_k + D // 2, mask=m_j[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(DOT)
        b_ks = tl.load(p_scale.to(tl.pointer_type(tl.float32)), mask=m_j, other=0.0)
        b_dot = tl.dot(b_k1, b_q1, tl.dot(b_k0, b_q0)) * b_ks[:, None]  # a power-of-two scale: exact
    else:
        p_k = p_data.to(tl.pointer_type(tl.bfloat16))[:, None] + tl.arange(0, D // 2)[None, :]
        b_k0 = tl.load(p_k, mask=m_j[:, None], other=0.0).to(DOT)
        b_k1 = tl.load(p_k + D // 2, mask=m_j[:, None], other=0.0).to(DOT)
        b_dot = tl.dot(b_k1, b_q1, tl.dot(b_k0, b_q0))
    return b_dot


@triton.jit
def _q_dims(FORMAT: tl.constexpr, D: tl.constexpr):
    """The q dims of the two K = D/2 halves [D/2]: even / odd for MXFP4 (they meet a key byte's low / high
    nibbles), first / second half otherwise. Halves also halve the registers a q tile passes through on its
    way to shared memory (128 per thread for 4 rows of 64 heads)."""
    o_d = tl.arange(0, D // 2)
    if FORMAT == 2:
        return 2 * o_d, 2 * o_d + 1
    else:
        return o_d, o_d + D // 2


@triton.jit
def _relu(x):
    """max(x, 0) that keeps NaN, like torch.relu (one max.NaN on the GPU)."""
    return tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)


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
    COUNT: tl.constexpr, SCRATCH: tl.constexpr, COUNT_BLOCK: tl.constexpr,
):
    """The row kernel: one token row, one chunk of `chunk` entries (a multiple of BLOCK_J). MMA8: MXFP4 keys on FP8
    MMAs (`_mxfp4_fp8_scores`) when every head of the row's query passed `fp8_query_operand`'s check, else the bf16
    path. COUNT: then the top-k's digit 1 of the chunk's scores into the row's histogram (`count_first_digits`)."""
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
                b_q8_0, b_q8_1, b_q8_2, b_q8_3 = _q8_blocks(q8_ptr + t * num_heads * D + o_h[None, :] * D, m_h, D)
                _mxfp4_fp8_scores(pool_ptr, p_table, p_out, chunk_lo, tl.minimum(chunk_hi, visible), visible,
                                  num_entries, b_w * q_scale, b_q8_0, b_q8_1, b_q8_2, b_q8_3, D, P, PAGE_BYTES,
                                  DATA_BYTES, SCALE_BYTES, BLOCK_J, BLOCK_H, ASM, PAGE_TILES)
        if not exact:
            o_d0, o_d1 = _q_dims(FORMAT, D)
            # [D/2, BLOCK_H]
            b_q0 = round_bf16(tl.load(p_q + o_d0[:, None], mask=m_h[None, :], other=0.0).to(tl.float32)).to(DOT)
            b_q1 = round_bf16(tl.load(p_q + o_d1[:, None], mask=m_h[None, :], other=0.0).to(tl.float32)).to(DOT)
            for j0 in range(chunk_lo, tl.minimum(chunk_hi, visible), BLOCK_J):
                o_j = j0 + tl.arange(0, BLOCK_J)
                b_dot = _key_dot(pool_ptr, p_table, o_j, o_j < visible, b_q0, b_q1, FORMAT, D, P, PAGE_BYTES,
                                 DATA_BYTES, SCALE_BYTES, BLOCK_J, DOT, BITS)  # [BLOCK_J, BLOCK_H]
                b_s = tl.sum(_relu(b_dot) * b_w[None, :], axis=1)
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
                   BLOCK_H: tl.constexpr):
    """The stacked kernel's epilogue: ReLU of the dots [BLOCK_J, BLOCK_T * BLOCK_H], the head weights b_w
    [BLOCK_T, BLOCK_H] (D^-0.5 folded in), the sum over heads, -inf past each row's visible count; stored for the
    segment's rows."""
    b_dot = tl.reshape(_relu(b_dot), (BLOCK_J, BLOCK_T, BLOCK_H))
    b_s = tl.sum(b_dot * b_w[None, :, :], axis=2)  # [BLOCK_J, BLOCK_T]
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
    FILL: tl.constexpr, MMA8: tl.constexpr = False, ASM: tl.constexpr = False,
):
    """The stacked kernel: BLOCK_T consecutive token rows, one chunk of `chunk` entries (a multiple of BLOCK_J).
    MMA8: a segment whose rows' queries all passed `fp8_query_operand`'s check runs MXFP4 keys on FP8 MMAs
    (`_mxfp4_block_mma`, q's operand stacked in N as on the bf16 path); any other segment takes the bf16 path."""
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
                b_q8_0, b_q8_1, b_q8_2, b_q8_3 = _q8_blocks(q8_ptr + o_n, tl.reshape(m_w, (BLOCK_T * BLOCK_H,)), D)
                for j0 in range(chunk_lo, seg_hi, BLOCK_J):
                    o_j = j0 + tl.arange(0, BLOCK_J)
                    k0, k1, k2, k3, s0, s1, s2, s3 = _mxfp4_tile(pool_ptr, p_table, o_j, o_j < seg_hi, D, P,
                                                                 PAGE_BYTES, DATA_BYTES, SCALE_BYTES)
                    acc = _mxfp4_fp8_dot(k0, k1, k2, k3, s0, s1, s2, s3, b_q8_0, b_q8_1, b_q8_2, b_q8_3,
                                         BLOCK_T * BLOCK_H, D, BLOCK_J, ASM)
                    b_w = tl.load(p_w, mask=m_w, other=0.0) * score_scale * tl.load(p_q8s, mask=m_w, other=0.0)
                    _store_stacked(acc, b_w, o_j, visible, p_out, seg, num_entries, BLOCK_J, BLOCK_T, BLOCK_H)
        if not exact:
            # q^T of the segment's rows stacked in N: column t * BLOCK_H + h; other rows and padded heads are zero
            m_q = seg[None, :, None] & m_h[None, None, :]
            o_d0, o_d1 = _q_dims(FORMAT, D)
            # [D/2, BLOCK_T, BLOCK_H]
            b_q0 = round_bf16(tl.load(p_q + o_d0[:, None, None], mask=m_q, other=0.0).to(tl.float32))
            b_q0 = tl.reshape(b_q0, (D // 2, BLOCK_T * BLOCK_H)).to(DOT)
            b_q1 = round_bf16(tl.load(p_q + o_d1[:, None, None], mask=m_q, other=0.0).to(tl.float32))
            b_q1 = tl.reshape(b_q1, (D // 2, BLOCK_T * BLOCK_H)).to(DOT)
            for j0 in range(chunk_lo, seg_hi, BLOCK_J):
                o_j = j0 + tl.arange(0, BLOCK_J)
                b_dot = _key_dot(pool_ptr, p_table, o_j, o_j < seg_hi, b_q0, b_q1, FORMAT, D, P, PAGE_BYTES,
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


def key_format(layout: EntryLayout) -> int:
    if isinstance(layout, IndexerMXFP4Layout):
        return KEYS_MXFP4
    if isinstance(layout, IndexerFP8Layout):
        require(layout.scale_bytes == 4, f"layout: fp8 keys need one fp32 scale (4 B), got {layout.scale_bytes} B")
        return KEYS_FP8
    require(type(layout) is EntryLayout and layout.scale_bytes == 0 and layout.data_bytes == 2 * layout.dim
            and not layout.rotated,
            f"layout: expected an indexer layout (dsv4kv.layout.indexer_layout: mxfp4, fp8 or bf16), got {layout!r}")
    return KEYS_BF16


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
    MXFP4-valued (`fp8_query_operand`), and in the stacked kernel for each segment whose rows all are; the scores are
    those of the bf16 path up to summation order.

    Returns `out`: scores for j < visible(t); -inf elsewhere with fill=True, else unspecified there.
    """
    require(isinstance(plan, StepPlan), f"plan: expected a StepPlan, got {type(plan).__name__}")
    require(tuning is None or isinstance(tuning, IndexerTuning),
            f"tuning: expected an IndexerTuning, got {type(tuning).__name__}")
    fmt = key_format(layout)
    dim = layout.dim
    require(isinstance(ratio, int) and ratio > 0, f"ratio: expected a positive int, got {ratio!r}")
    require(isinstance(page_tokens, int) and page_tokens > 0 and page_tokens % ratio == 0,
            f"page_tokens: expected a positive multiple of ratio {ratio}, got {page_tokens!r}")
    require(dim >= 32 and dim & (dim - 1) == 0, f"layout: the kernel needs a power-of-two dim >= 32, got {dim}")
    device = key_pool.device if isinstance(key_pool, torch.Tensor) else None
    per_page = page_tokens // ratio
    check_pool("key_pool", key_pool, layout, per_page, device)
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
    tuning = tuning if tuning is not None else tuning_for(device)
    stacked = _stacked(plan, tuning) if stack_rows is None else stack_rows
    if digit_counts is not None:
        check_tensor("digit_counts", digit_counts, dtype=torch.int32, shape=(rows, 256), device=device,
                     contiguous=False)
        require(digit_counts.stride(1) == 1, "digit_counts: expected each row's 256 counts contiguous")
        require(not stacked, "digit_counts: only the row (decode) kernel counts digits; this call takes the stacked "
                             "kernel (see counts_digits)")
    if out is not None:
        check_tensor("out", out, dtype=torch.float32, shape=(rows, None), device=device)
        require(max_entries is None or max_entries == out.shape[1],
                f"max_entries: {max_entries} disagrees with out's {out.shape[1]} columns")
        entries = out.shape[1]
    else:
        if max_entries is None:
            max_entries = plan.block_table.shape[1] * per_page
        require(isinstance(max_entries, int) and max_entries >= 0,
                f"max_entries: expected a non-negative int, got {max_entries!r}")
        entries = max_entries
        out = torch.empty((rows, entries), dtype=torch.float32, device=device)
    if rows == 0 or entries == 0:
        return out

    block_h = max(16, triton.next_power_of_2(heads))
    common = {"FORMAT": fmt, "RATIO": ratio, "D": dim, "P": per_page, "PAGE_BYTES": key_pool.shape[1],
              "DATA_BYTES": layout.data_bytes, "SCALE_BYTES": layout.scale_bytes, "BLOCK_H": block_h,
              # Triton's interpreter multiplies the bit patterns of bf16 dot operands (triton-lang/triton#11584):
              # there the same bf16 values go through an fp32 dot, which forms the same exact products
              "DOT": tl.float32 if interpreted() else tl.bfloat16, "FILL": fill}
    args = (q, weights, plan.positions, plan.token_request, plan.request_slots, plan.block_table, key_pool, out)
    if stacked:
        mma8 = _stack_takes_fp8(fmt, dim, device, tuning)
        block_t, block_j, iters, num_warps, num_stages = _stack_config(
            rows, entries, block_h, device, tuning.stacked_fp8 if mma8 else tuning.stacked, tuning.grid_waves)
        chunk = block_j * iters  # a runtime int (a multiple of 16 for Triton): no compilation per chunk size
        grid = (triton.cdiv(rows, block_t), triton.cdiv(entries, chunk))
        q8, q8_scale = _q8_args(q, q_fp8, mma8)
        _indexer_scores_stacked_kernel[grid](
            *args, q8, q8_scale, rows, heads, entries, plan.block_table.stride(0), dim ** -0.5, chunk, **common,
            BLOCK_T=block_t, BLOCK_J=block_j,
            FILL_J=min(chunk, max(block_j, tuning.fill_elems // block_t)) if fill else block_j, MMA8=mma8,
            ASM=not interpreted(), num_warps=num_warps, num_stages=num_stages, **launch_options(device))
    else:
        block_j, iters, num_warps = _config(rows, entries, device, tuning)
        chunk = block_j * iters
        grid = (rows, triton.cdiv(entries, chunk))
        mma8 = _row_takes_fp8(fmt, dim, device, tuning)
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
        _indexer_scores_kernel[grid](*args, q8, q8_scale, *counts, heads, entries, plan.block_table.stride(0),
                                     dim ** -0.5, chunk,
                                     **common, BLOCK_J=block_j, FILL_J=chunk if fill else block_j, MMA8=mma8,
                                     ASM=not interpreted(), BITS=bits,
                                     PAGE_TILES=mma8 and tuning.page_tiles and per_page % block_j == 0,
                                     COUNT=count, SCRATCH=scratch, COUNT_BLOCK=tuning.count_block,
                                     num_warps=num_warps,
                                     num_stages=tuning.row.num_stages,
                                     **cap, **launch_options(device))
    return out
