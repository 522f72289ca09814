"""On a GPU: plans and pools on the device equal the CPU ones, and a captured CUDA graph replays over
plans rebuilt into the same StepBuffers. Skipped where no CUDA device exists (CI); run on the H200."""

import random

import pytest
import torch

from dsv4kv import CacheManager, ModelGeometry, StepPlan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FIELDS = ("positions", "token_request", "window_slots", "request_slots", "query_start", "seq_lens")


def schedule(seed, steps, live=4):
    """A fixed random list of actions: ('admit',), ('release', k), ('step', [(k, n), ...]) with k = admission order."""
    rng = random.Random(seed)
    actions, alive, admitted = [], [], 0
    for _ in range(steps):
        if len(alive) < live and rng.random() < 0.2:
            actions.append(("admit",))
            alive.append(admitted)
            admitted += 1
        elif alive and rng.random() < 0.05:
            k = alive.pop(rng.randrange(len(alive)))
            actions.append(("release", k))
        elif alive:
            chosen = rng.sample(alive, rng.randint(1, len(alive)))
            actions.append(("step", [(k, 1 if rng.random() < 0.7 else rng.randint(2, 40)) for k in chosen]))
    return actions


@pytest.mark.parametrize("geometry", ["tiny", "flash"])
def test_cuda_plans_equal_cpu_plans(geometry):
    g = ModelGeometry.preset(geometry)
    managers = [CacheManager(g, max_requests=4, max_tokens=20000, page_tokens=256, device=d) for d in ("cpu", "cuda")]
    ids = [[], []]
    for action in schedule(seed=3, steps=400):
        plans = []
        for m, rids in zip(managers, ids):
            if action[0] == "admit":
                rids.append(m.admit())
            elif action[0] == "release":
                m.release(rids[action[1]])
            else:
                plans.append(m.plan_step([(rids[k], n) for k, n in action[1]]))
        if plans:
            cpu, gpu = plans
            assert isinstance(cpu, StepPlan) and isinstance(gpu, StepPlan)
            assert gpu.positions.is_cuda
            for name in FIELDS:
                assert torch.equal(getattr(cpu, name), getattr(gpu, name).cpu()), name
            for ratio in g.ratios:
                for name in ("slots", "request", "index"):
                    assert torch.equal(getattr(cpu.entries[ratio], name), getattr(gpu.entries[ratio], name).cpu())
        assert torch.equal(managers[0].block_table, managers[1].block_table.cpu())


def test_graph_replays_over_rebuilt_plans():
    m = CacheManager(ModelGeometry.preset("tiny"), max_requests=4, max_tokens=4000, page_tokens=128,
                     device="cuda", poison=True)
    buffers = m.step_buffers(max_tokens=4, max_requests=4)  # decode batches of up to 4
    rids = [m.admit() for _ in range(4)]
    plan = m.plan_step([(r, 1) for r in rids], buffers=buffers)

    def step(plan):
        # stands in for a decode step: reads every plan field and the persistent block table
        first_block = plan.block_table[plan.request_slots.clamp(min=0).long(), 0]
        return (plan.positions * 1000 + plan.window_slots, torch.where(plan.request_slots >= 0, first_block, -7),
                plan.seq_lens.sum(), plan.entries[4].slots * 3, plan.entries[16].slots + plan.entries[16].index)

    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step(plan)

    rng = random.Random(5)
    for i in range(300):
        live = rng.sample(rids, rng.randint(1, 4))  # fewer rows than captured: the rest is padding
        plan = m.plan_step([(r, 1) for r in live], buffers=buffers)
        assert isinstance(plan, StepPlan)
        graph.replay()
        expected = step(plan)
        for got, want in zip(outputs, expected):
            assert torch.equal(got, want), f"step {i}"
    assert m.length(rids[0]) > 64  # windows wrapped, CSA and HCA entries completed, new blocks were taken
    assert m.num_used_blocks > 4
