"""Byte layouts of cache entries and pages: the contract other systems can read (docs/layout.md).

A pool is a uint8 tensor `[num_pages, page_bytes]`. A page of P entries stores the P data rows first,
then the P scale rows, then zero padding up to a multiple of `page_align` bytes:

    | data row 0 | data row 1 | ... | data row P-1 | scale row 0 | ... | scale row P-1 | pad |

Slot `s` addresses entry `s % P` of page `s // P`; slot -1 means "no entry" (writes skip it, reads
return NaN). Layouts:

- `fp8` main entry (FlashMLA "MODEL1"): data = nope e4m3 | rope bf16 (576 B for V4), scale = one ue8m0
  byte per 64 nope dims, zero-padded to 8 (7 + 1 B for V4), page padded to a multiple of the data row.
- `bf16` main entry: the 512-d kv vector in bf16 (1024 B), no scales: the exact mode.
- `fp8` indexer key (DeepGEMM): 128 e4m3 | one fp32 scale (132 B), Hadamard-rotated.
- `mxfp4` indexer key: 64 B packed e2m1 | 4 ue8m0 bytes (68 B), Hadamard-rotated (the official numerics).
- `bf16` indexer key: 128 bf16 (256 B), unrotated: the exact mode (what transformers computes).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from . import quant

__all__ = ["KVFormat", "IndexerFormat", "EntryLayout", "main_layout", "indexer_layout"]


class KVFormat(str, enum.Enum):
    FP8 = "fp8"
    BF16 = "bf16"

    @classmethod
    def _missing_(cls, value):
        _refuse_format("kv_format", cls, value)


class IndexerFormat(str, enum.Enum):
    MXFP4 = "mxfp4"
    FP8 = "fp8"
    BF16 = "bf16"

    @classmethod
    def _missing_(cls, value):
        _refuse_format("indexer_format", cls, value)


def _refuse_format(name: str, formats: type[enum.Enum], value) -> None:
    # enum raises this ValueError in place of its own "'fp4' is not a valid KVFormat", which lists nothing
    valid = ", ".join(repr(f.value) for f in formats)
    raise ValueError(f"{name}: expected one of {valid}, got {value!r}")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """[N, k] tensor of any dtype -> its little-endian bytes [N, k * itemsize] (a view)."""
    return x.contiguous().view(torch.uint8)


@dataclass(frozen=True)
class EntryLayout:
    """One entry format: `encode` turns [N, dim] floats into data/scale rows, `decode` turns them back.

    The base class is the plain bf16 format (no scales); subclasses quantize.
    """

    name: str
    dim: int
    data_bytes: int
    scale_bytes: int = 0
    page_align: int = 1
    rotated: bool = False  # keys stored in the Hadamard basis: queries must be rotated the same way

    @property
    def entry_bytes(self) -> int:
        return self.data_bytes + self.scale_bytes

    def page_bytes(self, entries: int) -> int:
        return _round_up(entries * self.entry_bytes, self.page_align)

    # --- encoding (per entry) -----------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, dim] -> (data uint8 [N, data_bytes], scales uint8 [N, scale_bytes])."""
        return _as_bytes(x.to(torch.bfloat16)), x.new_empty((x.shape[0], 0), dtype=torch.uint8)

    def decode(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Inverse of `encode`: fp32 [N, dim]."""
        return data.contiguous().view(torch.bfloat16).float()

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, dim] -> fp32 [N, dim]: exactly what a read of x written in this format returns."""
        return self.decode(*self.encode(x))

    # --- pages -----------------------------------------------------------------------------------
    def page_views(self, pool: torch.Tensor, entries: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of a pool [pages, page_bytes] as data rows [pages, P, data_bytes] and scale rows [pages, P, scale_bytes]."""
        expected = self.page_bytes(entries)
        if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != expected:
            raise ValueError(f"pool: expected uint8 [pages, {expected}] ({self.name}, {entries} entries/page), "
                             f"got {pool.dtype} {list(pool.shape)}")
        if not pool.is_contiguous():
            raise ValueError("pool: must be contiguous (a copy would swallow in-place writes)")
        split = entries * self.data_bytes
        data = pool[:, :split].view(pool.shape[0], entries, self.data_bytes)
        scales = pool[:, split:split + entries * self.scale_bytes].view(pool.shape[0], entries, self.scale_bytes)
        return data, scales

    def write(self, pool: torch.Tensor, entries: int, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Encode x [N, dim] (float) into the pool at slots [N] (int); slot -1 rows are skipped."""
        if x.dim() != 2 or x.shape[1] != self.dim or not x.is_floating_point():
            raise ValueError(f"write: expected float x [N, {self.dim}], got {x.dtype} {list(x.shape)}")
        data_rows, scale_rows = self.page_views(pool, entries)
        _check_slots(slots, x.shape[0], pool)
        if x.device != pool.device:
            raise ValueError(f"write: x on {x.device}, pool on {pool.device}")
        keep = slots >= 0
        slots, x = slots[keep].long(), x[keep]
        if slots.numel() and int(slots.max()) >= pool.shape[0] * entries:
            raise ValueError(f"write: slot {int(slots.max())} beyond the pool's {pool.shape[0] * entries} entries")
        data, scales = self.encode(x)
        page, offset = slots // entries, slots % entries
        data_rows[page, offset] = data
        scale_rows[page, offset] = scales

    def read(self, pool: torch.Tensor, entries: int, slots: torch.Tensor) -> torch.Tensor:
        """Decode the entries at slots [N] -> fp32 [N, dim]; slot -1 rows are NaN."""
        data_rows, scale_rows = self.page_views(pool, entries)
        _check_slots(slots, slots.shape[0] if slots.dim() == 1 else -1, pool)
        if slots.numel() and int(slots.max()) >= pool.shape[0] * entries:
            raise ValueError(f"read: slot {int(slots.max())} beyond the pool's {pool.shape[0] * entries} entries")
        valid = slots >= 0
        index = torch.where(valid, slots, torch.zeros_like(slots)).long()
        page, offset = index // entries, index % entries
        out = self.decode(data_rows[page, offset], scale_rows[page, offset])
        return torch.where(valid.unsqueeze(-1), out, torch.full_like(out, float("nan")))


@dataclass(frozen=True)
class MainFP8Layout(EntryLayout):
    """FlashMLA MODEL1: nope e4m3 with a ue8m0 scale per 64 dims, rope bf16, scale row padded to 8 B."""

    rope_dim: int = 64

    @property
    def nope_dim(self) -> int:
        return self.dim - self.rope_dim

    def encode(self, x):
        q, scale = quant.quantize_fp8(x[:, :self.nope_dim], 64)
        data = torch.cat((q.view(torch.uint8), _as_bytes(x[:, self.nope_dim:].to(torch.bfloat16))), dim=1)
        scales = torch.zeros((x.shape[0], self.scale_bytes), dtype=torch.uint8, device=x.device)
        scales[:, :scale.shape[1]] = quant.ue8m0_encode(scale)
        return data, scales

    def decode(self, data, scales):
        n_scales = self.nope_dim // 64
        nope = quant.dequantize_fp8(data[:, :self.nope_dim].contiguous().view(torch.float8_e4m3fn),
                                    quant.ue8m0_decode(scales[:, :n_scales]), 64)
        rope = data[:, self.nope_dim:].contiguous().view(torch.bfloat16).float()
        return torch.cat((nope, rope), dim=1)


@dataclass(frozen=True)
class IndexerFP8Layout(EntryLayout):
    """DeepGEMM paged indexer keys: e4m3 values, one fp32 power-of-two scale per key."""

    def encode(self, x):
        q, scale = quant.quantize_fp8(_rotate(x), self.dim)
        return q.view(torch.uint8), _as_bytes(scale)

    def decode(self, data, scales):
        return quant.dequantize_fp8(data.contiguous().view(torch.float8_e4m3fn),
                                    scales.contiguous().view(torch.float32), self.dim)


@dataclass(frozen=True)
class IndexerMXFP4Layout(EntryLayout):
    """MXFP4 indexer keys: packed e2m1 pairs, one ue8m0 scale per 32 values."""

    def encode(self, x):
        packed, scale = quant.quantize_mxfp4(_rotate(x), 32)
        return packed, quant.ue8m0_encode(scale)

    def decode(self, data, scales):
        return quant.dequantize_mxfp4(data, quant.ue8m0_decode(scales), 32)


def _check_slots(slots: torch.Tensor, n: int, pool: torch.Tensor) -> None:
    if slots.dtype not in (torch.int32, torch.int64) or slots.shape != (n,) or slots.device != pool.device:
        raise ValueError(f"slots: expected int32/int64 [{n}] on {pool.device}, "
                         f"got {slots.dtype} {list(slots.shape)} on {slots.device}")


def _rotate(x: torch.Tensor) -> torch.Tensor:
    # The official indexer rotates bf16 activations to bf16 before quantizing; round the same way.
    return quant.hadamard_rotate(x).to(torch.bfloat16)


def main_layout(kv_format: KVFormat | str, head_dim: int, rope_dim: int) -> EntryLayout:
    """The main-entry layout (window ring and compressed entries) for a kv format."""
    kv_format = KVFormat(kv_format)
    if kv_format is KVFormat.BF16:
        return EntryLayout("bf16", head_dim, data_bytes=2 * head_dim)
    nope = head_dim - rope_dim
    if nope <= 0 or nope % 64:
        raise ValueError(f"kv_format 'fp8': nope dims (head_dim - rope dims = {nope}) must be a positive multiple of 64")
    data_bytes = nope + 2 * rope_dim
    return MainFP8Layout("fp8", head_dim, data_bytes=data_bytes, scale_bytes=_round_up(nope // 64, 8),
                         page_align=data_bytes, rope_dim=rope_dim)


def indexer_layout(indexer_format: IndexerFormat | str, dim: int) -> EntryLayout:
    """The indexer-key layout for a CSA layer's keys of `dim` (index_head_dim) values."""
    indexer_format = IndexerFormat(indexer_format)
    if indexer_format is IndexerFormat.BF16:
        return EntryLayout("bf16", dim, data_bytes=2 * dim)
    if dim & (dim - 1) or dim < 32:
        raise ValueError(f"indexer_format {indexer_format.value!r}: index_head_dim must be a power of two >= 32 "
                         f"(Hadamard rotation, 32-value MX blocks), got {dim}")
    if indexer_format is IndexerFormat.FP8:
        return IndexerFP8Layout("fp8", dim, data_bytes=dim, scale_bytes=4, rotated=True)
    return IndexerMXFP4Layout("mxfp4", dim, data_bytes=dim // 2, scale_bytes=dim // 32, rotated=True)
