"""Bit-exact tests of `dsv4kv.quant` against independent oracles written here.

Every oracle below is derived from the format definitions (exact rationals, value tables, popcount),
never from the function under test.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch

from dsv4kv.cache.quant import (
    FP4_MAX,
    FP8_MAX,
    SCALE_EPS,
    dequantize_fp8,
    dequantize_mxfp4,
    e2m1_decode,
    e2m1_encode,
    hadamard_matrix,
    hadamard_rotate,
    pow2_scale,
    quantize_fp8,
    quantize_mxfp4,
    ue8m0_decode,
    ue8m0_encode,
)

FP32_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # index = code & 7, from the OCP MX spec


# ----------------------------------------------------------------------------------------------------
# Oracles
# ----------------------------------------------------------------------------------------------------


def fp32(value: float) -> float:
    """Round a Python float to the nearest fp32 value (round-to-nearest-even)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def oracle_pow2_scale(amax: float, qmax: float, eps: float = SCALE_EPS) -> float:
    """Smallest power of two >= fp32(max(amax, eps)) / qmax, in exact rational arithmetic; NaN if non-finite."""
    if not math.isfinite(amax):
        return math.nan
    ratio = Fraction(fp32(max(amax, eps))) / Fraction(qmax)
    k = ratio.numerator.bit_length() - ratio.denominator.bit_length()  # 2^(k-1) < ratio < 2^(k+1)
    while Fraction(2) ** k < ratio:
        k += 1
    while Fraction(2) ** (k - 1) >= ratio:
        k -= 1
    return math.ldexp(1.0, k)


def oracle_block_scales(x: torch.Tensor, block: int, qmax: float, eps: float = SCALE_EPS) -> torch.Tensor:
    amax = x.double().unflatten(-1, (-1, block)).abs().amax(-1)
    flat = [oracle_pow2_scale(a, qmax, eps) for a in amax.flatten().tolist()]
    return torch.tensor(flat, dtype=torch.float64).reshape(amax.shape)


def e4m3_finite_table() -> tuple[torch.Tensor, torch.Tensor]:
    """(bytes, values) of all finite float8_e4m3fn codes, NaN codes 0x7F / 0xFF dropped."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).double()
    keep = ~torch.isnan(values)
    return codes[keep], values[keep]


E4M3_BYTES, E4M3_VALUES = e4m3_finite_table()
E4M3_POS_VALUES = E4M3_VALUES[E4M3_BYTES < 0x80]  # bytes 0x00..0x7E: increasing magnitudes 0..448


def nearest_even_index(mag: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of the increasing `table` to each `mag`; a tie goes to the even index."""
    hi = torch.searchsorted(table, mag).clamp(max=len(table) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - table[lo], table[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.where(pick_hi, hi, lo)


def oracle_e4m3_bytes(y: torch.Tensor) -> torch.Tensor:
    """float64 values with |y| <= 448 -> e4m3 bytes by RNE search; the sign bit follows y (even for zero)."""
    # On one side of zero consecutive finite codes are consecutive bytes, so "even mantissa LSB" == even byte.
    idx = nearest_even_index(y.abs(), E4M3_POS_VALUES)
    return (idx | (torch.signbit(y).long() << 7)).to(torch.uint8)


def oracle_e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """float64 values with |y| <= 6 -> e2m1 codes 0..15; ties to the even code, sign bit 3 from y."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    idx = nearest_even_index(y.abs(), table)
    return (idx | (torch.signbit(y).long() << 3)).to(torch.uint8)


def oracle_e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    mag = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def sylvester_entry(i: int, j: int, n: int) -> float:
    return (-1.0) ** bin(i & j).count("1") / math.sqrt(n)


# ----------------------------------------------------------------------------------------------------
# Assertion helpers
# ----------------------------------------------------------------------------------------------------


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor, inputs: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype == torch.uint8, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: first mismatch at {bad}: input {inputs[tuple(bad)].item()!r} "
            f"got 0x{got[tuple(bad)].item():02X}, want 0x{want[tuple(bad)].item():02X} "
            f"({int((got != want).sum())} mismatches of {got.numel()})"
        )


def assert_fp32_bits_equal(got: torch.Tensor, want: torch.Tensor, inputs: torch.Tensor, what: str) -> None:
    """Bit equality of fp32 tensors, except that any NaN matches any NaN."""
    assert got.dtype == want.dtype == torch.float32, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    got_nan, want_nan = torch.isnan(got), torch.isnan(want)
    same = torch.where(got_nan | want_nan, got_nan == want_nan, got.view(torch.int32) == want.view(torch.int32))
    if not bool(same.all()):
        bad = tuple((~same).nonzero()[0].tolist())
        raise AssertionError(
            f"{what}: first mismatch at {list(bad)}: input {inputs[bad].item()!r} "
            f"got {got[bad].item()!r}, want {want[bad].item()!r} ({int((~same).sum())} mismatches)"
        )


def check_fp8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8 vs the oracles: scale, bytes, dequantization and the scale invariant."""
    q, scale = quantize_fp8(x, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (*x.shape[:-1], x.shape[-1] // block)

    want_scale = oracle_block_scales(x, block, FP8_MAX)
    amax = x.double().unflatten(-1, (-1, block)).abs().amax(-1)
    assert_fp32_bits_equal(scale, want_scale.float(), amax, "fp8 block scale")

    y = x.double().unflatten(-1, (-1, block)) / want_scale.unsqueeze(-1)  # exact: scale is a power of two
    assert bool((y.abs() <= FP8_MAX).all()), "|x / s| exceeds 448"
    floor = torch.clamp(amax, min=fp32(SCALE_EPS))
    assert bool((floor / (want_scale / 2) > FP8_MAX).all()), "s / 2 would also keep |x / s| <= 448"

    assert_bytes_equal(q.view(torch.uint8), oracle_e4m3_bytes(y.flatten(-2)), x, "e4m3 bytes")

    q_values = q.view(torch.uint8).view(torch.float8_e4m3fn).double().unflatten(-1, (-1, block))
    want_deq = (q_values * want_scale.unsqueeze(-1)).flatten(-2).float()
    assert_fp32_bits_equal(dequantize_fp8(q, scale, block), want_deq, x, "fp8 dequantization")
    return q, scale


def check_mxfp4(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_mxfp4 vs the oracles: scale, packed codes, dequantization."""
    packed, scale = quantize_mxfp4(x, block)
    assert packed.dtype == torch.uint8 and packed.shape == (*x.shape[:-1], x.shape[-1] // 2)
    assert scale.dtype == torch.float32 and scale.shape == (*x.shape[:-1], x.shape[-1] // block)

    want_scale = oracle_block_scales(x, block, FP4_MAX)
    amax = x.double().unflatten(-1, (-1, block)).abs().amax(-1)
    assert_fp32_bits_equal(scale, want_scale.float(), amax, "mxfp4 block scale")

    y = (x.double().unflatten(-1, (-1, block)) / want_scale.unsqueeze(-1)).flatten(-2)
    assert bool((y.abs() <= FP4_MAX).all()), "|x / s| exceeds 6"
    codes = oracle_e2m1_codes(y)
    want_packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    assert_bytes_equal(packed, want_packed, x[..., 0::2], "packed e2m1 bytes (input shown: even element)")

    want_deq = (oracle_e2m1_values(codes).unflatten(-1, (-1, block)) * want_scale.unsqueeze(-1)).flatten(-2)
    assert_fp32_bits_equal(dequantize_mxfp4(packed, scale, block), want_deq.float(), x, "mxfp4 dequantization")
    return packed, scale


def fp32_neighbours(values: list[float]) -> torch.Tensor:
    """The fp32 values themselves plus one ulp below and above each (finite, non-negative only)."""
    v = torch.tensor(values, dtype=torch.float32)
    out = torch.cat((v, torch.nextafter(v, torch.zeros_like(v)), torch.nextafter(v, torch.full_like(v, math.inf))))
    return out[torch.isfinite(out) & (out >= 0)]


# ----------------------------------------------------------------------------------------------------
# 1. pow2_scale
# ----------------------------------------------------------------------------------------------------


def pow2_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    log_uniform = 10.0 ** (torch.rand(4000, generator=gen, dtype=torch.float64) * 68.5 - 30.0)  # 1e-30..3e38
    log_uniform = log_uniform.clamp(max=FP32_MAX).float()
    raw_bits = torch.randint(0, 0x7F800000, (4000,), generator=gen, dtype=torch.int32).view(torch.float32)
    eps32 = fp32(SCALE_EPS)
    return {
        "zeros": torch.zeros(4),
        "log_uniform_1e-30_3e38": log_uniform,
        "random_positive_fp32_bits": raw_bits,  # includes subnormals
        "eps_boundary": fp32_neighbours([eps32, eps32 / 2, eps32 * 2, 1e-30, 0.0]),
        "fp32_max_and_tiny": fp32_neighbours([FP32_MAX, 2.0**-149, 2.0**-126, 1.0]),
    }


@pytest.mark.parametrize("qmax", [FP8_MAX, FP4_MAX], ids=["qmax448", "qmax6"])
@pytest.mark.parametrize("case", list(pow2_inputs()))
def test_pow2_scale_matches_exact_rational(case: str, qmax: float) -> None:
    amax = pow2_inputs()[case]
    want = torch.tensor([oracle_pow2_scale(a, qmax) for a in amax.tolist()], dtype=torch.float32)
    assert_fp32_bits_equal(pow2_scale(amax, qmax), want, amax, f"pow2_scale(qmax={qmax})")


@pytest.mark.parametrize("qmax", [FP8_MAX, FP4_MAX], ids=["qmax448", "qmax6"])
def test_pow2_scale_at_exact_powers_times_qmax(qmax: float) -> None:
    # amax = qmax * 2^k must give exactly 2^k (above eps); one ulp up must give 2^(k+1).
    candidates = [qmax * 2.0**k for k in range(-160, 130)]
    exact = [v for v in candidates if v <= FP32_MAX and fp32(v) == v]  # representable in fp32 (incl. subnormal)
    amax = fp32_neighbours(exact)
    want = torch.tensor([oracle_pow2_scale(a, qmax) for a in amax.tolist()], dtype=torch.float32)
    assert_fp32_bits_equal(pow2_scale(amax, qmax), want, amax, f"pow2_scale(qmax={qmax}) at qmax*2^k")
    # Sanity of the oracle itself on the exact points above the eps floor.
    for k in (0, 5, 100):
        assert oracle_pow2_scale(qmax * 2.0**k, qmax) == 2.0**k
        one_ulp_up = fp32_neighbours([qmax * 2.0**k])[2].item()
        assert oracle_pow2_scale(one_ulp_up, qmax) == 2.0 ** (k + 1)


@pytest.mark.parametrize("eps", [SCALE_EPS, 0.5, 3.0, 2.0**-20], ids=["default", "0.5", "3.0", "2^-20"])
def test_pow2_scale_eps_floor(eps: float) -> None:
    e = fp32(eps)
    amax = fp32_neighbours([e, e / 3, 0.0, e * 1.5])
    want = torch.tensor([oracle_pow2_scale(a, FP8_MAX, eps) for a in amax.tolist()], dtype=torch.float32)
    got = pow2_scale(amax, FP8_MAX, eps)
    assert_fp32_bits_equal(got, want, amax, f"pow2_scale(eps={eps})")
    below = amax <= e
    assert bool((got[below] == oracle_pow2_scale(e, FP8_MAX, eps)).all()), "amax <= eps must give the eps scale"


def test_pow2_scale_accepts_bf16_amax() -> None:
    amax = torch.tensor([0.0, 1e-5, 0.3, 447.0, 448.0, 449.0, 1e20])
    want = torch.tensor([oracle_pow2_scale(a, FP8_MAX) for a in amax.bfloat16().double().tolist()])
    assert_fp32_bits_equal(pow2_scale(amax.bfloat16(), FP8_MAX), want.float(), amax, "bf16 amax")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.nan], ids=["nan", "+inf", "-nan"])
@pytest.mark.parametrize("qmax", [FP8_MAX, FP4_MAX], ids=["qmax448", "qmax6"])
def test_pow2_scale_nonfinite_is_nan(value: float, qmax: float) -> None:
    got = pow2_scale(torch.tensor([value, 1.0]), qmax)
    assert math.isnan(got[0].item()), f"pow2_scale({value}) = {got[0].item()}, want NaN"
    assert got[1].item() == oracle_pow2_scale(1.0, qmax), "the finite neighbour must be unaffected"


# ----------------------------------------------------------------------------------------------------
# 2. ue8m0
# ----------------------------------------------------------------------------------------------------


def test_ue8m0_round_trip_all_normal_powers_of_two() -> None:
    k = torch.arange(-126, 128)
    scale = torch.tensor([2.0 ** int(i) for i in k], dtype=torch.float32)
    code = ue8m0_encode(scale)
    assert_bytes_equal(code, (k + 127).to(torch.uint8), scale, "ue8m0_encode(2^k) = k + 127")
    assert_fp32_bits_equal(ue8m0_decode(code), scale, code, "ue8m0_decode(ue8m0_encode(2^k))")


def test_ue8m0_nan_code() -> None:
    code = ue8m0_encode(torch.tensor([math.nan, 1.0]))
    assert code.tolist() == [0xFF, 127]
    decoded = ue8m0_decode(torch.tensor([0xFF, 127], dtype=torch.uint8))
    assert math.isnan(decoded[0].item()) and decoded[1].item() == 1.0


def test_ue8m0_decode_every_byte() -> None:
    codes = torch.arange(255, dtype=torch.uint8)
    want = torch.tensor([2.0 ** (b - 127) for b in range(255)], dtype=torch.float32)  # byte 0: subnormal 2^-127
    assert want[0].item() == 2.0**-127, "2^-127 must be representable as an fp32 subnormal"
    assert_fp32_bits_equal(ue8m0_decode(codes), want, codes, "ue8m0_decode")


# ----------------------------------------------------------------------------------------------------
# 3. fp8 e4m3 with power-of-two block scales
# ----------------------------------------------------------------------------------------------------


def test_e4m3_table_sanity() -> None:
    # The oracle table: 254 finite codes, +-448 at the ends, magnitudes strictly increasing over 0x00..0x7E.
    assert len(E4M3_VALUES) == 254
    assert E4M3_POS_VALUES[-1].item() == 448.0 and E4M3_POS_VALUES[1].item() == 2.0**-9
    assert bool((E4M3_POS_VALUES[1:] > E4M3_POS_VALUES[:-1]).all())


def fp8_random(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * torch.rand(shape[:-1] + (1,), generator=gen) * 20).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "shape,block",
    [((16, 448), 64), ((8, 64), 64), ((3, 5, 128), 64), ((4, 512), 128), ((6, 96), 32)],
    ids=["D448_b64_7blocks", "D64_b64", "3d_D128_b64", "D512_b128", "D96_b32"],
)
def test_quantize_fp8_random(shape: tuple[int, ...], block: int, dtype: torch.dtype) -> None:
    check_fp8(fp8_random(shape, seed=sum(shape) + block, dtype=dtype), block)


def test_quantize_fp8_wide_dynamic_range() -> None:
    gen = torch.Generator().manual_seed(7)
    mag = 10.0 ** (torch.rand(32, 448, generator=gen, dtype=torch.float64) * 60 - 30)
    sign = torch.where(torch.rand(32, 448, generator=gen) < 0.5, -1.0, 1.0).double()
    check_fp8((mag * sign).float(), 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantize_fp8_zero_blocks(dtype: torch.dtype) -> None:
    x = torch.zeros(3, 448, dtype=dtype)
    x[1, 64:128] = -0.0  # a negative-zero block keeps its sign bit
    x[2, :64] = torch.linspace(-3, 3, 64)
    q, scale = check_fp8(x, 64)
    assert bool((scale[0] == oracle_pow2_scale(0.0, FP8_MAX)).all()), "all-zero blocks get the eps scale"
    assert bool((q.view(torch.uint8)[1, 64:128] == 0x80).all()), "-0.0 must encode as 0x80"


@pytest.mark.parametrize("k", [-10, 0, 3, 40], ids=lambda k: f"scale2^{k}")
def test_quantize_fp8_huge_and_tiny(k: int) -> None:
    # One value 448 * 2^k pins s = 2^k; the others land on e4m3 subnormals (2^-9 steps) or flush to +-0.
    gen = torch.Generator().manual_seed(100 + k)
    tiny = (10.0 ** (torch.rand(4, 64, generator=gen, dtype=torch.float64) * 4 - 5)) * 2.0**k  # 1e-5..0.1 scaled
    tiny = tiny * torch.where(torch.rand(4, 64, generator=gen) < 0.5, -1.0, 1.0).double()
    tiny[:, 5] = 448.0 * 2.0**k
    tiny[1, 5] = -448.0 * 2.0**k
    tiny[2, 7] = -(2.0**-12) * 2.0**k  # below half the smallest subnormal: -> -0 (0x80)
    tiny[3, 9] = 2.0**-12 * 2.0**k
    q, scale = check_fp8(tiny.float(), 64)
    bytes_ = q.view(torch.uint8)
    assert bool((scale == 2.0**k).all())
    assert bytes_[2, 7].item() == 0x80 and bytes_[3, 9].item() == 0x00
    subnormal = (bytes_ & 0x7F) < 8
    assert bool((subnormal & (bytes_ & 0x7F != 0)).any()), "the test must exercise e4m3 subnormals"


@pytest.mark.parametrize("k", [0, -7, 12], ids=lambda k: f"scale2^{k}")
def test_quantize_fp8_rounding_midpoints(k: int) -> None:
    # Every midpoint between adjacent non-negative e4m3 values, and one fp32 ulp either side of it.
    mids = ((E4M3_POS_VALUES[:-1] + E4M3_POS_VALUES[1:]) / 2).float()  # exact in fp32
    vals = torch.cat((mids, torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, mids * 2 + 1)))
    vals = torch.cat((vals, -vals))
    n = vals.numel()
    per_block = 63  # one slot per block holds 448 * 2^k, which pins the scale to 2^k
    pad = (-n) % per_block
    vals = torch.cat((vals, torch.zeros(pad))).reshape(-1, per_block)
    x = torch.cat((torch.full((vals.shape[0], 1), 448.0), vals), dim=1) * 2.0**k
    q, scale = check_fp8(x.reshape(1, -1), 64)
    assert bool((scale == 2.0**k).all())
    # Spot-check known ties: 432 (416|448) -> 448 = 0x7E; 2^-10 (0|2^-9) -> 0;
    # 17 (16|18) -> 16 = 0x58; 19 (18|20) -> 20 = 0x5A.
    y = torch.tensor([432.0, -432.0, 2.0**-10, -(2.0**-10), 17.0, 19.0, 448.0]) * 2.0**k
    got = quantize_fp8(torch.cat((y, torch.zeros(57))).reshape(1, 64), 64)[0].view(torch.uint8)[0, :7]
    assert got.tolist() == [0x7E, 0xFE, 0x00, 0x80, 0x58, 0x5A, 0x7E], [hex(b) for b in got.tolist()]


def test_quantize_fp8_rejects_ragged_last_dim() -> None:
    with pytest.raises(ValueError):
        quantize_fp8(torch.zeros(2, 100), 64)


# ----------------------------------------------------------------------------------------------------
# 4. e2m1 / MXFP4
# ----------------------------------------------------------------------------------------------------


E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def test_e2m1_decode_all_codes() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    want = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    assert_fp32_bits_equal(e2m1_decode(codes), want, codes, "e2m1_decode")


def test_e2m1_encode_exact_values_round_trip() -> None:
    y = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    assert_bytes_equal(e2m1_encode(y), torch.arange(16, dtype=torch.uint8), y, "e2m1_encode of table values")


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["pos", "neg"])
@pytest.mark.parametrize("offset", ["at", "below", "above"])
def test_e2m1_encode_midpoints(offset: str, sign: float) -> None:
    mids = torch.tensor(E2M1_MIDPOINTS) * sign
    if offset == "below":  # toward zero
        mids = torch.nextafter(mids, torch.zeros_like(mids))
    elif offset == "above":  # away from zero
        mids = torch.nextafter(mids, mids * 2)
    assert_bytes_equal(e2m1_encode(mids), oracle_e2m1_codes(mids.double()), mids, f"e2m1_encode {offset} midpoints")
    if offset == "at":  # ties to even code: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4
        want = [0, 2, 2, 4, 4, 6, 6]
        assert [c & 7 for c in e2m1_encode(mids).tolist()] == want


def test_e2m1_encode_dense_sweep() -> None:
    y = torch.linspace(-6, 6, 12001)  # step 0.001 hits every midpoint and zero
    y = torch.cat((y, torch.tensor([-0.0, 1e-30, -1e-30, 0.2499999, -0.2500001])))
    assert_bytes_equal(e2m1_encode(y), oracle_e2m1_codes(y.double()), y, "e2m1_encode sweep")


def test_mxfp4_packing_hand_example() -> None:
    # Block amax 6 -> s = 1; codes: 0.5=1, -1=0xA, 6=7, 0=0, 3=5, -6=0xF, -0.25=0x8 (tie -> even 0, sign kept), 1.25=2.
    x = torch.zeros(1, 32)
    x[0, :8] = torch.tensor([0.5, -1.0, 6.0, 0.0, 3.0, -6.0, -0.25, 1.25])
    packed, scale = quantize_mxfp4(x)
    assert scale.tolist() == [[1.0]]
    assert packed[0, :4].tolist() == [0xA1, 0x07, 0xF5, 0x28], [hex(b) for b in packed[0, :4].tolist()]
    assert packed[0, 4:].tolist() == [0] * 12
    check_mxfp4(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(16, 128), (8, 64), (2, 3, 128)], ids=["D128", "D64", "3d_D128"])
def test_quantize_mxfp4_random(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    check_mxfp4(fp8_random(shape, seed=sum(shape) + 4, dtype=dtype))


def test_quantize_mxfp4_midpoints_through_scale() -> None:
    # Midpoints and their fp32 neighbours, scaled by 2^k through a pinned block amax of 6 * 2^k.
    mids = torch.tensor(E2M1_MIDPOINTS)
    vals = torch.cat((mids, torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, mids * 2)))
    vals = torch.cat((vals, -vals, torch.tensor([6.0, -6.0, 0.0, -0.0, 1e-3, -1e-3])))  # 48 values
    rows = []
    for k in (-9, 0, 5):  # two blocks of 32, each led by 6 (its amax), then padded with zeros
        row = torch.cat((torch.tensor([6.0]), vals[:31], torch.tensor([6.0]), vals[31:], torch.zeros(14)))
        rows.append(row * 2.0**k)
    _, scale = check_mxfp4(torch.stack(rows))
    assert scale.tolist() == [[2.0**-9] * 2, [1.0] * 2, [32.0] * 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantize_mxfp4_zero_and_wide_range(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    mag = 10.0 ** (torch.rand(8, 128, generator=gen, dtype=torch.float64) * 50 - 25)
    x = (mag * torch.where(torch.rand(8, 128, generator=gen) < 0.5, -1.0, 1.0).double()).to(dtype)
    x[0] = 0.0
    x[1, 32:64] = -0.0
    packed, scale = check_mxfp4(x)
    assert bool((scale[0] == oracle_pow2_scale(0.0, FP4_MAX)).all())
    assert bool((packed[1, 16:32] == 0x88).all()), "-0.0 pairs must pack to 0x88"


# ----------------------------------------------------------------------------------------------------
# 5. NaN / inf policy
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_nonfinite_block_is_nan_and_isolated(fmt: str, bad: float) -> None:
    block = 64 if fmt == "fp8" else 32
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4 * block, generator=gen) * 5
    x[1, block + 3] = bad  # poisons block 1 of row 1 only
    if fmt == "fp8":
        q, scale = quantize_fp8(x, block)
        deq = dequantize_fp8(q, scale, block)
        codes = q.view(torch.uint8)
        code_width = block
    else:
        codes, scale = quantize_mxfp4(x, block)
        deq = dequantize_mxfp4(codes, scale, block)
        code_width = block // 2

    assert math.isnan(scale[1, 1].item()), f"scale of the poisoned block is {scale[1, 1].item()}, want NaN"
    assert ue8m0_encode(scale)[1, 1].item() == 0xFF
    assert bool(torch.isnan(deq[1, block : 2 * block]).all()), "the whole poisoned block must dequantize to NaN"

    poisoned = torch.zeros_like(scale, dtype=torch.bool)
    poisoned[1, 1] = True
    assert bool(torch.isfinite(scale[~poisoned]).all())
    for r in range(3):
        for b in range(4):
            if r == 1 and b == 1:
                continue
            alone = x[r : r + 1, b * block : (b + 1) * block]
            if fmt == "fp8":
                q_alone, s_alone = quantize_fp8(alone, block)
                c_alone, d_alone = q_alone.view(torch.uint8), dequantize_fp8(q_alone, s_alone, block)
            else:
                c_alone, s_alone = quantize_mxfp4(alone, block)
                d_alone = dequantize_mxfp4(c_alone, s_alone, block)
            where = f"row {r} block {b}"
            assert torch.equal(codes[r : r + 1, b * code_width : (b + 1) * code_width], c_alone), where
            assert torch.equal(scale[r : r + 1, b : b + 1].view(torch.int32), s_alone.view(torch.int32)), where
            assert torch.equal(deq[r : r + 1, b * block : (b + 1) * block], d_alone), where
            assert bool(torch.isfinite(d_alone).all()), where


# ----------------------------------------------------------------------------------------------------
# 6. Hadamard
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 64, 128, 256], ids=lambda n: f"n{n}")
def test_hadamard_matrix(n: int) -> None:
    h = hadamard_matrix(n)
    assert h.dtype == torch.float32 and h.shape == (n, n)
    want = torch.tensor([[sylvester_entry(i, j, n) for j in range(n)] for i in range(n)], dtype=torch.float32)
    assert_fp32_bits_equal(h, want, h, f"hadamard_matrix({n}) vs (-1)^popcount(i&j)/sqrt(n)")
    assert torch.equal(h, h.T), "must be symmetric"
    assert bool((h.abs() == fp32(n**-0.5)).all()), "entries must be +-n^-0.5"
    assert bool((h[0] > 0).all()), "first row must be all positive"
    err = (h.double() @ h.double().T - torch.eye(n, dtype=torch.float64)).abs().max().item()
    assert err <= 1e-6, f"H @ H.T deviates from I by {err}"


@pytest.mark.parametrize("n", [0, 3, 12, -4], ids=lambda n: f"n{n}")
def test_hadamard_rejects_non_power_of_two(n: int) -> None:
    with pytest.raises(ValueError):
        hadamard_matrix(n)


@pytest.mark.parametrize("n", [64, 128], ids=lambda n: f"n{n}")
def test_hadamard_rotate_preserves_dot_products(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(5, 32, n, generator=gen)
    k = torch.randn(5, 32, n, generator=gen).bfloat16()
    qr, kr = hadamard_rotate(q), hadamard_rotate(k)
    assert qr.dtype == kr.dtype == torch.float32 and qr.shape == q.shape
    want = q.double() @ k.double().transpose(-1, -2)
    got = (qr.double() @ kr.double().transpose(-1, -2))
    norms = q.double().norm(dim=-1, keepdim=True) * k.double().norm(dim=-1).unsqueeze(-2)
    rel = ((got - want).abs() / norms).max().item()  # relative to |q||k|: a single dot may cancel to ~0
    assert rel <= 1e-5, f"dot products drift by {rel} (relative)"
    norm_rel = ((qr.double().norm(dim=-1) - q.double().norm(dim=-1)).abs() / q.double().norm(dim=-1)).max().item()
    assert norm_rel <= 1e-5, f"norms drift by {norm_rel} (relative)"
