"""transformers' DeepseekV4ForCausalLM as the engine's reference: small configs, reproducible random weights of
realistic scale, and its one-shot teacher-forced forward (the oracle of the engine's tokens).

transformers is imported on use: the engine itself needs it only for the model it is given.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch

__all__ = ["tiny_config", "flash_config", "random_model", "with_dtype", "reference_logits", "Fork", "fork",
           "hit_difference", "logprob_difference", "before_fork", "own_argmax", "ForkCheck", "judge_fork", "HIT_TOL"]


def tiny_config(**overrides):
    """Three layers, one of each kind (window, CSA ratio 4, HCA ratio 128), hash-routed then learned-routed MoE;
    the tiny preset's attention sizes (index_head_dim >= the rope dims, as transformers' indexer needs)."""
    from transformers import DeepseekV4Config

    fields = dict(
        vocab_size=512, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=8,
        head_dim=128, qk_rope_head_dim=64, q_lora_rank=64, o_groups=2, o_lora_rank=32, sliding_window=16,
        index_n_heads=4, index_head_dim=64, index_topk=8, n_routed_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        max_position_embeddings=65536, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1})
    fields.update(overrides)
    config = DeepseekV4Config(**fields)
    config._attn_implementation = "eager"
    return config


def flash_config(num_layers: int = 4, **overrides):
    """V4-Flash's attention geometry (hidden 4096, 64 heads x 512, q_lora 1024, 8 x 1024 output groups, window 128,
    indexer 64 x 128 top-512, CSA 4 / HCA 128, YaRN) and vocabulary, with `num_layers` layers of the pattern
    window, CSA, HCA, CSA, ... and a reduced MoE: 8 routed experts of width 512, 2 per token, plus the shared one
    (V4-Flash: 256 experts of 2048, 6 per token)."""
    kinds = ["sliding_attention"] + [("compressed_sparse_attention", "heavily_compressed_attention")[i % 2]
                                     for i in range(num_layers - 1)]
    fields = dict(
        vocab_size=129280, hidden_size=4096, moe_intermediate_size=512, num_hidden_layers=num_layers,
        num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
        sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512, n_routed_experts=8,
        num_experts_per_tok=2, layer_types=kinds, mlp_layer_types=["hash_moe"] + ["moe"] * (num_layers - 1),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        max_position_embeddings=1048576, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                      "beta_slow": 1})
    fields.update(overrides)
    return tiny_config(**fields)


def random_model(config, *, seed: int = 0, device: torch.device | str = "cpu"):
    """A fp32 DeepseekV4ForCausalLM with reproducible random weights of realistic scale, every value
    bf16-representable (so a bf16 copy holds exactly the same weights): linear and expert weights
    N(0, 1/fan_in), embeddings N(0, 1), norm weights 1 + N(0, 0.1), hyper-connection bases N(0, 0.5) and scales
    1 + N(0, 0.1), compressor position biases N(0, 0.5), sinks N(0, 1), router correction biases N(0, 0.1), and
    hash routes drawn uniformly (distinct experts per token)."""
    from transformers import DeepseekV4ForCausalLM

    with torch.device(device):
        model = DeepseekV4ForCausalLM(config).eval()
    generator = torch.Generator(device=device).manual_seed(seed)
    randn = functools.partial(torch.randn, generator=generator, device=device)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            shape = param.shape
            if name.endswith("embed_tokens.weight"):
                value = randn(shape)
            elif name.endswith("norm.weight"):
                value = 1 + 0.1 * randn(shape)
            elif name.endswith(("position_bias", ".base", "hc_base")):
                value = 0.5 * randn(shape)
            elif name.endswith(("scale", "hc_scale")):
                value = 1 + 0.1 * randn(shape)
            elif name.endswith("sinks"):
                value = randn(shape)
            else:  # [..., out, in] weights: N(0, 1/in)
                value = randn(shape) * shape[-1] ** -0.5
            param.copy_(value.bfloat16().float())
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * randn(buffer.shape))
            elif name.endswith("tid2eid"):
                vocab, k = buffer.shape
                scores = torch.rand(vocab, config.n_routed_experts, generator=generator, device=device)
                buffer.copy_(scores.argsort(-1)[:, :k])
    return model


def with_dtype(model, dtype: torch.dtype):
    """A copy with parameters in `dtype` except those transformers keeps in fp32 (hyper-connections, norms, sinks,
    biases); buffers (rotary tables, hash routes) untouched."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules_strict", ()) or ())
    model = copy.deepcopy(model)
    for name, param in model.named_parameters():
        if not any(part in name.split(".") for part in keep):
            param.data = param.data.to(dtype)
    return model


QUERY_ROWS = 2048  # longer sequences run transformers' eager attention this many query rows at a time


def _eager_attention_by_rows(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager attention (the sink included) over query rows QUERY_ROWS at a time: the same per-row
    arithmetic with [heads, QUERY_ROWS, keys] logits instead of [heads, L, keys] (27 GB in fp32 at 9K tokens)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward

    outputs = []
    for lo in range(0, query.shape[-2], QUERY_ROWS):
        rows = slice(lo, lo + QUERY_ROWS)
        mask = attention_mask[..., rows, :] if attention_mask is not None else None
        outputs.append(eager_attention_forward(module, query[..., rows, :], key, value, mask, scaling, dropout,
                                               **kwargs)[0])
    return torch.cat(outputs, dim=1), None  # [B, L, H, D], as eager's; no weights kept


@torch.no_grad()
def reference_logits(model, token_ids, last: int = 0) -> torch.Tensor:
    """transformers' one forward over a whole sequence, teacher-forced: fp32 logits [L, vocab], row t predicting
    token t + 1 (`last` > 0: only the last that many rows). The sliding-window causal mask is passed explicitly
    (SPEC section 4: without a mask tensor its CSA layers attend to every compressed entry). Beyond QUERY_ROWS
    tokens the eager attention runs by rows (`_eager_attention_by_rows`)."""
    from transformers import AttentionInterface

    ids = torch.as_tensor(token_ids, dtype=torch.long, device=model.lm_head.weight.device)[None]
    length = ids.shape[1]
    i = torch.arange(length, device=ids.device)
    allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < model.config.sliding_window)
    dtype = model.model.embed_tokens.weight.dtype
    mask = torch.where(allowed, 0.0, float("-inf")).to(dtype)[None, None]
    config, implementation = model.config, model.config._attn_implementation
    if length > QUERY_ROWS and implementation == "eager":
        AttentionInterface.register("dsv4kv_eager_by_rows", _eager_attention_by_rows)
        config._attn_implementation = "dsv4kv_eager_by_rows"  # the layers read it from this shared config
    try:
        out = model(input_ids=ids, attention_mask={"sliding_attention": mask}, use_cache=False, logits_to_keep=last)
    finally:
        config._attn_implementation = implementation
    return out.logits[0].float()


@dataclass
class Fork:
    """Where two greedy continuations of one prompt first differ, judged by the fp32 oracle."""

    position: int  # index of the first differing generated token
    gap: float  # |oracle logit of one token - of the other| at that position
    bound: float  # max(margin, 2 d), d = max(bf16_error, engine_error)
    bf16_error: float  # the bf16 model's largest |logit - oracle's| on generated positions 0 .. position
    engine_error: float | None = None  # the given engine's largest |logit - oracle's| at the position (None: no engine)
    # given a hot engine too: teacher-forced at the position, max |hot engine's logit - the engine's| (None: no hot)
    hit_error: float | None = None
    margin: float = 0.05  # the margin the bound was taken with

    @property
    def near_tie(self) -> bool:
        return self.gap <= self.bound


def fork(oracle, served, prompt: list[int], a: list[int], b: list[int], margin: float = 0.05, *,
         engine=None, hot=None) -> Fork | None:
    """Two greedy continuations a, b of `prompt` that were computed in bf16 along different paths (other step
    shapes, a cache hit instead of a prefill): None if equal, else where they first differ, k, and whether that is
    a near tie. Teacher-forced over prompt + a[:k], the fp32 `oracle` scores both tokens at k; they count as tied
    when within max(margin, 2 d): two computations that each lie within d of the oracle may each pick a token up to
    2 d below the other's. A fork beyond that is a computation error, or a one-step excursion of one computation
    (see `judge_fork`), not rounding.

    d is the largest |logit - oracle's| of `served` (transformers' bf16 model) over the generated positions 0..k,
    and, given an `engine`, of that engine's own logits at k (`Engine.next_token_logits`, teacher-forced over the
    same tokens). An engine with quantized cache formats (FP8 entries, MXFP4 indexer keys) errs by more than bf16
    rounding, which `served` does not have. Pass an engine that is not the path under test (a cold one with
    caching off, judging a cache hit): its error bounds honest rounding, and a wrong hit lands beyond it.

    `hot` (with `engine`): an engine with prefix caching on that holds the prompt's shared prefix (the hit path);
    `hit_error` is then max |its logits - the engine's| over the vocabulary, teacher-forced over the same tokens.
    RuntimeError if its prefill there served no prefix hit."""
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if k is None:
        if len(a) != len(b):
            raise ValueError(f"continuations of different lengths ({len(a)}, {len(b)}) agree up to the shorter")
        return None
    if hot is not None and engine is None:
        raise ValueError("hot: given without an engine to compare it with")
    sequence = list(prompt) + list(a[:k])
    exact = reference_logits(oracle, sequence, last=k + 1)
    bf16_error = float((reference_logits(served, sequence, last=k + 1) - exact).abs().max())
    engine_error = hit_error = None
    if engine is not None:
        served_row = engine.next_token_logits([sequence])[0]
        engine_error = float((served_row.to(exact.device) - exact[-1]).abs().max())
        if hot is not None:
            hit_error = hit_difference(hot, served_row, sequence)
    gap = abs(float(exact[-1, a[k]] - exact[-1, b[k]]))
    return Fork(k, gap, max(margin, 2 * bf16_error, 2 * (engine_error or 0.0)), bf16_error, engine_error, hit_error,
                margin)


def hit_difference(hot, cold_row: torch.Tensor, sequence: list[int]) -> float:
    """Teacher-forced over `sequence`: max |hot engine's next-token logits - cold_row| over the vocabulary, where the
    hot engine (prefix caching on) must serve a prefix hit for it (RuntimeError otherwise)."""
    before = hot.stats.prefix_hit_tokens
    row = hot.next_token_logits([sequence])[0]
    if hot.stats.prefix_hit_tokens <= before:
        raise RuntimeError(f"hot engine: no prefix hit for a {len(sequence)}-token context (prefix caching "
                           f"{'on' if getattr(hot, 'prefix_caching', False) else 'off'}); serve the shared prefix first")
    return float((row - cold_row.to(row.device)).abs().max())


# --- the chat bench's gate on forks between two greedy runs, from their logprobs --------------------------------
TopLogprobs = tuple[tuple[int, float], ...]  # (token id, logprob), best first: RequestOutput.logprobs per token


def logprob_difference(x: TopLogprobs, y: TopLogprobs) -> float:
    """Two top-logprob lists of one position: the largest |logprob difference| over the tokens in both (inf when
    they share none)."""
    y = dict(y)
    common = [abs(v - y[i]) for i, v in x if i in y]
    return max(common) if common else float("inf")


def before_fork(a: tuple[TopLogprobs, ...], b: tuple[TopLogprobs, ...], k: int,
                tol: float) -> tuple[float, int | None, int]:
    """Two runs' per-token top logprobs over positions 0 .. k - 1 (where the runs had the same context): the largest
    `logprob_difference`, the position it is at, and how many positions differ by more than tol; (0.0, None, 0)
    for k = 0."""
    if len(a) < k or len(b) < k:
        raise ValueError(f"logprobs of {len(a)} and {len(b)} positions, expected at least {k}")
    worst, where, outliers = 0.0, None, 0
    for j in range(k):
        d = logprob_difference(a[j], b[j])
        outliers += d > tol
        if where is None or d > worst:
            worst, where = d, j
    return worst, where, outliers


def own_argmax(token: int, top: TopLogprobs, token_logprob: float) -> bool:
    """A greedy token is its position's argmax by its own run's logprobs: it is in its top list with the top value,
    and its reported logprob is that value (a token changed after sampling fails both)."""
    return bool(top) and dict(top).get(token) == top[0][1] and token_logprob == top[0][1]


@dataclass
class ForkCheck:
    """A request whose greedy tokens differ between run a (e.g. prefix caching off) and run b (caching on), first
    at generated token k = fork.position. It passes when
      (a) consistent: at the positions before k (the same context in both) the runs' top logprobs agree within
          tol, for the tokens in both lists, at all but a quarter of them: a wrong cache hit has its state in place
          from the first position and shifts them all, while a one-step excursion (~5% of the positions of any bf16
          computation of the random demo model, docs/engine.md) strays at one position and comes back;
      (b) argmax: each run's token at k is the argmax of its own logprobs (no token changed after sampling);
      (c) explained: the fork is a near tie by the fp32 oracle (`fork`), or a one-step excursion: teacher-forced
          over the shared context, the hit path and a cold engine agree within tol there (`Fork.hit_error`), so the
          cache state at k is right and one run's step strayed from it."""

    fork: Fork
    before: float  # (a) the largest top-logprob difference between the runs before k (0.0 for k = 0)
    before_at: int | None  # where it is (None for k = 0)
    argmax: tuple[bool, bool]  # (b) run a's and run b's token at k is its own argmax
    # per run at k: (its token, that token's logprob reported with it, its top list there)
    at_fork: tuple[tuple[int, float, TopLogprobs], tuple[int, float, TopLogprobs]]
    tol: float
    outliers: int = 0  # (a) positions before k where the runs differ by more than tol

    @property
    def consistent(self) -> bool:
        return self.outliers <= self.fork.position // 4

    @property
    def excursion(self) -> bool:
        """(c) by the second way: the hit path and a cold engine agree at the fork's context, after a consistent
        run-up (a)."""
        return self.consistent and self.fork.hit_error is not None and self.fork.hit_error <= self.tol

    @property
    def explained(self) -> bool:
        return self.fork.near_tie or self.excursion

    @property
    def passed(self) -> bool:
        return self.consistent and all(self.argmax) and self.explained

    def failures(self, names: tuple[str, str] = ("run a", "run b")) -> list[str]:
        """What failed, with its numbers (empty when passed)."""
        f, k, out = self.fork, self.fork.position, []
        if not self.consistent:
            out.append(f"(a) before the fork the runs' top logprobs differ by more than {self.tol} at {self.outliers} "
                       f"of {self.fork.position} generated tokens (a quarter allowed), by up to {self.before:.3f} at "
                       f"generated token {self.before_at}")
        for name, ok, (token, own, top) in zip(names, self.argmax, self.at_fork):
            if not ok:
                listed = dict(top).get(token)
                where = (f"not among its top {len(top)}" if listed is None else f"at {listed:.3f} in its list")
                best = f"token {top[0][0]}'s {top[0][1]:.3f}" if top else "empty"
                out.append(f"(b) {name}'s token {token} at generated token {k} is not its own argmax: its top there "
                           f"is {best}, token {token} is {where}, its reported logprob {own:.3f}")
        if not self.explained:
            parts = [f"max({f.margin}"]
            if f.engine_error is not None:
                parts.append(f"2 x the engine's own error {f.engine_error:.3f}")
            parts.append(f"2 x transformers' bf16 error {f.bf16_error:.3f})")
            if f.hit_error is None:
                hit = "the hit path not measured"
            elif f.hit_error > self.tol:
                hit = f"teacher-forced, the hit path and a cold engine differ by {f.hit_error:.3f} there"
            else:
                hit = (f"teacher-forced, the hit path and a cold engine within {f.hit_error:.3f} there, but the runs "
                       "disagree before it")
            out.append(f"(c) the fork at generated token {k} is neither a near tie (gap {f.gap:.3f} against a bound "
                       f"of {f.bound:.3f} = {', '.join(parts)}) nor a one-step excursion ({hit}; tolerance "
                       f"{self.tol})")
        return out


# Two bf16 runs' logits at the same context agree within about 0.04 .. 0.07 (max |on - off| over the vocabulary) at
# every position outside a one-step excursion. HIT_TOL is about 4x the largest: the runs before a fork and,
# teacher-forced, the hit path against a cold engine at the fork must agree within it. A wrong hit has its wrong
# state in place from the first generated token on.
HIT_TOL = 0.25


def judge_fork(oracle, served, prompt: list[int], a, b, *, engine, hot, margin: float = 0.05,
               tol: float = HIT_TOL) -> ForkCheck | None:
    """Two greedy runs' outputs a, b of `prompt` (`RequestOutput`s with logprobs: `SamplingParams.logprobs` > 0):
    None if their tokens are equal, else the `ForkCheck` of where they first differ. `engine`: a cold engine with
    caching off (the near-tie bound's engine error, and the hit path's reference); `hot`: an engine with prefix
    caching on that holds the prompt's shared prefix (`fork`)."""
    for name, out in (("a", a), ("b", b)):
        if out.logprobs is None or out.token_logprobs is None:
            raise ValueError(f"{name}: no logprobs (serve it with SamplingParams(logprobs=N), N > 0)")
    found = fork(oracle, served, prompt, list(a.token_ids), list(b.token_ids), margin, engine=engine, hot=hot)
    if found is None:
        return None
    k = found.position
    worst, where, outliers = before_fork(a.logprobs, b.logprobs, k, tol)
    at_fork = tuple((out.token_ids[k], out.token_logprobs[k], out.logprobs[k]) for out in (a, b))
    argmax = tuple(own_argmax(token, top, own) for token, own, top in at_fork)
    return ForkCheck(found, worst, where, argmax, at_fork, tol, outliers)
