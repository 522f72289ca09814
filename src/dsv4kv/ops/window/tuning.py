"""`kv_insert`'s tuning per GPU architecture (`ops.shared.tuning`). Importing it does not import triton."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..shared.tuning import pick

__all__ = ["WindowTuning", "TUNING", "tuning_for"]


@dataclass(frozen=True)
class WindowTuning:
    """kv_insert is bound by its bytes (1 KB of kv in, 584 B out per row at D = 512), not by its ~8.5 instructions
    per value (encode.py)."""

    # 16 rows x 512 dims over 4 warps: 64 values a thread (eight 16-B loads, four 16-B e4m3 stores), ~80 registers;
    # more rows a thread amortize the per-row work (slot, page division, the rope dims)
    kv_insert_rows: int = 16
    kv_insert_warps: int = 4
    # a launch of fewer programs takes fewer rows a program (`encode.program_rows`): 2 per SM of an H200 (132 SMs)
    spread_programs: int = 264


TUNING = MappingProxyType({"sm90": WindowTuning()})


def tuning_for(device: torch.device) -> WindowTuning:
    """The config of `device`'s architecture."""
    return pick(TUNING, device)
