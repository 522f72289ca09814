"""Prefill / decode disaggregation (issue 39; engine/disaggregated.py) on the tiny three-layer model in two CPU
processes over gloo: a router with the prefill engine on rank 0, the decode engine on rank 1. Greedy tokens are
identical to one engine serving alone: long and short prompts, more requests than the decode engine's slots
(queued with their states), one that ends at its first token (never moved), one that ends on a stop token on the
decode side, the decode engine with prefix caching on and off; nothing is left held on either side."""

from __future__ import annotations

import datetime
import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv4kv.engine import SamplingParams

LENGTHS = (131, 47, 260, 9, 75)


@functools.lru_cache(maxsize=None)
def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    from test_engine import prompts

    params = [SamplingParams(max_new_tokens=n) for n in (6, 5, 7, 1, 6)]
    return prompts(LENGTHS, seed=81), params


def _run(rank: int, init_file: str, out: str, stop: int) -> None:
    from test_engine import engine
    from dsv4kv.engine.disaggregated import DecodeWorker, PairGroups, PrefillRouter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    for decode_caching in (False, True):  # the same two processes serve twice: new engines, new groups
        groups = PairGroups.make(prefill_rank=0, decode_rank=1)
        if rank == 1:
            worker = DecodeWorker(engine(max_requests=2, prefix_caching=decode_caching), groups)
            worker.run()
            assert worker.received == 4 and worker.failed == 0
            c = worker.engine.cache
            assert (c.num_live_requests, c.num_used_blocks) == (0, 0) and not worker.engine.has_unfinished
            continue
        prompts, params = workload()
        params = list(params)
        params[4] = SamplingParams(max_new_tokens=6, stop_token_ids=(stop,))
        router = PrefillRouter(engine(max_requests=2), groups)
        with pytest.raises(ValueError, match="logprobs"):
            router.add_request(prompts[0], SamplingParams(logprobs=2))
        outputs = router.generate(prompts, params)
        router.close()
        assert router.stats.moved == 4 and router.stats.failed_moves == 0 and router.stats.bytes_sent > 0
        c = router.engine.cache
        assert (c.num_live_requests, c.num_used_blocks) == (0, 0) and not router.engine.has_unfinished
        results[decode_caching] = [(o.token_ids, o.finish_reason, o.moved, len(o.token_times)) for o in outputs]
    if rank == 0:
        torch.save(results, os.path.join(out, "outputs.pt"))
    dist.destroy_process_group()


def test_disaggregated_greedy_tokens_equal_one_engine(tmp_path):
    from test_engine import engine

    prompts, params = workload()
    alone = engine().generate(prompts, params)
    stop = alone[4].token_ids[3]  # the 5th request stops at its 4th token, on the decode side
    want = engine().generate(prompts, params[:4] + [SamplingParams(max_new_tokens=6, stop_token_ids=(stop,))])
    assert want[4].finish_reason == "stop" and len(want[4].token_ids) == want[4].token_ids.index(stop) + 1
    mp.spawn(_run, args=(str(tmp_path / "init"), str(tmp_path), stop), nprocs=2, join=True)
    results = torch.load(tmp_path / "outputs.pt")
    for decode_caching, got in results.items():
        assert [g[0] for g in got] == [o.token_ids for o in want], f"decode caching {decode_caching}"
        assert [g[1] for g in got] == [o.finish_reason for o in want]
        assert [g[2] for g in got] == [True, True, True, False, True]  # the 1-token request never moved
        assert [g[3] for g in got] == [len(o.token_ids) for o in want]  # a time per token
    assert sorted(results) == [False, True]


def _no_room(rank: int, init_file: str, out: str) -> None:
    """Rank 1 plays a decode side without room: it answers the first move's header NO_ROOM (no slot), and the second
    move's final reply NO_ROOM (its import finds no slot: a receiver told there was room at the header). The router
    keeps both requests on the prefill engine."""
    from test_engine import engine
    from dsv4kv.cache.distributed import RequestReceiver
    from dsv4kv.engine.disaggregated import NEW, STOP, PairGroups, PrefillRouter

    class RoomAtHeader(RequestReceiver):
        def _room(self, length, tokens, skip):  # as if a slot were free at the header; the import finds none
            return None

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    groups = PairGroups.make(prefill_rank=0, decode_rank=1)
    prompts, params = workload()
    if rank == 1:
        cache = engine(max_requests=1).cache
        cache.admit()  # its only slot is taken
        before = (cache.request_ids(), cache.num_free_blocks)
        answers = []
        for receiver in (RequestReceiver(cache, peer=0, group=groups.transfer, control_group=groups.control),
                         RoomAtHeader(cache, peer=0, group=groups.transfer, control_group=groups.control)):
            words = torch.zeros(8, dtype=torch.int64)
            dist.recv(words, 0, group=groups.control)
            kind, _, prompt_len, params_len = words.tolist()[:4]
            assert kind == NEW
            dist.recv(torch.empty(params_len, dtype=torch.uint8), 0, group=groups.control)
            dist.recv(torch.empty(prompt_len, dtype=torch.int64), 0, group=groups.control)
            answers.append(receiver.recv())
        assert [type(a).__name__ for a in answers] == ["NoRoom", "NoRoom"]
        assert (cache.request_ids(), cache.num_free_blocks) == before
        dist.recv(words, 0, group=groups.control)
        assert words[0] == STOP
        dist.send(torch.tensor([STOP] + [0] * 7, dtype=torch.int64), 0, group=groups.control)  # the goodbye
    else:
        router = PrefillRouter(engine(max_requests=2), groups)
        outputs = router.generate(prompts[:2], params[:2])
        router.close()
        assert (router.stats.moved, router.stats.failed_moves, router.stats.bytes_sent) == (0, 2, 0)
        c = router.engine.cache
        assert (c.num_live_requests, c.num_used_blocks) == (0, 0) and not router.engine.has_unfinished
        torch.save([(o.token_ids, o.moved) for o in outputs], os.path.join(out, "outputs.pt"))
    dist.destroy_process_group()


def test_a_decode_side_without_room_leaves_the_requests_on_the_prefill_engine(tmp_path):
    from test_engine import engine

    prompts, params = workload()
    want = engine().generate(prompts[:2], params[:2])
    mp.spawn(_no_room, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "outputs.pt")
    assert got == [(o.token_ids, False) for o in want]
