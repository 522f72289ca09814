"""What a new user met (issue 36 item 7), each answered clearly and truthfully: the demo's model is named apart from the
geometry presets, the demo explains its memory ratios and its agreement with transformers where it prints them, its
progress bar's count reaches its total, a device that cannot run is refused in one line, bad engine input and bad
formats say what was expected, and every CLI option has help. CPU only; the one model built is the demo's own."""

from __future__ import annotations

import argparse
import functools
import io

import pytest
import torch

from dsv4kv.cache.layout import IndexerFormat, KVFormat
from dsv4kv.cache.spec import CacheSpec
from dsv4kv.engine import Engine, EngineStats, SamplingParams
from dsv4kv.engine.reference import random_model, tiny_config
from dsv4kv.geometry import PRESETS, ModelGeometry
from dsv4kv.tools import demo
from dsv4kv.tools.cli import build_parser, main

VOCAB = 512  # tiny_config's


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@functools.lru_cache(maxsize=None)
def demo_cpu_model():
    return random_model(tiny_config(), seed=0)


def engine() -> Engine:
    return Engine.from_transformers(demo_cpu_model(), max_requests=2, max_tokens=512, page_tokens=128, step_tokens=64,
                                    kv_format="bf16", indexer_format="bf16")


def assert_untouched(e: Engine) -> None:
    """Nothing admitted, nothing held; the next request gets the first id."""
    assert not e.has_unfinished and e.cache.num_live_requests == 0 and e.cache.num_used_blocks == 0
    assert e.add_request([1, 2, 3], SamplingParams(max_new_tokens=1)) == 0


def rendered(result) -> list[str]:
    console_file = io.StringIO()
    from rich.console import Console

    demo.render(result, Console(file=console_file, width=1000))
    return console_file.getvalue().splitlines()


def demo_result(kv_format="fp8", indexer_format="mxfp4", memory=None, **fields):
    """A DemoResult as run_demo would fill it (the CPU workload's figures), without running the demo."""
    result = demo.DemoResult(demo.default_workload(torch.device("cpu")), "cpu", "float32", kv_format, indexer_format)
    result.stats = EngineStats(steps=61, decode_steps=46, prefill_tokens=2115, decode_tokens=184,
                               prefill_seconds=0.7, decode_seconds=0.7, tokens_in_prefill_steps=2145)
    result.requests = [(301, 24, 0.2, 0.02, 0)] * 8
    result.peak_tokens, result.peak_live, result.memory = 1178, 4, memory or {}
    result.agree, result.near_ties, result.compared = 168, 9, 192
    for name, value in fields.items():
        setattr(result, name, value)
    return result


# --- 1. "tiny" names the geometry preset; the demo's models are named apart -----------------------------------------
def test_plan_help_says_what_each_preset_is(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps
    for name in PRESETS:
        g = ModelGeometry.preset(name)
        assert f"{name} " in out and f"{g.num_layers} layers" in out
    assert "tiny a small test geometry: 4 layers, 1 window, 2 CSA ratio 4, 1 HCA ratio 16; 8 heads x 128" in out
    assert "demo-cpu and demo-gpu, which are none of these" in out


def test_demo_names_its_model_and_its_layer_kinds():
    workload = demo.default_workload(torch.device("cpu"))
    assert workload.model == "demo-cpu" and workload.model not in PRESETS
    config = tiny_config()
    line = demo.describe_model(workload.model, ModelGeometry.from_hf_config(config), config)
    assert line.startswith("demo-cpu: 3 layers (window, CSA ratio 4, HCA ratio 128), 8 heads x 128, window 16, ")
    lines = rendered(demo_result(model=line))
    assert lines[0] == f"dsv4kv demo, model {line}; random weights in float32 on cpu"
    with pytest.raises(ValueError, match="model: expected one of \\('demo-cpu', 'demo-gpu'\\), got 'mini'"):
        demo.demo_model("mini", "cpu")


# --- 2. a layer kind above a dense bf16 cache says why, under the table ---------------------------------------------
def test_memory_ratio_above_one_is_explained_under_the_table():
    memory = {"window": (1, 13_056, 301_568, 13_056), "CSA": (1, 202_752, 301_568, 111_360),
              "HCA": (1, 541_952, 301_568, 537_344)}  # the CPU demo's peak (4 live requests)
    lines = rendered(demo_result(memory=memory))
    table_end = max(i for i, line in enumerate(lines) if line.startswith("└"))
    note = lines[table_end + 1]
    assert note.startswith("  HCA ratio above 1: its fixed per-request state (window ring + fp32 compressor state, "
                           "131.19 KiB x 4 live requests = 524.75 KiB of 529.25 KiB) dominates at these short lengths")
    assert [line for line in lines if "ratio above 1" in line] == [note]  # CSA and window stay below 1: no note
    below = {kind: (n, held, held * 2, fixed) for kind, (n, held, _, fixed) in memory.items()}
    assert not any("ratio above 1" in line for line in rendered(demo_result(memory=below)))


# --- 3. the agreement line says which numerics ran, before its count ------------------------------------------------
def test_agreement_line_says_which_numerics_ran():
    line, = [line for line in rendered(demo_result()) if "168 of 192" in line]
    numerics = line.index("official numerics (fp8 cache entries, mxfp4 indexer keys, which transformers does not model")
    assert numerics < line.index("168 of 192") and "--kv-format bf16 --indexer-format bf16 is the exact mode" in line
    exact, = [line for line in rendered(demo_result("bf16", "bf16")) if "168 of 192" in line]
    assert "exact mode (bf16 cache entries and indexer keys): 168 of 192" in exact
    other, = [line for line in rendered(demo_result("fp8", "bf16")) if "168 of 192" in line]
    assert "quantized numerics (fp8 cache entries, bf16 indexer keys" in other


# --- 4. the progress bar's count reaches its total ------------------------------------------------------------------
def test_progress_count_reaches_its_total_and_memory_splits_the_fixed_bytes(monkeypatch):
    bars = []

    class Bar:
        def __init__(self, enabled):
            self.total, self.completed = None, []
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def add_task(self, description, total):
            self.total = total

        def update(self, task, completed, description):
            self.completed.append(completed)

    monkeypatch.setattr(demo, "_progress", Bar)
    workload = demo.Workload("demo-cpu", prompts=(70, 9, 41), new_tokens=3, arrival_every=2, step_tokens=64,
                             max_requests=2, page_tokens=128, max_seq_len=256)
    result = demo.run_demo(device="cpu", workload=workload, compare=False)
    bar, = bars
    assert bar.completed[-1] == bar.total == sum(r[1] for r in result.requests) == 9
    assert bar.completed == sorted(bar.completed)
    spec = CacheSpec(ModelGeometry.from_hf_config(tiny_config()), "fp8", "mxfp4", 128)
    hca = [s for s in spec.layers if s.layer.kind.short == "HCA"][0]
    assert result.memory["HCA"][3] == result.peak_live * hca.request_bytes and result.peak_live >= 1


# --- 5. a device that cannot run: one line on stderr, exit code 2 ---------------------------------------------------
def test_demo_refuses_cuda_without_cuda_in_one_line(no_cuda, capsys, monkeypatch):
    monkeypatch.setattr(demo, "run_demo", lambda **_: pytest.fail("nothing is built for a device that cannot run"))
    for device, message in (("cuda", "device 'cuda': no CUDA device is available here"),
                            ("cuda:1", "device 'cuda:1': no CUDA device is available here"),
                            ("gpu", "device: expected 'cpu' or 'cuda' (or 'cuda:<index>'), got 'gpu'"),
                            ("meta", "device: expected 'cpu' or 'cuda' (or 'cuda:<index>'), got 'meta'")):
        assert main(["demo", "--device", device, "--no-progress"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1
        assert captured.err.startswith(f"dsv4kv demo: {message}")


def test_bench_names_itself_once(no_cuda, capsys):
    assert main(["bench", "topk"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4kv bench: needs a CUDA GPU") and err.count("dsv4kv bench") == 1
    assert err.count("\n") == 1


# --- 6. engine input: what was expected, and nothing changes --------------------------------------------------------
def test_a_float_token_id_is_not_a_token_id():
    e = engine()
    for prompt, got in (([1, 2.0], "got 2.0 (a float) at 1"), ([True, 3], "got True (a bool) at 0"),
                        ([1.0, 2.0, 5], "got 1.0 (a float) at 0 (2 entries are not ints)")):
        with pytest.raises(ValueError) as error:
            e.add_request(prompt, SamplingParams(max_new_tokens=2))
        assert str(error.value) == f"prompt: token ids must be ints in the vocabulary [0, 512), {got}"
        with pytest.raises(ValueError, match="^prompts\\[1\\]: token ids must be ints"):
            e.generate([[1, 2], prompt])
    with pytest.raises(ValueError, match="2 token ids outside the vocabulary \\[0, 512\\), first 512 at 1"):
        e.add_request([1, 512, -1])  # ints outside the vocabulary: as before
    assert_untouched(e)


def test_a_dict_is_not_sampling_params():
    e = engine()
    bad = {"max_new_tokens": 3}
    for prompts in ([[1, 2]], [[1, 2], [3, 4]]):  # a dict of one key iterated as its keys, or counted as 1
        with pytest.raises(TypeError, match="^params: expected a SamplingParams \\(or a list of them\\), got dict$"):
            e.generate(prompts, bad)
    with pytest.raises(TypeError, match="^params: expected a SamplingParams \\(or a list of them\\), got str$"):
        e.generate([[1, 2]], "greedy")
    with pytest.raises(TypeError, match="^params\\[1\\]: expected a SamplingParams, got dict$"):
        e.generate([[1, 2], [3, 4]], [SamplingParams(), bad])
    with pytest.raises(TypeError, match="^params: expected a SamplingParams, got dict$"):
        e.add_request([1, 2], bad)
    assert_untouched(e)


def test_stop_token_ids_outside_the_vocabulary_are_refused():
    e = engine()
    with pytest.raises(ValueError, match="^params.stop_token_ids: 1 outside the vocabulary \\[0, 512\\), first 512$"):
        e.add_request([1, 2], SamplingParams(stop_token_ids=[7, VOCAB]))
    with pytest.raises(ValueError, match="^params\\[1\\].stop_token_ids: 2 outside the vocabulary \\[0, 512\\), "
                                         "first 600$"):
        e.generate([[1, 2], [3, 4]], [SamplingParams(), SamplingParams(stop_token_ids=(600, 1 << 40))])
    with pytest.raises(ValueError, match="stop_token_ids: expected int token ids >= 0 \\(a float or bool is not a "
                                         "token id\\), got \\(1, 2.0\\)"):
        SamplingParams(stop_token_ids=[1, 2.0])
    assert_untouched(e)
    rid = e.add_request([4, 5], SamplingParams(max_new_tokens=1, stop_token_ids=[VOCAB - 1]))  # the last id is fine
    assert rid == 1


# --- 7. a bad format lists the valid ones ---------------------------------------------------------------------------
def test_bad_formats_list_the_valid_ones():
    with pytest.raises(ValueError, match="^kv_format: expected one of 'fp8', 'bf16', got 'fp4'$"):
        KVFormat("fp4")
    with pytest.raises(ValueError, match="^indexer_format: expected one of 'mxfp4', 'fp8', 'bf16', got 'fp4'$"):
        IndexerFormat("fp4")
    geometry = ModelGeometry.preset("tiny")
    with pytest.raises(ValueError, match="kv_format: expected one of 'fp8', 'bf16', got 'fp4'"):
        CacheSpec(geometry, "fp4", "mxfp4")
    with pytest.raises(ValueError, match="indexer_format: expected one of 'mxfp4', 'fp8', 'bf16', got 'MXFP4'"):
        CacheSpec(geometry, "fp8", "MXFP4")
    assert KVFormat("bf16") is KVFormat.BF16 and IndexerFormat(IndexerFormat.FP8) is IndexerFormat.FP8


# --- 8. every option says what it is --------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["plan", "demo", "bench"])
def test_every_option_has_help(command, capsys):
    sub, = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser = sub.choices[command]
    bare = [a.dest for a in parser._actions if not a.help]
    assert bare == [], f"{command}: options without help: {bare}"
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for action in parser._actions:
        assert all(option in out for option in action.option_strings)


def test_plan_into_a_closed_pipe_stops_quietly():
    """`dsv4kv plan | head -1`: the reader leaves before the table is written; no traceback, a non-zero status."""
    import subprocess
    import sys

    reader = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE)
    reader.wait()  # gone: writing into its pipe raises BrokenPipeError
    plan = subprocess.run([sys.executable, "-m", "dsv4kv", "plan"], stdout=reader.stdin, stderr=subprocess.PIPE,
                          text=True, timeout=120)
    reader.stdin.close()
    assert plan.returncode == 1 and "Traceback" not in plan.stderr, plan.stderr
