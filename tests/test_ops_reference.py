"""Reference ops of the attention path (append, compress, gather, indexer, attention) against naive
per-token / per-entry implementations written here from the documented math, over multi-request,
randomly chunked schedules on a NaN-poisoned cache."""

import math
import random

import pytest
import torch

from dsv4kv import CacheManager, ModelGeometry
from dsv4kv.ops.compress.reference import append_state, compressor_logits
from dsv4kv.ops.window.reference import append_window
from dsv4kv.ops.attention.reference import sparse_attention
from dsv4kv.ops.shared.rows import entry_slots, step_rows
from dsv4kv.ops.compress.reference import compress_and_insert, pool_entries
from dsv4kv.ops.attention.gather import gather_entries, gather_window, visible_entries
from dsv4kv.ops.indexer.reference import indexer_query, indexer_topk
from dsv4kv.ops.rope.reference import apply_rope

TINY = ModelGeometry.preset("tiny")  # layers: 0 window, 1 CSA m=4, 2 HCA m=16, 3 CSA; window 16
PAGE = 128  # small pages: requests span several, non-contiguous blocks
CHUNKS = (1, 3, 5, 17, 40)


# --- helpers ----------------------------------------------------------------------------------------
def gen(seed):
    return torch.Generator().manual_seed(seed)


def same_bits(a, b):
    """Bitwise equality of two tensors of one dtype (NaN == NaN when the bits agree)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


def make_cache(kv_format="bf16", indexer_format="bf16", max_requests=4, max_tokens=600, **kw):
    return CacheManager(TINY, max_requests=max_requests, max_tokens=max_tokens, kv_format=kv_format,
                        indexer_format=indexer_format, page_tokens=PAGE, poison=True, **kw)


def admit_requests(cache, count):
    """`count` request ids on non-trivial slots: a dummy request holds slot 0 and is released, so slot 0
    stays unused (its state must never be touched) and the live slots are 1.."""
    dummy = cache.admit()
    rids = [cache.admit() for _ in range(count)]
    cache.release(dummy)
    return rids


def schedule(seed, lengths, chunks=CHUNKS):
    """Random steps feeding every request its full length: lists of (request number, new tokens)."""
    rng = random.Random(seed)
    remaining, steps = list(lengths), []
    while any(remaining):
        active = [i for i, r in enumerate(remaining) if r]
        chosen = rng.sample(active, rng.randint(1, len(active)))
        step = []
        for i in chosen:
            n = min(remaining[i], rng.choice(chunks))
            step.append((i, n))
            remaining[i] -= n
        steps.append(step)
    return steps


def poison_state(cache, layer, slots):
    lc = cache.pools.layers[layer]
    for t in (lc.state_kv, lc.state_score, lc.index_state_kv, lc.index_state_score):
        if t is not None:
            t[slots] = float("nan")


def entry_slot(cache, rid, j, m):
    """Pool slot of entry j of ratio m, from the request's block list (docs: block * P/m + (j*m % P)/m)."""
    token = j * m
    return cache.blocks(rid)[token // PAGE] * (PAGE // m) + (token % PAGE) // m


def entry_bytes_at(pool, layout, entries, slot):
    """Data and scale bytes of one entry, addressed by hand from the page format (data rows, then scale rows)."""
    page, off = divmod(slot, entries)
    data = pool[page, off * layout.data_bytes:(off + 1) * layout.data_bytes]
    base = entries * layout.data_bytes
    scale = pool[page, base + off * layout.scale_bytes:base + (off + 1) * layout.scale_bytes]
    return data, scale


# --- sparse attention ---------------------------------------------------------------------------------
def naive_attention(q, keys, valid, sinks, scale):
    n, heads, dim = q.shape
    out = torch.zeros(n, heads, dim, dtype=torch.float64)
    q, keys, sinks = q.double(), keys.double(), sinks.double()
    for t in range(n):
        ks = [k for k in range(keys.shape[1]) if valid[t, k]]
        for h in range(heads):
            logits = [scale * float(torch.dot(q[t, h], keys[t, k])) for k in ks]
            top = max(logits + [float(sinks[h])])
            num = [math.exp(l - top) for l in logits]
            den = sum(num) + math.exp(float(sinks[h]) - top)
            for w, k in zip(num, ks):
                out[t, h] += (w / den) * keys[t, k]
    return out


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_matches_naive_softmax_with_sink(q_dtype):
    g = gen(3)
    n, heads, k, dim = 7, 3, 11, 37
    q = (torch.randn(n, heads, dim, generator=g) * 2).to(q_dtype)
    keys = torch.randn(n, k, dim, generator=g)
    valid = torch.rand(n, k, generator=g) < 0.6
    valid[2] = False  # no valid key: the sink takes all the weight
    valid[4] = True
    valid[5] = False
    valid[5, 7] = True  # a single key
    keys[~valid] = float("nan")  # must not leak
    sinks = torch.tensor([-1.5, 0.0, 4.0])  # the last one dominates some rows
    scale = dim ** -0.5
    before = keys.clone()
    got = sparse_attention(q, keys, valid, sinks, scale)
    assert got.dtype == torch.float32 and got.shape == (n, heads, dim)
    assert same_bits(keys, before), "keys must not be modified"
    assert torch.isfinite(got).all()
    assert torch.equal(got[2], torch.zeros(heads, dim))
    want = naive_attention(q.float(), keys, valid, sinks, scale)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_sparse_attention_extreme_logits_and_sink():
    """Large logits (overflow without the max shift) and a sink far above / below every logit."""
    g = gen(4)
    q = torch.randn(3, 2, 16, generator=g) * 30
    keys = torch.randn(3, 5, 16, generator=g) * 30
    valid = torch.ones(3, 5, dtype=torch.bool)
    sinks = torch.tensor([200.0, -200.0])
    got = sparse_attention(q, keys, valid, sinks, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), naive_attention(q, keys, valid, sinks, 1.0), atol=1e-5, rtol=1e-5)


def test_sparse_attention_rejects_bad_input():
    q, keys = torch.randn(4, 2, 8), torch.randn(4, 3, 8)
    valid, sinks = torch.ones(4, 3, dtype=torch.bool), torch.zeros(2)
    with pytest.raises(ValueError, match=r"q: expected a float tensor"):
        sparse_attention(q[0], keys, valid, sinks, 1.0)
    with pytest.raises(ValueError, match=r"q: expected a float tensor"):
        sparse_attention(q.long(), keys, valid, sinks, 1.0)
    with pytest.raises(ValueError, match=r"keys: expected a float tensor \[4, \*, 8\]"):
        sparse_attention(q, keys[:, :, :7], valid, sinks, 1.0)
    with pytest.raises(ValueError, match=r"keys: expected a float tensor"):
        sparse_attention(q, keys.int(), valid, sinks, 1.0)
    with pytest.raises(ValueError, match=r"valid must be bool \[4, 3\]"):
        sparse_attention(q, keys, valid.float(), sinks, 1.0)
    with pytest.raises(ValueError, match=r"valid must be bool"):
        sparse_attention(q, keys, valid[:, :2], sinks, 1.0)
    with pytest.raises(ValueError, match=r"sinks: expected a float tensor \[2\]"):
        sparse_attention(q, keys, valid, torch.zeros(3), 1.0)


# --- compressor logits and state append ---------------------------------------------------------------
def test_compressor_logits_per_token():
    g = gen(5)
    m, w = 4, 6
    gate = torch.randn(9, w, generator=g).to(torch.bfloat16)
    bias = torch.randn(m, w, generator=g)
    positions = torch.tensor([0, 1, 2, 3, 4, 7, 13, 130, 1031], dtype=torch.int32)
    got = compressor_logits(gate, bias, positions)
    assert got.dtype == torch.float32
    for t in range(9):
        p = int(positions[t])
        assert same_bits(got[t], gate[t].float() + bias[p % m])
    with pytest.raises(ValueError, match=r"compressor_logits: expected gate \[N, w\] and bias \[m, w\]"):
        compressor_logits(gate[:, :5], bias, positions)
    with pytest.raises(ValueError, match=r"compressor_logits"):
        compressor_logits(gate[0], bias, positions)
    with pytest.raises(ValueError, match=r"compressor_logits"):  # positions [1] must not broadcast over N rows
        compressor_logits(gate, bias, positions[:1])
    with pytest.raises(ValueError, match=r"compressor_logits"):
        compressor_logits(gate.long(), bias, positions)


@pytest.mark.parametrize("layer", [1, 2], ids=["csa", "hca"])
def test_append_state_keeps_last_rows_per_request(layer):
    cache = make_cache()
    lc = cache.pools.layers[layer]
    m = TINY.layers[layer].ratio
    ring, width = lc.state_kv.shape[1], lc.state_kv.shape[2]
    lengths = [130, 1, 75]
    rids = admit_requests(cache, 3)
    poison_state(cache, layer, [cache.slot(r) for r in rids])
    g = gen(6 + layer)
    kv_full = [torch.randn(n, width, generator=g) for n in lengths]
    gate_full = [torch.randn(n, width, generator=g) for n in lengths]
    bias = torch.randn(m, width, generator=g)
    done = [0] * 3
    for step in schedule(11 + layer, lengths):
        plan = cache.plan_step([(rids[i], n) for i, n in step])
        kv = torch.cat([kv_full[i][done[i]:done[i] + n] for i, n in step])
        gate = torch.cat([gate_full[i][done[i]:done[i] + n] for i, n in step])
        logits = compressor_logits(gate, bias, plan.positions)
        before_kv, before_score = lc.state_kv.clone(), lc.state_score.clone()
        append_state(lc.state_kv, lc.state_score, plan, kv, logits)
        for i, n in step:
            done[i] += n
        stepped = {cache.slot(rids[i]) for i, _ in step}
        for slot in range(cache.max_requests):
            if slot not in stepped:  # other slots: untouched, bit-exact
                assert same_bits(lc.state_kv[slot], before_kv[slot]) and same_bits(lc.state_score[slot], before_score[slot])
        for i, _ in step:
            slot, length = cache.slot(rids[i]), done[i]
            written = set()
            for p in range(max(0, length - ring), length):
                written.add(p % ring)
                assert same_bits(lc.state_kv[slot, p % ring], kv_full[i][p]), (i, p)
                assert same_bits(lc.state_score[slot, p % ring], gate_full[i][p] + bias[p % m]), (i, p)
            for r in set(range(ring)) - written:  # rows no position has reached yet
                assert same_bits(lc.state_kv[slot, r], before_kv[slot, r])
                assert same_bits(lc.state_score[slot, r], before_score[slot, r])


def test_append_state_rejects_bad_input():
    cache = make_cache()
    lc = cache.pools.layers[1]
    rid = cache.admit()
    plan = cache.plan_step([(rid, 5)])
    rows = torch.zeros(5, lc.state_kv.shape[2])
    with pytest.raises(ValueError, match=r"append_state: expected fp32 state"):
        append_state(lc.state_kv.double(), lc.state_score.double(), plan, rows, rows)
    with pytest.raises(ValueError, match=r"kv_rows: expected a float tensor \[5, 256\]"):
        append_state(lc.state_kv, lc.state_score, plan, rows[:4], rows)
    with pytest.raises(ValueError, match=r"kv_rows: expected a float tensor"):
        append_state(lc.state_kv, lc.state_score, plan, rows.long(), rows)
    with pytest.raises(ValueError, match=r"logit_rows: expected a float tensor \[5, 256\]"):
        append_state(lc.state_kv, lc.state_score, plan, rows, rows[:, :128])


# --- window ring --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_format,kv_dtype", [("bf16", torch.float32), ("fp8", torch.float32),
                                                ("fp8", torch.bfloat16)])
def test_window_gather_then_append(kv_format, kv_dtype):
    cache = make_cache(kv_format)
    window, layout = TINY.window, cache.spec.layers[0].main
    pool = cache.pools.layers[0].window
    lengths = [90, 7, 61]
    rids = admit_requests(cache, 3)
    buffers = cache.step_buffers(max_tokens=128, max_requests=4)  # padded plans: ops must cut the padding
    g = gen(21)
    kv_full = [(torch.randn(n, layout.dim, generator=g) * 2).to(kv_dtype) for n in lengths]
    stored = [torch.cat([layout.round_trip(kv_full[i][p:p + 1]) for p in range(n)]) for i, n in enumerate(lengths)]
    done = [0] * 3
    untouched_slot = pool[0].clone()
    for step in schedule(22, lengths):
        plan = cache.plan_step([(rids[i], n) for i, n in step], buffers=buffers)
        kv = torch.cat([kv_full[i][done[i]:done[i] + n] for i, n in step])
        # the layer's order: gather (reads the ring) before append (overwrites it)
        keys, valid = gather_window(pool, layout, window, plan, layout.round_trip(kv))
        append_window(pool, layout, window, plan, kv)
        assert keys.shape == (plan.num_tokens, window, layout.dim) and valid.dtype == torch.bool
        row = 0
        for i, n in step:
            for p in range(done[i], done[i] + n):
                for k in range(window):
                    q = p - window + 1 + k
                    assert bool(valid[row, k]) == (q >= 0)
                    if q >= 0:
                        assert same_bits(keys[row, k], stored[i][q]), (i, p, q)
                row += 1
            done[i] += n
    assert same_bits(pool[0], untouched_slot), "the unused slot's ring was written"
    # after the last step, each ring holds exactly the request's last `window` positions
    for i, rid in enumerate(rids):
        slot = cache.slot(rid)
        for p in range(max(0, lengths[i] - window), lengths[i]):
            got = layout.read(pool.view(-1, layout.page_bytes(window)), window, torch.tensor([slot * window + p % window]))
            assert same_bits(got[0], stored[i][p])


def test_window_rejects_bad_input():
    cache = make_cache()
    layout, pool = cache.spec.layers[0].main, cache.pools.layers[0].window
    plan = cache.plan_step([(cache.admit(), 3)])
    with pytest.raises(ValueError, match=r"step_kv: expected a float tensor \[3, 128\]"):
        gather_window(pool, layout, TINY.window, plan, torch.zeros(3, 64))
    with pytest.raises(ValueError, match=r"step_kv: expected a float tensor"):
        gather_window(pool, layout, TINY.window, plan, torch.zeros(3, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"kv: expected a float tensor \[3, 128\]"):
        append_window(pool, layout, TINY.window, plan, torch.zeros(4, 128))
    with pytest.raises(ValueError, match=r"kv: expected a float tensor"):
        append_window(pool, layout, TINY.window, plan, torch.zeros(3, 128, dtype=torch.uint8))


# --- compress and insert ------------------------------------------------------------------------------
def naive_pool(kv, logits, j, m, overlap):
    """Entry j from a request's full rows kv / logits [L, w], per channel softmax over its rows (fp64)."""
    if overlap:
        d = kv.shape[1] // 2
        vals, logs = [], []
        for p in range((j - 1) * m, j * m):  # previous block, low half; j = 0: weight 0, left out
            if p >= 0:
                vals.append(kv[p, :d])
                logs.append(logits[p, :d])
        for p in range(j * m, (j + 1) * m):  # own block, high half
            vals.append(kv[p, d:])
            logs.append(logits[p, d:])
    else:
        vals = [kv[p] for p in range(j * m, (j + 1) * m)]
        logs = [logits[p] for p in range(j * m, (j + 1) * m)]
    vals, logs = torch.stack(vals).double(), torch.stack(logs).double()
    top = logs.max(dim=0).values
    e = torch.exp(logs - top)
    return (e * vals).sum(dim=0) / e.sum(dim=0)


def finish_entry(pooled, j, m, weight, eps, rope, dtype):
    """RMSNorm (fp32, weighted), RoPE at j*m, round to dtype."""
    normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return apply_rope(normed, torch.tensor([j * m] * pooled.shape[0]), rope).to(dtype)


@pytest.mark.parametrize("kv_format,indexer_format,out_dtype", [("bf16", "bf16", torch.bfloat16),
                                                                ("fp8", "mxfp4", torch.bfloat16),
                                                                ("fp8", "fp8", torch.float32)])
def test_compress_and_insert_over_random_chunking(kv_format, indexer_format, out_dtype):
    cache = make_cache(kv_format, indexer_format, max_tokens=700)
    lengths = [203, 38, 130]
    rids = admit_requests(cache, 3)
    buffers = cache.step_buffers(max_tokens=128, max_requests=4)
    eps = TINY.rms_norm_eps
    g = gen(31)
    # (pool name, state names, layer, layout, overlap, row width)
    d_main, d_index = TINY.head_dim, TINY.index_head_dim
    targets = []
    for layer, pool_name, states, layout, overlap, d in [
            (1, "entries", ("state_kv", "state_score"), cache.spec.layers[1].main, True, d_main),
            (1, "index_keys", ("index_state_kv", "index_state_score"), cache.spec.layers[1].index, True, d_index),
            (2, "entries", ("state_kv", "state_score"), cache.spec.layers[2].main, False, d_main)]:
        w = 2 * d if overlap else d
        m = TINY.layers[layer].ratio
        targets.append(dict(
            layer=layer, pool=getattr(cache.pools.layers[layer], pool_name),
            state=tuple(getattr(cache.pools.layers[layer], s) for s in states), layout=layout, overlap=overlap,
            d=d, m=m, rope=TINY.layers[layer].rope,
            kv=[torch.randn(n, w, generator=g) for n in lengths],
            gate=[torch.randn(n, w, generator=g) * 2 for n in lengths],
            bias=torch.randn(m, w, generator=g),
            weight=(1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16),
            pooled={}, returned={}))
    for layer in (1, 2):
        poison_state(cache, layer, list(range(cache.max_requests)))  # a read of an unwritten row turns NaN
    done = [0] * 3
    for step in schedule(32, lengths):
        plan = cache.plan_step([(rids[i], n) for i, n in step], buffers=buffers)
        for t in targets:
            kv = torch.cat([t["kv"][i][done[i]:done[i] + n] for i, n in step])
            gate = torch.cat([t["gate"][i][done[i]:done[i] + n] for i, n in step])
            logits = compressor_logits(gate, t["bias"], plan.positions[:plan.num_tokens])
            writes = plan.entries[t["m"]]
            owners = [(step[int(b)][0], int(j)) for b, j in zip(writes.request[:writes.count], writes.index[:writes.count])]
            pooled = pool_entries(*t["state"], plan, kv, logits, ratio=t["m"], overlap=t["overlap"])
            entries = compress_and_insert(*t["state"], plan, kv, logits, ratio=t["m"], overlap=t["overlap"],
                                          norm_weight=t["weight"], eps=eps, rope=t["rope"], out_dtype=out_dtype,
                                          layout=t["layout"], pool=t["pool"], page_tokens=PAGE)
            assert pooled.shape == (len(owners), t["d"]) and entries.dtype == out_dtype
            for e, key in enumerate(owners):
                assert key not in t["pooled"], f"entry {key} written twice"
                t["pooled"][key], t["returned"][key] = pooled[e], entries[e]
            append_state(*t["state"], plan, kv, logits)
        for i, n in step:
            done[i] += n
    for t in targets:
        m, layout, entries_per_page = t["m"], t["layout"], PAGE // t["m"]
        expected_keys = {(i, j) for i, n in enumerate(lengths) for j in range(n // m)}
        assert set(t["pooled"]) == expected_keys
        logits_full = [t["gate"][i] + t["bias"][torch.arange(n) % m] for i, n in enumerate(lengths)]
        for (i, j), pooled in t["pooled"].items():
            want = naive_pool(t["kv"][i], logits_full[i], j, m, t["overlap"])
            torch.testing.assert_close(pooled.double(), want, atol=1e-6, rtol=1e-6)
            expected = finish_entry(pooled[None], j, m, t["weight"], eps, t["rope"], out_dtype)
            assert same_bits(t["returned"][(i, j)], expected[0])
            # and the naive pooling's entry agrees to the output dtype's precision
            naive_entry = finish_entry(want.float()[None], j, m, t["weight"], eps, t["rope"], out_dtype)
            torch.testing.assert_close(naive_entry.float(), expected.float(), atol=2e-2, rtol=1e-2)
            data, scales = layout.encode(expected)
            got_data, got_scales = entry_bytes_at(t["pool"], layout, entries_per_page, entry_slot(cache, rids[i], j, m))
            assert torch.equal(got_data, data[0]) and torch.equal(got_scales, scales[0]), (t["layer"], i, j)
        # nothing else in the pool was written: every other entry still reads NaN
        written = {entry_slot(cache, rids[i], j, m) for i, j in expected_keys}
        all_slots = torch.arange(t["pool"].shape[0] * entries_per_page)
        rest = torch.tensor(sorted(set(all_slots.tolist()) - written))
        assert torch.isnan(layout.read(t["pool"], entries_per_page, rest)).all(dim=1).all()


def test_compressed_entries_do_not_depend_on_chunking():
    """The same rows fed in different chunkings (one prefill; random chunks; token by token) store
    bit-identical entries."""
    lengths = [77, 40]
    g = gen(45)
    kv_full = [torch.randn(n, 256, generator=g) for n in lengths]
    gate_full = [torch.randn(n, 256, generator=g) for n in lengths]
    bias, weight = torch.randn(4, 256, generator=g), 1 + 0.1 * torch.randn(128, generator=g)
    stored = []
    for steps in ([[(0, 77), (1, 40)]], schedule(46, lengths), [[(0, 1), (1, 1)]] * 40 + [[(0, 1)]] * 37):
        cache = make_cache("fp8")
        lc, layout = cache.pools.layers[1], cache.spec.layers[1].main
        rids = admit_requests(cache, 2)
        done = [0, 0]
        for step in steps:
            plan = cache.plan_step([(rids[i], n) for i, n in step])
            kv = torch.cat([kv_full[i][done[i]:done[i] + n] for i, n in step])
            logits = compressor_logits(torch.cat([gate_full[i][done[i]:done[i] + n] for i, n in step]), bias,
                                       plan.positions)
            compress_and_insert(lc.state_kv, lc.state_score, plan, kv, logits, ratio=4, overlap=True,
                                norm_weight=weight, eps=1e-6, rope=TINY.layers[1].rope, out_dtype=torch.bfloat16,
                                layout=layout, pool=lc.entries, page_tokens=PAGE)
            append_state(lc.state_kv, lc.state_score, plan, kv, logits)
            for i, n in step:
                done[i] += n
        assert done == lengths
        stored.append([torch.cat(entry_bytes_at(lc.entries, layout, PAGE // 4, entry_slot(cache, rids[i], j, 4)))
                       for i, n in enumerate(lengths) for j in range(n // 4)])
    assert len(stored[0]) == 77 // 4 + 40 // 4
    for other in stored[1:]:
        assert len(other) == len(stored[0]) and all(torch.equal(a, b) for a, b in zip(stored[0], other))


def test_pool_entries_step_without_entries_and_decode():
    """A step completing no entry returns [0, d]; decode steps complete entries one at a time."""
    cache = make_cache()
    lc, layout = cache.pools.layers[2], cache.spec.layers[2].main
    rid = cache.admit()
    g = gen(41)
    kv_full, gate_full = torch.randn(20, 128, generator=g), torch.randn(20, 128, generator=g)
    bias = torch.zeros(16, 128)
    for p in range(20):
        plan = cache.plan_step([(rid, 1)])
        kv, logits = kv_full[p:p + 1], compressor_logits(gate_full[p:p + 1], bias, plan.positions)
        pooled = pool_entries(lc.state_kv, lc.state_score, plan, kv, logits, ratio=16, overlap=False)
        entries = compress_and_insert(lc.state_kv, lc.state_score, plan, kv, logits, ratio=16, overlap=False,
                                      norm_weight=torch.ones(128), eps=1e-6, rope=TINY.layers[2].rope,
                                      out_dtype=torch.bfloat16, layout=layout, pool=lc.entries, page_tokens=PAGE)
        assert pooled.shape == ((1, 128) if p == 15 else (0, 128)) and entries.shape == pooled.shape
        if p == 15:
            torch.testing.assert_close(pooled[0].double(), naive_pool(kv_full, gate_full, 0, 16, False),
                                       atol=1e-6, rtol=1e-6)
        append_state(lc.state_kv, lc.state_score, plan, kv, logits)


def test_compress_rejects_bad_input():
    cache = make_cache()
    lc, layout = cache.pools.layers[1], cache.spec.layers[1].main
    plan = cache.plan_step([(cache.admit(), 8)])
    rows = torch.zeros(8, 256)
    with pytest.raises(ValueError, match=r"kv_rows: expected a float tensor \[8, 256\]"):
        pool_entries(lc.state_kv, lc.state_score, plan, rows[:, :128], rows, ratio=4, overlap=True)
    with pytest.raises(ValueError, match=r"kv_rows: expected a float tensor"):
        pool_entries(lc.state_kv, lc.state_score, plan, rows.long(), rows, ratio=4, overlap=True)
    with pytest.raises(ValueError, match=r"logit_rows: expected a float tensor \[8, 256\]"):
        pool_entries(lc.state_kv, lc.state_score, plan, rows, rows[:7], ratio=4, overlap=True)
    with pytest.raises(ValueError, match=r"pool_entries: state shapes differ"):
        pool_entries(lc.state_kv, lc.state_score[:, :4], plan, rows, rows, ratio=4, overlap=True)
    with pytest.raises(ValueError, match=r"pool_entries: the plan has no entries of ratio 8"):
        pool_entries(lc.state_kv, lc.state_score, plan, rows, rows, ratio=8, overlap=True)
    with pytest.raises(ValueError, match=r"compress_and_insert: entry width 128, norm weight \[64\]"):
        compress_and_insert(lc.state_kv, lc.state_score, plan, rows, rows, ratio=4, overlap=True,
                            norm_weight=torch.ones(64), eps=1e-6, rope=TINY.layers[1].rope, out_dtype=torch.bfloat16,
                            layout=layout, pool=lc.entries, page_tokens=PAGE)


# --- gather entries -----------------------------------------------------------------------------------
def fill_entries(cache, layer, pool, layout, rids, seed):
    """Write a random value at every complete entry of every request; returns {(request number, j): value}."""
    m = TINY.layers[layer].ratio
    g = gen(seed)
    values = {}
    for i, rid in enumerate(rids):
        for j in range(cache.length(rid) // m):
            x = torch.randn(1, layout.dim, generator=g).to(torch.bfloat16)
            layout.write(pool, PAGE // m, torch.tensor([entry_slot(cache, rid, j, m)]), x)
            values[(i, j)] = x
    return values


@pytest.mark.parametrize("kv_format,layer", [("bf16", 1), ("fp8", 2)], ids=["bf16-csa", "fp8-hca"])
def test_visible_and_gather_entries(kv_format, layer):
    cache = make_cache(kv_format)
    m, layout, pool = TINY.layers[layer].ratio, cache.spec.layers[layer].main, cache.pools.layers[layer].entries
    rids = admit_requests(cache, 3)
    cache.plan_step([(rids[0], 140), (rids[2], 30)])  # history, interleaving the requests' blocks
    plan = cache.plan_step([(rids[2], 3), (rids[0], 1), (rids[1], 40)])
    order = [2, 0, 1]
    values = fill_entries(cache, layer, pool, layout, rids, seed=51)
    tokens = [(i, p) for i, n in zip(order, (3, 1, 40)) for p in range(cache.length(rids[i]) - n, cache.length(rids[i]))]
    assert plan.positions.tolist() == [p for _, p in tokens]

    picks = visible_entries(plan, ratio=m)
    width = max((p + 1) // m for _, p in tokens)
    assert picks.dtype == torch.long and picks.shape == (len(tokens), width)
    for row, (i, p) in enumerate(tokens):
        assert picks[row].tolist() == [j if j < (p + 1) // m else -1 for j in range(width)]

    keys, valid = gather_entries(pool, layout, plan, picks, ratio=m, page_tokens=PAGE)
    for row, (i, p) in enumerate(tokens):
        for k, j in enumerate(picks[row].tolist()):
            assert bool(valid[row, k]) == (j >= 0)
            if j >= 0:
                want = layout.read(pool, PAGE // m, torch.tensor([entry_slot(cache, rids[i], j, m)]))[0]
                assert same_bits(keys[row, k], want)
                torch.testing.assert_close(keys[row, k], values[(i, j)][0].float(), atol=0.15, rtol=0.07)
    # arbitrary picks (repeats, unordered, -1 in the middle)
    rng = random.Random(52)
    custom = torch.tensor([[rng.choice([-1] + list(range((p + 1) // m))) for _ in range(5)] for _, p in tokens])
    keys, valid = gather_entries(pool, layout, plan, custom.int(), ratio=m, page_tokens=PAGE)
    for row, (i, p) in enumerate(tokens):
        for k, j in enumerate(custom[row].tolist()):
            assert bool(valid[row, k]) == (j >= 0)
            if j >= 0:
                assert same_bits(keys[row, k], layout.round_trip(values[(i, j)])[0])
    with pytest.raises(ValueError, match=r"gather_entries: expected integer indices \[44, K\]"):
        gather_entries(pool, layout, plan, custom.float(), ratio=m, page_tokens=PAGE)
    with pytest.raises(ValueError, match=r"gather_entries: expected integer indices"):
        gather_entries(pool, layout, plan, custom[:3], ratio=m, page_tokens=PAGE)


def test_entry_slots_by_hand():
    cache = make_cache()
    rids = admit_requests(cache, 2)
    cache.plan_step([(rids[0], 130), (rids[1], 200)])
    plan = cache.plan_step([(rids[1], 60), (rids[0], 140)])  # 260 and 270 tokens on interleaved blocks
    rows = step_rows(plan)
    order = [rids[1], rids[0]]  # batch rows
    request = torch.tensor([[0, 0, 0, 1, 1], [1, 1, 0, 1, 0]])
    for m, index in ((4, torch.tensor([[0, 31, 32, -1, 66], [-1, 64, 64, 16, 40]])),
                     (16, torch.tensor([[0, 7, 8, -1, 16], [-1, 16, 15, 1, -1]]))):
        got = entry_slots(plan, rows, request, index, ratio=m, page_tokens=PAGE)
        assert got.shape == index.shape
        for b, j, slot in zip(request.flatten().tolist(), index.flatten().tolist(), got.flatten().tolist()):
            assert slot == (entry_slot(cache, order[b], j, m) if j >= 0 else -1), (m, b, j, slot)


def test_visible_entries_none_yet():
    cache = make_cache()
    plan = cache.plan_step([(cache.admit(), 3)])
    assert visible_entries(plan, ratio=4).shape == (3, 0)


# --- indexer ------------------------------------------------------------------------------------------
def naive_topk(scores, visible, k):
    """Entry indices sorted by (score desc, index asc) over the visible ones, -1 padded to k."""
    ranked = sorted(range(visible), key=lambda j: (-scores[j], j))[:k]
    return ranked + [-1] * (k - len(ranked))


def naive_scores(q, w, keys, visible):
    """score[j] = sum_h w[h] * relu(q[h] . K[j]) * dim^-0.5, per j < visible (fp64)."""
    dim = q.shape[-1]
    out = []
    for j in range(visible):
        s = 0.0
        for h in range(q.shape[0]):
            s += float(w[h]) * max(0.0, float(torch.dot(q[h].double(), keys[j].double()))) * dim ** -0.5
        out.append(s)
    return out


def index_setup(indexer_format, seed, key_values):
    """Three requests with history, a mixed step, keys written at every complete entry by `key_values`."""
    cache = make_cache("bf16", indexer_format)
    layer, m = 1, TINY.layers[1].ratio
    layout, pool = cache.spec.layers[layer].index, cache.pools.layers[layer].index_keys
    rids = admit_requests(cache, 3)
    cache.plan_step([(rids[0], 130), (rids[1], 9)])
    step = [(1, 1), (2, 17), (0, 5)]  # decode, a fresh prefill (rows with < topk visible), a chunk
    plan = cache.plan_step([(rids[i], n) for i, n in step])
    tokens = [(i, p) for i, n in step for p in range(cache.length(rids[i]) - n, cache.length(rids[i]))]
    g = gen(seed)
    keys = {}
    for i, rid in enumerate(rids):
        count = cache.length(rid) // m
        k = key_values(g, count)
        slots = torch.tensor([entry_slot(cache, rid, j, m) for j in range(count)])
        layout.write(pool, PAGE // m, slots, k)
        keys[i] = layout.read(pool, PAGE // m, slots)
    return cache, plan, layout, pool, tokens, keys, m


def int_keys(g, count):
    k = torch.randint(-2, 3, (count, TINY.index_head_dim), generator=g).float()
    for j in range(1, count, 3):
        k[j] = k[j - 1]  # duplicates: exactly equal scores
    k[count // 2:count // 2 + 4] = k[count // 2]
    return k


def test_indexer_topk_bf16_exact_with_ties():
    """Integer queries and keys, dyadic weights: every score is exact in fp32, so the op's picks must equal
    the naive (score desc, index asc) ranking exactly, ties included."""
    cache, plan, layout, pool, tokens, keys, m = index_setup("bf16", 61, int_keys)
    n, heads, dim = plan.num_tokens, TINY.index_n_heads, TINY.index_head_dim
    g = gen(62)
    q = torch.randint(-3, 4, (n, heads, dim), generator=g).to(torch.bfloat16)
    weights = torch.randint(-2, 5, (n, heads), generator=g).float() * 0.25
    weights[:, 0] = 1.0  # at least one positive head
    assert torch.equal(indexer_query(q, layout), q.float())
    ties = 0
    for topk in (TINY.index_topk, 3, 40):
        picks = indexer_topk(q, weights, plan, pool, layout, ratio=m, topk=topk, page_tokens=PAGE)
        assert picks.dtype == torch.long and picks.shape == (n, topk)
        for row, (i, p) in enumerate(tokens):
            visible = (p + 1) // m
            scores = naive_scores(q[row].float(), weights[row], keys[i], visible)
            want = naive_topk(scores, visible, topk)
            assert picks[row].tolist() == want, (topk, i, p)
            chosen = [j for j in want if j >= 0]
            ties += sum(scores[a] == scores[b] for a, b in zip(chosen, chosen[1:]))
    assert ties > 10, "the case must exercise tied scores"
    assert any((p + 1) // m < TINY.index_topk for _, p in tokens)


def rand_keys_with_duplicates(g, count):
    k = torch.randn(count, TINY.index_head_dim, generator=g)
    for j in range(2, count, 4):
        k[j] = k[j - 2]
    return k


@pytest.mark.parametrize("indexer_format", ["mxfp4", "fp8"])
def test_indexer_topk_quantized(indexer_format):
    """Scores from the op's own query transform (rotated, quantized) and the keys as stored; the ranking
    is checked independently: within a float tolerance of the naive ranking, and exactly where keys are
    bit-identical duplicates (equal scores: the lower index first)."""
    cache, plan, layout, pool, tokens, keys, m = index_setup(indexer_format, 71, rand_keys_with_duplicates)
    n, heads, dim = plan.num_tokens, TINY.index_n_heads, TINY.index_head_dim
    g = gen(72)
    q = torch.randn(n, heads, dim, generator=g).to(torch.bfloat16)
    weights = torch.rand(n, heads, generator=g) * 0.5
    weights[::3, 1] *= -1
    query = indexer_query(q, layout)
    assert query.shape == (n, heads, dim) and query.dtype == torch.float32
    # the query meets the keys in their numerics: each head row round-tripped through the key format
    assert same_bits(query, layout.round_trip(q.reshape(n * heads, dim)).view(n, heads, dim))
    # the rotation preserves dot products: the transformed query approximates the plain one in the keys' basis
    h = torch.tensor([[1.0]])
    while h.shape[0] < dim:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    torch.testing.assert_close(query @ (h / dim ** 0.5), q.float(), atol=0.6, rtol=0.3)
    topk = TINY.index_topk
    picks = indexer_topk(q, weights, plan, pool, layout, ratio=m, topk=topk, page_tokens=PAGE)
    dup_checked = 0
    for row, (i, p) in enumerate(tokens):
        visible = (p + 1) // m
        scores = naive_scores(query[row], weights[row], keys[i], visible)
        want = naive_topk(scores, visible, topk)
        got = picks[row].tolist()
        valid = [j for j in got if j >= 0]
        assert got == valid + [-1] * (topk - len(valid)) and len(valid) == min(topk, visible)
        assert len(set(valid)) == len(valid) and all(0 <= j < visible for j in valid)
        for a, b in zip(got, want):  # equal up to the order of near-equal scores
            if a != b:
                assert abs(scores[a] - scores[b]) <= 1e-5 * (1 + abs(scores[b])), (i, p, got, want)
        # exact ties: duplicates of one key; the lower index comes first and is never dropped for the higher
        for a in range(visible):
            for b in range(a + 1, visible):
                if torch.equal(keys[i][a], keys[i][b]):
                    dup_checked += 1
                    if b in valid:
                        assert a in valid and valid.index(a) < valid.index(b), (i, p, a, b, got)
    assert dup_checked > 20


def test_indexer_rejects_bad_input():
    cache, plan, layout, pool, tokens, keys, m = index_setup("bf16", 81, int_keys)
    n = plan.num_tokens
    q, w = torch.zeros(n, 4, 64), torch.zeros(n, 4)
    kw = dict(ratio=m, topk=8, page_tokens=PAGE)
    with pytest.raises(ValueError, match=rf"q: expected a float tensor \[{n}, \*, 64\]"):
        indexer_topk(q[:, :, :32], w, plan, pool, layout, **kw)
    with pytest.raises(ValueError, match=r"q: expected a float tensor"):
        indexer_topk(q.int(), w, plan, pool, layout, **kw)
    with pytest.raises(ValueError, match=rf"weights: expected a float tensor \[{n}, 4\]"):
        indexer_topk(q, w[:, :3], plan, pool, layout, **kw)
    with pytest.raises(ValueError, match=r"indexer_topk: topk must be positive"):
        indexer_topk(q, w, plan, pool, layout, ratio=m, topk=0, page_tokens=PAGE)
