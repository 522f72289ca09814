"""Byte compatibility with FlashMLA (GPU, `flash_mla` from the `sgl-flash-mla` wheel): on pages that dsv4kv wrote
through its own kernels (a V4-Flash CSA / HCA layer's prefill: kv insert, compress-and-insert, window appends), FlashMLA's
legacy SM90 sparse FP8 decode (`kv_format="V4"`) and dsv4kv's attention kernel: ours is within the attention
tolerance of the fp32 reference on the dequantized keys; FlashMLA, and the difference between the two, within
FlashMLA's own looser bound (bench.flashmla.FLASHMLA_TOL: FlashMLA's error, 2.2e-3..4.5e-3 measured, dominates the
difference; a misread page would be off by far more). Skipped without a GPU or without flash_mla."""

import pytest
import torch

from dsv4kv import CacheManager, DSV4Attention, ModelGeometry
from dsv4kv.tools.bench.flashmla import ATTENTION_TOL, FLASHMLA_TOL, Case, _flash_mla, row_error
from dsv4kv.model.layer import init_random_weights

flash_mla, REASON = _flash_mla() if torch.cuda.is_available() else (None, "no CUDA device")
pytestmark = pytest.mark.skipif(flash_mla is None, reason=REASON or "")

FLASH = ModelGeometry.from_hf_config("flash")


@pytest.mark.parametrize("kind", ["CSA", "HCA"])
def test_flashmla_decodes_pages_written_by_our_kernels(kind):
    device = torch.device("cuda", torch.cuda.current_device())
    index = next(i for i, layer in enumerate(FLASH.layers) if layer.kind.short == kind)
    cache = CacheManager(FLASH, max_requests=3, max_tokens=3 * 5000, device=device)
    layer = init_random_weights(DSV4Attention(FLASH, index, device=device, backend="triton"), seed=3)
    rids = [cache.admit() for _ in range(3)]
    g = torch.Generator(device=device).manual_seed(0)
    for chunk in ([(rids[0], 2048), (rids[1], 1500), (rids[2], 3001)], [(rids[0], 2049), (rids[1], 2000)]):
        plan = cache.plan_step(chunk)
        x = torch.randn(plan.num_tokens, FLASH.hidden_size, generator=g, device=device).bfloat16()
        layer(x, plan, cache)  # writes the window ring, compressed entries and indexer keys with our kernels
    case = Case(cache, index, rids, device, seed=4)
    ref = case.reference()
    ours = case.ours().clone()
    theirs = case.flash_mla_runner(flash_mla)()[:, 0].float()
    ours_err, theirs_err, between = row_error(ours, ref), row_error(theirs, ref), row_error(theirs, ours)
    print(f"{kind}: dsv4kv {ours_err:.2e}, FlashMLA {theirs_err:.2e} against fp32; FlashMLA vs dsv4kv {between:.2e}")
    assert torch.isfinite(ours).all() and torch.isfinite(theirs).all()
    assert ours_err <= ATTENTION_TOL and between <= FLASHMLA_TOL and theirs_err <= FLASHMLA_TOL
