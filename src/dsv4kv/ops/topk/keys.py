"""Top-k's keys, digit counts and picks (Triton device functions): a score's sortable int32 key, counting a tile's
digits by warp (also from the indexer's scores kernel, which counts digit 1 as it writes the scores:
`count_first_digits`), a digit from a histogram, the k-th largest key by bisection and the picks in column order,
shared by the row kernel and the split radix select's phases (`kernel.py`).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["sortable", "row_tile", "candidate_keys", "histogram", "count_digits", "count_first_digits", "pick_digit",
           "load_shared", "kth_key", "running_sum", "write_picks", "fill_tail"]


@triton.jit
def sortable(x):
    """fp32 -> int32 whose signed order is the float order; -0.0 maps onto +0.0 (they tie)."""
    b_bits = x.to(tl.int32, bitcast=True)
    b_bits = tl.where(b_bits == -2147483648, 0, b_bits)
    return b_bits ^ ((b_bits >> 31) & 0x7FFFFFFF)


@triton.jit
def row_tile(p_row, start, end, BLOCK: tl.constexpr):
    """Columns start.. of a row: (columns, keys, candidate mask); columns >= end are not read."""
    o_c = start + tl.arange(0, BLOCK)
    m_c = o_c < end
    b_x = tl.load(p_row + o_c, mask=m_c, other=float("-inf"))
    return o_c, sortable(b_x), m_c & (b_x != float("-inf"))


@triton.jit
def candidate_keys(p_row, o_c, n):
    """Keys of columns o_c (any shape) of a row of n columns: int32 min where there is no candidate (past n, or -inf),
    and candidates above it (NaN's lowest key pattern moves up one)."""
    b_x = tl.load(p_row + o_c, mask=o_c < n, other=float("-inf"))
    return tl.where((o_c < n) & (b_x != float("-inf")), tl.maximum(sortable(b_x), -2147483647), -2147483648)


@triton.jit
def histogram(digits, mask, BLOCK: tl.constexpr):
    """int32 [256] counts of digits[mask] (masked lanes go to bin 0 and are taken back out)."""
    b_h = tl.histogram(tl.where(mask, digits, 0), 256)
    missed = BLOCK - tl.sum(mask.to(tl.int32))
    return b_h - tl.where(tl.arange(0, 256) == 0, missed, 0)


@triton.jit
def count_digits(p_counts, digits, mask, ASM: tl.constexpr):
    """p_counts[d] += #(set lanes of mask with digit d) (digits 0..255). ASM (a GPU): per key, the lanes of its warp
    that hold the same digit (match.any; unset lanes hold -1) elect their lowest lane, which adds their count to
    global memory (red, relaxed: the program reads the counts back after a CTA barrier). Every thread must hold
    distinct keys (a tile of at least 32 x warps lanes), or a replicated key would count twice. Else an atomic add
    per key (the interpreter runs no inline PTX)."""
    if ASM:
        tl.inline_asm_elementwise(
            asm="""{
            .reg .pred p_leader;
            .reg .b32 peers, lower, count;
            match.any.sync.b32 peers, $1, 0xffffffff;
            mov.u32 lower, %lanemask_lt;
            and.b32 lower, lower, peers;
            popc.b32 count, peers;
            setp.ge.s32 p_leader, $1, 0;
            setp.eq.and.u32 p_leader, lower, 0, p_leader;
            @p_leader red.relaxed.gpu.global.add.u32 [$2], count;
            mov.u32 $0, 0;
            }""",
            constraints="=r,r,l", args=[tl.where(mask, digits, -1), p_counts + tl.where(mask, digits, 0)],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.atomic_add(p_counts + digits, tl.full(digits.shape, 1, tl.int32), mask=mask, sem="relaxed")


@triton.jit
def count_first_digits(p_row, lo, hi, p_hist, p_scratch, ASM: tl.constexpr, BLOCK: tl.constexpr,
                       SCRATCH: tl.constexpr, AHEAD: tl.constexpr = False):
    """p_hist[d] += how many candidates among columns lo..hi-1 of a score row have digit 1 (key >> 24, + 128) = d:
    phase A's count (phase A calls it with SCRATCH), and the same made by the kernel that writes the scores
    (`first_digit_counted`; its stores of those scores must precede this, a CTA barrier). Straight into the row's
    histogram, or (SCRATCH) into the program's own 256-count row p_scratch first, then added once per bin: many
    programs of one long row would meet at its few busy bins. AHEAD: the first tile's loads issued first, before
    the scratch row is zeroed, and that tile counted outside the loop (`SplitTiling.first_tile_ahead`). BLOCK >= 32
    x warps (`count_digits`)."""
    first = lo  # where the loop starts: past the first tile when that is loaded ahead
    if AHEAD:
        o_c, b_key, m_c = row_tile(p_row, lo, hi, BLOCK)
        first = lo + BLOCK
    p_counts = p_hist
    if SCRATCH:
        o_b = tl.arange(0, 256)
        tl.store(p_scratch + o_b, tl.zeros([256], dtype=tl.int32))
        tl.debug_barrier()
        p_counts = p_scratch
    if AHEAD:  # outside the loop, which carries no tile (registers; an empty chunk's tile is all masked)
        count_digits(p_counts, (b_key >> 24) + 128, m_c, ASM)
    for start in range(first, hi, BLOCK):
        o_c, b_key, m_c = row_tile(p_row, start, hi, BLOCK)
        count_digits(p_counts, (b_key >> 24) + 128, m_c, ASM)
    if SCRATCH:
        tl.debug_barrier()
        b_h = load_shared(p_scratch + o_b)
        tl.atomic_add(p_hist + o_b, b_h, mask=b_h != 0, sem="relaxed")


@triton.jit
def pick_digit(b_h, need):
    """The digit where the count from the top reaches `need` (0 when it never does) and how many
    keys with that digit are still needed."""
    o_b = tl.arange(0, 256)
    b_suffix = tl.sum(b_h) - tl.cumsum(b_h, 0) + b_h  # keys with digit >= b
    digit = tl.max(tl.where(b_suffix >= need, o_b, 0))
    return digit, need - tl.sum(tl.where(o_b > digit, b_h, 0))


@triton.jit
def load_shared(p):
    """A load of data other programs of this launch wrote: past L1, which is not coherent across SMs."""
    return tl.load(p, cache_modifier=".cg")


@triton.jit
def kth_key(b_key, lo, hi, k):
    """A threshold t with #(b_key > t) <= k <= #(b_key >= t), given #(b_key >= lo) >= k > #(b_key >= hi) (int64
    bounds; with fewer than k keys >= lo, lo itself): bisection, each step a compare and an add per key and one
    block reduction (a 256-bin tl.histogram costs ~73 instructions per key for 8 bits; counting above 2 or 4 bounds a
    step, 3 or 5 parts, was slower: the compares cost more than the steps they save; so was a bound interpolated from
    the counts), stopping early once a count is exactly k."""
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        above = tl.sum((b_key >= mid.to(tl.int32)).to(tl.int32), axis=0)
        hi = tl.where(above >= k, tl.where(above == k, mid + 1, hi), mid)
        lo = tl.where(above >= k, mid, lo)
    return lo.to(tl.int32)


@triton.jit
def running_sum(values, BLOCK: tl.constexpr):
    """int32 [BLOCK]: the sum of values up to and including each lane (tl.cumsum's result). Scanned as rows of 4
    lanes, each within a thread, and a scan of the row totals: a third to a half fewer instructions than a scan of
    the flat vector, which shuffles each lane's value through its warp."""
    b_rows = tl.reshape(values, (BLOCK // 4, 4))
    b_totals = tl.sum(b_rows, 1)
    return tl.reshape(tl.cumsum(b_rows, 1) + (tl.cumsum(b_totals, 0) - b_totals)[:, None], (BLOCK,))


@triton.jit
def write_picks(o_c, b_key, m_c, threshold, k, p_out, BLOCK: tl.constexpr):
    """Store the picks among candidates m_c [BLOCK] held in registers in column order: every key > threshold, then
    the first k - #(key > threshold) keys == threshold. Returns how many were stored.
    Both counts travel in one int32 (keys above in bits 0..15, ties in 16..30: BLOCK < 2^15), so one reduction gives
    the totals and one scan gives each lane's place: the keys above before it, plus the ties before it up to the
    number needed (two scans and three reductions before)."""
    tl.static_assert(BLOCK < 32768)
    m_above = m_c & (b_key > threshold)
    m_tie = m_c & (b_key == threshold)
    b_flags = m_above.to(tl.int32) + (m_tie.to(tl.int32) << 16)
    totals = tl.sum(b_flags, axis=0)
    # >= 0 for a threshold that meets `kth_key`'s contract; clamped, so that a broken one (wrong producer counts,
    # `first_digit_counted`) gives wrong picks, never a store before out
    need = tl.maximum(k - (totals & 0xFFFF), 0)
    b_run = running_sum(b_flags, BLOCK)
    b_ties = b_run >> 16  # ties up to and including this lane
    m_pick = m_above | (m_tie & (b_ties <= need))
    o_out = (b_run & 0xFFFF) + tl.minimum(b_ties, need) - 1
    tl.store(p_out + o_out, o_c, mask=m_pick & (o_out < k))
    return tl.minimum((totals & 0xFFFF) + (totals >> 16), k)


@triton.jit
def fill_tail(p_out, written, k, BLOCK: tl.constexpr):
    """-1 into out[written:k]."""
    for start in range(0, k, BLOCK):
        o_o = start + tl.arange(0, BLOCK)
        tl.store(p_out + o_o, tl.full([BLOCK], -1, tl.int32), mask=(o_o >= written) & (o_o < k))
