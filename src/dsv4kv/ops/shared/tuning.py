"""How an op's tuning table is read: one frozen config per op (`ops/<op>/tuning.py`) and GPU architecture.

An op's `TUNING` maps an architecture key to its config:

    "sm90"         Hopper and later GPUs: the H100 and H200 every value was timed on
    "pre-sm90"     older CUDA GPUs (untimed)
    "interpreter"  the CPU under Triton's interpreter, where smaller tiles make the tests take every path

A device whose key has no entry takes the "sm90" config. The wrappers take `tuning=` (default: the device's
config), so a test passes `dataclasses.replace(config, ...)`; nothing is reassigned at run time. Importing this
module does not import triton.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import torch

from .common import hopper_or_later

__all__ = ["arch", "pick"]

_T = TypeVar("_T")


def arch(device: torch.device) -> str:
    """The tuning key of `device`: "sm90", "pre-sm90" or "interpreter" (any device but CUDA)."""
    if device.type != "cuda":
        return "interpreter"
    return "sm90" if hopper_or_later(device) else "pre-sm90"


def pick(table: Mapping[str, _T], device: torch.device) -> _T:
    """`table`'s config for `device`: its architecture's entry, else the "sm90" one."""
    return table.get(arch(device), table["sm90"])
