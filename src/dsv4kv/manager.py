"""CacheManager: the request lifecycle over the pools (admit, plan a step, release) and the counters.

Blocks cover `page_tokens` original tokens of one request; every layer's paged pools are indexed by
the same block id, so one block table per request serves all layers. A request holds
ceil(length / page_tokens) blocks. `plan_step` allocates every block the step will fill before
returning the plan, so nothing allocates while the step (or a captured CUDA graph) runs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from .checks import positive_int
from .geometry import ModelGeometry
from .layout import IndexerFormat, KVFormat
from .memory.allocator import BlockAllocator
from .memory.pools import POISON_BYTE, CachePools
from .memory.spec import DEFAULT_PAGE_TOKENS, CacheSpec
from .plan import EntryWrites, OutOfBlocks, StepBuffers, StepPlan, new_cache_id

__all__ = ["CacheManager", "RequestError"]


class RequestError(ValueError):
    """A request id that is unknown, already released, or used twice in one step."""


@dataclass
class _Request:
    rid: int
    slot: int
    length: int = 0
    num_blocks: int = 0  # its block ids are the manager's host table row [slot, :num_blocks]


class CacheManager:
    """Paged DeepSeek-V4 cache for up to `max_requests` live requests holding `max_tokens` tokens in all.

    Args:
        geometry: the model (`ModelGeometry`).
        max_requests: request slots (window rings and compressor state are per slot).
        max_tokens: total history, in original tokens, the pools must hold across all live requests,
            however it is split among up to `max_requests` requests.
        kv_format: "fp8" (584-B FlashMLA MODEL1 entries, the default) or "bf16" (exact).
        indexer_format: "mxfp4" (official, default), "fp8" (DeepGEMM 132 B) or "bf16" (exact).
        device: where the pools and plans live.
        page_tokens: original tokens per block (multiple of 128).
        max_seq_len: longest request; defaults to the model's max_position_embeddings.
        num_blocks: override the block count derived from max_tokens.
        poison: fill pools and fresh windows with 0xFF (NaN in every format) to make stale reads loud.
    """

    def __init__(self, geometry: ModelGeometry, *, max_requests: int, max_tokens: int,
                 kv_format: KVFormat | str = KVFormat.FP8, indexer_format: IndexerFormat | str = IndexerFormat.MXFP4,
                 device: torch.device | str = "cpu", page_tokens: int = DEFAULT_PAGE_TOKENS,
                 max_seq_len: int | None = None, num_blocks: int | None = None, poison: bool = False):
        if not isinstance(geometry, ModelGeometry):
            raise TypeError(f"geometry: expected a ModelGeometry, got {type(geometry).__name__}")
        self.spec = CacheSpec(geometry, kv_format, indexer_format, page_tokens)
        self.geometry = geometry
        self.max_requests = positive_int("max_requests", max_requests)
        self.max_tokens = positive_int("max_tokens", max_tokens)
        self.max_seq_len = positive_int("max_seq_len", max_seq_len if max_seq_len is not None else geometry.max_position)
        if self.max_seq_len > geometry.max_position:
            raise ValueError(f"max_seq_len: {self.max_seq_len} exceeds the model's max_position_embeddings "
                             f"{geometry.max_position}")
        # Any split of max_tokens over max_requests requests fits: sum ceil(n_i / P) <= ceil(N / P) + R - 1.
        default_blocks = self.spec.blocks_for(self.max_tokens) + self.max_requests - 1
        self.num_blocks = positive_int("num_blocks", num_blocks if num_blocks is not None else default_blocks)
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:<current>", comparable with tensors'

        self.poison = poison
        self.allocator = BlockAllocator(self.num_blocks)
        self.pools = CachePools(self.spec, num_blocks=self.num_blocks, max_requests=self.max_requests,
                                device=self.device, fill_byte=POISON_BYTE if poison else 0)
        self.max_blocks_per_request = min(self.spec.blocks_for(self.max_seq_len), self.num_blocks)
        self.block_table = torch.full((self.max_requests, self.max_blocks_per_request), -1, dtype=torch.int32,
                                      device=self.device)
        self._host_table = np.full((self.max_requests, self.max_blocks_per_request), -1, dtype=np.int64)
        self._free_slots: deque[int] = deque(range(self.max_requests))
        self._requests: dict[int, _Request] = {}
        self._next_rid = 0
        self._step = 0
        self._layers_run: set[int] = set()  # layers that have consumed the current plan
        self.cache_id = new_cache_id()

    # --- lifecycle ------------------------------------------------------------------------------
    def admit(self) -> int | None:
        """A new request id with fresh state, or None when every request slot is taken."""
        if not self._free_slots:
            return None
        slot = self._free_slots.popleft()
        self.pools.reset_request(slot)
        rid = self._next_rid
        self._next_rid += 1
        self._requests[rid] = _Request(rid, slot)
        return rid

    def release(self, rid: int) -> None:
        """Return a request's blocks and slot. Releasing an unknown or released id raises RequestError."""
        request = self._request(rid)
        self.allocator.free(self._host_table[request.slot, :request.num_blocks].tolist())
        self._host_table[request.slot] = -1
        self.block_table[request.slot].fill_(-1)
        self._free_slots.append(request.slot)
        del self._requests[rid]

    def plan_step(self, batch: Sequence[tuple[int, int]], *, buffers: StepBuffers | None = None
                  ) -> StepPlan | OutOfBlocks:
        """Plan one step: `batch` lists (request id, new tokens) pairs, prefill chunks and decode tokens alike.

        Allocates the blocks the step fills and advances each request's length (the caller then runs
        every layer over the plan). When the blocks do not fit, returns `OutOfBlocks` and changes nothing.
        Bad input (unknown id, repeated id, non-positive count, length past max_seq_len, a request
        larger than the whole cache, more rows than `buffers` hold) raises before anything changes.
        """
        requests, counts = self._validate_batch(batch)
        starts = np.array([r.length for r in requests], dtype=np.int64)
        counts_np = np.array(counts, dtype=np.int64)
        # entries of ratio m each request completes in this step: those ending at or before its new length
        new_entries = {m: (starts + counts_np) // m - starts // m for m in self.geometry.ratios}
        entry_counts = {m: int(per_request.sum()) for m, per_request in new_entries.items()}
        num_tokens, num_requests = int(counts_np.sum()), len(requests)
        if buffers is not None:
            self._check_buffers(buffers, num_tokens, num_requests, entry_counts, int((starts + counts_np).max()))
        need = [self.spec.blocks_for(r.length + n) - r.num_blocks for r, n in zip(requests, counts)]
        fresh = self.allocator.allocate(sum(need))
        if fresh is None:
            return OutOfBlocks(needed=sum(need), free=self.allocator.num_free)
        self._map_blocks(requests, need, fresh)

        for request, n in zip(requests, counts):
            request.length += n
        host = self._plan_fields(requests, starts, counts_np, new_entries)
        if buffers is None:
            buffers = StepBuffers(self.cache_id, self.geometry.ratios, max_tokens=num_tokens,
                                  max_requests=num_requests, device=self.device, entries=entry_counts,
                                  persistent=False)
        views = buffers.load(host, num_tokens, num_requests)
        longest = int(host["seq_lens"].max()) if num_requests else 0
        self._step += 1
        self._layers_run.clear()
        return StepPlan(
            cache_id=self.cache_id, step=self._step, request_ids=tuple(r.rid for r in requests),
            num_tokens=num_tokens, num_requests=num_requests,
            positions=views["positions"], token_request=views["token_request"], window_slots=views["window_slots"],
            request_slots=views["request_slots"], query_start=views["query_start"], seq_lens=views["seq_lens"],
            block_table=self.block_table,
            entries={m: EntryWrites(ratio=m, slots=views[f"slots{m}"], request=views[f"request{m}"],
                                    index=views[f"index{m}"], count=entry_counts[m])
                     for m in self.geometry.ratios},
            max_seq_len=buffers.max_seq_len if buffers.max_seq_len is not None else longest,
        )

    def step_buffers(self, *, max_tokens: int, max_requests: int, max_seq_len: int | None = None) -> StepBuffers:
        """Preallocated plan storage (fixed addresses) for CUDA-graph capture and replay. Plans built into them
        carry `max_seq_len` (default: the cache's) as their fixed context bound; longer requests are refused."""
        max_seq_len = positive_int("max_seq_len", max_seq_len if max_seq_len is not None else self.max_seq_len)
        if max_seq_len > self.max_seq_len:
            raise ValueError(f"max_seq_len: {max_seq_len} exceeds the cache's {self.max_seq_len}")
        return StepBuffers(self.cache_id, self.geometry.ratios, max_tokens=max_tokens, max_requests=max_requests,
                           device=self.device, max_seq_len=max_seq_len)

    # --- counters --------------------------------------------------------------------------------
    @property
    def steps_planned(self) -> int:
        """Steps planned so far; a plan's `step` equals it until the next `plan_step`."""
        return self._step

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.allocator.num_used

    @property
    def num_live_requests(self) -> int:
        return len(self._requests)

    @property
    def tokens_held(self) -> int:
        return sum(r.length for r in self._requests.values())

    @property
    def bytes_used(self) -> int:
        """Bytes of blocks in use plus the window and state of live request slots."""
        return self.num_used_blocks * self.spec.block_bytes + self.num_live_requests * self.spec.request_fixed_bytes

    @property
    def bytes_reserved(self) -> int:
        """Bytes of every pool and state tensor, used or not."""
        return self.pools.nbytes

    def layer_has_run(self, layer_index: int) -> bool:
        """Whether layer `layer_index` has already run over the current plan."""
        return layer_index in self._layers_run

    def mark_layer_run(self, layer_index: int) -> None:
        """Record that a layer is running over the current plan: a second run would re-read ring rows the
        first one overwrote, so DSV4Attention refuses it."""
        self._layers_run.add(layer_index)

    def is_live(self, rid: int) -> bool:
        """Whether `rid` was admitted and not yet released."""
        return rid in self._requests

    def request_ids(self) -> list[int]:
        return list(self._requests)

    def length(self, rid: int) -> int:
        return self._request(rid).length

    def blocks(self, rid: int) -> list[int]:
        request = self._request(rid)
        return self._host_table[request.slot, :request.num_blocks].tolist()

    def slot(self, rid: int) -> int:
        return self._request(rid).slot

    # --- internals --------------------------------------------------------------------------------
    def _request(self, rid) -> _Request:
        is_id = isinstance(rid, (int, np.integer)) and not isinstance(rid, bool)
        request = self._requests.get(rid) if is_id else None
        if request is not None:
            return request
        if is_id and 0 <= rid < self._next_rid:
            raise RequestError(f"request {rid} was already released")
        raise RequestError(f"unknown request id {rid!r}")

    def _validate_batch(self, batch) -> tuple[list[_Request], list[int]]:
        if isinstance(batch, (str, bytes)) or not isinstance(batch, Iterable):
            raise TypeError(f"batch: expected a sequence of (request id, new tokens) pairs, got {type(batch).__name__}")
        batch = list(batch)
        if not batch:
            raise ValueError("batch: empty step")
        requests, counts, seen = [], [], set()
        for item in batch:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise TypeError(f"batch: expected (request id, new tokens) pairs, got {item!r}")
            rid, n = item
            request = self._request(rid)
            if rid in seen:
                raise RequestError(f"request {rid} appears twice in one step")
            seen.add(rid)
            n = positive_int(f"new tokens of request {rid}", n)
            if request.length + n > self.max_seq_len:
                raise ValueError(f"request {rid}: {request.length} + {n} tokens exceeds max_seq_len {self.max_seq_len}")
            if self.spec.blocks_for(request.length + n) > self.num_blocks:
                raise ValueError(f"request {rid}: {request.length + n} tokens need "
                                 f"{self.spec.blocks_for(request.length + n)} blocks, the cache has {self.num_blocks}")
            requests.append(request)
            counts.append(n)
        return requests, counts

    def _check_buffers(self, buffers, tokens: int, requests: int, entries: dict[int, int], longest: int) -> None:
        if not isinstance(buffers, StepBuffers):
            raise TypeError(f"buffers: expected StepBuffers from step_buffers(), got {type(buffers).__name__}")
        if buffers.cache_id != self.cache_id:
            raise ValueError("buffers: made by another CacheManager")
        short = [m for m in self.geometry.ratios if buffers.entry_capacity.get(m, -1) < entries[m]]
        if buffers.max_seq_len is not None and longest > buffers.max_seq_len:
            raise ValueError(f"buffers: a request reaches {longest} tokens, the buffers' max_seq_len is "
                             f"{buffers.max_seq_len}")
        if tokens > buffers.max_tokens or requests > buffers.max_requests or short:
            raise ValueError(f"buffers: step has {tokens} tokens / {requests} requests / entries {entries}, buffers "
                             f"hold {buffers.max_tokens} / {buffers.max_requests} / {buffers.entry_capacity}")

    def _map_blocks(self, requests: list[_Request], need: list[int], fresh: list[int]) -> None:
        if not fresh:
            return
        rows = np.repeat([r.slot for r in requests], need)
        cols = np.concatenate([np.arange(r.num_blocks, r.num_blocks + n) for r, n in zip(requests, need)])
        self._host_table[rows, cols] = fresh
        for request, n in zip(requests, need):
            request.num_blocks += n
        update = torch.from_numpy(np.stack((rows, cols, np.asarray(fresh)))).to(self.device)  # one copy
        self.block_table[update[0], update[1]] = update[2].to(torch.int32)
        if self.poison:  # reused blocks hold their previous owner's bytes: make them NaN again
            for layer in self.pools.layers:
                for pool in (layer.entries, layer.index_keys):
                    if pool is not None:
                        pool[update[2]] = POISON_BYTE

    def _plan_fields(self, requests: list[_Request], starts: np.ndarray, counts: np.ndarray,
                     new_entries: dict[int, np.ndarray]) -> dict[str, np.ndarray]:
        rows = np.arange(len(requests))
        slots = np.array([r.slot for r in requests], dtype=np.int64)
        query_start = np.concatenate(([0], np.cumsum(counts)))
        token_request = np.repeat(rows, counts)
        positions = np.arange(query_start[-1]) - query_start[token_request] + starts[token_request]
        window = self.geometry.window
        fields = {
            "positions": positions, "token_request": token_request,
            # Only a request's last `window` tokens land in its ring; earlier tokens of a long chunk would
            # be overwritten within the same step (and duplicate scatter targets are nondeterministic).
            "window_slots": np.where(positions >= (starts + counts)[token_request] - window,
                                     slots[token_request] * window + positions % window, -1),
            "request_slots": slots, "query_start": query_start, "seq_lens": starts + counts,
        }
        page = self.spec.page_tokens
        for m, per_request in new_entries.items():
            first = starts // m  # entries complete before the step
            entry_request = np.repeat(rows, per_request)
            offsets = np.concatenate(([0], np.cumsum(per_request)))[:-1]
            index = np.arange(per_request.sum()) - offsets[entry_request] + first[entry_request]
            token = index * m
            block = self._host_table[slots[entry_request], token // page]
            fields[f"slots{m}"] = block * (page // m) + (token % page) // m
            fields[f"request{m}"] = entry_request
            fields[f"index{m}"] = index
        return fields
