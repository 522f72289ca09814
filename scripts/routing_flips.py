"""Do the rare large bf16 logit errors of the random demo model come from MoE routing near-ties? On a CPU: the chat
bench's quick prompt (`bench chat --quick`, request 5) plus 16 tokens through transformers' DeepseekV4ForCausalLM
twice, in fp32 and in bf16 (the demo's "flash" model: V4-Flash attention geometry, 4 layers, 8 routed experts, 2
per token, top-k routing in layers 1-3). For every position: the largest |bf16 - fp32| logit, and whether the bf16
forward routed that token to other experts than fp32 in some layer. Prints the positions with a large error, the
positions with a routing flip, and how the two sets overlap. About 14 minutes on 2 cores, 16 GB:

    python scripts/routing_flips.py"""

import time

import torch

from dsv4kv.bench.workloads import CHAT_QUICK
from dsv4kv.demo import demo_model
from dsv4kv.engine.reference import reference_logits, with_dtype

LARGE = 0.5  # a logit error this large is an excursion: the bf16 rounding scale of this model is ~0.05-0.1


def forward(model, sequence):
    """fp32 logits [L, vocab] of every position, and per top-k-routed layer the sorted expert ids [L, k] and the
    fp32 router scores with the correction bias [L, experts]."""
    found = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: found.append(
        (out[2].sort(-1).values, (mod.score_fn(out[0].float()) + mod.e_score_correction_bias).float())))
        for m in model.modules() if type(m).__name__ == "DeepseekV4TopKRouter"]
    try:
        logits = reference_logits(model, sequence)
    finally:
        for h in hooks:
            h.remove()
    return logits, found


def main() -> None:
    start = time.time()
    oracle, _ = demo_model("flash", "cpu", seed=0)
    served = with_dtype(oracle, torch.bfloat16)
    gen = torch.Generator().manual_seed(11)  # the chat bench's prompts
    vocab = oracle.config.vocab_size
    system = torch.randint(0, vocab, (CHAT_QUICK.shared,), generator=gen).tolist()
    prompts = [system + torch.randint(0, vocab, (CHAT_QUICK.suffix,), generator=gen).tolist()
               for _ in range(CHAT_QUICK.requests)]
    sequence = prompts[5] + torch.randint(0, vocab, (16,), generator=torch.Generator().manual_seed(5)).tolist()
    exact, exact_routes = forward(oracle, sequence)
    bf16, bf16_routes = forward(served, sequence)
    error = (bf16 - exact).abs().max(-1).values
    flipped = torch.zeros(len(sequence), dtype=torch.bool)
    margins = {}
    for layer, ((e_idx, e_scores), (b_idx, _)) in enumerate(zip(exact_routes, bf16_routes), start=1):
        rows = (e_idx != b_idx).any(-1)
        flipped |= rows
        top = e_scores.sort(-1, descending=True).values
        for pos in rows.nonzero().flatten().tolist():
            margins.setdefault(pos, []).append(f"layer {layer}: fp32 margin {float(top[pos, 1] - top[pos, 2]):.1e}")
    large = error > LARGE
    print(f"{len(sequence)} positions; |bf16 - fp32| logit: median {float(error.median()):.3f}, "
          f"99th percentile {float(error.quantile(0.99)):.3f}, max {float(error.max()):.3f}")
    print(f"positions with an error > {LARGE}: {int(large.sum())}; with a routing flip: {int(flipped.sum())}; both: "
          f"{int((large & flipped).sum())}")
    print(f"largest error at positions without a flip: {float(error[~flipped].max()):.3f}; "
          f"median error at positions with a flip: {float(error[flipped].median()):.3f}")
    for pos in large.nonzero().flatten().tolist():
        print(f"  position {pos}: error {float(error[pos]):.3f}; routing flip: {'; '.join(margins.get(pos, ['none']))}")
    print(f"({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
