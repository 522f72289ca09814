"""Memory planner: what a token, a request and a whole model cost, and how many requests fit.

Every figure is derived from `CacheSpec`, the same object the pools allocate from."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..geometry import LayerKind
from .spec import CacheSpec

__all__ = ["MemoryPlan", "parse_bytes", "format_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """'141GiB', '80GB', '1.5TiB', '123456' -> bytes (KB/MB/GB/TB are powers of 1000, KiB.. of 1024)."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"memory: expected a size like 141GiB, 80GB or 1073741824, got {text!r}")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"memory: expected a positive size, got {text!r}")
    return size


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class MemoryPlan:
    spec: CacheSpec
    context: int = 1 << 20
    memory: int = 141 * 2**30
    snapshots: int = 0  # prefix-cache boundary snapshots set aside before requests are counted

    def __post_init__(self):
        if self.context <= 0:
            raise ValueError(f"context: expected a positive token count, got {self.context}")
        if self.memory <= 0:
            raise ValueError(f"memory: expected a positive size, got {self.memory}")
        if isinstance(self.snapshots, bool) or not isinstance(self.snapshots, int) or self.snapshots < 0:
            raise ValueError(f"snapshots: expected an int >= 0, got {self.snapshots!r}")

    def kinds(self) -> list[dict]:
        """One row per layer kind present: per-layer and all-layer bytes."""
        rows = []
        for kind in LayerKind:
            layers = [layer for layer in self.spec.layers if layer.layer.kind is kind]
            if not layers:
                continue
            one = layers[0]  # layers of a kind are identical in bytes
            rows.append({
                "kind": kind.short, "layers": len(layers), "ratio": one.layer.ratio,
                "entries_per_block": one.entries_per_page,
                "block_bytes_per_layer": one.block_bytes,
                "paged_bytes_per_token_per_layer": one.block_bytes / self.spec.page_tokens,
                "paged_bytes_per_token": len(layers) * one.block_bytes / self.spec.page_tokens,
                "window_bytes_per_request_per_layer": one.window_bytes,
                "state_bytes_per_request_per_layer": one.state_bytes,
                "boundary_bytes_per_layer": one.boundary_bytes,
            })
        return rows

    def report(self) -> dict:
        spec, n = self.spec, self.context
        blocks = spec.blocks_for(n)
        window = sum(layer.window_bytes for layer in spec.layers)
        state = sum(layer.state_bytes for layer in spec.layers)
        request = spec.request_bytes(n)
        layers = spec.layers
        snapshot_bytes = spec.pool_bytes(0, 0, self.snapshots)  # includes the scratch snapshot
        return {
            "model": spec.geometry.describe(),
            "kv_format": spec.kv_format.value,
            "kv_entry_bytes": layers[0].main.entry_bytes,
            "indexer_format": spec.indexer_format.value,
            "indexer_key_bytes": next((l.index.entry_bytes for l in layers if l.index is not None), 0),
            "page_tokens": spec.page_tokens,
            "kinds": self.kinds(),
            "paged_bytes_per_token": spec.bytes_per_token,
            "dense_bf16_bytes_per_token": 2 * spec.geometry.head_dim * spec.geometry.num_layers,
            "request": {
                "tokens": n, "blocks": blocks, "paged_bytes": blocks * spec.block_bytes,
                "window_bytes": window, "state_bytes": state, "total_bytes": request,
            },
            "prefix_caching": {
                # one cached boundary: its full block (shared by refcount) plus the snapshot of the state after it
                "block_bytes": spec.block_bytes,
                "boundary_bytes": spec.boundary_bytes,
                "boundary_window_bytes": window,
                "boundary_state_bytes": spec.boundary_bytes - window,
                "boundary_per_block": spec.boundary_bytes / spec.block_bytes,
                "snapshots": self.snapshots,
                "snapshot_pool_bytes": snapshot_bytes,
            },
            "memory_bytes": self.memory,
            "requests_fit": max(self.memory - snapshot_bytes, 0) // request,
        }

    def table(self) -> str:
        r = self.report()
        req = r["request"]
        lines = [
            f"{r['model']}",
            f"kv {r['kv_format']} ({r['kv_entry_bytes']} B/entry), indexer keys {r['indexer_format']} "
            f"({r['indexer_key_bytes']} B/key), pages of {r['page_tokens']} tokens",
            "",
            f"{'kind':<7}{'layers':>7}{'ratio':>7}{'entries/blk':>12}{'B/blk/layer':>13}{'B/tok/layer':>13}"
            f"{'B/tok (all)':>13}{'window B/req/layer':>20}{'state B/req/layer':>19}",
        ]
        for k in r["kinds"]:
            lines.append(
                f"{k['kind']:<7}{k['layers']:>7}{k['ratio']:>7}{k['entries_per_block']:>12}"
                f"{k['block_bytes_per_layer']:>13,}{k['paged_bytes_per_token_per_layer']:>13.2f}"
                f"{k['paged_bytes_per_token']:>13.2f}{k['window_bytes_per_request_per_layer']:>20,}"
                f"{k['state_bytes_per_request_per_layer']:>19,}")
        lines += [
            f"{'model':<7}{sum(k['layers'] for k in r['kinds']):>7}{'':>32}{r['paged_bytes_per_token']:>13.2f}",
            "",
            f"dense bf16 cache for comparison: {r['dense_bf16_bytes_per_token']:,} B/token",
            f"one request of {req['tokens']:,} tokens ({req['blocks']:,} blocks):",
            f"  paged   {req['paged_bytes']:>16,} B  {format_bytes(req['paged_bytes']):>11}",
            f"  window  {req['window_bytes']:>16,} B  {format_bytes(req['window_bytes']):>11}",
            f"  state   {req['state_bytes']:>16,} B  {format_bytes(req['state_bytes']):>11}",
            f"  total   {req['total_bytes']:>16,} B  {format_bytes(req['total_bytes']):>11}",
            f"prefix caching: a cached boundary snapshot (window + CSA rows) costs {r['prefix_caching']['boundary_bytes']:,} B"
            f" = {r['prefix_caching']['boundary_per_block']:.2f} blocks",
            f"requests of {req['tokens']:,} tokens that fit in {format_bytes(r['memory_bytes'])}"
            + (f" beside {self.snapshots:,} snapshots" if self.snapshots else "") + f": {r['requests_fit']:,}",
        ]
        return "\n".join(lines)
