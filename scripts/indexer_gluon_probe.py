"""A probe, not a kernel of the package: the MXFP4 indexer's decode (row) scores written in Gluon (Triton's lower-level
language; GPU only, no interpreter), FP8 path only (D = 128, 64 heads, pages holding whole 64-entry tiles). The
design the Triton kernel cannot express: a tile's key bytes go to shared memory by cp.async STAGES - 1 tiles ahead (no
registers held), each scale block's 16 bytes are read straight into the MMA's A-fragment layout (the nibble split
is a layout no-op, `convert_layout(assert_trivial=True)`), and the four per-block MMAs are asynchronous, two in
flight, so one block's scaling runs while the next multiplies. The products and the fp32 sum order are those of
`kernels.indexer`'s FP8 path: its scores are bit-equal at every shape run.

Result (H100, docs/performance.md "What bounds the MXFP4 indexer", log docs/device/2026-11-27-indexer-gluon-h100.log):
no faster than the Triton kernel (batch 64 / 128K 115.3 against 116.5 us at best, batch 1 / 1M 23.5 against 21.7),
so it stays a probe.

    PYTHONPATH=/tmp/t36:src python scripts/indexer_gluon_probe.py compile   # sm_90a on a CPU (triton 3.6 as in
                                                                            # scripts/indexer_sass.py): registers
    PYTHONPATH=src python scripts/indexer_gluon_probe.py bench    # GPU: bit-equality and time against the Triton path
    PYTHONPATH=src python scripts/indexer_gluon_probe.py probe    # GPU: parts of the work taken out (timing only)
    PYTHONPATH=src python scripts/indexer_gluon_probe.py ncu      # each kernel once at batch 64, for ncu
"""
import sys

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from dsv4kv.kernels.indexer import _E2M1_E4M3_ASM

BLOCK_J = gl.constexpr(64)
H = gl.constexpr(64)
D = gl.constexpr(128)


@gluon.jit
def _e2m1_e4m3(byte):
    """`kernels.indexer._e2m1_e4m3`'s bit moves, its PTX (a Gluon kernel cannot call a triton.jit function)."""
    return gl.inline_asm_elementwise(asm=_E2M1_E4M3_ASM, constraints="=r,=r,r", args=[byte],
                                     dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4)


@gluon.jit
def _ue8m0_times_64(code):
    """`kernels.indexer._ue8m0_times_64`: an e8m0 code -> 2^(code - 127) * 2^6 in fp32."""
    bits = gl.minimum(code + 6, 255) << 23
    return gl.where(code == 0xFF, 0x7FC00000, bits).to(gl.float32, bitcast=True)


@gluon.jit
def _issue_tile(buf, slot, p_page, row0, n_valid, LOAD: gl.constexpr):
    """cp.async of a tile's 64 x 64 key bytes into buf[slot] ([256, 16]: block b's 16 bytes of row r at b * 64 + r)."""
    o_s = gl.arange(0, 256, layout=gl.SliceLayout(1, LOAD))
    o_i = gl.arange(0, 16, layout=gl.SliceLayout(0, LOAD))
    o_r = o_s % 64
    offs = (row0 + o_r)[:, None] * 64 + (o_s // 64)[:, None] * 16 + o_i[None, :]
    mask = (o_r < n_valid)[:, None] & (o_i >= 0)[None, :]
    async_copy.async_copy_global_to_shared(buf.index(slot), p_page + offs, mask=mask)


@gluon.jit
def _a_block(tile, b: gl.constexpr, BYTES: gl.constexpr, A_L: gl.constexpr, CONV: gl.constexpr = True):
    """Scale block b of the tile's keys as the MMA's A operand: e4m3 [64, 32], k = 16 * nibble + byte."""
    byte = tile.slice(64 * b, 64).load(BYTES)
    if CONV:
        lo, hi = _e2m1_e4m3(byte)
    else:  # timing probe only: the bytes as they are
        lo, hi = byte, byte ^ 0x11
    k = gl.reshape(gl.permute(gl.join(lo, hi), (0, 2, 1)), [64, 32])
    return gl.convert_layout(k, A_L, assert_trivial=True).to(gl.float8e4nv, bitcast=True)


@gluon.jit
def _ws_scores_kernel(q8_ptr, q8_scale_ptr, w_ptr, positions_ptr, token_request_ptr, request_slots_ptr,
                      block_table_ptr, pool_ptr, out_ptr, num_entries, table_stride, score_scale, chunk,
                      RATIO: gl.constexpr, P: gl.constexpr, PAGE_BYTES: gl.constexpr, STAGES: gl.constexpr,
                      SCALE: gl.constexpr = True, CONV: gl.constexpr = True, EPI: gl.constexpr = True):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    # a block's 16 bytes per key as the A fragment wants them after the nibble split: a thread's 4 consecutive bytes
    # of rows g and g + 8 (lane = 4 g + t holds bytes 4t..4t+3), warps 16 rows apart
    BYTES: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 16])
    LOAD: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[32, 1], warps_per_cta=[4, 1],
                                          order=[1, 0])
    QL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[8, 4], warps_per_cta=[4, 1],
                                        order=[1, 0])
    ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
    HEADS: gl.constexpr = gl.SliceLayout(0, MMA)
    BUF_L: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    Q_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=8, rank=2)

    i_t = gl.program_id(0)
    i_c = gl.program_id(1)
    t = i_t.to(gl.int64)
    position = gl.load(positions_ptr + i_t)
    request = gl.load(token_request_ptr + i_t)
    slot = gl.load(request_slots_ptr + gl.maximum(request, 0))
    slot = gl.where(request >= 0, slot, -1)
    visible = gl.where((position >= 0) & (slot >= 0), (position + 1) // RATIO, 0)
    visible = gl.minimum(visible, num_entries)
    chunk_lo = i_c * chunk
    hi = gl.minimum(gl.minimum(chunk_lo + chunk, num_entries), visible)
    if chunk_lo < hi:
        p_out = out_ptr + t * num_entries
        p_table = block_table_ptr + slot.to(gl.int64) * table_stride
        # q's FP8 operand per scale block, K-major [64 heads, 32]: dims of block b in the keys' order (the 16 low
        # nibbles' dims 2c, then the high nibbles' 2c + 1)
        qs = gl.allocate_shared_memory(gl.float8e4nv, [4, 64, 32], Q_SL)
        o_h = gl.arange(0, 64, layout=gl.SliceLayout(1, QL))
        o_k = gl.arange(0, 32, layout=gl.SliceLayout(0, QL))
        dim = (o_k % 16) * 2 + o_k // 16
        for b in gl.static_range(4):
            qb = gl.load(q8_ptr + t * (H * D) + o_h[:, None] * D + (32 * b + dim)[None, :])
            qs.index(b).store(qb.to(gl.float8e4nv, bitcast=True))
        o_w = gl.arange(0, 64, layout=HEADS)
        b_w = gl.load(w_ptr + t * H + o_w) * gl.load(q8_scale_ptr + t * H + o_w) * score_scale

        buf = gl.allocate_shared_memory(gl.uint8, [STAGES, 256, 16], BUF_L)
        n_tiles = gl.cdiv(hi - chunk_lo, BLOCK_J)
        for s in gl.static_range(STAGES - 1):
            j = chunk_lo + s * BLOCK_J
            block = gl.load(p_table + j // P, mask=j < hi, other=-1)
            _issue_tile(buf, s, pool_ptr + block.to(gl.int64) * PAGE_BYTES, j % P,
                        gl.where(block >= 0, hi - j, 0), LOAD)
            async_copy.commit_group()
        fence_async_shared()
        o_r = gl.arange(0, 64, layout=ROWS)
        block = gl.load(p_table + chunk_lo // P)
        p_words = (pool_ptr + block.to(gl.int64) * PAGE_BYTES + P * 64).to(gl.pointer_type(gl.int32))
        words = gl.load(p_words + chunk_lo % P + o_r, mask=(block >= 0) & (chunk_lo + o_r < hi), other=0x7F7F7F7F)
        zero = gl.zeros([64, 64], gl.float32, MMA)
        total = gl.zeros([64, 64], gl.float32, MMA)
        for it in range(n_tiles):
            j0 = chunk_lo + it * BLOCK_J
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            # the tile STAGES - 1 ahead into the slot the last iteration read
            jn = j0 + (STAGES - 1) * BLOCK_J
            block_n = gl.load(p_table + jn // P, mask=jn < hi, other=-1)
            _issue_tile(buf, (it + STAGES - 1) % STAGES, pool_ptr + block_n.to(gl.int64) * PAGE_BYTES, jn % P,
                        gl.where(block_n >= 0, hi - jn, 0), LOAD)
            async_copy.commit_group()
            # the next tile's scale words
            j1 = j0 + BLOCK_J
            block_1 = gl.load(p_table + j1 // P, mask=j1 < hi, other=-1)
            p_words1 = (pool_ptr + block_1.to(gl.int64) * PAGE_BYTES + P * 64).to(gl.pointer_type(gl.int32))
            words_next = gl.load(p_words1 + j1 % P + o_r, mask=(block_1 >= 0) & (j1 + o_r < hi), other=0x7F7F7F7F)

            tile = buf.index(it % STAGES)
            a0 = _a_block(tile, 0, BYTES, A_L, CONV)
            a1 = _a_block(tile, 1, BYTES, A_L, CONV)
            a2 = _a_block(tile, 2, BYTES, A_L, CONV)
            a3 = _a_block(tile, 3, BYTES, A_L, CONV)
            p0 = warpgroup_mma(a0, qs.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
            p1 = warpgroup_mma(a1, qs.index(1).permute((1, 0)), zero, use_acc=False, is_async=True)
            p0 = warpgroup_mma_wait(1, deps=[p0])
            if SCALE:
                acc = p0 * _ue8m0_times_64(words & 0xFF)[:, None]
            else:
                acc = p0
            p2 = warpgroup_mma(a2, qs.index(2).permute((1, 0)), zero, use_acc=False, is_async=True)
            p1 = warpgroup_mma_wait(1, deps=[p1])
            if SCALE:
                acc = acc + p1 * _ue8m0_times_64((words >> 8) & 0xFF)[:, None]
            else:
                acc = acc + p1
            p3 = warpgroup_mma(a3, qs.index(3).permute((1, 0)), zero, use_acc=False, is_async=True)
            p2 = warpgroup_mma_wait(1, deps=[p2])
            if SCALE:
                acc = acc + p2 * _ue8m0_times_64((words >> 16) & 0xFF)[:, None]
            else:
                acc = acc + p2
            p3 = warpgroup_mma_wait(0, deps=[p3])
            if SCALE:
                acc = acc + p3 * _ue8m0_times_64((words >> 24) & 0xFF)[:, None]
            else:
                acc = acc + p3
            words = words_next
            if EPI:
                b_s = gl.sum(gl.maximum(acc, 0.0, propagate_nan=tl.PropagateNan.ALL) * b_w[None, :], axis=1)
                o_j = j0 + o_r
                gl.store(p_out + o_j, gl.where(o_j < visible, b_s, float("-inf")), mask=o_j < num_entries)
            else:  # timing probe only: the tiles' sums, stored once
                total = total + acc
        if EPI == 0:
            gl.store(p_out + chunk_lo + o_r, gl.sum(total, axis=1))
        async_copy.wait_group(0)


def scores(q8, q8_scale, w, plan, pool, *, ratio, page_tokens, out, chunk, stages=3, maxnreg=None, **probe):
    rows = plan.positions.shape[0]
    grid = (rows, triton.cdiv(out.shape[1], chunk))
    opts = {"maxnreg": maxnreg} if maxnreg else {}
    _ws_scores_kernel[grid](q8, q8_scale, w, plan.positions, plan.token_request, plan.request_slots,
                            plan.block_table, pool, out, out.shape[1], plan.block_table.stride(0), D.value ** -0.5, chunk,
                            RATIO=ratio, P=page_tokens // ratio, PAGE_BYTES=pool.shape[1], STAGES=stages,
                            num_warps=4, **probe, **opts)
    return out


def compile_only():
    from triton.backends.compiler import GPUTarget
    sys.path.insert(0, "scripts")
    from attention_sass import ptxas_and_sass, registers_and_spills
    kernel = _ws_scores_kernel
    names = kernel.arg_names
    consts = {"RATIO": 4, "P": 256, "PAGE_BYTES": 256 * 68, "STAGES": 3, "SCALE": True, "CONV": True, "EPI": True}
    ptrs = {"q8_ptr": "*u8", "q8_scale_ptr": "*fp32", "w_ptr": "*fp32", "positions_ptr": "*i32",
            "token_request_ptr": "*i32", "request_slots_ptr": "*i32", "block_table_ptr": "*i32", "pool_ptr": "*u8",
            "out_ptr": "*fp32"}
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n == "score_scale" else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in ptrs or n in ("num_entries", "table_stride", "chunk")}
    from triton.experimental.gluon._runtime import GluonASTSource
    src = GluonASTSource(fn=kernel, signature=sig, attrs=attrs,
                                    constexprs={(names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptxas, sass = ptxas_and_sass(compiled)
    print(registers_and_spills(ptxas))
    from attention_sass import loop_mix
    count, ops = loop_mix(sass)
    print(f"tile loop: {count} SASS instructions;", ", ".join(f"{k} {v}" for k, v in ops.most_common(12)))


def bench():
    sys.path.insert(0, "scripts")
    from bench_variants import DEVICE, indexer_decode_case
    import dsv4kv.kernels.indexer as K
    from dsv4kv.bench.timing import time_cuda
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for batch, history in ((1, (1 << 20) - 1), (8, 131071), (64, 131071)):
        c = indexer_decode_case(batch, history)
        (q8, q8s), entries, out = c.q_fp8, c.out.shape[1], c.out
        assert bool((q8s > 0).all())
        ref = torch.empty_like(out)

        def run_ref():
            return K.indexer_scores_paged(c.q, c.w, c.plan, c.pool, c.layout, ratio=4, page_tokens=c.page_tokens,
                                          out=ref, q_fp8=c.q_fp8)
        run_ref()
        _, iters, _ = K._config(batch, entries, DEVICE)
        mb = batch * entries * 68 / 1e6
        t_ref = [time_cuda(run_ref, device=DEVICE, runs=30).median_us for _ in range(3)]
        print(f"batch {batch} ctx {history + 1} ({mb:.1f} MB) triton FP8 path: {sorted(t_ref)[1]:.1f} us "
              f"(iters {iters})", flush=True)
        for stages in (2, 3, 4):
            for maxnreg in (None, 168, 128):
                for mult in (0.5, 1, 2):
                    it = max(1, int(iters * mult))
                    chunk = 64 * it

                    def run(stages=stages, maxnreg=maxnreg, chunk=chunk):
                        return scores(q8, q8s, c.w, c.plan, c.pool, ratio=4, page_tokens=c.page_tokens, out=out,
                                      chunk=chunk, stages=stages, maxnreg=maxnreg)
                    out.fill_(float("nan"))
                    try:
                        run()
                        torch.cuda.synchronize()
                    except Exception as e:  # noqa: BLE001
                        print(f"  stages {stages} maxnreg {maxnreg} iters {it}: FAILED {type(e).__name__}: "
                              f"{str(e)[:300]}", flush=True)
                        continue
                    same = torch.equal(out, ref)
                    ndiff = int((out != ref).sum())
                    ts = [time_cuda(run, device=DEVICE, runs=30).median_us for _ in range(3)]
                    print(f"  gluon stages {stages} maxnreg {maxnreg} iters {it}: {sorted(ts)[1]:.1f} us "
                          f"({min(ts):.1f}-{max(ts):.1f}) bit-equal {same} ({ndiff} differ)", flush=True)
        del c, out, ref
        torch.cuda.empty_cache()


def ncu_once():
    """Each kernel once at batch 64 / 128K (for ncu): the Triton FP8 path, then the Gluon kernel at 128 and 177
    registers (2 stages, 32 tiles a program)."""
    sys.path.insert(0, "scripts")
    from bench_variants import indexer_decode_case
    import dsv4kv.kernels.indexer as K
    c = indexer_decode_case(64, 131071)
    K.indexer_scores_paged(c.q, c.w, c.plan, c.pool, c.layout, ratio=4, page_tokens=c.page_tokens, out=c.out,
                           q_fp8=c.q_fp8)
    for maxnreg in (128, None):
        scores(*c.q_fp8, c.w, c.plan, c.pool, ratio=4, page_tokens=c.page_tokens, out=c.out, chunk=64 * 32,
               stages=2, maxnreg=maxnreg)
    torch.cuda.synchronize()


def probe():
    """The Gluon kernel (2 stages, 128 registers, 32 tiles a program at batch 64, 16 at batch 1) with parts of its work
    taken out (timing only):
    SCALE (the key scales), CONV (the e2m1 -> e4m3 moves), EPI (ReLU, weights, head sum and store per tile), and the
    keys from 8 pages (L2 hits) instead of the request's."""
    sys.path.insert(0, "scripts")
    from bench_variants import DEVICE, hot_plan, indexer_decode_case
    from dsv4kv.bench.timing import time_cuda
    for batch, history in ((1, (1 << 20) - 1), (64, 131071)):
        c = indexer_decode_case(batch, history)
        iters = 32 if batch > 1 else 16
        for flags in ({}, {"SCALE": False}, {"CONV": False}, {"EPI": False}, {"SCALE": False, "CONV": False},
                      {"SCALE": False, "CONV": False, "EPI": False}):
            for name, p in (("normal", c.plan), ("hot", hot_plan(c.plan))):
                def run(p=p, flags=flags):
                    return scores(*c.q_fp8, c.w, p, c.pool, ratio=4, page_tokens=c.page_tokens, out=c.out,
                                  chunk=64 * iters, stages=2, maxnreg=128, **flags)
                run()
                torch.cuda.synchronize()
                ts = [time_cuda(run, device=DEVICE, runs=30).median_us for _ in range(3)]
                print(f"batch {batch} ctx {history + 1} {name:6s} without {sorted(k for k in flags) or '-'}: "
                      f"{sorted(ts)[1]:.1f} us", flush=True)
        del c
        torch.cuda.empty_cache()


if __name__ == "__main__":
    {"compile": compile_only, "bench": bench, "probe": probe, "ncu": ncu_once}[sys.argv[1]]()
