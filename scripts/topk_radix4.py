"""The top-k kernel before issue 12 (commit c499d52), kept only so scripts/bench_variants.py can time it against
`dsv4kv.kernels.topk` in the same run. Not part of the package; the docstring below is the original's.

Exact top-k column indices of every score row: a radix select in four kernels, no sort of the row.

    out[r] = the columns of the min(k, n_r) highest candidate scores of row r, in ascending column order,
             then -1                                                      (int32 [R, k])

Row r's candidates are columns 0..lengths[r]-1 (lengths clamped to [0, J]) whose score is not -inf;
columns past the length are never read. Among equal scores the lower column wins, so the set is the one
`dsv4kv.ops.indexer.topk_picks` gives (a stable descending sort); -0.0 and +0.0 count as equal. NaN
scores inside the length are unspecified (they get some rank; nothing is written out of bounds).

Algorithm. A score becomes an int32 key whose signed order is the float order (sign-magnitude flipped,
-0.0 folded onto +0.0); the k-th largest key T is found one 8-bit digit at a time (a radix select:
histogram the digit among the keys that share the digits found so far, take the digit where the count
from the top reaches the number still needed). Then the selection is: every key > T, plus the first
`need` keys == T in column order, where `need` = k - #(key > T). With fewer than k candidates the
descent bottoms out at T = int32 min and everything is taken. Each row is split into S chunks (S grows
as R shrinks, so one long decode row still fills the GPU); the kernels, in launch order:

1. `_hist1`   [R, S]  histogram of digit 1 (bits 31..24) of the chunk   -> atomics into hist1[r]
2. `_hist2`   [R, S]  digit 1 from hist1; histogram of digit 2 among keys of that top digit
                      -> atomics into hist2[r]; also the chunk's count of keys >= each 16-bit prefix
                      that could be chosen, suffix[r, s, :] (no atomics)
3. `_compact` [R, S]  digit 2 from hist2, i.e. the 16-bit prefix P of T; the chunk's candidates with
                      key >> 16 >= P (M of them in the row, ~k plus one fine bin) go to a per-row
                      buffer (key, column) in column order, offsets from suffix[r, :, d2]
4. `_select`  [R]     digits 3 and 4 from two histograms over the buffer, then one ordered pass writes
                      the picks (cumsum ranks, ties counted in column order) and the -1 tail; it
                      zeroes hist1[r] and hist2[r] for the next call.

Passes over the scores: three (kernels 1-3) in parallel chunks, then ~3 over the M buffered candidates.
If M exceeds the buffer's capacity (e.g. tens of thousands of equal scores), kernel 4 makes its three
passes over the whole row instead: exact, only slower.

Workspace (int32 [R, 512 + 256 * S + 2 * capacity], see `topk_workspace`): hist1 [256], hist2 [256],
suffix [S, 256], buffer keys [capacity], buffer columns [capacity]. The two histograms must be zero on
entry and every call leaves them zero, so a workspace from `topk_workspace` can be reused call after call.
For a CUDA graph, allocate `out` and the workspace before capture and pass both: the op then allocates
nothing, reads nothing back to the host, and launches the same four kernels for fixed (R, J, k).
"""

from __future__ import annotations

import functools

import torch

from dsv4kv.kernels.common import check_tensor
from dsv4kv.ops.common import require

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install without Triton: the wrapper's checks say so
    triton = None

__all__ = ["topk_indices", "topk_workspace", "MAX_K"]

MAX_K = 2048
_BINS = 256  # 8-bit digits: four levels cover the 32-bit key
_HEADER = 2 * _BINS  # hist1, hist2
_BLOCK = {"cuda": 1024, "cpu": 64}  # columns per tile; small under the interpreter so tests split rows
_CPU_PROGRAMS = 6  # programs the interpreter aims for when splitting rows (tests exercise S > 1)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split(rows: int, cols: int, device: torch.device) -> tuple[int, int, int]:
    """(splits S, chunk columns, tile columns) for a [rows, cols] problem: about two programs per SM."""
    block = _BLOCK["cuda" if device.type == "cuda" else "cpu"]
    if device.type == "cuda":
        programs = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        programs = _CPU_PROGRAMS
    splits = max(1, min(-(-programs // max(rows, 1)), -(-cols // block)))
    chunk = max(1, -(-(-(-cols // splits)) // block)) * block
    return max(1, -(-cols // chunk)), chunk, block


def topk_workspace(rows: int, cols: int, k: int, device: torch.device | str, *,
                   capacity: int | None = None) -> torch.Tensor:
    """A zeroed workspace int32 [rows, 512 + 256 * S + 2 * capacity] for `topk_indices` on scores
    [rows, cols] of `device` (S depends on rows, cols and the device). `capacity` (default 3k) candidates
    per row fit the buffer; any capacity >= 0 is exact, rows that overflow it take the slower path."""
    device = torch.device(device)
    capacity = 3 * k if capacity is None else capacity
    require(capacity >= 0, f"topk_workspace: capacity must be >= 0, got {capacity}")
    splits, _, _ = _split(rows, cols, device)
    return torch.zeros(rows, _HEADER + _BINS * splits + 2 * capacity, dtype=torch.int32, device=device)


def topk_indices(scores: torch.Tensor, lengths: torch.Tensor, k: int, *, out: torch.Tensor | None = None,
                 workspace: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k columns of each row -> int32 [R, k]: ascending column order, -1 past min(k, candidates).

    scores: fp32 [R, J] contiguous; lengths: int32 [R], row r's candidates are columns < lengths[r]
    (clamped to [0, J]) with a score other than -inf; k: 1..2048; out: int32 [R, k] (allocated when None);
    workspace: from `topk_workspace(R, J, k, device)` (allocated when None), histogram part zero on entry.
    """
    device = scores.device if isinstance(scores, torch.Tensor) else None
    check_tensor("scores", scores, dtype=torch.float32, shape=(None, None), device=device)
    rows, cols = scores.shape
    check_tensor("lengths", lengths, dtype=torch.int32, shape=(rows,), device=device)
    require(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_K,
            f"k: expected an int in 1..{MAX_K}, got {k!r}")
    if out is None:
        out = torch.empty(rows, k, dtype=torch.int32, device=device)
    check_tensor("out", out, dtype=torch.int32, shape=(rows, k), device=device)
    splits, chunk, block = _split(rows, cols, device)
    if workspace is None:
        workspace = topk_workspace(rows, cols, k, device)
    check_tensor("workspace", workspace, dtype=torch.int32, shape=(rows, None), device=device)
    width = workspace.shape[1]
    require(width >= _HEADER + _BINS * splits,
            f"workspace: expected int32 [{rows}, >= {_HEADER + _BINS * splits}] for scores {list(scores.shape)} "
            f"(use topk_workspace), got {list(workspace.shape)}")
    if rows == 0:
        return out
    if cols == 0:
        return out.fill_(-1)
    capacity = (width - _HEADER - _BINS * splits) // 2
    splits_p2 = triton.next_power_of_2(splits)
    grid = (rows, splits)
    _hist1[grid](scores, lengths, workspace, cols, width, chunk, BLOCK=block)
    _hist2[grid](scores, lengths, workspace, cols, width, chunk, k, BLOCK=block)
    _compact[grid](scores, lengths, workspace, cols, width, chunk, splits, capacity, k,
                   BLOCK=block, SPLITS=splits_p2)
    _select[(rows,)](scores, lengths, workspace, out, cols, width, splits, capacity, k,
                     BLOCK=block, SPLITS=splits_p2)
    return out


if triton is not None:

    @triton.jit
    def _sortable(x):
        """fp32 -> int32 whose signed order is the float order; -0.0 maps onto +0.0 (they tie)."""
        b_bits = x.to(tl.int32, bitcast=True)
        b_bits = tl.where(b_bits == -2147483648, 0, b_bits)
        return b_bits ^ ((b_bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _row_tile(p_row, start, end, BLOCK: tl.constexpr):
        """Columns start.. of a row: (columns, keys, candidate mask); columns >= end are not read."""
        o_c = start + tl.arange(0, BLOCK)
        m_c = o_c < end
        b_x = tl.load(p_row + o_c, mask=m_c, other=float("-inf"))
        return o_c, _sortable(b_x), m_c & (b_x != float("-inf"))

    @triton.jit
    def _histogram(digits, mask, BLOCK: tl.constexpr):
        """int32 [256] counts of digits[mask] (masked lanes go to bin 0 and are taken back out)."""
        b_h = tl.histogram(tl.where(mask, digits, 0), 256)
        missed = BLOCK - tl.sum(mask.to(tl.int32))
        return b_h - tl.where(tl.arange(0, 256) == 0, missed, 0)

    @triton.jit
    def _pick(b_h, need):
        """The digit where the count from the top reaches `need` (0 when it never does) and how many
        keys with that digit are still needed."""
        o_b = tl.arange(0, 256)
        b_suffix = tl.sum(b_h) - tl.cumsum(b_h, 0) + b_h  # keys with digit >= b
        digit = tl.max(tl.where(b_suffix >= need, o_b, 0))
        return digit, need - tl.sum(tl.where(o_b > digit, b_h, 0))

    @triton.jit
    def _prefix16(p_ws, k):
        """The 16-bit prefix of the threshold (signed, as key >> 16), its digit 2 and the count still
        needed among keys with that prefix, from hist1 and hist2."""
        o_b = tl.arange(0, 256)
        d1, need1 = _pick(tl.load(p_ws + o_b), k)
        d2, need2 = _pick(tl.load(p_ws + 256 + o_b), need1)
        return (d1 - 128) * 256 + d2, d2, need2

    @triton.jit
    def _row_bounds(lengths_ptr, i_r, i_s, J, CHUNK):
        n = tl.minimum(tl.maximum(tl.load(lengths_ptr + i_r), 0), J)
        lo = i_s * CHUNK
        return lo, tl.minimum(lo + CHUNK, n)

    @triton.jit
    def _hist1(scores_ptr, lengths_ptr, ws_ptr, J, W, CHUNK, BLOCK: tl.constexpr):
        i_r, i_s = tl.program_id(0), tl.program_id(1)
        lo, hi = _row_bounds(lengths_ptr, i_r, i_s, J, CHUNK)
        p_row = scores_ptr + i_r.to(tl.int64) * J
        b_h = tl.zeros([256], dtype=tl.int32)
        for start in range(lo, hi, BLOCK):
            o_c, b_key, m_c = _row_tile(p_row, start, hi, BLOCK)
            b_h += _histogram((b_key >> 24) + 128, m_c, BLOCK)
        tl.atomic_add(ws_ptr + i_r.to(tl.int64) * W + tl.arange(0, 256), b_h, mask=b_h != 0, sem="relaxed")

    @triton.jit
    def _hist2(scores_ptr, lengths_ptr, ws_ptr, J, W, CHUNK, k, BLOCK: tl.constexpr):
        i_r, i_s = tl.program_id(0), tl.program_id(1)
        lo, hi = _row_bounds(lengths_ptr, i_r, i_s, J, CHUNK)
        p_row = scores_ptr + i_r.to(tl.int64) * J
        p_ws = ws_ptr + i_r.to(tl.int64) * W
        o_b = tl.arange(0, 256)
        d1, _ = _pick(tl.load(p_ws + o_b), k)
        top = d1 - 128  # digit 1 as key >> 24
        b_above = tl.zeros([BLOCK], dtype=tl.int32)  # keys whose top digit is higher: all in the buffer
        b_h = tl.zeros([256], dtype=tl.int32)
        for start in range(lo, hi, BLOCK):
            o_c, b_key, m_c = _row_tile(p_row, start, hi, BLOCK)
            b_above += (m_c & ((b_key >> 24) > top)).to(tl.int32)
            b_h += _histogram((b_key >> 16) & 255, m_c & ((b_key >> 24) == top), BLOCK)
        tl.atomic_add(p_ws + 256 + o_b, b_h, mask=b_h != 0, sem="relaxed")
        # this chunk's keys with key >> 16 >= (top, b), for each digit b that kernel 3 may choose
        b_suffix = tl.sum(b_above) + tl.sum(b_h) - tl.cumsum(b_h, 0) + b_h
        tl.store(p_ws + 512 + i_s * 256 + o_b, b_suffix)

    @triton.jit
    def _compact(scores_ptr, lengths_ptr, ws_ptr, J, W, CHUNK, S, CAP, k, BLOCK: tl.constexpr,
                 SPLITS: tl.constexpr):
        i_r, i_s = tl.program_id(0), tl.program_id(1)
        lo, hi = _row_bounds(lengths_ptr, i_r, i_s, J, CHUNK)
        p_row = scores_ptr + i_r.to(tl.int64) * J
        p_ws = ws_ptr + i_r.to(tl.int64) * W
        prefix, d2, _ = _prefix16(p_ws, k)
        o_s = tl.arange(0, SPLITS)
        b_count = tl.load(p_ws + 512 + o_s * 256 + d2, mask=o_s < S, other=0)  # buffered keys per chunk
        base = tl.sum(tl.where(o_s < i_s, b_count, 0))
        hi = tl.where(tl.sum(b_count) <= CAP, hi, lo)  # an overflowing row is read whole by kernel 4
        p_keys = p_ws + 512 + S * 256
        written = tl.full((), 0, tl.int32)
        for start in range(lo, hi, BLOCK):
            o_c, b_key, m_c = _row_tile(p_row, start, hi, BLOCK)
            m_keep = m_c & ((b_key >> 16) >= prefix)
            b_keep = m_keep.to(tl.int32)
            o_buf = base + written + tl.cumsum(b_keep, 0) - 1
            tl.store(p_keys + o_buf, b_key, mask=m_keep)
            tl.store(p_keys + CAP + o_buf, o_c, mask=m_keep)
            written += tl.sum(b_keep)

    @triton.jit
    def _candidates(p_row, p_keys, p_cols, start, buffer_end, row_end, BLOCK: tl.constexpr):
        """Tile start.. of the row's candidates in column order, from the buffer (buffer_end > 0) or
        from the row (row_end > 0): (columns, keys, valid mask)."""
        o_t = start + tl.arange(0, BLOCK)
        m_buf = o_t < buffer_end
        m_row = o_t < row_end
        b_bkey = tl.load(p_keys + o_t, mask=m_buf, other=0)
        b_bcol = tl.load(p_cols + o_t, mask=m_buf, other=0)
        b_x = tl.load(p_row + o_t, mask=m_row, other=float("-inf"))
        b_key = tl.where(m_buf, b_bkey, _sortable(b_x))
        return tl.where(m_buf, b_bcol, o_t), b_key, m_buf | (m_row & (b_x != float("-inf")))

    @triton.jit
    def _select(scores_ptr, lengths_ptr, ws_ptr, out_ptr, J, W, S, CAP, k, BLOCK: tl.constexpr,
                SPLITS: tl.constexpr):
        i_r = tl.program_id(0)
        n = tl.minimum(tl.maximum(tl.load(lengths_ptr + i_r), 0), J)
        p_row = scores_ptr + i_r.to(tl.int64) * J
        p_ws = ws_ptr + i_r.to(tl.int64) * W
        p_out = out_ptr + i_r.to(tl.int64) * k
        p_keys = p_ws + 512 + S * 256
        p_cols = p_keys + CAP
        prefix16, d2, need2 = _prefix16(p_ws, k)
        o_s = tl.arange(0, SPLITS)
        total = tl.sum(tl.load(p_ws + 512 + o_s * 256 + d2, mask=o_s < S, other=0))
        buffer_end = tl.where(total <= CAP, total, 0)
        row_end = tl.where(total <= CAP, 0, n)
        end = buffer_end + row_end
        # digit 3 among keys with the 16-bit prefix
        b_h = tl.zeros([256], dtype=tl.int32)
        for start in range(0, end, BLOCK):
            o_c, b_key, m_c = _candidates(p_row, p_keys, p_cols, start, buffer_end, row_end, BLOCK)
            b_h += _histogram((b_key >> 8) & 255, m_c & ((b_key >> 16) == prefix16), BLOCK)
        d3, need3 = _pick(b_h, need2)
        prefix24 = prefix16 * 256 + d3
        # digit 4 among keys with the 24-bit prefix
        b_h = tl.zeros([256], dtype=tl.int32)
        for start in range(0, end, BLOCK):
            o_c, b_key, m_c = _candidates(p_row, p_keys, p_cols, start, buffer_end, row_end, BLOCK)
            b_h += _histogram(b_key & 255, m_c & ((b_key >> 8) == prefix24), BLOCK)
        d4, need = _pick(b_h, need3)
        threshold = prefix24 * 256 + d4
        # keys > threshold, then the first `need` keys == threshold, written in column order
        ties = tl.full((), 0, tl.int32)
        written = tl.full((), 0, tl.int32)
        for start in range(0, end, BLOCK):
            o_c, b_key, m_c = _candidates(p_row, p_keys, p_cols, start, buffer_end, row_end, BLOCK)
            m_tie = m_c & (b_key == threshold)
            m_pick = (m_c & (b_key > threshold)) | (m_tie & (ties + tl.cumsum(m_tie.to(tl.int32), 0) <= need))
            o_out = written + tl.cumsum(m_pick.to(tl.int32), 0) - 1
            tl.store(p_out + o_out, o_c, mask=m_pick & (o_out < k))
            ties += tl.sum(m_tie.to(tl.int32))
            written += tl.sum(m_pick.to(tl.int32))
        for start in range(0, k, BLOCK):
            o_o = start + tl.arange(0, BLOCK)
            tl.store(p_out + o_o, tl.full([BLOCK], -1, tl.int32), mask=(o_o >= written) & (o_o < k))
        # leave the histograms zero for the next call (this row's kernels 1-3 are done with them)
        o_h = tl.arange(0, 512)
        tl.store(p_ws + o_h, tl.zeros([512], dtype=tl.int32))
