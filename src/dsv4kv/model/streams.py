"""A second CUDA stream for the kernels of a layer step that do not feed each other.

At decode a CSA layer's core is a chain of small launches, each mostly latency. Only the indexer chain (indexer query
and compress, scores, top-k) and attention feed each other; the q RoPE, the kv insert and the main compress feed
attention alone, so they run on a side stream beside the chain and meet it before attention (HCA likewise beside its
main compress; a window layer's chain is its q RoPE and kv insert, and no side kernel feeds its attention). The state
appends run there too, and at decode the window append runs there beside attention (the order is in
`schedules.py`). A CUDA graph captured over the step keeps the two branches as parallel nodes.

Every call is a no-op on the CPU (Triton's interpreter) and with `concurrent=False` (`Schedule.side_stream`): the
kernels then run in program order, which is one of the orders the events allow, so both modes compute the same bytes
(tests/test_kernel_layer.py compares them on the GPU).

Tensors used on the side stream are allocated on the main stream and kept alive until the main stream has joined
the side stream, so the caching allocator never hands their memory out while a side kernel may still use it.
"""

from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["StepStreams"]


@functools.lru_cache(maxsize=None)
def _side_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index)


class StepStreams:
    """The current stream ("main") and one side stream of `device`, with the few orderings a step needs."""

    def __init__(self, device: torch.device, concurrent: bool = True):
        """concurrent=False: every call a no-op, the kernels in program order."""
        self.enabled = concurrent and device.type == "cuda"
        if self.enabled:
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.main = torch.cuda.current_stream(index)
            self.side = _side_stream(index)
            if self.side == self.main:  # a caller already running on our side stream: nothing to overlap with
                self.enabled = False

    def fork(self) -> None:
        """Side-stream work queued from here on starts after everything queued on the main stream so far."""
        if self.enabled:
            self.side.wait_stream(self.main)

    def on_side(self):
        """A context in which launches go to the side stream (on the main one when disabled)."""
        return torch.cuda.stream(self.side) if self.enabled else contextlib.nullcontext()

    def side_mark(self) -> torch.cuda.Event | None:
        """An event after the side stream's work so far (for `main_waits`)."""
        return self.side.record_event() if self.enabled else None

    def main_mark(self) -> torch.cuda.Event | None:
        """An event after the main stream's work so far (for `side_waits`)."""
        return self.main.record_event() if self.enabled else None

    def main_waits(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            self.main.wait_event(event)

    def side_waits(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            self.side.wait_event(event)

    def join(self) -> None:
        """Main-stream work queued from here on starts after everything queued on the side stream so far."""
        if self.enabled:
            self.main.wait_stream(self.side)
