"""Compiles the indexer's row (decode) kernel for sm_90a on a machine without a GPU and prints, per build: registers,
spill bytes (ptxas -v), shared memory, and the instruction count and mix of the key loops (cuobjdump -sass). The
device-free proxy used for `kernels/indexer.py` (docs/performance.md).

    pip install --no-deps --target /tmp/t36 triton==3.6.0          # the device image's Triton (its own ptxas)
    PYTHONPATH=/tmp/t36:src python scripts/indexer_sass.py [--mix 12]

The builds: the bf16 path with its MXFP4 decode through fp32 and by bit moves (`BF16_BITS`), the FP8 MMA path, and the
FP8 path under its register cap (`FP8_MAX_REGISTERS`, as launched), at the default stage count (the FP8 builds also
hold the bf16 loop, their fallback, with the bit-move decode). The launch is V4-Flash decode (64 heads, head dim 128,
MXFP4 keys of 68 B, 256 entries a page, so the FP8 path addresses its tiles by page: `PAGE_TILES`, counting the
top-k's first digit after its tiles: `digit_counts`, one more loop) with the alignment hints a real launch gets. Fewer
loop instructions did not make this kernel faster by themselves (its time is a latency-bound tile chain at 16 warps
per SM; ncu in docs/performance.md): only the GPU decides."""

from __future__ import annotations

import argparse
import os
import sys

import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from attention_sass import compile_sm90, loops, ptxas_and_sass, registers_and_spills  # noqa: E402

from dsv4kv.kernels import indexer  # noqa: E402

POINTERS = {"q_ptr": "*fp32", "w_ptr": "*fp32", "positions_ptr": "*i32", "token_request_ptr": "*i32",
            "request_slots_ptr": "*i32", "block_table_ptr": "*i32", "pool_ptr": "*u8", "out_ptr": "*fp32",
            "q8_ptr": "*u8", "q8_scale_ptr": "*fp32", "counts_ptr": "*i32", "scratch_ptr": "*i32"}
# as a V4-Flash launch specializes them
DIVISIBLE_BY_16 = {"num_heads", "num_entries", "table_stride", "chunk", "counts_stride"}


def compile_row_kernel(fp8: bool, stages: int, block_j: int = 64, warps: int = 4, maxnreg: int | None = None,
                       bits: bool = True, page_tiles: bool | None = None, count: bool = True):
    kernel = indexer._indexer_scores_kernel
    if page_tiles is None:  # as the launch decides it for 256-entry pages
        page_tiles = fp8 and indexer.PAGE_TILES and 256 % block_j == 0
    consts = dict(FORMAT=indexer._MXFP4, RATIO=4, D=128, P=256, PAGE_BYTES=256 * 68, DATA_BYTES=64, SCALE_BYTES=4,
                  BLOCK_H=64, BLOCK_J=block_j, FILL_J=block_j, DOT=tl.bfloat16, FILL=False, MMA8=fp8, ASM=True,
                  BITS=bits, PAGE_TILES=page_tiles, COUNT=count, SCRATCH=False)
    return compile_sm90(kernel, consts, POINTERS, divisible=DIVISIBLE_BY_16, floats={"score_scale"}, num_warps=warps,
                        num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mix", type=int, default=0, help="also print each loop's N most frequent opcodes")
    args = ap.parse_args()
    stages = indexer._ROW_TILES["num_stages"]
    # the default stage count; the FP8 path without and with its register cap (the launch applies the cap)
    for fp8, cap, bits in ((False, None, False), (False, None, True), (True, None, True),
                           (True, indexer.FP8_MAX_REGISTERS, True)):
        compiled = compile_row_kernel(fp8, stages, maxnreg=cap, bits=bits)
        ptxas, sass = ptxas_and_sass(compiled)
        regs, spills, _ = registers_and_spills(ptxas)
        found = loops(sass)  # with the FP8 path the kernel holds both key loops (the bf16 one is the fallback)
        decode = "bit moves" if bits else "through fp32"
        print(f"{'FP8 MMA' if fp8 else 'bf16'} path (bf16 decode {decode}){f', maxnreg {cap}' if cap else ''}, "
              f"{stages} stage(s): "
              f"{regs} registers, spill stores {spills} B, shared {compiled.metadata.shared} B, key loops "
              f"{[n for n, _ in found]} instructions")
        for _, ops in found if args.mix else ():
            print("   ", ", ".join(f"{op} {n}" for op, n in ops.most_common(args.mix)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
