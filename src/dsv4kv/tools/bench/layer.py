"""The layer workloads: one layer's decode steps against transformers' DeepseekV4Attention, and a CSA layer's
prefill of a long prompt in chunks against the indexer's FLOP floor."""

from __future__ import annotations

import contextlib
import copy
import json
import statistics
import time
from importlib import resources

import torch

from ...cache.manager import CacheManager
from ...model.layer import DSV4Attention, init_random_weights
from .common import Context, check_layer, free_cuda, kernel_stage, layer_index, row_error
from .picks import explain_rows
from .report import Result
from .timing import profile_kernels, time_cuda

__all__ = ["layer_vs_transformers", "prefill"]

HF_TOL = 0.05  # exact mode against transformers in fp32, decode rows (tests/test_oracle.py: 0.03 where picks agree)
# CSA in exact mode stores bf16 indexer keys where transformers scores fp32 keys: near-tie picks flip, and a CSA
# row beyond HF_TOL passes only if each of our picks scores, by transformers' fp32 scores, within HF_TIE_TOL of the
# score range of its k-th best (tests/test_oracle.py's TIE_TOL).
HF_TIE_TOL = 0.02


# --- layer vs transformers -------------------------------------------------------------------------------------
def _hf_config():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**json.loads(resources.files("dsv4kv.presets").joinpath("flash.json").read_text()))


class _HFDecoder:
    """transformers' DeepseekV4Attention fed a prompt in chunks, then decode steps, with its own cache and an
    explicit sliding-window causal mask (its incremental path; SPEC section 4). `inputs` builds a call's
    RoPE tables and mask (what a model does once per step for all its layers), `run` is the module call."""

    def __init__(self, hf, config, device):
        from transformers import DynamicCache
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

        self.hf, self.config, self.device = hf, config, device
        self.cache = DynamicCache(config=config)
        self.rotary = DeepseekV4RotaryEmbedding(config).to(device)
        self.length = 0

    def inputs(self, x: torch.Tensor) -> tuple:
        n, window = x.shape[0], self.config.sliding_window
        x = x.to(next(self.hf.parameters()).dtype)
        kept = min(self.length, window - 1)  # window keys the cache holds from before
        positions = torch.arange(self.length, self.length + n, device=self.device)
        key_positions = torch.arange(self.length - kept, self.length + n, device=self.device)
        allowed = (key_positions[None] <= positions[:, None]) & (positions[:, None] - key_positions[None] < window)
        mask = torch.where(allowed, 0.0, float("-inf")).to(x.dtype)[None, None]
        cos_sin = {kind: self.rotary(x[None], positions[None], layer_type=kind) for kind in ("main", "compress")}
        return x[None], cos_sin, positions[None], mask

    def run(self, args: tuple) -> torch.Tensor:
        out = self.hf(*args, past_key_values=self.cache)[0][0]
        self.length += args[0].shape[1]
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self.inputs(x))


def _our_decoder(layer: DSV4Attention, prompt: torch.Tensor, steps: int, kv_format: str, indexer_format: str):
    """Our layer over a cache of the given formats, the prompt prefilled in 8K chunks: (decode graph, request id)."""
    from ...model.graph import DecodeGraph

    g, context = layer.geometry, prompt.shape[0]
    cache = CacheManager(g, max_requests=1, max_tokens=context + steps, device=prompt.device, kv_format=kv_format,
                         indexer_format=indexer_format)
    rid = cache.admit()
    for lo in range(0, context, 8192):
        hi = min(context, lo + 8192)
        layer(prompt[lo:hi], cache.plan_step([(rid, hi - lo)]), cache)
    return DecodeGraph([layer], cache, batch=1, max_seq_len=context + steps), rid


def _hook_indexer(hf) -> dict:
    """Forward hooks on transformers' CSA indexer: after each call, "picks" [k'] and "scores" [T] (fp32) are its last
    row's (batch 1; k' = min(k, T)); "handles" removes the hooks."""
    seen: dict = {}
    indexer = hf.compressor.indexer
    seen["handles"] = [indexer.register_forward_hook(lambda m, i, o: seen.__setitem__("picks", o[0][-1])),
                       indexer.scorer.register_forward_hook(lambda m, i, o: seen.__setitem__("scores", o[0][-1]))]
    return seen


@contextlib.contextmanager
def _kernel_picks(holder: dict | None):
    """While active, `holder["picks"]` is the output of each `kernels.topk_indices` call. Inside a CUDA-graph
    capture that output is the graph's own buffer, which every replay rewrites."""
    import dsv4kv.ops.kernels as kernels

    if holder is None:
        yield
        return
    original = kernels.topk_indices

    def select(*args, **kwargs):
        holder["picks"] = original(*args, **kwargs)
        return holder["picks"]

    kernels.topk_indices = select
    try:
        yield
    finally:
        kernels.topk_indices = original


def layer_vs_transformers(ctx: Context) -> None:
    """Decode steps of one layer: transformers' module (eager bf16) against ours (CUDA graph), same weights and
    inputs. The check: our exact mode (bf16 cache) against transformers in fp32, the project's oracle; the
    official mode (FP8 / MXFP4, the timed one) is checked against our reference in the `decode` workload."""
    try:
        config = _hf_config()
    except ImportError:
        ctx.log("layer: transformers is not installed, skipped")
        return
    for context in ([16384] if ctx.quick else [4096, 16384]):
        for kind in ("window", "csa", "hca"):
            _layer_versus(ctx, config, kind, context)
            free_cuda()


def _layer_versus(ctx: Context, config, kind: str, context: int) -> None:
    """One layer kind at one context: transformers' module in bf16 (timed) and fp32 (the oracle), ours in the
    official and the exact mode, each prefilled with the same prompt and then fed the same decode tokens."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    g = ctx.geometry
    steps = 12
    i = layer_index(g, kind)
    hf32 = init_random_weights(DeepseekV4Attention(config, i).eval().to(ctx.device), seed=i)
    with torch.no_grad():  # bf16-representable weights: every module here holds the same values
        for param in hf32.parameters():
            param.copy_(param.bfloat16().float())
    hf16 = _HFDecoder(copy.deepcopy(hf32).to(torch.bfloat16), config, ctx.device)
    oracle = _HFDecoder(hf32, config, ctx.device)
    gen = torch.Generator(device=ctx.device).manual_seed(context + i)
    prompt = torch.randn(context, g.hidden_size, generator=gen, device=ctx.device).bfloat16()
    tokens = torch.randn(steps, g.hidden_size, generator=gen, device=ctx.device).bfloat16()
    seen = _hook_indexer(hf32) if kind == "csa" else None  # transformers' picks and fp32 scores
    with torch.no_grad():
        for lo in range(0, context, 2048):
            hf16(prompt[lo:lo + 2048])
            oracle(prompt[lo:lo + 2048])
        ours = {mode: _our_decoder(DSV4Attention.from_transformers(hf16.hf), prompt, steps, *formats)
                for mode, formats in (("official", ("fp8", "mxfp4")), ("exact", ("bf16", "bf16")))}
        hf_times, walls, errors, picks = _decode_steps(ctx, hf16, oracle, ours, tokens, seen)
        # replays of the last plan: the graph's device time (the step is idempotent over one plan)
        replay = {mode: time_cuda(graph.graph.replay, device=ctx.device, runs=ctx.runs, graph=False, warmup=1)
                  for mode, (graph, _) in ours.items()}
    hf_us = statistics.median(hf_times[2:])
    wall_us = statistics.median(walls[2:])
    official = max(errors["official"])
    verdict = _exact_verdict(errors["exact"], picks, seen)
    passed = verdict.passed
    check = (f"{verdict.text('exact mode vs transformers fp32, decode rows')}; "
             f"official mode: worst {official:.2e} (FP8/MXFP4 numerics, not gated)")
    params = {"kind": kind, "context": context, "batch": 1}
    ctx.report.add(Result("layer", f"transformers {kind}, ctx {context} (eager bf16)", params, hf_us,
                          check="the module timed", extra={"module": "DeepseekV4Attention"}))
    for mode, timing in replay.items():
        ctx.report.add(Result("layer", f"dsv4kv {kind}, ctx {context}, {mode} (graph replay)",
                              {**params, "mode": mode}, timing.median_us, check=check, passed=passed,
                              extra={**timing.as_dict(), "speedup": hf_us / timing.median_us,
                                     "step_wall_us": wall_us if mode == "official" else None}))
    ctx.log(f"  {kind} {context}: transformers {hf_us:.0f} us, ours {replay['official'].median_us:.1f} us "
            f"official / {replay['exact'].median_us:.1f} us exact (x{hf_us / replay['official'].median_us:.1f}"
            f"; a whole step with planning {wall_us:.0f} us), {check}")


def _decode_steps(ctx: Context, hf16: _HFDecoder, oracle: _HFDecoder, ours: dict, tokens: torch.Tensor,
                  seen: dict | None) -> tuple[list[float], list[float], dict[str, list[float]], dict[str, list]]:
    """Feed each token to transformers (timed on the GPU), the oracle and our graphs (timed on the host, official
    mode). Returns transformers' times (us), our step walls (us), our row errors by mode and, for CSA, the picks:
    ours (exact mode), transformers' (padded with -1 to k) and transformers' fp32 scores, a row per step."""
    g = ctx.geometry
    hf_times, walls, errors = [], [], {"official": [], "exact": []}
    picks = {"ours": [], "theirs": [], "scores": []}
    ours_picks: dict = {}  # the exact-mode graph's top-k output (the capture's buffer once captured)
    for s in range(tokens.shape[0]):
        token = tokens[s:s + 1]
        args = hf16.inputs(token)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        hf16.run(args)
        end.record()
        torch.cuda.synchronize()
        hf_times.append(start.elapsed_time(end) * 1e3)
        want = oracle(token)
        for mode, (graph, rid) in ours.items():
            t0 = time.perf_counter()
            with _kernel_picks(ours_picks if mode == "exact" and seen is not None else None):
                got = graph.step([(rid, 1)], token) - token  # the graph's chain adds the residual
            torch.cuda.synchronize()
            if mode == "official":
                walls.append((time.perf_counter() - t0) * 1e6)
            errors[mode].append(row_error(got, want))
        if seen is not None:
            picks["ours"].append(ours_picks["picks"][0].long().cpu())
            theirs = seen["picks"].long().cpu()
            picks["theirs"].append(torch.nn.functional.pad(theirs, (0, g.index_topk - theirs.shape[0]), value=-1))
            picks["scores"].append(seen["scores"].float().cpu())
    return hf_times, walls, errors, picks


def _exact_verdict(errors: list[float], picks: dict[str, list], seen: dict | None):
    """The exact mode's rows against transformers fp32: within HF_TOL, or (CSA) explained by near-tie picks. Removes
    the indexer hooks."""
    if seen is None:
        return explain_rows(torch.tensor(errors), None, None, None, row_tol=HF_TOL, tie_tol=HF_TIE_TOL)
    for handle in seen["handles"]:
        handle.remove()
    width = max(row.shape[0] for row in picks["scores"])
    scores = torch.stack([torch.nn.functional.pad(row, (0, width - row.shape[0]), value=float("-inf"))
                          for row in picks["scores"]])
    return explain_rows(torch.tensor(errors), torch.stack(picks["ours"]), torch.stack(picks["theirs"]), scores,
                        row_tol=HF_TOL, tie_tol=HF_TIE_TOL)


# --- prefill -------------------------------------------------------------------------------------------------
def prefill(ctx: Context) -> None:
    """A CSA layer over a long prompt in chunks: the whole prompt's time against the indexer's FLOP floor, the last
    chunk's kernels by stage, and the indexer scores kernel alone on the last chunk."""
    g = ctx.geometry
    i = layer_index(g, "csa")
    spec = g.layers[i]
    prompt_len, chunk = (32768, 8192) if ctx.quick else (65536, 8192)
    layer = init_random_weights(DSV4Attention(g, i, device=ctx.device), seed=i)
    gen = torch.Generator(device=ctx.device).manual_seed(7)
    x = torch.randn(prompt_len, g.hidden_size, generator=gen, device=ctx.device).bfloat16()
    _warm_chunks(layer, x, chunk)
    cache = CacheManager(g, max_requests=1, max_tokens=prompt_len, device=ctx.device)
    plan, chunk_us, check, passed, kernels = _timed_chunks(ctx, layer, cache, x, chunk)
    # the indexer's arithmetic: 2 * H * D per (row, visible entry)
    visible = sum((t + 1) // spec.ratio for t in range(prompt_len))
    flops = 2 * g.index_n_heads * g.index_head_dim * visible
    total = sum(chunk_us)
    params = {"prompt": prompt_len, "chunk": chunk}
    ctx.report.add(Result("prefill", f"CSA layer, {prompt_len} tokens in {chunk}-token chunks", params, total,
                          flops=flops, check=check, passed=passed,
                          extra={"tokens_per_s": prompt_len / (total * 1e-6), "chunk_us": chunk_us,
                                 "flops_are": "the indexer's alone (the floor)"}))
    by_stage: dict[str, list[float]] = {}
    for name, us in kernels:
        by_stage.setdefault(kernel_stage(name), []).append(us)
    for stage, times in by_stage.items():
        ctx.report.add(Result("prefill", f"  last chunk: {stage} ({len(times)} kernels)", params, sum(times),
                              check=check, passed=passed, extra={"stage": stage, "profiled": "eager, one run"}))
    ctx.log("  last chunk kernels: " + ", ".join(f"{stage} {sum(t) / 1e3:.2f} ms" for stage, t in by_stage.items()))
    timing = _indexer_alone(ctx, layer, cache, plan, x, chunk)
    last_visible = sum((t + 1) // spec.ratio for t in range(prompt_len - chunk, prompt_len))
    ctx.report.add(Result("prefill", f"indexer scores, last chunk ({chunk} rows x <= {prompt_len // 4} keys)", params,
                          timing.median_us, flops=2 * g.index_n_heads * g.index_head_dim * last_visible,
                          bytes=chunk * (prompt_len // spec.ratio) * 4, passed=passed,
                          check=f"the kernel of the layer checked above, not on its own: {check}",
                          extra=timing.as_dict()))
    ctx.log(f"  prefill {prompt_len}: {total / 1e3:.1f} ms ({prompt_len / (total * 1e-6):.0f} tokens/s), "
            f"indexer floor {flops / ctx.report.gemm * 1e3:.2f} ms" if ctx.report.gemm else "")
    free_cuda()


def _warm_chunks(layer: DSV4Attention, x: torch.Tensor, chunk: int) -> None:
    """Every chunk shape of the timed run once, on a cache of its own: each chunk's score rows are wider, and past
    4096 columns top-k's row kernel compiles for the wider block, which must not happen inside a timed chunk."""
    warm = CacheManager(layer.geometry, max_requests=1, max_tokens=x.shape[0], device=x.device)
    rid = warm.admit()
    for lo in range(0, x.shape[0], chunk):
        layer(x[lo:lo + chunk], warm.plan_step([(rid, chunk)]), warm)


def _timed_chunks(ctx: Context, layer: DSV4Attention, cache: CacheManager, x: torch.Tensor, chunk: int):
    """Prefill `x` in chunks, each timed on the GPU; chunk 1 (the first with history) is checked against the
    reference first, the last chunk's kernels profiled first. Returns (the last plan, chunk times in us, check text,
    passed, the last chunk's kernels)."""
    rid = cache.admit()
    tensors = cache.pools.layers[layer.layer_index].tensors()
    prompt_len = x.shape[0]
    chunk_us, check, passed, kernels = [], "not run", True, []
    for c, lo in enumerate(range(0, prompt_len, chunk)):
        plan = cache.plan_step([(rid, chunk)])
        if lo + chunk == prompt_len:  # the last chunk's kernels, profiled on a copy of the state it starts from
            snapshot = [t.clone() for t in tensors]
            pages = cache.pages(layer.layer_index)
            attn = layer.attention_plan(plan, pages, "triton")
            kernels = profile_kernels(lambda: layer._forward_kernels(x[lo:lo + chunk], attn, pages),
                                      device=ctx.device, graph=False)
            for t, s in zip(tensors, snapshot):
                t.copy_(s)
            snapshot.clear()
        if c == 1:  # check one chunk with history against the reference, then run it for real
            check, passed = check_layer(layer, x[lo:lo + chunk], plan, cache, f"chunk 1 (history {lo}) vs reference")
            free_cuda()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        layer(x[lo:lo + chunk], plan, cache)
        end.record()
        torch.cuda.synchronize()
        chunk_us.append(start.elapsed_time(end) * 1e3)
    return plan, chunk_us, check, passed, kernels


def _indexer_alone(ctx: Context, layer: DSV4Attention, cache: CacheManager, plan, x: torch.Tensor, chunk: int):
    """The indexer scores kernel alone over the prompt `x`'s last chunk (its plan reused read-only): the timing."""
    from ...ops.indexer.kernel import indexer_scores_paged
    from ...ops.indexer.query_kernel import indexer_query_and_weights
    from ...ops.rope.reference import rope_cos_sin

    g, i = ctx.geometry, layer.layer_index
    spec, ls = g.layers[i], cache.spec.layers[i]
    projected = layer.project(x[-chunk:], plan.positions)
    q_index, weights = indexer_query_and_weights(projected.index_q, projected.index_weights,
                                                 *rope_cos_sin(spec.rope, plan.positions), ls.index,
                                                 scale=g.index_n_heads ** -0.5)
    run = lambda: indexer_scores_paged(q_index, weights, plan, cache.pools.layers[i].index_keys,  # noqa
                                       ls.index, ratio=spec.ratio, page_tokens=cache.spec.page_tokens,
                                       max_entries=x.shape[0] // spec.ratio)
    return time_cuda(run, device=ctx.device, runs=max(5, ctx.runs // 5), graph=False)
