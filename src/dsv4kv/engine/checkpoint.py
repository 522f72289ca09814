"""A checkpoint folder (config.json + *.safetensors) -> DSV4Model.

Accepted names: transformers' (`model.layers.{i}.mlp.experts.gate_up_proj`, ...), the official DeepSeek-V4
ones (`embed.weight`, `head.weight`, `hc_head_fn`, `layers.{i}.attn_norm.weight`, `layers.{i}.hc_attn_fn`,
`layers.{i}.ffn.gate.bias`, `layers.{i}.ffn.experts.{e}.w1.weight`, ...), and the mix transformers' own
`save_pretrained` writes; each with or without a `model.` prefix. Attention weights go to
`DSV4Attention.from_state_dict` (`dsv4kv.model.weights`), the rest to transformers' per-token modules. FP8 weights
with 128x128 block scales (`.scale` or `.weight_scale_inv`) are dequantized, as for attention. FP4 expert weights are
refused, not guessed at.

The MTP layer (`mtp.0.*`, official names: the block's names as a main layer's, plus `e_proj`, `h_proj`, `enorm`,
`hnorm`, `norm`, `hc_head_{fn,base,scale}`) is read by `load_pretrained_mtp` into an `mtp.MTPLayer`; `load_pretrained`
ignores it, as it ignores any other `mtp.*` layer and layers past num_hidden_layers.
"""

from __future__ import annotations

import glob
import os
import re
from collections import defaultdict

import torch
from torch import nn

from ..geometry import ModelGeometry
from ..model.layer import DSV4Attention
from ..model.weights import WeightError, check_state_keys, dequantize_block_fp8
from .model import DecoderBlock, DSV4Model

__all__ = ["load_pretrained", "load_pretrained_mtp", "read_checkpoint", "normalize_names", "mtp_names"]

_ATTENTION = re.compile(r"^(?:model\.)?layers\.(\d+)\.(?:attn|self_attn)\.")
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(w[123])\.weight$")
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_TOP_NAMES = {"embed.weight": "embed_tokens.weight", "head.weight": "lm_head.weight",
              "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
# applied in order to what follows `layers.{i}.`
_LAYER_NAMES = [(r"^attn_norm\.", "input_layernorm."), (r"^ffn_norm\.", "post_attention_layernorm."),
                (r"^hc_attn_(fn|base|scale)$", r"attn_hc.\1"), (r"^hc_ffn_(fn|base|scale)$", r"ffn_hc.\1"),
                (r"^ffn\.", "mlp."), (r"^mlp\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
                (r"^mlp\.shared_experts\.w1\.", "mlp.shared_experts.gate_proj."),
                (r"^mlp\.shared_experts\.w2\.", "mlp.shared_experts.down_proj."),
                (r"^mlp\.shared_experts\.w3\.", "mlp.shared_experts.up_proj."),
                (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1")]  # the MTP layer's own hyper-head
# per-token parameters transformers keeps in fp32 whatever the model dtype
_FP32 = ("attn_hc.", "ffn_hc.", "hc_head.", "norm.weight", "e_score_correction_bias")


def read_checkpoint(path: str | os.PathLike) -> tuple[object, dict[str, torch.Tensor]]:
    """(transformers DeepseekV4Config, every tensor of every *.safetensors file) of a checkpoint folder."""
    from safetensors.torch import load_file
    from transformers import DeepseekV4Config

    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"checkpoint: no config.json in {path!r}")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"checkpoint: no *.safetensors files in {path!r}")
    config = DeepseekV4Config.from_pretrained(path)
    config._attn_implementation = "eager"
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return config, state


def normalize_names(state: dict[str, torch.Tensor], num_layers: int) -> tuple[dict, dict]:
    """Split a checkpoint into (attention entries, as given) and (every other weight in transformers' names
    without the `model.` prefix, FP8 blocks dequantized to fp32, per-expert weights stacked). MTP layers and layers
    past num_layers are left out."""
    attention, rest = {}, {}
    for key, value in state.items():
        if _MTP.match(key) or _layer_index(key) >= num_layers:
            continue
        if _ATTENTION.match(key):
            # transformers' save_pretrained writes the main kv norm as `attn.norm` (its reverse of the official
            # `.norm.` -> `.kv_norm.` rename); the official name is `attn.kv_norm`
            attention[re.sub(r"\.attn\.norm\.", ".attn.kv_norm.", key)] = value
        else:
            rest[key] = value
    return attention, _per_token_names(rest)


def mtp_names(state: dict[str, torch.Tensor]) -> tuple[dict, dict] | None:
    """The first MTP layer's weights (`[model.]mtp.0.*`) as if they were layer 0's: (attention entries under
    `layers.0.attn.`, every other weight in transformers' names under `layers.0.`), as `normalize_names` splits a
    main layer's; None when the checkpoint has no MTP layer."""
    own = {}
    for key, value in state.items():
        match = _MTP.match(key)
        if match and match.group(1) == "0":
            own[f"layers.0.{match.group(2)}"] = value
    if not own:
        return None
    attention = {k: v for k, v in own.items() if _ATTENTION.match(k)}
    return attention, _per_token_names({k: v for k, v in own.items() if k not in attention})


def _per_token_names(rest: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Non-attention weights -> transformers' names without the `model.` prefix, FP8 blocks dequantized, per-expert
    weights stacked."""
    rest = _dequantize(rest)
    renamed, experts = {}, defaultdict(dict)
    for key, value in rest.items():
        name = key[len("model."):] if key.startswith("model.") else key
        layer = _LAYER.match(name)
        if layer is None:
            renamed[_TOP_NAMES.get(name, name)] = value
            continue
        index, tail = layer.groups()
        for pattern, replacement in _LAYER_NAMES:
            tail = re.sub(pattern, replacement, tail)
        expert = _EXPERT.match(tail)
        if expert:
            experts[index][(int(expert.group(1)), expert.group(2))] = value
        else:
            renamed[f"layers.{index}.{tail}"] = value
    for index, weights in experts.items():
        count = 1 + max(e for e, _ in weights)
        missing = [f"{e}.{w}" for e in range(count) for w in ("w1", "w2", "w3") if (e, w) not in weights]
        if missing:
            raise WeightError(f"layer {index}: expert weights missing: {missing}")
        w1, w2, w3 = ([weights[(e, w)] for e in range(count)] for w in ("w1", "w2", "w3"))
        renamed[f"layers.{index}.mlp.experts.gate_up_proj"] = torch.cat((torch.stack(w1), torch.stack(w3)), dim=1)
        renamed[f"layers.{index}.mlp.experts.down_proj"] = torch.stack(w2)
    return renamed


def load_pretrained(path: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str = "cpu") -> DSV4Model:
    """The model of a checkpoint folder, weights in `dtype` (fp32 where transformers keeps them so) on `device`.
    Missing, unexpected or misshapen weights raise WeightError. Its MTP layer, if any, is ignored."""
    return _load(path, dtype, device, mtp=False)[0]


def load_pretrained_mtp(path: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str = "cpu"):
    """(the model, its MTP layer as an `mtp.MTPLayer` sharing the model's embedding and head, or None when the
    checkpoint has no `mtp.*` weights), as `load_pretrained` reads them."""
    return _load(path, dtype, device, mtp=True)


def _load(path, dtype, device, *, mtp: bool):
    from transformers import DeepseekV4ForCausalLM

    config, state = read_checkpoint(path)
    geometry = ModelGeometry.from_hf_config(config)
    attention, rest = normalize_names(state, geometry.num_layers)
    mtp_state = mtp_names(state) if mtp else None
    with torch.device("meta"):  # the modules' shapes, no memory; weights are assigned below
        skeleton = DeepseekV4ForCausalLM(config)
    inner = skeleton.model
    parts: dict[str, nn.Module] = {"embed_tokens": inner.embed_tokens, "norm": inner.norm, "hc_head": inner.hc_head,
                                   "lm_head": skeleton.lm_head}
    for i, layer in enumerate(inner.layers):
        for name in ("attn_hc", "input_layernorm", "ffn_hc", "post_attention_layernorm", "mlp"):
            parts[f"layers.{i}.{name}"] = getattr(layer, name)
    _assign_all(parts, rest, "checkpoint", dtype, device)
    blocks = [DecoderBlock(layer.attn_hc, layer.input_layernorm,
                           DSV4Attention.from_state_dict(attention, geometry, i, dtype=dtype, device=device),
                           layer.ffn_hc, layer.post_attention_layernorm, layer.mlp)
              for i, layer in enumerate(inner.layers)]
    model = DSV4Model(config, inner.embed_tokens, blocks, inner.hc_head, inner.norm, skeleton.lm_head)
    if mtp_state is None:
        return model, None
    from .mtp import MTPLayer, mtp_geometry

    mtp_attention, mtp_rest = mtp_state
    mtp_parts = MTPLayer.modules_for(model, meta=True)
    _assign_all({f"layers.0.{name}": module for name, module in mtp_parts.items()}, mtp_rest, "mtp.0", dtype, device)
    mtp_parts["self_attn"] = DSV4Attention.from_state_dict(mtp_attention, mtp_geometry(config), 0, dtype=dtype,
                                                           device=device)
    return model, MTPLayer.assemble(model, mtp_parts)


def _assign_all(parts: dict[str, nn.Module], weights: dict[str, torch.Tensor], what: str, dtype, device) -> None:
    """Assign each module of `parts` (by name prefix) its weights; a weight no part takes raises WeightError."""
    used = set()
    for prefix, module in parts.items():
        own = {k[len(prefix) + 1:]: v for k, v in weights.items() if k.startswith(prefix + ".")}
        used.update(f"{prefix}.{k}" for k in own)
        _assign(module, own, prefix, dtype, device)
    unexpected = sorted(set(weights) - used)
    if unexpected:
        raise WeightError(f"{what}: unexpected weights {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")


def _assign(module: nn.Module, weights: dict[str, torch.Tensor], prefix: str, dtype, device) -> None:
    own = module.state_dict()
    check_state_keys(own, weights, prefix)
    cast = {}
    for key, value in weights.items():
        full = f"{prefix}.{key}"
        if not own[key].is_floating_point():  # hash routes stay integer
            cast[key] = value.to(device=device, dtype=own[key].dtype)
        else:
            cast[key] = value.to(device=device, dtype=torch.float32 if any(p in full for p in _FP32) else dtype)
    module.load_state_dict(cast, strict=True, assign=True)


def _layer_index(key: str) -> int:
    match = _LAYER.match(key)
    return int(match.group(1)) if match else -1


def _dequantize(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FP8 weights with block scales -> fp32; anything else quantized is refused."""
    scales = {key[:-len(suffix)]: key for key in state for suffix in _SCALE_SUFFIXES if key.endswith(suffix)}
    out = {}
    for key, value in state.items():
        if any(key.endswith(suffix) for suffix in _SCALE_SUFFIXES):
            continue
        name = key[:-len(".weight")] if key.endswith(".weight") else key
        if value.dtype == torch.float8_e4m3fn:
            if name not in scales:
                raise WeightError(f"{key} is FP8 but has no '.scale' / '.weight_scale_inv' block scales")
            value = dequantize_block_fp8(value, state[scales.pop(name)])
        elif name in scales:
            raise WeightError(f"{key}: {value.dtype} weights with block scales (FP4 experts?) are not supported; "
                              "dsv4kv dequantizes FP8 (float8_e4m3fn) 128x128 blocks only")
        out[key] = value
    if scales:
        raise WeightError(f"block scales without a weight: {sorted(scales.values())}")
    return out
