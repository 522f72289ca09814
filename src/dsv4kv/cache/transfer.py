"""A request's cache state as a host record (`RequestState`): what `CacheManager.export_request` takes out and
`import_request` puts into another cache, and what `cache/files.py` writes to disk (docs/prefix-caching.md).

The bytes are those `CachePools.save` copies for a swap: per layer, in `LayerCache.request_tensors` order, the
paged pools' rows of the request's blocks (in block-table order) and its slot's window ring and compressor rows.
Here they get names (`layers.<i>.<field>`) so a file can hold them, and beside them the cache's spec as text, so
a receiver of another geometry or format refuses the state naming what differs.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from .pools import CachePools, LayerCache
from .spec import CacheSpec

__all__ = ["RequestState", "spec_fields", "check_spec", "tensor_names", "check_tensors", "token_array",
           "check_state"]

# LayerCache fields a request owns, by name (`LayerCache.request_tensors` gives them in its own order)
_FIELDS = ("entries", "index_keys", "window", "state_kv", "state_score", "index_state_kv", "index_state_score")
_PAGED = ("entries", "index_keys")


@dataclass(frozen=True)
class RequestState:
    """One request's cache state on the host, enough to continue it bit for bit in a cache of the same spec.

    spec: `spec_fields` of the sender's CacheSpec (geometry, kv_format, indexer_format, page_tokens), as text.
    length: tokens the cache holds for it (the next step feeds position `length`).
    tokens: int64 [n >= length] token ids the sender knew (prefix caching), or None.
    tensors: name -> CPU tensor, in `tensor_names` order: `layers.<i>.entries` / `.index_keys` uint8
        [blocks, page_bytes] (its blocks in block-table order), `layers.<i>.window` uint8 [window_bytes] and
        `.state_kv` / `.state_score` / `.index_state_kv` / `.index_state_score` fp32 [rows, width].
    """

    spec: Mapping[str, str]
    length: int
    tokens: torch.Tensor | None
    tensors: Mapping[str, torch.Tensor]

    @property
    def num_blocks(self) -> int:
        return next((t.shape[0] for name, t in self.tensors.items() if name.rsplit(".", 1)[1] in _PAGED), 0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def spec_fields(spec: CacheSpec) -> dict[str, str]:
    """What a receiver must share with the sender, as text: every geometry field but the name (a renamed preset
    holds the same bytes), the layer schedule and RoPE, the two formats and page_tokens."""
    g = spec.geometry
    fields = {f.name: str(getattr(g, f.name)) for f in dataclasses.fields(g) if f.name not in ("name", "layers")}
    fields["layers"] = ",".join(f"{layer.kind.short}/{layer.ratio}" for layer in g.layers)
    fields["rope"] = json.dumps([dataclasses.asdict(layer.rope) for layer in g.layers], sort_keys=True)
    fields.update(kv_format=spec.kv_format.value, indexer_format=spec.indexer_format.value,
                  page_tokens=str(spec.page_tokens))
    return fields


def check_spec(state_spec: Mapping[str, str], spec: CacheSpec) -> None:
    """ValueError naming every field where the state's spec and the receiving cache's differ."""
    mine = spec_fields(spec)
    differ = [f"{key}: {state_spec.get(key, '<missing>')!s} in the state, {mine.get(key, '<missing>')!s} here"
              for key in sorted(set(mine) | set(state_spec)) if state_spec.get(key) != mine.get(key)]
    if differ:
        raise ValueError("request state: another geometry or format than this cache's; " + "; ".join(differ))


def _field(layer: LayerCache, tensor: torch.Tensor) -> str:
    return next(name for name in _FIELDS if getattr(layer, name) is tensor)


def tensor_names(pools: CachePools) -> list[str]:
    """The names of `CachePools.save`'s tensors, in its order."""
    return [f"layers.{i}.{_field(layer, tensor)}" for i, layer in enumerate(pools.layers)
            for tensor, _ in layer.request_tensors()]


def check_tensors(state: RequestState, pools: CachePools) -> list[torch.Tensor]:
    """The state's tensors in `CachePools.load` order, after checking names, dtypes and shapes against `pools`
    (one block per page of `length`); ValueError naming the first that differs."""
    if isinstance(state.length, bool) or not isinstance(state.length, int) or state.length < 0:
        raise ValueError(f"request state: length: expected an int >= 0, got {state.length!r}")
    blocks = pools.spec.blocks_for(state.length)
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
            raise ValueError(f"request state: {name}: expected {pool.dtype} {list(shape)} for {state.length} tokens, "
                             f"got {what}")
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
    return saved, ids
