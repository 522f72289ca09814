"""The attention plan: what every layer of one kind reads in one step besides its own pages and weights.

A step's `StepPlan` holds the index fields the manager wrote (positions, slots, block table). A layer kind needs more,
derived from them alone: RoPE tables at the rows' positions and at the completing entries' first tokens, the visible
entry counts, the widths of the score rows, the indexer's path choices and top-k's workspace. `attention_plan` builds
them once per step and kind (and RoPE), before the first such layer runs, and every later layer of the kind reads the
same tensors: the layer asks the kernel modules no host question of its own. A plan asked for inside a CUDA-graph
capture is built there, so every replay rebuilds its tensors before their first use; one built eagerly is never read
by a capture. The reference path's plan (the step's rows, read back to the host) is one per step for every kind.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..cache.plan import StepPlan
from ..cache.spec import LayerCacheSpec
from ..geometry import LayerKind, ModelGeometry
from ..ops.rope.reference import rope_cos_sin
from ..ops.shared.rows import StepRows, step_rows

__all__ = ["AttentionPlan", "attention_plan"]


@dataclass(frozen=True)
class AttentionPlan:
    """One step's plan for the layers of one kind, on one backend ("torch": the reference; "triton": the kernels)."""

    step: StepPlan | None  # None only in the step's memo (`StepPlan.layer_plans`), which must not point back at it
    kind: LayerKind | None  # None: the reference's plan, one for every kind
    backend: str
    # the reference: the step's rows read back to the host (the reference's one sync per step)
    rows: StepRows | None = None
    # the kernels, over every padded row
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None  # fp32 [R, rope_dim / 2]: RoPE at each row's position
    entry_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None  # at each completing entry's first token (j * m)
    row_slots: torch.Tensor | None = None  # int32 [R]: each row's slot in the step page (its row index)
    max_entries: int | None = None  # compressed layers: a per-row bound on visible entries, host-known
    score_columns: int | None = None  # CSA: the width of the indexer's score rows
    visible: torch.Tensor | None = None  # CSA: int32 [R]: entries each row may pick
    indexer_fp8: bool = False  # CSA: the scores run an FP8-MMA path, so the query kernel makes q's FP8 operand
    counts_digit: bool = False  # CSA: the scores kernel counts top-k's first digit; top-k skips that pass
    topk_workspace: torch.Tensor | None = None  # CSA: zeroed; top-k leaves it zeroed, so every CSA layer shares it
    # one row per request (every decode step): the ring entry a row's append overwrites, position p - window, is
    # outside that row's window, so the window append may run beside attention instead of after it
    decode: bool = False


def score_columns(step: StepPlan, ratio: int) -> int:
    """The width of a step's indexer score rows: the per-row entry bound rounded up to a multiple of 16, so the
    indexer and top-k kernels see the same alignment class at every step (Triton compiles a variant per class of an
    int argument; the eager steps' bound moves)."""
    return -(-max(step.max_seq_len // ratio, 1) // 16) * 16


def attention_plan(step: StepPlan, spec: LayerCacheSpec, geometry: ModelGeometry, backend: str) -> AttentionPlan:
    """The attention plan of `step` for the layers of `spec`'s kind: built by the first layer of the kind that asks
    (kept in `step.layer_plans`), read by the rest."""
    if backend == "triton":
        capturing = step.positions.is_cuda and torch.cuda.is_current_stream_capturing()
        key = (backend, spec.layer.kind, spec.layer.rope, capturing)
    else:
        key = (backend,)
    plan = step.layer_plans.get(key)
    if plan is None:
        plan = step.layer_plans[key] = (_kernel_plan(step, spec, geometry, key[-1]) if backend == "triton"
                                        else AttentionPlan(step=None, kind=None, backend=backend, rows=step_rows(step)))
    return dataclasses.replace(plan, step=step)


def _kernel_plan(step: StepPlan, spec: LayerCacheSpec, geometry: ModelGeometry, capturing: bool) -> AttentionPlan:
    layer, positions = spec.layer, step.positions
    rows, device = positions.shape[0], positions.device

    def shared(key, make):  # tensors more than one kind reads (CSA's and HCA's RoPE is one): made once a step
        key = ("shared", *key, capturing)
        if key not in step.layer_plans:
            step.layer_plans[key] = make()
        return step.layer_plans[key]

    fields = dict(cos_sin=shared(("rope", layer.rope), lambda: rope_cos_sin(layer.rope, positions)),
                  row_slots=shared(("rows",), lambda: torch.arange(rows, dtype=torch.int32, device=device)),
                  decode=step.num_tokens == step.num_requests)
    if layer.compressed:
        fields.update(entry_cos_sin=shared(("entry rope", layer.rope, layer.ratio), lambda: rope_cos_sin(
                          layer.rope, step.entries[layer.ratio].index * layer.ratio)),
                      max_entries=max(step.max_seq_len // layer.ratio, 1))
    if layer.kind is LayerKind.CSA:
        from ..ops.indexer.kernel import counts_digits, fp8_query_wanted
        from ..ops.topk.kernel import takes_first_digit_counts, topk_workspace
        columns = score_columns(step, layer.ratio)
        workspace = topk_workspace(rows, columns, geometry.index_topk, device)
        fields.update(score_columns=columns,
                      visible=torch.clamp((positions + 1) // layer.ratio, min=0).to(torch.int32),
                      indexer_fp8=fp8_query_wanted(step, spec.index, columns),
                      counts_digit=counts_digits(step) and takes_first_digit_counts(rows, columns),
                      topk_workspace=workspace)
    return AttentionPlan(step=None, kind=layer.kind, backend="triton", **fields)
