"""The oracle comparison of tests/test_oracle.py as a table (GPU): worst and median row error against transformers
(fp32, whole sequence) for the reference ops and the Triton kernels, tiny and V4-Flash geometries, and the rows
whose top-k set differs. Writes the table to stdout (docs/kernels.md quotes it)."""

import sys
import time

import torch

sys.path.insert(0, "tests")
import test_oracle as T  # noqa: E402

from dsv4kv.layer import DSV4Attention  # noqa: E402


def measure(o, index, mode, backend, schedule, page_tokens):
    layer = DSV4Attention.from_transformers(o.hf_bf16).to("cuda")
    layer.backend = backend
    start = time.perf_counter()
    got, picks, _, _ = T.feed(layer, o.x, schedule, *T.MODES[mode], page_tokens=page_tokens)
    seconds = time.perf_counter() - start
    errors = T.row_errors(got, o.out)
    compared = torch.ones(len(errors), dtype=torch.bool)
    differ = 0
    if picks is not None:
        rows, _ = T.differing_rows(picks, o, layer.spec.ratio)
        compared[rows] = False
        differ = len(rows)
    e = errors[compared]
    return f"{float(e.max()):.4f} | {float(e.median()):.4f} | {differ} | {seconds:.1f}"


print("| geometry | layer | mode | backend | schedule | worst row | median | rows picking differently | s |")
print("|---|---|---|---|---|---|---|---|---|")
for kind, index in T.LAYERS.items():
    o = T.oracle(index)
    for mode in ("exact", "official", "fp8-indexer"):
        if mode == "fp8-indexer" and kind != "csa":
            continue
        for backend in ("torch", "triton"):
            print(f"| tiny | {kind} | {mode} | {backend} | interleaved | "
                  f"{measure(o, index, mode, backend, 'interleaved', 128)} |", flush=True)
for kind, index in T.FLASH_LAYERS.items():
    o = T.flash_oracle(index)
    for mode in ("exact", "official"):
        for backend in ("torch", "triton"):
            print(f"| flash | {kind} | {mode} | {backend} | chunks | {measure(o, index, mode, backend, 'chunks', 256)} |",
                  flush=True)
