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

from ..layout import EntryLayout
from ..plan import StepPlan
from .common import StepRows, check_float, require, step_rows

__all__ = ["compressor_logits", "append_window", "append_state"]


def compressor_logits(gate: torch.Tensor, bias: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Logit rows of the compressor: gate [N, w] + bias [m, w] at position % m -> fp32 [N, w].

    The learned positional bias (`ape` / `position_bias`) goes on the logits only, never on the kv rows.
    """
    require(gate.dim() == 2 and bias.dim() == 2 and gate.shape[1] == bias.shape[1] and gate.is_floating_point()
            and bias.is_floating_point() and positions.shape == gate.shape[:1],
            f"compressor_logits: expected gate [N, w] and bias [m, w] (float) and positions [N], got "
            f"{gate.dtype} {list(gate.shape)}, {bias.dtype} {list(bias.shape)} and {list(positions.shape)}")
    return gate.float() + bias.float()[positions.long() % bias.shape[0]]


def append_window(window_pool: torch.Tensor, layout: EntryLayout, window: int, plan: StepPlan,
                  kv: torch.Tensor) -> None:
    """Write kv [N, head_dim] (float, plan order) into the window ring pool [max_requests, window_bytes]."""
    check_float("kv", kv, (plan.num_tokens, layout.dim), window_pool.device)
    layout.write(window_pool.view(-1, layout.page_bytes(window)), window, plan.window_slots[:plan.num_tokens], kv)


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
