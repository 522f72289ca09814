"""The indexer kernels' tuning per GPU architecture (`ops.shared.tuning`): the scores' (`IndexerTuning`) and the
query's (`QueryTuning`). Importing it does not import triton."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..shared.tuning import pick

__all__ = ["Tiles", "IndexerTuning", "TUNING", "tuning_for", "QueryTuning", "QUERY_TUNING", "query_tuning_for"]


@dataclass(frozen=True)
class Tiles:
    """A scores kernel's tiles: BLOCK_T rows x BLOCK_J entries, up to `max_iters` tiles a program (fewer where the
    grid would not give every SM `IndexerTuning.grid_waves` programs)."""

    block_j: int
    max_iters: int
    num_warps: int
    num_stages: int
    block_t: int = 1  # rows a program: the stacked kernel's (at most 256 // heads)


@dataclass(frozen=True)
class IndexerTuning:
    """`indexer_scores_paged`: the row (decode) kernel, the stacked (prefill) kernel and the host choices between
    their paths."""

    # a decode row's MMA is [64, D] x [D, 64 heads]; up to 16 tiles a program give a few long rows the whole GPU;
    # one stage was the faster on the H100
    row: Tiles = Tiles(block_j=64, max_iters=16, num_warps=4, num_stages=1)
    # 4 rows of 64 heads make N = 256, the widest wgmma, so a key's decode (~6 CUDA-core ops a value) is shared by
    # 256 MMA columns; 128-key tiles over 8 warps the fastest (H200); 32 tiles amortise the 4 rows' 128 KB of q
    stacked: Tiles = Tiles(block_j=128, max_iters=32, num_warps=8, num_stages=3, block_t=4)
    # the exact FP8 path's block result and running sum are both [BLOCK_J, BLOCK_T * 64] fp32: 2 rows over 4 warps
    # (255 registers; 4 rows over 8 warps and 128-key tiles were slower)
    stacked_fp8: Tiles = Tiles(block_j=64, max_iters=64, num_warps=4, num_stages=2, block_t=2)
    # the per-key-scale FP8 path has one accumulator, as the bf16 path: its N = 256 tiles (4 rows of 64 heads: a
    # verify step's rows of one request share each decoded key tile)
    stacked_key_scale: Tiles = Tiles(block_j=128, max_iters=32, num_warps=8, num_stages=2, block_t=4)
    # MXFP4 keys on FP8 MMAs where the query allows, in both kernels: faster than the bf16 MMAs at every grid timed
    # (docs/performance.md); False takes the bf16 MMAs, as GPUs before sm_90 do
    fp8_mma: bool = True
    # the FP8 path's MXFP4 keys under one power-of-two scale per key (their largest block scale; `keys.
    # mxfp4_key_scale_keys`): one K = D MMA and one multiply per key where the exact path pays D/32 MMAs from zero and
    # D/32 scaled adds per (key, row, head). Scores within the tolerance of ops/indexer/kernel.py's docstring, not bit
    # for bit; False: the exact per-block path (scores the bf16 path's up to fp32 summation order)
    fp8_key_scale: bool = True
    # the row kernel's FP8 build takes 167 registers uncapped (sm_90a): 3 programs an SM; capped, no spills and 4
    fp8_max_registers: int = 128
    # where a page holds whole tiles, the FP8 path addresses a tile from its page and reads its block id and scale
    # words a tile ahead (10% less time at batch 64, H200); False addresses each entry, as on other pages
    page_tiles: bool = True
    # programs an SM the row kernel's chunks aim for (latency hiding: a program's tiles run one after another)
    grid_waves: int = 3
    # the stacked kernel when requests average this many rows: a decode row costs it a BLOCK_T times wider MMA
    stack_min_rows_per_request: int = 2
    # top-k digit counts of rows wider than this (their capacity) go through a scratch row a program first: many
    # programs of one long row would meet at its few busy bins
    digit_count_scratch_above: int = 65536
    # scores a tile of the digit count: at least 32 lanes x warps, so that no lane is replicated (counted twice)
    count_block: int = 1024
    # elements a -inf store tile (`fill=True`): 16 a thread at 4 warps, four 16-B stores
    fill_elems: int = 2048


TUNING = MappingProxyType({"sm90": IndexerTuning()})


def tuning_for(device: torch.device) -> IndexerTuning:
    """The scores' config of `device`'s architecture."""
    return pick(TUNING, device)


@dataclass(frozen=True)
class QueryTuning:
    """`indexer_query_rows` / `indexer_query_and_weights`: one program per (row, block of heads)."""

    block_h: int = 16  # heads a program: [16, 128] through the butterfly (7 shuffles of the tile via shared memory)
    warps: int = 4
    # a small launch (a decode step's rows) takes fewer heads a program, down to this many: its time is one
    # program's chain (the butterfly's exchanges, the quantizers' reductions), shorter with fewer values a thread;
    # a prefill chunk keeps the whole tile, faster there
    min_block_h: int = 4
    # ... while the launch would have fewer programs than this (`encode.program_rows`): 2 per SM of an H200
    spread_programs: int = 264


QUERY_TUNING = MappingProxyType({"sm90": QueryTuning()})


def query_tuning_for(device: torch.device) -> QueryTuning:
    """The query's config of `device`'s architecture."""
    return pick(QUERY_TUNING, device)
