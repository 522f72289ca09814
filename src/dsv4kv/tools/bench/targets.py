"""The project's speed targets, evaluated from a run's results: met or missed, and by how much.

V4-Flash's decode-core targets are fixed times. V4-Pro's are derived from them the same way at each shape: the Flash
target scaled by the bytes the Pro core must move over the bytes the Flash core moves (`decode.core_bytes`, FP8
entries and MXFP4 indexer keys), so both ask for the same multiple of their bytes floor.
"""

from __future__ import annotations

import functools

from ...cache.spec import CacheSpec
from .common import MODEL_NAMES, layer_index, model_geometry
from .decode import core_bytes
from .report import Report, Result, indexer_keys

__all__ = ["evaluate_targets", "core_target_us", "CORE_TARGETS_US", "TOPK_TARGETS_US", "FLASHMLA_RATIO",
           "VERIFY_OVER_DECODE", "SPEC_SPEEDUP", "SPEC_ACCEPTANCE"]

# V4-Flash decode core, MXFP4 indexer keys: (kind, context, batch) -> microseconds
CORE_TARGETS_US = {("csa", 1 << 20, 1): 35.0, ("csa", 131072, 64): 130.0, ("hca", 131072, 64): 60.0}
# top-k (k = 512) of (rows, candidates) -> microseconds; exact index sets
TOPK_TARGETS_US = {(1, 262144): 12.0, (1, 1 << 20): 20.0, (64, 32768): 20.0}
FLASHMLA_RATIO = 1.0  # our sparse attention / FlashMLA's on the same pages, every row
# the indexer scores' share of copy bandwidth: batch >= 8 at context >= 64K, and batch 1 at 1M
INDEXER_PCT_BATCHED, INDEXER_PCT_LONG = 60, 50
# speculative decoding: a CSA core verify step (4 tokens a request) over a 1-token decode step, batch 1..16 at 128K;
# decode tokens/s over plain decoding's where drafts are accepted at >= 2.5 tokens a step
VERIFY_OVER_DECODE, SPEC_SPEEDUP, SPEC_ACCEPTANCE = 1.4, 2.0, 2.5


@functools.lru_cache(maxsize=None)
def _core_bytes(model: str, kind: str, context: int, batch: int) -> int:
    g = model_geometry(model)
    return sum(core_bytes(g, CacheSpec(g), layer_index(g, kind), context, batch).values())


def core_target_us(model: str, kind: str, context: int, batch: int) -> float | None:
    """The decode core's target at a shape (None where there is none): Flash's fixed time, Pro's scaled by bytes."""
    flash = CORE_TARGETS_US.get((kind, context, batch))
    if flash is None or model == "flash":
        return flash
    return flash * _core_bytes(model, kind, context, batch) / _core_bytes("flash", kind, context, batch)


def _model(r: Result) -> str:
    return r.params.get("model", "flash")


def evaluate_targets(report: Report) -> list[dict]:
    """Every target this run measured: {"target", "measured", "met"}. A refused figure (failed check) has none."""
    targets = []

    def add(target: str, measured: str, met: bool) -> None:
        targets.append({"target": target, "measured": measured, "met": bool(met)})

    bw = report.copy_bw
    for r in report.results:
        if not (r.workload == "decode" and r.time_us and r.extra.get("stage") == "core"
                and indexer_keys(r.params) == "mxfp4"):
            continue
        model, kind, context, batch = _model(r), r.params.get("kind"), r.params.get("context"), r.params.get("batch")
        bound = core_target_us(model, kind, context, batch)
        if bound is None:
            continue
        floor = f", {r.time_us / (r.bytes / bw * 1e6):.1f}x the bytes floor" if r.bytes and bw else ""
        derived = "" if model == "flash" else " (Flash's, scaled by bytes)"
        add(f"{MODEL_NAMES[model]} {kind.upper()} core, batch {batch}, {context // 1024}K <= {bound:.0f} us{derived}",
            f"{r.time_us:.1f} us ({r.time_us / bound:.2f}x the target{floor})", r.time_us <= bound)
    for r in report.results:
        bound = TOPK_TARGETS_US.get((r.params.get("rows"), r.params.get("cols"))) if r.workload == "topk" else None
        if bound is not None and r.time_us:
            rows, cols = r.params["rows"], r.params["cols"]
            what = f"top-{r.params.get('k', 512)} of {cols:,} candidates x {rows} row{'s' * (rows > 1)}"
            add(f"{what} <= {bound:.0f} us", f"{r.time_us:.1f} us", r.time_us <= bound)
    for r in report.results:  # the indexer's share of copy bandwidth (its keys' own bytes), MXFP4 and FP8 keys
        if not (r.workload == "decode" and r.extra.get("stage") == "indexer scores" and r.time_us and r.bytes and bw):
            continue
        batch, context = r.params.get("batch", 0), r.params.get("context", 0)
        need = INDEXER_PCT_BATCHED if batch >= 8 and context >= 65536 else \
            INDEXER_PCT_LONG if batch == 1 and context >= 1 << 20 else None
        if need is not None:
            pct = 100 * r.bytes / (r.time_us * 1e-6) / bw
            keys = "" if indexer_keys(r.params) == "mxfp4" else f" ({indexer_keys(r.params)} keys)"
            model = "" if _model(r) == "flash" else f"{MODEL_NAMES[_model(r)]} "
            add(f"{model}indexer scores{keys}, batch {batch}, {context // 1024}K context >= {need}% of copy bandwidth",
                f"{pct:.0f}%", pct >= need)
    for r in report.results:
        if r.workload == "flashmla" and r.time_us and "ratio" in r.extra:
            p = r.params
            add(f"{MODEL_NAMES[_model(r)]} {p['kind']} attention, batch {p['batch']}, {p['context'] // 1024}K: "
                f"dsv4kv / FlashMLA <= {FLASHMLA_RATIO:g}",
                f"{r.extra['ratio']:.2f} ({r.time_us:.1f} vs {r.extra['flashmla_us']:.1f} us)",
                r.extra["ratio"] <= FLASHMLA_RATIO)
    for r in report.results:
        if (r.workload == "spec" and r.time_us and "verify_over_decode" in r.extra and r.params.get("rows", 1) > 1
                and r.params.get("batch", 0) <= 16 and r.params.get("context", 0) >= 131072):
            p = r.params
            add(f"CSA core verify ({p['rows']} tokens a request) / decode, batch {p['batch']}, "
                f"{p['context'] // 1024}K <= {VERIFY_OVER_DECODE:g}", f"{r.extra['verify_over_decode']:.2f}",
                r.extra["verify_over_decode"] <= VERIFY_OVER_DECODE)
        if (r.workload == "spec" and r.time_us and r.extra.get("acceptance_length", 0) >= SPEC_ACCEPTANCE
                and r.extra.get("verify_speedup")):  # over the steps that verified drafts (`spec.py`)
            add(f"{r.name}: decode tokens/s of its verify steps >= {SPEC_SPEEDUP:g}x plain at acceptance length "
                f"{r.extra['acceptance_length']:.2f}", f"{r.extra['verify_speedup']:.2f}x (whole run "
                f"{r.extra['speedup']:.2f}x)", r.extra["verify_speedup"] >= SPEC_SPEEDUP)
    for r in report.results:
        if r.workload == "insert" and r.time_us and bw and r.params.get("rows", 0) >= 8192:
            pct = 100 * r.bytes / (r.time_us * 1e-6) / bw
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
