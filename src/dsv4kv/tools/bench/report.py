"""Benchmark results: one `Result` per measured thing, derived rates against the machine's measured copy
bandwidth and GEMM rate, a printed table, JSON, and PNG plots (when matplotlib is installed).

A result whose correctness check failed in the same run is refused: its time is dropped (JSON `time_us`
null, `refused` says why) and the table prints the failure instead of a number.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

__all__ = ["Result", "Report", "plot_report", "markdown", "indexer_keys"]


# timings a workload may keep in `extra`: dropped with the time when the check fails
_TIMING_KEYS = ("median_us", "p10_us", "p90_us", "runs", "speedup", "step_wall_us", "tokens_per_s", "chunk_us",
                "with_step_tensors_us", "kernels_us", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "total_s")


@dataclass
class Result:
    workload: str
    name: str
    params: dict
    time_us: float | None  # median
    bytes: int | None = None  # bytes the work must move (reads + writes), by the model in the workload
    flops: float | None = None  # arithmetic the work must do
    check: str = "not checked"  # what was compared against the reference in this run, and the outcome
    passed: bool = True
    extra: dict = field(default_factory=dict)
    refused: str | None = None

    def __post_init__(self):
        if not self.passed:  # no figure survives a failed check, the extras' timings included
            self.refused = f"correctness check failed: {self.check}"
            self.time_us = None
            self.extra = {k: v for k, v in self.extra.items() if k not in _TIMING_KEYS}


@dataclass
class Report:
    meta: dict
    results: list[Result] = field(default_factory=list)
    targets: list[dict] = field(default_factory=list)

    @property
    def copy_bw(self) -> float | None:
        return self.meta.get("copy_bandwidth_Bps")

    @property
    def gemm(self) -> float | None:
        return self.meta.get("bf16_gemm_flops")

    def rates(self, r: Result) -> dict:
        """GB/s and % of the measured copy bandwidth; TFLOP/s and % of the measured bf16 GEMM rate."""
        out = {}
        if r.time_us:
            seconds = r.time_us * 1e-6
            if r.bytes:
                out["GBps"] = r.bytes / seconds / 1e9
                if self.copy_bw:
                    out["pct_bandwidth"] = 100 * r.bytes / seconds / self.copy_bw
                    out["floor_us"] = r.bytes / self.copy_bw * 1e6
            if r.flops:
                out["TFLOPs"] = r.flops / seconds / 1e12
                if self.gemm:
                    out["pct_gemm"] = 100 * r.flops / seconds / self.gemm
        return out

    def add(self, result: Result) -> Result:
        self.results.append(result)
        return result

    def to_json(self) -> dict:
        rows = []
        for r in self.results:
            row = asdict(r)
            row.update(self.rates(r))
            rows.append(row)
        return {"meta": self.meta, "results": rows, "targets": self.targets}

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1, default=float)

    def table(self) -> str:
        m = self.meta
        lines = [f"dsv4kv bench: {m.get('gpu')}, torch {m.get('torch')}, triton {m.get('triton')}, "
                 f"{m.get('date')}, commit {m.get('commit')}, sources {m.get('sources')}"]
        if self.copy_bw:
            lines.append(f"  measured copy bandwidth {self.copy_bw / 1e12:.2f} TB/s (read + write), "
                         f"bf16 GEMM {self.gemm / 1e12:.0f} TFLOP/s")
        lines.append(f"  {'workload':<12}{'name':<44}{'time us':>10}{'MB':>9}{'GB/s':>8}{'%bw':>6}"
                     f"{'TFLOP/s':>9}{'%gemm':>7}  check")
        for r in self.results:
            rate = self.rates(r)
            if r.refused:
                lines.append(f"  {r.workload:<12}{r.name:<44}{'REFUSED':>10}  {r.refused}")
                continue
            time = f"{r.time_us:10.1f}" if r.time_us is not None else f"{'-':>10}"
            mb = f"{r.bytes / 1e6:9.2f}" if r.bytes else f"{'':>9}"
            gbps = f"{rate['GBps']:8.0f}" if "GBps" in rate else f"{'':>8}"
            pct = f"{rate['pct_bandwidth']:6.0f}" if "pct_bandwidth" in rate else f"{'':>6}"
            tf = f"{rate['TFLOPs']:9.1f}" if "TFLOPs" in rate else f"{'':>9}"
            pg = f"{rate['pct_gemm']:7.1f}" if "pct_gemm" in rate else f"{'':>7}"
            lines.append(f"  {r.workload:<12}{r.name:<44}{time}{mb}{gbps}{pct}{tf}{pg}  {r.check}")
        if self.targets:
            lines.append("  targets:")
            for t in self.targets:
                lines.append(f"    [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['measured']}")
        return "\n".join(lines)


def indexer_keys(params: dict) -> str:
    """A decode result's indexer key format, from its params (rows from before the bench recorded it: MXFP4, the only
    one then)."""
    return params.get("indexer_format", "mxfp4")


def markdown(data: dict) -> str:
    """A report's JSON as markdown tables (what docs/performance.md quotes)."""
    m = data["meta"]
    lines = [f"{m.get('gpu')}, torch {m.get('torch')} (CUDA {m.get('cuda')}), triton {m.get('triton')}, {m.get('date')}, "
             f"commit {m.get('commit')}, sources {m.get('sources')}; measured copy bandwidth "
             f"{m.get('copy_bandwidth_Bps', 0) / 1e12:.2f} TB/s (read + write), bf16 GEMM {m.get('bf16_gemm_flops', 0) / 1e12:.0f} TFLOP/s.", ""]
    for workload in dict.fromkeys(r["workload"] for r in data["results"]):
        rows = [r for r in data["results"] if r["workload"] == workload]
        lines += [f"**{workload}**", "", "| what | median us | MB moved | GB/s | % of copy bw | TFLOP/s | % of GEMM |"
                  " check |", "|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            def cell(key, fmt):
                return format(r[key], fmt) if r.get(key) is not None else ""
            time = "refused" if r.get("refused") else cell("time_us", ".1f")
            mb = format(r["bytes"] / 1e6, ".2f") if r.get("bytes") else ""
            lines.append(f"| {r['name'].strip()} | {time} | {mb} | {cell('GBps', '.0f')} | {cell('pct_bandwidth', '.0f')} | "
                         f"{cell('TFLOPs', '.1f')} | {cell('pct_gemm', '.1f')} | {r['check']} |")
        lines.append("")
    if data.get("targets"):
        lines += ["**targets**", "", "| target | measured | |", "|---|---|---|"]
        lines += [f"| {t['target']} | {t['measured']} | {'met' if t['met'] else 'missed'} |" for t in data["targets"]]
    return "\n".join(lines) + "\n"


def plot_report(data: dict, out_dir: str) -> list[str]:
    """PNG plots from a report's JSON: decode-core time and time / floor against context (batch 1) and batch
    (128K context). Returns the files written; none when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows = [r for r in data["results"] if r["workload"] == "decode" and r["time_us"]
            and r["extra"].get("stage") == "core"
            and indexer_keys(r["params"]) == "mxfp4"  # FP8 keys: extra points, not plotted
            and r["params"].get("model", "flash") == "flash"]  # V4-Pro: a few points, in the tables only
    written = []
    stamp = f"{data['meta'].get('gpu')}, torch {data['meta'].get('torch')}, triton {data['meta'].get('triton')}, " \
            f"{data['meta'].get('date', '')[:10]}, {data['meta'].get('commit')}"
    for axis, fixed_key, fixed_value, label in (("context", "batch", 1, "context (tokens)"),
                                                ("batch", "context", 131072, "batch (requests)")):
        fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4))
        for kind in sorted({r["params"]["kind"] for r in rows}):
            sel = sorted((r for r in rows if r["params"]["kind"] == kind and r["params"][fixed_key] == fixed_value),
                         key=lambda r: r["params"][axis])
            if len(sel) < 2:
                continue
            xs = [r["params"][axis] for r in sel]
            ax_t.plot(xs, [r["time_us"] for r in sel], "o-", label=f"{kind} attention core")
            if all(r.get("floor_us") for r in sel):
                ax_t.plot(xs, [r["floor_us"] for r in sel], "--", label=f"{kind} bytes / bandwidth")
                ax_r.plot(xs, [r["time_us"] / r["floor_us"] for r in sel], "o-", label=kind)
        for ax in (ax_t, ax_r):
            ax.set_xscale("log", base=2)
            ax.set_xlabel(label)
            ax.grid(True, which="both", alpha=0.3)
        ax_t.set_yscale("log")
        ax_t.set_ylabel("decode step, us (CUDA graph)")
        ax_r.set_ylabel("time / (bytes read / measured bandwidth)")
        ax_r.axhline(1.0, color="gray", lw=0.8)
        if not ax_t.lines:  # this run has no such series: leave any earlier plot in place
            plt.close(fig)
            continue
        ax_t.legend(fontsize=7)
        ax_r.legend(fontsize=7)
        fixed = f"batch {fixed_value}" if fixed_key == "batch" else f"context {fixed_value}"
        fig.suptitle(f"V4-Flash decode attention core, {fixed} -- {stamp}", fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"decode-vs-{axis}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
