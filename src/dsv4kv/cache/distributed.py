"""A request's cache state moved between two processes over torch.distributed (docs/request-state.md): NCCL between
GPUs, gloo between CPU processes; point-to-point sends and receives only, no socket of our own.

    # sender (rank 0)                                   # receiver (rank 1)
    sender = RequestSender(cache, rid, peer=1, tokens=ids)   receiver = RequestReceiver(cache, peer=0)
    sender.start()          # header -> reply                rid = receiver.recv()   # -> its id, or NoRoom
    for i in range(layers): sender.send_layer(i)
    answer = sender.finish()  # the receiver's id, or NoRoom

The messages, in order, between one sender and one receiver (a pair's point-to-point messages arrive in order):

1. header (sender -> receiver): a control message (one 32 KiB frame: 8 int64 words, magic, kind, status, value,
   0, transfer id, 0 and the text's length, then the text; a text longer than the frame sends its rest in a second
   message). In a header the value is the token count and the text the JSON of the format, the spec fields of
   `transfer.spec_fields`, length, tensor names, bytes per layer, layers per message and the sender's chunk bytes.
   The token ids (int64, when given) follow. The receiver checks the spec, names, sizes and room, and allocates its
   staging, before it answers; it looks its token ids up in its prefix cache. The sender allocates its staging
   before the header.
2. reply (receiver -> sender), a control message: ACCEPT with `skip_tokens` (the whole blocks its prefix cache
   holds: their pages are not sent, as in `export_request(rid, skip_tokens=...)`), or REFUSED / NO_ROOM with the
   reason. Nothing else follows a refusal.
3. the layers, in order, in messages of consecutive layers (`message_bytes`: 1 GiB by default, so a request's state
   is mostly one message; or one layer per message), each sent in `chunk_bytes` sends and ending in a 64-byte trailer
   (magic, LAYER or ABORT, message index, payload bytes, transfer id, first and end layer). Inside a message the
   request's tensors (pages from block skip_tokens / page_tokens on) go field by field, and within a field the
   layers stored together (`CachePools.stacks`) back to back: a *run*, which one `index_select` over the group's
   rows (`CachePools.stack_rows`) fills, moving 8-byte elements where the rows allow. The receiver posts every
   chunk's receive at once into staging buffers (on the cache's device for NCCL), so the link never waits on the
   host. The sender gathers each chunk right before its send (`send_all`: a select per run the chunk overlaps), or
   each layer when it is ready (`send_layer(i)`, any time after layer i ran over the request's last plan: a prefill
   can send layer i while layers > i compute, a launch per part), and posts a message's sends once its last layer is
   in.
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
import math
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from .manager import CacheManager, RequestError
from .pools import CachePools, wide_views
from .spec import CacheSpec
from .swap import NoRoom
from .transfer import REQUEST_FIELDS, RequestState, check_spec, first_block, spec_fields, tensor_names

__all__ = ["RequestSender", "RequestReceiver", "TransferError", "send_request", "FORMAT"]

FORMAT = "dsv4kv.request-transfer/2"
MAGIC = 0x3476_7364_6B76  # "kvdsv4"
HEADER, REPLY, LAYER, ABORT, FINAL = 1, 2, 3, 4, 5
ACCEPT, REFUSED, NO_ROOM, DONE, FAILED = 0, 1, 2, 3, 4
TRAILER = 64  # bytes: int64 [8]
CONTROL_TAG = 0x4B56  # the control messages' tag ("KV")
FRAME = 32 << 10  # bytes of a control message (header, replies): its words and, mostly, all its text
ALIGN = 16
MESSAGE_BYTES = 1 << 30  # a sender's default message size: a request's state is mostly one message (fewest gathers)
CHUNK_BYTES = 64 << 20  # a sender's default send size (the last takes the rest), each send's bytes gathered just
# before it is posted: the link starts after the first chunk's gather, not the message's


class TransferError(RuntimeError):
    """A transfer that did not complete (the peer aborted, died, timed out, or sent a malformed message). Both caches
    are as they were before it."""


@dataclass(frozen=True)
class _Part:
    name: str
    offset: int  # in its message's buffer
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class _Run:
    """One stack group's part (`CachePools.stacks(field)[group]`) of a message's layers, back to back from `offset`:
    rows of one tensor (`CachePools.stack_rows`), so one select gathers it, or one per chunk it spans (pages: the
    request's blocks of every layer; slot rows: its slot's)."""

    field: str
    group: int
    positions: tuple[int, ...]  # the layers' positions in the group's stack, in layer order
    paged: bool
    offset: int


@dataclass(frozen=True)
class _Message:
    """Layers first..end-1 of a state in one buffer: their parts in runs (field by field, a stack group's layers
    together), then the trailer."""

    index: int
    first: int
    end: int
    parts: tuple[tuple[_Part, ...], ...]  # per layer, `LayerCache.request_tensors` order
    runs: tuple[_Run, ...]
    payload: int  # bytes before the trailer (a multiple of ALIGN)

    @property
    def nbytes(self) -> int:
        return self.payload + TRAILER


# (name, field, dtype, row shape, paged, stack group, position in the group) of one request tensor of one layer
_Row = tuple[str, str, torch.dtype, tuple[int, ...], bool, int, int]


@functools.lru_cache(maxsize=16)
def _template(spec: CacheSpec) -> tuple[tuple[_Row, ...], ...]:
    """Per layer, its request tensors (`LayerCache.request_tensors` order) with their stack groups: a function of
    the spec, read once from pools on the meta device (no memory), so a transfer pays no per-layer Python walk over a
    cache's tensors."""
    pools = CachePools(spec, num_blocks=1, max_requests=1, device=torch.device("meta"))
    where = {}  # (field, layer) -> (group, position)
    for field in REQUEST_FIELDS:
        for g, (indices, _) in enumerate(pools.stacks(field)):
            where.update({(field, i): (g, k) for k, i in enumerate(indices)})
    names = iter(tensor_names(pools))
    layers = []
    for i, layer in enumerate(pools.layers):
        rows = []
        for tensor, paged in layer.request_tensors():
            name = next(names)
            field = name.rsplit(".", 1)[1]
            rows.append((name, field, tensor.dtype, tuple(tensor.shape[1:]), paged, *where[field, i]))
        layers.append(tuple(rows))
    return tuple(layers)


def _row_bytes(row: _Row, blocks: int) -> int:
    _, _, dtype, shape, paged, _, _ = row
    return math.prod(shape) * dtype.itemsize * (blocks if paged else 1)


@functools.lru_cache(maxsize=64)
def _layer_bytes(spec: CacheSpec, blocks: int) -> tuple[int, ...]:
    """Each layer's request bytes for a state of `blocks` pages (the header's check; messages are grouped by it)."""
    return tuple(sum(_row_bytes(row, blocks) for row in rows) for rows in _template(spec))


@functools.lru_cache(maxsize=64)
def _layout(spec: CacheSpec, blocks: int, counts: tuple[int, ...]) -> tuple[_Message, ...]:
    """The messages of a state of `blocks` pages, `counts[m]` consecutive layers in message m. Inside a message the
    parts go field by field (`REQUEST_FIELDS`), and within a field stack group by stack group, a group's layers
    back to back (a `_Run`), each run at an ALIGN offset."""
    template = _template(spec)
    messages, first = [], 0
    for m, count in enumerate(counts):
        layers = range(first, first + count)
        runs, offsets, offset = [], {}, 0
        for field in REQUEST_FIELDS:
            groups: dict[int, list[tuple[int, int]]] = {}  # stack group -> (layer, its tensor's index)
            for i in layers:
                for k, row in enumerate(template[i]):
                    if row[1] == field:
                        groups.setdefault(row[5], []).append((i, k))
            for g, members in sorted(groups.items()):
                rows = [template[i][k] for i, k in members]
                part_bytes = _row_bytes(rows[0], blocks)
                runs.append(_Run(field, g, tuple(row[6] for row in rows), rows[0][4], offset))
                for n, (i, k) in enumerate(members):
                    offsets[i, k] = offset + n * part_bytes
                offset += -(-part_bytes * len(members) // ALIGN) * ALIGN
        parts = tuple(tuple(_Part(name, offsets[i, k], dtype, (blocks, *shape) if paged else shape)
                            for k, (name, _, dtype, shape, paged, _, _) in enumerate(template[i])) for i in layers)
        messages.append(_Message(m, first, first + count, parts, tuple(runs), offset))
        first += count
    return tuple(messages)


def _names(spec: CacheSpec) -> list[str]:
    return [row[0] for rows in _template(spec) for row in rows]


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


def _comm_device(cache: CacheManager, group) -> torch.device:
    """NCCL moves device tensors; gloo moves host tensors."""
    return cache.device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _channels(cache: CacheManager, peer: int, group, control_group, timeout) -> tuple["_Channel", "_Channel"]:
    """The bulk channel (token ids, the layers' messages) on `group` and the control channel (header, replies) on
    `control_group` (default: `group`), under its own tag so other traffic on a shared group cannot be mistaken for
    it."""
    control_group = group if control_group is None else control_group
    return (_Channel(peer, group, _comm_device(cache, group), timeout),
            _Channel(peer, control_group, _comm_device(cache, control_group), timeout, tag=CONTROL_TAG))


class _Channel:
    """Point-to-point messages with one peer under one tag, each wait bounded by `timeout`; a failed one raises
    TransferError."""

    def __init__(self, peer: int, group, device: torch.device, timeout: timedelta | None, tag: int = 0):
        if isinstance(peer, bool) or not isinstance(peer, int) or peer < 0:
            raise ValueError(f"peer: expected a rank >= 0, got {peer!r}")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
        self.peer, self.group, self.device, self.tag = peer, group, device, tag
        self.timeout = timeout if timeout is not None else timedelta(0)  # 0: the group's own timeout

    def post_send(self, tensor: torch.Tensor):
        try:
            return dist.isend(tensor, self.peer, group=self.group, tag=self.tag)
        except Exception as e:  # a pair already closed fails at once
            raise TransferError(f"send to rank {self.peer}: {type(e).__name__}: {e}") from e

    def post_recv(self, tensor: torch.Tensor):
        try:
            return dist.irecv(tensor, self.peer, group=self.group, tag=self.tag)
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

    def send_message(self, kind: int, *, transfer_id: int, status: int = 0, value: int = 0, text: bytes = b"",
                     what: str) -> None:
        """A control message: one FRAME of 8 int64 words (MAGIC, kind, status, value, 0, transfer id, 0, the text's
        length) and the text's first FRAME - 64 bytes; a longer text's rest follows in a second message."""
        frame = np.zeros(FRAME, dtype=np.uint8)
        words = [MAGIC, kind, status, value, 0, transfer_id, 0, len(text)]
        frame[:64] = np.asarray(words, dtype=np.int64).view(np.uint8)
        head = text[:FRAME - 64]
        frame[64:64 + len(head)] = np.frombuffer(head, dtype=np.uint8)
        self.send(torch.from_numpy(frame).to(self.device), what)
        if len(text) > len(head):
            self.send(torch.frombuffer(bytearray(text[len(head):]), dtype=torch.uint8).to(self.device), what)

    def post_message(self) -> tuple[torch.Tensor, object]:
        """Post the receive of a control message now (wait for it with `wait_message`)."""
        frame = torch.empty(FRAME, dtype=torch.uint8, device=self.device)
        return frame, self.post_recv(frame)

    def wait_message(self, posted: tuple[torch.Tensor, object], kind: int, what: str) -> "_Control":
        """A posted control message of `kind`; TransferError if it is not one."""
        frame, work = posted
        self.wait(work, what)
        host = frame.cpu().numpy()
        words = host[:64].view(np.int64).tolist()
        if words[0] != MAGIC or words[1] != kind or not 0 <= words[7] <= 1 << 30:
            raise TransferError(f"{what}: a malformed message (control words {words[:3]})")
        n = words[7]
        text = host[64:64 + min(n, FRAME - 64)].tobytes()
        if n > len(text):
            rest = self.recv(torch.empty(n - len(text), dtype=torch.uint8, device=self.device), what)
            text += rest.cpu().numpy().tobytes()
        return _Control(status=words[2], value=words[3], transfer_id=words[5], text=text)

    def recv_message(self, kind: int, what: str) -> "_Control":
        return self.wait_message(self.post_message(), kind, what)


class _Control(NamedTuple):
    """A control message's fields: `status` (a reply's ACCEPT / REFUSED / ... ), `value` (the header's token count,
    a reply's skip_tokens, a final reply's request id), the transfer id and the text (JSON or a reason)."""

    status: int
    value: int
    transfer_id: int
    text: bytes


class RequestSender:
    """Sends live request `rid` of `cache` to rank `peer`: `start()`, `send_layer(i)` for every layer in order, then
    `finish()`; or `abort()` after `start()`. The sender's cache is only read; the request stays live (release it
    after `finish()` answers the receiver's id).

    tokens: the request's token ids (at least `cache.length(rid)` of them; the receiver's prefix cache finds the
        pages it holds by them and the imported request carries them), or None (every page is sent).
    group: the process group of the bulk bytes (token ids, the layers; default: the world's).
    control_group: the group of the small control messages (header, replies), default `group`. With NCCL bulk, a gloo
        group here keeps the round trips on the hosts (no kernel launch or device sync per message): the transfer
        starts sooner. The receiver must pass the same pair.
    message_bytes: consecutive layers share a message until it holds this many bytes (default 1 GiB: a request's
        state is mostly one message); 0 sends each layer as soon as it is gathered (overlapping a prefill layer by
        layer).
    chunk_bytes: a message goes in sends of this many bytes (default 64 MiB), each gathered right before it is posted;
        the header tells the receiver.
    timeout: bound on each wait (default: the process group's timeout). On NCCL a wait with a timeout polls on the
        host until the operation is done; leave it None where the transfer's speed matters.
    """

    def __init__(self, cache: CacheManager, rid: int, *, peer: int, group=None, control_group=None, tokens=None,
                 message_bytes: int = MESSAGE_BYTES, chunk_bytes: int = CHUNK_BYTES,
                 timeout: timedelta | None = None):
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
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < ALIGN:
            raise ValueError(f"chunk_bytes: expected an int >= {ALIGN}, got {chunk_bytes!r}")
        self.message_bytes, self.chunk_bytes = message_bytes, chunk_bytes
        self.channel, self.control = _channels(cache, peer, group, control_group, timeout)
        self.transfer_id = secrets.randbits(62)
        self.skip_tokens: int | None = None  # from the receiver's reply
        self.bytes_sent = 0
        self._next_layer = 0
        self._works: list = []  # (message index, work, buffer) of sends in flight
        self._messages: tuple[_Message, ...] = ()
        self._prepared: int | None = None  # the first block `_prepare` made the messages from

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
        layer_bytes = _layer_bytes(spec, blocks)
        counts = _group(layer_bytes, self.message_bytes)
        # the staging for every page (a state that skips some takes a prefix of it), allocated before anything is
        # sent: nothing after the header can fail short of memory and leave the receiver waiting
        self._staging = torch.empty(sum(m.nbytes for m in _layout(spec, blocks, tuple(counts))), dtype=torch.uint8,
                                    device=self.channel.device)
        header = json.dumps({"format": FORMAT, "spec": spec_fields(spec), "length": self.length,
                             "names": _names(spec), "layer_bytes": list(layer_bytes), "messages": counts,
                             "chunk_bytes": self.chunk_bytes})
        data = header.encode()
        n = self.tokens.numel() if self.tokens is not None else 0
        ch = self.control
        ch.send_message(HEADER, value=n, transfer_id=self.transfer_id, text=data, what="header")
        if n:
            self.channel.send(self.tokens.to(self.channel.device), "token ids")
        reply = ch.post_message()
        if self.tokens is None:  # nothing can be skipped: the index is made while the header travels
            self._prepare(blocks, 0, counts)
        answer = ch.wait_message(reply, REPLY, "reply")
        status, skip, reason = answer.status, answer.value, answer.text.decode(errors="replace")
        if answer.transfer_id != self.transfer_id or status not in (ACCEPT, REFUSED, NO_ROOM):
            raise TransferError(f"reply: a malformed message ({answer._replace(text=reason)})")
        if status == REFUSED:
            raise ValueError(f"the receiver (rank {ch.peer}) refused the request's state: {reason}")
        if status == NO_ROOM:
            what, needed, free = json.loads(reason)
            return NoRoom(what, needed, free)
        try:
            k = first_block(skip, self.length, spec.page_tokens)
        except ValueError as e:
            raise TransferError(f"reply: the receiver asked to skip {skip} tokens: {e}") from e
        self.skip_tokens = skip
        if self._prepared != k:
            self._prepare(blocks, k, counts)
        return skip

    def _prepare(self, blocks: int, k: int, counts: list[int]) -> None:
        """The messages of the state from block k on, their index and trailers."""
        self._messages = _layout(self.cache.spec, blocks - k, tuple(counts))
        self._num_layers = sum(counts)
        self._gathers = _Gathers(self.cache, self.rid, k, self._messages, self._staging, self.chunk_bytes)
        self._trailers = torch.tensor([_trailer(LAYER, m, self.transfer_id) for m in self._messages],
                                      dtype=torch.int64).to(self.channel.device)
        self._message_of = [m for m in self._messages for _ in range(m.first, m.end)]
        self._prepared = k

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
        self._gathers.layer(i, message)
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
        """Send the layers not sent yet (every layer ran over the request's last plan). A message none of whose layers
        went by `send_layer` is gathered chunk by chunk, a launch per run (stack group) a chunk, each chunk's send
        posted as soon as its gathers are queued."""
        while self._next_layer < self._num_layers:
            message = self._message_of[self._next_layer]
            if self._next_layer != message.first:
                self.send_layer(self._next_layer)
                continue
            try:
                self._check_unchanged()
            except TransferError:
                self.abort()
                raise
            self._next_layer = message.end
            self._post(message, LAYER, gather=True)

    def abort(self) -> None:
        """Stop after the layers sent so far: the message being gathered and the rest go as ABORT messages (their
        sizes, not their bytes), the receiver drops everything and answers FAILED; the pair stays in step. Raises
        TransferError only on a fault."""
        if self.skip_tokens is None:
            raise RuntimeError("abort: nothing to abort before start() accepted")
        if self._next_layer < self._num_layers:
            for message in self._messages[self._message_of[self._next_layer].index:]:
                self._post(message, ABORT)
        self._next_layer = self._num_layers
        status, _, reason = self._final()
        if status != FAILED:
            raise TransferError(f"final reply: expected FAILED after an abort, got status {status} ({reason})")

    def finish(self) -> int | NoRoom:
        """Wait until every layer is sent and the receiver answers: its request id (-1: it took the state to import
        later, `RequestReceiver.recv_state`), or NoRoom (its room or cached prefix went meanwhile; nothing changed
        there). TransferError if it failed the transfer or on a fault."""
        if self.skip_tokens is None or self._next_layer != self._num_layers:
            raise RuntimeError(f"finish: {self._next_layer} of {self._num_layers} layers sent")
        status, value, reason = self._final()
        if status == DONE:
            return value
        if status == NO_ROOM:
            what, needed, free = json.loads(reason)
            return NoRoom(what, needed, free)
        raise TransferError(f"the receiver (rank {self.channel.peer}) failed the transfer: {reason}")

    def _post(self, message: _Message, kind: int, gather: bool = False) -> None:
        """Post `message`'s sends, chunk by chunk (`gather`: each chunk's gathers queued right before its send), with
        a LAYER or ABORT trailer."""
        buffer = self._gathers.buffers[message.index]
        trailer = buffer[-TRAILER:].view(torch.int64)
        trailer.copy_(self._trailers[message.index])
        if kind != LAYER:
            trailer[1] = kind
        for (start, end), jobs in zip(_chunks(message.nbytes, self.chunk_bytes), self._gathers.jobs[message.index]):
            if gather:
                for src, index, out in jobs:
                    _select(src, index, out)
            self._works.append((message.index, self.channel.post_send(buffer[start:end]), buffer))
        self.bytes_sent += buffer.numel()

    def _final(self) -> tuple[int, int, str]:
        """Wait for the messages in flight and the receiver's final reply: (status, value, reason)."""
        for m, work, _ in self._works:
            self.channel.wait(work, f"message {m}")
        self._works.clear()
        answer = self.control.recv_message(FINAL, "final reply")
        reason = answer.text.decode(errors="replace")
        if answer.transfer_id != self.transfer_id or answer.status not in (DONE, NO_ROOM, FAILED):
            raise TransferError(f"final reply: a malformed message ({answer._replace(text=reason)})")
        return answer.status, answer.value, reason


class _Gathers:
    """The sender's copies of one request's state into its message buffers (allocated here): by layer (`layer`, a
    launch per part) or by chunk (`jobs`: one `index_select` per run a chunk overlaps, over its stack group's
    rows, `CachePools.stack_rows`). Every index is made on the host and copied to the device at once, and every copy
    moves the widest integer elements the rows and addresses allow (`wide_views`)."""

    def __init__(self, cache: CacheManager, rid: int, first_block: int, messages: tuple[_Message, ...],
                 staging: torch.Tensor, chunk_bytes: int):
        self.pools, self.slot, self.chunk_bytes = cache.pools, cache.slot(rid), chunk_bytes
        ends = np.cumsum([m.nbytes for m in messages]).tolist()
        self.buffers = [staging[end - m.nbytes:end] for m, end in zip(messages, ends)]
        blocks = np.asarray(cache.blocks(rid)[first_block:], dtype=np.int64)
        host, at = [blocks, np.asarray([self.slot], dtype=np.int64)], blocks.size + 1
        spans = {}  # (message, run) -> its rows' span of the index
        for message in messages:
            for r, run in enumerate(message.runs):
                _, per_layer = self.pools.stack_rows(run.field)[run.group]
                positions = np.asarray(run.positions, dtype=np.int64) * per_layer
                rows = (positions[:, None] + blocks[None, :]).ravel() if run.paged else positions + self.slot
                host.append(rows)
                spans[message.index, r] = (at, at + rows.size)
                at += rows.size
        self.index = torch.from_numpy(np.concatenate(host)).to(cache.device)
        self.blocks, self.slot_index = self.index[:blocks.size], self.index[blocks.size:blocks.size + 1]
        self._spans = spans
        # made once, before the first send (with no token ids, while the header travels); a state sent layer by layer
        # does not use them
        self.jobs = [self._chunk_jobs(m) for m in messages]

    def layer(self, i: int, message: _Message) -> None:
        """Layer i's parts into their places in its message's buffer, a launch per part."""
        buffer = self.buffers[message.index]
        for part, (tensor, paged) in zip(message.parts[i - message.first], self.pools.layers[i].request_tensors()):
            src, out = wide_views(_bytes(tensor), buffer[part.offset:part.offset + part.nbytes])
            _select(src, self.blocks if paged else self.slot_index, out)

    def _chunk_jobs(self, message: _Message) -> list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        """Per chunk of `message` (`_chunks`), the (rows, index, out) selects that fill it: the rows of each run that
        start before the chunk's end and were not in an earlier chunk's (so a row a chunk boundary splits is whole
        before the first chunk holding part of it goes)."""
        buffer, chunks = self.buffers[message.index], _chunks(message.nbytes, self.chunk_bytes)
        jobs: list[list] = [[] for _ in chunks]
        for r, run in enumerate(message.runs):
            rows, _ = self.pools.stack_rows(run.field)[run.group]
            src = _bytes(rows)
            first, end = self._spans[message.index, r]
            row_bytes, done = src.shape[1], 0
            for c, (_, chunk_end) in enumerate(chunks):
                upto = min(end - first, max(0, -(-(chunk_end - run.offset) // row_bytes)))
                if upto > done:
                    out = buffer[run.offset + done * row_bytes:run.offset + upto * row_bytes]
                    wide, out = wide_views(src, out)
                    jobs[c].append((wide, self.index[first + done:first + upto], out))
                    done = upto
        return jobs


def _chunks(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """A message's sends: (start, end) byte ranges of `chunk_bytes` (the sender's, in the header), the last taking
    the rest (trailer included)."""
    starts = list(range(0, max(nbytes - TRAILER, 1), chunk_bytes))
    return [(a, b) for a, b in zip(starts, starts[1:] + [nbytes])]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` [rows, ...] as uint8 [rows, row bytes]; the last dim is contiguous in every cache tensor, so this is
    a view."""
    return tensor.flatten(1).view(torch.uint8)


def _select(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """out (flat) <- src's rows `index`, one launch where both share a device."""
    if out.device == src.device:
        torch.index_select(src, 0, index, out=out.view(index.numel(), src.shape[1]))
    else:
        out.copy_(src[index].reshape(-1))


def _trailer(kind: int, message: _Message, transfer_id: int) -> list[int]:
    return [MAGIC, kind, message.index, message.payload, transfer_id, message.first, message.end, 0]


class RequestReceiver:
    """Receives requests' cache states from rank `peer` into `cache`, one `recv()` per request.

    group, control_group: as the sender's (the same pair on both sides).
    timeout: bound on each wait (default: the process group's timeout; see `RequestSender`). A receive that failed
        keeps its posted buffers here (the backend may still write them) until the receiver is dropped.
    """

    def __init__(self, cache: CacheManager, *, peer: int, group=None, control_group=None,
                 timeout: timedelta | None = None):
        if not isinstance(cache, CacheManager):
            raise TypeError(f"cache: expected a CacheManager, got {type(cache).__name__}")
        self.cache = cache
        self.channel, self.control = _channels(cache, peer, group, control_group, timeout)
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
        message = self.control.recv_message(HEADER, "header")
        transfer_id, n, data = message.transfer_id, message.value, message.text
        if not 0 <= n <= 1 << 40:
            self._reply(REPLY, REFUSED, 0, transfer_id, f"a malformed header: {n} token ids")
            raise TransferError(f"header: a malformed message: {n} token ids")
        tokens = ch.recv(torch.empty(n, dtype=torch.int64, device=ch.device), "token ids").cpu() if n else None
        try:
            header = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self._reply(REPLY, REFUSED, 0, transfer_id, f"a malformed header: {e}")
            raise TransferError(f"header: a malformed message: {e}") from e
        try:  # whatever fails here, the sender is told (it waits for this reply) before this side raises
            length, skip, counts, chunk = self._check(header, tokens, skip_cached=import_now)
            room = self._room(length, tokens, skip) if import_now else None
            if room is None:  # the staging before the answer: nothing after it can fail short of memory
                k = skip // cache.spec.page_tokens
                messages = _layout(cache.spec, cache.spec.blocks_for(length) - k, tuple(counts))
                buffers = [torch.empty(m.nbytes, dtype=torch.uint8, device=ch.device) for m in messages]
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
        works = []  # all posted at once: the link never waits on the host
        try:
            for message, buffer in zip(messages, buffers):
                for start, end in _chunks(message.nbytes, chunk):
                    works.append((message.index, ch.post_recv(buffer[start:end])))
        except TransferError:
            self._stale.append((works, buffers))
            raise
        tensors = {}  # the state's tensors, views of the buffers, made while the bytes are on their way
        for message, buffer in zip(messages, buffers):
            for parts in message.parts:
                for part in parts:
                    tensors[part.name] = buffer[part.offset:part.offset + part.nbytes].view(part.dtype).view(part.shape)
        for i, (m, work) in enumerate(works):
            try:
                ch.wait(work, f"message {m}")
            except TransferError:
                self._stale.append((works[i:], buffers))
                raise
        self.bytes_received += sum(b.numel() for b in buffers)
        trailers = torch.stack([b[-TRAILER:].view(torch.int64) for b in buffers]).cpu().tolist()  # one sync
        problem = self._problem(trailers, messages, messages[-1].end, transfer_id)
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

    def _check(self, header: dict, tokens: torch.Tensor | None, *,
               skip_cached: bool) -> tuple[int, int, list[int], int]:
        """(length, skip_tokens, layers per message, the sender's chunk bytes) of a header this cache can take;
        ValueError naming what differs."""
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
        want = list(_layer_bytes(cache.spec, cache.spec.blocks_for(length)))
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
        chunk = header.get("chunk_bytes")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < ALIGN:
            raise ValueError(f"chunk_bytes: expected an int >= {ALIGN}, got {chunk!r}")
        return length, skip, counts, chunk

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
        self.control.send_message(kind, status=status, value=value, transfer_id=transfer_id, text=reason.encode(),
                                  what="reply")


def send_request(cache: CacheManager, rid: int, *, peer: int, group=None, control_group=None, tokens=None,
                 message_bytes: int = MESSAGE_BYTES, chunk_bytes: int = CHUNK_BYTES,
                 timeout: timedelta | None = None) -> int | NoRoom:
    """Send live request `rid` whole (`RequestSender`: start, every layer, finish): the receiver's request id, or
    NoRoom. The request stays live here."""
    sender = RequestSender(cache, rid, peer=peer, group=group, control_group=control_group, tokens=tokens,
                           message_bytes=message_bytes, chunk_bytes=chunk_bytes, timeout=timeout)
    answer = sender.start()
    if isinstance(answer, NoRoom):
        return answer
    sender.send_all()
    return sender.finish()
