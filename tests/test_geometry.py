"""`ModelGeometry`: the presets reproduce SPEC §1, every config form (transformers object, dict,
config.json path, legacy and modern keys) reads to the same geometry, and configs dsv4kv cannot
serve are refused with a `GeometryError` naming the field.

The expected values below are typed in from SPEC §1, never read back from the library.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from importlib import resources

import pytest
from transformers import DeepseekV4Config

from dsv4kv.geometry import GeometryError, LayerKind, LayerSpec, ModelGeometry, RopeSpec, YarnScaling

# ----------------------------------------------------------------------------------------------------
# SPEC §1, typed in
# ----------------------------------------------------------------------------------------------------

SPEC = {
    "flash": dict(hidden_size=4096, num_layers=43, num_heads=64, q_lora_rank=1024, o_groups=8, index_topk=512,
                  pattern=[0, 0] + [4, 128] * 20 + [4]),
    "pro": dict(hidden_size=7168, num_layers=61, num_heads=128, q_lora_rank=1536, o_groups=16, index_topk=1024,
                pattern=[128, 128] + [4, 128] * 29 + [4]),
}
# Fields both models share (SPEC §1 "same" column).
SHARED = dict(head_dim=512, rope_dim=64, nope_dim=448, o_lora_rank=1024, window=128, index_n_heads=64,
              index_head_dim=128)
KIND_OF_RATIO = {0: LayerKind.WINDOW, 4: LayerKind.CSA, 128: LayerKind.HCA}
WINDOW_ROPE = RopeSpec(theta=10000.0, dim=64, yarn=None)
COMPRESS_ROPE = RopeSpec(theta=160000.0, dim=64, yarn=YarnScaling(
    factor=16.0, original_max_position=65536, beta_fast=32.0, beta_slow=1.0, attention_factor=1.0))
LAYER_COUNTS = {  # (window, CSA, HCA)
    "flash": (2, 21, 20),
    "pro": (0, 30, 31),
}
ALL_PRESETS = ("flash", "pro", "tiny", "mini")


# ----------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------

def preset_dict(name: str) -> dict:
    """A fresh copy of a preset's config.json-style dict."""
    return json.loads(resources.files("dsv4kv.presets").joinpath(f"{name}.json").read_text())


def renamed(geometry: ModelGeometry, name: str) -> ModelGeometry:
    return dataclasses.replace(geometry, name=name)


def assert_same_geometry(got: ModelGeometry, want: ModelGeometry) -> None:
    """Equal in every field but `name`; on failure, say which fields differ."""
    got = renamed(got, want.name)
    if got != want:
        diffs = [f.name for f in dataclasses.fields(want) if getattr(got, f.name) != getattr(want, f.name)]
        raise AssertionError(f"geometries differ in {diffs}")


def pattern(geometry: ModelGeometry) -> list[tuple[LayerKind, int]]:
    return [(spec.kind, spec.ratio) for spec in geometry.layers]


def expected_pattern(ratios: list[int]) -> list[tuple[LayerKind, int]]:
    return [(KIND_OF_RATIO[r], r) for r in ratios]


def legacy_to_layer_types(data: dict) -> dict:
    """The same config with `compress_ratios` rewritten as modern `layer_types`."""
    data = copy.deepcopy(data)
    n = data["num_hidden_layers"]
    data["layer_types"] = [KIND_OF_RATIO[r].value for r in data.pop("compress_ratios")[:n]]
    return data


# ----------------------------------------------------------------------------------------------------
# 1. Presets reproduce SPEC §1
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["flash", "pro"])
def test_preset_scalar_fields_match_spec(name):
    g = ModelGeometry.preset(name)
    want = {**SHARED, **{k: v for k, v in SPEC[name].items() if k != "pattern"}}
    got = {k: getattr(g, k) for k in want}
    assert got == want
    assert g.name == name


@pytest.mark.parametrize("name", ["flash", "pro"])
def test_preset_layer_pattern_matches_spec(name):
    g = ModelGeometry.preset(name)
    assert pattern(g) == expected_pattern(SPEC[name]["pattern"])
    assert [spec.index for spec in g.layers] == list(range(SPEC[name]["num_layers"]))


@pytest.mark.parametrize("name", ["flash", "pro"])
def test_preset_rope_per_layer_kind(name):
    g = ModelGeometry.preset(name)
    for spec in g.layers:
        want = WINDOW_ROPE if spec.kind is LayerKind.WINDOW else COMPRESS_ROPE
        assert spec.rope == want, f"layer {spec.index} ({spec.kind.short}): {spec.rope} != {want}"


@pytest.mark.parametrize("name", ["flash", "pro"])
def test_preset_json_trailing_mtp_entry_is_ignored(name):
    data = preset_dict(name)
    n = data["num_hidden_layers"]
    # the JSON carries one MTP layer entry past num_hidden_layers
    assert len(data["compress_ratios"]) == n + 1
    assert ModelGeometry.preset(name).num_layers == n
    # whatever that trailing entry says, it must not change the geometry
    data["compress_ratios"][-1] = 4
    assert_same_geometry(ModelGeometry.from_hf_config(data), ModelGeometry.preset(name))


@pytest.mark.parametrize("name", ALL_PRESETS)
def test_preset_by_name_through_from_hf_config(name):
    assert ModelGeometry.from_hf_config(name) == ModelGeometry.preset(name)


# ----------------------------------------------------------------------------------------------------
# 2. transformers' own DeepseekV4Config, dicts and paths
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL_PRESETS)
def test_transformers_config_gives_preset_geometry(name):
    cfg = DeepseekV4Config(**preset_dict(name))  # transformers folds the legacy keys itself
    assert_same_geometry(ModelGeometry.from_hf_config(cfg), ModelGeometry.preset(name))


@pytest.mark.parametrize("name", ALL_PRESETS)
def test_transformers_normalized_dict_gives_preset_geometry(name):
    normalized = DeepseekV4Config(**preset_dict(name)).to_dict()
    assert_same_geometry(ModelGeometry.from_hf_config(normalized), ModelGeometry.preset(name))


@pytest.mark.parametrize("name", ALL_PRESETS)
def test_config_json_path_and_dict_agree(name, tmp_path):
    data = preset_dict(name)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    from_path = ModelGeometry.from_hf_config(path)
    from_str = ModelGeometry.from_hf_config(str(path))
    from_dict = ModelGeometry.from_hf_config(data)
    assert from_path == from_str
    assert_same_geometry(from_path, from_dict)
    assert_same_geometry(from_dict, ModelGeometry.preset(name))


def test_names_default_sensibly(tmp_path):
    model_dir = tmp_path / "DeepSeek-V4-Flash"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(preset_dict("flash")))
    assert ModelGeometry.from_hf_config(model_dir / "config.json").name == "DeepSeek-V4-Flash"
    assert ModelGeometry.from_hf_config(preset_dict("flash"), name="mine").name == "mine"


def test_tiny_preset_has_hca_ratio_16():
    g = ModelGeometry.preset("tiny")
    assert pattern(g) == [(LayerKind.WINDOW, 0), (LayerKind.CSA, 4), (LayerKind.HCA, 16), (LayerKind.CSA, 4)]
    assert g.ratios == (4, 16)


# ----------------------------------------------------------------------------------------------------
# 3. Legacy and modern forms read alike
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["flash", "pro"])
def test_layer_types_and_compress_ratios_agree(name):
    modern = legacy_to_layer_types(preset_dict(name))
    assert "compress_ratios" not in modern
    assert_same_geometry(ModelGeometry.from_hf_config(modern), ModelGeometry.preset(name))


def test_legacy_scalar_compress_rates_fold_like_compress_rates():
    data = preset_dict("tiny")
    rates = data.pop("compress_rates")
    data["compress_rate_csa"] = rates["compressed_sparse_attention"]
    data["compress_rate_hca"] = rates["heavily_compressed_attention"]
    assert_same_geometry(ModelGeometry.from_hf_config(data), ModelGeometry.preset("tiny"))


@pytest.mark.parametrize("rope_keys", [
    pytest.param({"qk_rope_head_dim": 64}, id="qk_rope_head_dim"),
    pytest.param({"partial_rotary_factor": 0.125}, id="partial_rotary_factor"),  # 0.125 * 512 = 64
    pytest.param({}, id="default"),
])
def test_rope_width_forms(rope_keys):
    data = preset_dict("flash")
    del data["qk_rope_head_dim"]
    data.update(rope_keys)
    g = ModelGeometry.from_hf_config(data)
    assert (g.rope_dim, g.nope_dim) == (64, 448)
    assert_same_geometry(g, ModelGeometry.preset("flash"))


def test_partial_rotary_factor_sets_another_width():
    data = preset_dict("flash")
    del data["qk_rope_head_dim"]
    data["partial_rotary_factor"] = 0.25
    assert ModelGeometry.from_hf_config(data).rope_dim == 128


def _yarn_params(**extra) -> dict:
    return {"factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1, **extra}


@pytest.mark.parametrize("rope_form", [
    pytest.param({"rope_scaling": _yarn_params(type="yarn")}, id="rope_scaling-type"),
    pytest.param({"rope_scaling": _yarn_params(rope_type="yarn")}, id="rope_scaling-rope_type"),
    pytest.param({"rope_parameters": _yarn_params(rope_type="yarn")}, id="rope_parameters-flat"),
    pytest.param({"rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0},
        "compress": _yarn_params(rope_type="yarn", rope_theta=160000.0, attention_factor=1.0),
    }}, id="rope_parameters-nested"),
])
def test_rope_scaling_forms(rope_form):
    data = preset_dict("flash")
    del data["rope_scaling"]
    data.update(rope_form)
    assert_same_geometry(ModelGeometry.from_hf_config(data), ModelGeometry.preset("flash"))


def test_nested_rope_parameters_yarn_values_are_read():
    data = preset_dict("flash")
    del data["rope_scaling"]
    data["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": 10000.0},
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 8, "original_max_position_embeddings": 32768,
                     "beta_fast": 16, "beta_slow": 2},
    }
    g = ModelGeometry.from_hf_config(data)
    assert g.layers[2].rope.yarn == YarnScaling(factor=8.0, original_max_position=32768, beta_fast=16.0, beta_slow=2.0)
    assert g.layers[0].rope.yarn is None  # window-only layers never scale


def test_nested_rope_parameters_thetas_are_read():
    data = preset_dict("flash")
    for key in ("rope_scaling", "rope_theta", "compress_rope_theta"):
        del data[key]
    data["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": 50000.0},
        "compress": {"rope_type": "yarn", "rope_theta": 320000.0, **_yarn_params()},
    }
    # DeepseekV4RotaryEmbedding uses config.rope_parameters[kind]["rope_theta"]
    for source in (DeepseekV4Config(**data), data):
        g = ModelGeometry.from_hf_config(source)
        assert (g.layers[0].rope.theta, g.layers[2].rope.theta) == (50000.0, 320000.0)


def test_disagreeing_rope_width_fields_are_refused():
    data = preset_dict("flash")
    data["partial_rotary_factor"] = 0.25  # 128 rope dims, but qk_rope_head_dim says 64
    with pytest.raises(GeometryError, match="partial_rotary_factor.*qk_rope_head_dim = 64"):
        ModelGeometry.from_hf_config(data)


def test_text_config_wrapper_of_v4_is_unwrapped():
    wrapped = {"model_type": "some_wrapper", "text_config": preset_dict("flash")}
    assert ModelGeometry.from_hf_config(wrapped, name="flash") == ModelGeometry.preset("flash")


def test_v41_ratios_refused_even_beside_layer_types():
    data = preset_dict("tiny")
    data["compress_ratios"] = [0, 4, 2, 4]
    with pytest.raises(GeometryError, match=r"V4\.1.*compress_ratios\[2\] = 2"):
        ModelGeometry.from_hf_config(data)


def test_no_rope_scaling_means_no_yarn():
    data = preset_dict("flash")
    del data["rope_scaling"]
    g = ModelGeometry.from_hf_config(data)
    assert all(spec.rope.yarn is None for spec in g.layers)


def test_integral_floats_are_accepted():
    data = preset_dict("flash")
    data["hidden_size"] = 4096.0
    assert ModelGeometry.from_hf_config(data).hidden_size == 4096


# ----------------------------------------------------------------------------------------------------
# 4. Refusals name the field
# ----------------------------------------------------------------------------------------------------

def _set(**changes):
    """An edit of the flash dict: key=value sets it, key=DELETE removes it."""
    def edit(data: dict) -> dict:
        for key, value in changes.items():
            if value is DELETE:
                data.pop(key, None)
            else:
                data[key] = value
        return data
    return edit


def _ratios(**at):
    """Flash's compress_ratios with entries replaced: _ratios(i2=6) sets layer 2's ratio to 6."""
    def edit(data: dict) -> dict:
        for key, value in at.items():
            data["compress_ratios"][int(key[1:])] = value
        return data
    return edit


def _as_v41_text_config(data: dict) -> dict:
    return {"model_type": "deepseek_v41", "text_config": {**data, "model_type": "deepseek_v41_text"}}


def _text_config_only_v41(data: dict) -> dict:
    return {"text_config": {**data, "model_type": "deepseek_v41_text"}}


def _modern(**changes):
    """Flash in layer_types form, then edited."""
    def edit(data: dict) -> dict:
        return _set(**changes)(legacy_to_layer_types(data))
    return edit


DELETE = object()
FLASH_TYPES = [KIND_OF_RATIO[r].value for r in SPEC["flash"]["pattern"]]

REFUSALS = [
    ("v41-model_type", _set(model_type="deepseek_v41"), r"model_type.*V4\.1"),
    ("v41-text_config", _as_v41_text_config, r"V4\.1"),
    ("v41-text_config-inner-type", _text_config_only_v41, r"V4\.1.*deepseek_v41_text"),
    ("v41-ratio-1", _ratios(i3=1), r"V4\.1.*compress_ratios\[3\] = 1"),
    ("v41-ratio-2", _ratios(i2=2), r"V4\.1.*compress_ratios\[2\] = 2"),
    ("v41-kv_source_layer_ids", _set(kv_source_layer_ids=[0] * 43), r"kv_source_layer_ids"),
    ("kv-heads-2", _set(num_key_value_heads=2), r"num_key_value_heads"),
    ("layer_types-short", _modern(layer_types=FLASH_TYPES[:42]), r"layer_types: 42 entries"),
    ("compress_ratios-short", _set(compress_ratios=SPEC["flash"]["pattern"][:40]), r"compress_ratios: 40 entries"),
    ("layer_types-unknown", _modern(layer_types=FLASH_TYPES[:5] + ["full_attention"] + FLASH_TYPES[6:]),
     r"layer_types\[5\].*full_attention"),
    ("no-schedule", _set(compress_ratios=DELETE), r"layer_types: missing"),
    ("ratio-6", _ratios(i2=6), r"compress_ratios\[2\]: expected 0 \(window\), 4 \(CSA\) or 128 \(HCA\)"),
    ("ratio-256", _ratios(i3=256), r"compress_ratios\[3\]: expected 0 \(window\), 4 \(CSA\) or 128 \(HCA\)"),
    ("ratio-vs-rate", _set(compress_rate_hca=64), r"compress_ratios\[3\].*128 \(HCA\) per compress_rates, got 128|"
     r"compress_ratios\[3\]: expected 0 \(window\), 4 \(CSA\) or 64 \(HCA\)"),
    ("rate-not-pow2", _set(compress_rates={"heavily_compressed_attention": 96}), r"compress_rates.*power of two"),
    ("types-vs-ratios", _set(layer_types=["sliding_attention"] * 43), r"layer_types\[2\].*disagrees with compress_ratios\[2\]"),
    ("layers-negative", _set(num_hidden_layers=-40), r"num_hidden_layers: expected a positive int"),
    ("ratios-not-list", _set(compress_ratios=5), r"compress_ratios: expected a list or tuple"),
    ("rates-not-dict", _set(compress_rates=[4, 128]), r"compress_rates: expected a dict"),
    ("rope-scaling-str", _set(rope_scaling="yarn"), r"rope_scaling: expected a dict"),
    ("rope-params-list", _set(rope_parameters=[1]), r"rope_parameters: expected a dict"),
    ("eps-negative", _set(rms_norm_eps=-1), r"rms_norm_eps: expected a positive number"),
    ("theta-negative", _set(rope_theta=-5), r"rope_theta: expected a positive number"),
    ("v4_1-spelling", _set(model_type="deepseek_v4_1"), r"V4\.1"),
    ("compress_rates-256", _modern(compress_rates={"heavily_compressed_attention": 256}),
     r"compress_rates\['heavily_compressed_attention'\]"),
    ("compress_rates-6", _modern(compress_rates={"compressed_sparse_attention": 6}),
     r"compress_rates\['compressed_sparse_attention'\]"),
    ("rope-odd", _set(qk_rope_head_dim=63), r"qk_rope_head_dim"),
    ("rope-eq-head_dim", _set(qk_rope_head_dim=512), r"qk_rope_head_dim"),
    ("rope-gt-head_dim", _set(qk_rope_head_dim=1024), r"qk_rope_head_dim"),
    ("o_groups-3", _set(o_groups=3), r"o_groups: 3 does not divide num_attention_heads=64"),
    ("index_head_dim-32", _set(index_head_dim=32), r"index_head_dim"),
    ("hidden_size-missing", _set(hidden_size=DELETE), r"hidden_size: missing"),
    ("num_hidden_layers-missing", _set(num_hidden_layers=DELETE), r"num_hidden_layers: missing"),
    ("hidden_size-str", _set(hidden_size="big"), r"hidden_size: expected an integer"),
    ("hidden_size-fraction", _set(hidden_size=4096.5), r"hidden_size: expected an integer"),
    ("hidden_size-bool", _set(hidden_size=True), r"hidden_size"),
    ("num_heads-zero", _set(num_attention_heads=0), r"num_heads"),
    ("model_type-llama", _set(model_type="llama"), r"model_type: expected 'deepseek_v4'.*llama"),
    ("rope_scaling-linear", _set(rope_scaling={"type": "linear", "factor": 4}), r"rope_scaling.*linear"),
    ("rope_scaling-yarn-no-factor", _set(rope_scaling={"type": "yarn", "original_max_position_embeddings": 65536}),
     r"rope_scaling\.factor"),
    ("partial_rotary_factor-fraction", _set(qk_rope_head_dim=DELETE, partial_rotary_factor=0.1),
     r"partial_rotary_factor"),
]


@pytest.mark.parametrize("edit, match", [pytest.param(e, m, id=i) for i, e, m in REFUSALS])
def test_refusal_names_the_field(edit, match):
    data = edit(preset_dict("flash"))
    with pytest.raises(GeometryError, match=match):
        ModelGeometry.from_hf_config(data)


def test_geometry_error_is_a_value_error():
    # callers (the CLI) catch ValueError
    assert issubclass(GeometryError, ValueError)


def test_missing_path_is_refused(tmp_path):
    missing = tmp_path / "no" / "config.json"
    with pytest.raises(GeometryError, match=r"config: .*config\.json.* neither a preset"):
        ModelGeometry.from_hf_config(missing)


def test_unknown_preset_is_refused():
    with pytest.raises(GeometryError, match=r"preset: expected one of .*'huge'"):
        ModelGeometry.preset("huge")
    with pytest.raises(GeometryError, match=r"config: 'huge' is neither a preset"):
        ModelGeometry.from_hf_config("huge")


def test_unsupported_config_type_is_refused():
    with pytest.raises(GeometryError, match=r"config: expected .*got int"):
        ModelGeometry.from_hf_config(42)


# ----------------------------------------------------------------------------------------------------
# 5. Derived properties
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["flash", "pro"])
def test_layer_counts_by_kind(name):
    g = ModelGeometry.preset(name)
    counts = tuple(len(g.layers_of(kind)) for kind in (LayerKind.WINDOW, LayerKind.CSA, LayerKind.HCA))
    assert counts == LAYER_COUNTS[name]
    assert sum(counts) == g.num_layers == SPEC[name]["num_layers"]
    assert all(spec.kind is kind for kind in LayerKind for spec in g.layers_of(kind))


@pytest.mark.parametrize("name", ["flash", "pro"])
def test_ratios_and_nope_dim(name):
    g = ModelGeometry.preset(name)
    assert g.ratios == (4, 128)
    assert g.nope_dim == 448 == g.head_dim - g.rope_dim


@pytest.mark.parametrize("name", ["flash", "pro"])
def test_layer_flags(name):
    g = ModelGeometry.preset(name)
    for spec in g.layers:
        assert spec.compressed == (spec.kind is not LayerKind.WINDOW), spec
        assert spec.has_indexer == (spec.kind is LayerKind.CSA), spec


def test_describe_counts_kinds():
    assert ModelGeometry.preset("flash").describe() == "flash: 43 layers (2 window, 21 CSA, 20 HCA), 64 heads x 512"
    assert ModelGeometry.preset("pro").describe() == "pro: 61 layers (0 window, 30 CSA, 31 HCA), 128 heads x 512"


@pytest.mark.parametrize("content,match", [("{not json", "cannot read"), ("[1, 2]", "JSON list, expected an object")],
                         ids=["invalid-json", "json-list"])
def test_unreadable_config_files_are_refused(tmp_path, content, match):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(GeometryError, match=match):
        ModelGeometry.from_hf_config(str(path))
    with pytest.raises(GeometryError, match="cannot read"):
        ModelGeometry.from_hf_config(str(tmp_path))  # a directory


def test_dict_and_transformers_agree_on_custom_rates():
    data = preset_dict("tiny")  # layer_types + compress_rates {CSA: 4, HCA: 16}
    data["compress_ratios"] = [0, 4, 16, 4]  # the legacy form beside it, consistent
    assert ModelGeometry.from_hf_config(data) == dataclasses.replace(
        ModelGeometry.from_hf_config(DeepseekV4Config(**preset_dict("tiny"))), name=ModelGeometry.from_hf_config(data).name)


def test_layer_spec_validates_itself():
    rope = RopeSpec(theta=1e4, dim=64)
    with pytest.raises(GeometryError, match="CSA layer with compression ratio 0"):
        LayerSpec(index=0, kind=LayerKind.CSA, ratio=0, rope=rope)
    with pytest.raises(GeometryError, match="window layer with compression ratio 4"):
        LayerSpec(index=0, kind=LayerKind.WINDOW, ratio=4, rope=rope)
