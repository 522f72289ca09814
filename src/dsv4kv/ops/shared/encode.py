"""Triton device functions that encode entries into the cache's byte formats (`dsv4kv.cache.layout`), bit for bit.

Every rounding is exact in both Triton's interpreter and on the GPU: the interpreter truncates fp32 -> bf16 / e4m3
casts where the GPU rounds to nearest even, and the same code must give the same bytes in both. So values are
first rounded in fp32 (bf16: on the integer bits; e4m3: by adding and subtracting a constant c >= 2^23 grid steps,
which IEEE fp32 addition rounds to nearest even in both, see `e4m3_round`), and only values already on the target
grid are cast (exact everywhere; on the GPU one `cvt.rn.satfinite.e4m3x2` per two values). About 8.5 instructions
per e4m3 value (the integer-only encoder before was ~30). bf16 bytes are the top half of the fp32 bits, stored as
int16, so NaN payloads pass unchanged. Scales follow `quant.pow2_scale`: s = 2^ceil(log2(max(amax, 1e-4) / qmax)),
computed from the exponent and mantissa of max(amax, 1e-4) with no division (exact; see `pow2_exponent`).

Every function works on rows: a leading dimension R of entries (one program encodes R entries at once, so
the loads and stores are wide and the bit operations of different rows interleave). Main entries come as fp32
tiles [R, D // 64, 64] (block i = dims 64i .. 64i + 63) plus the rope dims [R, 64]; indexer keys as [R, D].
Non-finite blocks (a NaN or an inf anywhere in the block) get the NaN scale code 0xFF, as the reference does;
their e4m3 data bytes are 0x7F (e4m3 NaN) where the reference's may carry a sign, their e2m1 codes +0 as the
reference's.
"""

from __future__ import annotations

import triton
import triton.language as tl

SCALE_EPS = tl.constexpr(1e-4)  # quant.SCALE_EPS (a constexpr: jit code reads no other globals)


def program_rows(n: int, rows: int, programs: int) -> int:
    """Rows (entries) per program for n rows: `rows`, halved while the launch would have fewer than `programs`
    programs (an op's `spread_programs`), so a small launch (a decode step) spreads over the SMs in short programs
    instead of queueing its rows in a few long ones. A function of the host-side n only: a captured graph keeps its
    choice."""
    while rows > 1 and -(-n // rows) < programs:
        rows //= 2
    return rows


@triton.jit
def round_bf16(x):
    """fp32 -> fp32 holding x rounded to bf16, nearest even (NaN stays NaN)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # 0xFFFF0000
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))


@triton.jit
def bf16_bits(x):
    """bf16-valued fp32 x -> its bf16 bits as int16: the top half of the fp32 bits (exact; NaN payloads kept)."""
    return (x.to(tl.int32, bitcast=True) >> 16).to(tl.int16)


@triton.jit
def as_int16(ptr):
    """A uint8 pointer (2-byte aligned) as an int16 pointer: add element offsets after the cast, so the compiler sees
    contiguous int16 stores and vectorizes them."""
    return ptr.to(tl.pointer_type(tl.int16))


@triton.jit
def pow2_exponent(amax, QMAX_EXP: tl.constexpr, QMAX_MANT: tl.constexpr):
    """e with 2^e = quant.pow2_scale(amax, qmax), qmax = (1 + QMAX_MANT / 2^23) * 2^QMAX_EXP.

    a = max(amax, eps) = m * 2^e0 (m in [1, 2)): a / qmax <= 2^(e0 - QMAX_EXP) iff m <= qmax's mantissa, so
    e = e0 - QMAX_EXP + (mantissa(a) > mantissa(qmax)); clamped like the reference's biased exponent 1..254.
    Returns (e, finite)."""
    a = tl.maximum(amax, SCALE_EPS)
    bits = a.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - QMAX_EXP + ((bits & 0x7FFFFF) > QMAX_MANT).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -126), 127)
    finite = (amax == amax) & (amax < float("inf"))
    return e, finite


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def nan_amax(x, axis: tl.constexpr):
    """max |x| along `axis`, NaN where a NaN is among them (tl.max drops NaNs, and a block holding one must still get
    the NaN scale); one NaN-propagating max per value (`max.NaN.f32`, the abs a free operand modifier)."""
    return tl.reduce(tl.abs(x), axis, _max_nan)


@triton.jit
def exp2_int(e):
    """fp32 2^e for an int32 e in -126..127 (exact, from the bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_round(y, BF16_VALUED: tl.constexpr = False):
    """fp32 y, |y| <= 448 -> fp32 on the float8_e4m3fn grid, round to nearest even; -0 where a negative y rounds to
    zero (as torch's cast).

    The grid step at |y| is ulp = 2^(max(e, -6) - 3) (e = floor(log2 |y|); below 2^-6 the subnormal step 2^-9).
    For c in [2^23, 2^24) ulp with |y| + c below 2^24 ulp, fp32's own step at |y| + c is ulp: the addition rounds
    |y| to the grid, to nearest even when c / ulp is even, and subtracting c is exact. The sign bit is or-ed back
    (x - x is +0).
    - In general c = 1.5 * 2^23 ulp: the exponent field of max(|y|, 2^-6) plus 20, mantissa 0x400000 (|y| < 16 ulp
      keeps |y| + c below 2^24 ulp).
    - BF16_VALUED (y = a bf16 value times a power of two: a mantissa m of 7 bits): c = max(|y|, 2^-6) * 2^20 =
      m * 2^23 ulp, even, and |y| + c = c (1 + 2^-20) < 2^24 ulp as m <= 2 - 2^-7. One instruction fewer."""
    bits = y.to(tl.int32, bitcast=True)
    mag = tl.abs(y)
    if BF16_VALUED:
        c = tl.maximum(mag, 0.015625) * 1048576.0
    else:
        c = ((tl.maximum(mag, 0.015625).to(tl.int32, bitcast=True) & 0x7F800000) + 0x0A400000).to(tl.float32,
                                                                                                   bitcast=True)
    r = (mag + c) - c
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_cast(r):
    """fp32 r on the e4m3 grid (`e4m3_round`) -> float8_e4m3fn code (uint8): an exact cast (on the GPU one
    `cvt.rn.satfinite.e4m3x2.f32` per two values)."""
    return r.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def e4m3_grid_code(y):
    """fp32 y on the e4m3 grid, |y| <= 448 -> its float8_e4m3fn code (int32 0..255), by moving bits (no cast): normal
    values keep their sign, exponent (rebiased 127 -> 7) and top 3 mantissa bits; below 2^-6 the code is |y| / 2^-9;
    -0 -> 0x80."""
    bits = y.to(tl.int32, bitcast=True)
    mag = tl.abs(y)
    normal = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)
    return ((bits >> 24) & 0x80) | tl.where(mag >= 0.015625, normal, (mag * 512.0).to(tl.int32))


@triton.jit
def e4m3_bits(y):
    """fp32 |y| <= 448 -> float8_e4m3fn code (int32 0..255), round to nearest even; NaN -> 0x7F."""
    return tl.where(y == y, e4m3_cast(e4m3_round(tl.where(y == y, y, 0.0))).to(tl.int32), 0x7F)


@triton.jit
def e2m1_bits(y):
    """Scaled fp32 (|y| <= 6) -> e2m1 code 0..15, nearest with ties to the even code (quant.e2m1_encode)."""
    mag = tl.abs(y)
    code = ((mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
            + (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
            + (mag > 5.0).to(tl.int32))
    negative = ((y.to(tl.int32, bitcast=True) >> 31) & 1) == 1
    return code | tl.where(negative & (y == y), 8, 0)


@triton.jit
def rope_block(x, cos, sin, INVERSE: tl.constexpr = False, ROUND: tl.constexpr = True):
    """Interleaved RoPE (pairs 2i, 2i+1) of the rope dims x fp32 [R, 64] with cos / sin fp32 [R, 32], as
    `ops.rope.reference.apply_rope`: `even * cos - odd * sin`, `odd * cos + even * sin` (compile without fp fusion for
    torch's separately rounded products); with ROUND rounded to bf16 like the reference's `.to(bf16)` (fp32
    activations stay fp32)."""
    R: tl.constexpr = x.shape[0]
    even, odd = tl.split(tl.reshape(x, (R, 32, 2)))
    if INVERSE:
        sin = sin * -1.0  # -0 where sin is +0, as torch (Triton 3.6 compiles unary minus to 0 - x: +0)
    rot_even = even * cos - odd * sin
    rot_odd = odd * cos + even * sin
    if ROUND:
        rot_even = round_bf16(rot_even)
        rot_odd = round_bf16(rot_odd)
    return tl.reshape(tl.join(rot_even, rot_odd), (R, 64))


@triton.jit
def last_block(x, LOG_NB: tl.constexpr):
    """Block NB - 1 of x [R, NB, 64] (NB = 2^LOG_NB) -> [R, 64], exactly (no arithmetic: -0 and NaN kept)."""
    R: tl.constexpr = x.shape[0]
    y = tl.permute(x, (0, 2, 1))  # [R, 64, NB]: halve the block axis, keeping the odd half, LOG_NB times
    for _ in tl.static_range(LOG_NB):
        _, y = tl.split(tl.reshape(y, (R, 64, y.shape[2] // 2, 2)))
    return tl.reshape(y, (R, 64))


@triton.jit
def store_main_entries(data_ptr, scale_ptr, x, rope, valid, NB: tl.constexpr, FP8: tl.constexpr,
                       SCALE_BYTES: tl.constexpr, BF16_VALUED: tl.constexpr = False):
    """R main entries (D = 64 * NB dims, the last 64 = rope): nope dims from x fp32 [R, NB, 64] (blocks 0 .. NB - 2;
    block NB - 1 is ignored), rope dims from rope fp32 [R, 64] (rounded to bf16 here). data_ptr / scale_ptr:
    [R] uint8 pointers to each entry's data and scale row (2- and 8-byte aligned); nothing is stored for rows where
    valid [R] is False.
    BF16_VALUED: x holds bf16 values (a cheaper e4m3 rounding, see `e4m3_round`).

    FP8 (FlashMLA MODEL1): nope dims e4m3 with a ue8m0 scale per 64 (scale row zero-padded to SCALE_BYTES),
    then the rope dims as bf16; else every dim bf16."""
    o_b = tl.arange(0, NB)[None, :, None]
    o_c = tl.arange(0, 64)[None, None, :]
    m_nope = (o_b < NB - 1) & valid[:, None, None]
    o_rope = tl.arange(0, 64)[None, :]
    m_rope = valid[:, None] & (o_rope >= 0)
    if FP8:
        e, finite = pow2_exponent(nan_amax(x, 2), 8, 0x600000)  # [R, NB]; 448 = 1.75 * 2^8
        # |x| / s <= 448 by the choice of s (e is never clamped for amax >= eps): no clamp needed; the product is
        # exact (a power of two), so the reference's division gives the same value
        code = e4m3_cast(e4m3_round(x * exp2_int(-e)[:, :, None], BF16_VALUED))
        # a non-finite block's bytes are 0x7F (e4m3 NaN): a second, masked store instead of a select per byte
        p_nope = data_ptr[:, None, None] + o_b * 64 + o_c
        tl.store(p_nope, code, mask=m_nope & finite[:, :, None])
        tl.store(p_nope, tl.full((1, 1, 64), 0x7F, tl.uint8), mask=m_nope & ~finite[:, :, None])
        tl.store(as_int16(data_ptr + (NB - 1) * 64)[:, None] + o_rope, bf16_bits(round_bf16(rope)), mask=m_rope)
        # the scale row: one ue8m0 byte per nope block, zero-padded to SCALE_BYTES (a multiple of 8 >= NB - 1)
        o_k = tl.arange(0, NB)[None, :]
        scale = tl.where(o_k < NB - 1, tl.where(finite, e + 127, 0xFF), 0).to(tl.uint8)  # [R, NB]
        tl.store(scale_ptr[:, None] + o_k, scale, mask=valid[:, None] & (o_k >= 0))
        if SCALE_BYTES > NB:
            o_s = NB + tl.arange(0, SCALE_BYTES)[None, :]
            tl.store(scale_ptr[:, None] + o_s, tl.zeros((1, SCALE_BYTES), tl.uint8),
                     mask=(o_s < SCALE_BYTES) & valid[:, None])
    else:
        p_data = as_int16(data_ptr)[:, None, None]
        tl.store(p_data + o_b * 64 + o_c, bf16_bits(round_bf16(x)), mask=m_nope)
        tl.store(as_int16(data_ptr)[:, None] + (NB - 1) * 64 + o_rope, bf16_bits(round_bf16(rope)), mask=m_rope)


@triton.jit
def hadamard_rows(x, LOG_D: tl.constexpr):
    """Unnormalized Sylvester Hadamard transform of each row of x fp32 [R, D] (D = 2^LOG_D): y[j] = sum_i
    (-1)^popcount(i & j) x[i]. Each stage applies (a + b, a - b) to the pairs of the lowest index bit and moves that
    bit to the top, so after log2 D stages every bit is done once and the order is back. Exact while a row's
    values span less than 2^(24 - 8 - LOG_D) in magnitude (bf16 inputs); else only the smallest values' low bits
    round away. The order of `quant.hadamard_rotate`, so the two agree bit for bit."""
    R: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    for _ in tl.static_range(LOG_D):
        a, b = tl.split(tl.reshape(x, (R, D // 2, 2)))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (R, D))
    return x


@triton.jit
def rotate_keys(x, h_scale, LOG_D: tl.constexpr):
    """The indexer keys' Hadamard rotation, rounded to bf16 (`layout._rotate`): x fp32 [R, D] -> fp32 [R, D].
    h_scale = fl(D^-0.5), the reference matrix's entries; + 0.0: a GEMM gives +0 where a sum of -0 gives -0."""
    return round_bf16(hadamard_rows(x, LOG_D) * h_scale + 0.0)


@triton.jit
def store_index_entries(data_ptr, scale_ptr, x, valid, FORMAT: tl.constexpr):
    """R indexer keys from x fp32 [R, D]: FORMAT 0 = bf16 (x unrotated, rounded here); 1 = FP8 (DeepGEMM:
    e4m3, one fp32 pow2 scale per key); 2 = MXFP4 (packed e2m1 low nibble first, ue8m0 scale per 32). For
    formats 1 and 2, x is the rotated key, bf16-valued (`rotate_keys`). data_ptr / scale_ptr: [R] uint8 pointers;
    nothing is stored for rows where valid [R] is False."""
    R: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    o_d = tl.arange(0, D)[None, :]
    if FORMAT == 0:
        tl.store(as_int16(data_ptr)[:, None] + o_d, bf16_bits(round_bf16(x)), mask=valid[:, None] & (o_d >= 0))
    elif FORMAT == 1:
        e, finite = pow2_exponent(nan_amax(x, 1), 8, 0x600000)  # 448 = 1.75 * 2^8
        code = tl.where(finite[:, None], e4m3_cast(e4m3_round(x * exp2_int(-e)[:, None], True)), 0x7F)
        tl.store(data_ptr[:, None] + o_d, code, mask=valid[:, None] & (o_d >= 0))
        bits = tl.where(finite, (e + 127) << 23, 0x7FC00000)  # the fp32 scale (NaN: torch's quiet NaN)
        tl.store(scale_ptr.to(tl.pointer_type(tl.int32)), bits, mask=valid)
    else:
        blocks = tl.reshape(x, (R, D // 32, 32))
        e, finite = pow2_exponent(nan_amax(blocks, 2), 2, 0x400000)  # 6 = 1.5 * 2^2
        code = tl.where(finite[:, :, None], e2m1_bits(blocks * exp2_int(-e)[:, :, None]), 0)  # NaN block: +0 codes
        lo, hi = tl.split(tl.reshape(code, (R, D // 2, 2)))
        o_h = tl.arange(0, D // 2)[None, :]
        tl.store(data_ptr[:, None] + o_h, (lo | (hi << 4)).to(tl.uint8), mask=valid[:, None] & (o_h >= 0))
        o_s = tl.arange(0, D // 32)[None, :]
        scale = tl.where(finite, e + 127, 0xFF).to(tl.uint8)
        tl.store(scale_ptr[:, None] + o_s, scale, mask=valid[:, None] & (o_s >= 0))
