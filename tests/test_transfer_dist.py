"""A request's cache state moved between two processes over torch.distributed (issue 39; cache/distributed.py): gloo
between two spawned CPU processes in CI, NCCL between two GPUs where there are two. The tiny preset's real layers,
NaN-poisoned pools, 128-token blocks. The receiver's continuation equals the run without a move bit for bit (every
output and every byte of the state), on both sides; pages the receiver caches are not sent; a layer-by-layer send
overlaps the last prefill chunk; a refusal, no room, an explicit abort, a malformed layer, and a peer that leaves
midway each leave both caches as they were (every pool byte, block and slot compared), the pair in step where the
protocol allows it, and the sender's request servable."""

from __future__ import annotations

import datetime
import functools
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv4kv import CacheManager, StepPlan
from dsv4kv.cache import NoRoom
from dsv4kv.cache.distributed import FORMAT, RequestReceiver, RequestSender, TransferError, send_request
from dsv4kv.cache.distributed import _chunks, _Gathers, _layout  # the wire layout, checked without a peer
from dsv4kv.geometry import ModelGeometry
from dsv4kv.model.layer import DSV4Attention, init_random_weights

G = ModelGeometry.preset("tiny")  # window, CSA m=4 with its indexer, HCA m=16, window 16
TIMEOUT = datetime.timedelta(seconds=30)
TOKENS = list(range(11, 341))
CONTINUE = (1, 1, 37, 1, 1)  # after the move: decode steps and a chunk that crosses a CSA / HCA boundary


# --- one process's cache and layers (device-generic) ----------------------------------------------
@functools.lru_cache(maxsize=None)
def layers(device: str) -> tuple[DSV4Attention, ...]:
    backend = "torch" if device == "cpu" else "auto"
    return tuple(init_random_weights(DSV4Attention(G, i, device=device, backend=backend), seed=10 + i)
                 for i in range(G.num_layers))


def make(device: str, **kw) -> CacheManager:
    kw.setdefault("max_requests", 2)
    return CacheManager(G, max_tokens=1024, page_tokens=128, poison=True, device=device, **kw)


def hidden(seed: int, n: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, G.hidden_size, generator=g).to(torch.bfloat16).to(device)


def chunks(length: int) -> list[int]:
    return [min(100, length - i) for i in range(0, length, 100)]


def run(cache: CacheManager, plan: StepPlan, h: torch.Tensor, after_layer=None) -> torch.Tensor:
    for i, layer in enumerate(layers(str(cache.device.type if cache.device.type == "cpu" else cache.device))):
        h = h + layer(h, plan, cache)
        if after_layer is not None:
            after_layer(i)
    return h


def prefill(cache: CacheManager, length: int, seed: int, tokens=None, last=None) -> int:
    """A request of `length` tokens fed in chunks of 100; `last(rid)` (if given) is called once the last chunk is
    planned and returns a function run after each of its layers."""
    rid = cache.admit(tokens)
    sizes = chunks(length)
    for i, n in enumerate(sizes):
        plan = cache.plan_step([(rid, n)])
        assert isinstance(plan, StepPlan)
        hook = last(rid) if last is not None and i == len(sizes) - 1 else None
        run(cache, plan, hidden(seed + i, n, cache.device), hook)
    return rid


def continued(cache: CacheManager, rid: int, seed: int) -> list[torch.Tensor]:
    outs = []
    for i, n in enumerate(CONTINUE):
        if cache.prefix is not None:
            cache.append_tokens(rid, list(range(seed + i * 50, seed + i * 50 + n)))
        plan = cache.plan_step([(rid, n)])
        outs.append(run(cache, plan, hidden(seed + 1000 + i, n, cache.device)).cpu())
    return outs


def state_bytes(cache: CacheManager, rid: int) -> dict:
    state = cache.export_request(rid)
    return {"length": state.length, **{name: t.view(torch.uint8).clone() for name, t in state.tensors.items()}}


def snapshot(cache: CacheManager) -> tuple:
    """Everything a failed receive could change: every pool byte, the counters, the block table."""
    tensors = [t.view(torch.uint8).cpu().clone() for layer in cache.pools.layers for t in layer.tensors()]
    return tensors, (cache.num_free_blocks, cache.num_used_blocks, cache.request_ids(),
                     cache.block_table.tolist())


def assert_unchanged(cache: CacheManager, before: tuple) -> None:
    tensors, counters = snapshot(cache)
    assert counters == before[1]
    assert all(torch.equal(a, b) for a, b in zip(tensors, before[0]))


# --- a message's bytes, without a peer ------------------------------------------------------------
@pytest.mark.parametrize("counts", [(4,), (1, 1, 1, 1), (3, 1), (1, 3)])
def test_a_message_gathered_by_chunks_or_by_layers_holds_the_exported_bytes(counts):
    chunk = 1000  # chunk boundaries split rows of every run
    cache = make("cpu")
    other = prefill(cache, 150, seed=80)  # slot 0 and the first blocks: the request's ids are not 0..n
    rid = prefill(cache, 333, seed=81)
    cache.release(other)
    state, k = cache.export_request(rid, skip_tokens=128), 1
    messages = _layout(cache.spec, cache.spec.blocks_for(333) - k, counts)
    staging = torch.empty(sum(m.nbytes for m in messages), dtype=torch.uint8)
    gathers = _Gathers(cache, rid, k, messages, staging, chunk)
    for message, buffer in zip(messages, gathers.buffers):
        spans = sorted((part.offset, part.offset + part.nbytes) for parts in message.parts for part in parts)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= message.payload
        buffer.fill_(0xFF)
        for i in range(message.first, message.end):
            gathers.layer(i, message)
        by_layers = buffer.clone()
        buffer.fill_(0xFF)
        chunks = _chunks(message.nbytes, chunk)
        assert chunks[0][0] == 0 and chunks[-1][1] == message.nbytes and len(chunks) > 1
        for (_, end), jobs in zip(chunks, gathers.jobs[message.index]):
            for src, index, out in jobs:
                torch.index_select(src, 0, index, out=out.view(index.numel(), -1))
            for a, b in spans:  # every part byte before the chunk's end is in when the chunk is sent
                assert torch.equal(buffer[a:min(b, end)], by_layers[a:min(b, end)])
        assert torch.equal(buffer, by_layers)
        for parts in message.parts:
            for part in parts:
                got = buffer[part.offset:part.offset + part.nbytes].view(part.dtype).view(part.shape)
                assert torch.equal(got.view(torch.uint8), state.tensors[part.name].view(torch.uint8)), part.name


# --- the two sides ----------------------------------------------------------------------------------
CONTROL: dict = {}  # this process's control group: gloo beside NCCL, else none (the default group carries all)


def new_sender(*args, **kw) -> RequestSender:
    return RequestSender(*args, control_group=CONTROL.get("group"), **kw)


def new_receiver(*args, **kw) -> RequestReceiver:
    return RequestReceiver(*args, control_group=CONTROL.get("group"), **kw)


def send_whole(*args, **kw):
    return send_request(*args, control_group=CONTROL.get("group"), **kw)


def _sender(device: str, out: str, dead_peer: bool) -> None:
    results = {}
    cache = make(device)
    rid = prefill(cache, 203, seed=70)
    before = snapshot(cache)
    # refused (another spec there), no room there: nothing sent
    with pytest.raises(ValueError, match="refused the request's state: .*kv_format: fp8 in the state, bf16 here"):
        new_sender(cache, rid, peer=1, timeout=TIMEOUT).start()
    answer = send_whole(cache, rid, peer=1, timeout=TIMEOUT)
    assert isinstance(answer, NoRoom) and answer.resource == "request slots"
    # an explicit abort after two of four layers (one message each); then a malformed message 1
    sender = new_sender(cache, rid, peer=1, message_bytes=0, timeout=TIMEOUT)
    assert sender.start() == 0
    sender.send_layer(0)
    sender.send_layer(1)
    sender.abort()
    sender = new_sender(cache, rid, peer=1, message_bytes=0, timeout=TIMEOUT)
    sender.start()
    sender._trailers[1, 2] = 7  # message 1's trailer says message 7
    sender.send_all()
    with pytest.raises(TransferError, match=r"failed the transfer: message 1 \(layers 1..1\): a malformed message"):
        sender.finish()
    assert_unchanged(cache, before)  # a sender only reads its cache
    # the pair is still in step: the whole request moves, in chunks of another size than the receiver's default (the
    # header carries the sender's; 4099 B chunks split rows); both continue
    assert send_whole(cache, rid, peer=1, chunk_bytes=4099, timeout=TIMEOUT) == 1  # the receiver's 2nd (its 1st busy)
    results["moved"] = continued(cache, rid, seed=71)
    results["moved_state"] = state_bytes(cache, rid)

    # the receiver caches 256 of these 330 tokens; each layer of the last chunk is sent as soon as it ran
    cached = make(device, prefix_caching=True)
    senders = []

    def last_chunk(rid: int):  # one message: each layer's parts go into their runs as the layer runs
        sender = new_sender(cached, rid, peer=1, tokens=TOKENS, timeout=TIMEOUT)
        assert sender.start() == 256  # the header carries the length after this chunk
        senders.append(sender)
        return sender.send_layer

    rid = prefill(cached, 330, seed=60, tokens=TOKENS, last=last_chunk)
    assert isinstance(senders[0].finish(), int)
    whole = sum(t.numel() * t.element_size() for t in cached.export_request(rid).tensors.values())
    assert senders[0].bytes_sent < whole - 2 * cached.spec.block_bytes + 1024 * G.num_layers
    results["dedup"] = continued(cached, rid, seed=72)
    results["dedup_state"] = state_bytes(cached, rid)

    torch.save(results, os.path.join(out, "sender.pt"))
    if not dead_peer:
        return
    # the sender leaves after the header and one layer
    sender = new_sender(cache, 0, peer=1, message_bytes=0, timeout=TIMEOUT)
    sender.start()
    sender.send_layer(0)
    sender._works[0][1].wait()  # layer 0 arrived whole
    os._exit(0)  # no goodbye: the receiver sees its peer gone


def _receiver(device: str, out: str, dead_peer: bool) -> None:
    results = {}
    other = make(device, kv_format="bf16")
    before = snapshot(other)
    with pytest.raises(ValueError, match="kv_format: fp8 in the state, bf16 here"):
        new_receiver(other, peer=0, timeout=TIMEOUT).recv()
    assert_unchanged(other, before)
    full = make(device, max_requests=1)
    full.admit()
    before = snapshot(full)
    assert isinstance(new_receiver(full, peer=0, timeout=TIMEOUT).recv(), NoRoom)
    assert_unchanged(full, before)

    cache = make(device)
    busy = cache.admit()
    assert cache.plan_step([(busy, 150)])  # slot 0 and the first blocks are taken: other ids than the sender's
    receiver = new_receiver(cache, peer=0, timeout=TIMEOUT)
    before = snapshot(cache)
    with pytest.raises(TransferError, match="the sender aborted the transfer after 2 of 4 layers"):
        receiver.recv()
    assert_unchanged(cache, before)
    with pytest.raises(TransferError, match=r"message 1 \(layers 1..1\): a malformed message \(trailer"):
        receiver.recv()
    assert_unchanged(cache, before)
    got = receiver.recv()
    assert got == 1 and cache.length(got) == 203
    results["moved"] = continued(cache, got, seed=71)
    results["moved_state"] = state_bytes(cache, got)

    cached = make(device, prefix_caching=True, max_requests=3)
    cached.release(prefill(cached, 300, seed=60, tokens=TOKENS[:300]))
    free = cached.num_free_blocks
    got = new_receiver(cached, peer=0, timeout=TIMEOUT).recv()
    assert cached.length(got) == 330 and cached.num_free_blocks == free - 3  # 2 cached blocks taken, 1 fresh
    results["dedup"] = continued(cached, got, seed=72)
    results["dedup_state"] = state_bytes(cached, got)
    torch.save(results, os.path.join(out, "receiver.pt"))
    if not dead_peer:
        return
    cache.release(1)
    before = snapshot(cache)
    with pytest.raises(TransferError, match="message 1"):
        receiver.recv()
    assert_unchanged(cache, before)
    os._exit(0)  # its failed receive may still hold the dead pair's buffers


def _init(rank: int, backend: str, init_file: str) -> str:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=TIMEOUT)
    if backend == "nccl":  # control messages over gloo beside NCCL's bytes, as PrefillRouter sends them
        CONTROL["group"] = dist.new_group([0, 1], backend="gloo")
    return "cpu" if backend == "gloo" else f"cuda:{rank}"


def _run(rank: int, backend: str, init_file: str, out: str) -> None:
    device = _init(rank, backend, init_file)
    # a dead peer: gloo raises at once; NCCL waits for its watchdog, which ends the process
    (_sender if rank == 0 else _receiver)(device, out, dead_peer=backend == "gloo")
    dist.destroy_process_group()


@functools.lru_cache(maxsize=None)
def reference(device: str) -> dict:
    """The moves' continuations without a move: the same prefill and steps in one cache, on one thread as the two
    processes run (a CPU matmul's summation order depends on its threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain, cached = make(device), make(device, prefix_caching=True)
        a, b = prefill(plain, 203, seed=70), prefill(cached, 330, seed=60, tokens=TOKENS)
        return {"moved": continued(plain, a, seed=71), "moved_state": state_bytes(plain, a),
                "dedup": continued(cached, b, seed=72), "dedup_state": state_bytes(cached, b)}
    finally:
        torch.set_num_threads(threads)


BACKENDS = [pytest.param("gloo", id="gloo-cpu"),
            pytest.param("nccl", id="nccl-2gpu", marks=pytest.mark.skipif(
                torch.cuda.device_count() < 2 or not dist.is_nccl_available(), reason="needs two CUDA GPUs"))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_processes_move_requests(tmp_path, backend):
    mp.spawn(_run, args=(backend, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    sent, received = torch.load(tmp_path / "sender.pt"), torch.load(tmp_path / "receiver.pt")
    want = reference("cpu" if backend == "gloo" else "cuda:0")
    for key in ("moved", "dedup"):
        for i, (a, b, c) in enumerate(zip(received[key], sent[key], want[key])):
            assert torch.isfinite(a).all(), f"{key} step {i}: a poisoned byte was read"
            assert torch.equal(a.view(torch.uint8), c.view(torch.uint8)), f"{key} step {i}: receiver differs"
            assert torch.equal(b.view(torch.uint8), c.view(torch.uint8)), f"{key} step {i}: sender differs"
        for states in (received, sent):
            got, ref = states[f"{key}_state"], want[f"{key}_state"]
            assert got.keys() == ref.keys() and got["length"] == ref["length"]
            assert all(torch.equal(got[k].cpu(), ref[k].cpu()) for k in ref if k != "length")


def _receiver_leaves(rank: int, backend: str, init_file: str, out: str) -> None:
    """The receiver accepts, then leaves before any layer arrives: the sender's request stays live and servable."""
    device = _init(rank, backend, init_file)
    if rank == 1:
        channel = new_receiver(make(device), peer=0, timeout=TIMEOUT).control
        header = channel.recv_message(1, "header")  # HEADER
        channel.send_message(2, transfer_id=header.transfer_id, what="reply")  # REPLY: ACCEPT, skip 0
        os._exit(0)
    cache = make(device)
    rid = prefill(cache, 203, seed=70)
    before = snapshot(cache)
    sender = new_sender(cache, rid, peer=1, timeout=TIMEOUT)
    assert sender.start() == 0
    with pytest.raises(TransferError):
        sender.send_all()
        sender.finish()
    assert_unchanged(cache, before)
    torch.save({"moved": continued(cache, rid, seed=71)}, os.path.join(out, "sender.pt"))
    os._exit(0)


def test_a_receiver_that_leaves_midway_leaves_the_senders_request_servable(tmp_path):
    mp.spawn(_receiver_leaves, args=("gloo", str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    sent = torch.load(tmp_path / "sender.pt")
    for a, b in zip(sent["moved"], reference("cpu")["moved"]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_the_transfer_bench_runs_on_two_cpu_processes():
    """`python -m dsv4kv.tools.bench.transfer --cpu`: every part at tiny sizes over gloo, every check passed."""
    from dsv4kv.tools.bench.transfer import CPU, run_transfer_bench

    results, meta = run_transfer_bench(backend="gloo", sizes=CPU, log=lambda _: None)
    assert meta["gpus"] == ["cpu", "cpu"] and meta["backend"] == "gloo"
    assert [r.name for r in results] == ["gloo send/recv, one buffer, 1K", "transfer (recv_state), 1K",
                                         "move incl. import (recv), 1K", "mixed: one GPU serving both",
                                         "mixed: disaggregated (two GPUs)"]
    assert all(r.passed and r.time_us > 0 for r in results), [r.check for r in results]
    assert "sha256 equals" in results[2].check and "for 4 of 4 requests" in results[4].check
    assert results[1].bytes == results[0].bytes > 0
    mixed = results[4].extra
    assert mixed["router_moved"] == 4 and mixed["gaps"] == 2 * (CPU.decode_new - 1) + 2 * (CPU.long_new - 1)
    assert 0 < mixed["itl_p50_ms"] <= mixed["itl_p99_ms"]


# --- a sender whose request changes, a header of the wrong shape ----------------------------------
def _guarded(rank: int, backend: str, init_file: str, out: str) -> None:
    """Each refusal or abort leaves the receiver's cache as it was and the pair in step: a request in a tentative step
    is refused before anything is sent; a step planned, or the request released, between start() and a later layer
    aborts the transfer; a JSON header whose spec is not a mapping gets a REFUSED reply (the sender does not wait
    for a reply that never comes). Then a whole request moves, every byte equal."""
    from dsv4kv.cache.manager import RequestError

    device = _init(rank, backend, init_file)
    if rank == 1:
        cache = make(device)
        busy = cache.admit()
        assert cache.plan_step([(busy, 150)])
        receiver = new_receiver(cache, peer=0, timeout=TIMEOUT)
        before = snapshot(cache)
        for match in ("aborted the transfer after 1 of 4 layers", "aborted the transfer after 0 of 4 layers",
                      r"a malformed header: AttributeError"):
            with pytest.raises(TransferError, match=match):
                receiver.recv()
            assert_unchanged(cache, before)
        got = receiver.recv()
        torch.save({"state": state_bytes(cache, got)}, os.path.join(out, "receiver.pt"))
        dist.destroy_process_group()
        return
    cache = make(device)
    rid = prefill(cache, 203, seed=70)
    # a verify step awaits accept: refused at start, nothing sent
    plan = cache.plan_step([(rid, 3)], tentative=True)
    run(cache, plan, hidden(5, 3, cache.device))
    with pytest.raises(RequestError, match=r"start: a tentative step awaits accept\(\) of requests \[0\]"):
        new_sender(cache, rid, peer=1, timeout=TIMEOUT).start()
    cache.accept(rid, 1)  # settled: 204 tokens
    sender = new_sender(cache, rid, peer=1, message_bytes=0, timeout=TIMEOUT)
    assert sender.start() == 0 and sender.length == 204
    sender.send_layer(0)
    run(cache, cache.plan_step([(rid, 1)]), hidden(6, 1, cache.device))  # a decode step: 205 tokens, new bytes
    with pytest.raises(TransferError, match=r"a step was planned after start\(\) \(steps_planned 4 then 5\)"):
        sender.send_layer(1)
    other = prefill(cache, 131, seed=71)
    sender = new_sender(cache, other, peer=1, timeout=TIMEOUT)  # one message: aborted before any layer
    assert sender.start() == 0
    cache.release(other)
    with pytest.raises(TransferError, match=f"request {other} was released or swapped out after start"):
        sender.send_layer(0)
    # a well-formed JSON header whose spec is a list, longer than a control message's frame
    channel = sender.control
    data = json.dumps({"format": FORMAT, "spec": [], "pad": "x" * 40000}).encode()  # longer than one frame
    channel.send_message(1, transfer_id=12345, text=data, what="header")  # HEADER
    reply = channel.recv_message(2, "reply")  # REPLY
    assert reply.status == 1 and reply.transfer_id == 12345  # REFUSED, this transfer
    assert "AttributeError" in reply.text.decode()
    assert send_whole(cache, rid, peer=1, timeout=TIMEOUT) == 1
    torch.save({"state": state_bytes(cache, rid)}, os.path.join(out, "sender.pt"))
    dist.destroy_process_group()


def test_a_request_that_changes_midway_or_a_bad_header_leaves_the_receiver_as_it_was(tmp_path):
    mp.spawn(_guarded, args=("gloo", str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    sent, received = torch.load(tmp_path / "sender.pt")["state"], torch.load(tmp_path / "receiver.pt")["state"]
    assert sent.keys() == received.keys() and sent["length"] == received["length"] == 205
    assert all(torch.equal(sent[k], received[k]) for k in sent if k != "length")
