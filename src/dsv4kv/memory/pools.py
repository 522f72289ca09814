"""The cache's tensors: per-layer paged pools (indexed by block id) and per-request state (indexed
by request slot). Shapes and bytes come from `CacheSpec`; nothing here decides a size."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .spec import CacheSpec, LayerCacheSpec

__all__ = ["LayerCache", "CachePools", "POISON_BYTE"]

# 0xFF is NaN in e4m3, bf16, ue8m0 and fp32; an MXFP4 key's data byte 0xFF is a valid e2m1 pair, but its
# 0xFF scale makes the key NaN. A read of a never-written entry in a poisoned cache cannot pass for data.
POISON_BYTE = 0xFF


@dataclass
class LayerCache:
    """One layer's storage. Block-indexed pools hold `entries_per_page` entries per block; request-slot
    indexed tensors hold one row per live request."""

    spec: LayerCacheSpec
    window: torch.Tensor  # uint8 [max_requests, window_bytes]: ring of `window` main entries, slot = r * window + pos % window
    entries: torch.Tensor | None  # uint8 [num_blocks, entry_page_bytes]: compressed main entries (CSA, HCA)
    index_keys: torch.Tensor | None  # uint8 [num_blocks, index_page_bytes]: indexer keys (CSA)
    state_kv: torch.Tensor | None  # fp32 [max_requests, state_rows, state_width]: projected rows, ring by pos % rows
    state_score: torch.Tensor | None  # fp32, same shape: gate logits + positional bias; -inf = no row yet
    index_state_kv: torch.Tensor | None  # fp32 [max_requests, state_rows, 2 * index_head_dim] (CSA)
    index_state_score: torch.Tensor | None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.window, self.entries, self.index_keys, self.state_kv, self.state_score,
                            self.index_state_kv, self.index_state_score) if t is not None]


class CachePools:
    def __init__(self, spec: CacheSpec, *, num_blocks: int, max_requests: int, device: torch.device,
                 fill_byte: int = 0):
        self.spec = spec
        self.num_blocks = num_blocks
        self.max_requests = max_requests
        self.fill_byte = fill_byte

        def pool(rows: int, row_bytes: int) -> torch.Tensor | None:
            if row_bytes == 0:
                return None
            return torch.full((rows, row_bytes), fill_byte, dtype=torch.uint8, device=device)

        def state(rows: int, width: int, fill: float) -> torch.Tensor | None:
            if width == 0:
                return None
            return torch.full((max_requests, rows, width), fill, dtype=torch.float32, device=device)

        self.layers: list[LayerCache] = []
        for layer in spec.layers:
            self.layers.append(LayerCache(
                spec=layer,
                window=pool(max_requests, layer.window_bytes),
                entries=pool(num_blocks, layer.entry_page_bytes),
                index_keys=pool(num_blocks, layer.index_page_bytes),
                state_kv=state(layer.state_rows, layer.state_width, 0.0),
                state_score=state(layer.state_rows, layer.state_width, float("-inf")),
                index_state_kv=state(layer.state_rows, layer.index_state_width, 0.0),
                index_state_score=state(layer.state_rows, layer.index_state_width, float("-inf")),
            ))

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
