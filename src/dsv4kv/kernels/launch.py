"""Programmatic dependent launch (PDL) between the kernels of a step.

A decode step is a chain of short kernels, and between two of them the GPU drains one grid before it launches the
next. Launched with PDL (`launch_options`), a kernel may be launched while the kernel before it in its stream still
runs. Its programs then wait in `wait_for_prior_grids`, which every kernel here calls before it reads or writes
global memory:
- the wait returns once the grid before it has completed and its writes are visible;
- then it lets the next kernel launch.

The wait is transitive: a kernel completes only after its own wait has returned, so when a wait returns, everything
earlier in the stream is complete. Every read and write happens in stream order, as without PDL. What PDL hides is
the launch. A kernel before it that was not launched with PDL (a torch op) lets the next launch only when it
completes. Without PDL the wait returns at once.

`DEPENDENT_LAUNCH = False` launches without PDL (read at each launch; the bench compares the two). The interpreter
runs no inline PTX and launches nothing early, so there the wait is compiled out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..backend import interpreted

__all__ = ["DEPENDENT_LAUNCH", "launch_options", "wait_for_prior_grids"]

DEPENDENT_LAUNCH = True
_GPU = tl.constexpr(not interpreted())


def launch_options(device: torch.device) -> dict:
    """Launch keywords for a kernel of this package on `device`: PDL on a GPU while DEPENDENT_LAUNCH is set."""
    return {"launch_pdl": True} if DEPENDENT_LAUNCH and device.type == "cuda" else {}


@triton.jit
def wait_for_prior_grids():
    """Wait for the grid before this one in the stream (complete, its writes visible), then let the next launch.
    The first statement of every kernel here."""
    if _GPU:
        gdc_wait()
        gdc_launch_dependents()
