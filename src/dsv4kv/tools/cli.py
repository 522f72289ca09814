"""Command line: `dsv4kv plan` (memory planner), `dsv4kv demo` (token generation through the engine) and
`dsv4kv bench` (GPU benchmarks)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..geometry import PRESET_NOTES, PRESETS, GeometryError, LayerKind, ModelGeometry
from ..cache.layout import IndexerFormat, KVFormat
from ..cache.planner import MemoryPlan, parse_bytes
from ..cache.spec import DEFAULT_PAGE_TOKENS, CacheSpec


def _plan(args: argparse.Namespace) -> int:
    geometry = ModelGeometry.from_hf_config(args.model)
    spec = CacheSpec(geometry, args.kv_format, args.indexer_format, args.page_tokens)
    plan = MemoryPlan(spec, context=args.context, memory=parse_bytes(args.memory))
    print(json.dumps(plan.report(), indent=2) if args.json else plan.table())
    return 0


def _demo(args: argparse.Namespace) -> int:
    import torch

    from .demo import demo_device, render, run_demo  # imports the engine and transformers only when asked

    device = demo_device(args.device)  # a device that cannot run refuses here, in one line
    if device.type == "cpu" and not torch.cuda.is_available():
        # the demo-cpu model's ops are too small to gain from threads, and spinning threads slow it several times
        # over when other processes share the cores
        torch.set_num_threads(1)

    result = run_demo(device=device, kv_format=args.kv_format, indexer_format=args.indexer_format,
                      seed=args.seed, progress=not args.no_progress, compare=not args.no_compare)
    render(result)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import QUICK, WORKLOADS, plot_report, run_bench

    if args.plot:
        with open(args.plot) as f:
            written = plot_report(json.load(f), args.out)
        print("\n".join(written) if written else "no plots written (is matplotlib installed?)")
        return 0
    workloads = args.workloads or (list(QUICK) if args.quick else list(WORKLOADS))
    report = run_bench(workloads, out_dir=args.out, name=args.name, quick=args.quick, runs=args.runs,
                       device=args.device)
    print(report.table())
    for path in report.meta.get("written", []):
        print(f"wrote {path}")
    return 1 if any(r.refused for r in report.results) else 0


KV_FORMAT_HELP = "cache entry format: fp8 (the official numerics) or bf16 (the exact mode) (default %(default)s)"
INDEXER_FORMAT_HELP = ("CSA indexer key format: mxfp4 (the official numerics), fp8, or bf16 (the exact mode) "
                       "(default %(default)s)")


def _presets_epilog() -> str:
    """`plan --help`'s list of presets: what each is, its layers by kind and ratio, its heads."""
    lines = ["presets (attention geometry only, no weights; `dsv4kv demo` builds models of its own,",
             "demo-cpu and demo-gpu, which are none of these):"]
    for name in PRESETS:
        g = ModelGeometry.preset(name)
        kinds = ", ".join(f"{len(g.layers_of(k))} {k.short}" + (f" ratio {g.layers_of(k)[0].ratio}"
                                                                 if k is not LayerKind.WINDOW else "")
                          for k in LayerKind if g.layers_of(k))
        lines.append(f"  {name:6} {PRESET_NOTES[name]}: {g.num_layers} layers,")
        lines.append(f"         {kinds}; {g.num_heads} heads x {g.head_dim}, window {g.window}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4kv", description="DeepSeek-V4 KV cache substrate")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="bytes per token / request, and how many requests fit in memory",
                          epilog=_presets_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("--model", default="flash", help=f"a preset ({', '.join(PRESETS)}: listed below) or the path "
                                                       f"of a config.json (default flash)")
    plan.add_argument("--context", type=int, default=1 << 20, help="tokens per request (default 1048576)")
    plan.add_argument("--memory", default="141GiB", help="memory for the cache, e.g. 141GiB, 80GB (default 141GiB)")
    plan.add_argument("--kv-format", default=KVFormat.FP8.value, choices=[f.value for f in KVFormat],
                      help=KV_FORMAT_HELP)
    plan.add_argument("--indexer-format", default=IndexerFormat.MXFP4.value, choices=[f.value for f in IndexerFormat],
                      help=INDEXER_FORMAT_HELP)
    plan.add_argument("--page-tokens", type=int, default=DEFAULT_PAGE_TOKENS,
                      help=f"original tokens per block, a multiple of 128 (default {DEFAULT_PAGE_TOKENS})")
    plan.add_argument("--json", action="store_true", help="print the figures as JSON")
    plan.set_defaults(run=_plan)

    demo = sub.add_parser("demo", help="generate tokens with a random DeepSeek-V4 model through the engine and "
                                        "compare with transformers")
    demo.add_argument("--device", default=None, help="cpu or cuda[:index] (default: cuda when available, else cpu). "
                                                    "On cuda the model is demo-gpu (V4-Flash attention geometry, 4 "
                                                    "layers, bf16); on cpu demo-cpu (3 layers: window, CSA, HCA; "
                                                    "fp32). Neither is a `dsv4kv plan` preset")
    demo.add_argument("--kv-format", default=KVFormat.FP8.value, choices=[f.value for f in KVFormat],
                      help=KV_FORMAT_HELP)
    demo.add_argument("--indexer-format", default=IndexerFormat.MXFP4.value,
                      choices=[f.value for f in IndexerFormat], help=INDEXER_FORMAT_HELP)
    demo.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (default 0)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--no-compare", action="store_true", help="skip the comparison with transformers")
    demo.set_defaults(run=_demo)

    from .bench.workloads import WORKLOADS  # names only: importing it imports no kernel

    bench = sub.add_parser("bench", help="time the kernels, a decode step, prefill, scale, speculation and transfers "
                                         "on a GPU; write JSON and plots")
    bench.add_argument("workloads", nargs="*", help=f"{', '.join(WORKLOADS)} (default: all; --quick: a short "
                                                    f"subset)")
    bench.add_argument("--quick", action="store_true", help="fewer sizes (a few minutes)")
    bench.add_argument("--out", default="docs/bench", help="folder for the JSON and PNG files (default docs/bench)")
    bench.add_argument("--name", default=None, help="JSON file name without .json (default bench-<date>-<gpu>)")
    bench.add_argument("--runs", type=int, default=50, help="timed runs per figure (the median is reported)")
    bench.add_argument("--device", default="cuda", help="the CUDA device to time, e.g. cuda:1 (default cuda: the "
                                                        "current device)")
    bench.add_argument("--plot", metavar="JSON", help="only draw the plots of an earlier run's JSON into --out")
    bench.set_defaults(run=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (GeometryError, ValueError) as error:
        print(f"dsv4kv {args.command}: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (`dsv4kv plan | head`): stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 1


if __name__ == "__main__":
    sys.exit(main())
