"""The projection glue's tuning per GPU architecture (`ops.shared.tuning`): `rms_norm_rows`, `compressor_rows`,
`gemv_rows`. Importing it does not import triton."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..shared.tuning import pick

__all__ = ["ProjectionTuning", "TUNING", "tuning_for"]


@dataclass(frozen=True)
class ProjectionTuning:
    # values an rms_norm_rows program takes (32 a thread at 4 warps), or one row if D is wider: the same tile at any
    # row count, so one compilation per (D, weighted) serves every step
    norm_values: int = 4096
    norm_warps: int = 4
    split_block: int = 256  # columns a compressor_rows program copies (a row of one compressor)
    split_warps: int = 2
    # gemv_rows: weight rows a program for short rows (K <= gemv_long_k) / long ones, the fastest of 4 / 8 / 16 / 32
    # (q_b and the indexer's q_b at 8, q_a and o_b at 4)
    gemv_block_n: tuple[int, int] = (8, 4)
    gemv_long_k: int = 2048
    gemv_block_k: int = 128  # K a step: each lane keeps fp32 partial sums over the tile
    gemv_warps: int = 8


TUNING = MappingProxyType({"sm90": ProjectionTuning()})


def tuning_for(device: torch.device) -> ProjectionTuning:
    """The config of `device`'s architecture."""
    return pick(TUNING, device)
