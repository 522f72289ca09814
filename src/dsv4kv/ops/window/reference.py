"""Append: a step's new rows into each request's per-slot state.

- the window ring: each token's kv, encoded in the main-entry format, at `plan.window_slots`;
- the compressor state: each token's projected kv row and logit row (gate + positional bias), fp32,
  in a ring of `rows` rows per request slot at position % rows.

Only a request's last `window` (resp. `rows`) tokens of the step are written: earlier ones would be
overwritten in the same step. Run append *after* the step's reads (window gather, compress-and-insert):
the rows it overwrites can still be needed by the step's own earlier tokens.
"""

from __future__ import annotations

import torch

from ...cache.layout import EntryLayout
from ...cache.plan import StepPlan
from ..shared.rows import StepRows, step_rows
from ...checks import check_float, require

__all__ = ["append_window"]


def append_window(window_pool: torch.Tensor, layout: EntryLayout, window: int, plan: StepPlan,
                  kv: torch.Tensor) -> None:
    """Write kv [N, head_dim] (float, plan order) into the window ring pool [max_requests, window_bytes]."""
    check_float("kv", kv, (plan.num_tokens, layout.dim), window_pool.device)
    layout.write(window_pool.view(-1, layout.page_bytes(window)), window, plan.window_slots[:plan.num_tokens], kv)


