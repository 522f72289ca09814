"""Model geometry: the DeepSeek-V4 attention facts the cache is shaped by.

`ModelGeometry.from_hf_config` reads a transformers `DeepseekV4Config`, a config dict or a
`config.json` path (modern `layer_types` or legacy `compress_ratios` form) or a preset name, and
refuses anything it cannot serve (V4.1, multi-head KV, malformed fields) naming the field.

Presets (`presets/<name>.json`; attention geometry only, no weights; `dsv4kv plan --help` lists them with their layers):
`flash` is DeepSeek-V4-Flash (43 layers), `pro` DeepSeek-V4-Pro (61 layers); `tiny` (4 layers, 8 heads x 128, window
16, HCA ratio 16) and `mini` (4 layers, 16 heads x 512, window 128, V4's ratios) are small test geometries. None is
the model `dsv4kv demo` builds (`demo-cpu`, `demo-gpu`: tools/demo.py).
"""

from __future__ import annotations

import enum
import json
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from typing import Any, Mapping

__all__ = ["LayerKind", "YarnScaling", "RopeSpec", "LayerSpec", "ModelGeometry", "PRESETS", "PRESET_NOTES",
           "GeometryError"]

PRESETS = ("flash", "pro", "tiny", "mini")
PRESET_NOTES = {"flash": "DeepSeek-V4-Flash", "pro": "DeepSeek-V4-Pro", "tiny": "a small test geometry",
                "mini": "a small test geometry with V4's head size"}  # what each preset is, for `dsv4kv plan --help`


class GeometryError(ValueError):
    """A config that dsv4kv cannot serve; the message names the offending field."""


class LayerKind(str, enum.Enum):
    WINDOW = "sliding_attention"  # window branch only
    CSA = "compressed_sparse_attention"  # window + overlapped compression (m=4) + lightning indexer
    HCA = "heavily_compressed_attention"  # window + dense attention over every compressed entry

    @property
    def short(self) -> str:
        return {"sliding_attention": "window", "compressed_sparse_attention": "CSA",
                "heavily_compressed_attention": "HCA"}[self.value]


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # V4 applies no mscale to cos/sin

    def __post_init__(self):
        if self.factor <= 1.0:
            raise GeometryError(f"rope yarn factor: expected > 1, got {self.factor}")
        if self.original_max_position <= 0:
            raise GeometryError(f"rope yarn original_max_position_embeddings: expected > 0, got {self.original_max_position}")


@dataclass(frozen=True)
class RopeSpec:
    """Interleaved RoPE over the last `dim` dims of a head (pairs 2i, 2i+1)."""

    theta: float
    dim: int
    yarn: YarnScaling | None = None


@dataclass(frozen=True)
class LayerSpec:
    index: int
    kind: LayerKind
    ratio: int  # 0 for window-only layers, else tokens pooled into one compressed entry
    rope: RopeSpec

    def __post_init__(self):
        if not isinstance(self.kind, LayerKind):
            raise GeometryError(f"layer {self.index}: kind must be a LayerKind, got {self.kind!r}")
        if (self.ratio == 0) != (self.kind is LayerKind.WINDOW) or self.ratio < 0:
            raise GeometryError(f"layer {self.index}: {self.kind.short} layer with compression ratio {self.ratio}")

    @property
    def compressed(self) -> bool:
        return self.kind is not LayerKind.WINDOW

    @property
    def has_indexer(self) -> bool:
        return self.kind is LayerKind.CSA


@dataclass(frozen=True)
class ModelGeometry:
    name: str
    hidden_size: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    max_position: int
    rms_norm_eps: float
    layers: tuple[LayerSpec, ...] = field(repr=False)

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "head_dim", "rope_dim", "q_lora_rank", "o_groups",
                     "o_lora_rank", "window", "index_n_heads", "index_head_dim", "index_topk", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise GeometryError(f"{name}: expected a positive int, got {value!r}")
        if self.rope_dim % 2 or self.rope_dim >= self.head_dim:
            raise GeometryError(f"qk_rope_head_dim: expected even and < head_dim={self.head_dim}, got {self.rope_dim}")
        if self.num_heads % self.o_groups:
            raise GeometryError(f"o_groups: {self.o_groups} does not divide num_attention_heads={self.num_heads}")
        if self.index_head_dim < self.rope_dim:
            # the indexer rotates the last rope_dim dims of its 128-d keys and queries
            raise GeometryError(f"index_head_dim: expected >= qk_rope_head_dim={self.rope_dim}, got {self.index_head_dim}")
        if not self.layers:
            raise GeometryError("num_hidden_layers: expected at least one layer")
        if [spec.index for spec in self.layers] != list(range(len(self.layers))):
            raise GeometryError("layers: indices must be 0..num_layers-1 in order")
        for kind in (LayerKind.CSA, LayerKind.HCA):
            if len({spec.ratio for spec in self.layers_of(kind)}) > 1:
                raise GeometryError(f"compress_rates: {kind.short} layers must share one ratio")
        if not self.rms_norm_eps > 0:
            raise GeometryError(f"rms_norm_eps: expected > 0, got {self.rms_norm_eps}")

    # --- derived -----------------------------------------------------------------------------
    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layers_of(self, kind: LayerKind) -> tuple[LayerSpec, ...]:
        return tuple(spec for spec in self.layers if spec.kind is kind)

    @cached_property
    def ratios(self) -> tuple[int, ...]:
        """Distinct compression ratios, ascending."""
        return tuple(sorted({spec.ratio for spec in self.layers if spec.compressed}))

    def describe(self) -> str:
        counts = ", ".join(f"{len(self.layers_of(k))} {k.short}" for k in LayerKind)
        return f"{self.name}: {self.num_layers} layers ({counts}), {self.num_heads} heads x {self.head_dim}"

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> "ModelGeometry":
        if name not in PRESETS:
            raise GeometryError(f"preset: expected one of {PRESETS}, got {name!r}")
        text = resources.files("dsv4kv.presets").joinpath(f"{name}.json").read_text()
        return cls.from_hf_config(json.loads(text), name=name)

    @classmethod
    def from_hf_config(cls, config: Any, *, name: str | None = None) -> "ModelGeometry":
        """Geometry from a transformers `DeepseekV4Config`, a config dict, a config.json path or a preset name."""
        if isinstance(config, (str, os.PathLike)):
            text = os.fspath(config)
            if text in PRESETS:
                return cls.preset(text)
            if not os.path.exists(text):
                raise GeometryError(f"config: {text!r} is neither a preset {PRESETS} nor an existing file")
            try:
                with open(text) as f:
                    data = json.load(f)
            except (OSError, ValueError) as error:
                raise GeometryError(f"config: cannot read {text!r} as JSON: {error}") from None
            if not isinstance(data, dict):
                raise GeometryError(f"config: {text!r} holds a JSON {type(data).__name__}, expected an object")
            return _from_dict(data, name or os.path.basename(os.path.dirname(os.path.abspath(text))) or text)
        if isinstance(config, Mapping):
            return _from_dict(dict(config), name or str(config.get("_name_or_path") or "custom"))
        if hasattr(config, "to_dict"):
            data = config.to_dict()
            # transformers keeps the resolved rope width as a runtime attribute only
            if getattr(config, "qk_rope_head_dim", None) is not None:
                data["qk_rope_head_dim"] = config.qk_rope_head_dim
            return _from_dict(data, name or str(getattr(config, "_name_or_path", "") or "custom"))
        raise GeometryError(f"config: expected a DeepseekV4Config, dict, path or preset name, got {type(config).__name__}")


# --- parsing ----------------------------------------------------------------------------------
_V41_FIELDS = ("kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id")
_V41_NAME = re.compile(r"v4[._]?1")
_DEFAULT_RATES = {LayerKind.CSA: 4, LayerKind.HCA: 128}


def _from_dict(data: dict, name: str) -> ModelGeometry:
    if isinstance(data.get("text_config"), dict):  # multimodal wrapper: the text model is inside
        if _V41_NAME.search(str(data.get("model_type"))):
            _refuse_v41(data["model_type"])
        data = {**data["text_config"]}
    model_type = data.get("model_type")
    if model_type is not None and _V41_NAME.search(str(model_type)):
        _refuse_v41(model_type)
    for key in _V41_FIELDS:
        if key in data:
            _refuse_v41(f"field {key!r}")
    for i, value in enumerate(_typed(data, "compress_ratios", (list, tuple)) or []):
        if value in (1, 2) and not isinstance(value, bool):
            _refuse_v41(f"compress_ratios[{i}] = {value}")
    if model_type not in (None, "deepseek_v4"):
        raise GeometryError(f"model_type: expected 'deepseek_v4', got {model_type!r}")

    num_layers = _int(data, "num_hidden_layers")
    if num_layers <= 0:
        raise GeometryError(f"num_hidden_layers: expected a positive int, got {num_layers}")
    kv_heads = data.get("num_key_value_heads", 1)
    if kv_heads != 1:
        raise GeometryError(f"num_key_value_heads: DeepSeek-V4 shares one KV head (K = V), got {kv_heads}")
    head_dim = _int(data, "head_dim", 512)
    rope_dim = _rope_dim(data, head_dim)

    kinds, ratios = _layer_schedule(data, num_layers)
    main_rope = RopeSpec(theta=_theta(data, "main", "rope_theta", 10000.0), dim=rope_dim)
    compress_rope = RopeSpec(theta=_theta(data, "compress", "compress_rope_theta", 160000.0), dim=rope_dim,
                             yarn=_yarn(data))
    layers = tuple(
        LayerSpec(index=i, kind=kind, ratio=ratio, rope=main_rope if kind is LayerKind.WINDOW else compress_rope)
        for i, (kind, ratio) in enumerate(zip(kinds, ratios))
    )
    return ModelGeometry(
        name=name,
        hidden_size=_int(data, "hidden_size"),
        num_heads=_int(data, "num_attention_heads"),
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=_int(data, "q_lora_rank"),
        o_groups=_int(data, "o_groups"),
        o_lora_rank=_int(data, "o_lora_rank"),
        window=_int(data, "sliding_window", 128),
        index_n_heads=_int(data, "index_n_heads", 64),
        index_head_dim=_int(data, "index_head_dim", 128),
        index_topk=_int(data, "index_topk", 512),
        max_position=_int(data, "max_position_embeddings", 1 << 20),
        rms_norm_eps=_positive_float(data.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
        layers=layers,
    )


def _refuse_v41(what: Any) -> None:
    raise GeometryError(
        f"model_type: DeepSeek-V4.1 ({what}) shares KV across layers and uses compression ratios 1 and 2; "
        "dsv4kv serves DeepSeek-V4 (deepseek_v4) only"
    )


def _int(data: dict, key: str, default: int | None = None) -> int:
    value = data.get(key, default)
    if value is None:
        raise GeometryError(f"{key}: missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise GeometryError(f"{key}: expected an integer, got {value!r}")
    return int(value)


def _rope_dim(data: dict, head_dim: int) -> int:
    legacy = _int(data, "qk_rope_head_dim") if data.get("qk_rope_head_dim") is not None else None
    factor = data.get("partial_rotary_factor")
    if factor is None:
        return 64 if legacy is None else legacy
    dim = head_dim * float(factor)
    if dim != int(dim):
        raise GeometryError(f"partial_rotary_factor: {factor} x head_dim {head_dim} is not an integer")
    if legacy is not None and legacy != int(dim):
        raise GeometryError(f"partial_rotary_factor: {factor} x head_dim {head_dim} = {int(dim)} rope dims "
                            f"disagrees with qk_rope_head_dim = {legacy}")
    return int(dim)


def _theta(data: dict, rope_kind: str, key: str, default: float) -> float:
    """RoPE base: transformers' nested rope_parameters[kind] wins over the flat config key."""
    nested = _typed(data, "rope_parameters", dict)
    if nested and isinstance(nested.get(rope_kind), dict) and "rope_theta" in nested[rope_kind]:
        return _positive_float(nested[rope_kind]["rope_theta"], f"rope_parameters[{rope_kind!r}].rope_theta")
    return _positive_float(data.get(key, default), key)


def _positive_float(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise GeometryError(f"{where}: expected a positive number, got {value!r}")
    return float(value)


def _layer_schedule(data: dict, num_layers: int) -> tuple[list[LayerKind], list[int]]:
    """Per-layer kinds and ratios, read as transformers reads them: `layer_types` names the kind, one
    rate per kind gives the ratio; legacy `compress_ratios` values map to kinds through those rates.
    Entries past num_hidden_layers (MTP layers) are ignored; if both forms are given they must agree."""
    rates = dict(_DEFAULT_RATES)
    given = _typed(data, "compress_rates", dict) or {}
    for kind in (LayerKind.CSA, LayerKind.HCA):
        legacy = data.get("compress_rate_csa" if kind is LayerKind.CSA else "compress_rate_hca")
        value = given.get(kind.value, legacy)
        if value is not None:
            rates[kind] = _ratio(value, f"compress_rates[{kind.value!r}]")

    from_types = from_ratios = None
    types = _typed(data, "layer_types", (list, tuple))
    if types is not None:
        if len(types) < num_layers:
            raise GeometryError(f"layer_types: {len(types)} entries for num_hidden_layers={num_layers}")
        from_types = []
        for i, value in enumerate(types[:num_layers]):
            try:
                from_types.append(LayerKind(value))
            except ValueError:
                raise GeometryError(
                    f"layer_types[{i}]: expected one of {[k.value for k in LayerKind]}, got {value!r}"
                ) from None
    values = _typed(data, "compress_ratios", (list, tuple))
    if values is not None:
        if len(values) < num_layers:
            raise GeometryError(f"compress_ratios: {len(values)} entries for num_hidden_layers={num_layers}")
        by_value = {0: LayerKind.WINDOW, rates[LayerKind.CSA]: LayerKind.CSA, rates[LayerKind.HCA]: LayerKind.HCA}
        from_ratios = []
        for i, value in enumerate(values[:num_layers]):
            if isinstance(value, bool) or value not in by_value:
                raise GeometryError(f"compress_ratios[{i}]: expected 0 (window), {rates[LayerKind.CSA]} (CSA) or "
                                    f"{rates[LayerKind.HCA]} (HCA) per compress_rates, got {value!r}")
            from_ratios.append(by_value[value])
    if from_types is not None and from_ratios is not None:
        for i, (a, b) in enumerate(zip(from_types, from_ratios)):
            if a is not b:
                raise GeometryError(f"layer_types[{i}] = {a.value!r} disagrees with compress_ratios[{i}] "
                                    f"({b.short})")
    kinds = from_types if from_types is not None else from_ratios
    if kinds is None:
        raise GeometryError("layer_types: missing (and no legacy compress_ratios)")
    return kinds, [0 if k is LayerKind.WINDOW else rates[k] for k in kinds]


def _typed(data: dict, key: str, types) -> Any:
    value = data.get(key)
    if value is not None and not isinstance(value, types):
        names = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        raise GeometryError(f"{key}: expected a {names}, got {type(value).__name__}")
    return value


def _ratio(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 4 or value > 128 or value & (value - 1):
        raise GeometryError(f"{where}: expected a power of two in [4, 128], got {value!r}")
    return value


def _yarn(data: dict) -> YarnScaling | None:
    """YaRN parameters of the compressed layers (window-only layers never scale)."""
    params = _typed(data, "rope_parameters", dict)
    if params and isinstance(params.get("compress"), dict):
        scaling = params["compress"]
    elif params:
        scaling = params
    else:
        scaling = _typed(data, "rope_scaling", dict) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise GeometryError(f"rope_scaling.type: expected 'yarn' or none, got {kind!r}")
    try:
        factor = float(scaling["factor"])
        original = int(scaling["original_max_position_embeddings"])
    except KeyError as missing:
        raise GeometryError(f"rope_scaling.{missing.args[0]}: missing for yarn") from None
    return YarnScaling(
        factor=factor,
        original_max_position=original,
        beta_fast=float(scaling.get("beta_fast", 32.0)),
        beta_slow=float(scaling.get("beta_slow", 1.0)),
        attention_factor=float(scaling.get("attention_factor", 1.0)),  # V4: no mscale
    )
