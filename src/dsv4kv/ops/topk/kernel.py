"""Exact top-k column indices of every score row, without sorting the row: one program per row (short rows, or
many rows of moderate length) or a radix select split over programs (long rows).

    out[r] = the columns of the min(k, n_r) highest candidate scores of row r, in ascending column order,
             then -1                                                      (int32 [R, k])

Row r's candidates are columns 0..lengths[r]-1 (lengths clamped to [0, J]) whose score is not -inf;
columns past the length are never read. Among equal scores the lower column wins, so the set is the one
`ops.topk.reference.topk_picks` gives (a stable descending sort); -0.0 and +0.0 count as equal. NaN
scores inside the length are unspecified (they get some rank; nothing is written out of bounds). The keys, digit
counts and picks both kernels share are `keys.py`'s.

Row kernel (`_topk_row_kernel`; rows of up to `TopkTuning.row_max_cols` columns, or `row_max_cols_many` when there
are `row_many` rows or more). One program holds its row's keys (below) in registers and finds the k-th largest key T
by bisection on the int32 key space (`kth_key`). The picks are every key > T and the first k - #(key > T) keys == T
in column order, stored in column order by a running count. No workspace is used. One SM per row makes a long lone
row slow, hence the split kernel past those sizes.

Split kernel. A score becomes an int32 key whose signed order is the float order (sign-magnitude flipped,
-0.0 folded onto +0.0); the top 16 bits of the k-th largest key T are found one 8-bit digit at a time (a radix
select: histogram the digit among the keys that share the digits found so far, take the digit where the count
from the top reaches the number still needed), the low 16 bits by bisection among the candidates that share them
(or by two more digits where those candidates are too many for registers). Then the selection is: every key > T,
plus the first `need` keys == T in column order, where `need` = k - #(key > T). With fewer than k candidates the
descent bottoms out at T = int32 min and everything is taken. Each row is split into S chunks (S grows
as R shrinks, so one long decode row still fills the GPU). Four phases, one launch each:

A  [S per row]  histogram of digit 1 (bits 31..24) of a chunk                     -> atomics into hist1[r]
B  [S per row]  digit 1 from hist1; histogram of digit 2 among keys of that top digit -> atomics into
                hist2[r]; the chunk's count of keys >= each 16-bit prefix that could be chosen, suffix[r, s, :]
                A and B zero a chunk's row suffix[r, s, :], count the chunk's digits into it (on a GPU by warp:
                the lanes that share a digit add their count in one reduction to global memory) and read that
                back as the chunk's histogram; B then overwrites it with the suffix.
                A does not run where the scores' producer counted digit 1 into hist1 (`first_digit_counted`: the
                indexer of a decode step, `indexer_scores_paged(digit_counts=)`).
C  [S per row]  digit 2 from hist2, i.e. the 16-bit prefix P of T; the chunk's candidates with key >> 16 >= P
                (M in the row, ~k plus one fine bin) go to a per-row buffer (key, column) in column order,
                offsets from suffix[r, :, d2]
D  [1 per row]  the low 16 bits of T, then the picks (running counts, ties counted in column order) and the -1
                tail. With M <= SELECT the buffer is read once into registers and T found there by bisection
                (`kth_key`, at most 16 steps of one compare per key); else three passes over the buffer, digits 3
                and 4 from two histograms. It zeroes the row's histograms and counters for the next call.

Passes over the scores: three (phases A-C, chunks in parallel; after the first, from L2; two where the producer
counted digit 1), then the M buffered candidates. If M exceeds the buffer's capacity (e.g. tens of thousands of equal
scores), phase D makes its three passes over the whole row instead: exact, only slower.

Workspace (int32 [R, 512 + 256 * S + 2 * capacity], see `topk_workspace`): hist1 [256], hist2 [256], suffix [S, 256],
buffer keys [capacity], buffer columns [capacity]. The histograms must be zero on entry (hist1 may instead hold the
producer's digit-1 counts, `first_digit_counted`) and every call leaves them zero, so a workspace from
`topk_workspace` can be reused call after call (suffix needs no zeros: phases A and B zero a chunk's row before they
count into it). For a CUDA graph, allocate
`out` and the workspace before capture and pass both: the op then allocates nothing, reads nothing back to the host,
and launches the same kernel for fixed (R, J, k).
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from ...backend import interpreted
from ...checks import require
from ...checks import check_tensor
from ..shared.common import sm_count
from ..shared.launch import launch_options, wait_for_prior_grids
from .keys import (candidate_keys, count_digits, count_first_digits, fill_tail, histogram, kth_key,
                   load_shared, pick_digit, row_tile, sortable, write_picks)
from .tuning import SplitTiling, TopkTuning, default, tuning_for

__all__ = ["topk_indices", "topk_workspace", "first_digit_counts", "takes_first_digit_counts", "MAX_K"]

MAX_K = 2048
_BINS = 256  # 8-bit digits: four levels cover the 32-bit key
_HIST1 = 0
_HIST2 = _HIST1 + _BINS
_HEADER = _HIST2 + _BINS  # hist1, hist2; then suffix [S, 256] and the buffer


def _split_tiling(rows: int, cols: int, tuning: TopkTuning) -> SplitTiling:
    """The split kernel's tiling for scores [rows, cols]: `tuning.big` from `tuning.big_from` scores."""
    return tuning.big if rows * cols >= tuning.big_from else tuning.small


def _tiling(rows: int, cols: int, device: torch.device, tuning: TopkTuning) -> tuple[int, int]:
    """(programs per phase the split aims for, columns per tile) for a [rows, cols] problem."""
    tiling = _split_tiling(rows, cols, tuning)
    return tiling.programs_per_sm * (sm_count(device) if device.type == "cuda" else 1), tiling.block


def _split(rows: int, cols: int, device: torch.device, tuning: TopkTuning) -> tuple[int, int, int, int]:
    """(splits S, chunk columns, tile columns, programs per phase the tiling aims for) for a [rows, cols] problem
    (`_tiling`)."""
    programs, block = _tiling(rows, cols, device, tuning)
    splits = max(1, min(-(-programs // max(rows, 1)), -(-cols // block)))
    chunk = max(1, -(-(-(-cols // splits)) // block)) * block
    return max(1, -(-cols // chunk)), chunk, block, programs


def _select_block(k: int, tuning: TopkTuning) -> int:
    """Buffered candidates phase D holds in registers (a power of two): ~k plus one fine bin must fit."""
    return min(tuning.select_max, max(tuning.select_min, triton.next_power_of_2(k + k // 2)))


def _by_row(rows: int, cols: int, tuning: TopkTuning) -> bool:
    """Whether scores [rows, cols] go to the one-program-per-row kernel (a host decision on the shape alone)."""
    return cols <= (tuning.row_max_cols_many if rows >= tuning.row_many else tuning.row_max_cols)


def takes_first_digit_counts(rows: int, cols: int, tuning: TopkTuning | None = None) -> bool:
    """Whether `topk_indices` over scores [rows, cols] can use a producer's digit-1 counts (`first_digit_counted`):
    the split kernel. A host fact of the shape, as `first_digit_counts` finds it in a workspace. tuning: the config
    `topk_indices` runs with (default: `tuning.default()`, whose row kernel thresholds every device shares)."""
    return not _by_row(rows, cols, tuning if tuning is not None else default())


def topk_workspace(rows: int, cols: int, k: int, device: torch.device | str, *, capacity: int | None = None,
                   tuning: TopkTuning | None = None) -> torch.Tensor:
    """A zeroed workspace int32 [rows, 512 + 256 * S + 2 * capacity] for `topk_indices` on scores [rows, cols] of
    `device` (S depends on rows, cols, the device and `tuning`, default the device's); int32 [rows, 0] where those
    scores go to the row kernel, which needs none. `capacity` (default 3k) candidates per row fit the buffer; any
    capacity >= 0 is exact, rows that overflow it take the slower path."""
    device = torch.device(device)
    tuning = tuning if tuning is not None else tuning_for(device)
    capacity = 3 * k if capacity is None else capacity
    require(capacity >= 0, f"topk_workspace: capacity must be >= 0, got {capacity}")
    if _by_row(rows, cols, tuning):
        return torch.zeros(rows, 0, dtype=torch.int32, device=device)
    splits = _split(rows, cols, device, tuning)[0]
    return torch.zeros(rows, _HEADER + _BINS * splits + 2 * capacity, dtype=torch.int32, device=device)


def first_digit_counts(workspace: torch.Tensor) -> torch.Tensor | None:
    """The row histograms of digit 1 inside a `topk_workspace` (int32 [rows, 256] view), for a kernel that writes the
    scores to count their first digit as it goes (`indexer_scores_paged(digit_counts=...)`) so that `topk_indices(...,
    first_digit_counted=True)` skips phase A; None for a workspace of the row kernel (no histograms)."""
    require(isinstance(workspace, torch.Tensor), f"workspace: expected a tensor, got {type(workspace).__name__}")
    check_tensor("workspace", workspace, dtype=torch.int32, shape=(None, None), device=workspace.device)
    return workspace[:, _HIST1:_HIST1 + _BINS] if workspace.shape[1] >= _HEADER else None


def topk_indices(scores: torch.Tensor, lengths: torch.Tensor, k: int, *, out: torch.Tensor | None = None,
                 workspace: torch.Tensor | None = None, first_digit_counted: bool = False,
                 tuning: TopkTuning | None = None) -> torch.Tensor:
    """Top-k columns of each row -> int32 [R, k]: ascending column order, -1 past min(k, candidates).

    scores: fp32 [R, J] contiguous (Triton specializes on J == 1 / a multiple of 16: a J that changes from call to
    call is best rounded up to a multiple of 16); lengths: int32 [R], row r's candidates are columns < lengths[r]
    (clamped to [0, J]) with a score other than -inf; k: 1..2048; out: int32 [R, k] (allocated when None);
    workspace: from `topk_workspace(R, J, k, device)` (allocated when None and the split kernel runs), histograms
    zero on entry (every call leaves them so); the row kernel reads none (any width is accepted).
    first_digit_counted: `first_digit_counts(workspace)` already holds, per row, the count of each digit 1 (key >>
    24, + 128) among the row's candidates for these `lengths`, exactly (the scores' producer counted them: wrong counts
    give wrong picks), so phase A does not run. The split kernel only, with the workspace given.
    tuning: the kernel choice and tiles (default: the device's; a workspace must be made with the same).
    """
    device = scores.device if isinstance(scores, torch.Tensor) else None
    check_tensor("scores", scores, dtype=torch.float32, shape=(None, None), device=device)
    rows, cols = scores.shape
    check_tensor("lengths", lengths, dtype=torch.int32, shape=(rows,), device=device)
    require(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_K,
            f"k: expected an int in 1..{MAX_K}, got {k!r}")
    tuning = tuning if tuning is not None else tuning_for(device)
    if out is None:
        out = torch.empty(rows, k, dtype=torch.int32, device=device)
    check_tensor("out", out, dtype=torch.int32, shape=(rows, k), device=device)
    splits, chunk, block, programs = _split(rows, cols, device, tuning)
    by_row = _by_row(rows, cols, tuning)
    require(isinstance(first_digit_counted, bool),
            f"first_digit_counted: expected a bool, got {first_digit_counted!r}")
    require(not first_digit_counted or not by_row,
            f"first_digit_counted: scores {list(scores.shape)} take the row kernel, which has no digit histograms")
    require(not first_digit_counted or workspace is not None,
            "first_digit_counted: pass the workspace whose histograms hold the counts (first_digit_counts)")
    if workspace is None and not by_row:
        workspace = topk_workspace(rows, cols, k, device, tuning=tuning)
    if workspace is not None:
        check_tensor("workspace", workspace, dtype=torch.int32, shape=(rows, None), device=device)
        require(by_row or workspace.shape[1] >= _HEADER + _BINS * splits,
                f"workspace: expected int32 [{rows}, >= {_HEADER + _BINS * splits}] for scores "
                f"{list(scores.shape)} (use topk_workspace), got {list(workspace.shape)}")
    if rows == 0:
        return out
    if cols == 0:
        return out.fill_(-1)
    if by_row:
        _launch_row_kernel(scores, lengths, out, k, tuning)
    else:
        _launch_split_kernel(scores, lengths, out, k, workspace, first_digit_counted, tuning)
    return out


def _launch_row_kernel(scores: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor, k: int,
                       tuning: TopkTuning) -> None:
    rows, cols = scores.shape
    # two row sizes only (row_block, else the power of two above: 16384 by default), so a context that grows from
    # step to step compiles no new kernel (test_engine_compiles)
    row_tile = max(tuning.row_block, triton.next_power_of_2(cols))
    per_thread = tuning.row_keys_per_thread[rows >= tuning.row_many]
    _topk_row_kernel[(rows,)](scores, lengths, out, cols, k, BLOCK=row_tile,
                              OUT_BLOCK=min(triton.next_power_of_2(k), 1024),
                              num_warps=max(4, min(32, row_tile // (32 * per_thread))),
                              **launch_options(scores.device))


def _launch_split_kernel(scores: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor, k: int,
                         workspace: torch.Tensor, first_digit_counted: bool, tuning: TopkTuning) -> None:
    rows, cols = scores.shape
    device = scores.device
    splits, chunk, block, programs = _split(rows, cols, device, tuning)
    width = workspace.shape[1]
    capacity = (width - _HEADER - _BINS * splits) // 2
    select = _select_block(k, tuning)
    args = (scores, lengths, workspace, out, cols, width, chunk, splits, capacity, k)
    warps = 4 if select <= 1024 else 8
    asm = device.type == "cuda" and not interpreted()
    require(not asm or block >= 32 * warps, f"top-k: a {block}-column tile over {warps} warps would replicate keys, "
            "which the warp counts would count twice (SplitTiling.block)")
    # SPLITS (the width of the per-chunk count vector) is the tiling's bound, not this call's S, and S is a plain
    # runtime int (do_not_specialize): S follows the row count, so it would otherwise compile a kernel per step shape
    meta = dict(BLOCK=block, SPLITS=triton.next_power_of_2(programs), SELECT=select, ASM=asm,
                AHEAD=_split_tiling(rows, cols, tuning).first_tile_ahead, num_warps=warps, **launch_options(device))
    for phase in range(1 if first_digit_counted else 0, 3):
        _topk_kernel[(rows, splits)](*args, PHASE=phase, **meta)
    _topk_kernel[(rows, 1)](*args, PHASE=3, **meta)


# the workspace offsets as constexprs (jit code reads no other globals)
_C_HIST1, _C_HIST2, _C_HEADER = tl.constexpr(_HIST1), tl.constexpr(_HIST2), tl.constexpr(_HEADER)


@triton.jit
def _histograms(p_ws):
    """hist1 and hist2, both loads issued before either is used (a pick's scan holds CTA barriers, which a later
    load would not be moved above)."""
    o_b = tl.arange(0, 256)
    return load_shared(p_ws + _C_HIST1 + o_b), load_shared(p_ws + _C_HIST2 + o_b)


@triton.jit
def _prefix16(hist1, hist2, k):
    """The 16-bit prefix of the threshold (signed, as key >> 16), its digit 2 and the count still
    needed among keys with that prefix, from the row's two histograms (`_histograms`)."""
    d1, need1 = pick_digit(hist1, k)
    d2, need2 = pick_digit(hist2, need1)
    return (d1 - 128) * 256 + d2, d2, need2


@triton.jit
def _buffered(p_ws, d2, S, SPLITS: tl.constexpr):
    """Candidates with the threshold's 16-bit prefix or above, per chunk [SPLITS] (0 past S), from suffix."""
    o_s = tl.arange(0, SPLITS)
    return tl.load(p_ws + _C_HEADER + o_s * 256 + d2, mask=o_s < S, other=0, cache_modifier=".cg")


@triton.jit
def _phase_a(p_row, p_ws, i_s, lo, hi, BLOCK: tl.constexpr, ASM: tl.constexpr, AHEAD: tl.constexpr):
    # counted into this chunk's row of the workspace (the row's histogram itself would take every program's
    # reductions at its few busy bins: 1.7x slower at 1M columns), then added to it
    count_first_digits(p_row, lo, hi, p_ws + _C_HIST1, p_ws + _C_HEADER + i_s * 256, ASM, BLOCK, True, AHEAD)


@triton.jit
def _digit2_tile(p_chunk, b_key, m_c, top, b_above, ASM: tl.constexpr):
    """Phase B over one tile: its keys above top digit `top` added to b_above (returned), its digit 2 among keys of
    that top digit counted into p_chunk."""
    b_above += (m_c & ((b_key >> 24) > top)).to(tl.int32)
    count_digits(p_chunk, (b_key >> 16) & 255, m_c & ((b_key >> 24) == top), ASM)
    return b_above


@triton.jit
def _phase_b(p_row, p_ws, i_s, lo, hi, k, BLOCK: tl.constexpr, ASM: tl.constexpr, AHEAD: tl.constexpr):
    o_b = tl.arange(0, 256)
    first = lo
    if AHEAD:  # the first tile's loads in flight with hist1's
        o_c, b_key, m_c = row_tile(p_row, lo, hi, BLOCK)
        first = lo + BLOCK
    p_chunk = p_ws + _C_HEADER + i_s * 256  # this chunk's digit-2 counts, then its suffix
    # counted from zero: the row holds phase A's counts, or the previous call's suffix
    tl.store(p_chunk + o_b, tl.zeros([256], dtype=tl.int32))
    d1, _ = pick_digit(load_shared(p_ws + _C_HIST1 + o_b), k)
    top = d1 - 128  # digit 1 as key >> 24
    tl.debug_barrier()  # the zeros before any warp's counts
    b_above = tl.zeros([BLOCK], dtype=tl.int32)  # keys whose top digit is higher: all in the buffer
    if AHEAD:  # outside the loop, as in phase A
        b_above = _digit2_tile(p_chunk, b_key, m_c, top, b_above, ASM)
    for start in range(first, hi, BLOCK):
        o_c, b_key, m_c = row_tile(p_row, start, hi, BLOCK)
        b_above = _digit2_tile(p_chunk, b_key, m_c, top, b_above, ASM)
    tl.debug_barrier()  # every warp's counts are in
    b_h = load_shared(p_chunk + o_b)
    tl.debug_barrier()  # read by every warp before the suffix overwrites them
    tl.atomic_add(p_ws + _C_HIST2 + o_b, b_h, mask=b_h != 0, sem="relaxed")
    # this chunk's keys with key >> 16 >= (top, b), for each digit b that phase C may choose
    b_suffix = tl.sum(b_above) + tl.sum(b_h) - tl.cumsum(b_h, 0) + b_h
    tl.store(p_chunk + o_b, b_suffix)


@triton.jit
def _buffer_tile(p_keys, CAP, o_c, b_key, m_c, prefix, at):
    """Phase C over one tile: its keys with key >> 16 >= prefix into the buffer from slot `at`, in column order.
    Returns how many."""
    m_keep = m_c & ((b_key >> 16) >= prefix)
    # a flat cumsum: the rows-of-4 scan (`running_sum`, then of a mask) made this phase slower (more registers)
    o_buf = at + tl.cumsum(m_keep.to(tl.int32), 0) - 1
    tl.store(p_keys + o_buf, b_key, mask=m_keep)
    tl.store(p_keys + CAP + o_buf, o_c, mask=m_keep)
    return tl.sum(m_keep.to(tl.int32))


@triton.jit
def _phase_c(p_row, p_ws, i_s, lo, hi, S, CAP, k, BLOCK: tl.constexpr, SPLITS: tl.constexpr, AHEAD: tl.constexpr):
    first = lo
    if AHEAD:  # the first tile's loads in flight with the histograms'
        o_c, b_key, m_c = row_tile(p_row, lo, hi, BLOCK)
        first = lo + BLOCK
    hist1, hist2 = _histograms(p_ws)
    prefix, d2, _ = _prefix16(hist1, hist2, k)
    o_s = tl.arange(0, SPLITS)
    b_count = _buffered(p_ws, d2, S, SPLITS)
    at = tl.sum(tl.where(o_s < i_s, b_count, 0))
    hi = tl.where(tl.sum(b_count) <= CAP, hi, lo)  # an overflowing row is read whole by phase D
    p_keys = p_ws + _C_HEADER + S * 256
    if AHEAD:  # outside the loop, as in phase A (a tile carried by the loop costs registers)
        at += _buffer_tile(p_keys, CAP, o_c, b_key, m_c & (o_c < hi), prefix, at)
    written = tl.full((), 0, tl.int32)
    for start in range(first, hi, BLOCK):
        o_c, b_key, m_c = row_tile(p_row, start, hi, BLOCK)
        written += _buffer_tile(p_keys, CAP, o_c, b_key, m_c, prefix, at + written)


@triton.jit
def _candidates(p_row, p_keys, p_cols, start, buffer_end, row_end, BLOCK: tl.constexpr):
    """Tile start.. of the row's candidates in column order, from the buffer (buffer_end > 0) or
    from the row (row_end > 0): (columns, keys, valid mask)."""
    o_t = start + tl.arange(0, BLOCK)
    m_buf = o_t < buffer_end
    m_row = o_t < row_end
    b_bkey = tl.load(p_keys + o_t, mask=m_buf, other=0, cache_modifier=".cg")
    b_bcol = tl.load(p_cols + o_t, mask=m_buf, other=0, cache_modifier=".cg")
    b_x = tl.load(p_row + o_t, mask=m_row, other=float("-inf"))
    b_key = tl.where(m_buf, b_bkey, sortable(b_x))
    return tl.where(m_buf, b_bcol, o_t), b_key, m_buf | (m_row & (b_x != float("-inf")))


@triton.jit
def _select_looped(p_row, p_keys, p_cols, p_out, buffer_end, row_end, prefix16, need, k, BLOCK: tl.constexpr):
    """The picks among the candidates of the buffer (buffer_end > 0) or of the row (row_end > 0), read a tile at a
    time, given the threshold's top 16 bits `prefix16` and the count `need` still needed among keys that share them:
    its digits 3 and 4 from one 256-bin histogram pass each, then a pass that stores the picks in column order.
    Returns how many were stored."""
    end = buffer_end + row_end
    prefix = prefix16
    for level in tl.static_range(2, 4):
        b_h = tl.zeros([256], dtype=tl.int32)
        for start in range(0, end, BLOCK):
            o_c, b_key, m_c = _candidates(p_row, p_keys, p_cols, start, buffer_end, row_end, BLOCK)
            m_c = m_c & ((b_key >> (32 - 8 * level)) == prefix)
            b_h += histogram((b_key >> (24 - 8 * level)) & 255, m_c, BLOCK)
        digit, need = pick_digit(b_h, need)
        prefix = prefix * 256 + digit
    written = tl.full((), 0, tl.int32)
    ties = tl.full((), 0, tl.int32)
    for start in range(0, end, BLOCK):
        o_c, b_key, m_c = _candidates(p_row, p_keys, p_cols, start, buffer_end, row_end, BLOCK)
        m_tie = m_c & (b_key == prefix)
        # flat cumsums: the rows-of-4 scan (`running_sum`, then of a mask) made phase D spill at k = 512, register
        # path included
        m_pick = (m_c & (b_key > prefix)) | (m_tie & (ties + tl.cumsum(m_tie.to(tl.int32), 0) <= need))
        o_out = written + tl.cumsum(m_pick.to(tl.int32), 0) - 1
        tl.store(p_out + o_out, o_c, mask=m_pick & (o_out < k))
        ties += tl.sum(m_tie.to(tl.int32))
        written += tl.sum(m_pick.to(tl.int32))
    return tl.minimum(written, k)


@triton.jit
def _phase_d(p_row, p_ws, p_out, n, S, CAP, k, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
             SELECT: tl.constexpr):
    p_keys = p_ws + _C_HEADER + S * 256
    p_cols = p_keys + CAP
    # the register path's candidates (the buffer's first SELECT slots, however many hold one) in flight with the
    # histograms', before the count of them is known
    o_t = tl.arange(0, SELECT)
    b_bkey = tl.load(p_keys + o_t, mask=o_t < CAP, other=0, cache_modifier=".cg")
    b_bcol = tl.load(p_cols + o_t, mask=o_t < CAP, other=0, cache_modifier=".cg")
    hist1, hist2 = _histograms(p_ws)
    prefix16, d2, need2 = _prefix16(hist1, hist2, k)
    total = tl.sum(_buffered(p_ws, d2, S, SPLITS))
    if (total <= SELECT) & (total <= CAP):  # the usual case: every buffered candidate in registers at once
        o_c, b_key, m_c = b_bcol, b_bkey, o_t < total  # slots past `total` hold stale keys: every use is masked
        # T has the 16-bit prefix: #(key >= prefix16 << 16) >= k > #(key >= (prefix16 + 1) << 16) (fewer than
        # k candidates: prefix16 << 16 is int32 min, where the empty lanes sit, and every candidate is a pick)
        lo = (prefix16 * 65536).to(tl.int64)
        threshold = kth_key(tl.where(m_c, b_key, -2147483648), lo, lo + 65536, k)
        written = write_picks(o_c, b_key, m_c, threshold, k, p_out, SELECT)
    else:  # a big buffer: three passes over it; an overflowed one: three passes over the row
        buffer_end = tl.where(total <= CAP, total, 0)
        row_end = tl.where(total <= CAP, 0, n)
        written = _select_looped(p_row, p_keys, p_cols, p_out, buffer_end, row_end, prefix16, need2, k, BLOCK)
    fill_tail(p_out, written, k, BLOCK)


@triton.jit
def _topk_row_kernel(scores_ptr, lengths_ptr, out_ptr, J, k, BLOCK: tl.constexpr, OUT_BLOCK: tl.constexpr):
    """Row i_r whole in one program's registers. The k-th largest key T by bisection on the int32 key space
    (`kth_key`), then the picks: every key > T and the first k - #(key > T) keys == T in column order, written in
    column order."""
    wait_for_prior_grids()
    i_r = tl.program_id(0)
    n = tl.minimum(tl.maximum(tl.load(lengths_ptr + i_r), 0), J)
    o_c = tl.arange(0, BLOCK)
    b_key = candidate_keys(scores_ptr + i_r.to(tl.int64) * J, o_c, n)
    m_c = b_key > -2147483648
    threshold = tl.full((), -2147483648, tl.int32)  # fewer than k candidates: all of them
    if tl.sum(m_c.to(tl.int32), axis=0) > k:
        # from the whole key range (every candidate key is >= int32 min + 1, `candidate_keys`). Starting from the
        # row's smallest and largest keys (a reduction each) would save steps on rows of a narrow key range (all 32
        # on a row of equal scores), and was no faster on the timed rows (docs/performance.md)
        threshold = kth_key(b_key, tl.full((), -2147483647, tl.int64), tl.full((), 2147483648, tl.int64), k)
    p_out = out_ptr + i_r.to(tl.int64) * k
    fill_tail(p_out, write_picks(o_c, b_key, m_c, threshold, k, p_out, BLOCK), k, OUT_BLOCK)


@triton.jit(do_not_specialize=["S"])
def _topk_kernel(scores_ptr, lengths_ptr, ws_ptr, out_ptr, J, W, CHUNK, S, CAP, k, BLOCK: tl.constexpr,
                 SPLITS: tl.constexpr, SELECT: tl.constexpr, PHASE: tl.constexpr, ASM: tl.constexpr,
                 AHEAD: tl.constexpr):
    """Row i_r, phase PHASE (0..3 = A..D): grid (R, S) for A-C, (R, 1) for D, ordered by the launches."""
    wait_for_prior_grids()
    i_r = tl.program_id(0)
    i_s = tl.program_id(1)
    n = tl.minimum(tl.maximum(tl.load(lengths_ptr + i_r), 0), J)
    p_row = scores_ptr + i_r.to(tl.int64) * J
    p_ws = ws_ptr + i_r.to(tl.int64) * W
    lo = i_s * CHUNK
    hi = tl.minimum(lo + CHUNK, n)
    if PHASE == 0:
        _phase_a(p_row, p_ws, i_s, lo, hi, BLOCK, ASM, AHEAD)
    elif PHASE == 1:
        _phase_b(p_row, p_ws, i_s, lo, hi, k, BLOCK, ASM, AHEAD)
    elif PHASE == 2:
        _phase_c(p_row, p_ws, i_s, lo, hi, S, CAP, k, BLOCK, SPLITS, AHEAD)
    else:
        _phase_d(p_row, p_ws, out_ptr + i_r.to(tl.int64) * k, n, S, CAP, k, BLOCK, SPLITS, SELECT)
        # leave the histograms zero for the next call
        tl.debug_barrier()
        tl.store(p_ws + tl.arange(0, _C_HEADER), tl.zeros([_C_HEADER], dtype=tl.int32))
