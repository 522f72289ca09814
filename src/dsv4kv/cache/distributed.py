"""A request's cache state moved between two processes over torch.distributed (docs/request-state.md): NCCL between
GPUs, gloo between CPU processes; point-to-point sends and receives only, no socket of our own.

    # sender (rank 0)                                   # receiver (rank 1)
    sender = RequestSender(cache, rid, peer=1, tokens=ids)   receiver = RequestReceiver(cache, peer=0)
    sender.start()          # header -> reply                rid = receiver.recv()   # -> its id, or NoRoom
    for i in range(layers): sender.send_layer(i)
    answer = sender.finish()  # the receiver's id, or NoRoom

The messages, in order, between one sender and one receiver (a pair's point-to-point messages arrive in order):

1. header (sender -> receiver): a control word block (int64 [8]: magic, HEADER, JSON bytes, token count, transfer
   id), the JSON (format, the spec fields of `transfer.spec_fields`, length, tensor names, bytes per layer, layers
   per message) and the token ids (int64, when given). The receiver checks the spec, names, sizes and room *before* it allocates
   anything, and looks its token ids up in its prefix cache.
2. reply (receiver -> sender): ACCEPT with `skip_tokens` (the whole blocks its prefix cache holds: their pages are
   not sent, as in `export_request(rid, skip_tokens=...)`), or REFUSED / NO_ROOM with the reason. Nothing else
   follows a refusal.
3. the layers, in order, in messages of consecutive layers (`message_bytes`: 32 MiB by default, or one layer per
   message): each layer's request tensors (`LayerCache.request_tensors` order, pages from block
   skip_tokens / page_tokens on) packed into the message's uint8 buffer, each part at a 16-byte offset, then a
   64-byte trailer (magic, LAYER or ABORT, message index, payload bytes, transfer id, first and end layer). The
   receiver posts every message's receive at once into staging buffers (on the cache's device for NCCL), so the
   link never waits on the host. The sender gathers each layer when it is ready (`send_layer(i)`, any time after
   layer i ran over the request's last plan: a prefill can send layer i while layers > i compute) and posts a
   message's send once its last layer is in; a layer's gather is a few launches (one `index_select` per paged
   pool, through 8-byte elements where the page size allows, and one multi-tensor copy of the slot's rows).
   Measured on two H200s over NCCL (docs/performance.md), a 128K-token request's move took 12.8 ms where one
   `dist.send` of the same 482 MB takes 1.54 ms; where the difference goes is not profiled yet.
4. final reply (receiver -> sender): DONE with the receiver's request id, NO_ROOM (its prefix blocks were evicted
   or its room taken meanwhile), or FAILED (an ABORT trailer, a malformed message).

Faults leave both caches as they were: the sender only reads its cache (its request stays live until the caller
releases it after DONE), and the receiver imports (`CacheManager.import_request`) only after every layer arrived
whole, so an abort, a malformed message, a dead peer or a timeout allocates nothing. `TransferError` reports each.
An ABORT (`RequestSender.abort`) or a malformed-but-complete message keeps the pair in step for the next transfer;
after a dead peer or a timeout, messages may be left in flight: make a new process group before the next transfer.

Between `start()` and the last `send_layer` the request must not step, be released or swapped out: `start()` refuses
a request while a tentative step (speculative decoding) awaits `accept` (RequestError, nothing sent), and
`send_layer` aborts the transfer (the receiver keeps nothing) and raises TransferError if the request left or any
step was planned since `start()`. Running the layers of the plan `start()` saw, and sending each one after it ran, is
allowed.
"""

from __future__ import annotations

import functools
import json
import secrets
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from .manager import CacheManager, RequestError
from .pools import CachePools
from .spec import CacheSpec
from .swap import NoRoom
from .transfer import RequestState, check_spec, first_block, spec_fields, tensor_names

__all__ = ["RequestSender", "RequestReceiver", "TransferError", "send_request", "FORMAT"]

FORMAT = "dsv4kv.request-transfer/1"
MAGIC = 0x3476_7364_6B76  # "kvdsv4"
HEADER, REPLY, LAYER, ABORT, FINAL = 1, 2, 3, 4, 5
ACCEPT, REFUSED, NO_ROOM, DONE, FAILED = 0, 1, 2, 3, 4
TRAILER = 64  # bytes: int64 [8]
ALIGN = 16
MESSAGE_BYTES = 32 << 20  # a sender's default message size: few sends, each long enough for the link's full rate


class TransferError(RuntimeError):
    """A transfer that did not complete (the peer aborted, died, timed out, or sent a malformed message). Both caches
    are as they were before it."""


@dataclass(frozen=True)
class _Part:
    name: str
    offset: int  # in the layer's buffer
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@functools.lru_cache(maxsize=16)
def _template(spec: CacheSpec) -> tuple[tuple[tuple[str, torch.dtype, tuple[int, ...], bool], ...], ...]:
    """Per layer, its request tensors' (name, dtype, row shape, paged): a function of the spec, read once from pools
    on the meta device (no memory), so a transfer pays no per-layer Python walk over a cache's tensors."""
    pools = CachePools(spec, num_blocks=1, max_requests=1, device=torch.device("meta"))
    names = iter(tensor_names(pools))
    return tuple(tuple((next(names), t.dtype, tuple(t.shape[1:]), paged) for t, paged in layer.request_tensors())
                 for layer in pools.layers)


@functools.lru_cache(maxsize=64)
def _layout(spec: CacheSpec, blocks: int) -> tuple[tuple[_Part, ...], ...]:
    """Per layer, where each of its request tensors sits in the layer's buffer for a state of `blocks` pages."""
    layers = []
    for rows in _template(spec):
        parts, offset = [], 0
        for name, dtype, row, paged in rows:
            part = _Part(name, offset, dtype, (blocks, *row) if paged else row)
            parts.append(part)
            offset += -(-part.nbytes // ALIGN) * ALIGN
        layers.append(tuple(parts))
    return tuple(layers)


def _names(spec: CacheSpec) -> list[str]:
    return [name for rows in _template(spec) for name, *_ in rows]


@dataclass(frozen=True)
class _Message:
    """Layers first..end-1 of a state in one buffer: each layer's parts at `offsets[i - first]`, then the trailer."""

    index: int
    first: int
    end: int
    offsets: tuple[int, ...]
    payload: int  # bytes before the trailer (a multiple of ALIGN)

    @property
    def nbytes(self) -> int:
        return self.payload + TRAILER


def _group(layer_bytes: list[int], message_bytes: int) -> list[int]:
    """Layers per message: consecutive layers until a message holds at least `message_bytes` (0: one layer each)."""
    counts, size = [], 0
    for nbytes in layer_bytes:
        if not counts or size >= message_bytes:
            counts.append(0)
            size = 0
        counts[-1] += 1
        size += nbytes
    return counts


def _messages(layers: tuple[tuple[_Part, ...], ...], counts: list[int]) -> list[_Message]:
    messages, first = [], 0
    for m, count in enumerate(counts):
        offsets, offset = [], 0
        for parts in layers[first:first + count]:
            offsets.append(offset)
            offset += -(-_payload_bytes(parts) // ALIGN) * ALIGN
        messages.append(_Message(m, first, first + count, tuple(offsets), offset))
        first += count
    return messages


def _payload_bytes(parts: tuple[_Part, ...]) -> int:
    return parts[-1].offset + parts[-1].nbytes if parts else 0


def _comm_device(cache: CacheManager, group) -> torch.device:
    """NCCL moves device tensors; gloo moves host tensors."""
    return cache.device if dist.get_backend(group) == "nccl" else torch.device("cpu")


class _Channel:
    """Point-to-point messages with one peer, each wait bounded by `timeout`; a failed one raises TransferError."""

    def __init__(self, peer: int, group, device: torch.device, timeout: timedelta | None):
        if isinstance(peer, bool) or not isinstance(peer, int) or peer < 0:
            raise ValueError(f"peer: expected a rank >= 0, got {peer!r}")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
        self.peer, self.group, self.device = peer, group, device
        self.timeout = timeout if timeout is not None else timedelta(0)  # 0: the group's own timeout

    def post_send(self, tensor: torch.Tensor):
        try:
            return dist.isend(tensor, self.peer, group=self.group)
        except Exception as e:  # a pair already closed fails at once
            raise TransferError(f"send to rank {self.peer}: {type(e).__name__}: {e}") from e

    def post_recv(self, tensor: torch.Tensor):
        try:
            return dist.irecv(tensor, self.peer, group=self.group)
        except Exception as e:
            raise TransferError(f"receive from rank {self.peer}: {type(e).__name__}: {e}") from e

    def wait(self, work, what: str) -> None:
        try:
            ok = work.wait(self.timeout) if self.timeout else work.wait()
        except Exception as e:  # a dead peer, a timeout: the backends raise RuntimeError subclasses
            raise TransferError(f"{what}: {type(e).__name__}: {e}") from e
        if ok is False:
            raise TransferError(f"{what}: timed out")

    def send(self, tensor: torch.Tensor, what: str) -> None:
        self.wait(self.post_send(tensor), what)

    def recv(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        self.wait(self.post_recv(tensor), what)
        return tensor

    def control(self, *words: int) -> torch.Tensor:
        return torch.tensor(list(words) + [0] * (8 - len(words)), dtype=torch.int64).to(self.device)

    def recv_control(self, kind: int, what: str) -> list[int]:
        words = self.recv(torch.zeros(8, dtype=torch.int64, device=self.device), what).tolist()
        if words[0] != MAGIC or words[1] != kind:
            raise TransferError(f"{what}: a malformed message (control words {words[:3]})")
        return words

    def send_bytes(self, data: bytes, what: str) -> None:
        if data:
            self.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device), what)

    def recv_bytes(self, n: int, what: str) -> bytes:
        if not n:
            return b""
        return self.recv(torch.empty(n, dtype=torch.uint8, device=self.device), what).cpu().numpy().tobytes()


class RequestSender:
    """Sends live request `rid` of `cache` to rank `peer`: `start()`, `send_layer(i)` for every layer in order, then
    `finish()`; or `abort()` after `start()`. The sender's cache is only read; the request stays live (release it
    after `finish()` answers the receiver's id).

    tokens: the request's token ids (at least `cache.length(rid)` of them; the receiver's prefix cache finds the
        pages it holds by them and the imported request carries them), or None (every page is sent).
    message_bytes: consecutive layers share a message until it holds this many bytes (default 32 MiB: few sends,
        each large enough for the link's full rate); 0 sends each layer as soon as it is gathered (overlapping a
        prefill layer by layer).
    timeout: bound on each wait (default: the process group's timeout). On NCCL a wait with a timeout polls on the
        host until the operation is done; leave it None where the transfer's speed matters.
    """

    def __init__(self, cache: CacheManager, rid: int, *, peer: int, group=None, tokens=None,
                 message_bytes: int = MESSAGE_BYTES, timeout: timedelta | None = None):
        if not isinstance(cache, CacheManager):
            raise TypeError(f"cache: expected a CacheManager, got {type(cache).__name__}")
        self.cache, self.rid = cache, rid
        self.length = cache.length(rid)  # raises RequestError for an unknown id
        if not cache.is_live(rid):
            raise ValueError(f"request {rid} is swapped out: swap it in before sending it")
        self.tokens = None
        if tokens is not None:
            self.tokens = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
            if self.tokens.dim() != 1 or self.tokens.numel() < self.length:
                raise ValueError(f"tokens: expected at least the request's {self.length} token ids, got "
                                 f"{list(self.tokens.shape)}")
        if isinstance(message_bytes, bool) or not isinstance(message_bytes, int) or message_bytes < 0:
            raise ValueError(f"message_bytes: expected an int >= 0, got {message_bytes!r}")
        self.message_bytes = message_bytes
        self.channel = _Channel(peer, group, _comm_device(cache, group), timeout)
        self.transfer_id = secrets.randbits(62)
        self.skip_tokens: int | None = None  # from the receiver's reply
        self.bytes_sent = 0
        self._next_layer = 0
        self._works: list = []  # (work, buffer) of messages in flight
        self._layers: tuple[tuple[_Part, ...], ...] = ()
        self._messages: list[_Message] = []
        self._buffer: torch.Tensor | None = None  # the message being gathered

    def start(self) -> int | NoRoom:
        """Send the header and wait for the receiver's reply: the tokens whose pages it already holds (they are not
        sent), or NoRoom when it has no room now. ValueError when it refuses the state (another spec), carrying its
        reason; TransferError on a fault."""
        if self.skip_tokens is not None:
            raise RuntimeError("start: already started")
        if not self.cache.is_live(self.rid):
            raise RequestError(f"start: request {self.rid} is not live (released or swapped out)")
        pending = self.cache.awaiting_accept()
        if pending:  # the step's bytes settle once every request of it is accepted; nothing is sent
            raise RequestError(f"start: a tentative step awaits accept() of requests {pending}; accept (or release) "
                               f"them before sending request {self.rid}")
        self.length = self.cache.length(self.rid)  # steps may have run since the sender was made
        if self.tokens is not None and self.tokens.numel() < self.length:
            raise ValueError(f"tokens: expected at least the request's {self.length} token ids, got "
                             f"{self.tokens.numel()}")
        self._step = self.cache.steps_planned
        spec = self.cache.spec
        blocks = spec.blocks_for(self.length)
        layer_bytes = [_payload_bytes(p) for p in _layout(spec, blocks)]
        counts = _group(layer_bytes, self.message_bytes)
        header = json.dumps({"format": FORMAT, "spec": spec_fields(spec), "length": self.length,
                             "names": _names(spec), "layer_bytes": layer_bytes, "messages": counts})
        data = header.encode()
        n = self.tokens.numel() if self.tokens is not None else 0
        ch = self.channel
        ch.send(ch.control(MAGIC, HEADER, len(data), n, self.transfer_id), "header")
        ch.send_bytes(data, "header")
        if n:
            ch.send(self.tokens.to(ch.device), "token ids")
        words = ch.recv_control(REPLY, "reply")
        status, skip, reason_bytes = words[2], words[3], words[4]
        reason = ch.recv_bytes(reason_bytes, "reply").decode(errors="replace")
        if status == REFUSED:
            raise ValueError(f"the receiver (rank {ch.peer}) refused the request's state: {reason}")
        if status == NO_ROOM:
            what, needed, free = json.loads(reason)
            return NoRoom(what, needed, free)
        if status != ACCEPT or words[5] != self.transfer_id:
            raise TransferError(f"reply: a malformed message (control words {words[:6]})")
        try:
            k = first_block(skip, self.length, spec.page_tokens)
        except ValueError as e:
            raise TransferError(f"reply: the receiver asked to skip {skip} tokens: {e}") from e
        self.skip_tokens = skip
        self._layers = _layout(spec, blocks - k)
        self._messages = _messages(self._layers, counts)
        self._index = torch.tensor(self.cache.blocks(self.rid)[k:], dtype=torch.long, device=self.cache.device)
        self._slot = self.cache.slot(self.rid)
        self._trailers = torch.tensor([_trailer(LAYER, m, self.transfer_id) for m in self._messages],
                                      dtype=torch.int64).to(ch.device)
        self._message_of = [m for m in self._messages for _ in range(m.first, m.end)]
        return skip

    def send_layer(self, i: int) -> None:
        """Gather layer i's part of the request's state into its message, and post the message's send once its last
        layer is in (layers in order, each once). Call it any time after layer i ran over the request's last plan;
        the send overlaps what the caller runs next."""
        if self.skip_tokens is None:
            raise RuntimeError("send_layer: start() first (and it must have accepted)")
        if i != self._next_layer:
            raise ValueError(f"send_layer: layer {self._next_layer} is next, got {i}")
        try:
            self._check_unchanged()
        except TransferError:
            self.abort()  # the receiver drops what came and answers FAILED: its cache is unchanged
            raise
        message = self._message_of[i]
        if self._buffer is None:
            self._buffer = torch.empty(message.nbytes, dtype=torch.uint8, device=self.channel.device)
        base = message.offsets[i - message.first]
        dsts, srcs = [], []
        for part, (tensor, paged) in zip(self._layers[i], self.cache.pages(i).request_tensors()):
            dst = self._buffer[base + part.offset:base + part.offset + part.nbytes]
            if paged:  # the request's blocks
                _gather(tensor, self._index, dst)
            else:  # the slot's rows, as bytes: one multi-tensor copy for the layer
                dsts.append(dst)
                srcs.append(tensor[self._slot].view(-1).view(torch.uint8))
        if dsts and all(d.device == t.device for d, t in zip(dsts, srcs)):
            torch._foreach_copy_(dsts, srcs)
        else:
            for d, t in zip(dsts, srcs):
                d.copy_(t)
        self._next_layer += 1
        if i == message.end - 1:
            self._post(message, LAYER)

    def _check_unchanged(self) -> None:
        """TransferError unless the request is live and no step was planned since start(): the blocks, slot and length
        the header announced are still the request's."""
        if not self.cache.is_live(self.rid):
            raise TransferError(f"send_layer: request {self.rid} was released or swapped out after start(); the "
                                f"transfer is aborted (the receiver keeps nothing)")
        if self.cache.steps_planned != self._step:
            raise TransferError(f"send_layer: a step was planned after start() (steps_planned {self._step} then "
                                f"{self.cache.steps_planned}): the request's state may no longer be the "
                                f"{self.length} tokens the header announced; the transfer is aborted (the receiver "
                                f"keeps nothing)")

    def send_all(self) -> None:
        for i in range(self._next_layer, len(self._layers)):
            self.send_layer(i)

    def abort(self) -> None:
        """Stop after the layers sent so far: the message being gathered and the rest go as ABORT messages (their
        sizes, not their bytes), the receiver drops everything and answers FAILED; the pair stays in step. Raises
        TransferError only on a fault."""
        if self.skip_tokens is None:
            raise RuntimeError("abort: nothing to abort before start() accepted")
        if self._next_layer < len(self._layers):
            for message in self._messages[self._message_of[self._next_layer].index:]:
                self._post(message, ABORT)
        self._next_layer = len(self._layers)
        status, _, reason = self._final()
        if status != FAILED:
            raise TransferError(f"final reply: expected FAILED after an abort, got status {status} ({reason})")

    def finish(self) -> int | NoRoom:
        """Wait until every layer is sent and the receiver answers: its request id (-1: it took the state to import
        later, `RequestReceiver.recv_state`), or NoRoom (its room or cached prefix went meanwhile; nothing changed
        there). TransferError if it failed the transfer or on a fault."""
        if self.skip_tokens is None or self._next_layer != len(self._layers):
            raise RuntimeError(f"finish: {self._next_layer} of {len(self._layers)} layers sent")
        status, value, reason = self._final()
        if status == DONE:
            return value
        if status == NO_ROOM:
            what, needed, free = json.loads(reason)
            return NoRoom(what, needed, free)
        raise TransferError(f"the receiver (rank {self.channel.peer}) failed the transfer: {reason}")

    def _post(self, message: _Message, kind: int) -> None:
        buffer = self._buffer
        if buffer is None:  # an aborted message never gathered
            buffer = torch.empty(message.nbytes, dtype=torch.uint8, device=self.channel.device)
        trailer = buffer[-TRAILER:].view(torch.int64)
        trailer.copy_(self._trailers[message.index])
        if kind != LAYER:
            trailer[1] = kind
        self._works.append((self.channel.post_send(buffer), buffer))
        self.bytes_sent += buffer.numel()
        self._buffer = None

    def _final(self) -> tuple[int, int, str]:
        """Wait for the messages in flight and the receiver's final reply: (status, value, reason)."""
        ch = self.channel
        for i, (work, _) in enumerate(self._works):
            ch.wait(work, f"message {i}")
        self._works.clear()
        words = ch.recv_control(FINAL, "final reply")
        reason = ch.recv_bytes(words[4], "final reply").decode(errors="replace")
        if words[5] != self.transfer_id or words[2] not in (DONE, NO_ROOM, FAILED):
            raise TransferError(f"final reply: a malformed message (control words {words[:6]})")
        return words[2], words[3], reason


def _wide(rows: torch.Tensor, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` [N, ...] (contiguous) as [N, row] and `flat` (its destination bytes) as [n, row], in the widest integer
    type the row bytes and both addresses allow: a gather moves elements, so 8-byte ones move 8x fewer."""
    row = rows[0].numel() * rows.element_size()
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        w = dtype.itemsize
        if row % w == 0 and rows.data_ptr() % w == 0 and flat.data_ptr() % w == 0:
            return rows.view(rows.shape[0], -1).view(torch.uint8).view(dtype), flat.view(-1, row).view(dtype)
    raise AssertionError("unreachable: uint8 always fits")


def _gather(pool: torch.Tensor, index: torch.Tensor, dst: torch.Tensor) -> None:
    """dst (uint8, a staging slice) <- the bytes of pool's rows `index`, in order."""
    src, out = _wide(pool, dst)
    if out.device == src.device:
        torch.index_select(src, 0, index, out=out)
    else:
        out.copy_(src[index])


def _trailer(kind: int, message: _Message, transfer_id: int) -> list[int]:
    return [MAGIC, kind, message.index, message.payload, transfer_id, message.first, message.end, 0]


class RequestReceiver:
    """Receives requests' cache states from rank `peer` into `cache`, one `recv()` per request.

    timeout: bound on each wait (default: the process group's timeout; see `RequestSender`). A receive that failed
        keeps its posted buffers here (the backend may still write them) until the receiver is dropped.
    """

    def __init__(self, cache: CacheManager, *, peer: int, group=None, timeout: timedelta | None = None):
        if not isinstance(cache, CacheManager):
            raise TypeError(f"cache: expected a CacheManager, got {type(cache).__name__}")
        self.cache = cache
        self.channel = _Channel(peer, group, _comm_device(cache, group), timeout)
        self.bytes_received = 0
        self._stale: list = []

    def recv(self) -> int | NoRoom:
        """Receive one request and import it: its id here, or NoRoom (no slot, too few blocks, or its cached prefix
        evicted; the sender was told, nothing changed). ValueError when its spec or shapes differ from this cache's
        (the sender was told why, nothing changed); TransferError on an ABORT, a malformed message, a dead peer or a
        timeout, with nothing changed."""
        return self._recv(import_now=True)

    def recv_state(self) -> RequestState:
        """Receive one request's whole state (every page: the cache may change before it is imported) without
        importing it: the caller imports it later (`CacheManager.import_request`, or an engine's admission). Its
        tensors are staging buffers on the transfer's device. The sender's `finish()` answers -1. Errors as `recv`."""
        return self._recv(import_now=False)

    def _recv(self, *, import_now: bool) -> int | NoRoom | RequestState:
        ch, cache = self.channel, self.cache
        words = ch.recv_control(HEADER, "header")
        transfer_id, n = words[4], words[3]
        data = ch.recv_bytes(words[2], "header")
        tokens = ch.recv(torch.empty(n, dtype=torch.int64, device=ch.device), "token ids").cpu() if n else None
        try:
            header = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self._reply(REPLY, REFUSED, 0, transfer_id, f"a malformed header: {e}")
            raise TransferError(f"header: a malformed message: {e}") from e
        try:  # whatever fails here, the sender is told (it waits for this reply) before this side raises
            length, skip, counts = self._check(header, tokens, skip_cached=import_now)
            room = self._room(length, tokens, skip) if import_now else None
        except ValueError as e:
            self._reply(REPLY, REFUSED, 0, transfer_id, str(e))
            raise
        except Exception as e:  # a well-formed JSON of the wrong shape
            reason = f"a malformed header: {type(e).__name__}: {e}"
            self._reply(REPLY, REFUSED, 0, transfer_id, reason)
            raise TransferError(f"header: {reason}") from e
        if room is not None:
            self._reply(REPLY, NO_ROOM, 0, transfer_id, json.dumps([room.resource, room.needed, room.free]))
            return room
        self._reply(REPLY, ACCEPT, skip, transfer_id)

        k = skip // cache.spec.page_tokens
        layers = _layout(cache.spec, cache.spec.blocks_for(length) - k)
        messages = _messages(layers, counts)
        buffers = [torch.empty(m.nbytes, dtype=torch.uint8, device=ch.device) for m in messages]
        works = []  # all posted at once: the link never waits on the host
        try:
            for buffer in buffers:
                works.append(ch.post_recv(buffer))
        except TransferError:
            self._stale.append((works, buffers))
            raise
        tensors = {}  # the state's tensors, views of the buffers, made while the bytes are on their way
        for message, buffer in zip(messages, buffers):
            for parts, base in zip(layers[message.first:message.end], message.offsets):
                for part in parts:
                    start = base + part.offset
                    tensors[part.name] = buffer[start:start + part.nbytes].view(part.dtype).view(part.shape)
        for i, work in enumerate(works):
            try:
                ch.wait(work, f"message {i}")
            except TransferError:
                self._stale.append((works[i:], buffers))
                raise
        self.bytes_received += sum(b.numel() for b in buffers)
        trailers = torch.stack([b[-TRAILER:].view(torch.int64) for b in buffers]).cpu().tolist()  # one sync
        problem = self._problem(trailers, messages, len(layers), transfer_id)
        if problem is not None:
            self._reply(FINAL, FAILED, 0, transfer_id, problem)
            raise TransferError(problem)
        try:  # checked with the header; only a bug gets here, and the sender still gets its final reply
            state = RequestState(header["spec"], length, tokens, tensors, first_block=k)
            answer = cache.import_request(state) if import_now else -1
        except Exception as e:
            self._reply(FINAL, FAILED, 0, transfer_id, f"{type(e).__name__}: {e}")
            raise
        if not import_now:
            self._reply(FINAL, DONE, -1, transfer_id)
            return state
        if isinstance(answer, NoRoom):
            self._reply(FINAL, NO_ROOM, 0, transfer_id, json.dumps([answer.resource, answer.needed, answer.free]))
        else:
            self._reply(FINAL, DONE, answer, transfer_id)
        return answer

    def _check(self, header: dict, tokens: torch.Tensor | None, *, skip_cached: bool) -> tuple[int, int, list[int]]:
        """(length, skip_tokens, layers per message) of a header this cache can take; ValueError naming what
        differs."""
        cache = self.cache
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError(f"expected a {FORMAT} header, got format {header.get('format')!r}"
                             if isinstance(header, dict) else "a header that is not a JSON object")
        check_spec(header.get("spec", {}), cache.spec)
        length = header.get("length")
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= cache.max_seq_len:
            raise ValueError(f"length: expected an int in [0, {cache.max_seq_len}] (this cache's max_seq_len), "
                             f"got {length!r}")
        if cache.spec.blocks_for(length) > cache.num_blocks:
            raise ValueError(f"{length} tokens need {cache.spec.blocks_for(length)} blocks, the cache has "
                             f"{cache.num_blocks}")
        if header.get("names") != _names(cache.spec):
            raise ValueError("the state's tensor names differ from this cache's")
        want = [_payload_bytes(p) for p in _layout(cache.spec, cache.spec.blocks_for(length))]
        if header.get("layer_bytes") != want:
            raise ValueError(f"bytes per layer: {header.get('layer_bytes')} in the state, {want} here")
        if tokens is not None and tokens.numel() < length:
            raise ValueError(f"{tokens.numel()} token ids for {length} tokens")
        counts = header.get("messages")
        if (not isinstance(counts, list) or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0
                                                    for c in counts) or sum(counts) != len(want)):
            raise ValueError(f"messages: expected positive layer counts summing to {len(want)}, got {counts!r}")
        skip = 0
        if skip_cached and tokens is not None and cache.prefix is not None:
            page = cache.spec.page_tokens
            skip = min(cache.lookup(tokens), length // page * page)
        return length, skip, counts

    def _room(self, length: int, tokens: torch.Tensor | None, skip: int) -> NoRoom | None:
        """What `import_request` would say now if short of a slot or blocks (its cached prefix counted as a hit)."""
        cache, spec = self.cache, self.cache.spec
        if cache.num_live_requests >= cache.max_requests:
            return NoRoom("request slots", 1, 0)
        need = spec.blocks_for(length)
        if skip:  # the hit's blocks live requests hold are shared, not taken
            need -= spec.blocks_for(tokens.numel()) - cache.admission_blocks(tokens)
        if need > cache.num_free_blocks:
            return NoRoom("blocks", need, cache.num_free_blocks)
        return None

    @staticmethod
    def _problem(trailers: list[list[int]], messages: list[_Message], num_layers: int, transfer_id: int) -> str | None:
        for words, message in zip(trailers, messages):
            if words == _trailer(ABORT, message, transfer_id):
                return f"the sender aborted the transfer after {message.first} of {num_layers} layers"
            if words != _trailer(LAYER, message, transfer_id):
                return (f"message {message.index} (layers {message.first}..{message.end - 1}): a malformed message "
                        f"(trailer {words[:7]})")
        return None

    def _reply(self, kind: int, status: int, value: int, transfer_id: int, reason: str = "") -> None:
        data = reason.encode()
        self.channel.send(self.channel.control(MAGIC, kind, status, value, len(data), transfer_id), "reply")
        self.channel.send_bytes(data, "reply")


def send_request(cache: CacheManager, rid: int, *, peer: int, group=None, tokens=None,
                 message_bytes: int = MESSAGE_BYTES, timeout: timedelta | None = None) -> int | NoRoom:
    """Send live request `rid` whole (`RequestSender`: start, every layer, finish): the receiver's request id, or
    NoRoom. The request stays live here."""
    sender = RequestSender(cache, rid, peer=peer, group=group, tokens=tokens, message_bytes=message_bytes,
                           timeout=timeout)
    answer = sender.start()
    if isinstance(answer, NoRoom):
        return answer
    sender.send_all()
    return sender.finish()
