"""The indexer scores' key decoding and products (Triton device functions), shared by the row and the stacked kernel
(`kernel.py`, whose docstring gives the numerics): MXFP4 / FP8 / bf16 key tiles straight from the pool's pages against
bf16 MMAs (`key_dot`), MXFP4 keys against FP8 MMAs (`mxfp4_fp8_dot`, `mxfp4_fp8_scores`) and the query's FP8 operand
(`fp8_query_operand`, `q8_blocks`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...cache.layout import EntryLayout, IndexerFP8Layout, IndexerMXFP4Layout
from ...checks import require
from ..shared.encode import e4m3_grid_code, e4m3_round

__all__ = ["KEYS_BF16", "KEYS_FP8", "KEYS_MXFP4", "key_format", "fp8_query_operand", "q8_blocks", "q8_operand",
           "mxfp4_tile", "mxfp4_fp8_dot", "mxfp4_key_scale_keys", "fp8_dot", "mxfp4_fp8_scores", "key_dot", "q_dims",
           "relu"]

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
def q8_blocks(p_q8, m_h, D: tl.constexpr):
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
def mxfp4_tile(pool_ptr, p_table, o_j, m_j, D: tl.constexpr, P: tl.constexpr, PAGE_BYTES: tl.constexpr,
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
    # dims in `q8_blocks`'s order: the block's low nibbles (even dims), then its high nibbles (odd dims); the
    # natural order would interleave bytes (a PRMT per pair of values)
    b_k = tl.reshape(tl.permute(tl.join(b_lo, b_hi), (0, 2, 1)), (BLOCK_J, 32)).to(tl.float8e4nv, bitcast=True)
    b_sc = _ue8m0_times_64(code.to(tl.int32))
    if ASM:
        part = tl.dot(b_k, b_q8)
    else:  # the interpreter: the same exact products and sums through an fp32 dot
        part = tl.dot(b_k.to(tl.float32), b_q8.to(tl.float32))
    return acc + part * b_sc[:, None]


@triton.jit
def mxfp4_fp8_dot(k0, k1, k2, k3, s0, s1, s2, s3, b_q0, b_q1, b_q2, b_q3, N: tl.constexpr, D: tl.constexpr,
                   BLOCK_J: tl.constexpr, ASM: tl.constexpr):
    """A tile's MXFP4 keys (`mxfp4_tile`'s bytes and codes per scale block) times q's FP8 operand [32, N] per block
    -> fp32 [BLOCK_J, N]: the sum over scale blocks, in block order, of exact per-block MMAs (`_mxfp4_block_mma`)."""
    acc = _mxfp4_block_mma(k0, s0, b_q0, tl.zeros((BLOCK_J, N), dtype=tl.float32), BLOCK_J, ASM)
    if D >= 64:
        acc = _mxfp4_block_mma(k1, s1, b_q1, acc, BLOCK_J, ASM)
    if D >= 128:
        acc = _mxfp4_block_mma(k2, s2, b_q2, acc, BLOCK_J, ASM)
        acc = _mxfp4_block_mma(k3, s3, b_q3, acc, BLOCK_J, ASM)
    return acc


# `_e2m1_e4m3_shifted`'s PTX, four packed bytes per 32-bit register (two per key block's table, see the docstring):
# the magnitudes (3 bits a nibble) select table bytes (PRMT: 8 bytes of two registers, 4 selectors a call), two more
# PRMTs sort the results into low and high nibbles, and the signs (bit 3 -> 7) are or-ed in
_E2M1_E4M3_SHIFTED_ASM = tl.constexpr("""{
            .reg .b32 u, v, r0, r1, t;
            and.b32 u, $2, 0x77777777;
            shr.b32 v, u, 16;
            prmt.b32 r0, $3, $7, u;
            prmt.b32 r1, $5, $9, v;
            prmt.b32 u, r0, r1, 0x6420;
            prmt.b32 v, r0, r1, 0x7531;
            shl.b32 t, $2, 4;
            and.b32 t, t, 0x80808080;
            or.b32 $0, u, t;
            and.b32 t, $2, 0x80808080;
            or.b32 $1, v, t;
            }""")
# e4m3 codes of the e2m1 magnitudes 0, 0.5, 1, 1.5 (low word) and 2, 3, 4, 6 (high word) times 2^6, byte c = code c
_SHIFT_LO = tl.constexpr(0x6C686000)
_SHIFT_HI = tl.constexpr(0x7C787470)


@triton.jit
def _shift_tables(d):
    """Block shifts d (int32 >= 0: the key's largest scale code minus the block's) -> (low, high) int32 tables: byte c
    of (low, high) the e4m3 code of e2m1 magnitude c (0..3, 4..7) times 2^(6 - d). Exact for d <= 11 (every nonzero
    entry a normal e4m3 number: its exponent field lowered by d, no byte borrowing from the next); `_shift_tables_exact`
    beyond."""
    return d * -0x08080800 + _SHIFT_LO, d * -0x08080808 + _SHIFT_HI  # (tensor first: a constexpr's - gives constexpr)


@triton.jit
def _table_byte(p, VALUE: tl.constexpr):
    """The e4m3 code of VALUE * p (fp32 p a power of two <= 2^6), rounded to nearest even: subnormal below 2^-6, 0 from
    2^-10 down."""
    return e4m3_grid_code(e4m3_round(p * VALUE))


@triton.jit
def _shift_tables_exact(d):
    """`_shift_tables` for any d >= 0: each entry rounded to the e4m3 grid (nearest even) where it falls below the
    normal range (d >= 12; exact to d = 14, all zero from d = 19)."""
    p = ((133 - tl.minimum(d, 40)) << 23).to(tl.float32, bitcast=True)  # 2^(6 - d), a normal fp32 number
    lo = (_table_byte(p, 0.5) << 8) | (_table_byte(p, 1.0) << 16) | (_table_byte(p, 1.5) << 24)
    hi = _table_byte(p, 2.0) | (_table_byte(p, 3.0) << 8) | (_table_byte(p, 4.0) << 16) | (_table_byte(p, 6.0) << 24)
    return lo, hi


@triton.jit
def _e2m1_e4m3_shifted(byte, t_lo, t_hi, ASM: tl.constexpr):
    """Packed MXFP4 bytes (uint8) and their block's tables (`_shift_tables`, int32, broadcast to the bytes' shape) ->
    (low nibble, high nibble) as e4m3 bytes (uint8) of value * 2^(6 - d): a table lookup by magnitude, the sign
    or-ed in (-0 for code 8, as `_e2m1_e4m3`). ASM: four bytes per 32-bit register, 11 ALU ops per 8 values; the
    table of the first of each two bytes serves both, so two neighbouring bytes of a register must be of one key
    block (they are: a block's 16 bytes are contiguous, and a thread's registers hold runs of 4 of them, the row's
    16-byte loads and the MMA operand's 4-byte k groups alike). Else the same lookup per element (the interpreter)."""
    if ASM:
        return tl.inline_asm_elementwise(asm=_E2M1_E4M3_SHIFTED_ASM, constraints="=r,=r,r,r,r,r,r,r,r,r,r",
                                         args=[byte, t_lo, t_hi], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    else:
        b = byte.to(tl.int32)
        lo_mag, hi_mag = b & 7, (b >> 4) & 7
        lo = (tl.where(lo_mag < 4, t_lo, t_hi) >> ((lo_mag & 3) * 8)) & 0xFF
        hi = (tl.where(hi_mag < 4, t_lo, t_hi) >> ((hi_mag & 3) * 8)) & 0xFF
        return (lo | ((b & 0x08) << 4)).to(tl.uint8), (hi | (b & 0x80)).to(tl.uint8)


@triton.jit
def _key_scale(code):
    """The key's largest ue8m0 code (int32) -> fp32 2^(code - 127) * 2^-6, the scale of its e4m3 values (`_ue8m0`'s
    2^-127 for code 0: 2^-133, a subnormal; 0xFF -> NaN), from bits (no subnormal multiply)."""
    bits = tl.where(code >= 7, (code - 6) << 23, 1 << (tl.minimum(code, 6) + 16))
    return tl.where(code == 0xFF, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _shifted_block(byte, t_lo, t_hi, BLOCK_J: tl.constexpr, ASM: tl.constexpr):
    """One scale block's bytes [BLOCK_J, 16] and tables [BLOCK_J] -> e4m3 [BLOCK_J, 32] in `q8_operand`'s order
    (the block's low nibbles, then its high nibbles)."""
    b_lo, b_hi = _e2m1_e4m3_shifted(byte, tl.broadcast_to(t_lo[:, None], (BLOCK_J, 16)),
                                    tl.broadcast_to(t_hi[:, None], (BLOCK_J, 16)), ASM)
    return tl.reshape(tl.permute(tl.join(b_lo, b_hi), (0, 2, 1)), (BLOCK_J, 32))


@triton.jit
def _cat_k(a, b, BLOCK_J: tl.constexpr, K: tl.constexpr):
    """[BLOCK_J, K] and [BLOCK_J, K] -> [BLOCK_J, 2K], a's columns first."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (BLOCK_J, 2 * K))


@triton.jit
def mxfp4_key_scale_keys(k0, k1, k2, k3, s0, s1, s2, s3, D: tl.constexpr, BLOCK_J: tl.constexpr, ASM: tl.constexpr):
    """A tile's MXFP4 keys (`mxfp4_tile`'s bytes and codes per scale block) under one scale per key -> (e4m3 [BLOCK_J,
    D] in `q8_operand`'s order, holding each value times 2^6 / 2^(smax - 127), smax the key's largest code; fp32
    [BLOCK_J] 2^(smax - 127) * 2^-6, `_key_scale`). A block d = smax - s_b below shifts its values by 2^-d: exact to
    d = 14, rounded to the e4m3 grid beyond (`_shift_tables_exact`, taken by a whole tile when one of its keys needs
    it)."""
    smax = s0
    if D >= 64:
        smax = tl.maximum(smax, s1)
    if D >= 128:
        smax = tl.maximum(tl.maximum(smax, s2), s3)
    lo0, hi0 = _shift_tables(smax - s0)
    lo1, hi1, lo2, hi2, lo3, hi3 = lo0, hi0, lo0, hi0, lo0, hi0
    if D >= 64:
        lo1, hi1 = _shift_tables(smax - s1)
    if D >= 128:
        lo2, hi2 = _shift_tables(smax - s2)
        lo3, hi3 = _shift_tables(smax - s3)
    spread = smax - s0
    if D >= 64:
        spread = tl.maximum(spread, smax - s1)
    if D >= 128:
        spread = tl.maximum(spread, tl.maximum(smax - s2, smax - s3))
    if tl.max(spread, axis=0) > 11:  # a block 2^-12 or further below its key's largest: subnormal or flushed values
        lo0, hi0 = _shift_tables_exact(smax - s0)
        if D >= 64:
            lo1, hi1 = _shift_tables_exact(smax - s1)
        if D >= 128:
            lo2, hi2 = _shift_tables_exact(smax - s2)
            lo3, hi3 = _shift_tables_exact(smax - s3)
    b_k = _shifted_block(k0, lo0, hi0, BLOCK_J, ASM)
    if D >= 64:
        b_k = _cat_k(b_k, _shifted_block(k1, lo1, hi1, BLOCK_J, ASM), BLOCK_J, 32)
    if D >= 128:
        b_k = _cat_k(b_k, _cat_k(_shifted_block(k2, lo2, hi2, BLOCK_J, ASM), _shifted_block(k3, lo3, hi3, BLOCK_J, ASM),
                                 BLOCK_J, 32), BLOCK_J, 64)
    return b_k.to(tl.float8e4nv, bitcast=True), _key_scale(smax)


@triton.jit
def q8_operand(p_q8, m_n, D: tl.constexpr):
    """q's FP8 MMA operand (`fp8_query_operand`'s codes at p_q8 [1, N] column pointers, m_n [N] the columns read) as
    one [D, N] e4m3 tile in the per-key path's order: per 32-dim scale block, its even dims, then its odd dims."""
    o_k = tl.arange(0, D)
    o_d = (o_k // 32) * 32 + (o_k % 16) * 2 + (o_k % 32) // 16
    return tl.load(p_q8 + o_d[:, None], mask=m_n[None, :], other=0).to(tl.float8e4nv, bitcast=True)


@triton.jit
def fp8_dot(b_k, b_q8, ASM: tl.constexpr):
    """e4m3 [M, K] x e4m3 [K, N] -> fp32 [M, N] on an FP8 MMA; under the interpreter the same products through an fp32
    dot."""
    if ASM:
        return tl.dot(b_k, b_q8)
    else:
        return tl.dot(b_k.to(tl.float32), b_q8.to(tl.float32))


@triton.jit
def mxfp4_fp8_scores(pool_ptr, p_table, p_out, chunk_lo, hi, visible, num_entries, b_w, b_q0, b_q1, b_q2, b_q3,
                      D: tl.constexpr, P: tl.constexpr, PAGE_BYTES: tl.constexpr, DATA_BYTES: tl.constexpr,
                      SCALE_BYTES: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr, ASM: tl.constexpr,
                      PAGE_TILES: tl.constexpr, KEY_SCALE: tl.constexpr = False):
    """Scores of entries chunk_lo..hi-1 of one row against MXFP4 keys on FP8 MMAs: per tile, the sum over scale
    blocks, in block order, of exact per-block MMAs (`_mxfp4_block_mma`; b_q0..b_q3 `q8_blocks`'s), then ReLU and the
    head weights. KEY_SCALE: one scale per key instead (`mxfp4_key_scale_keys`; b_q0 `q8_operand`'s [D, BLOCK_H], the
    others unread): one K = D MMA a tile, ReLU and the head weights, then the key's scale once per key (ReLU commutes
    with a positive power of two).
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
            k0, k1, k2, k3, s0, s1, s2, s3 = mxfp4_tile(pool_ptr, p_table, o_j, o_j < hi, D, P, PAGE_BYTES,
                                                         DATA_BYTES, SCALE_BYTES)
        if KEY_SCALE:
            b_k, b_ks = mxfp4_key_scale_keys(k0, k1, k2, k3, s0, s1, s2, s3, D, BLOCK_J, ASM)
            b_s = tl.sum(relu(fp8_dot(b_k, b_q0, ASM)) * b_w[None, :], axis=1) * b_ks
        else:
            acc = mxfp4_fp8_dot(k0, k1, k2, k3, s0, s1, s2, s3, b_q0, b_q1, b_q2, b_q3, BLOCK_H, D, BLOCK_J, ASM)
            b_s = tl.sum(relu(acc) * b_w[None, :], axis=1)
        tl.store(p_out + o_j, tl.where(o_j < visible, b_s, float("-inf")), mask=o_j < num_entries)


@triton.jit
def key_dot(pool_ptr, p_table, o_j, m_j, b_q0, b_q1,
             FORMAT: tl.constexpr, D: tl.constexpr, P: tl.constexpr, PAGE_BYTES: tl.constexpr,
             DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, BLOCK_J: tl.constexpr, DOT: tl.constexpr,
             BITS: tl.constexpr = False):
    """Keys of entries o_j [BLOCK_J] of the request whose block-table row is p_table, decoded in registers,
    times the query -> fp32 [BLOCK_J, N]. b_q0 / b_q1: bf16 q^T [D/2, N] at the dims `q_dims` gives (two
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
def q_dims(FORMAT: tl.constexpr, D: tl.constexpr):
    """The q dims of the two K = D/2 halves [D/2]: even / odd for MXFP4 (they meet a key byte's low / high
    nibbles), first / second half otherwise. Halves also halve the registers a q tile passes through on its
    way to shared memory (128 per thread for 4 rows of 64 heads)."""
    o_d = tl.arange(0, D // 2)
    if FORMAT == 2:
        return 2 * o_d, 2 * o_d + 1
    else:
        return o_d, o_d + D // 2


@triton.jit
def relu(x):
    """max(x, 0) that keeps NaN, like torch.relu (one max.NaN on the GPU)."""
    return tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)


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
