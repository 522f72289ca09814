"""A request's cache state on disk: `save_request` / `load_request` (docs/prefix-caching.md).

One safetensors file: the state's tensors under their names (`layers.<i>.<field>`), the token ids as `tokens`
(int64, when known), and in the metadata the format version, the sender's spec fields (`spec.<key>`), the length
and a sha256 checksum over the metadata and every tensor's name, dtype, shape and bytes in name order. A file that
safetensors cannot parse (truncated, a damaged header) or whose checksum does not match is refused with
ValueError before a `RequestState` exists, so nothing is ever half-loaded into a cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .transfer import RequestState

__all__ = ["save_request", "load_request", "FORMAT"]

FORMAT = "dsv4kv.request-state/1"
_TOKENS = "tokens"


def _checksum(meta: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> str:
    digest = hashlib.sha256(json.dumps(dict(meta), sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"\n{name} {t.dtype} {list(t.shape)}\n".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def save_request(state: RequestState, path: str | os.PathLike) -> None:
    """Write `state` (from `CacheManager.export_request`) to a safetensors file at `path`, replacing it whole."""
    if not isinstance(state, RequestState):
        raise TypeError(f"state: expected a RequestState, got {type(state).__name__}")
    if state.first_block:
        raise ValueError(f"state: its first {state.first_block} blocks were left out (a receiver's cached prefix); "
                         f"a file holds every block: export it with skip_tokens=0")
    tensors = {name: t.detach().cpu().contiguous() for name, t in state.tensors.items()}
    if _TOKENS in tensors:
        raise ValueError(f"state: a tensor named {_TOKENS!r} clashes with the token ids")
    if state.tokens is not None:
        tensors[_TOKENS] = state.tokens.detach().cpu().to(torch.int64).contiguous()
    meta = {"format": FORMAT, "length": str(state.length), **{f"spec.{k}": v for k, v in state.spec.items()}}
    meta["checksum"] = _checksum(meta, tensors)
    path = os.fspath(path)
    partial = f"{path}.partial-{os.getpid()}"
    try:  # a write that stops midway leaves no file under `path` (an older one there stays whole)
        save_file(tensors, partial, metadata=meta)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def load_request(path: str | os.PathLike) -> RequestState:
    """The `RequestState` saved at `path`; ValueError if the file is not one, is truncated or corrupted (its
    checksum does not match). Geometry and formats are checked by `CacheManager.import_request`."""
    path = os.fspath(path)
    try:
        with safe_open(path, framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path}: not a readable request-state file (truncated or corrupted?): {e}") from e
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: expected a {FORMAT} file, its metadata says format {meta.get('format')!r}")
    want = meta.pop("checksum", None)
    if want != _checksum(meta, tensors):
        raise ValueError(f"{path}: checksum mismatch: the file is corrupted")
    length = meta.get("length", "")
    if not length.isdigit():
        raise ValueError(f"{path}: length {length!r} is not a token count")
    spec = {k[len("spec."):]: v for k, v in meta.items() if k.startswith("spec.")}
    tokens = tensors.pop(_TOKENS, None)
    return RequestState(spec=spec, length=int(length), tokens=tokens, tensors=tensors)
