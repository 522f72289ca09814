"""`rope_rows`: interleaved RoPE (`rope.reference.apply_rope`) over rows x [N, H, D] with the step's cos/sin, result
bf16: the roped query q (bf16 in; whole heads, or their rope dims only), and the inverse rotation of an fp32
attention output (`apply_rope(out, positions, rope, inverse=True).to(bf16)`, which attention's merge and single pass
apply themselves through `rope_pairs`).

Numerics: bit for bit with the reference, on the GPU as under the interpreter. Each pair is
`even * cos - odd * sin`, `odd * cos + even * sin` with separately rounded fp32 products (the kernels compile with
enable_fp_fusion=False, so no FMA), rounded to bf16 to nearest even on the integer bits (the interpreter's
fp32 -> bf16 cast truncates, the GPU's rounds; see shared/encode.py).

Work split: one program per (row, block of BLOCK_H heads), single pass; rows in grid axis 0 (any N), head blocks in
axis 1. With out=x (in place, bf16) or an out of rope_dim dims a head, only the rope dims of each head are touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...checks import check_tensor, require
from ..shared.common import overlaps
from ..shared.encode import round_bf16
from ..shared.launch import launch_options, let_next_grid_launch, wait_for_prior_grids
from .tuning import RopeTuning, tuning_for

__all__ = ["rope_rows", "rope_pairs", "check_cos_sin"]


def _tiles(dims_only: bool, heads: int, tuning: RopeTuning) -> tuple[int, int]:
    """(BLOCK_H, num_warps) for `heads` heads, whole or (dims_only) their rope dims."""
    block_h, warps = tuning.rope_dims if dims_only else tuning.heads
    return min(block_h, triton.next_power_of_2(heads)), warps


@triton.jit
def rope_pairs(x, cos_ptr, sin_ptr, row, BLOCK_H: tl.constexpr, COLS: tl.constexpr, FIRST_PAIR,
                ROPE_PAIR: tl.constexpr, HALF: tl.constexpr, INVERSE: tl.constexpr):
    """x fp32 [BLOCK_H, COLS] holding dims 2 * FIRST_PAIR .. of each head: rotate pairs ROPE_PAIR .. ROPE_PAIR +
    HALF - 1 (global pair index) as apply_rope does, rounded to bf16; other pairs are returned unchanged."""
    o_p = FIRST_PAIR + tl.arange(0, COLS // 2)
    o_r = o_p - ROPE_PAIR
    m_r = (o_r >= 0) & (o_r < HALF)
    b_cos = tl.load(cos_ptr + row * HALF + o_r, mask=m_r, other=1.0)
    b_sin = tl.load(sin_ptr + row * HALF + o_r, mask=m_r, other=0.0)
    if INVERSE:
        b_sin = b_sin * -1.0  # torch's -sin: -0 where sin is +0; Triton 3.6 compiles unary minus to 0 - x (+0)
    even, odd = tl.split(tl.reshape(x, (BLOCK_H, COLS // 2, 2)))
    rot_even = round_bf16(even * b_cos[None, :] - odd * b_sin[None, :])
    rot_odd = round_bf16(odd * b_cos[None, :] + even * b_sin[None, :])
    even = tl.where(m_r[None, :], rot_even, even)
    odd = tl.where(m_r[None, :], rot_odd, odd)
    return tl.reshape(tl.join(even, odd), (BLOCK_H, COLS))


@triton.jit
def _rope_rows_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr,
                      H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, START: tl.constexpr,
                      COLS: tl.constexpr, OUT_D: tl.constexpr, BLOCK_H: tl.constexpr, INVERSE: tl.constexpr,
                      LAUNCH_NEXT: tl.constexpr):
    """Row i_t, heads i_h * BLOCK_H ..: dims START .. D - 1 of each head (START = 0: the whole head, rounded
    to bf16; START = D - 2 * HALF: the rope dims only, for an in-place call or into an out of OUT_D = 2 * HALF dims a
    head). LAUNCH_NEXT: the next grid may launch once this one's programs have waited
    (`launch.let_next_grid_launch`)."""
    wait_for_prior_grids()
    if LAUNCH_NEXT:
        let_next_grid_launch()
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    t = i_t.to(tl.int64)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    o_d = START + tl.arange(0, COLS)
    m = (o_h[:, None] < H) & (o_d[None, :] < D)
    offs = t * (H * D) + o_h[:, None] * D + o_d[None, :]
    b_x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    b_x = rope_pairs(b_x, cos_ptr, sin_ptr, t, BLOCK_H, COLS, START // 2, D // 2 - HALF, HALF, INVERSE)
    # nope dims of an fp32 input round here too (the layer's final .to(bf16)); bf16 values pass unchanged
    o_out = t * (H * OUT_D) + o_h[:, None] * OUT_D + (o_d - (D - OUT_D))[None, :]
    tl.store(out_ptr + o_out, round_bf16(b_x).to(tl.bfloat16), mask=m)


def check_cos_sin(cos, sin, rows: int, dim: int, device: torch.device) -> int:
    """cos, sin fp32 [rows, rope_dim // 2] -> rope_dim // 2 (rope_dim a power of two <= dim)."""
    half = cos.shape[1] if isinstance(cos, torch.Tensor) and cos.dim() == 2 else -1
    check_tensor("cos", cos, dtype=torch.float32, shape=(rows, None), device=device)
    check_tensor("sin", sin, dtype=torch.float32, shape=(rows, half), device=device)
    require(half >= 1 and half & (half - 1) == 0 and 2 * half <= dim,
            f"cos/sin: expected [N, rope_dim // 2] with rope_dim a power of two <= head dim {dim}, got half {half}")
    return half


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False,
              out: torch.Tensor | None = None, launch_next: bool = False,
              tuning: RopeTuning | None = None) -> torch.Tensor:
    """Interleaved RoPE on the last rope_dim dims of every head, result bf16, bit for bit
    `apply_rope(x, positions, rope, inverse=inverse).to(torch.bfloat16)`.

    x: bf16 or fp32 [N, H, D], contiguous (fp32: the attention output; its nope dims are rounded to bf16 too);
    cos, sin: fp32 [N, rope_dim // 2] = `ops.rope.reference.rope_cos_sin(rope, positions)`, computed once per step.
    out: bf16 [N, H, D], contiguous; may be x itself (bf16 x), then only the rope dims are read and written; or
        bf16 [N, H, rope_dim]: the rope dims only (`sparse_attention_paged(q_rope_dims=)` reads q's other dims from x).
    launch_next: the first kernel of a pair (`launch`'s module docstring): the next one may launch while this runs.
    tuning: heads and warps a program (default: the device's).
    """
    require(isinstance(x, torch.Tensor), f"x: expected a tensor, got {type(x).__name__}")
    check_tensor("x", x, dtype=(torch.bfloat16, torch.float32), shape=(None, None, None), device=x.device)
    n, heads, dim = x.shape
    half = check_cos_sin(cos, sin, n, dim, x.device)
    require(isinstance(inverse, bool), f"inverse: expected a bool, got {type(inverse).__name__}")
    require(isinstance(launch_next, bool), f"launch_next: expected a bool, got {launch_next!r}")
    if out is None:
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    rope_only = isinstance(out, torch.Tensor) and out.dim() == 3 and out.shape[2] == 2 * half < dim
    check_tensor("out", out, dtype=torch.bfloat16, shape=(n, heads, 2 * half if rope_only else dim), device=x.device)
    in_place = not rope_only and out.data_ptr() == x.data_ptr() and out.dtype == x.dtype
    require(in_place or not overlaps(out, x), "out: overlaps x without being x (only out=x is allowed in place)")
    if out.numel() == 0:
        return out
    dims_only = in_place or rope_only  # only the rope dims are read and written
    start = dim - 2 * half if dims_only else 0
    block_h, warps = _tiles(dims_only, heads, tuning if tuning is not None else tuning_for(x.device))
    _rope_rows_kernel[(n, triton.cdiv(heads, block_h))](
        x, cos, sin, out, H=heads, D=dim, HALF=half, START=start, COLS=triton.next_power_of_2(dim - start),
        OUT_D=out.shape[2], BLOCK_H=block_h, INVERSE=inverse, LAUNCH_NEXT=launch_next, num_warps=warps,
        enable_fp_fusion=False, **launch_options(x.device))
    return out
