"""A request's cache state moved between two processes over torch.distributed (docs/request-state.md): NCCL between
GPUs, gloo between CPU processes; point-to-point sends and receives only, no socket of our own.

    # sender (rank 0)                                   # receiver (rank 1)
    sender = RequestSender(cache, rid, peer=1, tokens=ids)   receiver = RequestReceiver(cache, peer=0)
    sender.start()          # header -> reply                rid = receiver.recv()   # -> its id, or NoRoom
    for i in range(layers): sender.send_layer(i)
    answer = sender.finish()  # the receiver's id, or NoRoom

The messages, in order, between one sender and one receiver (a pair's point-to-point messages arrive in order):

1. header (sender -> receiver): a control word block (int64 [8]: magic, HEADER, JSON bytes, token count, transfer
   id), the JSON (format, the spec fields of `transfer.spec_fields`, length, tensor names, bytes per layer) and
   the token ids (int64, when given). The receiver checks the spec, names, sizes and room *before* it allocates
   anything, and looks its token ids up in its prefix cache.
2. reply (receiver -> sender): ACCEPT with `skip_tokens` (the whole blocks its prefix cache holds: their pages are
   not sent, as in `export_request(rid, skip_tokens=...)`), or REFUSED / NO_ROOM with the reason. Nothing else
   follows a refusal.
3. one message per layer, in layer order: the layer's request tensors (`LayerCache.request_tensors` order, pages
   from block skip_tokens / page_tokens on), packed into one uint8 buffer, each part at a 16-byte offset, and a
   64-byte trailer (magic, LAYER or ABORT, layer index, payload bytes, transfer id). The receiver posts every
   layer's receive at once into staging buffers (on the cache's device for NCCL), so the link never waits on the
   host; the sender gathers and sends each layer when it is ready (`send_layer(i)`, any time after layer i ran over
   the request's last plan: a prefill can send layer i while layers > i compute).
4. final reply (receiver -> sender): DONE with the receiver's request id, NO_ROOM (its prefix blocks were evicted
   or its room taken meanwhile), or FAILED (an ABORT trailer, a malformed message).

Faults leave both caches as they were: the sender only reads its cache (its request stays live until the caller
releases it after DONE), and the receiver imports (`CacheManager.import_request`) only after every layer arrived
whole, so an abort, a malformed message, a dead peer or a timeout allocates nothing. `TransferError` reports each.
An ABORT (`RequestSender.abort`) or a malformed-but-complete message keeps the pair in step for the next transfer;
after a dead peer or a timeout, messages may be left in flight: make a new process group before the next transfer.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from .manager import CacheManager
from .swap import NoRoom
from .transfer import RequestState, check_spec, first_block, spec_fields, tensor_names

__all__ = ["RequestSender", "RequestReceiver", "TransferError", "send_request", "FORMAT"]

FORMAT = "dsv4kv.request-transfer/1"
MAGIC = 0x3476_7364_6B76  # "kvdsv4"
HEADER, REPLY, LAYER, ABORT, FINAL = 1, 2, 3, 4, 5
ACCEPT, REFUSED, NO_ROOM, DONE, FAILED = 0, 1, 2, 3, 4
TRAILER = 64  # bytes: int64 [8]
ALIGN = 16


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


def _layout(cache: CacheManager, blocks: int) -> list[list[_Part]]:
    """Per layer, where each of its request tensors sits in the layer's buffer for a state of `blocks` pages."""
    names = iter(tensor_names(cache.pools))
    layers = []
    for i in range(cache.geometry.num_layers):
        parts, offset = [], 0
        for tensor, paged in cache.pages(i).request_tensors():
            shape = (blocks, tensor.shape[1]) if paged else tuple(tensor.shape[1:])
            part = _Part(next(names), offset, tensor.dtype, shape)
            parts.append(part)
            offset += -(-part.nbytes // ALIGN) * ALIGN
        layers.append(parts)
    return layers


def _payload_bytes(parts: list[_Part]) -> int:
    return parts[-1].offset + parts[-1].nbytes if parts else 0


def _buffer_bytes(parts: list[_Part]) -> int:
    return -(-_payload_bytes(parts) // ALIGN) * ALIGN + TRAILER


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
        return dist.isend(tensor, self.peer, group=self.group)

    def post_recv(self, tensor: torch.Tensor):
        return dist.irecv(tensor, self.peer, group=self.group)

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
    timeout: bound on each wait (default: the process group's timeout). On NCCL a wait with a timeout polls on the
        host until the operation is done; leave it None where the transfer's speed matters.
    """

    def __init__(self, cache: CacheManager, rid: int, *, peer: int, group=None, tokens=None,
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
        self.channel = _Channel(peer, group, _comm_device(cache, group), timeout)
        self.transfer_id = secrets.randbits(62)
        self.skip_tokens: int | None = None  # from the receiver's reply
        self.bytes_sent = 0
        self._next_layer = 0
        self._works: list = []  # (work, buffer) of layers in flight
        self._layers: list[list[_Part]] = []

    def start(self) -> int | NoRoom:
        """Send the header and wait for the receiver's reply: the tokens whose pages it already holds (they are not
        sent), or NoRoom when it has no room now. ValueError when it refuses the state (another spec), carrying its
        reason; TransferError on a fault."""
        if self.skip_tokens is not None:
            raise RuntimeError("start: already started")
        pools, num_layers = self.cache.pools, self.cache.geometry.num_layers
        blocks = self.cache.spec.blocks_for(self.length)
        full = _layout(self.cache, blocks)
        header = json.dumps({"format": FORMAT, "spec": spec_fields(self.cache.spec), "length": self.length,
                             "names": tensor_names(pools), "layer_bytes": [_payload_bytes(p) for p in full]})
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
            k = first_block(skip, self.length, self.cache.spec.page_tokens)
        except ValueError as e:
            raise TransferError(f"reply: the receiver asked to skip {skip} tokens: {e}") from e
        self.skip_tokens = skip
        self._layers = _layout(self.cache, blocks - k)
        self._index = torch.tensor(self.cache.blocks(self.rid)[k:], dtype=torch.long, device=self.cache.device)
        self._trailers = torch.tensor([[MAGIC, LAYER, i, _payload_bytes(self._layers[i]), self.transfer_id, 0, 0, 0]
                                       for i in range(num_layers)], dtype=torch.int64).to(ch.device)
        return skip

    def send_layer(self, i: int) -> None:
        """Gather layer i's part of the request's state and post its send (layers in order, each once). Call it any
        time after layer i ran over the request's last plan; the send overlaps what the caller runs next."""
        if self.skip_tokens is None:
            raise RuntimeError("send_layer: start() first (and it must have accepted)")
        if i != self._next_layer:
            raise ValueError(f"send_layer: layer {self._next_layer} is next, got {i}")
        parts, layer = self._layers[i], self.cache.pages(i)
        slot = self.cache.slot(self.rid)
        buffer = torch.empty(_buffer_bytes(parts), dtype=torch.uint8, device=self.channel.device)
        for part, (tensor, paged) in zip(parts, layer.request_tensors()):
            dst = buffer[part.offset:part.offset + part.nbytes].view(part.dtype).view(part.shape)
            if paged and dst.device == tensor.device:
                torch.index_select(tensor, 0, self._index, out=dst)
            else:
                dst.copy_(tensor[self._index] if paged else tensor[slot])
        buffer[-TRAILER:].view(torch.int64).copy_(self._trailers[i])
        self._works.append((self.channel.post_send(buffer), buffer))
        self.bytes_sent += buffer.numel()
        self._next_layer += 1

    def send_all(self) -> None:
        for i in range(self._next_layer, len(self._layers)):
            self.send_layer(i)

    def abort(self) -> None:
        """Stop after the layers sent so far: the rest go as ABORT messages (their sizes, not their bytes), the
        receiver drops everything and answers FAILED; the pair stays in step. Raises TransferError only on a
        fault."""
        if self.skip_tokens is None:
            raise RuntimeError("abort: nothing to abort before start() accepted")
        for i in range(self._next_layer, len(self._layers)):
            buffer = torch.empty(_buffer_bytes(self._layers[i]), dtype=torch.uint8, device=self.channel.device)
            buffer[-TRAILER:].view(torch.int64).copy_(self._trailers[i])
            buffer[-TRAILER:].view(torch.int64)[1] = ABORT
            self._works.append((self.channel.post_send(buffer), buffer))
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

    def _final(self) -> tuple[int, int, str]:
        """Wait for the layers in flight and the receiver's final reply: (status, value, reason)."""
        ch = self.channel
        for i, (work, _) in enumerate(self._works):
            ch.wait(work, f"layer {i}")
        self._works.clear()
        words = ch.recv_control(FINAL, "final reply")
        reason = ch.recv_bytes(words[4], "final reply").decode(errors="replace")
        if words[5] != self.transfer_id or words[2] not in (DONE, NO_ROOM, FAILED):
            raise TransferError(f"final reply: a malformed message (control words {words[:6]})")
        return words[2], words[3], reason


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
        try:
            length, skip = self._check(header, tokens, skip_cached=import_now)
        except ValueError as e:
            self._reply(REPLY, REFUSED, 0, transfer_id, str(e))
            raise
        room = self._room(length, tokens, skip) if import_now else None
        if room is not None:
            self._reply(REPLY, NO_ROOM, 0, transfer_id, json.dumps([room.resource, room.needed, room.free]))
            return room
        self._reply(REPLY, ACCEPT, skip, transfer_id)

        k = skip // cache.spec.page_tokens
        layers = _layout(cache, cache.spec.blocks_for(length) - k)
        buffers = [torch.empty(_buffer_bytes(parts), dtype=torch.uint8, device=ch.device) for parts in layers]
        works = [ch.post_recv(buffer) for buffer in buffers]  # all posted: the link never waits on the host
        for i, work in enumerate(works):
            try:
                ch.wait(work, f"layer {i}")
            except TransferError:
                self._stale.append((works[i:], buffers))
                raise
        self.bytes_received += sum(b.numel() for b in buffers)
        trailers = torch.stack([b[-TRAILER:].view(torch.int64) for b in buffers]).cpu().tolist()  # one sync
        problem = self._problem(trailers, layers, transfer_id)
        if problem is not None:
            self._reply(FINAL, FAILED, 0, transfer_id, problem)
            raise TransferError(problem)
        tensors = {part.name: buffer[part.offset:part.offset + part.nbytes].view(part.dtype).view(part.shape)
                   for parts, buffer in zip(layers, buffers) for part in parts}
        state = RequestState(header["spec"], length, tokens, tensors, first_block=k)
        if not import_now:
            self._reply(FINAL, DONE, -1, transfer_id)
            return state
        try:
            answer = cache.import_request(state)
        except ValueError as e:  # checked with the header; only a bug gets here
            self._reply(FINAL, FAILED, 0, transfer_id, str(e))
            raise
        if isinstance(answer, NoRoom):
            self._reply(FINAL, NO_ROOM, 0, transfer_id, json.dumps([answer.resource, answer.needed, answer.free]))
        else:
            self._reply(FINAL, DONE, answer, transfer_id)
        return answer

    def _check(self, header: dict, tokens: torch.Tensor | None, *, skip_cached: bool) -> tuple[int, int]:
        """(length, skip_tokens) of a header this cache can take; ValueError naming what differs."""
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
        if header.get("names") != tensor_names(cache.pools):
            raise ValueError("the state's tensor names differ from this cache's")
        want = [_payload_bytes(p) for p in _layout(cache, cache.spec.blocks_for(length))]
        if header.get("layer_bytes") != want:
            raise ValueError(f"bytes per layer: {header.get('layer_bytes')} in the state, {want} here")
        if tokens is not None and tokens.numel() < length:
            raise ValueError(f"{tokens.numel()} token ids for {length} tokens")
        skip = 0
        if skip_cached and tokens is not None and cache.prefix is not None:
            page = cache.spec.page_tokens
            skip = min(cache.lookup(tokens), length // page * page)
        return length, skip

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
    def _problem(trailers: list[list[int]], layers: list[list[_Part]], transfer_id: int) -> str | None:
        for i, (words, parts) in enumerate(zip(trailers, layers)):
            if words[0] == MAGIC and words[1] == ABORT and words[4] == transfer_id:
                return f"the sender aborted the transfer after {i} of {len(layers)} layers"
            if words[:5] != [MAGIC, LAYER, i, _payload_bytes(parts), transfer_id]:
                return f"layer {i}: a malformed message (trailer {words[:5]})"
        return None

    def _reply(self, kind: int, status: int, value: int, transfer_id: int, reason: str = "") -> None:
        data = reason.encode()
        self.channel.send(self.channel.control(MAGIC, kind, status, value, len(data), transfer_id), "reply")
        self.channel.send_bytes(data, "reply")


def send_request(cache: CacheManager, rid: int, *, peer: int, group=None, tokens=None,
                 timeout: timedelta | None = None) -> int | NoRoom:
    """Send live request `rid` whole (`RequestSender`: start, every layer, finish): the receiver's request id, or
    NoRoom. The request stays live here."""
    sender = RequestSender(cache, rid, peer=peer, group=group, tokens=tokens, timeout=timeout)
    answer = sender.start()
    if isinstance(answer, NoRoom):
        return answer
    sender.send_all()
    return sender.finish()
