"""Step plans: everything the kernels of one step need, built once on the host and read by every layer.

All index fields live in one int32 device buffer, filled by a single host-to-device copy. A plan built
into `StepBuffers` (preallocated for capacities) keeps the same tensor addresses every step, so a
captured CUDA graph replays with new contents. Rows past the real counts are padding:

    positions, token_request, window_slots, entry slots / request / index  -> -1  (skip)
    request_slots -> -1, seq_lens -> 0, query_start -> num_tokens            (empty request)
    snapshot window / state slots (prefix caching)                           -> -1  (skip)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from ..checks import positive_int

__all__ = ["EntryWrites", "SnapshotWrites", "StepPlan", "StepStatus", "StepBuffers", "OutOfBlocks", "host_fields"]


@dataclass(frozen=True)
class OutOfBlocks:
    """`plan_step`'s answer when the step needs more blocks than are free. Nothing was changed."""

    needed: int
    free: int

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return f"out of blocks: the step needs {self.needed} new blocks, {self.free} are free"


@dataclass(frozen=True)
class EntryWrites:
    """Compressed entries of one ratio that complete in this step (in request order, then j)."""

    ratio: int
    slots: torch.Tensor  # int32 [E]: pool slot = block * (page_tokens // ratio) + (j * ratio % page_tokens) // ratio
    request: torch.Tensor  # int32 [E]: batch row of the owning request
    index: torch.Tensor  # int32 [E]: entry index j; the entry pools tokens [j * ratio, (j + 1) * ratio)
    count: int  # real entries; rows [count:] are padding


@dataclass(frozen=True)
class SnapshotWrites:
    """Prefix caching: the step's rows that belong to the boundary state of a block the step fills (the window
    and CSA compressor rows just before a block boundary), and where in the snapshots they go. Each layer
    writes them into its own pages' snapshots after its appends (`LayerCache.write_boundaries`); rows before the
    step were copied from the rings when the plan was made."""

    window_slots: torch.Tensor  # int32 [T]: snapshot * window + position % window, or -1
    state_slots: torch.Tensor  # int32 [T]: snapshot * m + position % m (CSA ratio m), or -1
    count: int  # host: rows with a window or state slot (0: a layer may skip the capture, outside a graph)


@dataclass
class StepStatus:
    """The manager's record of one plan, carried by the plan so that a layer checks it without the manager: whether
    a later plan replaced it, which of its requests left since (released or swapped out), and which layers have run
    over it (the manager publishes the blocks it filled once every layer has)."""

    current: bool = True
    left: set[int] = field(default_factory=set)
    layers_run: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class StepPlan:
    """One step of ragged work: tokens of request b are rows query_start[b]:query_start[b+1], in batch order.

    `block_table` is the manager's persistent [max_requests, max_blocks] int32 table (-1 = no block),
    indexed by request slot: request b's i-th block is block_table[request_slots[b], i].
    """

    cache_id: int
    step: int
    request_ids: tuple[int, ...]  # host: the batch's request ids, in order
    num_tokens: int  # host: real token rows
    num_requests: int  # host: real requests
    positions: torch.Tensor  # int32 [T]: absolute position of each token
    token_request: torch.Tensor  # int32 [T]: batch row of each token
    # int32 [T]: window ring slot = request_slot * window + position % window, or -1 for a token that a
    # later token of the same step overwrites (a chunk longer than the window). The ring entries a step
    # overwrites may still be in its own earlier queries' windows: read the window before writing it.
    window_slots: torch.Tensor
    request_slots: torch.Tensor  # int32 [B]: state / block-table row of each request
    query_start: torch.Tensor  # int32 [B + 1]: cumulative new-token counts
    seq_lens: torch.Tensor  # int32 [B]: length after this step (history + new tokens)
    block_table: torch.Tensor  # int32 [max_requests, max_blocks]
    entries: dict[int, EntryWrites]  # per compression ratio
    # host: a bound on seq_lens that sizes the kernels' per-row work (indexer scores span max_seq_len // m
    # entries): the longest request for a plan of its own, the buffers' fixed capacity for persistent buffers
    # (so a captured graph's shapes hold for every later plan)
    max_seq_len: int = 0
    snapshots: SnapshotWrites | None = None  # prefix caching only
    tentative: bool = False  # host: a verify step, settled by `CacheManager.accept` (cache/rollback.py)
    status: StepStatus = field(default_factory=StepStatus, compare=False, repr=False)
    # per layer kind, the attention plan (`model.attention_plan.AttentionPlan`: RoPE tables, visible counts, path
    # choices, workspaces) that the first layer of the kind builds and the others read, and the tensors kinds share
    # (row slots, RoPE tables of one RoPE): built once per step
    layer_plans: dict = field(default_factory=dict, compare=False, repr=False)

    def __repr__(self) -> str:
        entries = ", ".join(f"m={m}: {w.count}" for m, w in self.entries.items())
        return (f"StepPlan(step={self.step}, requests={self.request_ids}, tokens={self.num_tokens}, "
                f"rows={self.positions.shape[0]}, new entries {{{entries}}}, device={self.positions.device})")


FIELD_ALIGN = 16  # int32s: every field starts on a 64-byte boundary


class _Fields:
    """Offsets of each field in the flat int32 buffer, for given capacities. Each field starts on a multiple of
    FIELD_ALIGN: Triton specializes a kernel on whether each pointer is 16-byte aligned, so fields packed back to
    back would move in and out of alignment with the step's token count and cost a compilation per variant."""

    def __init__(self, tokens: int, requests: int, entries: dict[int, int], snapshots: bool = False):
        self.tokens, self.requests, self.entries = tokens, requests, dict(entries)
        sizes = [("positions", tokens), ("token_request", tokens), ("window_slots", tokens),
                 ("request_slots", requests), ("query_start", requests + 1), ("seq_lens", requests)]
        if snapshots:
            sizes += [("snapshot_window", tokens), ("snapshot_state", tokens)]
        for ratio, count in sorted(entries.items()):
            sizes += [(f"slots{ratio}", count), (f"request{ratio}", count), (f"index{ratio}", count)]
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in sizes:
            self.offsets[name] = (start, size)
            start += -(-size // FIELD_ALIGN) * FIELD_ALIGN
        self.total = start

    def view(self, buffer, name):
        start, size = self.offsets[name]
        return buffer[start:start + size]


class StepBuffers:
    """Plan storage for at most `max_tokens` token rows and `max_requests` requests per step.

    Made by `CacheManager.step_buffers` (persistent: pinned staging, fixed device addresses) or per step
    by `plan_step` itself (exact size). A plan built into persistent buffers is overwritten by the next
    `plan_step` that uses them.
    """

    def __init__(self, cache_id: int, ratios: tuple[int, ...], *, max_tokens: int, max_requests: int,
                 device: torch.device, entries: dict[int, int] | None = None, persistent: bool = True,
                 max_seq_len: int | None = None, snapshots: bool = False):
        self.cache_id = cache_id
        self.snapshots = snapshots  # holds prefix caching's capture fields
        self.max_seq_len = max_seq_len  # None: each plan's own longest request
        self.max_tokens = positive_int("max_tokens", max_tokens) if persistent else max_tokens
        self.max_requests = positive_int("max_requests", max_requests) if persistent else max_requests
        # Entries of ratio m completing in a step: sum_b floor((s_b % m + n_b) / m) <= max_tokens // m + max_requests
        self.entry_capacity = dict(entries) if entries is not None else {
            m: max_tokens // m + max_requests for m in ratios}
        self.fields = _Fields(max_tokens, max_requests, self.entry_capacity, snapshots)
        self.device = torch.device(device)
        self.buffer = torch.empty(self.fields.total, dtype=torch.int32, device=self.device)
        self.views = {name: self.fields.view(self.buffer, name) for name in self.fields.offsets}
        pin = persistent and self.device.type == "cuda"
        self._host = torch.empty(self.fields.total, dtype=torch.int32, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None

    def load(self, host_fields: dict[str, np.ndarray], num_tokens: int, num_requests: int) -> dict[str, torch.Tensor]:
        """Write the real rows (padding the rest) and copy to the device; returns device views by name."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy may still read the staging buffer
        host = self._host.numpy()
        host.fill(-1)
        for name, (start, size) in self.fields.offsets.items():
            values = host_fields[name]
            host[start:start + len(values)] = values
        start, size = self.fields.offsets["seq_lens"]
        host[start + num_requests:start + size] = 0
        start, size = self.fields.offsets["query_start"]
        host[start + num_requests + 1:start + size] = num_tokens
        self.buffer.copy_(self._host, non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()
        return self.views


def host_fields(slots: np.ndarray, starts: np.ndarray, counts: np.ndarray, new_entries: dict[int, np.ndarray], *,
                window: int, page_tokens: int, block_table: np.ndarray) -> dict[str, np.ndarray]:
    """A step's index fields on the host (`StepBuffers.load` takes them): request b (state slot slots[b], starts[b]
    tokens before the step) brings counts[b] tokens and completes new_entries[m][b] entries of each ratio m;
    block_table: the host copy of the manager's table, the step's blocks already mapped."""
    rows = np.arange(len(slots))
    query_start = np.concatenate(([0], np.cumsum(counts)))
    token_request = np.repeat(rows, counts)
    positions = np.arange(query_start[-1]) - query_start[token_request] + starts[token_request]
    fields = {
        "positions": positions, "token_request": token_request,
        # Only a request's last `window` tokens land in its ring; earlier tokens of a long chunk would
        # be overwritten within the same step (and duplicate scatter targets are nondeterministic).
        "window_slots": np.where(positions >= (starts + counts)[token_request] - window,
                                 slots[token_request] * window + positions % window, -1),
        "request_slots": slots, "query_start": query_start, "seq_lens": starts + counts,
    }
    for m, per_request in new_entries.items():
        first = starts // m  # entries complete before the step
        entry_request = np.repeat(rows, per_request)
        offsets = np.concatenate(([0], np.cumsum(per_request)))[:-1]
        index = np.arange(per_request.sum()) - offsets[entry_request] + first[entry_request]
        token = index * m
        block = block_table[slots[entry_request], token // page_tokens]
        fields[f"slots{m}"] = block * (page_tokens // m) + (token % page_tokens) // m
        fields[f"request{m}"] = entry_request
        fields[f"index{m}"] = index
    return fields


_cache_ids = itertools.count(1)  # tags plans and buffers with the manager that made them


def new_cache_id() -> int:
    return next(_cache_ids)
