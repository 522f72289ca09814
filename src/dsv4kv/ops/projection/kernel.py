"""The glue around the layer's input projections (`DSV4Attention.project`), one launch each instead of torch op chains:

- `rms_norm_rows`: the RMS norm of each row's last dim, bf16 in and out: `ops.projection.reference.rms_norm` with a
  weight (q_a's and kv's norms) or `unit_rms_norm` without one (the query's per-head norm, in place). The torch form
  takes 5-7 kernels and, for a prefill chunk's query (8192 rows x 64 heads x 512), ~2 ms of fp32 temporaries.
- `compressor_rows`: each compressor's kv rows and logit rows (gate + positional bias,
  `ops.compress.reference.compressor_logits`), split out of the one fp32 GEMM the layer runs for all its compressors'
  projections.

Numerics. The norms do the references' fp32 operations with separately rounded products (compiled without FMA
contraction), but sum the squares in the kernel's order: the mean may differ in its last bit, and then a bf16 result,
rarely, by one unit (tests/test_kernel_projection.py counts them). `compressor_rows` copies and adds one fp32 value:
bit for bit.

Work split (`ProjectionTuning`): `rms_norm_rows`, max(1, 4096 // next_pow2(D)) rows of the flattened [rows, D] per
program whatever the row count, so that one compilation per (D, weighted) serves every step (a step-dependent tile
would compile anew on new step shapes, tests/test_engine_compiles.py); `compressor_rows`, one row and BLOCK columns
of one compressor per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...checks import require
from ...checks import check_tensor
from ..shared.common import overlaps
from ..shared.encode import round_bf16
from ..shared.launch import launch_options, wait_for_prior_grids
from .tuning import ProjectionTuning, tuning_for

__all__ = ["rms_norm_rows", "compressor_rows"]


@triton.jit(do_not_specialize=["rows"])  # a step's row count: one compilation for all
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, rows, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_R: tl.constexpr, WEIGHTED: tl.constexpr):
    wait_for_prior_grids()
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m = (o_r < rows)[:, None] & m_d[None, :]
    offs = o_r.to(tl.int64)[:, None] * D + o_d[None, :]
    b_x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    b_r = tl.math.rsqrt(tl.sum(b_x * b_x, axis=1) * (1.0 / D) + eps)  # torch's mean: the sum times fp32(1 / D)
    if WEIGHTED:  # weight * (x * r), fp32, one rounding
        b_w = tl.load(w_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_y = b_w[None, :] * (b_x * b_r[:, None])
    else:  # x * bf16(r): the product of two bf16 values, exact in fp32, then rounded as a bf16 multiply would
        b_y = b_x * round_bf16(b_r)[:, None]
    tl.store(out_ptr + offs, round_bf16(b_y).to(tl.bfloat16), mask=m)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                  out: torch.Tensor | None = None, tuning: ProjectionTuning | None = None) -> torch.Tensor:
    """RMS norm over the last dim of bf16 x [..., D], contiguous -> bf16 like x: `ops.projection.reference.rms_norm(x,
    weight, eps)` with a weight (float [D]), `unit_rms_norm(x, eps)` with None. out: bf16 like x, may be x itself.
    tuning: values and warps a program (default: the device's)."""
    require(isinstance(x, torch.Tensor), f"x: expected a bf16 tensor [..., D], got {type(x).__name__}")
    shape = tuple(x.shape)
    require(len(shape) >= 1, "x: expected a bf16 tensor [..., D], got a scalar")
    check_tensor("x", x, dtype=torch.bfloat16, shape=(None,) * len(shape), device=x.device)
    dim = shape[-1]
    if weight is not None:
        check_tensor("weight", weight, dtype=(torch.float32, torch.bfloat16), shape=(dim,), device=x.device)
    require(isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0,
            f"eps: expected a float >= 0, got {eps!r}")
    if out is None:
        out = torch.empty_like(x)
    check_tensor("out", out, dtype=torch.bfloat16, shape=shape, device=x.device)
    require(out.data_ptr() == x.data_ptr() or not overlaps(out, x), "out: overlaps x without being x")
    rows = x.numel() // max(dim, 1)
    if rows == 0 or dim == 0:
        return out
    tuning = tuning if tuning is not None else tuning_for(x.device)
    block_d = triton.next_power_of_2(dim)
    block_r = max(1, tuning.norm_values // block_d)
    _rms_norm_kernel[(triton.cdiv(rows, block_r),)](
        x, weight if weight is not None else x, out, rows, float(eps), D=dim, BLOCK_D=block_d, BLOCK_R=block_r,
        WEIGHTED=weight is not None, num_warps=tuning.norm_warps, enable_fp_fusion=False, **launch_options(x.device))
    return out


@triton.jit
def _split_rows(p_row, c, phase, bias_ptr, kv_ptr, logits_ptr, W: tl.constexpr, BLOCK: tl.constexpr):
    """Columns c.. of one compressor's [kv | gate] (2W fp32 at p_row) -> kv row, gate + bias[phase] logit row."""
    o = c + tl.arange(0, BLOCK)
    m = o < W
    tl.store(kv_ptr + o, tl.load(p_row + o, mask=m), mask=m)
    b_gate = tl.load(p_row + W + o, mask=m)
    tl.store(logits_ptr + o, b_gate + tl.load(bias_ptr + phase * W + o, mask=m), mask=m)


@triton.jit
def _compressor_rows_kernel(y_ptr, positions_ptr, bias0_ptr, kv0_ptr, logits0_ptr, bias1_ptr, kv1_ptr, logits1_ptr,
                            RATIO: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, BLOCK: tl.constexpr):
    wait_for_prior_grids()
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    pos = tl.load(positions_ptr + t)
    phase = (pos % RATIO + RATIO) % RATIO  # torch's remainder: the divisor's sign (padding rows at -1 too)
    p_row = y_ptr + t * (2 * (W0 + W1))
    NB0: tl.constexpr = (W0 + BLOCK - 1) // BLOCK
    if b < NB0:
        _split_rows(p_row, b * BLOCK, phase, bias0_ptr, kv0_ptr + t * W0, logits0_ptr + t * W0, W0, BLOCK)
    else:
        _split_rows(p_row + 2 * W0, (b - NB0) * BLOCK, phase, bias1_ptr, kv1_ptr + t * W1, logits1_ptr + t * W1, W1,
                    BLOCK)


def compressor_rows(y: torch.Tensor, positions: torch.Tensor, biases: list[torch.Tensor], *,
                    out: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                    tuning: ProjectionTuning | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The compressors' state rows out of one GEMM: y fp32 [N, sum of 2 w_i] holds compressor i's [kv | gate] columns
    in turn; biases: its positional biases fp32 [m, w_i] (one or two compressors, one m). -> [(kv fp32 [N, w_i],
    logits fp32 [N, w_i])], bit for bit `(kv_i, ops.compress.reference.compressor_logits(gate_i, bias_i, positions))`;
    into `out` when given (contiguous, apart from y). tuning: columns and warps a program (default: the device's)."""
    require(isinstance(biases, (list, tuple)) and len(biases) in (1, 2),
            f"biases: expected a list of one or two tensors, got {type(biases).__name__} of "
            f"{len(biases) if isinstance(biases, (list, tuple)) else '?'}")
    require(isinstance(y, torch.Tensor), f"y: expected fp32 [N, C], got {type(y).__name__}")
    check_tensor("y", y, dtype=torch.float32, shape=(None, None), device=y.device)
    device = y.device
    rows = y.shape[0]
    for i, bias in enumerate(biases):
        check_tensor(f"biases[{i}]", bias, dtype=torch.float32, shape=(None, None), device=device)
    ratio, widths = biases[0].shape[0], [bias.shape[1] for bias in biases]
    require(ratio >= 1 and all(bias.shape[0] == ratio for bias in biases) and min(widths) >= 1,
            f"biases: expected [m, w] each with one m >= 1, got {[list(b.shape) for b in biases]}")
    require(y.shape[1] == 2 * sum(widths), f"y: expected {2 * sum(widths)} columns ([kv | gate] of each compressor: "
                                           f"2 x {' + '.join(map(str, widths))}), got {y.shape[1]}")
    check_tensor("y", y, dtype=torch.float32, shape=(rows, 2 * sum(widths)), device=device)
    check_tensor("positions", positions, dtype=(torch.int32, torch.int64), shape=(rows,), device=device)
    if out is None:
        out = [(torch.empty(rows, w, dtype=torch.float32, device=device),
                torch.empty(rows, w, dtype=torch.float32, device=device)) for w in widths]
    require(isinstance(out, (list, tuple)) and len(out) == len(widths) and all(len(pair) == 2 for pair in out),
            f"out: expected {len(widths)} (kv, logits) pairs")
    for i, (pair, w) in enumerate(zip(out, widths)):
        for name, t in zip(("kv", "logits"), pair):
            check_tensor(f"out[{i}].{name}", t, dtype=torch.float32, shape=(rows, w), device=device)
            require(not overlaps(t, y), f"out[{i}].{name}: overlaps y")
    outs = [tuple(pair) for pair in out]
    if rows == 0:
        return outs
    tuning = tuning if tuning is not None else tuning_for(device)
    block = tuning.split_block
    w1 = widths[1] if len(widths) > 1 else 0
    second = (biases[1], *outs[1]) if w1 else (biases[0], *outs[0])  # unread without a second compressor
    blocks = triton.cdiv(widths[0], block) + triton.cdiv(w1, block)
    _compressor_rows_kernel[(rows, blocks)](y, positions, biases[0], *outs[0], *second, RATIO=ratio, W0=widths[0],
                                            W1=w1, BLOCK=block, num_warps=tuning.split_warps,
                                            **launch_options(device))
    return outs
