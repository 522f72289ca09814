"""`kernels.gemv_rows` (the layer's projections of one row) against an fp64 reference and against torch:

- every value within one bf16 unit of the exact (fp64) result plus 2^-16 of the sum of the products' magnitudes (the
  products are exact in fp32; the fp32 sums round, and a result that cancels can then move by more than a unit), and
  equal to the exact result rounded to bf16 in all but 2% of the values;
- groups = 1 is `torch.mm(x, w.t())`, groups > 1 the layer's grouped o_a (`DSV4Attention._grouped_o_a`), each within
  one unit; the layer's output projection through it within 2^-7 of the largest output of torch's;
- odd sizes (K not a multiple of the 128-wide tile, N not a multiple of the 8 or 4 rows a program owns), NaN-poisoned
  outputs, nothing written for no rows, and refusals of bad input (more than one row among them).

On the CPU the kernel runs under Triton's interpreter; the GPU test uses V4-Flash shapes.
"""

import dataclasses

import pytest
import torch

from dsv4kv import ModelGeometry
from dsv4kv.geometry import LayerKind
from dsv4kv.ops.projection.gemv import MAX_ROWS, gemv_rows
from dsv4kv.model.layer import DSV4Attention, init_random_weights

FLASH = ModelGeometry.preset("flash")
DEVICE = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def bf16(shape, seed, scale=1.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16).to(DEVICE)


def units_from(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """How many bf16 units each bf16 value of `got` lies from the fp64 `exact` rounded to bf16."""
    want = exact.to(torch.bfloat16)
    return (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()


def assert_near_exact(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, groups: int) -> None:
    exact = grouped_exact(x, w, groups)
    magnitude = grouped_exact(x.abs(), w.abs(), groups)
    unit = torch.ldexp(torch.ones_like(exact), torch.frexp(exact.abs().clamp_min(1e-38))[1] - 8)  # bf16 ulp
    err = (got.double() - exact).abs()
    assert torch.all(err <= unit + 2 ** -16 * magnitude), f"worst {(err / (unit + 2 ** -16 * magnitude)).max()}"
    assert (units_from(got, exact) > 0).float().mean().item() <= 0.02


def grouped_exact(x: torch.Tensor, w: torch.Tensor, groups: int) -> torch.Tensor:
    """fp64 x [M, G * K] by w [N, K]: each group of N / G weight rows against its K columns of x."""
    m, n = x.shape[0], w.shape[0]
    xg = x.double().view(m, groups, -1)  # [M, G, K]
    wg = w.double().view(groups, n // groups, -1)  # [G, N / G, K]
    return torch.einsum("mgk,gnk->mgn", xg, wg).reshape(m, n)


@pytest.mark.parametrize("n, k, groups", [(13, 200, 1), (64, 128, 1), (24, 3000, 1), (48, 96, 3), (40, 136, 8),
                                          (32, 256, 2)])
def test_gemv_rows_within_one_unit_of_exact(n, k, groups):
    rows = 1
    x, w = bf16((rows, groups * k), n), bf16((n, k), k, scale=k ** -0.5)
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = gemv_rows(x, w, groups=groups, out=out)
    assert got is out and not out.isnan().any()
    assert_near_exact(out, x, w, groups)


def test_gemv_rows_is_torchs_projection_within_one_unit():
    """groups = 1 against torch.mm; groups = 8 against the layer's grouped o_a (a bmm into o_b's layout)."""
    x, w = bf16((1, 256), 1), bf16((40, 256), 2, scale=1 / 16)
    assert units_from(gemv_rows(x, w), torch.mm(x, w.t()).double()).max().item() <= 1
    g = ModelGeometry.preset("tiny")
    layer = init_random_weights(DSV4Attention(g, 0, device=DEVICE), 3)
    out = bf16((1, g.num_heads, g.head_dim), 4)
    rows = gemv_rows(out.reshape(1, -1), layer.o_a_proj.weight, groups=g.o_groups)
    assert units_from(rows, layer._grouped_o_a(out).double()).max().item() <= 1
    want = layer.o_b_proj(layer._grouped_o_a(out)).float()  # o_b over o_a's values, each within one unit
    assert (layer.output_projection(out).float() - want).abs().max() <= 2 ** -7 * want.abs().max()


def test_gemv_rows_edges_and_refusals():
    w = bf16((8, 32), 0)
    assert gemv_rows(bf16((0, 32), 1), w).shape == (0, 8)
    assert torch.equal(gemv_rows(bf16((1, 0), 1), bf16((8, 0), 0)), torch.zeros(1, 8, dtype=torch.bfloat16,
                                                                                  device=DEVICE))
    with pytest.raises(ValueError, match="takes one"):
        gemv_rows(bf16((MAX_ROWS + 1, 32), 1), w)
    with pytest.raises(ValueError, match="x: expected"):
        gemv_rows(bf16((1, 33), 1), w)
    with pytest.raises(ValueError, match="x: expected"):
        gemv_rows(bf16((1, 32), 1).float(), w)
    with pytest.raises(ValueError, match="groups"):
        gemv_rows(bf16((1, 96), 1), w, groups=3)
    with pytest.raises(ValueError, match="groups"):
        gemv_rows(bf16((1, 32), 1), w, groups=0)
    with pytest.raises(ValueError, match="contiguous"):
        gemv_rows(bf16((1, 64), 1)[:, ::2], w)
    x = bf16((1, 32), 1)
    with pytest.raises(ValueError, match="overlaps"):
        gemv_rows(x, w, out=torch.empty(1, 8, dtype=torch.bfloat16, device=DEVICE).set_(x.untyped_storage(), 0,
                                                                                     (1, 8)))
    with pytest.raises(ValueError, match="out: expected"):
        gemv_rows(x, w, out=torch.empty(1, 9, dtype=torch.bfloat16, device=DEVICE))


def test_kernel_layer_takes_the_gemv_for_few_rows(monkeypatch):
    """A step of one row projects through gemv_rows and more rows through torch: counted by a wrapper."""
    from dsv4kv.ops import kernels
    calls = []
    real = kernels.gemv_rows
    monkeypatch.setattr(kernels, "gemv_rows", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    g = ModelGeometry.preset("tiny")
    csa = next(i for i, s in enumerate(g.layers) if s.kind is LayerKind.CSA)
    layer = init_random_weights(DSV4Attention(g, csa, device=DEVICE), 5)
    x = bf16((MAX_ROWS, g.hidden_size), 6)
    positions = torch.arange(MAX_ROWS, dtype=torch.int32, device=DEVICE)
    layer.project(x, positions)
    layer.output_projection(bf16((MAX_ROWS, g.num_heads, g.head_dim), 7))
    assert calls == [MAX_ROWS] * 5  # q_a, q_b, the indexer's q_b, o_a, o_b
    calls.clear()
    layer.project(bf16((MAX_ROWS + 1, g.hidden_size), 6), torch.arange(MAX_ROWS + 1, dtype=torch.int32,
                                                                        device=DEVICE))
    # operands gemv_rows refuses (here not contiguous) keep torch's GEMMs instead of stopping the step
    strided = bf16((MAX_ROWS, 2 * g.hidden_size), 6)[:, ::2]
    assert torch.equal(layer.project(strided, positions).q, layer.project(strided.contiguous(), positions).q)
    assert calls == [MAX_ROWS] * 5  # q_b and the indexer's q_b of the strided x (its q_a: torch), all three of the copy
    calls.clear()
    out = bf16((MAX_ROWS, g.num_heads, 2 * g.head_dim), 7)[..., ::2]
    assert torch.equal(layer.output_projection(out), layer.o_b_proj(layer._grouped_o_a(out)))
    layer.schedule = dataclasses.replace(layer.schedule, gemv_rows=0)
    layer.project(x, positions)
    assert calls == []


@needs_cuda
def test_cuda_flash_projections():
    """V4-Flash's projection shapes: near exact as above, and one unit from torch.mm in at most 1% of the values (the
    GPU's GEMMs sum in other orders)."""
    for n, k, groups in ((FLASH.q_lora_rank, FLASH.hidden_size, 1),
                         (FLASH.num_heads * FLASH.head_dim, FLASH.q_lora_rank, 1),
                         (FLASH.index_n_heads * FLASH.index_head_dim, FLASH.q_lora_rank, 1),
                         (FLASH.o_groups * FLASH.o_lora_rank, FLASH.num_heads * FLASH.head_dim // FLASH.o_groups,
                          FLASH.o_groups),
                         (FLASH.hidden_size, FLASH.o_groups * FLASH.o_lora_rank, 1)):
        w = bf16((n, k), n, scale=k ** -0.5)
        x = bf16((1, groups * k), k)
        got = gemv_rows(x, w, groups=groups)
        assert_near_exact(got, x, w, groups)
        if groups == 1:
            off = units_from(got, torch.mm(x, w.t()).double())
            assert (off > 0).float().mean().item() <= 0.01, (n, k, off.max().item())
