"""Compiles the sparse-attention kernel for sm_90a on a machine without a GPU and prints, per tile: registers,
spill bytes (ptxas -v), shared memory, and the instruction count and mix of the key loop (cuobjdump -sass).

    pip install --no-deps --target /tmp/t36 triton==3.6.0          # the device image's Triton (its own ptxas)
    PYTHONPATH=/tmp/t36:src python scripts/attention_sass.py [--module dsv4kv.kernels.attention] [--mix 12]

The launch is V4-Flash decode (head_dim 512, 448 FP8 nope dims, window 128, CSA picks or HCA entries, bf16 q),
with the alignment hints a real launch gets (pointers and page sizes divisible by 16), so the loads vectorize as
on the device. A proxy for the device, not a timing: fewer loop instructions and no spills have gone with faster
kernels (docs/performance.md, issue 11), but only `scripts/attention_variants.py` on the GPU decides."""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

POINTERS = {"p_q": "*bf16", "p_sinks": "*fp32", "p_out": "*fp32", "p_ws": "*fp32", "p_positions": "*i32",
            "p_token_request": "*i32", "p_request_slots": "*i32", "p_query_start": "*i32", "p_seq_lens": "*i32",
            "p_block_table": "*i32", "p_step": "*u8", "p_win": "*u8", "p_ent": "*u8", "p_picks": "*i32",
            "p_scratch": "*fp32", "p_cos": "*fp32", "p_sin": "*fp32", "p_q_rope": "*bf16"}
DIVISIBLE_BY_16 = {"win_page_bytes", "ent_page_bytes", "n_picks", "H", "bt_stride", "ent_per_page", "page_tokens"}
TILES = [(64, 64, 8), (64, 32, 8), (16, 32, 4)]  # (BLOCK_H, BLOCK_N, num_warps) of `attention._config`


def compile_sm90(kernel, consts: dict, pointers: dict, *, divisible=(), floats=(), **options):
    """`kernel` compiled for sm_90a as a launch would specialize it: `consts` as constexprs, the named pointers with
    their types and 16-byte alignment, runtime ints as i32 (fp32 where named in `floats`), those in `divisible`
    marked divisible by 16. options: num_warps, num_stages, maxnreg."""
    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n in floats else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in pointers or n in divisible}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, attrs=attrs,
                                       constexprs={(names.index(n),): v for n, v in consts.items() if n in names})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def registers_and_spills(ptxas: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from ptxas -v's report."""
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas).groups()
    return int(re.search(r"Used (\d+) registers", ptxas).group(1)), int(stores), int(loads)


def compile_kernel(kernel, block_h: int, block_n: int, warps: int, csa: bool, scratch: bool):
    """The kernel compiled for sm_90a (runtime ints as i32; constexprs of a V4-Flash CSA or HCA launch; scratch:
    the logits through memory, `attention.QK_SCRATCH`)."""
    consts = dict(RATIO=4 if csa else 128, ENT_PER_PAGE=256 if csa else 8, WINDOW=128, D=512, NOPE=448,
                  QK_SCRATCH=scratch, DATA_BYTES=576, SCALE_BYTES=8, ENTRIES=2 if csa else 1, Q_SPLIT=False, DOT_F32=False,
                  BLOCK_H=block_h, BLOCK_N=block_n, SPLIT=False, ROPE_HALF=0, Q_ROPE_DIMS=0)
    return compile_sm90(kernel, consts, POINTERS, divisible=DIVISIBLE_BY_16, floats={"qk_scale"}, num_warps=warps,
                        num_stages=1, enable_fp_fusion=False)  # as launched


def tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def ptxas_and_sass(compiled) -> tuple[str, str]:
    """(ptxas -v's report, cuobjdump -sass's listing) of a kernel compiled for sm_90a."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        open(ptx, "w").write(compiled.asm["ptx"])
        open(cubin, "wb").write(compiled.asm["cubin"])
        ptxas = subprocess.run([tool("ptxas"), "-v", "--gpu-name", "sm_90a", ptx, "-o", os.devnull],
                               capture_output=True, text=True).stderr
        sass = subprocess.run([tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    return ptxas, sass


def loops(sass: str, at_least: int = 100) -> list[tuple[int, collections.Counter]]:
    """(instructions, opcode counts) of every backward branch's body of at least `at_least` instructions."""
    code = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]+)\*/\s+([^;]*);", sass)]
    found = []
    for addr, text in code:
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for a, t in code if lo <= a <= addr)
            if sum(ops.values()) >= at_least:
                found.append((sum(ops.values()), ops))
    return found


def loop_mix(sass: str) -> tuple[int, collections.Counter]:
    """Instructions of the longest backward branch's body (the key loop) and their opcodes."""
    return max(loops(sass, at_least=1), key=lambda loop: loop[0], default=(0, collections.Counter()))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--module", default="dsv4kv.kernels.attention")
    ap.add_argument("--mix", type=int, default=0, help="also print the loop's N most frequent opcodes")
    ap.add_argument("--scratch", action="store_true", help="the logits through memory (attention.QK_SCRATCH)")
    args = ap.parse_args()
    kernel = importlib.import_module(args.module)._sparse_attention_kernel
    for csa in (True, False):
        for block_h, block_n, warps in TILES:
            compiled = compile_kernel(kernel, block_h, block_n, warps, csa, args.scratch)
            ptxas, sass = ptxas_and_sass(compiled)
            regs, *spills = registers_and_spills(ptxas)
            count, ops = loop_mix(sass)
            print(f"{'CSA' if csa else 'HCA'} heads {block_h} keys {block_n} warps {warps}: {regs} registers, "
                  f"spill stores / loads {spills[0]} / {spills[1]} B, shared {compiled.metadata.shared} B, "
                  f"key loop {count} instructions")
            if args.mix:
                print("   ", ", ".join(f"{op} {n}" for op, n in ops.most_common(args.mix)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
