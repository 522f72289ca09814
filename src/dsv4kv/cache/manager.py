"""CacheManager: the request lifecycle over the pools (admit, plan a step, release) and the counters.

Blocks cover `page_tokens` original tokens of one request; every layer's paged pools are indexed by
the same block id, so one block table per request serves all layers. A request holds
ceil(length / page_tokens) blocks. `plan_step` allocates every block the step will fill before
returning the plan, so nothing allocates while the step (or a captured CUDA graph) runs.

With `prefix_caching=True` (docs/prefix-caching.md), full blocks and the state at their end (a snapshot
of the window ring and the CSA compressor rows) are kept by token content: `admit(tokens)` reuses the
longest cached prefix at a block boundary and the caller feeds only the rest; a step's full blocks are
published once every layer has run over its plan (`PrefixPublisher`, cache/publish.py). `swap_out` / `swap_in`
preempt a request to host memory and bring it back bit for bit, with or without prefix caching;
`export_request` / `import_request` move one into another cache of the same spec (cache/transfer.py).
Speculative decoding: `plan_step(batch, tentative=True)` plans a verify step and `accept(rid, n)` keeps the first n
tokens of each of its requests, the cache then bit-identical to one fed only those (cache/rollback.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import torch

from ..checks import positive_int
from ..geometry import ModelGeometry
from .layout import IndexerFormat, KVFormat
from .allocator import BlockAllocator
from .pools import POISON_BYTE, CachePools, LayerCache
from .prefix import CachedBlock, PrefixCache, PrefixStats
from .spec import DEFAULT_PAGE_TOKENS, CacheSpec
from .swap import NoRoom, Swapped
from .transfer import RequestState, cached_prefix, check_state, first_block, spec_fields, tensor_names
from .plan import EntryWrites, OutOfBlocks, SnapshotWrites, StepBuffers, StepPlan, StepStatus, host_fields, new_cache_id
from .publish import PrefixPublisher, Publication, TokenIds, token_ids
from .rollback import LogViews, TentativeRequest, TentativeStep, max_tentative_tokens

__all__ = ["CacheManager", "RequestError"]


class RequestError(ValueError):
    """A request id that is unknown, already released, used twice in one step, or awaiting `accept`."""


@dataclass
class _Request:
    rid: int
    slot: int
    length: int = 0
    num_blocks: int = 0  # its block ids are the manager's host table row [slot, :num_blocks]
    # prefix caching
    tokens: TokenIds | None = None  # None: admitted without token ids, never publishes nor hits
    cached: int = 0  # tokens served from the cache at admission
    nodes: list[CachedBlock] = field(default_factory=list)  # its blocks 0.. as cached nodes, in order
    publishing: bool = False  # its next full block may be published (its bytes sit on top of `nodes`)


@dataclass
class _TentativePlan:
    """A tentative plan in progress: its undo log once made (what a plan that raises must undo)."""

    step: TentativeStep | None = None


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
        prefix_caching: keep full blocks and their boundary state by token content (docs/prefix-caching.md).
        prefix_snapshots: boundary snapshots kept (default max_requests; each costs `spec.boundary_bytes`).
        swap_bytes: host memory `swap_out` may use (default: no limit).
    """

    def __init__(self, geometry: ModelGeometry, *, max_requests: int, max_tokens: int,
                 kv_format: KVFormat | str = KVFormat.FP8, indexer_format: IndexerFormat | str = IndexerFormat.MXFP4,
                 device: torch.device | str = "cpu", page_tokens: int = DEFAULT_PAGE_TOKENS,
                 max_seq_len: int | None = None, num_blocks: int | None = None, poison: bool = False,
                 prefix_caching: bool = False, prefix_snapshots: int | None = None, swap_bytes: int | None = None):
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

        if not isinstance(prefix_caching, bool):
            raise TypeError(f"prefix_caching: expected a bool, got {type(prefix_caching).__name__}")
        if prefix_snapshots is not None and not prefix_caching:
            raise ValueError("prefix_snapshots: given without prefix_caching=True")
        self.prefix: PrefixCache | None = None
        snapshots = 0
        if prefix_caching:
            if geometry.window > self.spec.page_tokens:
                # each token then belongs to at most one boundary's window: one snapshot slot per token and step
                raise ValueError(f"prefix_caching: expected a window <= page_tokens, got window {geometry.window} "
                                 f"and page_tokens {self.spec.page_tokens}")
            snapshots = positive_int("prefix_snapshots", prefix_snapshots if prefix_snapshots is not None
                                     else self.max_requests)
            self.prefix = PrefixCache(self.spec.page_tokens, snapshots)
        self.swap_bytes = positive_int("swap_bytes", swap_bytes) if swap_bytes is not None else None

        self.poison = poison
        self.allocator = BlockAllocator(self.num_blocks)
        self.pools = CachePools(self.spec, num_blocks=self.num_blocks, max_requests=self.max_requests,
                                device=self.device, fill_byte=POISON_BYTE if poison else 0, snapshots=snapshots)
        self.max_blocks_per_request = min(self.spec.blocks_for(self.max_seq_len), self.num_blocks)
        self.block_table = torch.full((self.max_requests, self.max_blocks_per_request), -1, dtype=torch.int32,
                                      device=self.device)
        self._host_table = np.full((self.max_requests, self.max_blocks_per_request), -1, dtype=np.int64)
        self._free_slots: deque[int] = deque(range(self.max_requests))
        self._requests: dict[int, _Request] = {}
        self._next_rid = 0
        self._step = 0
        self._status = StepStatus(current=False)  # the latest plan's record (`StepPlan.status`)
        self._swapped: dict[int, Swapped] = {}
        self._swap_used = 0
        self.cache_id = new_cache_id()
        self._publisher = PrefixPublisher(self.prefix, self.pools, self.allocator, geometry) if prefix_caching else None
        self._tentative: TentativeStep | None = None  # the tentative step awaiting accept (or its settle), if any
        self._broken: str | None = None  # why every call raises: a settle that failed past its retryable part
        self.max_tentative_tokens = max_tentative_tokens(self.spec)
        self._log_views = LogViews(self.pools)  # what a tentative step's undo log reaches, found once

    # --- lifecycle ------------------------------------------------------------------------------
    def admit(self, tokens=None) -> int | None:
        """A new request id with fresh state, or None when every request slot is taken.

        tokens: the prompt's token ids (a 1-D integer sequence, array or tensor). With prefix caching the
        longest cached prefix that ends at a block boundary and leaves at least one token to feed is mapped
        in: the request starts with `length(rid) == cached_tokens(rid)` tokens and the caller feeds only the
        rest. Token ids are then needed for every token fed (`append_tokens` for generated ones). Without
        prefix caching they are checked and otherwise ignored.
        """
        ids = token_ids("tokens", tokens) if tokens is not None else None
        if ids is not None and len(ids) > self.max_seq_len:
            raise ValueError(f"tokens: {len(ids)} ids, max_seq_len is {self.max_seq_len}")
        self._refuse_while_tentative("admit")
        self._settle(final=False)
        if not self._free_slots:
            return None
        slot = self._free_slots.popleft()
        self.pools.reset_request(slot)
        rid = self._next_rid
        self._next_rid += 1
        request = self._requests[rid] = _Request(rid, slot)
        if self.prefix is not None and ids is not None:
            request.tokens, request.publishing = TokenIds(ids), True
            self._set_table(slot, 0, self._publisher.reuse(request, ids))
        return rid

    def lookup(self, tokens) -> int:
        """How many leading tokens of `tokens` an `admit(tokens)` would serve from the cache now (no change)."""
        ids = token_ids("tokens", tokens)
        if self.prefix is None:
            return 0
        self._settle(final=False)
        return len(self._publisher.hit(ids)) * self.spec.page_tokens

    def admission_blocks(self, tokens) -> int:
        """Free blocks that `admit(tokens)` and then holding all of `tokens` would take now: one per page of the
        tokens, less the blocks of the prefix hit that live requests hold (shared, not taken; unreferenced cached
        blocks are counted free, and are taken). No change to the cache."""
        ids = token_ids("tokens", tokens)
        blocks = self.spec.blocks_for(len(ids))
        if self.prefix is None:
            return blocks
        self._settle(final=False)
        return blocks - sum(1 for node in self._publisher.hit(ids) if self.allocator.refcount(node.block) > 0)

    def append_tokens(self, rid: int, tokens) -> None:
        """Record the ids of tokens the request will be fed next (e.g. the one just sampled). Needed with prefix
        caching for requests admitted with token ids; checked and otherwise ignored without it."""
        ids = token_ids("tokens", tokens)
        record = self._swapped.get(rid)
        request = record.request if record is not None else self._request(rid)
        self._refuse_while_tentative("append_tokens", rid)
        if self.prefix is None:
            return
        if request.tokens is None:
            raise ValueError(f"append_tokens: request {rid} was admitted without token ids; pass the prompt to "
                             f"admit(tokens=...) to cache it")
        if request.tokens.n + len(ids) > self.max_seq_len:
            raise ValueError(f"append_tokens: request {rid} would know {request.tokens.n + len(ids)} token ids, "
                             f"max_seq_len is {self.max_seq_len}")
        request.tokens.append(ids)

    def forget_tokens(self, rid: int, keep: int) -> None:
        """Forget the ids recorded past the request's first `keep` tokens: ids appended for tokens it will not be fed
        after all (the drafts of a speculative step that failed before its plan). `keep` may not cut into the tokens
        the cache holds (its length) nor exceed the ids known; a request admitted without ids, or no prefix caching:
        checked and otherwise ignored, as `append_tokens`."""
        record = self._swapped.get(rid) if self._is_id(rid) else None
        request = record.request if record is not None else self._request(rid)
        self._refuse_while_tentative("forget_tokens", rid)
        if isinstance(keep, bool) or not isinstance(keep, (int, np.integer)):
            raise TypeError(f"forget_tokens: keep must be an int, got {type(keep).__name__}")
        known = request.tokens.n if request.tokens is not None else None
        if keep < request.length or (known is not None and keep > known):
            raise ValueError(f"forget_tokens: keep {keep} cuts into the {request.length} tokens request {rid} holds"
                             if keep < request.length else
                             f"forget_tokens: keep {keep} exceeds the {known} token ids request {rid} has")
        if self.prefix is not None and request.tokens is not None:
            request.tokens.truncate(int(keep))

    def release(self, rid: int) -> None:
        """Return a request's blocks and slot (or its host copy, if swapped out). Releasing an unknown or
        released id raises RequestError. While a tentative step awaits accept, a request of it that is released
        keeps none of its tokens not yet accepted (an abort mid-verify), and every release takes effect when the
        step settles: a cache fed only the kept tokens planned their step before the release."""
        record = self._swapped.pop(rid, None) if self._is_id(rid) else None
        if record is not None:
            self._swap_used -= record.nbytes
            return
        request = self._request(rid)
        self._status.left.add(rid)
        if self._tentative is not None:
            del self._requests[rid]
            self._tentative.leave(request)
            if self._tentative.settled:
                self._settle_tentative()
            return
        self._settle(final=False, leaving=rid)
        self._drop(request)

    def swap_out(self, rid: int) -> int | NoRoom:
        """Preempt a live request: copy its blocks, window ring and compressor state to host memory (pinned on
        CUDA), then free its blocks and slot. Returns the bytes copied, or `NoRoom` (nothing changed) when the
        host budget `swap_bytes` is short. Its id stays valid for `swap_in`, `release` and `append_tokens`."""
        request = self._request(rid)
        self._refuse_while_tentative("swap_out")
        nbytes = request.num_blocks * self.spec.block_bytes + self.spec.request_fixed_bytes
        if self.swap_bytes is not None and self._swap_used + nbytes > self.swap_bytes:
            return NoRoom("host swap bytes", nbytes, self.swap_bytes - self._swap_used)
        self._settle(final=False, leaving=rid)
        self._status.left.add(rid)
        blocks = self._host_table[request.slot, :request.num_blocks].tolist()
        saved = self.pools.save(request.slot, blocks)
        nodes = [self.prefix.cached(b) if self.prefix is not None else None for b in blocks]
        self._free_blocks(blocks)
        self._host_table[request.slot] = -1
        self.block_table[request.slot].fill_(-1)
        self._free_slots.append(request.slot)
        del self._requests[rid]
        request.slot, request.num_blocks = -1, 0
        self._swapped[rid] = Swapped(request=request, saved=saved, block_nodes=nodes, nbytes=nbytes)
        self._swap_used += nbytes
        return nbytes

    def swap_in_blocks(self, rid: int) -> int:
        """Free blocks `swap_in(rid)` would take now: its private blocks, and its cached ones that no live request
        holds (those still held are shared again, not taken). No change to the cache."""
        record = self._swapped.get(rid) if self._is_id(rid) else None
        if record is None:
            raise RequestError(f"swap_in_blocks: request {rid!r} is not swapped out")
        self._settle(final=False)
        alive = [node for node in record.block_nodes if node is not None and node.alive]
        return len(record.block_nodes) - sum(1 for node in alive if self.allocator.refcount(node.block) > 0)

    def swap_in(self, rid: int) -> int | NoRoom:
        """Bring a swapped-out request back, bit for bit, into a free slot and blocks (blocks it shared that are
        still cached are shared again, not copied). Returns the bytes it holds, or `NoRoom` (nothing changed)
        when no slot or too few blocks are free."""
        record = self._swapped.get(rid) if self._is_id(rid) else None
        if record is None:
            if self._is_id(rid) and rid in self._requests:
                raise RequestError(f"swap_in: request {rid} is not swapped out")
            self._request(rid)  # raises the unknown / released error
        self._refuse_while_tentative("swap_in")
        self._settle(final=False)
        if not self._free_slots:
            return NoRoom("request slots", 1, 0)
        nodes = [node if node is not None and node.alive else None for node in record.block_nodes]
        reused = [node.block for node in nodes if node is not None]
        idle = {b for b in reused if self.allocator.refcount(b) == 0}  # cached, waiting in the free queue
        fresh_count = len(nodes) - len(reused)
        if fresh_count + len(idle) > self.allocator.num_free:
            return NoRoom("blocks", fresh_count + len(idle), self.allocator.num_free)
        self.allocator.take(sorted(idle))
        self.allocator.share([b for b in reused if b not in idle])
        fresh = iter(self._allocate(fresh_count))
        blocks = [node.block if node is not None else next(fresh) for node in nodes]
        request = record.request
        request.slot = self._free_slots.popleft()
        request.num_blocks = len(blocks)
        self._set_table(request.slot, 0, blocks)
        self.pools.load(record.saved, request.slot, blocks, [i for i, node in enumerate(nodes) if node is None])
        alive = [node for node in request.nodes if node.alive]  # a prefix: evictions take whole subtrees
        if len(alive) < len(request.nodes):
            request.nodes, request.publishing = alive, False  # its later blocks are private copies now
        del self._swapped[rid]
        self._swap_used -= record.nbytes
        self._requests[rid] = request
        return record.nbytes

    def export_request(self, rid: int, *, skip_tokens: int = 0) -> RequestState:
        """A host copy of the live request's pages, window ring, compressor state, length and token ids, taken between
        steps (cache/transfer.py). `skip_tokens` (whole blocks; what the receiver's `lookup(tokens)` said it caches)
        leaves out the pages of those first blocks. An unknown, released or swapped-out id raises RequestError, a bad
        skip_tokens ValueError; nothing changes."""
        request = self._request(rid)
        self._refuse_while_tentative("export_request", rid, accepted=True)
        k = first_block(skip_tokens, request.length, self.spec.page_tokens)
        saved = self.pools.save(request.slot, self._host_table[request.slot, k:request.num_blocks].tolist())
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the asynchronous host copies have landed
        tokens = torch.from_numpy(request.tokens[:].copy()) if request.tokens is not None else None
        return RequestState(spec_fields(self.spec), request.length, tokens, dict(zip(tensor_names(self.pools), saved)),
                            first_block=k)

    def import_request(self, state: RequestState) -> int | NoRoom:
        """Admit a request holding `state` byte for byte in a fresh slot and blocks: its id, or `NoRoom` (nothing
        changed) when no slot or too few blocks are free. A state without its first blocks (`first_block`) gets this
        cache's cached blocks of its token ids for them (shared, as a prefix hit's), or `NoRoom("cached prefix
        blocks", ...)` when some are no longer cached. Another spec, or a malformed or too long state, raises."""
        saved, ids = check_state(state, self.pools, max_seq_len=self.max_seq_len)
        self._refuse_while_tentative("import_request")
        n, k = self.spec.blocks_for(state.length), state.first_block
        self._settle(final=False)
        chain = cached_prefix(self.prefix, state, ids)
        if not self._free_slots:
            return NoRoom("request slots", 1, 0)
        if len(chain) < k:
            return NoRoom("cached prefix blocks", k, len(chain))
        idle = sorted(node.block for node in chain if self.allocator.refcount(node.block) == 0)
        if n - k + len(idle) > self.allocator.num_free:
            return NoRoom("blocks", n - k + len(idle), self.allocator.num_free)
        self.allocator.take(idle)  # cached blocks waiting in the free queue
        self.allocator.share([node.block for node in chain if node.block not in idle])
        blocks = [node.block for node in chain] + self._allocate(n - k)
        slot, rid = self._free_slots.popleft(), self._next_rid
        self._next_rid += 1
        request = self._requests[rid] = _Request(rid, slot, length=state.length, num_blocks=n)
        if self.prefix is not None and ids is not None:
            # publishes on from its cached chain; a private full block past it ends its publication
            request.tokens, request.publishing, request.nodes = TokenIds(ids), True, list(chain)
            if chain:
                self.prefix.touch(chain[-1])
        try:
            self._set_table(slot, 0, blocks)
            self.pools.load(saved, slot, blocks[k:], range(n - k))
        except BaseException:  # a fault (device out of memory) leaves no request with partial bytes behind
            self._drop(request)
            self._free_slots.appendleft(self._free_slots.pop())  # the slot first again, as before the call
            self._next_rid -= 1
            raise
        return rid

    def plan_step(self, batch: Sequence[tuple[int, int]], *, buffers: StepBuffers | None = None,
                  tentative: bool = False) -> StepPlan | OutOfBlocks:
        """Plan one step: `batch` lists (request id, new tokens) pairs, prefill chunks and decode tokens alike.

        Allocates the blocks the step fills and advances each request's length (the caller then runs
        every layer over the plan). When the blocks do not fit, returns `OutOfBlocks` and changes nothing.
        Bad input (unknown id, repeated id, non-positive count, length past max_seq_len, a request
        larger than the whole cache, more rows than `buffers` hold, with prefix caching tokens whose ids
        are not known) raises before anything changes. With prefix caching, unreferenced cached blocks are
        evicted (least recently used first) when no other block is free, and the blocks this step fills are
        published once every layer has run over it.

        tentative=True: a verify step (speculative decoding). Every token of it is tentative until `accept(rid, n)`
        has said, for each of its requests, how many stay; the layers run over it as over any plan. Until then no
        other step is planned (RequestError). A request that brings more than `max_tentative_tokens` keeps all or none.
        """
        if not isinstance(tentative, bool):
            raise ValueError(f"tentative: expected a bool, got {tentative!r}")
        self._refuse_while_tentative("plan_step")
        requests, counts = self._validate_batch(batch)
        starts = np.array([r.length for r in requests], dtype=np.int64)
        counts_np = np.array(counts, dtype=np.int64)
        # entries of ratio m each request completes in this step: those ending at or before its new length
        new_entries = {m: (starts + counts_np) // m - starts // m for m in self.geometry.ratios}
        entry_counts = {m: int(per_request.sum()) for m, per_request in new_entries.items()}
        num_tokens, num_requests = int(counts_np.sum()), len(requests)
        if buffers is not None:
            self._check_buffers(buffers, num_tokens, num_requests, entry_counts, int((starts + counts_np).max()))
        self._settle(final=True)  # the previous plan is over: publish what it filled, if every layer ran
        held = [r.num_blocks for r in requests]
        need = [self.spec.blocks_for(r.length + n) - r.num_blocks for r, n in zip(requests, counts)]
        if sum(need) > self.allocator.num_free:
            return OutOfBlocks(needed=sum(need), free=self.allocator.num_free)
        if buffers is None:
            buffers = StepBuffers(self.cache_id, self.geometry.ratios, max_tokens=num_tokens,
                                  max_requests=num_requests, device=self.device, entries=entry_counts,
                                  persistent=False, snapshots=self.prefix is not None)
        if tentative:
            # all or nothing: a plan that raises (a device gather out of memory) leaves the cache as it was
            step = _TentativePlan()
            try:
                views, capture_rows = self._plan_blocks(requests, counts, held, need, starts, counts_np, new_entries,
                                                        buffers, tentative=step)
            except BaseException:
                self._unplan_tentative(requests, starts, held, need, step.step)
                raise
        else:
            views, capture_rows = self._plan_blocks(requests, counts, held, need, starts, counts_np, new_entries,
                                                    buffers, tentative=None)
        longest = int((starts + counts_np).max()) if num_requests else 0
        self._step += 1
        self._status.current = False
        self._status = StepStatus()
        snapshots = None
        if self.prefix is not None:
            snapshots = SnapshotWrites(window_slots=views["snapshot_window"], state_slots=views["snapshot_state"],
                                       count=capture_rows)
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
            snapshots=snapshots, status=self._status, tentative=tentative,
        )

    def _plan_blocks(self, requests: list[_Request], counts: list[int], held: list[int], need: list[int],
                     starts: np.ndarray, counts_np: np.ndarray, new_entries: dict, buffers: StepBuffers, *, tentative: _TentativePlan | None) -> tuple[dict, int]:
        """`plan_step`'s changes: map (and, for a plain step, take) the blocks, advance the lengths, log a tentative
        step's undo (its `TentativeStep` goes into `tentative.step` as soon as it exists), queue the publications and
        load the plan's buffers. Returns the buffers' views and the snapshot capture rows."""
        # a tentative step maps blocks without taking them: they are taken for its kept tokens when it settles
        fresh = self.allocator.peek(sum(need)) if tentative is not None else self._allocate(sum(need))
        self._map_blocks(requests, need, fresh, poison=tentative is None)
        for request, n in zip(requests, counts):
            request.length += n
        host = host_fields(np.array([r.slot for r in requests], dtype=np.int64), starts, counts_np, new_entries,
                           window=self.geometry.window, page_tokens=self.spec.page_tokens,
                           block_table=self._host_table)
        step = None
        if tentative is not None:  # the undo log: copies of what the step will overwrite, issued before its layers run
            step = tentative.step = TentativeStep(
                self._step + 1, [TentativeRequest(r, b, int(starts[b]), n, h) for b, (r, n, h)
                                 in enumerate(zip(requests, counts, held))],
                self._log_views, host, fresh, poison=self.poison)
        capture_rows = 0
        if self._publisher is not None:
            if step is not None:
                step.before_queue(self.prefix)
            capture_rows = self._publisher.plan_captures(
                requests, starts, counts_np, host, self._host_table, taken=step.snapshot_takes if step else None,
                before_copies=step.log_snapshots if step else None)
            if step is not None:
                step.publications = list(self._publisher.pending)
        views = buffers.load(host, int(counts_np.sum()), len(requests))
        self._tentative = step
        return views, capture_rows

    def _unplan_tentative(self, requests: list[_Request], starts: np.ndarray, held: list[int], need: list[int],
                          step: TentativeStep | None) -> None:
        """Undo a tentative plan that raised before it was returned: the queueing and bytes the step wrote
        (`TentativeStep.abandon`), the blocks it mapped (host and device tables) and the lengths."""
        self._tentative = None
        if step is not None:
            step.abandon(self.prefix, self._publisher)
        for request, start, h, n in zip(requests, starts, held, need):
            if n:  # columns past a request's blocks are -1: put back exactly those the plan mapped
                self._host_table[request.slot, h:h + n] = -1
                self.block_table[request.slot, h:h + n] = -1
            request.num_blocks, request.length = h, int(start)

    def accept(self, rid: int, n: int) -> None:
        """Keep the first n tokens request `rid` brought to the tentative step awaiting accept (0 <= n <= its count;
        a request that brought more than `max_tentative_tokens` keeps 0 or all) and roll back the rest: its length
        and token ids at once, its bytes when the step settles, once every request of the step is accepted or
        released. Then the cache is bit-identical to one that planned only the kept tokens (a plain step of them, or
        none): every pool, state and snapshot byte, block table, reference count, free queue, prefix-cache entry and
        counter (but `steps_planned`). Call it after the layers ran over the plan, before anything else touches
        the request. An unknown id, or one without a tentative step awaiting accept, raises RequestError and a bad
        n ValueError; nothing changes. Cost: cache/rollback.py.

        If settling raises (a device fault) while gathering or putting back bytes, the step stays unsettled and the next
        call on the cache retries it; past that (its blocks being taken) every later call raises RuntimeError."""
        self._usable()
        entry = self._tentative.awaiting(rid) if self._tentative is not None and self._is_id(rid) else None
        if entry is None:
            self._request(rid)  # the unknown / released / swapped-out error
            raise RequestError(f"accept: request {rid} has no tentative step awaiting accept")
        self._tentative.keep(entry, n, self.max_tentative_tokens)
        self._status.current = False  # no layer may run over the step any more
        if self._tentative.settled:
            self._settle_tentative()

    def awaiting_accept(self) -> list[int]:
        """Requests of the tentative step whose kept count is not known yet (empty when none awaits)."""
        return self._tentative.pending() if self._tentative is not None else []

    def step_buffers(self, *, max_tokens: int, max_requests: int, max_seq_len: int | None = None) -> StepBuffers:
        """Preallocated plan storage (fixed addresses) for CUDA-graph capture and replay. Plans built into them
        carry `max_seq_len` (default: the cache's) as their fixed context bound; longer requests are refused."""
        max_seq_len = positive_int("max_seq_len", max_seq_len if max_seq_len is not None else self.max_seq_len)
        if max_seq_len > self.max_seq_len:
            raise ValueError(f"max_seq_len: {max_seq_len} exceeds the cache's {self.max_seq_len}")
        return StepBuffers(self.cache_id, self.geometry.ratios, max_tokens=max_tokens, max_requests=max_requests,
                           device=self.device, max_seq_len=max_seq_len, snapshots=self.prefix is not None)

    # --- counters --------------------------------------------------------------------------------
    @property
    def steps_planned(self) -> int:
        """Steps planned so far; a plan's `step` equals it until the next `plan_step`."""
        return self._step

    @property
    def num_free_blocks(self) -> int:
        """Blocks a plan can take: never used, or (prefix caching) cached but referenced by no live request."""
        return self.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks live requests hold (a block shared by several counts once)."""
        return self.allocator.num_used

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, live or not (0 without prefix caching)."""
        self._settle(final=False)
        return self.prefix.num_cached_blocks if self.prefix is not None else 0

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no live request references: counted in `num_free_blocks`, evicted LRU when needed."""
        self._settle(final=False)
        if self.prefix is None:
            return 0
        return sum(1 for node in self.prefix.cached_blocks() if self.allocator.refcount(node.block) == 0)

    @property
    def num_snapshots(self) -> int:
        """Boundary snapshots held by cached blocks."""
        self._settle(final=False)
        return self.prefix.num_snapshots_held if self.prefix is not None else 0

    @property
    def prefix_stats(self) -> PrefixStats | None:
        """Hit-rate and eviction counters (None without prefix caching)."""
        self._settle(final=False)
        return self.prefix.stats if self.prefix is not None else None

    @property
    def bytes_cached(self) -> int:
        """Bytes the prefix cache holds beyond live requests: evictable blocks plus held snapshots."""
        return self.num_evictable_blocks * self.spec.block_bytes + self.num_snapshots * self.spec.boundary_bytes

    @property
    def bytes_swapped(self) -> int:
        """Host bytes held by swapped-out requests."""
        return self._swap_used

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
        return layer_index in self._status.layers_run

    def mark_layer_run(self, layer_index: int) -> None:
        """Record that a layer ran over the current plan outside `DSV4Attention` (a stand-in layer of a test or a
        simulation): the plan's status holds what a layer records itself."""
        self._status.layers_run.add(layer_index)

    def pages(self, layer_index: int) -> LayerCache:
        """Layer `layer_index`'s own pages and state: what its forward reads and writes."""
        return self.pools.layers[layer_index]

    def is_live(self, rid: int) -> bool:
        """Whether `rid` was admitted and is neither released nor swapped out."""
        return rid in self._requests

    def is_swapped(self, rid: int) -> bool:
        return rid in self._swapped

    def swapped_ids(self) -> list[int]:
        return list(self._swapped)

    def cached_tokens(self, rid: int) -> int:
        """Tokens the request was given from the prefix cache at admission (a multiple of page_tokens)."""
        record = self._swapped.get(rid)
        return record.request.cached if record is not None else self._request(rid).cached

    def request_ids(self) -> list[int]:
        return list(self._requests)

    def length(self, rid: int) -> int:
        record = self._swapped.get(rid)
        return record.request.length if record is not None else self._request(rid).length

    def blocks(self, rid: int) -> list[int]:
        request = self._request(rid)
        return self._host_table[request.slot, :request.num_blocks].tolist()

    def slot(self, rid: int) -> int:
        return self._request(rid).slot

    # --- internals --------------------------------------------------------------------------------
    @staticmethod
    def _is_id(rid) -> bool:
        return isinstance(rid, (int, np.integer)) and not isinstance(rid, bool)

    def _usable(self) -> None:
        """Raise if a failed settle left the cache unusable; finish a settle that raised in its retryable part."""
        if self._broken is not None:
            raise RuntimeError(self._broken)
        if self._tentative is not None and self._tentative.settled:
            self._settle_tentative()

    def _request(self, rid) -> _Request:
        self._usable()
        is_id = self._is_id(rid)
        request = self._requests.get(rid) if is_id else None
        if request is not None:
            return request
        if is_id and rid in self._swapped:
            raise RequestError(f"request {rid} is swapped out: swap_in first")
        if is_id and 0 <= rid < self._next_rid:
            raise RequestError(f"request {rid} was already released")
        raise RequestError(f"unknown request id {rid!r}")

    def _refuse_while_tentative(self, what: str, rid: int | None = None, *, accepted: bool = False) -> None:
        """RequestError (nothing changed) while a tentative step awaits accept: for any request (rid None), or for `rid`
        if it awaits accept (with `accepted`, also if it was accepted: its bytes settle with the step)."""
        self._usable()
        pending = self.awaiting_accept()
        if pending and (rid is None or rid in pending or (accepted and rid in self._tentative.requests)):
            raise RequestError(f"{what}: tentative step {self._tentative.step} awaits accept() of requests {pending}; "
                               f"accept (or release) them first")

    def _settle_tentative(self) -> None:
        """Every request of the tentative step is accepted or released: put back what the rejected tokens wrote and
        take the blocks and snapshots a plain step of the kept tokens would (cache/rollback.py)."""
        step = self._tentative
        # Gathering the kept bytes and putting the logged ones back are the step's device work; until both succeed
        # the step stays awaiting its settle, which the next call retries (restore is idempotent, the set-aside bytes
        # are kept). What follows takes blocks and snapshots and writes the kept bytes there: a failure in it cannot
        # be retried (the blocks are taken), so the cache then refuses every call (`_broken`).
        if step.aside is None:
            step.aside = step.set_aside()
        if not step.restored:
            step.restore(self._host_table, self.block_table)
            step.restored = True
        try:
            self._finish_settle(step)
        except BaseException as error:
            self._broken = (f"settling tentative step {step.step} failed after its blocks were being taken "
                            f"({type(error).__name__}: {error}); the cache's state is undefined: make a new cache")
            raise

    def _finish_settle(self, step: TentativeStep) -> None:
        entries, snapshots = step.aside
        if self._publisher is not None:
            step.undo_queue(self.prefix, self._publisher)
        kept = [entry for entry in step.requests.values() if entry.kept]
        requests = [entry.request for entry in kept]
        need = [self.spec.blocks_for(entry.end) - entry.held for entry in kept]
        self._map_blocks(requests, need, self._allocate(sum(need)))
        published = []
        if self._publisher is not None:
            published = self._publisher.queue_kept(requests, np.array([e.start for e in kept], dtype=np.int64),
                                                   np.array([e.kept for e in kept], dtype=np.int64), self._host_table)
        for publish in step.place(entries, snapshots, self._host_table, published):
            self.prefix.return_snapshot(publish.snapshot)  # not captured: snapshots ran short in the step
            publish.snapshot = None
        self._tentative = None  # settled: the releases below publish and drop as after a plain step
        for request in step.leaving:  # released meanwhile: they leave now, as after a plain step of the kept tokens
            self._requests[request.rid] = request
            self._settle(final=False, leaving=request.rid)
            self._drop(request)

    def _drop(self, request: _Request) -> None:
        """Free a live request's blocks and slot."""
        self._free_blocks(self._host_table[request.slot, :request.num_blocks].tolist())
        self._host_table[request.slot] = -1
        self.block_table[request.slot].fill_(-1)
        self._free_slots.append(request.slot)
        del self._requests[request.rid]

    def _settle(self, *, final: bool, leaving: int | None = None) -> None:
        """Publish the latest plan's filled blocks if every layer ran over it, else keep or drop them
        (`PrefixPublisher.settle`). A tentative step's wait for its accepts."""
        if self._publisher is not None and self._tentative is None:
            self._publisher.settle(self._status.layers_run, self._requests, final=final, leaving=leaving)

    @property
    def _pending(self) -> list[Publication]:
        """Publications waiting for the latest plan's layers (each holds a snapshot id until settled)."""
        return self._publisher.pending if self._publisher is not None else []

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
            if request.tokens is not None and request.length + n > request.tokens.n:
                raise ValueError(f"request {rid}: feeds tokens up to {request.length + n}, {request.tokens.n} token "
                                 f"ids are known (prefix caching needs them: append_tokens first)")
            requests.append(request)
            counts.append(n)
        return requests, counts

    def _check_buffers(self, buffers, tokens: int, requests: int, entries: dict[int, int], longest: int) -> None:
        if not isinstance(buffers, StepBuffers):
            raise TypeError(f"buffers: expected StepBuffers from step_buffers(), got {type(buffers).__name__}")
        if buffers.cache_id != self.cache_id:
            raise ValueError("buffers: made by another CacheManager")
        if getattr(buffers, "snapshots", False) != (self.prefix is not None):
            raise ValueError(f"buffers: {'with' if buffers.snapshots else 'without'} prefix-caching fields, the "
                             f"cache has prefix_caching={self.prefix is not None}; make them with step_buffers()")
        short = [m for m in self.geometry.ratios if buffers.entry_capacity.get(m, -1) < entries[m]]
        if buffers.max_seq_len is not None and longest > buffers.max_seq_len:
            raise ValueError(f"buffers: a request reaches {longest} tokens, the buffers' max_seq_len is "
                             f"{buffers.max_seq_len}")
        if tokens > buffers.max_tokens or requests > buffers.max_requests or short:
            raise ValueError(f"buffers: step has {tokens} tokens / {requests} requests / entries {entries}, buffers "
                             f"hold {buffers.max_tokens} / {buffers.max_requests} / {buffers.entry_capacity}")

    def _set_table(self, slot: int, first: int, blocks: list[int]) -> None:
        """Map `blocks` at columns first.. of the slot's block-table row (host and device)."""
        if not blocks:
            return
        self._host_table[slot, first:first + len(blocks)] = blocks
        self.block_table[slot, first:first + len(blocks)] = torch.tensor(blocks, dtype=torch.int32).to(self.device)

    def _allocate(self, n: int) -> list[int]:
        """n blocks from the free queue (the caller checked there are enough). Cached blocks among them leave the
        prefix cache with their subtrees; the subtrees' blocks, worthless now, move to the front of the queue."""
        blocks = self.allocator.allocate(n)
        if self.prefix is not None:
            for block in blocks:
                dropped = self.prefix.evict(block)
                self.allocator.to_front([node.block for node in dropped[1:]])
        return blocks

    def _free_blocks(self, blocks: list[int]) -> None:
        """Drop a request's references. With prefix caching, private blocks go to the front of the free queue
        (reused first) and cached ones to the back, deepest first, so a prefix outlives its extensions."""
        if self.prefix is None:
            self.allocator.free(blocks)
            return
        cached = [b for b in blocks if self.prefix.cached(b) is not None]
        self.allocator.free([b for b in blocks if self.prefix.cached(b) is None], front=True)
        self.allocator.free(cached[::-1])

    def _map_blocks(self, requests: list[_Request], need: list[int], fresh: list[int], *, poison: bool = True) -> None:
        if not fresh:
            return
        rows = np.repeat([r.slot for r in requests], need)
        cols = np.concatenate([np.arange(r.num_blocks, r.num_blocks + n) for r, n in zip(requests, need)])
        self._host_table[rows, cols] = fresh
        for request, n in zip(requests, need):
            request.num_blocks += n
        update = torch.from_numpy(np.stack((rows, cols, np.asarray(fresh)))).to(self.device)  # one copy
        self.block_table[update[0], update[1]] = update[2].to(torch.int32)
        if self.poison and poison:  # reused blocks hold their previous owner's bytes: make them NaN again
            for layer in self.pools.layers:
                for pool in (layer.entries, layer.index_keys):
                    if pool is not None:
                        pool[update[2]] = POISON_BYTE
