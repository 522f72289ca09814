"""What bounds the indexer's row kernel (FP8 MMA path): its time with parts of its work taken out. Timing only: the
patched modes' scores are wrong by design.

    python scripts/indexer_bound_probe.py {base|noscale|noconv|both}     # one mode per process (patched before compiling)

noscale: each scale block's MMA result added without its key scale (Triton then chains the four MMAs into one
accumulator); noconv: the key bytes fed to the MMA without the e2m1 -> e4m3 bit moves; both. Each mode times the
request's block table and a 'hot' one (every tile read from 8 pages, so from L2), at batch 1 / 1M, 8 / 128K and
64 / 128K. Results: docs/performance.md, "What bounds the MXFP4 indexer" (nineteenth session)."""
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "scripts")
from bench_variants import DEVICE, hot_plan, indexer_decode_case  # noqa: E402
import dsv4kv.kernels.indexer as K  # noqa: E402
from dsv4kv.bench.timing import time_cuda  # noqa: E402

mode = sys.argv[1]


@triton.jit
def _mma_patched(b_byte, code, b_q8, acc, BLOCK_J: tl.constexpr, ASM: tl.constexpr, SCALE: tl.constexpr,
                 CONV: tl.constexpr):
    if CONV:
        b_lo, b_hi = K._e2m1_e4m3(b_byte, ASM)
    else:
        b_lo, b_hi = b_byte, b_byte ^ 0x11
    b_k = tl.reshape(tl.permute(tl.join(b_lo, b_hi), (0, 2, 1)), (BLOCK_J, 32)).to(tl.float8e4nv, bitcast=True)
    part = tl.dot(b_k, b_q8)
    if SCALE:
        b_sc = K._ue8m0_times_64(code.to(tl.int32))
        return acc + part * b_sc[:, None]
    else:
        return acc + part


SCALE_C = tl.constexpr(mode in ("base", "noconv"))
CONV_C = tl.constexpr(mode in ("base", "noscale"))


@triton.jit
def _mma(b_byte, code, b_q8, acc, BLOCK_J: tl.constexpr, ASM: tl.constexpr):
    return _mma_patched(b_byte, code, b_q8, acc, BLOCK_J, ASM, SCALE_C, CONV_C)


if mode != "base":
    K._mxfp4_block_mma = _mma

for batch, history in ((1, (1 << 20) - 1), (8, 131071), (64, 131071)):
    c = indexer_decode_case(batch, history)
    for name, p in (("normal", c.plan), ("hot", hot_plan(c.plan))):
        def run(p=p):
            return K.indexer_scores_paged(c.q, c.w, p, c.pool, c.layout, ratio=4, page_tokens=c.page_tokens,
                                          out=c.out, q_fp8=c.q_fp8)
        run()
        torch.cuda.synchronize()
        ts = [time_cuda(run, device=DEVICE, runs=30).median_us for _ in range(3)]
        mb = batch * c.out.shape[1] * 68 / 1e6
        print(f"mode {mode:8s} batch {batch:3d} ctx {history + 1:8d} {name:6s}: {sorted(ts)[1]:7.1f} us "
              f"({min(ts):.1f}-{max(ts):.1f}; {mb:.1f} MB)", flush=True)
    del c
    torch.cuda.empty_cache()
