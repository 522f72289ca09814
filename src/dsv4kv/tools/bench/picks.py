"""Why a CSA row may differ from its comparison by more than the row tolerance: its top-k picks.

A CSA row attends to the top-k compressed entries by indexer score. Where the k-th and the next score are within
rounding of each other, two computations of the same step can pick different entries, and the row's output then
differs by a whole entry's weight: far beyond the rounding of the rows that pick alike. The bench's checks
compare every row's output; a row beyond the tolerance is accepted only when its picks explain it:

- **near-tie flip**: the picks differ, and each of ours is within `tie_tol` of the score range of the k-th best
  score by the comparison's own scores (tests/test_oracle.py's rule, there against transformers' scores);
- **input flip** (kernels against the reference): each of the kernels' picks is a near tie by the reference's
  scores of *the kernels' own inputs* (their indexer query, head weights and the keys their compressor wrote),
  so the kernels' scores and top-k are right for what they were given; the sets differ because this step's
  keys or the query were encoded one grid step apart. Those inputs are gated separately (`InputCheck`);
- anything else is **unexplained** and refuses the figure: a row beyond the tolerance with the same picks (the
  error is in attention or the entries), or a pick that is not near the top-k (the indexer or top-k is wrong).

`explain_rows` is the classification (pure tensor code, tested with synthetic rows); `CSACapture` records what
the reference layer and the kernel path picked and scored in one run of each.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

__all__ = ["pick_gaps", "explain_rows", "RowVerdict", "CSACapture", "InputCheck"]


def pick_gaps(picks: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """How far each row's picks are from a top-k set of `scores`: fp32 [n], per row the largest
    (k-th best score - score of a pick) / max |score| over the row's candidates, 0 when the picks are exactly a
    top set; inf when a pick is not a candidate (-inf score, out of range, repeated) or the row has fewer or more
    picks than min(k, candidates).

    picks: int [n, k], -1 = none; scores: fp32 [n, J], -inf = not a candidate (invisible)."""
    n, k = picks.shape
    scores = scores.float()
    if scores.shape[1] == 0:
        return torch.where((picks >= 0).any(1), float("inf"), 0.0)
    candidates = scores > float("-inf")
    expected = candidates.sum(1).clamp(max=k)
    valid = picks >= 0
    index = picks.long().clamp(0, scores.shape[1] - 1)
    picked = torch.where(valid & (picks < scores.shape[1]), scores.gather(1, index), float("-inf"))
    ordered_picks = picks.long().sort(1).values
    repeated = ((ordered_picks.diff(dim=1) == 0) & (ordered_picks[:, 1:] >= 0)).any(1)
    ordered = scores.sort(1, descending=True).values
    kth = ordered.gather(1, (expected - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    scale = torch.where(candidates, scores.abs(), 0.0).amax(1).clamp_min(1e-30)
    gap = torch.where(valid, (kth.unsqueeze(1) - picked).clamp(min=0), 0.0).amax(1) / scale
    bad = (valid.sum(1) != expected) | repeated | (valid & (picked == float("-inf"))).any(1)
    return torch.where(bad, float("inf"), torch.where(expected > 0, gap, 0.0))


@dataclass
class RowVerdict:
    """The rows of one comparison: how many exceed the tolerance and what explains each."""
    rows: int
    row_tol: float
    tie_tol: float
    beyond: int = 0  # rows with error > row_tol
    near_ties: int = 0  # ... whose picks differ by near ties of the comparison's scores
    input_flips: int = 0  # ... whose picks are near ties of the kernels' own inputs (kernels vs reference only)
    same_picks: int = 0  # unexplained: the same picks, yet beyond the tolerance
    far_picks: int = 0  # unexplained: a pick that is not near the top-k
    differing: int = 0  # rows whose pick sets differ, within the tolerance or not
    worst_within: float = 0.0  # the largest row error within the tolerance
    worst_gap: float = 0.0  # the largest gap (of the score range) among the explained rows
    finite: bool = True

    @property
    def passed(self) -> bool:
        return self.finite and self.same_picks == 0 and self.far_picks == 0

    def text(self, what: str) -> str:
        out = (f"{what}: {self.rows - self.beyond}/{self.rows} rows within {self.row_tol:g} "
               f"(worst {self.worst_within:.2e})")
        if self.beyond:
            out += (f"; {self.beyond} beyond: {self.near_ties} near-tie pick flips"
                    + (f", {self.input_flips} flips from this step's inputs" if self.input_flips else "")
                    + f" (gaps <= {self.worst_gap:.1e} of the score range, allowed {self.tie_tol:g})")
            if self.same_picks or self.far_picks:
                out += f", UNEXPLAINED: {self.same_picks} with the same picks, {self.far_picks} with a far pick"
        out += f"; {self.differing} rows pick differently in all"
        return out + ("" if self.finite else ", NOT FINITE")


def explain_rows(errors: torch.Tensor, picks: torch.Tensor | None, ref_picks: torch.Tensor | None,
                 scores: torch.Tensor | None, *, row_tol: float, tie_tol: float,
                 input_scores: torch.Tensor | None = None) -> RowVerdict:
    """Classify the rows of a comparison (see the module docstring).

    errors: fp32 [n] per-row error (inf or NaN for a non-finite row); picks, ref_picks: int [n, k] ours and the
    comparison's (-1 = none), None for a layer without top-k (then every row must be within row_tol); scores:
    fp32 [n, J] the comparison's scores (-inf = invisible); input_scores: fp32 [n, J] the reference's scores of
    our own inputs (kernels vs reference), or None (against transformers: near ties of `scores` only)."""
    errors = errors.float().cpu()
    finite = bool(torch.isfinite(errors).all())
    over = ~(errors <= row_tol)  # NaN counts as over
    within = errors[~over]
    verdict = RowVerdict(rows=errors.numel(), row_tol=row_tol, tie_tol=tie_tol, beyond=int(over.sum()),
                         worst_within=float(within.max()) if within.numel() else 0.0, finite=finite)
    if picks is None:
        verdict.same_picks = verdict.beyond
        return verdict
    picks, ref_picks = picks.long().cpu(), ref_picks.long().cpu()
    differ = (picks.sort(1).values != ref_picks.sort(1).values).any(1)
    verdict.differing = int(differ.sum())
    gap = pick_gaps(picks, scores.cpu())
    near = differ & (gap <= tie_tol)
    if input_scores is not None:
        own = pick_gaps(picks, input_scores.cpu())
        from_inputs = differ & ~near & (own <= tie_tol)
    else:
        own, from_inputs = gap, torch.zeros_like(differ)
    verdict.near_ties = int((over & near).sum())
    verdict.input_flips = int((over & from_inputs).sum())
    verdict.same_picks = int((over & ~differ).sum())
    verdict.far_picks = int((over & differ & ~near & ~from_inputs).sum())
    explained = over & (near | from_inputs)
    if explained.any():
        verdict.worst_gap = float(torch.where(near, gap, own)[explained].max())
    return verdict


@dataclass
class InputCheck:
    """The kernels' inputs to the indexer against the reference's.

    - The indexer keys this step wrote: bytes within the compressor's documented rounding (<= 1% of the new keys'
      bytes differ).
    - The query and head weights the scores kernel read, in two steps. Each must equal the reference run on the
      fused query kernel's own inputs, bit for bit (`query_mismatches` == 0: RoPE, Hadamard rotation, quantization
      and `weights.float() * scale` are exact). Those inputs (the query roped) must be within INPUT_TOL of each
      head's (the weights: each row's) largest value of the reference's (`input_gap`): the two paths' projections
      and norms round one bf16 unit apart (`gemv_rows`, `kernels.rms_norm_rows`), a wrong row, head or weight is
      off by its own size. A NaN in either path's inputs fails.
    - The quantized queries of the two paths: >= 99.9% of the values equal bit for bit, and >= 99% in every row, for
      MXFP4 and bf16 keys. Reported, not gated, for FP8 keys: the rotation spreads one input's rounding over a head's
      128 values, and FP8's 3-bit mantissas under one scale per head change more codes than MXFP4's (about 99.85%
      equal at 1M / batch 1, a row of batch 8 as low as 96.3%); the two checks above then bound it."""
    key_bytes_differ: int
    new_key_bytes: int
    query_equal: float
    query_worst_row: float = 1.0  # the fewest equal values of one row, as a fraction of its values
    query_mismatches: int = 0  # scored query and weight values unequal to the reference on the kernel's own inputs
    input_gap: float = 0.0  # the largest |difference| of the two paths' inputs / its head's or row's largest |value|
    fp8_keys: bool = False

    KEY_FRACTION = 0.01
    QUERY_FRACTION = 0.999
    QUERY_ROW_FRACTION = 0.99
    INPUT_TOL = 2.0 ** -6  # a few bf16 units of the largest value

    @property
    def passed(self) -> bool:
        cross = self.fp8_keys or (self.query_equal >= self.QUERY_FRACTION
                                  and self.query_worst_row >= self.QUERY_ROW_FRACTION)
        return (self.key_bytes_differ <= self.KEY_FRACTION * self.new_key_bytes and cross
                and self.query_mismatches == 0 and self.input_gap <= self.INPUT_TOL)

    def text(self) -> str:
        gate = "reported, not gated for FP8 keys" if self.fp8_keys else \
            f">= {self.QUERY_FRACTION}; the worst row >= {self.QUERY_ROW_FRACTION}"
        return (f"indexer inputs: {self.key_bytes_differ} of {self.new_key_bytes} new key bytes differ (<= "
                f"{self.KEY_FRACTION:.0%}); {self.query_mismatches} scored query and weight values differ from the "
                f"reference on the kernel's own inputs (0 allowed), those inputs within {self.input_gap:.1e} of the "
                f"reference's (<= {self.INPUT_TOL:.1e}); query values equal across the paths {self.query_equal:.5f}, "
                f"in the worst row {self.query_worst_row:.4f} ({gate})")


class CSACapture:
    """Records one CSA layer's picks and scores on each path while active (`with CSACapture() as cap:`):

    - the reference (`layer._forward_reference` -> `ops.indexer.reference.indexer_topk`): its picks [n, k], its scores
      [n, J] (-inf past each row's visible entries), its quantized query [n, H, D], and a copy of the key pool;
    - the kernels (`layer.attention_core` -> `kernels.indexer_query_and_weights`, `kernels.indexer_scores_paged`,
      `kernels.topk_indices`): the fused query's input roped by torch and the reference query of that input, the
      picks of the plan's first n rows, a copy of the key pool, the query the kernel scored, and `input_scores`: the
      reference's scores (`ops.indexer.reference.indexer_scores`) of the kernels' own query, weights and keys.

    It patches module attributes the layer looks up at call time, and restores them on exit (not reentrant)."""

    def __init__(self):
        self.reference: dict = {}
        self.kernels: dict = {}

    def __enter__(self) -> "CSACapture":
        import dsv4kv.ops.kernels as kernels
        import dsv4kv.model.layer as layer_module
        import dsv4kv.ops.indexer.reference as ops_indexer

        from ...cache.layout import IndexerFP8Layout
        from ...ops.rope.reference import rotate_pairs

        self._stack = contextlib.ExitStack()
        originals = {"topk": ops_indexer.topk_picks, "ref": layer_module.indexer_topk,
                     "scores": kernels.indexer_scores_paged, "select": kernels.topk_indices,
                     "query": kernels.indexer_query_and_weights}

        def reference(q, weights, plan, key_pool, layout, *, ratio, topk, page_tokens, rows=None):
            calls = []

            def picks(scores, k):
                calls.append(scores)
                return originals["topk"](scores, k)

            ops_indexer.topk_picks = picks
            try:
                out = originals["ref"](q, weights, plan, key_pool, layout, ratio=ratio, topk=topk,
                                       page_tokens=page_tokens, rows=rows)
            finally:
                ops_indexer.topk_picks = originals["topk"]
            rows_ = rows if rows is not None else _step_rows(plan)
            self.reference.update(picks=out, scores=_assemble(calls, rows_, ratio, q.device),
                                  query=ops_indexer.indexer_query(q, layout), pool=key_pool.clone(), query_input=q,
                                  weights=weights)
            return out

        def query(q, weights, cos, sin, layout, *, scale, **kw):
            out = originals["query"](q, weights, cos, sin, layout, scale=scale, **kw)
            roped = rotate_pairs(q, cos, sin)  # the kernel's own input, roped as the reference ropes
            self.kernels.update(query_input=roped, query_own=ops_indexer.indexer_query(roped, layout),
                                weights_own=weights.float() * scale, fp8_keys=isinstance(layout, IndexerFP8Layout))
            return out

        def scores(q, weights, plan, key_pool, layout, *, ratio, page_tokens, max_entries, **kw):
            out = originals["scores"](q, weights, plan, key_pool, layout, ratio=ratio, page_tokens=page_tokens,
                                      max_entries=max_entries, **kw)
            rows_ = _step_rows(plan)
            n = rows_.num_tokens
            self.kernels.update(query=q[:n].clone(), weights=weights[:n].clone(), pool=key_pool.clone(),
                                input_scores=_torch_scores(
                q[:n], weights[:n], plan, rows_, key_pool, layout, ratio, page_tokens))
            return out

        def select(scores_, lengths, k, **kw):
            out = originals["select"](scores_, lengths, k, **kw)
            self.kernels["picks"] = out
            return out

        layer_module.indexer_topk = reference
        kernels.indexer_scores_paged, kernels.topk_indices = scores, select
        kernels.indexer_query_and_weights = query

        def restore():
            layer_module.indexer_topk = originals["ref"]
            kernels.indexer_scores_paged, kernels.topk_indices = originals["scores"], originals["select"]
            kernels.indexer_query_and_weights = originals["query"]

        self._stack.callback(restore)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def verdict(self, errors: torch.Tensor, *, row_tol: float, tie_tol: float,
                new_key_bytes: int) -> tuple[RowVerdict, InputCheck]:
        """Classify the rows (errors [n], kernels against the reference) and check the indexer's inputs
        (new_key_bytes: the bytes of the indexer keys this step completes, the only ones that may differ). Raises
        RuntimeError where the kernel path never called `kernels.indexer_query_and_weights`."""
        ref, ker = self.reference, self.kernels
        n = errors.numel()
        width = max(ref["scores"].shape[1], ker["input_scores"].shape[1])
        verdict = explain_rows(errors, ker["picks"][:n], ref["picks"], _pad(ref["scores"], width), row_tol=row_tol,
                               tie_tol=tie_tol, input_scores=_pad(ker["input_scores"], width))
        differ = int((ref["pool"] != ker["pool"]).sum())
        m = ker["query"].shape[0]  # the plan's rows (the fused query also ran over the padding rows)
        equal = _bit_equal(ker["query"], ref["query"])
        if not equal.numel():
            return verdict, InputCheck(differ, new_key_bytes, 1.0)
        if "query_own" not in ker:
            raise RuntimeError("CSACapture: the kernel path never called kernels.indexer_query_and_weights")
        # what the scores kernel read against the reference on the fused kernel's own inputs, value by value
        mismatches = int((~_bit_equal(ker["query"], ker["query_own"][:m])).sum()
                         + (~_bit_equal(ker["weights"], ker["weights_own"][:m])).sum())
        gap = max(_gap(ker["query_input"][:m], ref["query_input"]), _gap(ker["weights_own"][:m], ref["weights"]))
        return verdict, InputCheck(differ, new_key_bytes, float(equal.float().mean()),
                                   float(equal.float().mean(1).min()), query_mismatches=mismatches,
                                   input_gap=gap, fp8_keys=ker["fp8_keys"])


def _bit_equal(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row [n, values]: fp32 values equal bit for bit (NaN to NaN)."""
    got, want = got.float(), want.float()
    same = (got.view(torch.int32) == want.view(torch.int32)) | (want.isnan() & got.isnan())
    return same.reshape(want.shape[0], -1)


def _gap(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / the largest |want| along the last dim (per head of a query, per row of weights); NaN or inf
    anywhere gives inf."""
    got, want = got.float(), want.float()
    scale = want.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    gap = ((got - want).abs() / scale).nan_to_num(nan=float("inf"), posinf=float("inf"))
    return float(gap.max()) if gap.numel() else 0.0


def _step_rows(plan):
    from ...ops.shared.rows import step_rows

    return step_rows(plan)


def _assemble(calls: list[torch.Tensor], rows, ratio: int, device) -> torch.Tensor:
    """The reference's per-request score blocks (in `indexer_topk`'s loop order) -> fp32 [n, J], -inf elsewhere."""
    counts = [s // ratio for s in rows.host_seq_lens]
    out = torch.full((rows.num_tokens, max(counts, default=0)), float("-inf"), device=device)
    it = iter(calls)
    for b, (lo, hi) in enumerate(zip(rows.host_query_start[:-1], rows.host_query_start[1:])):
        if hi == lo or counts[b] == 0:
            continue
        out[lo:hi, :counts[b]] = next(it)
    return out


def _torch_scores(q, weights, plan, rows, key_pool, layout, ratio: int, page_tokens: int,
                  block_rows: int = 512) -> torch.Tensor:
    """`ops.indexer.reference.indexer_scores` in fp64 (exact products and nearly exact sums, whatever the GEMM's
    precision mode) of an already-quantized query q [n, H, D] and weights [n, H] against the pool's keys, each row
    over its request's visible entries -> fp32 [n, J], -inf past them. Rows go in blocks to bound the [rows, H, J]
    dots."""
    from ...ops.shared.rows import entry_slots
    from ...ops.indexer.reference import indexer_scores

    counts = [s // ratio for s in rows.host_seq_lens]
    out = torch.full((rows.num_tokens, max(counts, default=0)), float("-inf"), device=q.device)
    for b, (lo, hi) in enumerate(zip(rows.host_query_start[:-1], rows.host_query_start[1:])):
        if hi == lo or counts[b] == 0:
            continue
        index = torch.arange(counts[b], device=q.device)
        slots = entry_slots(plan, rows, torch.full_like(index, b), index, ratio=ratio, page_tokens=page_tokens)
        keys = layout.read(key_pool, page_tokens // ratio, slots).double()
        for r in range(lo, hi, block_rows):
            e = min(hi, r + block_rows)
            block = indexer_scores(q[r:e].double(), weights[r:e].double(), keys).float()
            visible = (rows.positions[r:e] + 1) // ratio
            out[r:e, :counts[b]] = block.masked_fill(index >= visible.unsqueeze(1), float("-inf"))
    return out


def _pad(scores: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(scores, (0, width - scores.shape[1]), value=float("-inf"))
