"""kv insert: RoPE + encoding (FP8 MODEL1 or bf16) + write of each token's kv, in one pass; and the
window-ring append, a byte copy of those encoded rows.

A step first encodes its kv into a step page (one page of R entries, row t = token row t): attention
reads the step's own window keys from there and older ones from the ring. The ring is written after
attention (`append_window`), because a prefill chunk's later tokens overwrite ring rows that its earlier
tokens still attend to. The bytes are those of `layout.write(pool, ..., apply_rope(kv, positions, rope))`,
bit for bit (tests/test_kernel_window.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..geometry import RopeSpec
from ..layout import EntryLayout
from ..ops.common import require
from ..ops.rope import rope_cos_sin
from .common import check_plan, check_pool, check_tensor
from .encode import rope_last_block, store_main_entry

__all__ = ["kv_insert", "append_window", "check_main_layout"]


def check_main_layout(layout: EntryLayout, rope: RopeSpec) -> None:
    require(layout.name in ("fp8", "bf16") and not layout.rotated, f"expected a main-entry layout, got {layout.name!r}")
    blocks = layout.dim // 64
    require(rope.dim == 64 and layout.dim % 64 == 0 and blocks & (blocks - 1) == 0,
            f"the kernels handle 64 rope dims and head_dim = 64 * a power of two, got {rope.dim} and {layout.dim}")


@triton.jit
def _kv_insert_kernel(kv_ptr, cos_ptr, sin_ptr, slots_ptr, pool_ptr, page_bytes, entries,
                      NB: tl.constexpr, FP8: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr):
    row = tl.program_id(0)
    given = tl.load(slots_ptr + row).to(tl.int64)
    slot = tl.maximum(given, 0)
    offs = tl.arange(0, NB)[:, None] * 64 + tl.arange(0, 64)[None, :]
    x = tl.load(kv_ptr + row.to(tl.int64) * (NB * 64) + offs).to(tl.float32)
    half = tl.arange(0, 32)
    x = rope_last_block(x, tl.load(cos_ptr + row * 32 + half), tl.load(sin_ptr + row * 32 + half), NB)
    page, offset = slot // entries, slot % entries
    data_ptr = pool_ptr + page * page_bytes + offset * DATA_BYTES
    scale_ptr = pool_ptr + page * page_bytes + entries * DATA_BYTES + offset * SCALE_BYTES
    store_main_entry(data_ptr, scale_ptr, x, given, NB, FP8, SCALE_BYTES)


def kv_insert(kv: torch.Tensor, positions: torch.Tensor, rope: RopeSpec, layout: EntryLayout, pool: torch.Tensor,
              entries: int, slots: torch.Tensor, *, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Rotate kv bf16 [N, D] (normed, not yet roped) at positions int [N], encode it in `layout` and write row i
    to pool slot slots[i] (int32 [N]; -1 = skip). pool: uint8 [pages, layout.page_bytes(entries)].
    cos_sin: `ops.rope.rope_cos_sin(rope, positions)` when the caller already has it (computed here otherwise)."""
    n = kv.shape[0] if isinstance(kv, torch.Tensor) else -1
    check_main_layout(layout, rope)
    check_tensor("kv", kv, dtype=torch.bfloat16, shape=(None, layout.dim), device=pool.device)
    check_tensor("positions", positions, dtype=(torch.int32, torch.int64), shape=(n,), device=pool.device)
    check_tensor("slots", slots, dtype=torch.int32, shape=(n,), device=pool.device)
    check_pool("pool", pool, layout, entries, pool.device)
    if n == 0:
        return
    cos, sin = cos_sin if cos_sin is not None else rope_cos_sin(rope, positions)
    check_tensor("cos", cos, dtype=torch.float32, shape=(n, rope.dim // 2), device=pool.device)
    check_tensor("sin", sin, dtype=torch.float32, shape=(n, rope.dim // 2), device=pool.device)
    _kv_insert_kernel[(n,)](kv, cos, sin, slots, pool, pool.shape[1], entries,
                            NB=layout.dim // 64, FP8=layout.name == "fp8", DATA_BYTES=layout.data_bytes,
                            SCALE_BYTES=max(layout.scale_bytes, 1), enable_fp_fusion=False, num_warps=2)


@triton.jit
def _copy_entries_kernel(src_ptr, src_page_bytes, src_entries, dst_ptr, dst_page_bytes, dst_entries, slots_ptr,
                         DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, BLOCK: tl.constexpr):
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
                                  num_warps=4)
