"""What the kernels' public wrappers share: input validation (kernels trust their inputs, the wrappers
do not) and where a kernel may run.

Kernels run over every row of a plan's buffers, padding included: a plan built into persistent
`StepBuffers` has `positions.shape[0]` (= max_tokens) rows, of which rows past `num_tokens` are padding
(position -1) that the kernels skip or answer with zeros. Nothing reads `num_tokens` on the device side,
so a captured CUDA graph replays over any plan written into the same buffers.
"""

from __future__ import annotations

import functools

import torch

from ...cache.layout import EntryLayout
from ...checks import check_tensor, require
from ...backend import interpreted, kernels_can_run

__all__ = ["interpreted", "kernels_can_run", "check_pool", "check_plan", "padded_rows", "sm_count",
           "hopper_or_later", "overlaps"]


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of a and b (from their first element, numel elements on) intersect."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def check_pool(name: str, pool, layout: EntryLayout, entries: int, device: torch.device) -> None:
    """A paged pool uint8 [pages, layout.page_bytes(entries)] on `device`, contiguous: kernels write it in
    place, so a non-contiguous pool is rejected, never copied."""
    check_tensor(name, pool, dtype=torch.uint8, shape=(None, layout.page_bytes(entries)), device=device)


def check_plan(plan, device: torch.device) -> None:
    """A StepPlan whose buffers live on `device` (the kernels read them there)."""
    from ...cache.plan import StepPlan

    require(isinstance(plan, StepPlan), f"plan: expected a StepPlan, got {type(plan).__name__}")
    require(plan.positions.device == device, f"plan: on {plan.positions.device}, the pools are on {device}")


def padded_rows(plan) -> int:
    """Token rows the kernels run over: every row of the plan's buffers, padding included."""
    return plan.positions.shape[0]


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device: the launch heuristics size their grids in programs per SM."""
    return _properties(_index(device))[0]


def hopper_or_later(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or more: programmatic dependent launch, bf16x2 multiplies and FP8
    MMAs (the tested target; older GPUs take the plain paths)."""
    return _properties(_index(device))[1] >= 9


@functools.lru_cache(maxsize=None)
def _properties(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.major
