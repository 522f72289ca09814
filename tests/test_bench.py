"""`dsv4kv bench` plumbing on the CPU (refusal of failed checks, derived rates, targets, JSON, plots, CLI), and
one real GPU run of a small workload where a GPU exists. Speed itself is measured by the bench, never here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

from dsv4kv.bench import Report, Result, bench_device, evaluate_targets, plot_report, run_bench
from dsv4kv.bench.timing import source_commit
from dsv4kv.bench.workloads import core_bytes
from dsv4kv.cli import main
from dsv4kv import CacheManager, ModelGeometry

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
    report = Report(meta=dict(META))
    report.add(Result("topk", "t", {"rows": 1, "cols": 262144, "k": 512}, 16.5, bytes=1 << 20))
    report.add(Result("decode", "core", {"kind": "csa", "context": 1 << 20, "batch": 1}, 38.0, bytes=18_000_000,
                      extra={"stage": "core"}))
    report.add(Result("decode", "core", {"kind": "csa", "context": 131072, "batch": 64}, 60.0, bytes=170_000_000,
                      extra={"stage": "core"}))
    report.add(Result("layer", "transformers csa", {"kind": "csa", "context": 16384, "batch": 1}, 2000.0))
    report.add(Result("layer", "dsv4kv csa", {"kind": "csa", "context": 16384, "batch": 1, "mode": "official"}, 80.0))
    targets = {t["target"]: t for t in evaluate_targets(report)}
    assert not targets["top-512 of 262,144 candidates, one row <= 15 us"]["met"]
    assert targets["CSA core decode, batch 1, 1M context <= 40 us"]["met"]
    floor = 170_000_000 / 4e12 * 1e6  # 42.5 us: 60 us is 1.41x
    batch64 = targets["CSA core decode, batch 64, 128K context <= 1.4x bytes / bandwidth"]
    assert not batch64["met"] and f"{60 / floor:.2f}x" in batch64["measured"]
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
    cache = CacheManager(g, max_requests=1, max_tokens=4096)
    csa = next(i for i, layer in enumerate(g.layers) if layer.kind.short == "CSA")
    parts = core_bytes(g, cache, csa, 1 << 20, 2)
    assert parts["indexer keys"] == 2 * (1 << 18) * 68
    assert parts["picked entries"] == 2 * 512 * 584
    assert parts["window keys"] == 2 * 128 * 584
    assert "compressor state" in parts  # 2^20 is a multiple of 4: the step completes an entry
    assert "compressor state" not in core_bytes(g, cache, csa, (1 << 20) - 1, 1)
    hca = next(i for i, layer in enumerate(g.layers) if layer.kind.short == "HCA")
    state = core_bytes(g, cache, hca, 1 << 20, 1)["compressor state"]  # all 128 rows of kv and logits, fp32
    assert state == 2 * 128 * 512 * 4 + 584


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
    repository's commit; the project's own checkout is stamped with its commit; DSV4KV_COMMIT overrides both."""
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
    assert source_commit(str(tmp_path / "nowhere")) == "unknown"
    monkeypatch.setenv("DSV4KV_COMMIT", "abc1234")
    assert source_commit(str(copy)) == "abc1234"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_topk_workload_runs_and_checks(tmp_path):
    """The default device "cuda" (no index) through the whole bench path."""
    report = run_bench(["topk"], out_dir=str(tmp_path), name="run", quick=True, runs=5, log=lambda line: None)
    rows = [r for r in report.results if r.workload == "topk"]
    assert rows and all(r.time_us and r.time_us > 0 and not r.refused for r in rows)
    assert report.meta["copy_bandwidth_Bps"] > 1e12
    assert json.loads((tmp_path / "run.json").read_text())["results"] and (tmp_path / "run.md").exists()
    assert not (tmp_path / "decode-vs-context.png").exists()  # no decode rows: no plot
