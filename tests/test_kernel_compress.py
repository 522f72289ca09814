"""Compressor kernels (dsv4kv.ops.compress.kernel) against the reference over random multi-request chunked
schedules on a poisoned cache (pools 0xFF, state rings NaN until written, padding rows NaN):

- append_state == ops.compress.reference.append_state, bit for bit (the state rings);
- compress_insert == ops.compress.reference.compress_and_insert: the kernel pools, norms and rotates in another order
  (and on a GPU with other exp / rsqrt), so the entries are compared through the layout's decode within one
  quantization step (the tolerance table below) with >= 99% of their bytes equal; every byte the plan does not write
  keeps its poison.

CSA (overlap, m = 4) and HCA (m = 16) layers of the tiny geometry, main entries FP8 MODEL1 / bf16 and indexer
keys MXFP4 / FP8 / bf16, exact and padded persistent plans, bf16 and fp32 entries. Interpreted on the CPU; the
GPU tests use V4-Flash / V4-Pro shapes (d 512, index 128, ratios 4 and 128, 256-token pages).
"""

from dataclasses import dataclass, field, replace

import pytest
import torch
import triton
import triton.language as tl
from schedules import admit, random_steps, written_bytes

from dsv4kv import CacheManager, ModelGeometry
from dsv4kv.cache import quant
from dsv4kv.backend import interpreted
from dsv4kv.geometry import LayerKind
from dsv4kv.ops.compress import kernel as compress
from dsv4kv.ops.compress.kernel import append_state, compress_insert
from dsv4kv.ops.compress.tuning import CompressTile, PoolTile, tuning_for
from dsv4kv.ops.shared.encode import rotate_keys, store_index_entries
from dsv4kv.cache.layout import IndexerFP8Layout, IndexerMXFP4Layout, MainFP8Layout, indexer_layout, main_layout
from dsv4kv.ops.compress.reference import append_state as reference_append
from dsv4kv.ops.compress.reference import compress_and_insert
from dsv4kv.ops.rope.reference import rope_cos_sin

TINY = ModelGeometry.preset("tiny")  # layers: 0 window, 1 CSA m=4, 2 HCA m=16; head_dim 128, index_head_dim 64
MAIN_FORMATS = ("fp8", "bf16")
INDEX_FORMATS = ("mxfp4", "fp8", "bf16")
POISON = 0xFF
DEVICE = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Padding entries pool no rows (0 / 0) and the kernels rotate every row of a tile, keeping the rope row: the
# interpreter's numpy reports the (discarded) NaNs.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# Tolerance of a decoded entry value against the reference's, per format: one step of the format's grid at that
# value (the larger gap to a neighbour, at the larger of the two sides' scales),
#   bf16 (main, indexer, FP8 MODEL1 rope dims): 2^(floor(log2 |v|) - 7)
#   e4m3 (MODEL1 nope dims, ue8m0 scale s per 64; indexer FP8, one fp32 scale s): 2^(max(floor(log2 |v/s|), -6) - 3) * s
#   e2m1 (MXFP4, ue8m0 scale s per 32): 0.5 s below 2 s, 1 s below 4 s, else 2 s
# plus ATOL * max |entry| for values near zero, whose fp32 error (a reordered sum over the whole entry) exceeds
# their own bf16 step. Rotated keys (indexer FP8 / MXFP4) also get SPREAD * rms(entry): the entry is rounded to
# bf16 before the Hadamard rotation, the kernel's fp32 sums can round an element the other way (one bf16 step,
# at most 2^-7 |x_i| <= 2^-7 sqrt(d) rms), and the rotation spreads that over every value / sqrt(d): up to
# 2^-7 rms per such element in every rotated value, so SPREAD = 2^-5 allows four of them in one entry.
ATOL = 2.0**-16
SPREAD = 2.0**-5
MIN_EQUAL_BYTES = 0.99


# --- helpers ----------------------------------------------------------------------------------------
def gen(seed):
    return torch.Generator().manual_seed(seed)


def same_bits(a, b):
    """Bitwise equality (NaN == NaN when the bits agree)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))



def bf16_step(v):
    exponent = (v.abs().view(torch.int32) >> 23).clamp(min=1) - 127  # floor(log2 |v|); subnormals: -126
    return torch.ldexp(torch.ones_like(v), exponent - 7)


def e4m3_step(v, scale):
    mantissa, exponent = torch.frexp(v.abs() / scale)
    exponent = torch.where(mantissa > 0, exponent - 1, -6).clamp(min=-6)  # floor(log2 |y|); subnormals: -6
    return torch.ldexp(torch.ones_like(v), exponent - 3) * scale


def e2m1_step(v, scale):
    y = v.abs() / scale
    return torch.where(y < 2, 0.5, torch.where(y < 4, 1.0, 2.0)) * scale


def grid_step(layout, pool, entries, slots, values):
    """fp32 [E, dim]: one step of the layout's grid at each decoded value of the entries at `slots`."""
    _, scale_rows = layout.page_views(pool, entries)
    slots = slots.long()
    scales = scale_rows[slots // entries, slots % entries]  # uint8 [E, scale_bytes]
    if isinstance(layout, MainFP8Layout):
        nope = layout.nope_dim
        scale = quant.ue8m0_decode(scales[:, :nope // 64]).repeat_interleave(64, dim=1)
        return torch.cat((e4m3_step(values[:, :nope], scale), bf16_step(values[:, nope:])), dim=1)
    if isinstance(layout, IndexerFP8Layout):
        return e4m3_step(values, scales.contiguous().view(torch.float32))
    if isinstance(layout, IndexerMXFP4Layout):
        return e2m1_step(values, quant.ue8m0_decode(scales).repeat_interleave(32, dim=1))
    return bf16_step(values)


@dataclass
class Agreement:
    """What one layout's entries measured over a schedule."""

    entries: int = 0
    seen: set = field(default_factory=set)  # (padded plan, out_dtype) of the steps that wrote entries
    worst: float = 0.0  # max |kernel - reference| / tolerance
    max_abs: float = 0.0
    bytes_total: int = 0
    bytes_equal: int = 0

    def __str__(self):
        share = self.bytes_equal / max(self.bytes_total, 1)
        return (f"{self.entries} entries, max |diff| {self.max_abs:.3g} = {self.worst:.3g} of the tolerance, "
                f"bytes equal {share:.5f}")


def check_entries(layout, entries, pool, want, before, slots, agreement, seen):
    """Kernel pool vs reference pool after one compress_insert: unwritten bytes keep their poison, the written
    entries decode within TOLERANCE of the reference's, and their bytes are counted."""
    written = written_bytes(layout, entries, pool.shape[0], slots.cpu()).to(pool.device)
    assert torch.equal(pool[~written], before[~written]), "bytes of slots the plan does not write must not change"
    if slots.numel() == 0:
        return
    got, expected = layout.read(pool, entries, slots), layout.read(want, entries, slots)
    assert expected.isfinite().all()
    step = torch.maximum(grid_step(layout, pool, entries, slots, got),
                         grid_step(layout, want, entries, slots, expected))
    bound = step + ATOL * expected.abs().amax(dim=1, keepdim=True)
    if layout.rotated:
        bound = bound + SPREAD * expected.pow(2).mean(dim=1, keepdim=True).sqrt()
    diff = (got - expected).abs()
    assert (diff <= bound).all(), (f"{layout.name}: entries beyond one quantization step: max |diff| "
                                   f"{diff.nan_to_num(float('inf')).max():.4g}, {(~(diff <= bound)).sum()} values")
    if isinstance(layout, MainFP8Layout):  # the scale row's pad bytes are not decoded: compare them directly
        _, kernel_scales = layout.page_views(pool, entries)
        _, want_scales = layout.page_views(want, entries)
        s = slots.long()
        pad = layout.nope_dim // 64
        assert torch.equal(kernel_scales[s // entries, s % entries, pad:], want_scales[s // entries, s % entries, pad:])
    agreement.entries += slots.numel()
    agreement.seen.add(seen)
    agreement.worst = max(agreement.worst, float((diff / bound).max()))
    agreement.max_abs = max(agreement.max_abs, float(diff.max()))
    agreement.bytes_total += int(written.sum())
    agreement.bytes_equal += int((pool == want)[written].sum())


@dataclass
class Compressor:
    """One compressor of a layer (main or indexer): state rings and one pool per layout, kernel side and
    reference side, all poisoned."""

    main: bool
    dim: int
    layouts: list
    norm_weight: torch.Tensor
    kv_scale: float
    state: list = field(default_factory=list)  # kernel [kv, logits], reference [kv, logits]
    pools: dict = field(default_factory=dict)  # layout name -> (kernel pool, reference pool)
    agreement: dict = field(default_factory=dict)


def make_compressors(cache, layer, g):
    geometry, spec = cache.geometry, cache.geometry.layers[layer]
    csa = spec.kind is LayerKind.CSA
    ring, blocks, entries = (2 if csa else 1) * spec.ratio, cache.num_blocks, cache.spec.page_tokens // spec.ratio
    d = geometry.head_dim
    made = [Compressor(True, d, [main_layout(f, d, geometry.rope_dim) for f in MAIN_FORMATS],
                       1 + 0.2 * torch.randn(d, generator=g), 3.0)]
    if csa:
        d = geometry.index_head_dim
        made.append(Compressor(False, d, [indexer_layout(f, d) for f in INDEX_FORMATS],
                               1 + 0.2 * torch.randn(d, generator=g), 1.0))
    for c in made:
        c.norm_weight = c.norm_weight.to(cache.device)
        shape = (cache.max_requests, ring, (2 if csa else 1) * c.dim)
        nan = torch.full(shape, float("nan"), device=cache.device)  # never read before a step writes it
        c.state = [nan.clone(), nan.clone(), nan.clone(), nan.clone()]
        for layout in c.layouts:
            pool = torch.full((blocks, layout.page_bytes(entries)), POISON, dtype=torch.uint8, device=cache.device)
            c.pools[layout.name] = (pool, pool.clone())
            c.agreement[layout.name] = Agreement()
    return made


def run_compress_schedule(cache, layer, rids, steps, buffers, seed, every_layout=True, tuning=None):
    """Runs the schedule (steps: ((request number, tokens), ...), padded) through kernels (with `tuning`) and
    reference and checks every step; returns the compressors (with their Agreement per layout). Without
    `every_layout` each step encodes into one main and one indexer layout, in turn (the interpreter is slow); state
    rings are shared."""
    g = gen(seed)
    spec, device = cache.geometry.layers[layer], cache.device
    csa = spec.kind is LayerKind.CSA
    entries = cache.spec.page_tokens // spec.ratio
    compressors = make_compressors(cache, layer, g)
    for i, (batch, padded) in enumerate(steps):
        plan = cache.plan_step([(rids[r], n) for r, n in batch], buffers=buffers if padded else None)
        rows, n = plan.positions.shape[0], plan.num_tokens
        writes = plan.entries[spec.ratio]
        slots = writes.slots[:writes.count]
        out_dtype = torch.float32 if i % 5 == 1 else torch.bfloat16
        for c in compressors:
            width = c.state[0].shape[2]
            kv_rows = torch.randn(rows, width, generator=g) * c.kv_scale
            logit_rows = torch.randn(rows, width, generator=g) * 2
            kv_rows[n:], logit_rows[n:] = float("nan"), float("nan")  # padding rows: never read
            kv_rows, logit_rows = kv_rows.to(device), logit_rows.to(device)
            kernel_kv, kernel_logits, ref_kv, ref_logits = c.state
            turn = c.layouts[(i + i // len(c.layouts)) % len(c.layouts)]  # padded steps reach every layout
            for layout in c.layouts if every_layout else [turn]:
                pool, want = c.pools[layout.name]
                kw = dict(ratio=spec.ratio, overlap=csa, norm_weight=c.norm_weight, eps=cache.geometry.rms_norm_eps,
                          rope=spec.rope, out_dtype=out_dtype, layout=layout, page_tokens=cache.spec.page_tokens)
                before = pool.clone()
                compress_insert(kernel_kv, kernel_logits, plan, kv_rows, logit_rows, pool=pool, main=c.main,
                                tuning=tuning, **kw)
                compress_and_insert(ref_kv, ref_logits, plan, kv_rows[:n], logit_rows[:n], pool=want, **kw)
                check_entries(layout, entries, pool, want, before, slots, c.agreement[layout.name], (padded, out_dtype))
            append_state(kernel_kv, kernel_logits, plan, kv_rows, logit_rows)
            reference_append(ref_kv, ref_logits, plan, kv_rows[:n], logit_rows[:n])
            assert same_bits(kernel_kv, ref_kv) and same_bits(kernel_logits, ref_logits), f"state rings after {plan}"
    for c in compressors:
        for name, agreement in c.agreement.items():
            assert agreement.bytes_equal >= MIN_EQUAL_BYTES * agreement.bytes_total, f"{name}: {agreement}"
            print(f"layer {layer} {'main' if c.main else 'indexer'} {name}: {agreement}")
    return compressors


def schedule(seed, lengths, chunks, padded_every, cap):
    """Random steps as (batch, padded): every `padded_every`-th step goes through the persistent buffers and so
    holds at most `cap` tokens."""
    steps = random_steps(seed, lengths, chunks, cap=cap, capped_every=padded_every)
    return [(step, k % padded_every == padded_every - 1) for k, step in enumerate(steps)]


def untouched_slot(compressors, slot):
    for c in compressors:
        assert all(t[slot].isnan().all() for t in c.state), "the unused slot's state rings"


# --- schedules on the interpreter ---------------------------------------------------------------------------
# Tiles, every launch keeping its tile (no spreading of small launches): "default" is the device's (4 indexer keys
# per program; the tiny HCA's 16 rows in one chunk); "chunked" puts 2-8 entries in a program and pools in chunks of
# 4 rows (the online softmax across chunks, CSA's first chunk empty for entry 0, HCA in 4 chunks).
def spread_off():
    return replace(tuning_for(DEVICE), spread_programs=1)


TILES = {"default": {}, "chunked": dict(csa_main=CompressTile(2, 4, 2), csa_index=CompressTile(8, 4, 2), hca_entries=4,
                                        pool_few=PoolTile(4, 4, 1), pool_many=PoolTile(32, 4, 4))}


@pytest.mark.parametrize("tiles", list(TILES))
@pytest.mark.parametrize("layer, lengths, seed", [(1, (141, 25, 12), 8), (2, (141, 37, 22), 22)],
                         ids=["csa-m4", "hca-m16"])
def test_compress_and_state_over_random_schedule(layer, lengths, seed, tiles):
    """Three requests (the first crosses into a second, non-adjacent block), chunks of 1..60 tokens, every third
    step a padded plan (buffers for 5 tokens: padding entries, programs of padding only), every fifth fp32 entries;
    the layouts take turns."""
    tuning = replace(spread_off(), **TILES[tiles])
    cache = CacheManager(TINY, max_requests=4, max_tokens=600, page_tokens=128, device=DEVICE, poison=True)
    rids = admit(cache, 3)
    buffers = cache.step_buffers(max_tokens=5, max_requests=3)
    steps = schedule(seed, lengths, chunks=(1, 1, 2, 5, 13, 29, 60), padded_every=3, cap=5)
    compressors = run_compress_schedule(cache, layer, rids, steps, buffers, seed=layer, every_layout=False,
                                        tuning=tuning)
    blocks = cache.blocks(rids[0])
    assert len(blocks) == 2 and blocks[1] != blocks[0] + 1, "non-contiguous blocks"
    assert any(n >= 29 for batch, padded in steps if not padded for _, n in batch)
    for c in compressors:
        for name, agreement in c.agreement.items():
            padded, dtypes = {p for p, _ in agreement.seen}, {d for _, d in agreement.seen}
            assert padded == {False, True} and dtypes == {torch.bfloat16, torch.float32}, f"{name}: {agreement.seen}"
    untouched_slot(compressors, 0)


@pytest.mark.parametrize("channels", [32, 128])
def test_hca_pool_split_changes_no_byte(channels, monkeypatch):
    """HCA pooled in a first launch split over slices of `channels` channels, then normed and encoded in a second,
    writes the bytes of a pooling launch whose programs take all of an entry's channels, with the same rows per
    chunk (channels are independent; the interpreter reduces a chunk's rows in one order whatever the warps), over
    the random schedule. Launches of up to `few_entries` entries take the "few" tile (one warp), the others the
    "many" tile (here 2 entries splits the schedule's launches)."""
    tuning = replace(spread_off(), hca_entries=2, few_entries=2)
    split = replace(tuning, pool_few=PoolTile(channels, 4, 1), pool_many=PoolTile(channels, 4, 4))
    whole = replace(tuning, pool_few=PoolTile(1 << 16, 4, 4), pool_many=PoolTile(1 << 16, 4, 4))
    pooling = compress_insert
    calls = []

    def both(state_kv, state_logits, plan, kv_rows, logit_rows, *, pool, tuning, **kw):
        other = pool.clone()
        pooling(state_kv, state_logits, plan, kv_rows, logit_rows, pool=other, tuning=whole, **kw)
        pooling(state_kv, state_logits, plan, kv_rows, logit_rows, pool=pool, tuning=split, **kw)
        assert torch.equal(pool, other)
        writes = plan.entries[kw["ratio"]]
        calls.append((writes.count, writes.slots.shape[0]))  # entries completing, the launch's count

    monkeypatch.setitem(globals(), "compress_insert", both)
    cache = CacheManager(TINY, max_requests=4, max_tokens=600, page_tokens=128, device=DEVICE, poison=True)
    rids = admit(cache, 3)
    buffers = cache.step_buffers(max_tokens=5, max_requests=3)
    steps = schedule(22, (141, 37, 22), chunks=(1, 1, 2, 5, 13, 29, 60), padded_every=3, cap=5)
    run_compress_schedule(cache, 2, rids, steps, buffers, seed=2, every_layout=False, tuning=tuning)
    counts = [launched for _, launched in calls]
    assert sum(done for done, _ in calls) > 10 and min(counts) <= 2 < max(counts)  # both tiles ran


def test_compress_wait_late_changes_no_byte(monkeypatch):
    """`wait_late` (the wait for the grid before it moved to the kernel's end, every exit included) and `launch_next`
    (the next grid let in after the wait) write the bytes the plain launch writes, over the CSA random schedule (on
    the GPU the layer's streams test runs them for real)."""
    plain = compress_insert
    calls = []

    def both(state_kv, state_logits, plan, kv_rows, logit_rows, *, pool, **kw):
        other = pool.clone()
        plain(state_kv, state_logits, plan, kv_rows, logit_rows, pool=other, **kw)
        writes = plan.entries[kw["ratio"]]
        cos_sin = rope_cos_sin(kw["rope"], writes.index * kw["ratio"])
        early = pool.clone()
        plain(state_kv, state_logits, plan, kv_rows, logit_rows, pool=pool, wait_late=True, cos_sin=cos_sin, **kw)
        plain(state_kv, state_logits, plan, kv_rows, logit_rows, pool=early, launch_next=True, **kw)
        assert torch.equal(pool, other) and torch.equal(early, other)
        calls.append((writes.count, writes.slots.shape[0]))

    monkeypatch.setitem(globals(), "compress_insert", both)
    cache = CacheManager(TINY, max_requests=4, max_tokens=600, page_tokens=128, device=DEVICE, poison=True)
    rids = admit(cache, 3)
    buffers = cache.step_buffers(max_tokens=5, max_requests=3)
    steps = schedule(8, (61, 25, 12), chunks=(1, 2, 13, 29), padded_every=3, cap=5)
    run_compress_schedule(cache, 1, rids, steps, buffers, seed=1, every_layout=False, tuning=spread_off())
    assert sum(count for count, _ in calls) > 10
    assert any(count == 0 < launched for count, launched in calls)  # a launch whose programs all return early


@pytest.mark.skipif(not interpreted(), reason="counts calls of the PDL wait, a plain Python function only under "
                    "Triton's interpreter (the CPU run)")
def test_wait_late_waits_once_per_program(monkeypatch):
    """A `wait_late` program still waits before it exits, programs of padding entries only (which return early)
    included: under the interpreter, where the wait is a plain function, every program of a launch calls it once on
    both paths. With `launch_next` every program waits, then lets the next grid in. The caller's cos_sin is required
    for wait_late (made here, they would be written right before the early reader)."""
    events = []
    monkeypatch.setattr(compress, "wait_for_prior_grids", lambda: events.append("wait"))
    monkeypatch.setattr(compress, "let_next_grid_launch", lambda: events.append("launch"))
    cache = CacheManager(TINY, max_requests=2, max_tokens=300, page_tokens=128, device=DEVICE, poison=True)
    rid = cache.admit()
    buffers = cache.step_buffers(max_tokens=5, max_requests=2)
    layer, layout, spec = cache.pools.layers[1], cache.spec.layers[1].index, TINY.layers[1]
    for step, completing in (([(rid, 1)], 0), ([(rid, 5)], 1)):  # position 0: no entry completes; 1..5: entry 0
        plan = cache.plan_step(step, buffers=buffers)
        writes = plan.entries[spec.ratio]
        assert writes.count == completing and writes.slots.shape[0] > 0
        rows = plan.positions.shape[0]
        kw = dict(ratio=spec.ratio, overlap=True, norm_weight=torch.ones(layout.dim, device=DEVICE), eps=1e-6,
                  rope=spec.rope, out_dtype=torch.bfloat16, layout=layout, pool=layer.index_keys, page_tokens=128,
                  main=False)
        state = (layer.index_state_kv, layer.index_state_score, plan, torch.randn(rows, 2 * layout.dim, device=DEVICE),
                 torch.randn(rows, 2 * layout.dim, device=DEVICE))
        counts = {}
        for late in (False, True):
            events.clear()
            compress_insert(*state, cos_sin=rope_cos_sin(spec.rope, writes.index * spec.ratio), wait_late=late, **kw)
            counts[late] = len(events)
        assert counts[True] == counts[False] > 0 and set(events) == {"wait"}, counts
        events.clear()
        compress_insert(*state, launch_next=True, **kw)
        assert events == ["wait", "launch"] * counts[False], events
        with pytest.raises(ValueError, match="wait_late needs the caller's cos_sin"):
            compress_insert(*state, wait_late=True, **kw)
    # an exact-size plan whose step completes no entry has no entry slot: nothing launches, but the first kernel of a
    # pair launches one program, which waits and lets the next grid in (the second kernel's wait is on it)
    plan = cache.plan_step([(rid, 1)])
    assert plan.entries[spec.ratio].slots.shape[0] == 0
    state = (layer.index_state_kv, layer.index_state_score, plan, torch.randn(1, 2 * layout.dim, device=DEVICE),
             torch.randn(1, 2 * layout.dim, device=DEVICE))
    for launch_next, want in ((False, []), (True, ["wait", "launch"])):
        events.clear()
        compress_insert(*state, launch_next=launch_next, **kw)
        assert events == want, (launch_next, events)


# --- indexer-key encoders, bit for bit ------------------------------------------------------------------------
# compress_insert's entries come out of a softmax, a norm and a rotation, so random schedules almost never put a
# value on a rounding tie. The encoders it calls are checked here on constructed (already rotated) keys instead,
# several keys per program (the rotation itself is covered by the schedules above).
@triton.jit
def _encode_keys_kernel(x_ptr, out_ptr, n, D: tl.constexpr, FORMAT: tl.constexpr, DATA_BYTES: tl.constexpr,
                        SCALE_BYTES: tl.constexpr, BLOCK_R: tl.constexpr):
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < n
    x = tl.load(x_ptr + o_r[:, None] * D + tl.arange(0, D)[None, :], mask=m_r[:, None], other=0.0)
    p_data = out_ptr + o_r.to(tl.int64) * (DATA_BYTES + SCALE_BYTES)
    store_index_entries(p_data, p_data + DATA_BYTES, x, m_r, FORMAT)


def key_corners(fmt, d, g):
    """fp32 [N, d] bf16-valued keys: scale-setting maxima (qmax * 2^k, a bit above it, the eps floor), values on
    the rounding ties of e2m1 (MXFP4, per 32) or e4m3 (FP8, per key), exact grid values, zeros and -0."""
    if fmt == "mxfp4":
        qmax, block = 6.0, 32
        ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.0, 0.3125, 2.625]
    else:
        qmax, block = 448.0, d
        ties = [(17 + 2 * m) / 16 * 2.0**e for e in range(-6, 9) for m in range(8) if (17 + 2 * m) / 16 * 2.0**e < 448]
        ties += [(k + 0.5) * 2.0**-9 for k in range(8)] + [0.0]
    ties = torch.tensor(ties)
    rows = []
    for scale in (1.0, 2.0**-5, 2.0**7, 2.0**-13):
        signs = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0)
        values = ties[torch.randint(0, len(ties), (d,), generator=g)] * signs
        values[::block] = qmax  # every block's amax: its scale is exactly `scale`
        rows.append(values * scale)
    above = rows[0].clone()
    above[::block] = qmax * 1.0625  # just above qmax: the scale doubles
    tiny, plain = (torch.randn(2, d, generator=g) * torch.tensor([[3e-5], [1.0]])).to(torch.bfloat16).float()
    keys = torch.stack(rows + [above, tiny, torch.zeros(d), -torch.zeros(d), plain])
    assert torch.equal(keys.to(torch.bfloat16).float(), keys)
    return keys


def encode_keys(keys, layout, fmt_code, block_r=4):
    """(kernel bytes, reference bytes) [N, entry_bytes] of bf16-valued keys fp32 [N, d] taken as already rotated."""
    n, d = keys.shape
    out = torch.full((n, layout.entry_bytes), POISON, dtype=torch.uint8, device=keys.device)
    _encode_keys_kernel[(triton.cdiv(n, block_r),)](keys, out, n, D=d, FORMAT=fmt_code, DATA_BYTES=layout.data_bytes,
                                                     SCALE_BYTES=layout.scale_bytes, BLOCK_R=block_r)
    rotated = keys.to(torch.bfloat16)
    if fmt_code == 2:
        packed, scale = quant.quantize_mxfp4(rotated, 32)
        want = torch.cat((packed, quant.ue8m0_encode(scale)), dim=1)
    else:
        q, scale = quant.quantize_fp8(rotated, d)
        want = torch.cat((q.view(torch.uint8), scale.contiguous().view(torch.uint8)), dim=1)
    return out, want


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("fmt, fmt_code", [("mxfp4", 2), ("fp8", 1)])
def test_index_key_encoders_bit_for_bit(fmt, fmt_code, d):
    layout = indexer_layout(fmt, d)
    keys = key_corners(fmt, d, gen(d)).to(DEVICE)
    out, want = encode_keys(keys, layout, fmt_code)
    assert torch.equal(out, want)


@pytest.mark.parametrize("fmt, fmt_code", [("mxfp4", 2), ("fp8", 1)])
def test_index_key_encoders_nonfinite(fmt, fmt_code):
    """A NaN or inf in a rotated key: the scale of its block (MXFP4: the 32 values; FP8: the whole key) is NaN and
    the block decodes to NaN; other blocks and keys are unaffected. (Before encoding, the rotation spreads a NaN
    or inf over the whole key: NaN * 0 in the reference's GEMM, a +- b in the kernel's butterfly.)"""
    layout = indexer_layout(fmt, 64)
    keys = torch.randn(3, 64, generator=gen(5)).to(torch.bfloat16).float()
    keys[0, 40], keys[1, 3] = float("nan"), float("-inf")
    keys = keys.to(DEVICE)
    out, want = encode_keys(keys, layout, fmt_code)
    nan_blocks = [[1], [0], []] if fmt == "mxfp4" else [[0], [0], []]
    block = 32 if fmt == "mxfp4" else 64
    if fmt == "mxfp4":  # ue8m0 0xFF scales, e2m1 codes +0 as the reference's
        assert torch.equal(out, want)
        for key, blocks in enumerate(nan_blocks):
            for k in range(2):
                assert (out[key, 32 + k] == 0xFF) == (k in blocks)
            for k in blocks:
                assert (out[key, 16 * k:16 * (k + 1)] == 0).all()
    else:  # e4m3 data 0x7F where the reference's may carry a sign; the fp32 scale is NaN
        assert torch.equal(out[2], want[2]) and torch.equal(out[:2, 64:], want[:2, 64:])
        assert ((out[:2, :64] & 0x7F) == 0x7F).all() and ((want[:2, :64] & 0x7F) == 0x7F).all()
    decoded = layout.decode(out[:, :layout.data_bytes], out[:, layout.data_bytes:])
    for key, blocks in enumerate(nan_blocks):
        for k in range(64 // block):
            values = decoded[key, k * block:(k + 1) * block]
            assert values.isnan().all() if k in blocks else values.isfinite().all()


@triton.jit
def _rotate_keys_kernel(x_ptr, out_ptr, h_scale, D: tl.constexpr, LOG_D: tl.constexpr, BLOCK_R: tl.constexpr):
    offs = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(out_ptr + offs, rotate_keys(tl.load(x_ptr + offs), h_scale, LOG_D))


@pytest.mark.parametrize("d", [64, 128])
def test_rotate_keys_is_the_exact_rotation_rounded(d):
    """The butterfly sums bf16 keys exactly (their values span less than 2^9 here), so the rotated key is the exact
    Hadamard sum (float64), times fl(d^-0.5) once in fp32, rounded to bf16, +0 for -0 (the reference's fp32 GEMM
    rounds each product and partial sum: the schedules above bound that difference)."""
    g = gen(d + 3)
    keys = (torch.randn(8, d, generator=g) * 2).to(torch.bfloat16).float()
    keys[1] = 0.0
    keys[2] = -0.0
    keys[3, ::2] = -keys[3, 1::2]  # sums that cancel exactly
    h = quant.hadamard_matrix(d)
    h_scale = float(h[0, 0])
    out = torch.full((8, d), float("nan"), device=DEVICE)
    _rotate_keys_kernel[(2,)](keys.to(DEVICE), out, h_scale, D=d, LOG_D=d.bit_length() - 1, BLOCK_R=4)
    exact = (keys.double() @ (h.double() / h_scale).round()).float()  # +-1 matrix: the exact sums, fp32-exact here
    want = (exact * h_scale).to(torch.bfloat16).float() + 0.0
    assert same_bits(out.cpu(), want)


# --- bad input ------------------------------------------------------------------------------------------------
def test_compress_insert_rejects_bad_input():
    cache = CacheManager(TINY, max_requests=2, max_tokens=300, page_tokens=128, device=DEVICE, poison=True)
    plan = cache.plan_step([(cache.admit(), 9)])
    layer = cache.pools.layers[1]
    layout, index = cache.spec.layers[1].main, cache.spec.layers[1].index  # fp8 main, mxfp4 indexer keys
    state_kv, state_logits, pool = layer.state_kv, layer.state_score, layer.entries
    kv_rows, logit_rows = torch.randn(9, 256, device=DEVICE), torch.randn(9, 256, device=DEVICE)
    before = [t.clone() for t in (state_kv, state_logits, pool)]

    def call(**changes):
        args = dict(state_kv=state_kv, state_logits=state_logits, plan=plan, kv_rows=kv_rows, logit_rows=logit_rows,
                    ratio=4, overlap=True, norm_weight=torch.ones(128, device=DEVICE), eps=1e-6,
                    rope=TINY.layers[1].rope, out_dtype=torch.bfloat16, layout=layout, pool=pool, page_tokens=128,
                    main=True)
        args.update(changes)
        compress_insert(**args)

    with pytest.raises(ValueError, match=r"kv_rows: expected torch.float32 \[9, 256\], got torch.bfloat16"):
        call(kv_rows=kv_rows.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"kv_rows: expected torch.float32 \[9, 256\], got torch.float32 \[8, 256\]"):
        call(kv_rows=kv_rows[:8])
    with pytest.raises(ValueError, match=r"logit_rows: expected torch.float32 \[9, 256\], got .* \[9, 128\]"):
        call(logit_rows=logit_rows[:, :128].contiguous())
    with pytest.raises(ValueError, match=r"logit_rows: must be contiguous"):
        call(logit_rows=torch.randn(9, 300, device=DEVICE)[:, :256])
    with pytest.raises(ValueError, match=rf"kv_rows: on meta, expected {DEVICE}"):
        call(kv_rows=kv_rows.to("meta"))
    with pytest.raises(ValueError, match=r"state_kv: expected torch.float32 \[\*, \*, 256\]"):
        call(state_kv=state_kv[..., :128].contiguous())
    with pytest.raises(ValueError, match=r"state_kv: must be contiguous"):  # rejected, never copied
        call(state_kv=torch.zeros(2, 8, 300, device=DEVICE)[..., :256])
    with pytest.raises(ValueError, match=r"state_logits: expected torch.float32 \[2, 8, 256\], got .* \[2, 4, 256\]"):
        call(state_logits=state_logits[:, :4].contiguous())
    with pytest.raises(ValueError, match=r"state_logits: on meta"):
        call(state_logits=state_logits.to("meta"))
    with pytest.raises(ValueError, match=r"pool: must be contiguous"):  # rejected, never copied
        call(pool=torch.zeros(pool.shape[0], pool.shape[1] + 8, dtype=torch.uint8, device=DEVICE)[:, :pool.shape[1]])
    with pytest.raises(ValueError, match=rf"pool: expected torch.uint8 \[\*, {layout.page_bytes(64)}\]"):
        call(page_tokens=256)
    with pytest.raises(ValueError, match=r"pool: expected torch.uint8 .* got torch.float32"):
        call(pool=pool.float())
    with pytest.raises(ValueError, match=r"norm_weight: expected torch.float32 \[128\], got torch.bfloat16"):
        call(norm_weight=torch.ones(128, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match=r"norm_weight: expected torch.float32 \[128\], got torch.float32 \[64\]"):
        call(norm_weight=torch.ones(64, device=DEVICE))
    with pytest.raises(ValueError, match=r"layout 'mxfp4' is not a main-entry layout"):  # indexer keys as main
        call(layout=index)
    with pytest.raises(ValueError, match=r"layout 'fp8' is not a indexer-key layout"):  # MODEL1 as indexer keys
        call(main=False)
    with pytest.raises(ValueError, match=r"the plan has no entries of ratio 8"):
        call(ratio=8)
    with pytest.raises(ValueError, match=r"out_dtype bf16 or fp32, got torch.float16"):
        call(out_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"d = 64 \* a power of two"):
        call(layout=main_layout("bf16", 192, 64))
    with pytest.raises(ValueError, match=r"wait_late: expected a bool, got 1"):
        call(wait_late=1)
    with pytest.raises(ValueError, match=r"launch_next: expected a bool, got 1"):
        call(launch_next=1)
    with pytest.raises(ValueError, match=r"wait_late and launch_next are the two ends of a pair"):
        call(wait_late=True, launch_next=True,
             cos_sin=rope_cos_sin(TINY.layers[1].rope, torch.zeros(0, dtype=torch.int32, device=DEVICE)))
    hca = cache.pools.layers[2]
    for end in ("wait_late", "launch_next"):  # HCA's pooling is a launch of its own
        with pytest.raises(ValueError, match=r"wait_late / launch_next need one launch"):
            call(state_kv=hca.state_kv, state_logits=hca.state_score, kv_rows=torch.randn(9, 128, device=DEVICE),
                 logit_rows=torch.randn(9, 128, device=DEVICE), ratio=TINY.layers[2].ratio, overlap=False,
                 layout=cache.spec.layers[2].main, pool=hca.entries, **{end: True},
                 cos_sin=rope_cos_sin(TINY.layers[2].rope, torch.zeros(0, dtype=torch.int32, device=DEVICE)))
    for tensor, old in zip((state_kv, state_logits, pool), before):
        assert same_bits(tensor, old)


def test_append_state_rejects_bad_input():
    cache = CacheManager(TINY, max_requests=2, max_tokens=300, page_tokens=128, device=DEVICE, poison=True)
    plan = cache.plan_step([(cache.admit(), 5)])
    state_kv, state_logits = cache.pools.layers[2].state_kv, cache.pools.layers[2].state_score  # HCA: [2, 16, 128]
    kv_rows, logit_rows = torch.randn(5, 128, device=DEVICE), torch.randn(5, 128, device=DEVICE)
    before = [state_kv.clone(), state_logits.clone()]
    with pytest.raises(ValueError, match=r"state_kv: must be contiguous"):  # rejected, never copied
        append_state(torch.zeros(2, 16, 130, device=DEVICE)[..., :128], state_logits, plan, kv_rows, logit_rows)
    with pytest.raises(ValueError, match=r"state_kv: expected torch.float32 \[\*, \*, \*\], got torch.float64"):
        append_state(state_kv.double(), state_logits, plan, kv_rows, logit_rows)
    with pytest.raises(ValueError, match=r"state_logits: expected torch.float32 \[2, 16, 128\], got .* \[2, 16, 64\]"):
        append_state(state_kv, state_logits[..., :64].contiguous(), plan, kv_rows, logit_rows)
    with pytest.raises(ValueError, match=r"kv_rows: expected torch.float32 \[5, 128\], got torch.float32 \[4, 128\]"):
        append_state(state_kv, state_logits, plan, kv_rows[:4], logit_rows)
    with pytest.raises(ValueError, match=r"logit_rows: expected torch.float32 \[5, 128\], got torch.bfloat16"):
        append_state(state_kv, state_logits, plan, kv_rows, logit_rows.to(torch.bfloat16))
    with pytest.raises(ValueError, match=rf"logit_rows: on meta, expected {DEVICE}"):
        append_state(state_kv, state_logits, plan, kv_rows, logit_rows.to("meta"))
    assert same_bits(state_kv, before[0]) and same_bits(state_logits, before[1])


# --- on a GPU, at V4 shapes -------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("kind", [LayerKind.CSA, LayerKind.HCA], ids=["csa", "hca"])
@pytest.mark.parametrize("preset", ["flash", "pro"])
def test_cuda_compress_and_state_decode_and_prefill(preset, kind):
    """24 live requests on 256-token pages: prefills, decode batches of every request, and 1024-token prefill
    chunks mixed with decode tokens; exact and padded persistent plans, every layout on every step. Same checks
    and tolerance as on the interpreter."""
    g = ModelGeometry.preset(preset)
    layer = next(i for i, spec in enumerate(g.layers) if spec.kind is kind)
    cache = CacheManager(g, max_requests=25, max_tokens=16000, page_tokens=256, device=DEVICE, poison=True)
    rids = admit(cache, 24)
    buffers = cache.step_buffers(max_tokens=1100, max_requests=24)
    decode = [(i, 1) for i in range(24)]
    steps = [([(0, 1024)] + [(i, 3 + 41 * i % 300) for i in range(1, 24)], False), (decode, True), (decode, False)]
    steps += [([(1, 1024)] + decode[2:], True), (decode, True), ([(0, 1024), (2, 1), (3, 60)], False)]
    steps += [(decode[::2], True)] * 3 + [(decode, False)]
    compressors = run_compress_schedule(cache, layer, rids, steps, buffers, seed=51)
    untouched_slot(compressors, 0)


@needs_cuda
@pytest.mark.parametrize("tiles", ["default", "wide", "narrow"])
@pytest.mark.parametrize("kind", [LayerKind.CSA, LayerKind.HCA], ids=["csa", "hca"])
def test_cuda_compress_prefill_tiles(kind, tiles):
    """V4-Flash shapes through tiles one may time (`CompressTuning`): an 8192-token prefill chunk (2048 CSA / 64 HCA
    entries, 4 indexer keys per program by default) beside a request continuing its 3000-token history by 1000 tokens
    (entries straddling the ring and the step rows), then padded decode steps. Same checks and tolerance as on the
    interpreter."""
    variants = {"default": {},
                "wide": dict(csa_main=CompressTile(1, 8, 8), csa_index=CompressTile(8, 8, 8),
                             pool_many=PoolTile(64, 64, 8), pooled_warps=8),
                "narrow": dict(csa_main=CompressTile(2, 4, 4), csa_index=CompressTile(1, 8, 4),
                               pool_many=PoolTile(16, 32, 2), hca_entries=2)}
    tuning = replace(tuning_for(DEVICE), **variants[tiles])
    g = ModelGeometry.preset("flash")
    layer = next(i for i, spec in enumerate(g.layers) if spec.kind is kind)
    cache = CacheManager(g, max_requests=3, max_tokens=16000, page_tokens=256, device=DEVICE, poison=True)
    rids = admit(cache, 2)
    buffers = cache.step_buffers(max_tokens=1100, max_requests=2)
    steps = [([(0, 3000)], False), ([(1, 8192), (0, 1000)], False)] + [([(0, 1), (1, 1)], True)] * 3
    compressors = run_compress_schedule(cache, layer, rids, steps, buffers, seed=71, tuning=tuning)
    untouched_slot(compressors, 0)
