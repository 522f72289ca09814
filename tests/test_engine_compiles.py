"""The engine's steps compile a bounded set of kernels: after a warm-up, steps of new shapes (new prompt lengths,
batch sizes, growing contexts, every decode graph size) launch no kernel with a specialization key (constexpr
values, launch options, Triton's classes of int and pointer arguments) that an earlier step did not have. On a
GPU each new key is a compilation (hundreds of ms to seconds), paid inside a step (issue 13: 9 tokens/s).

The keys are Triton's own (`dsv4kv.ops.shared.specialization`); the kernels are not run (`launch=False`): the
launches an engine step makes depend on the scheduler's shapes only, so the tokens (sampled from unwritten
outputs) do not matter, and the test takes seconds instead of minutes under the interpreter."""

from __future__ import annotations

import functools

import pytest
import torch

from dsv4kv.engine import Engine, SamplingParams
from dsv4kv.engine.reference import random_model, tiny_config, with_dtype
from dsv4kv.ops.attention import kernel as attention_module
from dsv4kv.ops.attention.tuning import TUNING as ATTENTION_TUNING
from dsv4kv.ops.indexer import query_kernel as query_module
from dsv4kv.ops.indexer.tuning import QUERY_TUNING
from dsv4kv.ops.topk import kernel as topk_module
from dsv4kv.ops.topk.tuning import TUNING as TOPK_TUNING
from dsv4kv.ops.shared.specialization import record_launches


pytestmark = pytest.mark.usefixtures("one_thread")

pytest.importorskip("triton")

FORMATS = {"official": dict(kv_format="fp8", indexer_format="mxfp4"),
           "exact": dict(kv_format="bf16", indexer_format="bf16")}
# one key per kernel and layer variant: attention and its launches per layer kind (window, CSA, HCA), the
# compressor per (CSA main, CSA indexer, HCA), append_state per ring shape, top-k per phase, the q RoPE (whole
# heads, rope dims only), the projection norms (q_a's, q's, kv's), the compressor rows split (CSA, HCA) and the
# one-row projections (q_a, q_b, the indexer's q_b, o_a, o_b)
BOUND = 34


@functools.lru_cache(maxsize=None)
def bf16_model():
    return with_dtype(random_model(tiny_config(), seed=0), torch.bfloat16)


def serve(engine: Engine, launches, lengths, *, new_tokens: int, arrive_every: int, seed: int) -> int:
    """Requests of `lengths` arriving every `arrive_every` steps; returns the steps run."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]
    added, steps = 0, 0
    while added < len(prompts) or engine.has_unfinished:
        if added < len(prompts) and steps % arrive_every == 0:
            engine.add_request(prompts[added], SamplingParams(max_new_tokens=new_tokens))
            added += 1
        launches.step += 1
        engine.step()
        steps += 1
    return steps


@pytest.mark.parametrize("numerics", FORMATS)
def test_steps_of_new_shapes_compile_nothing_new(numerics):
    device = "cuda" if torch.cuda.is_available() else None  # the CPU needs the interpreter, which a GPU run lacks
    engine = Engine.from_transformers(bf16_model(), max_requests=4, max_tokens=2048, page_tokens=128, step_tokens=64,
                                      max_seq_len=512, decode_graph_sizes=(1, 2, 4), device=device,
                                      **FORMATS[numerics])
    for layer in engine.model.attention_layers:
        layer.backend = "triton"
    with record_launches(launch=False) as launches:
        # warm-up: a prefill alone, mixed steps, decode steps of every graph size
        serve(engine, launches, (37, 5, 70, 18), new_tokens=5, arrive_every=3, seed=0)
        warm = {name: set(keys) for name, keys in launches.keys.items()}
        first_new = launches.step + 1
        # new shapes: other prompt lengths and arrival patterns, up to 4 requests at once, contexts past 300
        serve(engine, launches, (3, 129, 61, 250, 16, 44, 97, 1), new_tokens=9, arrive_every=2, seed=1)
        serve(engine, launches, (301, 2, 77), new_tokens=17, arrive_every=5, seed=2)
    assert engine.stats.graph_steps > 0 and engine.stats.decode_steps < engine.stats.steps
    new = {name: len(keys - warm.get(name, set())) for name, keys in launches.keys.items()}
    first = [key for step in range(first_new, launches.step + 1) for key in launches.new_keys(step)][:2]
    assert not any(new.values()), (f"steps {first_new}..{launches.step} launched kernels with new specialization "
                                   f"keys: {new}; the first: {first}")
    assert launches.distinct() <= BOUND, str({name: len(keys) for name, keys in launches.keys.items()})


def test_the_recorder_sees_what_triton_specializes():
    """The key tells the classes Triton compiles apart: an int == 1, divisible by 16, or neither; a pointer 16-byte
    aligned or not; unless the kernel lists the argument under do_not_specialize."""
    from dsv4kv.ops.shared.specialization import specialization_key

    kernel = topk_module._topk_kernel  # S is not specialized, k is

    def key(S, k, scores):
        args = (scores, torch.zeros(2, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                torch.zeros(4, dtype=torch.int32), 32, 1024, 64, S, 48, k)
        meta = dict(BLOCK=64, SPLITS=8, SELECT=64, PHASE=0, ASM=False, AHEAD=True, num_warps=4)
        return dict(specialization_key(kernel, args, meta))

    scores = torch.zeros(64)
    assert key(1, 8, scores)["S"] == key(3, 8, scores)["S"] == key(32, 8, scores)["S"]
    assert len({key(1, k, scores)["k"] for k in (1, 3, 32)}) == 3
    assert key(1, 8, scores)["scores_ptr"] != key(1, 8, scores[1:])["scores_ptr"]
    assert key(1, 8, scores)["PHASE"] == ("constexpr", "0") and key(1, 8, scores)["num_warps"] == ("option", 4)


def test_gpu_launch_configs_take_few_values(monkeypatch):
    """The tiles chosen per launch on a GPU (132 SMs), which Triton compiles as constants, take a handful of values
    over every decode and prefill shape of V4-Flash, while the split counts, which follow the shape, are runtime
    ints. Attention: heads 64, head_dim 512, window 128 + 512 picks (CSA) or up to 1M / 128 entries (HCA)."""
    monkeypatch.setattr(attention_module, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    attention = ATTENTION_TUNING["sm90"]
    configs = {(c.block_h, c.block_n, c.splits > 1, c.num_warps, c.num_stages)
               for rows in range(1, 4097) for max_keys in (128 + 512, 128 + 64, 128 + 8192)
               for c in [attention_module._config(rows, 64, max_keys, cuda, attention)]}
    assert len(configs) <= 6, configs  # (16 | 64 heads) x (32 | 64 keys) x (split or not), in part
    merges = {attention_module._merge_tile(c.splits, 512, attention) for rows in range(1, 4097)
              for max_keys in (128 + 512, 128 + 64, 128 + 8192, 128 + 4096, 128 + 1024)
              for c in [attention_module._config(rows, 64, max_keys, cuda, attention)] if c.splits > 1}
    assert len(merges) <= len(attention.merge_chunks), merges  # the merge's MERGE_S, DIMS and warps
    monkeypatch.setattr(topk_module, "sm_count", lambda device: 132)
    shapes = [(rows, cols) for rows in (1, 2, 3, 64, 8192) for cols in (1, 5000, 1 << 15, 1 << 18, 1 << 20)]
    # (programs, tile columns): two tilings, so two compilations (BLOCK, and SPLITS = 512 or 1024)
    topk = TOPK_TUNING["sm90"]
    tilings = {topk_module._tiling(rows, cols, torch.device("cuda", 0), topk) for rows, cols in shapes}
    assert tilings == {(264, 1024), (528, 2048)}
    for rows, cols in shapes:  # S fits the count vector of its own tiling
        programs, block = topk_module._tiling(rows, cols, torch.device("cuda", 0), topk)
        assert topk_module._split(rows, cols, torch.device("cuda", 0), topk)[0] <= programs
    # the indexer query's heads a program (a constexpr) over every row count: three values, so three compilations
    assert {query_module._tiles(64, rows, QUERY_TUNING["sm90"])[0] for rows in range(1, 8193)} == {4, 8, 16}
