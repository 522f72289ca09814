"""The engine's API, scheduler, sampler, errors and checkpoint loading on the tiny three-layer model (CPU, exact
mode unless said). Token-level agreement with transformers is tests/test_engine_oracle.py."""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest
import torch

from dsv4kv import CacheManager, RequestError, WeightError
from dsv4kv.engine import DSV4Model, Engine, SamplingParams
from dsv4kv.engine.reference import random_model, reference_logits, tiny_config, with_dtype
from dsv4kv.engine.request import Request, Status
from dsv4kv.engine.sampler import sample, sample_with_logprobs
from dsv4kv.engine.scheduler import ScheduledStep, Scheduler

EXACT = dict(kv_format="bf16", indexer_format="bf16")
CACHE = dict(max_requests=4, max_tokens=1024, page_tokens=128, step_tokens=96, **EXACT)


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def tiny_model():
    return random_model(tiny_config(), seed=0)


def engine(**overrides) -> Engine:
    return Engine.from_transformers(tiny_model(), **{**CACHE, **overrides})


def prompts(lengths, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


@functools.lru_cache(maxsize=None)
def greedy_reference(lengths=(131, 47, 9), new_tokens=6) -> tuple:
    return tuple(o.token_ids for o in engine().generate(prompts(lengths), SamplingParams(max_new_tokens=new_tokens)))


# --- SamplingParams and the sampler -----------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("max_new_tokens", 0), ("max_new_tokens", 2.0), ("temperature", -0.1),
                                         ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
                                         ("top_k", -1), ("seed", -3), ("seed", 1.5), ("stop_token_ids", "ab"),
                                         ("stop_token_ids", (1, -2)), ("max_new_tokens", True),
                                         ("logprobs", -1), ("logprobs", 65), ("logprobs", 2.0), ("logprobs", True),
                                         ("logprobs", None)])
def test_sampling_params_refuse_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_greedy_is_the_argmax_and_top_k_1_is_greedy():
    logits = torch.randn(5, 37, generator=torch.Generator().manual_seed(0))
    want = logits.argmax(-1).tolist()
    greedy = [SamplingParams()] * 5
    assert sample(logits, greedy, [None] * 5) == want
    hot = [SamplingParams(temperature=2.0, top_k=1, seed=s) for s in range(5)]
    assert sample(logits, hot, [torch.Generator().manual_seed(s) for s in range(5)]) == want
    nucleus = [SamplingParams(temperature=1.0, top_p=1e-6, seed=s) for s in range(5)]
    assert sample(logits, nucleus, [torch.Generator().manual_seed(s) for s in range(5)]) == want


def test_sampling_follows_the_distribution_within_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.07, 0.03]]))
    g = torch.Generator().manual_seed(11)
    counts = torch.zeros(5)
    for _ in range(3000):
        counts[sample(logits, [SamplingParams(temperature=1.0, top_k=3)], [g])[0]] += 1
    assert counts[3:].sum() == 0
    torch.testing.assert_close(counts[:3] / 3000, torch.tensor([4, 3, 2]) / 9, atol=0.03, rtol=0)
    counts.zero_()
    for _ in range(3000):  # top_p 0.75: 0.4 + 0.3 < 0.75, so the third token is kept, the rest are not
        counts[sample(logits, [SamplingParams(temperature=1.0, top_p=0.75)], [g])[0]] += 1
    assert counts[3:].sum() == 0 and counts[2] > 0


def test_a_sampled_row_does_not_depend_on_the_other_rows():
    """Rows are sampled together (one softmax, sort and search over the batch); each row's token equals the one it
    gets alone, for mixed temperatures, top-k, top-p and greedy rows, with generators seeded alike."""
    logits = torch.randn(7, 1009, generator=torch.Generator().manual_seed(2)) * 3
    params = [SamplingParams(temperature=0.7, seed=1), SamplingParams(), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.2, top_k=40, top_p=0.5),
              SamplingParams(temperature=2.0), SamplingParams(temperature=1.0, top_k=1009, top_p=0.999)]
    for trial in range(20):
        seeds = [100 * trial + r for r in range(len(params))]
        together = sample(logits, params, [torch.Generator().manual_seed(s) for s in seeds])
        alone = [sample(logits[r:r + 1], params[r:r + 1], [torch.Generator().manual_seed(seeds[r])])[0]
                 for r in range(len(params))]
        assert together == alone
        assert together[1] == int(logits[1].argmax())


def test_sampler_refuses_half_precision_logits():
    with pytest.raises(ValueError, match="float32"):
        sample(torch.zeros(1, 8, dtype=torch.bfloat16), [SamplingParams()], [None])


def test_sampler_logprobs_are_log_softmax_of_the_rows_that_ask():
    """Mixed rows (greedy, sampled; some asking for 3 or 7 logprobs, some not): the asking rows get the top of
    log_softmax of their own fp32 logits (before temperature), best first, and their token's own logprob; the others
    None; the tokens are those of `sample`. More than the vocabulary gives the whole vocabulary."""
    logits = torch.randn(5, 37, generator=torch.Generator().manual_seed(4)) * 2
    params = [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(temperature=0.8, seed=1, logprobs=7),
              SamplingParams(temperature=1.2, seed=2), SamplingParams(logprobs=64)]
    gens = lambda: [torch.Generator().manual_seed(s) if not p.greedy else None for s, p in enumerate(params)]
    got = sample_with_logprobs(logits, params, gens())
    assert got.tokens == sample(logits, params, gens())
    assert got.tokens[0] == int(logits[0].argmax()) and got.tokens[4] == int(logits[4].argmax())
    reference = torch.log_softmax(logits, dim=-1)
    for row, p in enumerate(params):
        if not p.logprobs:
            assert got.logprobs[row] is None and got.token_logprobs[row] is None
            continue
        top = reference[row].topk(min(p.logprobs, 37))
        assert [i for i, _ in got.logprobs[row]] == top.indices.tolist()
        assert [v for _, v in got.logprobs[row]] == top.values.tolist()  # the same fp32 values, exactly
        assert got.token_logprobs[row] == float(reference[row, got.tokens[row]])
    assert len(got.logprobs[4]) == 37
    none = sample_with_logprobs(logits, [SamplingParams()] * 5, [None] * 5)
    assert none.logprobs == [None] * 5 and none.token_logprobs == [None] * 5


def run_step(cache: CacheManager, step, sampled: int = 1) -> None:
    """What the engine does with a scheduled step, minus the model: plan it, advance, sample a token."""
    assert cache.plan_step([(r.cache_id, n) for r, n in step.batch])
    for r, n in step.batch:
        r.num_computed += n
        if r.pending == 0:
            r.tokens.append(sampled)


# --- serving ------------------------------------------------------------------------------------------------
def test_generate_returns_outputs_in_prompt_order_with_timings():
    e = engine()
    token_lists = prompts((131, 47, 9))
    outputs = e.generate(token_lists, [SamplingParams(max_new_tokens=n) for n in (6, 3, 1)])
    assert [o.prompt_token_ids for o in outputs] == [tuple(p) for p in token_lists]
    again = engine().generate([torch.tensor(token_lists[1]), np.array(token_lists[2])],
                              [SamplingParams(max_new_tokens=n) for n in (3, 1)])
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs[1:]]
    assert [len(o.token_ids) for o in outputs] == [6, 3, 1]
    assert all(o.finished and o.finish_reason == "length" and o.cached_tokens == 0 for o in outputs)
    assert all(o.ttft > 0 for o in outputs) and outputs[0].itl > 0 and outputs[2].itl is None
    assert e.cache.num_live_requests == 0 and e.cache.num_used_blocks == 0 and not e.has_unfinished


def test_each_step_respects_the_budget_decodes_first_then_prefill_in_arrival_order():
    cache = CacheManager(tiny_model_geometry(), max_requests=4, max_tokens=1024, page_tokens=128, **EXACT)
    scheduler = Scheduler(cache, step_tokens=50)
    a, b, c = (Request(i, tuple(range(n)), SamplingParams(), None) for i, n in enumerate((30, 70, 40)))
    for r in (a, b, c):
        scheduler.add(r)
    step = scheduler.schedule()
    assert [(r.id, n) for r, n in step.batch] == [(0, 30), (1, 20)]  # c waits: no budget left to admit it
    run_step(cache, step)  # a sampled its first token: one pending, a decode
    step = scheduler.schedule()
    assert [(r.id, n) for r, n in step.batch] == [(0, 1), (1, 49)]
    assert not step.is_decode
    run_step(cache, step)
    step = scheduler.schedule()  # two decodes, then c admitted with the rest of the budget
    assert [(r.id, n) for r, n in step.batch] == [(0, 1), (1, 1), (2, 40)]
    assert c.status is Status.RUNNING and not step.preempted
    run_step(cache, step)
    assert scheduler.schedule().is_decode


def test_preemption_takes_the_most_recently_admitted_request():
    cache = CacheManager(tiny_model_geometry(), max_requests=3, max_tokens=256, page_tokens=128, num_blocks=3,
                         **EXACT)
    scheduler = Scheduler(cache, step_tokens=512)
    old, new = (Request(i, tuple(range(n)), SamplingParams(), None) for i, n in enumerate((128, 200)))
    scheduler.add(old)
    scheduler.add(new)
    step = scheduler.schedule()
    assert [(r.id, n) for r, n in step.batch] == [(0, 128), (1, 200)]
    run_step(cache, step)
    assert cache.num_free_blocks == 0
    step = scheduler.schedule()  # old's decode needs a 2nd block: new, admitted last, is preempted
    assert step.preempted == [new] and [(r.id, n) for r, n in step.batch] == [(0, 1)]
    assert new.status is Status.WAITING and new.preemptions == 1 and new.num_computed == 0 and new.cache_id is None
    assert new.tokens == list(range(200)) + [1]  # its sampled token is kept: recompute feeds all 201
    run_step(cache, step)
    step = scheduler.schedule()  # one block free, new needs 2 for its 201 tokens: it waits
    assert [(r.id, n) for r, n in step.batch] == [(0, 1)] and list(scheduler.waiting) == [new]
    run_step(cache, step)
    scheduler.finish(old, "stop")
    step = scheduler.schedule()
    assert [(r.id, n) for r, n in step.batch] == [(1, 201)] and cache.num_live_requests == 1


def test_a_prefill_chunk_shrinks_to_the_free_blocks_before_preempting():
    cache = CacheManager(tiny_model_geometry(), max_requests=2, max_tokens=256, page_tokens=128, num_blocks=3,
                         **EXACT)
    scheduler = Scheduler(cache, step_tokens=100)
    a, b = (Request(i, tuple(range(n)), SamplingParams(), None) for i, n in enumerate((250, 120)))
    scheduler.add(a)
    scheduler.add(b)
    step = scheduler.schedule()
    assert [(r.id, n) for r, n in step.batch] == [(0, 100)]  # b not admitted: no budget left
    run_step(cache, step)
    step = scheduler.schedule()
    assert [(r.id, n) for r, n in step.batch] == [(0, 100)]
    run_step(cache, step)
    step = scheduler.schedule()  # a: 50 left; b admitted (1 block) with the other 50
    assert [(r.id, n) for r, n in step.batch] == [(0, 50), (1, 50)] and not step.preempted


def test_a_step_with_both_waiting_and_running_stays_in_arrival_order_after_preemption():
    cache = CacheManager(tiny_model_geometry(), max_requests=3, max_tokens=256, page_tokens=128, num_blocks=3,
                         **EXACT)
    scheduler = Scheduler(cache, step_tokens=512)
    requests = [Request(i, tuple(range(n)), SamplingParams(), None) for i, n in enumerate((128, 100, 60))]
    for r in requests[:2]:
        scheduler.add(r)
    run_step(cache, scheduler.schedule())
    scheduler.add(requests[2])
    scheduler._preempt(requests[1], ScheduledStep())
    assert [r.id for r in scheduler.waiting] == [1, 2]  # the preempted request keeps its place by arrival


def tiny_model_geometry():
    return DSV4Model.from_transformers(tiny_model()).geometry


def test_seeded_sampling_gives_the_same_tokens_alone_and_in_a_batch():
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    target = prompts((140,), seed=9)[0]
    alone = engine().generate([target], params)[0].token_ids
    others = [SamplingParams(max_new_tokens=5, temperature=1.3, seed=7), SamplingParams(max_new_tokens=9),
              SamplingParams(max_new_tokens=3, temperature=0.5)]  # the last one draws a fresh seed
    batched = engine().generate(prompts((33, 150, 12)) + [target], others + [params])
    assert batched[3].token_ids == alone
    assert engine().generate([target], SamplingParams(**{**params.__dict__, "seed": 99}))[0].token_ids != alone


def test_greedy_tokens_do_not_depend_on_the_batch():
    alone = [engine().generate([p], SamplingParams(max_new_tokens=6))[0].token_ids for p in prompts((131, 47, 9))]
    assert tuple(alone) == greedy_reference()


def test_stop_token_ends_the_request_and_is_kept():
    want = greedy_reference()[0]
    stop = want[2]
    out = engine().generate(prompts((131,)), SamplingParams(max_new_tokens=6, stop_token_ids=[stop]))[0]
    first = want.index(stop)
    assert out.token_ids == want[:first + 1] and out.finish_reason == "stop"


def test_a_request_stops_at_max_seq_len():
    e = engine(max_seq_len=140)
    out = e.generate(prompts((131,)), SamplingParams(max_new_tokens=50))[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"  # 131 + 9 fed = 140; the 10th is not fed
    assert out.token_ids == engine().generate(prompts((131,)), SamplingParams(max_new_tokens=10))[0].token_ids


def test_max_seq_len_is_what_the_blocks_hold():
    """max_seq_len 4096 over a cache of 3 blocks of 128 tokens: requests are bounded by the 384 tokens the blocks
    hold, so a long prompt is refused instead of waiting forever for blocks."""
    e = engine(max_requests=2, max_tokens=256, max_seq_len=4096)
    assert e.cache.num_blocks == 3 and e.max_seq_len == 384
    with pytest.raises(ValueError, match="400 tokens, the cache holds at most 384"):
        e.add_request(list(range(400)))
    out = e.generate(prompts((380,)), SamplingParams(max_new_tokens=20))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_decode_steps_through_padded_graph_steps_give_the_same_tokens():
    """On a CPU the decode-graph path runs eagerly over padded rows (position -1, token 0) with the batched MoE:
    the same tokens as the eager steps."""
    e = engine(decode_graph_sizes=(2, 4))
    assert e.runner.graphs and not any(g.capture for g in e.runner.graphs.values())
    outputs = e.generate(prompts((131, 47, 9)), SamplingParams(max_new_tokens=6))
    assert e.stats.graph_steps > 0
    assert tuple(o.token_ids for o in outputs) == greedy_reference()


def test_the_kernel_path_serves_the_reference_tokens():
    """bf16 weights with the attention on the Triton kernels (on a CPU under Triton's interpreter, on CUDA compiled
    and with decode steps captured as CUDA graphs), decode steps through padded graph steps: the same greedy tokens
    as the PyTorch reference."""
    from dsv4kv.backend import kernels_can_run

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not kernels_can_run(device):
        pytest.skip("Triton is not installed, or TRITON_INTERPRET is off on a CPU")
    model = with_dtype(random_model(tiny_config(), seed=0, device=device), torch.bfloat16)
    token_lists = prompts((33, 9), seed=5)
    got = {}
    for backend, sizes in (("torch", ()), ("triton", (2,))):
        e = Engine.from_transformers(model, max_requests=2, max_tokens=256, page_tokens=128, step_tokens=64,
                                     max_seq_len=128, decode_graph_sizes=sizes, **EXACT)
        for layer in e.model.attention_layers:
            layer.backend = backend
        got[backend] = [o.token_ids for o in e.generate(token_lists, SamplingParams(max_new_tokens=3))]
        if backend == "triton":
            assert e.stats.graph_steps == 2, e.stats
    assert got["triton"] == got["torch"]


def test_cuda_graph_sizes_are_checked():
    with pytest.raises(ValueError, match="decode_graph_sizes"):
        engine(decode_graph_sizes=(2, 8))
    with pytest.raises(TypeError, match="DSV4Model"):
        Engine(tiny_model(), max_requests=2, max_tokens=256)
    with pytest.raises(TypeError, match="DeepseekV4ForCausalLM"):
        DSV4Model.from_transformers(torch.nn.Linear(2, 2))


BAD_PROMPTS = [([], ValueError, "empty"), ([1, 512], ValueError, "outside the vocabulary"),
               ([-1], ValueError, "vocabulary"), ([1, 2.0], ValueError, "vocabulary"), ([True], ValueError, "vocabulary"),
               ("abc", TypeError, "sequence"), (list(range(300)) * 4, ValueError, "at most 1024"),
               (torch.ones(2, 2, dtype=torch.long), ValueError, "1-D")]


def test_bad_input_is_refused_and_leaves_other_requests_untouched():
    e = engine()
    ids = [e.add_request(p, SamplingParams(max_new_tokens=6)) for p in prompts((131, 47, 9))]
    e.step()
    for prompt, error, match in BAD_PROMPTS:  # between steps, with requests mid-prefill and mid-decode
        with pytest.raises(error, match=match):
            e.add_request(prompt, SamplingParams(max_new_tokens=3))
        with pytest.raises(error, match="prompts\\[1\\]"):
            e.generate([[1, 2], prompt], SamplingParams(max_new_tokens=2))  # nothing of it is queued
        e.step()
    with pytest.raises(TypeError, match="SamplingParams"):
        e.add_request([1, 2], {"max_new_tokens": 3})
    with pytest.raises(RequestError, match="unknown request id 17"):
        e.abort(17)
    with pytest.raises(RequestError, match="unknown request id 'a'"):
        e.output("a")
    while e.has_unfinished:
        e.step()
    assert tuple(e.output(i).token_ids for i in ids) == greedy_reference()


def test_abort_releases_the_request_and_the_others_go_on():
    e = engine()
    ids = [e.add_request(p, SamplingParams(max_new_tokens=6)) for p in prompts((131, 47, 9))]
    for _ in range(3):
        e.step()
    used = e.cache.num_used_blocks
    e.abort(ids[0])
    assert e.cache.num_used_blocks < used and e.cache.num_live_requests == 2
    e.abort(ids[0])  # already finished: nothing happens
    while e.has_unfinished:
        e.step()
    aborted = e.output(ids[0])
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) < 6
    assert tuple(e.output(i).token_ids for i in ids[1:]) == greedy_reference()[1:]
    with pytest.raises(RequestError, match="output was read"):
        e.output(ids[1])


def test_step_reports_each_new_token_once():
    e = engine()
    ids = [e.add_request(p, SamplingParams(max_new_tokens=4)) for p in prompts((131, 47))]
    seen = {i: [] for i in ids}
    finished = set()
    while e.has_unfinished:
        for request_id, tokens, done in e.step():
            assert request_id not in finished
            seen[request_id] += tokens
            if done:
                finished.add(request_id)
    assert finished == set(ids)
    assert [tuple(seen[i]) for i in ids] == [o[:4] for o in greedy_reference()[:2]]


def test_generate_checks_params_count():
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        engine().generate(prompts((5, 6, 7)), [SamplingParams()] * 2)


# --- logprobs ------------------------------------------------------------------------------------------------
LOGPROBS_TOL = 0.02  # exact mode's bf16 cache rounding moves the logprobs by <= 0.011 here (measured)


def test_logprobs_are_log_softmax_of_transformers_logits():
    """Exact mode, fp32 weights: at every generated position the top-5 logprobs are those of log_softmax of
    transformers' fp32 logits (teacher-forced over prompt + generated tokens), the same tokens in the same order;
    under greedy the generated token is the first and its logprob the largest; asking does not change the tokens."""
    token_lists = prompts((131, 47, 9))
    outputs = engine().generate(token_lists, SamplingParams(max_new_tokens=6, logprobs=5))
    assert tuple(o.token_ids for o in outputs) == greedy_reference()
    for prompt, out in zip(token_lists, outputs):
        assert len(out.logprobs) == len(out.token_logprobs) == len(out.token_ids) == 6
        logits = reference_logits(tiny_model(), list(prompt) + list(out.token_ids))
        rows = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:len(prompt) - 1 + 6]  # row k predicts token k
        for k, (top, own, token) in enumerate(zip(out.logprobs, out.token_logprobs, out.token_ids)):
            want = rows[k].topk(5)
            assert [i for i, _ in top] == want.indices.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in top]), want.values, rtol=0, atol=LOGPROBS_TOL)
            assert top[0][0] == token and own == top[0][1] == max(v for _, v in top)
    plain = engine().generate(token_lists[:1], SamplingParams(max_new_tokens=6))[0]
    assert plain.logprobs is None and plain.token_logprobs is None


def test_logprobs_do_not_change_seeded_sampling_and_follow_the_sampled_token():
    """Sampled tokens are the same with or without logprobs, alone or beside greedy requests that ask for none; a
    sampled token's logprob is its own (in its top list when it is there, and never above the top)."""
    target = prompts((140,), seed=9)[0]
    params = SamplingParams(max_new_tokens=8, temperature=1.5, seed=1234)
    plain = engine().generate([target], params)[0]
    asked = engine().generate(prompts((33,)) + [target], [SamplingParams(max_new_tokens=4),
                                                         SamplingParams(**{**params.__dict__, "logprobs": 64})])
    assert asked[1].token_ids == plain.token_ids and asked[0].logprobs is None
    out = asked[1]
    for top, own, token in zip(out.logprobs, out.token_logprobs, out.token_ids):
        assert own <= top[0][1] and dict(top).get(token, own) == own
    assert any(token != top[0][0] for top, token in zip(out.logprobs, out.token_ids))  # temperature 1.5 strays


def test_logprobs_through_padded_decode_graph_steps_and_preemption():
    """Decode steps through padded graph steps (a view of the graph's logits, read before the next step), and a
    cache so small that requests are preempted and recomputed: the same tokens and logprobs as plain eager steps
    with room, one list per generated token."""
    token_lists = prompts((125, 122, 120), seed=6)
    params = SamplingParams(max_new_tokens=12, logprobs=4)
    want = engine().generate(token_lists, params)
    graphs = engine(decode_graph_sizes=(2, 4))
    padded = graphs.generate(token_lists, params)
    small = engine(max_requests=3, max_tokens=256)  # 4 blocks for 3 requests that each grow into a second
    preempted = small.generate(token_lists, params)
    assert graphs.stats.graph_steps > 0 and small.stats.preemptions > 0
    for got in (padded, preempted):
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for o, w in zip(got, want):
            assert len(o.logprobs) == len(o.token_logprobs) == 12
            assert [[i for i, _ in top] for top in o.logprobs] == [[i for i, _ in top] for top in w.logprobs]
            values = torch.tensor([[v for _, v in top] for top in o.logprobs])
            torch.testing.assert_close(values, torch.tensor([[v for _, v in top] for top in w.logprobs]),
                                       rtol=0, atol=1e-4)
            assert o.token_logprobs == tuple(top[0][1] for top in o.logprobs)


# --- next_token_logits ----------------------------------------------------------------------------------------
def test_next_token_logits_are_transformers_logits_and_leave_the_engine_usable():
    """Exact mode (bf16 cache rounding: measured <= 0.012 off transformers' fp32 logits), the 131-token prompt in
    two chunks of the 96-token budget; afterwards the engine serves the tokens of a fresh one."""
    e = engine()
    token_lists = prompts((131, 47, 9))
    logits = e.next_token_logits(token_lists)
    assert logits.dtype == torch.float32 and logits.shape == (3, 512) and e.stats.steps == 2
    for prompt, row in zip(token_lists, logits):
        torch.testing.assert_close(row, reference_logits(tiny_model(), prompt, last=1)[0], rtol=0, atol=0.03)
    assert not e.has_unfinished and e.cache.num_live_requests == 0 and e.cache.num_used_blocks == 0
    outputs = e.generate(token_lists, SamplingParams(max_new_tokens=6))
    assert tuple(o.token_ids for o in outputs) == greedy_reference()
    assert logits.argmax(-1).tolist() == [t[0] for t in greedy_reference()]
    assert e.next_token_logits([]).shape == (0, 512)


def test_next_token_logits_are_the_engines_own():
    """Official mode (FP8 entries, MXFP4 indexer keys) moves the logits well past exact mode's (measured 0.35), and
    its greedy token is the argmax of its own logits."""
    official = dict(kv_format="fp8", indexer_format="mxfp4")
    token_lists = prompts((131, 47, 9))
    logits = engine(**official).next_token_logits(token_lists)
    assert (logits - engine().next_token_logits(token_lists)).abs().max() > 0.1
    outputs = engine(**official).generate(token_lists, SamplingParams(max_new_tokens=1))
    assert logits.argmax(-1).tolist() == [o.token_ids[0] for o in outputs]


def test_next_token_logits_refuse_bad_input_and_requests_in_flight():
    e = engine()
    for prompt, error, match in BAD_PROMPTS:
        with pytest.raises(error, match="prompts\\[1\\]"):
            e.next_token_logits([[1, 2], prompt])  # nothing of it is queued
    with pytest.raises(TypeError, match="list of token id lists"):
        e.next_token_logits("abc")
    assert not e.has_unfinished
    rid = e.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="in flight"):
        e.next_token_logits([[4, 5]])
    while e.has_unfinished:
        e.step()
    assert len(e.output(rid).token_ids) == 2 and e.next_token_logits([[4, 5]]).shape == (1, 512)


# --- checkpoints --------------------------------------------------------------------------------------------
def test_from_pretrained_reads_what_transformers_saves(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    e = Engine.from_pretrained(tmp_path, dtype=torch.float32, device="cpu", **CACHE)
    outputs = e.generate(prompts((131, 47, 9)), SamplingParams(max_new_tokens=6))
    assert tuple(o.token_ids for o in outputs) == greedy_reference()


def quantize_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] -> e4m3 [out, in] and ue8m0 scales [ceil(out/128), ceil(in/128)] (power-of-two per block)."""
    rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
    padded = torch.zeros(rows * 128, cols * 128)
    padded[:w.shape[0], :w.shape[1]] = w
    amax = padded.view(rows, 128, cols, 128).abs().amax((1, 3)).clamp(min=1e-30)
    exponents = torch.ceil(torch.log2(amax / 448.0))
    scale = torch.pow(2.0, exponents).repeat_interleave(128, 0).repeat_interleave(128, 1)[:w.shape[0], :w.shape[1]]
    return (w / scale).to(torch.float8_e4m3fn), (exponents + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


OFFICIAL_ATTENTION = {"q_a_proj": "wq_a", "q_a_norm": "q_norm", "q_b_proj": "wq_b", "kv_proj": "wkv",
                      "kv_norm": "kv_norm", "o_a_proj": "wo_a", "o_b_proj": "wo_b", "sinks": "attn_sink",
                      "compressor.indexer.kv_proj": "indexer.compressor.wkv",
                      "compressor.indexer.gate_proj": "indexer.compressor.wgate",
                      "compressor.indexer.position_bias": "indexer.compressor.ape",
                      "compressor.indexer.kv_norm": "indexer.compressor.norm",
                      "compressor.indexer.q_b_proj": "indexer.wq_b",
                      "compressor.indexer.scorer.weights_proj": "indexer.weights_proj",
                      "compressor.kv_proj": "compressor.wkv", "compressor.gate_proj": "compressor.wgate",
                      "compressor.position_bias": "compressor.ape", "compressor.kv_norm": "compressor.norm"}
OFFICIAL_BLOCK = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                  "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
                  "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
                  "mlp.gate.weight": "ffn.gate.weight", "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
                  "mlp.gate.tid2eid": "ffn.gate.tid2eid",
                  "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
                  "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
                  "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight"}
OFFICIAL_TOP = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
                "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
                "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}


def official_checkpoint(model, quantize) -> tuple[dict, dict]:
    """(the model's weights in official DeepSeek names, FP8 blocks for the 2-D weights `quantize` picks and every
    expert matrix; what the loader must produce for each transformers name)."""
    state, expected = {}, {}

    def put(official: str, hf: str, value: torch.Tensor, fp8: bool):
        if fp8:
            q, scale = quantize_fp8_blocks(value.float())
            state[official], state[official[:-len("weight")] + "scale"] = q, scale
            expected[hf] = q.float() * scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[
                :value.shape[0], :value.shape[1]]
        else:
            state[official], expected[hf] = value, value

    full = dict(model.state_dict())
    for key, value in full.items():
        if "rotary_emb" in key:
            continue
        if key in OFFICIAL_TOP:
            put(OFFICIAL_TOP[key], key, value, quantize(key))
            continue
        _, _, i, tail = key.split(".", 3)
        prefix = f"layers.{i}."
        if tail.startswith("self_attn."):
            name = tail[len("self_attn."):]
            if name.endswith(".weight"):
                name = OFFICIAL_ATTENTION[name[:-len(".weight")]] + ".weight"
                put(f"{prefix}attn.{name}", key, value, value.dim() == 2 and quantize(key))
            else:  # sinks, position biases
                put(f"{prefix}attn.{OFFICIAL_ATTENTION[name]}", key, value, False)
        elif tail.startswith("mlp.experts."):
            experts = value.shape[0]
            for e in range(experts):
                if tail.endswith("gate_up_proj"):
                    gate, up = value[e].chunk(2, dim=0)
                    put(f"{prefix}ffn.experts.{e}.w1.weight", f"{key}/{e}/w1", gate, True)
                    put(f"{prefix}ffn.experts.{e}.w3.weight", f"{key}/{e}/w3", up, True)
                else:
                    put(f"{prefix}ffn.experts.{e}.w2.weight", f"{key}/{e}/w2", value[e], True)
        else:
            put(prefix + OFFICIAL_BLOCK[tail], key, value, value.dim() == 2 and quantize(key))
    for key in [k for k in expected if "/" in k]:  # restack the experts the loader must rebuild
        name, e, part = key.split("/")
        expected.setdefault(name + "/parts", {})[(int(e), part)] = expected.pop(key)
    for key in [k for k in expected if k.endswith("/parts")]:
        parts, name = expected.pop(key), key[:-len("/parts")]
        count = 1 + max(e for e, _ in parts)
        if name.endswith("gate_up_proj"):
            expected[name] = torch.stack([torch.cat((parts[(e, "w1")], parts[(e, "w3")])) for e in range(count)])
        else:
            expected[name] = torch.stack([parts[(e, "w2")] for e in range(count)])
    return state, expected


def write_checkpoint(path, model, state) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_dict(), f)
    names = sorted(state)
    save_file({k: state[k].contiguous() for k in names[:len(names) // 2]}, os.path.join(path, "part-1.safetensors"))
    save_file({k: state[k].contiguous() for k in names[len(names) // 2:]}, os.path.join(path, "part-2.safetensors"))


def test_from_pretrained_official_names_with_fp8_blocks(tmp_path):
    """Official names, two shards, FP8 128x128 blocks (ue8m0 scales) for attention projections, the shared expert,
    every routed expert and the LM head: the engine serves the dequantized model's tokens."""
    model = tiny_model()
    fp8 = lambda key: key.endswith(("q_b_proj.weight", "o_a_proj.weight", "shared_experts.down_proj.weight",
                                    "lm_head.weight", "compressor.kv_proj.weight"))
    state, expected = official_checkpoint(model, fp8)
    write_checkpoint(tmp_path, model, state)
    dequantized = random_model(tiny_config(), seed=0)
    dequantized.load_state_dict(expected, strict=False)
    for key, value in expected.items():
        assert torch.equal(dequantized.state_dict()[key].float(), value.float()), key
    want = Engine.from_transformers(dequantized, **CACHE).generate(prompts((131, 47)), SamplingParams(max_new_tokens=5))
    got = Engine.from_pretrained(tmp_path, dtype=torch.float32, device="cpu", **CACHE).generate(
        prompts((131, 47)), SamplingParams(max_new_tokens=5))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_from_pretrained_refuses_missing_and_unexpected_weights(tmp_path):
    model = tiny_model()
    state, _ = official_checkpoint(model, lambda key: False)
    write_checkpoint(tmp_path / "missing", model, {k: v for k, v in state.items() if k != "layers.1.hc_ffn_base"})
    with pytest.raises(WeightError, match="layers.1.ffn_hc: missing \\['base'\\]"):
        Engine.from_pretrained(tmp_path / "missing", device="cpu", **CACHE)
    write_checkpoint(tmp_path / "extra", model, {**state, "layers.0.ffn.surprise.weight": torch.zeros(2)})
    with pytest.raises(WeightError, match="unexpected .*surprise"):
        Engine.from_pretrained(tmp_path / "extra", device="cpu", **CACHE)
    write_checkpoint(tmp_path / "fp4", model, {**state, "layers.0.ffn.experts.0.w1.weight": torch.zeros(64, 64,
                     dtype=torch.int8), "layers.0.ffn.experts.0.w1.scale": torch.zeros(64, 4)})
    with pytest.raises(WeightError, match="FP4"):
        Engine.from_pretrained(tmp_path / "fp4", device="cpu", **CACHE)
    with pytest.raises(FileNotFoundError, match="config.json"):
        Engine.from_pretrained(tmp_path / "nothing", device="cpu", **CACHE)
