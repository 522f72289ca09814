"""How the benchmarks time GPU work, and the machine figures every result is compared with.

Times are medians of many CUDA-event measurements after warm-up. Before each timed run the L2 cache is
flushed (a 256 MiB read, larger than the H100's 50 MB L2 and the 60 MB torch reports on the H200: a decode step
of a real model meets its layer's cache cold; a read, so that no dirty line is left to write back) and a short
spin kernel is queued, so the host's launch of the timed work overlaps the spin and the events measure the GPU's
execution alone. `graph=True` captures the work once as a CUDA graph and times replays, as a serving step would
run it; `graph=False` times eager calls, launch overhead included (transformers' eager module is measured that
way: its cost is what a user of it pays).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import statistics
import subprocess
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Timing", "time_cuda", "copy_bandwidth", "gemm_rate", "machine_info", "profile_kernels", "source_commit",
           "source_digest"]

_FLUSH_BYTES = 256 << 20
_SPIN_CYCLES = 40_000  # ~20 us at 1.98 GHz: longer than the host needs to launch a graph or a few kernels


@dataclass(frozen=True)
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    runs: int

    def as_dict(self) -> dict:
        return {"median_us": self.median_us, "p10_us": self.p10_us, "p90_us": self.p90_us, "runs": self.runs}


_flush_buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _flush_l2(device: torch.device) -> None:
    """Evict the timed work's data from the L2 by reading 256 MiB into one scalar. A flush by writing would leave
    the L2 full of dirty lines, which the timed kernels would then write back as they evict them: work a real step
    does not do (a 67 MB GEMV takes about 30% longer after a written flush than after a read one, which times it as
    no flush does; a CSA decode layer at batch 1 / 16K about 7% longer)."""
    if device not in _flush_buffers:
        _flush_buffers[device] = (torch.zeros(_FLUSH_BYTES // 8, dtype=torch.int64, device=device),
                                  torch.empty((), dtype=torch.int64, device=device))
    flush, total = _flush_buffers[device]
    torch.sum(flush, dim=0, out=total)


def time_cuda(fn: Callable[[], object], *, device: torch.device, runs: int = 50, warmup: int = 3,
              graph: bool = True, flush: bool = True, spin: bool = True) -> Timing:
    """Median GPU time of fn() over `runs` runs (after `warmup` eager calls; with `graph`, of replays of one
    captured call). fn must be repeatable: each run sees the state the previous one left."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    work = fn
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        work = captured.replay
        work()  # the first replay uploads the graph
    torch.cuda.synchronize(device)
    pairs = []
    for _ in range(runs):
        if flush:
            _flush_l2(device)
        if spin:
            torch.cuda._sleep(_SPIN_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize(device)
    times = sorted(s.elapsed_time(e) * 1e3 for s, e in pairs)
    return Timing(statistics.median(times), times[len(times) // 10], times[(9 * len(times)) // 10], runs)


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the bytes read and the bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    timing = time_cuda(lambda: dst.copy_(src), device=device, runs=20, graph=False, flush=False)
    return 2 * src.numel() / (timing.median_us * 1e-6)


def gemm_rate(device: torch.device, n: int = 8192) -> float:
    """Dense bf16 GEMM rate (FLOP/s) of an n x n x n torch.matmul (cuBLAS)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    out = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    timing = time_cuda(lambda: torch.matmul(a, b, out=out), device=device, runs=20, graph=False, flush=False)
    return 2 * n ** 3 / (timing.median_us * 1e-6)


# the package's own directory: <project root>/src/dsv4kv in the project's checkout, or site-packages/dsv4kv
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROJECT_ROOT = os.path.dirname(os.path.dirname(_PACKAGE_DIR))


def _git(root: str, *args: str) -> str:
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, check=True).stdout.strip()


def source_commit(root: str = _PROJECT_ROOT) -> str:
    """The commit of the checkout at `root`, "<commit>+dirty" when tracked files differ from it (what ran is not
    that commit), or "unknown". Git is trusted only when `root` is itself the top of a work tree: a copy of the
    project without .git inside another repository (or an installed package inside one) would otherwise be
    stamped with that repository's commit. DSV4KV_COMMIT overrides git."""
    if os.environ.get("DSV4KV_COMMIT"):
        return os.environ["DSV4KV_COMMIT"]
    try:
        top = _git(root, "rev-parse", "--show-toplevel")
        if os.path.realpath(top) != os.path.realpath(root):
            return "unknown"
        head = _git(root, "rev-parse", "--short", "HEAD")
        return head + "+dirty" if _git(root, "status", "--porcelain", "--untracked-files=no") else head
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def source_digest(package_dir: str = _PACKAGE_DIR) -> str:
    """sha256 (16 hex digits) of the package's Python sources: each .py file's path below `package_dir` and its
    bytes, in path order. It names the code that ran whatever git says (a copy whose .git is stale or absent); the
    same function at a checkout of a commit tells whether that commit is what ran."""
    digest = hashlib.sha256()
    paths = sorted(os.path.relpath(os.path.join(folder, name), package_dir).replace(os.sep, "/")
                   for folder, _, names in os.walk(package_dir) for name in names if name.endswith(".py"))
    for path in paths:
        with open(os.path.join(package_dir, path), "rb") as f:
            data = f.read()
        digest.update(f"{path}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:16]


def machine_info(device: torch.device) -> dict:
    """GPU, versions, date, commit (`source_commit`: DSV4KV_COMMIT, else git where the project is a checkout) and
    the sources' digest (`source_digest`)."""
    import triton

    props = torch.cuda.get_device_properties(device)
    return {"gpu": torch.cuda.get_device_name(device), "sm_count": props.multi_processor_count,
            "memory_bytes": props.total_memory, "capability": f"{props.major}.{props.minor}",
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": source_commit(), "sources": source_digest()}


def _kernels(prof) -> list[tuple[str, float]]:
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "Memset" not in e.name
                      and "Memcpy" not in e.name), key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us()) for e in kernels]


def profile_kernels(fn: Callable[[], object], *, device: torch.device, runs: int = 10,
                    graph: bool = True) -> list[tuple[str, float]]:
    """Each GPU kernel fn() launches, in launch order, with its median duration (us) over `runs` replays of a
    captured graph of fn (L2 flushed before each); `graph=False`: one eager call of fn, profiled as it runs.
    Empty when the profiler records no kernels (no CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    if not graph:
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        return _kernels(prof)
    fn()
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        fn()
    captured.replay()
    torch.cuda.synchronize(device)
    per_run: list[list[tuple[str, float]]] = []
    for _ in range(runs):
        _flush_l2(device)
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            captured.replay()
            torch.cuda.synchronize(device)
        per_run.append(_kernels(prof))
    per_run = [r for r in per_run if r]
    if not per_run or any(len(r) != len(per_run[0]) for r in per_run):
        return [(name, t) for name, t in (per_run[0] if per_run else [])]
    return [(per_run[0][i][0], statistics.median(r[i][1] for r in per_run)) for i in range(len(per_run[0]))]
