"""A served request's cache to a file and back (docs/engine.md, "Saving a request's cache"): what `Engine.save` and
`Engine.add_request(..., cache_file=path)` do, on top of `CacheManager.export_request` / `import_request` and
`cache.files.save_request` / `load_request`.

A file the engine writes holds the request's cache state and the ids of exactly the tokens that state holds (the
first `length` of prompt + generated). A file is read and checked in full when the request is added (readable,
checksum, spec, every tensor's shape, its tokens a prefix of the prompt that leaves a token to feed), so a refused
file changes nothing; the scheduler imports the checked state when it admits the request.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch

from ..cache.files import load_request
from ..cache.manager import CacheManager, RequestError
from ..cache.transfer import RequestState, check_state, token_array
from .request import Request, Status

__all__ = ["request_state", "state_to_save", "state_for_prompt", "checked_for_prompt"]


def request_state(cache: CacheManager, request: Request) -> RequestState:
    """The running request's cache state (a host copy), with the ids of the tokens it holds."""
    state = cache.export_request(request.cache_id)
    return dataclasses.replace(state, tokens=torch.tensor(request.tokens[:state.length], dtype=torch.int64))


def state_to_save(cache: CacheManager, request: Request) -> RequestState:
    """What `Engine.save` writes for `request`: its state now if it runs, the state kept when it finished (added
    with keep_cache=True); RequestError when it holds nothing to save."""
    if request.status is Status.FINISHED:
        if request.kept_state is None:
            raise RequestError(f"request {request.id} has finished and its cache was released; add it with "
                               f"keep_cache=True to save it after it finishes")
        return request.kept_state
    if request.status is Status.SWAPPED:
        raise RequestError(f"request {request.id} is swapped out to host memory; save it once it runs again")
    if request.status is not Status.RUNNING or request.num_computed == 0:
        raise RequestError(f"request {request.id} has nothing cached yet (waiting for admission)")
    return request_state(cache, request)


def state_for_prompt(cache: CacheManager, path: str | os.PathLike, prompt: tuple[int, ...]) -> RequestState:
    """The state saved at `path`, checked against `cache` and `prompt` (`checked_for_prompt`). ValueError naming the
    file if it is unreadable or corrupted too."""
    name = os.fspath(path)
    return checked_for_prompt(cache, load_request(name), prompt, name)  # load_request names the file in its errors


def checked_for_prompt(cache: CacheManager, state: RequestState, prompt: tuple[int, ...], name: str) -> RequestState:
    """`state` checked against `cache` and `prompt`, its token ids cut to the tokens it holds. ValueError (naming
    `name`) if it is of another geometry or format, holds no token ids, or its tokens are not a prefix of the prompt
    that leaves at least one prompt token to feed."""
    try:
        check_state(state, cache.pools, max_seq_len=cache.max_seq_len)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from e
    if state.first_block:
        raise ValueError(f"{name}: its first {state.first_block} blocks are left out; an engine takes whole states")
    ids = token_array(state)
    if ids is None:
        raise ValueError(f"{name}: holds no token ids (saved without them), so it cannot be matched to a prompt")
    n = min(len(ids), len(prompt))
    differ = np.flatnonzero(ids[:n] != np.asarray(prompt[:n], dtype=np.int64))
    if differ.size or len(ids) > len(prompt):
        where = (f"differs at token {differ[0]}" if differ.size
                 else f"holds {len(ids)} token ids, the prompt {len(prompt)}")
        raise ValueError(f"{name}: its token ids are not a prefix of the prompt ({where})")
    if state.length >= len(prompt):
        raise ValueError(f"{name}: caches all {len(prompt)} prompt tokens; the prompt must extend them by at least "
                         f"one token (its logits give the first new token)")
    return dataclasses.replace(state, tokens=torch.tensor(prompt[:state.length], dtype=torch.int64))
