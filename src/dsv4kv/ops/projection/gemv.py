"""The layer's bf16 projections of one row (decode at batch 1): `gemv_rows(x, weight)` = x @ weight.T.

With one row a projection reads its weight once and does almost no arithmetic: its time is the weight's bytes over
the rate at which one kernel reads them. On these shapes cuBLAS reads them slower than this kernel does, which comes
near a plain read of the weight (docs/performance.md, "The bench's L2 flush; one-row projections").

Work split. One program owns BLOCK_N weight rows (output columns) and walks K in BLOCK_K tiles; each lane keeps fp32
partial sums of the exact products bf16 x * bf16 w, which `tl.sum` then adds across the tile. `groups` serves the
grouped o_a projection: weight rows [g * N / groups, (g + 1) * N / groups) read x's columns [g * K, (g + 1) * K), and
the output is [1, N] in the groups' order (o_b's input layout).

Numerics. The products are exact and the sums fp32, rounded once to bf16: the result differs from cuBLAS's only in
summation order, so a bf16 output is one unit away from torch's in a small fraction of values (tests bound it
against an fp64 reference).
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

__all__ = ["gemv_rows", "MAX_ROWS"]

MAX_ROWS = 1  # the rows the kernel computes (batch-1 decode, the latency case); steps of more take torch's GEMM


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, group_rows, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    wait_for_prior_grids()
    n0 = tl.program_id(0) * BLOCK_N
    o_n = n0 + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    p_w = w_ptr + o_n.to(tl.int64)[:, None] * K
    p_x = x_ptr + (n0 // group_rows).to(tl.int64) * K  # this block's group of x
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_N and EVEN_K:  # unmasked loads
            b_w = tl.load(p_w + (k + o_k)[None, :])
            b_x = tl.load(p_x + k + o_k)
        else:
            m_k = k + o_k < K
            b_w = tl.load(p_w + (k + o_k)[None, :], mask=(o_n < N)[:, None] & m_k[None, :], other=0.0)
            b_x = tl.load(p_x + k + o_k, mask=m_k, other=0.0)
        acc += b_w.to(tl.float32) * b_x.to(tl.float32)[None, :]  # exact products, fp32 sums per lane
    # rounded to nearest even by bits: the interpreter's fp32 -> bf16 cast truncates
    tl.store(out_ptr + o_n, round_bf16(tl.sum(acc, axis=1)).to(tl.bfloat16), mask=o_n < N)


def _block_n(k: int, groups: int, group_rows: int, tuning: ProjectionTuning) -> int:
    """Weight rows per program (`gemv_block_n`, by K); with groups, halved until it divides a group (a program's
    rows read one group of x). Without groups a last partial block is masked."""
    block = tuning.gemv_block_n[k > tuning.gemv_long_k]
    while groups > 1 and group_rows % block:
        block //= 2
    return block


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, *, groups: int = 1,
              out: torch.Tensor | None = None, tuning: ProjectionTuning | None = None) -> torch.Tensor:
    """bf16 x [M, groups * K] (M <= MAX_ROWS = 1) and bf16 weight [N, K] (N a multiple of groups), contiguous -> bf16
    [M, N]: out[m, n] = sum_k x[m, g(n) * K + k] * weight[n, k], g(n) = n // (N / groups), in fp32
    (`torch.mm(x, weight.t())` for groups = 1; for more, torch's grouped o_a, `DSV4Attention._grouped_o_a`).
    out: bf16 [M, N], contiguous, overlapping neither input. tuning: the tiles (default: the device's)."""
    require(isinstance(groups, int) and not isinstance(groups, bool) and groups >= 1,
            f"groups: expected an int >= 1, got {groups!r}")
    require(isinstance(weight, torch.Tensor) and weight.dim() == 2, "weight: expected a bf16 tensor [N, K]")
    n, k = weight.shape
    require(isinstance(x, torch.Tensor) and x.dim() == 2, "x: expected a bf16 tensor [M, groups * K]")
    rows = x.shape[0]
    require(rows <= MAX_ROWS, f"x: {rows} rows, gemv_rows takes one (a GEMM serves more)")
    require(n % groups == 0, f"weight: {n} rows do not split into {groups} groups")
    check_tensor("weight", weight, dtype=torch.bfloat16, shape=(n, k), device=weight.device)
    check_tensor("x", x, dtype=torch.bfloat16, shape=(rows, groups * k), device=weight.device)
    if out is None:
        out = torch.empty(rows, n, dtype=torch.bfloat16, device=x.device)
    check_tensor("out", out, dtype=torch.bfloat16, shape=(rows, n), device=x.device)
    require(not overlaps(out, x) and not overlaps(out, weight), "out: overlaps x or weight")
    if rows == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    tuning = tuning if tuning is not None else tuning_for(x.device)
    group_rows = n // groups
    block_n, block_k = _block_n(k, groups, group_rows, tuning), tuning.gemv_block_k
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, n, k, group_rows, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_N=n % block_n == 0,
        EVEN_K=k % block_k == 0, num_warps=tuning.gemv_warps, **launch_options(x.device))
    return out
