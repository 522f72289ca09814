"""Per-step glue of the layer's kernel path, one launch each instead of the torch op chains:

- `rope_rows`: interleaved RoPE (`ops.rope.apply_rope`) over rows x [N, H, D] with the step's cos/sin, result
  bf16: the roped query q (bf16 in; whole heads, or their rope dims only), and the inverse rotation of an fp32
  attention output (`apply_rope(out, positions, rope, inverse=True).to(bf16)`, what attention's merge and single pass
  apply themselves);
- `indexer_query_rows`: RoPE on the indexer query, then `ops.indexer.indexer_query` (Hadamard rotation, bf16
  rounding, MXFP4 / FP8 round trip; plain float for bf16 keys); `indexer_query_and_weights` also writes the
  head weights `weights_proj(x).float() * scale` in the same launch.

Numerics: bit for bit with the references, on the GPU as under the interpreter. RoPE: each pair is
`even * cos - odd * sin`, `odd * cos + even * sin` with separately rounded fp32 products (the kernels compile with
enable_fp_fusion=False, so no FMA), rounded to bf16 to nearest even on the integer bits (the interpreter's
fp32 -> bf16 cast truncates, the GPU's rounds; see encode.py). The Hadamard rotation is the butterfly of
`quant.hadamard_rotate` in the same order (`encode.rotate_keys`). The quantizers use encode.py's scale and
e4m3 / e2m1 encoders and keep the value on the grid in fp32: no fp8 cast and decode back (with Triton 3.6 on the
H200, the cast-and-decode form gave wrong values for the last num_warps heads of some tiles, docs/performance.md).

Work split: one program per (row, block of BLOCK_H heads), single pass; rows in grid axis 0 (any N), head
blocks in axis 1. `rope_rows` with out=x (in place, bf16) or an out of rope_dim dims a head touches only the rope
dims of each head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layout import EntryLayout
from ..ops.common import require
from .common import check_tensor, overlaps
from .encode import e2m1_bits, e4m3_round, exp2_int, nan_amax, pow2_exponent, program_rows, rotate_keys, round_bf16
from .indexer import _BF16, _MXFP4, fp8_query_operand
from .indexer import _format as _layout_format
from .launch import check_pair_ends, launch_options, let_next_grid_launch, wait_for_prior_grids

__all__ = ["indexer_query_and_weights", "indexer_query_rows", "rope_rows"]

_ROTATED = 3  # test hook: store the bf16-rounded rotation itself (fp32), no quantization

# (BLOCK_H, num_warps) per kernel; assign to time variants. All three are memory- or launch-bound, so the tiles
# aim at 16-32 values per thread (16 B vector accesses) and many small programs (one decode row still makes
# H / BLOCK_H of them): "rope": whole heads [8, 512] (8 KB of bf16 in and out); "rope_inplace": the rope dims
# [16, 64] only (in place, or into an out of the rope dims); "indexer": [16, 128] through the butterfly (7 shuffles
# of the tile through shared memory).
TILES = {"rope": (8, 4), "rope_inplace": (16, 2), "indexer": (16, 4)}
# The indexer query of a small launch (a decode step's rows) takes fewer heads per program, down to this many, while
# it would have fewer than `encode.SPREAD_PROGRAMS` programs: its time is the latency of one program's chain (the
# butterfly's exchanges, the quantizers' reductions), which is shorter with fewer values per thread. H100, 2026-11-26
# (docs/performance.md): CSA decode core at batch 1 / 1M 59.7 -> 56.8 us with 4 heads a program, at batch 8 / 128K
# 66.3 -> 63.9; at 8192 prefill rows 4 heads took 464 us against 406 with 16.
INDEXER_MIN_BLOCK_H = 4


def _tiles(kind: str, heads: int, rows: int | None = None) -> tuple[int, int]:
    """(BLOCK_H, num_warps) of `kind` for [rows, heads]. Given rows (the indexer query's launch), a small launch
    spreads: BLOCK_H halves while it would have fewer than `encode.SPREAD_PROGRAMS` programs, down to
    `INDEXER_MIN_BLOCK_H` (V4: 4 heads up to 32 rows, 8 up to 65, 16 from 66)."""
    block_h, warps = TILES[kind]
    block_h = min(block_h, triton.next_power_of_2(heads))
    if rows is not None:
        block_h = max(min(block_h, INDEXER_MIN_BLOCK_H), program_rows(rows * heads, block_h))
    return block_h, warps


@triton.jit
def _rope_pairs(x, cos_ptr, sin_ptr, row, BLOCK_H: tl.constexpr, COLS: tl.constexpr, FIRST_PAIR,
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
    b_x = _rope_pairs(b_x, cos_ptr, sin_ptr, t, BLOCK_H, COLS, START // 2, D // 2 - HALF, HALF, INVERSE)
    # nope dims of an fp32 input round here too (the layer's final .to(bf16)); bf16 values pass unchanged
    o_out = t * (H * OUT_D) + o_h[:, None] * OUT_D + (o_d - (D - OUT_D))[None, :]
    tl.store(out_ptr + o_out, round_bf16(b_x).to(tl.bfloat16), mask=m)


@triton.jit
def _e2m1_value(code):
    """e2m1 code (int32 0..15, bit 3 = sign) -> fp32 value, exactly."""
    mag = code & 7
    normal = ((mag << 22) + (126 << 23)).to(tl.float32, bitcast=True)  # codes >= 2: exponent (mag >> 1) - 1
    value = tl.where(mag < 2, mag.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, value * -1.0, value)  # -0 for code 8 (not 0 - x: +0)


@triton.jit
def _indexer_query_kernel(q_ptr, cos_ptr, sin_ptr, out_ptr, w_ptr, w_out_ptr, q8_ptr, q8_scale_ptr, w_scale, h_scale,
                          H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, COLS: tl.constexpr,
                          LOG_D: tl.constexpr, BLOCK_H: tl.constexpr, FORMAT: tl.constexpr, WEIGHTS: tl.constexpr,
                          FP8_OUT: tl.constexpr, LAUNCH_NEXT: tl.constexpr, WAIT_LATE: tl.constexpr):
    """Row i_t, heads i_h * BLOCK_H ..: q bf16 -> roped (bf16 values) -> FORMAT's query numerics, fp32 out; FP8_OUT
    (MXFP4): also the scores kernel's FP8 MMA operand of those values (`indexer.fp8_query_operand`). LAUNCH_NEXT:
    the next grid may launch once this one's programs have waited (`launch.let_next_grid_launch`); WAIT_LATE: the
    wait for the grid before it comes last (the second kernel of a pair)."""
    if not WAIT_LATE:
        wait_for_prior_grids()
        if LAUNCH_NEXT:
            let_next_grid_launch()
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    t = i_t.to(tl.int64)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_d = tl.arange(0, COLS)
    m = m_h[:, None] & (o_d[None, :] < D)
    offs = t * (H * D) + o_h[:, None] * D + o_d[None, :]
    b_x = tl.load(q_ptr + offs, mask=m, other=0.0).to(tl.float32)
    b_x = _rope_pairs(b_x, cos_ptr, sin_ptr, t, BLOCK_H, COLS, 0, D // 2 - HALF, HALF, False)
    if FORMAT == 0:
        b_y = b_x
    else:
        b_r = rotate_keys(b_x, h_scale, LOG_D)  # the keys' own rotation (compress_insert), rounded to bf16
        if FORMAT == 1:  # FP8 (indexer._FP8): one pow2 scale per head row (block = D)
            e, finite = pow2_exponent(nan_amax(b_r, 1), 8, 0x600000)  # 448 = 1.75 * 2^8
            b_q = tl.minimum(tl.maximum(b_r * exp2_int(-e)[:, None], -448.0), 448.0)
            b_y = e4m3_round(b_q) * exp2_int(e)[:, None]  # the value on the e4m3 grid, -0 kept
            b_y = tl.where(finite[:, None], b_y, float("nan"))
        elif FORMAT == 2:  # MXFP4 (indexer._MXFP4): one pow2 scale per 32 values
            b_blk = tl.reshape(b_r, (BLOCK_H, D // 32, 32))
            e, finite = pow2_exponent(nan_amax(b_blk, 2), 2, 0x400000)  # 6 = 1.5 * 2^2
            b_y = _e2m1_value(e2m1_bits(b_blk * exp2_int(-e)[:, :, None])) * exp2_int(e)[:, :, None]
            b_y = tl.where(finite[:, :, None], b_y, float("nan"))
            if FP8_OUT:
                codes, q8_scale = fp8_query_operand(b_y)
                tl.store(q8_ptr + offs, tl.reshape(codes, (BLOCK_H, D)), mask=m)
                tl.store(q8_scale_ptr + t * H + o_h, q8_scale, mask=m_h)
            b_y = tl.reshape(b_y, (BLOCK_H, D))
        else:
            b_y = b_r
    tl.store(out_ptr + offs, b_y, mask=m)
    if WEIGHTS:
        b_w = tl.load(w_ptr + t * H + o_h, mask=m_h, other=0.0).to(tl.float32)
        tl.store(w_out_ptr + t * H + o_h, b_w * w_scale, mask=m_h)
    if WAIT_LATE:
        wait_for_prior_grids()


def _check_cos_sin(cos, sin, rows: int, dim: int, device: torch.device) -> int:
    """cos, sin fp32 [rows, rope_dim // 2] -> rope_dim // 2 (rope_dim a power of two <= dim)."""
    half = cos.shape[1] if isinstance(cos, torch.Tensor) and cos.dim() == 2 else -1
    check_tensor("cos", cos, dtype=torch.float32, shape=(rows, None), device=device)
    check_tensor("sin", sin, dtype=torch.float32, shape=(rows, half), device=device)
    require(half >= 1 and half & (half - 1) == 0 and 2 * half <= dim,
            f"cos/sin: expected [N, rope_dim // 2] with rope_dim a power of two <= head dim {dim}, got half {half}")
    return half


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False,
              out: torch.Tensor | None = None, launch_next: bool = False) -> torch.Tensor:
    """Interleaved RoPE on the last rope_dim dims of every head, result bf16, bit for bit
    `apply_rope(x, positions, rope, inverse=inverse).to(torch.bfloat16)`.

    x: bf16 or fp32 [N, H, D], contiguous (fp32: the attention output; its nope dims are rounded to bf16 too);
    cos, sin: fp32 [N, rope_dim // 2] = `ops.rope.rope_cos_sin(rope, positions)`, computed once per step.
    out: bf16 [N, H, D], contiguous; may be x itself (bf16 x), then only the rope dims are read and written; or
        bf16 [N, H, rope_dim]: the rope dims only (`sparse_attention_paged(q_rope_dims=)` reads q's other dims from x).
    launch_next: the first kernel of a pair (`launch`'s module docstring): the next one may launch while this runs.
    """
    require(isinstance(x, torch.Tensor), f"x: expected a tensor, got {type(x).__name__}")
    check_tensor("x", x, dtype=(torch.bfloat16, torch.float32), shape=(None, None, None), device=x.device)
    n, heads, dim = x.shape
    half = _check_cos_sin(cos, sin, n, dim, x.device)
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
    block_h, warps = _tiles("rope_inplace" if dims_only else "rope", heads)
    _rope_rows_kernel[(n, triton.cdiv(heads, block_h))](
        x, cos, sin, out, H=heads, D=dim, HALF=half, START=start, COLS=triton.next_power_of_2(dim - start),
        OUT_D=out.shape[2], BLOCK_H=block_h, INVERSE=inverse, LAUNCH_NEXT=launch_next, num_warps=warps,
        enable_fp_fusion=False, **launch_options(x.device))
    return out


def _indexer_query(q, cos, sin, layout, out, weights, scale, weights_out, fmt=None, fp8_out=None,
                   launch_next=False, wait_late=False) -> torch.Tensor:
    require(isinstance(layout, EntryLayout), f"layout: expected an EntryLayout, got {type(layout).__name__}")
    fmt = _layout_format(layout) if fmt is None else fmt
    require(isinstance(q, torch.Tensor), f"q: expected a tensor, got {type(q).__name__}")
    device = q.device
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, None, layout.dim), device=device)
    n, heads, dim = q.shape
    half = _check_cos_sin(cos, sin, n, dim, device)
    require(fmt == _BF16 or (dim >= 32 and dim & (dim - 1) == 0),
            f"layout: a rotated query needs a power-of-two dim >= 32, got {dim}")
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32, device=device)
    check_tensor("out", out, dtype=torch.float32, shape=(n, heads, dim), device=device)
    require(not overlaps(out, q), "out: overlaps q")
    if weights is not None:
        check_tensor("weights", weights, dtype=(torch.bfloat16, torch.float32), shape=(n, heads), device=device)
        require(isinstance(scale, (int, float)) and not isinstance(scale, bool),
                f"scale: expected a float, got {type(scale).__name__}")
        if weights_out is None:
            weights_out = torch.empty((n, heads), dtype=torch.float32, device=device)
        check_tensor("weights_out", weights_out, dtype=torch.float32, shape=(n, heads), device=device)
        require(not overlaps(weights_out, out) and not overlaps(weights_out, q),
                "weights_out: overlaps out or q")
        require(weights_out.data_ptr() == weights.data_ptr() or not overlaps(weights_out, weights),
                "weights_out: overlaps weights without being weights")
    if fp8_out is not None:
        require(fmt == _MXFP4, f"fp8_out: the FP8 MMA operand is made for MXFP4 keys only, not {layout.name!r}")
        require(isinstance(fp8_out, tuple) and len(fp8_out) == 2, "fp8_out: expected (codes, scales)")
        check_tensor("fp8_out codes", fp8_out[0], dtype=torch.uint8, shape=(n, heads, dim), device=device)
        check_tensor("fp8_out scales", fp8_out[1], dtype=torch.float32, shape=(n, heads), device=device)
    if out.numel() > 0:
        block_h, warps = _tiles("indexer", heads, n)
        # the matrix entries of quant.hadamard_matrix: D^-0.5 rounded once to fp32
        h_scale = float(torch.tensor(dim ** -0.5, dtype=torch.float64).float())
        _indexer_query_kernel[(n, triton.cdiv(heads, block_h))](
            q, cos, sin, out, weights if weights is not None else out, weights_out if weights is not None else out,
            *(fp8_out if fp8_out is not None else (out, out)),
            float(scale) if weights is not None else 1.0, h_scale, H=heads, D=dim, HALF=half,
            COLS=triton.next_power_of_2(dim), LOG_D=max(dim.bit_length() - 1, 0), BLOCK_H=block_h, FORMAT=fmt,
            WEIGHTS=weights is not None, FP8_OUT=fp8_out is not None, LAUNCH_NEXT=launch_next, WAIT_LATE=wait_late,
            num_warps=warps, enable_fp_fusion=False, **launch_options(device))
    return out if weights is None else (out, weights_out)


def indexer_query_rows(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: EntryLayout, *,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """The indexer query in its keys' numerics: `ops.indexer.indexer_query(apply_rope(q, positions, rope), layout)`
    (bit for bit for bf16 keys; see the module docstring for the Hadamard rotation of MXFP4 / FP8 keys).

    q: bf16 [N, H, layout.dim], contiguous (q_b_proj's output, not yet roped); cos, sin: fp32 [N, rope_dim // 2];
    layout: the indexer-key layout (`layout.indexer_layout`); out: fp32 [N, H, layout.dim], contiguous."""
    return _indexer_query(q, cos, sin, layout, out, None, None, None)


def indexer_query_and_weights(q: torch.Tensor, weights: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              layout: EntryLayout, *, scale: float, out: torch.Tensor | None = None,
                              weights_out: torch.Tensor | None = None,
                              fp8_out: tuple[torch.Tensor, torch.Tensor] | None = None, launch_next: bool = False,
                              wait_late: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`indexer_query_rows` and, in the same launch, the head weights `weights.float() * scale` (bit for bit).

    weights: bf16 or fp32 [N, H] (weights_proj's output); scale: e.g. index_n_heads^-0.5 (applied as an fp32,
    as torch does for a Python scalar); weights_out: fp32 [N, H], contiguous (may be weights itself when fp32);
    fp8_out (MXFP4 keys): (uint8 [N, H, D], fp32 [N, H]) for the scores kernel's FP8 operand of the query, written in
    the same launch, bit for bit `indexer.indexer_query_fp8(query)`; launch_next / wait_late: the first / second
    kernel of a pair (`launch`'s module docstring), beside `compress_insert(wait_late=True)` /
    `compress_insert(launch_next=True)`. Every input is the caller's, as a wait_late kernel needs.
    Returns (query fp32 [N, H, D], weights fp32 [N, H])."""
    require(weights is not None, "weights: expected a tensor, got None")
    check_pair_ends("indexer_query_and_weights", launch_next, wait_late, tables_given=True)  # cos, sin: the caller's
    return _indexer_query(q, cos, sin, layout, out, weights, scale, weights_out, fp8_out=fp8_out,
                          launch_next=launch_next, wait_late=wait_late)
