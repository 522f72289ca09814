"""How far transformers' own bf16 forward strays from fp32, position by position, on the GPU oracle test's V4-Flash
request (tests/test_engine_oracle.py: flash_config(4, index_topk=1024), seed 0, prompt 2 of (2600, 700, 1900, 129)
drawn with seed 1) and its 12-token fp32 greedy continuation. Runs on a CPU (about 10 minutes, 12 GB):

    python scripts/bf16_error_scale.py

Prints each position's largest |bf16 - fp32| logit, the fp32 top-2 gaps and the bf16 argmax misses: the scale the
engine's bf16 path is bounded by in `check_against_bf16_oracle`."""

import time

import torch

from dsv4kv.engine.reference import flash_config, random_model, reference_logits, with_dtype

NEW_TOKENS = 12


def main() -> None:
    start = time.time()
    config = flash_config(4, index_topk=1024)
    served = with_dtype(random_model(config, seed=0, device="cpu"), torch.bfloat16)
    oracle = with_dtype(served, torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in (2600, 700, 1900, 129)]
    sequence = list(prompts[1])
    for _ in range(NEW_TOKENS):  # the fp32 greedy continuation
        sequence.append(int(reference_logits(oracle, sequence, last=1)[-1].argmax()))
    exact = reference_logits(oracle, sequence, last=NEW_TOKENS + 1)[:-1]
    bf16 = reference_logits(served, sequence, last=NEW_TOKENS + 1)[:-1]
    error = (bf16 - exact).abs().max(-1).values
    top2 = exact.topk(2).values
    print("per-position max |bf16 - fp32| logit:", [round(float(e), 3) for e in error])
    print(f"largest {float(error.max()):.3f}; fp32 top-2 gaps:", [round(float(a - b), 3) for a, b in top2])
    print(f"bf16 argmax misses: {int((bf16.argmax(-1) != exact.argmax(-1)).sum())} of {NEW_TOKENS} "
          f"({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
