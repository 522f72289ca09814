"""Bad input to DSV4Attention(hidden_states, plan, cache): a clear ValueError / TypeError raised before anything
is written (every pool, state tensor and the block table bit-for-bit unchanged), and a valid call afterwards."""

import json
from importlib import resources

import pytest
import torch

from dsv4kv import CacheManager, ModelGeometry, OutOfBlocks
from dsv4kv.model.layer import DSV4Attention, init_random_weights

TINY = json.loads(resources.files("dsv4kv.presets").joinpath("tiny.json").read_text())
LAYERS = [0, 1, 2]
LAYER_IDS = ["window", "CSA", "HCA"]


# --- helpers -------------------------------------------------------------------------------------
def raw(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's bits: NaN pools (poison bytes) and -inf states compare exactly."""
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}.get(t.dtype, t.dtype))


def cache_tensors(cache: CacheManager) -> list[torch.Tensor]:
    return [t for layer in cache.pools.layers for t in layer.tensors()] + [cache.block_table]


def snapshot(cache: CacheManager):
    return ([t.clone() for t in cache_tensors(cache)],
            (cache.steps_planned, cache.num_free_blocks, cache.tokens_held, cache.num_live_requests))


def assert_unchanged(cache: CacheManager, snap):
    tensors, counters = snap
    now = cache_tensors(cache)
    assert len(now) == len(tensors)
    for i, (before, after) in enumerate(zip(tensors, now)):
        assert before.dtype == after.dtype and before.shape == after.shape
        assert torch.equal(raw(before), raw(after)), f"cache tensor {i} ({after.dtype} {list(after.shape)}) changed"
    assert (cache.steps_planned, cache.num_free_blocks, cache.tokens_held, cache.num_live_requests) == counters


def hidden(n: int, width: int = 256, dtype=torch.bfloat16, seed: int = 0, device="cpu") -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def two_steps(cache, first, second, run=()):
    """Admit two requests, plan `first` (new tokens of each) and run it through the layers `run`, then plan
    `second`; returns (a, b, plan of the second step)."""
    a, b = cache.admit(), cache.admit()
    plan = cache.plan_step([(a, first[0]), (b, first[1])])
    for layer in run:
        x = hidden(plan.num_tokens, dtype=layer.q_a_proj.weight.dtype, seed=1, device=cache.device)
        assert torch.isfinite(layer(x, plan, cache)).all()
    return a, b, cache.plan_step([(a, second[0]), (b, second[1])])


class Setup:
    """A poisoned tiny cache two steps into two requests; `plan` is its current step (20 tokens). The first
    step is run through the layers `run` (none by default: the bad calls never read the cache)."""

    FIRST, SECOND = (40, 21), (1, 19)

    def __init__(self, device="cpu", run=(), first=FIRST, second=SECOND):
        self.geometry = ModelGeometry.preset("tiny")
        self.cache = CacheManager(self.geometry, max_requests=3, max_tokens=512, page_tokens=128, poison=True,
                                  device=device)
        self.first, self.second = first, second
        self.a, self.b, self.plan = two_steps(self.cache, first, second, run)
        self.x = hidden(self.plan.num_tokens, device=device)


@pytest.fixture(scope="module")
def tiny_layers():
    g = ModelGeometry.preset("tiny")
    return {i: init_random_weights(DSV4Attention(g, i), seed=i) for i in LAYERS}


@pytest.fixture(scope="module")
def mini_layers():
    """Layers of the mini preset (uninitialized CPU weights: only the checks run)."""
    g = ModelGeometry.preset("mini")
    return {i: DSV4Attention(g, i, device="meta").to_empty(device="cpu") for i in LAYERS}


def geometry_of(**changes) -> ModelGeometry:
    return ModelGeometry.from_hf_config({**TINY, **changes})


# Each case: (id, exception, message regex, make) where make(setup) does any preparation
# (possibly planning steps) and returns the call's arguments; the cache is snapshotted after make.
def _other_cache_plan(s):
    other = CacheManager(s.geometry, max_requests=3, max_tokens=512, page_tokens=128, poison=True)
    plan = two_steps(other, s.first, s.second)[2]
    assert (plan.step, plan.num_tokens) == (s.plan.step, s.plan.num_tokens)  # only the owner differs
    return s.x, plan, s.cache


def _stale_plan(s):
    new = s.cache.plan_step([(s.a, 1)])
    assert new.step == s.plan.step + 1
    return s.x, s.plan, s.cache


def _stale_plan_same_size(s):
    s.cache.plan_step([(s.a, s.second[0]), (s.b, s.second[1])])  # same shape of step: only the step number tells
    return s.x, s.plan, s.cache


def _released_request(s):
    s.cache.release(s.b)  # after plan_step: the plan still lists b
    return s.x, s.plan, s.cache


def _out_of_blocks_as_plan(s):
    c = s.cache.admit()
    result = s.cache.plan_step([(c, 640)])
    assert isinstance(result, OutOfBlocks)
    return s.x, result, s.cache


MUTATING = (_stale_plan, _stale_plan_same_size, _out_of_blocks_as_plan, _released_request)

CASES = [
    ("width-narrow", ValueError, r"hidden_states: expected \[N, 256\], got \[20, 255\]",
     lambda s: (s.x[:, :255], s.plan, s.cache)),
    ("width-wide", ValueError, r"hidden_states: expected \[N, 256\], got \[20, 512\]",
     lambda s: (torch.cat((s.x, s.x), 1), s.plan, s.cache)),
    ("1-D", ValueError, r"hidden_states: expected \[N, 256\], got \[256\]",
     lambda s: (s.x[0], s.plan, s.cache)),
    ("3-D", ValueError, r"hidden_states: expected \[N, 256\], got \[1, 20, 256\]",
     lambda s: (s.x[None], s.plan, s.cache)),
    ("not-a-tensor", ValueError, r"hidden_states: expected \[N, 256\], got list",
     lambda s: (s.x.tolist(), s.plan, s.cache)),
    ("fp32-into-bf16", ValueError, r"hidden_states: dtype torch\.float32, the layer's weights are torch\.bfloat16",
     lambda s: (s.x.float(), s.plan, s.cache)),
    ("fp16-into-bf16", ValueError, r"hidden_states: dtype torch\.float16",
     lambda s: (s.x.half(), s.plan, s.cache)),
    ("more-rows", ValueError, r"hidden_states: 21 rows, the plan has 20 tokens",
     lambda s: (torch.cat((s.x, s.x[:1])), s.plan, s.cache)),
    ("fewer-rows", ValueError, r"hidden_states: 19 rows, the plan has 20 tokens",
     lambda s: (s.x[:-1], s.plan, s.cache)),
    ("no-rows", ValueError, r"hidden_states: 0 rows, the plan has 20 tokens",
     lambda s: (s.x[:0], s.plan, s.cache)),
    ("plan-of-another-cache", ValueError, r"plan: made by another CacheManager than `cache`", _other_cache_plan),
    ("stale-plan", ValueError, (r"plan: step 2 is stale, the cache has planned step 3; run every layer over the "
                                r"latest plan"), _stale_plan),
    ("stale-plan-same-shape", ValueError, r"plan: step 2 is stale, the cache has planned step 3",
     _stale_plan_same_size),
    ("released-request", ValueError, r"plan: requests \[1\] were released after the plan was made",
     _released_request),
    ("mini-layer", ValueError, (r"layer \d: geometry differs from the cache's in \['hidden_size', 'num_heads', "
                                r"'head_dim', 'q_lora_rank', 'o_groups', 'o_lora_rank', 'window', 'index_n_heads', "
                                r"'index_head_dim', 'index_topk'(, 'layers\[\d\]')?\]"),
     lambda s: (hidden(20, 1024), s.plan, s.cache)),
    ("other-window", ValueError, r"layer \d: geometry differs from the cache's in \['window'\]",
     lambda s: (s.x, s.plan, s.cache)),
    ("other-eps", ValueError, r"layer \d: geometry differs from the cache's in \['rms_norm_eps'\]",
     lambda s: (s.x, s.plan, s.cache)),
    ("other-layer-kind", ValueError, r"layer (\d): geometry differs from the cache's in \['layers\[\1\]'\]",
     lambda s: (s.x, s.plan, s.cache)),
    ("plan-None", TypeError, r"plan: expected a StepPlan from CacheManager\.plan_step, got NoneType",
     lambda s: (s.x, None, s.cache)),
    ("plan-OutOfBlocks", TypeError, r"plan: expected a StepPlan from CacheManager\.plan_step, got OutOfBlocks",
     _out_of_blocks_as_plan),
    ("plan-dict", TypeError, r"plan: expected a StepPlan .* got dict",
     lambda s: (s.x, dict(vars(s.plan)), s.cache)),
    ("cache-None", TypeError, r"cache: expected a CacheManager, got NoneType",
     lambda s: (s.x, s.plan, None)),
    ("cache-pools", TypeError, r"cache: expected a CacheManager, got CachePools",
     lambda s: (s.x, s.plan, s.cache.pools)),
    ("plan-and-cache-swapped", TypeError, r"cache: expected a CacheManager, got StepPlan",
     lambda s: (s.x, s.cache, s.plan)),
]

# the layer each case runs (default: the tiny layer of that index)
LAYER_GEOMETRY = {
    "other-window": {"sliding_window": 32},
    "other-eps": {"rms_norm_eps": 1e-5},
    # every layer of 0..2 gets another kind: window -> CSA, CSA -> HCA, HCA -> window
    "other-layer-kind": {"layer_types": ["compressed_sparse_attention", "heavily_compressed_attention",
                                         "sliding_attention", "compressed_sparse_attention"]},
}


_VARIANTS = {}


def layer_for(case_id, index, tiny_layers, mini_layers):
    if case_id == "mini-layer":
        return mini_layers[index]
    if case_id in LAYER_GEOMETRY:
        if (case_id, index) not in _VARIANTS:
            _VARIANTS[case_id, index] = DSV4Attention(geometry_of(**LAYER_GEOMETRY[case_id]), index)
        return _VARIANTS[case_id, index]
    return tiny_layers[index]


def check_rejected(setup, layer, error, message, make):
    args = make(setup)
    snap = snapshot(setup.cache)
    with pytest.raises(error, match=message):
        layer(*args)
    assert_unchanged(setup.cache, snap)


# --- the bad inputs, one by one ---------------------------------------------------------------------
@pytest.mark.parametrize("case_id,error,message,make", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("index", LAYERS, ids=LAYER_IDS)
def test_bad_input_raises_and_leaves_the_cache_unchanged(tiny_layers, mini_layers, index, case_id, error, message,
                                                         make):
    layer = layer_for(case_id, index, tiny_layers, mini_layers)
    check_rejected(Setup(), layer, error, message, make)


def test_geometry_cases_really_differ_only_where_named():
    tiny = ModelGeometry.preset("tiny")
    assert geometry_of(sliding_window=32).layers == tiny.layers
    assert geometry_of(rms_norm_eps=1e-5).layers == tiny.layers
    other = geometry_of(**LAYER_GEOMETRY["other-layer-kind"])
    assert all(other.layers[i].kind is not tiny.layers[i].kind for i in LAYERS)
    # a layer whose geometry differs only in fields the layer does not use is accepted
    s = Setup()
    layer = DSV4Attention(geometry_of(max_position_embeddings=131072), 0)
    assert layer(s.x, s.plan, s.cache).shape == (20, 256)


# --- then a valid call ---------------------------------------------------------------------------------
def test_valid_call_after_every_failure(tiny_layers, mini_layers):
    """One cache, warmed by a real step through layers 0..2; every bad call above is rejected without a trace;
    then the current plan runs through each layer and gives finite [N, hidden] output in the layer's dtype
    (the cache is poisoned: a read of anything not written would be NaN)."""
    s = Setup(run=[tiny_layers[i] for i in LAYERS], first=(19, 6), second=(1, 3))
    cache, a = s.cache, s.a
    snap, rejected = snapshot(cache), 0
    for case_id, error, message, make in CASES:
        if make in MUTATING:
            continue  # these plan further steps or release a request; the end of this test does that
        for i in LAYERS:
            layer = layer_for(case_id, i, tiny_layers, mini_layers)
            args = make(s)
            with pytest.raises(error):  # messages are checked case by case above
                layer(*args)
            assert_unchanged(cache, snap)
            rejected += 1
    assert rejected == 3 * (len(CASES) - len(MUTATING))

    # a step that did not fit (OutOfBlocks) leaves the current plan current
    c = cache.admit()
    assert isinstance(cache.plan_step([(c, 640)]), OutOfBlocks)
    cache.release(c)

    before = snapshot(cache)
    for i in LAYERS:
        out = tiny_layers[i](s.x, s.plan, cache)
        assert out.shape == (4, 256) and out.dtype == torch.bfloat16
        assert torch.isfinite(out).all()
    changed = [not torch.equal(raw(x), raw(y)) for x, y in zip(before[0], cache_tensors(cache))]
    assert any(changed), "a valid step writes the cache"

    # and the plan is stale after the next plan_step, as before
    nxt = cache.plan_step([(a, 1)])
    snap = snapshot(cache)
    with pytest.raises(ValueError, match="stale"):
        tiny_layers[1](s.x, s.plan, cache)
    assert_unchanged(cache, snap)
    out = tiny_layers[1](hidden(1, seed=3), nxt, cache)
    assert out.shape == (1, 256) and torch.isfinite(out).all()


def test_fp32_layer_takes_fp32_and_rejects_bf16():
    layer = init_random_weights(DSV4Attention(ModelGeometry.preset("tiny"), 2, dtype=torch.float32), seed=4)
    s = Setup(run=[layer], first=(19, 6), second=(1, 3))
    check_rejected(s, layer, ValueError,
                   r"hidden_states: dtype torch\.bfloat16, the layer's weights are torch\.float32",
                   lambda s: (s.x, s.plan, s.cache))
    out = layer(s.x.float(), s.plan, s.cache)
    assert out.dtype == torch.float32 and out.shape == (4, 256) and torch.isfinite(out).all()


def test_plan_with_a_released_request_is_rejected(tiny_layers):
    """Released and its slot re-admitted: the plan would write b's tokens into d's fresh window and state."""
    s = Setup()
    slot_b = s.cache.slot(s.b)
    s.cache.release(s.b)
    s.cache.admit()  # takes the free slot 2
    d = s.cache.admit()
    assert s.cache.slot(d) == slot_b  # d has b's slot, freshly reset
    snap = snapshot(s.cache)
    with pytest.raises(ValueError, match=r"plan: requests \[1\] were released after the plan was made"):
        tiny_layers[1](s.x, s.plan, s.cache)
    assert_unchanged(s.cache, snap)


# --- devices (CUDA only) -------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("where", ["layer-on-cuda", "hidden-on-cuda", "cache-on-cuda", "hidden-on-cpu"])
def test_device_mismatch(tiny_layers, where):
    if where in ("layer-on-cuda", "hidden-on-cuda"):  # CPU cache
        s = Setup()
        layer = DSV4Attention(s.geometry, 1, device="cuda") if where == "layer-on-cuda" else tiny_layers[1]
        x = s.x.cuda() if where == "hidden-on-cuda" else s.x
    else:  # CUDA cache
        s = Setup(device="cuda:0")
        layer = tiny_layers[1] if where == "cache-on-cuda" else DSV4Attention(s.geometry, 1, device="cuda")
        x = s.x.cpu()
    snap = snapshot(s.cache)
    with pytest.raises(ValueError, match=r"hidden_states on (cpu|cuda:0), weights on (cpu|cuda:0), cache on "
                                         r"(cpu|cuda:0)"):
        layer(x, s.plan, s.cache)
    assert_unchanged(s.cache, snap)


@cuda
@pytest.mark.parametrize("cache_device", ["cuda:0", "cuda"])  # "cuda" (no index) must work too
def test_valid_call_on_cuda(cache_device):
    layer = init_random_weights(DSV4Attention(ModelGeometry.preset("tiny"), 1, device="cuda"), seed=1)
    s = Setup(device=cache_device, run=[layer], first=(19, 6), second=(1, 3))
    out = layer(s.x, s.plan, s.cache)
    assert out.device.type == "cuda" and out.shape == (4, 256) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()


def test_a_layer_runs_once_per_plan(tiny_layers):
    """A second run of one layer over the same plan would re-read ring rows the first run overwrote."""
    s = Setup(run=[tiny_layers[1], tiny_layers[2]])
    out = tiny_layers[1](s.x, s.plan, s.cache)
    assert torch.isfinite(out).all()
    snap = snapshot(s.cache)
    with pytest.raises(ValueError, match=r"layer 1 already ran over plan step \d+: plan the next step first"):
        tiny_layers[1](s.x, s.plan, s.cache)
    assert_unchanged(s.cache, snap)
    tiny_layers[2](s.x, s.plan, s.cache)  # other layers still run over it
    plan = s.cache.plan_step([(s.a, 1)])
    tiny_layers[1](hidden(1), plan, s.cache)  # and the next plan runs again


def test_the_cache_never_joins_autograd(tiny_layers):
    """Called with grad enabled (no torch.no_grad), nothing written into the cache tracks gradients."""
    s = Setup(run=[tiny_layers[1]])
    layer = tiny_layers[1]
    x = s.x.clone().requires_grad_(True)
    with torch.enable_grad():
        out = layer(x, s.plan, s.cache)
    assert not out.requires_grad
    assert not any(t.requires_grad for t in cache_tensors(s.cache))


def test_compressor_fp32_weights_follow_weight_changes():
    """The compressor keeps fp32 copies of its projections between steps; replacing or editing a weight renews
    them (load_state_dict and in-place edits alike)."""
    import dsv4kv
    from dsv4kv.model.layer import init_random_weights

    g = dsv4kv.ModelGeometry.from_hf_config("tiny")
    layer = init_random_weights(dsv4kv.DSV4Attention(g, 1, dtype=torch.float32), seed=0)
    comp = layer.compressor
    x, positions = torch.randn(5, g.hidden_size), torch.arange(5)
    before = comp.rows(x, positions)[0]
    assert torch.equal(before, torch.nn.functional.linear(x, comp.kv_proj.weight))
    with torch.no_grad():
        comp.kv_proj.weight.mul_(2)
    assert torch.equal(comp.rows(x, positions)[0], 2 * before)
    layer.load_state_dict({k: v * 3 if k == "compressor.kv_proj.weight" else v
                           for k, v in layer.state_dict().items()})
    torch.testing.assert_close(comp.rows(x, positions)[0], 6 * before, rtol=1e-5, atol=1e-4)
