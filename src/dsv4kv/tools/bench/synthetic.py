"""Random, valid cache contents for benchmarks: long contexts without running a long prefill.

Speed does not depend on the values a cache holds (the top-k is the exception: its data path depends on
how scores are distributed, so the values are random, not constant), so a benchmark at 1M tokens plans the
history (which allocates every block) and fills the pools with random bytes that decode to finite numbers:
e4m3 bytes other than NaN, bf16 values from a normal distribution, ue8m0 scales near 2^0, any e2m1 nibble.
Every byte of each pool is written, so every block a plan maps is valid whatever the allocator handed out.
"""

from __future__ import annotations

import torch

from ...cache.layout import EntryLayout, IndexerFP8Layout, IndexerMXFP4Layout, MainFP8Layout
from ...cache.pools import LayerCache

__all__ = ["fill_layer"]


def _e4m3_bytes(shape, generator, device) -> torch.Tensor:
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator, device=device)
    return torch.where((x & 0x7F) == 0x7F, x ^ 1, x)  # S.1111.111 is NaN: step to the next value


_CHUNK_BYTES = 1 << 30  # pages filled at a time: the random temporaries stay small next to a nearly full GPU


def _fill_pool(pool: torch.Tensor, layout: EntryLayout, entries: int, generator: torch.Generator) -> None:
    step = max(1, _CHUNK_BYTES // pool.shape[1])
    for lo in range(0, pool.shape[0], step):
        _fill_pages(pool[lo:lo + step], layout, entries, generator)


def _fill_pages(pool: torch.Tensor, layout: EntryLayout, entries: int, generator: torch.Generator) -> None:
    data, scales = layout.page_views(pool, entries)
    device = pool.device

    def ue8m0(shape):
        return torch.randint(124, 131, shape, dtype=torch.uint8, generator=generator, device=device)

    if isinstance(layout, MainFP8Layout):
        nope = layout.nope_dim
        data[..., :nope] = _e4m3_bytes(data[..., :nope].shape, generator, device)
        rope = data[..., nope:].view(torch.bfloat16)
        rope.copy_(torch.randn(rope.shape, generator=generator, device=device))
        scales.copy_(ue8m0(scales.shape))
    elif isinstance(layout, IndexerMXFP4Layout):
        data.copy_(torch.randint(0, 256, data.shape, dtype=torch.uint8, generator=generator, device=device))
        scales.copy_(ue8m0(scales.shape))
    elif isinstance(layout, IndexerFP8Layout):
        data.copy_(_e4m3_bytes(data.shape, generator, device))
        exponent = torch.randint(-3, 4, scales.shape[:-1], generator=generator, device=device)
        scales.view(torch.float32)[..., 0] = torch.exp2(exponent.float())
    else:  # bf16 entries or keys
        values = data.view(torch.bfloat16)
        values.copy_(torch.randn(values.shape, generator=generator, device=device))


def fill_layer(layer: LayerCache, *, window: int, seed: int = 0) -> None:
    """Random valid bytes in every pool of one layer (window ring, compressed entries, indexer keys) and
    random compressor state rows (kv and logits from a normal distribution)."""
    generator = torch.Generator(device=layer.window.device).manual_seed(seed)
    spec = layer.spec
    _fill_pool(layer.window, spec.main, window, generator)
    if layer.entries is not None:
        _fill_pool(layer.entries, spec.main, spec.entries_per_page, generator)
    if layer.index_keys is not None:
        _fill_pool(layer.index_keys, spec.index, spec.entries_per_page, generator)
    for state in (layer.state_kv, layer.state_score, layer.index_state_kv, layer.index_state_score):
        if state is not None:
            state.normal_(generator=generator)
