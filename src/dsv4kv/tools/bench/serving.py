"""The serving workloads: all 43 layers at scale (one 2^20-token request, the most 128K requests that fit), and the
engine over a chat workload with prefix caching off and on."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ...cache.manager import CacheManager
from ...cache.planner import MemoryPlan
from ...cache.spec import CacheSpec
from ...checks import require
from ...geometry import ModelGeometry
from ...model.layer import DSV4Attention, init_random_weights
from .common import Context, free_cuda
from .report import Result
from .synthetic import fill_layer
from .timing import time_cuda

__all__ = ["scale", "chat", "ChatSizes", "CHAT", "CHAT_QUICK"]


# --- scale ---------------------------------------------------------------------------------------------------
def scale(ctx: Context) -> None:
    from ...model.graph import DecodeGraph

    g = ctx.geometry
    steps = 8
    ctx.log("scale: building all 43 layers (random bf16 weights)")
    layers = [init_random_weights(DSV4Attention(g, i, device=ctx.device), seed=i) for i in range(g.num_layers)]
    weights = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())

    def run(label: str, batch: int, context: int) -> None:
        cache = CacheManager(g, max_requests=batch, max_tokens=batch * context, device=ctx.device,
                             max_seq_len=context)
        allocated_before = torch.cuda.memory_allocated(ctx.device)  # right after the pools were allocated
        rids = [cache.admit() for _ in range(batch)]
        for rid in rids:
            cache.plan_step([(rid, context - steps)])
        for i in range(g.num_layers):
            fill_layer(cache.pools.layers[i], window=g.window, seed=i)
        graph = DecodeGraph(layers, cache, batch=batch, max_seq_len=context)
        x = torch.randn(batch, g.hidden_size, device=ctx.device).bfloat16()
        walls = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = graph.step([(rid, 1) for rid in rids], x)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e6)
        finite = bool(torch.isfinite(out).all())
        replay = time_cuda(graph.graph.replay, device=ctx.device, runs=10, graph=False, warmup=1)
        plan_report = MemoryPlan(cache.spec, context=context).report()
        planned = batch * plan_report["request"]["total_bytes"]
        held = cache.bytes_used
        params = {"batch": batch, "context": context, "layers": g.num_layers}
        ctx.report.add(Result("scale", label, params, replay.median_us, check=f"outputs finite: {finite}",
                              passed=finite,
                              extra={**replay.as_dict(), "step_wall_us": sorted(walls[2:])[len(walls[2:]) // 2],
                                     "tokens_per_s": batch / (replay.median_us * 1e-6),
                                     "held_bytes": held, "planned_bytes": planned, "held_over_planned": held / planned,
                                     # the device tensors of the cache (pools with the allocator's slack blocks,
                                     # windows, states), against the plan: the measured side of the 2% target
                                     "reserved_bytes": cache.bytes_reserved,
                                     "reserved_over_planned": cache.bytes_reserved / planned,
                                     "cuda_allocated_with_cache": allocated_before,  # weights + the cache's tensors
                                     "weights_bytes": weights,
                                     "peak_allocated": torch.cuda.max_memory_allocated(ctx.device)}))
        ctx.log(f"  {label}: step {replay.median_us / 1e3:.2f} ms (graph), held {held / 2**30:.2f} GiB vs planned "
                f"{planned / 2**30:.2f} GiB ({100 * (held / planned - 1):+.2f}%)")
        del cache, graph
        free_cuda()

    run("one request at 2^20 tokens, 43 layers", 1, 1 << 20)
    if not ctx.quick:
        context = 131072
        free, _ = torch.cuda.mem_get_info(ctx.device)
        budget = free - (8 << 30)  # the decode graph's workspace and the allocator's slack
        probe = MemoryPlan(CacheSpec(g), context=context).report()["request"]["total_bytes"]
        batch = int(budget // probe)
        while batch > 1 and _pool_bytes(g, batch, context) > budget:
            batch -= 1
        require(batch >= 1, "scale: not even one 128K request fits")
        ctx.log(f"  {batch} concurrent 128K requests fit in {budget / 2**30:.1f} GiB")
        run(f"{batch} concurrent requests at 131072 tokens, 43 layers", batch, context)


# --- chat: the engine with prefix caching off and on -----------------------------------------------------------
@dataclass(frozen=True)
class ChatSizes:
    shared: int  # system prompt tokens, the same for every request
    suffix: int  # tokens after it, different for each request
    requests: int  # all queued at once
    new_tokens: int  # generated per request, greedy


CHAT = ChatSizes(shared=8192, suffix=1024, requests=64, new_tokens=128)
CHAT_QUICK = ChatSizes(shared=1024, suffix=64, requests=8, new_tokens=16)
CHAT_LOGPROBS = 8  # the timed runs ask for each generated token's top-8 logprobs: the fork gate reads them


def chat(ctx: Context) -> None:
    """Every request is queued at once and served to the end by one engine, with prefix caching off and then on.
    The step budget is the shared prompt: with caching on, the first request computes it in the first step and
    every later admission hits it. On CUDA the model is the demo's demo-gpu (V4-Flash attention geometry, 4 layers,
    bf16, Triton kernels, CUDA-graph decode steps); elsewhere its demo-cpu in fp32. The timed runs ask for each
    generated token's top-CHAT_LOGPROBS logprobs (one log_softmax and top-k in the sampler batch, negligible against
    the model step): the check reads them.

    The check: greedy outputs with caching on against caching off, request by request. A hit is bit-identical only
    to the same step shapes (tests/test_engine_prefix.py), and here the two runs compute the shared prompt in
    different steps; in fp32 (CPU) they agree anyway, in bf16 the tokens may fork: at a near tie, or where one
    computation makes a one-step excursion (on an H100 every bf16 computation of this model, transformers' included,
    strays by 1-2.6 logits at ~5% of positions, one position at a time: MoE routing flips). A request whose tokens
    differ, first at generated token k, passes only when (`engine.reference.judge_fork`)
      (a) before k the runs' top logprobs agree within `reference.HIT_TOL` at all but a quarter of the positions
          (the same context; a wrong hit would show at every one, an excursion at one);
      (b) each run's token at k is the argmax of its own logprobs;
      (c) the fork is a near tie by the fp32 oracle (within twice the larger of transformers' bf16 error and a cold
          caching-off engine's, teacher-forced to the fork: `engine.reference.fork`), or a one-step excursion:
          teacher-forced to the fork, the hit path (an engine with caching on holding the shared prompt) and the
          cold engine agree within HIT_TOL.
    Any other fork refuses both figures. The judging engines are built after the timed ones are freed, and only when
    some request differs."""
    from ..demo import demo_model
    from ...engine import Engine, SamplingParams

    sizes = CHAT_QUICK if ctx.quick else CHAT
    cuda = ctx.device.type == "cuda"
    oracle, model = demo_model("demo-gpu" if cuda else "demo-cpu", ctx.device, seed=0)
    page_tokens = 1024 if cuda else 128
    require(sizes.shared % page_tokens == 0, f"chat: the shared prompt ({sizes.shared}) is not whole blocks")
    gen = torch.Generator().manual_seed(11)
    vocab = model.config.vocab_size
    system = torch.randint(0, vocab, (sizes.shared,), generator=gen).tolist()
    prompts = [system + torch.randint(0, vocab, (sizes.suffix,), generator=gen).tolist()
               for _ in range(sizes.requests)]
    params = SamplingParams(max_new_tokens=sizes.new_tokens, logprobs=CHAT_LOGPROBS)
    longest = sizes.shared + sizes.suffix + sizes.new_tokens
    options = dict(max_requests=sizes.requests, max_tokens=sizes.requests * longest, max_seq_len=longest,
                   page_tokens=page_tokens, step_tokens=sizes.shared)
    # compile every kernel (prefill, a hit, decode steps) before timing: a few short requests, caching on
    warm = Engine.from_transformers(model, prefix_caching=True, **options)
    warm.generate([system[:page_tokens] + p[-8:] for p in prompts[:2]], SamplingParams(max_new_tokens=4))
    del warm
    runs = {}
    for caching in (False, True):
        ctx.log(f"chat: {sizes.requests} requests of {sizes.shared} shared + {sizes.suffix} tokens, "
                f"{sizes.new_tokens} new, prefix caching {'on' if caching else 'off'}")
        runs[caching] = _chat_run(ctx, model, prompts, params, options, caching)
        free_cuda()
    forks = _judge_forks(ctx, oracle, model, prompts, runs, options)
    passed, check = _chat_check(sizes.requests, forks)
    _chat_report(ctx, sizes, page_tokens, runs, passed, check)


def _chat_run(ctx: Context, model, prompts: list[list[int]], params, options: dict, caching: bool) -> tuple:
    """Serve every prompt to the end on a new engine: (outputs, seconds, the engine's stats)."""
    from ...engine import Engine

    engine = Engine.from_transformers(model, prefix_caching=caching, **options)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    return outputs, time.perf_counter() - start, engine.stats


def _judge_forks(ctx: Context, oracle, model, prompts: list[list[int]], runs: dict, options: dict) -> dict:
    """`judge_fork`'s `ForkCheck` of each request whose tokens differ between the runs, by request."""
    from ...engine import Engine
    from ...engine.reference import judge_fork

    differ = [i for i, (a, b) in enumerate(zip(runs[False][0], runs[True][0])) if a.token_ids != b.token_ids]
    if not differ:
        return {}
    # a cold engine with caching off (the runs' options and cache formats: the served path's own logit error, not
    # the hit path under test) and a hot one with caching on that holds the shared prompt (the hit path)
    ctx.log(f"chat: {len(differ)} of {len(prompts)} requests differ; judging where they fork")
    cold = Engine.from_transformers(model, prefix_caching=False, **options)
    hot = Engine.from_transformers(model, prefix_caching=True, **options)
    hot.next_token_logits([prompts[0]])  # publishes its full blocks: the shared prompt
    forks = {i: judge_fork(oracle, model, prompts[i], runs[False][0][i], runs[True][0][i], engine=cold, hot=hot)
             for i in differ}
    del cold, hot
    free_cuda()
    return forks


def _chat_report(ctx: Context, sizes: ChatSizes, page_tokens: int, runs: dict, passed: bool, check: str) -> None:
    """A result per run (caching off, on): time to first token, total time, output tokens/s, hits."""
    cuda = ctx.device.type == "cuda"
    params = {"shared": sizes.shared, "suffix": sizes.suffix, "requests": sizes.requests,
              "new_tokens": sizes.new_tokens, "page_tokens": page_tokens, "step_tokens": sizes.shared}
    for caching in (False, True):
        outputs, seconds, stats = runs[caching]
        ttfts = sorted(o.ttft for o in outputs)
        generated = sum(len(o.token_ids) for o in outputs)
        extra = {"ttft_mean_ms": 1e3 * statistics.fmean(ttfts), "ttft_p50_ms": 1e3 * _quantile(ttfts, 0.5),
                 "ttft_p90_ms": 1e3 * _quantile(ttfts, 0.9), "total_s": seconds,
                 "tokens_per_s": generated / seconds, "output_tokens": generated,
                 "prefill_tokens": stats.prefill_tokens, "steps": stats.steps, "preemptions": stats.preemptions,
                 "hit_rate": stats.prefix_hit_rate, "cached_tokens": sum(o.cached_tokens for o in outputs),
                 "prefix_hits": stats.prefix_hits, "model": "flash-4-layers bf16" if cuda else "tiny fp32"}
        name = f"prefix caching {'on' if caching else 'off'}: {sizes.requests} x ({sizes.shared} + {sizes.suffix})"
        ctx.report.add(Result("chat", name, {**params, "prefix_caching": caching}, seconds * 1e6, check=check,
                              passed=passed, extra=extra))
        ctx.log(f"  caching {'on ' if caching else 'off'}: {seconds:.2f} s, TTFT mean {extra['ttft_mean_ms']:.0f} ms"
                f" p50 {extra['ttft_p50_ms']:.0f} p90 {extra['ttft_p90_ms']:.0f}, {extra['tokens_per_s']:.1f} output "
                f"tokens/s, hit rate {extra['hit_rate']:.3f}, {extra['cached_tokens']} cached tokens; {check}")


def _chat_check(requests: int, forks: dict) -> tuple[bool, str]:
    """The chat check's verdict and text from the `ForkCheck`s of the requests whose tokens differ (by request)."""
    check = f"greedy tokens with caching on equal caching off in {requests - len(forks)} of {requests} requests"
    if not forks:
        return True, check
    ties = [f for f in forks.values() if f.passed and f.fork.near_tie]
    excursions = [f for f in forks.values() if f.passed and not f.fork.near_tie]
    failed = {i: f for i, f in forks.items() if not f.passed}
    parts = [f"{len(ties)} near {'tie' if len(ties) == 1 else 'ties'} by the fp32 oracle"]
    if excursions:
        hit = max(f.fork.hit_error for f in excursions)
        apart = sum(f.outliers for f in excursions)
        parts.append(f"{len(excursions)} one-step {'excursion' if len(excursions) == 1 else 'excursions'} (teacher-"
                     f"forced, the hit path and a cold engine within {hit:.3f} there; before "
                     f"{'it' if len(excursions) == 1 else 'them'} the runs apart at {apart} of "
                     f"{sum(f.fork.position for f in excursions)} tokens)")
    if failed:
        parts.append(f"{len(failed)} refused")
    worst = max(forks.values(), key=lambda f: f.before)
    check += (f"; the {len(forks)} {'fork' if len(forks) == 1 else 'forks'}: {', '.join(parts)}; worst before-fork "
              f"difference {worst.before:.3f} (tolerance {worst.tol} at three quarters of the tokens before a fork)")
    if failed:
        reasons = [f"request {i}: " + "; ".join(f.failures(("caching off", "caching on"))) for i, f in failed.items()]
        check += "; refused: " + " | ".join(reasons)
    return not failed, check


def _quantile(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted values, linear between the two nearest."""
    x = q * (len(ordered) - 1)
    lo = int(x)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (x - lo)


def _pool_bytes(g: ModelGeometry, batch: int, context: int) -> int:
    """The pools' bytes for `batch` requests of `context` tokens (with the allocator's slack blocks)."""
    spec = CacheSpec(g)
    return spec.pool_bytes(spec.blocks_for(batch * context) + batch - 1, batch)
