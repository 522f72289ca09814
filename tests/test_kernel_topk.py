"""The top-k kernel against the reference `topk_picks` (a stable descending sort): the same index set,
bit for bit, on rows full of exact ties, short and empty rows, -inf inside and NaN past the length; by the
one-program-per-row kernel (rows up to `TopkTuning.row_max_cols`) and by the split radix select's four launches,
with phase D's candidates in registers and looped.
Small cases run under the interpreter; V4-Flash / V4-Pro shapes (1M tokens at ratio 4) need a GPU."""

from dataclasses import replace

import pytest
import torch

from dsv4kv import ModelGeometry
from dsv4kv.ops.topk import kernel as topk_module
from dsv4kv.ops.topk.kernel import MAX_K, topk_indices, topk_workspace
from dsv4kv.ops.topk.reference import topk_picks
from dsv4kv.ops.topk.tuning import tuning_for

SENTINEL = -7  # prefilled into out: every element must be overwritten
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(scores, lengths, k):
    """int32 [R, k]: topk_picks on the length-masked scores, picks sorted ascending, -1 after."""
    cols = torch.arange(scores.shape[1], device=scores.device)
    masked = scores.masked_fill(cols >= lengths.long().clamp(0, scores.shape[1]).unsqueeze(1), float("-inf"))
    picks = topk_picks(masked, k)
    big = torch.iinfo(torch.int64).max
    picks = torch.where(picks < 0, big, picks).sort(dim=1).values
    return torch.where(picks == big, -1, picks).to(torch.int32)


def make_rows(seed, rows, cols, kind, device="cpu"):
    """fp32 [rows, cols] scores of `kind` with NaN past each row's length, and int32 lengths that include
    0, cols, negative and > cols (clamped by the op)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":  # integers: long runs of exact ties at the threshold
        scores = torch.randint(-6, 7, (rows, cols), generator=g).float()
    elif kind == "equal":
        scores = torch.full((rows, cols), 2.5)
    elif kind == "wide":  # signed, 1e-30..1e30, and a tenth of the extremes: +-max, +-subnormal, -0.0, +-min normal
        scores = torch.randn(rows, cols, generator=g).sign() * 10.0 ** (torch.rand(rows, cols, generator=g) * 60 - 30)
        info = torch.finfo(torch.float32)
        extremes = torch.tensor([info.max, -info.max, info.tiny, -info.tiny, 1e-45, -1e-45, -0.0, 0.0])
        pick = torch.rand(rows, cols, generator=g) < 0.1
        scores[pick] = extremes[torch.randint(0, len(extremes), (int(pick.sum()),), generator=g)]
    elif kind == "band":  # one 16-bit key prefix for every score: digits 3 and 4 alone decide, with exact ties
        scores = 1 + torch.randint(0, 64, (rows, cols), generator=g) * 2.0 ** -17 \
            + torch.randint(0, 4, (rows, cols), generator=g) * 2.0 ** -21
    elif kind == "normal":  # a fine grid (ties inside the last radix digits too), 5% -inf: no candidates
        scores = (torch.randn(rows, cols, generator=g) * 64).round() / 64
        scores = scores.masked_fill(torch.rand(rows, cols, generator=g) < 0.05, float("-inf"))
    else:
        raise ValueError(kind)
    lengths = torch.randint(0, cols + 1, (rows,), generator=g)
    fixed = [0, cols, cols + 5, -3, 1]
    lengths[:min(rows, len(fixed))] = torch.tensor(fixed[:rows])
    cols_idx = torch.arange(cols)
    scores = scores.masked_fill(cols_idx >= lengths.clamp(0, cols).unsqueeze(1), float("nan"))
    return scores.to(device), lengths.to(torch.int32).to(device)


def split_variant(param):
    """A config that sends every row to the split radix select: "phased" loads each chunk's first tile before the
    histogram reads, "phased-behind" after them (not `SplitTiling.first_tile_ahead`: the GPU's big tiling)."""
    tuning = tuning_for(torch.device(DEVICE))
    ahead = param != "phased-behind"
    return replace(tuning, row_max_cols=0, row_max_cols_many=0, small=replace(tuning.small, first_tile_ahead=ahead),
                   big=replace(tuning.big, first_tile_ahead=ahead))


@pytest.fixture(params=["row", "phased", "phased-behind"])
def mode(request):
    """A config: the one-program-per-row kernel, or the split radix select (`split_variant`): the same results."""
    if request.param == "row":
        return replace(tuning_for(torch.device(DEVICE)), row_max_cols=1 << 30, row_max_cols_many=1 << 30)
    return split_variant(request.param)


@pytest.fixture(params=["phased", "phased-behind"])
def split_mode(request):
    """A config of the split radix select for every row length (its workspace, buffer and select paths)."""
    return split_variant(request.param)


def run(scores, lengths, k, **kw):
    out = torch.full((scores.shape[0], k), SENTINEL, dtype=torch.int32, device=scores.device)
    result = topk_indices(scores, lengths, k, out=out, **kw)
    assert result is out
    return out


# --- interpreter-sized cases ---------------------------------------------------------------------------
@pytest.mark.parametrize("rows,cols,k,kind", [
    (1, 300, 7, "ties"),  # one row split across programs
    (3, 517, 64, "ties"),
    (7, 201, 16, "normal"),  # one chunk per row
    (5, 90, 128, "ties"),  # k > J: every candidate, then -1
    (1, 257, 257, "normal"),  # k == J
    (3, 300, 50, "equal"),  # the whole row ties: the buffer overflows, kernel 4 reads the row
], ids=lambda v: str(v))
def test_topk_matches_reference(rows, cols, k, kind, mode):
    scores, lengths = make_rows(rows * cols + k, rows, cols, kind, DEVICE)
    assert torch.equal(run(scores, lengths, k, tuning=mode), reference(scores, lengths, k))


@pytest.mark.parametrize("capacity", [0, 9])
def test_topk_small_buffer_is_exact(capacity, split_mode):
    """Rows whose candidates overflow the buffer are selected from the row itself, with the same result."""
    scores, lengths = make_rows(11, 3, 203, "ties", DEVICE)
    ws = topk_workspace(3, 203, 12, scores.device, capacity=capacity, tuning=split_mode)
    assert torch.equal(run(scores, lengths, 12, workspace=ws, tuning=split_mode), reference(scores, lengths, 12))


@pytest.mark.parametrize("select", [16, 1024])
def test_topk_select_in_registers_or_looped(select, split_mode):
    """Phase D holds up to SELECT buffered candidates in registers and loops over a bigger buffer: both exact."""
    tuning = replace(split_mode, select_min=select, select_max=select)
    for seed, (rows, cols, k, kind) in enumerate(((2, 400, 9, "normal"), (3, 517, 40, "ties"), (1, 300, 1, "ties"),
                                                  (3, 100, 37, "band"))):
        scores, lengths = make_rows(seed, rows, cols, kind, DEVICE)
        assert torch.equal(run(scores, lengths, k, tuning=tuning), reference(scores, lengths, k)), (rows, cols, k, kind)


def test_topk_wide_keys(mode):
    """The k-th key's bisection (`keys.kth_key`: the row kernel's, over the whole key range, and phase D's over the
    buffered candidates' low 16 bits) on ties, a fine grid, keys from -max to +max with subnormals and signed zeros,
    and rows with fewer candidates than k (60 columns: under the interpreter they fit phase D's registers too)."""
    for seed, (rows, cols, k, kind) in enumerate(((2, 400, 9, "normal"), (3, 517, 40, "ties"), (2, 301, 17, "wide"),
                                                  (3, 60, 128, "wide"))):
        scores, lengths = make_rows(seed, rows, cols, kind, DEVICE)
        assert torch.equal(run(scores, lengths, k, tuning=mode), reference(scores, lengths, k)), (rows, cols, k, kind)


def test_topk_wrong_digit_counts_stay_inside_out():
    """Digit counts that break `first_digit_counted`'s contract (every key counted in the lowest digit) give wrong
    picks, but every store stays inside out: the rows around it keep their sentinels and the picks are -1 or columns.
    (All 60 keys land in phase D's registers, more than k of them above the threshold it finds.)"""
    tuning = split_variant("phased")
    rows, cols, k = 2, 60, 8
    scores = torch.randn(rows, cols, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    lengths = torch.full((rows,), cols, dtype=torch.int32, device=DEVICE)
    ws = topk_workspace(rows, cols, k, scores.device, capacity=200, tuning=tuning)
    topk_module.first_digit_counts(ws)[:, 0] = cols
    padded = torch.full((rows + 2, k), SENTINEL, dtype=torch.int32, device=DEVICE)
    topk_indices(scores, lengths, k, out=padded[1:-1], workspace=ws, first_digit_counted=True, tuning=tuning)
    assert bool((padded[0] == SENTINEL).all()) and bool((padded[-1] == SENTINEL).all())
    picks = padded[1:-1]
    assert bool(((picks >= -1) & (picks < cols)).all())


def test_topk_empty_rows_write_no_picks(mode):
    """Rows of length <= 0 (padding rows of a captured batch) pick nothing, and leave the workspace reusable."""
    scores = torch.randn(4, 300, device=DEVICE)
    lengths = torch.tensor([0, -5, 0, -1], dtype=torch.int32, device=DEVICE)
    ws = topk_workspace(4, 300, 8, DEVICE, tuning=mode)
    assert run(scores, lengths, 8, workspace=ws, tuning=mode).eq(-1).all()
    assert ws[:, :topk_module._HEADER].eq(0).all()


def test_topk_inf_and_signed_zero(mode):
    """-inf inside the length is no candidate; -0.0 ties +0.0 (lower column first); +inf ranks first."""
    inf = float("inf")
    row = [0.0, -inf, -0.0, 3.0, -inf, inf, 0.0, -1e38, -0.0, -inf, 3.0, -2.0, 0.0]
    scores = torch.tensor([row, row, [-inf] * len(row)], device=DEVICE)
    lengths = torch.tensor([13, 11, 13], dtype=torch.int32, device=DEVICE)
    for k in (1, 3, 5, 7, 12):
        assert torch.equal(run(scores, lengths, k, tuning=mode), reference(scores, lengths, k)), k
    assert run(scores, lengths, 4, tuning=mode)[2].eq(-1).all()  # an all -inf row picks nothing


def test_topk_workspace_reused(split_mode):
    """A workspace serves call after call: the histograms it needs zeroed are zero again afterwards."""
    ws = topk_workspace(3, 150, 20, DEVICE, tuning=split_mode)
    ws[:, topk_module._HEADER:] = 12345  # suffix rows and buffer need no zeros: each call writes them before reading
    for seed, kind in ((1, "ties"), (2, "normal"), (3, "equal")):
        scores, lengths = make_rows(seed, 3, 150, kind, DEVICE)
        assert torch.equal(run(scores, lengths, 20, workspace=ws, tuning=split_mode), reference(scores, lengths, 20))
        assert ws[:, :topk_module._HEADER].eq(0).all()


def first_digit_histograms(scores, lengths):
    """int32 [R, 256]: per row, how many candidates (columns < length, score not -inf) have each digit 1 of the
    sortable key (`topk.keys.sortable` >> 24, + 128): what phase A counts."""
    bits = scores.view(torch.int32)
    bits = torch.where(bits == -(2 ** 31), 0, bits)
    digit = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)) >> 24) + 128
    cols = torch.arange(scores.shape[1], device=scores.device)
    candidate = (cols < lengths.long().clamp(0, scores.shape[1])[:, None]) & (scores != float("-inf"))
    counts = torch.zeros(scores.shape[0], 256, dtype=torch.int64, device=scores.device)
    counts.scatter_add_(1, torch.where(candidate, digit, 0).long(), candidate.long())
    return counts.int()


@pytest.mark.parametrize("param", ["phased", "phased-behind"])
def test_topk_first_digit_counted_by_the_producer(param):
    """With digit 1 already counted into the workspace's histograms (`first_digit_counts`, as the indexer does at
    decode), the three remaining launches pick what four do, call after call on one workspace (phase B zeroes its
    chunk rows itself: they hold the previous call's suffix counts), and leave the histograms zero. Row kernel
    shapes refuse the flag."""
    tuning = split_variant(param)
    ws = topk_workspace(3, 150, 20, DEVICE, tuning=tuning)
    ws[:, topk_module._HEADER:] = 12345
    for seed, kind in ((1, "ties"), (2, "normal"), (3, "wide"), (4, "equal")):
        scores, lengths = make_rows(seed, 3, 150, kind, DEVICE)
        counts = topk_module.first_digit_counts(ws)
        assert counts.shape == (3, 256) and counts.eq(0).all()
        counts += first_digit_histograms(scores, lengths)
        got = topk_indices(scores, lengths, 20, workspace=ws, first_digit_counted=True, tuning=tuning)
        assert torch.equal(got, reference(scores, lengths, 20)), kind
        assert ws[:, :topk_module._HEADER].eq(0).all()
    by_row = replace(tuning, row_max_cols=1 << 30)
    assert topk_module.first_digit_counts(topk_workspace(3, 150, 20, DEVICE, tuning=by_row)) is None
    with pytest.raises(ValueError, match="take the row kernel"):
        topk_indices(scores, lengths, 20, first_digit_counted=True, tuning=by_row)
    with pytest.raises(ValueError, match="pass the workspace"):  # a fresh one would hold no counts
        topk_indices(scores, lengths, 20, first_digit_counted=True, tuning=tuning)
    with pytest.raises(ValueError, match="expected a bool"):
        topk_indices(scores, lengths, 20, workspace=ws, first_digit_counted=1, tuning=tuning)


def test_topk_bad_inputs(split_mode):
    scores, lengths = make_rows(0, 3, 40, "ties", DEVICE)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    good = dict(scores=scores, lengths=lengths, k=5, tuning=split_mode)
    bad = [
        (dict(scores=scores.half()), "scores: expected torch.float32"),
        (dict(scores=scores[0]), r"scores: expected torch.float32 \[\*, \*\]"),
        (dict(scores=scores.t().contiguous().t()), "scores: must be contiguous"),
        (dict(scores=scores.to("meta")), "scores: Triton kernels need a CUDA tensor"),
        (dict(lengths=lengths.to("meta")), f"lengths: on meta, expected {DEVICE}"),
        (dict(lengths=lengths.long()), "lengths: expected torch.int32 \\[3\\]"),
        (dict(lengths=lengths[:2]), "lengths: expected torch.int32 \\[3\\]"),
        (dict(k=0), "k: expected an int in 1..2048"),
        (dict(k=MAX_K + 1), "k: expected an int in 1..2048"),
        (dict(k=5.0), "k: expected an int"),
        (dict(k=True), "k: expected an int"),
        (dict(out=torch.empty(3, 5, dtype=torch.int64, device=DEVICE)), "out: expected torch.int32 \\[3, 5\\]"),
        (dict(out=torch.empty(3, 6, **i32)), "out: expected torch.int32 \\[3, 5\\]"),
        (dict(out=torch.empty(5, 3, **i32).t()), "out: must be contiguous"),
        (dict(out=torch.empty(3, 5, dtype=torch.int32, device="meta")), f"out: on meta, expected {DEVICE}"),
        (dict(workspace=torch.zeros(3, 100, **i32)), "workspace: expected int32 \\[3, >= "),
        (dict(workspace=torch.zeros(2, 5000, **i32)), "workspace: expected torch.int32 \\[3, \\*\\]"),
        (dict(workspace=torch.zeros(3, 5000, dtype=torch.int64, device=DEVICE)), "workspace: expected torch.int32"),
        (dict(workspace=torch.zeros(3, 10000, **i32)[:, ::2]), "workspace: must be contiguous"),
    ]
    for change, message in bad:
        args = {**good, **change}
        with pytest.raises(ValueError, match=message):
            topk_indices(args.pop("scores"), args.pop("lengths"), args.pop("k"), **args)
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        topk_workspace(3, 40, 5, "cpu", capacity=-1)


def test_topk_empty_shapes():
    out = run(torch.zeros(2, 0, device=DEVICE), torch.tensor([3, 0], dtype=torch.int32, device=DEVICE), 4)
    assert out.eq(-1).all()
    assert run(torch.zeros(0, 9, device=DEVICE), torch.zeros(0, dtype=torch.int32, device=DEVICE), 4).shape == (0, 4)


def test_topk_kernel_choice(monkeypatch):
    """Rows of up to `row_max_cols` columns, or `row_max_cols_many` with at least `row_many` rows, go to the row
    kernel; the rest to the split radix select's four launches (a host decision on the shape alone)."""
    launches = []

    class Spy:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, grid))

    monkeypatch.setattr(topk_module, "_topk_row_kernel", Spy("row"))
    monkeypatch.setattr(topk_module, "_topk_kernel", Spy("split"))
    tuning = tuning_for(torch.device(DEVICE))
    few, many, rows_many = tuning.row_max_cols, tuning.row_max_cols_many, tuning.row_many
    for rows, cols, want in ((1, few, "row"), (1, few + 1, "split"), (rows_many, many, "row"),
                             (rows_many - 1, many, "split"), (rows_many, many + 1, "split")):
        launches.clear()
        lengths = torch.full((rows,), cols, dtype=torch.int32, device=DEVICE)
        topk_indices(torch.zeros(rows, cols, device=DEVICE), lengths, 8)
        assert {name for name, _ in launches} == {want}, (rows, cols)
        assert len(launches) == (1 if want == "row" else 4)


def test_topk_row_kernel_needs_no_workspace():
    """A workspace for a shape the row kernel takes is int32 [R, 0]; the op accepts it, or none, or a split one."""
    scores, lengths = make_rows(3, 5, 300, "ties", DEVICE)
    ws = topk_workspace(5, 300, 9, DEVICE)
    tuning = tuning_for(torch.device(DEVICE))
    assert ws.shape == (5, 0) and topk_module._by_row(5, 300, tuning)
    for workspace in (ws, None, torch.zeros(5, 4000, dtype=torch.int32, device=DEVICE)):
        assert torch.equal(run(scores, lengths, 9, workspace=workspace), reference(scores, lengths, 9))
    assert topk_workspace(5, tuning.row_max_cols + 1, 9, DEVICE).shape[1] > topk_module._HEADER


def test_topk_splits_rows():
    """The interpreted cases above do split single rows across programs (and leave bigger batches whole)."""
    cpu = torch.device("cpu")
    assert topk_module._split(1, 300, cpu, tuning_for(cpu))[0] > 1
    assert topk_module._split(7, 201, cpu, tuning_for(cpu))[0] == 1


# --- GPU: V4 shapes (1M-token context at ratio 4) -----------------------------------------------------
CONTEXT = ModelGeometry.preset("flash").max_position // 4  # 262,144 candidates


@cuda
@pytest.mark.parametrize("preset", ["flash", "pro"])
@pytest.mark.parametrize("kind", ["normal", "ties", "equal"])
def test_topk_gpu_one_long_row(preset, kind):
    k = ModelGeometry.preset(preset).index_topk  # 512 / 1024
    scores, lengths = make_rows(5, 1, CONTEXT, kind, "cuda")
    lengths.fill_(CONTEXT)
    scores = torch.nan_to_num(scores, nan=0.0)
    assert torch.equal(run(scores, lengths, k), reference(scores, lengths, k))


@cuda
@pytest.mark.parametrize("rows,cols,k,kind", [
    (64, 32768, 512, "normal"), (64, 32768, 512, "ties"), (300, 65536, 1024, "normal"), (300, 20001, 512, "ties"),
    (7, CONTEXT, 1024, "normal"), (64, 16384, 512, "ties"), (128, 16000, 2048, "normal"), (2, 4096, 512, "equal"),
    (9, 3001, 1024, "ties"),
], ids=lambda v: str(v))
def test_topk_gpu_batches(rows, cols, k, kind):
    scores, lengths = make_rows(rows + k, rows, cols, kind, "cuda")  # mixed lengths, NaN past them
    assert torch.equal(run(scores, lengths, k), reference(scores, lengths, k))


@cuda
@pytest.mark.parametrize("rows,cols,k", [(1, CONTEXT, 512), (1, 4 * CONTEXT, 512), (64, 32768, 512),
                                         (3, CONTEXT, 1024), (128, 16384, 512), (1, 4096, 512)],
                         ids=lambda v: str(v))
def test_topk_gpu_repeated_calls(rows, cols, k):
    """100 calls on one workspace, new scores each time: a phase that read another's data before it was complete
    would show as a wrong set."""
    ws = topk_workspace(rows, cols, k, "cuda")
    out = torch.empty(rows, k, dtype=torch.int32, device="cuda")
    lengths = torch.full((rows,), cols, dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(rows + cols)
    for i in range(100):
        scores = torch.randn(rows, cols, generator=g, device="cuda")
        if i % 3 == 1:
            scores = (scores * 8).round()  # exact ties at the threshold
        topk_indices(scores, lengths, k, out=out, workspace=ws)
        assert torch.equal(out, reference(scores, lengths, k)), i
    assert ws[:, :topk_module._HEADER].eq(0).all()


@cuda
@pytest.mark.parametrize("rows,cols,k", [(1, CONTEXT, 512), (64, 32768, 512), (9, 70001, 1024)], ids=lambda v: str(v))
def test_topk_gpu_warp_counts(rows, cols, k):
    """Phases A and B counting digits by warp (match.any + red into the workspace): the reference's index sets on
    scores where a warp's lanes mostly share a digit (integers, one value) and where they rarely do, call after call
    on one workspace whose suffix rows start as junk."""
    ws = topk_workspace(rows, cols, k, "cuda")
    ws[:, topk_module._HEADER:] = 12345  # phases A and B zero the rows they count into; the rest is written first
    for i, kind in enumerate(("normal", "ties", "equal", "wide", "normal", "ties")):
        scores, lengths = make_rows(100 + i, rows, cols, kind, "cuda")
        want = reference(scores, lengths, k)
        assert torch.equal(run(scores, lengths, k, workspace=ws), want), kind
        assert ws[:, :topk_module._HEADER].eq(0).all()


@cuda
@pytest.mark.parametrize("rows,cols", [(1, CONTEXT), (64, 32768), (1, 1 << 20)], ids=["small", "big", "big-1M"])
def test_topk_gpu_first_digit_counted(rows, cols):
    """Three launches after a producer's digit-1 counts, at both GPU tilings (the big one, from 2^20 scores, loads no
    tile ahead): the picks of the reference, call after call on one workspace, its header left zero."""
    k = 512
    ws = topk_workspace(rows, cols, k, "cuda")
    for i, kind in enumerate(("normal", "ties", "wide")):
        scores, lengths = make_rows(200 + i, rows, cols, kind, "cuda")
        topk_module.first_digit_counts(ws).add_(first_digit_histograms(scores, lengths))
        got = topk_indices(scores, lengths, k, workspace=ws, first_digit_counted=True)
        assert torch.equal(got, reference(scores, lengths, k)), kind
        assert ws[:, :topk_module._HEADER].eq(0).all()


@cuda
@pytest.mark.parametrize("rows,cols", [(5, CONTEXT), (64, 16384), (3, 4000)], ids=["split", "row-many", "row"])
def test_topk_gpu_graph_replay(rows, cols):
    """Captured once with preallocated out and workspace, replayed over new scores and lengths."""
    k = 512
    scores, lengths = make_rows(1, rows, cols, "normal", "cuda")
    out = torch.full((rows, k), SENTINEL, dtype=torch.int32, device="cuda")
    ws = topk_workspace(rows, cols, k, "cuda")
    topk_indices(scores, lengths, k, out=out, workspace=ws)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_indices(scores, lengths, k, out=out, workspace=ws)
    for seed, kind in ((2, "ties"), (3, "normal"), (4, "equal")):
        new_scores, new_lengths = make_rows(seed, rows, cols, kind, "cuda")
        scores.copy_(new_scores)
        lengths.copy_(new_lengths)
        out.fill_(SENTINEL)
        graph.replay()
        assert torch.equal(out, reference(scores, lengths, k)), kind
