"""A request's cache state as a host record (`RequestState`): what `CacheManager.export_request` takes out and
`import_request` puts into another cache, and what `cache/files.py` writes to disk (docs/prefix-caching.md).

The bytes are those `CachePools.save` copies for a swap: per layer, in `LayerCache.request_tensors` order, the
paged pools' rows of the request's blocks (in block-table order) and its slot's window ring and compressor rows.
Here they get names (`layers.<i>.<field>`) so a file can hold them, and beside them the cache's spec as text, so
a receiver of another geometry or format refuses the state naming what differs.

Pages a receiver already caches need not travel: a state may leave out its first `first_block` blocks when the
receiver's prefix cache holds them (the sender exports with `skip_tokens=receiver.lookup(tokens)`); the receiver
maps its own cached blocks for them (`cached_prefix`) and writes the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from .pools import CachePools, LayerCache
from .prefix import CachedBlock, PrefixCache
from .spec import CacheSpec

__all__ = ["RequestState", "REQUEST_FIELDS", "spec_fields", "check_spec", "tensor_names", "check_tensors",
           "token_array", "check_state", "first_block", "cached_prefix"]

# LayerCache fields a request owns, by name, in `LayerCache.request_tensors`' order
REQUEST_FIELDS = ("entries", "index_keys", "window", "state_kv", "state_score", "index_state_kv", "index_state_score")
_PAGED = ("entries", "index_keys")


@dataclass(frozen=True)
class RequestState:
    """One request's cache state on the host, enough to continue it bit for bit in a cache of the same spec.

    spec: `spec_fields` of the sender's CacheSpec (geometry, kv_format, indexer_format, page_tokens), as text.
    length: tokens the cache holds for it (the next step feeds position `length`).
    tokens: int64 [n >= length] token ids the sender knew (prefix caching), or None.
    tensors: name -> CPU tensor, in `tensor_names` order: `layers.<i>.entries` / `.index_keys` uint8
        [blocks - first_block, page_bytes] (its blocks from `first_block` on, in block-table order),
        `layers.<i>.window` uint8 [window_bytes] and `.state_kv` / `.state_score` / `.index_state_kv` /
        `.index_state_score` fp32 [rows, width].
    first_block: blocks left out (0: none): the receiver's prefix cache holds them, found by the token ids.
    """

    spec: Mapping[str, str]
    length: int
    tokens: torch.Tensor | None
    tensors: Mapping[str, torch.Tensor]
    first_block: int = 0

    @property
    def num_blocks(self) -> int:
        """Blocks whose pages the state holds (its first `first_block` are left out)."""
        return next((t.shape[0] for name, t in self.tensors.items() if name.rsplit(".", 1)[1] in _PAGED), 0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def spec_fields(spec: CacheSpec) -> dict[str, str]:
    """What a receiver must share with the sender, as text: every geometry field but the name (a renamed preset
    holds the same bytes), the layer schedule and RoPE, the two formats and page_tokens."""
    return dict(_spec_fields(spec))


@functools.lru_cache(maxsize=16)
def _spec_fields(spec: CacheSpec) -> tuple[tuple[str, str], ...]:
    """`spec_fields` once per spec (a transfer's header and check read it; JSON of every layer's RoPE is slow)."""
    g = spec.geometry
    fields = {f.name: str(getattr(g, f.name)) for f in dataclasses.fields(g) if f.name not in ("name", "layers")}
    fields["layers"] = ",".join(f"{layer.kind.short}/{layer.ratio}" for layer in g.layers)
    fields["rope"] = json.dumps([dataclasses.asdict(layer.rope) for layer in g.layers], sort_keys=True)
    fields.update(kv_format=spec.kv_format.value, indexer_format=spec.indexer_format.value,
                  page_tokens=str(spec.page_tokens))
    return tuple(fields.items())


def check_spec(state_spec: Mapping[str, str], spec: CacheSpec) -> None:
    """ValueError naming every field where the state's spec and the receiving cache's differ."""
    mine = spec_fields(spec)
    differ = [f"{key}: {state_spec.get(key, '<missing>')!s} in the state, {mine.get(key, '<missing>')!s} here"
              for key in sorted(set(mine) | set(state_spec)) if state_spec.get(key) != mine.get(key)]
    if differ:
        raise ValueError("request state: another geometry or format than this cache's; " + "; ".join(differ))


def _field(layer: LayerCache, tensor: torch.Tensor) -> str:
    return next(name for name in REQUEST_FIELDS if getattr(layer, name) is tensor)


def tensor_names(pools: CachePools) -> list[str]:
    """The names of `CachePools.save`'s tensors, in its order."""
    return [f"layers.{i}.{_field(layer, tensor)}" for i, layer in enumerate(pools.layers)
            for tensor, _ in layer.request_tensors()]


def check_tensors(state: RequestState, pools: CachePools) -> list[torch.Tensor]:
    """The state's tensors in `CachePools.load` order, after checking names, dtypes and shapes against `pools`
    (one block per page of `length`); ValueError naming the first that differs."""
    if isinstance(state.length, bool) or not isinstance(state.length, int) or state.length < 0:
        raise ValueError(f"request state: length: expected an int >= 0, got {state.length!r}")
    k = state.first_block
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k * pools.spec.page_tokens <= state.length:
        raise ValueError(f"request state: first_block: expected an int in [0, {state.length // pools.spec.page_tokens}]"
                         f" (whole blocks of its {state.length} tokens), got {k!r}")
    blocks = pools.spec.blocks_for(state.length) - k
    names = tensor_names(pools)
    if sorted(state.tensors) != sorted(names):
        missing, extra = sorted(set(names) - set(state.tensors)), sorted(set(state.tensors) - set(names))
        raise ValueError(f"request state: tensors missing {missing}, unexpected {extra}")
    ordered = []
    for name in names:
        i, field = name.split(".")[1:]
        pool = getattr(pools.layers[int(i)], field)
        shape = (blocks, pool.shape[1]) if field in _PAGED else tuple(pool.shape[1:])
        got = state.tensors[name]
        if not isinstance(got, torch.Tensor) or got.dtype != pool.dtype or tuple(got.shape) != shape:
            what = f"{got.dtype} {list(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
            raise ValueError(f"request state: {name}: expected {pool.dtype} {list(shape)} for {state.length} tokens "
                             f"from block {k}, got {what}")
        ordered.append(got)
    return ordered


def token_array(state: RequestState) -> np.ndarray | None:
    """The state's token ids as int64 [n >= length], or None; ValueError if they do not cover its length."""
    if state.tokens is None:
        return None
    tokens = state.tokens
    if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.int64 or tokens.dim() != 1:
        raise ValueError(f"request state: tokens: expected int64 [n], got {getattr(tokens, 'dtype', type(tokens))}")
    if tokens.numel() < state.length:
        raise ValueError(f"request state: {tokens.numel()} token ids for {state.length} tokens")
    return tokens.numpy().copy()


def check_state(state: RequestState, pools: CachePools, *, max_seq_len: int) -> tuple[list[torch.Tensor],
                                                                                     np.ndarray | None]:
    """What `CacheManager.import_request` checks before it changes anything: the type, the spec, every tensor, the
    token ids, and that the request fits a cache of `max_seq_len` tokens and `pools.num_blocks` blocks. Returns the
    tensors in `CachePools.load` order and the token ids (or None)."""
    if not isinstance(state, RequestState):
        raise TypeError(f"state: expected a RequestState, got {type(state).__name__}")
    check_spec(state.spec, pools.spec)
    saved, ids = check_tensors(state, pools), token_array(state)
    if state.length > max_seq_len or pools.spec.blocks_for(state.length) > pools.num_blocks:
        raise ValueError(f"request state: {state.length} tokens; this cache holds at most {max_seq_len} tokens and "
                         f"{pools.num_blocks} blocks per request")
    if state.first_block and ids is None:
        raise ValueError(f"request state: its first {state.first_block} blocks are left out, and it has no token ids "
                         f"to find them by")
    return saved, ids


def first_block(skip_tokens: int, length: int, page_tokens: int) -> int:
    """The blocks an export leaves out for `skip_tokens` (what the receiver's `lookup` said it caches): whole blocks
    of the request's `length` tokens; ValueError otherwise."""
    if isinstance(skip_tokens, bool) or not isinstance(skip_tokens, int) or skip_tokens < 0 \
            or skip_tokens % page_tokens or skip_tokens > length:
        raise ValueError(f"skip_tokens: expected a multiple of page_tokens {page_tokens} in [0, {length}] (the "
                         f"receiver's lookup of the request's tokens), got {skip_tokens!r}")
    return skip_tokens // page_tokens


def cached_prefix(prefix: PrefixCache | None, state: RequestState, ids: np.ndarray | None) -> list[CachedBlock]:
    """The receiver's cached blocks for the state's left-out first blocks, found by its token ids (checked by
    `check_state`): the whole chain, or a shorter one when some were evicted since the sender was told (the caller
    answers NoRoom). ValueError when the state leaves blocks out and the receiver has no prefix cache."""
    if not state.first_block:
        return []
    if prefix is None:
        raise ValueError(f"request state: its first {state.first_block} blocks are left out (the receiver's cached "
                         f"prefix), and this cache has no prefix cache")
    return prefix.match(ids, state.first_block)
