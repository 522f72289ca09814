"""kv insert: RoPE + encoding (FP8 MODEL1 or bf16) + write of each token's kv, in one pass; and the
window-ring append, a byte copy of those encoded rows.

A step first encodes its kv into a step page (one page of R entries, row t = token row t): attention reads the step's
own window keys from there and older ones from the ring. The ring is written after attention (`append_window`),
because a prefill chunk's later tokens overwrite ring rows that its earlier tokens still attend to; with one row per
request (decode) the layer runs it beside attention instead, as the entry a row's append overwrites (position p -
window) is in no row's window. The bytes are those of `layout.write(pool, ..., apply_rope(kv, positions, rope))`, bit
for bit (tests/test_kernel_window.py).

kv_insert runs `WindowTuning.kv_insert_rows` rows per program (fewer for small launches): the rows' kv is one
contiguous [rows, D] block, loaded as 16-byte vectors and encoded as [rows, D // 64, 64] tiles; e4m3 codes leave as
16-byte stores. The rope dims are loaded a second time as their own [rows, 64] tile (an L1 hit) and rotated alone.
Its cost per value is ~8.5 instructions (encode.py), so it is bound by its bytes, not by the bit operations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...geometry import RopeSpec
from ...cache.layout import EntryLayout
from ...checks import require
from ..rope.reference import rope_cos_sin
from ..shared.common import check_plan, check_pool
from ...checks import check_tensor
from ..shared.encode import program_rows, rope_block, store_main_entries
from ..shared.launch import check_wait_late, launch_options, wait_for_prior_grids
from .tuning import WindowTuning, tuning_for

__all__ = ["kv_insert", "append_window", "check_main_layout"]


def check_main_layout(layout: EntryLayout, rope: RopeSpec) -> None:
    require(layout.name in ("fp8", "bf16") and not layout.rotated, f"expected a main-entry layout, got {layout.name!r}")
    blocks = layout.dim // 64
    require(rope.dim == 64 and layout.dim % 64 == 0 and blocks & (blocks - 1) == 0,
            f"the kernels handle 64 rope dims and head_dim = 64 * a power of two, got {rope.dim} and {layout.dim}")


# n, page_bytes and entries follow the step's row count (the engine encodes a step's kv into a page of its own)
@triton.jit(do_not_specialize=["n", "page_bytes", "entries"])
def _kv_insert_kernel(kv_ptr, cos_ptr, sin_ptr, slots_ptr, pool_ptr, n, page_bytes, entries,
                      NB: tl.constexpr, FP8: tl.constexpr, DATA_BYTES: tl.constexpr,
                      SCALE_BYTES: tl.constexpr, BLOCK_R: tl.constexpr, WAIT_LATE: tl.constexpr):
    """Rows pid * BLOCK_R ..: kv bf16 [n, 64 * NB] -> RoPE on the last 64 dims -> entry bytes at slot slots[row].
    WAIT_LATE: the wait for the grid before it comes last (`kv_insert(wait_late=True)`)."""
    if not WAIT_LATE:
        wait_for_prior_grids()
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < n
    given = tl.load(slots_ptr + o_r, mask=m_r, other=-1)
    slot = tl.maximum(given, 0)
    row = o_r.to(tl.int64) * (NB * 64)
    o_b = tl.arange(0, NB)[None, :, None]
    o_c = tl.arange(0, 64)[None, None, :]
    b_x = tl.load(kv_ptr + row[:, None, None] + o_b * 64 + o_c, mask=m_r[:, None, None], other=0.0).to(tl.float32)
    # the rope dims again (an L1 hit), alone: rotating only them is 1/NB of rotating the whole tile
    o_d = tl.arange(0, 64)[None, :]
    b_rope = tl.load(kv_ptr + row[:, None] + (NB - 1) * 64 + o_d, mask=m_r[:, None], other=0.0).to(tl.float32)
    o_p = o_r[:, None].to(tl.int64) * 32 + tl.arange(0, 32)[None, :]
    b_cos = tl.load(cos_ptr + o_p, mask=m_r[:, None], other=1.0)
    b_sin = tl.load(sin_ptr + o_p, mask=m_r[:, None], other=0.0)
    b_rope = rope_block(b_rope, b_cos, b_sin, ROUND=False)  # rounded to bf16 by the encoder
    page, offset = slot // entries, slot % entries  # int32: the slots are
    p_page = pool_ptr + page.to(tl.int64) * page_bytes
    p_data = p_page + offset * DATA_BYTES
    p_scale = p_page + entries * DATA_BYTES + offset * SCALE_BYTES
    store_main_entries(p_data, p_scale, b_x, b_rope, given >= 0, NB, FP8, SCALE_BYTES, BF16_VALUED=True)
    if WAIT_LATE:
        wait_for_prior_grids()


def kv_insert(kv: torch.Tensor, positions: torch.Tensor, rope: RopeSpec, layout: EntryLayout, pool: torch.Tensor,
              entries: int, slots: torch.Tensor, *, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
              wait_late: bool = False, tuning: WindowTuning | None = None) -> None:
    """Rotate kv bf16 [N, D] (normed, not yet roped) at positions int [N], encode it in `layout` and write row i
    to pool slot slots[i] (int32 [N]; -1 = skip). pool: uint8 [pages, layout.page_bytes(entries)].
    cos_sin: `ops.rope.reference.rope_cos_sin(rope, positions)` when the caller already has it (computed here
    otherwise). wait_late: the second kernel of a pair (`launch`'s module docstring: beside the window layer's q
    RoPE), its wait last; needs the caller's cos_sin. tuning: rows and warps a program (default: the device's)."""
    n = kv.shape[0] if isinstance(kv, torch.Tensor) else -1
    check_main_layout(layout, rope)
    check_tensor("kv", kv, dtype=torch.bfloat16, shape=(None, layout.dim), device=pool.device)
    check_tensor("positions", positions, dtype=(torch.int32, torch.int64), shape=(n,), device=pool.device)
    check_tensor("slots", slots, dtype=torch.int32, shape=(n,), device=pool.device)
    check_pool("pool", pool, layout, entries, pool.device)
    check_wait_late("kv_insert", wait_late, cos_sin is not None)
    if n == 0:
        return
    cos, sin = cos_sin if cos_sin is not None else rope_cos_sin(rope, positions)
    check_tensor("cos", cos, dtype=torch.float32, shape=(n, rope.dim // 2), device=pool.device)
    check_tensor("sin", sin, dtype=torch.float32, shape=(n, rope.dim // 2), device=pool.device)
    tuning = tuning if tuning is not None else tuning_for(pool.device)
    block_r, warps = program_rows(n, tuning.kv_insert_rows, tuning.spread_programs), tuning.kv_insert_warps
    _kv_insert_kernel[(triton.cdiv(n, block_r),)](
        kv, cos, sin, slots, pool, n, pool.shape[1], entries, NB=layout.dim // 64, FP8=layout.name == "fp8",
        DATA_BYTES=layout.data_bytes, SCALE_BYTES=max(layout.scale_bytes, 1), BLOCK_R=block_r,
        WAIT_LATE=wait_late, enable_fp_fusion=False, num_warps=warps, **launch_options(pool.device))


@triton.jit(do_not_specialize=["src_page_bytes", "src_entries"])  # the step page: the step's row count
def _copy_entries_kernel(src_ptr, src_page_bytes, src_entries, dst_ptr, dst_page_bytes, dst_entries, slots_ptr,
                         DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, BLOCK: tl.constexpr):
    wait_for_prior_grids()
    row = tl.program_id(0)
    given = tl.load(slots_ptr + row).to(tl.int64)
    dst = tl.maximum(given, 0)
    src = row.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    valid = (offs * 0 + given) >= 0
    src_page, src_off = src // src_entries, src % src_entries
    dst_page, dst_off = dst // dst_entries, dst % dst_entries
    src_data = src_ptr + src_page * src_page_bytes + src_off * DATA_BYTES
    dst_data = dst_ptr + dst_page * dst_page_bytes + dst_off * DATA_BYTES
    tl.store(dst_data + offs, tl.load(src_data + offs, mask=offs < DATA_BYTES), mask=(offs < DATA_BYTES) & valid)
    if SCALE_BYTES > 0:
        src_scale = src_ptr + src_page * src_page_bytes + src_entries * DATA_BYTES + src_off * SCALE_BYTES
        dst_scale = dst_ptr + dst_page * dst_page_bytes + dst_entries * DATA_BYTES + dst_off * SCALE_BYTES
        mask = offs < SCALE_BYTES
        tl.store(dst_scale + offs, tl.load(src_scale + offs, mask=mask), mask=mask & valid)


def append_window(window_pool: torch.Tensor, layout: EntryLayout, window: int, plan, step_kv: torch.Tensor) -> None:
    """Copy each token's encoded kv from the step page step_kv (uint8 [1, layout.page_bytes(R)], entry t = row t)
    into the window ring window_pool (uint8 [max_requests, layout.page_bytes(window)]) at plan.window_slots."""
    check_plan(plan, window_pool.device)
    rows = plan.positions.shape[0]
    check_pool("window_pool", window_pool, layout, window, window_pool.device)
    check_pool("step_kv", step_kv, layout, rows, window_pool.device)
    require(step_kv.shape[0] == 1, f"step_kv: expected one page of {rows} entries, got {step_kv.shape[0]} pages")
    if rows == 0:
        return
    _copy_entries_kernel[(rows,)](step_kv, step_kv.shape[1], rows, window_pool, window_pool.shape[1], window,
                                  plan.window_slots, DATA_BYTES=layout.data_bytes, SCALE_BYTES=layout.scale_bytes,
                                  BLOCK=triton.next_power_of_2(max(layout.data_bytes, layout.scale_bytes)),
                                  num_warps=4, **launch_options(window_pool.device))
