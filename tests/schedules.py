"""Helpers shared by the kernel tests: random feeding schedules, request admission on non-zero slots, and
which pool bytes an entry write may touch."""

import random

import torch


def random_steps(seed, lengths, chunks, cap=None, capped_every=1):
    """Random steps feeding every request its full length: lists of (request number, new tokens). Every
    `capped_every`-th step holds at most `cap` tokens (None: no cap)."""
    rng = random.Random(seed)
    remaining, steps = list(lengths), []
    while any(remaining):
        capped = cap is not None and len(steps) % capped_every == capped_every - 1
        active = [i for i, r in enumerate(remaining) if r]
        step, room = [], cap if capped else sum(remaining)
        for i in rng.sample(active, rng.randint(1, len(active))):
            n = min(remaining[i], rng.choice(chunks), room)
            if n:
                step.append((i, n))
                remaining[i] -= n
                room -= n
        steps.append(step)
    return steps


def admit(cache, count):
    """Request ids on slots 1..count: slot 0 (a released dummy) must stay untouched."""
    dummy = cache.admit()
    rids = [cache.admit() for _ in range(count)]
    cache.release(dummy)
    return rids


def written_bytes(layout, entries, pages, slots):
    """bool [pages, page_bytes]: the data and scale bytes of the entries at `slots` (>= 0)."""
    mask = torch.zeros(pages, layout.page_bytes(entries), dtype=torch.bool)
    for slot in slots.tolist():
        page, off = divmod(slot, entries)
        mask[page, off * layout.data_bytes:(off + 1) * layout.data_bytes] = True
        base = entries * layout.data_bytes + off * layout.scale_bytes
        mask[page, base:base + layout.scale_bytes] = True
    return mask
