"""The indexer query in one launch per step: `indexer_query_rows` ropes the indexer query, then computes
`indexer.reference.indexer_query` (Hadamard rotation, bf16 rounding, MXFP4 / FP8 round trip; plain float for bf16
keys); `indexer_query_and_weights` also writes the head weights `weights_proj(x).float() * scale` in the same launch,
and, for MXFP4 keys on the FP8-MMA path, q's FP8 operand.

Numerics: bit for bit with the reference, on the GPU as under the interpreter: RoPE as `rope.kernel.rope_pairs`,
the Hadamard rotation as the butterfly of `quant.hadamard_rotate` in the same order (`encode.rotate_keys`). The
quantizers use encode.py's scale and e4m3 / e2m1 encoders and keep the value on the grid in fp32: no fp8 cast and
decode back (with Triton 3.6 on the H200 the cast-and-decode form gave wrong values for the last num_warps heads of
some tiles).

Work split: one program per (row, block of BLOCK_H heads), single pass; rows in grid axis 0 (any N), head blocks in
axis 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...cache.layout import EntryLayout
from ...checks import check_tensor, require
from ..shared.common import overlaps
from ..shared.encode import (
    e2m1_bits,
    e4m3_round,
    exp2_int,
    nan_amax,
    pow2_exponent,
    program_rows,
    rotate_keys,
)
from .keys import KEYS_BF16, KEYS_MXFP4, fp8_query_operand
from .keys import key_format as _layout_format
from ..rope.kernel import check_cos_sin, rope_pairs
from ..shared.launch import check_pair_ends, launch_options, let_next_grid_launch, wait_for_prior_grids
from .tuning import QueryTuning, query_tuning_for

__all__ = ["indexer_query_and_weights", "indexer_query_rows"]

_ROTATED = 3  # test hook: store the bf16-rounded rotation itself (fp32), no quantization


def _tiles(heads: int, rows: int, tuning: QueryTuning) -> tuple[int, int]:
    """(BLOCK_H, num_warps) for [rows, heads]: a small launch spreads, BLOCK_H halving while it would have fewer than
    `tuning.spread_programs` programs, down to `tuning.min_block_h` (V4: 4 heads up to 32 rows, 8 up to 65, 16 from
    66)."""
    block_h = min(tuning.block_h, triton.next_power_of_2(heads))
    block_h = max(min(block_h, tuning.min_block_h), program_rows(rows * heads, block_h, tuning.spread_programs))
    return block_h, tuning.warps


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
    (MXFP4): also the scores kernel's FP8 MMA operand of those values (`keys.fp8_query_operand`). LAUNCH_NEXT:
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
    b_x = rope_pairs(b_x, cos_ptr, sin_ptr, t, BLOCK_H, COLS, 0, D // 2 - HALF, HALF, False)
    if FORMAT == 0:
        b_y = b_x
    else:
        b_r = rotate_keys(b_x, h_scale, LOG_D)  # the keys' own rotation (compress_insert), rounded to bf16
        if FORMAT == 1:  # FP8 (`reference.indexer_query`): one pow2 scale per head row (block = D)
            e, finite = pow2_exponent(nan_amax(b_r, 1), 8, 0x600000)  # 448 = 1.75 * 2^8
            b_q = tl.minimum(tl.maximum(b_r * exp2_int(-e)[:, None], -448.0), 448.0)
            b_y = e4m3_round(b_q) * exp2_int(e)[:, None]  # the value on the e4m3 grid, -0 kept
            b_y = tl.where(finite[:, None], b_y, float("nan"))
        elif FORMAT == 2:  # MXFP4 (`reference.indexer_query`): one pow2 scale per 32 values
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


def _indexer_query(q, cos, sin, layout, out, weights, scale, weights_out, fmt=None, fp8_out=None,
                   launch_next=False, wait_late=False, tuning: QueryTuning | None = None) -> torch.Tensor:
    require(isinstance(layout, EntryLayout), f"layout: expected an EntryLayout, got {type(layout).__name__}")
    fmt = _layout_format(layout) if fmt is None else fmt
    require(isinstance(q, torch.Tensor), f"q: expected a tensor, got {type(q).__name__}")
    device = q.device
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, None, layout.dim), device=device)
    n, heads, dim = q.shape
    half = check_cos_sin(cos, sin, n, dim, device)
    require(fmt == KEYS_BF16 or (dim >= 32 and dim & (dim - 1) == 0),
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
        require(fmt == KEYS_MXFP4, f"fp8_out: the FP8 MMA operand is made for MXFP4 keys only, not {layout.name!r}")
        require(isinstance(fp8_out, tuple) and len(fp8_out) == 2, "fp8_out: expected (codes, scales)")
        check_tensor("fp8_out codes", fp8_out[0], dtype=torch.uint8, shape=(n, heads, dim), device=device)
        check_tensor("fp8_out scales", fp8_out[1], dtype=torch.float32, shape=(n, heads), device=device)
    if out.numel() > 0:
        block_h, warps = _tiles(heads, n, tuning if tuning is not None else query_tuning_for(device))
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
                       out: torch.Tensor | None = None, tuning: QueryTuning | None = None) -> torch.Tensor:
    """The indexer query in its keys' numerics: `ops.indexer.reference.indexer_query(apply_rope(q, positions, rope),
    layout)` (bit for bit for bf16 keys; see the module docstring for the Hadamard rotation of MXFP4 / FP8 keys).

    q: bf16 [N, H, layout.dim], contiguous (q_b_proj's output, not yet roped); cos, sin: fp32 [N, rope_dim // 2];
    layout: the indexer-key layout (`layout.indexer_layout`); out: fp32 [N, H, layout.dim], contiguous; tuning: heads
    a program (default: the device's)."""
    return _indexer_query(q, cos, sin, layout, out, None, None, None, tuning=tuning)


def indexer_query_and_weights(q: torch.Tensor, weights: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              layout: EntryLayout, *, scale: float, out: torch.Tensor | None = None,
                              weights_out: torch.Tensor | None = None,
                              fp8_out: tuple[torch.Tensor, torch.Tensor] | None = None, launch_next: bool = False,
                              wait_late: bool = False, tuning: QueryTuning | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`indexer_query_rows` and, in the same launch, the head weights `weights.float() * scale` (bit for bit).

    weights: bf16 or fp32 [N, H] (weights_proj's output); scale: e.g. index_n_heads^-0.5 (applied as an fp32,
    as torch does for a Python scalar); weights_out: fp32 [N, H], contiguous (may be weights itself when fp32);
    fp8_out (MXFP4 keys): (uint8 [N, H, D], fp32 [N, H]) for the scores kernel's FP8 operand of the query, written in
    the same launch, bit for bit `kernel.indexer_query_fp8(query)`; launch_next / wait_late: the first / second
    kernel of a pair (`launch`'s module docstring), beside `compress_insert(wait_late=True)` /
    `compress_insert(launch_next=True)`. Every input is the caller's, as a wait_late kernel needs. tuning: as
    `indexer_query_rows`'s. Returns (query fp32 [N, H, D], weights fp32 [N, H])."""
    require(weights is not None, "weights: expected a tensor, got None")
    check_pair_ends("indexer_query_and_weights", launch_next, wait_late, tables_given=True)  # cos, sin: the caller's
    return _indexer_query(q, cos, sin, layout, out, weights, scale, weights_out, fp8_out=fp8_out,
                          launch_next=launch_next, wait_late=wait_late, tuning=tuning)
