"""Tentative steps and `accept` (issue 38, the cache): after a verify step and its accept, the cache is bit-identical
to a twin cache fed only the kept tokens, and both give the same outputs from then on.

Two caches run one schedule: `spec` plans verify steps tentative (drafts whose rejected part carries wrong token ids)
and accepts a random prefix of each request's tokens; `twin` plans a plain step of the kept tokens only (none if none
is kept). Both run the real layers of the `tiny` preset (window, CSA m=4 with its indexer, HCA m=16, CSA; window 16;
FP8 entries, MXFP4 keys; 128-token blocks; NaN-poisoned pools) on the PyTorch reference and, smaller, on the Triton
kernels (the interpreter on a CPU). After every step and accept: every pool, state and snapshot byte (the scratch
snapshot row aside: padding rows' captures land there), both block tables, the allocator's reference counts and free
queue, the slots, every request's length, blocks, token ids and prefix chain, the prefix index (blocks by content,
snapshot ids and their LRU order) and every counter are equal; every plain step's outputs are equal bit for bit.

Why the layers see exact inputs: a GEMM rounds by its shape, so a kept token's kv computed in a (k+1)-row verify step
may differ in the last bit from the same token in a plain step of fewer rows. Here the weights and the token
embeddings are multiples of 1/64 and 1/8 (small numerators): every product and sum of the projections that feed the
cache is exact in fp32, so the bytes a token writes do not depend on its step's shape, and each layer is fed the
embedding (no residual stream, whose attention outputs are not exact). What is compared is then the cache's own work.
"""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch

from dsv4kv import CacheManager, StepPlan
from dsv4kv.cache import NoRoom
from dsv4kv.cache.manager import RequestError
from dsv4kv.geometry import ModelGeometry
from dsv4kv.model.layer import DSV4Attention, init_random_weights

G = ModelGeometry.preset("tiny")
P = 128  # page_tokens
VOCAB = 512
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# --- the model: each layer over the token embeddings, exact projections -------------------------------------------
@functools.lru_cache(maxsize=None)
def model(backend: str, device: str) -> tuple[torch.Tensor, tuple[DSV4Attention, ...]]:
    layers = []
    for i in range(G.num_layers):
        layer = init_random_weights(DSV4Attention(G, i, device=device, backend=backend), seed=20 + i)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if p.dim() == 2 and "position_bias" not in name:
                    p.copy_((p.float() * 64).round() / 64)
        layers.append(layer)
    embedding = torch.randn(VOCAB, G.hidden_size, generator=torch.Generator().manual_seed(7))
    return (embedding * 8).round().div(8).to(torch.bfloat16).to(device), tuple(layers)


def run_layers(cache: CacheManager, plan: StepPlan, ids: list[int], backend: str) -> torch.Tensor:
    """Every layer over the plan, each fed the tokens' embeddings -> [layers, N, hidden]."""
    embedding, layers = model(backend, str(cache.device))
    x = embedding[torch.tensor(ids, device=cache.device)]
    return torch.stack([layer(x, plan, cache) for layer in layers])


# --- the state compared ----------------------------------------------------------------------------------------
def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def state(cache: CacheManager) -> dict:
    """Everything a cache holds, on the host (the scratch snapshot row left out)."""
    out = {}
    for i, layer in enumerate(cache.pools.layers):
        for name in ("window", "entries", "index_keys", "state_kv", "state_score", "index_state_kv",
                     "index_state_score", "boundary_window", "boundary_kv", "boundary_score", "boundary_index_kv",
                     "boundary_index_score"):
            t = getattr(layer, name)
            if t is not None:
                out[f"{i}.{name}"] = bits(t[:-1] if name.startswith("boundary") else t).cpu()
    out["block_table"] = cache.block_table.cpu()
    out["host_table"] = cache._host_table.copy()
    alloc = cache.allocator
    out["allocator"] = ([alloc.refcount(b) for b in range(cache.num_blocks)], alloc.free_order())
    out["slots"] = list(cache._free_slots)
    out["requests"] = {rid: (r.slot, r.length, r.num_blocks, r.cached, r.publishing,
                             None if r.tokens is None else r.tokens[:].tolist(), [n.block for n in r.nodes])
                       for rid, r in cache._requests.items()}
    out["swapped"] = (sorted(cache._swapped), cache.bytes_swapped)
    out["counters"] = (cache.num_free_blocks, cache.num_used_blocks, cache.tokens_held, cache.num_live_requests,
                       cache.bytes_used, cache._next_rid)
    if cache.prefix is not None:
        prefix = cache.prefix
        out["prefix"] = (
            {n.block: (n.depth, n.tokens.tolist(), n.snapshot, n.parent.block if n.parent else None,
                       [c.block for c in n.children]) for n in prefix.cached_blocks()},
            [(s, n.block) for s, n in prefix._snapshot_lru.items()], list(prefix._free_snapshots),
            prefix.stats.as_dict(),
            [(p.rid, p.depth, p.block, p.snapshot) for p in cache._pending])
    return out


def assert_same(a: CacheManager, b: CacheManager, where: str) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        x, y = sa[key], sb[key]
        if isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                rows = (x != y).reshape(x.shape[0], -1).any(1).nonzero().flatten().tolist()
                raise AssertionError(f"{where}: {key} differs in rows {rows[:8]}")
        elif isinstance(x, np.ndarray):
            assert np.array_equal(x, y), f"{where}: {key} differs"
        else:
            assert x == y, f"{where}: {key} differs:\n{x}\n{y}"


# --- the two caches, one schedule -------------------------------------------------------------------------------
class Twins:
    """`spec` speculates, `twin` is fed only what `spec` keeps. Each request has a true token stream; a verify step
    feeds its next tokens, the rejected ones replaced by wrong ids."""

    def __init__(self, backend="torch", device="cpu", *, prefix_caching=False, seed=0, **kw):
        kw = dict(max_requests=3, max_tokens=1200, page_tokens=P, poison=True, device=device,
                  prefix_caching=prefix_caching, **kw)
        self.spec, self.twin = CacheManager(G, **kw), CacheManager(G, **kw)
        self.backend = backend
        self.rng = random.Random(seed)
        self.streams: dict[int, list[int]] = {}  # request id -> its true tokens (prompt, then what it generates)
        self.prompt: dict[int, int] = {}
        self.steps = 0

    @property
    def prefix(self) -> bool:
        return self.spec.prefix is not None

    def admit(self, prompt: list[int], generated: int = 400) -> int | None:
        tokens = prompt if self.prefix else None
        rid = self.spec.admit(tokens)
        assert self.twin.admit(tokens) == rid
        if rid is not None:
            self.streams[rid] = list(prompt) + [self.rng.randrange(VOCAB) for _ in range(generated)]
            self.prompt[rid] = len(prompt)
        return rid

    def _ids(self, cache: CacheManager, rid: int, ids: list[int]) -> None:
        """With prefix caching, tell `cache` the ids fed next beyond those it knows."""
        if self.prefix:
            request = cache._requests[rid]
            known, start = request.tokens.n, request.length
            if start + len(ids) > known:
                cache.append_tokens(rid, ids[known - start:])

    def plain(self, batch: list[tuple[int, int]]) -> None:
        """A plain step in both; their outputs must be equal."""
        outs = []
        for cache in (self.spec, self.twin):
            ids = []
            for rid, n in batch:
                start = cache.length(rid)
                self._ids(cache, rid, self.streams[rid][start:start + n])
                ids += self.streams[rid][start:start + n]
            plan = cache.plan_step(batch)
            assert isinstance(plan, StepPlan), plan
            outs.append(run_layers(cache, plan, ids, self.backend))
        assert torch.isfinite(outs[0]).all(), "a poisoned byte was read"
        assert torch.equal(bits(outs[0]), bits(outs[1])), f"step {self.steps}: outputs differ"
        self.steps += 1
        assert_same(self.spec, self.twin, f"after plain step {self.steps}")

    def verify(self, batch: list[tuple[int, int, int]], *, order=None, release=(), buffers=None, graph=None) -> None:
        """batch: (request, tokens, kept). `spec` plans all of them tentative, runs the layers, accepts `kept` (in
        `order` of batch rows; releases the requests in `release` instead); `twin` plans the kept ones plainly."""
        ids, fed = [], {}
        for rid, n, keep in batch:
            start = self.spec.length(rid)
            true = self.streams[rid][start:start + n]
            wrong = [(t + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB for t in true[keep:]]  # never the true id
            fed[rid] = true[:keep] + wrong if start + n > self.prompt[rid] else true
            self._ids(self.spec, rid, fed[rid])
            ids += fed[rid]
        plan = self.spec.plan_step([(rid, n) for rid, n, _ in batch], tentative=True, buffers=buffers)
        assert isinstance(plan, StepPlan) and plan.tentative, plan
        if graph is not None:
            graph(plan, ids)
        else:
            run_layers(self.spec, plan, ids, self.backend)
        rows = list(order) if order is not None else list(range(len(batch)))
        for b in rows:
            rid, n, keep = batch[b]
            if rid in release:
                self.spec.release(rid)
            else:
                assert self.spec.awaiting_accept(), "the step settled before its last accept"
                self.spec.accept(rid, keep)
        assert not self.spec.awaiting_accept()
        kept = [(rid, keep) for rid, _, keep in batch if keep and rid not in release]
        kept_ids = [t for rid, _, keep in batch if keep and rid not in release for t in fed[rid][:keep]]
        if kept:
            for rid, keep in kept:
                start = self.twin.length(rid)
                self._ids(self.twin, rid, self.streams[rid][start:start + keep])
            plan = self.twin.plan_step(kept)
            assert isinstance(plan, StepPlan), plan
            run_layers(self.twin, plan, kept_ids, self.backend)
        for rid in release:
            self.twin.release(rid)
            del self.streams[rid]
        self.steps += 1
        assert_same(self.spec, self.twin, f"after verify step {self.steps} {batch}")

    def release(self, rid: int) -> None:
        self.spec.release(rid)
        self.twin.release(rid)
        del self.streams[rid]
        assert_same(self.spec, self.twin, f"after release of {rid}")

    def swap(self, rid: int) -> None:
        for cache in (self.spec, self.twin):
            assert not isinstance(cache.swap_out(rid), NoRoom)
        assert_same(self.spec, self.twin, f"after swap_out of {rid}")
        for cache in (self.spec, self.twin):
            assert not isinstance(cache.swap_in(rid), NoRoom)
        assert_same(self.spec, self.twin, f"after swap_in of {rid}")


def random_schedule(t: Twins, steps: int, prompts, *, max_draft=8) -> None:
    """Admissions, prefill chunks (plain, or in a verify step, kept whole), verify steps of 1..max_draft tokens per
    decoding request with a random kept count (whole requests released mid-verify now and then), releases, swaps."""
    rng = t.rng
    pending_prompts = list(prompts)
    for _ in range(steps):
        if pending_prompts and len(t.streams) < t.spec.max_requests and rng.random() < 0.5:
            t.admit(pending_prompts.pop(0))
            continue
        live = [rid for rid in t.streams if t.spec.is_live(rid)]
        if not live:
            continue
        roll = rng.random()
        if roll < 0.05 and len(live) > 1:
            t.release(rng.choice(live))
            continue
        if roll < 0.1:
            t.swap(rng.choice(live))
            continue
        batch, plain = [], roll < 0.3
        for rid in rng.sample(live, rng.randint(1, len(live))):
            length, prompt = t.spec.length(rid), t.prompt[rid]
            room = min(len(t.streams[rid]) - length, t.spec.max_seq_len - length)
            if room <= 0:
                continue
            if length < prompt:  # prefill: a chunk, kept whole
                n = min(prompt - length, rng.choice([5, 37, 100, 128, 200]), room)
                batch.append((rid, n, n))
            else:
                n = min(rng.randint(1, max_draft), room)
                batch.append((rid, n, n if plain else rng.randint(0, n)))
        if not batch:
            continue
        if plain:
            t.plain([(rid, n) for rid, n, _ in batch])
            continue
        order = list(range(len(batch)))
        rng.shuffle(order)
        decoding = [rid for rid, n, keep in batch if t.spec.length(rid) >= t.prompt[rid]]
        release = [rng.choice(decoding)] if decoding and len(live) > 1 and rng.random() < 0.08 else []
        t.verify(batch, order=order, release=release)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


# --- schedules -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [1, 2])
def test_random_schedule_equals_the_twin_fed_only_kept_tokens(seed):
    t = Twins(seed=seed)
    random_schedule(t, 60, [tokens(seed * 10 + i, n) for i, n in enumerate((37, 140, 5, 260, 99))])


@pytest.mark.parametrize("seed", [3, 4])
def test_random_schedule_with_prefix_caching(seed):
    """Shared prompts of every length around the page: boundaries crossed by kept and by rejected tokens, hits."""
    system = tokens(seed, 250)
    prompts = [system[:n] + tokens(seed * 10 + i, extra) for i, (n, extra) in
               enumerate(((128, 9), (250, 0), (127, 3), (250, 6), (128, 0), (60, 70)))]
    t = Twins(seed=seed, prefix_caching=True, prefix_snapshots=4)
    random_schedule(t, 70, prompts)
    assert t.spec.prefix_stats.hits > 0
