"""Checks of a request before anything is queued: its prompt tokens, its image spans against the model's patch grid,
its adapter name. Each raises `ValueError` (a message for that request only) and touches no engine state; the
engine runs them in the caller's thread (`Engine.add_request`, and the serve layer before it builds a request).
"""
from __future__ import annotations

import struct

import numpy as np

from ...messages import UnknownAdapterError
from ..messages import MultiModalSpan
from ..models.lora_placement import ResidentAdapter
from .mm_inputs import validate_mm_spans

# The most reply tokens a prompt's int64 array keeps room for (`prompt_array`'s `room`, 32 KiB; the engine gives no
# more room than the prompt's own length either, so a queue of short prompts holds at most twice their bytes, as the
# doubling would): appends past it grow the array by doubling, one copy of the prompt per doubling.
REPLY_ROOM = 4096


def check_prompt(token_ids: list[int], vocab_size: int, session_len: int) -> None:
    """Non-empty, every id an int in `[0, vocab_size)`, and room left for one generated token."""
    prompt_array(token_ids, vocab_size, session_len)


def prompt_array(token_ids: list[int], vocab_size: int, session_len: int, room: int = 0) -> np.ndarray:
    """`check_prompt`'s checks; returns the prompt as a new int64 array (the conversion the checks make, so that
    the engine need not convert the list again), `room` entries longer than the prompt: the room past it is left
    uninitialised, for the reply's tokens to be appended without copying the prompt (`adopt_token_array`). The
    conversion packs the list into the array with `struct` (format `q`), which takes exactly the values with
    `__index__` (ints, bools, numpy integers) and raises on anything else, in one C pass: on a 2-core x86 machine
    32,800 tokens take 0.60 ms, against 1.26 ms for `array.array('q', ...)` timed in the same process
    (`docs/benchmarks.md`, host work per step)."""
    n = len(token_ids)
    if n == 0:
        raise ValueError('the prompt is empty')
    ids = np.empty(n + max(room, 0), dtype=np.int64)
    try:  # one C pass over the list; the Python loop below only runs on bad input
        struct.pack_into(f'{n}q', ids, 0, *token_ids)
        fast = bool(ids[:n].min() >= 0 and ids[:n].max() < vocab_size)
    except struct.error:
        fast = False
    bad = [] if fast else [t for t in token_ids if not isinstance(t, int) or t < 0 or t >= vocab_size]
    if bad:
        raise ValueError(f'token ids out of the vocabulary [0, {vocab_size}): {bad[:8]}')
    if n >= session_len:
        raise ValueError(f'the prompt has {n} tokens; session_len is {session_len} '
                         '(the prompt must leave room for at least one generated token)')
    if not fast:
        ids[:n] = np.fromiter(token_ids, np.int64, n)
    return ids


def check_image_spans(model, token_ids: list[int], mm_spans: tuple[MultiModalSpan, ...],
                      image_token_id: int | None) -> None:
    """The spans' placement (`mm_inputs.validate_mm_spans`), and each span as long as its patch grid encodes to."""
    validate_mm_spans(token_ids, mm_spans, image_token_id)
    for span in mm_spans:
        if model.num_image_tokens(span.data.grid_thw) != span.end - span.start:
            raise ValueError(f'image span [{span.start}, {span.end}) does not match its patch grid '
                             f'{span.data.grid_thw}')


def adapter_identity(adapters: dict[str, ResidentAdapter], adapter_name: str | None) -> str | None:
    """The prefix-cache identity of a resident adapter (None: the base model); `UnknownAdapterError` (a
    `ValueError`) for an unknown name."""
    if adapter_name is None:
        return None
    adapter = adapters.get(adapter_name)
    if adapter is None:
        raise UnknownAdapterError(f'unknown adapter {adapter_name!r}; loaded adapters: {sorted(adapters)}')
    return adapter.identity
