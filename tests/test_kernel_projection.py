"""The projections' glue kernels (dsv4kv.kernels.projection) and the compressors' one GEMM, against the torch forms:

- rms_norm_rows == ops.norm.rms_norm (weighted) / ops.norm.unit_rms_norm (unweighted, in place): the same fp32
  operations, the sum of squares in another order. Tolerance: every value within one bf16 unit of the reference's,
  and at most 0.1% of them off by that unit (a mean that differs in its last bit moves a rounding; measured: 1 in
  65,536 under the interpreter, ~1e-4 on the H200 through the q_a, q_b and q norms together); zero, NaN and
  overflowing rows as the reference;
- compressor_rows == (kv columns, ops.append.compressor_logits(gate columns, bias, positions)), bit for bit, one or
  two compressors, padding positions (-1) included;
- `_MainCompressor.projected_rows` (one GEMM of all the layer's compressor projections) against `rows` (an fp32 GEMM per
  projection): within 2^-16 of the sum of the products' magnitudes (on a GPU the tensor cores' fp32 sums round
  differently; the products of bf16 values are exact either way).

On the CPU the kernels run under Triton's interpreter; the GPU tests use V4-Flash shapes.
"""

import pytest
import torch

from dsv4kv import ModelGeometry
from dsv4kv.geometry import LayerKind
from dsv4kv.ops.projection.kernel import compressor_rows, rms_norm_rows
from dsv4kv.model.layer import DSV4Attention, init_random_weights
from dsv4kv.ops.compress.reference import compressor_logits
from dsv4kv.ops.projection.reference import rms_norm, unit_rms_norm

FLASH = ModelGeometry.preset("flash")
DEVICE = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NAN = float("nan")
# an overflowing square (a test row) warns under the interpreter, as in numpy
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def bf16_rows(shape, seed, special=True):
    """Random bf16 rows of various scales; with `special`, rows of zeros, a NaN and an overflowing square."""
    x = torch.randn(shape, generator=gen(seed)) * torch.logspace(-3, 3, shape[-2] if len(shape) > 1 else 1)[:, None]
    x = x.to(torch.bfloat16)
    if special:  # the first three of the flattened rows
        flat = x.view(-1, shape[-1])
        flat[0] = 0.0
        flat[1, 3 % shape[-1]] = NAN
        flat[2, 0] = 1e30
    return x.to(DEVICE)


def assert_within_one_unit(got, want, max_fraction=1e-3):
    """bf16 results: NaN where the reference has NaN; elsewhere equal, or one bf16 unit apart in at most
    `max_fraction` of the values."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    g, w = got.float().masked_fill(nan, 0), want.float().masked_fill(nan, 0)
    unit = torch.ldexp(torch.ones_like(w), torch.frexp(w.abs().clamp_min(1e-38))[1] - 8)  # one bf16 ulp at w
    off = g != w
    assert torch.all((g - w).abs() <= unit), f"worst {((g - w).abs() / unit).max().item()} units"
    assert off.float().mean().item() <= max_fraction, f"{off.sum().item()} of {off.numel()} values differ"
    return off.sum().item()


# --- rms_norm_rows -------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(9, 48), (6, 3, 40), (2, 64, 512), (5, 1024), (4, 7168)])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, None])  # None: unweighted
def test_rms_norm_rows_matches_the_reference(shape, weight_dtype):
    x = bf16_rows(shape, seed=sum(shape))
    weight = None if weight_dtype is None else (torch.rand(shape[-1], generator=gen(1)) * 2).to(weight_dtype).to(DEVICE)
    want = unit_rms_norm(x, 1e-6) if weight is None else rms_norm(x, weight, 1e-6)
    out = torch.full_like(x, NAN)
    got = rms_norm_rows(x, weight, 1e-6, out=out)
    assert got is out
    assert_within_one_unit(got, want)
    flat = got.view(-1, shape[-1])
    assert torch.all(flat[0] == 0) and torch.all(flat[1].isnan())  # zero and NaN rows
    assert torch.all(flat[2, 1:] == 0)  # x^2 overflows: the factor is 0, as in the reference
    assert torch.equal(rms_norm_rows(x, weight, 1e-6).isnan(), got.isnan())  # allocates its out


def test_rms_norm_rows_in_place_equals_out_of_place():
    x = bf16_rows((7, 4, 512), seed=3)
    want = rms_norm_rows(x, None, 1e-6)
    y = x.clone()
    assert rms_norm_rows(y, None, 1e-6, out=y) is y
    assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y.nan_to_num(), want.nan_to_num())


def test_rms_norm_rows_handles_no_rows_and_refuses_bad_input():
    empty = torch.empty(0, 8, dtype=torch.bfloat16, device=DEVICE)
    assert rms_norm_rows(empty, None, 1e-6).shape == (0, 8)
    x = bf16_rows((4, 8), seed=0, special=False)
    before = x.clone()
    bad = [
        dict(x=x.float(), weight=None),  # fp32 x
        dict(x=x, weight=torch.ones(7, device=DEVICE)),  # weight of another width
        dict(x=x, weight=None, eps=-1.0),
        dict(x=x, weight=None, out=torch.empty(4, 8, device=DEVICE)),  # fp32 out
        dict(x=x.t(), weight=None),  # not contiguous
    ]
    for kw in bad:
        with pytest.raises(ValueError):
            rms_norm_rows(kw.pop("x"), kw.pop("weight"), kw.pop("eps", 1e-6), **kw)
    whole = torch.zeros(5, 8, dtype=torch.bfloat16, device=DEVICE)
    whole[:4] = x
    with pytest.raises(ValueError, match="overlaps"):
        rms_norm_rows(whole[:4], None, 1e-6, out=whole[1:])
    assert torch.equal(x, before)


# --- compressor_rows -----------------------------------------------------------------------------------
def reference_rows(y, positions, biases):
    out, col = [], 0
    for bias in biases:
        w = bias.shape[1]
        out.append((y[:, col:col + w], compressor_logits(y[:, col + w:col + 2 * w], bias, positions)))
        col += 2 * w
    return out


@pytest.mark.parametrize("widths,ratio", [((1024, 256), 4), ((512,), 128), ((40, 24), 4), ((300,), 3)])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_compressor_rows_bit_exact(widths, ratio, pos_dtype):
    rows = 11
    y = torch.randn(rows, 2 * sum(widths), generator=gen(rows)).to(DEVICE)
    y[3, 5] = NAN
    biases = [torch.randn(ratio, w, generator=gen(w)).to(DEVICE) for w in widths]
    far = (1 << 33) + 5 if pos_dtype == torch.int64 else (1 << 31) - 1
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 130, 131, far, -1, -1], dtype=pos_dtype, device=DEVICE)
    got = compressor_rows(y, positions, biases)
    for (kv, logits), (kv_want, logits_want) in zip(got, reference_rows(y, positions, biases)):
        assert kv.is_contiguous() and logits.is_contiguous()
        for a, b in ((kv, kv_want), (logits, logits_want)):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_compressor_rows_into_given_outputs():
    y = torch.randn(5, 20, generator=gen(2)).to(DEVICE)
    pos = torch.arange(5, dtype=torch.int32, device=DEVICE)
    biases = [torch.randn(4, 6, generator=gen(3)).to(DEVICE), torch.randn(4, 4, generator=gen(4)).to(DEVICE)]
    out = [(torch.full((5, w), NAN, device=DEVICE), torch.full((5, w), NAN, device=DEVICE)) for w in (6, 4)]
    got = compressor_rows(y, pos, biases, out=out)
    for (kv, logits), (kv_out, logits_out), (kv_want, logits_want) in zip(got, out, reference_rows(y, pos, biases)):
        assert kv is kv_out and logits is logits_out
        assert torch.equal(kv, kv_want) and torch.equal(logits, logits_want)
    with pytest.raises(ValueError, match="overlaps y"):
        compressor_rows(y, pos, biases, out=[(y[:, :6].contiguous(), y.view(-1)[:30].view(5, 6)), out[1]])
    with pytest.raises(ValueError, match="pairs"):
        compressor_rows(y, pos, biases, out=out[:1])


def test_compressor_rows_refuses_bad_input():
    y = torch.zeros(3, 20, device=DEVICE)
    pos = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    good = [torch.zeros(4, 6, device=DEVICE), torch.zeros(4, 4, device=DEVICE)]
    assert len(compressor_rows(y, pos, good)) == 2
    assert compressor_rows(y[:0], pos[:0], good)[1][0].shape == (0, 4)
    for args in [(y, pos, [torch.zeros(4, 6, device=DEVICE), torch.zeros(2, 4, device=DEVICE)]),  # two m
                 (y, pos, [torch.zeros(4, 6, device=DEVICE)]),  # y wider than 2 w
                 (y, pos[:2], good), (y.double(), pos, good), (y, pos.float(), good), (y, pos, good * 2),
                 (torch.zeros(20, 3, device=DEVICE).t(), pos, good),  # not contiguous
                 (y, pos, [torch.zeros(6, 4, device=DEVICE).t(), good[1]])]:
        with pytest.raises(ValueError):
            compressor_rows(*args)


# --- the compressors' one GEMM ---------------------------------------------------------------------------
def _csa_layer(g):
    index = next(i for i, s in enumerate(g.layers) if s.kind is LayerKind.CSA)
    return init_random_weights(DSV4Attention(g, index, device=DEVICE), seed=index)


def assert_rows_close(got, want, x, weights):
    """|got - want| <= 2^-16 * sum_k |x_k w_k| per value (the products are exact; only the fp32 sums differ)."""
    bound = (x.float().abs() @ weights.float().abs().t()) * 2.0 ** -16
    assert torch.all((got - want).abs() <= bound)


@pytest.mark.parametrize("rows", [1, 13])
def test_projected_rows_are_rows_from_one_gemm(rows):
    g = ModelGeometry.preset("tiny")
    layer = _csa_layer(g)
    comp = layer.compressor
    x = torch.randn(rows, g.hidden_size, generator=gen(rows)).to(torch.bfloat16).to(DEVICE)
    positions = torch.arange(rows, dtype=torch.int32, device=DEVICE) - 1  # one padding row first
    got = comp.projected_rows(x, positions)
    parts = (comp, comp.indexer)
    for (kv, logits), part in zip(got, parts):
        kv_want, logits_want = part.rows(x, positions)
        assert_rows_close(kv, kv_want, x, part.kv_proj.weight)
        assert_rows_close(logits, logits_want, x, part.gate_proj.weight)
    with torch.no_grad():  # a weight changed in place: the stacked copy is made again
        comp.indexer.gate_proj.weight.mul_(-1)
    logits = comp.projected_rows(x, positions)[1][1]
    assert_rows_close(logits, comp.indexer.rows(x, positions)[1], x, comp.indexer.gate_proj.weight)


def test_project_outside_no_grad():
    """`project` called directly with autograd on (the bench does): its GEMMs write into given outputs, which autograd
    refuses for parameters that require grad, so it runs under no_grad itself."""
    g = ModelGeometry.preset("tiny")
    layer = _csa_layer(g)
    x = torch.randn(3, g.hidden_size, generator=gen(3)).to(torch.bfloat16).to(DEVICE)
    assert torch.is_grad_enabled() and layer.q_a_proj.weight.requires_grad
    p = layer.project(x, torch.arange(3, dtype=torch.int32, device=DEVICE))
    assert not p.q.requires_grad and p.index_weights.shape == (3, g.index_n_heads)


@needs_cuda
def test_cuda_flash_projection_glue():
    """V4-Flash CSA layer on the GPU: the norms within one unit of the torch forms, the compressor rows within the
    GEMM bound of the fp32 GEMMs, the stacked GEMM on tensor cores."""
    layer = _csa_layer(FLASH)
    x = torch.randn(257, FLASH.hidden_size, generator=gen(0)).to(torch.bfloat16).to(DEVICE)
    positions = torch.arange(257, dtype=torch.int32, device=DEVICE) + 4093
    with torch.no_grad():
        p = layer.project(x, positions)
        qa = layer.q_a_proj(x)
        qr = rms_norm_rows(qa, layer.q_a_norm.weight, FLASH.rms_norm_eps)  # each norm against its torch form alone
        assert_within_one_unit(qr, layer.q_a_norm(qa))
        q = layer.q_b_proj(qr).view(257, FLASH.num_heads, FLASH.head_dim)
        assert_within_one_unit(p.q, unit_rms_norm(q, FLASH.rms_norm_eps))
        assert_within_one_unit(p.kv, layer.kv_norm(layer.kv_proj(x)))
        for (kv, logits), part in zip((p.state, p.index_state), (layer.compressor, layer.compressor.indexer)):
            kv_want, logits_want = part.rows(x, positions)
            assert_rows_close(kv, kv_want, x, part.kv_proj.weight)
            assert_rows_close(logits, logits_want, x, part.gate_proj.weight)
    assert layer.compressor._stacked_bfloat16.dtype == torch.bfloat16  # the tensor-core GEMM ran
