"""Sparse attention with a sink, reading the paged cache directly (Triton): the kernel of
`ops.attention.reference.sparse_attention` over the keys `ops.attention.gather` would gather, without gathering them.

For token row t (position p >= 0 of request b) and head h:

    out[t, h] = sum_k w_k * key_k,   w = softmax_k(scale * q[t, h] . key_k) with exp(sink_h) added to the
                                     denominator only (V = K, all head_dim dims)

over the keys, in an online softmax (flash-attention style, log2 domain), walked in blocks of BLOCK_N keys:
- window blocks: positions max(0, p - window + 1) .. p in order; those of this step (>= start_b) from `step_kv`
  entry query_start[b] + pos - start_b, older ones from the request's window ring (entry pos % window);
- then entry blocks, compressed entries of ratio m (when `entry_pool` is given): every visible entry
  j < (p + 1) // m (HCA, `picks` None) or the entries picks[t, i] >= 0 (CSA; any order, -1 = no pick, a repeated
  pick counts once per occurrence, as in the reference). Entry j lives at block_table[slot, j*m // page_tokens],
  offset j % (page_tokens // m).
The sink starts the softmax as a key of value 0 (running max = sink, sum = 1), so a row that never meets a key
(padding rows: position -1) ends with acc = 0: exact zeros.

Split-KV (flash decoding), for grids too small to fill the GPU (decode batches). With S > 1 splits (chosen on the
host from fixed shapes only, `_config`), program (t, head block, s) walks the s-th run of ceil(blocks_t / S)
consecutive key blocks of row t (runs start on block boundaries, so the split of a row depends on its own key
count). Each split starts from running max m = sink, sum l = 0, acc = 0 (the sink as a reference point only) and
writes (m_s, l_s, acc_s) to the workspace; a second kernel merges the splits that hold keys, in order:

    M = max(sink, max_s m_s),  l = 2^(sink - M) + sum_s l_s 2^(m_s - M),  out = sum_s acc_s 2^(m_s - M) / l

so the sink counts once, a split without keys is never written nor read (no -inf - -inf), and a row without keys
still gets acc = 0, l = 1. S = 1 is the single pass: no workspace, no merge.

Work split (`AttentionTuning`). A program holds up to 64 heads of one row (BLOCK_H): they are the M dimension of both
tensor-core products, so each key block is read and decoded once per 64 heads into one bf16 tile [BLOCK_N, D] that
both products read (q . k through a transposed view of it, w . V = w . K), with the fp32 accumulator [64, D] split
over two warpgroups; with two warpgroups each block's logits go through a scratch row (QK_SCRATCH), so each computes
half of q . k instead of all of it. The window blocks and the entry blocks run in one loop (both address forms
computed, one selected).

Numerics (docs/numerics.md). Keys are exact: e4m3 * 2^(ue8m0 - 127) and the rope dims are bf16 values; codes are
not flushed (ue8m0 code 0 scales by 2^-127, code 0xFF is NaN, as `quant.ue8m0_decode`). q enters the product in
bf16 (an fp32 q as two bf16 parts, ~2^-17 relative), the softmax runs in fp32 and its weights enter w . V in bf16,
as FlashMLA does; the running sum adds the weights as rounded. Against the fp32 reference: within 4e-3 of each
(row, head)'s largest output (tests/test_kernel_attention.py). The merge is fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...cache.layout import EntryLayout, MainFP8Layout
from ...checks import require
from ...cache.plan import StepPlan
from ..shared.common import check_pool, interpreted, overlaps, padded_rows, sm_count
from ...checks import check_tensor
from ..shared.encode import round_bf16
from ..shared.launch import launch_options, wait_for_prior_grids
from ..rope.kernel import check_cos_sin, rope_pairs
from .keys import entry_blocks, entry_ids, key_rows, key_tile, row_blocks
from .tuning import AttentionTuning, tuning_for

__all__ = ["sparse_attention_paged"]

_WINDOW_ONLY, _ALL_VISIBLE, _PICKS = 0, 1, 2  # which compressed entries a row attends to
_LOG2E = 1.4426950408889634


class _Config(NamedTuple):
    """Tiles and launch shape of one call."""

    block_h: int  # heads per program
    block_n: int  # keys per online-softmax block (split boundaries fall on these)
    splits: int  # key splits per row; 1 = single pass
    num_warps: int
    num_stages: int


def _config(rows: int, heads: int, max_keys: int, device: torch.device, tuning: AttentionTuning) -> _Config:
    """Tiles and split count from fixed shapes only (the plan's padded rows, heads, the most keys a row can have),
    so the launch shape is the same at every replay of a captured graph.

    A program holds one SM (registers, shared memory), so a grid of rows x head blocks programs fills the GPU once
    it reaches the SM count. Split only where it leaves at least half the SMs idle (a grid of 0.5..1 waves gains
    little from splitting and would pay the merge): then as many splits as one wave holds, each keeping at least
    `min_split_blocks` key blocks of the longest row; if even that leaves half the SMs idle, `small_block_h`-head
    blocks with splits of `small_min_split_blocks`. Off CUDA (the interpreter) always the single pass with `block_n`
    keys a block; tests force splits. V4-Flash decode on 132 SMs: CSA batch 1 (640 keys) -> 16 heads x 20 splits;
    HCA batch 1 at 1M -> 64 heads x 130 splits; batch 8 -> 10 (CSA) / 16 (HCA) splits; batch 64 -> 64-key blocks, 2
    splits; batch >= 67 -> 64-key blocks, no split.
    """
    t = tuning
    block_h = max(16, min(t.block_h, triton.next_power_of_2(heads)))  # a tensor-core M of at least 16
    if device.type != "cuda":
        return _Config(block_h, t.block_n, 1, 4 if block_h <= 32 else 8, t.num_stages)
    sms = sm_count(device)
    programs = max(rows, 1) * triton.cdiv(heads, block_h)
    block_n = t.large_block_n if 3 * programs >= sms else t.block_n
    splits = _splits(programs, max_keys, block_n, sms, t.min_split_blocks)
    if programs * splits < sms // 2 and block_h > t.small_block_h:
        block_h = t.small_block_h
        programs = max(rows, 1) * triton.cdiv(heads, block_h)
        splits = _splits(programs, max_keys, block_n, sms, t.small_min_split_blocks)
    return _Config(block_h, block_n, splits, 4 if block_h <= 32 else 8, t.num_stages)


def _splits(programs: int, max_keys: int, block_n: int, sms: int, min_blocks: int) -> int:
    if 2 * programs > sms:
        return 1
    return max(1, min(sms // programs, triton.cdiv(max_keys, block_n) // min_blocks))


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
def _round_bf16(x, DOT_F32: tl.constexpr):
    """x rounded to bf16, nearest even: a bf16 tensor, or under the interpreter (DOT_F32, whose casts truncate) an
    fp32 tensor holding the rounded values."""
    if DOT_F32:
        return round_bf16(x.to(tl.float32))
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _attend(b_q, b_q_lo, b_k, valid, unread, m_i, l_i, acc, qk_scale, p_scratch, Q_SPLIT: tl.constexpr,
            DOT_F32: tl.constexpr, QK_SCRATCH: tl.constexpr):
    """One block of keys b_k bf16 [BLOCK_N, D] (valid [BLOCK_N]; `unread`: picks without a block, whose logits
    are NaN as the reference's reads of slot -1 are) into the running max m_i, sum l_i [BLOCK_H] and
    acc fp32 [BLOCK_H, D] (log2 domain), for bf16 queries b_q [BLOCK_H, D] (Q_SPLIT: b_q + b_q_lo, the two bf16 parts
    of an fp32 q). The key tile is the B operand of both products (V = K); the weights enter the second in bf16.
    QK_SCRATCH: the logits pass through fp32 [BLOCK_H, BLOCK_N] at p_scratch (8-warp programs, see the wrapper)."""
    b_kt = tl.trans(b_k)
    b_s = _dot(b_q, b_kt, tl.zeros([b_q.shape[0], b_k.shape[0]], tl.float32), DOT_F32)
    if Q_SPLIT:
        b_s = _dot(b_q_lo, b_kt, b_s, DOT_F32)
    if QK_SCRATCH:
        o_s = tl.arange(0, b_q.shape[0])[:, None] * b_k.shape[0] + tl.arange(0, b_k.shape[0])[None, :]
        tl.store(p_scratch + o_s, b_s)
        tl.debug_barrier()  # every warp's logits are written before any warp reads a row
        b_s = tl.load(p_scratch + o_s)
        tl.debug_barrier()  # ... and read before the next block overwrites them
    b_s = tl.where(valid[None, :], b_s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
    b_s = tl.where(unread[None, :], float("nan"), b_s)
    m_new = tl.maximum(m_i, tl.max(b_s, 1))  # finite: m_i starts at the sink
    alpha = tl.exp2(m_i - m_new)
    # the sum takes the weights as rounded for the product, so the rounding scales each weight, not their total
    b_p = _round_bf16(tl.exp2(b_s - m_new[:, None]), DOT_F32)
    l_i = l_i * alpha + tl.sum(b_p.to(tl.float32), 1)
    acc = _dot(b_p, b_k, acc * alpha[:, None], DOT_F32)
    return m_new, l_i, acc


# The step's row count and the split count change from step to step (eager steps) and between graph sizes: plain
# runtime ints, so Triton neither compiles a variant per value class (== 1, % 16) nor bakes them in.
@triton.jit(do_not_specialize=["step_entries", "splits"])
def _sparse_attention_kernel(
        p_q, p_sinks, p_out, p_ws,  # q [R, H, D], sinks fp32 [H], out [R, H, D] (fp32, bf16 with ROPE_HALF),
        # workspace fp32 [R, S, H, D+2]
        p_positions, p_token_request, p_request_slots, p_query_start, p_seq_lens, p_block_table, bt_stride,
        p_step, step_entries,  # this step's kv: one page of R entries
        p_win, win_page_bytes,  # the window ring: page = request slot, WINDOW entries
        p_ent, ent_page_bytes,  # compressed entries: ENT_PER_PAGE of ratio RATIO per page
        p_picks, n_picks, qk_scale, H, splits, p_scratch,  # scratch: fp32 [programs, BLOCK_H * BLOCK_N]
        p_cos, p_sin,  # fp32 [R, ROPE_HALF]: the rows' RoPE tables, for the output's inverse RoPE (ROPE_HALF > 0)
        p_q_rope,  # bf16 [R, H, Q_ROPE_DIMS]: q's last dims, roped (Q_ROPE_DIMS > 0; q's own are then unread)
        RATIO: tl.constexpr, ENT_PER_PAGE: tl.constexpr,
        WINDOW: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, DATA_BYTES: tl.constexpr,
        SCALE_BYTES: tl.constexpr, ENTRIES: tl.constexpr, Q_SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, QK_SCRATCH: tl.constexpr,
        ROPE_HALF: tl.constexpr, Q_ROPE_DIMS: tl.constexpr):
    """One program per (token row, head block, key split); pools are uint8 pointers. SPLIT: write split
    program_id(2)'s partial softmax to the workspace; else (splits = 1) the row's normalized output, fp32, or
    (ROPE_HALF > 0) with the layer's inverse RoPE and rounded to bf16, as the merge writes it. The heads
    of the block are the M dimension of both products, so each key tile is read and decoded once per head
    block (once per row for V4-Flash's 64 heads)."""
    wait_for_prior_grids()
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    i_s = tl.program_id(2)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_d = tl.arange(0, D)

    pos = tl.load(p_positions + i_t)
    n_win, n_ent, n_win_blocks, n_blocks, per_split = row_blocks(pos, n_picks, splits, RATIO, WINDOW, ENTRIES,
                                                                  BLOCK_N)
    b_lo = i_s * per_split  # this split's blocks [b_lo, b_hi): all of them for the single pass
    b_hi = tl.minimum(b_lo + per_split, n_blocks)
    if SPLIT:
        if b_lo >= b_hi:  # a split without keys writes nothing: the merge skips it
            return
    # a row without keys (padding rows) reads no q; a [BLOCK_H] comparison, as the interpreter turns
    # `bool tensor & bool scalar` into ints
    m_busy = m_h & (b_lo + tl.zeros([BLOCK_H], tl.int32) < b_hi)

    p_q_row = p_q + i_t.to(tl.int64) * H * D
    p_q_tile = p_q_row + o_h[:, None] * D + o_d[None, :]
    if Q_ROPE_DIMS > 0:  # one load from two tensors: a tile made by arithmetic (a select) would feed the MMA from
        # registers and spill beside the accumulator; a loaded one goes through shared memory
        p_q_rope_tile = (p_q_rope + i_t.to(tl.int64) * H * Q_ROPE_DIMS + o_h[:, None] * Q_ROPE_DIMS
                         + (o_d - (D - Q_ROPE_DIMS))[None, :])
        p_q_tile = tl.where((o_d >= D - Q_ROPE_DIMS)[None, :], p_q_rope_tile, p_q_tile)
    b_q = tl.load(p_q_tile, mask=m_busy[:, None], other=0.0)
    # bf16 q as given; an fp32 q as two bf16 parts (16 significant bits: ~2^-17 relative per product)
    b_q_hi = _round_bf16(b_q, DOT_F32)
    b_q_lo = b_q_hi
    if Q_SPLIT:
        b_q_lo = _round_bf16(b_q - b_q_hi.to(tl.float32), DOT_F32)

    # the sink as a key of value 0 and logit sink_h: running max = sink, sum = exp(0) = 1. A split starts from the
    # same max (a finite reference point) with sum 0: the merge adds the sink once.
    m_i = tl.load(p_sinks + o_h, mask=m_h, other=0.0) * 1.4426950408889634
    if SPLIT:
        l_i = tl.zeros([BLOCK_H], tl.float32)
    else:
        l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)

    b = tl.maximum(tl.load(p_token_request + i_t), 0)  # padding rows (-1) have no keys: any request will do
    slot = tl.load(p_request_slots + b)
    q_lo = tl.load(p_query_start + b)
    start = tl.load(p_seq_lens + b) - (tl.load(p_query_start + b + 1) - q_lo)  # history before the step

    # One loop over the split's blocks, window blocks first (both address forms in one body, `key_rows`).
    p_ring = p_win + slot.to(tl.int64) * win_page_bytes
    p_bt_row = p_block_table + slot.to(tl.int64) * bt_stride
    p_picks_row = p_picks + i_t.to(tl.int64) * n_picks
    program = (i_t.to(tl.int64) * tl.num_programs(1) + i_h) * tl.num_programs(2) + i_s
    p_scratch_row = p_scratch + program * BLOCK_H * BLOCK_N
    for blk in range(b_lo, b_hi):
        ids = entry_ids(blk, p_picks_row, n_win_blocks, n_ent, ENTRIES, BLOCK_N)
        p_data, p_scale, valid, unread = key_rows(
            blk, ids, entry_blocks(ids, p_bt_row, ENT_PER_PAGE, ENTRIES), pos, n_win, n_win_blocks, start, q_lo,
            p_ring, p_step, step_entries, p_ent, ent_page_bytes, ENT_PER_PAGE, WINDOW, DATA_BYTES, SCALE_BYTES,
            ENTRIES, BLOCK_N)
        b_k = key_tile(p_data, p_scale, valid & ~unread, D, NOPE, BLOCK_N)
        m_i, l_i, acc = _attend(b_q_hi, b_q_lo, b_k, valid, unread, m_i, l_i, acc, qk_scale, p_scratch_row, Q_SPLIT,
                                DOT_F32, QK_SCRATCH)

    # the epilogue's offsets are built here from the row's base pointer, so no [BLOCK_H, D] offset tensor stays
    # live across the key loops (it would hold as many registers as acc)
    o_hd = tl.arange(0, BLOCK_H)[:, None] * D + tl.arange(0, D)[None, :]
    if SPLIT:
        # workspace row (t, s, h): acc [D], then m, l
        p_w = p_ws + ((i_t.to(tl.int64) * splits + i_s) * H + i_h * BLOCK_H) * (D + 2)
        tl.store(p_w + o_hd + tl.arange(0, BLOCK_H)[:, None] * 2, acc, mask=m_h[:, None])
        o_w = tl.arange(0, BLOCK_H) * (D + 2) + D
        tl.store(p_w + o_w, m_i, mask=m_h)
        tl.store(p_w + o_w + 1, l_i, mask=m_h)
    elif ROPE_HALF > 0:  # bf16 out: the inverse RoPE and the rounding of `rope_rows(fp32 out, inverse=True)`
        b_o = rope_pairs(acc / l_i[:, None], p_cos, p_sin, i_t.to(tl.int64), BLOCK_H, D, 0, D // 2 - ROPE_HALF,
                          ROPE_HALF, True)
        tl.store(p_out + (i_t.to(tl.int64) * H + i_h * BLOCK_H) * D + o_hd, round_bf16(b_o).to(tl.bfloat16),
                 mask=m_h[:, None])
    else:
        tl.store(p_out + (i_t.to(tl.int64) * H + i_h * BLOCK_H) * D + o_hd, acc / l_i[:, None], mask=m_h[:, None])


@triton.jit(do_not_specialize=["splits"])
def _merge_kernel(p_ws, p_sinks, p_out, p_positions, p_cos, p_sin, n_picks, H, splits, RATIO: tl.constexpr,
                  WINDOW: tl.constexpr, D: tl.constexpr, ENTRIES: tl.constexpr, BLOCK_N: tl.constexpr,
                  MERGE_S: tl.constexpr, ROPE_HALF: tl.constexpr, DIMS: tl.constexpr):
    """One program per (token row, head, DIMS of its D dims): merges the row's splits that hold keys (the first
    ceil(blocks / per_split)) with the sink, in fp32, into out [R, H, D]: fp32, or (ROPE_HALF > 0) with the layer's
    inverse RoPE over the last 2 * ROPE_HALF dims and rounded to bf16, bit for bit `rope_rows(fp32 out,
    inverse=True)`. Splits are read MERGE_S at a time (`_merge_tile`: all of a launch's, up to 256): the loads of a
    chunk do not wait on the previous chunk's arithmetic. The programs of a head compute the same running max and
    sum (one tile, one order)."""
    wait_for_prior_grids()
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    d_lo = tl.program_id(2) * DIMS
    o_d = d_lo + tl.arange(0, DIMS)
    _, _, _, n_blocks, per_split = row_blocks(tl.load(p_positions + i_t), n_picks, splits, RATIO, WINDOW, ENTRIES,
                                               BLOCK_N)
    used = tl.cdiv(n_blocks, tl.maximum(per_split, 1))

    # start from the sink: max = sink, sum = 1, acc = 0 (a row without keys ends there: zeros)
    m_i = tl.load(p_sinks + i_h) * 1.4426950408889634
    l_i = m_i * 0.0 + 1.0
    acc = tl.zeros([DIMS], tl.float32)
    p_row = p_ws + (i_t.to(tl.int64) * splits * H + i_h) * (D + 2)
    for s0 in range(0, used, MERGE_S):
        o_s = s0 + tl.arange(0, MERGE_S)
        m_s = o_s < used
        p_s = p_row + o_s.to(tl.int64) * H * (D + 2)
        b_m = tl.load(p_s + D, mask=m_s, other=float("-inf"))  # >= the sink where written: every split starts there
        b_l = tl.load(p_s + D + 1, mask=m_s, other=0.0)
        b_acc = tl.load(p_s[:, None] + o_d[None, :], mask=m_s[:, None], other=0.0)
        m_new = tl.maximum(m_i, tl.max(b_m, 0))
        alpha = tl.exp2(m_i - m_new)
        beta = tl.exp2(b_m - m_new)
        l_i = l_i * alpha + tl.sum(b_l * beta, 0)
        acc = acc * alpha + tl.sum(b_acc * beta[:, None], 0)
        m_i = m_new
    p_head = p_out + (i_t.to(tl.int64) * H + i_h) * D + o_d
    if ROPE_HALF > 0:
        b_x = rope_pairs((acc / l_i)[None, :], p_cos, p_sin, i_t.to(tl.int64), 1, DIMS, d_lo // 2,
                          D // 2 - ROPE_HALF, ROPE_HALF, True)
        tl.store(p_head[None, :], round_bf16(b_x).to(tl.bfloat16))
    else:
        tl.store(p_head, acc / l_i)


def _merge_tile(splits: int, dim: int, tuning: AttentionTuning) -> tuple[int, int, int]:
    """(splits read at once, head dims, warps) of a merge program: a launch's splits at once (`merge_chunks`) over as
    many of the head's dims as `merge_elems` allows (32 at 256 splits), so a program has one load of its partials in
    flight rather than a chain of chunks, and rows of many splits spread over more programs. V4-Flash: 2 splits
    (batch 64) -> 2 x 512 dims; up to 16 -> 16 x 512; 20 (CSA batch 1) -> 32 x 256; 66 (HCA batch 1 at 512K) ->
    128 x 64; 130 (1M) -> 256 x 32. A sum of two terms and zeros is one rounding in any order, so 2 splits give the
    bytes of any tile; with more, the tile sets the order of the fp32 sums over splits (on a GPU the dims too: the
    reduction's layout follows them)."""
    chunk = next((c for c in tuning.merge_chunks if c >= splits), tuning.merge_chunks[-1])
    dims = min(dim, tuning.merge_elems // chunk)
    return chunk, dims, 2 if chunk * dims <= tuning.merge_two_warps else 4


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
                           picks: torch.Tensor | None = None, out: torch.Tensor | None = None,
                           max_entries: int | None = None, splits: int | None = None,
                           workspace: torch.Tensor | None = None,
                           inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                           q_rope_dims: torch.Tensor | None = None,
                           tuning: AttentionTuning | None = None) -> torch.Tensor:
    """Sparse attention with sink over the window (ring + this step's kv) and compressed entries -> fp32 [R, H, D]
    (bf16 with `inverse_rope`).

    Args:
        q: bf16 / fp32 [R, H, D] roped queries, R = the plan's padded rows (plan.positions.shape[0]); with
            `q_rope_dims`, bf16 and its last dims unread (they may be unroped).
        plan: the step's plan; every row runs (padding rows give zeros).
        sinks: fp32 [H] learned sinks; scale: softmax scale (head_dim^-0.5).
        layout: the main-entry layout (`main_layout("fp8" | "bf16", D, rope_dim)`).
        window: window length; window_pool: uint8 [max_requests, layout.page_bytes(window)], the ring
            (page = request slot, entry = position % window), as before this step's append: no entry a row
            reads may be overwritten yet (with one row per request the append overwrites none of them).
        step_kv: uint8 [1, layout.page_bytes(R)]: this step's kv encoded in `layout`, entry t = row t.
        entry_pool: uint8 [pages, layout.page_bytes(page_tokens // ratio)] compressed entries, or None
            (window-only layer). ratio / page_tokens: its compression ratio and tokens per page.
        picks: int32 / int64 [R, K] entry indices (-1 = none) for CSA; None with an entry pool = every
            visible entry (HCA).
        out: optional fp32 [R, H, D] (bf16 with `inverse_rope`) to write, not overlapping q (nothing is allocated
            then, unless the split path needs a workspace and none is given, and the logits' scratch rows of 8-warp
            programs: CUDA-graph capturable, torch's graph pool serves the allocations).
        max_entries: HCA: a host bound on any row's visible entries (e.g. plan.max_seq_len // ratio), used only to
            choose the split count (a row with more entries is still exact); default block_table.shape[1] *
            page_tokens // ratio. Ignored for CSA (K picks) and window-only layers.
        splits: key splits per row (1 = single pass); None = automatic (`_config`: from R, H, the most keys a row
            can have and the SM count; fixed shapes only, so stable under graph capture), or workspace.shape[1]
            when a workspace is given.
        workspace: optional fp32 [R, S, H, D + 2] for S > 1 splits: per (row, split, head) the unnormalized
            output [D], then the running max (log2 domain) and sum. Its S is the split count (unless `splits`
            says otherwise, then they must agree); S = 1 runs the single pass and leaves it untouched.
        inverse_rope: (cos, sin) fp32 [R, rope_dim // 2] of the rows' positions: the output then gets the layer's
            inverse RoPE and is rounded to bf16, bit for bit `rope_rows(output, cos, sin, inverse=True)`
            (`out`, if given, is bf16). The single pass applies it as it stores the output; with S > 1 splits the
            merge does.
        q_rope_dims: bf16 [R, H, rope_dim], q's last rope_dim dims of each head, roped (`rope_rows(q, cos,
            sin, out=q_rope_dims)`); q's own last dims are then never read, so q may be the query before its RoPE.
        tuning: tiles and split thresholds (default: the device's).
    """
    require(isinstance(plan, StepPlan), f"plan: expected a StepPlan, got {type(plan).__name__}")
    require(isinstance(layout, EntryLayout), f"layout: expected an EntryLayout, got {type(layout).__name__}")
    nope, scale_bytes = _layout_dims(layout)
    rows, dim, device = padded_rows(plan), layout.dim, plan.positions.device  # the cache's device
    _check_step(q, plan, sinks, scale, layout, window, window_pool, step_kv, max_entries)
    heads = q.shape[1]
    keys = _entry_keys(plan, layout, window, step_kv, entry_pool, ratio, page_tokens, picks, max_entries)
    out, rope_half, (cos, sin) = _check_outputs(q, out, sinks, inverse_rope, q_rope_dims)
    require(splits is None or (isinstance(splits, int) and not isinstance(splits, bool) and 1 <= splits <= 65535),
            f"splits: expected an int in 1..65535 (a grid dimension) or None, got {splits!r}")
    tuning = tuning if tuning is not None else tuning_for(device)
    config = _config(rows, heads, keys.max_keys, device, tuning)
    if workspace is not None:
        check_tensor("workspace", workspace, dtype=torch.float32,
                     shape=(rows, splits if splits is not None else None, heads, dim + 2), device=device)
        config = config._replace(splits=workspace.shape[1])
    if splits is not None:
        config = config._replace(splits=splits)
    if rows == 0:
        return out

    split = config.splits > 1
    if split and workspace is None:
        workspace = torch.empty((rows, config.splits, heads, dim + 2), dtype=torch.float32, device=device)
    grid = (rows, triton.cdiv(heads, config.block_h), config.splits)
    # with two warpgroups (8 warps) each block's logits pass through a scratch row in global memory (L2): Triton lays
    # out a dot whose result feeds another dot with all warps along M, so both warpgroups would compute the whole
    # q . k; through memory each computes half (no spills, fewer instructions, for a 16 KB store and two barriers)
    qk_scratch = config.num_warps == 8
    scratch = out  # an unused stand-in pointer unless qk_scratch
    if qk_scratch:
        scratch = torch.empty(grid[0] * grid[1] * grid[2] * config.block_h * config.block_n, dtype=torch.float32,
                              device=device)
    _sparse_attention_kernel[grid](
        q, sinks, out, workspace if split else out,
        plan.positions, plan.token_request, plan.request_slots, plan.query_start, plan.seq_lens,
        plan.block_table, plan.block_table.shape[1],
        step_kv, rows,
        window_pool, window_pool.shape[1],
        keys.pool, keys.pool.shape[1],
        keys.picks, keys.n_picks, float(scale) * _LOG2E, heads, config.splits, scratch,
        cos, sin, q_rope_dims if q_rope_dims is not None else q,
        RATIO=max(ratio, 1), ENT_PER_PAGE=keys.per_page,  # fixed per layer: divisions by constants
        WINDOW=window, D=dim, NOPE=nope, DATA_BYTES=layout.data_bytes, SCALE_BYTES=scale_bytes, ENTRIES=keys.mode,
        Q_SPLIT=q.dtype == torch.float32, DOT_F32=interpreted(), BLOCK_H=config.block_h, BLOCK_N=config.block_n,
        SPLIT=split, QK_SCRATCH=qk_scratch, ROPE_HALF=rope_half if not split else 0,
        Q_ROPE_DIMS=q_rope_dims.shape[2] if q_rope_dims is not None else 0, num_warps=config.num_warps,
        num_stages=config.num_stages,
        # the inverse RoPE's separately rounded products (`rope_rows`); the key loop is the same up to a few
        # FMULs for FFMAs, and its outputs were byte-equal either way (docs/performance.md)
        enable_fp_fusion=False, **launch_options(device),
    )
    if split:
        chunk, dims, warps = _merge_tile(config.splits, dim, tuning)
        _merge_kernel[(rows, heads, dim // dims)](
            workspace, sinks, out, plan.positions, cos, sin, keys.n_picks, heads, config.splits,
            RATIO=max(ratio, 1), WINDOW=window, D=dim, ENTRIES=keys.mode, BLOCK_N=config.block_n,
            MERGE_S=chunk,
            ROPE_HALF=rope_half, DIMS=dims, num_warps=warps,
            # rope_rows' rounding (separately rounded products), and the same fp32 merge with or without the RoPE
            enable_fp_fusion=False, **launch_options(device),
        )
    return out


def _check_step(q, plan: StepPlan, sinks, scale, layout: EntryLayout, window, window_pool, step_kv,
                max_entries) -> None:
    """`sparse_attention_paged`'s checks of q, the sinks and scale, the plan's tensors, the window and the step's kv."""
    rows, dim, device = padded_rows(plan), layout.dim, plan.positions.device
    require(dim >= 16 and dim & (dim - 1) == 0, f"layout: head_dim must be a power of two >= 16, got {dim}")
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
    require(max_entries is None or (isinstance(max_entries, int) and not isinstance(max_entries, bool)
                                    and max_entries >= 0),
            f"max_entries: expected a non-negative int, got {max_entries!r}")


class _EntryKeys(NamedTuple):
    """The compressed entries a call's rows attend to, as the kernel takes them."""

    mode: int  # _WINDOW_ONLY, _ALL_VISIBLE or _PICKS
    pool: torch.Tensor  # the entry pages (the step page, unread, for a window-only layer)
    per_page: int  # entries a page
    picks: torch.Tensor  # CSA's picks (the positions, unread, otherwise)
    n_picks: int
    max_keys: int  # the most keys a row can have: window + entries (HCA: `max_entries`'s bound)


def _entry_keys(plan: StepPlan, layout: EntryLayout, window: int, step_kv, entry_pool, ratio, page_tokens, picks,
                max_entries) -> _EntryKeys:
    """`sparse_attention_paged`'s entry arguments, checked."""
    if entry_pool is None:
        require(picks is None, "picks: given without an entry_pool")
        return _EntryKeys(_WINDOW_ONLY, step_kv, 1, plan.positions, 0, window)
    rows, device = padded_rows(plan), plan.positions.device
    require(isinstance(ratio, int) and isinstance(page_tokens, int) and ratio >= 1 and page_tokens >= 1
            and page_tokens % ratio == 0,
            f"ratio / page_tokens: expected positive ints with page_tokens a multiple of ratio, got "
            f"{ratio!r} / {page_tokens!r}")
    per_page = page_tokens // ratio
    check_pool("entry_pool", entry_pool, layout, per_page, device)
    if picks is None:
        entries = max_entries if max_entries is not None else plan.block_table.shape[1] * per_page
        return _EntryKeys(_ALL_VISIBLE, entry_pool, per_page, plan.positions, 0, window + entries)
    check_tensor("picks", picks, dtype=(torch.int32, torch.int64), shape=(rows, None), device=device)
    require(picks.shape[1] >= 1, "picks: needs at least one column")
    return _EntryKeys(_PICKS, entry_pool, per_page, picks, picks.shape[1], window + picks.shape[1])


def _check_outputs(q, out, sinks, inverse_rope, q_rope_dims) -> tuple[torch.Tensor, int, tuple]:
    """`sparse_attention_paged`'s out (made when None), inverse RoPE and q_rope_dims, checked -> (out, the RoPE's
    half dims (0: none), its (cos, sin); the sinks, unread, without it)."""
    rows, heads, dim = q.shape
    device = q.device
    out_dtype = torch.float32 if inverse_rope is None else torch.bfloat16
    if out is None:
        out = torch.empty((rows, heads, dim), dtype=out_dtype, device=device)
    else:
        check_tensor("out", out, dtype=out_dtype, shape=(rows, heads, dim), device=device)
    rope_half, cos_sin = 0, (sinks, sinks)
    if inverse_rope is not None:
        require(isinstance(inverse_rope, tuple) and len(inverse_rope) == 2, "inverse_rope: expected (cos, sin)")
        rope_half = check_cos_sin(*inverse_rope, rows, dim, device)
        cos_sin = inverse_rope
    require(not overlaps(out, q), "out: overlaps q")
    if q_rope_dims is not None:
        require(q.dtype == torch.bfloat16, f"q_rope_dims: q must be bf16, got {q.dtype}")
        check_tensor("q_rope_dims", q_rope_dims, dtype=torch.bfloat16, shape=(rows, heads, None), device=device)
        require(1 <= q_rope_dims.shape[2] < dim, f"q_rope_dims: expected 1..{dim - 1} dims a head, got "
                                                 f"{q_rope_dims.shape[2]}")
        require(not overlaps(out, q_rope_dims), "out: overlaps q_rope_dims")
    return out, rope_half, cos_sin
