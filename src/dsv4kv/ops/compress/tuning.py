"""`compress_insert`'s tuning per GPU architecture (`ops.shared.tuning`). Importing it does not import triton."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..shared.tuning import pick

__all__ = ["CompressTile", "PoolTile", "CompressTuning", "TUNING", "tuning_for"]


@dataclass(frozen=True)
class CompressTile:
    """A one-launch tile: the kernel reads each entry's rows once, bound by that read in prefill and by latency in
    decode; a chunk's loads are issued at once, so a chunk is what a program has in flight. Tiles are [rows,
    entries, d] with 16-B vectors along d; warps fill d first, then entries, then rows."""

    entries: int  # entries a program (fewer for small launches, `encode.program_rows`)
    chunk: int  # rows pooled at once (halved until it divides the entry's rows)
    warps: int


@dataclass(frozen=True)
class PoolTile:
    """A program of HCA's pooling launch: one entry's rows over a slice of its channels."""

    channels: int
    chunk: int  # rows pooled at once
    warps: int
    max_registers: int | None = None  # the launch's register cap (GPU only)


@dataclass(frozen=True)
class CompressTuning:
    # d 512, 8 rows: [8, 1, 512] over 4 warps (d spans them exactly): 2 x 32 values a thread, row sums in registers
    csa_main: CompressTile = CompressTile(entries=1, chunk=8, warps=4)
    # d 128 (one warp spans d): 4 entries over 4 warps, the same 2 x 32 values a thread, 1/4 of the work per entry
    csa_index: CompressTile = CompressTile(entries=4, chunk=8, warps=4)
    # HCA pools in a first launch split over channels, so that one entry's 512 KB of rows spread over many SMs
    # instead of one (docs/performance.md); a second launch norms, ropes and encodes
    hca_entries: int = 1  # entries a program of the second launch
    pooled_warps: int = 4  # its warps: the fastest of 2 / 4 / 8 / 16 (H100)
    # up to `few_entries` entries: 1-warp programs of 4 channels holding all 128 rows, their row sums within the
    # warp, so a lone entry's read spreads over 128 programs
    pool_few: PoolTile = PoolTile(channels=4, chunk=128, warps=1)
    few_entries: int = 8  # past 8 entries the few tile was equal or slower
    # more: 4-warp programs of 32 channels, capped at 64 registers (no spills) so 8 fit an SM and batch 64's 1024
    # programs run in one wave
    pool_many: PoolTile = PoolTile(channels=32, chunk=64, warps=4, max_registers=64)
    # a launch of fewer programs takes fewer entries a program (`encode.program_rows`): 2 per SM of an H200
    spread_programs: int = 264


TUNING = MappingProxyType({"sm90": CompressTuning()})


def tuning_for(device: torch.device) -> CompressTuning:
    """The config of `device`'s architecture."""
    return pick(TUNING, device)
