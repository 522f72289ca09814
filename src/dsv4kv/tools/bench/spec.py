"""`dsv4kv bench spec`: speculative decoding (docs/speculative-decoding.md).

Two parts:

- the verify step's attention core: a CSA layer's core over a step of 4 query tokens per request (the newest token
  and 3 drafts, planned tentative) against a 1-token decode step, batch 1, 4 and 16 at 128K context (V4-Flash, FP8
  entries, MXFP4 indexer keys; the history synthetic as in the `decode` workload), each checked against the PyTorch
  reference first (`common.check_layer`);
- the engine on the demo's model (demo-gpu: V4-Flash attention geometry, 4 layers, bf16, Triton kernels, CUDA-graph
  decode and verify steps): decode tokens/s without speculation and with each drafter, the acceptance length (tokens a
  request gains per verify step) and the mean engine step. The prompts repeat a random segment, the n-gram drafter's
  kind of workload. `replay` is a drafter for measurement only: it proposes the greedy continuation plain decoding
  produced, correct for a set number of drafts per step and wrong after them, so the speed at a controlled
  acceptance length is measured (the target: >= 2x plain decoding at >= 2.5 accepted tokens a step). The MTP drafter
  needs a checkpoint's MTP layer; the demo model (transformers' DeepseekV4ForCausalLM) has none, and the report
  says so.

Every speculative run's greedy tokens are compared with plain decoding's, request by request; a request that
differs passes only where the fp32 oracle calls the fork a near tie (`engine.reference.fork`: the verify step's
bf16 GEMMs have other shapes than a decode step's). With --quick on a CPU it runs the tiny model and a tiny
geometry (the reference layer timed by the host clock): a check that it runs, not a figure.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ...cache.manager import CacheManager
from ...checks import require
from ...engine.drafters import Drafter
from ...geometry import ModelGeometry
from ...model.layer import DSV4Attention, init_random_weights
from .common import Context, check_layer, free_cuda, kernel_stage, layer_index
from .report import Result
from .synthetic import fill_layer
from .timing import profile_kernels, time_cuda

__all__ = ["spec", "ReplayDrafter", "SpecSizes", "SPEC", "SPEC_QUICK", "SPEC_CPU"]

VERIFY_ROWS = 4  # query tokens per request in the timed verify step: the newest token and 3 drafts


@dataclass(frozen=True)
class SpecSizes:
    context: int  # the verify core's context
    core_batches: tuple[int, ...]
    requests: tuple[int, ...]  # engine batch sizes (all requests queued at once)
    segment: int  # each prompt is a random segment of this many tokens, repeated
    repeats: int
    new_tokens: int  # generated per request, greedy
    draft_tokens: int  # k
    replay: tuple[tuple[int, ...], ...]  # replay patterns: correct drafts per step, cycled


SPEC = SpecSizes(context=131072, core_batches=(1, 4, 16), requests=(1, 4), segment=64, repeats=8, new_tokens=128,
                 draft_tokens=3, replay=((0,), (1, 2), (3,)))
SPEC_QUICK = SpecSizes(context=131072, core_batches=(1, 16), requests=(4,), segment=64, repeats=4, new_tokens=64,
                       draft_tokens=3, replay=((1, 2), (3,)))
SPEC_CPU = SpecSizes(context=512, core_batches=(1, 2), requests=(2,), segment=8, repeats=3, new_tokens=8,
                     draft_tokens=3, replay=((1, 2),))


def spec(ctx: Context) -> None:
    cuda = ctx.device.type == "cuda"
    sizes = (SPEC_QUICK if ctx.quick else SPEC) if cuda else SPEC_CPU
    _verify_core(ctx, sizes)
    if cuda:
        free_cuda()
    _engine_runs(ctx, sizes)


# --- the verify step's attention core ---------------------------------------------------------------------------
def _verify_core(ctx: Context, sizes: SpecSizes) -> None:
    cuda = ctx.device.type == "cuda"
    g = ctx.geometry if cuda else ModelGeometry.preset("tiny")
    i = layer_index(g, "csa")
    context = sizes.context
    for batch in sizes.core_batches:
        ctx.log(f"spec: CSA core, verify step of {VERIFY_ROWS} tokens vs a decode step, batch {batch}, context "
                f"{context}")
        cache = CacheManager(g, max_requests=batch, max_tokens=batch * (context + VERIFY_ROWS), device=ctx.device,
                             max_seq_len=context + VERIFY_ROWS)
        rids = [cache.admit() for _ in range(batch)]
        for rid in rids:
            cache.plan_step([(rid, context - 1)])  # the history: blocks allocated, contents filled below
        fill_layer(cache.pools.layers[i], window=g.window, seed=i)
        layer = init_random_weights(DSV4Attention(g, i, device=ctx.device), seed=i)
        gen = torch.Generator(device=ctx.device).manual_seed(batch)
        times, checks = {}, {}
        for rows in (VERIFY_ROWS, 1):  # the verify step first, rolled back: the decode step sees the same history
            buffers = cache.step_buffers(max_tokens=batch * rows, max_requests=batch,
                                         max_seq_len=context + VERIFY_ROWS)
            step = [(rid, rows) for rid in rids]
            plan = (cache.plan_step(step, buffers=buffers, tentative=True) if rows > 1
                    else cache.plan_step(step, buffers=buffers))
            x = torch.randn(batch * rows, g.hidden_size, generator=gen, device=ctx.device).to(layer.q_a_proj.weight)
            times[rows], checks[rows] = _time_core(ctx, cache, layer, plan, x)
            if rows > 1:
                for rid in rids:
                    cache.accept(rid, 0)
        ratio = times[VERIFY_ROWS] / times[1]
        passed = all(p for _, p in checks.values())
        params = {"kind": "csa", "context": context, "batch": batch, "verify_rows": VERIFY_ROWS}
        timer = "CUDA graph" if cuda else "host clock, the reference layer (no kernels on a CPU)"
        for rows, what in ((VERIFY_ROWS, f"verify ({VERIFY_ROWS} tokens/request)"), (1, "decode")):
            ctx.report.add(Result("spec", f"CSA core {what}, {context} b{batch}", {**params, "rows": rows},
                                  times[rows], check=checks[rows][0], passed=passed,
                                  extra={"verify_over_decode": ratio, "timer": timer}))
        ctx.log(f"  verify {times[VERIFY_ROWS]:.1f} us, decode {times[1]:.1f} us: {ratio:.2f}x ({timer}); "
                f"{checks[VERIFY_ROWS][0]}")
        del cache, layer
        if cuda:
            free_cuda()


def _time_core(ctx: Context, cache: CacheManager, layer: DSV4Attention, plan, x) -> tuple[float, tuple[str, bool]]:
    """The layer's attention core over `plan` (CUDA graph replays; on a CPU the reference layer by the host clock),
    after the kernels' check against the reference: (median us, (check text, passed))."""
    pages = cache.pages(layer.layer_index)
    if ctx.device.type != "cuda":
        walls = []
        for _ in range(3):
            plan.layer_plans.clear()
            t0 = time.perf_counter()
            layer.run(x, plan, pages, backend="torch")
            walls.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(walls), ("not checked: the kernels need a GPU (the reference layer timed)", True)
    check = check_layer(layer, x, plan, cache, "layer vs reference")
    projected = layer.project(x, plan.positions)
    attn = layer.attention_plan(plan, pages, "triton")
    core = lambda: layer.attention_core(projected, attn, pages)  # noqa: E731
    timing = time_cuda(core, device=ctx.device, runs=ctx.runs)
    by_stage: dict[str, float] = {}
    for name, us in profile_kernels(core, device=ctx.device):
        by_stage[kernel_stage(name)] = by_stage.get(kernel_stage(name), 0.0) + us
    ctx.log(f"    {plan.num_tokens} rows: " + ", ".join(f"{stage} {us:.1f}" for stage, us in by_stage.items())
            + " us (kernel time by stage; two streams overlap)")
    return timing.median_us, check


# --- the engine -------------------------------------------------------------------------------------------------
class ReplayDrafter(Drafter):
    """For measurement only: proposes a known greedy continuation of each prompt, the first `pattern[i]` drafts of
    its i-th verify correct (the pattern cycled) and the rest wrong (the correct token + 1), so the acceptance length
    is 1 + the pattern's mean wherever the engine's greedy tokens follow the continuation. A request that left it
    (a fork) gets no drafts."""

    name = "replay"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], pattern: tuple[int, ...], vocab: int):
        self.continuations, self.pattern, self.vocab = continuations, pattern, vocab
        self._calls: dict[int, int] = {}
        self._lengths = sorted({len(p) for p in continuations})

    def propose(self, requests):
        out = []
        for r in requests:
            tokens = list(r.tokens)
            n = next((n for n in self._lengths if tuple(tokens[:n]) in self.continuations), None)
            known = self.continuations[tuple(tokens[:n])] if n is not None else None
            if known is None or known[:len(tokens) - n] != tokens[n:]:
                out.append([])
                continue
            call = self._calls.get(r.request_id, 0)
            self._calls[r.request_id] = call + 1
            correct = self.pattern[call % len(self.pattern)]
            ahead = known[len(tokens) - n:len(tokens) - n + r.max_drafts]
            out.append([t if j < correct else (t + 1) % self.vocab for j, t in enumerate(ahead)])
        return out

    def release(self, request_id: int) -> None:
        self._calls.pop(request_id, None)


def _engine_runs(ctx: Context, sizes: SpecSizes) -> None:
    from ..demo import demo_model

    cuda = ctx.device.type == "cuda"
    name = "demo-gpu" if cuda else "demo-cpu"
    oracle, model = demo_model(name, ctx.device, seed=0)
    vocab = model.config.vocab_size
    ctx.log(f"spec: the engine on {name}; mtp not measured: the demo model is transformers' DeepseekV4ForCausalLM, "
            "which has no MTP layer (a checkpoint's is served by Engine.from_pretrained(path, speculative='mtp'))")
    ctx.report.add(Result("spec", "mtp drafter", {"drafter": "mtp"}, None,
                          check="not measured: the demo model has no MTP layer (mtp.* weights); transformers' "
                                "DeepseekV4ForCausalLM drops them"))
    for batch in sizes.requests:
        gen = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(0, vocab, (sizes.segment,), generator=gen).tolist() * sizes.repeats
                   for _ in range(batch)]
        longest = sizes.segment * sizes.repeats + sizes.new_tokens + sizes.draft_tokens + 1
        options = dict(max_requests=batch, max_tokens=batch * longest, max_seq_len=longest,
                       page_tokens=256 if cuda else 128, step_tokens=max(batch * sizes.segment * sizes.repeats, 256))
        runs = {"plain": _serve(ctx, model, prompts, sizes, options, None)}
        continuations = {tuple(p): list(o.token_ids) for p, o in zip(prompts, runs["plain"][0])}
        drafters = [("ngram", "ngram")] + [(f"replay {'/'.join(map(str, p))} correct", ReplayDrafter(
            continuations, p, vocab)) for p in sizes.replay]
        for label, drafter in drafters:
            runs[label] = _serve(ctx, model, prompts, sizes, options, drafter)
            if cuda:
                free_cuda()
        _engine_report(ctx, oracle, model, prompts, sizes, options, batch, runs)


def _serve(ctx: Context, model, prompts, sizes: SpecSizes, options: dict, speculative) -> tuple:
    """Serve the prompts on a new engine after a warm-up (the kernels compiled, the graphs captured): (outputs, the
    decode steps' seconds, the stats of the timed run)."""
    from ...engine import Engine, EngineStats, SamplingParams

    kwargs = dict(speculative=speculative, draft_tokens=sizes.draft_tokens) if speculative is not None else {}
    engine = Engine.from_transformers(model, **options, **kwargs)
    params = SamplingParams(max_new_tokens=sizes.new_tokens)
    # warm-up on the same prompts (drafts, so the verify steps' kernels compile and their graphs are captured too)
    engine.generate(prompts, SamplingParams(max_new_tokens=2 + 2 * sizes.draft_tokens))
    engine.stats = EngineStats()
    outputs = engine.generate(prompts, params)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    stats = engine.stats
    del engine
    return outputs, stats


def _engine_report(ctx: Context, oracle, model, prompts, sizes: SpecSizes, options: dict, batch: int,
                   runs: dict) -> None:
    plain_outputs, plain = runs["plain"]
    plain_rate = plain.decode_tokens / plain.decode_seconds
    for label, (outputs, stats) in runs.items():
        rate = stats.decode_tokens / stats.decode_seconds
        check, passed = _token_check(ctx, oracle, model, prompts, plain_outputs, outputs, options) \
            if label != "plain" else ("the baseline", True)
        step_us = 1e6 * stats.decode_seconds / stats.decode_steps
        # the steps that verified drafts alone: a request that forked from the replayed continuation (a near tie
        # under the verify step's other GEMM shapes) gets no drafts after it, and its plain steps would dilute the
        # figure with steps that are not speculative
        verify_rate = stats.tokens_in_verify_steps / stats.verify_seconds if stats.verify_seconds else None
        extra = {"decode_tokens_per_s": rate, "speedup": rate / plain_rate,
                 "verify_steps": stats.verify_steps, "verify_step_us": 1e6 * stats.verify_seconds / stats.verify_steps
                 if stats.verify_steps else None, "verify_tokens_per_s": verify_rate,
                 "verify_speedup": verify_rate / plain_rate if verify_rate else None,
                 "acceptance_length": stats.acceptance_length, "acceptance_rate": stats.acceptance_rate,
                 "draft_tokens": stats.draft_tokens, "accepted_tokens": stats.accepted_tokens,
                 "verifies": stats.verifies, "decode_steps": stats.decode_steps, "graph_steps": stats.graph_steps,
                 "decode_step_us": step_us, "decode_tokens": stats.decode_tokens,
                 "model": "flash-4-layers bf16" if ctx.device.type == "cuda" else "tiny fp32"}
        params = {"drafter": label.split()[0], "label": label, "requests": batch, "draft_tokens": sizes.draft_tokens,
                  "new_tokens": sizes.new_tokens, "prompt": sizes.segment * sizes.repeats}
        ctx.report.add(Result("spec", f"{label}, batch {batch}", params, step_us, check=check, passed=passed,
                              extra=extra))
        if verify_rate:
            ctx.log(f"  {label}, batch {batch}: over its {stats.verify_steps} verify steps {verify_rate:.0f} decode "
                    f"tokens/s ({verify_rate / plain_rate:.2f}x plain), {extra['verify_step_us'] / 1e3:.2f} ms a step")
        ctx.log(f"  {label}, batch {batch}: {rate:.0f} decode tokens/s ({rate / plain_rate:.2f}x), acceptance length "
                f"{stats.acceptance_length:.2f}, engine step {step_us / 1e3:.2f} ms ({stats.graph_steps} of "
                f"{stats.decode_steps} from graphs); {check}")


def _token_check(ctx: Context, oracle, model, prompts, plain, outputs, options: dict) -> tuple[str, bool]:
    """Greedy tokens with speculation against plain decoding: equal, or forks the fp32 oracle calls near ties
    (teacher-forced to the fork, within twice the larger of transformers' bf16 error and a plain engine's)."""
    from ...engine import Engine
    from ...engine.reference import fork

    differ = [i for i, (a, b) in enumerate(zip(plain, outputs)) if a.token_ids != b.token_ids]
    text = f"greedy tokens equal plain decoding's in {len(prompts) - len(differ)} of {len(prompts)} requests"
    if not differ:
        return text, True
    cold = Engine.from_transformers(model, **options)
    forks = [fork(oracle, model, prompts[i], list(plain[i].token_ids), list(outputs[i].token_ids), engine=cold)
             for i in differ]
    del cold
    ties = sum(f.near_tie for f in forks)
    require(all(f is not None for f in forks), "spec: a request differs in length only")
    text += f"; {ties} of {len(forks)} forks near ties by the fp32 oracle"
    return text, ties == len(forks)
