"""The cache's tensors: per-layer paged pools (indexed by block id), per-request state (indexed by request
slot) and, with prefix caching, boundary snapshots (indexed by snapshot id). Shapes and bytes come from
`CacheSpec`; nothing here decides a size, and nothing here decides *which* bytes move: the manager does.

Each kind of tensor (the window rings, a ratio's entry pools, ...) of the layers that share its shape lives in one
allocation, a layer's tensor a contiguous view of it (`CachePools.stacks`): one indexing op then moves a row of every
layer at once (a tentative step's undo log, cache/rollback.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .plan import SnapshotWrites
from .spec import CacheSpec, LayerCacheSpec

__all__ = ["LayerCache", "CachePools", "POISON_BYTE", "wide_views"]

_FIELDS = ("window", "entries", "index_keys", "state_kv", "state_score", "index_state_kv", "index_state_score",
           "boundary_window", "boundary_kv", "boundary_score", "boundary_index_kv", "boundary_index_score")
_ALIGN = 256  # bytes: where each layer's tensor starts in its group's allocation (kernels specialize on alignment)

# 0xFF is NaN in e4m3, bf16, ue8m0 and fp32; an MXFP4 key's data byte 0xFF is a valid e2m1 pair, but its
# 0xFF scale makes the key NaN. A read of a never-written entry in a poisoned cache cannot pass for data.
POISON_BYTE = 0xFF


def wide_views(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """uint8 tensors (bytes in a contiguous last dim) viewed as the widest integer type that divides every last dim,
    address and stride: an indexing op moves elements, so 8-byte ones move 8x fewer."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        w = dtype.itemsize
        if all(t.shape[-1] % w == 0 and t.data_ptr() % w == 0 and all(st % w == 0 for st in t.stride()[:-1])
               for t in tensors):
            return [t.view(dtype) for t in tensors]
    return list(tensors)


@dataclass
class LayerCache:
    """One layer's storage. Block-indexed pools hold `entries_per_page` entries per block; request-slot
    indexed tensors hold one row per live request; snapshot-indexed tensors (prefix caching) hold one
    boundary state per row, the last row a scratch target for padding."""

    spec: LayerCacheSpec
    window: torch.Tensor  # uint8 [max_requests, window_bytes]: ring of `window` main entries, slot = r * window + pos % window
    entries: torch.Tensor | None  # uint8 [num_blocks, entry_page_bytes]: compressed main entries (CSA, HCA)
    index_keys: torch.Tensor | None  # uint8 [num_blocks, index_page_bytes]: indexer keys (CSA)
    state_kv: torch.Tensor | None  # fp32 [max_requests, state_rows, state_width]: projected rows, ring by pos % rows
    state_score: torch.Tensor | None  # fp32, same shape: gate logits + positional bias; -inf = no row yet
    index_state_kv: torch.Tensor | None  # fp32 [max_requests, state_rows, 2 * index_head_dim] (CSA)
    index_state_score: torch.Tensor | None
    # prefix caching, snapshot s at a boundary B: the window ring as the request held it at B (same slot
    # layout, pos % window), and for CSA the compressor rows of tokens B-m .. B-1 at row pos % m
    boundary_window: torch.Tensor | None = None  # uint8 [snapshots + 1, window_bytes]
    boundary_kv: torch.Tensor | None = None  # fp32 [snapshots + 1, m, state_width] (CSA)
    boundary_score: torch.Tensor | None = None
    boundary_index_kv: torch.Tensor | None = None  # fp32 [snapshots + 1, m, 2 * index_head_dim] (CSA)
    boundary_index_score: torch.Tensor | None = None
    scratch: int = 0  # the snapshot id that padding rows' captures go to

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.window, self.entries, self.index_keys, self.state_kv, self.state_score,
                            self.index_state_kv, self.index_state_score, self.boundary_window, self.boundary_kv,
                            self.boundary_score, self.boundary_index_kv, self.boundary_index_score) if t is not None]

    def request_tensors(self) -> list[tuple[torch.Tensor, bool]]:
        """What one request owns in this layer, as (tensor, paged): paged pools are indexed by block id, the
        rest by request slot."""
        return [(t, paged) for t, paged in ((self.entries, True), (self.index_keys, True), (self.window, False),
                                            (self.state_kv, False), (self.state_score, False),
                                            (self.index_state_kv, False), (self.index_state_score, False))
                if t is not None]

    def state_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """CSA: (ring kv, ring logits, snapshot kv, snapshot logits) of the main and the indexer compressor."""
        if self.boundary_kv is None:
            return []
        return [(self.state_kv, self.state_score, self.boundary_kv, self.boundary_score),
                (self.index_state_kv, self.index_state_score, self.boundary_index_kv, self.boundary_index_score)]

    def write_boundaries(self, snapshots: SnapshotWrites | None, *, kv: torch.Tensor | None = None,
                         step_kv: torch.Tensor | None = None, state_rows: Sequence = ()) -> None:
        """Prefix caching, after the layer's appends: copy the step's rows that belong to a boundary snapshot
        (`snapshots`, the plan's) into this layer's snapshots.

        kv: the reference path's kv [N, head_dim] (float, as `append_window` takes it), encoded here exactly as
        the ring encodes it; or step_kv: the kernel path's encoded step page (uint8 [1, page_bytes(R)], every
        padded row; no host sync, so a captured graph replays it). state_rows: the layer's (ring kv, ring logits,
        kv rows [N, w], logit rows [N, w]) for the main then the indexer compressor (CSA)."""
        if snapshots is None:
            return
        layout = self.spec.main
        states = [(kv_rows, logit_rows) for _, _, kv_rows, logit_rows in state_rows]
        if step_kv is not None:
            rows = snapshots.window_slots.shape[0]
            data, scales = layout.page_views(step_kv, rows)
            self._capture_window(snapshots.window_slots, data[0], scales[0])
            self._capture_state(snapshots.state_slots, states)
            return
        if snapshots.count == 0:
            return
        n = kv.shape[0]
        keep = snapshots.window_slots[:n] >= 0
        if bool(keep.any()):
            data, scales = layout.encode(kv[keep])
            self._capture_window(snapshots.window_slots[:n][keep], data, scales)
        keep = snapshots.state_slots[:n] >= 0
        if bool(keep.any()) and states:
            self._capture_state(snapshots.state_slots[:n][keep],
                                [(kv_rows[keep], logit_rows[keep]) for kv_rows, logit_rows in states])

    def _capture_window(self, slots: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> None:
        """Encoded window entries into snapshots: slots [N] = snapshot * window + pos % window, or -1; data uint8
        [N, data_bytes], scales uint8 [N, scale_bytes] (byte for byte what the ring receives). Rows -1 go to the
        scratch snapshot: no branch, no host sync, so a captured graph replays it."""
        if self.boundary_window is None:
            return
        window = self.spec.window
        dst = torch.where(slots >= 0, slots, torch.full_like(slots, self.scratch * window)).long()
        data_dst, scale_dst = self.spec.main.page_views(self.boundary_window, window)
        page, offset = dst // window, dst % window
        data_dst[page, offset] = data
        if self.spec.main.scale_bytes:
            scale_dst[page, offset] = scales

    def _capture_state(self, slots: torch.Tensor, rows: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """CSA compressor rows into snapshots: slots [N] = snapshot * m + pos % m, or -1 (scratch); rows: (kv, logits)
        fp32 [N, w] of the main then the indexer compressor. Other layers: nothing."""
        pairs = self.state_pairs()
        if not pairs:
            return
        m = self.spec.boundary_rows
        dst = torch.where(slots >= 0, slots, torch.full_like(slots, self.scratch * m)).long()
        page, offset = dst // m, dst % m
        for (_, _, snap_kv, snap_score), (kv_rows, logit_rows) in zip(pairs, rows):
            snap_kv[page, offset] = kv_rows.float()
            snap_score[page, offset] = logit_rows.float()


class CachePools:
    def __init__(self, spec: CacheSpec, *, num_blocks: int, max_requests: int, device: torch.device,
                 fill_byte: int = 0, snapshots: int = 0):
        self.spec = spec
        self.num_blocks = num_blocks
        self.max_requests = max_requests
        self.fill_byte = fill_byte
        self.snapshots = snapshots  # the scratch snapshot is id `snapshots`

        # (shape, dtype, fill) of each layer's tensors first; allocated below, one group of equal ones at a time
        def pool(rows: int, row_bytes: int) -> tuple | None:
            return ((rows, row_bytes), torch.uint8, fill_byte) if row_bytes and rows else None

        def state(slots: int, rows: int, width: int, fill: float) -> tuple | None:
            return ((slots, rows, width), torch.float32, fill) if width and rows and slots else None

        snapshot_rows = snapshots + 1 if snapshots else 0
        self.layers: list[LayerCache] = []
        for layer in spec.layers:
            m = layer.boundary_rows
            self.layers.append(LayerCache(
                spec=layer,
                window=pool(max_requests, layer.window_bytes),
                entries=pool(num_blocks, layer.entry_page_bytes),
                index_keys=pool(num_blocks, layer.index_page_bytes),
                state_kv=state(max_requests, layer.state_rows, layer.state_width, 0.0),
                state_score=state(max_requests, layer.state_rows, layer.state_width, float("-inf")),
                index_state_kv=state(max_requests, layer.state_rows, layer.index_state_width, 0.0),
                index_state_score=state(max_requests, layer.state_rows, layer.index_state_width, float("-inf")),
                boundary_window=pool(snapshot_rows, layer.window_bytes),
                boundary_kv=state(snapshot_rows, m, layer.state_width, 0.0),
                boundary_score=state(snapshot_rows, m, layer.state_width, float("-inf")),
                boundary_index_kv=state(snapshot_rows, m, layer.index_state_width, 0.0),
                boundary_index_score=state(snapshot_rows, m, layer.index_state_width, float("-inf")),
                scratch=snapshots,
            ))
        self._stacks: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
        self._stack_rows: dict[str, list[tuple[torch.Tensor, int]]] = {}
        for name in _FIELDS:
            groups: dict[tuple, list[int]] = {}
            for i, layer in enumerate(self.layers):
                if getattr(layer, name) is not None:
                    groups.setdefault(getattr(layer, name), []).append(i)
            self._stacks[name], self._stack_rows[name] = [], []
            for (shape, dtype, fill), indices in groups.items():
                # each layer's rows padded to whole rows at an _ALIGN boundary: the group is then also one tensor of
                # rows (`stack_rows`), where one index_select reaches any layer's rows
                row_bytes = math.prod(shape[1:]) * torch.empty(0, dtype=dtype).element_size()
                step = _ALIGN // math.gcd(row_bytes, _ALIGN)
                rows = -(-shape[0] // step) * step
                storage = torch.full((len(indices), rows, *shape[1:]), fill, dtype=dtype, device=device)
                for k, i in enumerate(indices):
                    setattr(self.layers[i], name, storage[k, :shape[0]])
                self._stacks[name].append((tuple(indices), storage[:, :shape[0]]))
                self._stack_rows[name].append((storage.flatten(0, 1), rows))

    def stacks(self, name: str) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """`LayerCache.<name>` of every layer that has one, as (layer indices, view [layers, *shape]) per group of
        layers stored together: one indexing op on a group's view reaches the rows of all its layers."""
        return self._stacks[name]

    def stack_rows(self, name: str) -> list[tuple[torch.Tensor, int]]:
        """Per group of `stacks(name)`, its storage as one tensor of rows and the rows per layer: row
        `position * rows_per_layer + r` is row r of the group's layer at `position`. A layer's rows past its own
        (padding to a 256-byte boundary, a few MiB over a V4 cache at most) are not part of `nbytes`."""
        return self._stack_rows[name]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())

    def reset_request(self, slot: int) -> None:
        """Fresh state for a newly admitted request: empty compressor rows (kv 0, logits -inf) and,
        so stale entries of the slot's previous owner are never mistaken for data, a refilled window."""
        for layer in self.layers:
            layer.window[slot].fill_(self.fill_byte)
            for kv, score in ((layer.state_kv, layer.state_score), (layer.index_state_kv, layer.index_state_score)):
                if kv is not None:
                    kv[slot].zero_()
                    score[slot].fill_(float("-inf"))

    # --- prefix caching: boundary snapshots ----------------------------------------------------------
    def copy_to_snapshot(self, slot: int, snapshot: int, window_positions: Sequence[int],
                         state_positions: Sequence[int]) -> None:
        """Copy ring rows of the request in `slot` (positions it holds now) into `snapshot`, every layer."""
        device = self.layers[0].window.device
        w_pos = torch.tensor(list(window_positions), dtype=torch.long, device=device)
        s_pos = torch.tensor(list(state_positions), dtype=torch.long, device=device)
        for layer in self.layers:
            if layer.boundary_window is None:
                continue
            spec = layer.spec
            if w_pos.numel():
                offset = w_pos % spec.window
                src_data, src_scales = spec.main.page_views(layer.window, spec.window)
                dst_data, dst_scales = spec.main.page_views(layer.boundary_window, spec.window)
                dst_data[snapshot, offset] = src_data[slot, offset]
                dst_scales[snapshot, offset] = src_scales[slot, offset]
            if s_pos.numel():
                for ring_kv, ring_score, snap_kv, snap_score in layer.state_pairs():
                    snap_kv[snapshot, s_pos % spec.boundary_rows] = ring_kv[slot, s_pos % spec.state_rows]
                    snap_score[snapshot, s_pos % spec.boundary_rows] = ring_score[slot, s_pos % spec.state_rows]

    def restore(self, snapshot: int, slot: int, boundary: int) -> None:
        """Give the (freshly reset) request in `slot` the state of `snapshot`, taken at token `boundary`."""
        for layer in self.layers:
            if layer.boundary_window is None:
                continue
            layer.window[slot].copy_(layer.boundary_window[snapshot])
            m = layer.spec.boundary_rows
            if not m:
                continue
            positions = torch.arange(boundary - m, boundary, device=layer.window.device)
            for ring_kv, ring_score, snap_kv, snap_score in layer.state_pairs():
                ring_kv[slot, positions % layer.spec.state_rows] = snap_kv[snapshot, positions % m]
                ring_score[slot, positions % layer.spec.state_rows] = snap_score[snapshot, positions % m]

    # --- preemption: a request's bytes to host memory and back ----------------------------------------
    def save(self, slot: int, blocks: Sequence[int]) -> list[torch.Tensor]:
        """Host copies (pinned on CUDA) of everything the request in `slot` with `blocks` owns: per layer, in
        `LayerCache.request_tensors` order, the paged pools' rows of its blocks and its slot's rows."""
        device = self.layers[0].window.device
        pin = device.type == "cuda"
        index = torch.tensor(list(blocks), dtype=torch.long, device=device)
        saved = []
        for layer in self.layers:
            for tensor, paged in layer.request_tensors():
                if paged:
                    rows = torch.empty((index.numel(), *tensor.shape[1:]), dtype=tensor.dtype, device=device)
                    pool, out = wide_views(tensor, rows)
                    torch.index_select(pool, 0, index, out=out)
                else:
                    rows = tensor[slot]
                host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=pin)
                host.copy_(rows, non_blocking=pin)  # ordered before any later kernel on the stream
                saved.append(host)
        return saved

    def load(self, saved: Sequence[torch.Tensor], slot: int, blocks: Sequence[int], copy: Sequence[int]) -> None:
        """Inverse of `save` into `slot` and `blocks` (the request's new block ids, in order), writing only the
        block rows at indices `copy` (ascending, each once; the others are shared cached blocks that still hold these
        bytes)."""
        device = self.layers[0].window.device
        pin = device.type == "cuda"
        copy = list(copy)
        dst = torch.tensor([blocks[i] for i in copy], dtype=torch.long, device=device)
        src = torch.tensor(copy, dtype=torch.long, device=device)
        it = iter(saved)
        for layer in self.layers:
            for tensor, paged in layer.request_tensors():
                host = next(it)
                if not paged:
                    tensor[slot].copy_(host, non_blocking=pin)
                elif copy:
                    # select on the device: on the host the (asynchronous) swap-out copy may not have landed yet
                    rows = host.to(device, non_blocking=pin)
                    if len(copy) != rows.shape[0]:
                        rows = rows[src]
                    pool, rows = wide_views(tensor, rows.contiguous())
                    pool.index_copy_(0, dst, rows)
