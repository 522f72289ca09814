"""Times sparse-attention tile variants beside FlashMLA on the decode shapes of `dsv4kv bench flashmla` (GPU).

    python scripts/attention_variants.py [--old path/to/attention.py ...] [--quick]  > variants.txt

Every variant is checked against the fp32 reference (`bench.flashmla.Case.reference`) before it is timed; one
beyond the tolerance is reported and not timed. Each `--old` times another version of kernels/attention.py (a file,
named by its stem) for a before / after figure. The table at the end gives each shape's best variant against FlashMLA."""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

import dsv4kv.kernels.attention as A
from dsv4kv import ModelGeometry
from dsv4kv.bench.flashmla import ATTENTION_TOL, QUICK_SHAPES, SHAPES, Case, _flash_mla, row_error
from dsv4kv.bench.timing import time_cuda

DEVICE = torch.device("cuda", 0)
KNOBS = ("BLOCK_N", "LARGE_BLOCK_N", "NUM_STAGES", "MIN_SPLIT_BLOCKS", "SMALL_BLOCK_H", "QK_SCRATCH")
VARIANTS = [dict(zip(KNOBS, v)) for v in [  # the defaults first
    (32, 64, 1, 2, 16, True), (32, 64, 1, 2, 16, False)]]


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("dsv4kv.kernels._attention_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", action="append", default=[])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    g = ModelGeometry.from_hf_config("flash")
    flash_mla, reason = _flash_mla()
    if flash_mla is None:
        print("FlashMLA:", reason)
    olds = {path.rsplit("/", 1)[-1].removesuffix(".py"): load_old(path) for path in args.old}
    default = {k: getattr(A, k) for k in KNOBS}
    table = []
    for kind, batch, context in (QUICK_SHAPES if args.quick else SHAPES):
        case = Case.synthetic(g, kind, batch, context, DEVICE)
        ref = case.reference()
        label = f"{kind} b{batch} {context // 1024}K"
        row = {"shape": label}
        if flash_mla is not None:
            theirs = case.flash_mla_runner(flash_mla)
            err = row_error(theirs()[:, 0], ref)
            row["flashmla"] = time_cuda(theirs, device=DEVICE, runs=args.runs).median_us
            print(f"{label} FlashMLA: {row['flashmla']:.1f} us, error {err:.2e}", flush=True)
        for name, old in olds.items():
            def run_old(old=old):
                return old.sparse_attention_paged(
                    case.q, case.plan, sinks=case.sinks, scale=case.scale, layout=case.ls.main, window=case.window,
                    window_pool=case.lc.window, step_kv=case.step_kv, entry_pool=case.lc.entries, ratio=case.ratio,
                    page_tokens=case.page_tokens, picks=case.picks, out=case.out, max_entries=case.visible)
            err = row_error(run_old(), ref)
            row[name] = time_cuda(run_old, device=DEVICE, runs=args.runs).median_us
            print(f"{label} {name}: {row[name]:.1f} us, error {err:.2e}", flush=True)
        best = None
        for v in VARIANTS:
            for k, val in v.items():
                setattr(A, k, val)
            name = "/".join(f"{val}" for val in v.values())
            try:
                out = case.ours()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
                print(f"{label} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            err = row_error(out, ref)
            if not err <= ATTENTION_TOL:
                print(f"{label} {name}: error {err:.2e} beyond {ATTENTION_TOL}, not timed", flush=True)
                continue
            t = time_cuda(case.ours, device=DEVICE, runs=args.runs).median_us
            cfg = A._config(batch, g.num_heads, case.keys_per_row, DEVICE)
            print(f"{label} {name} (splits {cfg.splits}): {t:.1f} us, error {err:.2e}", flush=True)
            if best is None or t < best[0]:
                best = (t, name)
        for k, val in default.items():
            setattr(A, k, val)
        row["best"] = best
        table.append(row)
        del case, ref
        torch.cuda.empty_cache()
    print("\nvariant = " + "/".join(KNOBS))
    print(f"{'shape':<14}{'FlashMLA':>10}" + "".join(f"{name[-12:]:>13}" for name in olds)
          + f"{'best':>10}  best variant   best/FlashMLA")
    for r in table:
        best = r["best"]
        fm = r.get("flashmla")
        print(f"{r['shape']:<14}{fm or float('nan'):>10.1f}" + "".join(f"{r[name]:>13.1f}" for name in olds)
              + f"{best[0] if best else float('nan'):>10.1f}  {best[1] if best else '-':<14} "
              f"{(best[0] / fm) if (best and fm) else float('nan'):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
