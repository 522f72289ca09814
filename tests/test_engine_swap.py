"""Preemption by swap in the engine (issue 14) on the tiny three-layer model, CPU, exact mode, 128-token blocks: a
swapped request comes back bit for bit, so its tokens are those of a run without preemption; swapped requests come
back before admissions, oldest first; an abort drops the host copy; and a random schedule never loses or leaks a
block, a slot or a host byte."""

from __future__ import annotations

import functools
import random

import pytest

from dsv4kv import CacheManager
from dsv4kv.engine import SamplingParams
from dsv4kv.engine.request import Request, Status
from dsv4kv.engine.scheduler import Scheduler

from prefix_sim import check_invariants
from test_engine import EXACT, engine, prompts, run_step, tiny_model_geometry

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(max_requests=2, max_tokens=384)  # 4 blocks of 128 tokens
PARAMS = SamplingParams(max_new_tokens=12)


@functools.lru_cache(maxsize=None)
def two_long() -> tuple[list[int], ...]:
    """Two 250-token prompts: both fit (2 blocks each) until one decodes past 256 tokens and needs a 3rd block."""
    return tuple(prompts((250, 250), seed=31))


@functools.lru_cache(maxsize=None)
def unpreempted(token_lists: tuple[tuple[int, ...], ...], max_new_tokens: int) -> tuple[tuple[int, ...], ...]:
    """Every prompt served together from a cache that holds them all (no preemption)."""
    e = engine()
    outs = e.generate([list(p) for p in token_lists], SamplingParams(max_new_tokens=max_new_tokens))
    assert e.stats.preemptions == 0
    return tuple(o.token_ids for o in outs)


def served(e, token_lists, params=PARAMS) -> list[tuple[int, ...]]:
    return [o.token_ids for o in e.generate(token_lists, params)]


def assert_clean(e) -> None:
    c = e.cache
    assert (c.num_live_requests, c.num_used_blocks, c.bytes_swapped, c.swapped_ids()) == (0, 0, 0, [])
    assert c.num_free_blocks == c.num_blocks and not e.scheduler.swapped


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["caching-off", "caching-on"])
def test_swapped_requests_give_the_tokens_of_no_preemption_and_of_recompute(prefix_caching):
    token_lists = list(two_long())
    want = unpreempted(tuple(map(tuple, token_lists)), PARAMS.max_new_tokens)
    swap = engine(preemption="swap", prefix_caching=prefix_caching, **SMALL)
    recompute = engine(preemption="recompute", prefix_caching=prefix_caching, **SMALL)
    assert served(swap, token_lists) == list(want) == served(recompute, token_lists)
    s = swap.stats
    assert s.swap_preemptions == s.preemptions == s.swap_ins >= 1 and s.recompute_preemptions == 0
    # the swapped request's 256 computed tokens: 2 blocks and the per-request state, out and back
    assert s.swap_bytes == 2 * s.swap_preemptions * (2 * swap.cache.spec.block_bytes
                                                     + swap.cache.spec.request_fixed_bytes)
    assert s.prefill_tokens == 500  # nothing recomputed
    r = recompute.stats
    assert r.recompute_preemptions == r.preemptions >= 1 and r.swap_preemptions == r.swap_bytes == 0
    assert r.prefill_tokens > 500
    assert_clean(swap)


@pytest.mark.parametrize("prefix_caching,kind", [(False, "swap"), (True, "recompute")],
                         ids=["caching-off-swaps", "caching-on-recomputes"])
def test_auto_recomputes_what_is_mostly_cached_and_swaps_the_rest(prefix_caching, kind):
    """The preempted request holds 257 tokens: with caching its first 256 are cached blocks (1 token to
    recompute), without caching all 257 would be recomputed (more than a block: swapped)."""
    token_lists = list(two_long())
    e = engine(preemption="auto", prefix_caching=prefix_caching, **SMALL)
    assert served(e, token_lists) == list(unpreempted(tuple(map(tuple, token_lists)), PARAMS.max_new_tokens))
    s = e.stats
    assert s.preemptions >= 1
    assert (s.swap_preemptions if kind == "swap" else s.recompute_preemptions) == s.preemptions
    assert_clean(e)


def test_a_short_host_budget_recomputes_instead():
    token_lists = list(two_long())
    e = engine(preemption="swap", swap_bytes=1000, **SMALL)  # less than any request's state
    assert served(e, token_lists) == list(unpreempted(tuple(map(tuple, token_lists)), PARAMS.max_new_tokens))
    assert e.stats.recompute_preemptions == e.stats.preemptions >= 1 and e.stats.swap_preemptions == 0
    assert_clean(e)


def test_swap_options_are_checked():
    with pytest.raises(ValueError, match="preemption: expected one of recompute, swap, auto, got 'later'"):
        engine(preemption="later")
    with pytest.raises(ValueError, match="swap_bytes: given with preemption='recompute'"):
        engine(swap_bytes=1 << 20)


def test_abort_of_a_swapped_request_drops_its_host_copy_and_the_others_go_on():
    a, b = two_long()
    c = prompts((40,), seed=32)[0]
    e = engine(preemption="swap", max_requests=3, max_tokens=384)
    ids = [e.add_request(p, PARAMS) for p in (a, b)]
    while not e.scheduler.swapped:
        e.step()
    swapped = e.scheduler.swapped[0]
    cache_id = swapped.cache_id
    assert swapped.status is Status.SWAPPED and e.cache.is_swapped(cache_id) and e.cache.bytes_swapped > 0
    ids.append(e.add_request(c, PARAMS))  # arrives while b is out
    e.abort(swapped.id)
    assert e.cache.bytes_swapped == 0 and not e.cache.is_swapped(cache_id) and not e.scheduler.swapped
    while e.has_unfinished:
        e.step()
    outs = {i: e.output(i) for i in ids}
    aborted = outs[swapped.id]
    assert aborted.finish_reason == "abort" and aborted.preemptions == 1
    want = unpreempted((tuple(a), tuple(b), tuple(c)), PARAMS.max_new_tokens)
    assert aborted.token_ids == want[ids.index(swapped.id)][:len(aborted.token_ids)]
    assert [outs[i].token_ids for i in ids if i != swapped.id] == [w for i, w in zip(ids, want) if i != swapped.id]
    assert_clean(e)


def test_a_swapped_request_comes_back_before_any_admission():
    """No model: the scheduler over 5 blocks. r0 (128 tokens), r1 (127) and r2 (256) take 4 blocks; when r0 and r2
    both need another block, r2 (the newest) is swapped out. A request arriving meanwhile is not admitted, though a
    slot and its block are free, until r2 came back (it needs its 2 blocks and a 3rd)."""
    cache = CacheManager(tiny_model_geometry(), max_requests=3, max_tokens=384, page_tokens=128, num_blocks=5,
                         **EXACT)
    scheduler = Scheduler(cache, step_tokens=512, preemption="swap")
    r0, r1, r2 = (Request(i, tuple(range(n)), SamplingParams(), None) for i, n in enumerate((128, 127, 256)))
    for r in (r0, r1, r2):
        scheduler.add(r)
    run_step(cache, scheduler.schedule())
    assert cache.num_free_blocks == 1
    step = scheduler.schedule()  # r0 takes the free block; r2 needs a 3rd: swapped out
    assert step.swapped_out == step.preempted == [r2] and r2.status is Status.SWAPPED
    assert r2.num_computed == 256 and cache.is_swapped(r2.cache_id) and cache.length(r2.cache_id) == 256
    assert [(r.id, n) for r, n in step.batch] == [(0, 1), (1, 1)]
    run_step(cache, step)
    late = Request(3, tuple(range(10)), SamplingParams(), None)
    scheduler.add(late)
    step = scheduler.schedule()  # 2 free: r1 takes one; r2 needs 3; late (1 block) would fit but must wait
    assert [(r.id, n) for r, n in step.batch] == [(0, 1), (1, 1)] and not step.swapped_in
    assert late.status is Status.WAITING and cache.num_live_requests == 2
    run_step(cache, step)
    scheduler.finish(r0, "stop")  # 3 free: r2 comes back and decodes; late still waits (no block left)
    step = scheduler.schedule()
    assert step.swapped_in == [r2] and [(r.id, n) for r, n in step.batch] == [(1, 1), (2, 1)]
    assert r2.status is Status.RUNNING and cache.bytes_swapped == 0 and late.status is Status.WAITING
    assert step.swap_bytes == 2 * cache.spec.block_bytes + cache.spec.request_fixed_bytes
    run_step(cache, step)
    scheduler.finish(r1, "stop")
    step = scheduler.schedule()
    assert [(r.id, n) for r, n in step.batch] == [(2, 1), (3, 10)]


# --- a seeded random schedule ------------------------------------------------------------------------------
def check_accounting(e) -> None:
    """After every step: no block, slot or host byte lost or leaked."""
    c, sched = e.cache, e.scheduler
    check_invariants(c)
    assert c.num_live_requests == len(sched.running)
    assert sorted(c.request_ids()) == sorted(r.cache_id for r in sched.running)
    assert len(c._free_slots) == c.max_requests - c.num_live_requests
    assert sorted(c.swapped_ids()) == sorted(r.cache_id for r in sched.swapped)
    assert [r.id for r in sched.swapped] == sorted(r.id for r in sched.swapped)  # oldest comes back first
    assert all(r.status is Status.SWAPPED for r in sched.swapped)
    spec = c.spec
    assert c.bytes_swapped == sum(spec.blocks_for(r.num_computed) * spec.block_bytes + spec.request_fixed_bytes
                                  for r in sched.swapped)
    for r in sched.running + list(sched.swapped):
        assert c.length(r.cache_id) == r.num_computed
    assert all(r.cache_id is None and r.num_computed == 0 for r in sched.waiting)


@functools.lru_cache(maxsize=None)
def random_workload(seed: int):
    """Prompts of 60 .. 245 tokens (half of those past a block start with the same 128 tokens), 20 or 40 new
    tokens, arrival steps: many prompts end just before a block boundary, so growing requests collide."""
    rng = random.Random(seed)
    lengths = [rng.choice([60, 110, 120, 245]) for _ in range(9)]
    new_tokens = tuple(rng.choice([20, 40]) for _ in range(9))
    arrivals = tuple(sorted(rng.randrange(0, 8) for _ in range(9)))
    shared = prompts((128,), seed=seed)[0]
    token_lists = []
    for i, tail in enumerate(prompts(lengths, seed=seed + 1)):
        head = shared if len(tail) > 128 and i % 2 else []
        token_lists.append(tuple(head + tail[len(head):]))
    return tuple(token_lists), new_tokens, arrivals


@functools.lru_cache(maxsize=None)
def unpreempted_each(seed: int) -> tuple[tuple[int, ...], ...]:
    token_lists, new_tokens, _ = random_workload(seed)
    e = engine(max_requests=9, max_tokens=9 * 600, step_tokens=2048)
    outs = e.generate([list(p) for p in token_lists], [SamplingParams(max_new_tokens=n) for n in new_tokens])
    assert e.stats.preemptions == 0
    return tuple(o.token_ids for o in outs)


@pytest.mark.parametrize("preemption,prefix_caching,swap_bytes", [
    ("auto", True, None), ("auto", False, None), ("swap", True, 200_000), ("swap", False, 200_000)],
    ids=["auto-caching-on", "auto-caching-off", "swap-budget-caching-on", "swap-budget-caching-off"])
def test_a_random_schedule_loses_nothing_and_gives_the_tokens_of_no_preemption(preemption, prefix_caching,
                                                                                swap_bytes):
    """9 requests (short and long, some sharing a block) arriving over 8 steps into 3 slots and 5 blocks, 2 of
    them aborted at random steps (preferably while swapped out); the manager's counters are checked after every
    step. With "auto" and caching off both kinds happen (with caching on, every preempted request here is mostly
    cached: all recomputed); with "swap" a host budget of one 2-block request makes some swaps fall back to
    recompute."""
    seed = 10
    token_lists, new_tokens, arrivals = random_workload(seed)
    want = unpreempted_each(seed)
    e = engine(max_requests=3, max_tokens=384, max_seq_len=640, step_tokens=160, preemption=preemption,
               prefix_caching=prefix_caching, swap_bytes=swap_bytes)
    assert e.cache.num_blocks == 5
    rng = random.Random(seed)
    aborts = set(rng.sample(range(len(token_lists)), 2))
    ids: list[int] = []
    step = aborted_out = 0
    while len(ids) < len(token_lists) or e.has_unfinished:
        while len(ids) < len(token_lists) and arrivals[len(ids)] <= step:
            ids.append(e.add_request(list(token_lists[len(ids)]), SamplingParams(max_new_tokens=new_tokens[len(ids)])))
        for i in sorted(aborts):  # abort at a random point: preferably while swapped out
            request = e._requests[ids[i]] if i < len(ids) else None
            if request is not None and not request.finished and (
                    request.status is Status.SWAPPED or rng.random() < 0.05):
                aborted_out += request.status is Status.SWAPPED
                e.abort(ids[i])
                aborts.discard(i)
        e.step()
        check_accounting(e)
        step += 1
        assert step < 2000, "no progress"
    outs = [e.output(i) for i in ids]
    for i, (out, w) in enumerate(zip(outs, want)):
        if out.finish_reason == "abort":
            assert out.token_ids == w[:len(out.token_ids)], f"request {i} (aborted)"
        else:
            assert out.token_ids == w, f"request {i}"
    s = e.stats
    assert s.preemptions == s.swap_preemptions + s.recompute_preemptions
    assert s.swap_ins == s.swap_preemptions - aborted_out  # every swapped request came back or was aborted
    assert s.recompute_preemptions >= 1, s
    if (preemption, prefix_caching) != ("auto", True):  # there, every preempted request was mostly cached
        assert s.swap_preemptions >= 1, s
    assert_clean(e)
