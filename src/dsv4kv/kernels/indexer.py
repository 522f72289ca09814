"""Lightning-indexer scores over the paged indexer-key pool (Triton), the kernel of `ops.indexer.indexer_scores`.

    out[t, j] = sum_h w[t, h] * ReLU(q[t, h] . K_j) * D^-0.5     for j < visible(t) = (positions[t] + 1) // ratio
    out[t, j] = -inf                                              for j >= visible(t) and for padding rows

K_j is entry j of row t's request, decoded in the kernel straight from the pool bytes (no dequantized
copy): MXFP4 (packed e2m1, element 2i in the low nibble, one ue8m0 scale per 32 values; 0xFF = NaN,
0x00 = 2^-127), FP8 (e4m3 values, one fp32 scale per key) or bf16. Never-written or unallocated entries
are never loaded (masked loads), so a NaN-poisoned pool cannot leak into visible scores.

Numerics. The query arrives already in the keys' numerics (`ops.indexer.indexer_query`): for MXFP4 and
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
conversion gives NaN, and the quantizer never writes such a byte under a finite scale.

Work split. Grid (row, chunk of BLOCK_J * ITERS entries): a program loads q[t] ([H, D] = [64, 128] for
V4, as bf16 q^T [D, H]) and the head weights once, then per iteration decodes [BLOCK_J, D] keys in
registers and runs one [BLOCK_J, D] x [D, H] MMA (the keys are the A operand so the decoded registers
feed it directly). Chunks past visible(t) only store -inf. Decode (R small, J up to 2^18) gets its
parallelism from the chunks. For prefill (R in the thousands) this reads every key once per row; the
change to make there: a program per (request, chunk) that stacks BLOCK_T rows of one request into the
MMA's N dimension (BLOCK_T * H columns, weights reduced per row after), so each key tile is decoded
once for BLOCK_T rows, with the -inf mask per row.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..layout import EntryLayout, IndexerFP8Layout, IndexerMXFP4Layout
from ..ops.common import require
from ..plan import StepPlan
from .common import check_pool, check_tensor, interpreted, padded_rows

__all__ = ["indexer_scores_paged"]

_BF16, _FP8, _MXFP4 = 0, 1, 2


@triton.jit
def _ue8m0(code):
    """E8M0 byte (int32) -> fp32 2^(code - 127); 0x00 -> 2^-127 (subnormal), 0xFF -> NaN."""
    bits = tl.where(code == 0, 0x00400000, tl.where(code == 0xFF, 0x7FC00000, code << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(code):
    """e2m1 code (int32, 0..15; bit 3 = sign) -> fp32 value in {0, 0.5, 1, 1.5, 2, 3, 4, 6} with sign."""
    mag = code & 7
    # codes >= 2 are normal: exponent (mag >> 1) - 1, mantissa bit mag & 1 -> fp32 bits directly
    normal = ((mag << 22) + (126 << 23)).to(tl.float32, bitcast=True)
    value = tl.where(mag < 2, mag.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32; NaN stays NaN. Done on the bits so the
    GPU and the interpreter (whose fp32 -> bf16 cast truncates) round alike."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # noqa: PLR0124 (x != x: NaN)


@triton.jit
def _indexer_scores_kernel(
    q_ptr,  # fp32 [R, H, D]
    w_ptr,  # fp32 [R, H]
    positions_ptr, token_request_ptr, request_slots_ptr,  # int32 [R], [R], [B]
    block_table_ptr,  # int32 [max_requests, table_stride]
    pool_ptr,  # uint8 [pages, PAGE_BYTES]
    out_ptr,  # fp32 [R, num_entries]
    num_heads, num_entries, table_stride, score_scale,
    FORMAT: tl.constexpr, RATIO: tl.constexpr, D: tl.constexpr, P: tl.constexpr, PAGE_BYTES: tl.constexpr,
    DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr, ITERS: tl.constexpr, DOT: tl.constexpr,
):
    i_t, i_c = tl.program_id(0), tl.program_id(1)
    t = i_t.to(tl.int64)
    position = tl.load(positions_ptr + i_t)
    request = tl.load(token_request_ptr + i_t)
    slot = tl.load(request_slots_ptr + request, mask=request >= 0, other=-1)
    visible = tl.where((position >= 0) & (slot >= 0), (position + 1) // RATIO, 0)
    visible = tl.minimum(visible, num_entries)
    chunk_lo = i_c * (BLOCK_J * ITERS)
    chunk_hi = tl.minimum(chunk_lo + BLOCK_J * ITERS, num_entries)
    p_out = out_ptr + t * num_entries

    if chunk_lo < visible:  # chunks wholly past visible(t) (and padding rows) never load q
        o_h = tl.arange(0, BLOCK_H)
        m_h = o_h < num_heads
        # D^-0.5 folded into the head weights; padded heads get weight 0 (and a zero query column)
        b_w = tl.load(w_ptr + t * num_heads + o_h, mask=m_h, other=0.0) * score_scale
        p_q = q_ptr + t * num_heads * D + o_h[None, :] * D
        if FORMAT == 2:
            # q^T split into even / odd elements: they meet the low / high nibbles of each key byte
            o_d = tl.arange(0, D // 2)
            b_qe = _round_bf16(tl.load(p_q + 2 * o_d[:, None], mask=m_h[None, :], other=0.0)).to(DOT)  # [D/2, H]
            b_qo = _round_bf16(tl.load(p_q + 2 * o_d[:, None] + 1, mask=m_h[None, :], other=0.0)).to(DOT)
            o_nb = tl.arange(0, D // 32)
            o_nib = tl.arange(0, 16)
        else:
            o_d = tl.arange(0, D)
            b_q = _round_bf16(tl.load(p_q + o_d[:, None], mask=m_h[None, :], other=0.0)).to(DOT)  # [D, BLOCK_H]
        p_table = block_table_ptr + slot.to(tl.int64) * table_stride

        for j0 in range(chunk_lo, tl.minimum(chunk_hi, visible), BLOCK_J):
            o_j = j0 + tl.arange(0, BLOCK_J)
            m_j = o_j < visible
            block = tl.load(p_table + o_j // P, mask=m_j, other=-1)
            m_j = m_j & (block >= 0)
            p_entry = pool_ptr + block.to(tl.int64) * PAGE_BYTES
            p_data = p_entry + (o_j % P) * DATA_BYTES
            p_scale = p_entry + P * DATA_BYTES + (o_j % P) * SCALE_BYTES
            if FORMAT == 2:
                # [BLOCK_J, D/32 scale blocks, 16 bytes = 32 values]; masked entries decode to 0 (scale 1)
                b_byte = tl.load(p_data[:, None, None] + o_nb[None, :, None] * 16 + o_nib[None, None, :],
                                 mask=m_j[:, None, None], other=0).to(tl.int32)
                b_sc = tl.load(p_scale[:, None] + o_nb[None, :], mask=m_j[:, None], other=127).to(tl.int32)
                b_sc = _ue8m0(b_sc)[:, :, None]
                # e2m1 times a power of two: exact in bf16
                b_lo = tl.reshape(_e2m1(b_byte & 15) * b_sc, (BLOCK_J, D // 2)).to(DOT)
                b_hi = tl.reshape(_e2m1(b_byte >> 4) * b_sc, (BLOCK_J, D // 2)).to(DOT)
                b_dot = tl.dot(b_lo, b_qe)
                b_dot = tl.dot(b_hi, b_qo, b_dot)  # [BLOCK_J, BLOCK_H]
            elif FORMAT == 1:
                b_k = tl.load(p_data[:, None] + o_d[None, :], mask=m_j[:, None], other=0)
                b_k = b_k.to(tl.float8e4nv, bitcast=True).to(DOT)
                b_ks = tl.load(p_scale.to(tl.pointer_type(tl.float32)), mask=m_j, other=0.0)
                b_dot = tl.dot(b_k, b_q) * b_ks[:, None]  # a power-of-two scale: exact
            else:
                b_k = tl.load(p_data.to(tl.pointer_type(tl.bfloat16))[:, None] + o_d[None, :], mask=m_j[:, None],
                              other=0.0).to(DOT)
                b_dot = tl.dot(b_k, b_q)
            b_dot = tl.where(b_dot < 0, 0.0, b_dot)  # ReLU that keeps NaN, like torch.relu
            b_s = tl.sum(b_dot * b_w[None, :], axis=1)
            tl.store(p_out + o_j, tl.where(o_j < visible, b_s, float("-inf")), mask=o_j < num_entries)

    # the rest of the chunk is past visible(t)
    for j0 in range(tl.maximum(chunk_lo, tl.cdiv(visible, BLOCK_J) * BLOCK_J), chunk_hi, BLOCK_J):
        o_j = j0 + tl.arange(0, BLOCK_J)
        tl.store(p_out + o_j, tl.full((BLOCK_J,), float("-inf"), tl.float32), mask=o_j < num_entries)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _config(rows: int, entries: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_J, ITERS, num_warps): iterations per program grow (q is loaded once per program) while
    the grid still fills the GPU about once over."""
    block_j = 64
    blocks = triton.cdiv(entries, block_j)
    target = 1 if device.type != "cuda" else _num_sms(device)
    iters = 1
    while iters < 16 and rows * triton.cdiv(blocks, 2 * iters) >= target:
        iters *= 2
    return block_j, iters, 4


def _format(layout: EntryLayout) -> int:
    if isinstance(layout, IndexerMXFP4Layout):
        return _MXFP4
    if isinstance(layout, IndexerFP8Layout):
        require(layout.scale_bytes == 4, f"layout: fp8 keys need one fp32 scale (4 B), got {layout.scale_bytes} B")
        return _FP8
    require(type(layout) is EntryLayout and layout.scale_bytes == 0 and layout.data_bytes == 2 * layout.dim
            and not layout.rotated,
            f"layout: expected an indexer layout (dsv4kv.layout.indexer_layout: mxfp4, fp8 or bf16), got {layout!r}")
    return _BF16


def indexer_scores_paged(q: torch.Tensor, weights: torch.Tensor, plan, key_pool: torch.Tensor, layout: EntryLayout,
                         *, ratio: int, page_tokens: int, out: torch.Tensor | None = None,
                         max_entries: int | None = None) -> torch.Tensor:
    """Indexer scores of every plan row against its request's compressed keys -> fp32 [R, J].

    Args:
        q: fp32 [R, H, D] contiguous, R = plan.positions.shape[0] (padding rows included): the roped
            indexer query already in the keys' numerics (`ops.indexer.indexer_query(q_raw, layout)`).
        weights: fp32 [R, H] contiguous, head weights already multiplied by H^-0.5.
        plan: the step's `StepPlan` (positions, token_request, request_slots, block_table are read).
        key_pool: uint8 [pages, layout.page_bytes(page_tokens // ratio)] contiguous: the CSA layer's keys.
        layout: `dsv4kv.layout.indexer_layout("mxfp4" | "fp8" | "bf16", D)`.
        ratio: the layer's compression ratio; page_tokens: original tokens per block (a multiple of ratio).
        out: optional fp32 [R, J] contiguous, overwritten entirely (for CUDA-graph capture).
        max_entries: J when `out` is not given; default block_table.shape[1] * page_tokens // ratio.

    Returns `out`: scores for j < visible(t), -inf elsewhere and on padding rows.
    """
    require(isinstance(plan, StepPlan), f"plan: expected a StepPlan, got {type(plan).__name__}")
    fmt = _format(layout)
    dim = layout.dim
    require(isinstance(ratio, int) and ratio > 0, f"ratio: expected a positive int, got {ratio!r}")
    require(isinstance(page_tokens, int) and page_tokens > 0 and page_tokens % ratio == 0,
            f"page_tokens: expected a positive multiple of ratio {ratio}, got {page_tokens!r}")
    require(dim >= 16 and dim & (dim - 1) == 0, f"layout: the kernel needs a power-of-two dim >= 16, got {dim}")
    device = key_pool.device if isinstance(key_pool, torch.Tensor) else None
    per_page = page_tokens // ratio
    check_pool("key_pool", key_pool, layout, per_page, device)
    rows = padded_rows(plan)
    check_tensor("q", q, dtype=torch.float32, shape=(rows, None, dim), device=device)
    heads = q.shape[1]
    require(heads > 0, "q: expected at least one head")
    check_tensor("weights", weights, dtype=torch.float32, shape=(rows, heads), device=device)
    check_tensor("plan.positions", plan.positions, dtype=torch.int32, shape=(rows,), device=device)
    check_tensor("plan.token_request", plan.token_request, dtype=torch.int32, shape=(rows,), device=device)
    check_tensor("plan.request_slots", plan.request_slots, dtype=torch.int32, shape=(None,), device=device)
    check_tensor("plan.block_table", plan.block_table, dtype=torch.int32, shape=(None, None), device=device)
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

    block_j, iters, num_warps = _config(rows, entries, device)
    grid = (rows, triton.cdiv(entries, block_j * iters))
    _indexer_scores_kernel[grid](
        q, weights, plan.positions, plan.token_request, plan.request_slots, plan.block_table, key_pool, out,
        heads, entries, plan.block_table.stride(0), dim ** -0.5,
        FORMAT=fmt, RATIO=ratio, D=dim, P=per_page, PAGE_BYTES=key_pool.shape[1],
        DATA_BYTES=layout.data_bytes, SCALE_BYTES=layout.scale_bytes,
        BLOCK_H=max(16, triton.next_power_of_2(heads)), BLOCK_J=block_j, ITERS=iters, num_warps=num_warps,
        # Triton's interpreter multiplies the bit patterns of bf16 dot operands (triton-lang/triton#11584):
        # there the same bf16 values go through an fp32 dot, which forms the same exact products
        DOT=tl.float32 if interpreted() else tl.bfloat16,
    )
    return out
