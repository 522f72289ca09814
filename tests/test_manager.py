"""CacheManager: request lifecycle, step plans, out-of-blocks, bad input, randomized schedules."""

import random

import numpy as np
import pytest
import torch

from dsv4kv import CacheManager, ModelGeometry, OutOfBlocks, RequestError, StepPlan

TINY = ModelGeometry.preset("tiny")  # window 16, CSA m=4, HCA m=16


def make(max_requests=3, max_tokens=1000, **kw):
    kw.setdefault("page_tokens", 128)
    return CacheManager(TINY, max_requests=max_requests, max_tokens=max_tokens, **kw)


def snapshot(m: CacheManager):
    return (m.num_free_blocks, {r: (m.length(r), m.blocks(r)) for r in m.request_ids()},
            m.block_table.clone(), m.tokens_held)


def assert_unchanged(m, before):
    after = snapshot(m)
    assert after[0] == before[0] and after[1] == before[1] and after[3] == before[3]
    assert torch.equal(after[2], before[2])


def test_hand_checked_plan():
    m = make()
    a, b = m.admit(), m.admit()
    plan = m.plan_step([(a, 130), (b, 5)])
    assert isinstance(plan, StepPlan) and (plan.num_tokens, plan.num_requests) == (135, 2)
    assert plan.query_start.tolist() == [0, 130, 135]
    assert plan.seq_lens.tolist() == [130, 5]
    assert plan.positions[125:135].tolist() == [125, 126, 127, 128, 129, 0, 1, 2, 3, 4]
    assert plan.token_request[128:132].tolist() == [0, 0, 1, 1]
    assert plan.window_slots[126:133].tolist() == [14, 15, 0, 1, 16, 17, 18]  # slot * 16 + pos % 16
    assert m.blocks(a) == [0, 1] and m.blocks(b) == [2]
    csa = plan.entries[4]  # 32 entries of a (tokens 0..127, page 0) then b's entry 0 in its block 2
    assert csa.count == 33
    assert csa.slots.tolist() == list(range(32)) + [2 * 32]
    assert csa.index.tolist() == list(range(32)) + [0]
    hca = plan.entries[16]  # a: 8 entries in block 0; b: none
    assert hca.slots.tolist() == list(range(8)) and hca.request.tolist() == [0] * 8
    assert m.block_table[:, :3].tolist() == [[0, 1, -1], [2, -1, -1], [-1, -1, -1]]

    plan = m.plan_step([(b, 3), (a, 2)])  # b reaches 8 (CSA entry 1), a reaches 132 (CSA entry 32, block 1)
    assert plan.entries[4].slots.tolist() == [2 * 32 + 1, 1 * 32 + 0]
    assert plan.entries[4].index.tolist() == [1, 32]
    assert plan.entries[16].count == 0


def test_admit_until_full_then_none():
    m = make(max_requests=2)
    ids = [m.admit(), m.admit()]
    assert ids == [0, 1] and m.admit() is None
    m.release(ids[0])
    assert m.admit() == 2  # ids are never reused; the slot is
    assert m.slot(2) == 0


def test_admit_resets_state():
    m = make(max_requests=1, poison=True)
    rid = m.admit()
    m.plan_step([(rid, 40)])
    layer = m.pools.layers[1]
    layer.state_kv[0].fill_(7.0)
    layer.state_score[0].fill_(1.0)
    layer.window[0].fill_(3)
    m.release(rid)
    m.admit()
    assert layer.state_kv[0].eq(0).all() and layer.state_score[0].eq(float("-inf")).all()
    assert layer.index_state_score[0].eq(float("-inf")).all()
    assert layer.window[0].eq(0xFF).all()


def test_out_of_blocks_changes_nothing():
    m = make(max_requests=2, max_tokens=256, num_blocks=3)
    a, b = m.admit(), m.admit()
    assert m.plan_step([(a, 200)])
    before = snapshot(m)
    answer = m.plan_step([(a, 10), (b, 200)])  # a needs 0 new blocks, b needs 2, 1 is free
    assert isinstance(answer, OutOfBlocks) and not answer
    assert (answer.needed, answer.free) == (2, 1)
    assert "2 new blocks" in str(answer)
    assert_unchanged(m, before)
    assert m.plan_step([(b, 100)])  # still usable afterwards


def test_release_returns_blocks_and_twice_raises():
    m = make()
    rid = m.admit()
    m.plan_step([(rid, 300)])
    assert m.num_used_blocks == 3
    m.release(rid)
    assert m.num_used_blocks == 0 and m.tokens_held == 0
    assert m.block_table.eq(-1).all()
    with pytest.raises(RequestError, match="already released"):
        m.release(rid)
    with pytest.raises(RequestError, match="unknown request id 99"):
        m.release(99)


@pytest.mark.parametrize("batch,error,match", [
    ([], ValueError, "empty step"),
    ("ab", TypeError, "sequence"),
    ([(0,)], TypeError, "pairs"),
    ([(7, 1)], RequestError, "unknown request id 7"),
    ([(0, 1), (0, 2)], RequestError, "twice"),
    ([(0, 0)], ValueError, "positive int"),
    ([(0, -3)], ValueError, "positive int"),
    ([(0, 1.5)], ValueError, "positive int"),
    ([(0, True)], ValueError, "positive int"),
    ([(0, 1), (1, 5000)], ValueError, "exceeds max_seq_len"),
], ids=["empty", "string", "not-pair", "unknown", "duplicate", "zero", "negative", "float", "bool", "too-long"])
def test_bad_batches_raise_and_change_nothing(batch, error, match):
    m = make(max_seq_len=4096)
    a, b = m.admit(), m.admit()
    m.plan_step([(a, 20), (b, 3)])
    before = snapshot(m)
    with pytest.raises(error, match=match):
        m.plan_step(batch)
    assert_unchanged(m, before)


def test_released_request_in_batch_raises():
    m = make()
    a, b = m.admit(), m.admit()
    m.release(a)
    before = snapshot(m)
    with pytest.raises(RequestError, match="already released"):
        m.plan_step([(b, 1), (a, 1)])
    assert_unchanged(m, before)


def test_step_buffers_keep_addresses_and_pad():
    m = make()
    a, b = m.admit(), m.admit()
    buffers = m.step_buffers(max_tokens=8, max_requests=3)
    first = m.plan_step([(a, 5), (b, 2)], buffers=buffers)
    second = m.plan_step([(b, 1)], buffers=buffers)
    for name in ("positions", "token_request", "window_slots", "request_slots", "query_start", "seq_lens"):
        assert getattr(first, name).data_ptr() == getattr(second, name).data_ptr(), name
    assert second.positions.tolist() == [2] + [-1] * 7
    assert second.token_request.tolist() == [0] + [-1] * 7
    assert second.window_slots.tolist() == [16 + 2] + [-1] * 7
    assert second.request_slots.tolist() == [1, -1, -1]
    assert second.query_start.tolist() == [0, 1, 1, 1]
    assert second.seq_lens.tolist() == [3, 0, 0]
    csa = second.entries[4]
    assert csa.slots.shape == (8 // 4 + 3,) and csa.count == 0 and csa.slots.eq(-1).all()

    other = make()
    before = snapshot(m)
    with pytest.raises(ValueError, match="another CacheManager"):
        m.plan_step([(a, 1)], buffers=other.step_buffers(max_tokens=8, max_requests=3))
    with pytest.raises(ValueError, match="buffers hold 8 / 3"):
        m.plan_step([(a, 9)], buffers=buffers)
    assert_unchanged(m, before)


@pytest.mark.parametrize("kw,match", [
    (dict(max_requests=0), "max_requests"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(page_tokens=192), "multiple of 128"),
    (dict(max_seq_len=1 << 30), "max_position_embeddings"),
    (dict(kv_format="int4"), "int4"),
    (dict(num_blocks=0), "num_blocks"),
])
def test_bad_construction(kw, match):
    with pytest.raises(ValueError, match=match):
        make(**kw)


def test_default_block_count_fits_any_split():
    # 1000 tokens over 3 requests at 128-token pages: ceil(1000/128) + 3 - 1 = 10 blocks
    m = make(max_requests=3, max_tokens=1000)
    assert m.num_blocks == 10
    ids = [m.admit() for _ in range(3)]
    assert m.plan_step([(ids[0], 129), (ids[1], 129), (ids[2], 1000 - 258)])  # 2 + 2 + 6 blocks


# --- randomized schedules ------------------------------------------------------------------------
TAG = np.dtype("<i8")


def tag_views(m):
    """int64 views of the first 8 bytes of every entry in each pool we tag: (layer cache, pool name, view)."""
    views = []
    for layer in m.pools.layers:
        for name in ("entries", "index_keys"):
            pool = getattr(layer, name)
            if pool is None:
                continue
            layout = layer.spec.main if name == "entries" else layer.spec.index
            data, _ = layout.page_views(pool, layer.spec.entries_per_page)
            views.append((layer.spec.layer.ratio, data.numpy().reshape(-1, layout.data_bytes)[:, :8]))
        data, _ = layer.spec.main.page_views(layer.window, layer.spec.window)
        views.append((0, data.numpy().reshape(-1, layer.spec.main.data_bytes)[:, :8]))
    return views


def tag(rid, index):
    return (np.asarray(rid, dtype=np.int64) << 32) | np.asarray(index, dtype=np.int64)


def write_tags(views, plan, rids):
    rids = np.array(rids, dtype=np.int64)
    for ratio, rows in views:
        if ratio == 0:
            n = plan.num_tokens
            slots, owner, index = (plan.window_slots[:n].numpy(), plan.token_request[:n].numpy(),
                                   plan.positions[:n].numpy())
            keep = slots >= 0
            # a token gets a ring slot iff it is among its request's last `window` tokens after the step
            ends = plan.seq_lens.numpy()[owner]
            assert np.array_equal(keep, index >= ends - TINY.window)
            slots, owner, index = slots[keep], owner[keep], index[keep]
        else:
            w = plan.entries[ratio]
            slots, owner, index = w.slots[:w.count].numpy(), w.request[:w.count].numpy(), w.index[:w.count].numpy()
        assert len(np.unique(slots)) == len(slots), "two writes of one step share a slot"
        rows[slots] = tag(rids[owner], index)[:, None].view(np.uint8)


def check_tags(views, m, window):
    """Every live request still finds its own tag in every entry and window row it wrote."""
    page = m.spec.page_tokens
    for ratio, rows in views:
        got = rows.copy().view(TAG)[:, 0]
        for rid in m.request_ids():
            length, slot, blocks = m.length(rid), m.slot(rid), np.array(m.blocks(rid), dtype=np.int64)
            if ratio == 0:
                pos = np.arange(max(0, length - window), length)
                slots = slot * window + pos % window
                index = pos
            else:
                index = np.arange(length // ratio)
                token = index * ratio
                slots = blocks[token // page] * (page // ratio) + (token % page) // ratio
            bad = got[slots] != tag(rid, index)
            assert not bad.any(), f"request {rid}: ratio {ratio} entry {index[bad][:3]} overwritten"


@pytest.mark.parametrize("seed,steps,use_buffers", [(0, 3000, False), (1, 1500, True), (2, 1500, False)],
                         ids=["seed0-S3000", "seed1-S1500-buffers", "seed2-S1500"])
def test_randomized_schedule(seed, steps, use_buffers):
    rng = random.Random(seed)
    m = CacheManager(TINY, max_requests=5, max_tokens=900, page_tokens=128, max_seq_len=2048, kv_format="bf16",
                     indexer_format="bf16")
    views = tag_views(m)
    buffers = m.step_buffers(max_tokens=96, max_requests=5) if use_buffers else None
    shadow: dict[int, int] = {}
    written: dict[int, dict[int, set]] = {}  # rid -> ratio -> entry indices written so far
    outcomes = {"plan": 0, "oob": 0, "admit_full": 0, "release": 0}
    for _ in range(steps):
        action = rng.random()
        if action < 0.15:
            rid = m.admit()
            if rid is None:
                assert len(shadow) == m.max_requests
                outcomes["admit_full"] += 1
            else:
                assert rid not in shadow
                shadow[rid], written[rid] = 0, {r: set() for r in TINY.ratios}
        elif action < 0.25 and shadow:
            rid = rng.choice(sorted(shadow))
            m.release(rid)
            del shadow[rid], written[rid]
            outcomes["release"] += 1
        elif shadow:
            chosen = rng.sample(sorted(shadow), rng.randint(1, len(shadow)))
            budget = 96 if use_buffers else 400
            batch = []
            for rid in chosen:
                n = 1 if rng.random() < 0.6 else rng.randint(2, 60)
                n = min(n, 2048 - shadow[rid], budget - sum(c for _, c in batch))
                if n > 0:
                    batch.append((rid, n))
            if not batch:
                continue
            needed = sum(max(0, -(-(shadow[r] + n) // 128) - len(m.blocks(r))) for r, n in batch)
            free = m.num_free_blocks
            plan = m.plan_step(batch, buffers=buffers)
            if needed > free:
                assert isinstance(plan, OutOfBlocks) and (plan.needed, plan.free) == (needed, free)
                outcomes["oob"] += 1
                # an engine would preempt: release the longest request
                victim = max(shadow, key=shadow.get)
                m.release(victim)
                del shadow[victim], written[victim]
            else:
                assert isinstance(plan, StepPlan)
                outcomes["plan"] += 1
                check_plan(plan, batch, shadow, written)
                write_tags(views, plan, plan.request_ids)
                for rid, n in batch:
                    shadow[rid] += n
        check_invariants(m, shadow)
        check_tags(views, m, TINY.window)
    assert min(outcomes.values()) > 0, outcomes  # every branch was exercised


def check_plan(plan, batch, shadow, written):
    starts = [shadow[r] for r, _ in batch]
    expected_positions = np.concatenate([np.arange(s, s + n) for s, (_, n) in zip(starts, batch)])
    n = plan.num_tokens
    assert np.array_equal(plan.positions[:n].numpy(), expected_positions)
    assert plan.seq_lens[:plan.num_requests].tolist() == [s + c for s, (_, c) in zip(starts, batch)]
    for ratio, writes in plan.entries.items():
        got = list(zip(writes.request[:writes.count].tolist(), writes.index[:writes.count].tolist()))
        expected = [(row, j) for row, (s, (_, c)) in enumerate(zip(starts, batch)) for j in range(s // ratio, (s + c) // ratio)]
        assert got == expected, f"ratio {ratio}"
        for row, j in got:
            rid = batch[row][0]
            assert j not in written[rid][ratio], f"entry {j} of request {rid} written twice"
            written[rid][ratio].add(j)


def check_invariants(m, shadow):
    held = [b for rid in m.request_ids() for b in m.blocks(rid)]
    assert len(held) == len(set(held)), "a block is mapped by two requests"
    assert len(held) == m.num_used_blocks and m.num_used_blocks + m.num_free_blocks == m.num_blocks
    assert all(m.allocator.refcount(b) == 1 for b in held)
    assert sorted(m.request_ids()) == sorted(shadow)
    assert m.tokens_held == sum(shadow.values())
    assert m.bytes_used == m.num_used_blocks * m.spec.block_bytes + len(shadow) * m.spec.request_fixed_bytes
    table = m.block_table.numpy()
    live_slots = set()
    for rid, length in shadow.items():
        blocks = m.blocks(rid)
        assert m.length(rid) == length and len(blocks) == -(-length // m.spec.page_tokens)
        row = table[m.slot(rid)]
        assert row[:len(blocks)].tolist() == blocks and (row[len(blocks):] == -1).all()
        live_slots.add(m.slot(rid))
    for slot in set(range(m.max_requests)) - live_slots:
        assert (table[slot] == -1).all()


def test_poison_covers_reused_blocks():
    m = make(max_requests=1, num_blocks=1, poison=True)
    rid = m.admit()
    plan = m.plan_step([(rid, 8)])
    layer = m.pools.layers[1]  # CSA
    spec = layer.spec
    writes = plan.entries[4]
    spec.main.write(layer.entries, spec.entries_per_page, writes.slots, torch.ones(writes.count, spec.main.dim))
    assert spec.main.read(layer.entries, spec.entries_per_page, writes.slots).eq(1).all()
    m.release(rid)
    rid = m.admit()
    assert m.plan_step([(rid, 3)])  # takes the same block back, before any entry of it is complete
    stale = spec.main.read(layer.entries, spec.entries_per_page, torch.tensor([0, 1]))
    assert stale.isnan().all(), "a reused block must read as NaN until rewritten"


def test_request_larger_than_cache_raises():
    m = make(max_requests=1, num_blocks=2, max_seq_len=4096)
    rid = m.admit()
    before = snapshot(m)
    with pytest.raises(ValueError, match="need 3 blocks, the cache has 2"):
        m.plan_step([(rid, 257)])
    assert_unchanged(m, before)


def test_foreign_or_mismatched_buffers_change_nothing():
    from dsv4kv.cache.plan import StepBuffers
    m = make()
    rid = m.admit()
    before = snapshot(m)
    wrong_ratios = StepBuffers(m.cache_id, (4,), max_tokens=64, max_requests=2, device="cpu")
    with pytest.raises(ValueError, match="buffers: step has 20 tokens"):
        m.plan_step([(rid, 20)], buffers=wrong_ratios)
    too_few_entries = StepBuffers(m.cache_id, (4, 16), max_tokens=64, max_requests=2, device="cpu",
                                  entries={4: 1, 16: 1})
    with pytest.raises(ValueError, match="entries"):
        m.plan_step([(rid, 20)], buffers=too_few_entries)
    with pytest.raises(TypeError, match="StepBuffers"):
        m.plan_step([(rid, 20)], buffers="not buffers")
    assert_unchanged(m, before)


def test_bool_request_id_is_unknown():
    m = make()
    m.admit()
    with pytest.raises(RequestError, match="unknown request id True"):
        m.release(True)
