"""`sparse_attention_paged`'s tuning per GPU architecture (`ops.shared.tuning`). Importing it does not import
triton."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..shared.tuning import pick

__all__ = ["AttentionTuning", "TUNING", "tuning_for"]


@dataclass(frozen=True)
class AttentionTuning:
    """A program holds up to `block_h` heads of one row, the M dimension of both tensor-core products, so each key
    tile is read and decoded once per head block; its fp32 accumulator [64, D] is split over 2 warpgroups (128
    registers a thread at D = 512). The split and tile choice from fixed shapes is `kernel._config`'s."""

    block_h: int = 64  # most heads a program
    small_block_h: int = 16  # where even the split grid leaves most SMs idle (CSA batch 1): more, shorter programs
    block_n: int = 32  # keys an online-softmax block in small grids (split rows); splits start on these boundaries
    large_block_n: int = 64  # ... once the rows alone fill a third of the SMs (CSA batch 128)
    num_stages: int = 1  # 2 stages were slower at every decode shape (more registers, spills)
    # fewest key blocks a split: its fixed cost (q load, partial write, its share of the merge) must not dominate
    min_split_blocks: int = 2
    small_min_split_blocks: int = 1  # with `small_block_h` programs one block a split was the faster
    merge_elems: int = 8192  # partial values a merge program holds at once: 64 fp32 registers a thread at 4 warps
    # splits a merge program reads at once: the smallest of these that holds a launch's splits (else the largest,
    # chunk after chunk), so a program has one load of its partials in flight; each value is a compilation
    merge_chunks: tuple[int, ...] = (2, 16, 32, 64, 128, 256)
    merge_two_warps: int = 1024  # a merge tile of at most this many values runs on 2 warps (batch 64's), else on 4


TUNING = MappingProxyType({"sm90": AttentionTuning()})


def tuning_for(device: torch.device) -> AttentionTuning:
    """The config of `device`'s architecture."""
    return pick(TUNING, device)
