"""FP8 wgmma throughput per SM at the indexer's shapes (Gluon; GPU only): each CTA runs 256 x 4 MMAs of [64, 32] x
[32, N] (A from registers or shared memory), either chained into one accumulator or, as the indexer does, each from
zero, waited and added in fp32; 1, 2 or 4 CTAs per SM. Prints cycles per MMA per SM and the fraction of the dense FP8
rate (4096 MAC / cycle / SM on Hopper; the run logged in docs/device/2026-11-27-fp8-mma-rate-h100.log divided by
2048, so its percentages are twice the true ones).

    PYTHONPATH=src python scripts/fp8_mma_rate.py"""
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _mma_loop(out_ptr, niter, N: gl.constexpr, A_REG: gl.constexpr, SYNC_EACH: gl.constexpr):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 32])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    BL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[16, 2], warps_per_cta=[4, 1],
                                        order=[1, 0])
    SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=8, rank=2)
    o_r = gl.arange(0, 64, layout=gl.SliceLayout(1, BL))
    o_c = gl.arange(0, 32, layout=gl.SliceLayout(0, BL))
    av = ((o_r[:, None] + o_c[None, :]) % 7 + 0x30).to(gl.uint8).to(gl.float8e4nv, bitcast=True)
    a_s = gl.allocate_shared_memory(gl.float8e4nv, [64, 32], SL)
    a_s.store(av)
    o_n = gl.arange(0, N, layout=gl.SliceLayout(1, BL))
    bv = ((o_n[:, None] * 3 + o_c[None, :]) % 5 + 0x30).to(gl.uint8).to(gl.float8e4nv, bitcast=True)
    b_s = gl.allocate_shared_memory(gl.float8e4nv, [N, 32], SL)
    b_s.store(bv)
    fence_async_shared()
    gl.thread_barrier()
    b = b_s.permute((1, 0))
    if A_REG:
        a = a_s.load(A_L)
    else:
        a = a_s
    acc = gl.zeros([64, N], gl.float32, MMA)
    for i in range(niter):
        if SYNC_EACH:  # as the indexer: four MMAs from zero, each waited and added
            for _ in gl.static_range(4):
                p = warpgroup_mma(a, b, acc, use_acc=False, is_async=True)
                p = warpgroup_mma_wait(0, deps=[p])
                acc = acc + p
        else:
            for _ in gl.static_range(4):
                acc = warpgroup_mma(a, b, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
    s = gl.sum(gl.sum(acc, axis=1), axis=0)
    gl.store(out_ptr + gl.program_id(0), s)


def main():
    from dsv4kv.bench.timing import time_cuda
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(torch.cuda.get_device_name(), triton.__version__, flush=True)
    niter = 256
    for n in (64, 128, 256):
        for a_reg in (True, False):
            for sync in (False, True):
                for per_sm in (1, 2, 4):
                    if n == 256 and per_sm == 4:
                        continue
                    out = torch.empty(sms * per_sm, device=dev)

                    def run():
                        _mma_loop[(sms * per_sm,)](out, niter, N=n, A_REG=a_reg, SYNC_EACH=sync, num_warps=4)
                    try:
                        run()
                        torch.cuda.synchronize()
                    except Exception as e:  # noqa: BLE001
                        print(f"N {n} A_REG {a_reg} sync {sync} per_sm {per_sm}: FAILED {str(e)[:200]}")
                        continue
                    us = time_cuda(run, device=dev, runs=20, flush=False).median_us
                    # assumed clocks (not read from the device): cycles scale with them
                    clock = 1.755e9 if "H100" in torch.cuda.get_device_name() else 1.98e9
                    mmas = niter * 4 * per_sm
                    cyc = us * 1e-6 * clock / mmas
                    peak = 64 * n * 32 / 4096
                    print(f"N {n:3d} A {'reg ' if a_reg else 'smem'} {'waited each' if sync else 'chained    '} "
                          f"CTAs/SM {per_sm}: {us:7.1f} us, {cyc:6.1f} cycles per MMA per SM "
                          f"(peak {peak:.0f}: {peak / cyc:.0%})", flush=True)


if __name__ == "__main__":
    main()
