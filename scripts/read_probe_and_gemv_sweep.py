"""(1) What one kernel can read: a Triton read probe (grid-stride or chunked, programs per SM, bytes
per iteration) at 16 / 64 / 256 MiB against copy_; (2) one-row GEMVs of decode's projection shapes on CUDA cores
(tl.sum, optional split-K) against torch.mm. time_cuda (graph, the read L2 flush, 30 replays), median of 3 rounds."""
import statistics
import torch
import triton
import triton.language as tl
from dsv4kv.bench.timing import time_cuda

dev = torch.device("cuda")
SMS = torch.cuda.get_device_properties(dev).multi_processor_count
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, SMS, "SMs", flush=True)


@triton.jit
def _read(x_ptr, out_ptr, n, per_prog, BLOCK: tl.constexpr, CHUNKED: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    if CHUNKED:
        lo = pid * per_prog
        for start in range(lo, lo + per_prog, BLOCK):
            acc += tl.load(x_ptr + start + offs, mask=start + offs < n, other=0)
    else:
        step = tl.num_programs(0) * BLOCK
        for start in range(pid * BLOCK, n, step):
            acc += tl.load(x_ptr + start + offs, mask=start + offs < n, other=0)
    tl.store(out_ptr + pid, tl.sum(acc))


def med3(fn):
    return statistics.median(time_cuda(fn, device=dev, runs=30).median_us for _ in range(3))


for mib in (16, 64, 256):
    x = torch.ones(mib << 18, dtype=torch.int32, device=dev)
    n = x.numel()
    out = torch.empty(SMS * 16, dtype=torch.int32, device=dev)
    half = torch.empty(mib << 17, dtype=torch.int32, device=dev)
    res = {"copy_ (read + write, same bytes moved)": med3(lambda: half.copy_(x[: n // 2]))}
    for chunked in (False, True):
        for per_sm in (1, 2, 4, 8, 16):
            for block in (1024, 2048, 4096):
                for warps in (4, 8):
                    progs = SMS * per_sm
                    per = triton.cdiv(triton.cdiv(n, progs), block) * block
                    res[f"{'chunk' if chunked else 'stride'} {per_sm}/SM block {block * 4 // 1024}KiB w{warps}"] = med3(
                        lambda: _read[(progs,)](x, out, n, per, BLOCK=block, CHUNKED=chunked, num_warps=warps))
    best = sorted(res, key=res.get)
    print(f"== read {mib} MiB", flush=True)
    for k in best[:5] + ["copy_ (read + write, same bytes moved)"]:
        print(f"  {k:42s} {res[k]:7.2f} us  {mib * 2**20 / res[k] / 1e6:5.2f} TB/s", flush=True)
    del x, half


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, N, K, K_PER, BN: tl.constexpr, BK: tl.constexpr, PARTIAL: tl.constexpr):
    pid, split = tl.program_id(0), tl.program_id(1)
    rows = pid * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    k0 = split * K_PER
    for k in range(k0, k0 + K_PER, BK):
        xv = tl.load(x_ptr + k + ks).to(tl.float32)
        wv = tl.load(w_ptr + rows[:, None] * K + (k + ks)[None, :]).to(tl.float32)
        acc += wv * xv[None, :]
    total = tl.sum(acc, axis=1)
    if PARTIAL:
        tl.store(y_ptr + split * N + rows, total)
    else:
        tl.store(y_ptr + rows, total.to(tl.bfloat16))


@triton.jit
def _sum_splits(p_ptr, y_ptr, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    acc = tl.load(p_ptr + offs, mask=m, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * N + offs, mask=m, other=0.0)
    tl.store(y_ptr + offs, acc.to(tl.bfloat16), mask=m)


def gemv(x, w, bn, bk, split, warps):
    N, K = w.shape
    y = torch.empty(1, N, dtype=torch.bfloat16, device=dev)
    if split == 1:
        _gemv[(N // bn, 1)](x, w, y, N, K, K, BN=bn, BK=bk, PARTIAL=False, num_warps=warps)
    else:
        part = torch.empty(split, N, dtype=torch.float32, device=dev)
        _gemv[(N // bn, split)](x, w, part, N, K, K // split, BN=bn, BK=bk, PARTIAL=True, num_warps=warps)
        _sum_splits[(triton.cdiv(N, 1024),)](part, y, N, SPLIT=split, BLOCK=1024, num_warps=4)
    return y


for name, (N, K) in {"q_b": (32768, 1024), "o_b": (4096, 8192), "index q_b": (8192, 1024), "q_a": (1024, 4096),
                     "kv": (512, 4096)}.items():
    w = (torch.randn(N, K, device=dev) / K ** 0.5).bfloat16()
    x = torch.randn(1, K, device=dev).bfloat16()
    ref = torch.mm(x, w.t())
    res = {"torch.mm": med3(lambda: torch.mm(x, w.t()))}
    fns = {}
    for split in (1, 2, 4, 8, 16):
        for bn in (4, 8, 16, 32):
            for bk in (128, 256, 512):
                for warps in (4, 8):
                    if (K // split) % bk or N // bn * split < SMS or bn * bk > 8192 or N // bn * split > SMS * 64:
                        continue
                    key = f"tl.sum bn{bn} bk{bk} split{split} w{warps}"
                    fns[key] = lambda a=(bn, bk, split, warps): gemv(x, w, *a)
    for key, f in fns.items():
        res[key] = med3(f)
    best = sorted(res, key=res.get)
    print(f"== GEMV 1 row, {name} N {N} K {K} ({N * K * 2 / 1e6:.1f} MB)", flush=True)
    for k in best[:5] + (["torch.mm"] if "torch.mm" not in best[:5] else []):
        out = ref if k == "torch.mm" else fns[k]()
        differ = (out != ref).float().mean().item()
        print(f"  {k:34s} {res[k]:7.2f} us  {N * K * 2 / res[k] / 1e6:5.2f} TB/s  values differing from torch.mm "
              f"{differ:.1e}", flush=True)
    del w
