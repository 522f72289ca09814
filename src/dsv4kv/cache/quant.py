"""Quantizers of the official DeepSeek-V4 numerics, in plain PyTorch (the reference).

Scale rule (all formats): `s = 2^ceil(log2(max(amax, eps) / qmax))`, a power of two, computed exactly
from the fp32 bits of `max(amax, eps) / qmax` (no `log2` rounding), so `|x / s| <= qmax` always and the
division by `s` is exact.

Non-finite input: a block whose amax is NaN or inf gets a NaN scale (ue8m0 byte 0xFF, the E8M0 NaN
code), and the whole block dequantizes to NaN. Nothing is clamped into a plausible value; other
blocks and entries are unaffected.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "FP8_MAX", "FP4_MAX", "SCALE_EPS", "pow2_scale", "ue8m0_encode", "ue8m0_decode",
    "quantize_fp8", "dequantize_fp8", "e2m1_encode", "e2m1_decode", "quantize_mxfp4", "dequantize_mxfp4",
    "hadamard_matrix", "hadamard_rotate",
]

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1
SCALE_EPS = 1e-4  # amax floor of the official quantizers
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code & 7 -> magnitude; bit 3 is the sign


def pow2_scale(amax: torch.Tensor, qmax: float, eps: float = SCALE_EPS) -> torch.Tensor:
    """Exact `2^ceil(log2(max(amax, eps) / qmax))` in fp32; NaN where amax is NaN or inf."""
    if not eps / qmax >= 2.0**-126:  # the bit trick below needs a normal fp32 ratio
        raise ValueError(f"eps / qmax must be >= 2^-126 (a normal fp32), got eps={eps}, qmax={qmax}")
    ratio = torch.clamp(amax.float(), min=eps) / qmax  # >= eps/qmax: a normal fp32, never subnormal
    bits = ratio.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    scale = ((exponent + 127).clamp(1, 254) << 23).view(torch.float32)
    return torch.where(torch.isfinite(ratio), scale, torch.full_like(scale, float("nan")))


def ue8m0_encode(scale: torch.Tensor) -> torch.Tensor:
    """fp32 power of two -> E8M0 byte (biased exponent); NaN -> 0xFF."""
    exponent = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return torch.where(torch.isnan(scale), torch.full_like(exponent, 0xFF), exponent)


def ue8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """E8M0 byte -> fp32 `2^(code - 127)`; 0xFF -> NaN, 0x00 -> 2^-127 (fp32 subnormal)."""
    code32 = code.to(torch.int32)
    scale = (code32 << 23).view(torch.float32)
    scale = torch.where(code32 == 0, torch.full_like(scale, 2.0**-127), scale)
    return torch.where(code32 == 0xFF, torch.full_like(scale, float("nan")), scale)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantization block {block}")
    return x.float().unflatten(-1, (x.shape[-1] // block, block))


def quantize_fp8(x: torch.Tensor, block: int, eps: float = SCALE_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (float8_e4m3fn [..., D], fp32 power-of-two scales [..., D // block]); RNE rounding."""
    xb = _blocks(x, block)
    scale = pow2_scale(xb.abs().amax(-1), FP8_MAX, eps)
    q = (xb / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of `quantize_fp8`: fp32 [..., D]."""
    return (_blocks(q, block) * scale.unsqueeze(-1)).flatten(-2)


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """Already-scaled fp32 values (|y| <= 6) -> e2m1 codes (uint8 0..15), round to nearest, ties to even code.

    A tie goes to the neighbour whose code is even (mantissa bit 0): `>` where the lower neighbour is
    even, `>=` where the upper one is. NaN encodes as +0 (its block's NaN scale carries the NaN).
    """
    mag = y.abs()
    code = ((mag > 0.25).to(torch.uint8) + (mag >= 0.75) + (mag > 1.25) + (mag >= 1.75)
            + (mag > 2.5) + (mag >= 3.5) + (mag > 5.0))
    return code | (torch.signbit(y) & ~torch.isnan(y)).to(torch.uint8) << 3


@functools.lru_cache(maxsize=8)
def _e2m1_table(device: torch.device) -> torch.Tensor:
    # cached per device: a host-to-device copy per call would break CUDA-graph capture
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    mag = _e2m1_table(code.device)[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def quantize_mxfp4(x: torch.Tensor, block: int = 32, eps: float = SCALE_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed e2m1 uint8 [..., D // 2], fp32 power-of-two scales [..., D // block]).

    Packing follows OCP MX / torch `float4_e2m1fn_x2`: element 2i in the low nibble, 2i+1 in the high.
    """
    xb = _blocks(x, block)
    scale = pow2_scale(xb.abs().amax(-1), FP4_MAX, eps)
    code = e2m1_encode(xb / scale.unsqueeze(-1)).flatten(-2)
    return code[..., 0::2] | (code[..., 1::2] << 4), scale


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    code = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    return (_blocks(e2m1_decode(code), block) * scale.unsqueeze(-1)).flatten(-2)


@functools.lru_cache(maxsize=8)
def _hadamard_cpu(n: int) -> torch.Tensor:
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:  # Sylvester construction: natural (not sequency) order
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h * n**-0.5).float()


@functools.lru_cache(maxsize=32)
def _hadamard_on(n: int, device: torch.device) -> torch.Tensor:
    return _hadamard_cpu(n).to(device)


def hadamard_matrix(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix [n, n] (symmetric, entries +-n^-0.5), fp32. Do not modify it: it is cached."""
    return _hadamard_on(n, torch.device(device))


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] -> x @ H_n in fp32 (n a power of two), as a fast Walsh-Hadamard butterfly: log2 n stages of
    (a + b, a - b) over adjacent pairs, each stage's sums first, then its differences; then one product with the
    matrix entry fl(n^-0.5), + 0.0 (a zero comes out +0). Every step is one IEEE fp32 operation, so the result is
    the same bits on any device, and the kernels (`kernels.encode.hadamard_rows`) compute it in the same order:
    bit for bit. The sums are exact while a row's nonzero bf16 values span less than 2^(16 - log2 n) in magnitude;
    beyond, only the smallest values' low bits round away. Rotating queries and keys alike leaves their dot products
    unchanged."""
    n = x.shape[-1]
    scale = float(hadamard_matrix(n)[0, 0])  # fl(n^-0.5); raises ValueError unless n is a power of two
    y = x.float()
    for _ in range(n.bit_length() - 1):
        pairs = y.unflatten(-1, (n // 2, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        y = torch.cat((a + b, a - b), dim=-1)
    return y * scale + 0.0
