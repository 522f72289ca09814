"""`dsv4kv bench` plumbing on the CPU (refusal of failed checks, derived rates, targets, JSON, plots, CLI), and
one real GPU run of a small workload where a GPU exists. Speed itself is measured by the bench, never here."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess

import pytest
import torch

from dsv4kv.tools.bench import Report, Result, bench_device, evaluate_targets, plot_report, run_bench
from dsv4kv.tools.bench.targets import core_target_us
from dsv4kv.tools.bench.picks import InputCheck, explain_rows, pick_gaps
from dsv4kv.tools.bench.timing import source_commit, source_digest
from dsv4kv.tools.bench.workloads import check_layer, core_bytes
from dsv4kv.tools.cli import main
from dsv4kv import CacheManager, ModelGeometry
from dsv4kv.cache.spec import CacheSpec
from dsv4kv.model.layer import DSV4Attention, init_random_weights
from dsv4kv.ops.topk.reference import topk_picks

TINY = ModelGeometry.preset("tiny")  # layer 1: CSA, m = 4, top-8 of a 4 x 64 indexer

META = {"gpu": "test GPU", "torch": "x", "triton": "y", "date": "2026-11-21T00:00:00+00:00", "commit": "abc",
        "copy_bandwidth_Bps": 4e12, "bf16_gemm_flops": 8e14}


def test_a_failed_check_refuses_the_figure():
    report = Report(meta=dict(META))
    good = report.add(Result("topk", "good", {"rows": 1, "cols": 262144}, 12.0, bytes=262144 * 4, check="equal"))
    bad = report.add(Result("topk", "bad", {"rows": 1, "cols": 4096}, 3.0, bytes=4096 * 4, check="sets DIFFER",
                            passed=False))
    assert bad.time_us is None and bad.refused == "correctness check failed: sets DIFFER"
    kept = Result("layer", "x", {}, 5.0, extra={"median_us": 5.0, "speedup": 9.0, "module": "m"}, passed=False)
    assert kept.extra == {"module": "m"}  # no timing survives a failed check
    assert good.time_us == 12.0 and good.refused is None
    rates = report.rates(good)
    assert rates["GBps"] == pytest.approx(262144 * 4 / 12e-6 / 1e9)
    assert rates["pct_bandwidth"] == pytest.approx(100 * 262144 * 4 / 12e-6 / 4e12)
    assert rates["floor_us"] == pytest.approx(262144 * 4 / 4e12 * 1e6)
    assert report.rates(bad) == {}
    table = report.table()
    assert "REFUSED" in table and "sets DIFFER" in table
    rows = report.to_json()["results"]
    assert rows[1]["time_us"] is None and "GBps" not in rows[1]


def test_targets_met_and_missed():
    """The targets from a run's results: met or missed, with the measured figure; V4-Pro's core targets are Flash's
    scaled by the bytes each core moves."""
    report = Report(meta=dict(META))
    report.add(Result("topk", "t", {"rows": 1, "cols": 262144, "k": 512}, 16.5, bytes=1 << 20))
    report.add(Result("topk", "t", {"rows": 1, "cols": 1 << 20, "k": 512}, 19.0, bytes=4 << 20))
    report.add(Result("topk", "t", {"rows": 64, "cols": 32768, "k": 512}, 12.0, bytes=8 << 20))
    report.add(Result("topk", "t", {"rows": 1, "cols": 262144, "k": 512}, 1.0, passed=False))  # refused: no target
    # a core row over FP8 indexer keys: the core targets name MXFP4 keys and must not take it
    fp8 = {"kind": "csa", "context": 131072, "batch": 64, "indexer_format": "fp8"}
    report.add(Result("decode", "core", {**fp8, "context": 1 << 20, "batch": 1}, 1.0, bytes=18_000_000,
                      extra={"stage": "core"}))
    report.add(Result("decode", "core", {"kind": "csa", "context": 1 << 20, "batch": 1}, 34.0, bytes=18_000_000,
                      extra={"stage": "core"}))
    report.add(Result("decode", "core", {"kind": "csa", "context": 131072, "batch": 64}, 150.0, bytes=170_000_000,
                      extra={"stage": "core"}))
    report.add(Result("decode", "core", {"kind": "csa", "context": 131072, "batch": 8}, 50.0, bytes=20_000_000,
                      extra={"stage": "core"}))  # no core target at batch 8
    report.add(Result("decode", "core", {"model": "pro", "kind": "hca", "context": 131072, "batch": 64}, 70.0,
                      bytes=60_000_000, extra={"stage": "core"}))
    report.add(Result("decode", "idx", {"kind": "csa", "context": 131072, "batch": 64}, 80.0, bytes=142_000_000,
                      extra={"stage": "indexer scores"}))
    report.add(Result("decode", "idx", {"kind": "csa", "context": 1 << 20, "batch": 1}, 10.0, bytes=17_800_000,
                      extra={"stage": "indexer scores"}))
    report.add(Result("decode", "idx", {"kind": "csa", "context": 16384, "batch": 1}, 5.0, bytes=278_528,
                      extra={"stage": "indexer scores"}))  # no target at 16K, batch 1
    report.add(Result("decode", "idx", fp8, 100.0, bytes=276_000_000, extra={"stage": "indexer scores"}))
    report.add(Result("flashmla", "f", {"model": "pro", "kind": "CSA", "batch": 64, "context": 65536}, 59.0,
                      extra={"ratio": 59.0 / 60.0, "flashmla_us": 60.0}))
    report.add(Result("flashmla", "f", {"model": "flash", "kind": "CSA", "batch": 128, "context": 65536}, 74.0,
                      extra={"ratio": 74.0 / 54.0, "flashmla_us": 54.0}))
    report.add(Result("layer", "transformers csa", {"kind": "csa", "context": 16384, "batch": 1}, 2000.0))
    report.add(Result("layer", "dsv4kv csa", {"kind": "csa", "context": 16384, "batch": 1, "mode": "official"}, 80.0))
    verify = {"kind": "csa", "context": 131072, "verify_rows": 4}
    for batch, ratio in ((4, 1.3), (16, 1.6), (64, 1.0)):  # no target past batch 16
        report.add(Result("spec", "v", {**verify, "batch": batch, "rows": 4}, 100.0 * ratio,
                          extra={"verify_over_decode": ratio}))
        report.add(Result("spec", "d", {**verify, "batch": batch, "rows": 1}, 100.0, extra={"verify_over_decode": ratio}))
    report.add(Result("spec", "replay 3/3, batch 1", {"drafter": "replay"}, 900.0,
                      extra={"acceptance_length": 4.0, "speedup": 1.3, "verify_speedup": 2.6}))
    report.add(Result("spec", "ngram, batch 1", {"drafter": "ngram"}, 900.0, extra={"acceptance_length": 1.2,
                                                                                    "speedup": 0.9}))
    targets = {t["target"]: t for t in evaluate_targets(report)}
    assert targets["CSA core verify (4 tokens a request) / decode, batch 4, 128K <= 1.4"]["met"]
    assert not targets["CSA core verify (4 tokens a request) / decode, batch 16, 128K <= 1.4"]["met"]
    assert not any("batch 64, 128K <= 1.4" in t for t in targets)
    replay = targets["replay 3/3, batch 1: decode tokens/s of its verify steps >= 2x plain at acceptance length 4.00"]
    assert replay["met"] and replay["measured"] == "2.60x (whole run 1.30x)"
    assert not any(t.startswith("ngram") for t in targets)  # accepted at 1.2 tokens a step: no target
    assert not targets["top-512 of 262,144 candidates x 1 row <= 12 us"]["met"]
    assert targets["top-512 of 1,048,576 candidates x 1 row <= 20 us"]["met"]
    assert targets["top-512 of 32,768 candidates x 64 rows <= 20 us"]["met"]
    assert sum(t.startswith("top-512 of 262,144") for t in targets) == 1  # the refused row's figure is gone
    assert targets["V4-Flash CSA core, batch 1, 1024K <= 35 us"]["met"]
    assert targets["V4-Flash CSA core, batch 1, 1024K <= 35 us"]["measured"].startswith("34.0 us (0.97x the target")
    floor = 170_000_000 / 4e12 * 1e6  # 42.5 us: 150 us is 3.5x
    batch64 = targets["V4-Flash CSA core, batch 64, 128K <= 130 us"]
    assert not batch64["met"] and f"{150 / floor:.1f}x the bytes floor" in batch64["measured"]
    assert not any("batch 8, 128K <=" in t for t in targets)
    pro_bound = core_target_us("pro", "hca", 131072, 64)
    g = {m: ModelGeometry.from_hf_config(m) for m in ("flash", "pro")}
    hca = {m: sum(core_bytes(g[m], CacheSpec(g[m]), next(i for i, layer in enumerate(g[m].layers)
                                                          if layer.kind.short == "HCA"), 131072, 64).values())
           for m in g}
    assert pro_bound == pytest.approx(60.0 * hca["pro"] / hca["flash"]) and pro_bound > 60.0  # 128 heads' q and out
    pro = targets[f"V4-Pro HCA core, batch 64, 128K <= {pro_bound:.0f} us (Flash's, scaled by bytes)"]
    assert pro["met"] == (70.0 <= pro_bound)
    indexer = targets["indexer scores, batch 64, 128K context >= 60% of copy bandwidth"]
    assert indexer["measured"] == f"{100 * 142e6 / 80e-6 / 4e12:.0f}%" and not indexer["met"]  # 44%
    assert not targets["indexer scores, batch 1, 1024K context >= 50% of copy bandwidth"]["met"]  # 44.5%
    fp8_keys = targets["indexer scores (fp8 keys), batch 64, 128K context >= 60% of copy bandwidth"]
    assert fp8_keys["measured"] == "69%" and fp8_keys["met"]  # 276 MB in 100 us at 4 TB/s
    assert not any("16K context" in t for t in targets)
    assert targets["V4-Pro CSA attention, batch 64, 64K: dsv4kv / FlashMLA <= 1"]["met"]
    flash128 = targets["V4-Flash CSA attention, batch 128, 64K: dsv4kv / FlashMLA <= 1"]
    assert not flash128["met"] and flash128["measured"] == "1.37 (74.0 vs 54.0 us)"
    assert targets["csa layer decode, batch 1, 16K: >= 20x transformers"]["met"]  # 25x


def test_json_round_trip_and_plots(tmp_path):
    report = Report(meta=dict(META))
    for context in (16384, 131072, 1 << 20):
        report.add(Result("decode", "core", {"kind": "csa", "context": context, "batch": 1}, 10.0 + context / 1e4,
                          bytes=68 * context // 4, extra={"stage": "core"}))
    path = tmp_path / "run.json"
    report.save(str(path))
    data = json.loads(path.read_text())
    assert data["meta"]["gpu"] == "test GPU" and len(data["results"]) == 3
    assert data["results"][0]["floor_us"] == pytest.approx(68 * 16384 // 4 / 4e12 * 1e6)
    pytest.importorskip("matplotlib")
    written = plot_report(data, str(tmp_path))
    # batch-1 rows only: the context plot; no batch series, so no (empty) batch plot
    assert [p.split("/")[-1] for p in written] == ["decode-vs-context.png"]
    assert (tmp_path / "decode-vs-context.png").read_bytes()[:4] == b"\x89PNG"


def test_core_bytes_model():
    """The bytes a CSA decode step must read: every visible indexer key, the picked entries and the window."""
    g = ModelGeometry.from_hf_config("flash")
    spec = CacheSpec(g)
    csa = next(i for i, layer in enumerate(g.layers) if layer.kind.short == "CSA")
    parts = core_bytes(g, spec, csa, 1 << 20, 2)
    assert parts["indexer keys"] == 2 * (1 << 18) * 68
    assert parts["picked entries"] == 2 * 512 * 584
    assert parts["window keys"] == 2 * 128 * 584
    assert "compressor state" in parts  # 2^20 is a multiple of 4: the step completes an entry
    assert "compressor state" not in core_bytes(g, spec, csa, (1 << 20) - 1, 1)
    hca = next(i for i, layer in enumerate(g.layers) if layer.kind.short == "HCA")
    state = core_bytes(g, spec, hca, 1 << 20, 1)["compressor state"]  # all 128 rows of kv and logits, fp32
    assert state == 2 * 128 * 512 * 4 + 584


def test_every_step_kernel_has_a_stage():
    """The decode bench names each kernel of a profiled step by its stage: every Triton kernel of the package maps to
    one (a new kernel left out would be counted as "torch kernels" and its stage reported short)."""
    import importlib
    import pkgutil

    import dsv4kv.ops
    from dsv4kv.tools.bench.common import kernel_stage as _stage

    kernels = {name for info in pkgutil.walk_packages(dsv4kv.ops.__path__, "dsv4kv.ops.")
               for name, value in vars(importlib.import_module(info.name)).items()
               if hasattr(value, "arg_names") and name.endswith("_kernel")}  # jit functions (or interpreted)
    assert {"_pool_kernel", "_compress_kernel", "_topk_kernel", "_indexer_scores_kernel"} <= kernels
    assert {name for name in kernels if _stage(name) == "torch kernels"} == set()
    # the first key found names the stage: a key inside another kernel's name must not take it
    assert _stage("_compressor_rows_kernel") == "compressor rows" and _stage("_compress_kernel") == "compress-and-insert"
    assert _stage("_rms_norm_kernel") == "projection norms"


def test_cli_rejects_unknown_workloads_and_needs_a_gpu(capsys):
    assert main(["bench", "nonsense"]) == 2
    assert "unknown workloads ['nonsense']" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "topk"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_device_gets_an_index(monkeypatch):
    """`--device cuda` (the default) means the current device: torch.cuda.set_device rejects a device without an
    index ("Expected a torch.device with a specified index"), so the bench resolves it first."""
    if not torch.cuda.is_available():  # a pretend machine with 2 GPUs, the second current
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    current, count = torch.cuda.current_device(), torch.cuda.device_count()
    assert bench_device("cuda") == torch.device("cuda", current)
    assert bench_device(torch.device("cuda")) == torch.device("cuda", current)
    assert bench_device("cuda:0") == torch.device("cuda", 0)
    assert bench_device(torch.device("cuda", count - 1)).index == count - 1
    for bad, message in (("cpu", "needs a CUDA GPU"), (f"cuda:{count}", f"cuda:{count} does not exist"),
                         ("gpu", "expected a CUDA device such as 'cuda'")):
        with pytest.raises(ValueError, match=message):
            bench_device(bad)


def _git(cwd, *args):
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True,
                          env=env).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_commit_stamp_trusts_only_the_projects_own_checkout(tmp_path, monkeypatch):
    """A copy of the project without .git inside another repository is stamped "unknown", not with that
    repository's commit; the project's own checkout is stamped with its commit, "+dirty" once a tracked file
    differs from it; DSV4KV_COMMIT overrides both."""
    monkeypatch.delenv("DSV4KV_COMMIT", raising=False)
    outer = tmp_path / "outer"
    copy = outer / "vendor" / "dsv4kv"
    (copy / "src" / "dsv4kv" / "bench").mkdir(parents=True)
    (copy / "pyproject.toml").write_text("[project]\nname = 'dsv4kv'\n")
    _git(outer, "init", "-q")
    _git(outer, "add", "-A")
    _git(outer, "commit", "-q", "-m", "outer")
    assert source_commit(str(copy)) == "unknown"
    _git(copy, "init", "-q")  # the copy becomes a checkout of its own
    _git(copy, "add", "-A")
    _git(copy, "commit", "-q", "-m", "own")
    assert source_commit(str(copy)) == _git(copy, "rev-parse", "--short", "HEAD") != _git(outer, "rev-parse", "--short",
                                                                                          "HEAD")
    (copy / "pyproject.toml").write_text("[project]\nname = 'dsv4kv-edited'\n")  # what runs is not HEAD
    assert source_commit(str(copy)) == _git(copy, "rev-parse", "--short", "HEAD") + "+dirty"
    assert source_commit(str(tmp_path / "nowhere")) == "unknown"
    monkeypatch.setenv("DSV4KV_COMMIT", "abc1234")
    assert source_commit(str(copy)) == "abc1234"


def test_source_digest_names_the_code_not_its_place(tmp_path):
    """The sources' digest is the package's own (the installed dsv4kv's), the same for a copy elsewhere, and changes
    with one byte of one file, with a renamed file and with a new one; other files do not count."""
    import dsv4kv

    package = os.path.dirname(os.path.abspath(dsv4kv.__file__))
    assert source_digest() == source_digest(package) and len(source_digest()) == 16
    copy = tmp_path / "dsv4kv"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "notes.txt").write_text("not a source")
    assert source_digest(str(copy)) == source_digest(package)
    target = copy / "ops" / "topk" / "kernel.py"
    text = target.read_bytes()
    target.write_bytes(text.replace(b"MAX_K = 2048", b"MAX_K = 2049"))
    assert source_digest(str(copy)) != source_digest(package)
    target.write_bytes(text)
    assert source_digest(str(copy)) == source_digest(package)
    target.rename(copy / "ops" / "topk" / "kernel2.py")
    assert source_digest(str(copy)) != source_digest(package)
    (copy / "ops" / "topk" / "kernel2.py").rename(target)
    (copy / "extra.py").write_text("")
    assert source_digest(str(copy)) != source_digest(package)


def test_l2_flush_reads_and_writes_nothing(monkeypatch):
    """time_cuda's L2 flush reads its whole buffer (into one scalar) and writes none of it: a written flush would
    leave dirty lines for the timed kernels to write back (docs/device/2026-11-27-l2-flush-h100.log)."""
    from dsv4kv.tools.bench import timing
    monkeypatch.setattr(timing, "_FLUSH_BYTES", 8 * 1001)
    monkeypatch.setattr(timing, "_flush_buffers", {})
    device = torch.device("cpu")
    timing._flush_l2(device)
    flush, total = timing._flush_buffers[device]
    pattern = torch.arange(1001, dtype=torch.int64) * 7 - 3
    flush.copy_(pattern)
    timing._flush_l2(device)
    assert torch.equal(flush, pattern) and total.item() == pattern.sum().item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_topk_workload_runs_and_checks(tmp_path):
    """The default device "cuda" (no index) through the whole bench path."""
    report = run_bench(["topk"], out_dir=str(tmp_path), name="run", quick=True, runs=5, log=lambda line: None)
    rows = [r for r in report.results if r.workload == "topk"]
    assert rows and all(r.time_us and r.time_us > 0 and not r.refused for r in rows)
    assert report.meta["copy_bandwidth_Bps"] > 1e12
    assert json.loads((tmp_path / "run.json").read_text())["results"] and (tmp_path / "run.md").exists()
    assert not (tmp_path / "decode-vs-context.png").exists()  # no decode rows: no plot


# --- pick flips: what may explain a CSA row beyond the tolerance (bench/picks.py) -------------------------------
def _rows_with_a_tie(n=6, entries=40, k=8, seed=0):
    """Scores [n, entries] (the last 5 entries invisible in row 1), and reference picks = each row's top-k."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, entries, generator=g)
    scores[1, -5:] = float("-inf")
    return scores, topk_picks(scores, k)


def _swap_kth(picks, scores, row, replacement):
    """picks with row's k-th best pick replaced by `replacement`."""
    picks = picks.clone()
    kth = scores[row].sort(descending=True).indices[picks.shape[1] - 1]
    picks[row][picks[row] == kth] = replacement
    return picks


def test_pick_gaps():
    scores, ref = _rows_with_a_tie()
    assert torch.equal(pick_gaps(ref, scores), torch.zeros(6))
    order = scores[0].sort(descending=True).indices
    scores[0, order[8]] = scores[0, order[7]] - 1e-6 * scores[0].abs().max()  # the (k+1)-th a hair below the k-th
    near = _swap_kth(ref, scores, 0, order[8])
    assert 0 < pick_gaps(near, scores)[0] <= 2e-6
    far = _swap_kth(ref, scores, 2, scores[2].argmin())
    assert pick_gaps(far, scores)[2] > 0.1
    invisible = _swap_kth(ref, scores, 1, 39)  # an entry past the row's visible count
    repeated = ref.clone()
    repeated[3, 0] = repeated[3, 1]
    short = ref.clone()
    short[4, -1] = -1
    gaps = pick_gaps(torch.stack((invisible[1], repeated[3], short[4])), scores[[1, 3, 4]])
    assert torch.isinf(gaps).all()
    few = torch.full((2, 3), float("-inf"))
    few[0, :2] = torch.tensor([1.0, 2.0])
    assert torch.equal(pick_gaps(torch.tensor([[1, 0, -1], [-1, -1, -1]]), few), torch.zeros(2))  # k > candidates


def test_a_near_tie_flip_passes_and_real_errors_are_refused():
    """The bench's CSA row check: a row beyond the tolerance passes only when its picks differ by a near tie."""
    scores, ref = _rows_with_a_tie()
    order = scores[0].sort(descending=True).indices
    scores[0, order[8]] = scores[0, order[7]] - 1e-6 * scores[0].abs().max()
    flipped = _swap_kth(ref, scores, 0, order[8])
    errors = torch.tensor([0.12, 0.004, 0.006, 0.003, 0.002, 0.001])
    verdict = explain_rows(errors, flipped, ref, scores, row_tol=0.02, tie_tol=1e-4)
    assert verdict.passed and (verdict.beyond, verdict.near_ties, verdict.differing) == (1, 1, 1)
    assert "1 near-tie pick flips" in verdict.text("t") and "5/6 rows within 0.02" in verdict.text("t")
    # the same picks, yet beyond the tolerance: the error is elsewhere (attention, the entries)
    same = explain_rows(errors, ref, ref, scores, row_tol=0.02, tie_tol=1e-4)
    assert not same.passed and same.same_picks == 1 and "UNEXPLAINED: 1 with the same picks" in same.text("t")
    # a pick far from the top-k (a low-scoring entry) is a real error
    wrong = _swap_kth(ref, scores, 0, scores[0].argmin())
    far = explain_rows(errors, wrong, ref, scores, row_tol=0.02, tie_tol=1e-4)
    assert not far.passed and far.far_picks == 1
    # kernels vs reference: a pick far by the reference's scores but a near tie by the reference's scores of the
    # kernels' own inputs (a key this step encoded one grid step apart) is a flip from the inputs
    inputs = scores.clone()
    inputs[0, scores[0].argmin()] = scores[0, order[7]] + 1e-7
    moved = explain_rows(errors, wrong, ref, scores, row_tol=0.02, tie_tol=1e-4, input_scores=inputs)
    assert moved.passed and moved.input_flips == 1 and moved.near_ties == 0
    assert not explain_rows(errors, wrong, ref, scores, row_tol=0.02, tie_tol=1e-4, input_scores=scores).passed
    # a NaN row is never explained; rows of a layer without top-k must all be within the tolerance
    nan = errors.clone()
    nan[3] = float("nan")
    assert not explain_rows(nan, flipped, ref, scores, row_tol=0.02, tie_tol=1e-4).passed
    assert not explain_rows(errors, None, None, None, row_tol=0.02, tie_tol=1e-4).passed
    assert explain_rows(errors.clamp(max=0.01), None, None, None, row_tol=0.02, tie_tol=1e-4).passed
    # flips within the tolerance need no explanation but are counted
    quiet = explain_rows(errors.clamp(max=0.01), wrong, ref, scores, row_tol=0.02, tie_tol=1e-4)
    assert quiet.passed and quiet.differing == 1 and quiet.beyond == 0


def test_input_check_gates_keys_and_query():
    assert InputCheck(6, 680, 1.0).passed
    assert not InputCheck(7, 680, 1.0).passed  # > 1% of the new key bytes differ
    assert InputCheck(0, 680, 0.9999).passed  # the q_a norm's rare one-unit roundings move ~1e-5 of the query
    assert not InputCheck(0, 680, 0.998).passed  # more than 0.1% of the query values differ
    assert not InputCheck(0, 680, 0.9999, 0.98).passed  # a row with more than 1% of its values differing
    assert not InputCheck(0, 680, 1.0, query_mismatches=1).passed  # one scored value off the reference of its input
    assert not InputCheck(0, 680, 1.0, input_gap=0.05).passed  # an input row or head off by its own size
    assert InputCheck(0, 680, 1.0, input_gap=2.0 ** -7).passed  # a bf16 unit or two of the head's largest
    # FP8 keys: the two paths' quantized queries are reported, not gated; the scored query and its inputs still are
    assert InputCheck(0, 680, 0.998, 0.96, fp8_keys=True).passed
    assert not InputCheck(0, 680, 0.998, 0.96, query_mismatches=1, fp8_keys=True).passed
    assert not InputCheck(0, 680, 1.0, input_gap=0.05, fp8_keys=True).passed


def _tiny_csa_step(seed=0, indexer_format="mxfp4"):
    """A tiny CSA layer with two requests of history (reference path) and a mixed next step."""
    g = torch.Generator().manual_seed(seed)
    # the kernels run compiled where a GPU exists, under the interpreter otherwise
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    layer = init_random_weights(DSV4Attention(TINY, 1, device=device), seed)
    cache = CacheManager(TINY, max_requests=2, max_tokens=400, page_tokens=128, device=device,
                         indexer_format=indexer_format)
    a, b = cache.admit(), cache.admit()
    x = torch.randn(159, TINY.hidden_size, generator=g).bfloat16().to(device)
    layer.backend = "torch"
    with torch.no_grad():
        layer(x[:100], cache.plan_step([(a, 100)]), cache)
        layer(x[100:150], cache.plan_step([(b, 50)]), cache)
    return layer, cache, x[150:], cache.plan_step([(a, 5), (b, 4)])


def test_check_layer_captures_both_paths_and_refuses_real_errors(monkeypatch):
    """check_layer on a tiny CSA layer (kernels under the interpreter on a CPU): both paths' picks are captured and
    agree; a wrong attention output or wrong picks are refused."""
    import dsv4kv.ops.kernels as kernels

    layer, cache, x, plan = _tiny_csa_step()
    text, passed = check_layer(layer, x, plan, cache, "tiny")
    assert passed, text
    assert "9/9 rows within" in text and "0 of 68 new key bytes differ" in text
    assert "; 0 scored query and weight values differ" in text and "across the paths 1.00000" in text
    original = kernels.sparse_attention_paged
    monkeypatch.setattr(kernels, "sparse_attention_paged", lambda *a, **kw: original(*a, **kw) * 1.25)
    text, passed = check_layer(layer, x, plan, cache, "tiny")
    assert not passed and "with the same picks" in text
    monkeypatch.setattr(kernels, "sparse_attention_paged", original)
    select = kernels.topk_indices

    def worst_picks(scores, lengths, k, **kw):  # the k lowest-scoring visible entries instead of the highest
        picks = select(scores, lengths, k, **kw)
        low = topk_picks(torch.where(scores > float("-inf"), -scores, float("-inf")), k)
        return torch.where(picks >= 0, low.to(picks.dtype), picks)

    monkeypatch.setattr(kernels, "topk_indices", worst_picks)
    text, passed = check_layer(layer, x, plan, cache, "tiny")
    assert not passed and "with a far pick" in text and "0 with a far pick" not in text


@pytest.mark.parametrize("indexer_format", ["mxfp4", "fp8"])
def test_check_layer_gates_the_scored_query_and_its_inputs(indexer_format, monkeypatch):
    """The query and head weights the scores kernel read must be the reference's on the fused kernel's own inputs,
    bit for bit, and those inputs near the reference's (`InputCheck`); for FP8 keys the two paths' quantized queries
    are reported, not gated, so these gates alone must refuse each corruption below."""
    import dsv4kv.ops.kernels as kernels

    layer, cache, x, plan = _tiny_csa_step(seed=1, indexer_format=indexer_format)
    text, passed = check_layer(layer, x, plan, cache, "tiny")
    assert passed, text
    assert "; 0 scored query and weight values differ" in text
    assert ("not gated for FP8" in text) == (indexer_format == "fp8")
    if indexer_format == "fp8":
        assert "indexer inputs: 0 of 136 new key bytes differ" in text  # two entries of 68 B (TINY: D = 64)
    query = kernels.indexer_query_and_weights

    def doubled_head(*args, **kw):  # head 1 of the query the scores read, doubled
        out = query(*args, **kw)
        out[0][:, 1] *= 2
        return out

    def rolled_buffer(*args, **kw):  # a right query returned, the buffer the scores read holds its heads rolled
        out = query(*args, **kw)
        right = out[0].clone()
        out[0].copy_(out[0].roll(1, dims=1))
        return right, out[1]

    def wrong_weights(*args, **kw):
        out = query(*args, **kw)
        out[1].copy_(out[1].flip(-1) * 3)
        return out

    for corrupt in (doubled_head, rolled_buffer, wrong_weights):
        monkeypatch.setattr(kernels, "indexer_query_and_weights", corrupt)
        text, passed = check_layer(layer, x, plan, cache, "tiny")
        assert not passed and "; 0 scored query and weight values differ" not in text, (corrupt.__name__, text)
    monkeypatch.setattr(kernels, "indexer_query_and_weights", query)
    project = layer.project

    def wrong_input(*args, **kw):  # the kernel path's indexer query input: head 1 doubled before the fused kernel
        p = project(*args, **kw)
        p.index_q[:, 1] *= 2
        return p

    monkeypatch.setattr(layer, "project", wrong_input)
    text, passed = check_layer(layer, x, plan, cache, "tiny")
    assert not passed and "; 0 scored query and weight values differ" in text, text  # exact on a wrong input
    gap = float(text.split("those inputs within ")[1].split(" ")[0])
    assert gap > 0.1, text


def test_transformers_indexer_hooks_give_its_last_row():
    """The layer workload's hooks on transformers' CSA indexer: the last row's picks are a top set of its scores."""
    from importlib import resources

    pytest.importorskip("transformers")
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4RotaryEmbedding

    from dsv4kv.tools.bench.layer import _hook_indexer

    config = DeepseekV4Config(**json.loads(resources.files("dsv4kv.presets").joinpath("tiny.json").read_text()))
    config._attn_implementation = "eager"
    hf = init_random_weights(DeepseekV4Attention(config, 1).eval(), 0)
    seen = _hook_indexer(hf)
    length = 61
    x = torch.randn(1, length, config.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(length)[None]
    rotary = DeepseekV4RotaryEmbedding(config)
    cos_sin = {kind: rotary(x, positions, layer_type=kind) for kind in ("main", "compress")}
    i = torch.arange(length)
    allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < config.sliding_window)
    with torch.no_grad():
        hf(x, cos_sin, positions, torch.where(allowed, 0.0, float("-inf"))[None, None])
    visible = length // 4
    assert seen["scores"].shape == (visible,) and seen["picks"].shape == (min(config.index_topk, visible),)
    picks = torch.nn.functional.pad(seen["picks"][None], (0, config.index_topk - seen["picks"].shape[0]), value=-1)
    assert pick_gaps(picks, seen["scores"][None]).item() == 0
    for handle in seen["handles"]:
        handle.remove()


def chat_on_cpu(monkeypatch, sizes) -> Report:
    """The chat workload at `sizes` on the CPU (the tiny model in fp32, 128-token blocks)."""
    from dsv4kv.tools.bench import serving as workloads

    monkeypatch.setattr(workloads, "CHAT_QUICK", sizes)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from threads on a shared host
    try:
        report = Report(meta=dict(META))
        workloads.chat(workloads.Context(device=torch.device("cpu"), report=report, quick=True, log=lambda _: None))
    finally:
        torch.set_num_threads(threads)
    return report


def test_chat_workload_serves_with_caching_off_and_on(monkeypatch):
    """4 requests sharing a 256-token prompt (+ 32 tokens each): with caching on, the first computes the shared
    blocks in the first step and the other three hit them; the greedy tokens are those of caching off."""
    from dsv4kv.tools.bench.workloads import ChatSizes

    report = chat_on_cpu(monkeypatch, ChatSizes(shared=256, suffix=32, requests=4, new_tokens=6))
    off, on = report.results
    assert [r.params["prefix_caching"] for r in (off, on)] == [False, True]
    assert off.passed and on.passed and on.check.endswith("4 of 4 requests")
    assert (off.extra["cached_tokens"], off.extra["hit_rate"], off.extra["prefill_tokens"]) == (0, 0.0, 4 * 288)
    assert (on.extra["cached_tokens"], on.extra["prefix_hits"]) == (3 * 256, 3)
    assert on.extra["hit_rate"] == pytest.approx(3 * 256 / (4 * 288))
    assert on.extra["prefill_tokens"] == 4 * 288 - 3 * 256
    for r in (off, on):
        assert r.extra["output_tokens"] == 24 and r.time_us > 0
        assert 0 < r.extra["ttft_p50_ms"] <= r.extra["ttft_p90_ms"] and r.extra["tokens_per_s"] > 0
    assert "chat" in report.table()


def tamper_caching_on(monkeypatch, change) -> None:
    """Engine.generate with prefix caching on returns `change(outputs)` instead of its outputs (the timed run only:
    the one asking for logprobs)."""
    from dsv4kv.engine import Engine

    generate = Engine.generate

    def tampered(self, prompts, params=None):
        outputs = generate(self, prompts, params)
        return change(outputs) if self.prefix_caching and getattr(params, "logprobs", 0) else outputs

    monkeypatch.setattr(Engine, "generate", tampered)


def excursion(out, k: int):
    """`out` with another token at generated position k, put on top of its own logprobs there (0.1 above the old
    top, the old list after it): a consistent one-step excursion; everything before k unchanged."""
    top = out.logprobs[k]
    token = next(t for t in range(512) if t not in dict(top))  # not among its 8 best: far from a near tie
    value = top[0][1] + 0.1
    return dataclasses.replace(
        out, token_ids=out.token_ids[:k] + (token,) + out.token_ids[k + 1:],
        logprobs=out.logprobs[:k] + (((token, value),) + top[:-1],) + out.logprobs[k + 1:],
        token_logprobs=out.token_logprobs[:k] + (value,) + out.token_logprobs[k + 1:])


def test_chat_workload_refuses_when_caching_changes_a_token(monkeypatch):
    """The caching-on run's last request gets another last token, its logprobs kept (as if the output path had
    changed it): that token is not the argmax of its own logprobs, (b)."""
    from dsv4kv.tools.bench.workloads import ChatSizes

    def change(outputs):
        last = outputs[-1]
        outputs[-1] = dataclasses.replace(last, token_ids=last.token_ids[:-1] + ((last.token_ids[-1] + 1) % 512,))
        return outputs

    tamper_caching_on(monkeypatch, change)
    report = chat_on_cpu(monkeypatch, ChatSizes(shared=128, suffix=16, requests=2, new_tokens=2))
    assert all(r.refused and r.time_us is None and "ttft_p50_ms" not in r.extra for r in report.results)
    refused = report.results[0].refused
    assert "equal caching off in 1 of 2 requests; the 1 fork: 0 near ties by the fp32 oracle" in refused
    assert "1 refused; worst" in refused and "refused: request 1: (b) caching on's token" in refused
    assert "at generated token 1 is not its own argmax: its top there is token " in refused
    assert "is not among its top 8, its reported logprob" in refused
    assert "(a)" not in refused and "caching off's token" not in refused


def test_chat_workload_refuses_logprobs_that_move_before_the_fork(monkeypatch):
    """The caching-on run's last request with its logprobs before the fork shifted by 1.0 (as a wrong hit would
    shift them from the first generated token on) and a consistent excursion at its last token: (b) and (c) hold,
    (a) refuses."""
    from dsv4kv.tools.bench.workloads import ChatSizes

    def change(outputs):
        last, k = outputs[-1], len(outputs[-1].token_ids) - 1
        last = excursion(last, k)
        shifted = tuple(tuple((i, v + 1.0) for i, v in top) for top in last.logprobs[:k])
        outputs[-1] = dataclasses.replace(last, logprobs=shifted + last.logprobs[k:],
                                          token_logprobs=tuple(v + 1.0 for v in last.token_logprobs[:k])
                                          + last.token_logprobs[k:])
        return outputs

    tamper_caching_on(monkeypatch, change)
    report = chat_on_cpu(monkeypatch, ChatSizes(shared=128, suffix=16, requests=2, new_tokens=3))
    assert all(r.refused and r.time_us is None for r in report.results)
    refused = report.results[0].refused
    assert "worst before-fork difference 1.000 (tolerance 0.25 at three quarters of the tokens before a fork)" in refused
    assert ("refused: request 1: (a) before the fork the runs' top logprobs differ by more than 0.25 at 2 of 2 "
            "generated tokens (a quarter allowed), by up to 1.000 at generated token 0; (c) the fork at generated "
            "token 2 is neither a near tie") in refused
    assert ("nor a one-step excursion (teacher-forced, the hit path and a cold engine within 0.000 there, but the runs "
            "disagree before it; tolerance 0.25)") in refused and "(b)" not in refused


def test_chat_workload_passes_a_one_step_excursion(monkeypatch):
    """In fp32 on a CPU the runs agree, so an excursion is simulated: the caching-on run's first request takes another
    token at generated token 1, on top of its own logprobs there, everything before unchanged. Not a near tie by the
    oracle, but the runs agree before it and, teacher-forced, the hit path and a cold engine agree there: it passes."""
    from dsv4kv.tools.bench.workloads import ChatSizes

    def change(outputs):
        outputs[0] = excursion(outputs[0], 1)
        return outputs

    tamper_caching_on(monkeypatch, change)
    report = chat_on_cpu(monkeypatch, ChatSizes(shared=128, suffix=16, requests=2, new_tokens=3))
    off, on = report.results
    assert off.passed and on.passed and not on.refused, on.check
    assert ("equal caching off in 1 of 2 requests; the 1 fork: 0 near ties by the fp32 oracle, 1 one-step excursion "
            "(teacher-forced, the hit path and a cold engine within 0.0") in on.check
    assert "before it the runs apart at 0 of 1 tokens)" in on.check
    assert on.check.endswith("worst before-fork difference 0.000 (tolerance 0.25 at three quarters of the tokens "
                             "before a fork)")


def test_spec_workload_runs_on_the_cpu():
    """`bench spec` at its CPU sizes (the tiny geometry's CSA layer by the reference, the tiny model): a verify and a
    decode result per batch, the MTP drafter reported as not measured, and the engine runs (plain, n-gram, replay)
    with the replay drafter's acceptance length above 1 and every run's greedy tokens equal to plain decoding's."""
    from dsv4kv.tools.bench import spec as workloads
    from dsv4kv.tools.bench.common import Context

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from threads on a shared host
    try:
        report = Report(meta=dict(META))
        workloads.spec(Context(device=torch.device("cpu"), report=report, quick=True, log=lambda _: None))
    finally:
        torch.set_num_threads(threads)
    cores = [r for r in report.results if "core" in r.name]
    assert [r.params["rows"] for r in cores] == [4, 1, 4, 1] and all(r.time_us > 0 for r in cores)
    assert cores[0].extra["verify_over_decode"] == pytest.approx(cores[0].time_us / cores[1].time_us)
    mtp = next(r for r in report.results if r.params.get("drafter") == "mtp")
    assert mtp.time_us is None and "no MTP layer" in mtp.check
    runs = {r.params["label"]: r for r in report.results if "label" in r.params}
    assert set(runs) == {"plain", "ngram", "replay 1/2 correct"} and all(r.passed for r in runs.values())
    assert all(r.check.startswith("greedy tokens equal plain decoding's in 2 of 2") for label, r in runs.items()
               if label != "plain")
    replay = runs["replay 1/2 correct"].extra
    assert replay["acceptance_length"] > 1.5 and replay["accepted_tokens"] > 0
    assert replay["acceptance_length"] == pytest.approx(1 + replay["accepted_tokens"] / replay["verifies"])
    assert runs["plain"].extra["speedup"] == 1.0 and runs["plain"].extra["verifies"] == 0
    assert "spec" in report.table()
