"""Entry and page layouts: bytes land exactly where docs/layout.md says, and nothing else moves."""

import pytest
import torch

from dsv4kv.cache import quant
from dsv4kv.cache.layout import indexer_layout, main_layout
from dsv4kv.cache.pools import POISON_BYTE


def poisoned_pool(layout, pages, entries):
    return torch.full((pages, layout.page_bytes(entries)), POISON_BYTE, dtype=torch.uint8)


def randn(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g) * 3).to(torch.bfloat16)


def expected_main_fp8_bytes(x, nope):
    """Data row and scale row of one MODEL1 entry, built from the quantizers alone."""
    q, scale = quant.quantize_fp8(x[:, :nope], 64)
    data = torch.cat((q.view(torch.uint8), x[:, nope:].to(torch.bfloat16).contiguous().view(torch.uint8)), 1)
    scales = torch.zeros(x.shape[0], 8, dtype=torch.uint8)
    scales[:, :nope // 64] = quant.ue8m0_encode(scale)
    return data, scales


@pytest.mark.parametrize("head_dim,rope,entries", [(512, 64, 64), (512, 64, 8), (128, 64, 16)],
                         ids=["v4-P64", "v4-P8", "tiny-P16"])
def test_main_fp8_bytes_at_documented_offsets(head_dim, rope, entries):
    layout = main_layout("fp8", head_dim, rope)
    nope, row = head_dim - rope, head_dim - rope + 2 * rope
    assert (layout.data_bytes, layout.scale_bytes) == (row, 8)
    pool = poisoned_pool(layout, 3, entries)
    before = pool.clone()
    slots = torch.tensor([entries + 5, 0, 3 * entries - 1])  # odd offsets, first and last entry of the pool
    x = randn(3, head_dim, seed=1)
    layout.write(pool, entries, slots, x)

    data, scales = expected_main_fp8_bytes(x, nope)
    touched = torch.zeros_like(pool, dtype=torch.bool)
    for i, slot in enumerate(slots.tolist()):
        page, offset = divmod(slot, entries)
        d0 = offset * row
        s0 = entries * row + offset * 8
        assert torch.equal(pool[page, d0:d0 + row], data[i]), f"data row of slot {slot}"
        assert torch.equal(pool[page, s0:s0 + 8], scales[i]), f"scale row of slot {slot}"
        touched[page, d0:d0 + row] = True
        touched[page, s0:s0 + 8] = True
    assert torch.equal(pool[~touched], before[~touched]), "bytes outside the written entries changed"


def test_v4_page_is_padded_to_data_rows():
    layout = main_layout("fp8", 512, 64)
    assert layout.entry_bytes == 584
    assert [layout.page_bytes(p) for p in (2, 8, 64, 256)] == [1728, 5184, 37440, 149760]


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_main_round_trip(fmt):
    layout = main_layout(fmt, 512, 64)
    pool = poisoned_pool(layout, 2, 8)
    x = randn(5, 512, seed=2)
    slots = torch.tensor([9, 2, 15, 0, 7])
    layout.write(pool, 8, slots, x)
    got = layout.read(pool, 8, slots)
    if fmt == "bf16":
        assert torch.equal(got, x.float())
    else:
        q, scale = quant.quantize_fp8(x[:, :448], 64)
        assert torch.equal(got[:, :448], quant.dequantize_fp8(q, scale, 64))
        assert torch.equal(got[:, 448:], x[:, 448:].float()), "rope dims must stay bf16-exact"


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "bf16"])
def test_indexer_keys(fmt):
    layout = indexer_layout(fmt, 128)
    assert layout.entry_bytes == {"fp8": 132, "mxfp4": 68, "bf16": 256}[fmt]
    pool = poisoned_pool(layout, 2, 16)
    k = randn(6, 128, seed=3)
    slots = torch.tensor([31, 0, 16, 5, 17, 30])
    layout.write(pool, 16, slots, k)
    got = layout.read(pool, 16, slots)
    if fmt == "bf16":
        assert not layout.rotated and torch.equal(got, k.float())
        return
    assert layout.rotated
    rotated = quant.hadamard_rotate(k).to(torch.bfloat16)
    if fmt == "fp8":
        q, scale = quant.quantize_fp8(rotated, 128)
        expected_data, expected_scale = q.view(torch.uint8), scale.view(torch.uint8)
        expected = quant.dequantize_fp8(q, scale, 128)
    else:
        packed, scale = quant.quantize_mxfp4(rotated, 32)
        expected_data, expected_scale = packed, quant.ue8m0_encode(scale)
        expected = quant.dequantize_mxfp4(packed, scale, 32)
    assert torch.equal(got, expected)
    # DeepGEMM-style page: all data rows first, then all scale rows
    page, offset = divmod(int(slots[0]), 16)
    d, s = layout.data_bytes, layout.scale_bytes
    assert torch.equal(pool[page, offset * d:(offset + 1) * d], expected_data[0])
    assert torch.equal(pool[page, 16 * d + offset * s:16 * d + (offset + 1) * s], expected_scale[0])
    # the rotation is orthonormal: scores against a rotated query survive quantization approximately
    q = torch.randn(128, generator=torch.Generator().manual_seed(4))
    exact = k.float() @ q
    approx = got @ quant.hadamard_rotate(q)
    tol = {"fp8": 0.08, "mxfp4": 0.35}[fmt] * k.float().norm(dim=1) * q.norm()
    assert (approx - exact).abs().le(tol).all(), (approx - exact).abs() / tol


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_sentinel_slots(fmt):
    layout = main_layout(fmt, 512, 64)
    pool = poisoned_pool(layout, 1, 4)
    before = pool.clone()
    layout.write(pool, 4, torch.tensor([-1, 2]), randn(2, 512, seed=5))
    got = layout.read(pool, 4, torch.tensor([2, -1, 1]))
    assert got[0].isfinite().all()
    assert got[1].isnan().all(), "slot -1 must read as NaN"
    assert got[2].isnan().all(), "a never-written poisoned entry must read as NaN"
    assert torch.equal(pool[:, :2 * layout.data_bytes], before[:, :2 * layout.data_bytes])


def test_non_finite_entry_poisons_only_its_block():
    layout = main_layout("fp8", 512, 64)
    pool = poisoned_pool(layout, 1, 2)
    x = randn(2, 512, seed=6).float()
    x[0, 70] = float("inf")  # second 64-dim block of entry 0
    layout.write(pool, 2, torch.tensor([0, 1]), x)
    got = layout.read(pool, 2, torch.tensor([0, 1]))
    assert got[0, 64:128].isnan().all()
    assert got[0, :64].isfinite().all() and got[0, 128:].isfinite().all()
    assert got[1].isfinite().all()


def test_bad_input():
    layout = main_layout("fp8", 512, 64)
    pool = poisoned_pool(layout, 2, 8)
    x = randn(2, 512, seed=7)
    with pytest.raises(ValueError, match=r"expected uint8 \[pages, 5184\]"):
        layout.write(pool.float(), 8, torch.tensor([0, 1]), x)
    with pytest.raises(ValueError, match="expected uint8"):
        layout.write(pool, 16, torch.tensor([0, 1]), x)  # wrong entries per page for this pool
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.zeros(2, 2 * 5184, dtype=torch.uint8)[:, ::2]  # right shape, not contiguous
        layout.write(strided, 8, torch.tensor([0, 1]), x)
    with pytest.raises(ValueError, match=r"x \[N, 512\]"):
        layout.write(pool, 8, torch.tensor([0, 1]), x[:, :256])
    with pytest.raises(ValueError, match="beyond"):
        layout.write(pool, 8, torch.tensor([0, 16]), x)
    with pytest.raises(ValueError, match="beyond"):
        layout.read(pool, 8, torch.tensor([16]))
    with pytest.raises(ValueError, match=r"slots: expected int32/int64 \[2\]"):
        layout.write(pool, 8, torch.tensor([0.0, 1.0]), x)
    with pytest.raises(ValueError, match=r"slots: expected int32/int64 \[2\]"):
        layout.write(pool, 8, torch.tensor([0, 1, 2]), x)
    with pytest.raises(ValueError, match="float x"):
        layout.write(pool, 8, torch.tensor([0, 1]), torch.ones(2, 512, dtype=torch.int32))
    with pytest.raises(ValueError, match="on meta"):
        layout.write(pool, 8, torch.tensor([0, 1]), x.to("meta"))
    with pytest.raises(ValueError, match="multiple of 64"):
        main_layout("fp8", 512, 96)
    with pytest.raises(ValueError, match="power of two"):
        indexer_layout("mxfp4", 96)
    with pytest.raises(ValueError):
        main_layout("fp16", 512, 64)
