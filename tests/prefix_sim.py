"""Helpers for the prefix-caching tests.

- `TINY3`: the tiny preset cut to one layer of each kind (window, CSA m=4, HCA m=16), window 16.
- Content tags: the tag of position p is a rolling hash of tokens[0..p], so two requests with the same prefix
  carry the same tags. `FakeLayers` writes, for every layer, tags where the real layers write data (window
  ring, compressed entries and indexer keys, compressor rings, boundary snapshots) and marks the layers run;
  `check_contents` then asserts that every live request reads the tags of its *own* tokens everywhere the
  next step reads: after a hit, a swap or an eviction, a stale or foreign byte shows up as a wrong tag.
- `check_invariants`: no block lost, leaked or shared by mistake, every reference count adds up.
"""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import torch

from dsv4kv import CacheManager, ModelGeometry

_TINY = json.loads(resources.files("dsv4kv.presets").joinpath("tiny.json").read_text())
TINY3 = ModelGeometry.from_hf_config({**_TINY, "num_hidden_layers": 3, "layer_types": [
    "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]})

_MOD = (1 << 61) - 1
_SALT = 0x5A5A5A5A5A5A5A5  # logit rows carry tag ^ salt: a kv/logit mix-up shows


class Content:
    """A request's token ids and their prefix tags (tags[p] identifies tokens[0..p])."""

    def __init__(self, tokens=()):
        self.tokens: list[int] = []
        self.tags: list[int] = []
        self.extend(tokens)

    def extend(self, tokens) -> None:
        h = self.tags[-1] if self.tags else 7
        for t in tokens:
            h = (h * 1_000_003 + int(t) + 1) % _MOD
            self.tokens.append(int(t))
            self.tags.append(h)

    def tag_array(self) -> np.ndarray:
        return np.array(self.tags, dtype=np.int64)


class _first8:
    """Read/write the first 8 data bytes of the entries of a pool (by slot) as int64, through numpy views of
    the pool's data rows [pages, entries, data_bytes] (never a copy: a reshape across pages would copy)."""

    def __init__(self, pool: torch.Tensor, layout, entries: int):
        self.rows = layout.page_views(pool, entries)[0].numpy()
        self.entries = entries

    def __getitem__(self, slots):
        slots = np.asarray(slots)
        return np.ascontiguousarray(self.rows[slots // self.entries, slots % self.entries, :8]).view(np.int64)[..., 0]

    def __setitem__(self, slots, values):
        slots = np.asarray(slots)
        self.rows[slots // self.entries, slots % self.entries, :8] = \
            np.asarray(values, dtype=np.int64).reshape(-1, 1).view(np.uint8)


def _state64(state: torch.Tensor) -> np.ndarray:
    """int64 view [slots, rows] of the first two fp32 words of each compressor row."""
    return state.numpy().view(np.int32)[:, :, :2].copy().view(np.int64)[:, :, 0]


def _write_state(state: torch.Tensor, slots, rows, values) -> None:
    words = np.asarray(values, dtype=np.int64).view(np.int32).reshape(-1, 2)
    state.numpy().view(np.int32)[slots, rows, :2] = words


class FakeLayers:
    """Stands in for running every layer over a plan: writes content tags, then marks each layer run."""

    def __init__(self, cache: CacheManager):
        self.cache = cache

    def run(self, plan, contents: dict[int, Content]) -> None:
        cache, n = self.cache, plan.num_tokens
        rids = plan.request_ids
        rows = plan.token_request[:n].numpy()
        positions = plan.positions[:n].numpy()
        tags = {rid: contents[rid].tag_array() for rid in rids}
        token_tags = np.array([tags[rids[b]][p] for b, p in zip(rows, positions)], dtype=np.int64)
        seq_lens = plan.seq_lens[:plan.num_requests].numpy()
        slots_of = plan.request_slots[:plan.num_requests].numpy()
        snaps = plan.snapshots
        for index, layer in enumerate(cache.pools.layers):
            spec = layer.spec
            window = spec.window
            ring = _first8(layer.window, spec.main, window)
            w_slots = plan.window_slots[:n].numpy()
            keep = w_slots >= 0
            ring[w_slots[keep]] = token_tags[keep]
            if snaps is not None and layer.boundary_window is not None:
                s_slots = snaps.window_slots[:n].numpy()
                keep = s_slots >= 0
                snap = _first8(layer.boundary_window, spec.main, window)
                snap[s_slots[keep]] = token_tags[keep]
            if not spec.layer.compressed:
                cache.mark_layer_run(index)
                continue
            m = spec.layer.ratio
            writes = plan.entries[m]
            count = writes.count
            e_slots, e_req, e_idx = (writes.slots[:count].numpy(), writes.request[:count].numpy(),
                                     writes.index[:count].numpy())
            e_tags = np.array([tags[rids[b]][(j + 1) * m - 1] for b, j in zip(e_req, e_idx)], dtype=np.int64)
            for pool, layout in ((layer.entries, spec.main), (layer.index_keys, spec.index)):
                if pool is not None and count:
                    _first8(pool, layout, spec.entries_per_page)[e_slots] = e_tags
            # compressor rings: a request's last `R` tokens of the step, at pos % R
            ring_rows = spec.state_rows
            last = positions >= seq_lens[rows] - ring_rows
            for kv, score in ((layer.state_kv, layer.state_score), (layer.index_state_kv, layer.index_state_score)):
                if kv is None:
                    continue
                _write_state(kv, slots_of[rows[last]], positions[last] % ring_rows, token_tags[last])
                _write_state(score, slots_of[rows[last]], positions[last] % ring_rows, token_tags[last] ^ _SALT)
            if snaps is not None and layer.boundary_kv is not None:
                s_slots = snaps.state_slots[:n].numpy()
                keep = s_slots >= 0
                b = spec.boundary_rows
                for kv, score in ((layer.boundary_kv, layer.boundary_score),
                                  (layer.boundary_index_kv, layer.boundary_index_score)):
                    _write_state(kv, s_slots[keep] // b, s_slots[keep] % b, token_tags[keep])
                    _write_state(score, s_slots[keep] // b, s_slots[keep] % b, token_tags[keep] ^ _SALT)
            cache.mark_layer_run(index)


def check_contents(cache: CacheManager, contents: dict[int, Content], rids=None) -> None:
    """Every live request (or those in `rids`) finds its own content's tags wherever its next step reads:
    the window ring (last `window` tokens), every compressed entry and indexer key so far, and the compressor
    rows the next entry pools (CSA: from the start of the previous block; HCA: the current block)."""
    page = cache.spec.page_tokens
    for rid in (rids if rids is not None else cache.request_ids()):
        length, slot = cache.length(rid), cache.slot(rid)
        tags = contents[rid].tag_array()
        blocks = np.array(cache.blocks(rid), dtype=np.int64)
        for layer in cache.pools.layers:
            spec = layer.spec
            window = spec.window
            ring = _first8(layer.window, spec.main, window)
            pos = np.arange(max(0, length - window), length)
            got = ring[slot * window + pos % window]
            bad = got != tags[pos]
            assert not bad.any(), f"request {rid} (length {length}): window position {pos[bad][:4]} holds foreign bytes"
            if not spec.layer.compressed:
                continue
            m = spec.layer.ratio
            j = np.arange(length // m)
            slots = blocks[(j * m) // page] * (page // m) + (j * m % page) // m
            for pool, layout in ((layer.entries, spec.main), (layer.index_keys, spec.index)):
                if pool is None:
                    continue
                got = _first8(pool, layout, spec.entries_per_page)[slots]
                bad = got != tags[(j + 1) * m - 1]
                assert not bad.any(), f"request {rid}: ratio {m} entry {j[bad][:4]} holds foreign bytes"
            first = (length // m - 1) * m if spec.state_rows == 2 * m else (length // m) * m
            pos = np.arange(max(first, 0), length)
            for kv, score in ((layer.state_kv, layer.state_score), (layer.index_state_kv, layer.index_state_score)):
                if kv is None:
                    continue
                assert (_state64(kv)[slot, pos % spec.state_rows] == tags[pos]).all(), \
                    f"request {rid}: ratio {m} compressor row of positions {pos.tolist()} is foreign"
                assert (_state64(score)[slot, pos % spec.state_rows] == (tags[pos] ^ _SALT)).all(), \
                    f"request {rid}: ratio {m} logit row of positions {pos.tolist()} is foreign"


def check_invariants(cache: CacheManager, contents: dict[int, Content] | None = None) -> None:
    """No block lost, leaked or shared by mistake, and every reference count adds up."""
    alloc, page = cache.allocator, cache.spec.page_tokens
    holders: dict[int, list[int]] = {}
    table = cache.block_table.cpu().numpy()
    live_slots = set()
    for rid in cache.request_ids():
        blocks = cache.blocks(rid)
        assert len(blocks) == len(set(blocks)), f"request {rid} maps a block twice: {blocks}"
        assert len(blocks) == cache.spec.blocks_for(cache.length(rid)), f"request {rid}: {len(blocks)} blocks"
        row = table[cache.slot(rid)]
        assert row[:len(blocks)].tolist() == blocks and (row[len(blocks):] == -1).all()
        live_slots.add(cache.slot(rid))
        for b in blocks:
            holders.setdefault(b, []).append(rid)
    for slot in set(range(cache.max_requests)) - live_slots:
        assert (table[slot] == -1).all(), f"free slot {slot} still maps blocks"
    free = alloc.free_order()
    assert len(free) == len(set(free)) == alloc.num_free
    assert alloc.num_free + alloc.num_used == cache.num_blocks
    for b in range(cache.num_blocks):
        refs = alloc.refcount(b)
        assert refs == len(holders.get(b, [])), f"block {b}: refcount {refs}, held by {holders.get(b)}"
    assert set(free) == {b for b in range(cache.num_blocks) if alloc.refcount(b) == 0}, "a block is lost"
    prefix = cache.prefix
    if prefix is None:
        assert all(len(h) == 1 for h in holders.values()), "a block is shared without prefix caching"
        return
    prefix.check()
    for b, rids in holders.items():
        node = prefix.cached(b)
        if len(rids) > 1:
            assert node is not None, f"block {b} is shared by {rids} but is not a cached block"
        if node is None:
            continue
        for rid in rids:  # a cached block is mapped where its content says, by requests with that content
            assert cache.blocks(rid)[node.depth] == b
            request = cache._requests[rid]
            assert node in request.nodes and request.nodes.index(node) == node.depth, \
                f"request {rid} maps cached block {b} outside its chain"
            if contents is not None:
                assert contents[rid].tokens[node.depth * page:(node.depth + 1) * page] == node.tokens.tolist()
    for node in prefix.cached_blocks():  # a cached block's chain spells its tokens' prefix
        chain, n = [], node
        while n is not None:
            chain.append(n)
            n = n.parent
        assert [c.depth for c in chain] == list(range(node.depth, -1, -1))
    pending = [p.snapshot for p in cache._pending if p.snapshot is not None]
    held = list(prefix._snapshot_lru)
    spare = list(prefix._free_snapshots)
    assert sorted(held + spare + pending) == list(range(prefix.num_snapshots)), "a snapshot is lost or shared"
    assert cache.bytes_swapped == sum(r.nbytes for r in cache._swapped.values())
