"""Checkpoint names and weight formats for one attention layer.

Accepted names (the layer's own names are transformers' `DeepseekV4Attention` names):
- transformers: `q_a_proj.weight`, ..., `compressor.indexer.scorer.weights_proj.weight`, bare or under a
  `[model.]layers.{i}.self_attn.` prefix;
- official DeepSeek-V4 checkpoint: under `layers.{i}.attn.`: `wq_a`, `q_norm`, `wq_b`, `wkv`, `kv_norm`,
  `wo_a`, `wo_b`, `attn_sink`, `compressor.{wkv, wgate, ape, norm}`, `indexer.{wq_b, weights_proj}`,
  `indexer.compressor.{wkv, wgate, ape, norm}` (the renames transformers' converter applies).
Weights may be FP8: float8_e4m3fn values with one scale per 128x128 block, under `<name>.scale`
(official) or `<name>.weight_scale_inv` (transformers / DeepSeek-V3 style). A scale may be
float8_e8m0fnu, raw ue8m0 bytes (uint8), or a float tensor; it multiplies the block.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from ..cache import quant

__all__ = ["OFFICIAL_NAMES", "FP32_PARAMETERS", "WeightError", "check_state_keys", "layer_state_dict",
           "dequantize_block_fp8"]

FP8_BLOCK = 128


class WeightError(KeyError):
    """A checkpoint that does not hold exactly one attention layer's weights in an accepted form."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


# official name (under layers.{i}.attn.) -> transformers name, longest match first
OFFICIAL_NAMES = {
    "indexer.compressor.wkv.": "compressor.indexer.kv_proj.",
    "indexer.compressor.wgate.": "compressor.indexer.gate_proj.",
    "indexer.compressor.ape": "compressor.indexer.position_bias",
    "indexer.compressor.norm.": "compressor.indexer.kv_norm.",
    "indexer.wq_b.": "compressor.indexer.q_b_proj.",
    "indexer.weights_proj.": "compressor.indexer.scorer.weights_proj.",
    "compressor.wkv.": "compressor.kv_proj.",
    "compressor.wgate.": "compressor.gate_proj.",
    "compressor.ape": "compressor.position_bias",
    "compressor.norm.": "compressor.kv_norm.",
    "wq_a.": "q_a_proj.",
    "q_norm.": "q_a_norm.",
    "wq_b.": "q_b_proj.",
    "wkv.": "kv_proj.",
    "kv_norm.": "kv_norm.",
    "wo_a.": "o_a_proj.",
    "wo_b.": "o_b_proj.",
    "attn_sink": "sinks",
}
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
# Kept in fp32 whatever the layer's dtype, as transformers (`_keep_in_fp32_modules_strict`) and the official
# checkpoint keep them: norm weights, the sinks and the compressors' positional biases.
FP32_PARAMETERS = ("norm.weight", "sinks", "position_bias")


def check_state_keys(own: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise WeightError naming every missing, unexpected and wrongly shaped weight of `weights` against a
    module's own state dict `own`."""
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    wrong = [f"{k} {list(weights[k].shape)} (want {list(own[k].shape)})" for k in own
             if k in weights and weights[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        raise WeightError(f"{what}: missing {missing}, unexpected {unexpected}, wrong shape {wrong}")


def dequantize_block_fp8(weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """e4m3 weight [out, in] with scales [ceil(out/block), ceil(in/block)] -> fp32 [out, in]."""
    if weight.dim() != 2:
        raise WeightError(f"FP8 weight must be 2-D, got {list(weight.shape)}")
    rows, cols = -(-weight.shape[0] // block), -(-weight.shape[1] // block)
    if tuple(scale.shape) != (rows, cols):
        raise WeightError(f"FP8 weight {list(weight.shape)} needs {block}x{block} block scales [{rows}, {cols}], "
                          f"got {list(scale.shape)}")
    if scale.dtype == torch.uint8 or scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        scale = quant.ue8m0_decode(scale.view(torch.uint8))
    full = scale.float().repeat_interleave(block, 0)[:weight.shape[0]].repeat_interleave(block, 1)[:, :weight.shape[1]]
    return weight.float() * full


def _strip_prefix(state: Mapping[str, torch.Tensor], layer_index: int) -> tuple[dict[str, torch.Tensor], bool]:
    """The layer's entries with their prefix removed, and whether they use official names."""
    pattern = re.compile(rf"^(?:model\.)?layers\.{layer_index}\.(self_attn|attn)\.(.+)$")
    found: dict[str, dict[str, torch.Tensor]] = {"self_attn": {}, "attn": {}}
    for key, value in state.items():
        match = pattern.match(key)
        if match:
            found[match.group(1)][match.group(2)] = value
    if found["self_attn"] and found["attn"]:
        raise WeightError(f"layer {layer_index}: both transformers (self_attn) and official (attn) names present")
    if found["attn"]:
        return found["attn"], True
    if found["self_attn"]:
        return found["self_attn"], False
    if any(re.match(r"^(?:model\.)?layers\.\d+\.", key) for key in state):
        raise WeightError(f"no weights for layer {layer_index} in the state dict")
    official = any(key.startswith(("wq_a.", "wkv.", "attn_sink")) for key in state)
    return dict(state), official


def _rename_official(key: str) -> str:
    for old, new in OFFICIAL_NAMES.items():
        if key.startswith(old):
            return new + key[len(old):]
    raise WeightError(f"unknown official attention weight {key!r}")


def layer_state_dict(state: Mapping[str, torch.Tensor], layer_index: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One layer's weights in transformers' names, FP8 blocks dequantized, cast to `dtype` (norm weights, sinks
    and positional biases to fp32)."""
    entries, official = _strip_prefix(state, layer_index)
    scales: dict[str, torch.Tensor] = {}
    for key in entries:
        for suffix in _SCALE_SUFFIXES:
            if key.endswith(suffix):
                name = key[:-len(suffix)]
                if name in scales:
                    raise WeightError(f"{name} has two block scales ({', '.join(name + s for s in _SCALE_SUFFIXES)})")
                scales[name] = entries[key]
    out = {}
    for key, value in entries.items():
        if any(key.endswith(suffix) for suffix in _SCALE_SUFFIXES):
            continue
        if not isinstance(value, torch.Tensor):
            raise WeightError(f"{key}: expected a tensor, got {type(value).__name__}")
        name = key[:-len(".weight")] if key.endswith(".weight") else None
        if value.dtype == torch.float8_e4m3fn:
            if name not in scales:
                raise WeightError(f"{key} is FP8 but has no '.scale' / '.weight_scale_inv' block scales")
            value = dequantize_block_fp8(value, scales.pop(name))
        elif name in scales:
            raise WeightError(f"{key} has block scales but is {value.dtype}, not float8_e4m3fn")
        name = _rename_official(key) if official else key
        out[name] = value.to(torch.float32 if name.endswith(FP32_PARAMETERS) else dtype)
    if scales:
        raise WeightError(f"block scales without an FP8 weight: {sorted(scales)}")
    return out
