"""`dsv4kv demo`: a small serving workload through every layer of a geometry, over one paged cache.

Requests with different prompt lengths arrive over time; each step packs the decode tokens of running
requests with chunks of waiting prompts (chunked prefill) under a token budget; finished requests are
released and new ones admitted into their slots. The hidden states are random "embeddings" chained
through the layers with a residual (h <- h + attention(h)); there is no MLP or LM head, so decode inputs
are drawn in advance rather than sampled. At the end: tokens processed, memory held per layer kind
against a dense bf16 cache, and the output difference against transformers' DeepseekV4Attention layers
(same weights, run once over the whole sequence of one request, fp32).
"""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import dataclass, field
from importlib import resources

import torch

from .geometry import ModelGeometry
from .layer import DSV4Attention, init_random_weights
from .manager import CacheManager
from .memory.planner import format_bytes

__all__ = ["Workload", "DemoResult", "run_demo", "default_workload"]


@dataclass(frozen=True)
class Workload:
    preset: str
    prompts: tuple[int, ...]  # prompt length of each request, in arrival order
    decode: int  # tokens decoded by every request after its prompt
    arrival_every: int  # steps between arrivals
    step_tokens: int  # token budget of one step (decode tokens first, then prefill chunks)
    max_requests: int  # live requests at once
    compare_request: int  # index of the request compared with transformers
    page_tokens: int = 1024  # original tokens per block


def default_workload(device: torch.device) -> Workload:
    if device.type == "cuda":
        return Workload("flash", prompts=(1500, 300, 4100, 700, 2300, 129, 3000, 900), decode=32, arrival_every=6,
                        step_tokens=2048, max_requests=4, compare_request=2)
    return Workload("tiny", prompts=(301, 77, 480, 150, 389, 45, 260, 413), decode=32, arrival_every=5,
                    step_tokens=160, max_requests=4, compare_request=2, page_tokens=128)


@dataclass
class _Request:
    index: int
    inputs: torch.Tensor  # [prompt + decode, hidden]: this request's whole input sequence
    prompt: int
    rid: int | None = None
    fed: int = 0
    outputs: list[torch.Tensor] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.fed == self.inputs.shape[0]


@dataclass
class DemoResult:
    workload: Workload
    device: str
    kv_format: str
    indexer_format: str
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    seconds: float = 0.0
    peak_tokens: int = 0
    memory: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # kind -> (layers, held, dense bf16) bytes
    compared_tokens: int = 0
    # worst and median row difference against transformers, relative to the row's max |value|:
    served_diff: tuple[float, float, float] | None = None  # as served (this run's formats): worst, median, <=3%
    exact_diff: tuple[float, float, float] | None = None  # the same request alone through an exact (bf16) cache
    hf_bf16_diff: tuple[float, float, float] | None = None  # transformers itself run in bf16: the rounding floor

    def table(self) -> str:
        w = self.workload
        lines = [f"dsv4kv demo: {w.preset} geometry, {len(w.prompts)} requests, {self.device}, "
                 f"entries {self.kv_format}, indexer keys {self.indexer_format}",
                 f"  steps {self.steps}, prefill tokens {self.prefill_tokens}, decode tokens {self.decode_tokens}, "
                 f"{self.seconds:.1f} s ({(self.prefill_tokens + self.decode_tokens) / self.seconds:.0f} tokens/s, "
                 "PyTorch reference)",
                 f"  memory at the peak ({self.peak_tokens} tokens held):",
                 f"    {'layer kind':<12}{'layers':>7}{'held':>14}{'dense bf16':>14}{'ratio':>8}"]
        for kind, (count, held, dense) in self.memory.items():
            lines.append(f"    {kind:<12}{count:>7}{format_bytes(held):>14}{format_bytes(dense):>14}"
                         f"{held / dense:>8.3f}")
        if self.served_diff is None:
            lines.append("  transformers comparison: skipped (transformers is not installed)")
            return "\n".join(lines)
        lines += [f"  vs transformers DeepseekV4Attention (fp32, one forward) on request {w.compare_request}, "
                  f"{self.compared_tokens} tokens through all layers; row difference / row max:",
                  f"    {'as served':<34} worst {self.served_diff[0]:7.2%}  median {self.served_diff[1]:7.2%}  "
                  f"rows within 3%: {self.served_diff[2]:.0%}",
                  f"    {'alone, exact mode (bf16 cache)':<34} worst {self.exact_diff[0]:7.2%}  "
                  f"median {self.exact_diff[1]:7.2%}  rows within 3%: {self.exact_diff[2]:.0%}",
                  f"    {'transformers itself in bf16':<34} worst {self.hf_bf16_diff[0]:7.2%}  "
                  f"median {self.hf_bf16_diff[1]:7.2%}  rows within 3%: {self.hf_bf16_diff[2]:.0%}"]
        if (self.kv_format, self.indexer_format) != ("bf16", "bf16"):
            lines.append("    (official numerics quantize kv to FP8 and select CSA entries by MXFP4/FP8 scores, which "
                         "transformers does not; see docs/numerics.md)")
        return "\n".join(lines)


class _Progress:
    """A bar on stderr: redrawn in place on a terminal, one line per 10% otherwise (logs stay readable)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.start = total, enabled, time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.printed = -1

    def update(self, done: int, note: str) -> None:
        tenth = 10 * done // self.total
        if not self.enabled or (not self.tty and tenth == self.printed):
            return
        self.printed = tenth
        width = 30
        filled = width * done // self.total
        rate = done / max(time.perf_counter() - self.start, 1e-9)
        line = f"  [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} tokens {rate:6.0f} tok/s  {note}"
        sys.stderr.write(f"\r{line:<100}" if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")


def _with_params(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy with parameters cast to `dtype` and buffers left alone: transformers' rotary tables (inv_freq)
    must stay fp32, and `module.to(bfloat16)` would round them too."""
    module = copy.deepcopy(module)
    for param in module.parameters():
        param.data = param.data.to(dtype)
    return module


def _build_layers(geometry: ModelGeometry, device: torch.device, seed: int):
    """Our bf16 layers, and transformers' fp32 layers with the same (bf16-representable) weights when
    transformers is installed (else None)."""
    try:
        from transformers import DeepseekV4Config
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention
    except ImportError:
        layers = [init_random_weights(DSV4Attention(geometry, i, device=device), seed + i)
                  for i in range(geometry.num_layers)]
        return layers, None
    config = DeepseekV4Config(**json.loads(resources.files("dsv4kv.presets").joinpath(
        f"{geometry.name}.json").read_text()))
    config._attn_implementation = "eager"
    hf_layers, layers = [], []
    for i in range(geometry.num_layers):
        hf = init_random_weights(DeepseekV4Attention(config, i).to(device).eval(), seed + i)
        hf = _with_params(_with_params(hf, torch.bfloat16), torch.float32)  # bf16-representable fp32 weights
        hf_layers.append(hf)
        layers.append(DSV4Attention.from_transformers(_with_params(hf, torch.bfloat16)))
    return layers, (config, hf_layers)


def _transformers_reference(hf, inputs: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' layers over one whole sequence in `dtype`, residual chain like the demo's."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding
    config, hf_layers = hf
    n = inputs.shape[0]
    positions = torch.arange(n, device=inputs.device)[None]
    h = inputs.to(dtype)[None]
    rotary = DeepseekV4RotaryEmbedding(config).to(inputs.device)
    cos_sin = {kind: rotary(h, positions, layer_type=kind) for kind in ("main", "compress")}
    i = torch.arange(n, device=inputs.device)
    allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < config.sliding_window)
    mask = torch.where(allowed, 0.0, float("-inf"))[None, None]
    with torch.no_grad():
        for module in hf_layers:
            layer = module if dtype == torch.float32 else _with_params(module, dtype)
            h = h + layer(h, cos_sin, positions, mask.to(dtype))[0]
    return h[0].float()


def run_demo(*, device: torch.device | str | None = None, workload: Workload | None = None,
             kv_format: str = "fp8", indexer_format: str = "mxfp4", seed: int = 0,
             progress: bool = True) -> DemoResult:
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    workload = workload or default_workload(device)
    geometry = ModelGeometry.preset(workload.preset)
    layers, hf = _build_layers(geometry, device, seed)
    total = sum(workload.prompts) + workload.decode * len(workload.prompts)
    cache = CacheManager(geometry, max_requests=workload.max_requests,
                         max_tokens=workload.max_requests * (max(workload.prompts) + workload.decode),
                         kv_format=kv_format, indexer_format=indexer_format, device=device,
                         page_tokens=workload.page_tokens)
    g = torch.Generator(device=device).manual_seed(seed + 1000)
    requests = [_Request(i, torch.randn(p + workload.decode, geometry.hidden_size, generator=g, device=device)
                         .to(torch.bfloat16), p) for i, p in enumerate(workload.prompts)]
    result = DemoResult(workload, str(device), kv_format, indexer_format)
    waiting, running = list(requests), []
    bar = _Progress(total, progress)
    start = time.perf_counter()
    while waiting or running:
        # admissions: one arrival every `arrival_every` steps, while a slot is free
        if waiting and result.steps % workload.arrival_every == 0 and len(running) < workload.max_requests:
            request = waiting.pop(0)
            request.rid = cache.admit()
            running.append(request)
        batch = _schedule(running, workload.step_tokens)
        if not batch:
            result.steps += 1
            continue
        plan = cache.plan_step([(r.rid, n) for r, n in batch])
        if not plan:
            raise RuntimeError(f"demo: {plan}")  # the cache is sized for the workload: never expected
        h = torch.cat([r.inputs[r.fed:r.fed + n] for r, n in batch])
        with torch.no_grad():
            for layer in layers:
                h = h + layer(h, plan, cache)
        start_row = 0
        for r, n in batch:
            r.outputs.append(h[start_row:start_row + n])
            start_row += n
            if r.fed < r.prompt:
                result.prefill_tokens += n
            else:
                result.decode_tokens += n
            r.fed += n
        if cache.tokens_held > result.peak_tokens:
            result.peak_tokens = cache.tokens_held
            result.memory = _memory_by_kind(cache)
        for r in [r for r in running if r.done]:
            cache.release(r.rid)
            running.remove(r)
        result.steps += 1
        bar.update(result.prefill_tokens + result.decode_tokens,
                   f"step {result.steps}, {cache.num_live_requests} live, {cache.num_used_blocks} blocks")
    if device.type == "cuda":
        torch.cuda.synchronize()
    result.seconds = time.perf_counter() - start
    bar.close()
    if hf is not None:
        request = requests[workload.compare_request]
        want = _transformers_reference(hf, request.inputs)
        result.compared_tokens = want.shape[0]
        result.served_diff = _row_diff(torch.cat(request.outputs), want)
        result.exact_diff = _row_diff(_run_alone(layers, request.inputs, workload.step_tokens), want)
        result.hf_bf16_diff = _row_diff(_transformers_reference(hf, request.inputs, torch.bfloat16), want)
    return result


def _row_diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, float]:
    rows = (got.float() - want).abs().amax(-1) / want.abs().amax(-1)
    return float(rows.max()), float(rows.median()), float((rows <= 0.03).float().mean())


def _run_alone(layers: list[DSV4Attention], inputs: torch.Tensor, chunk: int) -> torch.Tensor:
    """One request through a fresh exact-mode (bf16 entries and keys) cache, in prefill chunks."""
    geometry = layers[0].geometry
    cache = CacheManager(geometry, max_requests=1, max_tokens=inputs.shape[0], kv_format="bf16",
                         indexer_format="bf16", device=inputs.device, page_tokens=128)
    rid, outputs = cache.admit(), []
    with torch.no_grad():
        for start in range(0, inputs.shape[0], chunk):
            h = inputs[start:start + chunk]
            plan = cache.plan_step([(rid, h.shape[0])])
            for layer in layers:
                h = h + layer(h, plan, cache)
            outputs.append(h)
    return torch.cat(outputs)


def _schedule(running: list[_Request], budget: int) -> list[tuple[_Request, int]]:
    """Decode tokens of every running request first, then prefill chunks in arrival order."""
    batch, used = [], 0
    for r in running:
        if r.fed >= r.prompt and not r.done:
            batch.append((r, 1))
            used += 1
    for r in running:
        if r.fed < r.prompt and used < budget:
            n = min(r.prompt - r.fed, budget - used)
            batch.append((r, n))
            used += n
    return batch


def _memory_by_kind(cache: CacheManager) -> dict[str, tuple[int, int, int]]:
    """Per layer kind: bytes held (used blocks' pages + live slots' window and state) and a dense bf16 cache
    of every held token's kv (what an unpaged, uncompressed cache keeps)."""
    out = {}
    live, blocks = cache.num_live_requests, cache.num_used_blocks
    dense_per_layer = cache.tokens_held * cache.geometry.head_dim * 2
    for spec in cache.spec.layers:
        kind = spec.layer.kind.short
        held = blocks * spec.block_bytes + live * spec.request_bytes
        layers, old_held, old_dense = out.get(kind, (0, 0, 0))
        out[kind] = (layers + 1, old_held + held, old_dense + dense_per_layer)
    return out
