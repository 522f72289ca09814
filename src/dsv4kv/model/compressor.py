"""The modules of a layer's compressors (transformers' parameter names): the main compressor and, in CSA layers, the
lightning indexer's compressor, query projection and head-weight scorer.

`rows` computes a compressor's state rows as the official model does (fp32); `projected_rows`, the kernel path's, from
one GEMM of every compressor's projections stacked (`DSV4Attention.project`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..geometry import ModelGeometry
from ..ops.compress.reference import compressor_logits
from ..ops.projection.reference import rms_norm

__all__ = ["RMSNorm", "MainCompressor"]


class RMSNorm(nn.Module):  # its weight is one of weights.FP32_PARAMETERS
    """Weighted RMSNorm computed in fp32 (fp32 weight), returned in the input dtype (transformers' and the official rule)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _Scorer(nn.Module):
    def __init__(self, g: ModelGeometry, **kw):
        super().__init__()
        self.weights_proj = nn.Linear(g.hidden_size, g.index_n_heads, bias=False, **kw)


class _Compressor(nn.Module):
    """Projections of a compressor: width 2*dim with overlap (CSA), dim without (HCA)."""

    def __init__(self, g: ModelGeometry, dim: int, ratio: int, overlap: bool, **kw):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.kv_proj = nn.Linear(g.hidden_size, width, bias=False, **kw)
        self.gate_proj = nn.Linear(g.hidden_size, width, bias=False, **kw)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32, device=kw["device"]))
        self.kv_norm = RMSNorm(dim, g.rms_norm_eps, **kw)

    def rows(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's state rows, in fp32 like the official compressor: kv [N, width], logits (gate + bias) [N, width].
        The fp32 copies of the weights are kept between steps (a decode step would otherwise cast 2 x 16 MB of weights
        per CSA layer before its GEMMs)."""
        x32 = x.float()
        kv_weight, gate_weight = _weight_copy(self, "_fp32", (self.kv_proj.weight, self.gate_proj.weight),
                                              lambda ws: tuple(w.float() for w in ws))
        kv = torch.nn.functional.linear(x32, kv_weight)
        gate = torch.nn.functional.linear(x32, gate_weight)
        return kv, compressor_logits(gate, self.position_bias, positions)




# torch.mm(..., out_dtype=) (bf16 in, fp32 out on CUDA): torch >= 2.8; older versions take the fp32 GEMM
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


def _weight_copy(owner: nn.Module, name: str, weights: tuple[torch.Tensor, ...], make):
    """`make(weights)` (detached), kept on `owner` under `name` between steps and made again when a weight is replaced,
    moved or changed in place through autograd-visible ops (its `_version`). Not seen: writes through `.data`, and a
    captured CUDA graph, which keeps reading the copy it captured."""
    key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in weights)
    if getattr(owner, name + "_key", None) != key:
        setattr(owner, name, make(tuple(w.detach() for w in weights)))
        setattr(owner, name + "_key", key)
    return getattr(owner, name)


class _Indexer(_Compressor):
    def __init__(self, g: ModelGeometry, ratio: int, **kw):
        super().__init__(g, g.index_head_dim, ratio, overlap=True, **kw)
        self.q_b_proj = nn.Linear(g.q_lora_rank, g.index_n_heads * g.index_head_dim, bias=False, **kw)
        self.scorer = _Scorer(g, **kw)


class MainCompressor(_Compressor):
    def __init__(self, g: ModelGeometry, ratio: int, csa: bool, **kw):
        super().__init__(g, g.head_dim, ratio, overlap=csa, **kw)
        if csa:
            self.indexer = _Indexer(g, ratio, **kw)

    def _parts(self) -> list[_Compressor]:
        """This compressor, then its indexer's (CSA): the order of `projected_rows`' GEMM columns and outputs."""
        return [self, self.indexer] if hasattr(self, "indexer") else [self]

    def row_buffers(self, rows: int, device: torch.device
                    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Empty outputs of `projected_rows` for `rows` rows: the GEMM's fp32 [rows, sum of 2 w], and each compressor's
        (kv, logits) fp32 [rows, w] (for a caller that allocates on one stream and computes on another)."""
        widths = [part.kv_proj.weight.shape[0] for part in self._parts()]
        def empty(w):
            return torch.empty(rows, w, dtype=torch.float32, device=device)
        return empty(2 * sum(widths)), [(empty(w), empty(w)) for w in widths]

    def projected_rows(self, x: torch.Tensor, positions: torch.Tensor, buffers=None
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The kernel path's state rows (`rows`) of this compressor, then of its indexer's (CSA), from one GEMM of
        bf16 x with all their projections stacked, and one launch that splits it (`kernels.compressor_rows`).

        bf16 x and weights on a GPU: the GEMM runs on tensor cores with fp32 products and sums
        (`torch.mm(out_dtype=float32)`, an order of magnitude faster than the fp32 GEMM for a prefill chunk). The
        products of bf16 values are exact in fp32, as in `rows`' fp32 GEMM; only how the sums round differs
        (docs/numerics.md). Elsewhere an fp32 GEMM. The stacked copy of the weights
        (21 MB for a V4-Flash CSA layer) is kept as `rows`' fp32 copies are. buffers: `row_buffers`' outputs."""
        from ..ops import kernels
        parts = self._parts()
        weights = tuple(w for part in parts for w in (part.kv_proj.weight, part.gate_proj.weight))
        tensor_cores = (x.is_cuda and x.dtype == torch.bfloat16 and all(w.dtype == torch.bfloat16 for w in weights)
                        and _MM_OUT_DTYPE)
        dtype = torch.bfloat16 if tensor_cores else torch.float32
        stacked = _weight_copy(self, f"_stacked_{str(dtype)[6:]}", weights,
                               lambda ws: torch.cat([w.to(dtype) for w in ws]).t())  # [hidden, sum of widths]
        y, out = buffers if buffers is not None else self.row_buffers(x.shape[0], x.device)
        if tensor_cores:
            torch.mm(x, stacked, out_dtype=torch.float32, out=y)
        else:
            torch.mm(x.float(), stacked, out=y)
        return kernels.compressor_rows(y, positions, [part.position_bias for part in parts], out=out)

