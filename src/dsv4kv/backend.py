"""Where the Triton kernels can run. Importing this module does not import triton (an optional dependency)."""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["interpreted", "kernels_can_run"]


def interpreted() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET=1, read when the kernels were decorated)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernels_can_run(device: torch.device) -> bool:
    """Triton is installed and the kernels can run on `device`: CUDA, or the CPU under the interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreted())
