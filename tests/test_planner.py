"""Memory accounting: `CacheSpec` byte counts, the `MemoryPlan` report, `parse_bytes`, the `plan`
command line, and the pools allocating exactly what the spec says.

Reference figures are derived here from SPEC §2's entry sizes and layer counts, never read back from
the library.
"""

from __future__ import annotations

import json
from fractions import Fraction
from importlib import resources

import pytest

from dsv4kv.tools.cli import main
from dsv4kv.geometry import LayerKind, ModelGeometry
from dsv4kv.cache.layout import indexer_layout, main_layout
from dsv4kv.cache.planner import MemoryPlan, parse_bytes
from dsv4kv.cache.pools import CachePools
from dsv4kv.cache.spec import DEFAULT_PAGE_TOKENS, CacheSpec

GiB = 2**30
CONTEXT = 2**20

# SPEC §2 entry sizes, in bytes.
MAIN_FP8 = 448 + 2 * 64 + 7 + 1  # e4m3 nope | bf16 rope | 7 ue8m0 scales | pad
MAIN_FP8_DATA = 448 + 2 * 64  # a page's data rows; the page pads to a multiple of this
MAIN_BF16 = 2 * 512
INDEX_BYTES = {"fp8": 128 + 4, "mxfp4": 128 // 2 + 128 // 32, "bf16": 2 * 128}
LAYERS = {  # (window, CSA, HCA), SPEC §1
    "flash": (2, 21, 20),
    "pro": (0, 30, 31),
}
# SPEC §2 "Derived memory", B/token: (fp8 indexer, mxfp4 indexer).
SPEC_BYTES_PER_TOKEN = {
    "flash": {"fp8": 3850.25, "mxfp4": 3514.25},
    "pro": {"fp8": 5511.4375, "mxfp4": 5031.4375},
}


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def spec_bytes_per_token(model: str, indexer: str) -> Fraction:
    """Amortized bytes per token, unpadded: CSA = main + indexer key every 4 tokens, HCA = main every 128."""
    _, csa, hca = LAYERS[model]
    return csa * (Fraction(MAIN_FP8, 4) + Fraction(INDEX_BYTES[indexer], 4)) + hca * Fraction(MAIN_FP8, 128)


def within(got: float, want: float, rel: float) -> bool:
    return abs(got - want) <= rel * want


# ----------------------------------------------------------------------------------------------------
# 1. SPEC's derived figures at 2^20 tokens
# ----------------------------------------------------------------------------------------------------

def test_entry_sizes_match_spec_text():
    assert (MAIN_FP8, MAIN_FP8_DATA, MAIN_BF16) == (584, 576, 1024)
    assert INDEX_BYTES == {"fp8": 132, "mxfp4": 68, "bf16": 256}


@pytest.mark.parametrize("model", ["flash", "pro"])
@pytest.mark.parametrize("indexer", ["fp8", "mxfp4"])
def test_spec_bytes_per_token_derivation(model, indexer):
    assert spec_bytes_per_token(model, indexer) == Fraction(SPEC_BYTES_PER_TOKEN[model][indexer])


@pytest.mark.parametrize("model", ["flash", "pro"])
@pytest.mark.parametrize("indexer", ["fp8", "mxfp4"])
def test_request_at_2_20_tokens_within_1pct_of_spec(model, indexer):
    want = float(spec_bytes_per_token(model, indexer)) * CONTEXT
    request = MemoryPlan(CacheSpec(ModelGeometry.preset(model), "fp8", indexer), context=CONTEXT).report()["request"]
    assert request["total_bytes"] == request["paged_bytes"] + request["window_bytes"] + request["state_bytes"]
    for key in ("paged_bytes", "total_bytes"):
        got = request[key]
        assert within(got, want, 0.01), (
            f"{key} {got / GiB:.4f} GiB vs SPEC {want / GiB:.4f} GiB ({(got / want - 1) * 100:+.2f}%)")
        assert got >= want, f"{key} below the unpadded SPEC figure: {got} < {want}"


def test_spec_gib_figures_as_quoted():
    # SPEC §2 quotes 3.76 / 3.43 GiB (Flash) and 5.39 / 4.92 GiB (Pro) at 2^20 tokens; the Pro figures
    # are rounded up (5.382 / 4.914 GiB exactly), hence the 0.01 GiB tolerance
    quoted = {("flash", "fp8"): 3.76, ("flash", "mxfp4"): 3.43, ("pro", "fp8"): 5.39, ("pro", "mxfp4"): 4.92}
    for (model, indexer), gib in quoted.items():
        got = float(spec_bytes_per_token(model, indexer)) * CONTEXT / GiB
        assert got == pytest.approx(gib, abs=0.01), (model, indexer, got)


# ----------------------------------------------------------------------------------------------------
# 2. Exact byte accounting of the layouts
# ----------------------------------------------------------------------------------------------------

def test_main_entry_bytes():
    fp8, bf16 = main_layout("fp8", 512, 64), main_layout("bf16", 512, 64)
    assert (fp8.data_bytes, fp8.scale_bytes, fp8.entry_bytes) == (576, 8, MAIN_FP8)
    assert (bf16.data_bytes, bf16.scale_bytes, bf16.entry_bytes) == (1024, 0, MAIN_BF16)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "bf16"])
def test_indexer_entry_bytes(fmt):
    assert indexer_layout(fmt, 128).entry_bytes == INDEX_BYTES[fmt]


@pytest.mark.parametrize("entries, want", [(64, 37440), (2, 1728), (256, 149760), (8, 5184), (128, 74880), (1, 1152)])
def test_main_fp8_page_bytes(entries, want):
    assert round_up(entries * MAIN_FP8, MAIN_FP8_DATA) == want  # the reference itself
    assert main_layout("fp8", 512, 64).page_bytes(entries) == want


@pytest.mark.parametrize("entries", [1, 2, 8, 64, 128, 256])
def test_unpadded_page_bytes(entries):
    assert main_layout("bf16", 512, 64).page_bytes(entries) == entries * MAIN_BF16
    for fmt, size in INDEX_BYTES.items():
        assert indexer_layout(fmt, 128).page_bytes(entries) == entries * size, fmt


@pytest.mark.parametrize("page_tokens", [128, 256, 512, 1024, 4096])
@pytest.mark.parametrize("model", ["flash", "pro"])
def test_block_bytes_per_layer(model, page_tokens):
    spec = CacheSpec(ModelGeometry.preset(model), "fp8", "fp8", page_tokens)
    for layer in spec.layers:
        kind, m = layer.layer.kind, layer.layer.ratio
        if kind is LayerKind.WINDOW:
            want = 0
        else:
            want = round_up(page_tokens // m * MAIN_FP8, MAIN_FP8_DATA)
            if kind is LayerKind.CSA:
                want += page_tokens // m * INDEX_BYTES["fp8"]
        assert layer.block_bytes == want, f"layer {layer.layer.index} ({kind.short}), {page_tokens}-token pages"
    csa = next(layer for layer in spec.layers if layer.layer.kind is LayerKind.CSA)
    assert csa.entries_per_page == page_tokens // 4


def test_flashmla_shaped_pages_at_256_tokens():
    spec = CacheSpec(ModelGeometry.preset("flash"), "fp8", "fp8", 256)
    by_kind = {layer.layer.kind: layer for layer in spec.layers}
    assert by_kind[LayerKind.CSA].entry_page_bytes == 37440  # 64 entries
    assert by_kind[LayerKind.HCA].entry_page_bytes == 1728  # 2 entries, padded from 1168
    assert by_kind[LayerKind.CSA].index_page_bytes == 64 * 132


def state_bytes_reference(kind: LayerKind, ratio: int, head_dim: int, index_dim: int) -> int:
    """fp32 kv + logit rows. CSA: 2 blocks of m rows, 2d wide (main) + 2 d_I wide (indexer); HCA: m rows of d."""
    if kind is LayerKind.WINDOW:
        return 0
    if kind is LayerKind.CSA:
        return 2 * (2 * ratio) * (2 * head_dim + 2 * index_dim) * 4
    return 2 * ratio * head_dim * 4


def test_state_bytes_flash_figures():
    spec = CacheSpec(ModelGeometry.preset("flash"))
    by_kind = {layer.layer.kind: layer for layer in spec.layers}
    assert by_kind[LayerKind.CSA].state_bytes == 2 * 8 * (1024 + 256) * 4 == 81920
    assert by_kind[LayerKind.HCA].state_bytes == 2 * 128 * 512 * 4 == 524288
    assert by_kind[LayerKind.WINDOW].state_bytes == 0


@pytest.mark.parametrize("model", ["flash", "pro", "tiny", "mini"])
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_per_request_bytes(model, kv):
    g = ModelGeometry.preset(model)
    spec = CacheSpec(g, kv, "mxfp4")
    entry = MAIN_FP8 if kv == "fp8" else MAIN_BF16
    for layer in spec.layers:
        kind = layer.layer.kind
        # the window ring is one page of `window` main entries, on every layer
        window = round_up(g.window * layer.main.entry_bytes, layer.main.page_align)
        if g.head_dim == 512:
            assert layer.main.entry_bytes == entry
            assert window == (round_up(128 * 584, 576) if kv == "fp8" else 128 * 1024)
        assert layer.window_bytes == window, f"{model} layer {layer.layer.index}"
        # compressor state is fp32 whatever the entry format
        want_state = state_bytes_reference(kind, layer.layer.ratio, g.head_dim, g.index_head_dim)
        assert layer.state_bytes == want_state, f"{model} layer {layer.layer.index} ({kind.short})"
        assert layer.request_bytes == window + want_state


# ----------------------------------------------------------------------------------------------------
# 3. The report: requests that fit, dense comparison, block counts
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["flash", "pro"])
def test_requests_fit_is_floor_division(model):
    spec = CacheSpec(ModelGeometry.preset(model))
    total = MemoryPlan(spec, context=CONTEXT).report()["request"]["total_bytes"]
    for memory, want in ((10 * total, 10), (10 * total - 1, 9), (total - 1, 0), (141 * GiB, 141 * GiB // total)):
        assert MemoryPlan(spec, context=CONTEXT, memory=memory).report()["requests_fit"] == want, memory


@pytest.mark.parametrize("model, want", [("flash", 2 * 512 * 43), ("pro", 2 * 512 * 61)])
def test_dense_bf16_comparison(model, want):
    assert MemoryPlan(CacheSpec(ModelGeometry.preset(model))).report()["dense_bf16_bytes_per_token"] == want


@pytest.mark.parametrize("context, blocks", [(1, 1), (1024, 1), (1025, 2), (CONTEXT, 1024)])
def test_request_blocks_round_up(context, blocks):
    spec = CacheSpec(ModelGeometry.preset("flash"))
    request = MemoryPlan(spec, context=context).report()["request"]
    assert request["blocks"] == blocks
    assert request["paged_bytes"] == blocks * spec.block_bytes
    assert request["total_bytes"] == spec.request_bytes(context)


def test_report_headline_fields():
    r = MemoryPlan(CacheSpec(ModelGeometry.preset("flash"), "fp8", "mxfp4")).report()
    assert (r["kv_entry_bytes"], r["indexer_key_bytes"], r["page_tokens"]) == (584, 68, DEFAULT_PAGE_TOKENS)
    assert [(k["kind"], k["layers"], k["ratio"]) for k in r["kinds"]] == [("window", 2, 0), ("CSA", 21, 4), ("HCA", 20, 128)]
    assert r["paged_bytes_per_token"] == pytest.approx(sum(k["paged_bytes_per_token"] for k in r["kinds"]))


@pytest.mark.parametrize("field, value", [("context", 0), ("memory", -1)])
def test_plan_rejects_nonpositive(field, value):
    with pytest.raises(ValueError, match=field):
        MemoryPlan(CacheSpec(ModelGeometry.preset("tiny")), **{field: value})


# ----------------------------------------------------------------------------------------------------
# 4. parse_bytes
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, want", [
    ("141GiB", 141 * 2**30),
    ("80GB", 80 * 10**9),
    ("1.5TiB", 3 * 2**39),
    ("123", 123),
    (123, 123),
    ("1 KiB", 1024),
    ("2mib", 2 * 2**20),
])
def test_parse_bytes(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize("text", ["12XB", "", "-5GB", "GB", "1.2.3GB", "0GB", -5, 0, True])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="memory"):
        parse_bytes(text)


# ----------------------------------------------------------------------------------------------------
# 5. The `plan` command line
# ----------------------------------------------------------------------------------------------------

def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_table(capsys):
    code, out, err = run_cli(capsys, "--model", "flash")
    assert code == 0, err
    for needle in ("window", "CSA", "HCA", "dense bf16", "requests of 1,048,576 tokens that fit in 141.00 GiB:"):
        assert needle in out, f"{needle!r} missing from:\n{out}"
    fit = MemoryPlan(CacheSpec(ModelGeometry.preset("flash"))).report()["requests_fit"]
    assert out.rstrip().endswith(f": {fit:,}")


def test_cli_json_matches_report(capsys):
    code, out, err = run_cli(capsys, "--model", "flash", "--json")
    assert code == 0, err
    assert json.loads(out) == MemoryPlan(CacheSpec(ModelGeometry.preset("flash"))).report()


def test_cli_json_with_every_option(capsys):
    code, out, err = run_cli(capsys, "--model", "pro", "--json", "--context", "5000", "--memory", "80GB",
                             "--kv-format", "fp8", "--indexer-format", "fp8", "--page-tokens", "256")
    assert code == 0, err
    want = MemoryPlan(CacheSpec(ModelGeometry.preset("pro"), "fp8", "fp8", 256), context=5000, memory=80 * 10**9)
    assert json.loads(out) == want.report()


def test_cli_model_from_config_json(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(resources.files("dsv4kv.presets").joinpath("flash.json").read_text())
    code, out, err = run_cli(capsys, "--model", str(path), "--json")
    assert code == 0, err
    got = json.loads(out)
    want = MemoryPlan(CacheSpec(ModelGeometry.preset("flash"))).report()
    # only the model's name (from the directory) differs
    assert got.pop("model").split(":", 1)[1] == want.pop("model").split(":", 1)[1]
    assert got == want


@pytest.mark.parametrize("argv, needle", [
    pytest.param(("--model", "nope"), "nope", id="unknown-model"),
    pytest.param(("--page-tokens", "100"), "page_tokens", id="page-tokens-100"),
    pytest.param(("--memory", "lots"), "memory", id="bad-memory"),
    pytest.param(("--context", "0"), "context", id="context-0"),
])
def test_cli_errors_exit_2(capsys, argv, needle):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.startswith("dsv4kv plan: ") and needle in err, err


def test_cli_bf16_per_token(capsys):
    code, out, err = run_cli(capsys, "--kv-format", "bf16", "--indexer-format", "bf16", "--json")
    assert code == 0, err
    report = json.loads(out)
    # bf16 pages carry no padding, so the amortized figure is exact
    want = 21 * (Fraction(1024, 4) + Fraction(256, 4)) + 20 * Fraction(1024, 128)
    assert report["paged_bytes_per_token"] == want == 6880
    assert (report["kv_entry_bytes"], report["indexer_key_bytes"]) == (1024, 256)


# ----------------------------------------------------------------------------------------------------
# 6. Pools allocate what the spec says
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["tiny", "mini"])
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize("indexer", ["fp8", "mxfp4", "bf16"])
def test_pool_bytes_equal_allocated_bytes(model, kv, indexer):
    spec = CacheSpec(ModelGeometry.preset(model), kv, indexer)
    pools = CachePools(spec, num_blocks=3, max_requests=2, device="cpu")
    assert pools.nbytes == spec.pool_bytes(3, 2)
    assert spec.pool_bytes(3, 2) == 3 * spec.block_bytes + 2 * spec.request_fixed_bytes
    # and every tensor has the per-layer shape the spec names
    for layer in pools.layers:
        ls = layer.spec
        assert layer.window.shape == (2, ls.window_bytes)
        if ls.layer.compressed:
            assert layer.entries.shape == (3, ls.entry_page_bytes)
            assert layer.state_kv.shape == (2, ls.state_rows, ls.state_width)
        else:
            assert layer.entries is None and layer.state_kv is None
        assert (layer.index_keys is not None) == ls.layer.has_indexer


# ----------------------------------------------------------------------------------------------------
# Prefix caching: a boundary snapshot's bytes
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["flash", "pro"])
def test_boundary_snapshot_bytes(model):
    """A snapshot = every layer's window page (128 FP8 entries, padded to the 576-B data row) + per CSA layer
    4 fp32 rows of kv and logits of the main (2 x 512 wide) and indexer (2 x 128) compressors."""
    window, csa, hca = LAYERS[model]
    window_page = round_up(128 * MAIN_FP8, MAIN_FP8_DATA)
    csa_rows = 2 * 4 * (2 * 512 + 2 * 128) * 4
    want = (window + csa + hca) * window_page + csa * csa_rows
    spec = CacheSpec(ModelGeometry.preset(model), "fp8", "mxfp4")
    assert window_page == 74_880 and csa_rows == 40_960
    assert spec.boundary_bytes == want
    report = MemoryPlan(spec, context=CONTEXT).report()["prefix_caching"]
    assert report["boundary_bytes"] == want and report["block_bytes"] == spec.block_bytes
    assert report["boundary_window_bytes"] + report["boundary_state_bytes"] == want


def test_snapshots_are_set_aside_before_requests_fit():
    spec = CacheSpec(ModelGeometry.preset("flash"))
    memory = 141 * GiB
    request = spec.request_bytes(CONTEXT)
    plan = MemoryPlan(spec, context=CONTEXT, memory=memory, snapshots=64)
    r = plan.report()
    assert r["prefix_caching"]["snapshot_pool_bytes"] == 65 * spec.boundary_bytes  # + the scratch snapshot
    assert r["requests_fit"] == (memory - 65 * spec.boundary_bytes) // request
    assert "beside 64 snapshots" in plan.table() and "boundary snapshot" in plan.table()
    with pytest.raises(ValueError, match="snapshots: expected an int >= 0, got -1"):
        MemoryPlan(spec, snapshots=-1)
