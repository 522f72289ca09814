"""`rope_rows`' tuning per GPU architecture (`ops.shared.tuning`). Importing it does not import triton."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..shared.tuning import pick

__all__ = ["RopeTuning", "TUNING", "tuning_for"]


@dataclass(frozen=True)
class RopeTuning:
    """(heads a program, warps) of `rope_rows`: memory- or launch-bound, so the tiles aim at 16-32 values a thread
    (16-B vector accesses) and many small programs."""

    heads: tuple[int, int] = (8, 4)  # whole heads: [8, 512]
    rope_dims: tuple[int, int] = (16, 2)  # the rope dims only (in place, or into an out of rope dims): [16, 64]


TUNING = MappingProxyType({"sm90": RopeTuning()})


def tuning_for(device: torch.device) -> RopeTuning:
    """The config of `device`'s architecture."""
    return pick(TUNING, device)
