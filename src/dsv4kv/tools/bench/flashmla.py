"""The `flashmla` workload: dsv4kv's sparse attention kernel beside FlashMLA's, on the same pages.

FlashMLA (the `flash_mla` module of the `sgl-flash-mla` wheel, its legacy SM90 sparse FP8 decode with
`kv_format="V4"`) is the kernel vLLM and SGLang call for DeepSeek-V4. Both kernels read dsv4kv's own pools for the
same queries, sinks and picks: FlashMLA's main cache is our window ring (one page of `window` entries per request
slot), its extra cache our compressed-entry pages. The step's kv is appended to the ring first, so both kernels see
the window of every row in the pool (ours reads the step's own key from the step page, with the same bytes).

Each kernel is timed as a CUDA-graph replay with the L2 flushed, and checked against the fp32 reference on the
dequantized keys (`ops.attention.gather` + `ops.attention.reference.sparse_attention`): error =
max |out - ref| / max |ref| per (row, head). A figure is refused when ours exceeds ATTENTION_TOL or FlashMLA's
exceeds FLASHMLA_TOL.
"""

from __future__ import annotations

import torch

from ...cache.manager import CacheManager
from .common import MODEL_NAMES, model_geometry
from .report import Result
from .synthetic import fill_layer
from .timing import time_cuda

__all__ = ["flashmla", "ATTENTION_TOL", "FLASHMLA_TOL", "SHAPES"]

# bf16 q and bf16 weights in the P.V product, as FlashMLA does (docs/numerics.md)
ATTENTION_TOL = 4e-3
# FlashMLA's own error against the fp32 reference is its own (2.2e-3 to 4.1e-3 measured on the H200): this bound only
# tells a page FlashMLA read as we do from one it misread (errors of order 1)
FLASHMLA_TOL = 2 * ATTENTION_TOL
# (model, layer kind, batch, context): V4-Flash (64 heads; CSA: 128 window + 512 picks per row) and V4-Pro (128 heads;
# 128 window + 1024 picks) decode shapes
SHAPES = [("flash", "CSA", 1, 1 << 20), ("flash", "CSA", 8, 1 << 17), ("flash", "CSA", 64, 1 << 17),
          ("flash", "CSA", 128, 1 << 16), ("flash", "HCA", 1, 1 << 20), ("flash", "HCA", 8, 1 << 17),
          ("flash", "HCA", 64, 1 << 17),
          ("pro", "CSA", 1, 1 << 20), ("pro", "CSA", 8, 1 << 17), ("pro", "CSA", 64, 1 << 16),
          ("pro", "HCA", 1, 1 << 20), ("pro", "HCA", 64, 1 << 16)]
QUICK_SHAPES = [("flash", "CSA", 1, 1 << 20), ("flash", "CSA", 64, 1 << 17), ("flash", "HCA", 64, 1 << 17),
                ("pro", "CSA", 64, 1 << 16)]


def _flash_mla():
    """The flash_mla module, or (None, the reason it cannot run)."""
    try:
        import flash_mla
    except Exception as e:  # noqa: BLE001 - any import failure means the comparison cannot run here
        return None, f"import flash_mla failed ({type(e).__name__}: {e}); pip install --no-deps sgl-flash-mla"
    return flash_mla, None


def _paged_view(pool: torch.Tensor, entries: int, entry_bytes: int) -> torch.Tensor:
    """Our pool uint8 [pages, page_bytes] as FlashMLA's k_cache [pages, entries, 1, entry_bytes] (same bytes; a page
    keeps its own stride, padded to a multiple of the data row)."""
    return pool.as_strided((pool.shape[0], entries, 1, entry_bytes), (pool.shape[1], entry_bytes, entry_bytes, 1))


class Case:
    """One decode step of one layer over `cache`, whose requests `rids` hold a history of context - 1 tokens each,
    with everything both kernels read: q, sinks, picks (CSA: random distinct entries every row can see, in ascending
    column order as `topk_indices` writes them), the step page and the pools. The step's kv is encoded by dsv4kv's
    kv insert and appended to the ring by its append kernel."""

    def __init__(self, cache: CacheManager, layer_index: int, rids: list[int], device: torch.device, seed: int = 0):
        from ...ops.window.kernel import append_window, kv_insert

        g = cache.geometry
        self.cache, self.index, self.batch = cache, layer_index, len(rids)
        spec = g.layers[layer_index]
        self.kind = spec.kind.short
        self.lc, self.ls = cache.pools.layers[layer_index], cache.spec.layers[layer_index]
        self.plan = plan = cache.plan_step([(rid, 1) for rid in rids])
        self.context = int(plan.positions[0]) + 1
        batch = self.batch
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        # q as the layer makes it: RMS-normalized per head (|q| <= sqrt(D)), bf16
        q = torch.randn(batch, g.num_heads, g.head_dim, generator=gen, device=device)
        self.q = (q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True))).bfloat16()
        self.sinks = torch.randn(g.num_heads, generator=gen, device=device)
        self.step_kv = torch.empty(1, self.ls.main.page_bytes(batch), dtype=torch.uint8, device=device)
        kv_insert(torch.randn(batch, g.head_dim, generator=gen, device=device).bfloat16(), plan.positions, spec.rope,
                  self.ls.main, self.step_kv, batch, torch.arange(batch, dtype=torch.int32, device=device))
        append_window(self.lc.window, self.ls.main, g.window, plan, self.step_kv)
        self.visible = int(plan.positions[:batch].max() + 1) // spec.ratio  # the most entries a row sees
        self.picks = None
        if self.kind == "CSA":
            shared = int(plan.positions[:batch].min() + 1) // spec.ratio  # entries every row can see
            k = min(g.index_topk, shared)
            picks = torch.rand(batch, shared, generator=gen, device=device).topk(k).indices
            self.picks = picks.sort(dim=1).values.int().contiguous()
        self.window, self.ratio, self.page_tokens = g.window, spec.ratio, cache.spec.page_tokens
        self.scale = g.head_dim ** -0.5
        self.out = torch.empty(batch, g.num_heads, g.head_dim, device=device)

    @classmethod
    def synthetic(cls, geometry, kind: str, batch: int, context: int, device: torch.device, seed: int = 0) -> "Case":
        """A cache of `batch` requests with context - 1 tokens of random valid bytes (`synthetic.fill_layer`)."""
        index = next(i for i, layer in enumerate(geometry.layers) if layer.kind.short == kind)
        cache = CacheManager(geometry, max_requests=batch, max_tokens=batch * context, device=device)
        rids = [cache.admit() for _ in range(batch)]
        for rid in rids:
            cache.plan_step([(rid, context - 1)])
        fill_layer(cache.pools.layers[index], window=geometry.window, seed=seed)
        return cls(cache, index, rids, device, seed)

    @property
    def keys_per_row(self) -> int:
        return self.window + (self.picks.shape[1] if self.picks is not None else self.visible)

    def ours(self):
        from ...ops.attention.kernel import sparse_attention_paged

        return sparse_attention_paged(
            self.q, self.plan, sinks=self.sinks, scale=self.scale, layout=self.ls.main, window=self.window,
            window_pool=self.lc.window, step_kv=self.step_kv, entry_pool=self.lc.entries, ratio=self.ratio,
            page_tokens=self.page_tokens, picks=self.picks, out=self.out, max_entries=self.visible)

    def entry_columns(self) -> torch.Tensor:
        """long [batch, K]: the compressed entries each row attends to (picks, or every entry the row can see; -1
        past a row's own visible count)."""
        if self.picks is not None:
            return self.picks.long()
        visible = (self.plan.positions[:self.batch].long() + 1) // self.ratio
        j = torch.arange(int(visible.max()), device=self.q.device)
        return torch.where(j < visible[:, None], j, -1)

    def reference(self) -> torch.Tensor:
        """fp32 [batch, H, D] on the dequantized keys."""
        from ...ops.attention.reference import sparse_attention
        from ...ops.shared.rows import step_rows
        from ...ops.attention.gather import gather_entries, gather_window

        rows = step_rows(self.plan)
        layout = self.ls.main
        step = layout.read(self.step_kv, self.batch, torch.arange(self.batch, device=self.q.device))
        keys, valid = gather_window(self.lc.window, layout, self.window, self.plan, step, rows)
        entries, entry_valid = gather_entries(self.lc.entries, layout, self.plan, self.entry_columns(),
                                              ratio=self.ratio, page_tokens=self.page_tokens, rows=rows)
        keys, valid = torch.cat((keys, entries), 1), torch.cat((valid, entry_valid), 1)
        return sparse_attention(self.q.float(), keys, valid, self.sinks, self.scale)

    def flash_mla_runner(self, flash_mla):
        """A closure running FlashMLA on our pages -> its output [batch, 1, H, D] bf16."""
        layout, device = self.ls.main, self.q.device
        entry_bytes = layout.data_bytes + layout.scale_bytes  # 584
        k_cache = _paged_view(self.lc.window, self.window, entry_bytes)
        per_page = self.page_tokens // self.ratio
        extra = _paged_view(self.lc.entries, per_page, entry_bytes)
        slots = self.plan.request_slots[:self.batch].long()
        pos = self.plan.positions[:self.batch].long()
        back = torch.arange(self.window - 1, -1, -1, device=device)
        at = pos[:, None] - back  # [batch, window]: positions pos - window + 1 .. pos
        win = torch.where(at >= 0, slots[:, None] * self.window + at % self.window, -1)
        cols = self.entry_columns()
        blocks = self.plan.block_table[slots[:, None], (cols * self.ratio) // self.page_tokens].long()
        ent = torch.where(blocks >= 0, blocks * per_page + cols % per_page, -1)
        # FlashMLA walks its indices in blocks of 64 (a shorter list made it fault: misaligned address): pad with -1
        ent = torch.nn.functional.pad(ent, (0, -ent.shape[1] % 64), value=-1)
        win_idx = win.int()[:, None, :].contiguous()
        ent_idx = ent.int()[:, None, :].contiguous()
        q4 = self.q[:, None].contiguous()
        meta, _ = flash_mla.get_mla_metadata()

        def run():
            out, _ = flash_mla.flash_mla_with_kvcache(
                q4, k_cache, None, None, layout.dim, meta, softmax_scale=self.scale, is_fp8_kvcache=True,
                indices=win_idx, attn_sink=self.sinks, extra_k_cache=extra, extra_indices_in_kvcache=ent_idx,
                use_legacy=True, kv_format="V4")
            return out
        return run


def row_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest max |out - ref| / max |ref| over (row, head)."""
    err = (out.float() - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)
    return float(err.max())


def flashmla(ctx) -> None:
    module, reason = _flash_mla()
    if module is None:
        ctx.log(f"flashmla: skipped: {reason}")
        ctx.report.meta["flashmla_skipped"] = reason
        return
    ctx.report.meta["flash_mla_version"] = getattr(module, "__version__", "unknown")
    for model, kind, batch, context in (QUICK_SHAPES if ctx.quick else SHAPES):
        g = model_geometry(model)
        case = Case.synthetic(g, kind, batch, context, ctx.device)
        theirs = case.flash_mla_runner(module)
        ref = case.reference()
        ours_err = row_error(case.ours(), ref)
        theirs_err = row_error(theirs()[:, 0], ref)
        del ref
        t_ours = time_cuda(case.ours, device=ctx.device, runs=ctx.runs)
        t_theirs = time_cuda(theirs, device=ctx.device, runs=ctx.runs)
        keys = batch * case.keys_per_row
        flops = 4 * keys * g.num_heads * g.head_dim
        passed = ours_err <= ATTENTION_TOL and theirs_err <= FLASHMLA_TOL
        check = (f"vs fp32 reference: dsv4kv {ours_err:.2e} (tolerance {ATTENTION_TOL:g}), FlashMLA {theirs_err:.2e} "
                 f"({FLASHMLA_TOL:g}) of the row max")
        params = {"model": model, "kind": kind, "batch": batch, "context": context, "keys_per_row": case.keys_per_row}
        extra = {"flashmla_us": t_theirs.median_us, "ratio": t_ours.median_us / t_theirs.median_us,
                 "dsv4kv_error": ours_err, "flashmla_error": theirs_err, "flashmla": t_theirs.as_dict(),
                 **t_ours.as_dict()}
        name = f"{MODEL_NAMES[model]} {kind} attention, batch {batch}, {context // 1024}K"
        ctx.report.add(Result("flashmla", name, params,
                              t_ours.median_us, bytes=keys * 584, flops=flops, check=check, passed=passed,
                              extra=extra))
        ctx.log(f"  flashmla {name}: dsv4kv {t_ours.median_us:.1f} us, FlashMLA "
                f"{t_theirs.median_us:.1f} us (x{t_ours.median_us / t_theirs.median_us:.2f}); errors "
                f"{ours_err:.1e} / {theirs_err:.1e}")
        del case, theirs
        torch.cuda.empty_cache()
