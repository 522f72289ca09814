"""`dsv4kv bench transfer` (issue 39): a request's cache moved between two GPUs, and prefill / decode disaggregation.

Two processes, one GPU each (NCCL), spawned by the workload itself; or two CPU processes over gloo at tiny sizes
(`python -m dsv4kv.tools.bench.transfer --cpu`, what CI runs). Three things are measured:

1. Transfer bandwidth: one V4-Flash request (FP8 entries, MXFP4 indexer keys; every page filled with random valid
   bytes, `synthetic.fill_layer`) sent whole (`cache.distributed`: header and reply over the gloo group, the state
   as one message in 64 MiB chunks over NCCL, the receiver's check) against NCCL's own send / recv of the same
   bytes in one buffer. Timed on the receiver from a barrier to the last byte checked (median of the runs).
2. The time to move the request: the same, plus the import into the receiver's cache (fresh blocks, every byte);
   at 128K tokens in the full run. The check: the receiver's imported state hashes (sha256) to the sender's.
3. A mixed workload on the demo model (`tools/demo.py`: V4-Flash attention geometry, 4 layers, bf16 on CUDA):
   short requests decoding while long prompts arrive. One GPU serving both (one engine, chunked prefill sharing
   steps with the decodes) against disaggregation (`engine/disaggregated.py`: the prefill engine on GPU 0, the
   decode engine on GPU 1). Reported: inter-token latency p50 / p99 over every gap between consecutive tokens of
   every request (the gap that spans a move included), time to first token, output tokens/s. The check: every
   request finished with all its tokens; how many requests' greedy tokens equal one GPU's is reported (in bf16
   the two serve different batches, so a near tie may fork; tests/test_disaggregated.py shows identity in fp32).

Run on two GPUs: `python -m dsv4kv.tools.bench.transfer [--quick] --out DIR` (or `dsv4kv bench transfer`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from .report import Report, Result

__all__ = ["TransferSizes", "FULL", "QUICK", "CPU", "transfer", "run_transfer_bench", "main"]

# the process group's timeout bounds every wait; no per-call timeout (on NCCL a wait with one polls the host)
TIMEOUT = datetime.timedelta(seconds=300)


@dataclass(frozen=True)
class TransferSizes:
    tokens: int  # the moved request (V4-Flash geometry)
    runs: int  # timed moves of each kind
    page_tokens: int
    decode_requests: int  # mixed workload: short requests, all arriving at 0
    decode_prompt: int
    decode_new: int
    long_requests: int  # long prompts arriving one every `gap_s`, from `gap_s` on
    long_prompt: int
    long_new: int
    gap_s: float
    step_tokens: int  # the one-GPU engine's step budget (its prefill chunk)


FULL = TransferSizes(tokens=131072, runs=10, page_tokens=256, decode_requests=16, decode_prompt=1024, decode_new=128,
                     long_requests=6, long_prompt=32768, long_new=8, gap_s=0.3, step_tokens=8192)
QUICK = TransferSizes(tokens=32768, runs=5, page_tokens=256, decode_requests=8, decode_prompt=512, decode_new=48,
                      long_requests=3, long_prompt=16384, long_new=8, gap_s=0.2, step_tokens=4096)
CPU = TransferSizes(tokens=1024, runs=2, page_tokens=128, decode_requests=2, decode_prompt=40, decode_new=5,
                    long_requests=2, long_prompt=300, long_new=3, gap_s=0.0, step_tokens=128)


# --- the two processes --------------------------------------------------------------------------------
def _worker(rank: int, backend: str, sizes: TransferSizes, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1 if backend == "gloo" else torch.get_num_threads())
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=TIMEOUT)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    barrier = dist.new_group([0, 1], backend="gloo")
    figures = {"rank": rank, "device": torch.cuda.get_device_name(device) if backend == "nccl" else "cpu"}
    figures.update(_bandwidth(rank, device, sizes, barrier))
    figures.update(_mixed(rank, device, sizes, barrier))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(figures, f)
    dist.barrier(group=barrier)
    dist.destroy_process_group()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _digest(state) -> str:
    h = hashlib.sha256()
    for name in sorted(state.tensors):
        h.update(name.encode())
        h.update(state.tensors[name].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _bandwidth(rank: int, device: torch.device, sizes: TransferSizes, barrier) -> dict:
    """Parts 1 and 2: receiver-side times (seconds per run) of NCCL's one buffer, our transfer, our move."""
    import torch.distributed as dist

    from ...cache.distributed import RequestReceiver, RequestSender
    from ...cache.manager import CacheManager
    from .common import model_geometry
    from .synthetic import fill_layer

    g = model_geometry("flash")
    cache = CacheManager(g, max_requests=1, max_tokens=sizes.tokens, page_tokens=sizes.page_tokens, device=device)
    out: dict = {"tokens": sizes.tokens, "state_bytes": None}
    if rank == 0:
        rid = cache.admit()
        assert cache.plan_step([(rid, sizes.tokens)])  # every block allocated; the bytes are synthetic
        for i in range(g.num_layers):
            fill_layer(cache.pages(i), window=g.window, seed=i)
        _sync(device)
    state_bytes = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        state_bytes[0] = _state_bytes(cache, len(cache.blocks(rid)))
    dist.broadcast(state_bytes, 0, group=barrier)
    out["state_bytes"] = int(state_bytes)
    buffer = torch.empty(int(state_bytes), dtype=torch.uint8, device=device)
    times = {"nccl": [], "transfer": [], "move": []}
    # the control messages over the gloo group, the bytes over NCCL (as engine/disaggregated.py's roles send them)
    receiver = RequestReceiver(cache, peer=0, control_group=barrier) if rank == 1 else None
    for run in range(sizes.runs + 1):  # run 0 warms up (the NCCL communicator, the caching allocator)
        for kind in ("nccl", "transfer", "move"):
            dist.barrier(group=barrier)
            start = time.perf_counter()
            if rank == 0:
                if kind == "nccl":
                    dist.send(buffer, 1)
                else:
                    sender = RequestSender(cache, rid, peer=1, control_group=barrier)
                    sender.start()
                    sender.send_all()
                    sender.finish()
                _sync(device)
                continue
            if kind == "nccl":
                dist.recv(buffer, 0)
            elif kind == "transfer":
                receiver.recv_state()  # received and checked; dropped
            else:
                moved = receiver.recv()
            _sync(device)
            if run:
                times[kind].append(time.perf_counter() - start)
            if kind == "move" and run < sizes.runs:
                cache.release(moved)
    # the check: the moved request's every byte
    digest = _digest(cache.export_request(rid if rank == 0 else moved))
    out.update(times=times if rank == 1 else None, digest=digest)
    return out


def _state_bytes(cache, blocks: int) -> int:
    """The bytes of a request's state holding `blocks` blocks: its pages and its slot's window and compressor rows."""
    return sum((blocks if paged else 1) * t[0].numel() * t.element_size()
               for i in range(cache.geometry.num_layers) for t, paged in cache.pages(i).request_tensors())


def _schedule(sizes: TransferSizes, vocab: int) -> list[tuple[float, list[int], int]]:
    """(arrival seconds, prompt, new tokens), by arrival: the short requests at 0, then a long prompt each gap."""
    g = torch.Generator().manual_seed(5)
    short = [(0.0, torch.randint(0, vocab, (sizes.decode_prompt,), generator=g).tolist(), sizes.decode_new)
             for _ in range(sizes.decode_requests)]
    long = [(sizes.gap_s * (i + 1), torch.randint(0, vocab, (sizes.long_prompt,), generator=g).tolist(),
             sizes.long_new) for i in range(sizes.long_requests)]
    return short + long


def _engine_options(sizes: TransferSizes, device: torch.device) -> dict:
    longest = max(sizes.decode_prompt + sizes.decode_new, sizes.long_prompt + sizes.long_new)
    total = (sizes.decode_requests * (sizes.decode_prompt + sizes.decode_new)
             + sizes.long_requests * (sizes.long_prompt + sizes.long_new))
    return dict(max_requests=sizes.decode_requests + sizes.long_requests, max_tokens=total, max_seq_len=longest,
                page_tokens=sizes.page_tokens, step_tokens=sizes.step_tokens, device=device)


def _mixed(rank: int, device: torch.device, sizes: TransferSizes, barrier) -> dict:
    """Part 3: the one-GPU run on rank 0 (rank 1 waits), then the disaggregated run on both."""
    import torch.distributed as dist

    from ...engine import Engine, SamplingParams
    from ...engine.disaggregated import DecodeWorker, PairGroups, PrefillRouter
    from ..demo import demo_model

    oracle, model = demo_model("demo-gpu" if device.type == "cuda" else "demo-cpu", device, seed=0)
    if oracle is not model:
        del oracle
    schedule = _schedule(sizes, model.config.vocab_size)
    # the warm-up compiles every kernel and captures every decode graph size before anything is timed: as many short
    # requests as the engines hold, ending one every two steps (every batch size twice: a graph is captured at its
    # second step), and one long prompt (its chunks' shapes)
    options = _engine_options(sizes, device)
    requests = options["max_requests"]
    warm = [p[:sizes.page_tokens + 7] for _, p, _ in schedule[:1]] * (requests - 1) + [schedule[-1][1]]
    warm_params = [SamplingParams(max_new_tokens=2 + 2 * i) for i in range(requests - 1)]
    warm_params.append(SamplingParams(max_new_tokens=2))
    out: dict = {}
    if rank == 0:
        engine = Engine.from_transformers(model, **options)
        engine.generate(warm, warm_params)
        out["colocated"] = _serve_alone(engine, schedule)
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier(group=barrier)
    groups = PairGroups.make(prefill_rank=0, decode_rank=1)
    engine = Engine.from_transformers(model, **options)
    if rank == 1:
        # captured here, before any transfer: NCCL's watchdog may query events while a graph is captured
        engine.generate(warm, warm_params)
        worker = DecodeWorker(engine, groups)
        worker.run()  # the warm-up and the timed run, until the router closes
        out["received"] = worker.received
        return out
    router = PrefillRouter(engine, groups)
    router.generate(warm, warm_params)  # compile and capture on both sides
    before = dataclasses.asdict(router.stats)
    out["disaggregated"] = _serve_routed(router, schedule)
    out["router"] = {k: v - before[k] for k, v in dataclasses.asdict(router.stats).items()}
    router.close()
    return out


def _serve_alone(engine, schedule) -> dict:
    """Serve the arrival schedule on one engine: per request its tokens and token times (from the start)."""
    arrivals, ids, times, tokens = _Arrivals(engine, schedule), {}, {}, {}
    while arrivals.pending or engine.has_unfinished:
        now = arrivals.admit(ids, times)
        if not engine.has_unfinished:
            time.sleep(max(0.0, arrivals.pending[0][1][0] - now))
            continue
        for out in engine.step():
            times[ids[out.request_id]].append(arrivals.clock())
            if out.finished:
                tokens[ids[out.request_id]] = list(engine.output(out.request_id).token_ids)
    return {"tokens": tokens, "times": times}


def _serve_routed(router, schedule) -> dict:
    """The same schedule through the router (prefill here, decode on the other rank)."""
    arrivals, ids, times, tokens = _Arrivals(router, schedule), {}, {}, {}
    while arrivals.pending or router.has_unfinished:
        arrivals.admit(ids, times)
        for out in router.step():
            i = ids[out.request_id]
            times[i] += [t - arrivals.start for t in out.token_times]
            tokens[i] = list(out.token_ids)
        if not router.engine.has_unfinished:
            time.sleep(1e-4)  # requests are decoding on the other rank: poll again shortly
    return {"tokens": tokens, "times": times}


class _Arrivals:
    """The schedule's requests handed to `server` (an Engine or a PrefillRouter) as their arrival times pass."""

    def __init__(self, server, schedule):
        self.server, self.pending, self.start = server, deque(enumerate(schedule)), time.perf_counter()

    def clock(self) -> float:
        return time.perf_counter() - self.start

    def admit(self, ids: dict, times: dict) -> float:
        """Add every request whose arrival has passed (ids: server id -> schedule index; times: index -> [arrival]);
        returns the clock."""
        from ...engine import SamplingParams

        now = self.clock()
        while self.pending and self.pending[0][1][0] <= now:
            i, (at, prompt, n) = self.pending.popleft()
            ids[self.server.add_request(prompt, SamplingParams(max_new_tokens=n))] = i
            times[i] = [at]
        return now


# --- figures ------------------------------------------------------------------------------------------
def _latency(run: dict) -> dict:
    """Inter-token gaps p50 / p99 (ms) over every request, time to first token p50 / p99 (ms), output tokens/s."""
    gaps = np.concatenate([np.diff(t[1:]) for t in run["times"].values() if len(t) > 2]) * 1e3
    ttft = np.array([t[1] - t[0] for t in run["times"].values()]) * 1e3
    last = max(t[-1] for t in run["times"].values())
    count = sum(len(t) - 1 for t in run["times"].values())
    return {"itl_p50_ms": float(np.percentile(gaps, 50)), "itl_p99_ms": float(np.percentile(gaps, 99)),
            "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "tokens_per_s": count / last, "total_s": last, "gaps": int(gaps.size)}


def _results(sizes: TransferSizes, ranks: list[dict], backend: str) -> list[Result]:
    sender, receiver = ranks
    nbytes, times = receiver["state_bytes"], receiver["times"]
    median = {kind: float(np.median(t)) * 1e6 for kind, t in times.items()}
    same = sender["digest"] == receiver["digest"]
    check = f"the moved state's sha256 {'equals' if same else 'DIFFERS from'} the sender's"
    params = {"tokens": sizes.tokens, "model": "V4-Flash", "kv_format": "fp8", "indexer_format": "mxfp4",
              "page_tokens": sizes.page_tokens, "runs": sizes.runs}
    k = f"{sizes.tokens // 1024}K"
    rows = [Result("transfer", f"{backend} send/recv, one buffer, {k}", params, median["nccl"], bytes=nbytes,
                   check="the baseline (bytes not checked)")]
    for kind, what in (("transfer", "transfer (recv_state)"), ("move", "move incl. import (recv)")):
        rows.append(Result("transfer", f"{what}, {k}", params, median[kind], bytes=nbytes, check=check, passed=same,
                           extra={"pct_of_nccl": 100 * median["nccl"] / median[kind],
                                  "p10_us": float(np.percentile(times[kind], 10)) * 1e6,
                                  "p90_us": float(np.percentile(times[kind], 90)) * 1e6}))
    alone, routed = sender["colocated"], sender["disaggregated"]
    want = {int(i): t for i, t in alone["tokens"].items()}
    got = {int(i): t for i, t in routed["tokens"].items()}
    expected = [sizes.decode_new] * sizes.decode_requests + [sizes.long_new] * sizes.long_requests
    complete = all(len(run.get(i, [])) == n for run in (want, got) for i, n in enumerate(expected))
    equal = sum(want[i] == got[i] for i in want)
    check = (f"every request finished with its {'tokens' if complete else 'tokens: NO, some are missing'}; "
             f"greedy tokens equal one GPU's for {equal} of {len(want)} requests")
    mix = {"decode_requests": sizes.decode_requests, "decode_prompt": sizes.decode_prompt,
           "decode_new": sizes.decode_new, "long_requests": sizes.long_requests, "long_prompt": sizes.long_prompt,
           "long_new": sizes.long_new, "gap_s": sizes.gap_s, "step_tokens": sizes.step_tokens, "model": "demo"}
    one, two = _latency(alone), _latency(routed)
    rows.append(Result("transfer", "mixed: one GPU serving both", mix, one["itl_p50_ms"] * 1e3, check=check,
                       passed=complete, extra=one))
    rows.append(Result("transfer", "mixed: disaggregated (two GPUs)", mix,
                       two["itl_p50_ms"] * 1e3, check=check, passed=complete,
                       extra={**two, "itl_p99_vs_one_gpu": two["itl_p99_ms"] / one["itl_p99_ms"],
                              **{f"router_{k}": v for k, v in sender["router"].items()}}))
    return rows


def run_transfer_bench(*, backend: str = "nccl", sizes: TransferSizes = FULL,
                       log=lambda line: print(line, file=sys.stderr, flush=True)) -> tuple[list[Result], dict]:
    """Spawn the two processes (NCCL on cuda:0 and cuda:1, or gloo on the CPU), run every part; (results, meta)."""
    import torch.multiprocessing as mp

    if backend == "nccl" and torch.cuda.device_count() < 2:
        raise ValueError(f"needs two CUDA GPUs for NCCL, {torch.cuda.device_count()} visible")
    with tempfile.TemporaryDirectory() as tmp:
        log(f"transfer: {sizes.tokens}-token V4-Flash request x {sizes.runs} runs, then the mixed workload "
            f"({backend}, two processes)")
        mp.spawn(_worker, args=(backend, sizes, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in (0, 1)]
    meta = {"gpus": [r["device"] for r in ranks], "backend": backend, "sizes": dataclasses.asdict(sizes),
            "torch": torch.__version__}
    if backend == "nccl":
        from .timing import machine_info

        version = torch.cuda.nccl.version()
        meta.update(machine_info(torch.device("cuda", 0)),
                    nccl=".".join(map(str, version)) if isinstance(version, tuple) else str(version))
    return _results(sizes, ranks, backend), meta


def transfer(ctx) -> None:
    """The `dsv4kv bench transfer` workload: the figures of `run_transfer_bench` on cuda:0 and cuda:1."""
    from .common import free_cuda

    free_cuda()
    if torch.cuda.device_count() < 2:
        ctx.log("transfer: skipped: needs two CUDA GPUs")
        ctx.report.meta["transfer_skipped"] = "needs two CUDA GPUs"
        return
    results, meta = run_transfer_bench(sizes=QUICK if ctx.quick else FULL, log=ctx.log)
    for r in results:
        ctx.report.add(r)
    ctx.report.meta["transfer"] = meta


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsv4kv.tools.bench.transfer", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 32K-token request and a smaller mixed workload")
    parser.add_argument("--cpu", action="store_true", help="two CPU processes over gloo at tiny sizes")
    parser.add_argument("--out", default=None, help="folder for transfer-<date>-<gpu>.json (default: print only)")
    args = parser.parse_args(argv)
    backend = "gloo" if args.cpu else "nccl"
    sizes = CPU if args.cpu else QUICK if args.quick else FULL
    results, meta = run_transfer_bench(backend=backend, sizes=sizes)
    gpu = meta["gpus"][0]
    report = Report(meta={"gpu": gpu, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), **meta}, results=results)
    print(report.table())
    for r in results:
        if r.extra:
            shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.extra.items()}
            print(f"  {r.name}: {shown}")
    if args.out:
        name = f"transfer-{report.meta['date'][:10]}-{gpu.replace('NVIDIA ', '').replace(' ', '-')}"
        path = os.path.join(args.out, f"{name}.json")
        report.save(path)
        print(f"wrote {path}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
