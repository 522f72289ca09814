"""Argument checks: one home for every public entry's validation (ValueError naming the argument)."""

from __future__ import annotations

import numbers

import torch

from .backend import kernels_can_run

__all__ = ["positive_int", "require", "check_float", "check_tensor"]


def positive_int(name: str, value) -> int:
    """`value` as an int if it is a positive integer (Python or numpy, not bool); else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_float(name: str, x: torch.Tensor, shape: tuple[int | None, ...], device: torch.device) -> None:
    """x must be a floating tensor of `shape` (None = any size) on `device`."""
    ok = (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() == len(shape)
          and all(want is None or got == want for got, want in zip(x.shape, shape)))
    wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    require(ok, f"{name}: expected a float tensor {wanted}, got "
                f"{f'{x.dtype} {list(x.shape)}' if isinstance(x, torch.Tensor) else type(x).__name__}")
    require(x.device == device, f"{name}: on {x.device}, the cache is on {device}")


def check_tensor(name: str, x, *, dtype: torch.dtype | tuple[torch.dtype, ...], shape: tuple[int | None, ...],
                 device: torch.device, contiguous: bool = True) -> None:
    """x: a tensor of `dtype` (or one of them), `shape` (None = any size), on `device`, contiguous."""
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    require(isinstance(x, torch.Tensor), f"{name}: expected a tensor, got {type(x).__name__}")
    wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    require(x.dtype in dtypes and x.dim() == len(shape) and all(w is None or g == w for g, w in zip(x.shape, shape)),
            f"{name}: expected {'/'.join(str(d) for d in dtypes)} {wanted}, got {x.dtype} {list(x.shape)}")
    require(x.device == device, f"{name}: on {x.device}, expected {device}")
    require(not contiguous or x.is_contiguous(), f"{name}: must be contiguous (strides {x.stride()})")
    require(kernels_can_run(x.device), f"{name}: Triton kernels need a CUDA tensor (or TRITON_INTERPRET=1 on the "
                                       f"CPU), got one on {x.device}")


