"""`dsv4kv bench`: the speed of the substrate on a GPU, measured against the machine it runs on.

    from . import run_bench
    report = run_bench(["machine", "topk", "decode"], out_dir="docs/bench")   # -> Report (also JSON + PNG)

Workloads are in `workloads.py` (`WORKLOADS`), timing in `timing.py`, results and plots in `report.py`.
The project's speed targets are evaluated from the results (`targets.py`) and written with them.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Sequence

import torch

from .report import Report, Result, markdown, plot_report
from .targets import evaluate_targets
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
