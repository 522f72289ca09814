"""Compress-and-insert: every compressed entry that completes in a step, pooled, normed, roped, stored.

Entry j of ratio m pools, per channel, with a softmax over rows (fp32):
- HCA (no overlap, rows of width d): the m rows of tokens [j*m, (j+1)*m);
- CSA (overlap, rows of width 2d): tokens [(j-1)*m, j*m) through their low half (dims 0:d), then tokens
  [j*m, (j+1)*m) through their high half (dims d:2d): 2m rows. For j = 0 the previous rows are kv 0 with
  logit -inf (weight 0).
Then RMSNorm with weight (fp32), RoPE at position j*m, rounding to the activation dtype, and the entry
format's encoding into the paged pool.

Rows come from the step's new rows where the token is in this step, else from the request's state ring
(which append has not yet overwritten: compress before append). A prefill chunk completes many entries,
and an entry may straddle chunks; both read the same way.
"""

from __future__ import annotations

import torch

from ...geometry import RopeSpec
from ...cache.layout import EntryLayout
from ...cache.plan import StepPlan
from ..shared.rows import StepRows, step_rows
from ...checks import check_float, require
from ..projection.reference import rms_norm
from ..rope.reference import apply_rope

__all__ = ["pool_entries", "compress_and_insert"]


def _window_rows(state: torch.Tensor, step: torch.Tensor, rows: StepRows, request: torch.Tensor,
                 positions: torch.Tensor, empty: float) -> torch.Tensor:
    """Rows [E, R, w] of tokens `positions` [E, R] of batch rows `request` [E]: from `step` [N, w] when the
    token is in this step, from the ring `state` [slots, ring, w] when older, `empty` when negative."""
    start = rows.starts[request].unsqueeze(1)
    in_step = positions >= start
    step_index = (rows.query_start[request].unsqueeze(1) + positions - start).clamp(0, max(step.shape[0] - 1, 0))
    ring_index = positions.clamp(min=0) % state.shape[1]
    from_ring = state[rows.request_slots[request].unsqueeze(1), ring_index]
    from_step = step.float()[step_index] if step.shape[0] else from_ring
    out = torch.where(in_step.unsqueeze(-1), from_step, from_ring)
    return torch.where((positions >= 0).unsqueeze(-1), out, torch.full_like(out, empty))


def pool_entries(state_kv: torch.Tensor, state_logits: torch.Tensor, plan: StepPlan, kv_rows: torch.Tensor,
                 logit_rows: torch.Tensor, *, ratio: int, overlap: bool, rows: StepRows | None = None) -> torch.Tensor:
    """The softmax pooling of every entry of `ratio` completing in the plan -> fp32 [E, d] (plan.entries order).

    state_kv / state_logits: fp32 [max_requests, R, w] rings; kv_rows / logit_rows: [N, w] this step's rows
    (logits already include the positional bias). w = 2d with overlap (CSA), d without (HCA).
    """
    rows = rows if rows is not None else step_rows(plan)
    require(state_kv.shape == state_logits.shape and state_kv.dim() == 3,
            f"pool_entries: state shapes differ: {list(state_kv.shape)} / {list(state_logits.shape)}")
    width = state_kv.shape[2]
    check_float("kv_rows", kv_rows, (rows.num_tokens, width), state_kv.device)
    check_float("logit_rows", logit_rows, (rows.num_tokens, width), state_kv.device)
    require(ratio in plan.entries, f"pool_entries: the plan has no entries of ratio {ratio}")
    writes = plan.entries[ratio]
    request = writes.request[:writes.count].long()
    index = writes.index[:writes.count].long()
    span = 2 * ratio if overlap else ratio
    first = (index - 1 if overlap else index) * ratio
    positions = first.unsqueeze(1) + torch.arange(span, device=index.device)  # [E, span]
    kv = _window_rows(state_kv, kv_rows, rows, request, positions, 0.0)
    logits = _window_rows(state_logits, logit_rows, rows, request, positions, float("-inf"))
    if overlap:  # previous block through the low half, own block through the high half
        d = width // 2
        kv = torch.cat((kv[:, :ratio, :d], kv[:, ratio:, d:]), dim=1)
        logits = torch.cat((logits[:, :ratio, :d], logits[:, ratio:, d:]), dim=1)
    return (kv * logits.softmax(dim=1)).sum(dim=1)


def compress_and_insert(state_kv: torch.Tensor, state_logits: torch.Tensor, plan: StepPlan, kv_rows: torch.Tensor,
                        logit_rows: torch.Tensor, *, ratio: int, overlap: bool, norm_weight: torch.Tensor,
                        eps: float, rope: RopeSpec, out_dtype: torch.dtype, layout: EntryLayout, pool: torch.Tensor,
                        page_tokens: int, rows: StepRows | None = None) -> torch.Tensor:
    """Pool, RMSNorm (weight, fp32), RoPE at j*m, round to `out_dtype`, encode into `pool` at the plan's slots.

    Returns the entries as written, before encoding: `out_dtype` [E, d].
    """
    rows = rows if rows is not None else step_rows(plan)
    pooled = pool_entries(state_kv, state_logits, plan, kv_rows, logit_rows, ratio=ratio, overlap=overlap, rows=rows)
    require(norm_weight.shape == (pooled.shape[1],) and layout.dim == pooled.shape[1],
            f"compress_and_insert: entry width {pooled.shape[1]}, norm weight {list(norm_weight.shape)}, "
            f"layout {layout.dim}")
    writes = plan.entries[ratio]
    normed = rms_norm(pooled, norm_weight, eps)  # fp32 pooled rows: the result stays fp32
    entries = apply_rope(normed, writes.index[:writes.count].long() * ratio, rope).to(out_dtype)
    layout.write(pool, page_tokens // ratio, writes.slots[:writes.count], entries)
    return entries


def compressor_logits(gate: torch.Tensor, bias: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Logit rows of the compressor: gate [N, w] + bias [m, w] at position % m -> fp32 [N, w].

    The learned positional bias (`ape` / `position_bias`) goes on the logits only, never on the kv rows.
    """
    require(gate.dim() == 2 and bias.dim() == 2 and gate.shape[1] == bias.shape[1] and gate.is_floating_point()
            and bias.is_floating_point() and positions.shape == gate.shape[:1],
            f"compressor_logits: expected gate [N, w] and bias [m, w] (float) and positions [N], got "
            f"{gate.dtype} {list(gate.shape)}, {bias.dtype} {list(bias.shape)} and {list(positions.shape)}")
    return gate.float() + bias.float()[positions.long() % bias.shape[0]]


def append_state(state_kv: torch.Tensor, state_logits: torch.Tensor, plan: StepPlan, kv_rows: torch.Tensor,
                 logit_rows: torch.Tensor, rows: StepRows | None = None) -> None:
    """Write kv_rows / logit_rows [N, w] into the state rings [max_requests, R, w] (fp32) at position % R."""
    rows = rows if rows is not None else step_rows(plan)
    require(state_kv.shape == state_logits.shape and state_kv.dim() == 3
            and state_kv.dtype == state_logits.dtype == torch.float32,
            f"append_state: expected fp32 state [requests, R, w] twice, got {list(state_kv.shape)} / "
            f"{list(state_logits.shape)} {state_kv.dtype}")
    width, ring = state_kv.shape[2], state_kv.shape[1]
    check_float("kv_rows", kv_rows, (rows.num_tokens, width), state_kv.device)
    check_float("logit_rows", logit_rows, (rows.num_tokens, width), state_kv.device)
    keep = rows.positions >= rows.seq_lens[rows.token_request] - ring
    slot = rows.request_slots[rows.token_request][keep]
    row = rows.positions[keep] % ring
    state_kv[slot, row] = kv_rows[keep].float()
    state_logits[slot, row] = logit_rows[keep].float()
