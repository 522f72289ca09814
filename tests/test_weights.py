"""Checkpoint loading of one attention layer: DSV4Attention.from_transformers and .from_state_dict
(transformers and official names, prefixes, multi-layer dicts, FP8 block weights, and the errors)."""

import json
import math
import re
from dataclasses import replace
from importlib import resources

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

from dsv4kv import LayerKind, ModelGeometry
from dsv4kv.model.layer import DSV4Attention, init_random_weights
from dsv4kv.model.weights import FP32_PARAMETERS, OFFICIAL_NAMES, WeightError

TINY = json.loads(resources.files("dsv4kv.presets").joinpath("tiny.json").read_text())
KINDS = {0: LayerKind.WINDOW, 1: LayerKind.CSA, 2: LayerKind.HCA}
DTYPES = [torch.bfloat16, torch.float32]
E4M3 = torch.float8_e4m3fn

# Official DeepSeek-V4 name (under layers.{i}.attn.) -> transformers name, written out key by key from the
# official model's module tree (Attention: wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink; Compressor:
# wkv, wgate, ape, norm; Indexer: wq_b, weights_proj, compressor) -- independent of dsv4kv.weights.
OFFICIAL_TO_HF = {
    "wq_a.weight": "q_a_proj.weight",
    "q_norm.weight": "q_a_norm.weight",
    "wq_b.weight": "q_b_proj.weight",
    "wkv.weight": "kv_proj.weight",
    "kv_norm.weight": "kv_norm.weight",
    "wo_a.weight": "o_a_proj.weight",
    "wo_b.weight": "o_b_proj.weight",
    "attn_sink": "sinks",
    "compressor.wkv.weight": "compressor.kv_proj.weight",
    "compressor.wgate.weight": "compressor.gate_proj.weight",
    "compressor.ape": "compressor.position_bias",
    "compressor.norm.weight": "compressor.kv_norm.weight",
    "indexer.wq_b.weight": "compressor.indexer.q_b_proj.weight",
    "indexer.weights_proj.weight": "compressor.indexer.scorer.weights_proj.weight",
    "indexer.compressor.wkv.weight": "compressor.indexer.kv_proj.weight",
    "indexer.compressor.wgate.weight": "compressor.indexer.gate_proj.weight",
    "indexer.compressor.ape": "compressor.indexer.position_bias",
    "indexer.compressor.norm.weight": "compressor.indexer.kv_norm.weight",
}
HF_TO_OFFICIAL = {hf: official for official, hf in OFFICIAL_TO_HF.items()}


# --- helpers -------------------------------------------------------------------------------------
def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (bit-exact comparison: -0.0 != 0.0, NaN == same NaN)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same_state(got: dict, want: dict, dtype: torch.dtype | None = None):
    """Same names and values; dtype = `dtype` (default: want's), except FP32_PARAMETERS, which stay fp32."""
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].shape == value.shape, key
        expected = value if dtype is None else value.to(dtype)
        if key.endswith(FP32_PARAMETERS):  # never rounded to the layer dtype
            expected = value.float()
        assert got[key].dtype == expected.dtype, key
        assert torch.equal(bits(got[key]), bits(expected)), f"{key} differs"


def hf_layer(layer_index: int, dtype=torch.float32, seed: int = 0, config: dict = TINY) -> DeepseekV4Attention:
    module = DeepseekV4Attention(DeepseekV4Config(**config), layer_index).to(dtype)
    return init_random_weights(module, seed)


def ours(geometry: ModelGeometry, layer_index: int, dtype=torch.float32, seed: int = 0) -> DSV4Attention:
    return init_random_weights(DSV4Attention(geometry, layer_index, dtype=dtype), seed)


def prefixed(state: dict, prefix: str) -> dict:
    return {prefix + key: value for key, value in state.items()}


def to_official(state: dict) -> dict:
    return {HF_TO_OFFICIAL[key]: value for key, value in state.items()}


@pytest.fixture(scope="module")
def tiny():
    return ModelGeometry.preset("tiny")


# --- from_transformers ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("layer_index", [0, 1, 2], ids=["window", "CSA", "HCA"])
def test_from_transformers_copies_every_parameter(tiny, layer_index, dtype):
    hf = hf_layer(layer_index, dtype, seed=10 + layer_index)
    layer = DSV4Attention.from_transformers(hf)
    assert isinstance(layer, DSV4Attention)
    assert layer.layer_index == layer_index and layer.spec.kind is KINDS[layer_index]
    assert replace(layer.geometry, name=tiny.name) == tiny
    hf_state = hf.state_dict()
    assert_same_state(layer.state_dict(), hf_state)
    assert {p.dtype for n, p in layer.named_parameters() if not n.endswith(FP32_PARAMETERS)} == {dtype}
    assert {p.dtype for n, p in layer.named_parameters() if n.endswith(FP32_PARAMETERS)} == {torch.float32}
    # a copy, not a view of transformers' storage
    for key, value in layer.state_dict().items():
        assert value.data_ptr() != hf_state[key].data_ptr(), key
    with torch.no_grad():
        hf.q_a_proj.weight.zero_()
    assert layer.q_a_proj.weight.abs().sum() > 0


def test_from_transformers_rejects_other_modules(tiny):
    with pytest.raises(TypeError, match="expected a transformers DeepseekV4Attention, got DSV4Attention"):
        DSV4Attention.from_transformers(DSV4Attention(tiny, 0))
    with pytest.raises(TypeError, match="got Linear"):
        DSV4Attention.from_transformers(torch.nn.Linear(2, 2))


# --- from_state_dict: transformers names -----------------------------------------------------------
PREFIXES = ["", "model.layers.{i}.self_attn.", "layers.{i}.self_attn."]


@pytest.mark.parametrize("prefix", PREFIXES, ids=["bare", "model.layers", "layers"])
@pytest.mark.parametrize("layer_index", [0, 1, 2], ids=["window", "CSA", "HCA"])
def test_transformers_names(tiny, layer_index, prefix):
    state = hf_layer(layer_index, torch.bfloat16, seed=20 + layer_index).state_dict()
    layer = DSV4Attention.from_state_dict(prefixed(state, prefix.format(i=layer_index)), tiny, layer_index,
                                          dtype=torch.bfloat16)
    assert layer.spec.kind is KINDS[layer_index]
    assert_same_state(layer.state_dict(), state)


@pytest.mark.parametrize("source,target", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)],
                         ids=["bf16->fp32", "fp32->bf16"])
def test_dtype_is_the_requested_one(tiny, source, target):
    state = hf_layer(1, source, seed=3).state_dict()
    layer = DSV4Attention.from_state_dict(state, tiny, 1, dtype=target)
    assert_same_state(layer.state_dict(), state, dtype=target)
    assert {p.dtype for n, p in layer.named_parameters() if not n.endswith(FP32_PARAMETERS)} == {target}
    assert {p.dtype for n, p in layer.named_parameters() if n.endswith(FP32_PARAMETERS)} == {torch.float32}


def full_model_state(geometry, prefix_form: str, official: bool = False, skip=()) -> tuple[dict, dict]:
    """A multi-layer checkpoint (attention of every layer with its own seed, plus non-attention keys) and the
    per-layer transformers state dicts it was made from."""
    state, per_layer = {}, {}
    g = torch.Generator().manual_seed(99)
    for key in ("embed.weight", "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        state[key] = torch.randn(8, 4, generator=g)
    for i in range(geometry.num_layers):
        if i in skip:
            continue
        per_layer[i] = ours(geometry, i, torch.bfloat16, seed=100 + i).state_dict()
        attn = to_official(per_layer[i]) if official else per_layer[i]
        state.update(prefixed(attn, prefix_form.format(i=i)))
        layer_root = prefix_form.format(i=i).rsplit(".", 2)[0] + "."  # e.g. model.layers.3.
        for other in ("input_layernorm.weight", "mlp.gate.weight", "attn_norm.weight", "ffn.w1.weight",
                      "attn_hc.fn", "hc_attn_scale"):
            state[layer_root + other] = torch.randn(4, generator=g)
    return state, per_layer


@pytest.mark.parametrize("prefix_form,official", [("model.layers.{i}.self_attn.", False),
                                                  ("layers.{i}.self_attn.", False),
                                                  ("layers.{i}.attn.", True)],
                         ids=["transformers", "transformers-no-model", "official"])
def test_full_checkpoint_picks_the_requested_layer(tiny, prefix_form, official):
    state, per_layer = full_model_state(tiny, prefix_form, official)
    for i in range(tiny.num_layers):
        layer = DSV4Attention.from_state_dict(state, tiny, i, dtype=torch.bfloat16)
        assert_same_state(layer.state_dict(), per_layer[i])


def test_full_checkpoint_with_many_layers_does_not_confuse_1_and_10():
    config = {**TINY, "num_hidden_layers": 12, "layer_types": TINY["layer_types"] * 3}
    geometry = ModelGeometry.from_hf_config(config)
    state, per_layer = full_model_state(geometry, "model.layers.{i}.self_attn.")
    for i in (1, 10, 11):
        layer = DSV4Attention.from_state_dict(state, geometry, i, dtype=torch.bfloat16)
        assert_same_state(layer.state_dict(), per_layer[i])


# --- official names --------------------------------------------------------------------------------
def test_official_table_agrees_with_the_loader_mapping(tiny):
    """Our key-by-key table covers every parameter of each layer kind, and maps like OFFICIAL_NAMES."""
    names = set()
    for i in (0, 1, 2):
        names |= set(DSV4Attention(tiny, i).state_dict())
    assert names == set(HF_TO_OFFICIAL)
    for official, hf in OFFICIAL_TO_HF.items():
        matches = [old for old in OFFICIAL_NAMES if official.startswith(old)]
        assert matches, official
        first = next(old for old in OFFICIAL_NAMES if official.startswith(old))  # the loader's rule
        assert OFFICIAL_NAMES[first] + official[len(first):] == hf, official


@pytest.mark.parametrize("prefix", ["layers.{i}.attn.", "model.layers.{i}.attn.", ""],
                         ids=["layers", "model.layers", "bare"])
@pytest.mark.parametrize("layer_index", [0, 1, 2], ids=["window", "CSA", "HCA"])
def test_official_names(tiny, layer_index, prefix):
    state = hf_layer(layer_index, torch.bfloat16, seed=30 + layer_index).state_dict()
    official = prefixed(to_official(state), prefix.format(i=layer_index))
    layer = DSV4Attention.from_state_dict(official, tiny, layer_index, dtype=torch.bfloat16)
    assert_same_state(layer.state_dict(), state)
    via_hf = DSV4Attention.from_state_dict(state, tiny, layer_index, dtype=torch.bfloat16)
    assert_same_state(layer.state_dict(), via_hf.state_dict())


# --- FP8 block weights -----------------------------------------------------------------------------
# hidden 320 and q_lora_rank 192: edge blocks of 64 rows and/or columns in most projections, plus
# weights_proj [4, 320] (one partial block row) and o_a_proj [64, 512].
EDGE_CONFIG = {**TINY, "hidden_size": 320, "q_lora_rank": 192}


def quantize_block_fp8(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] -> (e4m3 [out, in], int exponents [ceil(out/128), ceil(in/128)]) with
    scale = 2^ceil(log2(amax / 448)) per block, computed exactly with frexp."""
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    q = torch.empty(w.shape, dtype=E4M3)
    exponents = torch.empty(rows, cols, dtype=torch.int32)
    for r in range(rows):
        for c in range(cols):
            tile = w[r * block:(r + 1) * block, c * block:(c + 1) * block]
            mantissa, exponent = math.frexp(tile.abs().max().item() / 448.0)  # ratio = m * 2^e, m in [0.5, 1)
            exponent -= mantissa == 0.5  # exact powers of two: ceil(log2) is e - 1
            scaled = tile / 2.0 ** exponent  # exact: division by a power of two
            assert scaled.abs().max() <= 448.0
            q[r * block:(r + 1) * block, c * block:(c + 1) * block] = scaled.to(E4M3)
            exponents[r, c] = exponent
    return q, exponents


def dequantize(q: torch.Tensor, exponents: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32)
    for r in range(exponents.shape[0]):
        for c in range(exponents.shape[1]):
            rs, cs = slice(r * block, (r + 1) * block), slice(c * block, (c + 1) * block)
            out[rs, cs] = q[rs, cs].float() * 2.0 ** exponents[r, c].item()
    return out


def encode_scale(exponents: torch.Tensor, encoding: str) -> torch.Tensor:
    if encoding == "fp32":
        return torch.pow(2.0, exponents.double()).float()
    raw = (exponents + 127).to(torch.uint8)  # ue8m0: biased exponent
    return raw if encoding == "uint8" else raw.view(torch.float8_e8m0fnu)


def test_scale_encodings_agree():
    exponents = torch.tensor([[-20, -7, 0, 3]], dtype=torch.int32)
    e8m0 = encode_scale(exponents, "e8m0")
    converted = torch.pow(2.0, exponents.float()).to(torch.float8_e8m0fnu)  # torch's own encoder
    assert torch.equal(e8m0.view(torch.uint8), converted.view(torch.uint8))
    assert torch.equal(e8m0.float(), encode_scale(exponents, "fp32"))


def fp8_checkpoint(geometry, layer_index, *, encoding, suffix, quantize=lambda key: True, seed=5):
    """(checkpoint in transformers names with FP8 2-D projection weights, expected fp32 weights)."""
    source = ours(geometry, layer_index, torch.float32, seed=seed).state_dict()
    g = torch.Generator().manual_seed(seed)
    state, expected = {}, {}
    for key, value in source.items():
        if key.endswith(".weight") and value.dim() == 2 and quantize(key):
            # a different power-of-two magnitude per block, so blocks cannot be mixed up unnoticed
            rows, cols = -(-value.shape[0] // 128), -(-value.shape[1] // 128)
            spread = torch.pow(2.0, torch.randint(-8, 9, (rows, cols), generator=g).float())
            spread = spread.repeat_interleave(128, 0)[:value.shape[0]].repeat_interleave(128, 1)[:, :value.shape[1]]
            value = value * spread
            q, exponents = quantize_block_fp8(value)
            state[key] = q
            state[key[:-len(".weight")] + suffix] = encode_scale(exponents, encoding)
            expected[key] = dequantize(q, exponents)
        else:  # norms, position biases, sinks (and unquantized projections) stay bf16
            state[key] = value.to(torch.bfloat16)
            expected[key] = state[key].float()
    return state, expected


def to_official_fp8(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        for suffix in (".scale", ".weight_scale_inv"):
            if key.endswith(suffix):
                out[HF_TO_OFFICIAL[key[:-len(suffix)] + ".weight"][:-len(".weight")] + suffix] = value
                break
        else:
            out[HF_TO_OFFICIAL[key]] = value
    return out


FP8_CASES = [("official", ".scale", "e8m0"), ("transformers", ".weight_scale_inv", "uint8"),
             ("transformers", ".scale", "fp32"), ("official", ".weight_scale_inv", "fp32"),
             ("transformers", ".weight_scale_inv", "e8m0")]


# every naming / scale encoding on the CSA layer (all projection kinds), fp32 output and the other kinds once
FP8_RUNS = ([(1, *case, torch.bfloat16) for case in FP8_CASES]
            + [(1, *FP8_CASES[0], torch.float32), (0, *FP8_CASES[1], torch.bfloat16),
               (2, *FP8_CASES[2], torch.float32)])


@pytest.mark.parametrize("layer_index,names,suffix,encoding,dtype", FP8_RUNS,
                         ids=[f"{KINDS[r[0]].short}-{r[1]}-{r[2][1:]}-{r[3]}-{str(r[4])[6:]}" for r in FP8_RUNS])
def test_fp8_block_weights(layer_index, names, suffix, encoding, dtype):
    geometry = ModelGeometry.from_hf_config(EDGE_CONFIG)
    state, expected = fp8_checkpoint(geometry, layer_index, encoding=encoding, suffix=suffix, seed=layer_index)
    assert any(v.dtype == E4M3 for v in state.values())
    if names == "official":
        state = prefixed(to_official_fp8(state), f"layers.{layer_index}.attn.")
    else:
        state = prefixed(state, f"model.layers.{layer_index}.self_attn.")
    layer = DSV4Attention.from_state_dict(state, geometry, layer_index, dtype=dtype)
    assert_same_state(layer.state_dict(), expected, dtype=dtype)


def test_fp8_shapes_cover_edge_blocks():
    """The edge geometry really has projections with partial 128-blocks in each dimension."""
    geometry = ModelGeometry.from_hf_config(EDGE_CONFIG)
    shapes = {k: tuple(v.shape) for k, v in DSV4Attention(geometry, 1).state_dict().items() if v.dim() == 2}
    assert shapes["q_a_proj.weight"] == (192, 320)  # partial rows and columns
    assert shapes["compressor.indexer.scorer.weights_proj.weight"] == (4, 320)
    assert any(r % 128 and not c % 128 for r, c in shapes.values())
    assert any(c % 128 and not r % 128 for r, c in shapes.values())


def test_fp8_mixed_with_bf16_projections():
    geometry = ModelGeometry.from_hf_config(EDGE_CONFIG)
    state, expected = fp8_checkpoint(geometry, 1, encoding="e8m0", suffix=".scale",
                                     quantize=lambda key: key in ("q_a_proj.weight", "compressor.kv_proj.weight"))
    assert sum(v.dtype == E4M3 for v in state.values()) == 2
    layer = DSV4Attention.from_state_dict(state, geometry, 1, dtype=torch.bfloat16)
    assert_same_state(layer.state_dict(), expected, dtype=torch.bfloat16)


# --- errors ----------------------------------------------------------------------------------------
def tiny_state(layer_index=1, dtype=torch.bfloat16):
    return hf_layer(layer_index, dtype, seed=7).state_dict()


def test_missing_weight(tiny):
    state = tiny_state()
    del state["compressor.indexer.kv_norm.weight"]
    with pytest.raises(WeightError, match=re.escape("missing ['compressor.indexer.kv_norm.weight']")):
        DSV4Attention.from_state_dict(state, tiny, 1)
    official = to_official(tiny_state())
    del official["attn_sink"]
    with pytest.raises(WeightError, match=re.escape("missing ['sinks']")):
        DSV4Attention.from_state_dict(prefixed(official, "layers.1.attn."), tiny, 1)


def test_unexpected_weight(tiny):
    state = tiny_state()
    state["q_c_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(WeightError, match=re.escape("unexpected ['q_c_proj.weight']")):
        DSV4Attention.from_state_dict(state, tiny, 1)
    # a CSA layer's weights (compressor, indexer) loaded as the window layer 0
    with pytest.raises(WeightError, match=r"layer 0: missing \[\], unexpected \['compressor\.gate_proj\.weight'"):
        DSV4Attention.from_state_dict(prefixed(tiny_state(1), "model.layers.0.self_attn."), tiny, 0)
    # an official name the mapping does not know
    official = prefixed({**to_official(tiny_state()), "wq_c.weight": torch.zeros(3)}, "layers.1.attn.")
    with pytest.raises(WeightError, match="unknown official attention weight 'wq_c.weight'"):
        DSV4Attention.from_state_dict(official, tiny, 1)


def test_wrong_shape(tiny):
    state = tiny_state()
    state["kv_proj.weight"] = state["kv_proj.weight"][:, :255]
    with pytest.raises(WeightError, match=re.escape("wrong shape ['kv_proj.weight [128, 255] (want [128, 256])']")):
        DSV4Attention.from_state_dict(state, tiny, 1)
    state = tiny_state()
    state["sinks"] = torch.zeros(8, 1, dtype=torch.bfloat16)
    with pytest.raises(WeightError, match=re.escape("sinks [8, 1] (want [8])")):
        DSV4Attention.from_state_dict(state, tiny, 1)


def fp8_tiny(suffix=".scale"):
    return fp8_checkpoint(ModelGeometry.preset("tiny"), 1, encoding="e8m0", suffix=suffix)[0]


def test_fp8_weight_without_scales(tiny):
    state = fp8_tiny()
    del state["compressor.indexer.scorer.weights_proj.scale"]
    with pytest.raises(WeightError, match=re.escape("compressor.indexer.scorer.weights_proj.weight is FP8 but has "
                                                    "no '.scale' / '.weight_scale_inv' block scales")):
        DSV4Attention.from_state_dict(state, tiny, 1)


def test_scales_without_fp8_weight(tiny):
    state = fp8_tiny(".weight_scale_inv")
    state["q_a_proj.weight"] = state["q_a_proj.weight"].to(torch.bfloat16)  # scales beside a bf16 weight
    with pytest.raises(WeightError, match=r"q_a_proj\.weight has block scales but is torch\.bfloat16, not "
                                          r"float8_e4m3fn"):
        DSV4Attention.from_state_dict(state, tiny, 1)
    state = fp8_tiny()
    state["o_c_proj.scale"] = torch.ones(1, 1)  # scales of no weight at all
    with pytest.raises(WeightError, match=re.escape("block scales without an FP8 weight: ['o_c_proj']")):
        DSV4Attention.from_state_dict(state, tiny, 1)


def test_two_scales_for_one_weight(tiny):
    """Both '.scale' and '.weight_scale_inv' for one weight: ambiguous, refused (not: the last key wins)."""
    state = fp8_tiny()
    state["q_a_proj.weight_scale_inv"] = state["q_a_proj.scale"].view(torch.uint8) + 3  # 8x, conflicting
    with pytest.raises(WeightError, match=re.escape("q_a_proj has two block scales (q_a_proj.scale, "
                                                    "q_a_proj.weight_scale_inv)")):
        DSV4Attention.from_state_dict(state, tiny, 1)


@pytest.mark.parametrize("shape", [(1, 1), (1, 2, 2), (2, 1)], ids=["too-few", "3-D", "transposed"])
def test_wrong_scale_shape(tiny, shape):
    state = fp8_tiny()
    assert state["kv_proj.weight"].shape == (128, 256)  # scales [1, 2]
    state["kv_proj.scale"] = torch.ones(shape)
    with pytest.raises(WeightError, match=re.escape(f"FP8 weight [128, 256] needs 128x128 block scales [1, 2], "
                                                    f"got {list(shape)}")):
        DSV4Attention.from_state_dict(state, tiny, 1)


def test_layer_missing_from_multi_layer_dict(tiny):
    state, _ = full_model_state(tiny, "model.layers.{i}.self_attn.", skip=(2,))
    with pytest.raises(WeightError, match="no weights for layer 2 in the state dict"):
        DSV4Attention.from_state_dict(state, tiny, 2)
    DSV4Attention.from_state_dict(state, tiny, 3)  # the others still load


def test_both_naming_schemes_for_one_layer(tiny):
    state = tiny_state(2)
    mixed = {**prefixed(state, "model.layers.2.self_attn."), **prefixed(to_official(state), "layers.2.attn.")}
    with pytest.raises(WeightError, match=r"layer 2: both transformers \(self_attn\) and official \(attn\) names"):
        DSV4Attention.from_state_dict(mixed, tiny, 2)
    # only one naming per layer is fine, even if layers differ
    mixed = {**prefixed(tiny_state(1), "model.layers.1.self_attn."), **prefixed(to_official(state), "layers.2.attn.")}
    assert_same_state(DSV4Attention.from_state_dict(mixed, tiny, 2).state_dict(), state)


def test_weight_error_is_a_key_error_with_a_plain_message(tiny):
    with pytest.raises(KeyError) as info:
        DSV4Attention.from_state_dict({}, tiny, 0)
    assert isinstance(info.value, WeightError)
    assert str(info.value).startswith("layer 0: missing [")


def test_public_names():
    """The layer and the ops are reachable where the README uses them."""
    import dsv4kv
    import dsv4kv.ops.kernels

    assert dsv4kv.DSV4Attention is DSV4Attention and dsv4kv.WeightError is WeightError
    assert all(callable(getattr(dsv4kv.ops.kernels, name)) for name in dsv4kv.ops.kernels.__all__)
