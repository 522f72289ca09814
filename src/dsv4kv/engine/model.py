"""DSV4Model: token ids -> hidden states -> logits for one step's flattened tokens over the paged cache.

Every module but attention acts per token, so they are transformers' own modules (embedding,
hyper-connections, norms, MoE with hash or learned routers, the final hyper-head, norm and LM head), run
on the step's tokens as one sequence [1, N, ...]. Attention is dsv4kv's `DSV4Attention`, which reads the
step plan to find each token's request, position and cache. The decoder block below follows
transformers' `DeepseekV4DecoderLayer.forward` operation for operation.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..geometry import ModelGeometry
from ..model.layer import DSV4Attention
from ..cache.manager import CacheManager
from ..cache.plan import StepPlan

__all__ = ["DSV4Model", "DecoderBlock"]


class DecoderBlock(nn.Module):
    """transformers' hyper-connections, norms and MoE around a `DSV4Attention`."""

    def __init__(self, attn_hc: nn.Module, input_layernorm: nn.Module, self_attn: DSV4Attention, ffn_hc: nn.Module,
                 post_attention_layernorm: nn.Module, mlp: nn.Module):
        super().__init__()
        self.attn_hc, self.input_layernorm, self.self_attn = attn_hc, input_layernorm, self_attn
        self.ffn_hc, self.post_attention_layernorm, self.mlp = ffn_hc, post_attention_layernorm, mlp

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, plan: StepPlan, cache: CacheManager
                ) -> torch.Tensor:
        """streams [1, N, hc_mult, hidden], input_ids [1, N] -> [1, N, hc_mult, hidden]."""
        dtype = streams.dtype
        post, comb, collapsed = self.attn_hc(streams)  # [1, N, hc], [1, N, hc, hc], [1, N, hidden]
        attn = self.self_attn(self.input_layernorm(collapsed)[0], plan, cache)[None]  # [1, N, hidden]
        streams = post.to(dtype).unsqueeze(-1) * attn.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams)
        post, comb, collapsed = self.ffn_hc(streams)
        mlp = self.mlp(self.post_attention_layernorm(collapsed), input_ids=input_ids)  # [1, N, hidden]
        return post.to(dtype).unsqueeze(-1) * mlp.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                streams)


class DSV4Model(nn.Module):
    """A DeepSeek-V4 causal LM over a `CacheManager`: `forward(ids, plan, cache)` gives final hidden states,
    `logits(hidden)` the fp32 logits of the rows asked for."""

    def __init__(self, config, embed_tokens: nn.Embedding, blocks: Sequence[DecoderBlock], hc_head: nn.Module,
                 norm: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.config = config
        self.geometry = ModelGeometry.from_hf_config(config)
        if len(blocks) != self.geometry.num_layers:
            raise ValueError(f"blocks: {len(blocks)} decoder blocks for {self.geometry.num_layers} layers")
        self.embed_tokens, self.blocks = embed_tokens, nn.ModuleList(blocks)
        self.hc_head, self.norm, self.lm_head = hc_head, norm, lm_head
        self.hc_mult = int(config.hc_mult)
        self.vocab_size = int(lm_head.weight.shape[0])

    @classmethod
    def from_transformers(cls, model: nn.Module) -> "DSV4Model":
        """Shares `model`'s per-token modules (no copy) and copies each layer's attention into a DSV4Attention."""
        config = getattr(model, "config", None)
        if getattr(config, "model_type", None) != "deepseek_v4" or not hasattr(model, "lm_head") \
                or not hasattr(getattr(model, "model", None), "layers"):
            raise TypeError(f"from_transformers: expected a transformers DeepseekV4ForCausalLM, got "
                            f"{type(model).__name__}")
        inner = model.model
        blocks = [DecoderBlock(layer.attn_hc, layer.input_layernorm, DSV4Attention.from_transformers(layer.self_attn),
                               layer.ffn_hc, layer.post_attention_layernorm, layer.mlp) for layer in inner.layers]
        return cls(config, inner.embed_tokens, blocks, inner.hc_head, inner.norm, model.lm_head)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def attention_layers(self) -> list[DSV4Attention]:
        return [block.self_attn for block in self.blocks]

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, plan: StepPlan, cache: CacheManager) -> torch.Tensor:
        """input_ids int64 [N] in plan order (N = the plan's tokens, or its padded rows) -> hidden [N, hidden]."""
        ids = input_ids[None]  # [1, N]
        embeds = self.embed_tokens(ids)  # [1, N, hidden]
        streams = embeds.unsqueeze(2).expand(-1, -1, self.hc_mult, -1).contiguous()  # [1, N, hc, hidden]
        for block in self.blocks:
            streams = block(streams, ids, plan, cache)
        return self.norm(self.hc_head(streams))[0]

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> fp32 logits [R, vocab]."""
        return self.lm_head(hidden).float()
