"""What the reference operations share: the step's ragged structure read from a plan, entry addressing,
and input checks.

The reference reads the plan's index fields back to the host once per call (`StepRows`); that sync is
the price of plain PyTorch and is what the Triton kernels of the next issue avoid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cache.plan import StepPlan

__all__ = ["StepRows", "step_rows", "entry_slots"]


@dataclass(frozen=True)
class StepRows:
    """The plan's real rows as device long tensors (padding cut off) and, for loops, host lists."""

    num_tokens: int
    positions: torch.Tensor  # [N]
    token_request: torch.Tensor  # [N]: batch row of each token
    request_slots: torch.Tensor  # [B]
    query_start: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B]
    starts: torch.Tensor  # [B]: length before the step
    host_query_start: list[int]
    host_seq_lens: list[int]
    host_starts: list[int]


def step_rows(plan: StepPlan) -> StepRows:
    n, b = plan.num_tokens, plan.num_requests
    query_start = plan.query_start[:b + 1].long()
    seq_lens = plan.seq_lens[:b].long()
    starts = seq_lens - (query_start[1:] - query_start[:-1])
    return StepRows(
        num_tokens=n, positions=plan.positions[:n].long(), token_request=plan.token_request[:n].long(),
        request_slots=plan.request_slots[:b].long(), query_start=query_start, seq_lens=seq_lens, starts=starts,
        host_query_start=query_start.tolist(), host_seq_lens=seq_lens.tolist(), host_starts=starts.tolist(),
    )


def entry_slots(plan: StepPlan, rows: StepRows, request: torch.Tensor, index: torch.Tensor, *, ratio: int,
                page_tokens: int) -> torch.Tensor:
    """Pool slots of compressed entries: request [...] (batch rows), index [...] (entry j, -1 = none) -> long [...].

    Entry j of a request pools tokens [j*m, (j+1)*m); it lives in the block holding token j*m, at
    offset (j*m % page_tokens) / m. Slots of index -1 are -1.
    """
    tokens = index.clamp(min=0) * ratio
    blocks = plan.block_table[rows.request_slots[request], tokens // page_tokens].long()
    slots = blocks * (page_tokens // ratio) + (tokens % page_tokens) // ratio
    return torch.where((index >= 0) & (blocks >= 0), slots, torch.full_like(slots, -1))
