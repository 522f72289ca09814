"""Operations of the attention path. Each has a PyTorch reference; later, Triton kernels beside them."""

from .rope import apply_rope, inv_freq, rope_cos_sin

__all__ = ["apply_rope", "inv_freq", "rope_cos_sin"]
