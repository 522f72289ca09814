"""Per-step glue kernels (dsv4kv.ops.rope.kernel, dsv4kv.ops.indexer.query_kernel) against the torch functions the
layer calls, on NaN-prefilled outputs:

- rope_rows == apply_rope(x, positions, rope, inverse=...).to(bf16), bit for bit: the bf16 query (forward), the fp32
  attention output (inverse), in place, at V4-Flash shapes with both of its rope specs (window theta 10000, CSA
  YaRN), positions 0 .. 2^20 - 1 and padding (-1), bf16 rounding ties, overflow to inf, -0 and NaN;
- indexer_query_rows == indexer_query(apply_rope(q, ...), layout), bit for bit for every key format: the Hadamard
  rotation (the butterfly of quant.hadamard_rotate, in its order) and the MXFP4 / FP8 round trips, at tiles where
  Triton 3.6's fp8 cast-and-decode form went wrong on the H200;
- indexer_query_and_weights: the same query and weights.float() * scale, bit for bit.

On the CPU the kernels run under Triton's interpreter; the GPU tests use V4-Flash / V4-Pro shapes and a CUDA graph.
"""

import dataclasses

import pytest
import torch

from dsv4kv import ModelGeometry
from dsv4kv.cache import quant
from dsv4kv.backend import interpreted
from dsv4kv.geometry import LayerKind, RopeSpec
from dsv4kv.ops.indexer import query_kernel as query
from dsv4kv.ops.rope import kernel as rope_kernel
from dsv4kv.ops.rope import tuning as rope_tuning
from dsv4kv.ops.indexer.tuning import QUERY_TUNING, query_tuning_for
from dsv4kv.ops.indexer.kernel import indexer_query_fp8
from dsv4kv.ops.indexer.query_kernel import indexer_query_and_weights, indexer_query_rows
from dsv4kv.ops.rope.kernel import rope_rows
from dsv4kv.cache.layout import indexer_layout, main_layout
from dsv4kv.ops.indexer.reference import indexer_query
from dsv4kv.ops.rope.reference import apply_rope, rope_cos_sin

FLASH = ModelGeometry.preset("flash")
CSA = next(s for s in FLASH.layers if s.kind is LayerKind.CSA)
ROPES = {"main": FLASH.layers[0].rope, "compress": CSA.rope}  # theta 10000; theta 160000 + YaRN
DEVICE = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
NAN = float("nan")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# huge rope inputs overflow in the rotation of the reference and the interpreter alike (numpy warns)
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


# --- helpers ----------------------------------------------------------------------------------------
def gen(seed):
    return torch.Generator().manual_seed(seed)


def assert_same(got, want):
    """Bit-equal; NaN exactly where the reference has NaN (a NaN's payload may differ), and on a GPU the sign of an
    exact zero may differ (seen on the H200 for all-zero rows: the products sum in registers with another signed-zero
    outcome than torch's separate kernels; a zero's sign reaches no later result)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    if got.is_cuda:
        got, want = torch.where(got == 0, 0.0, got).to(got.dtype), torch.where(want == 0, 0.0, want).to(want.dtype)
    ints = torch.int16 if got.element_size() == 2 else torch.int32
    assert torch.equal(got.view(ints).masked_fill(nan, 0), want.view(ints).masked_fill(nan, 0))


def make_positions(n, g, device=DEVICE):
    """int32 [n]: 0, 2^20 - 1, padding -1, 1, then random positions below 2^20."""
    fixed = torch.tensor([0, (1 << 20) - 1, -1, 1])[:n]
    return torch.cat((fixed, torch.randint(0, 1 << 20, (n - fixed.shape[0],), generator=g))).to(torch.int32).to(device)


def rope_tie_rows(rope, position, count, inverse, g):
    """Rope dims bf16 [count, rope.dim] whose rotation at `position` has a value exactly halfway between two bf16
    neighbours: found with the op's own arithmetic (separately rounded fp32 products)."""
    cos, sin = rope_cos_sin(rope, torch.tensor([position]))
    sin = -sin if inverse else sin
    rows = []
    while len(rows) < count:
        even = (torch.randn(4096, rope.dim // 2, generator=g) * 4).to(torch.bfloat16).float()
        odd = (torch.randn(4096, rope.dim // 2, generator=g) * 4).to(torch.bfloat16).float()
        ties = (((even * cos - odd * sin).view(torch.int32) & 0xFFFF) == 0x8000).any(1)
        ties |= (((odd * cos + even * sin).view(torch.int32) & 0xFFFF) == 0x8000).any(1)
        rows += [torch.stack((even[p], odd[p]), dim=-1).flatten() for p in ties.nonzero().flatten().tolist()]
    return torch.stack(rows[:count]).to(torch.bfloat16)


def corner_rows(x, rope, positions, inverse, g):
    """Write corners into x [N, H, D] (fp32 or bf16; N >= 4), in place: bf16 rounding ties of the rotation
    (row 3, 8 heads), -0 / 0 / huge / NaN / inf heads, and for fp32 x nope values halfway between bf16
    neighbours and one that rounds up to inf."""
    r = rope.dim
    x[3, :8, -r:] = rope_tie_rows(rope, int(positions[3]), 8, inverse, g).to(x.dtype).to(x.device)
    x[0, 0] = -0.0
    x[0, 1] = 0.0
    x[0, 2, -r:] = 3.0e38  # cos 1, sin 0 at position 0: passes through; elsewhere overflows to inf / NaN
    x[1, 2, -r:] = 3.0e38
    x[1, 3, 5] = NAN
    x[2, 4, -3] = float("inf")
    x[2, 5, :7] = float("-inf")
    if x.dtype == torch.float32:
        bf16 = torch.randn(x[1, 6:9].shape, generator=g).to(torch.bfloat16).float()
        x[1, 6:9] = (bf16.view(torch.int32) | 0x8000).view(torch.float32).to(x.device)  # ties: round to even
        x[1, 9, 0] = torch.tensor(0x7F7F8000, dtype=torch.int32).view(torch.float32)  # bf16 max + half an ulp
    return x


# --- rope_rows --------------------------------------------------------------------------------------
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("rope_name", list(ROPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rope_rows_flash_query_and_output(dtype, rope_name, inverse):
    """q bf16 [5, 64, 512] (forward: the roped query) and the fp32 attention output (inverse, then bf16)."""
    rope, g = ROPES[rope_name], gen(1)
    positions = make_positions(5, g)
    x = torch.randn(5, FLASH.num_heads, FLASH.head_dim, generator=g).to(dtype).to(DEVICE)
    x = corner_rows(x, rope, positions, inverse, g)
    cos, sin = rope_cos_sin(rope, positions)
    out = torch.full(x.shape, NAN, dtype=torch.bfloat16, device=DEVICE)
    assert rope_rows(x, cos, sin, inverse=inverse, out=out) is out
    assert_same(out, apply_rope(x, positions, rope, inverse=inverse).to(torch.bfloat16))
    early = rope_rows(x, cos, sin, inverse=inverse, launch_next=True)  # the next launch's timing changes no byte
    assert torch.equal(early.view(torch.int16), out.view(torch.int16))


@pytest.mark.parametrize("rope_name", list(ROPES))
def test_rope_rows_in_place(rope_name):
    """out=x: only the rope dims are rewritten; the nope dims (a NaN among them) keep their bits."""
    rope, g = ROPES[rope_name], gen(2)
    positions = make_positions(3, g)
    x = torch.randn(3, FLASH.num_heads, FLASH.head_dim, generator=g).to(torch.bfloat16).to(DEVICE)
    x[1, 7, :3] = NAN
    want = apply_rope(x, positions, rope)
    cos, sin = rope_cos_sin(rope, positions)
    nope = x[..., :-rope.dim].clone()
    assert rope_rows(x, cos, sin, out=x) is x
    assert_same(x, want)
    assert torch.equal(x[..., :-rope.dim].view(torch.int16), nope.view(torch.int16))


@pytest.mark.parametrize("dim,rope_dim,heads", [(96, 32, 5), (128, 64, 3), (66, 2, 9)], ids=lambda v: str(v))
def test_rope_rows_odd_shapes(dim, rope_dim, heads):
    """Head counts that leave a partial head block, head dims that are not powers of two, a 2-dim rope."""
    rope, g = RopeSpec(theta=10000.0, dim=rope_dim), gen(3)
    positions = make_positions(7, g)
    cos, sin = rope_cos_sin(rope, positions)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(7, heads, dim, generator=g) * 3).to(dtype).to(DEVICE)
        out = torch.full(x.shape, NAN, dtype=torch.bfloat16, device=DEVICE)
        assert_same(rope_rows(x, cos, sin, out=out), apply_rope(x, positions, rope).to(torch.bfloat16))
    x = x.to(torch.bfloat16)
    want = apply_rope(x, positions, rope, inverse=True)
    if rope_dim < dim:  # out of rope_dim dims a head: the rope dims alone, the same bits
        dims = torch.full((7, heads, rope_dim), NAN, dtype=torch.bfloat16, device=DEVICE)
        assert_same(rope_rows(x, cos, sin, inverse=True, out=dims), want[..., -rope_dim:].to(torch.bfloat16))
    assert_same(rope_rows(x, cos, sin, inverse=True, out=x), want)


def test_rope_rows_allocates_and_handles_no_rows():
    rope, g = ROPES["main"], gen(4)
    positions = make_positions(2, g)
    x = torch.randn(2, 3, 128, generator=g).to(DEVICE)
    got = rope_rows(x, *rope_cos_sin(rope, positions))
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert_same(got, apply_rope(x, positions, rope).to(torch.bfloat16))
    empty = torch.empty(0, 3, 128, device=DEVICE)
    assert rope_rows(empty, *rope_cos_sin(rope, positions[:0])).shape == (0, 3, 128)


# --- indexer_query_rows -----------------------------------------------------------------------------
def indexer_case(n, heads, dim, rope, seed, device=DEVICE):
    """q bf16 [n, heads, dim] (row 0: a -0 head, a zero head, a NaN head, an inf head), positions, cos, sin."""
    g = gen(seed)
    positions = make_positions(n, g, device)
    q = torch.randn(n, heads, dim, generator=g).to(torch.bfloat16).to(device)
    q[0, 0], q[0, 1], q[0, 2, 9], q[0, 3, -5] = -0.0, 0.0, NAN, float("-inf")  # -5: a rope dim
    return q, positions, *rope_cos_sin(rope, positions)


def check_rotated_query(q, positions, cos, sin, rope, layouts, tuning=None):
    """The kernel's rotation and its quantized queries against the references, bit for bit."""
    roped = apply_rope(q, positions, rope)
    rotated = query._indexer_query(q, cos, sin, layouts[0], None, None, None, None, fmt=query._ROTATED,
                                   tuning=tuning)
    assert_same(rotated, quant.hadamard_rotate(roped).to(torch.bfloat16).float())
    assert not (rotated.view(torch.int32) == -2**31).any(), "exact zeros are +0"
    for layout in layouts:
        out = torch.full(q.shape, NAN, device=q.device)
        assert indexer_query_rows(q, cos, sin, layout, out=out, tuning=tuning) is out
        assert_same(out, indexer_query(roped, layout))


@pytest.mark.parametrize("least_heads", [4, 16], ids=["spread", "whole-tile"])
def test_indexer_query_flash_rotated_formats(least_heads):
    """V4-Flash indexer query [9, 64, 128] with the CSA rope (YaRN): MXFP4 and FP8 keys' numerics; 9 rows take 4
    heads a program (`QueryTuning.min_block_h`), or the tile's 16 where that floor is raised."""
    tuning = dataclasses.replace(query_tuning_for(DEVICE), min_block_h=least_heads)
    q, positions, cos, sin = indexer_case(9, FLASH.index_n_heads, FLASH.index_head_dim, CSA.rope, seed=5)
    layouts = [indexer_layout(f, FLASH.index_head_dim) for f in ("mxfp4", "fp8")]
    check_rotated_query(q, positions, cos, sin, CSA.rope, layouts, tuning)
    # the quantizers' corners occur in these rows: e2m1 ties (|y| = 0.25, 0.75, ... * scale) and amaxes
    # that are exactly qmax times a power of two (the scale must not round up)
    rotated = quant.hadamard_rotate(apply_rope(q, positions, CSA.rope)).to(torch.bfloat16).float()
    blocks = rotated[1:].unflatten(-1, (4, 32))
    scaled = blocks / quant.pow2_scale(blocks.abs().amax(-1), quant.FP4_MAX).unsqueeze(-1)
    assert torch.isin(scaled.abs(), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=scaled.device)).sum() > 100
    assert (blocks.abs().amax(-1) / quant.FP4_MAX).log2().frac().eq(0).sum() > 0


@pytest.mark.parametrize("rope_name", list(ROPES))
def test_indexer_query_bf16_keys_exact(rope_name):
    """bf16 keys (exact mode): the roped query as fp32, bit for bit, with both flash rope specs."""
    rope = ROPES[rope_name]
    q, positions, cos, sin = indexer_case(5, FLASH.index_n_heads, FLASH.index_head_dim, rope, seed=6)
    layout = indexer_layout("bf16", FLASH.index_head_dim)
    out = torch.full(q.shape, NAN, device=DEVICE)
    assert_same(indexer_query_rows(q, cos, sin, layout, out=out), indexer_query(apply_rope(q, positions, rope), layout))


def test_indexer_query_main_rope_and_odd_heads():
    """The window layers' rope spec, 5 heads (a partial head block), head dim 64, MXFP4 and FP8."""
    rope = ROPES["main"]
    q, positions, cos, sin = indexer_case(7, 5, 64, rope, seed=7)
    check_rotated_query(q, positions, cos, sin, rope, [indexer_layout(f, 64) for f in ("mxfp4", "fp8")])
    got = indexer_query_rows(q, cos, sin, indexer_layout("fp8", 64))  # allocates its out
    assert got.dtype == torch.float32 and got.shape == q.shape


@pytest.mark.parametrize("fmt,wdtype,scale", [("bf16", torch.bfloat16, 64**-0.5), ("mxfp4", torch.float32, 1 / 3)])
def test_indexer_query_and_weights(fmt, wdtype, scale):
    """The head weights weights.float() * scale (as an fp32, like torch's Python scalar) ride along, bit for bit."""
    rope = CSA.rope
    q, _, cos, sin = indexer_case(3, 7, 128, rope, seed=9)
    layout = indexer_layout(fmt, 128)
    w = torch.randn(3, 7, generator=gen(10)).to(wdtype).to(DEVICE)
    out = torch.full(q.shape, NAN, device=DEVICE)
    w_out = torch.full((3, 7), NAN, device=DEVICE)
    got, got_w = indexer_query_and_weights(q, w, cos, sin, layout, scale=scale, out=out, weights_out=w_out)
    assert got is out and got_w is w_out
    assert_same(got_w, w.float() * scale)
    assert_same(got, indexer_query_rows(q, cos, sin, layout))
    for end in ("launch_next", "wait_late"):  # either end of a pair: the launches' timing changes no byte
        early, early_w = indexer_query_and_weights(q, w, cos, sin, layout, scale=scale, **{end: True})
        assert torch.equal(early.view(torch.int32), got.view(torch.int32)) and torch.equal(early_w, got_w)
    w32, want = w.float().clone(), w.float() * scale
    _, in_place = indexer_query_and_weights(q, w32, cos, sin, layout, scale=scale, weights_out=w32)
    assert in_place is w32 and torch.equal(w32, want)
    if fmt == "mxfp4":
        check_fp8_operand(q, w, cos, sin, layout)


@pytest.mark.skipif(not interpreted(), reason="records calls of the PDL wait and launch, plain Python functions "
                    "only under Triton's interpreter (the CPU run)")
def test_launch_next_comes_after_the_wait(monkeypatch):
    """`launch_next` lets the next grid in only after the program's own wait (everything before it then complete):
    under the interpreter, where both are plain functions, every program of the indexer query and of the q RoPE
    calls the wait, then the launch. With `wait_late` every program of the indexer query waits once."""
    events = []
    for module in (query, rope_kernel):
        monkeypatch.setattr(module, "wait_for_prior_grids", lambda: events.append("wait"))
        monkeypatch.setattr(module, "let_next_grid_launch", lambda: events.append("launch"))
    q, _, cos, sin = indexer_case(3, 7, 128, CSA.rope, seed=11)
    w = torch.randn(3, 7, generator=gen(12)).to(DEVICE)
    programs = []
    for launch in (lambda: indexer_query_and_weights(q, w, cos, sin, indexer_layout("mxfp4", 128), scale=1.0,
                                                     launch_next=True),
                   lambda: rope_rows(q, cos, sin, launch_next=True)):
        events.clear()
        launch()
        assert len(events) >= 6 and events == ["wait", "launch"] * (len(events) // 2), events
        programs.append(len(events) // 2)
    events.clear()
    indexer_query_and_weights(q, w, cos, sin, indexer_layout("mxfp4", 128), scale=1.0, wait_late=True)
    assert events == ["wait"] * programs[0], events


def check_fp8_operand(q, w, cos, sin, layout, tuning=None):
    """fp8_out: the scores kernel's FP8 operand written by the query kernel, bit for bit `indexer_query_fp8` of the
    query it wrote; every finite head passes the FP8 path's check (the cases' inf / NaN heads do not)."""
    codes = torch.full(q.shape, 0xEE, dtype=torch.uint8, device=DEVICE)
    scales = torch.full(q.shape[:2], NAN, device=DEVICE)
    got, _ = indexer_query_and_weights(q, w, cos, sin, layout, scale=1.0, fp8_out=(codes, scales), tuning=tuning)
    want_codes, want_scales = indexer_query_fp8(got)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    finite = torch.isfinite(got).all(dim=2)
    assert bool((scales[finite] > 0).all()) and bool((scales[~finite] == 0).all())


# --- bad input --------------------------------------------------------------------------------------
def test_bad_input():
    rope = ROPES["main"]
    positions = make_positions(3, gen(11))
    cos, sin = rope_cos_sin(rope, positions)
    x = torch.zeros(3, 4, 128, dtype=torch.bfloat16, device=DEVICE)
    base = torch.zeros(4, 4, 128, dtype=torch.bfloat16, device=DEVICE)
    wide = torch.zeros(3, 4, 256, dtype=torch.bfloat16, device=DEVICE)  # an fp32 [3, 4, 128] x in bf16 clothes
    cases = [
        (lambda: rope_rows(x.half(), cos, sin), "x: expected torch.bfloat16/torch.float32"),
        (lambda: rope_rows(x, cos, sin, launch_next=1), "launch_next: expected a bool"),
        (lambda: rope_rows(x[0], cos, sin), r"x: expected .* \[\*, \*, \*\], got .* \[4, 128\]"),
        (lambda: rope_rows(x.transpose(1, 2).contiguous().transpose(1, 2), cos, sin), "x: must be contiguous"),
        (lambda: rope_rows(x, cos.double(), sin), "cos: expected torch.float32"),
        (lambda: rope_rows(x, cos[:2], sin), r"cos: expected torch.float32 \[3, \*\]"),
        (lambda: rope_rows(x, cos, sin[:, :16]), r"sin: expected torch.float32 \[3, 32\]"),
        (lambda: rope_rows(x, cos.to("meta"), sin), "cos: on meta"),
        (lambda: rope_rows(x[..., :48].contiguous(), cos, sin), "rope_dim a power of two <= head dim 48"),
        (lambda: rope_rows(x, cos[:, :24].contiguous(), sin[:, :24].contiguous()), "power of two"),
        (lambda: rope_rows(x, cos, sin, inverse=1), "inverse: expected a bool"),
        (lambda: rope_rows(x, cos, sin, out=x.float()), "out: expected torch.bfloat16"),
        (lambda: rope_rows(x, cos, sin, out=x[:2]), r"out: expected torch.bfloat16 \[3, 4, 128\]"),
        (lambda: rope_rows(wide.view(torch.float32), cos, sin, out=wide.view(-1)[:1536].view(3, 4, 128)),
         "out: overlaps x without being x"),
        (lambda: rope_rows(base[:3], cos, sin, out=base[1:]), "out: overlaps x without being x"),
        (lambda: rope_rows("x", cos, sin), "x: expected a tensor"),
    ]
    q = torch.zeros(3, 4, 128, dtype=torch.bfloat16, device=DEVICE)
    mx = indexer_layout("mxfp4", 128)
    w = torch.zeros(3, 4, device=DEVICE)
    cases += [
        (lambda: indexer_query_rows(q.float(), cos, sin, mx), "q: expected torch.bfloat16"),
        (lambda: indexer_query_rows(q[..., :64].contiguous(), cos, sin, mx), r"q: expected .* \[\*, \*, 128\]"),
        (lambda: indexer_query_rows(q, cos, sin, main_layout("fp8", 128, 64)), "layout: expected an indexer layout"),
        (lambda: indexer_query_rows(q, cos, sin, "mxfp4"), "layout: expected an EntryLayout"),
        (lambda: indexer_query_rows(q, cos[1:], sin[1:], mx), r"cos: expected torch.float32 \[3, \*\]"),
        (lambda: indexer_query_rows(q, cos, sin, mx, out=q), "out: expected torch.float32"),
        (lambda: indexer_query_rows(q, cos, sin, mx, out=torch.zeros(3, 4, 64, device=DEVICE)), "out: expected"),
        (lambda: indexer_query_rows(q, cos, sin, mx, out=torch.zeros(3, 4, 256, device=DEVICE)[..., :128]),
         "out: must be contiguous"),
        (lambda: indexer_query_and_weights(q, None, cos, sin, mx, scale=1.0), "weights: expected a tensor"),
        (lambda: indexer_query_and_weights(q, w[:, :3], cos, sin, mx, scale=1.0), r"weights: expected .* \[3, 4\]"),
        (lambda: indexer_query_and_weights(q, w.half(), cos, sin, mx, scale=1.0), "weights: expected"),
        (lambda: indexer_query_and_weights(q, w, cos, sin, mx, scale="1"), "scale: expected a float"),
        (lambda: indexer_query_and_weights(q, w, cos, sin, mx, scale=1.0, weights_out=w.double()),
         "weights_out: expected torch.float32"),
    ]
    out = torch.zeros(3, 4, 128, device=DEVICE)
    cases += [(lambda: indexer_query_and_weights(q, w, cos, sin, mx, scale=1.0, out=out,
                                                 weights_out=out.view(-1)[:12].view(3, 4)), "weights_out: overlaps")]
    codes, scales = torch.zeros(3, 4, 128, dtype=torch.uint8, device=DEVICE), torch.zeros(3, 4, device=DEVICE)
    cases += [
        (lambda: indexer_query_and_weights(q, w, cos, sin, indexer_layout("fp8", 128), scale=1.0,
                                           fp8_out=(codes, scales)), "fp8_out: the FP8 MMA operand is made for MXFP4"),
        (lambda: indexer_query_and_weights(q, w, cos, sin, mx, scale=1.0, fp8_out=codes), "fp8_out: expected"),
        (lambda: indexer_query_and_weights(q, w, cos, sin, mx, scale=1.0, launch_next="yes"),
         "launch_next: expected a bool"),
        (lambda: indexer_query_and_weights(q, w, cos, sin, mx, scale=1.0, wait_late="yes"),
         "wait_late: expected a bool"),
        (lambda: indexer_query_and_weights(q, w, cos, sin, mx, scale=1.0, wait_late=True, launch_next=True),
         "wait_late and launch_next are the two ends of a pair"),
        (lambda: indexer_query_and_weights(q, w, cos, sin, mx, scale=1.0, fp8_out=(codes.float(), scales)),
         "fp8_out codes: expected torch.uint8"),
        (lambda: indexer_query_and_weights(q, w, cos, sin, mx, scale=1.0, fp8_out=(codes, scales[:2])),
         r"fp8_out scales: expected torch.float32 \[3, 4\]"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


# --- on a GPU, at V4 shapes -------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("preset", ["flash", "pro"])
def test_cuda_rope_rows_v4(preset):
    """The roped query (bf16, out of place and in place) and the inverse-roped fp32 attention output of 257 rows
    at the preset's head count, with each rope spec of the preset."""
    geometry, g = ModelGeometry.preset(preset), gen(20)
    for rope in sorted({spec.rope for spec in geometry.layers}, key=repr):
        positions = make_positions(257, g)
        cos, sin = rope_cos_sin(rope, positions)
        for dtype, inverse in ((torch.bfloat16, False), (torch.float32, True), (torch.bfloat16, True)):
            x = torch.randn(257, geometry.num_heads, geometry.head_dim, generator=g).to(dtype).to(DEVICE)
            x = corner_rows(x, rope, positions, inverse, g)
            want = apply_rope(x, positions, rope, inverse=inverse).to(torch.bfloat16)
            out = torch.full(x.shape, NAN, dtype=torch.bfloat16, device=DEVICE)
            assert_same(rope_rows(x, cos, sin, inverse=inverse, out=out), want)
            if dtype == torch.bfloat16:
                assert_same(rope_rows(x, cos, sin, inverse=inverse, out=x), want)


def test_indexer_query_tiles_spread_small_launches():
    """A decode step's few rows take `QueryTuning.min_block_h` heads a program, a prefill chunk's many the tile's."""
    tuning = QUERY_TUNING["sm90"]
    block_h = tuning.block_h
    assert query._tiles(64, 1, tuning)[0] == tuning.min_block_h == 4
    assert query._tiles(64, 8, tuning)[0] == 4 and query._tiles(5, 1, tuning)[0] == 4
    assert query._tiles(64, 8192, tuning)[0] == block_h == 16
    assert query._tiles(64, 32, tuning)[0] == 4 and query._tiles(64, 65, tuning)[0] == 8
    assert query._tiles(64, 64, tuning)[0] == 8  # 64 x 64 head rows: 256 programs of 16 heads, 512 of 8 (>= 264)
    rope = rope_tuning.TUNING["sm90"]
    assert rope_kernel._tiles(False, 64, rope)[0] == rope.heads[0]  # the RoPE kernels do not spread


@needs_cuda
@pytest.mark.parametrize("tile", [None, (16, 2), (4, 1), (64, 8)], ids=lambda t: "default" if t is None else str(t))
@pytest.mark.parametrize("preset", ["flash", "pro"])
@pytest.mark.parametrize("rows", [1025, 40, 3], ids=["prefill", "decode-40", "decode"])
def test_cuda_indexer_query_v4(preset, tile, rows):
    """The indexer query of 1025 rows (the tile's heads a program), 40 and 3 (a decode step's: 8 and 4 heads a
    program, `QueryTuning.min_block_h`) at V4 shapes (64 heads x 128), every key format, against the reference on the
    GPU, bit for bit; also at (heads, warps) tiles where an fp8 cast-and-decode form gave wrong heads."""
    tuning = query_tuning_for(DEVICE)
    if tile is not None:
        tuning = dataclasses.replace(tuning, block_h=tile[0], warps=tile[1])
    geometry = ModelGeometry.preset(preset)
    rope = next(s for s in geometry.layers if s.kind is LayerKind.CSA).rope
    q, positions, cos, sin = indexer_case(rows, geometry.index_n_heads, geometry.index_head_dim, rope, seed=21)
    layouts = [indexer_layout(f, geometry.index_head_dim) for f in ("mxfp4", "fp8")]
    check_rotated_query(q, positions, cos, sin, rope, layouts, tuning)
    bf16 = indexer_layout("bf16", geometry.index_head_dim)
    assert_same(indexer_query_rows(q, cos, sin, bf16, tuning=tuning),
                indexer_query(apply_rope(q, positions, rope), bf16))
    check_fp8_operand(q, torch.ones(q.shape[:2], device=DEVICE), cos, sin, layouts[0], tuning)


@needs_cuda
def test_cuda_graph_replays_glue():
    """rope_rows (query in place, output inverse) and indexer_query_and_weights captured in one CUDA graph with
    out= buffers, replayed over new positions and activations written into the captured inputs."""
    g, rope, rows, heads = gen(22), CSA.rope, 11, FLASH.num_heads
    layout = indexer_layout("mxfp4", FLASH.index_head_dim)
    positions = make_positions(rows, g)
    q = torch.randn(rows, heads, FLASH.head_dim, generator=g).to(torch.bfloat16).to(DEVICE)
    attn = torch.randn(rows, heads, FLASH.head_dim, generator=g).to(DEVICE)
    qi = torch.randn(rows, FLASH.index_n_heads, FLASH.index_head_dim, generator=g).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(rows, FLASH.index_n_heads, generator=g).to(torch.bfloat16).to(DEVICE)
    o_attn = torch.empty(rows, heads, FLASH.head_dim, dtype=torch.bfloat16, device=DEVICE)
    o_qi = torch.empty(rows, FLASH.index_n_heads, FLASH.index_head_dim, device=DEVICE)
    o_w = torch.empty(rows, FLASH.index_n_heads, device=DEVICE)
    rope_cos_sin(rope, positions)  # warm: inv_freq is on the device before capture

    def step():
        c, s = rope_cos_sin(rope, positions)
        rope_rows(q, c, s, out=q)
        rope_rows(attn, c, s, inverse=True, out=o_attn)
        indexer_query_and_weights(qi, w, c, s, layout, scale=FLASH.index_n_heads ** -0.5, out=o_qi, weights_out=o_w)

    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    positions.copy_(make_positions(rows, g))
    for t in (q, attn, qi, w):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    q0, attn0, qi0 = q.clone(), attn.clone(), qi.clone()
    for t in (o_attn, o_qi, o_w):
        t.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    assert_same(q, apply_rope(q0, positions, rope))
    assert_same(o_attn, apply_rope(attn0, positions, rope, inverse=True).to(torch.bfloat16))
    want = indexer_query(apply_rope(qi0, positions, rope), layout)
    assert_same(o_qi, want)
    assert_same(o_w, w.float() * FLASH.index_n_heads ** -0.5)
