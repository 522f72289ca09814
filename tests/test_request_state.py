"""A request's cache state exported, imported, saved and loaded (issue 39), with the real layers of the `tiny`
preset (window, CSA m=4 with its indexer, HCA m=16, window 16; DSV4Attention on the PyTorch reference, CPU),
128-token blocks and NaN-poisoned pools: a request continued in the cache it was imported into (in memory or
through a file) gives outputs, pages, window and state bit-identical to the sender's own continuation; another
geometry or format, a corrupted or truncated file, no room and a bad id are refused with nothing changed."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

from dsv4kv import CacheManager, StepPlan
from dsv4kv.cache import NoRoom, RequestState, load_request, save_request
from dsv4kv.cache.manager import RequestError
from dsv4kv.geometry import ModelGeometry
from dsv4kv.model.layer import DSV4Attention, init_random_weights

G = ModelGeometry.preset("tiny")
P = 128  # page_tokens
CONTINUE = (1, 1, 37, 1, 1)  # after the prompt: decode steps and a chunk that crosses a CSA / HCA boundary


@functools.lru_cache(maxsize=None)
def layers() -> tuple[DSV4Attention, ...]:
    return tuple(init_random_weights(DSV4Attention(G, i, device="cpu", backend="torch"), seed=10 + i)
                 for i in range(G.num_layers))


def make(**kw) -> CacheManager:
    kw.setdefault("max_requests", 2)
    kw.setdefault("max_tokens", 1024)
    kw.setdefault("page_tokens", P)
    return CacheManager(kw.pop("geometry", G), poison=True, **kw)


def hidden(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, G.hidden_size, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def step(cache: CacheManager, rid: int, h: torch.Tensor) -> torch.Tensor:
    """One step of `rid` over every layer (h <- h + layer(h)); the output rows."""
    plan = cache.plan_step([(rid, h.shape[0])])
    assert isinstance(plan, StepPlan), plan
    for layer in layers():
        h = h + layer(h, plan, cache)
    return h


def prefill(cache: CacheManager, length: int, seed: int, tokens=None) -> int:
    rid = cache.admit(tokens)
    for i, n in enumerate(chunks(length)):
        step(cache, rid, hidden(seed + i, n))
    return rid


def chunks(length: int) -> list[int]:
    return [min(100, length - i) for i in range(0, length, 100)]  # 100: not a multiple of 16, nor of 128


def continued(cache: CacheManager, rid: int, seed: int) -> list[torch.Tensor]:
    outs = []
    for i, n in enumerate(CONTINUE):
        if cache.prefix is not None:
            cache.append_tokens(rid, list(range(seed + i * 50, seed + i * 50 + n)))
        outs.append(step(cache, rid, hidden(seed + 1000 + i, n)))
    return outs


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_same_state(a: RequestState, b: RequestState) -> None:
    assert (a.length, a.spec, sorted(a.tensors)) == (b.length, b.spec, sorted(b.tensors))
    for name in a.tensors:
        assert torch.equal(bits(a.tensors[name]), bits(b.tensors[name])), name
    assert (a.tokens is None) == (b.tokens is None)
    assert a.tokens is None or torch.equal(a.tokens, b.tokens)


def snapshot(cache: CacheManager) -> tuple:
    """Everything an import could change."""
    tensors = [bits(t).clone() for layer in cache.pools.layers for t in layer.tensors()]
    counters = (cache.num_free_blocks, cache.num_used_blocks, cache.num_live_requests, cache.request_ids(),
                cache._next_rid, list(cache._free_slots), cache.block_table.clone().tolist())
    return tensors, counters


def assert_unchanged(cache: CacheManager, before: tuple) -> None:
    tensors, counters = snapshot(cache)
    assert counters == before[1]
    assert len(tensors) == len(before[0]) and all(torch.equal(a, b) for a, b in zip(tensors, before[0]))


def busy_receiver(**kw) -> tuple[CacheManager, int]:
    """A fresh cache where another request already holds slot 0 and the first blocks, so the import lands in
    another slot and other block ids than the sender's."""
    cache = make(**kw)
    other = cache.admit(list(range(150)) if kw.get("prefix_caching") else None)
    assert cache.plan_step([(other, 150)])  # its layers need not run: only the block ids matter here
    return cache, other


# --- the round trip -------------------------------------------------------------------------------
@pytest.mark.parametrize("length,via,prefix_caching", [
    (203, "memory", False), (37, "file", False), (261, "file", True), (128, "memory", True),
], ids=["T203-memory", "T37-file", "T261-file-prefix", "T128-memory-prefix"])
def test_imported_request_continues_bit_for_bit(tmp_path, length, via, prefix_caching):
    tokens = list(range(7, 7 + length)) if prefix_caching else None
    sender = make(prefix_caching=prefix_caching)
    rid = prefill(sender, length, seed=length, tokens=tokens)
    state = sender.export_request(rid)
    assert state.length == length and state.num_blocks == -(-length // P)
    assert (state.tokens is not None) == prefix_caching
    if via == "file":
        save_request(state, tmp_path / "r.safetensors")
        loaded = load_request(tmp_path / "r.safetensors")
        assert_same_state(loaded, state)
        state = loaded
    receiver, _ = busy_receiver(prefix_caching=prefix_caching)
    got = receiver.import_request(state)
    assert isinstance(got, int) and receiver.length(got) == length
    assert receiver.slot(got) != sender.slot(rid) and receiver.blocks(got) != sender.blocks(rid)
    assert_same_state(receiver.export_request(got), state)

    want, outs = continued(sender, rid, seed=length), continued(receiver, got, seed=length)
    for i, (a, b) in enumerate(zip(outs, want)):
        assert torch.isfinite(a).all(), f"step {i}: a poisoned byte was read"
        assert torch.equal(bits(a), bits(b)), f"step {i}: outputs differ"
    assert_same_state(receiver.export_request(got), sender.export_request(rid))


def test_a_request_that_hit_the_senders_prefix_cache_moves_as_private_copies():
    """Its first two blocks are shared cached blocks in the sender; the receiver gets copies it holds alone."""
    prompt = list(range(3, 303))
    sender = make(prefix_caching=True)
    donor = prefill(sender, 300, seed=40, tokens=prompt)
    sender.release(donor)
    rid = sender.admit(prompt)
    assert sender.cached_tokens(rid) == 256
    step(sender, rid, hidden(41, 44))
    receiver, _ = busy_receiver(prefix_caching=True)
    got = receiver.import_request(sender.export_request(rid))
    assert [receiver.allocator.refcount(b) for b in receiver.blocks(got)] == [1, 1, 1]
    assert receiver.cached_tokens(got) == 0 and receiver.num_cached_blocks == 0
    want, outs = continued(sender, rid, seed=42), continued(receiver, got, seed=42)
    assert all(torch.isfinite(a).all() and torch.equal(bits(a), bits(b)) for a, b in zip(outs, want))
    assert_same_state(receiver.export_request(got), sender.export_request(rid))


def test_a_state_of_length_zero_round_trips(tmp_path):
    sender = make()
    rid = sender.admit()
    save_request(sender.export_request(rid), tmp_path / "empty.safetensors")
    receiver = make()
    got = receiver.import_request(load_request(tmp_path / "empty.safetensors"))
    assert receiver.length(got) == 0 and receiver.blocks(got) == []
    want, outs = continued(sender, rid, seed=5), continued(receiver, got, seed=5)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(outs, want))


# --- refusals -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def state() -> RequestState:
    sender = make()
    return sender.export_request(prefill(sender, 203, seed=1))


@pytest.mark.parametrize("kw,says", [
    (dict(kv_format="bf16"), "kv_format: fp8 in the state, bf16 here"),
    (dict(indexer_format="fp8"), "indexer_format: mxfp4 in the state, fp8 here"),
    (dict(page_tokens=256), "page_tokens: 128 in the state, 256 here"),
    (dict(geometry=dataclasses.replace(G, window=32)), "window: 16 in the state, 32 here"),
], ids=["kv-format", "indexer-format", "page-tokens", "geometry"])
def test_another_geometry_or_format_is_refused(state, kw, says):
    receiver = make(**kw)
    before = snapshot(receiver)
    with pytest.raises(ValueError, match=says):
        receiver.import_request(state)
    assert_unchanged(receiver, before)


def test_a_malformed_state_is_refused_with_nothing_changed(state):
    receiver, _ = busy_receiver()
    before = snapshot(receiver)
    short = dict(state.tensors)
    short["layers.1.entries"] = short["layers.1.entries"][:1]
    with pytest.raises(ValueError, match=r"layers.1.entries: expected torch.uint8 \[2, .*got torch.uint8 \[1, "):
        receiver.import_request(dataclasses.replace(state, tensors=short))
    missing = {k: v for k, v in state.tensors.items() if k != "layers.3.index_keys"}
    with pytest.raises(ValueError, match=r"missing \['layers.3.index_keys'\]"):
        receiver.import_request(dataclasses.replace(state, tensors=missing))
    with pytest.raises(ValueError, match="203 tokens; this cache holds at most 200 tokens"):
        make(max_seq_len=200).import_request(state)
    with pytest.raises(TypeError, match="expected a RequestState, got dict"):
        receiver.import_request(dict(state.tensors))
    assert_unchanged(receiver, before)


@pytest.mark.parametrize("damage", ["flip-data", "flip-header", "truncate", "metadata"])
def test_a_corrupted_or_truncated_file_is_refused(tmp_path, state, damage):
    path = tmp_path / "r.safetensors"
    save_request(state, path)
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    if damage == "flip-data":
        data[header + (len(data) - header) // 2] ^= 0x01
    elif damage == "flip-header":
        data[12] ^= 0x55
    elif damage == "truncate":
        del data[-1000:]
    else:  # a valid file whose recorded length was changed
        text = data[8:header].decode()
        data[8:header] = text.replace('"length":"203"', '"length":"204"').encode()
    path.write_bytes(bytes(data))
    receiver, _ = busy_receiver()
    before = snapshot(receiver)
    says = "checksum mismatch" if damage in ("flip-data", "metadata") else "truncated or corrupted|checksum mismatch"
    with pytest.raises(ValueError, match=says):
        receiver.import_request(load_request(path))
    assert_unchanged(receiver, before)


def test_no_room_on_import_changes_nothing(state):
    receiver = make(num_blocks=3)  # the state needs 2 blocks
    assert receiver.plan_step([(receiver.admit(), 200)])  # holds 2 of them
    before = snapshot(receiver)
    answer = receiver.import_request(state)
    assert isinstance(answer, NoRoom) and not answer
    assert (answer.resource, answer.needed, answer.free) == ("blocks", 2, 1)
    assert_unchanged(receiver, before)

    full = make(max_requests=1)
    full.admit()
    before = snapshot(full)
    answer = full.import_request(state)
    assert isinstance(answer, NoRoom) and answer.resource == "request slots"
    assert_unchanged(full, before)


def test_exporting_a_bad_id_raises_and_changes_nothing():
    cache = make()
    rid = prefill(cache, 40, seed=2)
    gone = cache.admit()
    cache.release(gone)
    swapped = prefill(cache, 20, seed=4)
    cache.swap_out(swapped)
    before = snapshot(cache)
    for bad, says in ((99, "unknown request id 99"), (gone, "already released"), (swapped, "swapped out"),
                      ("0", "unknown request id '0'")):
        with pytest.raises(RequestError, match=says):
            cache.export_request(bad)
    assert_unchanged(cache, before)
    assert cache.export_request(rid).length == 40


# --- pages the receiver already caches are not sent -----------------------------------------------
@pytest.mark.parametrize("donor_length,hit", [(300, 256), (130, 128)], ids=["hit-2-blocks", "hit-1-block"])
def test_pages_the_receiver_caches_are_not_sent(tmp_path, donor_length, hit):
    """The receiver computed a prefix of the same tokens (same chunks, so the same bytes) and released it; the
    sender exports only the blocks past `receiver.lookup(tokens)`: the receiver maps its cached blocks in, writes
    the rest, and the continuation is bit for bit the sender's."""
    length, tokens = 330, list(range(11, 341))
    sender = make(prefix_caching=True)
    rid = prefill(sender, length, seed=60, tokens=tokens)
    receiver = make(prefix_caching=True, max_requests=3)
    receiver.release(prefill(receiver, donor_length, seed=60, tokens=tokens[:donor_length]))
    assert receiver.lookup(tokens) == hit
    whole = sender.export_request(rid)
    state = sender.export_request(rid, skip_tokens=receiver.lookup(tokens))
    k = hit // P
    assert (state.first_block, state.num_blocks, whole.num_blocks) == (k, 3 - k, 3)
    assert whole.nbytes - state.nbytes == k * sender.spec.block_bytes
    cached = [node.block for node in receiver.prefix.match(np.array(tokens), k)]
    free = receiver.num_free_blocks
    got = receiver.import_request(state)
    assert receiver.blocks(got)[:k] == cached and receiver.num_free_blocks == free - 3  # k idle cached + fresh ones
    assert [receiver.allocator.refcount(b) for b in receiver.blocks(got)] == [1, 1, 1]
    assert_same_state(receiver.export_request(got), whole)
    want, outs = continued(sender, rid, seed=61), continued(receiver, got, seed=61)
    for i, (a, b) in enumerate(zip(outs, want)):
        assert torch.isfinite(a).all() and torch.equal(bits(a), bits(b)), f"step {i}"
    assert_same_state(receiver.export_request(got), sender.export_request(rid))
    with pytest.raises(ValueError, match="first 1 blocks were left out|first 2 blocks were left out"):
        save_request(state, tmp_path / "partial.safetensors")
    assert not (tmp_path / "partial.safetensors").exists()


def test_a_cached_block_held_by_a_live_request_is_shared():
    tokens = list(range(11, 341))
    sender = make(prefix_caching=True)
    rid = prefill(sender, 330, seed=60, tokens=tokens)
    receiver = make(prefix_caching=True, max_requests=3)
    donor = prefill(receiver, 300, seed=60, tokens=tokens[:300])
    free = receiver.num_free_blocks
    got = receiver.import_request(sender.export_request(rid, skip_tokens=receiver.lookup(tokens)))
    assert receiver.blocks(got)[:2] == receiver.blocks(donor)[:2] and receiver.num_free_blocks == free - 1
    assert [receiver.allocator.refcount(b) for b in receiver.blocks(got)] == [2, 2, 1]
    want, outs = continued(sender, rid, seed=62), continued(receiver, got, seed=62)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(outs, want))
    receiver.release(got)
    assert [receiver.allocator.refcount(b) for b in receiver.blocks(donor)[:2]] == [1, 1]


def test_a_partial_state_the_receiver_cannot_complete_is_refused_with_nothing_changed():
    tokens = list(range(11, 341))
    sender = make(prefix_caching=True)
    rid = prefill(sender, 330, seed=60, tokens=tokens)
    partial = sender.export_request(rid, skip_tokens=256)
    evicted, _ = busy_receiver(prefix_caching=True)  # caches nothing of these tokens (its blocks were evicted, say)
    before = snapshot(evicted)
    answer = evicted.import_request(partial)
    assert isinstance(answer, NoRoom)
    assert (answer.resource, answer.needed, answer.free) == ("cached prefix blocks", 2, 0)
    assert_unchanged(evicted, before)
    plain, _ = busy_receiver()
    before = snapshot(plain)
    with pytest.raises(ValueError, match="first 2 blocks are left out .* no prefix cache"):
        plain.import_request(partial)
    with pytest.raises(ValueError, match="left out, and it has no token ids"):
        plain.import_request(dataclasses.replace(partial, tokens=None))
    with pytest.raises(ValueError, match=r"first_block: expected an int in \[0, 2\]"):
        plain.import_request(dataclasses.replace(partial, first_block=3))
    with pytest.raises(ValueError, match=r"layers.1.entries: expected torch.uint8 \[2, .* from block 1, got .*\[1, "):
        plain.import_request(dataclasses.replace(partial, first_block=1))
    assert_unchanged(plain, before)
    before = snapshot(sender)
    for bad in (100, -128, 384, True, 128.0):
        with pytest.raises(ValueError, match="skip_tokens: expected a multiple of page_tokens 128 in"):
            sender.export_request(rid, skip_tokens=bad)
    assert_unchanged(sender, before)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["plain", "prefix"])
def test_a_fault_while_loading_an_import_leaves_the_cache_as_it_was(state, monkeypatch, prefix_caching):
    """pools.load raising (a device out of memory) drops the half-imported request: no live request with partial
    bytes, its blocks and slot free again, and a later import and step work and share no block."""
    receiver, other = busy_receiver(prefix_caching=prefix_caching)
    before = snapshot(receiver)

    def fault(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (injected)")

    with monkeypatch.context() as patch:
        patch.setattr(receiver.pools, "load", fault)
        with pytest.raises(RuntimeError, match="injected"):
            receiver.import_request(state)
    assert_unchanged(receiver, before)
    assert receiver.request_ids() == [other] and receiver.length(other) == 150

    rid = receiver.import_request(state)
    assert receiver.is_live(rid) and receiver.length(rid) == state.length
    assert_same_state(receiver.export_request(rid), state)
    if prefix_caching:
        receiver.append_tokens(other, [7])
    assert receiver.plan_step([(other, 1)]) and receiver.plan_step([(rid, 1)])
    held = receiver.blocks(other) + receiver.blocks(rid)
    assert len(set(held)) == len(held) == receiver.num_used_blocks
