"""`dsv4kv demo`: token generation through the engine, checked against transformers.

A random DeepSeek-V4 model (transformers' DeepseekV4ForCausalLM) is served by `dsv4kv.engine.Engine`:
requests with prompts of different lengths arrive over time, steps mix decode tokens with prefill chunks,
and every request decodes greedily. The demo builds one of two models of its own (`DEMO_MODELS`; neither is a
`dsv4kv plan` preset): on a CPU `demo-cpu`, three layers (window, CSA ratio 4, HCA ratio 128; `reference.tiny_config`)
in fp32; on a GPU `demo-gpu`, V4-Flash's attention geometry in bf16 (4 layers: window, CSA, HCA, CSA; V4-Flash's
vocabulary; a reduced MoE of 8 experts x 512 wide, 2 per token, plus the shared expert; `reference.flash_config(4)`).
Printed: the model and its layer kinds, prefill and decode tokens/s, time to first token and inter-token latency,
cache memory per layer kind against a dense bf16 cache at the peak (and why a kind holds more), and how many
generated tokens are transformers' own greedy choice (its fp32 one-shot forward over the same tokens), with the
numerics that ran.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..engine import Engine, SamplingParams
from ..engine.reference import flash_config, random_model, reference_logits, tiny_config, with_dtype
from ..cache.manager import CacheManager
from ..cache.planner import format_bytes
from ..geometry import ModelGeometry

__all__ = ["Workload", "DemoResult", "DemoSetup", "build", "serve", "run_demo", "default_workload", "demo_model",
           "demo_device", "describe_model", "render", "DEMO_MODELS"]

NEAR_TIE = 0.05  # transformers' top-2 logits closer than this count as a tie (docs/engine.md)
DEMO_MODELS = ("demo-cpu", "demo-gpu")  # the demo's own models, named apart from the geometry presets (tiny, ...)


@dataclass(frozen=True)
class Workload:
    model: str  # one of DEMO_MODELS
    prompts: tuple[int, ...]  # prompt lengths, in arrival order
    new_tokens: int  # generated per request (greedy)
    arrival_every: int  # engine steps between arrivals
    step_tokens: int
    max_requests: int
    page_tokens: int
    max_seq_len: int


def default_workload(device: torch.device) -> Workload:
    if device.type == "cuda":
        return Workload("demo-gpu", prompts=(1500, 300, 4100, 700, 2300, 129, 3000, 900), new_tokens=32,
                        arrival_every=3, step_tokens=2048, max_requests=4, page_tokens=256, max_seq_len=8192)
    return Workload("demo-cpu", prompts=(301, 77, 480, 150, 389, 45, 260, 413), new_tokens=24, arrival_every=3,
                    step_tokens=160, max_requests=4, page_tokens=128, max_seq_len=1024)


def demo_model(name: str, device: torch.device | str, *, seed: int = 0):
    """The demo's random model, `(oracle, served)`: transformers' DeepseekV4ForCausalLM in fp32 ("demo-gpu": V4-Flash's
    attention geometry, 4 layers, reduced MoE; "demo-cpu": the three-layer one) and the copy the engine serves: bf16
    on CUDA, the fp32 model itself elsewhere. Every weight is bf16-representable, so both hold the same values."""
    if name not in DEMO_MODELS:
        raise ValueError(f"model: expected one of {DEMO_MODELS}, got {name!r}")
    device = torch.device(device)
    config = flash_config(4) if name == "demo-gpu" else tiny_config()
    oracle = random_model(config, seed=seed, device=device)
    served = with_dtype(oracle, torch.bfloat16) if device.type == "cuda" else oracle
    return oracle, served


def demo_device(device: torch.device | str | None) -> torch.device:
    """The device the demo runs on: None is CUDA when available, else the CPU. Anything but the CPU or an existing
    CUDA device raises ValueError in one line, before any model is built."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda' (or 'cuda:<index>'), got {str(device)!r}")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r}: no CUDA device is available here; run it on the CPU "
                             "(--device cpu, the demo-cpu model)")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: there are {torch.cuda.device_count()} CUDA devices")
    return resolved


def describe_model(name: str, geometry: ModelGeometry, config) -> str:
    """One line: the demo model's name, its layers by kind (with ratios) and sizes; `config` is its transformers
    DeepseekV4Config."""
    kinds = ", ".join(spec.kind.short + (f" ratio {spec.ratio}" if spec.compressed else "") for spec in geometry.layers)
    what = " (V4-Flash attention geometry)" if name == "demo-gpu" else ""
    return (f"{name}{what}: {geometry.num_layers} layers ({kinds}), {geometry.num_heads} heads x {geometry.head_dim}, "
            f"window {geometry.window}, hidden {config.hidden_size}, vocabulary {config.vocab_size}, MoE of "
            f"{config.n_routed_experts} experts x {config.moe_intermediate_size} ({config.num_experts_per_tok} per "
            f"token) + {config.n_shared_experts} shared")


@dataclass
class DemoResult:
    workload: Workload
    device: str
    dtype: str
    kv_format: str
    indexer_format: str
    model: str = ""  # describe_model's line
    backend: str = ""
    graphs: bool = False
    setup_seconds: float = 0.0
    serve_seconds: float = 0.0
    stats: object = None
    requests: list[tuple[int, int, float, float | None, int]] = field(default_factory=list)  # prompt, new, ttft, itl, preemptions
    peak_tokens: int = 0
    peak_live: int = 0  # requests holding a slot at the peak
    # kind -> (layers, held, dense bf16, the part of held that is per-request slots: window rings + compressor state)
    memory: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    agree: int = 0  # generated tokens equal to transformers' argmax
    near_ties: int = 0  # of the others, tokens within NEAR_TIE of it
    compared: int = 0


@dataclass
class DemoSetup:
    """What `build` makes: the engine, the fp32 model it serves a copy of (the oracle), the prompts, and the
    workload and device they were made for."""

    engine: Engine
    oracle: torch.nn.Module
    prompts: list[list[int]]
    workload: Workload
    device: torch.device
    dtype: torch.dtype  # of the served model


def build(*, device: torch.device | str | None = None, workload: Workload | None = None, kv_format: str = "fp8",
          indexer_format: str = "mxfp4", seed: int = 0) -> DemoSetup:
    """The demo's model (demo-cpu on a CPU, demo-gpu: V4-Flash attention geometry in bf16 on a GPU), its engine and
    prompts. A device other than the CPU or an existing CUDA device raises ValueError (`demo_device`)."""
    device = demo_device(device)
    workload = workload or default_workload(device)
    oracle, served = demo_model(workload.model, device, seed=seed)
    engine = Engine.from_transformers(served, max_requests=workload.max_requests,
                                      max_tokens=workload.max_requests * workload.max_seq_len, kv_format=kv_format,
                                      indexer_format=indexer_format, page_tokens=workload.page_tokens,
                                      step_tokens=workload.step_tokens, max_seq_len=workload.max_seq_len)
    g = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(0, oracle.config.vocab_size, (n,), generator=g).tolist() for n in workload.prompts]
    return DemoSetup(engine, oracle, prompts, workload, device, served.lm_head.weight.dtype)


def run_demo(*, device: torch.device | str | None = None, workload: Workload | None = None, kv_format: str = "fp8",
             indexer_format: str = "mxfp4", seed: int = 0, progress: bool = True, compare: bool = True) -> DemoResult:
    start = time.perf_counter()
    setup = build(device=device, workload=workload, kv_format=kv_format, indexer_format=indexer_format, seed=seed)
    engine, oracle, prompts, dtype = setup.engine, setup.oracle, setup.prompts, setup.dtype
    workload, device = setup.workload, setup.device
    result = DemoResult(workload, str(device), str(dtype).replace("torch.", ""), kv_format, indexer_format,
                        model=describe_model(workload.model, engine.model.geometry, oracle.config),
                        backend=engine.backend, graphs=any(g.capture for g in engine.runner.graphs.values()))
    result.setup_seconds = time.perf_counter() - start

    params = SamplingParams(max_new_tokens=workload.new_tokens)
    ids, outputs = [], {}
    generated = 0
    with _progress(progress) as bar:
        # counts generated tokens: a request's last token is never fed back, so tokens through the model would end
        # short of prompts + generated by one per request
        task = bar.add_task("serving", total=workload.new_tokens * len(prompts)) if bar else None
        start = time.perf_counter()
        for steps, step_outputs in serve(engine, prompts, params, workload.arrival_every, ids):
            generated += sum(len(out.new_token_ids) for out in step_outputs)
            if engine.cache.tokens_held > result.peak_tokens:
                result.peak_tokens, result.memory = engine.cache.tokens_held, memory_by_kind(engine.cache)
                result.peak_live = engine.cache.num_live_requests
            if bar:
                bar.update(task, completed=generated,
                           description=f"step {steps}, {engine.cache.num_live_requests} live")
        if device.type == "cuda":
            torch.cuda.synchronize()
        result.serve_seconds = time.perf_counter() - start
    result.stats = engine.stats
    for prompt, rid in zip(prompts, ids):
        out = engine.output(rid)
        outputs[rid] = out
        result.requests.append((len(prompt), len(out.token_ids), out.ttft, out.itl, out.preemptions))
    if compare:
        for prompt, rid in zip(prompts, ids):
            tokens = outputs[rid].token_ids
            rows = reference_logits(oracle, list(prompt) + list(tokens))[len(prompt) - 1:-1]  # row k -> token k
            best = rows.max(-1).values
            chosen = rows.gather(1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0]
            result.agree += int((chosen == best).sum())
            result.near_ties += int(((chosen != best) & (best - chosen <= NEAR_TIE)).sum())
            result.compared += len(tokens)
    return result


def serve(engine: Engine, prompts: list[list[int]], params: SamplingParams, arrival_every: int,
          ids: list[int] | None = None):
    """Serve `prompts` to completion, one arriving every `arrival_every` steps (the first before step 1); yields
    `(steps run, that step's StepOutputs)` after each one. Request ids are appended to `ids` as the requests arrive."""
    ids = [] if ids is None else ids
    added, steps = 0, 0
    while added < len(prompts) or engine.has_unfinished:
        if added < len(prompts) and steps % arrival_every == 0:
            ids.append(engine.add_request(prompts[added], params))
            added += 1
        outputs = engine.step()
        steps += 1
        yield steps, outputs


def memory_by_kind(cache: CacheManager) -> dict[str, tuple[int, int, int, int]]:
    """Per layer kind: layers, bytes held (used blocks' pages + live slots' window and state), what a dense bf16
    cache of every held token's kv would take, and the part of held that is the live slots' (fixed per request,
    whatever its length)."""
    out = {}
    live, blocks = cache.num_live_requests, cache.num_used_blocks
    dense_per_layer = cache.tokens_held * cache.geometry.head_dim * 2
    for spec in cache.spec.layers:
        kind = spec.layer.kind.short
        layers, held, dense, fixed = out.get(kind, (0, 0, 0, 0))
        out[kind] = (layers + 1, held + blocks * spec.block_bytes + live * spec.request_bytes, dense + dense_per_layer,
                     fixed + live * spec.request_bytes)
    return out


class _progress:
    """A rich progress bar on stderr (None when disabled)."""

    def __init__(self, enabled: bool):
        self.enabled, self.bar = enabled, None

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("tokens generated"), TimeElapsedColumn(), console=Console(stderr=True),
                                transient=False)
            self.bar.__enter__()
        return self.bar

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)


def render(result: DemoResult, console=None) -> None:
    """Print the result as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    w, s = result.workload, result.stats
    console.print(f"[bold]dsv4kv demo[/bold], model {result.model}; random weights in {result.dtype} on "
                  f"{result.device}")
    console.print(f"attention: {result.backend}"
                  + (", decode steps replayed from CUDA graphs" if result.graphs else ", every step eager")
                  + f"; cache entries {result.kv_format}, indexer keys {result.indexer_format}; "
                  f"{len(w.prompts)} requests, step budget {w.step_tokens} tokens, {w.max_requests} slots")
    decode_tokens_alone = s.decode_tokens - (s.tokens_in_prefill_steps - s.prefill_tokens)
    t = Table(title="throughput (wall time of the steps, host included)")
    for col in ("steps", "count", "tokens", "seconds", "tokens/s"):
        t.add_column(col, justify="right" if col != "steps" else "left")
    t.add_row("with prefill", str(s.steps - s.decode_steps), str(s.tokens_in_prefill_steps),
              f"{s.prefill_seconds:.2f}", f"{s.tokens_in_prefill_steps / max(s.prefill_seconds, 1e-9):,.0f}")
    t.add_row("decode only", str(s.decode_steps), str(decode_tokens_alone), f"{s.decode_seconds:.2f}",
              f"{decode_tokens_alone / max(s.decode_seconds, 1e-9):,.0f}")
    console.print(t)
    ttfts = [r[2] for r in result.requests]
    itls = [r[3] for r in result.requests if r[3] is not None]
    console.print(f"time to first token: mean {sum(ttfts) / len(ttfts) * 1e3:,.0f} ms, max {max(ttfts) * 1e3:,.0f} ms"
                  f" (from arrival, queueing included); inter-token latency: mean "
                  f"{sum(itls) / max(len(itls), 1) * 1e3:,.1f} ms; preemptions {s.preemptions}; "
                  f"setup {result.setup_seconds:.1f} s, serving {result.serve_seconds:.1f} s")
    m = Table(title=f"cache memory at the peak ({result.peak_tokens:,} tokens held, {w.page_tokens}-token pages)")
    for col in ("layer kind", "layers", "held", "dense bf16", "ratio"):
        m.add_column(col, justify="left" if col == "layer kind" else "right")
    for kind, (count, held, dense, _) in result.memory.items():
        m.add_row(kind, str(count), format_bytes(held), format_bytes(dense), f"{held / dense:.3f}")
    console.print(m)
    for line in _memory_notes(result):
        console.print(line)
    if result.compared:
        others = result.compared - result.agree
        console.print(f"greedy agreement with transformers (fp32, one forward over the same tokens), "
                      f"{_numerics(result.kv_format, result.indexer_format)}: [bold]{result.agree} of "
                      f"{result.compared}[/bold] tokens are its argmax; of the other {others}, {result.near_ties} "
                      f"are within {NEAR_TIE} of its best logit (near ties)")


def _memory_notes(result: DemoResult) -> list[str]:
    """One line per layer kind holding more than a dense bf16 cache at the peak: its fixed per-request bytes."""
    notes = []
    for kind, (_, held, dense, fixed) in result.memory.items():
        if held > dense:
            live = max(result.peak_live, 1)
            notes.append(f"  {kind} ratio above 1: its fixed per-request state (window ring + fp32 compressor state, "
                         f"{format_bytes(fixed // live)} x {result.peak_live} live requests = {format_bytes(fixed)} of "
                         f"{format_bytes(held)}) dominates at these short lengths; long contexts amortize it")
    return notes


def _numerics(kv_format: str, indexer_format: str) -> str:
    """Which numerics ran, and what they mean for the agreement with transformers."""
    if (kv_format, indexer_format) == ("bf16", "bf16"):
        return "exact mode (bf16 cache entries and indexer keys)"
    which = "official numerics" if (kv_format, indexer_format) == ("fp8", "mxfp4") else "quantized numerics"
    return (f"{which} ({kv_format} cache entries, {indexer_format} indexer keys, which transformers does not model: "
            f"fewer agree by design; --kv-format bf16 --indexer-format bf16 is the exact mode)")
