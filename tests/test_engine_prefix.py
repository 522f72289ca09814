"""The engine over the prefix cache (issue 14 item 2) on the tiny three-layer model, CPU, exact mode (bf16 entries and
indexer keys), 128-token blocks: hits are reported, skip their prefill, and never change a token."""

from __future__ import annotations

import pytest

from dsv4kv.engine import SamplingParams

from test_engine import engine, prompts

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_new_tokens=6)


def cold(token_lists, params=GREEDY, **overrides) -> list[tuple[int, ...]]:
    """Each prompt alone on a fresh engine with prefix caching off."""
    return [engine(**overrides).generate([p], params)[0].token_ids for p in token_lists]


def test_a_resent_identical_prompt_hits_and_gives_the_cold_tokens():
    prompt = prompts((300,), seed=21)[0]
    e = engine(prefix_caching=True)
    first = e.generate([prompt], GREEDY)[0]
    again = e.generate([prompt], GREEDY)[0]
    assert first.cached_tokens == 0
    assert again.cached_tokens == 256  # whole blocks, leaving the last prompt token to feed
    assert first.token_ids == again.token_ids == cold([prompt])[0]
    s = e.stats
    assert (s.prefix_queries, s.prefix_query_tokens, s.prefix_hits, s.prefix_hit_tokens) == (2, 600, 1, 256)
    assert s.prefix_hit_rate == pytest.approx(256 / 600)
    assert s.prefill_tokens == 300 + 44  # the hit's 256 tokens were not prefilled
    assert e.cache.num_live_requests == 0 and e.cache.num_used_blocks == 0


def test_a_prompt_shorter_than_two_blocks_hits_at_block_granularity():
    prompt = prompts((129,), seed=22)[0]
    e = engine(prefix_caching=True)
    e.generate([prompt], GREEDY)
    out = e.generate([prompt[:128] + [7, 8, 9]], GREEDY)[0]
    assert out.cached_tokens == 128 and out.token_ids == cold([prompt[:128] + [7, 8, 9]])[0]
    exactly_one_block = e.generate([prompt[:128]], GREEDY)[0]  # a hit leaves the last token to feed: no hit
    assert exactly_one_block.cached_tokens == 0


def test_prompts_sharing_a_long_prefix_hit_and_match_caching_off():
    shared = prompts((330,), seed=23)[0]
    a, b, c = (shared + tail for tail in prompts((20, 45, 131), seed=24))
    e = engine(prefix_caching=True)
    outs = [e.generate([p], GREEDY)[0] for p in (a, b, c)]
    assert [o.cached_tokens for o in outs] == [0, 256, 256]
    assert [o.token_ids for o in outs] == cold([a, b, c])
    # served together once the prefix is cached: both hit, tokens unchanged
    together = e.generate([c, b], GREEDY)
    assert [o.cached_tokens for o in together] == [384, 256]  # c's own 4th block was published by its first run
    assert [o.token_ids for o in together] == [outs[2].token_ids, outs[1].token_ids]


def test_a_generated_block_is_published_and_hit_by_a_follow_up_turn():
    """The follow-up turn resends prompt + answer: the blocks filled while decoding are hit too."""
    prompt = prompts((250,), seed=25)[0]
    e = engine(prefix_caching=True)
    first = e.generate([prompt], SamplingParams(max_new_tokens=20))[0]  # 270 tokens: blocks 0 and 1 filled
    follow_up = prompt + list(first.token_ids) + prompts((30,), seed=26)[0]
    out = e.generate([follow_up], GREEDY)[0]
    assert out.cached_tokens == 256 and out.token_ids == cold([follow_up])[0]


SMALL = dict(max_requests=2, max_tokens=384)  # 4 blocks of 128 tokens: two requests growing to 3 blocks collide


@pytest.mark.parametrize("shared", [False, True])
def test_preemption_with_caching_gives_the_tokens_of_caching_off(shared):
    """Two 200-token prompts (with or without a shared 128-token first block) growing to 300 tokens in 4 blocks:
    the later one is preempted and recomputed; with caching its readmission hits blocks still cached."""
    tails = prompts((200, 200), seed=27)
    token_lists = [tails[0][:128] + t[128:] for t in tails] if shared else tails
    params = SamplingParams(max_new_tokens=100)
    off = engine(**SMALL)
    want = off.generate(token_lists, params)
    on = engine(prefix_caching=True, **SMALL)
    got = on.generate(token_lists, params)
    assert off.stats.preemptions > 0 and on.stats.preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert on.stats.prefix_hits > 0
    assert on.stats.prefill_tokens < off.stats.prefill_tokens
    assert on.cache.num_live_requests == 0 and on.cache.num_used_blocks == 0


def test_caching_off_reports_nothing_and_needs_no_token_ids():
    e = engine()
    prompt = prompts((300,), seed=21)[0]
    outs = e.generate([prompt, prompt], GREEDY)
    assert [o.cached_tokens for o in outs] == [0, 0] and e.cache.prefix_stats is None
    s = e.stats
    assert (s.prefix_queries, s.prefix_hits, s.prefix_hit_tokens, s.prefix_hit_rate) == (0, 0, 0, 0.0)


def test_prefix_snapshots_need_prefix_caching():
    with pytest.raises(ValueError, match="prefix_snapshots"):
        engine(prefix_snapshots=4)


def serve_staggered(e, first, later, params) -> list[tuple[int, ...]]:
    """`first` queued and prefilled in one step, then `later` queued; served to the end."""
    ids = [e.add_request(p, params) for p in first]
    e.step()
    ids += [e.add_request(p, params) for p in later]
    while e.has_unfinished:
        e.step()
    return [e.output(i).token_ids for i in ids]


def test_preempting_a_request_that_shares_blocks_frees_only_its_own():
    """A and C (138 tokens each, 2 blocks each) decode in step; B (133 tokens) hits A's first block, so it holds
    one block of its own: 5 blocks, all used. When A and C both need a 3rd block in the same step, preempting B
    frees one block (the shared one stays A's), so C must be preempted too rather than planned into a block
    that is not free."""
    p, q = prompts((128, 128), seed=28)
    x, y, z = prompts((10, 10, 5), seed=29)
    params = SamplingParams(max_new_tokens=130)
    small = dict(max_requests=3, max_tokens=384, step_tokens=512)  # 3 + 2 = 5 blocks
    want = serve_staggered(engine(**small), [p + x, q + y], [p + z], params)
    e = engine(prefix_caching=True, **small)
    assert e.cache.num_blocks == 5
    got = serve_staggered(e, [p + x, q + y], [p + z], params)
    assert got == want
    assert e.stats.prefix_hits >= 1 and e.stats.preemptions >= 2
