"""Compress-and-insert and the compressor-state append, as Triton kernels.

`compress_insert` runs one program per completed entry of the plan (decode steps complete at most one per
request, prefill chunks many): it reads the entry's rows (from this step's rows or the request's state
ring), pools them per channel with a softmax (CSA overlap: the previous block's low half and the own
block's high half; HCA: the own block), applies the weighted RMSNorm and RoPE at j*m, rounds to bf16 and
writes the entry in its layout (main FP8 MODEL1 / bf16, or the indexer's MXFP4 / FP8 / bf16 with the
Hadamard rotation) into its page, in one pass. Same function as `ops.compress.compress_and_insert`; the
softmax, norm and rotation sums run in another order (and Triton's exp/rsqrt), so entries agree within
the tolerance of tests/test_kernel_compress.py rather than bit for bit.

`append_state` then copies the step's rows into the state rings (bit for bit `ops.append.append_state`);
it must run after every read of the rings in the step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import quant
from ..geometry import RopeSpec
from ..layout import EntryLayout, IndexerFP8Layout, IndexerMXFP4Layout, MainFP8Layout
from ..ops.common import require
from ..ops.rope import rope_cos_sin
from .common import check_plan, check_pool, check_tensor
from .encode import rope_last_block, round_bf16, store_index_entry, store_main_entry

__all__ = ["compress_insert", "append_state"]


@triton.jit
def _row_pointers(step_ptr, state_ptr, pos, start, query_start, slot, RING: tl.constexpr, WIDTH: tl.constexpr):
    """Where token `pos`'s state row lives: this step's rows when pos >= start, else the ring."""
    in_step = pos >= start
    step_row = (query_start + pos - start).to(tl.int64)
    ring_row = slot.to(tl.int64) * RING + (tl.maximum(pos, 0) % RING)
    return tl.where(in_step, step_ptr + step_row * WIDTH, state_ptr + ring_row * WIDTH)


@triton.jit
def _compress_kernel(kv_rows_ptr, logit_rows_ptr, state_kv_ptr, state_logit_ptr, norm_ptr, cos_ptr, sin_ptr,
                     slots_ptr, request_ptr, index_ptr, request_slots_ptr, query_start_ptr, seq_lens_ptr,
                     pool_ptr, page_bytes, entries, hadamard_ptr, eps,
                     RATIO: tl.constexpr, OVERLAP: tl.constexpr, D: tl.constexpr, RING: tl.constexpr,
                     MAIN: tl.constexpr, FORMAT: tl.constexpr, ROUND: tl.constexpr,
                     DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr):
    e = tl.program_id(0)
    j = tl.load(index_ptr + e)
    given = tl.load(slots_ptr + e).to(tl.int64)
    given = tl.where(j >= 0, given, -1)
    b = tl.maximum(tl.load(request_ptr + e), 0)
    slot = tl.maximum(tl.load(request_slots_ptr + b), 0)
    query_start = tl.load(query_start_ptr + b)
    start = tl.load(seq_lens_ptr + b) - (tl.load(query_start_ptr + b + 1) - query_start)
    WIDTH: tl.constexpr = 2 * D if OVERLAP else D
    SPAN: tl.constexpr = 2 * RATIO if OVERLAP else RATIO
    first = (j - 1) * RATIO if OVERLAP else j * RATIO
    cols = tl.arange(0, D)

    # pass 1: per-channel max of the logits; pass 2: exp-weighted sum of the kv rows (rows before 0 weigh 0)
    top = tl.full((D,), float("-inf"), tl.float32)
    for r in range(SPAN):
        pos = first + r
        col = cols + ((r // RATIO) * D if OVERLAP else 0)  # CSA: the own block reads the high half
        ptr = _row_pointers(logit_rows_ptr, state_logit_ptr, pos, start, query_start, slot, RING, WIDTH)
        top = tl.maximum(top, tl.load(ptr + col, mask=(cols * 0 + pos) >= 0, other=float("-inf")))
    total = tl.zeros((D,), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for r in range(SPAN):
        pos = first + r
        col = cols + ((r // RATIO) * D if OVERLAP else 0)  # CSA: the own block reads the high half
        real = (cols * 0 + pos) >= 0
        logit = tl.load(_row_pointers(logit_rows_ptr, state_logit_ptr, pos, start, query_start, slot, RING, WIDTH)
                        + col, mask=real, other=float("-inf"))
        kv = tl.load(_row_pointers(kv_rows_ptr, state_kv_ptr, pos, start, query_start, slot, RING, WIDTH) + col,
                     mask=real, other=0.0)
        weight = tl.where(real, tl.exp(logit - top), 0.0)
        total += weight
        acc += kv * weight
    pooled = acc / total

    normed = pooled * tl.math.rsqrt(tl.sum(pooled * pooled, axis=0) / D + eps) * tl.load(norm_ptr + cols)
    half = tl.arange(0, 32)
    # fp32 entries (not ROUND) keep fp32 rope dims: the indexer's Hadamard rotation reads them unrounded
    x = rope_last_block(tl.reshape(normed, (D // 64, 64)), tl.load(cos_ptr + e * 32 + half),
                        tl.load(sin_ptr + e * 32 + half), D // 64, ROUND=ROUND)
    if ROUND:
        x = round_bf16(x)
    slot_e = tl.maximum(given, 0)
    page, offset = slot_e // entries, slot_e % entries
    data_ptr = pool_ptr + page * page_bytes + offset * DATA_BYTES
    scale_ptr = pool_ptr + page * page_bytes + entries * DATA_BYTES + offset * SCALE_BYTES
    if MAIN:
        store_main_entry(data_ptr, scale_ptr, x, given, D // 64, FORMAT == 1, SCALE_BYTES)
    else:
        store_index_entry(data_ptr, scale_ptr, x, given, hadamard_ptr, D, FORMAT)


def _format_code(layout: EntryLayout, main: bool) -> int:
    if main:
        return 1 if layout.name == "fp8" else 0
    if isinstance(layout, IndexerMXFP4Layout):
        return 2
    return 1 if isinstance(layout, IndexerFP8Layout) else 0


def compress_insert(state_kv: torch.Tensor, state_logits: torch.Tensor, plan, kv_rows: torch.Tensor,
                    logit_rows: torch.Tensor, *, ratio: int, overlap: bool, norm_weight: torch.Tensor, eps: float,
                    rope: RopeSpec, out_dtype: torch.dtype, layout: EntryLayout, pool: torch.Tensor,
                    page_tokens: int, main: bool, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Every entry of `ratio` completing in the plan, pooled, normed, roped, rounded to `out_dtype` and encoded
    into `pool` at the plan's slots (`ops.compress.compress_and_insert`, without its return value).

    state_kv / state_logits: fp32 [max_requests, ring, w] (w = 2d with overlap, d without); kv_rows /
    logit_rows: fp32 [R, w] (R = the plan's padded rows); norm_weight fp32 [d]; main: a main entry (FP8
    MODEL1 / bf16) or an indexer key (MXFP4 / FP8 / bf16). cos_sin: `ops.rope.rope_cos_sin(rope,
    plan.entries[ratio].index * ratio)` when the caller already has it (computed here otherwise)."""
    device = pool.device
    check_plan(plan, device)
    rows = plan.positions.shape[0]
    d = layout.dim
    width = 2 * d if overlap else d
    require(ratio in plan.entries, f"compress_insert: the plan has no entries of ratio {ratio}")
    require(out_dtype in (torch.bfloat16, torch.float32), f"compress_insert: out_dtype bf16 or fp32, got {out_dtype}")
    require(rope.dim == 64 and d % 64 == 0 and (d // 64) & (d // 64 - 1) == 0,
            f"compress_insert: the kernel handles 64 rope dims and d = 64 * a power of two, got {rope.dim}, {d}")
    require(not layout.rotated if main else not isinstance(layout, MainFP8Layout),
            f"compress_insert: layout {layout.name!r} is not a {'main-entry' if main else 'indexer-key'} layout")
    check_tensor("state_kv", state_kv, dtype=torch.float32, shape=(None, None, width), device=device)
    check_tensor("state_logits", state_logits, dtype=torch.float32, shape=tuple(state_kv.shape), device=device)
    check_tensor("kv_rows", kv_rows, dtype=torch.float32, shape=(rows, width), device=device)
    check_tensor("logit_rows", logit_rows, dtype=torch.float32, shape=(rows, width), device=device)
    check_tensor("norm_weight", norm_weight, dtype=torch.float32, shape=(d,), device=device)
    check_pool("pool", pool, layout, page_tokens // ratio, device)
    writes = plan.entries[ratio]
    count = writes.slots.shape[0]
    if count == 0:
        return
    cos, sin = cos_sin if cos_sin is not None else rope_cos_sin(rope, writes.index * ratio)
    check_tensor("cos", cos, dtype=torch.float32, shape=(count, rope.dim // 2), device=device)
    check_tensor("sin", sin, dtype=torch.float32, shape=(count, rope.dim // 2), device=device)
    hadamard = quant.hadamard_matrix(d, device) if layout.rotated else norm_weight
    _compress_kernel[(count,)](
        kv_rows, logit_rows, state_kv, state_logits, norm_weight, cos, sin,
        writes.slots, writes.request, writes.index, plan.request_slots, plan.query_start, plan.seq_lens,
        pool, pool.shape[1], page_tokens // ratio, hadamard, eps,
        RATIO=ratio, OVERLAP=overlap, D=d, RING=state_kv.shape[1], MAIN=main, FORMAT=_format_code(layout, main),
        ROUND=out_dtype == torch.bfloat16, DATA_BYTES=layout.data_bytes, SCALE_BYTES=max(layout.scale_bytes, 1),
        num_warps=4)


@triton.jit
def _append_state_kernel(kv_rows_ptr, logit_rows_ptr, state_kv_ptr, state_logit_ptr, positions_ptr,
                         token_request_ptr, request_slots_ptr, seq_lens_ptr,
                         RING: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(positions_ptr + t)
    b = tl.maximum(tl.load(token_request_ptr + t), 0)
    slot = tl.maximum(tl.load(request_slots_ptr + b), 0).to(tl.int64)
    keep = (pos >= 0) & (pos >= tl.load(seq_lens_ptr + b) - RING)  # earlier rows are overwritten in this step
    dst = (slot * RING + tl.maximum(pos, 0) % RING) * WIDTH
    src = t.to(tl.int64) * WIDTH
    for c in range(0, WIDTH, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        mask = (cols < WIDTH) & ((cols * 0 + keep.to(tl.int32)) != 0)
        tl.store(state_kv_ptr + dst + cols, tl.load(kv_rows_ptr + src + cols, mask=mask), mask=mask)
        tl.store(state_logit_ptr + dst + cols, tl.load(logit_rows_ptr + src + cols, mask=mask), mask=mask)


def append_state(state_kv: torch.Tensor, state_logits: torch.Tensor, plan, kv_rows: torch.Tensor,
                 logit_rows: torch.Tensor) -> None:
    """Write kv_rows / logit_rows fp32 [R, w] into the state rings fp32 [max_requests, ring, w] at position % ring
    (each request's last `ring` tokens of the step), as `ops.append.append_state`."""
    device = state_kv.device
    check_plan(plan, device)
    rows = plan.positions.shape[0]
    check_tensor("state_kv", state_kv, dtype=torch.float32, shape=(None, None, None), device=device)
    check_tensor("state_logits", state_logits, dtype=torch.float32, shape=tuple(state_kv.shape), device=device)
    width = state_kv.shape[2]
    check_tensor("kv_rows", kv_rows, dtype=torch.float32, shape=(rows, width), device=device)
    check_tensor("logit_rows", logit_rows, dtype=torch.float32, shape=(rows, width), device=device)
    if rows == 0:
        return
    _append_state_kernel[(rows,)](kv_rows, logit_rows, state_kv, state_logits, plan.positions, plan.token_request,
                                  plan.request_slots, plan.seq_lens, RING=state_kv.shape[1], WIDTH=width,
                                  BLOCK=min(1024, triton.next_power_of_2(width)), num_warps=4)
