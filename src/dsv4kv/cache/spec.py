"""Cache spec: what each layer stores and how many bytes it takes. The one source of byte counts;
the pools allocate from it and the planner reports it.

Per layer and kind:
- every layer: a window ring of `window` main entries per request slot (one page of `window` entries);
- CSA / HCA: paged compressed entries, `page_tokens // ratio` per block, plus fp32 compressor state
  per request slot (CSA: 2 blocks of m rows x 2d for kv and for logits; HCA: m rows x d of each);
- CSA also: paged indexer keys and the indexer compressor's state (2m rows x 2 index_head_dim).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..checks import positive_int
from ..geometry import LayerKind, LayerSpec, ModelGeometry
from .layout import EntryLayout, IndexerFormat, KVFormat, indexer_layout, main_layout

__all__ = ["DEFAULT_PAGE_TOKENS", "LayerCacheSpec", "CacheSpec"]

# 1024, not the 256 of vLLM / SGLang: the MODEL1 page format pads a page to a multiple of its data row,
# and a 256-token page holds only 2 HCA entries (1168 B padded to 1728 B, +48% on every HCA pool). At
# 2^20 tokens the whole V4 cache, window and state included, is +1.6..1.9% over the unpadded figure
# with 256-token pages, +1.1..1.2% with 512 and +0.8..0.9% with 1024 (docs/layout.md). A request
# wastes at most one partly filled block. page_tokens=256 gives FlashMLA-shaped 64-entry CSA pages.
DEFAULT_PAGE_TOKENS = 1024
FP32_BYTES = 4


@dataclass(frozen=True)
class LayerCacheSpec:
    layer: LayerSpec
    main: EntryLayout
    index: EntryLayout | None  # CSA only
    page_tokens: int
    window: int
    index_dim: int

    @property
    def entries_per_page(self) -> int:
        return self.page_tokens // self.layer.ratio if self.layer.compressed else 0

    @property
    def entry_page_bytes(self) -> int:
        return self.main.page_bytes(self.entries_per_page) if self.layer.compressed else 0

    @property
    def index_page_bytes(self) -> int:
        return self.index.page_bytes(self.entries_per_page) if self.index is not None else 0

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (page_tokens original tokens) across this layer's paged pools."""
        return self.entry_page_bytes + self.index_page_bytes

    @property
    def window_bytes(self) -> int:
        return self.main.page_bytes(self.window)

    # Compressor state rows: a ring indexed by position % rows. CSA keeps the previous block too,
    # because entry j pools block j-1 (low half of the 2d-wide projections) with block j (high half).
    @property
    def state_rows(self) -> int:
        if not self.layer.compressed:
            return 0
        return 2 * self.layer.ratio if self.layer.kind is LayerKind.CSA else self.layer.ratio

    @property
    def state_width(self) -> int:
        return (2 if self.layer.kind is LayerKind.CSA else 1) * self.main.dim if self.layer.compressed else 0

    @property
    def index_state_width(self) -> int:
        return 2 * self.index_dim if self.index is not None else 0

    @property
    def state_bytes(self) -> int:
        """fp32 kv rows + logit rows of the main (and indexer) compressor, per request slot."""
        return 2 * self.state_rows * (self.state_width + self.index_state_width) * FP32_BYTES

    @property
    def request_bytes(self) -> int:
        """Fixed bytes per request slot: window ring + compressor state."""
        return self.window_bytes + self.state_bytes

    # Prefix caching: the state a request needs at a block boundary B (a multiple of page_tokens, so of m):
    # the window ring (the last `window` tokens), and for CSA the compressor rows of tokens B-m .. B-1 (entry
    # B/m pools them through the low half). HCA state is empty at a multiple of m; so are CSA rows B-2m..B-m-1,
    # which nothing after B reads.
    @property
    def boundary_rows(self) -> int:
        return self.layer.ratio if self.layer.kind is LayerKind.CSA else 0

    @property
    def boundary_bytes(self) -> int:
        """Bytes of one boundary snapshot of this layer: window ring + CSA rows (fp32 kv and logits, main and indexer)."""
        return self.window_bytes + 2 * self.boundary_rows * (self.state_width + self.index_state_width) * FP32_BYTES


@dataclass(frozen=True)
class CacheSpec:
    geometry: ModelGeometry
    kv_format: KVFormat = KVFormat.FP8
    indexer_format: IndexerFormat = IndexerFormat.MXFP4
    page_tokens: int = DEFAULT_PAGE_TOKENS

    def __post_init__(self):
        object.__setattr__(self, "kv_format", KVFormat(self.kv_format))
        object.__setattr__(self, "indexer_format", IndexerFormat(self.indexer_format))
        object.__setattr__(self, "page_tokens", positive_int("page_tokens", self.page_tokens))
        if self.page_tokens % 128:
            raise ValueError(f"page_tokens: expected a positive multiple of 128 (an HCA entry must not straddle "
                             f"pages), got {self.page_tokens!r}")
        for ratio in self.geometry.ratios:
            if self.page_tokens % ratio:
                raise ValueError(f"page_tokens: {self.page_tokens} is not a multiple of compression ratio {ratio}")
        self.layers  # builds (and so validates) the layouts

    def __hash__(self) -> int:  # once per spec: caches are keyed on specs, and the layer tuple makes it ~20 us
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.geometry, self.kv_format, self.indexer_format, self.page_tokens))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:  # string hashes differ between processes: never carry one along
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @cached_property
    def layers(self) -> tuple[LayerCacheSpec, ...]:
        g = self.geometry
        main = main_layout(self.kv_format, g.head_dim, g.rope_dim)
        index = indexer_layout(self.indexer_format, g.index_head_dim) if g.layers_of(LayerKind.CSA) else None
        return tuple(
            LayerCacheSpec(layer=spec, main=main, index=index if spec.has_indexer else None,
                           page_tokens=self.page_tokens, window=g.window, index_dim=g.index_head_dim)
            for spec in g.layers
        )

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across every layer's paged pools."""
        return sum(layer.block_bytes for layer in self.layers)

    @property
    def request_fixed_bytes(self) -> int:
        """Bytes one request slot takes across every layer (window rings + compressor state)."""
        return sum(layer.request_bytes for layer in self.layers)

    @property
    def boundary_bytes(self) -> int:
        """Bytes one prefix-cache boundary snapshot takes across every layer."""
        return sum(layer.boundary_bytes for layer in self.layers)

    @property
    def bytes_per_token(self) -> float:
        """Amortized paged bytes per original token, all layers (long context: window and state excluded)."""
        return self.block_bytes / self.page_tokens

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)

    def request_bytes(self, tokens: int) -> int:
        """Everything one request of `tokens` tokens holds: its blocks plus its slot's window and state."""
        return self.blocks_for(tokens) * self.block_bytes + self.request_fixed_bytes

    def pool_bytes(self, num_blocks: int, max_requests: int, snapshots: int = 0) -> int:
        """Bytes a cache with these many blocks, request slots and prefix-cache snapshots allocates (snapshot pools
        hold one scratch snapshot more: the target of a step's padding rows, so captures need no branch)."""
        snapshot_rows = snapshots + 1 if snapshots else 0
        return (num_blocks * self.block_bytes + max_requests * self.request_fixed_bytes
                + snapshot_rows * self.boundary_bytes)
