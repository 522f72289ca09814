"""Speculative decoding (issue 38, the engine side): the drafters, the verification's statistics, the MTP layer and
its checkpoint names, and the engine's tokens with speculation against plain decoding on the tiny three-layer model
(CPU, exact mode unless said)."""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch

from dsv4kv.engine import DSV4Model, Engine, SamplingParams
from dsv4kv.engine.drafters import DraftRequest, Drafter, NgramDrafter, ObservedRows
from dsv4kv.engine.mtp import MTPDrafter, MTPLayer
from dsv4kv.engine.reference import random_model, tiny_config
from dsv4kv.engine.sampler import probabilities, sample_with_logprobs, uniform
from dsv4kv.engine.speculative_sampling import accepted_prefix, advance, peek_uniforms, rejection_sample
from dsv4kv.model.weights import OFFICIAL_NAMES

from test_engine import CACHE, EXACT, tiny_model

# the 0.999 quantile of the chi-square distribution by degrees of freedom: a correct sampler fails 1 time in 1000
# per comparison, and the seeds are fixed
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458}


pytestmark = pytest.mark.usefixtures("one_thread")




def prompts(lengths, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) of observed counts against probabilities, over the tokens of nonzero
    probability (a token of probability 0 must never be seen: asserted)."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token of probability 0 was drawn"
    expected = probs[support] * counts.sum()
    assert expected.min() >= 5, "too few draws for the chi-square approximation"
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


# --- drafters ---------------------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    d = NgramDrafter(max_n=3, min_n=1)
    ask = lambda tokens, k, rid=0: d.propose([DraftRequest(rid, tokens, k)])[0]
    assert ask([5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]  # the latest of two 3-gram matches
    assert ask([4, 4, 6, 2, 3, 1, 2, 3], 3, rid=1) == [1, 2, 3]  # (2, 3) earlier ends at 5; it reaches the end,
    assert ask([4, 7, 6], 3, rid=2) == []  # then repeats with its period; no match at all: no drafts
    assert ask([1, 9, 5, 9], 2, rid=3) == [5, 9]  # n = 1: the last token alone
    assert ask([9, 9, 9, 9], 4, rid=4) == [9, 9, 9, 9]
    assert ask([3, 1, 2, 3], 0, rid=5) == []
    # the index grows with the request and starts over when its tokens were replaced
    assert ask([5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3, 7], 3) == [8, 1, 2]
    assert ask([6, 6, 1], 2) == []
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(max_n=2, min_n=3)


def test_ngram_drafts_equal_a_brute_force_search():
    """Random token sequences over a small vocabulary, grown a few tokens at a time: the incremental index gives what
    a search of the whole sequence gives."""
    g = torch.Generator().manual_seed(5)
    d = NgramDrafter(max_n=4, min_n=2)
    for rid in range(6):
        tokens = torch.randint(0, 4, (3,), generator=g).tolist()
        while len(tokens) < 60:
            tokens += torch.randint(0, 4, (int(torch.randint(1, 4, (), generator=g)),), generator=g).tolist()
            want = []
            for n in range(min(4, len(tokens) - 1), 1, -1):
                ends = [e for e in range(n, len(tokens)) if tokens[e - n:e] == tokens[-n:]]
                if ends:
                    period = len(tokens) - ends[-1]
                    want = [tokens[ends[-1] + j % period] for j in range(5)]
                    break
            assert d.propose([DraftRequest(rid, list(tokens), 5)])[0] == want


# --- verification -----------------------------------------------------------------------------------------------
def test_verifying_one_hot_drafts_is_rejection_sampling():
    """Rows of a small vocabulary with temperature and top-k: the target's own token at each row (its next uniform,
    as plain sampling draws it) accepts the draft when equal. Over 12,000 trials with drafts fixed per trial: the first
    emitted token follows row 0's distribution, the first draft is kept with probability p_0(draft), and after a kept
    first draft the next emitted token follows row 1's distribution (chi-square at the 0.999 level)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, generator=g) * 1.5
    params = [SamplingParams(temperature=0.8, top_k=5, seed=1)] * 3
    p = probabilities(logits, params)  # [3, 7]
    drafts = [int(p[0].argmax()), int(p[1].argsort()[-2])]  # a likely first draft, the second-best second one
    gen = torch.Generator().manual_seed(7)
    first, second, kept = torch.zeros(7), torch.zeros(7), 0
    trials = 12000
    for _ in range(trials):
        uniforms = peek_uniforms(gen, 3)
        targets = sample_with_logprobs(logits, params, [gen] * 3, uniforms).tokens
        a = accepted_prefix(targets, drafts)
        emitted = targets[:a + 1]
        advance(gen, len(emitted))
        first[emitted[0]] += 1
        if a >= 1:
            kept += 1
            second[emitted[1]] += 1
    stat, df = chi_square(first, p[0])
    assert stat < CHI2_999[df]
    stat, df = chi_square(second, p[1])
    assert stat < CHI2_999[df]
    rate, want = kept / trials, float(p[0, drafts[0]])
    assert abs(rate - want) < 4 * (want * (1 - want) / trials) ** 0.5


def test_peeked_uniforms_are_the_draws_plain_sampling_takes():
    gen = torch.Generator().manual_seed(3)
    peeked = peek_uniforms(gen, 4)
    assert [uniform(gen) for _ in range(2)] == peeked[:2]
    advance(gen, 1)
    assert uniform(gen) == peeked[3]


@pytest.mark.parametrize("draft_dist", ["q", "one-hot"])
def test_rejection_sample_keeps_the_target_distribution(draft_dist):
    """Drafts drawn from a distribution q (or fixed, q one-hot) over a vocabulary of 6, target rows p_0, p_1, p_2
    (k = 2): over 12,000 trials the first emitted token follows p_0, and after a kept first draft the second follows
    p_1; a kept draft's rate is sum_d min(p(d), q(d)) (chi-square / binomial bounds at the 0.999 level)."""
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(3, 6, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(2, 6, generator=g, dtype=torch.float64), -1)
    gen = torch.Generator().manual_seed(2)
    first, second, kept = torch.zeros(6), torch.zeros(6), 0
    trials = 12000
    for _ in range(trials):
        if draft_dist == "q":
            drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
            out = rejection_sample(p, drafts, q, gen)
        else:
            drafts = [1, 4]
            out = rejection_sample(p, drafts, None, gen)
        first[out[0]] += 1
        if out[0] == drafts[0] and len(out) > 1:
            kept += 1
            second[out[1]] += 1
    for counts, row in ((first, p[0]), (second, p[1])):
        stat, df = chi_square(counts, row.float())
        assert stat < CHI2_999[df]
    want = float(torch.minimum(p[0], q[0]).sum()) if draft_dist == "q" else float(p[0, 1])
    assert abs(kept / trials - want) < 4 * (want * (1 - want) / trials) ** 0.5


def test_rejection_sample_refuses_bad_input():
    p = torch.full((3, 5), 0.2, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="target"):
        rejection_sample(p, [1], None, gen)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rejection_sample(p, [1, 5], None, gen)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(p, [1, 2], torch.ones(2, 4, dtype=torch.float64), gen)
    with pytest.raises(ValueError, match="probability 0"):
        rejection_sample(p, [1, 2], torch.eye(5, dtype=torch.float64)[[0, 2]], gen)
    with pytest.raises(ValueError, match="targets"):
        accepted_prefix([1, 2], [1, 2])


# --- the MTP layer ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def mtp_target() -> DSV4Model:
    return DSV4Model.from_transformers(tiny_model())


@functools.lru_cache(maxsize=None)
def mtp_layer() -> MTPLayer:
    return MTPLayer.random(mtp_target(), seed=1)


def official_mtp_names(layer: MTPLayer) -> dict[str, torch.Tensor]:
    """The MTP layer's weights as the official checkpoint names them (`mtp.0.*`, per-expert matrices)."""
    attention = {new: old for old, new in OFFICIAL_NAMES.items()}
    block = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "mlp.gate.weight": "ffn.gate.weight", "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
             "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
             "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
             "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight"}
    out = {}
    for name, value in layer.state_dict().items():
        value = value.contiguous()
        if name.startswith("block.self_attn."):
            tail = name[len("block.self_attn."):]
            new = next(n for n in attention if tail.startswith(n))
            out["attn." + attention[new] + tail[len(new):]] = value
        elif name.startswith(("block.attn_hc.", "block.ffn_hc.")):
            out[f"hc_{name.split('.')[1][:-3]}_{name.split('.')[-1]}"] = value
        elif name == "block.mlp.experts.gate_up_proj":
            for e, rows in enumerate(value):
                w1, w3 = rows.chunk(2, dim=0)
                out[f"ffn.experts.{e}.w1.weight"], out[f"ffn.experts.{e}.w3.weight"] = w1.contiguous(), w3.contiguous()
        elif name == "block.mlp.experts.down_proj":
            for e, rows in enumerate(value):
                out[f"ffn.experts.{e}.w2.weight"] = rows.contiguous()
        elif name.startswith("block."):
            out[block[name[len("block."):]]] = value
        elif name.startswith("hc_head."):
            out["hc_head_" + name.split(".")[-1][len("hc_"):]] = value
        else:  # e_proj, h_proj, enorm, hnorm, norm
            out[name] = value
    return {f"mtp.0.{k}": v for k, v in out.items()}


def write_checkpoint_with_mtp(path, mtp: bool = True) -> None:
    from safetensors.torch import save_file

    tiny_model().save_pretrained(path)
    if mtp:
        save_file(official_mtp_names(mtp_layer()), os.path.join(path, "mtp.safetensors"))


def test_mtp_layer_loads_from_official_names(tmp_path):
    """The checkpoint's `mtp.0.*` weights in official names load into an MTPLayer equal to the one written, weight
    for weight (norms, hyper-connections and biases in fp32 as in the main layers), sharing the model's embedding and
    head; without them speculative='mtp' is refused naming the checkpoint, and a model from transformers (which drops
    them) is refused saying where the MTP layer comes from."""
    from dsv4kv.engine.checkpoint import load_pretrained_mtp

    write_checkpoint_with_mtp(tmp_path / "with")
    model, layer = load_pretrained_mtp(tmp_path / "with", dtype=torch.float32)
    want = mtp_layer().state_dict()
    got = layer.state_dict()
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]) and got[key].dtype == want[key].dtype, key
    assert layer.target is model and "embed_tokens.weight" not in got
    assert layer.geometry.num_layers == 1 and layer.geometry.layers[0].ratio == 0
    assert layer.geometry.layers[0].rope.theta == 10000.0 and layer.geometry.layers[0].rope.yarn is None
    write_checkpoint_with_mtp(tmp_path / "without", mtp=False)
    assert load_pretrained_mtp(tmp_path / "without", dtype=torch.float32)[1] is None
    with pytest.raises(ValueError, match="has no MTP layer"):
        Engine.from_pretrained(tmp_path / "without", dtype=torch.float32, device="cpu", speculative="mtp", **CACHE)
    with pytest.raises(ValueError, match="from_pretrained"):
        Engine.from_transformers(tiny_model(), speculative="mtp", **CACHE)


def test_mtp_drafts_are_deterministic():
    """Two MTP drafters fed the same target rows (a 40-token prompt's streams) propose the same three drafts, ids in the
    vocabulary: the first from the layer over those rows, the next two chained through its own output streams in
    tentative steps of its cache, which leave it as they found it (proposing again gives the same drafts); other
    streams give other drafts."""
    from dsv4kv import CacheManager

    model = mtp_target()
    streams = torch.randn(40, model.hc_mult, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    tokens = prompts((41,), seed=8)[0]

    def drafts(streams, twice=False):
        cache = CacheManager(model.geometry, max_requests=2, max_tokens=512, page_tokens=128, **EXACT)
        drafter = MTPDrafter(mtp_layer())
        drafter.bind(model, cache)
        drafter.observe([ObservedRows(7, 0, tokens[1:], streams, True)])
        first = drafter.propose([DraftRequest(7, tokens, 3)])[0]
        assert drafter.cache.num_live_requests == 1 and drafter.cache.awaiting_accept() == []
        assert drafter.cache.tokens_held == 40
        if twice:
            assert drafter.propose([DraftRequest(7, tokens, 3)])[0] == first
        return first

    a, b = drafts(streams, twice=True), drafts(streams.clone())
    assert a == b and len(a) == 3 and all(0 <= t < 512 for t in a)
    assert drafts(streams * -1) != a


# --- the engine -------------------------------------------------------------------------------------------------
class Scripted(Drafter):
    """Proposes what `script(request_id, tokens, k)` returns (a test's drafter)."""

    name = "scripted"

    def __init__(self, script):
        self.script = script

    def propose(self, requests):
        return [self.script(r.request_id, list(r.tokens), r.max_drafts) for r in requests]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(speculative="ngram", draft_tokens=-1), ValueError, "draft_tokens: expected an int >= 0"),
    (dict(speculative="ngram", draft_tokens=2.0), ValueError, "draft_tokens: expected an int >= 0"),
    (dict(speculative="ngram", draft_tokens=96), ValueError, "beyond the step budget"),
    (dict(speculative="ngram", draft_tokens=8), ValueError, "the cache rolls back at most 8"),
    (dict(speculative="medusa"), ValueError, "speculative: expected None, one of 'ngram', 'mtp'"),
    (dict(speculative=3), TypeError, "speculative: expected None"),
    (dict(draft_tokens=2), ValueError, "without speculative"),
])
def test_bad_speculative_settings_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        Engine.from_transformers(tiny_model(), **{**CACHE, **kwargs})


def test_a_drafters_bad_ids_are_refused_before_anything_changes():
    """A drafter proposing an id outside the vocabulary, too many drafts, or a non-int: step() raises naming the
    drafter and the request, with nothing scheduled (the request's tokens, its cache length, the step count as
    before); the engine then serves on, the same tokens as without speculation."""
    plain = Engine.from_transformers(tiny_model(), **CACHE).generate(prompts((40,)), SamplingParams(max_new_tokens=5))
    bad = iter([[512], [1, 2, 3, 4], ["7"], [-1]])
    drafter = Scripted(lambda rid, tokens, k: next(bad, []))
    e = Engine.from_transformers(tiny_model(), speculative=drafter, draft_tokens=3, **CACHE)
    rid = e.add_request(prompts((40,))[0], SamplingParams(max_new_tokens=5))
    e.step()  # the prompt's prefill: nothing to draft yet
    for match in ("draft 512 for request 0 is not a token id in the vocabulary", "4 drafts for request 0, at most 3",
                  "draft '7'", "draft -1"):
        before = (list(e._requests[rid].tokens), e.cache.length(e._requests[rid].cache_id), e.stats.steps)
        with pytest.raises(ValueError, match=match):
            e.step()
        assert (list(e._requests[rid].tokens), e.cache.length(e._requests[rid].cache_id), e.stats.steps) == before
    while e.has_unfinished:
        e.step()
    assert e.output(rid).token_ids == plain[0].token_ids
    assert e.stats.draft_tokens == 0 and e.stats.verifies == 0


def replay(want: dict, pattern=(0, 1, 2, 3)) -> Drafter:
    """The bench's replay drafter over plain decoding's greedy tokens `want` (by prompt): pattern[i] of the i-th
    verify's drafts correct, the rest wrong."""
    from dsv4kv.tools.bench.spec import ReplayDrafter

    return ReplayDrafter({tuple(p): list(t) for p, t in want.items()}, pattern, 512)


def random_drafts(seed: int = 0) -> Drafter:
    """0 .. k random ids per request and step: any proposal at all."""
    g = torch.Generator().manual_seed(seed)
    return Scripted(lambda rid, tokens, k: torch.randint(0, 512, (int(torch.randint(0, k + 1, (), generator=g)),),
                                                          generator=g).tolist())


def serve(engine: Engine, token_lists, params, arrivals=None) -> list:
    """Serve the prompts online, prompt i added before step arrivals[i] (default: all at once); outputs in order."""
    arrivals = arrivals or [0] * len(token_lists)
    params = params if isinstance(params, list) else [params] * len(token_lists)
    ids, step = {}, 0
    while len(ids) < len(token_lists) or engine.has_unfinished:
        for i, at in enumerate(arrivals):
            if at == step and i not in ids:
                ids[i] = engine.add_request(token_lists[i], params[i])
        engine.step()
        step += 1
    return [engine.output(ids[i]) for i in range(len(token_lists))]


PROMPTS = (131, 47, 9, 150)
ARRIVALS = [0, 0, 0, 3]  # the last one's prefill chunks ride along verify steps


@functools.lru_cache(maxsize=None)
def plain_greedy(new_tokens: int = 12) -> tuple:
    outputs = serve(Engine.from_transformers(tiny_model(), **CACHE), prompts(PROMPTS),
                    SamplingParams(max_new_tokens=new_tokens), ARRIVALS)
    return tuple(o.token_ids for o in outputs)


def drafter_for(name: str):
    want = dict(zip(map(tuple, prompts(PROMPTS)), plain_greedy()))
    return {"ngram": lambda: "ngram", "replay": lambda: replay(want), "random": lambda: random_drafts(),
            "mtp": lambda: MTPDrafter(mtp_layer())}[name]()


@pytest.mark.parametrize("graphs", [(), (2, 4)], ids=["eager", "padded-graphs"])
@pytest.mark.parametrize("name", ["ngram", "replay", "random", "mtp"])
def test_speculative_greedy_equals_plain_greedy(name, graphs):
    """Four requests (one arriving later, its prefill chunks beside verify steps; a 131-token prompt over two chunks
    of the 96-token budget), each drafter proposing 0 .. 3 drafts per request and step (replay: 0, 1, 2, 3 of them
    correct in turn; random: any ids): the tokens of plain greedy decoding, token for token. With decode graph sizes
    on a CPU the decode and verify steps run through padded graphs (eagerly). The stats count what was verified."""
    speculative = drafter_for(name)
    model = mtp_target() if name == "mtp" else None
    options = dict(CACHE, decode_graph_sizes=graphs, speculative=speculative, draft_tokens=3)
    e = Engine(model, **options) if model is not None else Engine.from_transformers(tiny_model(), **options)
    outputs = serve(e, prompts(PROMPTS), SamplingParams(max_new_tokens=12), ARRIVALS)
    assert tuple(o.token_ids for o in outputs) == plain_greedy()
    s = e.stats
    assert s.verifies > 0 and s.verify_steps > 0 and s.draft_tokens >= s.verifies
    assert s.acceptance_length == pytest.approx(1 + s.accepted_tokens / s.verifies)
    # every prompt token fed once; every generated token but the first (the prefill's) emitted by a decode or verify
    assert s.decode_tokens + s.prefill_tokens == sum(PROMPTS) + 4 * 11
    # a verify step's decode tokens: each verify's emitted tokens, plus plain decodes riding along
    assert s.verifies + s.accepted_tokens <= s.tokens_in_verify_steps <= s.decode_tokens
    assert 0 < s.verify_seconds <= s.decode_seconds + s.prefill_seconds
    if name == "replay":
        assert s.accepted_tokens > 0 and s.steps < 2 + 12
    if graphs:
        assert s.graph_steps > 0
    assert e.cache.num_live_requests == 0 and e.cache.num_used_blocks == 0


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["plain", "prefix"])
def test_warm_up_runs_every_graph_and_leaves_the_cache_as_it_was(prefix_caching):
    """`ModelRunner.warm_up` (what an engine capturing CUDA graphs runs when it is made; here the padded graphs run
    eagerly): every decode and verify graph runs a full step over scratch requests in every slot, and the cache is
    then bit for bit what it was (pools, tables, allocator, slot order, prefix cache; only its next request id moves
    on), and serving gives plain greedy's tokens."""
    from test_speculative_cache import state

    want = dict(zip(map(tuple, prompts(PROMPTS)), plain_greedy()))
    e = Engine.from_transformers(tiny_model(), **{**CACHE, "max_requests": 3}, decode_graph_sizes=(1, 2, 3),
                                 speculative=replay(want, (1, 2)), draft_tokens=3, prefix_caching=prefix_caching)
    graphs = [*e.runner.graphs.values(), *e.runner.verify_graphs.values()]
    assert [(g.batch, g.width) for g in graphs] == [(1, 1), (2, 1), (3, 1), (1, 4), (2, 4), (3, 4)]
    before = state(e.cache)
    e.runner.warm_up()
    after = state(e.cache)
    assert all(g.captured.steps == 1 for g in graphs)
    assert e.cache._next_rid == 3 and after["counters"][-1] == before["counters"][-1] + 3
    before["counters"], after["counters"] = before["counters"][:-1], after["counters"][:-1]
    for key in before:
        x, y = before[key], after[key]
        same = (torch.equal(x, y) if isinstance(x, torch.Tensor) else bool((x == y).all())
                if hasattr(x, "all") else x == y)
        assert same, f"{key} changed"
    outputs = serve(e, prompts(PROMPTS), SamplingParams(max_new_tokens=12), ARRIVALS)
    assert tuple(o.token_ids for o in outputs) == plain_greedy()
    assert e.stats.accepted_tokens > 0 and e.stats.graph_steps > 0


def test_seeded_speculative_sampling_gives_plain_samplings_tokens():
    """Sampled requests (temperature, top-k, top-p, their own seeds) with the replay drafter: each verify row draws
    with the request's next uniform, so the tokens are plain sampling's and the logprobs its own up to fp32
    rounding (the verify step's rows are computed beside each other)."""
    params = [SamplingParams(max_new_tokens=10, temperature=0.9, top_k=50, seed=1, logprobs=3),
              SamplingParams(max_new_tokens=10, temperature=1.3, seed=2, logprobs=3),
              SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.9, seed=3), SamplingParams(max_new_tokens=10)]
    token_lists = prompts(PROMPTS)
    plain = serve(Engine.from_transformers(tiny_model(), **CACHE), token_lists, params, ARRIVALS)
    e = Engine.from_transformers(tiny_model(), speculative=replay(
        {tuple(p): o.token_ids for p, o in zip(token_lists, plain)}, (3, 1, 2)), draft_tokens=3, **CACHE)
    outputs = serve(e, token_lists, params, ARRIVALS)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert e.stats.accepted_tokens > 0
    for a, b in zip(outputs, plain):
        if a.token_logprobs is not None:
            torch.testing.assert_close(torch.tensor(a.token_logprobs), torch.tensor(b.token_logprobs), atol=1e-4,
                                       rtol=0)


def test_stop_tokens_and_lengths_inside_an_accepted_run():
    """Drafts that would all be accepted run past a stop token, max_new_tokens and max_seq_len: the request stops
    where plain decoding stops (the stop token kept), and no request is asked for more drafts than it may still
    generate (max_new_tokens - generated - 1) or than the cache holds (max_seq_len - tokens)."""
    want = plain_greedy()
    asked = []  # (request id, tokens, drafts asked)
    inner = replay(dict(zip(map(tuple, prompts(PROMPTS)), want)), (3,))
    spy = Scripted(lambda rid, tokens, k: asked.append((rid, len(tokens), k)) or inner.propose(
        [DraftRequest(rid, tokens, k)])[0])
    e = Engine.from_transformers(tiny_model(), speculative=spy, draft_tokens=3, **{**CACHE, "max_seq_len": 131 + 6})
    stop = want[1][5]
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, stop_token_ids=[stop]),
              SamplingParams(max_new_tokens=4)]
    outputs = serve(e, prompts(PROMPTS)[:3], params)
    assert outputs[0].token_ids == want[0][:7] and outputs[0].finish_reason == "length"  # 131 + 6 fed: max_seq_len
    assert outputs[1].token_ids == want[1][:want[1].index(stop) + 1] and outputs[1].finish_reason == "stop"
    assert outputs[2].token_ids == want[2][:4] and outputs[2].finish_reason == "length"
    assert e.stats.accepted_tokens > 0
    for rid, n, k in asked:
        prompt = PROMPTS[rid]
        assert 1 <= k <= min(3, params[rid].max_new_tokens - (n - prompt) - 1, 131 + 6 - n), (rid, n, k)
    assert any(k < 3 for rid, _, k in asked if rid == 0) and any(k < 3 for rid, _, k in asked if rid == 2)


@pytest.mark.parametrize("at", [5, 6], ids=["stop-first", "stop-second"])
def test_counters_count_emitted_tokens_past_a_stop_token(at):
    """One request (a 47-token prompt, prefilled in one step) with three correct drafts per verify: verify 1 emits
    tokens 1 .. 4, verify 2 accepts its three drafts and keeps four tokens in the cache, but the stop token (greedy
    token 5: the model's first of the verify; token 6: its second, an accepted draft) ends the request there. The
    counters count what was emitted: decode_tokens and tokens_in_verify_steps the tokens after the prefill's, equal to
    plain decoding's; accepted_tokens the tokens each verify emitted beyond its first (3, then at - 5)."""
    prompt = prompts(PROMPTS)[1]
    want = Engine.from_transformers(tiny_model(), **CACHE).generate([prompt], SamplingParams(max_new_tokens=12))[0]
    want = want.token_ids
    assert want.index(want[at]) == at  # the stop token occurs first there
    params = SamplingParams(max_new_tokens=12, stop_token_ids=[want[at]])
    plain = Engine.from_transformers(tiny_model(), **CACHE)
    assert plain.generate([prompt], params)[0].token_ids == want[:at + 1]
    e = Engine.from_transformers(tiny_model(), speculative=replay({tuple(prompt): want}, (3,)), draft_tokens=3,
                                 **CACHE)
    out = e.generate([prompt], params)[0]
    assert out.token_ids == want[:at + 1] and out.finish_reason == "stop"
    s = e.stats
    assert (s.verifies, s.verify_steps, s.draft_tokens) == (2, 2, 6)
    assert (s.decode_tokens, s.tokens_in_verify_steps, s.accepted_tokens) == (at, at, 3 + at - 5)
    assert s.decode_tokens == plain.stats.decode_tokens and s.prefill_tokens == plain.stats.prefill_tokens == 47
    assert s.acceptance_length == 1 + (3 + at - 5) / 2 and s.acceptance_rate == (3 + at - 5) / 6


class Boom(RuntimeError):
    """The failure a test injects into a verify step."""


def same_state(a, b) -> bool:
    """Two `RequestState`s hold the same length, token ids and bytes."""
    if (a.length, a.first_block, sorted(a.tensors)) != (b.length, b.first_block, sorted(b.tensors)):
        return False
    if (a.tokens is None) != (b.tokens is None) or (a.tokens is not None and not torch.equal(a.tokens, b.tokens)):
        return False
    as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # NaN compares equal to itself here
    return all(torch.equal(as_bytes(a.tensors[k]), as_bytes(b.tensors[k])) for k in a.tensors)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["", "prefix-caching"])
@pytest.mark.parametrize("where", ["runner", "sampler", "before-plan"])
def test_a_verify_step_that_raises_leaves_the_engine_as_before(where, prefix_caching, monkeypatch):
    """The runner (after its layers ran over the tentative plan, or before it planned: the drafts' ids, recorded with
    prefix caching before the step, are then forgotten) or the sampler raises once, in a verify step holding
    a prefill chunk (more tokens than max_tentative_tokens: kept all or none) beside three verifies: the exception
    reaches the caller, no accept is left pending, every running request's cache state (pages, window ring, compressor
    state, length) is byte for byte what it was before the step and its token ids (prefix caching) are its tokens,
    its tokens and computed count are unchanged, and the engine serves on: plain greedy's tokens, the counters
    counting each token once."""
    e = Engine.from_transformers(tiny_model(), prefix_caching=prefix_caching, speculative=drafter_for("replay"),
                                 draft_tokens=3, **CACHE)
    run, sample = e.runner.run, e._sample
    armed = {}

    def failing_run(batch, *, decode, rows, tentative):
        arm = (tentative and "before" not in armed
               and any(len(tokens) > e.cache.max_tentative_tokens for _, tokens in batch))
        if arm:
            armed["before"] = {rid: e.cache.export_request(rid) for rid, _ in batch}
            armed["requests"] = {r.id: (list(r.tokens), r.num_computed) for r in e.scheduler.running}
            if where == "before-plan":
                raise Boom("the before-plan")
        result = run(batch, decode=decode, rows=rows, tentative=tentative)
        assert e.cache.awaiting_accept() == ([rid for rid, _ in batch] if tentative else [])
        if arm and where == "runner":
            raise Boom("the runner")
        armed["sampler"] = arm
        return result

    def failing_sample(work, logits):
        if armed.pop("sampler", False):
            raise Boom("the sampler")
        return sample(work, logits)

    monkeypatch.setattr(e.runner, "run", failing_run)
    monkeypatch.setattr(e, "_sample", failing_sample)
    token_lists, ids, step, failed = prompts(PROMPTS), {}, 0, 0
    while len(ids) < len(token_lists) or e.has_unfinished:
        for i, at in enumerate(ARRIVALS):
            if at == step and i not in ids:
                ids[i] = e.add_request(token_lists[i], SamplingParams(max_new_tokens=12))
        step += 1
        stats = dataclasses.replace(e.stats)
        try:
            e.step()
            continue
        except Boom as error:
            assert str(error) == f"the {where}"
        failed += 1
        assert e.cache.awaiting_accept() == [] and e.stats == stats
        assert {r.id: (list(r.tokens), r.num_computed) for r in e.scheduler.running} == armed["requests"]
        assert len(armed["before"]) == 4
        for r in e.scheduler.running:
            after = e.cache.export_request(r.cache_id)
            before = armed["before"][r.cache_id]
            assert after.length == r.num_computed
            assert same_state(after, dataclasses.replace(before, tokens=after.tokens))
            assert after.tokens is None if not prefix_caching else after.tokens.tolist() == r.tokens
    assert failed == 1
    assert tuple(e.output(ids[i]).token_ids for i in range(len(token_lists))) == plain_greedy()
    s = e.stats
    assert s.decode_tokens + s.prefill_tokens == sum(PROMPTS) + 4 * 11 and s.accepted_tokens > 0
    assert e.cache.num_live_requests == 0 and e.cache.num_used_blocks == 0


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_speculation_through_preemption(preemption):
    """Three requests of 118 .. 125 prompt tokens and three blocks of 128 tokens: each crosses into a second block
    while the others verify drafts, so requests are preempted (recompute or swap) and come back (the MTP drafter's
    state is dropped and rebuilt from where each comes back); the tokens are plain decoding's."""
    token_lists = prompts((118, 122, 125), seed=6)
    params = SamplingParams(max_new_tokens=12)
    plain = Engine.from_transformers(tiny_model(), **CACHE).generate(token_lists, params)
    e = Engine(mtp_target(), speculative=MTPDrafter(mtp_layer()), draft_tokens=3, preemption=preemption,
               **{**CACHE, "max_tokens": 128, "max_requests": 3, "max_seq_len": 384})
    outputs = e.generate(token_lists, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert e.stats.preemptions > 0 and e.stats.verifies > 0
    assert e.cache.num_used_blocks == 0 and e._speculator.drafter.cache.num_live_requests == 0


def test_abort_after_a_rejected_verify_releases_everything():
    """A request aborted right after a verify step that rejected some of its drafts: its blocks and its MTP state go,
    the others continue with plain decoding's tokens."""
    want = plain_greedy()
    drafter = MTPDrafter(mtp_layer())
    e = Engine(mtp_target(), speculative=drafter, draft_tokens=3, **CACHE)
    ids = [e.add_request(p, SamplingParams(max_new_tokens=12)) for p in prompts(PROMPTS[:3])]
    while e.stats.verifies == 0 or e.stats.draft_tokens == e.stats.accepted_tokens:
        e.step()
    live = e.cache.num_live_requests
    e.abort(ids[1])
    assert e.cache.num_live_requests == live - 1 and drafter.cache.num_live_requests == live - 1
    assert e.output(ids[1]).finish_reason == "abort"
    while e.has_unfinished:
        e.step()
    assert [e.output(i).token_ids for i in (ids[0], ids[2])] == [want[0], want[2]]
    assert e.cache.num_used_blocks == 0 and drafter.cache.num_live_requests == 0


def test_ngram_drafts_are_accepted_on_a_repetitive_prompt():
    """Prompts that repeat an 8-token segment six times: the model's greedy continuation repeats some of its own
    n-grams, the n-gram drafter proposes them and some are accepted; the tokens are plain decoding's."""
    g = torch.Generator().manual_seed(5)
    token_lists = [torch.randint(0, 512, (8,), generator=g).tolist() * 6 for _ in range(3)]
    options = dict(CACHE, step_tokens=256)
    params = SamplingParams(max_new_tokens=40)
    plain = Engine.from_transformers(tiny_model(), **options).generate(token_lists, params)
    e = Engine.from_transformers(tiny_model(), speculative="ngram", draft_tokens=3, **options)
    outputs = e.generate(token_lists, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert e.stats.accepted_tokens >= 3 and e.stats.acceptance_length > 1


def test_prefix_hits_with_speculation():
    """Prefix caching on: prompts sharing 256 tokens (two blocks) with tails of 37, 128 (a hit that ends at a page
    boundary) and 1 token, and one sharing a single block, served after the first published its blocks; with the
    replay drafter the tokens are plain decoding's (caching off), every later request hits, and blocks publish only
    accepted tokens (a second round hits the first round's generated blocks as well)."""
    g = torch.Generator().manual_seed(12)
    shared = torch.randint(0, 512, (256,), generator=g).tolist()
    tails = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (37, 128, 1)]
    token_lists = [shared + t for t in tails] + [shared[:128] + tails[0][:10]]
    params = SamplingParams(max_new_tokens=12)
    plain = Engine.from_transformers(tiny_model(), **CACHE).generate(token_lists, params)
    want = {tuple(p): o.token_ids for p, o in zip(token_lists, plain)}
    e = Engine.from_transformers(tiny_model(), prefix_caching=True, speculative=replay(want, (2, 3, 0, 1)),
                                 draft_tokens=3, **CACHE)
    first = e.generate(token_lists[:1], params)
    rest = e.generate(token_lists[1:], params)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in plain]
    assert [o.cached_tokens for o in rest] == [256, 256, 128]
    assert e.stats.accepted_tokens > 0
    # the first prompt again with its generated tokens: its blocks hold only accepted tokens, so it hits them all
    again = e.generate([token_lists[0] + list(first[0].token_ids)], SamplingParams(max_new_tokens=4))[0]
    assert again.cached_tokens == 256 and again.token_ids == Engine.from_transformers(tiny_model(), **CACHE).generate(
        [token_lists[0] + list(first[0].token_ids)], SamplingParams(max_new_tokens=4))[0].token_ids


def test_speculation_on_the_kernels():
    """bf16 weights with the attention on the Triton kernels (on a CPU under Triton's interpreter, on CUDA compiled,
    decode and verify steps captured as CUDA graphs): speculative greedy tokens are plain greedy's on the same path."""
    from dsv4kv.backend import kernels_can_run
    from dsv4kv.engine.reference import with_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not kernels_can_run(device):
        pytest.skip("Triton is not installed, or TRITON_INTERPRET is off on a CPU")
    model = with_dtype(random_model(tiny_config(), seed=0, device=device), torch.bfloat16)
    token_lists = prompts((33, 9), seed=5)
    options = dict(max_requests=2, max_tokens=256, page_tokens=128, step_tokens=64, max_seq_len=128,
                   decode_graph_sizes=(2,), **EXACT)

    def run(**kwargs):
        e = Engine.from_transformers(model, **options, **kwargs)
        for layer in e.model.attention_layers:
            layer.backend = "triton"
        # CUDA: three full verify steps (3 drafts each) before the drafts run out: warm-up, capture, replay;
        # the interpreter (slow): two verify steps
        new_tokens = 10 if device.type == "cuda" else 5
        return e, [o.token_ids for o in e.generate(token_lists, SamplingParams(max_new_tokens=new_tokens))]

    _, plain = run()
    e, got = run(speculative=replay(dict(zip(map(tuple, token_lists), plain)), (1, 1, 3)), draft_tokens=3)
    assert got == plain
    assert e.stats.verify_steps >= (3 if device.type == "cuda" else 2) and e.stats.accepted_tokens > 0
    if device.type == "cuda":
        assert e.runner.verify_graphs[2].captured.graph is not None and e.stats.graph_steps == e.stats.decode_steps
