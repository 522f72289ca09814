"""Where an engine step's time goes (issue 13): the demo's model and workload, step by step.

    python scripts/engine_profile.py --out DIR          # on the GPU: V4-Flash attention geometry, bf16, CUDA graphs

Builds the model, engine and prompts exactly as `dsv4kv demo` does (`dsv4kv.demo.build`, `dsv4kv.demo.serve`),
serves the workload and prints one line per step: its kind (prefill / mixed / decode; eager, or a decode graph's
warm-up / capture / replay), wall ms (synchronized), the Triton compilations it paid (Triton's jit hooks: count,
ms, which kernels) and its tokens. Then a few short requests are served until their decode steps replay a
graph, and two such steady-state decode steps run under torch.profiler: the top 15 ops by self CPU time and
by CUDA time. Everything printed is also written under --out (default $OUT): steps.tsv, compiles.tsv,
summary.txt, profile_cpu.txt, profile_cuda.txt, trace.json.

On a CPU (no kernels: the tiny model on the PyTorch reference path) it runs too, for a smoke test:
    python scripts/engine_profile.py --device cpu --requests 2 --new-tokens 2 --out /tmp/profile
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "engine_profile_out"),
                   help="folder for the outputs (default $OUT, else ./engine_profile_out)")
    p.add_argument("--device", default=None, help="default: cuda when available")
    p.add_argument("--kv-format", default="fp8")
    p.add_argument("--indexer-format", default="mxfp4")
    p.add_argument("--requests", type=int, default=None, help="serve only the first N of the demo's prompts")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per request (default the demo's)")
    p.add_argument("--profile-batch", type=int, default=None,
                   help="requests decoding together in the profiled steps (default the engine's max_requests)")
    return p.parse_args(argv)


class Compiles:
    """Triton compilations, from its jit hooks: the cache hook runs just before a compilation, the post-compile
    hook just after. Falls back to counting the kernels' caches where the hooks are missing."""

    def __init__(self):
        self.events: list[tuple[str, float, str]] = []  # kernel, ms, Triton's repr of the specialization
        self._started: dict = {}
        self.hooks = False

    @contextlib.contextmanager
    def installed(self):
        try:
            from triton import knobs
            runtime = knobs.runtime
            saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        except (ImportError, AttributeError):
            yield self
            return

        def before(*args, **kw):
            self._started[_hook_name(kw)] = time.perf_counter()
            return False  # compile as usual

        def after(*args, **kw):
            name = _hook_name(kw)
            began = self._started.pop(name, None)
            ms = (time.perf_counter() - began) * 1e3 if began is not None else float("nan")
            self.events.append((name, ms, str(kw.get("repr", ""))))

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
        self.hooks = True
        try:
            yield self
        finally:
            runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved


def _hook_name(kw) -> str:
    fn = kw.get("fn")
    return getattr(fn, "name", None) or str(kw.get("key", "?"))[:40]


def cached_kernels() -> int:
    """Compiled variants held by dsv4kv's kernels (every device): the fallback count."""
    from dsv4kv.ops.shared.specialization import jit_kernels

    total = 0
    for kernel in jit_kernels().values():
        for caches in getattr(kernel, "device_caches", {}).values():
            total += len(caches[0])
    return total


@dataclasses.dataclass
class Step:
    index: int
    kind: str  # prefill, mixed, decode
    path: str  # eager, or graph-<size>-warmup / capture / replay
    ms: float
    tokens: int
    requests: int
    compiles: int
    compile_ms: float
    kernels: str


def classify(engine, before) -> tuple[str, str]:
    s = engine.stats
    if s.decode_steps == before["decode_steps"]:
        riding = (s.decode_tokens - before["decode_tokens"]) > 0
        return ("mixed" if riding else "prefill"), "eager"
    for size, graph in engine.runner.graphs.items():
        ran = before["graph_steps"][size]
        if graph.steps != ran:
            phase = "padded" if not graph.capture else "warmup" if ran == 0 else "capture" if ran == 1 else "replay"
            return "decode", f"graph-{size}-{phase}"
    return "decode", "eager"


def timed_steps(engine, steps_iter, compiles: Compiles, sync, log) -> list[Step]:
    """Runs the engine's steps (the iterator advances one step per item), timing each."""
    out = []
    while True:
        s = engine.stats
        before = dict(decode_steps=s.decode_steps, decode_tokens=s.decode_tokens,
                      tokens=s.prefill_tokens + s.decode_tokens,
                      graph_steps={b: g.steps for b, g in engine.runner.graphs.items()})
        events, cached = len(compiles.events), (None if compiles.hooks else cached_kernels())
        live = engine.cache.num_live_requests
        sync()
        start = time.perf_counter()
        try:
            next(steps_iter)
        except StopIteration:
            return out
        sync()
        ms = (time.perf_counter() - start) * 1e3
        kind, path = classify(engine, before)
        new = compiles.events[events:]
        count = len(new) if compiles.hooks else cached_kernels() - cached
        names = sorted({name for name, _, _ in new})
        step = Step(engine.stats.steps, kind, path, ms, engine.stats.prefill_tokens + engine.stats.decode_tokens
                    - before["tokens"], max(live, engine.cache.num_live_requests), count,
                    sum(m for _, m, _ in new), ",".join(names))
        out.append(step)
        log(f"step {step.index:4d}  {step.kind:7s} {step.path:22s} {step.ms:9.1f} ms  {step.tokens:5d} tokens  "
            f"{step.compiles:3d} compiles ({step.compile_ms:8.1f} ms)  {step.kernels}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        print("no CUDA device: the tiny model on the PyTorch reference path (no Triton kernels run)", file=sys.stderr)
    from dsv4kv.tools.demo import build, default_workload, serve
    from dsv4kv.engine import SamplingParams

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def log(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    workload = default_workload(device)
    if args.requests is not None:
        workload = dataclasses.replace(workload, prompts=workload.prompts[:args.requests])
    if args.new_tokens is not None:
        workload = dataclasses.replace(workload, new_tokens=args.new_tokens)

    start = time.perf_counter()
    compiles = Compiles()
    with compiles.installed():
        setup = build(device=device, workload=workload, kv_format=args.kv_format, indexer_format=args.indexer_format)
        engine = setup.engine
        sync()
        log(f"device {torch.cuda.get_device_name(device) if cuda else 'cpu'}; torch {torch.__version__}; triton "
            f"{_triton_version()}; attention: {engine.backend}; decode graphs {sorted(engine.runner.graphs)} "
            f"(captured: {any(g.capture for g in engine.runner.graphs.values())}); {workload}")
        log(f"setup {time.perf_counter() - start:.1f} s; Triton compile hooks: {compiles.hooks}")
        params = SamplingParams(max_new_tokens=workload.new_tokens)
        serve_start = time.perf_counter()
        steps = timed_steps(engine, serve(engine, setup.prompts, params, workload.arrival_every), compiles, sync, log)
        serve_s = time.perf_counter() - serve_start

        # steady state: short requests decoding together until their steps replay a graph
        batch = args.profile_batch or engine.cache.max_requests
        g = torch.Generator().manual_seed(7)
        vocab = engine.model.vocab_size
        for _ in range(batch):
            engine.add_request(torch.randint(0, vocab, (64,), generator=g).tolist(), SamplingParams(max_new_tokens=64))
        warm = timed_steps(engine, _steps(engine, 6), compiles, sync, log)
        profiled = _profile(engine, out_dir, cuda, sync, log)
        while engine.has_unfinished:
            engine.step()

    _summary(steps, warm, serve_s, compiles, log)
    _write_tsv(out_dir / "steps.tsv", steps + warm)
    with open(out_dir / "compiles.tsv", "w") as f:
        f.write("kernel\tms\tspecialization\n")
        for name, ms, rep in compiles.events:
            f.write(f"{name}\t{ms:.1f}\t{rep}\n")
    (out_dir / "summary.txt").write_text("\n".join(lines) + "\n")
    log(f"wrote {out_dir}/ (steps.tsv, compiles.tsv, summary.txt{', ' + profiled if profiled else ''})")
    return 0


def _steps(engine, n):
    for _ in range(n):
        engine.step()
        yield


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return "absent"


def _profile(engine, out_dir: Path, cuda: bool, sync, log) -> str:
    """Two decode steps under torch.profiler; the top 15 by self CPU time and by CUDA time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with profile(activities=activities, record_shapes=False) as prof:
        for _ in range(2):
            engine.step()
        sync()
    table = prof.key_averages()
    cpu = table.table(sort_by="self_cpu_time_total", row_limit=15)
    log("\ntwo steady-state decode steps, top 15 by self CPU time:\n" + cpu)
    (out_dir / "profile_cpu.txt").write_text(cpu)
    written = "profile_cpu.txt"
    if cuda:
        gpu = table.table(sort_by="cuda_time_total", row_limit=15)
        log("\ntop 15 by CUDA time:\n" + gpu)
        (out_dir / "profile_cuda.txt").write_text(gpu)
        written += ", profile_cuda.txt"
    prof.export_chrome_trace(str(out_dir / "trace.json"))
    return written + ", trace.json"


def _summary(steps: list[Step], warm: list[Step], serve_s: float, compiles: Compiles, log) -> None:
    log("\nsummary (the demo's workload):")
    for kind in ("prefill", "mixed", "decode"):
        chosen = [s for s in steps if s.kind == kind]
        if chosen:
            ms = sum(s.ms for s in chosen)
            tokens = sum(s.tokens for s in chosen)
            log(f"  {kind:7s} {len(chosen):4d} steps  {ms / 1e3:7.2f} s  {tokens:6d} tokens  "
                f"{tokens / max(ms / 1e3, 1e-9):9.1f} tokens/s  {sum(s.compiles for s in chosen):4d} compiles "
                f"({sum(s.compile_ms for s in chosen) / 1e3:.1f} s)")
    replays = [s.ms for s in steps + warm if s.path.endswith("replay")]
    if replays:
        replays.sort()
        log(f"  graph replays: {len(replays)}, median {replays[len(replays) // 2]:.1f} ms, max {replays[-1]:.1f} ms")
    later = [s for s in steps[len(steps) // 2:] if s.compiles]
    log(f"  serving {serve_s:.1f} s; compilations {len(compiles.events) if compiles.hooks else sum(s.compiles for s in steps)}"
        f" in all, {sum(s.compiles for s in later)} in the second half of the steps")


def _write_tsv(path: Path, steps: list[Step]) -> None:
    fields = [f.name for f in dataclasses.fields(Step)]
    with open(path, "w") as f:
        f.write("\t".join(fields) + "\n")
        for s in steps:
            f.write("\t".join(f"{getattr(s, k):.2f}" if isinstance(getattr(s, k), float) else str(getattr(s, k))
                              for k in fields) + "\n")


if __name__ == "__main__":
    sys.exit(main())
