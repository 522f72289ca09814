"""DSV4Attention on the Triton kernels against the same layer on the PyTorch reference, and the CUDA-graph
decode step (DecodeGraph) against eager steps.

On the CPU the kernels run under Triton's interpreter (small sizes); the DecodeGraph tests need a GPU.
"""

import random

import pytest
import torch
from schedules import random_steps

from dsv4kv import CacheManager, ModelGeometry
from dsv4kv.model.graph import DecodeGraph
from dsv4kv.model.layer import DSV4Attention, init_random_weights
from dsv4kv.ops.shared import launch

TINY = ModelGeometry.preset("tiny")  # layers: 0 window, 1 CSA m=4, 2 HCA m=16, 3 CSA; window 16
PAGE = 128
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Per output row, max |triton - torch| / max |torch row|: the kernels sum in another order (and attention
# multiplies probabilities in bf16), so rows differ by a few bf16 ulps of the row's scale.
ROW_TOL = 2e-2


def layer_pair(index: int, seed: int = 0):
    torch_layer = init_random_weights(DSV4Attention(TINY, index, device=DEVICE), seed)
    torch_layer.backend = "torch"
    triton_layer = DSV4Attention(TINY, index, device=DEVICE, backend="triton")
    triton_layer.load_state_dict(torch_layer.state_dict())
    return torch_layer, triton_layer


def make_cache(kv_format, indexer_format):
    return CacheManager(TINY, max_requests=3, max_tokens=700, kv_format=kv_format, indexer_format=indexer_format,
                        page_tokens=PAGE, poison=True, device=DEVICE)


CASES = [(0, ("fp8", "mxfp4")), (0, ("bf16", "bf16")), (2, ("fp8", "mxfp4")), (2, ("bf16", "bf16")),
         (1, ("fp8", "mxfp4")), (1, ("fp8", "fp8")), (1, ("bf16", "bf16"))]


@pytest.mark.parametrize("index,formats", CASES)
def test_kernels_match_the_reference_layer(index, formats):
    """Same weights, same chunked multi-request schedule (padded persistent plans for the kernels): the window
    rings end bit-identical, the compressor state equal up to the rounding of differently shaped fp32 GEMMs
    (the kernels run the padded rows too), outputs within ROW_TOL of each row's max."""
    torch_layer, triton_layer = layer_pair(index)
    caches = [make_cache(*formats) for _ in range(2)]
    rids = [[c.admit() for _ in range(2)] for c in caches]
    buffers = caches[1].step_buffers(max_tokens=32, max_requests=3, max_seq_len=128)
    gen = torch.Generator().manual_seed(index)
    worst = 0.0
    for step in random_steps(index, (45, 30), chunks=(1, 2, 7, 23)):
        x = torch.randn(sum(n for _, n in step), TINY.hidden_size, generator=gen).to(torch.bfloat16).to(DEVICE)
        want = torch_layer(x, caches[0].plan_step([(rids[0][i], n) for i, n in step]), caches[0])
        plan = caches[1].plan_step([(rids[1][i], n) for i, n in step], buffers=buffers)
        got = triton_layer(x, plan, caches[1])
        assert got.shape == want.shape and torch.isfinite(got).all()
        worst = max(worst, float(((got.float() - want.float()).abs().amax(-1) / want.float().abs().amax(-1)).max()))
    assert worst <= ROW_TOL, worst
    mine, theirs = caches[1].pools.layers[index], caches[0].pools.layers[index]
    assert torch.equal(mine.window, theirs.window)
    for a, b in ((mine.state_kv, theirs.state_kv), (mine.state_score, theirs.state_score),
                 (mine.index_state_kv, theirs.index_state_kv), (mine.index_state_score, theirs.index_state_score)):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_decode_steps_append_the_window_beside_attention(monkeypatch, index):
    """With one row per request, the window append runs before attention in program order (beside it on a GPU's side
    stream): the ring entry each row overwrites, position p - window, is outside that row's window. Past the window
    (16 tokens), decode steps still match the reference layer, and a step where a request brings 3 rows (whose
    appends would overwrite entries its own earlier rows read) keeps the append after attention. Rings bit for bit.
    On a GPU the early append is queued on the side stream, attention on the main one."""
    from dsv4kv.ops import kernels
    calls, streams = [], []
    for name in ("append_window", "sparse_attention_paged"):
        original = getattr(kernels, name)

        def spy(*a, _f=original, _n=name, **kw):
            calls.append(_n)
            streams.append(torch.cuda.current_stream() if DEVICE == "cuda" else None)
            return _f(*a, **kw)
        monkeypatch.setattr(kernels, name, spy)
    torch_layer, triton_layer = layer_pair(index, seed=3)
    caches = [make_cache("fp8", "mxfp4") for _ in range(2)]
    rids = [[c.admit() for _ in range(2)] for c in caches]
    buffers = caches[1].step_buffers(max_tokens=40, max_requests=3, max_seq_len=128)
    gen = torch.Generator().manual_seed(index)
    steps = [[(0, 21), (1, 17)]] + [[(0, 1), (1, 1)]] * 3 + [[(0, 3), (1, 1)]] + [[(1, 1), (0, 1)]] * 2
    for step in steps:
        x = torch.randn(sum(n for _, n in step), TINY.hidden_size, generator=gen).to(torch.bfloat16).to(DEVICE)
        want = torch_layer(x, caches[0].plan_step([(rids[0][i], n) for i, n in step]), caches[0])
        calls.clear()
        streams.clear()
        got = triton_layer(x, caches[1].plan_step([(rids[1][i], n) for i, n in step], buffers=buffers), caches[1])
        decode = all(n == 1 for _, n in step)
        assert calls == (["append_window", "sparse_attention_paged"] if decode
                         else ["sparse_attention_paged", "append_window"]), (step, calls)
        assert (streams[0] != streams[1]) == (decode and DEVICE == "cuda"), (step, streams)
        error = (got.float() - want.float()).abs().amax(-1) / want.float().abs().amax(-1)
        assert float(error.max()) <= ROW_TOL, (step, error)
        assert torch.equal(caches[1].pools.layers[index].window, caches[0].pools.layers[index].window), step


def test_indexer_pair_first_kernel_always_launches(monkeypatch):
    """The indexer compress goes first in its pair with the query (`schedules._csa`, `launch_next`; the query
    waits last, `wait_late`, on it), so it must launch on every step: an exact-size decode plan whose step completes no
    entry has no entry slot, and the compress then launches one program that returns (under the interpreter, where the
    PDL calls are plain functions, seen here: it waits, then lets the query in). Outputs match the reference."""
    from dsv4kv.ops import kernels
    from dsv4kv.ops.compress import kernel as compress_module
    calls, events = [], []
    for name in ("compress_insert", "indexer_query_and_weights"):
        original = getattr(kernels, name)

        def spy(*a, _f=original, _n=name, **kw):
            if _n == "indexer_query_and_weights" or not kw["main"]:  # the indexer's compress, not the main one
                calls.append((_n, kw.get("launch_next", False), kw.get("wait_late", False)))
            return _f(*a, **kw)
        monkeypatch.setattr(kernels, name, spy)
    if DEVICE == "cpu":
        monkeypatch.setattr(compress_module, "let_next_grid_launch", lambda: events.append("launch"))
    torch_layer, triton_layer = layer_pair(1, seed=5)
    caches = [make_cache("fp8", "mxfp4") for _ in range(2)]
    rids = [c.admit() for c in caches]
    buffers = caches[1].step_buffers(max_tokens=24, max_requests=3, max_seq_len=128)
    gen = torch.Generator().manual_seed(5)
    seen = set()
    for n, padded in [(21, True)] + [(1, False)] * 4 + [(1, True)] * 2:  # decode positions 21..26: entry 5 at 23
        x = torch.randn(n, TINY.hidden_size, generator=gen).to(torch.bfloat16).to(DEVICE)
        want = torch_layer(x, caches[0].plan_step([(rids[0], n)]), caches[0])
        plan = caches[1].plan_step([(rids[1], n)], buffers=buffers if padded else None)
        slots = plan.entries[TINY.layers[1].ratio].slots.shape[0]
        calls.clear()
        events.clear()
        got = triton_layer(x, plan, caches[1])
        assert calls == [("compress_insert", True, False), ("indexer_query_and_weights", False, True)], calls
        if DEVICE == "cpu":  # the indexer compress's programs (the main compress runs plain: no launch_next)
            assert events and set(events) == {"launch"} and (slots > 0 or len(events) == 1), (n, padded, events)
        seen.add((padded, slots > 0))
        error = (got.float() - want.float()).abs().amax(-1) / want.float().abs().amax(-1)
        assert float(error.max()) <= ROW_TOL, (n, error)
    assert seen == {(True, True), (False, False), (False, True)}, seen


def test_backend_choice_and_bad_input():
    layer = DSV4Attention(TINY, 0, dtype=torch.float32)
    assert layer.resolved_backend(torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="backend"):
        layer.backend = "cuda"
    layer.backend = "triton"
    cache = CacheManager(TINY, max_requests=1, max_tokens=64, page_tokens=PAGE, kv_format="bf16",
                         indexer_format="bf16")
    rid = cache.admit()
    plan = cache.plan_step([(rid, 3)])
    with pytest.raises(ValueError, match="bf16 activations|CUDA"):
        layer(torch.zeros(3, TINY.hidden_size), plan, cache)
    assert not cache.layer_has_run(0)  # refused before anything ran
    with pytest.raises(ValueError, match="CUDA cache"):
        DecodeGraph([DSV4Attention(TINY, 0)], cache, batch=2)


@cuda
@pytest.mark.parametrize("switch", ["side stream", "dependent launch"])
def test_step_overlap_changes_no_byte(monkeypatch, switch):
    """The tiny model's 4 layers chained, with the side stream (`Schedule.side_stream`) and without, or with
    programmatic dependent launch (`launch.dependent_launch`) and without, over the same random prefill / decode
    schedule on twin caches: every output and every cache tensor equal bit for bit (a missing event between the
    streams, or a kernel touching memory before its grid-dependency wait, would let a kernel read bytes before or
    after their writer)."""
    import dataclasses

    from dsv4kv.model import streams
    from dsv4kv.ops.shared.common import hopper_or_later
    assert streams.StepStreams(torch.device("cuda")).enabled
    if switch == "dependent launch" and not hopper_or_later(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs sm_90 or later; older GPUs launch plainly either way")
    assert launch.launch_options(torch.device("cuda")) == {"launch_pdl": True}
    layers = [init_random_weights(DSV4Attention(TINY, i, device="cuda", backend="triton"), i) for i in range(4)]
    caches = [CacheManager(TINY, max_requests=4, max_tokens=1200, page_tokens=PAGE, poison=True, device="cuda")
              for _ in range(2)]
    rids = [[c.admit() for _ in range(3)] for c in caches]
    gen = torch.Generator(device="cuda").manual_seed(5)
    for step in random_steps(5, (300, 41, 170), chunks=(1, 1, 1, 9, 64)):
        x = torch.randn(sum(n for _, n in step), TINY.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        outs = []
        for on, cache, ids in zip((True, False), caches, rids):
            if switch == "side stream":
                for layer in layers:
                    layer.schedule = dataclasses.replace(layer.schedule, side_stream=on)
                outs.append(chain(layers, x, cache.plan_step([(ids[i], n) for i, n in step]), cache))
            else:
                with launch.dependent_launch(on):
                    outs.append(chain(layers, x, cache.plan_step([(ids[i], n) for i, n in step]), cache))
        assert torch.equal(outs[0], outs[1])
    for mine, theirs in zip(caches[0].pools.layers, caches[1].pools.layers):
        for field in dataclasses.fields(mine):
            a, b = getattr(mine, field.name), getattr(theirs, field.name)
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), field.name


def test_q_rope_dims_only_changes_no_byte():
    """`Schedule.rope_dims_only`: every layer kind with the q RoPE writing the rope dims only (attention reading the
    others from the unroped q) and with a whole roped copy of q, over a prefill chunk next to a decode row, then a
    decode step, on twin caches: outputs equal bit for bit."""
    import dataclasses

    from dsv4kv.geometry import LayerKind
    layers = [init_random_weights(DSV4Attention(TINY, i, device=DEVICE, backend="triton"), i) for i in range(3)]
    caches = [make_cache("fp8", "mxfp4") for _ in range(2)]
    rids = [[c.admit() for _ in range(2)] for c in caches]
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    for step in ([(0, 37), (1, 20)], [(0, 1), (1, 19)], [(0, 1), (1, 1)]):
        x = torch.randn(sum(n for _, n in step), TINY.hidden_size, generator=gen, device=DEVICE).to(torch.bfloat16)
        outs = []
        for kinds, cache, ids in zip((frozenset(LayerKind), frozenset()), caches, rids):
            for layer in layers:
                layer.schedule = dataclasses.replace(layer.schedule, rope_dims_only=kinds)
            outs.append(chain(layers, x, cache.plan_step([(ids[i], n) for i, n in step]), cache))
        assert torch.equal(outs[0], outs[1])


def test_side_stream_is_off_without_cuda():
    """On the CPU (the interpreter) the streams are no-ops: the kernels run in the order written."""
    from dsv4kv.model.streams import StepStreams
    streams = StepStreams(torch.device("cpu"))
    assert not streams.enabled and streams.side_mark() is None and streams.main_mark() is None
    streams.fork()
    with streams.on_side():
        streams.side_waits(None)
        streams.main_waits(None)
    streams.join()


def plan_of(layer, plan, cache):
    """The layer's attention plan over `plan` on the kernels, built anew (the switches below change between builds)."""
    plan.layer_plans.clear()
    return layer.attention_plan(plan, cache.pages(layer.layer_index), "triton")


def test_attention_plan_indexer_fp8_is_the_scores_choice(monkeypatch):
    """`AttentionPlan.indexer_fp8` (what the bench reports, and when the layer makes the query's FP8 operand): CSA
    layers with MXFP4 keys on decode steps (the row kernel) and prefill steps (the stacked kernel), unless the
    indexer's tuning turns its FP8 MMAs off; not FP8 keys, or layers without an indexer."""
    import dataclasses

    from dsv4kv.ops.indexer import tuning as indexer_tuning
    plain = {arch: dataclasses.replace(config, fp8_mma=False) for arch, config in indexer_tuning.TUNING.items()}
    window, csa = DSV4Attention(TINY, 0), DSV4Attention(TINY, 1)
    for indexer_format, want in (("mxfp4", True), ("fp8", False)):
        cache = make_cache("fp8", indexer_format)
        rid = cache.admit()
        prefill = cache.plan_step([(rid, 40)])
        assert plan_of(csa, prefill, cache).indexer_fp8 == want and not plan_of(window, prefill, cache).indexer_fp8
        with monkeypatch.context() as patch:
            patch.setattr(indexer_tuning, "TUNING", plain)
            assert not plan_of(csa, prefill, cache).indexer_fp8
        decode = cache.plan_step([(rid, 1)])
        assert plan_of(csa, decode, cache).indexer_fp8 == want and not plan_of(window, decode, cache).indexer_fp8


def test_attention_plan_counts_digit_is_the_steps_choice(monkeypatch):
    """`AttentionPlan.counts_digit` (what the bench reports): CSA decode steps whose top-k takes the split kernel; not
    prefill steps (the stacked scores kernel), rows the top-k row kernel takes, or layers without an indexer. The
    layer's step then launches top-k three times, else four (or once: the row kernel)."""
    import dataclasses

    from dsv4kv.ops.topk import tuning as topk_tuning
    window, csa = DSV4Attention(TINY, 0), DSV4Attention(TINY, 1)
    cache = make_cache("fp8", "mxfp4")
    rid = cache.admit()
    assert not plan_of(csa, cache.plan_step([(rid, 40)]), cache).counts_digit
    decode = cache.plan_step([(rid, 1)])
    assert not plan_of(csa, decode, cache).counts_digit  # 16 score columns: the top-k row kernel
    split = {arch: dataclasses.replace(config, row_max_cols=0) for arch, config in topk_tuning.TUNING.items()}
    monkeypatch.setattr(topk_tuning, "TUNING", split)
    assert plan_of(csa, decode, cache).counts_digit and not plan_of(window, decode, cache).counts_digit


# --- CUDA graphs --------------------------------------------------------------------------------------
def chain(layers, x, plan, cache):
    for layer in layers:
        x = x + layer(x, plan, cache)
    return x


def run_decode_graph(geometry, *, batch, prompts, steps, page_tokens, max_seq_len, seed=0, formats=("fp8", "mxfp4")):
    """Prefill `prompts`, then decode `steps` steps through a DecodeGraph and, on a twin cache, eagerly over the
    same padded plans (the graph with programmatic dependent launch, the eager steps without); requests leave and
    join on the way. Returns the per-step max |graph - eager| and stats."""
    torch.manual_seed(seed)
    layers = [init_random_weights(DSV4Attention(geometry, i, device="cuda", backend="triton"), seed + i)
              for i in range(geometry.num_layers)]
    caches = [CacheManager(geometry, max_requests=batch + 2, max_tokens=(len(prompts) + 2) * max_seq_len,
                           kv_format=formats[0], indexer_format=formats[1], page_tokens=page_tokens, poison=True,
                           device="cuda", max_seq_len=max_seq_len) for _ in range(2)]
    graph = DecodeGraph(layers, caches[0], batch=batch, max_seq_len=max_seq_len)
    eager_buffers = caches[1].step_buffers(max_tokens=batch, max_requests=batch, max_seq_len=max_seq_len)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rng = random.Random(seed)

    def admit(n):
        ids = [c.admit() for c in caches]
        x = torch.randn(n, geometry.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        for c, rid in zip(caches, ids):  # the same eager prefill into both caches
            chain(layers, x, c.plan_step([(rid, n)]), c)
        return ids

    live = [admit(n) for n in prompts]
    diffs, blocks_taken, entries_completed, replay_alloc = [], 0, 0, []
    for step in range(steps):
        if step % 7 == 6 and len(live) > 1:  # a request leaves; another joins with a fresh prompt
            gone = live.pop(rng.randrange(len(live)))
            for c, rid in zip(caches, gone):
                c.release(rid)
            live.append(admit(rng.choice(prompts)))
        active = live[:batch]
        x = torch.randn(len(active), geometry.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        used = caches[0].num_used_blocks
        lengths = [caches[0].length(ids[0]) for ids in active]
        entries_completed += sum((n + 1) // m - n // m for n in lengths for m in geometry.ratios)
        before = torch.cuda.memory_allocated()
        got = graph.step([(ids[0], 1) for ids in active], x).clone()
        if graph.steps > 2:
            replay_alloc.append(torch.cuda.memory_allocated() - before)
        blocks_taken += caches[0].num_used_blocks - used
        plan = caches[1].plan_step([(ids[1], 1) for ids in active], buffers=eager_buffers)
        padded = torch.cat((x, x.new_zeros(batch - len(active), x.shape[1])))
        with launch.dependent_launch(False):  # the graph's kernels wait on each other's grids; the eager ones launch plainly
            want = chain(layers, padded, plan, caches[1])[:len(active)]
        diffs.append(float((got.float() - want.float()).abs().max()))
    return diffs, blocks_taken, entries_completed, replay_alloc, graph


@cuda
def test_decode_graph_replays_equal_eager_steps_tiny():
    """All 4 tiny layers, capture size 8, 6 live requests: 48 replayed steps equal eager steps bit for bit,
    while windows complete (CSA every 4 tokens, HCA every 16) and requests cross pages (new blocks)."""
    diffs, blocks, entries, alloc, graph = run_decode_graph(TINY, batch=8, prompts=(120, 125, 3, 60, 127, 14),
                                                            steps=48, page_tokens=PAGE, max_seq_len=256)
    assert graph.graph is not None and graph.steps == 48
    assert blocks > 0 and entries > 0
    assert max(diffs) == 0.0, diffs
    assert all(a <= 0 for a in alloc), alloc  # replays allocate nothing (block-table updates are planned before)


@cuda
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_graph_replays_equal_eager_steps_flash(batch):
    """Every layer of the V4-Flash geometry (43, projections included), random weights, pages of 256 tokens."""
    flash = ModelGeometry.preset("flash")
    prompts = (250, 1021, 130, 509, 2047, 767, 300, 1500)[:max(batch - 1, 1)]
    diffs, blocks, entries, alloc, _ = run_decode_graph(flash, batch=batch, prompts=prompts, steps=24,
                                                        page_tokens=256, max_seq_len=4096)
    assert entries > 0
    assert max(diffs) == 0.0, diffs
    assert all(a <= 0 for a in alloc), alloc


def test_a_step_plan_is_freed_when_dropped():
    """The attention plans a step's layers share (`StepPlan.layer_plans`) do not point back at the step: a dropped plan
    and its tensors (RoPE tables, top-k's workspace) go at once, without the cycle collector; every layer of a kind
    reads the same tensors, and the reference's plan is one per step for every kind."""
    import gc
    import weakref

    # the layers run the reference (one plan of its own), the kernels' plans are made below on any device
    layers = [init_random_weights(DSV4Attention(TINY, i, device=DEVICE, backend="torch"), i) for i in range(3)]
    cache = make_cache("fp8", "mxfp4")
    rid = cache.admit()
    gc.disable()
    try:
        plan = cache.plan_step([(rid, 20)])
        x = torch.randn(20, TINY.hidden_size, generator=torch.Generator().manual_seed(7)).to(DEVICE, torch.bfloat16)
        for layer in layers:
            layer(x, plan, cache)
        kernel = [layer.attention_plan(plan, cache.pages(layer.layer_index), "triton") for layer in layers]
        again = layers[1].attention_plan(plan, cache.pages(1), "triton")
        assert again.topk_workspace is kernel[1].topk_workspace and again.step is plan
        assert len({id(p.step) for p in kernel}) == 1 and kernel[0].kind is not kernel[1].kind
        assert all(p.row_slots is kernel[0].row_slots for p in kernel)
        assert TINY.layers[1].rope == TINY.layers[2].rope and kernel[1].cos_sin is kernel[2].cos_sin
        assert len([key for key in plan.layer_plans if key[0] == "torch"]) == 1
        step, workspace = weakref.ref(plan), weakref.ref(kernel[1].topk_workspace)
        del plan, kernel, again
        assert step() is None and workspace() is None
    finally:
        gc.enable()
