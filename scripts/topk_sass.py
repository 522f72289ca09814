"""Compiles top-k's kernels for sm_90a on a machine without a GPU and prints, per build: registers, spill bytes
(ptxas -v), and the instruction counts of its loops (cuobjdump -sass). The device-free proxy used for
`kernels/topk.py` (docs/performance.md); only the GPU decides what is faster.

    pip install --no-deps --target /tmp/t36 triton==3.6.0          # the device image's Triton (its own ptxas)
    PYTHONPATH=/tmp/t36:src python scripts/topk_sass.py [--before PATH]

The builds: the split kernel's four phases at both tilings (`SPLIT_TILING`, SELECT for k = 512 and 1024) and the
row kernel at its two row sizes. --before names a copy of an earlier kernels/topk.py, compiled the same way
(e.g. `git show 1f3e2e1:src/dsv4kv/kernels/topk.py > /tmp/topk_before.py`)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import triton

sys.path.insert(0, os.path.dirname(__file__))
from attention_sass import compile_sm90, loops, ptxas_and_sass, registers_and_spills  # noqa: E402

import dsv4kv.kernels.topk as current  # noqa: E402

POINTERS = {"scores_ptr": "*fp32", "lengths_ptr": "*i32", "ws_ptr": "*i32", "out_ptr": "*i32"}


def compile_kernel(kernel, consts: dict, warps: int) -> str:
    """'registers R, spills S B, loops [N, ...]' of `kernel` built for sm_90a with `consts`."""
    ptxas, sass = ptxas_and_sass(compile_sm90(kernel, consts, POINTERS, num_warps=warps))
    registers, spills, _ = registers_and_spills(ptxas)
    sizes = sorted((n for n, _ in loops(sass, at_least=20)), reverse=True)
    return f"registers {registers:>3}, spills {spills:>2} B, loops {sizes}"


def report(label: str, module) -> None:
    for size, (per_sm, block) in sorted(module.SPLIT_TILING.items(), key=lambda item: item[1]):
        for k in (512, 1024):
            select = max(1024, triton.next_power_of_2(k + k // 2))
            for phase in range(4):
                consts = dict(BLOCK=block, SPLITS=1024, SELECT=select, PHASE=phase)
                if "WARP_COUNTS" in module._topk_kernel.arg_names:  # as launched on a GPU
                    consts["WARP_COUNTS"] = module.WARP_COUNTS
                if "ASM" in module._topk_kernel.arg_names:
                    consts["ASM"] = module.WARP_COUNTS
                if "AHEAD" in module._topk_kernel.arg_names:
                    consts["AHEAD"] = module.FIRST_TILE_AHEAD[size]
                print(f"{label} split {block}-column tiles, k {k}, phase {'ABCD'[phase]}: "
                      f"{compile_kernel(module._topk_kernel, consts, 4 if select <= 1024 else 8)}", flush=True)
    for block, warps in ((4096, 4), (16384, 8)):  # as launched for 1 row of 4096, 64 rows of 16K
        print(f"{label} row kernel {block} columns, {warps} warps: "
              f"{compile_kernel(module._topk_row_kernel, dict(BLOCK=block, OUT_BLOCK=512), warps)}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", help="an earlier kernels/topk.py to compile alongside")
    args = ap.parse_args()
    if args.before:
        spec = importlib.util.spec_from_file_location("dsv4kv.kernels._topk_before", args.before)
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
        report("before", before)
    report("now", current)
    return 0


if __name__ == "__main__":
    sys.exit(main())
