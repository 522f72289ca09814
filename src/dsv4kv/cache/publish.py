"""Prefix publication: the prefix cache's side of `CacheManager` (docs/prefix-caching.md).

A full block is published (entered in the prefix cache by its token content, with the boundary snapshot at its
end) only once every layer has run over the plan that filled it: before then its bytes are not all written.
`PrefixPublisher` maps the longest cached prefix into a request at admission (`reuse`), queues the blocks a plan
fills and says where each boundary snapshot's rows come from (`plan_captures`), and publishes or drops the queued
blocks when the manager settles the plan (`settle`). The manager owns the requests and the block table; they come
in as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from ..geometry import LayerKind, ModelGeometry
from .allocator import BlockAllocator
from .pools import CachePools
from .prefix import CachedBlock, PrefixCache

if TYPE_CHECKING:
    from .manager import _Request

__all__ = ["PrefixPublisher", "Publication", "TokenIds", "token_ids"]


def token_ids(name: str, tokens) -> np.ndarray:
    """Token ids as int64 [n], or ValueError saying what was expected and what came."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise ValueError(f"{name}: expected a 1-D integer tensor of token ids, got {tokens.dtype} "
                             f"{list(tokens.shape)}")
        return tokens.detach().cpu().to(torch.int64).numpy()
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (Sequence, np.ndarray)):
        raise ValueError(f"{name}: expected a 1-D sequence of integer token ids, got {type(tokens).__name__}")
    array = np.asarray(tokens)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected a 1-D sequence of integer token ids, got {array.dtype} "
                         f"shape {list(array.shape)}")
    if array.dtype.kind == "u" and array.dtype.itemsize == 8 and int(array.max()) >= 2 ** 63:
        raise ValueError(f"{name}: token id {int(array.max())} does not fit int64")
    return array.astype(np.int64)


class TokenIds:
    """A request's known token ids (int64), growing by appends (and cut back by a rejection)."""

    def __init__(self, ids: np.ndarray):
        self._buf = ids.copy()
        self.n = len(ids)

    def append(self, ids: np.ndarray) -> None:
        if self.n + len(ids) > len(self._buf):
            self._buf = np.concatenate((self._buf[:self.n], np.empty(max(self.n, len(ids)), np.int64)))
        self._buf[self.n:self.n + len(ids)] = ids
        self.n += len(ids)

    def __getitem__(self, index: slice) -> np.ndarray:
        return self._buf[:self.n][index]

    def truncate(self, n: int) -> None:
        """Forget the ids from position n on (a tentative step's rejected tokens)."""
        self.n = min(self.n, n)


@dataclass
class Publication:
    """A block filled by the current plan, to publish once every layer has run over it."""

    rid: int
    depth: int  # block index in the request
    block: int
    snapshot: int | None  # the boundary state at (depth + 1) * page_tokens, being captured by the plan


class PrefixPublisher:
    """What the manager does for the prefix cache: hits at admission, and publishing what each plan fills.

    Args:
        prefix: the cache index (blocks by content, snapshots).
        pools: the tensors; boundary snapshots are restored from and copied into them.
        allocator: the manager's block allocator (a hit takes or shares the blocks it maps).
        geometry: the model: a snapshot keeps `window` rows of ring and a CSA ratio's rows of compressor state;
            every layer must run over a plan before its blocks are published.
    """

    def __init__(self, prefix: PrefixCache, pools: CachePools, allocator: BlockAllocator, geometry: ModelGeometry):
        self.prefix = prefix
        self.pools = pools
        self.allocator = allocator
        self.page_tokens = prefix.page_tokens
        self.window = geometry.window
        csa = geometry.layers_of(LayerKind.CSA)
        self.csa_ratio = csa[0].ratio if csa else 0  # 0: no compressor state to snapshot
        self.num_layers = geometry.num_layers
        self.pending: list[Publication] = []  # blocks the current plan fills, published once its layers ran

    def hit(self, ids: np.ndarray) -> list[CachedBlock]:
        """The cached blocks `admit(ids)` would map now: the longest cached prefix ending at a boundary with a
        snapshot and leaving at least one token to feed."""
        chain = self.prefix.match(ids, max(len(ids) - 1, 0) // self.page_tokens)
        return chain[:self.prefix.hit_depth(chain)]

    def reuse(self, request: _Request, ids: np.ndarray) -> list[int]:
        """Give a new request the longest cached prefix of `ids`: take or share its blocks, restore the boundary
        state into the request's slot, record the hit. Returns the blocks for the caller's block table."""
        stats = self.prefix.stats
        stats.queries += 1
        stats.query_tokens += len(ids)
        chain = self.hit(ids)
        if not chain:
            return []
        blocks = [node.block for node in chain]
        idle = {b for b in blocks if self.allocator.refcount(b) == 0}  # cached, waiting in the free queue
        self.allocator.take(sorted(idle))
        self.allocator.share([b for b in blocks if b not in idle])
        boundary = len(chain) * self.page_tokens
        self.pools.restore(chain[-1].snapshot, request.slot, boundary)
        self.prefix.touch(chain[-1])
        request.length = request.cached = boundary
        request.num_blocks = len(blocks)
        request.nodes = list(chain)
        stats.hits += 1
        stats.hit_tokens += boundary
        return blocks

    # --- a plan's publications -------------------------------------------------------------------
    def plan_captures(self, requests: list[_Request], starts: np.ndarray, counts: np.ndarray,
                      host: dict[str, np.ndarray], host_table: np.ndarray, *, taken: list | None = None,
                      before_copies: Callable[[list[int]], None] | None = None) -> int:
        """Queue the publication of every block the step fills, take a snapshot id for each boundary and say
        where its state comes from: rows before the step are copied from the rings now (the step's appends
        would overwrite them), rows in the step get snapshot slots in the plan for the layers to capture.
        `host` gets the plan's `snapshot_window` / `snapshot_state` fields. Returns the number of rows with a slot.
        taken: gets the snapshot takes (`PrefixCache.take_snapshot`); before_copies(ids): called with the snapshot
        ids taken before anything is written into them (a tentative step logs their bytes)."""
        page, window, m = self.page_tokens, self.window, self.csa_ratio
        num_tokens = int(counts.sum())
        host["snapshot_window"] = np.full(num_tokens, -1, dtype=np.int64)
        host["snapshot_state"] = np.full(num_tokens, -1, dtype=np.int64)
        queued = self._take_snapshots(self._queue(requests, starts, counts, host_table), taken)
        if before_copies is not None:
            before_copies([publish.snapshot for _, publish in queued if publish.snapshot is not None])
        for b, publish in queued:
            if publish.snapshot is None:
                continue
            request, start = requests[b], int(starts[b])
            boundary = (publish.depth + 1) * page
            for name, size in (("snapshot_window", window), ("snapshot_state", m)):
                if size:
                    positions = np.arange(max(boundary - size, start), boundary)
                    host[name][host["query_start"][b] + positions - start] = publish.snapshot * size + positions % size
            if start > boundary - window:
                self.pools.copy_to_snapshot(request.slot, publish.snapshot, range(boundary - window, start),
                                            range(boundary - m, max(start, boundary - m)) if m else ())
        self.pending.extend(publish for _, publish in queued)
        return int(((host["snapshot_window"] >= 0) | (host["snapshot_state"] >= 0)).sum())

    def queue_kept(self, requests: list[_Request], starts: np.ndarray, counts: np.ndarray,
                   host_table: np.ndarray) -> list[Publication]:
        """A settled tentative step's publications: those a plain step of its kept tokens (`counts`) would queue,
        with the snapshot ids it would take, queued for publication. Their bytes are the caller's to write."""
        queued = self._take_snapshots(self._queue(requests, starts, counts, host_table), None)
        self.pending.extend(publish for _, publish in queued)
        return [publish for _, publish in queued]

    def _take_snapshots(self, queued: list[tuple[int, Publication]], taken: list | None
                        ) -> list[tuple[int, Publication]]:
        # the deepest boundaries first: when snapshots run short, a longer hit is worth more
        for _, publish in reversed(queued):
            publish.snapshot = self.prefix.take_snapshot(taken)
            if publish.snapshot is None:
                break
        return queued

    def _queue(self, requests: list[_Request], starts: np.ndarray, counts: np.ndarray,
               host_table: np.ndarray) -> list[tuple[int, Publication]]:
        """(batch row, publication) for each block the step fills that its request may publish, in batch order.
        A request stops publishing at a block that cannot be published (a gap, or content already cached)."""
        page = self.page_tokens
        queued: list[tuple[int, Publication]] = []
        for b, request in enumerate(requests):
            if request.tokens is None or not request.publishing:
                continue
            start, end = int(starts[b]), int(starts[b] + counts[b])
            for depth in range(start // page, end // page):
                if depth != len(request.nodes) + sum(q.rid == request.rid for _, q in queued):
                    request.publishing = False  # a block before this one was not published
                    break
                if depth == len(request.nodes):  # a queued parent has no children yet; a cached one may have it
                    parent = request.nodes[-1] if request.nodes else None
                    if self.prefix.child(parent, request.tokens[depth * page:(depth + 1) * page]) is not None:
                        self.prefix.stats.duplicate_blocks += 1
                        request.publishing = False
                        break
                queued.append((b, Publication(request.rid, depth, int(host_table[request.slot, depth]), None)))
        return queued

    def settle(self, layers_run: set[int], requests: dict[int, _Request], *, final: bool,
               leaving: int | None = None) -> None:
        """Finish the current plan's publications: once every layer has run over it (`layers_run`), publish the
        blocks it filled (with their snapshots). Otherwise keep waiting, drop those of a request `leaving`
        (released or swapped out: the plan can no longer run for it) or, with `final` (a new plan replaces this
        one), drop them all; a request whose publication is dropped stops publishing (its later bytes sit on a
        step that may not have run). `requests` are the live ones, by id."""
        if not self.pending:
            return
        if layers_run.issuperset(range(self.num_layers)):
            pending, self.pending = self.pending, []
            for publish in pending:
                self._publish(publish, requests)
            return
        keep = []
        for publish in self.pending:
            if final or publish.rid == leaving:
                self._drop(publish, requests)
            else:
                keep.append(publish)
        self.pending = keep

    def _publish(self, publish: Publication, requests: dict[int, _Request]) -> None:
        request = requests.get(publish.rid)
        if request is None or not request.publishing or len(request.nodes) != publish.depth:
            self._drop(publish, requests)
            return
        page = self.page_tokens
        parent = request.nodes[-1] if request.nodes else None
        tokens = request.tokens[publish.depth * page:(publish.depth + 1) * page]
        if self.prefix.child(parent, tokens) is not None:
            # the same content computed twice (e.g. two identical requests at once): the first one is kept; this
            # request keeps its copy private and publishes nothing more (its later bytes sit on that copy)
            self.prefix.stats.duplicate_blocks += 1
            self._drop(publish, requests)
            return
        request.nodes.append(self.prefix.insert(parent, publish.block, tokens, publish.snapshot))

    def _drop(self, publish: Publication, requests: dict[int, _Request]) -> None:
        if publish.snapshot is not None:
            self.prefix.return_snapshot(publish.snapshot)
        request = requests.get(publish.rid)
        if request is not None:
            request.publishing = False
