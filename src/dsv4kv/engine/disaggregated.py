"""Prefill / decode disaggregation (docs/request-state.md): a prefill engine and a decode engine in two processes
(one GPU each over NCCL, or CPU processes over gloo), and a small front that routes requests.

    # every rank                                     (torch.distributed initialized: NCCL on GPUs, gloo on CPUs)
    groups = PairGroups.make(prefill_rank=0, decode_rank=1)
    # rank 0: the front and the prefill engine
    router = PrefillRouter(prefill_engine, groups)
    outputs = router.generate(prompts, SamplingParams(max_new_tokens=64))   # or add_request / step online
    router.close()
    # rank 1: the decode engine
    DecodeWorker(decode_engine, groups).run()        # until the router closes

A request goes to the prefill engine, which prefills its prompt and samples its first token. The router then sends
it to the decode side: a control message (the prompt, the first token, the sampling params) over a gloo group and
the request's cache state over the transfer group (`cache.distributed`: NCCL between GPUs, its control messages over
the gloo group); once the decode side has every byte, the prefill engine drops the request. The decode engine queues
the request with its prompt + first token, imports the state when it admits it (only the first token is fed) and
decodes the rest, polling for new requests between its steps; finished outputs go back to the router. A request
that finishes at its first token never moves; one whose transfer fails or finds no room on the decode side keeps
decoding on the prefill engine. Greedy tokens are those of one engine serving alone (tests/test_disaggregated.py).
Sampled requests draw their first token on the prefill side and the rest from a generator seeded alike on the
decode side, so their tokens differ from one engine's; logprobs are not carried across the move (refused).
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from ..cache import NoRoom
from ..cache.distributed import RequestReceiver, RequestSender, TransferError
from .engine import Engine
from .params import SamplingParams

__all__ = ["PairGroups", "PrefillRouter", "DecodeWorker", "DisaggregatedOutput", "RouterStats"]

NEW, STOP, OUTPUT = 1, 2, 3
REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class PairGroups:
    """The two process groups between a prefill and a decode rank: `transfer` (the default backend: NCCL on GPUs)
    for cache states, `control` (gloo, host tensors) for the small messages the sides poll for."""

    prefill_rank: int
    decode_rank: int
    transfer: object
    control: object

    @classmethod
    def make(cls, prefill_rank: int, decode_rank: int) -> "PairGroups":
        """Every rank of the world calls this, in the same order (group creation is collective)."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
        if prefill_rank == decode_rank:
            raise ValueError(f"prefill_rank and decode_rank: expected two ranks, got {prefill_rank} twice")
        ranks = sorted((prefill_rank, decode_rank))
        return cls(prefill_rank, decode_rank, dist.new_group(ranks), dist.new_group(ranks, backend="gloo"))


@dataclass(frozen=True)
class DisaggregatedOutput:
    """A finished request, as the router reports it. Times are `time.perf_counter` seconds of this host: the first
    token's on the prefill side, the others on the decode side."""

    request_id: int
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: str
    arrival: float
    token_times: tuple[float, ...]
    moved: bool  # decoded by the decode engine (False: it finished at its first token, or its transfer failed)


@dataclass
class RouterStats:
    moved: int = 0  # requests handed to the decode side
    failed_moves: int = 0  # transfers that failed or found no room (the request decoded on the prefill engine)
    bytes_sent: int = 0
    transfer_seconds: float = 0.0  # wall time of the hand-offs (control message, state, the decode side's answer)


@dataclass
class _Route:
    prompt: tuple[int, ...]
    params: SamplingParams
    arrival: float
    times: list[float] = field(default_factory=list)
    first: int | None = None
    moved: bool = False


class _Control:
    """Host messages over the gloo group: int64 words, JSON, int64 / float64 arrays. Each side reads the other's
    messages on a thread of its own (`_Inbox`), so a send never waits on a peer busy with something else, and the
    main loop polls a queue (gloo's receives cannot be polled)."""

    def __init__(self, peer: int, group):
        self.peer, self.group = peer, group

    def send(self, tensor: torch.Tensor) -> None:
        dist.send(tensor, self.peer, group=self.group)

    def recv(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.recv(tensor, self.peer, group=self.group)
        return tensor

    def send_words(self, *words: int) -> None:
        self.send(torch.tensor(list(words) + [0] * (8 - len(words)), dtype=torch.int64))

    def recv_words(self) -> list[int]:
        return self.recv(torch.zeros(8, dtype=torch.int64)).tolist()

    def send_bytes(self, data: bytes) -> None:
        self.send(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def recv_bytes(self, n: int) -> bytes:
        return self.recv(torch.empty(n, dtype=torch.uint8)).numpy().tobytes()


class _Inbox:
    """A daemon thread reading whole messages with `read()` into a queue until one of kind STOP (or an error, which
    `get` raises in the caller's thread)."""

    def __init__(self, read):
        self._queue: queue.Queue = queue.Queue()
        self._read = read
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                message = self._read()
            except Exception as e:  # the peer died or sent garbage: the main loop raises it
                self._queue.put(e)
                return
            self._queue.put(message)
            if message[0] == STOP:
                return

    def get(self, *, block: bool):
        """The next message, or None when `block` is False and none is there."""
        try:
            message = self._queue.get(block=block)
        except queue.Empty:
            return None
        if isinstance(message, Exception):
            raise RuntimeError(f"the control channel failed: {message}") from message
        return message

    def join(self) -> None:
        self._thread.join()


def _params_json(params: SamplingParams) -> dict:
    return {**dataclasses.asdict(params), "stop_token_ids": list(params.stop_token_ids)}


class PrefillRouter:
    """The front and the prefill side (on the prefill rank): routes requests through `engine` (the prefill engine)
    to the decode rank's `DecodeWorker` and collects their outputs.

    timeout: bound on each wait of a state transfer (default: the process group's timeout).
    """

    def __init__(self, engine: Engine, groups: PairGroups, *, timeout: timedelta | None = None):
        if not isinstance(engine, Engine):
            raise TypeError(f"engine: expected an Engine, got {type(engine).__name__}")
        if dist.get_rank() != groups.prefill_rank:
            raise ValueError(f"PrefillRouter: runs on the prefill rank {groups.prefill_rank}, this is "
                             f"{dist.get_rank()}")
        self.engine, self.groups, self.timeout = engine, groups, timeout
        self.control = _Control(groups.decode_rank, groups.control)
        self.stats = RouterStats()
        self._routes: dict[int, _Route] = {}  # by the prefill engine's request id: the router's request id
        self._outputs: dict[int, DisaggregatedOutput] = {}
        self._inbox = _Inbox(self._read)  # the decode side's outputs
        self._closed = False

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a request on the prefill engine; returns its id. Bad input raises and changes nothing."""
        if params is not None and isinstance(params, SamplingParams) and params.logprobs:
            raise ValueError("params.logprobs: not carried across the move to the decode engine; ask for 0")
        request_id = self.engine.add_request(prompt, params)
        params = params if params is not None else SamplingParams()
        self._routes[request_id] = _Route(tuple(int(t) for t in prompt), params, time.perf_counter())
        return request_id

    @property
    def has_unfinished(self) -> bool:
        return bool(self._routes)

    def step(self, *, wait: bool = False) -> list[DisaggregatedOutput]:
        """One prefill step (if the prefill engine has work), the hand-off of every request that got its first
        token, and the outputs the decode side finished meanwhile. `wait`: when the prefill engine has nothing to do
        but requests are out on the decode side, block until one of them finishes."""
        if self.engine.has_unfinished:
            for out in self.engine.step():
                now = time.perf_counter()
                route = self._routes[out.request_id]
                route.times.append(now)
                if out.finished:  # at its first token, or decoded here after a failed move
                    output = self.engine.output(out.request_id)
                    self._finish(out.request_id, output.finish_reason, output.token_ids)
                elif not route.moved and route.first is None:
                    route.first = out.new_token_ids[0]
                    self._hand_off(out.request_id, route)
        self._poll(block=wait and not self.engine.has_unfinished and bool(self._routes))
        done, self._outputs = list(self._outputs.values()), {}
        return done

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[DisaggregatedOutput]:
        """Serve every prompt to completion; outputs in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        ids = [self.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
        done: dict[int, DisaggregatedOutput] = {}
        while not all(i in done for i in ids):
            done.update((o.request_id, o) for o in self.step(wait=True))
        return [done[i] for i in ids]

    def close(self) -> None:
        """Tell the decode side to stop (after every request finished)."""
        if self._routes:
            raise RuntimeError(f"close: {len(self._routes)} requests are unfinished")
        if not self._closed:
            self.control.send_words(STOP)
            while self._inbox.get(block=True)[0] != STOP:  # the decode side's goodbye ends the reading thread
                pass
            self._inbox.join()
            self._closed = True

    # --- internals --------------------------------------------------------------------------------
    def _hand_off(self, request_id: int, route: _Route) -> None:
        start = time.perf_counter()
        cache_id = self.engine.cache_request_id(request_id)
        ch = self.control
        params = _params_json(dataclasses.replace(route.params, max_new_tokens=route.params.max_new_tokens - 1))
        data = json.dumps(params).encode()
        ch.send_words(NEW, request_id, len(route.prompt), len(data), route.first)
        ch.send_bytes(data)
        ch.send(torch.tensor(route.prompt, dtype=torch.int64))
        sender = RequestSender(self.engine.cache, cache_id, peer=self.groups.decode_rank, group=self.groups.transfer,
                               control_group=self.groups.control, tokens=route.prompt, timeout=self.timeout)
        try:
            answer = sender.start()
            if not isinstance(answer, NoRoom):
                sender.send_all()
                answer = sender.finish()
        except TransferError:
            answer = None
        if answer is None or isinstance(answer, NoRoom):  # no room there (now), or a fault: it keeps decoding here
            self.stats.failed_moves += 1
            return
        self.engine.abort(request_id)
        self.engine.output(request_id)  # forget it here
        route.moved = True
        self.stats.moved += 1
        self.stats.bytes_sent += sender.bytes_sent
        self.stats.transfer_seconds += time.perf_counter() - start

    def _read(self) -> tuple:
        """One message of the decode side (on the inbox's thread): (OUTPUT, id, reason, tokens, times) or (STOP,)."""
        kind, request_id, n, reason = self.control.recv_words()[:4]
        if kind == STOP:
            return (STOP,)
        if kind != OUTPUT:
            raise RuntimeError(f"the decode side sent a malformed message (kind {kind})")
        tokens = self.control.recv(torch.empty(n, dtype=torch.int64)).tolist()
        times = self.control.recv(torch.empty(n, dtype=torch.float64)).tolist()
        return OUTPUT, request_id, reason, tokens, times

    def _poll(self, *, block: bool) -> None:
        """Collect the decode side's finished outputs (waiting for one when `block`)."""
        while (message := self._inbox.get(block=block)) is not None:
            _, request_id, reason, tokens, times = message
            route = self._routes[request_id]
            route.times.extend(times)
            self._finish(request_id, REASONS[reason], (route.first, *tokens))
            block = False

    def _finish(self, request_id: int, reason: str, tokens: Sequence[int]) -> None:
        route = self._routes.pop(request_id)
        self._outputs[request_id] = DisaggregatedOutput(request_id, route.prompt, tuple(tokens), reason, route.arrival,
                                                        tuple(route.times), route.moved)


class DecodeWorker:
    """The decode side (on the decode rank): takes requests and their cache states from the `PrefillRouter`, decodes
    them with `engine` (the decode engine), sends back each finished output; `run()` until the router closes.

    timeout: bound on each wait of a state transfer (default: the process group's timeout).
    """

    def __init__(self, engine: Engine, groups: PairGroups, *, timeout: timedelta | None = None):
        if not isinstance(engine, Engine):
            raise TypeError(f"engine: expected an Engine, got {type(engine).__name__}")
        if dist.get_rank() != groups.decode_rank:
            raise ValueError(f"DecodeWorker: runs on the decode rank {groups.decode_rank}, this is {dist.get_rank()}")
        self.engine = engine
        self.control = _Control(groups.prefill_rank, groups.control)
        self.receiver = RequestReceiver(engine.cache, peer=groups.prefill_rank, group=groups.transfer,
                                        control_group=groups.control, timeout=timeout)
        self.received = 0  # requests taken
        self.failed = 0  # transfers that failed (the router keeps those requests)
        self._keys: dict[int, int] = {}  # decode engine id -> router id
        self._times: dict[int, list[float]] = {}

    def run(self) -> None:
        """Serve until the router closes: between engine steps, take each request the router sent."""
        inbox = _Inbox(self._read)
        while True:
            message = inbox.get(block=not self.engine.has_unfinished)
            if message is not None:
                if message[0] == STOP:
                    self.control.send_words(STOP)  # goodbye: ends the router's reading thread
                    inbox.join()
                    return
                self._take(*message[1:])
                continue
            outputs = self.engine.step()
            now = time.perf_counter()
            for out in outputs:
                self._times[out.request_id].append(now)
                if out.finished:
                    self._send_output(out.request_id)

    def _read(self) -> tuple:
        """One message of the router (on the inbox's thread): (NEW, id, prompt, first token, params) or (STOP,)."""
        kind, key, prompt_len, params_len, first = self.control.recv_words()[:5]
        if kind == STOP:
            return (STOP,)
        if kind != NEW:
            raise RuntimeError(f"the router sent a malformed message (kind {kind})")
        params = SamplingParams(**json.loads(self.control.recv_bytes(params_len)))
        prompt = tuple(self.control.recv(torch.empty(prompt_len, dtype=torch.int64)).tolist())
        return NEW, key, prompt, first, params

    def _take(self, key: int, prompt: tuple[int, ...], first: int, params: SamplingParams) -> None:
        try:
            state = self.receiver.recv_state()
        except (TransferError, ValueError):
            self.failed += 1  # the router keeps the request
            return
        request_id = self.engine.add_request(prompt + (first,), params, cache_state=state)  # imported at admission
        self._keys[request_id] = key
        self._times[request_id] = []
        self.received += 1

    def _send_output(self, request_id: int) -> None:
        out = self.engine.output(request_id)
        times = self._times.pop(request_id)
        self.control.send_words(OUTPUT, self._keys.pop(request_id), len(out.token_ids),
                                REASONS.index(out.finish_reason))
        self.control.send(torch.tensor(out.token_ids, dtype=torch.int64))
        self.control.send(torch.tensor(times, dtype=torch.float64))
