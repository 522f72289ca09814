"""What the bench workloads share: the run's context, the check of a layer's kernels against its reference, the
stage of a profiled kernel, and freeing the GPU between sizes."""

from __future__ import annotations

import functools
import gc
from dataclasses import dataclass
from typing import Callable

import torch

from ...cache.manager import CacheManager
from ...geometry import LayerKind, ModelGeometry
from ...model.layer import DSV4Attention
from .picks import explain_rows
from .report import Report

__all__ = ["Context", "check_layer", "layer_index", "row_error", "free_cuda", "kernel_stage", "model_geometry",
           "MODEL_NAMES", "ROW_TOL", "TIE_TOL"]

ROW_TOL = 2e-2  # kernels against the reference layer: row error / row max (tests/test_kernel_layer.py)
# A CSA row beyond ROW_TOL passes only when its top-k picks explain it (tools/bench/picks.py): each of the kernels'
# picks within TIE_TOL of the score range of the k-th best, by the reference's scores (a near-tie flip) or by the
# reference's scores of the kernels' own inputs (a flip from this step's keys, encoded one grid step apart). The
# indexer's scores are within 2^-10 of the row's largest |score| (MXFP4 keys under one scale per key, ops/indexer/
# kernel.py), so two entries' order can flip within twice that; a wrong pick (an invisible or a low-scoring entry)
# is orders of magnitude further.
TIE_TOL = 2 ** -9


@dataclass
class Context:
    device: torch.device
    report: Report
    quick: bool
    log: Callable[[str], None]
    runs: int = 50

    @property
    def geometry(self) -> ModelGeometry:
        """V4-Flash: the geometry of every workload but the rows `decode` and `flashmla` time for V4-Pro."""
        return model_geometry("flash")


MODEL_NAMES = {"flash": "V4-Flash", "pro": "V4-Pro"}


@functools.lru_cache(maxsize=None)
def model_geometry(model: str) -> ModelGeometry:
    """The attention geometry of a preset model ("flash" or "pro")."""
    return ModelGeometry.from_hf_config(model)


def layer_index(g: ModelGeometry, kind: str) -> int:
    return next(i for i, layer in enumerate(g.layers) if layer.kind.short.lower() == kind)


def _row_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row max |out - ref| / max |ref| (inf where a row of out is not finite)."""
    out, ref = out.float(), ref.float()
    err = (out - ref).abs().amax(dim=-1) / ref.abs().amax(dim=-1).clamp_min(1e-30)
    return torch.where(torch.isfinite(out).all(dim=-1), err, float("inf"))


def check_layer(layer: DSV4Attention, x: torch.Tensor, plan, cache: CacheManager, what: str) -> tuple[str, bool]:
    """The layer on the kernels against the reference layer from the same cache state (restored after each),
    row by row: every row within ROW_TOL, or (CSA) a row beyond it explained by its picks, with the indexer's
    inputs within their rounding (tools/bench/picks.py). Returns (check text, passed)."""
    from ...ops.shared.rows import step_rows
    from .picks import CSACapture

    tensors = cache.pools.layers[layer.layer_index].tensors()
    snapshot = [t.clone() for t in tensors]

    def restore():
        for t, s in zip(tensors, snapshot):
            t.copy_(s)

    pages = cache.pages(layer.layer_index)
    with CSACapture() as capture, torch.no_grad():
        ref = layer._forward_reference(x, layer.attention_plan(plan, pages, "torch"), pages)
        restore()
        out = layer._forward_kernels(x, layer.attention_plan(plan, pages, "triton"), pages)
        restore()
    errors = _row_errors(out[:ref.shape[0]], ref)
    del ref, out, snapshot
    spec = layer.spec
    if spec.kind is not LayerKind.CSA:
        verdict = explain_rows(errors, None, None, None, row_tol=ROW_TOL, tie_tol=TIE_TOL)
        return verdict.text(what), verdict.passed
    rows = step_rows(plan)
    new_entries = sum(s // spec.ratio - st // spec.ratio for s, st in zip(rows.host_seq_lens, rows.host_starts))
    verdict, inputs = capture.verdict(errors, row_tol=ROW_TOL, tie_tol=TIE_TOL, new_key_bytes=new_entries
                                      * cache.spec.layers[layer.layer_index].index.entry_bytes)
    return f"{verdict.text(what)}; {inputs.text()}", verdict.passed and inputs.passed


def row_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst row of max |out - ref| / max |ref| (NaN anywhere counts as infinite)."""
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    err = (out - ref).abs().amax(dim=-1) / ref.abs().amax(dim=-1).clamp_min(1e-30)
    return float(err.max())


def free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# (a key inside the kernel's name, its stage), the first match wins: "_compressor_rows" before "_compress"
_STAGES = (("_kv_insert", "kv insert"), ("_compressor_rows", "compressor rows"), ("_compress", "compress-and-insert"),
           ("_pool_kernel", "compress-and-insert"),
           ("_indexer_scores", "indexer scores"), ("_topk", "top-k"),
           ("_sparse_attention", "attention"), ("_merge_kernel", "attention"), ("_copy_entries", "window append"),
           ("_append_state", "state append"), ("_rope_rows", "RoPE of q"),
           ("_indexer_query", "indexer query"), ("_q_fp8", "indexer query"),
           ("_rms_norm", "projection norms"), ("_gemv_kernel", "one-row projections"))


def kernel_stage(kernel: str) -> str:
    """The stage of the decode step a profiled kernel belongs to (by its name; "torch kernels" when none)."""
    return next((stage for key, stage in _STAGES if key in kernel), "torch kernels")
