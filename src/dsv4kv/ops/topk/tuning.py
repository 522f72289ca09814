"""`topk_indices`' tuning per GPU architecture (`ops.shared.tuning`). Importing it does not import triton."""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

import torch

from ..shared.tuning import pick

__all__ = ["SplitTiling", "TopkTuning", "TUNING", "tuning_for"]


@dataclass(frozen=True)
class SplitTiling:
    """The split kernel's tiling: S = programs_per_sm x SMs / R chunks a row (the interpreter counts as one SM), so a
    long decode row still fills the GPU; a workspace's size depends on S."""

    programs_per_sm: int  # programs a phase aims for, per SM
    block: int  # columns a tile (at least 32 x warps: `keys.count_digits`)
    # phases A-C load a chunk's first tile before their histogram reads, so its latency overlaps theirs: faster with
    # 2 programs an SM; with 4 the other programs hide it and the tile held across the reads costs registers
    first_tile_ahead: bool


@dataclass(frozen=True)
class TopkTuning:
    # one program a row (the row in registers) for rows of up to row_max_cols columns, or row_max_cols_many with at
    # least row_many rows; the split radix select beyond: one SM a row is slow for a long lone row
    row_max_cols: int = 4096
    row_max_cols_many: int = 16384
    row_many: int = 64
    # the row kernel's keys a thread below / from row_many rows: fewer warps a row when the rows fill the GPU
    row_keys_per_thread: tuple[int, int] = (32, 64)
    row_block: int = 4096  # the row kernel's smallest row tile: shorter rows share its compilation
    # below / from big_from scores; two tilings, so two compilations (the tile width and SPLITS)
    small: SplitTiling = SplitTiling(programs_per_sm=2, block=1024, first_tile_ahead=True)
    big: SplitTiling = SplitTiling(programs_per_sm=4, block=2048, first_tile_ahead=False)
    big_from: int = 1 << 20
    # buffered candidates phase D holds in registers: ~k plus one fine bin must fit (1.5 k up to a power of two,
    # within these bounds; more take three passes over the buffer)
    select_min: int = 1024
    select_max: int = 4096


# the interpreter: few programs and small tiles and selects, so that the tests' rows split (S > 1) and phase D takes
# both its register path and its looped one
TUNING = MappingProxyType({
    "sm90": TopkTuning(),
    "interpreter": replace(TopkTuning(), small=SplitTiling(6, 64, True), big=SplitTiling(6, 64, False), select_min=64,
                           select_max=64),
})


def tuning_for(device: torch.device) -> TopkTuning:
    """The config of `device`'s architecture."""
    return pick(TUNING, device)


def default() -> TopkTuning:
    """The config whose row kernel thresholds every architecture shares: for host questions asked without a device
    (`takes_first_digit_counts`)."""
    return TUNING["sm90"]
