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
import json
import random
from importlib import resources

import numpy as np
import pytest
import torch

from dsv4kv import CacheManager, StepPlan
from dsv4kv.cache import NoRoom
from dsv4kv.cache.manager import RequestError
from dsv4kv.cache.plan import StepBuffers
from dsv4kv.cache.rollback import TentativeStep
from dsv4kv.geometry import ModelGeometry
from dsv4kv.model.graph import CapturedStep
from dsv4kv.model.layer import DSV4Attention, init_random_weights

from prefix_sim import check_invariants

G = ModelGeometry.preset("tiny")  # window, CSA m=4, HCA m=16, CSA; window 16: max_tentative_tokens 8 (the CSA ring)
# the interpreter's geometry: one layer of each kind, 2 heads (the interpreter's time goes with the kernels' work)
SMALL = ModelGeometry.from_hf_config({
    **json.loads(resources.files("dsv4kv.presets").joinpath("tiny.json").read_text()),
    "num_hidden_layers": 3, "num_attention_heads": 2, "o_groups": 1, "index_n_heads": 2,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]})
P = 128  # page_tokens
VOCAB = 512
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def exact_gemms():
    """cuBLAS's bf16 GEMMs sum in fp32 (by default they may reduce split sums in bf16): the projections stay exact."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    yield
    matmul.allow_bf16_reduced_precision_reduction = before


# --- the model: each layer over the token embeddings, exact projections -------------------------------------------
@functools.lru_cache(maxsize=None)
def model(backend: str, device: str, geometry: ModelGeometry = G) -> tuple[torch.Tensor, tuple[DSV4Attention, ...]]:
    layers = []
    for i in range(geometry.num_layers):
        layer = init_random_weights(DSV4Attention(geometry, i, device=device, backend=backend), seed=20 + i)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if p.dim() == 2 and "position_bias" not in name:
                    p.copy_((p.float() * 64).round() / 64)
        layers.append(layer)
    embedding = torch.randn(VOCAB, geometry.hidden_size, generator=torch.Generator().manual_seed(7))
    return (embedding * 8).round().div(8).to(torch.bfloat16).to(device), tuple(layers)


def run_layers(cache: CacheManager, plan: StepPlan, ids: list[int], backend: str) -> torch.Tensor:
    """Every layer over the plan, each fed the tokens' embeddings -> [layers, N, hidden]."""
    embedding, layers = model(backend, str(cache.device), cache.geometry)
    x = embedding[torch.tensor(ids, device=cache.device)]
    return torch.stack([layer(x, plan, cache) for layer in layers])


class GraphVerify:
    """Verify steps of up to `batch` requests x `width` tokens over persistent buffers, run through a CUDA graph
    (`CapturedStep`: eager, then captured, then replayed): the layers' kernels, padding rows included."""

    def __init__(self, cache: CacheManager, *, batch: int, width: int):
        self.cache, self.width = cache, width
        self.buffers = cache.step_buffers(max_tokens=batch * width, max_requests=batch, max_seq_len=1024)
        self.embedding, self.layers = model("triton", str(cache.device), cache.geometry)
        self.x = torch.zeros(batch * width, cache.geometry.hidden_size, dtype=torch.bfloat16, device=cache.device)
        self.captured = CapturedStep(capture=cache.device.type == "cuda")

    def fits(self, counts: list[int]) -> bool:
        return len(counts) * self.width <= self.x.shape[0] and max(counts) <= self.width

    def __call__(self, plan: StepPlan, ids: list[int]) -> None:
        self.x.zero_()
        self.x[:len(ids)] = self.embedding[torch.tensor(ids, device=self.cache.device)]
        self.captured.run(lambda: torch.stack([layer(self.x, plan, self.cache) for layer in self.layers]), plan,
                          [layer.layer_index for layer in self.layers])


# --- the state compared ----------------------------------------------------------------------------------------
def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def state(cache: CacheManager) -> dict:
    """Everything a cache holds, on the host (the scratch snapshot row left out), as its public calls see it: they
    first publish what the latest plan filled once its layers ran (a twin that kept nothing planned nothing, so its
    previous plan's blocks wait for that call, where `spec` published them when it planned the tentative step)."""
    cache.num_cached_blocks  # settles
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

    def __init__(self, backend="torch", device="cpu", *, geometry=G, prefix_caching=False, seed=0, **kw):
        kw = {"max_requests": 3, "max_tokens": 1200, "page_tokens": P, "poison": True, "device": device,
              "prefix_caching": prefix_caching, **kw}
        self.spec, self.twin = CacheManager(geometry, **kw), CacheManager(geometry, **kw)
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

    def verify(self, batch: list[tuple[int, int, int]], *, order=None, release=(), graph: GraphVerify | None = None
               ) -> None:
        """batch: (request, tokens, kept). `spec` plans all of them tentative, runs the layers (through `graph` if
        given and the step fits), accepts `kept` (in `order` of batch rows; releases the requests in `release`
        instead); `twin` plans the kept ones plainly."""
        ids, fed = [], {}
        for rid, n, keep in batch:
            start = self.spec.length(rid)
            true = self.streams[rid][start:start + n]
            wrong = [(t + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB for t in true[keep:]]  # never the true id
            fed[rid] = true[:keep] + wrong if start + n > self.prompt[rid] else true
            self._ids(self.spec, rid, fed[rid])
            ids += fed[rid]
        graph = graph if graph is not None and graph.fits([n for _, n, _ in batch]) else None
        plan = self.spec.plan_step([(rid, n) for rid, n, _ in batch], tentative=True,
                                   buffers=graph.buffers if graph is not None else None)
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


def random_schedule(t: Twins, steps: int, prompts, *, max_draft=8, graph: GraphVerify | None = None,
                    mixed: bool = True) -> None:
    """Admissions, prefill chunks (plain, or with `mixed` in a verify step and kept whole), verify steps of
    1..max_draft tokens per decoding request with a random kept count (now and then a request released mid-verify),
    releases, swaps."""
    rng = t.rng
    waiting = list(prompts)
    for _ in range(steps):
        if waiting and len(t.streams) < t.spec.max_requests and rng.random() < 0.5:
            t.admit(waiting.pop(0))
            continue
        live = list(t.streams)
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
                if not (plain or mixed):
                    continue
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
        decoding = [rid for rid, _, _ in batch if t.spec.length(rid) >= t.prompt[rid]]
        release = [rng.choice(decoding)] if decoding and len(live) > 1 and rng.random() < 0.08 else []
        t.verify(batch, order=order, release=release, graph=graph)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def prefix_prompts(seed: int) -> list[list[int]]:
    """Prompts sharing a 250-token system prompt at 60, 127, 128 and 250 tokens (hits at 128), odd lengths."""
    system = tokens(seed, 250)
    return [system[:n] + tokens(seed * 10 + i, extra) for i, (n, extra) in
            enumerate(((128, 9), (250, 0), (127, 3), (250, 6), (128, 0), (60, 70)))]


# --- random schedules -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_schedule_equals_the_twin_fed_only_kept_tokens(seed):
    t = Twins(seed=seed)
    random_schedule(t, 70, [tokens(seed * 10 + i, n) for i, n in enumerate((37, 140, 5, 260, 99))])


@pytest.mark.parametrize("seed", [4, 5, 8])
def test_random_schedule_with_prefix_caching(seed):
    """Boundaries crossed by kept and by rejected tokens, prompts of every length around the page, hits, few
    snapshots (evicted least recently used)."""
    t = Twins(seed=seed, prefix_caching=True, prefix_snapshots=3)
    random_schedule(t, 80, prefix_prompts(seed))
    assert t.spec.prefix_stats.hits > 0 and t.spec.prefix_stats.snapshots_evicted > 0


@pytest.mark.parametrize("kv_format,indexer_format", [("bf16", "bf16"), ("fp8", "fp8")])
def test_random_schedule_in_the_other_formats(kv_format, indexer_format):
    t = Twins(seed=6, prefix_caching=True, prefix_snapshots=2, kv_format=kv_format, indexer_format=indexer_format)
    random_schedule(t, 50, prefix_prompts(6))


# --- the cases by name ------------------------------------------------------------------------------------------
def test_window_wrap_and_compressor_groups_completed_by_rejected_tokens():
    """Tokens 13..20 straddle the window ring's wrap (16) and complete CSA entries 3 and 4 and HCA entry 0; keeping
    2, 0, then all of such steps leaves the rings, entries and keys of the twin."""
    t = Twins(seed=5)
    a, b = t.admit(tokens(1, 13)), t.admit(tokens(2, 30))
    t.plain([(a, 13), (b, 30)])
    t.verify([(a, 8, 2), (b, 8, 7)])  # a: 13..20, keeps 13, 14; b: 30..37, keeps 30..36
    t.verify([(a, 8, 0), (b, 2, 2)])
    t.verify([(a, 8, 8), (b, 8, 1)])
    t.verify([(a, 1, 1)])
    t.plain([(a, 1), (b, 1)])
    assert t.spec.length(a) == 25 and t.spec.length(b) == 41


def test_boundaries_crossed_by_kept_and_by_rejected_tokens_and_hits_at_every_page():
    """A request decodes speculatively across 128, 256 and 384, each boundary first crossed by rejected tokens only
    (nothing published), then by kept ones (published, its snapshot the twin's); prompts ending past each boundary
    then hit it and go on bit for bit."""
    t = Twins(seed=6, prefix_caching=True, max_tokens=1600)
    a = t.admit(tokens(3, 123))
    t.plain([(a, 123)])
    for boundary in (128, 256, 384):
        t.plain([(a, boundary - 3 - t.spec.length(a))])
        t.verify([(a, 8, 2)])  # rejected tokens cross the boundary
        assert t.spec.num_cached_blocks == boundary // P - 1
        t.verify([(a, 8, 3)])  # kept tokens cross it
        assert t.spec.num_cached_blocks == boundary // P and t.spec.num_snapshots == boundary // P
    stream = t.streams[a]
    for pages, extra in ((1, 1), (2, 77), (3, 5)):
        rid = t.admit(stream[:pages * P + extra])
        assert t.spec.cached_tokens(rid) == pages * P
        t.plain([(rid, extra)])
        t.verify([(rid, 4, 2)])
        t.release(rid)


def test_two_requests_crossing_a_boundary_in_one_step_get_the_twins_blocks():
    """Both cross 128; the first keeps none of its crossing, the second keeps its: the second takes the block the
    twin gives it (the first free one, which the step had mapped to the first), and the free queue is the twin's."""
    t = Twins(seed=12, prefix_caching=True)
    a, b = t.admit(tokens(14, 126)), t.admit(tokens(15, 125))
    t.plain([(a, 126), (b, 125)])
    t.verify([(a, 8, 1), (b, 8, 6)], order=[1, 0])
    assert t.spec.blocks(b)[1] == t.twin.blocks(b)[1] and t.spec.num_cached_blocks == 1
    t.verify([(a, 8, 8), (b, 4, 4)])
    t.plain([(a, 1), (b, 1)])


def test_a_cached_block_the_step_maps_stays_cached_unless_kept_tokens_need_it():
    """The only free block is a cached one nobody holds: a step crossing a boundary maps it; rejected, the block keeps
    its bytes and its place in the prefix cache (a later prompt hits it); kept, it is evicted as the twin evicts it."""
    t = Twins(seed=13, prefix_caching=True, num_blocks=3)
    first = tokens(16, 200)
    a = t.admit(first)
    t.plain([(a, 200)])
    t.release(a)  # block 0 cached, free at the back of the queue
    b, c = t.admit(tokens(17, 125)), t.admit(tokens(18, 100))
    t.plain([(b, 125), (c, 100)])
    assert t.spec.num_free_blocks == 1 and t.spec.num_evictable_blocks == 1
    t.verify([(b, 8, 2), (c, 8, 8)])  # maps the cached block, keeps none of it
    assert t.spec.num_cached_blocks == 1 and t.spec.prefix_stats.evicted_blocks == 0
    t.release(c)
    d = t.admit(first[:128] + tokens(19, 4))
    assert t.spec.cached_tokens(d) == 128
    t.plain([(d, 4)])
    t.release(d)
    t.verify([(b, 8, 5)])  # keeps its crossing: takes a block as the twin does
    assert t.spec.prefix_stats.evicted_blocks == t.twin.prefix_stats.evicted_blocks


def test_nothing_is_published_before_the_accept():
    """Reading calls while a step that crosses a boundary awaits accept publish nothing; the rejected crossing is
    never published."""
    t = Twins(seed=14, prefix_caching=True)
    prompt = tokens(20, 125)
    a = t.admit(prompt)
    t.plain([(a, 125)])
    t.spec.append_tokens(a, tokens(21, 6))
    plan = t.spec.plan_step([(a, 6)], tentative=True)
    run_layers(t.spec, plan, tokens(21, 6), "torch")
    assert t.spec.num_cached_blocks == 0 and t.spec.lookup(prompt[:120] + tokens(21, 6) + [1]) == 0
    assert t.spec.prefix_stats.published_blocks == 0
    t.spec.accept(a, 2)
    assert t.spec.num_cached_blocks == 0 and t.spec.prefix_stats.published_blocks == 0
    t.spec.release(a)


def test_snapshots_running_short_in_a_step():
    """One snapshot for two boundaries in one step: the plan captures the later request's (rejected) crossing and not
    the earlier one's (kept); the kept block is published without a snapshot (a plain step of the kept tokens would
    have captured it), every id and reference stays accounted for, and the requests go on reading their own rows."""
    t = Twins(seed=15, prefix_caching=True, prefix_snapshots=1)
    a, b = t.admit(tokens(22, 126)), t.admit(tokens(23, 125))
    t.plain([(a, 126), (b, 125)])
    spec = t.spec
    ids = [t.streams[a][126:134], t.streams[b][125:133]]
    for rid, fed in zip((a, b), ids):
        spec.append_tokens(rid, fed)
    plan = spec.plan_step([(a, 8), (b, 8)], tentative=True)
    run_layers(spec, plan, ids[0] + ids[1], "torch")
    spec.accept(a, 5)
    spec.accept(b, 1)
    assert spec.num_cached_blocks == 1 and spec.num_snapshots == 0
    (node,) = spec.prefix.cached_blocks()
    assert node.block == spec.blocks(a)[0] and node.snapshot is None
    check_invariants(spec)
    spec.append_tokens(a, t.streams[a][131:132])
    spec.append_tokens(b, t.streams[b][126:127])
    plan = spec.plan_step([(a, 1), (b, 1)])
    assert torch.isfinite(run_layers(spec, plan, t.streams[a][131:132] + t.streams[b][126:127], "torch")).all()
    check_invariants(spec)


def test_release_mid_verify_frees_everything():
    """A request released before its accept leaves as if it had not been in the step; releasing every request of
    a step settles it without any accept."""
    t = Twins(seed=7, prefix_caching=True)
    a, b, c = t.admit(tokens(4, 126)), t.admit(tokens(5, 40)), t.admit(tokens(6, 20))
    t.plain([(a, 126), (b, 40), (c, 20)])
    t.verify([(a, 8, 5), (b, 6, 1), (c, 3, 3)], order=[2, 1, 0], release=[a])  # a crosses 128
    assert not t.spec.is_live(a) and t.spec.num_free_blocks == t.twin.num_free_blocks
    t.verify([(b, 8, 2), (c, 8, 8)], release=[b, c])
    assert t.spec.num_live_requests == 0 and t.spec.num_used_blocks == 0


def test_a_prefill_chunk_in_a_verify_step_is_kept_whole():
    """A request bringing more than max_tentative_tokens keeps all or none: a partial accept is refused."""
    t = Twins(seed=8)
    a, b = t.admit(tokens(7, 60)), t.admit(tokens(8, 9))
    t.plain([(b, 9)])
    assert t.spec.max_tentative_tokens == 8
    plan = t.spec.plan_step([(a, 37), (b, 5)], tentative=True)
    run_layers(t.spec, plan, t.streams[a][:37] + t.streams[b][9:14], "torch")
    with pytest.raises(ValueError, match="keeps all or none"):
        t.spec.accept(a, 9)
    t.spec.accept(a, 37)
    t.spec.accept(b, 4)
    plan = t.twin.plan_step([(a, 37), (b, 4)])
    run_layers(t.twin, plan, t.streams[a][:37] + t.streams[b][9:13], "torch")
    assert_same(t.spec, t.twin, "after a kept chunk")
    t.verify([(a, 23, 0), (b, 3, 3)])  # none of a chunk
    t.plain([(a, 23), (b, 1)])


def test_swap_after_accept():
    t = Twins(seed=9, prefix_caching=True)
    a = t.admit(tokens(9, 130))
    t.plain([(a, 130)])
    b = t.admit(tokens(9, 128) + tokens(10, 3))
    assert t.spec.cached_tokens(b) == 128
    t.verify([(a, 6, 2), (b, 3, 3)])
    t.swap(a)
    t.verify([(a, 8, 5), (b, 8, 3)])
    t.swap(b)
    t.plain([(a, 1), (b, 1)])


# --- bad input ------------------------------------------------------------------------------------------------
def pending_step(prefix_caching=False):
    """A cache with a tentative step awaiting accept: a (4 tokens) and b (2 tokens) in it, c outside it, d swapped."""
    cache = CacheManager(G, max_requests=4, max_tokens=600, page_tokens=P, poison=True, prefix_caching=prefix_caching)
    ids = tokens(11, 40)
    rids = [cache.admit(ids if prefix_caching else None) for _ in range(4)]
    plan = cache.plan_step([(rid, 30) for rid in rids])
    run_layers(cache, plan, ids[:30] * 4, "torch")
    assert cache.swap_out(rids[3])
    plan = cache.plan_step([(rids[0], 4), (rids[1], 2)], tentative=True)
    run_layers(cache, plan, ids[30:34] + ids[30:32], "torch")
    return cache, rids


def test_bad_accepts_raise_and_change_nothing():
    cache, (a, b, c, d) = pending_step()
    before = state(cache)
    for rid, n, error, says in [
        (99, 1, RequestError, "unknown"), ("a", 1, RequestError, "unknown"), (c, 1, RequestError, "no tentative"),
        (d, 1, RequestError, "swapped out"), (a, -1, ValueError, "cannot keep -1"), (a, 5, ValueError, "cannot keep 5"),
        (a, 1.0, ValueError, "must be an int"), (a, True, ValueError, "must be an int"), (a, "1", ValueError, "int"),
        (a, None, ValueError, "int")]:
        with pytest.raises(error, match=says):
            cache.accept(rid, n)
        assert_same_state(cache, before)
        assert cache.awaiting_accept() == [a, b]
    cache.accept(a, 4)
    with pytest.raises(RequestError, match="no tentative"):
        cache.accept(a, 4)  # twice
    cache.accept(b, 0)
    assert cache.awaiting_accept() == [] and cache.length(a) == 34 and cache.length(b) == 30
    with pytest.raises(RequestError, match="no tentative"):
        cache.accept(a, 0)  # no step pending
    with pytest.raises(ValueError, match="tentative: expected a bool"):
        cache.plan_step([(a, 1)], tentative=1)
    before = state(cache)
    short = cache.plan_step([(a, 8), (b, 8), (c, 850)], tentative=True)
    assert not short and short.needed > short.free  # OutOfBlocks: nothing changed, nothing awaits accept
    assert_same_state(cache, before)
    assert cache.awaiting_accept() == []


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_other_calls_wait_for_the_accept(prefix_caching):
    """While the step awaits accept, anything that would take blocks or slots, or move a request of the step, is
    refused with nothing changed; reading calls and another request's export work."""
    cache, (a, b, c, d) = pending_step(prefix_caching)
    before = state(cache)
    other = CacheManager(G, max_requests=2, max_tokens=300, page_tokens=P)
    moved = other.export_request(other.admit())
    calls = [lambda: cache.plan_step([(c, 1)]), lambda: cache.plan_step([(a, 1)], tentative=True),
             lambda: cache.admit(), lambda: cache.swap_out(c), lambda: cache.swap_out(a), lambda: cache.swap_in(d),
             lambda: cache.export_request(a), lambda: cache.import_request(moved),
             lambda: cache.append_tokens(a, [1])]
    for call in calls:
        with pytest.raises(RequestError, match="awaits accept"):
            call()
        assert_same_state(cache, before)
    assert cache.export_request(c).length == 30
    cache.lookup(tokens(11, 40))
    assert cache.swap_in_blocks(d) >= 0
    assert_same_state(cache, before)
    cache.accept(a, 1)
    with pytest.raises(RequestError, match="awaits accept"):
        cache.export_request(a)  # accepted, but its bytes settle with b's accept
    cache.accept(b, 2)
    assert cache.export_request(a).length == 31
    assert cache.plan_step([(c, 1)])


def assert_same_state(cache: CacheManager, before: dict) -> None:
    after = state(cache)
    for key in before:
        x, y = before[key], after[key]
        same = (torch.equal(x, y) if isinstance(x, torch.Tensor) else np.array_equal(x, y)
                if isinstance(x, np.ndarray) else x == y)
        assert same, f"{key} changed"


# --- the kernels ------------------------------------------------------------------------------------------------
def test_kernels_over_persistent_buffers(exact_gemms):
    """The Triton kernels (under the interpreter on a CPU) over persistent buffers with padding rows (on a GPU
    replayed from a CUDA graph): a boundary crossed by rejected then by kept tokens, a window wrap, compressor groups
    completed by rejected tokens, a request released mid-verify; the prefill on the reference (the same bytes in both
    caches)."""
    t = Twins(geometry=SMALL, prefix_caching=True, seed=10, device="cuda" if torch.cuda.is_available() else "cpu")
    a, b = t.admit(tokens(12, 125)), t.admit(tokens(13, 7))
    t.plain([(a, 125), (b, 7)])
    t.backend = "triton"
    graph = GraphVerify(t.spec, batch=2, width=8)
    t.verify([(a, 8, 2), (b, 8, 8)], order=[1, 0], graph=graph)  # a: 125..132, keeps 2: 128 crossed by rejected
    assert t.spec.num_cached_blocks == 0
    t.verify([(a, 8, 5), (b, 3, 1)], release=[b], graph=graph)
    assert t.spec.num_cached_blocks == 1
    t.plain([(a, 1)])


@cuda
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_cuda_schedules_with_captured_verify_steps(prefix_caching, exact_gemms):
    """The random schedules on the GPU's kernels, verify steps of up to 3 requests x 8 tokens replayed from one CUDA
    graph (captured on the second), the others eager. Prefill chunks go in plain steps only: the HCA pooling kernel
    picks its tile by the step's entry count, so a chunk's entries beside a verify step's rejected ones could round
    differently from the twin's (as a GEMM rounds by its shape), which is not the cache's doing."""
    t = Twins("triton", "cuda", seed=11, prefix_caching=prefix_caching, prefix_snapshots=3 if prefix_caching else None)
    graph = GraphVerify(t.spec, batch=3, width=8)
    prompts = prefix_prompts(11) if prefix_caching else [tokens(110 + i, n) for i, n in enumerate((37, 140, 5, 260))]
    random_schedule(t, 120, prompts, graph=graph, mixed=False)
    assert graph.captured.graph is not None and graph.captured.steps > 3


# --- faults (a device out of memory) ----------------------------------------------------------------------------
def injected(*args, **kwargs):
    raise RuntimeError("CUDA out of memory (injected)")


def failing_after(original):
    """`original`, then the injected fault: a fault after its writes landed."""
    def call(*args, **kwargs):
        original(*args, **kwargs)
        injected()
    return call


def crossing_pair(t: Twins) -> tuple[int, int]:
    """a at 126 tokens (a verify step of 8 crosses the first boundary, its snapshot copies window rows from before
    the step), b at 40."""
    a, b = t.admit(tokens(24, 126)), t.admit(tokens(25, 40))
    t.plain([(a, 126), (b, 40)])
    for rid, n in ((a, 8), (b, 5)):
        start = t.spec.length(rid)
        t._ids(t.spec, rid, t.streams[rid][start:start + n])
    return a, b


@pytest.mark.parametrize("prefix_caching,where", [
    (False, "log"), (False, "buffers"), (True, "log"), (True, "snapshot-copy"), (True, "buffers")])
def test_a_fault_while_planning_a_tentative_step_changes_nothing(monkeypatch, prefix_caching, where):
    """The undo log's gathers, a boundary snapshot's copy (after its bytes landed) or the plan's buffers raising:
    the error propagates and every byte, table, length, reference, snapshot and queued publication is as before;
    nothing awaits accept, and the cache goes on equal to its twin (no block handed to two requests)."""
    t = Twins(seed=16, prefix_caching=prefix_caching)
    a, b = crossing_pair(t)
    spec = t.spec
    before = state(spec)
    with monkeypatch.context() as patch:
        if where == "log":
            patch.setattr(TentativeStep, "_record", injected)
        elif where == "snapshot-copy":
            patch.setattr(spec.pools, "copy_to_snapshot", failing_after(spec.pools.copy_to_snapshot))
        else:
            patch.setattr(StepBuffers, "load", injected)
        with pytest.raises(RuntimeError, match="injected"):
            spec.plan_step([(a, 8), (b, 5)], tentative=True)
    assert_same_state(spec, before)
    assert spec.awaiting_accept() == []
    check_invariants(spec)
    t.verify([(a, 8, 5), (b, 5, 2)])
    c = t.admit(tokens(26, 30))
    t.plain([(c, 30), (a, 1)])
    check_invariants(spec)


@pytest.mark.parametrize("prefix_caching,where", [
    (False, "set_aside"), (False, "restore"), (True, "set_aside"), (True, "restore")])
def test_a_settle_that_raises_is_retried_by_the_next_call(monkeypatch, prefix_caching, where):
    """The last accept's settle raising while it gathers the kept bytes or puts the logged ones back (after they
    landed): the step stays unsettled, the next call settles it, and the cache equals its twin fed the kept tokens."""
    t = Twins(seed=17, prefix_caching=prefix_caching)
    a, b = crossing_pair(t)
    spec, twin = t.spec, t.twin
    plan = spec.plan_step([(a, 8), (b, 5)], tentative=True)
    run_layers(spec, plan, t.streams[a][126:134] + t.streams[b][40:45], "torch")
    spec.accept(a, 5)
    with monkeypatch.context() as patch:
        original = getattr(TentativeStep, where)
        patch.setattr(TentativeStep, where, injected if where == "set_aside" else failing_after(original))
        with pytest.raises(RuntimeError, match="injected"):
            spec.accept(b, 2)
    assert spec.length(b) == 42  # settles
    for rid, start, keep in ((a, 126, 5), (b, 40, 2)):
        t._ids(twin, rid, t.streams[rid][start:start + keep])
    plan = twin.plan_step([(a, 5), (b, 2)])
    run_layers(twin, plan, t.streams[a][126:131] + t.streams[b][40:42], "torch")
    assert_same(spec, twin, "after the retried settle")
    t.verify([(a, 3, 1), (b, 8, 8)])
    check_invariants(spec)


def test_a_settle_that_raises_once_blocks_are_taken_makes_every_call_raise(monkeypatch):
    """Past its retryable part (blocks taken, kept bytes being placed) a settle cannot be redone: the cache says so
    on every later call instead of handing out blocks whose owner it no longer knows."""
    t = Twins(seed=18)
    a, b = crossing_pair(t)
    spec = t.spec
    plan = spec.plan_step([(a, 8), (b, 5)], tentative=True)
    run_layers(spec, plan, t.streams[a][126:134] + t.streams[b][40:45], "torch")
    spec.accept(a, 5)
    with monkeypatch.context() as patch:
        patch.setattr(TentativeStep, "place", injected)
        with pytest.raises(RuntimeError, match="injected"):
            spec.accept(b, 2)
    for call in (lambda: spec.admit(), lambda: spec.plan_step([(a, 1)]), lambda: spec.length(a),
                 lambda: spec.release(b), lambda: spec.accept(a, 1)):
        with pytest.raises(RuntimeError, match="make a new cache"):
            call()
