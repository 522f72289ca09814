"""Interleaved RoPE over the last `rope.dim` dims of a head (pairs 2i, 2i+1), with YaRN on compressed layers.

Frequencies follow transformers' arithmetic (`DeepseekV4RotaryEmbedding`, `_compute_yarn_parameters` with
truncated correction range) so the oracle comparison is exact; cos/sin stay fp32 as in the official model
(transformers rounds them to the activation dtype first, which only matters for bf16 inputs).
"""

from __future__ import annotations

import functools
import math

import torch

from ...geometry import RopeSpec

__all__ = ["inv_freq", "rope_cos_sin", "apply_rope", "rotate_pairs"]


@functools.lru_cache(maxsize=16)
def _inv_freq_cpu(rope: RopeSpec) -> torch.Tensor:
    dim, base = rope.dim, rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.yarn is None:
        return 1.0 / pos_freqs
    y = rope.yarn

    def correction_dim(rotations: float) -> float:
        return dim * math.log(y.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(y.beta_fast)), 0)
    high = min(math.ceil(correction_dim(y.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency (high-frequency pairs), 0: interpolate
    return (1.0 / (y.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


@functools.lru_cache(maxsize=64)
def _inv_freq_on(rope: RopeSpec, device: torch.device) -> torch.Tensor:
    return _inv_freq_cpu(rope).to(device)


def inv_freq(rope: RopeSpec, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 [rope.dim // 2]: one angular frequency per interleaved pair. Cached per device, so no host-to-device
    copy happens after the first call (a CUDA graph capture forbids one). Do not modify it."""
    return _inv_freq_on(rope, torch.device(device))


def rope_cos_sin(rope: RopeSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] (int) -> cos, sin fp32 [..., rope.dim // 2], scaled by YaRN's attention factor (1 for V4)."""
    freqs = positions.float()[..., None] * inv_freq(rope, positions.device)
    scale = rope.yarn.attention_factor if rope.yarn is not None else 1.0
    return freqs.cos() * scale, freqs.sin() * scale


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rope: RopeSpec, *, inverse: bool = False) -> torch.Tensor:
    """Rotate the last `rope.dim` dims of x [N, ..., D] at positions [N]; `inverse` rotates by -angle.

    Computed in fp32, returned in x's dtype; the leading (nope) dims are returned unchanged.
    """
    if positions.dim() != 1 or x.shape[0] != positions.shape[0] or x.shape[-1] < rope.dim:
        raise ValueError(f"apply_rope: expected x [N, ..., >={rope.dim}] and positions [N], "
                         f"got {list(x.shape)} and {list(positions.shape)}")
    cos, sin = rope_cos_sin(rope, positions)
    return rotate_pairs(x, cos, -sin if inverse else sin)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` from its tables: the last 2 * R dims of x [N, ..., D] rotated pair by pair by cos, sin fp32
    [N, R] (`rope_cos_sin`'s, or a kernel's own tables), in fp32, returned in x's dtype."""
    half = cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)  # broadcast over head dims
    cos, sin = cos.view(shape), sin.view(shape)
    pairs = x[..., -2 * half:].float().unflatten(-1, (half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-2 * half], rotated.to(x.dtype)), dim=-1)
