"""CacheManager with prefix caching and swap, at the manager level (no attention math): admission hits, the
hash chain and its collisions, LRU eviction, publication, swap, bad input, and a seeded random schedule of
thousands of steps checked after every step (prefix_sim: content tags and cache-wide invariants)."""

import random

import numpy as np
import pytest
import torch

import dsv4kv.cache.prefix as prefix_module
from dsv4kv import CacheManager, OutOfBlocks, StepPlan
from dsv4kv.cache.manager import RequestError
from dsv4kv.cache.swap import NoRoom

from prefix_sim import TINY3, Content, FakeLayers, check_contents, check_invariants

P = 128  # page_tokens


def make(max_requests=4, max_tokens=2048, **kw):
    kw.setdefault("page_tokens", P)
    kw.setdefault("prefix_caching", True)
    return CacheManager(TINY3, max_requests=max_requests, max_tokens=max_tokens, **kw)


class Driver:
    """A cache plus the fake layers and each request's content."""

    def __init__(self, cache):
        self.cache, self.layers, self.contents = cache, FakeLayers(cache), {}

    def admit(self, tokens):
        rid = self.cache.admit(tokens)
        if rid is not None:
            self.contents[rid] = Content(tokens)
        return rid

    def step(self, batch):
        plan = self.cache.plan_step(batch)
        if isinstance(plan, StepPlan):
            self.layers.run(plan, self.contents)
        return plan

    def feed(self, rid, counts):
        for n in counts:
            assert self.step([(rid, n)])

    def decode(self, rid, tokens):
        for t in tokens:
            self.cache.append_tokens(rid, [t])
            self.contents[rid].extend([t])
            assert self.step([(rid, 1)])

    def check(self):
        check_invariants(self.cache, self.contents)
        check_contents(self.cache, self.contents)


def tokens(seed, n, vocab=50_000):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


# --- admission ------------------------------------------------------------------------------------
def test_resent_identical_request_hits_and_shares_blocks():
    d = Driver(make())
    prompt = tokens(0, 300)
    a = d.admit(prompt)
    assert d.cache.cached_tokens(a) == 0 and d.cache.length(a) == 0
    d.feed(a, [300])
    assert d.cache.lookup(prompt) == 256  # published once the layers ran: blocks 0, 1 and their snapshots
    assert d.cache.num_cached_blocks == 2 and d.cache.num_snapshots == 2
    b = d.admit(prompt)
    assert d.cache.cached_tokens(b) == d.cache.length(b) == 256
    assert d.cache.blocks(b) == d.cache.blocks(a)[:2]
    assert [d.cache.allocator.refcount(x) for x in d.cache.blocks(b)] == [2, 2]
    d.check()  # b's window ring and compressor rows are the ones a held at 256
    d.feed(b, [44])
    d.check()
    stats = d.cache.prefix_stats
    assert (stats.queries, stats.query_tokens, stats.hits, stats.hit_tokens) == (2, 600, 1, 256)
    assert stats.hit_rate == pytest.approx(256 / 600)


@pytest.mark.parametrize("shared,hit", [(127, 0), (128, 128), (129, 128), (200, 128), (256, 256), (257, 256),
                                        (1000, 896)])
def test_hit_at_block_granularity(shared, hit):
    """A prompt sharing `shared` tokens with a cached one (and 1 more of its own) reuses floor(shared / P) blocks;
    a prompt equal to a cached prefix leaves its last block to feed (the caller needs the last token's output)."""
    d = Driver(make(max_tokens=4096, prefix_snapshots=8))  # a snapshot at every boundary of the donor
    donor = tokens(1, 1100)
    a = d.admit(donor)
    d.feed(a, [1100])
    d.cache.release(a)
    assert d.cache.lookup(donor[:shared] + [7]) == hit
    assert d.cache.lookup(donor[:shared]) == ((shared - 1) // P) * P
    rid = d.admit(donor[:shared] + [7])
    assert d.cache.cached_tokens(rid) == hit
    d.feed(rid, [shared + 1 - hit])
    d.check()


def test_hit_after_the_window_scrolled_and_across_a_decoded_boundary():
    """The window at a boundary comes from its snapshot, not from the donor's ring (which moved on); boundaries
    crossed while decoding are published too (a multi-turn follow-up hits there)."""
    d = Driver(make())
    a = d.admit(tokens(2, 250))
    d.feed(a, [130, 120])
    d.decode(a, tokens(3, 20))  # crosses 256 one token at a time, the ring now ends at 270
    turn2 = d.contents[a].tokens + tokens(4, 30)
    b = d.admit(turn2)
    assert d.cache.cached_tokens(b) == 256
    c = d.admit(turn2[:140] + [1, 2, 3])
    assert d.cache.cached_tokens(c) == 128
    d.check()
    d.feed(b, [len(turn2) - 256])
    d.feed(c, [15])
    d.check()


def test_two_concurrent_identical_requests():
    """Both compute (nothing is cached yet), the first publishes, the second keeps its copies private; a third
    hits the first's blocks."""
    d = Driver(make())
    prompt = tokens(5, 270)
    a, b = d.admit(prompt), d.admit(prompt)
    for n in (100, 100, 70):
        assert d.step([(a, n), (b, n)])
    d.check()
    assert d.cache.prefix_stats.duplicate_blocks == 1  # b's first block; b then stops publishing
    assert not set(d.cache.blocks(a)) & set(d.cache.blocks(b))
    assert all(d.cache.prefix.cached(x) is None for x in d.cache.blocks(b))
    c = d.admit(prompt)
    assert d.cache.cached_tokens(c) == 256 and d.cache.blocks(c) == d.cache.blocks(a)[:2]
    d.cache.release(a)
    d.check()
    d.feed(c, [14])
    d.check()


def test_eviction_spares_blocks_a_live_request_shares():
    d = Driver(make(max_requests=3, num_blocks=6, prefix_snapshots=4))
    a = d.admit(tokens(6, 260))
    d.feed(a, [260])
    b = d.admit(tokens(6, 260)[:256] + tokens(60, 300))  # shares a's two blocks
    shared = d.cache.blocks(b)
    assert len(shared) == 2
    d.cache.release(a)  # a's third block is private: freed; the shared two stay referenced by b
    other = d.admit(tokens(7, 390))
    d.feed(other, [390])  # 4 blocks: every free one, none of b's
    d.check()
    assert d.cache.blocks(b) == shared and d.cache.num_free_blocks == 0
    assert isinstance(d.cache.plan_step([(b, 1)]), OutOfBlocks)  # nothing evictable: b's blocks are referenced
    d.cache.release(other)  # other's three full blocks become evictable cached blocks, its fourth is free
    assert d.cache.num_evictable_blocks == 3 and d.cache.num_free_blocks == 4
    d.feed(b, [260])  # three blocks: other's private one, then two cached ones, deepest first
    d.check()
    assert d.cache.blocks(b)[:2] == shared and d.cache.prefix_stats.evicted_blocks == 2
    assert d.cache.lookup(tokens(7, 390)) == 128  # other's first block is still cached


def test_release_of_one_of_two_sharers():
    d = Driver(make())
    prompt = tokens(8, 300)
    a = d.admit(prompt)
    d.feed(a, [300])
    b = d.admit(prompt)
    blocks = d.cache.blocks(b)
    d.cache.release(a)
    assert [d.cache.allocator.refcount(x) for x in blocks] == [1, 1]
    d.check()
    d.feed(b, [44])
    d.cache.release(b)
    assert [d.cache.allocator.refcount(x) for x in blocks] == [0, 0]
    assert d.cache.num_evictable_blocks == 2 and d.cache.lookup(prompt) == 256
    c = d.admit(prompt)
    assert d.cache.blocks(c) == blocks
    d.check()


def test_hash_collisions_are_misses(monkeypatch):
    """With every block hashing alike, lookups still compare tokens and parents."""
    monkeypatch.setattr(prefix_module, "block_hash", lambda parent, tokens: 0)
    d = Driver(make(max_tokens=4096))
    x, y = tokens(9, 300), tokens(10, 300)
    for prompt in (x, y):
        rid = d.admit(prompt)
        d.feed(rid, [300])
    assert d.cache.num_cached_blocks == 4
    assert d.cache.lookup(x) == d.cache.lookup(y) == 256
    assert d.cache.lookup(x[:128] + y[128:]) == 128  # y's second block is not x's second block
    assert d.cache.lookup(y[:128] + x[128:256] + [1]) == 128
    assert d.cache.lookup(tokens(11, 300)) == 0
    rid = d.admit(x[:128] + y[128:])
    d.feed(rid, [300 - 128])
    d.check()


def test_lru_eviction_order_and_subtrees():
    """Released chains are evicted deepest first, least recently used first; evicting a block takes its
    descendants out of the index (their bytes sit on it) and their blocks are reused before cached ones."""
    d = Driver(make(max_requests=2, num_blocks=8, prefix_snapshots=8))
    x, y = tokens(12, 390), tokens(13, 390)
    for prompt in (x, y):
        rid = d.admit(prompt)
        d.feed(rid, [390])
        d.cache.release(rid)
    cached = {n.block: n for n in d.cache.prefix.cached_blocks()}
    x_chain = d.cache.prefix.match(np.array(x), 3)
    y_chain = d.cache.prefix.match(np.array(y), 3)
    # free queue: the never-used blocks, then x's chain deepest first, then y's (released later)
    order = d.cache.allocator.free_order()
    assert order[-6:] == [n.block for n in x_chain[::-1] + y_chain[::-1]] and len(cached) == 6
    rid = d.admit(x)  # touches x's chain: it is referenced again, then released after y's
    assert d.cache.cached_tokens(rid) == 384
    d.feed(rid, [390 - 384])
    d.cache.release(rid)
    filler = d.admit(tokens(14, 4 * P))
    d.feed(filler, [4 * P])  # the two private blocks, then y's chain, deepest first
    assert d.cache.lookup(y) == 128 and d.cache.lookup(x) == 384
    assert d.cache.prefix_stats.evicted_blocks == 2  # y's block 2 (a leaf), then y's block 1
    d.check()


def test_evicted_parent_takes_its_subtree_along():
    d = Driver(make(max_requests=2, num_blocks=6, prefix_snapshots=8))
    x = tokens(15, 3 * P + 5)
    a = d.admit(x)
    d.feed(a, [3 * P + 5])
    d.cache.release(a)
    chain = d.cache.prefix.match(np.array(x), 3)
    d.cache.allocator.to_front([chain[0].block])  # make the root the next block out, as if least recently used
    filler = d.admit(tokens(16, 5))
    d.feed(filler, [5])
    assert d.cache.blocks(filler) == [chain[0].block]
    assert d.cache.num_cached_blocks == 0  # the root went, its two descendants with it
    assert not any(node.alive for node in chain) and d.cache.prefix_stats.evicted_blocks == 3
    assert sorted(d.cache.allocator.free_order()[:2]) == sorted(n.block for n in chain[1:])  # reused first
    again = d.admit(x)  # the same content recomputed is published afresh, never on top of stale bytes
    assert d.cache.cached_tokens(again) == 0
    d.feed(again, [3 * P + 5])
    d.check()
    assert d.cache.lookup(x) == 3 * P


def test_out_of_blocks_changes_nothing_with_a_cache():
    """Free means never used or cached and unreferenced; a step needing more than that changes nothing."""
    d = Driver(make(max_requests=3, num_blocks=5))
    a = d.admit(tokens(17, 300))
    d.feed(a, [300])
    d.cache.release(a)  # 2 cached blocks (evictable) + 1 private block, all free
    c = d.admit(tokens(18, 200))
    d.feed(c, [200])  # takes the private block and a never-used one
    assert (d.cache.num_free_blocks, d.cache.num_evictable_blocks) == (3, 2)
    b = d.admit(tokens(31, 600))
    before = (d.cache.num_free_blocks, d.cache.num_cached_blocks, d.cache.allocator.free_order(),
              d.cache.block_table.clone())
    answer = d.cache.plan_step([(b, 600)])
    assert isinstance(answer, OutOfBlocks) and (answer.needed, answer.free) == (5, 3)
    assert (d.cache.num_free_blocks, d.cache.num_cached_blocks, d.cache.allocator.free_order()) == before[:3]
    assert torch.equal(d.cache.block_table, before[3]) and d.cache.length(b) == 0
    assert d.cache.lookup(tokens(17, 300)) == 256
    d.check()


def test_publication_waits_for_every_layer():
    """A step that not every layer ran publishes nothing, and the request stops publishing (its later bytes sit
    on that step); the other requests are unaffected."""
    d = Driver(make())
    a, b = d.admit(tokens(19, 300)), d.admit(tokens(20, 300))
    plan = d.cache.plan_step([(a, 130), (b, 130)])
    d.cache.admit(tokens(19, 300))  # admission between planning and running must not see the step's blocks
    assert d.cache.lookup(tokens(19, 300)) == 0
    d.cache.mark_layer_run(0)  # only one of three layers ran
    assert d.cache.num_cached_blocks == 0
    assert d.step([(b, 130)])
    assert d.cache.num_cached_blocks == 0  # the first step's blocks were dropped, b's second step published none
    assert d.step([(a, 130)]) and d.step([(b, 1)])
    assert d.cache.num_cached_blocks == 0
    assert plan.snapshots is not None and d.cache.prefix.num_snapshots_held == 0
    check_invariants(d.cache)


def test_release_between_plan_and_layers_publishes_nothing():
    d = Driver(make())
    prompt = tokens(21, 200)
    a = d.admit(prompt)
    d.cache.plan_step([(a, 200)])
    d.cache.release(a)
    assert d.cache.num_cached_blocks == 0 and d.cache.lookup(prompt) == 0
    check_invariants(d.cache)


# --- swap -------------------------------------------------------------------------------------------
def request_bytes(cache, rid):
    slot, blocks = cache.slot(rid), cache.blocks(rid)
    out = []
    for layer in cache.pools.layers:
        for tensor, paged in layer.request_tensors():
            out.append((tensor[torch.tensor(blocks)] if paged else tensor[slot]).clone())
    return out


def bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "cache"])
def test_swap_round_trip_bit_for_bit(prefix_caching):
    d = Driver(make(max_requests=2, num_blocks=6, prefix_caching=prefix_caching, poison=True))
    a = d.admit(tokens(22, 300))
    d.feed(a, [290])
    before = request_bytes(d.cache, a)
    moved = d.cache.swap_out(a)
    assert moved == 3 * d.cache.spec.block_bytes + d.cache.spec.request_fixed_bytes == d.cache.bytes_swapped
    assert moved == sum(t.numel() * t.element_size() for t in d.cache._swapped[a].saved)
    assert d.cache.is_swapped(a) and not d.cache.is_live(a) and d.cache.length(a) == 290
    assert d.cache.num_used_blocks == 0
    other = d.admit(tokens(23, 700))  # overwrites every block and the slot
    d.feed(other, [700])
    d.cache.release(other)
    assert d.cache.swap_in(a) == moved and d.cache.bytes_swapped == 0
    after = request_bytes(d.cache, a)
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(before, after))
    d.feed(a, [10])
    d.check()


def test_swap_in_shares_blocks_still_cached():
    d = Driver(make(max_requests=3, num_blocks=8))
    prompt = tokens(24, 300)
    a = d.admit(prompt)
    d.feed(a, [300])
    b = d.admit(prompt)
    shared = d.cache.blocks(b)
    with pytest.raises(RequestError, match="not swapped out"):
        d.cache.swap_in_blocks(b)
    d.cache.swap_out(b)
    assert d.cache.swap_in_blocks(b) == 0  # both blocks are cached and a holds them: shared, not taken
    d.cache.release(a)
    assert d.cache.swap_in_blocks(b) == 2  # cached but unreferenced: taken from the free queue
    a = d.admit(prompt)
    assert d.cache.swap_in_blocks(b) == 0
    assert d.cache.swap_in(b)
    assert d.cache.blocks(b) == shared and [d.cache.allocator.refcount(x) for x in shared] == [2, 2]
    d.check()
    d.feed(b, [44])
    d.check()


def test_swap_no_room_changes_nothing():
    d = Driver(make(max_requests=2, num_blocks=4, swap_bytes=10))
    a = d.admit(tokens(25, 200))
    d.feed(a, [200])
    answer = d.cache.swap_out(a)
    assert isinstance(answer, NoRoom) and not answer and answer.resource == "host swap bytes"
    assert "no room" in str(answer) and d.cache.is_live(a)
    d = Driver(make(max_requests=2, num_blocks=4))
    a = d.admit(tokens(25, 200))
    d.feed(a, [200])
    assert d.cache.swap_out(a)
    fill = [d.admit(tokens(26, 5 + 3 * P)), d.admit(tokens(27, 5))]
    answer = d.cache.swap_in(a)
    assert isinstance(answer, NoRoom) and answer.resource == "request slots"
    d.cache.release(fill[1])
    d.feed(fill[0], [5, 3 * P])  # 4 blocks: none left for a
    state = (d.cache.num_free_blocks, d.cache.allocator.free_order(), d.cache.block_table.clone())
    answer = d.cache.swap_in(a)
    assert isinstance(answer, NoRoom) and (answer.resource, answer.needed, answer.free) == ("blocks", 2, 0)
    assert d.cache.swap_in_blocks(a) == 2
    assert (d.cache.num_free_blocks, d.cache.allocator.free_order()) == state[:2]
    assert torch.equal(d.cache.block_table, state[2]) and d.cache.is_swapped(a)
    d.cache.release(fill[0])
    assert d.cache.swap_in(a)
    d.check()


def test_swap_misuse_raises():
    d = Driver(make())
    a = d.admit(tokens(28, 20))
    d.feed(a, [20])
    with pytest.raises(RequestError, match="not swapped out"):
        d.cache.swap_in(a)
    d.cache.swap_out(a)
    with pytest.raises(RequestError, match="swapped out: swap_in first"):
        d.cache.plan_step([(a, 1)])
    with pytest.raises(RequestError, match="swapped out"):
        d.cache.swap_out(a)
    d.cache.append_tokens(a, [5])  # a swapped request still learns its next tokens
    d.cache.release(a)  # drops the host copy
    assert d.cache.bytes_swapped == 0
    with pytest.raises(RequestError, match="already released"):
        d.cache.swap_in(a)
    with pytest.raises(RequestError, match="unknown request id 99"):
        d.cache.swap_in(99)


# --- bad input, and prefix_caching=False ----------------------------------------------------------
@pytest.mark.parametrize("bad,match", [
    ("abc", "expected a 1-D sequence of integer token ids, got str"),
    ([[1, 2]], r"got int64 shape \[1, 2\]"),
    ([1.5, 2.0], "got float64"),
    (torch.tensor([1.0]), r"expected a 1-D integer tensor of token ids, got torch.float32 \[1\]"),
    (5, "got int"),
])
def test_bad_token_ids_raise(bad, match):
    m = make()
    with pytest.raises(ValueError, match=match):
        m.admit(bad)
    assert m.num_live_requests == 0
    rid = m.admit([1, 2, 3])
    with pytest.raises(ValueError, match=match):
        m.append_tokens(rid, bad)


def test_token_ids_must_cover_what_is_fed():
    m = make(max_seq_len=1000)
    rid = m.admit([1, 2, 3])
    with pytest.raises(ValueError, match="feeds tokens up to 4, 3 token ids are known"):
        m.plan_step([(rid, 4)])
    assert m.length(rid) == 0 and m.num_used_blocks == 0
    m.append_tokens(rid, np.array([4], dtype=np.int32))
    assert m.plan_step([(rid, 4)])
    with pytest.raises(ValueError, match="tokens: 1001 ids, max_seq_len is 1000"):
        m.admit(list(range(1001)))
    with pytest.raises(ValueError, match="would know 1001 token ids"):
        m.append_tokens(rid, list(range(997)))
    private = m.admit()  # no token ids: never hits, never publishes, fed freely
    assert m.plan_step([(private, 300)])
    with pytest.raises(ValueError, match="admitted without token ids"):
        m.append_tokens(private, [1])


@pytest.mark.parametrize("kw,error,match", [
    (dict(prefix_caching=False, prefix_snapshots=4), ValueError, "without prefix_caching=True"),
    (dict(prefix_snapshots=0), ValueError, "prefix_snapshots: expected a positive int, got 0"),
    (dict(prefix_caching="yes"), TypeError, "expected a bool, got str"),
    (dict(swap_bytes=-1), ValueError, "swap_bytes: expected a positive int, got -1"),
])
def test_bad_construction(kw, error, match):
    with pytest.raises(error, match=match):
        make(**kw)


def test_window_longer_than_a_block_is_refused():
    from test_layer_inputs import geometry_of
    g = geometry_of(sliding_window=256)
    with pytest.raises(ValueError, match="expected a window <= page_tokens, got window 256 and page_tokens 128"):
        CacheManager(g, max_requests=2, max_tokens=512, page_tokens=128, prefix_caching=True)


def test_caching_off_changes_nothing():
    """Token ids are checked and ignored; plans and buffers carry no prefix fields; counters stay 0."""
    m = make(prefix_caching=False)
    prompt = tokens(29, 300)
    a = m.admit(prompt)
    plan = m.plan_step([(a, 300)])
    assert plan.snapshots is None and "snapshot_window" not in m.step_buffers(max_tokens=4, max_requests=2).views
    m.release(a)
    b = m.admit(prompt)
    assert m.cached_tokens(b) == 0 and m.length(b) == 0 and m.lookup(prompt) == 0
    assert m.plan_step([(b, 301)])  # feeding past the given ids is fine without caching
    assert (m.num_cached_blocks, m.num_snapshots, m.prefix_stats, m.bytes_cached) == (0, 0, None, 0)
    assert all(layer.boundary_window is None for layer in m.pools.layers)
    assert m.bytes_reserved == m.spec.pool_bytes(m.num_blocks, m.max_requests)


def test_counters_and_reserved_bytes():
    d = Driver(make(prefix_snapshots=3))
    assert d.cache.bytes_reserved == d.cache.spec.pool_bytes(d.cache.num_blocks, 4, 3)
    a = d.admit(tokens(30, 600))
    d.feed(a, [300, 300])  # 2 + 2 boundaries, 3 snapshots: the least recently taken (block 0's) is evicted
    assert d.cache.num_cached_blocks == 4 and d.cache.num_snapshots == 3
    assert d.cache.prefix_stats.snapshots_evicted == 1
    assert d.cache.lookup(tokens(30, 600)[:200]) == 0  # block 0 has no snapshot any more
    assert d.cache.lookup(tokens(30, 600)[:300]) == 256
    d.cache.release(a)
    assert d.cache.num_evictable_blocks == 4 and d.cache.num_used_blocks == 0
    assert d.cache.bytes_cached == 4 * d.cache.spec.block_bytes + 3 * d.cache.spec.boundary_bytes
    assert d.cache.prefix_stats.as_dict()["published_blocks"] == 4


# --- a seeded random schedule -----------------------------------------------------------------------
SYSTEM = [tokens(100 + i, n) for i, n in enumerate((300, 140, 520))]


def random_prompt(rng, finished):
    kind = rng.random()
    if kind < 0.5:
        base = SYSTEM[rng.randrange(len(SYSTEM))]
        return base[:rng.randint(len(base) // 2, len(base))] + tokens(rng.randrange(1 << 30), rng.randint(1, 150))
    if kind < 0.8 and finished:  # a follow-up turn: a whole earlier request (prompt + generated) and more
        return rng.choice(finished)[:] + tokens(rng.randrange(1 << 30), rng.randint(1, 60))
    if kind < 0.9 and finished:  # the identical request again
        return rng.choice(finished)[:rng.randint(1, 400)]
    return tokens(rng.randrange(1 << 30), rng.randint(1, 400))


@pytest.mark.parametrize("seed,steps", [(0, 2500), (1, 1500)], ids=["seed0-S2500", "seed1-S1500"])
def test_random_schedule(seed, steps):
    rng = random.Random(seed)
    d = Driver(make(max_requests=5, max_tokens=1500, prefix_snapshots=6, max_seq_len=1200))
    cache, contents = d.cache, d.contents
    target: dict[int, int] = {}  # rid -> length at which it finishes
    finished: list[list[int]] = []
    seen = {k: 0 for k in ("hit", "oob", "swap_out", "swap_in", "swap_no_room", "release", "partial_run")}
    for _ in range(steps):
        live, swapped = cache.request_ids(), cache.swapped_ids()
        action = rng.random()
        if action < 0.12:
            prompt = random_prompt(rng, finished)[:1000]
            rid = d.admit(prompt)
            if rid is not None:
                target[rid] = len(prompt) + rng.randint(1, 120)
                seen["hit"] += cache.cached_tokens(rid) > 0
        elif action < 0.16 and live:
            rid = rng.choice(live)
            if cache.length(rid) > 0:
                finished.append(contents[rid].tokens[:cache.length(rid)])
            cache.release(rid)
            seen["release"] += 1
        elif action < 0.19 and live:
            assert cache.swap_out(rng.choice(live))
            seen["swap_out"] += 1
        elif action < 0.23 and swapped:
            answer = cache.swap_in(rng.choice(swapped))
            seen["swap_in" if answer else "swap_no_room"] += 1
        elif live:
            batch = []
            for rid in rng.sample(live, rng.randint(1, len(live))):
                length, known = cache.length(rid), len(contents[rid].tokens)
                if length >= target[rid]:
                    continue
                n = rng.choice([1, 1, 1, rng.randint(2, 140)])
                n = min(n, target[rid] - length)
                if length + n > known:  # generated tokens: learned one step ahead, as an engine would
                    new = tokens(rng.randrange(1 << 30), length + n - known)
                    cache.append_tokens(rid, new)
                    contents[rid].extend(new)
                batch.append((rid, n))
            if batch:
                plan = cache.plan_step(batch)
                if isinstance(plan, OutOfBlocks):
                    seen["oob"] += 1
                    victim = max(live, key=cache.length)  # preempt the longest by swap
                    assert cache.swap_out(victim)
                elif rng.random() < 0.01:  # an abandoned step: only some layers ran
                    cache.mark_layer_run(0)
                    seen["partial_run"] += 1
                    for rid, _ in batch:  # its requests' bytes are garbage now: drop them
                        cache.release(rid)
                else:
                    d.layers.run(plan, contents)
        check_invariants(cache, contents)
        check_contents(cache, contents)
    stats = cache.prefix_stats
    print(seen, stats.as_dict())
    assert min(seen.values()) > 0, seen
    assert stats.hits > 0 and stats.evicted_blocks > 0 and stats.snapshots_evicted > 0
    assert stats.duplicate_blocks > 0 and stats.hit_rate > 0.1


def test_forget_tokens_takes_back_ids_never_fed():
    """Ids appended for tokens a request is not fed after all (a speculative step's drafts, when the step failed before
    its plan) are forgotten; the ids of tokens it holds cannot be, nor more than it has; the block it then fills
    publishes the ids fed, not the forgotten ones."""
    from dsv4kv import RequestError

    d = Driver(make())
    prompt = tokens(81, P - 1)
    rid = d.admit(prompt)
    d.feed(rid, [P - 2])  # one prompt token left to feed
    d.cache.append_tokens(rid, [7, 8, 9])  # drafts that will not be fed
    with pytest.raises(ValueError, match=f"keep {P - 3} cuts into the {P - 2} tokens request {rid} holds"):
        d.cache.forget_tokens(rid, P - 3)
    with pytest.raises(ValueError, match=f"keep {P + 3} exceeds the {P + 2} token ids request {rid} has"):
        d.cache.forget_tokens(rid, P + 3)
    with pytest.raises(TypeError, match="keep must be an int"):
        d.cache.forget_tokens(rid, float(P))
    with pytest.raises(RequestError, match="unknown request id 99"):
        d.cache.forget_tokens(99, P)
    d.cache.forget_tokens(rid, P - 1)  # the prompt's ids only
    with pytest.raises(ValueError, match="token ids are known"):
        d.step([(rid, 2)])  # the drafts' ids are gone
    d.decode(rid, [5])  # the last prompt token and one generated token fill the block
    d.step([(rid, 1)])
    d.check()
    assert d.cache.lookup(prompt + [5, 1]) == P  # published with the ids fed
    assert d.cache.lookup(prompt + [7, 1]) == 0
