"""Triton device functions that encode entries into the cache's byte formats (`dsv4kv.layout`), bit for bit.

Every rounding is done on the integer bits, not by a float downcast: Triton's interpreter truncates
fp32 -> bf16 / e4m3 conversions where the GPU rounds to nearest even, and the same code must give the
same bytes in both. Scales follow `quant.pow2_scale`: s = 2^ceil(log2(max(amax, 1e-4) / qmax)), computed
from the exponent and mantissa of max(amax, 1e-4) with no division (exact; see `pow2_exponent`).

Entries are handled as fp32 tiles [D // 64, 64] (row i = dims 64i .. 64i + 63) whose values are already
bf16-representable. Non-finite blocks (a NaN or an inf anywhere in the block) get the NaN scale code 0xFF, as
the reference does; their e4m3 data bytes are 0x7F (e4m3 NaN) where the reference's may carry a sign, their
e2m1 codes +0 as the reference's.
"""

from __future__ import annotations

import triton
import triton.language as tl

SCALE_EPS = tl.constexpr(1e-4)  # quant.SCALE_EPS (a constexpr: jit code reads no other globals)


@triton.jit
def round_bf16(x):
    """fp32 -> fp32 holding x rounded to bf16, nearest even (NaN stays NaN)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # 0xFFFF0000
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))


@triton.jit
def store_bf16(ptr, x, mask):
    """Store bf16-valued fp32 x as 2 little-endian bytes each at ptr + 2 * i (ptr: uint8 pointers)."""
    bits = x.to(tl.int32, bitcast=True) >> 16
    tl.store(ptr, (bits & 0xFF).to(tl.uint8), mask=mask)
    tl.store(ptr + 1, ((bits >> 8) & 0xFF).to(tl.uint8), mask=mask)


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
def nan_amax(x, axis: tl.constexpr):
    """max |x| along `axis` with NaN counted as inf: tl.max drops NaNs (maxnum), and a block holding one must
    still get the NaN scale."""
    return tl.max(tl.where(x == x, tl.abs(x), float("inf")), axis=axis)


@triton.jit
def exp2_int(e):
    """fp32 2^e for an int32 e in -126..127 (exact, from the bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(y):
    """fp32 |y| <= 448 -> float8_e4m3fn code (int32 0..255), round to nearest even; NaN -> 0x7F."""
    mag = tl.abs(y)
    bits = mag.to(tl.int32, bitcast=True)
    exp = (bits >> 23) - 127
    # normal (|y| >= 2^-6): keep 3 mantissa bits, round the other 20 to nearest even; carries roll into the exponent
    mant3 = (bits >> 20) & 7
    rest = bits & 0xFFFFF
    up = (rest > 0x80000) | ((rest == 0x80000) & ((mant3 & 1) == 1))
    normal = (((exp + 7) << 3) | mant3) + up.to(tl.int32)
    # subnormal: multiples of 2^-9 (scaling by 512 is exact), rounded to nearest even
    t = mag * 512.0
    f = tl.floor(t)
    r = t - f
    fi = f.to(tl.int32)
    sub = fi + ((r > 0.5) | ((r == 0.5) & ((fi & 1) == 1))).to(tl.int32)
    code = tl.where(mag < 0.015625, sub, normal)
    code = code | ((y.to(tl.int32, bitcast=True) >> 24) & 0x80)
    return tl.where(y != y, 0x7F, code)


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
def store_main_entry(data_ptr, scale_ptr, x, slot, NB: tl.constexpr, FP8: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """A main entry (D = 64 * NB dims, the last 64 = rope) from bf16-valued fp32 x [NB, 64]; nothing is
    stored when the scalar `slot` is negative (masks are built from tensors: the interpreter rejects a
    scalar bool in a mask).

    FP8 (FlashMLA MODEL1): nope dims e4m3 with a ue8m0 scale per 64, then the rope dims as bf16; else bf16."""
    rows = tl.arange(0, NB)[:, None]
    cols = tl.arange(0, 64)[None, :]
    valid = (cols * 0 + slot) >= 0
    x = tl.where(rows == NB - 1, round_bf16(x), x)  # the rope dims (or the whole entry) are stored as bf16
    if FP8:
        is_nope = rows < NB - 1
        nope = tl.where(is_nope, x, 0.0)
        e, finite = pow2_exponent(nan_amax(nope, 1), 8, 0x600000)  # 448 = 1.75 * 2^8
        y = tl.minimum(tl.maximum(nope * exp2_int(-e)[:, None], -448.0), 448.0)
        code = tl.where(finite[:, None], e4m3_bits(y), 0x7F)
        tl.store(data_ptr + rows * 64 + cols, code.to(tl.uint8), mask=is_nope & valid)
        store_bf16(data_ptr + (NB - 1) * 64 + 2 * cols + 0 * rows, x, (rows == NB - 1) & valid)
        scale = tl.where(finite, e + 127, 0xFF)
        pad = tl.arange(0, SCALE_BYTES)
        tl.store(scale_ptr + pad, tl.zeros((SCALE_BYTES,), tl.uint8), mask=(pad >= NB - 1) & ((pad * 0 + slot) >= 0))
        block = tl.arange(0, NB)
        tl.store(scale_ptr + block, scale.to(tl.uint8), mask=(block < NB - 1) & ((block * 0 + slot) >= 0))
    else:
        store_bf16(data_ptr + 2 * (rows * 64 + cols), round_bf16(x), (rows >= 0) & valid)


@triton.jit
def rope_last_block(x, cos, sin, NB: tl.constexpr, INVERSE: tl.constexpr = False, ROUND: tl.constexpr = True):
    """Interleaved RoPE on row NB - 1 of x [NB, 64] (pairs 2i, 2i+1) with cos/sin fp32 [32]; with ROUND the
    result is rounded to bf16 like the reference's `rotated.to(bf16)` (fp32 activations stay fp32). Other rows
    are returned unchanged."""
    pairs = tl.reshape(x, (NB, 32, 2))
    even, odd = tl.split(pairs)
    if INVERSE:
        sin = -sin
    rot_even = even * cos[None, :] - odd * sin[None, :]
    rot_odd = odd * cos[None, :] + even * sin[None, :]
    if ROUND:
        rot_even = round_bf16(rot_even)
        rot_odd = round_bf16(rot_odd)
    last = (tl.arange(0, NB) == NB - 1)[:, None]
    out = tl.join(tl.where(last, rot_even, even), tl.where(last, rot_odd, odd))
    return tl.reshape(out, (NB, 64))


@triton.jit
def store_index_entry(data_ptr, scale_ptr, x, slot, hadamard_ptr, D: tl.constexpr, FORMAT: tl.constexpr):
    """An indexer key from bf16-valued fp32 x [D // 64, 64]; nothing stored when `slot` < 0.

    FORMAT 0 = bf16 (unrotated); 1 = FP8 (DeepGEMM: rotated, e4m3, one fp32 pow2 scale per key);
    2 = MXFP4 (rotated, packed e2m1 low nibble first, ue8m0 scale per 32). The Hadamard rotation is
    x @ H (fp32 [D, D] at hadamard_ptr) rounded to bf16, as the reference (`layout._rotate`)."""
    v = tl.reshape(x, (D,))
    i = tl.arange(0, D)
    if FORMAT == 0:
        store_bf16(data_ptr + 2 * i, round_bf16(v), (i * 0 + slot) >= 0)
    else:
        h = tl.load(hadamard_ptr + i[:, None] * D + i[None, :])
        rot = round_bf16(tl.sum(v[:, None] * h, axis=0) + 0.0)  # + 0.0: a GEMM gives +0 where a sum of -0 gives -0
        if FORMAT == 1:
            e, finite = pow2_exponent(nan_amax(rot, 0), 8, 0x600000)  # 448 = 1.75 * 2^8
            y = tl.minimum(tl.maximum(rot * exp2_int(-e), -448.0), 448.0)
            code = tl.where((i * 0 + finite.to(tl.int32)) != 0, e4m3_bits(y), 0x7F)
            tl.store(data_ptr + i, code.to(tl.uint8), mask=(i * 0 + slot) >= 0)
            k = tl.arange(0, 4)
            bits = tl.where((k * 0 + finite.to(tl.int32)) != 0, (k * 0 + e + 127) << 23, 0x7FC00000)
            tl.store(scale_ptr + k, ((bits >> (8 * k)) & 0xFF).to(tl.uint8), mask=(k * 0 + slot) >= 0)
        else:
            blocks = tl.reshape(rot, (D // 32, 32))
            e, finite = pow2_exponent(nan_amax(blocks, 1), 2, 0x400000)  # 6 = 1.5 * 2^2
            code = tl.where(finite[:, None], e2m1_bits(blocks * exp2_int(-e)[:, None]), 0)  # NaN block: +0 codes
            lo, hi = tl.split(tl.reshape(code, (D // 2, 2)))
            half = tl.arange(0, D // 2)
            tl.store(data_ptr + half, (lo | (hi << 4)).to(tl.uint8), mask=(half * 0 + slot) >= 0)
            b = tl.arange(0, D // 32)
            tl.store(scale_ptr + b, tl.where(finite, e + 127, 0xFF).to(tl.uint8), mask=(b * 0 + slot) >= 0)
