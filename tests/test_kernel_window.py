"""Window-path kernels (dsv4kv.ops.window.kernel) against the reference, bit for bit, on 0xFF-poisoned pools:

- kv_insert == layout.write(pool, entries, slots, apply_rope(kv, positions, rope)), FP8 MODEL1 and bf16, on
  rows built to hit the encoders' corners (zero blocks, 1e-9, e4m3 subnormals, e4m3 and bf16 rounding ties,
  largest magnitudes, -0, NaN / inf blocks), with programs of 1, 4, 8 and 16 rows over row counts that are
  not multiples of them;
- append_window (a byte copy of the step page into the ring) == ops.window.reference.append_window, over random
  multi-request chunked schedules (chunks longer than the window too), exact and padded persistent plans.

On the CPU the kernels run under Triton's interpreter; the GPU tests use V4-Flash / V4-Pro shapes.
"""


import dataclasses

import pytest
import torch
from schedules import admit, random_steps, written_bytes

from dsv4kv import CacheManager, ModelGeometry
from dsv4kv.backend import interpreted
from dsv4kv.geometry import RopeSpec
from dsv4kv.ops.window import kernel as window
from dsv4kv.ops.shared.encode import program_rows
from dsv4kv.ops.window.kernel import append_window, kv_insert
from dsv4kv.ops.window.tuning import tuning_for
from dsv4kv.cache.layout import indexer_layout, main_layout
from dsv4kv.ops.window import reference as reference
from dsv4kv.ops.rope.reference import apply_rope, rope_cos_sin

TINY = ModelGeometry.preset("tiny")  # head_dim 128, window 16
FLASH = ModelGeometry.preset("flash")  # head_dim 512, window 128
ROPES = {128: TINY.layers[1].rope, 512: FLASH.layers[0].rope}  # YaRN (compressed layer) and plain theta 10000
DEVICE = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
POISON = 0xFF
BF16_MAX = 3.3895313892515355e38
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# The kernels rotate every row of a [D // 64, 64] tile and keep only the rope row: huge or non-finite nope
# values overflow or make NaNs there (to no effect), which the interpreter's numpy reports.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


# --- helpers ----------------------------------------------------------------------------------------
def gen(seed):
    return torch.Generator().manual_seed(seed)





def e4m3_ties():
    """Scaled values (block scale 1: the block's amax is 448) halfway between two e4m3 neighbours, both signs:
    normal binades 2^-6 .. 2^8 and the subnormal range (multiples of 2^-9), including 7.5 * 2^-9 (rounds up to
    the smallest normal) and 2^-10 (rounds to 0)."""
    normal = [(17 + 2 * m) / 16 * 2.0**e for e in range(-6, 9) for m in range(8) if (17 + 2 * m) / 16 * 2.0**e < 448]
    subnormal = [(k + 0.5) * 2.0**-9 for k in range(8)]
    ties = torch.tensor(normal + subnormal)
    assert torch.equal(ties.to(torch.bfloat16).float(), ties), "the ties must be bf16 values"
    return ties


def nope_blocks(g):
    """64-value nope blocks (fp32, bf16-representable) that each hit a corner of the FP8 encoding."""
    ties = e4m3_ties()
    signs = torch.where(torch.rand(ties.shape[0], generator=g) < 0.5, -1.0, 1.0)

    def tie_block(scale):  # the amax 448 fixes the block scale at `scale`; the other values are exact ties
        values = torch.cat((torch.tensor([448.0]), (ties * signs)[torch.randperm(ties.shape[0], generator=g)[:63]]))
        return values[torch.randperm(64, generator=g)] * scale

    above = tie_block(1.0)
    above[above.abs().argmax()] = 456.0  # amax just past 448: the scale doubles
    subnormal = torch.randn(64, generator=g) * 3e-5  # e4m3 subnormals next to an amax of 1
    subnormal[7] = 1.0
    mixed_zero = torch.randn(64, generator=g)
    mixed_zero[::3] = 0.0
    mixed_zero[1::3] = -0.0
    largest = torch.randn(64, generator=g) * 1e37
    largest[:2] = torch.tensor([BF16_MAX, -BF16_MAX])
    return [
        torch.zeros(64), -torch.zeros(64), torch.full((64,), 1e-9), torch.randn(64, generator=g) * 1e-9,
        subnormal, tie_block(1.0), tie_block(2.0**-12), tie_block(2.0**-21), tie_block(2.0**20), above,
        mixed_zero, largest, torch.randn(64, generator=g) * 1e4, torch.randn(64, generator=g),
    ]


def rope_ties(rope, device, g, count=12):
    """(positions [count], rope dims fp32 [count, 64]) where one rotated value of each row lies exactly halfway
    between two bf16 neighbours (fp32 low half 0x8000). Found by search with the op's own fp32 arithmetic
    (`even * cos - odd * sin`, separate multiplies, as the kernel compiles it without fusion) on `device`."""
    positions = torch.randint(1, 1 << 20, (2048,), generator=g).to(device)
    cos, sin = rope_cos_sin(rope, positions)  # [P, 32]
    found, rows = set(), []
    for _ in range(16):
        even = (torch.randn(2048, 32, generator=g) * 4).to(torch.bfloat16).float().to(device)
        odd = (torch.randn(2048, 32, generator=g) * 4).to(torch.bfloat16).float().to(device)
        for rotated in (even * cos - odd * sin, odd * cos + even * sin):
            hits = ((rotated.view(torch.int32) & 0xFFFF) == 0x8000).nonzero().tolist()
            for p, i in hits:
                if p not in found and len(rows) < count:
                    found.add(p)
                    pairs = torch.stack((even[p], odd[p]), dim=-1).flatten()  # [64] interleaved
                    rows.append((int(positions[p]), pairs.cpu(), int(rotated[p, i].view(torch.int32)) >> 16 & 1))
        if len(rows) == count:
            break
    assert len(rows) == count, "the tie search came up short"
    assert {odd for _, _, odd in rows} == {0, 1}, "ties that round down and up to the even neighbour"
    return torch.tensor([p for p, _, _ in rows]), torch.stack([r for _, r, _ in rows])


def corner_rows(dim, rope, device, seed):
    """kv bf16 [N, dim] and positions int32 [N]: every nope block pattern of `nope_blocks`, rope dims with bf16
    rounding ties, zeros / -0 / 1e-9 / large values at position 0 and random positions, and plain random rows."""
    g = gen(seed)
    blocks = nope_blocks(g)
    nb = dim // 64 - 1
    tie_positions, tie_rope = rope_ties(rope, device, g)
    large = (torch.rand(64, generator=g) * 2 - 1) * 1.7e38  # |rotated| <= 2.4e38: no overflow, no inf - inf
    rope_rows = [torch.zeros(64), -torch.zeros(64), torch.full((64,), 1e-9), large,
                 torch.tensor([BF16_MAX, 0.0] * 32), torch.randn(64, generator=g)] + list(tie_rope)
    n = max(len(blocks) * 2 // nb + 1, len(rope_rows)) + 5
    kv = torch.randn(n, dim, generator=g) * 2
    for i in range(n * nb):  # cycle the block patterns over the rows' nope blocks
        kv[i // nb, (i % nb) * 64:(i % nb + 1) * 64] = blocks[i % len(blocks)]
    positions = torch.randint(0, 1 << 20, (n,), generator=g)
    for i, values in enumerate(rope_rows):
        kv[i, -64:] = values
    positions[:5] = 0  # cos 1, sin 0: the values pass through (-0, bf16 max)
    positions[6:6 + len(tie_positions)] = tie_positions
    return kv.to(torch.bfloat16).to(device), positions.to(torch.int32).to(device)


def insert_both(kv, positions, rope, layout, entries, slots, pages, tuning=None):
    """(kernel pool, reference pool), both 0xFF-poisoned before the write."""
    pool = torch.full((pages, layout.page_bytes(entries)), POISON, dtype=torch.uint8, device=kv.device)
    want = pool.clone()
    kv_insert(kv, positions, rope, layout, pool, entries, slots, tuning=tuning)
    layout.write(want, entries, slots, apply_rope(kv, positions.long(), rope))
    return pool, want


def random_slots(n, capacity, g, device, skipped=(2, 9)):
    slots = torch.randperm(capacity, generator=g)[:n].to(torch.int32)
    for i in skipped:
        slots[i % n] = -1
    return slots.to(device)


def check_insert(dim, fmt, device, seed, position_dtype=torch.int32, rope=None, tuning=None):
    """kv_insert of `corner_rows` on random slots of a poisoned pool == the reference's bytes; returns the pool."""
    rope, layout = rope or ROPES[dim], main_layout(fmt, dim, 64)
    kv, positions = corner_rows(dim, rope, device, seed)
    entries, pages = 13, 5  # odd page size; the rows land on random slots of all pages
    slots = random_slots(kv.shape[0], entries * pages, gen(seed + 1), device)
    pool, want = insert_both(kv, positions.to(position_dtype), rope, layout, entries, slots, pages, tuning)
    assert torch.equal(pool, want)
    untouched = ~written_bytes(layout, entries, pages, slots[slots >= 0].cpu()).to(device)
    assert (pool[untouched] == POISON).all(), "bytes of unwritten slots (and page padding) must keep the poison"
    return pool


@pytest.fixture
def tile_rows():
    """A config whose launches keep their tile's rows per program: with the default, `program_rows` gives the small
    launches of these tests one row per program (it spreads launches of fewer than 264 programs over the SMs)."""
    return dataclasses.replace(tuning_for(DEVICE), spread_programs=1)


# --- kv_insert ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
@pytest.mark.parametrize("dim", [128, 512], ids=["D128", "D512"])
def test_kv_insert_matches_reference_bit_for_bit(dim, fmt, tile_rows):
    """D512 is V4's head_dim (7 nope blocks); the default tile (16 rows per program, 34 and 23 rows here); on a GPU
    these run there too."""
    pool = check_insert(dim, fmt, DEVICE, seed=dim, tuning=tile_rows)
    if fmt == "fp8":  # the corner blocks really hit the corners: e4m3 subnormal codes and -0 were written
        codes = pool[:, :13 * (dim + 64)].reshape(-1, dim + 64)[:, :dim - 64]
        assert ((codes & 0x7F) < 8).sum() > 100 and (codes == 0x80).any()


def test_kv_insert_int64_positions():
    check_insert(128, "fp8", DEVICE, seed=7, position_dtype=torch.int64)


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_kv_insert_wait_late_changes_no_byte(fmt, tile_rows):
    """`wait_late` (the wait for the grid before it moved to the kernel's end: the window layer's kv insert beside its
    q RoPE) writes the bytes the plain launch writes."""
    rope, layout = ROPES[512], main_layout(fmt, 512, 64)
    kv, positions = corner_rows(512, rope, DEVICE, 3)
    slots = random_slots(kv.shape[0], 13 * 5, gen(4), DEVICE)
    plain = torch.full((5, layout.page_bytes(13)), POISON, dtype=torch.uint8, device=DEVICE)
    late = plain.clone()
    kv_insert(kv, positions, rope, layout, plain, 13, slots, tuning=tile_rows)
    kv_insert(kv, positions, rope, layout, late, 13, slots, cos_sin=rope_cos_sin(rope, positions), wait_late=True,
              tuning=tile_rows)
    assert torch.equal(late, plain) and not torch.equal(plain, torch.full_like(plain, POISON))


@pytest.mark.skipif(not interpreted(), reason="counts calls of the PDL wait, a plain Python function only under "
                    "Triton's interpreter (the CPU run)")
def test_kv_insert_wait_late_waits_once_per_program(monkeypatch):
    """Every program of a `wait_late` launch still waits (counted under the interpreter, where the wait is a plain
    function), as every program of a plain launch does; the caller's cos_sin is required."""
    waits = []
    monkeypatch.setattr(window, "wait_for_prior_grids", lambda: waits.append(1))
    rope, layout = ROPES[128], main_layout("fp8", 128, 64)
    kv, positions = corner_rows(128, rope, DEVICE, 5)
    slots = random_slots(kv.shape[0], 13 * 5, gen(6), DEVICE)
    pool = torch.full((5, layout.page_bytes(13)), POISON, dtype=torch.uint8, device=DEVICE)
    counts = {}
    for late in (False, True):
        waits.clear()
        kv_insert(kv, positions, rope, layout, pool, 13, slots, cos_sin=rope_cos_sin(rope, positions), wait_late=late)
        counts[late] = len(waits)
    assert counts[True] == counts[False] > 1, counts
    with pytest.raises(ValueError, match="wait_late needs the caller's cos_sin"):
        kv_insert(kv, positions, rope, layout, pool, 13, slots, wait_late=True)


@pytest.mark.parametrize("tile", [(1, 1), (4, 2), (8, 4)], ids=lambda t: f"R{t[0]}-W{t[1]}")
@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_kv_insert_rows_per_program(fmt, tile, tile_rows):
    """Other tiles (`WindowTuning`: rows per program, warps): 23 rows of D512, not a multiple of 4 or 8, two of
    them skipped (slot -1), on a poisoned pool: the same bytes."""
    tuning = dataclasses.replace(tile_rows, kv_insert_rows=tile[0], kv_insert_warps=tile[1])
    check_insert(512, fmt, DEVICE, seed=13, tuning=tuning)


def test_program_rows_spreads_small_launches():
    assert [program_rows(n, 16, 264) for n in (65536, 8192, 4096, 2000, 264, 64, 1)] == [16, 16, 8, 4, 1, 1, 1]
    assert program_rows(5000, 4, 264) == 4 and program_rows(0, 4, 264) == 1


@pytest.mark.parametrize("dim", [128, 512], ids=["D128", "D512"])
def test_kv_insert_nonfinite_block_fp8(dim, tile_rows):
    """A NaN or inf in a nope block: that block's scale byte is 0xFF (E8M0 NaN) and it decodes to NaN; the other
    blocks, the rope dims and the other entries are the reference's bytes. Data bytes of the NaN block may differ
    from the reference's in the sign bit only (see ops/shared/encode.py)."""
    rope, layout, entries = ROPES[dim], main_layout("fp8", dim, 64), 5
    g = gen(11)
    kv = torch.randn(4, dim, generator=g)
    kv[0, 5] = float("nan")
    kv[1, dim - 70] = float("-inf")  # the last nope block
    kv[2, 64 * ((dim // 64 - 2) // 2) + 10] = float("inf")
    kv = kv.to(torch.bfloat16).to(DEVICE)
    positions = torch.tensor([3, 90, 1000, 7], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([4, 0, 7, 2], dtype=torch.int32, device=DEVICE)
    pool, want = insert_both(kv, positions, rope, layout, entries, slots, 2, tile_rows)
    bad = [(0, 0), (1, dim // 64 - 2), (2, (dim // 64 - 2) // 2)]  # (row, nope block)
    data, scales = layout.page_views(pool, entries)
    want_data, _ = layout.page_views(want, entries)
    sloppy = torch.zeros_like(pool, dtype=torch.bool)
    for row, block in bad:
        page, off = divmod(int(slots[row]), entries)
        assert scales[page, off, block] == 0xFF
        assert ((data[page, off, block * 64:(block + 1) * 64] & 0x7F) == 0x7F).all()
        assert ((want_data[page, off, block * 64:(block + 1) * 64] & 0x7F) == 0x7F).all()
        sloppy[page, off * layout.data_bytes + block * 64:off * layout.data_bytes + (block + 1) * 64] = True
    assert torch.equal(pool[~sloppy], want[~sloppy])
    decoded = layout.read(pool, entries, slots)
    for row in range(4):
        nan_blocks = {block for r, block in bad if r == row}
        for block in range(dim // 64):
            values = decoded[row, block * 64:(block + 1) * 64]
            assert values.isnan().all() if block in nan_blocks else values.isfinite().all()


def test_kv_insert_nan_bf16_passes_through(tile_rows):
    rope, layout = ROPES[128], main_layout("bf16", 128, 64)
    kv = torch.randn(3, 128, generator=gen(12))
    kv[0, 3] = float("nan")
    kv[1, :64] = float("inf")
    kv = kv.to(torch.bfloat16).to(DEVICE)
    pool, want = insert_both(kv, torch.tensor([1, 2, 3], dtype=torch.int32, device=DEVICE), rope, layout, 4,
                             torch.tensor([3, -1, 0], dtype=torch.int32, device=DEVICE), 1, tile_rows)
    assert torch.equal(pool, want)


def test_kv_insert_nothing_to_write():
    layout = main_layout("fp8", 128, 64)
    pool = torch.full((2, layout.page_bytes(4)), POISON, dtype=torch.uint8, device=DEVICE)
    none = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    kv_insert(torch.zeros(0, 128, dtype=torch.bfloat16, device=DEVICE), none, ROPES[128], layout, pool, 4, none)
    skipped = torch.full((3,), -1, dtype=torch.int32, device=DEVICE)
    kv_insert(torch.ones(3, 128, dtype=torch.bfloat16, device=DEVICE), skipped, ROPES[128], layout, pool, 4, skipped)
    assert (pool == POISON).all()


def test_kv_insert_rejects_bad_input():
    layout, rope, entries = main_layout("fp8", 128, 64), ROPES[128], 4
    kv = torch.randn(3, 128, device=DEVICE).to(torch.bfloat16)
    positions = torch.arange(3, dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([0, 5, -1], dtype=torch.int32, device=DEVICE)
    pool = torch.full((2, layout.page_bytes(entries)), POISON, dtype=torch.uint8, device=DEVICE)
    before = pool.clone()

    def call(**changes):
        args = dict(kv=kv, positions=positions, rope=rope, layout=layout, pool=pool, entries=entries, slots=slots)
        args.update(changes)
        kv_insert(**args)

    with pytest.raises(ValueError, match=r"kv: expected torch.bfloat16 \[\*, 128\], got torch.float32"):
        call(kv=kv.float())
    with pytest.raises(ValueError, match=r"wait_late: expected a bool, got 'yes'"):
        call(wait_late="yes")
    with pytest.raises(ValueError, match=r"kv: expected torch.bfloat16 \[\*, 128\], got torch.bfloat16 \[3, 192\]"):
        call(kv=torch.zeros(3, 192, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match=r"kv: must be contiguous"):
        call(kv=torch.zeros(3, 130, dtype=torch.bfloat16, device=DEVICE)[:, :128])
    with pytest.raises(ValueError, match=rf"kv: on meta, expected {DEVICE}"):
        call(kv=kv.to("meta"))
    with pytest.raises(ValueError, match=r"positions: expected torch.int32/torch.int64 \[3\]"):
        call(positions=positions.float())
    with pytest.raises(ValueError, match=r"positions: expected .* \[3\], got torch.int32 \[2\]"):
        call(positions=positions[:2])
    with pytest.raises(ValueError, match=r"slots: expected torch.int32 \[3\], got torch.int64"):
        call(slots=slots.long())
    with pytest.raises(ValueError, match=r"slots: on meta"):
        call(slots=slots.to("meta"))
    with pytest.raises(ValueError, match=rf"pool: expected torch.uint8 \[\*, {layout.page_bytes(entries + 1)}\], "
                                         rf"got torch.uint8 \[2, {layout.page_bytes(entries)}\]"):
        call(entries=entries + 1)  # pages sized for another entry count
    with pytest.raises(ValueError, match=r"pool: expected torch.uint8"):
        call(pool=pool.to(torch.int8))
    with pytest.raises(ValueError, match=r"pool: must be contiguous"):  # rejected, never copied
        wide = torch.full((2, layout.page_bytes(entries) + 8), POISON, dtype=torch.uint8, device=DEVICE)
        call(pool=wide[:, :layout.page_bytes(entries)])
    with pytest.raises(ValueError, match=r"expected a main-entry layout, got 'mxfp4'"):
        call(layout=indexer_layout("mxfp4", 128))
    with pytest.raises(ValueError, match=r"expected a main-entry layout, got 'fp8'"):  # the rotated indexer FP8
        call(layout=indexer_layout("fp8", 128))
    with pytest.raises(ValueError, match=r"64 rope dims"):
        call(rope=RopeSpec(theta=10000.0, dim=32))
    with pytest.raises(ValueError, match=r"head_dim = 64 \* a power of two"):
        call(layout=main_layout("bf16", 192, 64), kv=torch.zeros(3, 192, dtype=torch.bfloat16, device=DEVICE))
    assert torch.equal(pool, before)


# --- append_window --------------------------------------------------------------------------------------
def run_window_schedule(cache, layer, rids, steps, buffers, seed):
    """Each step: kv_insert into a poisoned step page, then append_window into the ring; the reference writes
    the roped kv into its own ring. Steps alternate between exact plans and padded plans in `buffers` (when
    given). Returns the ring (kernel side)."""
    g, device = gen(seed), cache.device
    layout, window, rope = cache.spec.layers[layer].main, cache.geometry.window, cache.geometry.layers[layer].rope
    ring = cache.pools.layers[layer].window  # 0xFF since admit
    want = ring.clone()
    for i, step in enumerate(steps):
        plan = cache.plan_step([(rids[r], n) for r, n in step], buffers=buffers if i % 2 else None)
        rows, n = plan.positions.shape[0], plan.num_tokens
        kv = (torch.randn(rows, layout.dim, generator=g) * 3).to(torch.bfloat16).to(device)  # padding rows too
        page = torch.full((1, layout.page_bytes(rows)), POISON, dtype=torch.uint8, device=device)
        kv_insert(kv, plan.positions, rope, layout, page, rows, torch.arange(rows, dtype=torch.int32, device=device))
        page_want = torch.full_like(page, POISON)
        layout.write(page_want, rows, torch.arange(rows, device=device), apply_rope(kv, plan.positions.long(), rope))
        assert torch.equal(page, page_want), "the step page holds every row, padding included"
        append_window(ring, layout, window, plan, page)
        reference.append_window(want, layout, window, plan, apply_rope(kv[:n], plan.positions[:n].long(), rope))
        assert torch.equal(ring, want), f"ring differs after {plan}"
    return ring


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_append_window_matches_reference(fmt):
    """Three requests on slots 1..3, chunks up to 40 tokens (window 16); exact and padded plans alternate."""
    cache = CacheManager(TINY, max_requests=4, max_tokens=700, kv_format=fmt, page_tokens=128, device=DEVICE,
                         poison=True)
    rids = admit(cache, 3)
    buffers = cache.step_buffers(max_tokens=41, max_requests=4)  # odd row count; 3 requests at most: one padding
    steps = random_steps(7, [50, 33, 20], chunks=(1, 1, 3, 17, 40), cap=41)
    for plans in (steps[0::2], steps[1::2]):  # exact, padded
        assert any(n > TINY.window for step in plans for _, n in step), "chunks longer than the window"
    ring = run_window_schedule(cache, 0, rids, steps, buffers, seed=21)
    assert (ring[0] == POISON).all(), "the unused slot's ring"


# --- bad input ------------------------------------------------------------------------------------------
def test_append_window_rejects_bad_input():
    cache = CacheManager(TINY, max_requests=2, max_tokens=300, kv_format="fp8", page_tokens=128, device=DEVICE,
                         poison=True)
    plan = cache.plan_step([(cache.admit(), 5)])
    layout, window = cache.spec.layers[0].main, TINY.window
    ring = cache.pools.layers[0].window
    page = torch.zeros(1, layout.page_bytes(5), dtype=torch.uint8, device=DEVICE)
    page6, pages2 = torch.zeros(1, layout.page_bytes(6), dtype=torch.uint8, device=DEVICE), page.expand(2, -1).clone()
    ring_bytes, before = layout.page_bytes(window), ring.clone()
    with pytest.raises(ValueError, match=rf"step_kv: expected torch.uint8 \[\*, {layout.page_bytes(5)}\], "
                                         rf"got torch.uint8 \[1, {layout.page_bytes(6)}\]"):
        append_window(ring, layout, window, plan, page6)
    with pytest.raises(ValueError, match=r"step_kv: expected one page of 5 entries, got 2 pages"):
        append_window(ring, layout, window, plan, pages2)
    with pytest.raises(ValueError, match=r"step_kv: expected torch.uint8 .* got torch.int8"):
        append_window(ring, layout, window, plan, page.to(torch.int8))
    with pytest.raises(ValueError, match=rf"step_kv: on meta, expected {DEVICE}"):
        append_window(ring, layout, window, plan, page.to("meta"))
    with pytest.raises(ValueError, match=r"window_pool: must be contiguous"):  # rejected, never copied
        wide = torch.zeros(2, ring_bytes + 4, dtype=torch.uint8, device=DEVICE)
        append_window(wide[:, :ring_bytes], layout, window, plan, page)
    with pytest.raises(ValueError, match=rf"window_pool: expected torch.uint8 \[\*, {layout.page_bytes(window + 1)}\]"):
        append_window(ring, layout, window + 1, plan, page)
    with pytest.raises(ValueError, match=rf"window_pool: expected torch.uint8 \[\*, {ring_bytes}\], got torch.float32"):
        append_window(ring.float(), layout, window, plan, page)
    with pytest.raises(ValueError, match=rf"window_pool: expected torch.uint8 \[\*, {2 * 128 * window}\], "
                                         rf"got torch.uint8 \[2, {ring_bytes}\]"):
        append_window(ring, main_layout("bf16", 128, 64), window, plan, page)  # a ring of another format
    assert torch.equal(ring, before)


# --- on a GPU, at V4 shapes -------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
@pytest.mark.parametrize("preset", ["flash", "pro"])
def test_cuda_kv_insert_corners(preset, fmt):
    """The corner rows with each layer's RoPE of the preset (window theta 10000; compressed layers YaRN)."""
    g = ModelGeometry.preset(preset)
    for rope in sorted({spec.rope for spec in g.layers}, key=repr):
        check_insert(g.head_dim, fmt, DEVICE, seed=31, rope=rope)


@needs_cuda
@pytest.mark.parametrize("tile", [(1, 1), (4, 2), (8, 4), (16, 4), (16, 8), (32, 8)], ids=lambda t: f"R{t[0]}-W{t[1]}")
@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_cuda_kv_insert_prefill_tiles(fmt, tile):
    """A prefill-sized launch (20001 rows of V4's 512 dims, YaRN rope) for every tile the lead may time: random
    positions, slots scattered over pages of 256 entries with every 7th row skipped, on a poisoned pool; bit for bit."""
    tuning = dataclasses.replace(tuning_for(DEVICE), kv_insert_rows=tile[0], kv_insert_warps=tile[1])
    rope, layout, entries, n = FLASH.layers[2].rope, main_layout(fmt, 512, 64), 256, 20001
    g = gen(61)
    kv = (torch.randn(n, 512, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    positions = torch.randint(0, FLASH.max_position, (n,), generator=g, dtype=torch.int32).to(DEVICE)
    pages = -(-n // entries) + 3
    slots = torch.randperm(pages * entries, generator=g)[:n].to(torch.int32)
    slots[::7] = -1
    pool, want = insert_both(kv, positions, rope, layout, entries, slots.to(DEVICE), pages, tuning)
    assert torch.equal(pool, want)


@needs_cuda
@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
@pytest.mark.parametrize("preset", ["flash", "pro"])
def test_cuda_append_window_decode_and_prefill(preset, fmt):
    """48 live requests: short prefills, decode batches of every request, and 1024-token prefill chunks mixed
    with decode tokens, on persistent padded plans (the buffers of a captured graph)."""
    g = ModelGeometry.preset(preset)
    cache = CacheManager(g, max_requests=49, max_tokens=12000, kv_format=fmt, page_tokens=256, device=DEVICE,
                         poison=True)
    rids = admit(cache, 48)
    buffers = cache.step_buffers(max_tokens=1100, max_requests=49)
    steps = [[(i, 1 + 7 * i % 37) for i in range(48)], [(0, 1024)] + [(i, 1) for i in range(1, 48)]]
    steps += [[(i, 1) for i in range(48)]] * 3 + [[(i, 1) for i in range(0, 48, 3)]]
    steps += [[(5, 1024), (0, 1)] + [(i, 1) for i in range(6, 40)], [(i, 1) for i in range(48)]]
    ring = run_window_schedule(cache, 0, rids, steps, buffers, seed=41)
    assert (ring[0] == POISON).all()
