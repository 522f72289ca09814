"""A served request's cache saved to a file and loaded into an engine (issue 39: `Engine.save`,
`add_request(..., cache_file=path)`) on the tiny three-layer model, CPU, 128-token blocks: the greedy tokens after a
load equal those of an engine that prefilled the whole prompt, `cached_tokens` counts the file's tokens, and a file
of another format, corrupted, truncated, without token ids or not a prefix of the prompt is refused with nothing
queued or allocated."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from dsv4kv import RequestError
from dsv4kv.cache import load_request, save_request
from dsv4kv.engine import SamplingParams

from test_engine import EXACT, engine, prompts

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def whole(prompt: tuple[int, ...], new_tokens: int, **kw) -> tuple[int, ...]:
    """Greedy tokens of an engine that prefilled the whole prompt."""
    return engine(**dict(kw)).generate([list(prompt)], SamplingParams(max_new_tokens=new_tokens))[0].token_ids


def run_until(e, request_id: int, generated: int) -> None:
    while len(e._requests[request_id].tokens) - len(e._requests[request_id].prompt) < generated:
        e.step()


def state_of(e) -> tuple:
    """What adding a request could change."""
    c = e.cache
    return (len(e._requests), e._next_id, len(e.scheduler.waiting), len(e.scheduler.running), c.num_free_blocks,
            c.num_live_requests, e.has_unfinished)


def test_a_document_saved_after_it_finished_is_loaded_under_a_question(tmp_path):
    """The document's request ends after one token (keep_cache=True); a new prompt = document + its token + a
    question starts from the file: only the question is prefilled, the tokens equal a whole prefill."""
    document, question = prompts((300, 45), seed=51)
    sender = engine()
    rid = sender.add_request(document, SamplingParams(max_new_tokens=1), keep_cache=True)
    while sender.has_unfinished:
        sender.step()
    sender.save(rid, tmp_path / "doc.safetensors")
    first = sender.output(rid).token_ids
    assert sender.cache.num_used_blocks == 0  # the kept copy is on the host; the blocks were released
    state = load_request(tmp_path / "doc.safetensors")
    assert state.length == 300 and state.tokens.tolist() == document

    prompt = document + list(first) + question
    receiver = engine()
    got = receiver.add_request(prompt, SamplingParams(max_new_tokens=7), cache_file=tmp_path / "doc.safetensors")
    while receiver.has_unfinished:
        receiver.step()
    out = receiver.output(got)
    assert out.cached_tokens == 300 and receiver.stats.prefill_tokens == len(prompt) - 300
    assert out.token_ids == whole(tuple(prompt), 7)


@pytest.mark.parametrize("prefix_caching,kv", [(False, "exact"), (True, "exact"), (False, "fp8")],
                         ids=["caching-off", "receiver-caching-on", "fp8-mxfp4"])
def test_a_running_request_saved_mid_decode_continues_elsewhere(tmp_path, prefix_caching, kv):
    """Saved after 3 of 9 tokens; the receiver (busy with another request) continues prompt + those 3 tokens and
    gives the sender's last 6, which are those of a whole prefill."""
    formats = EXACT if kv == "exact" else dict(kv_format="fp8", indexer_format="mxfp4")
    prompt, other = prompts((211, 140), seed=52)
    sender = engine(**formats)
    rid = sender.add_request(prompt, SamplingParams(max_new_tokens=9))
    run_until(sender, rid, 3)
    sender.save(rid, tmp_path / "r.safetensors")
    while sender.has_unfinished:
        sender.step()
    want = sender.output(rid).token_ids
    assert want == whole(tuple(prompt), 9, **formats)

    receiver = engine(prefix_caching=prefix_caching, **formats)
    busy = receiver.add_request(other, SamplingParams(max_new_tokens=4))
    receiver.step()
    got = receiver.add_request(prompt + list(want[:3]), SamplingParams(max_new_tokens=6),
                               cache_file=tmp_path / "r.safetensors")
    while receiver.has_unfinished:
        receiver.step()
    out = receiver.output(got)
    assert out.cached_tokens == len(prompt) + 2  # the last sampled token was not fed yet when it was saved
    assert out.token_ids == want[3:]
    assert receiver.output(busy).token_ids == whole(tuple(other), 4, **formats)
    assert receiver.cache.num_used_blocks == 0 and receiver.cache.num_live_requests == 0


def test_save_refuses_what_holds_no_cache(tmp_path):
    e = engine(max_requests=1, step_tokens=64)
    first = e.add_request(prompts((100,), seed=53)[0], SamplingParams(max_new_tokens=2))
    waiting = e.add_request(prompts((30,), seed=54)[0], SamplingParams(max_new_tokens=1))
    e.step()  # the first request's first chunk; the second waits for the slot
    e.save(first, tmp_path / "mid-prefill.safetensors")  # mid-prefill: its 64 tokens
    assert load_request(tmp_path / "mid-prefill.safetensors").length == 64
    with pytest.raises(RequestError, match="nothing cached yet"):
        e.save(waiting, tmp_path / "x")
    with pytest.raises(RequestError, match="unknown request id 99"):
        e.save(99, tmp_path / "x")
    while e.has_unfinished:
        e.step()
    with pytest.raises(RequestError, match="finished and its cache was released; add it with keep_cache=True"):
        e.save(first, tmp_path / "x")
    e.output(first)
    with pytest.raises(RequestError, match="unknown request id"):
        e.save(first, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(TypeError, match="keep_cache: expected a bool"):
        e.add_request([1, 2], keep_cache=1)


def test_an_aborted_request_with_keep_cache_can_be_saved(tmp_path):
    prompt = prompts((150,), seed=55)[0]
    e = engine()
    rid = e.add_request(prompt, SamplingParams(max_new_tokens=20), keep_cache=True)
    run_until(e, rid, 2)
    e.abort(rid)
    e.save(rid, tmp_path / "a.safetensors")
    state = load_request(tmp_path / "a.safetensors")
    assert state.length == 151 and state.tokens.tolist() == prompt + [e.output(rid).token_ids[0]]


# --- refusals ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple:
    """A file of a 203-token prompt's state after 2 generated tokens (204 tokens held), and the prompt it holds."""
    path = tmp_path_factory.mktemp("files") / "r.safetensors"
    prompt = prompts((203,), seed=56)[0]
    e = engine()
    rid = e.add_request(prompt, SamplingParams(max_new_tokens=5))
    run_until(e, rid, 2)
    e.save(rid, path)
    return path, prompt + list(e._requests[rid].tokens[203:204])


def damaged(tmp_path, path, how: str):
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    if how == "flip-data":
        data[header + (len(data) - header) // 3] ^= 0x10
    elif how == "truncate":
        del data[len(data) // 2:]
    out = tmp_path / f"{how}.safetensors"
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("case,says", [
    ("another-format", r"kv_format: bf16 in the state, fp8 here"),
    ("another-page", r"page_tokens: 128 in the state, 256 here"),
    ("flip-data", "checksum mismatch"),
    ("truncate", "truncated or corrupted"),
    ("missing", "not a readable request-state file"),
    ("not-a-prefix", r"not a prefix of the prompt \(differs at token 17\)"),
    ("longer-than-prompt", r"not a prefix of the prompt \(holds 204 token ids, the prompt 150\)"),
    ("whole-prompt", "caches all 204 prompt tokens; the prompt must extend them"),
    ("no-token-ids", "holds no token ids"),
])
def test_a_bad_file_is_refused_with_nothing_queued_or_allocated(tmp_path, saved, case, says):
    path, held = saved
    prompt = held + [5, 6, 7]
    kw = {}
    if case == "another-format":
        kw = dict(kv_format="fp8", indexer_format="bf16")
    elif case == "another-page":
        kw = dict(page_tokens=256)
    elif case in ("flip-data", "truncate"):
        path = damaged(tmp_path, path, case)
    elif case == "missing":
        path = tmp_path / "nothing-here.safetensors"
    elif case == "not-a-prefix":
        prompt = held[:17] + [(held[17] + 1) % 512] + held[18:] + [5]
    elif case == "longer-than-prompt":
        prompt = held[:150]
    elif case == "whole-prompt":
        prompt = held
    elif case == "no-token-ids":
        state = load_request(path)
        path = tmp_path / "bare.safetensors"
        save_request(dataclasses.replace(state, tokens=None), path)
    e = engine(**kw)
    busy = e.add_request(prompts((40,), seed=57)[0], SamplingParams(max_new_tokens=3))
    e.step()
    before = state_of(e)
    with pytest.raises(ValueError, match=says) as info:
        e.add_request(prompt, SamplingParams(max_new_tokens=2), cache_file=path)
    assert str(path) in str(info.value)
    assert state_of(e) == before
    while e.has_unfinished:
        e.step()
    assert e.output(busy).finished


def test_a_file_from_the_cache_manager_with_token_ids_loads(tmp_path, saved):
    """A state exported by a CacheManager (prefix caching on, so it carries its ids) is a cache file too; its ids may
    run past its length (a token recorded, not fed yet)."""
    path, held = saved
    state = load_request(path)
    ids = state.tokens.tolist() + [9]  # the next prompt token, recorded with the state
    extra = tmp_path / "extra.safetensors"
    save_request(dataclasses.replace(state, tokens=state.tokens.new_tensor(ids)), extra)
    e = engine(prefix_caching=True)
    rid = e.add_request(held + [9, 10], SamplingParams(max_new_tokens=3), cache_file=extra)
    while e.has_unfinished:
        e.step()
    out = e.output(rid)
    assert out.cached_tokens == 204 and out.token_ids == whole(tuple(held + [9, 10]), 3)


def test_a_state_in_memory_starts_a_request_as_its_file_would(tmp_path):
    """add_request(cache_state=) takes what export gives (or cache.distributed receives), checked as a file's state;
    cache_request_id names the running request's pages in the cache."""
    document, question = prompts((200, 21), seed=57)
    sender = engine()
    rid = sender.add_request(document, SamplingParams(max_new_tokens=3))
    run_until(sender, rid, 1)  # the document prefilled, its first token drawn
    with pytest.raises(RequestError, match="unknown request id 7"):
        sender.cache_request_id(7)
    state = sender.export(rid)
    assert state.length == 200 and state.tokens.tolist() == document
    assert sender.cache.export_request(sender.cache_request_id(rid)).length == 200

    prompt = document + question
    receiver = engine()
    before = state_of(receiver)
    with pytest.raises(ValueError, match="cache_file and cache_state: give one of them"):
        receiver.add_request(prompt, cache_file=tmp_path / "x", cache_state=state)
    with pytest.raises(TypeError, match="cache_state: expected a RequestState, got dict"):
        receiver.add_request(prompt, cache_state={})
    with pytest.raises(ValueError, match="cache_state: its token ids are not a prefix of the prompt"):
        receiver.add_request(question + document, cache_state=state)
    assert state_of(receiver) == before
    got = receiver.add_request(prompt, SamplingParams(max_new_tokens=5), cache_state=state)
    with pytest.raises(RequestError, match=f"request {got} holds no cache now \\(waiting\\)"):
        receiver.cache_request_id(got)
    while receiver.has_unfinished:
        receiver.step()
    out = receiver.output(got)
    assert out.cached_tokens == 200 and out.token_ids == whole(tuple(prompt), 5)
