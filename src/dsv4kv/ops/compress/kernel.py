"""Compress-and-insert and the compressor-state append, as Triton kernels.

`compress_insert` pools every entry that completes in the plan (decode steps complete at most one per request,
prefill chunks many): it reads the entry's rows (from this step's rows or the request's state ring), pools them
per channel with a softmax (CSA overlap: the previous block's low half and the own block's high half; HCA: the
own block), applies the weighted RMSNorm and RoPE at j*m, rounds to bf16 and writes the entry in its layout (main
FP8 MODEL1 / bf16, or the indexer's MXFP4 / FP8 / bf16 with the Hadamard rotation) into its page, in one pass.

Work split (`CompressTuning`): a CSA program takes BLOCK_E entries and pools their rows CHUNK at a time with an
online softmax (running max, rescaled sums), reading every row once (all 8 rows of an entry in one chunk). HCA pools
in a first launch whose programs take one entry's rows over a slice of its channels (a tile by the launch's entry
count) into an fp32 buffer, and a second launch norms, ropes and encodes from it: one entry's 512 KB of rows then
spreads over 16 or more SMs instead of one. Programs whose entries are all padding (a captured step's spare
capacity) return at once.

Numerics. Same function as `ops.compress.reference.compress_and_insert`; the softmax (Triton's exp, and across
chunks the online rescaling), the norm (rsqrt) and the sums run in another order, and the indexer's Hadamard
rotation is an exact +-1 butterfly scaled once by fl(d^-0.5) where the reference sums separately rounded fp32
products (see `encode.hadamard_rows`), so entries agree within the tolerance of tests/test_kernel_compress.py (one
step of the format's grid, >= 99% of bytes equal) rather than bit for bit. The encoders themselves are exact
(encode.py).

`append_state` then copies the step's rows into the state rings (bit for bit `ops.compress.reference.append_state`);
it must run after every read of the rings in the step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...cache import quant
from ...geometry import RopeSpec
from ...cache.layout import EntryLayout, IndexerFP8Layout, IndexerMXFP4Layout, MainFP8Layout
from ...checks import require
from ..rope.reference import rope_cos_sin
from ..shared.common import check_plan, check_pool, interpreted
from ...checks import check_tensor
from ..shared.launch import check_pair_ends, launch_options, let_next_grid_launch, wait_for_prior_grids
from .tuning import CompressTuning, tuning_for
from ..shared.encode import (
    last_block,
    program_rows,
    rope_block,
    rotate_keys,
    round_bf16,
    store_index_entries,
    store_main_entries,
)

__all__ = ["compress_insert", "append_state"]


def _chunk(chunk: int, span: int) -> int:
    """Rows per chunk: `chunk`, halved until it divides the entry's `span` rows."""
    chunk = min(chunk, triton.next_power_of_2(span))
    while span % chunk:
        chunk //= 2
    return chunk


def _compress_tile(overlap: bool, main: bool, span: int, count: int, tuning: CompressTuning) -> tuple[int, int, int]:
    """(entries a program, rows a chunk, warps) of the compress launch; HCA's reads its rows pooled (chunk unused)."""
    if not overlap:
        return program_rows(count, tuning.hca_entries, tuning.spread_programs), 1, tuning.pooled_warps
    tile = tuning.csa_main if main else tuning.csa_index
    return program_rows(count, tile.entries, tuning.spread_programs), _chunk(tile.chunk, span), tile.warps


@triton.jit
def _entries(slots_ptr, request_ptr, index_ptr, request_slots_ptr, query_start_ptr, seq_lens_ptr, o_e, count):
    """Entries o_e of the plan: (valid mask, index j (-1: padding), slot in the pool (-1: padding), request's state
    slot, its first row in this step, its first position in this step)."""
    m_e = o_e < count
    j = tl.load(index_ptr + o_e, mask=m_e, other=-1)
    given = tl.where(j >= 0, tl.load(slots_ptr + o_e, mask=m_e, other=-1), -1)
    b = tl.maximum(tl.load(request_ptr + o_e, mask=m_e, other=0), 0)
    slot = tl.maximum(tl.load(request_slots_ptr + b), 0).to(tl.int64)
    query_start = tl.load(query_start_ptr + b)
    start = tl.load(seq_lens_ptr + b) - (tl.load(query_start_ptr + b + 1) - query_start)
    return m_e, j, given, slot, query_start, start


@triton.jit
def _pool(kv_rows_ptr, logit_rows_ptr, state_kv_ptr, state_logit_ptr, m_e, j, slot, query_start, start, o_d,
          RATIO: tl.constexpr, OVERLAP: tl.constexpr, D: tl.constexpr, RING: tl.constexpr, BLOCK_E: tl.constexpr,
          CHUNK: tl.constexpr):
    """fp32 [BLOCK_E, channels of o_d]: the entries' rows pooled per channel by a softmax over their logits, the rows
    read once, CHUNK at a time (online: running max, rescaled sums). Channels are independent: a split over them
    changes a value only where another tile reduces a chunk's rows in another order (on a GPU: one byte of 64 HCA
    entries differed; under the interpreter none) or where CHUNK differs (the online rescaling)."""
    WIDTH: tl.constexpr = 2 * D if OVERLAP else D
    SPAN: tl.constexpr = 2 * RATIO if OVERLAP else RATIO
    first = (j - 1) * RATIO if OVERLAP else j * RATIO  # [E]: the window's first token (< 0 before the sequence)
    # per channel: running max, sum of exp(logit - max) and sum of kv * exp(logit - max). Tiles are
    # [rows, entries, channels], warps over channels first: CSA's tiles reduce rows within a thread or across
    # warps, HCA's channel slices across threads too.
    b_max = tl.full((BLOCK_E, o_d.shape[0]), float("-inf"), tl.float32)
    b_sum = tl.zeros((BLOCK_E, o_d.shape[0]), tl.float32)
    b_acc = tl.zeros((BLOCK_E, o_d.shape[0]), tl.float32)
    for c in range(0, SPAN, CHUNK):
        o_k = c + tl.arange(0, CHUNK)
        pos = o_k[:, None] + first[None, :]  # [K, E]
        real = (pos >= 0) & m_e[None, :]  # rows before token 0 weigh 0
        in_step = pos >= start[None, :]  # this step's rows, else the state ring (not yet overwritten)
        step_row = (query_start[None, :] + pos - start[None, :]).to(tl.int64)[:, :, None] * WIDTH
        ring_row = (slot[None, :] * RING + tl.maximum(pos, 0) % RING)[:, :, None] * WIDTH
        if OVERLAP:  # the previous block through the low half, the own block through the high half
            col = o_d[None, None, :] + ((o_k // RATIO) * D)[:, None, None]  # [K, 1, D]
        else:
            col = o_d[None, None, :]
        # two masked loads, the second filling in the first's rows (not a select of pointers: the compiler then
        # sees contiguous rows and issues 16-byte loads)
        m_step = (real & in_step)[:, :, None]
        m_ring = (real & ~in_step)[:, :, None]
        b_lg = tl.load(state_logit_ptr + ring_row + col, mask=m_ring,
                       other=tl.load(logit_rows_ptr + step_row + col, mask=m_step, other=float("-inf")))
        b_kv = tl.load(state_kv_ptr + ring_row + col, mask=m_ring,
                       other=tl.load(kv_rows_ptr + step_row + col, mask=m_step, other=0.0))
        top = tl.maximum(b_max, tl.max(b_lg, axis=0))
        ref = tl.where(top == float("-inf"), 0.0, top)  # no row yet: exp(-inf - 0) = 0, never NaN
        alpha = tl.exp(b_max - ref)
        w = tl.exp(b_lg - ref[None, :, :])
        b_sum = b_sum * alpha + tl.sum(w, axis=0)
        b_acc = b_acc * alpha + tl.sum(b_kv * w, axis=0)
        b_max = top
    return b_acc / b_sum


@triton.jit(do_not_specialize=["count"])  # entries completing this step: one compilation for all
def _pool_kernel(kv_rows_ptr, logit_rows_ptr, state_kv_ptr, state_logit_ptr, slots_ptr, request_ptr, index_ptr,
                 request_slots_ptr, query_start_ptr, seq_lens_ptr, pooled_ptr, count,
                 RATIO: tl.constexpr, OVERLAP: tl.constexpr, D: tl.constexpr, RING: tl.constexpr,
                 CHANNELS: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Entries i_e * BLOCK_E .. pooled over channels i_c * CHANNELS .. -> pooled fp32 [count, D]."""
    wait_for_prior_grids()
    o_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    m_e, j, _, slot, query_start, start = _entries(slots_ptr, request_ptr, index_ptr, request_slots_ptr,
                                                   query_start_ptr, seq_lens_ptr, o_e, count)
    if tl.max(j, axis=0) < 0:  # only padding entries
        return
    o_d = tl.program_id(1) * CHANNELS + tl.arange(0, CHANNELS)
    pooled = _pool(kv_rows_ptr, logit_rows_ptr, state_kv_ptr, state_logit_ptr, m_e, j, slot, query_start, start,
                   o_d, RATIO, OVERLAP, D, RING, BLOCK_E, CHUNK)
    tl.store(pooled_ptr + o_e.to(tl.int64)[:, None] * D + o_d[None, :], pooled, mask=(j >= 0)[:, None])


@triton.jit(do_not_specialize=["count"])  # entries completing this step: one compilation for all
def _compress_kernel(kv_rows_ptr, logit_rows_ptr, state_kv_ptr, state_logit_ptr, norm_ptr, cos_ptr, sin_ptr,
                     slots_ptr, request_ptr, index_ptr, request_slots_ptr, query_start_ptr, seq_lens_ptr,
                     pool_ptr, pooled_ptr, count, page_bytes, entries, h_scale, eps,
                     RATIO: tl.constexpr, OVERLAP: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr,
                     RING: tl.constexpr, MAIN: tl.constexpr, FORMAT: tl.constexpr, ROUND: tl.constexpr,
                     DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, BLOCK_E: tl.constexpr,
                     CHUNK: tl.constexpr, POOLED: tl.constexpr, WAIT_LATE: tl.constexpr,
                     LAUNCH_NEXT: tl.constexpr):
    """Entries i_e * BLOCK_E .. of the plan: pool their rows (CHUNK at a time; POOLED: read them from pooled_ptr,
    `_pool_kernel`'s), norm, rope, encode, store. WAIT_LATE: the wait for the grid before it comes last, before
    every exit (`compress_insert(wait_late=True)`); LAUNCH_NEXT: the next grid may launch once this one's programs
    have waited (`compress_insert(launch_next=True)`)."""
    if not WAIT_LATE:
        wait_for_prior_grids()
        if LAUNCH_NEXT:
            let_next_grid_launch()
    o_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    m_e, j, given, slot, query_start, start = _entries(slots_ptr, request_ptr, index_ptr, request_slots_ptr,
                                                       query_start_ptr, seq_lens_ptr, o_e, count)
    if tl.max(j, axis=0) < 0:  # only padding entries (a captured step's spare programs): nothing to pool
        if WAIT_LATE:
            wait_for_prior_grids()
        return
    NB: tl.constexpr = D // 64
    o_d = tl.arange(0, D)
    if POOLED:
        pooled = tl.load(pooled_ptr + o_e.to(tl.int64)[:, None] * D + o_d[None, :], mask=(j >= 0)[:, None],
                         other=0.0)
    else:
        pooled = _pool(kv_rows_ptr, logit_rows_ptr, state_kv_ptr, state_logit_ptr, m_e, j, slot, query_start, start,
                       o_d, RATIO, OVERLAP, D, RING, BLOCK_E, CHUNK)

    rms = tl.math.rsqrt(tl.sum(pooled * pooled, axis=1) / D + eps)
    normed = pooled * rms[:, None] * tl.load(norm_ptr + o_d)[None, :]
    b_x = tl.reshape(normed, (BLOCK_E, NB, 64))
    o_p = o_e.to(tl.int64)[:, None] * 32 + tl.arange(0, 32)[None, :]
    b_cos = tl.load(cos_ptr + o_p, mask=m_e[:, None], other=1.0)
    b_sin = tl.load(sin_ptr + o_p, mask=m_e[:, None], other=0.0)
    # fp32 entries (not ROUND) keep fp32 rope dims: the indexer's Hadamard rotation reads them unrounded
    b_rope = rope_block(last_block(b_x, LOG_D - 6), b_cos, b_sin, ROUND=ROUND)
    if ROUND:
        b_x = round_bf16(b_x)
    slot_e = tl.maximum(given, 0)
    page, offset = slot_e // entries, slot_e % entries  # int32: the slots are
    p_page = pool_ptr + page.to(tl.int64) * page_bytes
    p_data = p_page + offset * DATA_BYTES
    p_scale = p_page + entries * DATA_BYTES + offset * SCALE_BYTES
    if MAIN:
        store_main_entries(p_data, p_scale, b_x, b_rope, given >= 0, NB, FORMAT == 1, SCALE_BYTES,
                           BF16_VALUED=ROUND)
    else:
        last = (tl.arange(0, NB) == NB - 1)[None, :, None]
        key = tl.reshape(tl.where(last, b_rope[:, None, :], b_x), (BLOCK_E, D))
        if FORMAT != 0:
            key = rotate_keys(key, h_scale, LOG_D)
        store_index_entries(p_data, p_scale, key, given >= 0, FORMAT)
    if WAIT_LATE:
        wait_for_prior_grids()


def _format_code(layout: EntryLayout, main: bool) -> int:
    if main:
        return 1 if layout.name == "fp8" else 0
    if isinstance(layout, IndexerMXFP4Layout):
        return 2
    return 1 if isinstance(layout, IndexerFP8Layout) else 0


def compress_insert(state_kv: torch.Tensor, state_logits: torch.Tensor, plan, kv_rows: torch.Tensor,
                    logit_rows: torch.Tensor, *, ratio: int, overlap: bool, norm_weight: torch.Tensor, eps: float,
                    rope: RopeSpec, out_dtype: torch.dtype, layout: EntryLayout, pool: torch.Tensor,
                    page_tokens: int, main: bool, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
                    wait_late: bool = False, launch_next: bool = False, tuning: CompressTuning | None = None) -> None:
    """Every entry of `ratio` completing in the plan, pooled, normed, roped, rounded to `out_dtype` and encoded
    into `pool` at the plan's slots (`ops.compress.reference.compress_and_insert`, without its return value).

    state_kv / state_logits: fp32 [max_requests, ring, w] (w = 2d with overlap, d without); kv_rows /
    logit_rows: fp32 [R, w] (R = the plan's padded rows); norm_weight fp32 [d]; main: a main entry (FP8
    MODEL1 / bf16) or an indexer key (MXFP4 / FP8 / bf16). cos_sin: `ops.rope.reference.rope_cos_sin(rope,
    plan.entries[ratio].index * ratio)` when the caller already has it (computed here otherwise).
    wait_late: the second kernel of a pair (`launch`'s module docstring: beside the layer's indexer query), its wait
    last; needs the caller's cos_sin and one launch (CSA: HCA pools in two). launch_next: the first kernel of a pair
    (the layer's indexer query beside it); one launch too, made even where no entry completes (one program that
    returns), since the second kernel's wait is on it. tuning: the tiles (default: the device's)."""
    device = pool.device
    tuning = tuning if tuning is not None else tuning_for(device)
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
    check_pair_ends("compress_insert", launch_next, wait_late, cos_sin is not None)
    require(not (wait_late or launch_next) or overlap,
            "compress_insert: wait_late / launch_next need one launch (CSA: HCA pools in two)")
    writes = plan.entries[ratio]
    count = writes.slots.shape[0]
    # nothing to compress; the first kernel of a pair launches all the same (one program that returns), since the
    # second kernel's wait is on it
    if count == 0 and not launch_next:
        return
    cos, sin = cos_sin if cos_sin is not None else rope_cos_sin(rope, writes.index * ratio)
    check_tensor("cos", cos, dtype=torch.float32, shape=(count, rope.dim // 2), device=device)
    check_tensor("sin", sin, dtype=torch.float32, shape=(count, rope.dim // 2), device=device)
    # the reference matrix's entries, fl(d^-0.5), scale the kernel's exact +-1 butterfly (a CPU tensor: no sync)
    h_scale = float(quant.hadamard_matrix(d)[0, 0]) if layout.rotated else 1.0
    span = 2 * ratio if overlap else ratio
    block_e, chunk, warps = _compress_tile(overlap, main, span, count, tuning)
    entry_args = (writes.slots, writes.request, writes.index, plan.request_slots, plan.query_start, plan.seq_lens)
    pooled = None
    if not overlap:
        tile = tuning.pool_few if count <= tuning.few_entries else tuning.pool_many
        channels = min(tile.channels, d)
        pooled = torch.empty(count, d, dtype=torch.float32, device=device)
        cap = {"maxnreg": tile.max_registers} if tile.max_registers and not interpreted() else {}
        _pool_kernel[(count, d // channels)](
            kv_rows, logit_rows, state_kv, state_logits, *entry_args, pooled, count, RATIO=ratio, OVERLAP=overlap,
            D=d, RING=state_kv.shape[1], CHANNELS=channels, BLOCK_E=1, CHUNK=_chunk(tile.chunk, span),
            num_warps=tile.warps, **launch_options(device), **cap)
    _compress_kernel[(max(triton.cdiv(count, block_e), 1),)](
        kv_rows, logit_rows, state_kv, state_logits, norm_weight, cos, sin, *entry_args,
        pool, pooled if pooled is not None else kv_rows, count, pool.shape[1], page_tokens // ratio, h_scale, eps,
        RATIO=ratio, OVERLAP=overlap, D=d, LOG_D=d.bit_length() - 1, RING=state_kv.shape[1], MAIN=main,
        FORMAT=_format_code(layout, main), ROUND=out_dtype == torch.bfloat16, DATA_BYTES=layout.data_bytes,
        SCALE_BYTES=max(layout.scale_bytes, 1), BLOCK_E=block_e, CHUNK=chunk, POOLED=pooled is not None,
        WAIT_LATE=wait_late, LAUNCH_NEXT=launch_next, num_warps=warps,
        **launch_options(device))


@triton.jit
def _append_state_kernel(kv_rows_ptr, logit_rows_ptr, state_kv_ptr, state_logit_ptr, positions_ptr,
                         token_request_ptr, request_slots_ptr, seq_lens_ptr,
                         RING: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    wait_for_prior_grids()
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
    (each request's last `ring` tokens of the step), as `ops.compress.reference.append_state`."""
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
                                  BLOCK=min(1024, triton.next_power_of_2(width)), num_warps=4, **launch_options(device))
