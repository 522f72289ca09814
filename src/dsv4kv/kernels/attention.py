"""Sparse attention with a sink, reading the paged cache directly (Triton): the kernel of
`dsv4kv.ops.attention.sparse_attention` over the keys `ops.gather` would gather, without gathering them.

For token row t (position p >= 0 of request b) and head h:

    out[t, h] = sum_k w_k * key_k,   w = softmax_k(scale * q[t, h] . key_k) with exp(sink_h) added to the
                                     denominator only (V = K, all head_dim dims)

over the keys, in one online-softmax pass (flash-attention style, log2 domain):
- window: positions max(0, p - window + 1) .. p; those of this step (>= start_b) from `step_kv` entry
  query_start[b] + pos - start_b, older ones from the request's window ring (entry pos % window);
- compressed entries of ratio m (when `entry_pool` is given): every visible entry j < (p + 1) // m (HCA,
  `picks` None) or the entries picks[t, i] >= 0 (CSA; any order, -1 = no pick, a repeated pick counts
  once per occurrence, as in the reference). Entry j lives at block_table[slot, j*m // page_tokens], offset
  j % (page_tokens // m).
Padding rows (position -1) and rows without keys return zeros: the sink starts the softmax as a key of
value 0 (running max = sink, sum = 1), so a row that never meets a key ends with acc = 0.

Numerics. Keys are dequantized in registers (no staging copy of any pool): e4m3 * 2^(ue8m0 - 127) and the
bf16 rope dims are exactly bf16 values, so q . k is a bf16 tensor-core dot with fp32 accumulation, exact per
product for a bf16 q (an fp32 q is split into three bf16 parts, which carry all its 24 bits). The softmax
runs in fp32; for w . V each fp32 weight is split into two bf16 parts (hi + lo, two dots), ~2^-17 relative
instead of bf16's 2^-9. Measured against the fp32 reference (error / the row's max |out|, tests/
test_kernel_attention.py, Triton's interpreter, whose fp32 -> bf16 casts truncate): <= 2.5e-5 with the split,
4e-3..7e-3 with bf16 weights alone. Keys are not flushed: ue8m0 code 0 scales by 2^-127, code 0xFF is NaN,
as `quant.ue8m0_decode`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layout import EntryLayout, MainFP8Layout
from ..ops.common import require
from ..plan import StepPlan
from .common import check_pool, check_tensor, interpreted, padded_rows

__all__ = ["sparse_attention_paged"]

# Tile sizes, checked by compiling for sm_90 ahead of time (triton 3.9, H=64, D=512): 8 warps with 32-key blocks and
# 2 stages use ~230 registers, no spills and ~130 KiB of shared memory (4 warps spill; 64-key blocks at 3 stages
# exceed shared memory). Not yet timed on the H200.
BLOCK_H = 16  # heads per program: the smallest tensor-core M; the [16, D] fp32 accumulator stays in registers
BLOCK_N = 32  # keys per online-softmax block
NUM_WARPS = 8
NUM_STAGES = 2

_WINDOW_ONLY, _ALL_VISIBLE, _PICKS = 0, 1, 2  # which compressed entries a row attends to


@triton.jit
def _rows(p_page, entry, per_page, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """Byte pointers [N] to the data rows and the scale rows of entries `entry` [N] of the pages at `p_page` (a page
    of per_page entries holds the data rows first, then the scale rows)."""
    entry = entry.to(tl.int64)
    return p_page + entry * DATA_BYTES, p_page + per_page * DATA_BYTES + entry * SCALE_BYTES


@triton.jit
def _load_keys(p_data, p_scale, mask, D: tl.constexpr, NOPE: tl.constexpr):
    """Keys of the entries at data / scale row pointers [N] -> bf16 [N, D], exactly their decoded values; 0 where
    ~mask."""
    o_d = tl.arange(0, D)
    m_row = mask[:, None]
    if NOPE > 0:
        # nope dims: e4m3 byte d times the ue8m0 scale of its 64-dim block (scales applied on an [N, D / 64, 64]
        # view, one load per scale byte); rope dims: bf16 after the nope bytes (data rows start at even bytes)
        o_s = tl.arange(0, D // 64)
        b_code = tl.load(p_data[:, None] + o_d[None, :], mask=m_row & (o_d < NOPE)[None, :], other=0)
        b_exp = tl.load(p_scale[:, None] + o_s[None, :], mask=m_row & (o_s < NOPE // 64)[None, :],
                        other=127).to(tl.int32)
        b_bits = tl.where(b_exp == 0, 0x400000, b_exp << 23)  # code 0: 2^-127, an fp32 subnormal (quant.ue8m0_decode)
        b_bits = tl.where(b_exp == 255, 0x7FC00000, b_bits)  # code 0xFF: NaN
        b_nope = tl.reshape(b_code.to(tl.float8e4nv, bitcast=True).to(tl.float32), [mask.shape[0], D // 64, 64])
        b_nope = tl.reshape(b_nope * b_bits.to(tl.float32, bitcast=True)[:, :, None], [mask.shape[0], D])
        p_rope = (p_data + NOPE).to(tl.pointer_type(tl.bfloat16))
        b_rope = tl.load(p_rope[:, None] + (o_d - NOPE)[None, :], mask=m_row & (o_d >= NOPE)[None, :], other=0.0)
        b_k = tl.where((o_d < NOPE)[None, :], b_nope, b_rope.to(tl.float32)).to(tl.bfloat16)
    else:
        b_k = tl.load(p_data.to(tl.pointer_type(tl.bfloat16))[:, None] + o_d[None, :], mask=m_row, other=0.0)
    return b_k


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    """a @ b + acc of bf16 operands, fp32 accumulation. DOT_F32: the same products in fp32 (exact for bf16
    values), for Triton's interpreter, whose bf16 tl.dot multiplies the raw bit patterns (triton#11584)."""
    if DOT_F32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _attend(b_q0, b_q1, b_q2, b_k, valid, m_i, l_i, acc, qk_scale, Q_SPLIT: tl.constexpr, DOT_F32: tl.constexpr):
    """One block of keys b_k bf16 [N, D] (valid [N]) into the running max m_i, sum l_i, acc [BLOCK_H, D] (log2
    domain). q is b_q0 (bf16 q) or b_q0 + b_q1 + b_q2 (Q_SPLIT: the three bf16 parts of an fp32 q)."""
    b_kt = tl.trans(b_k)
    b_s = _dot(b_q0, b_kt, tl.zeros([b_q0.shape[0], b_k.shape[0]], tl.float32), DOT_F32)
    if Q_SPLIT:
        b_s = _dot(b_q1, b_kt, b_s, DOT_F32)
        b_s = _dot(b_q2, b_kt, b_s, DOT_F32)
    b_s = tl.where(valid[None, :], b_s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_s, 1))  # finite: m_i starts at the sink
    alpha = tl.exp2(m_i - m_new)
    b_p = tl.exp2(b_s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(b_p, 1)
    # two bf16 parts of the fp32 weights: ~2^-17 relative instead of bf16's 2^-9
    b_ph = b_p.to(tl.bfloat16)
    b_pl = (b_p - b_ph.to(tl.float32)).to(tl.bfloat16)
    acc = _dot(b_ph, b_k, acc * alpha[:, None], DOT_F32)
    acc = _dot(b_pl, b_k, acc, DOT_F32)
    return m_new, l_i, acc


@triton.jit
def _sparse_attention_kernel(
        p_q, p_sinks, p_out,  # q [R, H, D], sinks fp32 [H], out fp32 [R, H, D]
        p_positions, p_token_request, p_request_slots, p_query_start, p_seq_lens, p_block_table, bt_stride,
        p_step, step_entries,  # this step's kv: one page of R entries
        p_win, win_page_bytes,  # the window ring: page = request slot, WINDOW entries
        p_ent, ent_page_bytes, ent_per_page, ratio, page_tokens,  # compressed entries
        p_picks, n_picks, qk_scale, H,
        WINDOW: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, DATA_BYTES: tl.constexpr,
        SCALE_BYTES: tl.constexpr, ENTRIES: tl.constexpr, Q_SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (token row, head block); pools are uint8 pointers."""
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_d = tl.arange(0, D)
    o_n = tl.arange(0, BLOCK_N)

    o_q = (i_t.to(tl.int64) * H + o_h)[:, None] * D + o_d[None, :]
    b_q = tl.load(p_q + o_q, mask=m_h[:, None], other=0.0)
    # fp32 q: three bf16 parts carry its 24 significant bits, so every q . k product stays exact
    b_q0 = b_q.to(tl.bfloat16)
    b_q1 = b_q0
    b_q2 = b_q0
    if Q_SPLIT:
        b_rest = b_q - b_q0.to(tl.float32)
        b_q1 = b_rest.to(tl.bfloat16)
        b_q2 = (b_rest - b_q1.to(tl.float32)).to(tl.bfloat16)

    pos = tl.load(p_positions + i_t)
    b = tl.maximum(tl.load(p_token_request + i_t), 0)  # padding rows (-1): every key below is masked off
    slot = tl.load(p_request_slots + b)
    q_lo = tl.load(p_query_start + b)
    start = tl.load(p_seq_lens + b) - (tl.load(p_query_start + b + 1) - q_lo)  # history before the step

    # the sink is a key of value 0 and logit sink_h: running max = sink, running sum = exp(0) = 1
    m_i = tl.load(p_sinks + o_h, mask=m_h, other=0.0) * 1.4426950408889634
    l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)

    # window positions lo .. pos: those before the step from the ring (not yet overwritten by this step's
    # append), the step's own from step_kv. Padding rows (pos -1) have neither.
    lo = tl.maximum(pos - WINDOW + 1, 0)
    p_ring = p_win + slot.to(tl.int64) * win_page_bytes
    n_ring = tl.minimum(start, pos + 1) - lo
    for i0 in range(0, n_ring, BLOCK_N):
        valid = i0 + o_n < n_ring
        p_data, p_scale = _rows(p_ring, (lo + i0 + o_n) % WINDOW, WINDOW, DATA_BYTES, SCALE_BYTES)
        b_k = _load_keys(p_data, p_scale, valid, D, NOPE)
        m_i, l_i, acc = _attend(b_q0, b_q1, b_q2, b_k, valid, m_i, l_i, acc, qk_scale, Q_SPLIT, DOT_F32)
    step_lo = tl.maximum(lo, start)
    n_step = pos + 1 - step_lo
    for i0 in range(0, n_step, BLOCK_N):
        valid = i0 + o_n < n_step
        p_data, p_scale = _rows(p_step, q_lo + step_lo - start + i0 + o_n, step_entries, DATA_BYTES, SCALE_BYTES)
        b_k = _load_keys(p_data, p_scale, valid, D, NOPE)
        m_i, l_i, acc = _attend(b_q0, b_q1, b_q2, b_k, valid, m_i, l_i, acc, qk_scale, Q_SPLIT, DOT_F32)

    if ENTRIES != 0:
        if ENTRIES == 1:
            count = (pos + 1) // ratio  # every visible entry; 0 for padding rows
        else:
            count = (pos >= 0).to(tl.int32) * n_picks  # padding rows: no picks
        for j0 in range(0, count, BLOCK_N):
            if ENTRIES == 1:
                o_j = (j0 + o_n).to(tl.int64)
                valid = o_j < count
            else:
                o_j = tl.load(p_picks + i_t.to(tl.int64) * n_picks + j0 + o_n, mask=j0 + o_n < n_picks,
                              other=-1).to(tl.int64)
                valid = o_j >= 0
            block = tl.load(p_block_table + slot.to(tl.int64) * bt_stride + (o_j * ratio) // page_tokens,
                            mask=valid, other=-1)
            p_data, p_scale = _rows(p_ent + block.to(tl.int64) * ent_page_bytes, o_j % ent_per_page, ent_per_page,
                                    DATA_BYTES, SCALE_BYTES)
            b_k = _load_keys(p_data, p_scale, valid & (block >= 0), D, NOPE)
            # a pick without a block reads NaN, as the reference's slot -1 does (never a stray address)
            b_k = tl.where((valid & (block < 0))[:, None], float("nan"), b_k.to(tl.float32)).to(tl.bfloat16)
            m_i, l_i, acc = _attend(b_q0, b_q1, b_q2, b_k, valid, m_i, l_i, acc, qk_scale, Q_SPLIT, DOT_F32)

    tl.store(p_out + o_q, acc / l_i[:, None], mask=m_h[:, None])


def _layout_dims(layout: EntryLayout) -> tuple[int, int]:
    """(nope dims, scale bytes) of a main-entry layout: (0, 0) for bf16 entries."""
    if isinstance(layout, MainFP8Layout) and layout.name == "fp8":
        return layout.nope_dim, layout.scale_bytes
    require(type(layout) is EntryLayout and layout.name == "bf16" and layout.data_bytes == 2 * layout.dim,
            f"layout: expected a main-entry layout (dsv4kv.layout.main_layout('fp8' | 'bf16', ...)), got {layout!r}")
    return 0, 0


def sparse_attention_paged(q: torch.Tensor, plan: StepPlan, *, sinks: torch.Tensor, scale: float,
                           layout: EntryLayout, window: int, window_pool: torch.Tensor, step_kv: torch.Tensor,
                           entry_pool: torch.Tensor | None = None, ratio: int = 0, page_tokens: int = 0,
                           picks: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sparse attention with sink over the window (ring + this step's kv) and compressed entries -> fp32 [R, H, D].

    Args:
        q: bf16 / fp32 [R, H, D] roped queries, R = the plan's padded rows (plan.positions.shape[0]).
        plan: the step's plan; every row runs (padding rows give zeros).
        sinks: fp32 [H] learned sinks; scale: softmax scale (head_dim^-0.5).
        layout: the main-entry layout (`main_layout("fp8" | "bf16", D, rope_dim)`).
        window: window length; window_pool: uint8 [max_requests, layout.page_bytes(window)], the ring
            (page = request slot, entry = position % window), read before this step's append.
        step_kv: uint8 [1, layout.page_bytes(R)]: this step's kv encoded in `layout`, entry t = row t.
        entry_pool: uint8 [pages, layout.page_bytes(page_tokens // ratio)] compressed entries, or None
            (window-only layer). ratio / page_tokens: its compression ratio and tokens per page.
        picks: int32 / int64 [R, K] entry indices (-1 = none) for CSA; None with an entry pool = every
            visible entry (HCA).
        out: optional fp32 [R, H, D] to write (nothing is allocated then: CUDA-graph capturable).
    """
    require(isinstance(plan, StepPlan), f"plan: expected a StepPlan, got {type(plan).__name__}")
    require(isinstance(layout, EntryLayout), f"layout: expected an EntryLayout, got {type(layout).__name__}")
    nope, scale_bytes = _layout_dims(layout)
    rows, dim = padded_rows(plan), layout.dim
    require(dim >= 16 and dim & (dim - 1) == 0, f"layout: head_dim must be a power of two >= 16, got {dim}")
    device = plan.positions.device  # the cache's device
    check_tensor("q", q, dtype=(torch.bfloat16, torch.float32), shape=(rows, None, dim), device=device)
    heads = q.shape[1]
    require(heads >= 1, "q: needs at least one head")
    check_tensor("sinks", sinks, dtype=torch.float32, shape=(heads,), device=device)
    require(isinstance(scale, (int, float)) and not isinstance(scale, bool) and 0 < float(scale) < float("inf"),
            f"scale: expected a positive finite float, got {scale!r}")
    require(isinstance(window, int) and not isinstance(window, bool) and window >= 1,
            f"window: expected a positive int, got {window!r}")
    for name in ("positions", "token_request"):
        check_tensor(f"plan.{name}", getattr(plan, name), dtype=torch.int32, shape=(rows,), device=device)
    requests = plan.request_slots.shape[0] if isinstance(plan.request_slots, torch.Tensor) else -1
    check_tensor("plan.request_slots", plan.request_slots, dtype=torch.int32, shape=(requests,), device=device)
    check_tensor("plan.seq_lens", plan.seq_lens, dtype=torch.int32, shape=(requests,), device=device)
    check_tensor("plan.query_start", plan.query_start, dtype=torch.int32, shape=(requests + 1,), device=device)
    check_tensor("plan.block_table", plan.block_table, dtype=torch.int32, shape=(None, None), device=device)
    check_pool("window_pool", window_pool, layout, window, device)
    require(window_pool.shape[0] == plan.block_table.shape[0],
            f"window_pool: {window_pool.shape[0]} request slots, the block table has {plan.block_table.shape[0]}")
    check_tensor("step_kv", step_kv, dtype=torch.uint8, shape=(1, layout.page_bytes(rows)), device=device)

    mode, per_page, n_picks = _WINDOW_ONLY, 1, 0
    ent_pool = step_kv  # an unused stand-in pointer for window-only layers
    if entry_pool is None:
        require(picks is None, "picks: given without an entry_pool")
    else:
        require(isinstance(ratio, int) and isinstance(page_tokens, int) and ratio >= 1 and page_tokens >= 1
                and page_tokens % ratio == 0,
                f"ratio / page_tokens: expected positive ints with page_tokens a multiple of ratio, got "
                f"{ratio!r} / {page_tokens!r}")
        per_page = page_tokens // ratio
        check_pool("entry_pool", entry_pool, layout, per_page, device)
        ent_pool, mode = entry_pool, _ALL_VISIBLE
        if picks is not None:
            check_tensor("picks", picks, dtype=(torch.int32, torch.int64), shape=(rows, None), device=device)
            require(picks.shape[1] >= 1, "picks: needs at least one column")
            mode, n_picks = _PICKS, picks.shape[1]
    if out is None:
        out = torch.empty((rows, heads, dim), dtype=torch.float32, device=device)
    else:
        check_tensor("out", out, dtype=torch.float32, shape=(rows, heads, dim), device=device)
    if rows == 0:
        return out

    grid = (rows, -(-heads // BLOCK_H))
    _sparse_attention_kernel[grid](
        q, sinks, out, plan.positions, plan.token_request, plan.request_slots, plan.query_start, plan.seq_lens,
        plan.block_table, plan.block_table.shape[1],
        step_kv, rows,
        window_pool, window_pool.shape[1],
        ent_pool, ent_pool.shape[1], per_page, max(ratio, 1), max(page_tokens, 1),
        picks if picks is not None else plan.positions, n_picks, float(scale) * 1.4426950408889634, heads,
        WINDOW=window, D=dim, NOPE=nope, DATA_BYTES=layout.data_bytes, SCALE_BYTES=scale_bytes, ENTRIES=mode,
        Q_SPLIT=q.dtype == torch.float32, DOT_F32=interpreted(), BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out
