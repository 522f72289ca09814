"""What time_cuda's L2 flush costs the timed work. Until a72a366 the flush wrote 256 MiB (`zero_`), which leaves
the L2 full of dirty lines that the timed kernels must write back as they evict them. Variants of the flush: that
write, a 256 MiB read (the L2 then holds clean lines; the bench's flush since), none. Median of 30 graph replays, median of 3
rounds, variants alternating."""
import statistics
import torch
import dsv4kv.bench.timing as T
from dsv4kv import ModelGeometry
from dsv4kv.bench.synthetic import fill_layer
from dsv4kv.bench.workloads import _layer_index
from dsv4kv.layer import DSV4Attention, init_random_weights
from dsv4kv.manager import CacheManager

dev = torch.device("cuda")
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
buf = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
sink = torch.empty((), dtype=torch.int64, device=dev)
MODES = {
    "write flush": lambda d: buf.zero_(),
    "read flush": lambda d: torch.sum(buf.view(torch.int64), dim=0, out=sink),
    "no flush": None,
}


def ab(label, run, nbytes=None):
    times = {m: [] for m in MODES}
    for r in range(3):
        for m, f in MODES.items():
            if f is None:
                times[m].append(T.time_cuda(run, device=dev, runs=30, flush=False).median_us)
            else:
                T._flush_l2 = f
                times[m].append(T.time_cuda(run, device=dev, runs=30).median_us)
    med = {m: statistics.median(t) for m, t in times.items()}
    rate = (lambda us: f" {nbytes / us / 1e6:5.2f} TB/s") if nbytes else (lambda us: "")
    print(f"{label:40s} " + "  ".join(f"{m} {med[m]:8.1f} us{rate(med[m])}" for m in MODES)
          + f"   rounds {[[round(v, 1) for v in t] for t in times.values()]}", flush=True)


G = ModelGeometry.preset("flash")
w = torch.randn(32768, 1024, device=dev).bfloat16()
xq = torch.randn(1, 1024, device=dev).bfloat16()
ab("q_b GEMV, 1 row (67 MB read)", lambda: torch.mm(xq, w.t()), w.numel() * 2)
big = torch.randn(32 << 20, device=dev).bfloat16()
ab("sum of 64 MiB bf16 (read)", lambda: big.sum(), big.numel() * 2)
small = torch.randn(4 << 20, device=dev).bfloat16()
ab("sum of 8 MiB bf16 (read)", lambda: small.sum(), small.numel() * 2)
dst = torch.empty_like(big)
ab("copy 64 MiB -> 64 MiB (read + write)", lambda: dst.copy_(big), 2 * big.numel() * 2)
del w, big, dst, small

for kind, context, batch in (("csa", 16384, 1), ("csa", 1 << 20, 1), ("csa", 131072, 64), ("hca", 131072, 64),
                             ("window", 16384, 1)):
    i = _layer_index(G, kind)
    layer = init_random_weights(DSV4Attention(G, i, device=dev), seed=i)
    cache = CacheManager(G, max_requests=batch, max_tokens=batch * context, device=dev)
    rids = [cache.admit() for _ in range(batch)]
    for rid in rids:
        cache.plan_step([(rid, context - 1)])
    fill_layer(cache.pools.layers[i], window=G.window, seed=i)
    buffers = cache.step_buffers(max_tokens=batch, max_requests=batch, max_seq_len=context)
    plan = cache.plan_step([(rid, 1) for rid in rids], buffers=buffers)
    x = torch.randn(batch, G.hidden_size, generator=torch.Generator(device=dev).manual_seed(batch),
                    device=dev).bfloat16()
    with torch.no_grad():
        p = layer.project(x, plan.positions)
        ab(f"{kind} core ctx {context} batch {batch}", lambda: layer.attention_core(p, plan, cache))
        ab(f"{kind} layer ctx {context} batch {batch}", lambda: layer._forward_kernels(x, plan, cache))
    del cache, plan, buffers, layer, p
    torch.cuda.empty_cache()
