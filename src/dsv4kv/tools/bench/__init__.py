"""`dsv4kv bench`: the speed of the substrate on a GPU, measured against the machine it runs on.

    from . import run_bench
    report = run_bench(["machine", "topk", "decode"], out_dir="docs/bench")   # -> Report (also JSON + PNG)

Workloads are in `workloads.py` (`WORKLOADS`), timing in `timing.py`, results and plots in `report.py`.
The issue's targets are evaluated from the results (`evaluate_targets`) and written with them.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Sequence

import torch

from .report import Report, Result, indexer_keys, markdown, plot_report
from .timing import machine_info
from .workloads import QUICK, WORKLOADS, Context

__all__ = ["run_bench", "bench_device", "evaluate_targets", "WORKLOADS", "QUICK", "Report", "Result", "plot_report",
           "markdown"]


def run_bench(workloads: Sequence[str] = QUICK, *, out_dir: str | None = "docs/bench", name: str | None = None,
              quick: bool = False, runs: int = 50, device: str | torch.device = "cuda",
              log: Callable[[str], None] | None = None) -> Report:
    """Run `workloads` (names from WORKLOADS; "machine" is always run first) and return the report; with
    `out_dir`, also write `<name>.json` (default: bench-<date>-<gpu>) and the plots there."""
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    device = bench_device(device)
    torch.cuda.set_device(device)  # events, the spin kernel and graph capture use the current device
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    report = Report(meta={**machine_info(device), "workloads": list(workloads), "quick": quick})
    ctx = Context(device=device, report=report, quick=quick, log=log, runs=runs)
    for workload in ["machine"] + [w for w in workloads if w != "machine"]:
        WORKLOADS[workload](ctx)
    report.targets = evaluate_targets(report)
    if out_dir is not None:
        gpu = report.meta["gpu"].replace("NVIDIA ", "").replace(" ", "-")
        name = name or f"bench-{report.meta['date'][:10]}-{gpu}"
        path = os.path.join(out_dir, f"{name}.json")
        report.save(path)
        with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
            f.write(markdown(report.to_json()))
        report.meta["written"] = [path, os.path.join(out_dir, f"{name}.md")] + plot_report(report.to_json(), out_dir)
    return report


def bench_device(device: str | torch.device) -> torch.device:
    """The CUDA device the bench runs on, with its index: "cuda" means the current device. torch.cuda.set_device
    and the per-device caches need an index ("cuda" alone is rejected by set_device)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device: expected a CUDA device such as 'cuda' or 'cuda:1', got {device!r}") from err
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"needs a CUDA GPU (the figures are GPU times), got device {str(device)!r}"
                         + ("" if torch.cuda.is_available() else " and no CUDA device is available"))
    index = torch.cuda.current_device() if device.index is None else device.index
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(f"device: cuda:{index} does not exist ({count} CUDA device{'s' * (count != 1)} visible)")
    return torch.device("cuda", index)


def _find(report: Report, workload: str, **params) -> Result | None:
    """The first result of `workload` with these params; a decode row: the core stage over MXFP4 indexer keys (the
    official format, which the core targets name)."""
    return next((r for r in report.results if r.workload == workload
                 and all(r.params.get(k) == v for k, v in params.items())
                 and (workload != "decode" or (r.extra.get("stage") == "core" and indexer_keys(r.params) == "mxfp4"))), None)


def evaluate_targets(report: Report) -> list[dict]:
    """The issue's speed targets that this run measured: met or missed, and by how much."""
    targets = []

    def add(target: str, measured: str, met: bool) -> None:
        targets.append({"target": target, "measured": measured, "met": bool(met)})

    r = _find(report, "decode", kind="csa", context=1 << 20, batch=1)
    if r and r.time_us:
        add("CSA core decode, batch 1, 1M context <= 40 us", f"{r.time_us:.1f} us ({r.time_us / 40:.2f}x the target)",
            r.time_us <= 40)
    for kind in ("csa", "hca"):  # issue 12: <= 2x the bytes floor (CSA moonshot 1.4x)
        r = _find(report, "decode", kind=kind, context=131072, batch=64)
        if r and r.time_us and r.bytes and report.copy_bw:
            floor = r.bytes / report.copy_bw * 1e6
            add(f"{kind.upper()} core decode, batch 64, 128K context <= 2x bytes / bandwidth",
                f"{r.time_us:.1f} us = {r.time_us / floor:.2f}x the {floor:.1f} us floor", r.time_us <= 2 * floor)
    for rows, cols, bound in ((1, 262144, 12), (1, 1 << 20, 25), (64, 32768, 25)):
        r = _find(report, "topk", rows=rows, cols=cols)
        if r and r.time_us:
            add(f"top-{r.params.get('k', 512)} of {cols:,} candidates x {rows} row{'s' * (rows > 1)} <= {bound} us",
                f"{r.time_us:.1f} us", r.time_us <= bound)
    for r in report.results:  # the indexer's share of the copy bandwidth (its keys' own bytes), from the decode
        # step's kernel split: MXFP4 keys, and FP8 keys "at the same fractions of their own bytes"
        if (r.workload == "decode" and r.extra.get("stage") == "indexer scores" and r.time_us and r.bytes
                and report.copy_bw):
            batch, context = r.params.get("batch", 0), r.params.get("context", 0)
            need = 60 if batch >= 8 and context >= 65536 else 40 if batch == 1 and context >= 1 << 20 else None
            if need is not None:
                pct = 100 * r.bytes / (r.time_us * 1e-6) / report.copy_bw
                keys = "" if indexer_keys(r.params) == "mxfp4" else f" ({indexer_keys(r.params)} keys)"
                add(f"indexer scores{keys}, batch {batch}, {context // 1024}K context >= {need}% of copy bandwidth",
                    f"{pct:.0f}%", pct >= need)
    for r in report.results:
        if r.workload == "insert" and r.time_us and report.copy_bw and r.params.get("rows", 0) >= 8192:
            pct = 100 * r.bytes / (r.time_us * 1e-6) / report.copy_bw
            add(f"{r.name} >= 75% of copy bandwidth", f"{pct:.0f}%", pct >= 75)
    for kind in ("window", "csa", "hca"):
        hf = next((r for r in report.results if r.workload == "layer" and r.name.startswith("transformers")
                   and r.params == {"kind": kind, "context": 16384, "batch": 1}), None)
        ours = next((r for r in report.results if r.workload == "layer" and r.params.get("kind") == kind
                     and r.params.get("context") == 16384 and r.params.get("mode") == "official"), None)
        if hf and ours and ours.time_us and hf.time_us:
            ratio = hf.time_us / ours.time_us
            add(f"{kind} layer decode, batch 1, 16K: >= 20x transformers", f"{ratio:.1f}x "
                f"({hf.time_us:.0f} us vs {ours.time_us:.1f} us)", ratio >= 20)
    r = next((r for r in report.results if r.workload == "prefill" and r.name.startswith("CSA layer")), None)
    if r and r.time_us and report.gemm:
        floor = r.flops / report.gemm * 1e6
        add(f"prefill {r.params['prompt']} tokens in {r.params['chunk']}-token chunks within 3x of the indexer FLOP floor",
            f"{r.time_us / 1e3:.1f} ms = {r.time_us / floor:.1f}x the {floor / 1e3:.2f} ms floor", r.time_us <= 3 * floor)
    for r in report.results:
        if r.workload == "scale" and r.time_us:
            ratio = r.extra["reserved_over_planned"]
            add(f"scale: {r.name}, memory within 2% of dsv4kv plan", f"cache tensors / planned = {ratio:.4f}, step "
                f"{r.time_us / 1e3:.2f} ms", abs(ratio - 1) <= 0.02)
    return targets
