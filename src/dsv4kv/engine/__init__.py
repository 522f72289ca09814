"""dsv4kv.engine: a DeepSeek-V4 model served over the paged cache, token ids in, token ids out.

    params.py     SamplingParams
    request.py    a request's state; RequestOutput, StepOutput
    scheduler.py  continuous batching under a token budget, preemption (no tensors)
    model.py      DSV4Model: transformers' per-token modules around DSV4Attention
    checkpoint.py a checkpoint folder -> DSV4Model (transformers or official names, FP8 block weights)
    runner.py     one step -> logits; decode steps through padded (CUDA-graph) steps
    sampler.py    greedy / temperature, top-k, top-p with per-request generators; logprobs
    engine.py     Engine: generate, add_request / step / abort / output, next_token_logits
    reference.py  transformers' model as the reference: small configs, random weights, one-shot forward
"""

from .engine import Engine, EngineStats
from .model import DSV4Model
from .params import SamplingParams
from .request import RequestOutput, StepOutput

__all__ = ["Engine", "EngineStats", "DSV4Model", "SamplingParams", "RequestOutput", "StepOutput"]
