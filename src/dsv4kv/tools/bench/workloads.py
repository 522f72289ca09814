"""The named benchmark workloads of `dsv4kv bench` (V4-Flash geometry, FP8 entries, MXFP4 indexer keys): `WORKLOADS`
by name, `QUICK` the `--quick` set.

Each workload checks what it times against the PyTorch reference in the same run (a failed check refuses
the figure) and adds `Result`s to the report. Long contexts are planned (every block allocated) and filled
with random valid bytes (`synthetic.fill_layer`) instead of being prefilled, except where a workload
compares outputs with transformers, which needs a real history.

    machine   copy bandwidth and bf16 GEMM rate (every other figure is a fraction of these)
    topk      top-k (k = 512) over one row of 16K .. 1M candidates and over batches
    insert    kv insert (RoPE, FP8 encode, write) and compress-and-insert at sizes that fill the GPU
    decode    a decode step of a layer: the attention core and the whole layer under CUDA graphs, per-kernel
              times (profiler), against context length (batch 1) and batch (128K context); CSA with FP8 indexer
              keys too at the indexer's target points
    layer     our layer against transformers' DeepseekV4Attention, decode, batch 1, 4K and 16K, each kind
    prefill   a CSA layer over a 64K-token prompt in 8K chunks, against the indexer's FLOP floor
    scale     one request at 2^20 tokens through all 43 layers; the most concurrent 128K requests that fit
    flashmla  our sparse attention beside FlashMLA's on the same pages (skipped without `import flash_mla`)
    chat      the engine over a shared 8K system prompt and 64 different 1K-token questions, prefix caching off and
              on: time to first token, total time, output tokens/s, hit rate (the demo's V4-Flash-geometry model)
    spec      speculative decoding: a CSA verify step's core (4 tokens per request) against a decode step's, and the
              engine's decode tokens/s and acceptance length without speculation and with each drafter (spec.py)

Where they live: machine, topk, insert and decode in `decode.py`; layer and prefill in `layer.py`; scale and chat
in `serving.py`; flashmla in `flashmla.py`. `common.py` holds the `Context` and the check of a layer's kernels
against its reference (`check_layer`).
"""

from __future__ import annotations

from typing import Callable

from .common import Context, check_layer
from .decode import core_bytes, decode, insert, machine, topk
from .flashmla import flashmla
from .layer import layer_vs_transformers, prefill
from .serving import ChatSizes, chat, scale
from .spec import spec
from .transfer import transfer

__all__ = ["Context", "WORKLOADS", "QUICK", "check_layer", "core_bytes", "ChatSizes"]

WORKLOADS: dict[str, Callable[[Context], None]] = {
    "machine": machine, "topk": topk, "insert": insert, "decode": decode, "layer": layer_vs_transformers,
    "prefill": prefill, "scale": scale, "flashmla": flashmla, "chat": chat, "spec": spec,
    "transfer": transfer,
}
QUICK = ("machine", "topk", "insert", "decode", "layer")
