"""The model's own multi-token-prediction (MTP) layer as a drafter.

DeepSeek-V4 checkpoints carry one MTP layer (`mtp.0.*`; transformers drops it on load). From the official inference
code (`MTPBlock`): it is a whole decoder block (hyper-connections, norms, attention, MoE) whose attention is
window-only (compress ratio 0: RoPE theta `rope_theta`, no YaRN), its MoE routed by the learned router (its index is
past the hash-routed layers), placed after the main layers. At position i it reads the target's last hidden streams
h_i ([hc_mult, hidden], before the final hyper-head) and the embedding of the next token t_{i+1}:

    x = e_proj(enorm(embed(t_{i+1})))[None] + h_proj(hnorm(h_i))        # [hc_mult, hidden]
    x = block(x)                                                        # its attention over its own window of x
    logits = lm_head(norm(hc_head'(x)))                                 # predicts t_{i+2}

with the target's embedding and LM head, its own norms and hyper-head. `MTPLayer` is that computation over a
`CacheManager` of its own (one window-only layer: a window ring per request, no pages).

`MTPDrafter` drives it: after each target step it feeds the pairs (h_i, t_{i+1}) the step kept (`observe`), and the
last one's logits give the first draft; each further draft feeds the layer's own output streams back as h with the
previous draft (tentative steps of the MTP cache, each rolled back). A request's MTP window starts where the drafter
first sees it (after a prefix hit, a preemption or a swap: the positions the target computed since), its positions
counted from there (window attention with RoPE depends on relative positions only), so its first drafts there look
back over fewer tokens; drafts are only guesses, the engine verifies every one.
"""

from __future__ import annotations

import copy
import functools
from typing import Sequence

import torch
from torch import nn

from ..cache.manager import CacheManager
from ..cache.plan import OutOfBlocks
from ..geometry import ModelGeometry
from ..model.layer import DSV4Attention
from .drafters import DraftRequest, Drafter, ObservedRows
from .model import DecoderBlock, DSV4Model

__all__ = ["MTPLayer", "MTPDrafter", "mtp_geometry", "mtp_config"]


def mtp_config(config):
    """The transformers config of the MTP layer's decoder block: `config` with one window-only, learned-routed layer."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = 1
    config.layer_types = ["sliding_attention"]
    config.mlp_layer_types = ["moe"]
    if getattr(config, "compress_ratios", None) is not None:
        config.compress_ratios = [0]
    return config


def mtp_geometry(config) -> ModelGeometry:
    """The MTP layer's attention geometry: the model's, with one window-only layer."""
    data = config.to_dict()
    if getattr(config, "qk_rope_head_dim", None) is not None:
        data["qk_rope_head_dim"] = config.qk_rope_head_dim
    data.update(num_hidden_layers=1, layer_types=["sliding_attention"])
    data.pop("compress_ratios", None)
    name = str(getattr(config, "_name_or_path", "") or "model")
    return ModelGeometry.from_hf_config(data, name=f"{name} MTP")


class MTPLayer(nn.Module):
    """The MTP layer over the pages of its own `CacheManager` (made over `self.geometry`). The target's embedding
    and LM head are shared, not owned: they are not in this module's state dict."""

    def __init__(self, config, block: DecoderBlock, e_proj: nn.Linear, h_proj: nn.Linear, enorm: nn.Module,
                 hnorm: nn.Module, norm: nn.Module, hc_head: nn.Module, target: DSV4Model):
        super().__init__()
        if not isinstance(target, DSV4Model):
            raise TypeError(f"target: expected a DSV4Model, got {type(target).__name__}")
        self.config = config
        self.geometry = block.self_attn.geometry
        self.block, self.e_proj, self.h_proj = block, e_proj, h_proj
        self.enorm, self.hnorm, self.norm, self.hc_head = enorm, hnorm, norm, hc_head
        self.hc_mult = int(config.hc_mult)
        object.__setattr__(self, "_target", target)  # shared embedding and head: not a submodule

    @property
    def target(self) -> DSV4Model:
        return self._target

    @property
    def device(self) -> torch.device:
        return self.e_proj.weight.device

    @classmethod
    def modules_for(cls, target: DSV4Model, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None, meta: bool = False) -> dict[str, nn.Module]:
        """Uninitialized modules of an MTP layer for `target` (transformers' decoder-block parts, `DSV4Attention`,
        the projections and norms), by name; on the meta device with meta=True (a checkpoint assigns them)."""
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4DecoderLayer,
                                                                           DeepseekV4HyperHead, DeepseekV4RMSNorm)

        config = target.config
        dtype = dtype or target.dtype
        device = torch.device("meta") if meta else torch.device(device if device is not None else target.device)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        with torch.device(device):
            layer = DeepseekV4DecoderLayer(mtp_config(config), 0)
            parts = {name: getattr(layer, name) for name in
                     ("attn_hc", "input_layernorm", "ffn_hc", "post_attention_layernorm", "mlp")}
            parts.update(e_proj=nn.Linear(hidden, hidden, bias=False), h_proj=nn.Linear(hidden, hidden, bias=False),
                         enorm=DeepseekV4RMSNorm(hidden, eps), hnorm=DeepseekV4RMSNorm(hidden, eps),
                         norm=DeepseekV4RMSNorm(hidden, eps), hc_head=DeepseekV4HyperHead(config))
        if not meta:  # parameters in `dtype` but those transformers keeps in fp32 (buffers untouched, as with_dtype)
            for name, module in parts.items():
                fp32 = name in ("attn_hc", "ffn_hc", "hc_head") or name.endswith("norm")
                for param_name, param in module.named_parameters():
                    keep = fp32 or param_name.endswith("norm.weight")
                    param.data = param.data.to(torch.float32 if keep else dtype)
            parts["self_attn"] = DSV4Attention(mtp_geometry(config), 0, dtype=dtype, device=device)
        return parts

    @classmethod
    def assemble(cls, target: DSV4Model, parts: dict[str, nn.Module]) -> "MTPLayer":
        block = DecoderBlock(parts["attn_hc"], parts["input_layernorm"], parts["self_attn"], parts["ffn_hc"],
                             parts["post_attention_layernorm"], parts["mlp"])
        return cls(target.config, block, parts["e_proj"], parts["h_proj"], parts["enorm"], parts["hnorm"],
                   parts["norm"], parts["hc_head"], target)

    @classmethod
    def random(cls, target: DSV4Model, *, seed: int = 0) -> "MTPLayer":
        """An MTP layer for `target` with reproducible random weights of realistic scale, every value
        bf16-representable (as `engine.reference.random_model`): linear and expert weights N(0, 1/fan_in), norm
        weights 1 + N(0, 0.1), hyper-connection bases N(0, 0.5) and scales 1 + N(0, 0.1), sinks N(0, 1), router
        correction biases N(0, 0.1)."""
        layer = cls.assemble(target, cls.modules_for(target))
        generator = torch.Generator(device=layer.device).manual_seed(seed)
        randn = functools.partial(torch.randn, generator=generator, device=layer.device)
        with torch.no_grad():
            for name, param in sorted(layer.named_parameters()):
                shape = param.shape
                if name.endswith("norm.weight"):
                    value = 1 + 0.1 * randn(shape)
                elif name.endswith(("base", "hc_base")):
                    value = 0.5 * randn(shape)
                elif name.endswith(("scale", "hc_scale")):
                    value = 1 + 0.1 * randn(shape)
                elif name.endswith("sinks"):
                    value = randn(shape)
                else:
                    value = randn(shape) * shape[-1] ** -0.5
                param.copy_(value.bfloat16().float())
            for name, buffer in sorted(layer.named_buffers()):
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(0.1 * randn(buffer.shape))
        return layer

    @torch.no_grad()
    def forward(self, streams: torch.Tensor, next_ids: torch.Tensor, plan, cache: CacheManager) -> torch.Tensor:
        """streams [N, hc_mult, hidden] (the target's, or this layer's own output for a chained draft), next_ids int64
        [N] (the token after each row's position), in the plan's order -> the block's output streams
        [N, hc_mult, hidden]."""
        dtype = self.e_proj.weight.dtype
        e = self.enorm(self._target.embed_tokens(next_ids).to(dtype))  # [N, hidden]
        h = self.hnorm(streams.to(dtype))  # [N, hc, hidden]
        x = self.e_proj(e).unsqueeze(1) + self.h_proj(h)  # [N, hc, hidden]
        return self.block(x[None], next_ids[None], plan, cache)[0]

    @torch.no_grad()
    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [R, hc_mult, hidden] (the block's output) -> fp32 logits [R, vocab] through this layer's hyper-head
        and norm and the target's LM head."""
        return self._target.logits(self.norm(self.hc_head(streams[None]))[0])


class _State:
    """One request's MTP state: its id in the MTP cache, the target position its MTP position 0 is, and after an
    observed final row, the first draft and the streams to chain the next ones from."""

    def __init__(self, cache_id: int, offset: int):
        self.cache_id, self.offset = cache_id, offset
        self.next = offset  # the next target position to feed
        self.first: int | None = None  # the draft for the token after the newest one
        self.streams: torch.Tensor | None = None  # [hc, hidden]: the layer's output at the newest fed position


class MTPDrafter(Drafter):
    """Drafts with an `MTPLayer`: greedy (argmax) drafts, so the draft distribution is one-hot."""

    name = "mtp"
    needs_streams = True

    def __init__(self, layer: MTPLayer):
        if not isinstance(layer, MTPLayer):
            raise TypeError(f"layer: expected an MTPLayer, got {type(layer).__name__}")
        self.layer = layer
        self.cache: CacheManager | None = None
        self._states: dict[int, _State] = {}

    def bind(self, model, cache: CacheManager) -> None:
        if model is not self.layer.target:
            raise ValueError("MTPDrafter: its layer was made for another model than the engine's")
        if self.cache is not None:
            raise ValueError("MTPDrafter: already bound to an engine (make one drafter per engine)")
        self.layer.to(cache.device)  # where the engine moved its model
        spec = cache.spec
        # a window-only layer's blocks hold no bytes: the MTP cache is one window ring per request slot
        self.cache = CacheManager(self.layer.geometry, max_requests=cache.max_requests,
                                  max_tokens=cache.max_requests * cache.max_seq_len, kv_format=spec.kv_format,
                                  indexer_format=spec.indexer_format, device=cache.device,
                                  page_tokens=spec.page_tokens, max_seq_len=cache.max_seq_len)

    def release(self, request_id: int) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.cache.release(state.cache_id)

    def observe(self, rows: Sequence[ObservedRows]) -> None:
        batch, streams, next_ids = [], [], []
        for r in rows:
            if len(r.next_tokens) == 0:
                continue
            state = self._states.get(r.request_id)
            if state is None or state.next != r.start:  # new, or back after a gap: its window starts here
                self.release(r.request_id)
                cache_id = self.cache.admit()
                if cache_id is None:
                    raise RuntimeError("MTPDrafter: no free slot in its cache (more live requests than the engine's)")
                state = self._states[r.request_id] = _State(cache_id, r.start)
            state.next = r.start + len(r.next_tokens)
            state.first, state.streams = None, None
            batch.append((state, len(r.next_tokens), r.final))
            streams.append(r.streams.to(self.layer.device))
            next_ids.extend(int(t) for t in r.next_tokens)
        if not batch:
            return
        ids = torch.tensor(next_ids, dtype=torch.long, device=self.layer.device)
        out = self._run([(s.cache_id, n) for s, n, _ in batch], torch.cat(streams), ids, tentative=False)
        last = torch.tensor([n for _, n, _ in batch]).cumsum(0) - 1
        wanted = [i for i, (_, _, final) in enumerate(batch) if final]
        if wanted:
            rows_out = out[last[wanted].to(out.device)]
            drafts = self.layer.logits(rows_out).argmax(-1).tolist()
            for i, draft, row in zip(wanted, drafts, rows_out):
                batch[i][0].first, batch[i][0].streams = draft, row.clone()

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        chains = []  # (index, state, max drafts): requests whose first draft is ready
        for i, r in enumerate(requests):
            state = self._states.get(r.request_id)
            # ready when the MTP has fed every position up to the one before the newest token
            if r.max_drafts > 0 and state is not None and state.first is not None and state.next == len(r.tokens) - 1:
                drafts[i].append(state.first)
                chains.append((i, state, r.max_drafts))
        # draft j + 1 from a tentative step over the chain's pairs so far (rolled back after): row 0 pairs the layer's
        # output at the newest fed position with draft 1, row m pairs the previous step's row m - 1 output with draft
        # m + 1; the last row's logits give the next draft
        inputs = {i: [state.streams] for i, state, _ in chains}
        for depth in range(1, max((k for _, _, k in chains), default=0)):
            active = [(i, state) for i, state, k in chains if k > depth]
            if not active:
                break
            batch = [(state.cache_id, depth) for _, state in active]
            streams = torch.stack([row for i, _ in active for row in inputs[i]])
            ids = torch.tensor([d for i, _ in active for d in drafts[i]], dtype=torch.long, device=self.layer.device)
            out = self._run(batch, streams, ids, tentative=True)
            ends = [depth * (n + 1) - 1 for n in range(len(active))]
            new = self.layer.logits(out[ends]).argmax(-1).tolist()
            for n, ((i, _), draft) in enumerate(zip(active, new)):
                drafts[i].append(draft)
                inputs[i] = [inputs[i][0]] + [out[n * depth + m].clone() for m in range(depth)]
        return drafts

    def _run(self, batch, streams: torch.Tensor, ids: torch.Tensor, *, tentative: bool) -> torch.Tensor:
        """One MTP step: (MTP cache id, rows) pairs -> output streams [N, hc, hidden]. A tentative step's rows are
        all rolled back after it (`CacheManager.accept(id, 0)`)."""
        plan = self.cache.plan_step(batch, tentative=True) if tentative else self.cache.plan_step(batch)
        if isinstance(plan, OutOfBlocks):  # window-only blocks hold no bytes: the cache has one per page of the length
            raise RuntimeError(f"MTPDrafter: {plan}")
        try:
            return self.layer(streams, ids, plan, self.cache)
        finally:
            if tentative:
                for cache_id, _ in batch:
                    self.cache.accept(cache_id, 0)
