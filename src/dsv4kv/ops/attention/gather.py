"""Gather: the keys each query row attends to, dequantized to fp32, with a validity mask.

- window: the raw kv of positions max(0, t - window + 1) .. t. Positions before the step come from the
  request's ring (read before append overwrites it); positions in the step from the step's own kv,
  round-tripped through the entry format so a token reads the same value however the sequence was fed.
- compressed entries: by entry index j per query row (the indexer's top-k for CSA, every visible entry
  for HCA); j = -1 is an empty pick.
"""

from __future__ import annotations

import torch

from ...cache.layout import EntryLayout
from ...cache.plan import StepPlan
from ..shared.rows import StepRows, entry_slots, step_rows
from ...checks import check_float, require

__all__ = ["gather_window", "visible_entries", "gather_entries"]


def gather_window(window_pool: torch.Tensor, layout: EntryLayout, window: int, plan: StepPlan,
                  step_kv: torch.Tensor, rows: StepRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Window keys of every token -> (fp32 [N, window, head_dim], valid bool [N, window]).

    step_kv: fp32 [N, head_dim], this step's kv as the format stores it (`layout.round_trip(kv)`).
    Key i of token t is position t - window + 1 + i (oldest first).
    """
    rows = rows if rows is not None else step_rows(plan)
    check_float("step_kv", step_kv, (rows.num_tokens, layout.dim), window_pool.device)
    offsets = torch.arange(window, device=step_kv.device) - (window - 1)
    positions = rows.positions.unsqueeze(1) + offsets  # [N, W]
    start = rows.starts[rows.token_request].unsqueeze(1)
    in_step = positions >= start
    step_index = (rows.query_start[rows.token_request].unsqueeze(1) + positions - start).clamp(min=0)
    ring_slots = rows.request_slots[rows.token_request].unsqueeze(1) * window + positions.clamp(min=0) % window
    ring_slots = torch.where(in_step | (positions < 0), torch.full_like(ring_slots, -1), ring_slots)
    pool = window_pool.view(-1, layout.page_bytes(window))
    from_ring = layout.read(pool, window, ring_slots.flatten()).view(*positions.shape, layout.dim)
    keys = torch.where(in_step.unsqueeze(-1), step_kv[step_index.clamp(max=max(rows.num_tokens - 1, 0))], from_ring)
    return keys, positions >= 0


def visible_entries(plan: StepPlan, *, ratio: int, rows: StepRows | None = None) -> torch.Tensor:
    """Every compressed entry each token may use: long [N, J] of entry indices 0..J-1, -1 past the token's
    visible count (t + 1) // m. J = the largest visible count in the step."""
    rows = rows if rows is not None else step_rows(plan)
    visible = (rows.positions + 1) // ratio
    j = torch.arange(int(visible.max()) if rows.num_tokens else 0, device=visible.device)
    return torch.where(j < visible.unsqueeze(1), j, torch.full_like(j, -1))


def gather_entries(pool: torch.Tensor, layout: EntryLayout, plan: StepPlan, indices: torch.Tensor, *, ratio: int,
                   page_tokens: int, rows: StepRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed entries by index: indices long [N, K] (j, or -1) -> (fp32 [N, K, dim], valid bool [N, K])."""
    rows = rows if rows is not None else step_rows(plan)
    require(indices.dim() == 2 and indices.shape[0] == rows.num_tokens and not indices.is_floating_point(),
            f"gather_entries: expected integer indices [{rows.num_tokens}, K], got {indices.dtype} {list(indices.shape)}")
    request = rows.token_request.unsqueeze(1).expand_as(indices)
    slots = entry_slots(plan, rows, request, indices.long(), ratio=ratio, page_tokens=page_tokens)
    keys = layout.read(pool, page_tokens // ratio, slots.flatten()).view(*indices.shape, layout.dim)
    return keys, indices >= 0
