"""Prefix caching and swap with the real layers (DSV4Attention on the PyTorch reference, official FP8 / MXFP4
formats, NaN-poisoned pools): a request served after a hit, or after a swap, produces hidden states bit-identical
to the same request on a cold cache with the same step shapes.

"The same step shapes": a step's GEMMs round by their shape, so a token's bits depend on the row count of its
step and its row in it (measured on this CPU: fp32 GEMMs of 1..7 rows differ from the same rows in a larger one).
Each cold reference therefore computes the shared prefix in the steps the donor used (its companions' rows
included), then the request's own steps as the hit run feeds them.

The model is the attention half of a transformer: h <- embedding[token]; h <- h + layer(h) for one layer of each
kind (window, CSA m=4 with its indexer, HCA m=16), window 16, 128-token blocks. Publication needs every layer of
the geometry to run, so the stack holds them all.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dsv4kv import CacheManager, StepPlan
from dsv4kv.model.graph import DecodeGraph
from dsv4kv.model.layer import DSV4Attention, init_random_weights
from dsv4kv.ops.rope.reference import apply_rope

from prefix_sim import TINY3, check_invariants

P = 128
VOCAB = 4096
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Stack:
    """The layers of TINY3 as a residual stack over token embeddings, fed step by step."""

    def __init__(self, device="cpu", backend="torch", seed=0):
        self.layers = [init_random_weights(DSV4Attention(TINY3, i, device=device, backend=backend), seed=seed + i)
                       for i in range(TINY3.num_layers)]
        self.embedding = torch.randn(VOCAB, TINY3.hidden_size, generator=torch.Generator().manual_seed(seed + 99))
        self.embedding = self.embedding.to(torch.bfloat16).to(device)
        self.inputs: list[torch.Tensor] = []  # each layer's input in the last step

    def step(self, cache: CacheManager, batch, prompts: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Plan `batch` (request id, new tokens), run every layer; returns each request's output rows."""
        plan = cache.plan_step(batch)
        assert isinstance(plan, StepPlan), plan
        ids = [prompts[rid][cache.length(rid) - n:cache.length(rid)] for rid, n in batch]
        h = self.embedding[torch.tensor([t for chunk in ids for t in chunk], device=self.embedding.device)]
        self.inputs = []
        for layer in self.layers:
            self.inputs.append(h)
            h = h + layer(h, plan, cache)
        out, row = {}, 0
        for rid, n in batch:
            out[rid] = h[row:row + n]
            row += n
        return out


@pytest.fixture(scope="module")
def stack():
    return Stack()


def cache(prefix_caching=True, **kw):
    kw.setdefault("max_requests", 3)
    kw.setdefault("max_tokens", 1600)
    return CacheManager(TINY3, page_tokens=P, poison=True, prefix_caching=prefix_caching, **kw)


def ids(seed, n):
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def run(stack, c, rid, counts, prompts, decode=()):
    """Feed `counts` (prefill chunks), then one step per decode token (ids learned just before); outputs in order."""
    outs = [stack.step(c, [(rid, n)], prompts)[rid] for n in counts]
    for t in decode:
        c.append_tokens(rid, [t])
        outs.append(stack.step(c, [(rid, 1)], prompts)[rid])
    return outs


def cold(stack, tokens, counts, decode=()):
    """The same request alone on a cold cache without prefix caching (on the stack's device)."""
    c = cache(prefix_caching=False, device=stack.embedding.device)
    rid = c.admit(tokens)
    return run(stack, c, rid, counts, {rid: list(tokens) + list(decode)}, decode)


def assert_bits(got: list[torch.Tensor], want: list[torch.Tensor]):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, f"step {i}: {list(a.shape)} vs {list(b.shape)}"
        assert torch.isfinite(a).all(), f"step {i}: non-finite output (a poisoned byte was read)"
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), \
            f"step {i}: {int((a != b).any(-1).sum())} rows differ, max {(a.float() - b.float()).abs().max():.3g}"


# --- the peers' failures -----------------------------------------------------------------------------
def test_resent_identical_request_hits(stack):
    prompt, decode = ids(0, 300), ids(1, 3)
    c = cache()
    donor = c.admit(prompt)
    run(stack, c, donor, [128, 128, 44], {donor: prompt + decode}, decode)
    c.release(donor)
    again = c.admit(prompt)
    assert c.cached_tokens(again) == 256
    got = run(stack, c, again, [44], {again: prompt + decode}, decode)
    assert_bits(got, cold(stack, prompt, [128, 128, 44], decode)[2:])
    assert c.prefix_stats.hits == 1 and c.prefix_stats.hit_tokens == 256


def test_short_prefix_hits_at_block_granularity(stack):
    """A 140-token shared prefix (far under 4096) hits at 128, one block."""
    system = ids(2, 140)
    donor_prompt, prompt = system + ids(3, 30), system + ids(4, 25)
    c = cache()
    donor = c.admit(donor_prompt)
    run(stack, c, donor, [128, 42], {donor: donor_prompt})
    rid = c.admit(prompt)
    assert c.cached_tokens(rid) == 128
    decode = ids(5, 2)
    got = run(stack, c, rid, [37], {rid: prompt + decode}, decode)
    assert_bits(got, cold(stack, prompt, [128, 37], decode)[1:])


def test_hit_after_the_window_scrolled(stack):
    """The donor decodes across 256, then takes a 20-token chunk: its ring no longer holds the window at 256
    (tokens 240..255), the snapshot does."""
    prompt, generated, turn = ids(6, 250), ids(7, 6), ids(8, 20)
    c = cache()
    donor = c.admit(prompt)
    run(stack, c, donor, [128, 122], {donor: prompt + generated + turn}, generated)  # 256 crossed while decoding
    c.append_tokens(donor, turn)
    stack.step(c, [(donor, 20)], {donor: prompt + generated + turn})  # the ring now holds 260..275
    follow_up = prompt + generated + ids(9, 24)  # another next turn: shares 256 tokens
    rid = c.admit(follow_up)
    assert c.cached_tokens(rid) == 256
    decode = ids(10, 2)
    got = run(stack, c, rid, [24], {rid: follow_up + decode}, decode)
    want = cold(stack, follow_up, [128, 122] + [1] * 6 + [24], decode)  # the donor's shapes up to 256
    assert_bits(got, want[-3:])


def test_two_concurrent_identical_requests(stack):
    """Two identical requests in the same steps: each equals its cold twin (the second's blocks stay private);
    a third, later, hits the first's blocks."""
    prompt, decode = ids(10, 200), ids(11, 1)
    steps = [[128, 128], [72, 72], [1, 1]]

    def pair(c):
        a, b = c.admit(prompt), c.admit(prompt)
        prompts = {a: prompt + decode, b: prompt + decode}
        outs = []
        for i, (na, nb) in enumerate(steps):
            if i >= 2:
                for rid in (a, b):
                    c.append_tokens(rid, [decode[i - 2]])
            outs.append(stack.step(c, [(a, na), (b, nb)], prompts))
        return a, b, outs

    c = cache()
    a, b, hot = pair(c)
    ca, cb, ref = pair(cache(prefix_caching=False))
    assert_bits([o[a] for o in hot], [o[ca] for o in ref])
    assert_bits([o[b] for o in hot], [o[cb] for o in ref])
    assert c.prefix_stats.duplicate_blocks == 1 and c.num_cached_blocks == 1
    third = c.admit(prompt)
    assert c.cached_tokens(third) == 128 and c.blocks(third)[0] == c.blocks(a)[0]
    got = run(stack, c, third, [72], {third: prompt + decode}, decode)
    # cold twin: block 0 computed beside a companion in one 256-row step, as `a` computed it
    r = cache(prefix_caching=False)
    t, companion = r.admit(prompt), r.admit(prompt)
    prompts = {t: prompt + decode, companion: prompt}
    stack.step(r, [(t, 128), (companion, 128)], prompts)
    assert_bits(got, run(stack, r, t, [72], prompts, decode))
    check_invariants(c)


def test_eviction_while_another_request_shares_the_blocks(stack):
    """The donor leaves; a third request's blocks evict the donor's unshared cached block, never the two the hit
    request still maps; the hit request goes on bit for bit."""
    donor_prompt = ids(12, 400)
    prompt = donor_prompt[:300] + ids(13, 10)
    c = cache(num_blocks=8)
    donor = c.admit(donor_prompt)
    run(stack, c, donor, [128, 128, 128, 16], {donor: donor_prompt})
    rid = c.admit(prompt)
    assert c.cached_tokens(rid) == 256
    shared = c.blocks(rid)
    c.release(donor)
    assert c.num_evictable_blocks == 1  # block 2; blocks 0 and 1 are referenced by rid
    hog_prompt = ids(14, 6 * P)
    hog = c.admit(hog_prompt)
    stack.step(c, [(hog, 6 * P)], {hog: hog_prompt})  # every free block, then the donor's block 2
    assert c.prefix_stats.evicted_blocks == 1 and c.blocks(rid) == shared and c.num_free_blocks == 0
    assert all(c.prefix.cached(b) is not None for b in shared)  # still cached (their snapshots went to the hog's)
    c.release(hog)
    decode = ids(15, 2)
    got = run(stack, c, rid, [54], {rid: prompt + decode}, decode)
    assert_bits(got, cold(stack, prompt, [128, 128, 54], decode)[2:])
    check_invariants(c)


def test_release_of_one_of_two_sharers(stack):
    prompt = ids(16, 280)
    c = cache()
    first = c.admit(prompt)
    run(stack, c, first, [128, 128, 24], {first: prompt})
    second = c.admit(prompt)
    shared = c.blocks(second)
    c.release(first)
    assert [c.allocator.refcount(b) for b in shared] == [1, 1]
    decode = ids(17, 3)
    got = run(stack, c, second, [24], {second: prompt + decode}, decode)
    assert_bits(got, cold(stack, prompt, [128, 128, 24], decode)[2:])
    c.release(second)
    third = c.admit(prompt)  # the blocks outlived both sharers
    assert c.blocks(third) == shared
    assert_bits(run(stack, c, third, [24], {third: prompt}), cold(stack, prompt, [128, 128, 24])[2:])


# --- capture inside a step, swap ---------------------------------------------------------------------
def test_snapshot_inside_a_long_chunk_is_the_layers_own_state(stack):
    """A 300-token prefill publishes boundaries 128 and 256 from inside the step: each snapshot holds, bit for bit,
    the window entries and CSA compressor rows the layer computed for those tokens in that very step."""
    prompt = ids(18, 300)
    c = cache()
    rid = c.admit(prompt)
    stack.step(c, [(rid, 300)], {rid: prompt})
    assert c.lookup(prompt) == 256  # (publishes: every layer ran over the step)
    positions = torch.arange(300)
    for boundary in (128, 256):
        node = c.prefix.match(np.array(prompt), boundary // P)[-1]
        assert node.depth == boundary // P - 1 and node.snapshot is not None
        s = node.snapshot
        for layer, h, lc in zip(stack.layers, stack.inputs, c.pools.layers):
            spec, window = lc.spec, lc.spec.window
            kv = apply_rope(layer.kv_norm(layer.kv_proj(h)), positions, layer.spec.rope)
            rows = torch.arange(boundary - window, boundary)
            data, scales = spec.main.encode(kv[rows])
            snap_data, snap_scales = spec.main.page_views(lc.boundary_window, window)
            assert torch.equal(snap_data[s, rows % window], data) and torch.equal(snap_scales[s, rows % window], scales)
            if not spec.boundary_rows:
                continue
            rows = torch.arange(boundary - 4, boundary)
            main, index = layer.compressor.rows(h, positions), layer.compressor.indexer.rows(h, positions)
            for snap, want in ((lc.boundary_kv, main[0]), (lc.boundary_score, main[1]),
                               (lc.boundary_index_kv, index[0]), (lc.boundary_index_score, index[1])):
                assert torch.equal(snap[s, rows % 4].view(torch.int32), want[rows].view(torch.int32))
    # and a hit there goes on like the donor would have: within a few ulps of a cold run (other step shapes)
    again = c.admit(prompt[:270])
    assert c.cached_tokens(again) == 256
    got = stack.step(c, [(again, 14)], {again: prompt})[again]
    want = cold(stack, prompt[:270], [256, 14])[1]
    assert torch.isfinite(got).all()
    assert ((got.float() - want.float()).abs().amax(-1) <= 0.02 * want.float().abs().amax(-1)).all()


def test_kernel_path_capture_equals_reference_capture():
    """The kernel path hands the encoded step page (every padded row) instead of floats: same snapshot bytes,
    padding rows land in the scratch snapshot, and no other snapshot is touched."""
    g = TINY3
    results = []
    for path in ("reference", "kernel"):
        c = cache(prefix_snapshots=2)
        buffers = c.step_buffers(max_tokens=160, max_requests=2)
        rid = c.admit(ids(19, 150))
        plan = c.plan_step([(rid, 150)], buffers=buffers)
        assert plan.positions.shape[0] == 160 and plan.snapshots.count == 16  # window 16 rows, CSA rows among them
        gen = torch.Generator().manual_seed(1)
        kv = torch.randn(160, g.head_dim, generator=gen).to(torch.bfloat16)
        rows = [(None, None, torch.randn(160, w, generator=gen), torch.randn(160, w, generator=gen))
                for w in (2 * g.head_dim, 2 * g.index_head_dim)]
        for i, lc in enumerate(c.pools.layers):
            main = lc.spec.main
            state_rows = rows if lc.spec.boundary_rows else []
            if path == "reference":
                lc.write_boundaries(plan.snapshots, kv=kv[:150], state_rows=[(a, b, k[:150], l[:150])
                                                                             for a, b, k, l in state_rows])
            else:
                data, scales = main.encode(kv)
                page = torch.zeros(1, main.page_bytes(160), dtype=torch.uint8)
                page_data, page_scales = main.page_views(page, 160)
                page_data[0], page_scales[0] = data, scales
                lc.write_boundaries(plan.snapshots, step_kv=page, state_rows=state_rows)
        results.append(c)
    ref, ker = results
    for a, b in zip(ref.pools.layers, ker.pools.layers):
        for name in ("boundary_window", "boundary_kv", "boundary_score", "boundary_index_kv", "boundary_index_score"):
            x, y = getattr(a, name), getattr(b, name)
            if x is None:
                continue
            x, y = (x.view(torch.int32), y.view(torch.int32)) if x.dtype == torch.float32 else (x, y)
            s = ker.prefix.num_snapshots  # the scratch snapshot differs: only the kernel path wrote padding there
            assert torch.equal(x[:s], y[:s]), name
    node = ker.prefix.match(np.array(ids(19, 150)), 1)
    assert not node  # not published: no layer ran over the plan
    main = ker.pools.layers[0].spec.main
    snap_data, _ = main.page_views(ker.pools.layers[0].boundary_window, g.window)
    want, _ = main.encode(kv[112:128])
    captured = [s for s in range(2) if torch.equal(snap_data[s, torch.arange(112, 128) % 16], want)]
    assert len(captured) == 1  # exactly one snapshot holds the window at 128
    other = 1 - captured[0]
    assert snap_data[other].eq(0xFF).all()  # the other is untouched (poison)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "cache"])
def test_swap_out_and_in_is_bit_identical(stack, prefix_caching):
    """Preempted mid-request by swap, its blocks reused by another request meanwhile, it comes back to the same
    outputs as a run without preemption."""
    swap_round_trip(stack, prefix_caching)


def swap_round_trip(stack, prefix_caching):
    prompt, decode = ids(20, 270), ids(21, 3)
    c = cache(prefix_caching=prefix_caching, num_blocks=4, device=stack.embedding.device)
    rid = c.admit(prompt)
    prompts = {rid: prompt + decode}
    got = run(stack, c, rid, [128, 100], prompts)
    assert c.swap_out(rid)
    other_prompt = ids(22, 4 * P)
    other = c.admit(other_prompt)
    stack.step(c, [(other, 4 * P)], {other: other_prompt})  # every block, and the slot's neighbours
    c.release(other)
    assert c.swap_in(rid)
    got += run(stack, c, rid, [42], prompts, decode)
    assert_bits(got, cold(stack, prompt, [128, 100, 42], decode))


def test_random_schedule_equals_caching_off(stack):
    """24 requests with shared system prompts, one request per step (prefill chunks end at block boundaries, then
    single decode tokens), releases, swaps and evictions under a small cache: every output row equals the same
    request run alone on a cold cache without prefix caching. (Seed 3: 9 hits, 14 evictions, 16 swaps.)"""
    rng = random.Random(3)
    systems = [ids(30, 290), ids(31, 150)]
    c = cache(max_requests=3, num_blocks=8, prefix_snapshots=4)
    programs, outputs, prompts, starts = {}, {}, {}, {}
    plan_of = {}  # rid -> remaining steps: chunk sizes, then 1s

    def new_request(k):
        # every third request shares nothing; requests 6 and 18 are long, so cached blocks must be evicted
        system = systems[k % 2] if k % 3 else ids(80 + k, 480 if k % 12 == 6 else 200)
        prompt = system[:rng.randint(len(system) - 30, len(system))] + ids(40 + k, rng.randint(5, 60))
        decode = ids(60 + k, rng.randint(1, 3))
        rid = c.admit(prompt)
        if rid is None:
            return
        prompts[rid] = prompt + decode
        programs[rid] = (prompt, decode)
        start = starts[rid] = c.cached_tokens(rid)
        chunks = [min(P - pos % P, len(prompt) - pos) for pos in range(start, len(prompt)) if
                  pos == start or pos % P == 0]
        plan_of[rid] = chunks + [1] * len(decode)
        outputs[rid] = []

    admitted, finished, swaps = 0, 0, 0
    while finished < 24:
        live, swapped = c.request_ids(), c.swapped_ids()
        roll = rng.random()
        if roll < 0.12 and admitted < 24 and len(live) < 3:
            new_request(admitted)
            admitted += 1
        elif roll < 0.2 and live:
            c.swap_out(rng.choice(live))
            swaps += 1
        elif roll < 0.3 and swapped:
            c.swap_in(rng.choice(swapped))
        elif live:
            rid = rng.choice(live)
            n = plan_of[rid].pop(0)
            prompt, decode = programs[rid]
            if c.length(rid) >= len(prompt):
                c.append_tokens(rid, [decode[c.length(rid) - len(prompt)]])
            plan = c.plan_step([(rid, n)])
            if not plan:  # out of blocks: preempt another live request, retry later
                plan_of[rid].insert(0, n)
                others = [r for r in live if r != rid]
                if others:
                    c.swap_out(rng.choice(others))
                elif swapped:
                    pass  # only this request is live: the swapped ones wait
                continue
            h = stack.embedding[torch.tensor(prompts[rid][c.length(rid) - n:c.length(rid)])]
            for layer in stack.layers:
                h = h + layer(h, plan, c)
            outputs[rid].append(h)
            if not plan_of[rid]:
                c.release(rid)
                finished += 1
        check_invariants(c)
    for rid, (prompt, decode) in programs.items():
        start = starts[rid]
        counts = [min(P - pos % P, len(prompt) - pos) for pos in range(0, len(prompt)) if pos % P == 0]
        want = cold(stack, prompt, counts, decode)
        assert_bits(outputs[rid], want[-len(outputs[rid]):])
        assert sum(o.shape[0] for o in outputs[rid]) == len(prompt) + len(decode) - start
    stats = c.prefix_stats
    assert stats.hits >= 6 and stats.evicted_blocks > 0 and swaps >= 6, (stats, swaps)


# --- on a GPU: the kernels and CUDA graphs ---------------------------------------------------------------
@cuda
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "cache"])
def test_cuda_swap_out_and_in_is_bit_identical(prefix_caching):
    """The swap round trip on the GPU with the Triton kernels: blocks, window ring and compressor state to pinned
    host memory and back, bit for bit against a run without preemption."""
    swap_round_trip(Stack(device="cuda", backend="triton"), prefix_caching)


@cuda
def test_cuda_graph_concurrent_identical_requests_and_a_hit():
    """Two identical requests decoded together in a captured graph (crossing a block boundary inside the graph)
    equal the same run without prefix caching; a third request then hits at that boundary and equals a cold run
    with the same shapes."""
    stack = Stack(device="cuda", backend="triton")
    prompt, decode, tail = ids(50, 250), ids(51, 8), ids(52, 12)

    def serve(prefix_caching):
        c = CacheManager(TINY3, max_requests=3, max_tokens=1600, page_tokens=P, poison=True, device="cuda",
                         prefix_caching=prefix_caching)
        a, b = c.admit(prompt), c.admit(prompt)
        prompts = {a: prompt + decode, b: prompt + decode}
        stack.step(c, [(a, 250), (b, 250)], prompts)
        graph = DecodeGraph(stack.layers, c, batch=2)
        outs = []
        for t in decode:  # positions 250..257: the step at 255 completes block 1 inside the graph
            for rid in (a, b):
                c.append_tokens(rid, [t])
            outs.append(graph.step([(a, 1), (b, 1)], stack.embedding[torch.tensor([t, t], device="cuda")]).clone())
        return c, a, outs

    c, a, hot = serve(True)
    ref_cache, ref, cold_outs = serve(False)
    for x, y in zip(hot, cold_outs):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    assert c.num_cached_blocks == 2 and c.prefix_stats.duplicate_blocks == 1
    check_invariants(c)
    follow_up = prompt + decode + tail
    third = c.admit(follow_up)
    assert c.cached_tokens(third) == 256
    got = stack.step(c, [(third, len(follow_up) - 256)], {third: follow_up})[third]
    # the cold twin: `ref` computed its first 258 tokens exactly as `a` did; a request admitted in its place
    # cannot be, so compare against `ref` itself fed the same tail from 258 on, minus the hit's first 2 tokens
    ref_cache.append_tokens(ref, tail)
    want = stack.step(ref_cache, [(ref, len(tail))], {ref: follow_up})[ref]
    assert torch.isfinite(got).all()
    assert ((got[2:].float() - want.float()).abs().amax(-1) <= 0.02 * want.float().abs().amax(-1)).all()
