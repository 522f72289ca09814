"""Tentative steps (speculative decoding): what `CacheManager.plan_step(batch, tentative=True)` records before the
layers run, and how the step settles once `CacheManager.accept` has said how many tokens of each request stay
(docs/prefix-caching.md, "Speculative decoding").

A tentative step is planned as a plain step of all its tokens, with three differences:
- the blocks it fills are mapped but not taken: the allocator still counts them free, first in its queue
  (`BlockAllocator.peek`), and cached ones stay cached;
- before the layers run, the *undo log* copies, by device gathers issued on the current stream, every byte the
  step's tokens will overwrite: per layer, each token's window-ring row and compressor (and indexer compressor) rows,
  and the entry and indexer-key slots of the entries the step completes; with prefix caching the boundary snapshots
  the step takes (whole); with poison=True the whole blocks it maps, which are then poisoned as taken blocks are;
- what it would publish (prefix caching) waits until it settles.
The layers run over the plan as over any plan, eager or replayed from a CUDA graph: nothing here runs inside them.

The step settles once each of its requests has been accepted (or released). The kept tokens' entries written into
mapped blocks and the kept boundaries' snapshots are set aside; every logged byte of a rejected token, of a mapped
block and of a taken snapshot is put back, and the snapshot takes are undone in reverse order; the manager then takes
the blocks and snapshots that a plain step of the kept tokens would take (the same ids, evictions, poisoning and
publications), and the bytes set aside land there. The cache is then bit-identical to one fed only the kept tokens
(but where a step crosses more boundaries than the cache has snapshots: a kept boundary the plan could not capture is
then published without a snapshot).

Which counts can be kept: a ring keeps only a step's last R rows (the window; R = 2m in CSA and m in HCA layers), so a
request that brings at most `max_tentative_tokens` tokens (the smallest ring: 8 on V4) may keep any number of them;
one that brings more (a prefill chunk in a verify step) keeps all or none.

Cost: the log copies each tentative token's rows (V4-Flash, FP8 entries, MXFP4 keys: 584 B in a window layer,
4,685 B in an HCA layer, 10,987 B in a CSA layer, 0.33 MB per token over the 43 layers), in one gather per kind of
tensor (the layers sharing a shape are stored together, `CachePools.stacks`); settling puts back the rows of the
rejected tokens only. A boundary snapshot the step takes is logged whole (4.1 MB), with poison=True a mapped block too.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .pools import POISON_BYTE, CachePools
from .publish import Publication
from .spec import CacheSpec

if TYPE_CHECKING:
    from .manager import _Request

__all__ = ["LogViews", "TentativeRequest", "TentativeStep", "max_tentative_tokens"]

_STATE_FIELDS = ("state_kv", "state_score", "index_state_kv", "index_state_score")
_PAGED_FIELDS = ("entries", "index_keys")
_SNAPSHOT_FIELDS = ("boundary_window", "boundary_kv", "boundary_score", "boundary_index_kv", "boundary_index_score")


def max_tentative_tokens(spec: CacheSpec) -> int:
    """The most tokens a request may bring to a tentative step and keep any number of: the smallest ring (the window,
    a compressor's state rows)."""
    return min([spec.geometry.window] + [layer.state_rows for layer in spec.layers if layer.state_rows])


@dataclass
class TentativeRequest:
    """One request of a tentative step."""

    request: _Request
    row: int  # its batch row
    start: int  # its length before the step
    count: int  # tokens it brought
    held: int  # blocks it held before the step
    kept: int | None = None  # tokens accepted (None: not yet)

    @property
    def end(self) -> int:
        """Its length once settled."""
        return self.start + (self.kept or 0)


def _row_views(tensor: torch.Tensor, layout, entries: int) -> list[torch.Tensor]:
    """A group's paged tensor [layers, pages, page_bytes] as its data and scale rows [layers, pages, entries, bytes]
    (views; the scale rows only where the format has them)."""
    split = entries * layout.data_bytes
    views = [tensor[..., :split].unflatten(-1, (entries, layout.data_bytes))]
    if layout.scale_bytes:
        views.append(tensor[..., split:split + entries * layout.scale_bytes].unflatten(-1, (entries, layout.scale_bytes)))
    return views


class LogViews:
    """The views of `pools` that a tentative step logs, by addressing: the window ring's, each compressor ring's (by
    its rows R) and each ratio's entry slots' (data and scale rows of every stack of layers that has them), and the
    whole paged and snapshot tensors. They depend on the pools alone: the manager makes them once."""

    def __init__(self, pools: CachePools):
        self.pools = pools
        spec0 = pools.layers[0].spec
        self.window, self.page_tokens = spec0.window, spec0.page_tokens
        self.window_views = [v for _, t in pools.stacks("window") for v in _row_views(t, spec0.main, self.window)]
        self.state_views = {
            rows: [t for name in _STATE_FIELDS for _, t in pools.stacks(name) if t.shape[2] == rows]
            for rows in sorted({layer.spec.state_rows for layer in pools.layers if layer.spec.state_rows})}
        self.entry_views = {}
        for ratio in sorted({layer.spec.layer.ratio for layer in pools.layers if layer.spec.entries_per_page}):
            views = []
            for name in _PAGED_FIELDS:
                for layers, t in pools.stacks(name):
                    spec = pools.layers[layers[0]].spec
                    if spec.layer.ratio == ratio:
                        views += _row_views(t, spec.main if name == "entries" else spec.index,
                                            self.page_tokens // ratio)
            self.entry_views[ratio] = views
        self.paged = [tensor for name in _PAGED_FIELDS for _, tensor in pools.stacks(name)]
        self.snapshots = [tensor for name in _SNAPSHOT_FIELDS for _, tensor in pools.stacks(name)]
        self.device = pools.layers[0].window.device


@dataclass
class _Rows:
    """The rows of one addressing that a step writes: the window ring (slot, pos % window), a compressor ring of R rows
    (slot, pos % R) or the entry slots of ratio m (block, offset), in every layer that has them. views: [layers, A, B, k]
    over the pools; a, b: the rows' indices (on the host, and their device copies a_d, b_d); position: the token whose
    write each row is (for an entry, the token that completes it); row: its request's batch row; block: its block
    (entries) or -1; saved: the log's copies [layers, K, k] of each view, taken before the layers ran."""

    views: list[torch.Tensor]
    a: np.ndarray
    b: np.ndarray
    position: np.ndarray
    row: np.ndarray
    block: np.ndarray
    saved: list[torch.Tensor] | None = None
    a_d: torch.Tensor | None = None
    b_d: torch.Tensor | None = None
    mapped: np.ndarray | None = None  # whether each row is in a block the step mapped


class TentativeStep:
    """A tentative step's requests and undo log, from its plan to its settling.

    Args:
        step: the plan's step number.
        requests: the step's requests, in batch order.
        views: the cache's tensors, as the log reaches them (`LogViews`).
        host: the plan's host index fields (`plan.host_fields`), the step's blocks mapped.
        mapped: the blocks the step maps and has not taken (in mapping order).
        poison: the cache poisons the blocks it takes: log the mapped blocks whole, then poison them.
    """

    def __init__(self, step: int, requests: list[TentativeRequest], views: LogViews, host: dict[str, np.ndarray],
                 mapped: list[int], *, poison: bool):
        self.step = step
        self.requests = {entry.request.rid: entry for entry in requests}
        self.views = views
        self.mapped = list(mapped)
        self.poison = poison
        self.device = views.device
        self.snapshot_takes: list[tuple[int, object]] = []  # (id, node detached or None), in take order
        self.publications: list[Publication] = []  # what the plan queued, as if every token were kept
        self.publishing: list[tuple[_Request, bool]] = []  # each request's publishing flag before the plan queued
        self.duplicate_blocks = 0  # the prefix counter before the plan queued
        self.leaving: list[_Request] = []  # released while the step awaited accept, in order
        self._snapshots: list[int] = []  # ids logged whole
        self._snapshot_log: list[torch.Tensor] = []
        self._block_log: list[torch.Tensor] = []
        self._queued = False  # `before_queue` ran: `abandon` undoes the queueing
        self.aside: tuple[list, tuple[dict, list]] | None = None  # `set_aside`'s bytes, kept until the step settles
        self.restored = False  # `restore` ran (a settle that failed after it retries from there)
        self._sites = self._record(host, requests)
        if poison and self.mapped:
            blocks = self._upload(np.asarray(self.mapped))[0]
            tensors = self.views.paged
            self._block_log = [tensor[:, blocks] for tensor in tensors]  # every copy before the first write
            try:
                for tensor in tensors:
                    tensor[:, blocks] = POISON_BYTE
            except BaseException:
                self._put_back_blocks()
                raise

    # --- the log ---------------------------------------------------------------------------------------
    def _record(self, host: dict[str, np.ndarray], requests: list[TentativeRequest]) -> list[_Rows]:
        log = self.views
        window = log.window
        slots = host["request_slots"]
        ends = host["seq_lens"]
        positions, token_row = host["positions"], host["token_request"]
        none = np.full(len(positions), -1, dtype=np.int64)
        sites = []
        # the window ring: the tokens with a ring slot (each request's last `window` tokens of the step)
        keep = host["window_slots"] >= 0
        ring = host["window_slots"][keep]
        sites.append(_Rows(log.window_views, ring // window, ring % window, positions[keep], token_row[keep],
                           none[keep]))
        # compressor rings: each request's last R tokens of the step, at pos % R
        for rows, views in log.state_views.items():
            keep = positions >= ends[token_row] - rows
            sites.append(_Rows(views, slots[token_row[keep]], positions[keep] % rows, positions[keep], token_row[keep],
                               none[keep]))
        # the entry (and indexer key) slots of the entries the step completes
        for ratio, views in log.entry_views.items():
            per_page = log.page_tokens // ratio
            entry_slots = host[f"slots{ratio}"]
            sites.append(_Rows(views, entry_slots // per_page, entry_slots % per_page,
                               (host[f"index{ratio}"] + 1) * ratio - 1, host[f"request{ratio}"], entry_slots // per_page))
        sites = [site for site in sites if len(site.a) and site.views]
        mapped = np.asarray(self.mapped, dtype=np.int64)
        for site in sites:
            site.mapped = np.isin(site.block, mapped)
        index = self._upload(*[x for site in sites for x in (site.a, site.b)])
        for site, a, b in zip(sites, index[0::2], index[1::2]):
            site.a_d, site.b_d = a, b  # kept: a settle that puts back every row of the site reuses them
            site.saved = [view[:, a, b] for view in site.views]
        return sites

    def log_snapshots(self, ids: list[int]) -> None:
        """Copy the snapshots the step takes, whole, before anything is written into them (prefix caching)."""
        if not ids:
            return
        self._snapshots = list(ids)
        index = self._upload(np.asarray(ids))[0]
        self._snapshot_log = [tensor.index_select(1, index) for tensor in self.views.snapshots]

    def _upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """int64 host arrays -> device tensors, in one copy (on CUDA from pinned memory, without waiting for the
        stream: the step before may still be running)."""
        if not arrays:
            return []
        flat = torch.from_numpy(np.concatenate([np.asarray(a, dtype=np.int64) for a in arrays]))
        if self.device.type == "cuda":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        return list(flat.to(self.device).split([len(a) for a in arrays]))

    # --- accepting ---------------------------------------------------------------------------------------
    def pending(self) -> list[int]:
        """Request ids still to be accepted or released."""
        return [rid for rid, entry in self.requests.items() if entry.kept is None]

    @property
    def settled(self) -> bool:
        return all(entry.kept is not None for entry in self.requests.values())

    def awaiting(self, rid) -> TentativeRequest | None:
        """The step's entry of request `rid` if it awaits accept, else None."""
        entry = self.requests.get(rid)
        return entry if entry is not None and entry.kept is None else None

    def keep(self, entry: TentativeRequest, n, limit: int) -> None:
        """The request keeps n of its tokens: its length and token ids change now, its bytes when the step settles.
        ValueError (nothing changed) unless 0 <= n <= its count, or for a request of more than `limit` tokens
        (`max_tentative_tokens`) n is 0 or all."""
        rid, count = entry.request.rid, entry.count
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise ValueError(f"accept: n must be an int, got {n!r}")
        if not 0 <= n <= count:
            raise ValueError(f"accept: request {rid} brought {count} tokens to tentative step {self.step}, "
                             f"cannot keep {n}")
        if count > limit and n not in (0, count):
            raise ValueError(f"accept: request {rid} brought {count} tokens to tentative step {self.step}, more "
                             f"than max_tentative_tokens ({limit}): it keeps all or none, not {n}")
        self._keep(entry, int(n))

    def _keep(self, entry: TentativeRequest, n: int) -> None:
        entry.kept = n
        request = entry.request
        request.length = entry.start + n
        if n < entry.count and request.tokens is not None:
            request.tokens.truncate(request.length)  # the rejected drafts' ids

    def leave(self, request: _Request) -> None:
        """A request released before the step settled (it leaves when the step settles, in release order): one of the
        step's keeps what it accepted, none if it had not (an abort mid-verify)."""
        entry = self.requests.get(request.rid)
        if entry is not None and entry.kept is None:
            self._keep(entry, 0)
        self.leaving.append(request)

    # --- prefix caching ----------------------------------------------------------------------------------
    def before_queue(self, prefix) -> None:
        """Note what queueing the plan's publications may change (each request's publishing flag, the duplicate-block
        counter), so that settling can queue as a plain step of the kept tokens would."""
        self.publishing = [(entry.request, entry.request.publishing) for entry in self.requests.values()]
        self.duplicate_blocks = prefix.stats.duplicate_blocks
        self._queued = True

    def undo_queue(self, prefix, publisher) -> None:
        """Undo the plan's queueing: its snapshot takes in reverse order, the flags and counter, its publications."""
        for snapshot, node in reversed(self.snapshot_takes):
            prefix.untake_snapshot(snapshot, node)
        for request, publishing in self.publishing:
            request.publishing = publishing
        prefix.stats.duplicate_blocks = self.duplicate_blocks
        queued = {id(p) for p in self.publications}
        publisher.pending = [p for p in publisher.pending if id(p) not in queued]

    # --- a plan that failed --------------------------------------------------------------------------------
    def abandon(self, prefix, publisher) -> None:
        """Undo what planning the step did to the pools and the prefix cache, for a plan that raised before it was
        returned (no layer ran over it): the queueing, the bytes written into taken snapshots (rows copied from the
        rings) and the poisoned mapped blocks. The manager unmaps the blocks itself."""
        if self._queued:
            self.undo_queue(prefix, publisher)
        if self._snapshot_log:
            ids = self._upload(np.asarray(self._snapshots))[0]
            for tensor, saved in zip(self.views.snapshots, self._snapshot_log):
                tensor[:, ids] = saved
        self._put_back_blocks()

    def _put_back_blocks(self) -> None:
        """The mapped blocks' logged bytes back (with poison=True; nothing otherwise)."""
        if self._block_log:
            blocks = self._upload(np.asarray(self.mapped))[0]
            for tensor, saved in zip(self.views.paged, self._block_log):
                tensor[:, blocks] = saved

    # --- settling ----------------------------------------------------------------------------------------
    def set_aside(self) -> tuple[list, tuple[dict, list]]:
        """The kept bytes that must move, gathered before `restore`: the entries kept tokens wrote into mapped blocks
        (per site: batch rows, positions, values) and the snapshots of kept boundaries ((request id, depth) -> row of
        the values, the values of each snapshot tensor)."""
        ends = self._ends()
        moved = []
        for site in self._sites:
            keep = (site.position < ends[site.row]) & site.mapped
            if keep.any():
                moved.append((site, keep))
        page = self.views.page_tokens
        kept = [p for p in self.publications
                if p.snapshot is not None and (p.depth + 1) * page <= ends[self.requests[p.rid].row]]
        # one copy of every index
        index = self._upload(*[x for site, keep in moved for x in (site.a[keep], site.b[keep])],
                             *([np.asarray([p.snapshot for p in kept])] if kept else []))
        entries = [(site, site.row[keep], site.position[keep], [view[:, a, b] for view in site.views])
                   for (site, keep), a, b in zip(moved, index[0::2], index[1::2])]
        values = [t.index_select(1, index[-1]) for t in self.views.snapshots] if kept else []
        return entries, ({(p.rid, p.depth): i for i, p in enumerate(kept)}, values)

    def restore(self, host_table: np.ndarray, block_table: torch.Tensor) -> None:
        """Put back every logged byte of a rejected token, of a mapped block and of a taken snapshot, and unmap the
        blocks the step mapped (the manager's tables; each request then holds its blocks from before the step)."""
        for entry in self.requests.values():
            request = entry.request
            if request.num_blocks > entry.held:
                host_table[request.slot, entry.held:request.num_blocks] = -1
                block_table[request.slot, entry.held:request.num_blocks] = -1
                request.num_blocks = entry.held
        ends = self._ends()
        masks = [(site.position >= ends[site.row]) | site.mapped for site in self._sites]
        sites = [(site, m) for site, m in zip(self._sites, masks) if m.any()]  # none when every token is kept
        # rows put back from some row to the last (every site of a one-request step: its rejected tokens, then its
        # mapped blocks, are its last) reuse the log's index and copies, sliced; other sites upload their rows
        first = {id(site): int(m.argmax()) for site, m in sites}
        part = [(site, m) for site, m in sites if not m[first[id(site)]:].all()]
        index = self._upload(*[x for site, m in part for x in (site.a[m], site.b[m], np.flatnonzero(m))])
        parts = {id(site): (a, b, i) for (site, _), a, b, i in zip(part, index[0::3], index[1::3], index[2::3])}
        for site, _ in sites:
            if id(site) in parts:
                a, b, i = parts[id(site)]
                for view, saved in zip(site.views, site.saved):
                    view[:, a, b] = saved.index_select(1, i)
            else:
                lo = first[id(site)]
                a, b = site.a_d[lo:], site.b_d[lo:]
                for view, saved in zip(site.views, site.saved):
                    view[:, a, b] = saved[:, lo:]
        self._put_back_blocks()
        if self._snapshot_log:
            ids = self._upload(np.asarray(self._snapshots))[0]
            for tensor, saved in zip(self.views.snapshots, self._snapshot_log):
                tensor.index_copy_(1, ids, saved)

    def place(self, entries: list, snapshots: tuple[dict, list], host_table: np.ndarray, kept: list[Publication]
              ) -> list[Publication]:
        """Write the bytes `set_aside` gathered where a plain step of the kept tokens puts them: entries at the slots
        of the blocks now mapped (host_table), snapshots at the ids of the publications `kept` queued. Returns the
        publications with a snapshot id but no bytes (a boundary the plan could not capture for want of snapshots:
        the caller gives their ids back)."""
        page = self.views.page_tokens
        slot = {entry.row: entry.request.slot for entry in self.requests.values()}
        where = []
        for site, row, position, _ in entries:
            ratio = page // site.views[0].shape[2]
            first = position + 1 - ratio  # the entry's first token
            block = host_table[np.array([slot[r] for r in row], dtype=np.int64), first // page]
            where += [block, (first % page) // ratio]
        rows, values = snapshots
        found = [(p, rows.get((p.rid, p.depth))) for p in kept if p.snapshot is not None]
        pairs = [(p.snapshot, i) for p, i in found if i is not None]
        if pairs:
            where += [np.asarray([d for d, _ in pairs]), np.asarray([i for _, i in pairs])]
        index = self._upload(*where)  # one copy of every index
        for (site, _, _, moved), a, b in zip(entries, index[0::2], index[1::2]):
            for view, value in zip(site.views, moved):
                view[:, a, b] = value
        if pairs:
            dst, src = index[-2:]
            for tensor, value in zip(self.views.snapshots, values):
                tensor.index_copy_(1, dst, value.index_select(1, src))
        return [p for p, i in found if i is None]

    def _ends(self) -> np.ndarray:
        """Each batch row's length once settled (start + kept)."""
        ends = np.zeros(len(self.requests), dtype=np.int64)
        for entry in self.requests.values():
            ends[entry.row] = entry.end
        return ends
