"""dsv4kv.engine: a DeepSeek-V4 model served over the paged cache, token ids in, token ids out.

    params.py     SamplingParams
    request.py    a request's state; RequestOutput, StepOutput
    scheduler.py  continuous batching under a token budget, preemption (no tensors)
    model.py      DSV4Model: transformers' per-token modules around DSV4Attention
    checkpoint.py a checkpoint folder -> DSV4Model (transformers or official names, FP8 block weights)
    runner.py     one step -> logits; decode and verify steps through padded (CUDA-graph) steps
    sampler.py    greedy / temperature, top-k, top-p with per-request generators; logprobs
    drafters.py   speculative decoding's Drafter interface and the n-gram (prompt lookup) drafter
    mtp.py        the checkpoint's MTP layer as a drafter, over its own window cache
    speculative.py         the engine's drafting: settings checked, drafts proposed and checked per step
    speculative_sampling.py  which drafts a verify step keeps (the target's own tokens decide)
    cache_files.py  a request's cache to and from a file (Engine.save, add_request(cache_file=))
    disaggregated.py  prefill / decode roles in two processes over torch.distributed
    engine.py     Engine: generate, add_request / step / abort / output, save, next_token_logits
    reference.py  transformers' model as the reference: small configs, random weights, one-shot forward
"""

from .engine import Engine, EngineStats
from .model import DSV4Model
from .params import SamplingParams
from .request import RequestOutput, StepOutput

__all__ = ["Engine", "EngineStats", "DSV4Model", "SamplingParams", "RequestOutput", "StepOutput"]
