"""transformers' DeepseekV4ForCausalLM as the engine's reference: small configs, reproducible random weights of
realistic scale, and its one-shot teacher-forced forward (the oracle of the engine's tokens).

transformers is imported on use: the engine itself needs it only for the model it is given.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch

__all__ = ["tiny_config", "flash_config", "random_model", "with_dtype", "reference_logits", "Fork", "fork"]


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


@torch.no_grad()
def reference_logits(model, token_ids, last: int = 0) -> torch.Tensor:
    """transformers' one forward over a whole sequence, teacher-forced: fp32 logits [L, vocab], row t predicting
    token t + 1 (`last` > 0: only the last that many rows). The sliding-window causal mask is passed explicitly
    (SPEC section 4: without a mask tensor its CSA layers attend to every compressed entry)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=model.lm_head.weight.device)[None]
    length = ids.shape[1]
    i = torch.arange(length, device=ids.device)
    allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < model.config.sliding_window)
    dtype = model.model.embed_tokens.weight.dtype
    mask = torch.where(allowed, 0.0, float("-inf")).to(dtype)[None, None]
    out = model(input_ids=ids, attention_mask={"sliding_attention": mask}, use_cache=False, logits_to_keep=last)
    return out.logits[0].float()


@dataclass
class Fork:
    """Where two greedy continuations of one prompt first differ, judged by the fp32 oracle."""

    position: int  # index of the first differing generated token
    gap: float  # |oracle logit of one token - of the other| at that position
    bound: float  # max(margin, 2 d), d = max(bf16_error, engine_error)
    bf16_error: float  # the bf16 model's largest |logit - oracle's| on generated positions 0 .. position
    engine_error: float | None = None  # the given engine's largest |logit - oracle's| at the position (None: no engine)

    @property
    def near_tie(self) -> bool:
        return self.gap <= self.bound


def fork(oracle, served, prompt: list[int], a: list[int], b: list[int], margin: float = 0.05, *,
         engine=None) -> Fork | None:
    """Two greedy continuations a, b of `prompt` that were computed in bf16 along different paths (other step
    shapes, a cache hit instead of a prefill): None if equal, else where they first differ, k, and whether that is
    a near tie. Teacher-forced over prompt + a[:k], the fp32 `oracle` scores both tokens at k; they count as tied
    when within max(margin, 2 d): two computations that each lie within d of the oracle may each pick a token up to
    2 d below the other's. A fork beyond that is a computation error, not rounding.

    d is the largest |logit - oracle's| of `served` (transformers' bf16 model) over the generated positions 0..k,
    and, given an `engine`, of that engine's own logits at k (`Engine.next_token_logits`, teacher-forced over the
    same tokens). An engine with quantized cache formats (FP8 entries, MXFP4 indexer keys) errs by more than bf16
    rounding, which `served` does not have. Pass an engine that is not the path under test (a cold one with
    caching off, judging a cache hit): its error bounds honest rounding, and a wrong hit lands beyond it."""
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if k is None:
        if len(a) != len(b):
            raise ValueError(f"continuations of different lengths ({len(a)}, {len(b)}) agree up to the shorter")
        return None
    sequence = list(prompt) + list(a[:k])
    exact = reference_logits(oracle, sequence, last=k + 1)
    bf16_error = float((reference_logits(served, sequence, last=k + 1) - exact).abs().max())
    engine_error = None
    if engine is not None:
        served_row = engine.next_token_logits([sequence])[0].to(exact.device)
        engine_error = float((served_row - exact[-1]).abs().max())
    gap = abs(float(exact[-1, a[k]] - exact[-1, b[k]]))
    return Fork(k, gap, max(margin, 2 * bf16_error, 2 * (engine_error or 0.0)), bf16_error, engine_error)
