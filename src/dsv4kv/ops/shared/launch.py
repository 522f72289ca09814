"""Programmatic dependent launch (PDL) between the kernels of a step.

A decode step is a chain of short kernels, and without PDL the GPU launches a kernel only after the kernel before it
has completed. Launched with PDL (`launch_options`), a kernel may be launched as soon as every program of the kernel
before it in its stream has exited, and its programs wait in `wait_for_prior_grids` until that kernel has completed
and its writes are visible. Every kernel here calls it before it reads or writes global memory, but for the second
kernel of the two pairs below.

The wait is transitive: a kernel's programs exit only after their own wait has returned, so when a wait returns,
everything earlier in the stream is complete. Every read and write happens in stream order, as without PDL; what PDL
hides is part of the launch. The argument needs every kernel launched with PDL to wait before it touches memory:
this package launches only its own kernels so (the pairs below keep the argument by other means). The kernel before
ours may be any kernel (a torch op): our wait covers it all the same. Copies and cross-stream event waits are full
dependencies.

As a rule no kernel lets the next one launch early (`griddepcontrol.launch_dependents` right after the wait): the
next grid's programs would then hold SM slots while they wait (slower than PDL alone, docs/performance.md).

Two pairs run side by side on purpose: the CSA layer's indexer compress and its indexer query
(`compress_insert(launch_next=True)`, `indexer_query_and_weights(wait_late=True)`; either may go first), and a window
layer's q RoPE and its kv insert (`kv_insert(wait_late=True)`). The first of a pair lets the next grid launch right
after its own wait (`let_next_grid_launch`); the second touches no tensor the first does and calls its wait last,
before every exit. It launches only once every program of the first has passed its wait, so everything before the
pair is complete when it reads; and it completes only after the first has, so the transitive argument above holds
for the kernel after the pair. Whatever the second reads must be complete before the first started (its wrapper
refuses to make its RoPE tables itself). And the first must launch, as the second's wait is on it:
`compress_insert(launch_next=True)` launches one program where no entry completes.

PDL and the wait's instruction need Hopper (sm_90) or later: on older GPUs the wait is compiled out and kernels are
launched plainly. Inside `with dependent_launch(False):` kernels launch plainly everywhere (a context variable,
read at each launch: the current thread and context only). The interpreter runs no inline PTX and launches nothing
early, so there the wait is a plain function that does nothing.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import triton
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.language.target_info import cuda_capability_geq

from ...backend import interpreted
from ...checks import require
from .common import hopper_or_later

__all__ = ["dependent_launch", "launch_options", "wait_for_prior_grids", "let_next_grid_launch", "check_wait_late"]

_dependent_launch = contextvars.ContextVar("dependent_launch", default=True)


@contextlib.contextmanager
def dependent_launch(enabled: bool):
    """Launch this package's kernels with PDL (`enabled`, the default outside any such block) or plainly, inside the
    block (e.g. a test's eager twin of a captured graph)."""
    require(isinstance(enabled, bool), f"enabled: expected a bool, got {enabled!r}")
    token = _dependent_launch.set(enabled)
    try:
        yield
    finally:
        _dependent_launch.reset(token)


def launch_options(device: torch.device) -> dict:
    """Launch keywords for a kernel of this package on `device`: PDL on a Hopper or later GPU, unless inside
    `dependent_launch(False)`."""
    return {"launch_pdl": True} if _dependent_launch.get() and device.type == "cuda" and hopper_or_later(device) else {}


def check_wait_late(op: str, wait_late, tables_given: bool) -> None:
    """A wrapper's `wait_late` argument: a bool, and only with the caller's RoPE tables. The kernel reads its inputs
    before its wait, so none may be made by a kernel launched right before it (the wrapper's own `rope_cos_sin`)."""
    require(isinstance(wait_late, bool), f"wait_late: expected a bool, got {wait_late!r}")
    require(not wait_late or tables_given, f"{op}: wait_late needs the caller's cos_sin")


def check_pair_ends(op: str, launch_next, wait_late, tables_given: bool) -> None:
    """A wrapper that can be either end of a pair: `launch_next` a bool, `wait_late` as `check_wait_late`, not both."""
    require(isinstance(launch_next, bool), f"launch_next: expected a bool, got {launch_next!r}")
    check_wait_late(op, wait_late, tables_given)
    require(not (wait_late and launch_next), f"{op}: wait_late and launch_next are the two ends of a pair; pass at "
                                             f"most one")


if interpreted():
    def wait_for_prior_grids():
        """Nothing to wait for: the interpreter runs kernels one after another as Python (a plain function, where a
        jit helper would cost ~0.5 ms per program there)."""

    def let_next_grid_launch():
        """Nothing to launch early under the interpreter."""
else:
    @triton.jit
    def let_next_grid_launch():
        """Let the next grid in the stream launch now, before this one's programs exit (`griddepcontrol
        .launch_dependents`). Only after `wait_for_prior_grids`: everything before this grid is then complete."""
        if cuda_capability_geq(9, 0):
            gdc_launch_dependents()

    @triton.jit
    def wait_for_prior_grids():
        """Wait until the grid before this one in the stream has completed and its writes are visible (at once
        without PDL). The first statement of every kernel here (the last, before every exit, of a `wait_late`
        kernel); compiled in for sm_90 and later GPUs only (the compiling device's capability)."""
        if cuda_capability_geq(9, 0):
            gdc_wait()
