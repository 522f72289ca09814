"""RoPE reference against transformers' DeepseekV4RotaryEmbedding / apply_rotary_pos_emb (fp32: bit-exact)."""

import json
from importlib import resources

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding, apply_rotary_pos_emb

from dsv4kv import ModelGeometry
from dsv4kv.ops.compress.reference import apply_rope
from dsv4kv.ops.rope.reference import inv_freq
from dsv4kv.ops.rope.reference import rotate_pairs


def hf_config(name):
    return DeepseekV4Config(**json.loads(resources.files("dsv4kv.presets").joinpath(f"{name}.json").read_text()))


def layer_of(geometry, rope_kind):
    return next(s for s in geometry.layers if (s.kind.short == "window") == (rope_kind == "main"))


CASES = [(p, k) for p in ("flash", "pro", "tiny") for k in ("main", "compress") if not (p == "pro" and k == "main")]


@pytest.mark.parametrize("preset,rope_kind", CASES, ids=[f"{p}-{k}" for p, k in CASES])
def test_inv_freq_matches_transformers(preset, rope_kind):
    hf = DeepseekV4RotaryEmbedding(hf_config(preset))
    ours = inv_freq(layer_of(ModelGeometry.preset(preset), rope_kind).rope)
    assert torch.equal(ours, getattr(hf, f"{rope_kind}_inv_freq"))
    assert getattr(hf, f"{rope_kind}_attention_scaling") == 1.0


@pytest.mark.parametrize("preset,rope_kind", CASES, ids=[f"{p}-{k}" for p, k in CASES])
def test_apply_rope_matches_transformers(preset, rope_kind):
    geometry = ModelGeometry.preset(preset)
    rope = layer_of(geometry, rope_kind).rope
    g = torch.Generator().manual_seed(0)
    n, heads = 37, 3
    positions = torch.cat((torch.randint(0, 1 << 20, (n - 5,), generator=g), torch.tensor([0, 1, 127, 128, 65537])))
    x = torch.randn(n, heads, geometry.head_dim, generator=g)
    hf = DeepseekV4RotaryEmbedding(hf_config(preset))
    cos, sin = hf(x, positions[None], layer_type=rope_kind)  # [1, N, rope/2] fp32
    # transformers wants [B, H, S, D]; ours takes [N, H, D]
    want = apply_rotary_pos_emb(x.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
    got = apply_rope(x, positions, rope)
    assert torch.equal(got, want)
    assert torch.equal(rotate_pairs(x, cos[0], sin[0]), want)  # from any caller's tables (the bench's own-input check)
    assert torch.equal(got[..., :-rope.dim], x[..., :-rope.dim]), "nope dims must pass through untouched"
    want_inverse = apply_rotary_pos_emb(x.transpose(0, 1)[None], cos, -sin)[0].transpose(0, 1)
    assert torch.equal(apply_rope(x, positions, rope, inverse=True), want_inverse)
    back = apply_rope(got, positions, rope, inverse=True)
    assert torch.allclose(back, x, atol=1e-5, rtol=1e-5)


def test_single_head_and_bf16():
    geometry = ModelGeometry.preset("tiny")
    rope = geometry.layers[1].rope
    x = torch.randn(5, geometry.head_dim, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    positions = torch.arange(5) * 1000
    got = apply_rope(x, positions, rope)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert torch.equal(got, apply_rope(x.float(), positions, rope).to(torch.bfloat16))


def test_bad_shapes():
    rope = ModelGeometry.preset("tiny").layers[0].rope
    with pytest.raises(ValueError, match="positions \\[N\\]"):
        apply_rope(torch.zeros(4, 128), torch.zeros(3, dtype=torch.long), rope)
    with pytest.raises(ValueError, match=">=64"):
        apply_rope(torch.zeros(4, 32), torch.zeros(4, dtype=torch.long), rope)
