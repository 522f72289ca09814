"""Where a row's keys are and how they decode (Triton device functions of `kernel.py`'s attention and merge): the
row's key blocks (window blocks first, then compressed entries), each block's data / scale row pointers into the
window ring, the step page or the entry pages, and the exact bf16 key tile decoded from them.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["entry_rows", "dequant_fp8", "key_tile", "row_blocks", "entry_ids", "entry_blocks", "key_rows"]


@triton.jit
def entry_rows(p_page, entry, per_page, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """Byte pointers [N] to the data rows and the scale rows of entries `entry` [N] of the pages at `p_page` (a page
    of per_page entries holds the data rows first, then the scale rows)."""
    entry = entry.to(tl.int64)
    return p_page + entry * DATA_BYTES, p_page + per_page * DATA_BYTES + entry * SCALE_BYTES


@triton.jit
def dequant_fp8(b_code, b_exp):
    """e4m3 codes uint8 [N, C, 64] times 2^(ue8m0 - 127) (codes uint8 [N, C]) -> bf16 [N, C, 64], exactly the
    decoded value (every product of an e4m3 value and a power of two in range is a bf16 value). Code 0 scales by
    2^-127 (an fp32 subnormal), code 0xFF is NaN, as `quant.ue8m0_decode`."""
    b_e = b_exp.to(tl.int32)
    b_bits = tl.where(b_e == 0, 0x400000, b_e << 23)
    b_bits = tl.where(b_e == 255, 0x7FC00000, b_bits)
    b_scale = b_bits.to(tl.float32, bitcast=True)
    return (b_code.to(tl.float8e4nv, bitcast=True).to(tl.float32) * b_scale[:, :, None]).to(tl.bfloat16)


@triton.jit
def key_tile(p_data, p_scale, mask, D: tl.constexpr, NOPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys of the entries at data / scale row pointers [BLOCK_N] -> bf16 [BLOCK_N, D], exactly their decoded
    values; 0 where ~mask. FP8 entries are decoded as [BLOCK_N, D / 64, 64] (one ue8m0 scale per 64 nope dims;
    the rope chunks are the bf16 values after the nope bytes), then viewed as [BLOCK_N, D]."""
    if NOPE > 0:
        C: tl.constexpr = D // 64
        o_c = tl.arange(0, C)
        o_d = (o_c * 64)[None, :, None] + tl.arange(0, 64)[None, None, :]  # [1, C, 64]
        m_nope = o_c < NOPE // 64
        m_row = mask[:, None, None]
        b_code = tl.load(p_data[:, None, None] + o_d, mask=m_row & m_nope[None, :, None], other=0)
        b_exp = tl.load(p_scale[:, None] + o_c[None, :], mask=mask[:, None] & m_nope[None, :], other=127)
        p_rope = (p_data + NOPE).to(tl.pointer_type(tl.bfloat16))  # data rows start at even bytes
        b_rope = tl.load(p_rope[:, None, None] + (o_d - NOPE), mask=m_row & (o_d >= NOPE), other=0.0)
        b_k = tl.where(m_nope[None, :, None], dequant_fp8(b_code, b_exp), b_rope)
        b_k = tl.reshape(b_k, (BLOCK_N, D))
    else:
        p_bf16 = p_data.to(tl.pointer_type(tl.bfloat16))
        b_k = tl.load(p_bf16[:, None] + tl.arange(0, D)[None, :], mask=mask[:, None], other=0.0)
    return b_k


@triton.jit
def row_blocks(pos, n_picks, splits, RATIO: tl.constexpr, WINDOW: tl.constexpr, ENTRIES: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Keys and key blocks of a row at position `pos` (-1: padding, no keys): window keys, entry keys (HCA: the
    visible entries; CSA: the pick columns), window blocks, all blocks (window blocks first), blocks per split."""
    n_win = tl.minimum(pos + 1, WINDOW)  # positions max(0, pos - WINDOW + 1) .. pos
    if ENTRIES == 1:
        n_ent = (pos + 1) // RATIO
    elif ENTRIES == 2:
        n_ent = (pos >= 0).to(tl.int32) * n_picks
    else:
        n_ent = n_win * 0
    n_win_blocks = tl.cdiv(n_win, BLOCK_N)
    n_blocks = n_win_blocks + tl.cdiv(n_ent, BLOCK_N)
    return n_win, n_ent, n_win_blocks, n_blocks, tl.cdiv(n_blocks, splits)


@triton.jit
def entry_ids(blk, p_picks_row, n_win_blocks, n_ent, ENTRIES: tl.constexpr, BLOCK_N: tl.constexpr):
    """Compressed entry indices of key block blk, int64 [BLOCK_N], -1 where none (window blocks, past the row's
    entries, CSA's -1 picks); CSA reads them from the row's picks."""
    j = (blk - n_win_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = (j >= 0) & (j < n_ent)
    if ENTRIES == 2:
        o_j = tl.load(p_picks_row + j, mask=m, other=-1).to(tl.int64)
    else:
        o_j = tl.where(m, j, -1).to(tl.int64)
    return o_j


@triton.jit
def entry_blocks(o_j, p_bt_row, ENT_PER_PAGE: tl.constexpr, ENTRIES: tl.constexpr):
    """Cache blocks (int64 [BLOCK_N], -1 = none) holding entries o_j: loads of the request's block-table row."""
    if ENTRIES != 0:
        block = tl.load(p_bt_row + o_j // ENT_PER_PAGE, mask=o_j >= 0, other=-1).to(tl.int64)
    else:
        block = o_j
    return block


@triton.jit
def key_rows(blk, o_j, block, pos, n_win, n_win_blocks, start, q_lo, p_ring, p_step, step_entries, p_ent,
              ent_page_bytes, ENT_PER_PAGE: tl.constexpr, WINDOW: tl.constexpr, DATA_BYTES: tl.constexpr,
              SCALE_BYTES: tl.constexpr, ENTRIES: tl.constexpr, BLOCK_N: tl.constexpr):
    """Data / scale row pointers [BLOCK_N] of key block blk, which keys are valid, and which are `unread` (picks
    without a block: their logits are NaN, as the reference's reads of slot -1 are). Window blocks come first:
    window key i is position pos - n_win + 1 + i, before the step from the ring (not yet overwritten by this step's
    append), the step's own from step_kv; entry blocks read the entry pages. Both address forms are computed and one
    selected, so the loop has one body."""
    o_n = tl.arange(0, BLOCK_N)
    o_i = blk * BLOCK_N + o_n
    is_win = o_i < n_win_blocks * BLOCK_N  # [BLOCK_N] (the interpreter mixes scalar and tensor bools badly)
    at = pos - n_win + 1 + o_i
    ring = at < start
    valid = is_win & (o_i < n_win)
    p_page = tl.where(ring, p_ring, p_step)
    entry = tl.where(ring, at % WINDOW, q_lo + at - start).to(tl.int64)
    per_page = tl.where(ring, WINDOW, step_entries)
    unread = o_n < 0
    if ENTRIES != 0:
        ent_valid = o_j >= 0
        # a pick without a block reads nothing (never a stray address) and turns the row NaN, as in the reference
        unread = ent_valid & (block < 0)
        p_page = tl.where(is_win, p_page, p_ent + block * ent_page_bytes)
        entry = tl.where(is_win, entry, o_j % ENT_PER_PAGE)
        per_page = tl.where(is_win, per_page, ENT_PER_PAGE)
        valid = tl.where(is_win, valid, ent_valid)
    p_data, p_scale = entry_rows(p_page, entry, per_page, DATA_BYTES, SCALE_BYTES)
    return p_data, p_scale, valid, unread
