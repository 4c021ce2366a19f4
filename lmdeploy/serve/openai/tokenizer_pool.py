"""`TokenizerPool`: prompt preparation (chat template, tokenization, checks) off the event loop, in bounded threads.

Two lanes, so that a small request never waits behind large ones: prompts of at most `SMALL_PROMPT_CHARS`
characters run on one dedicated thread; larger ones on `workers` threads. Both are bounded, so N large prompts use
at most `workers` cores, however many arrive (the rest wait in the lane's queue, and admission control bounds how
many requests wait at all). The `tokenizers` library releases the GIL while it encodes, so the event loop keeps
serving (/health included) while a lane works.
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar('T')
SMALL_PROMPT_CHARS = 16_384


class TokenizerPool:

    def __init__(self, workers: int):
        self._small = ThreadPoolExecutor(1, thread_name_prefix='lmdeploy-tokenize-small')
        self._large = ThreadPoolExecutor(workers, thread_name_prefix='lmdeploy-tokenize')

    async def run(self, size: int, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on the lane for a prompt of `size` characters."""
        lane = self._small if size <= SMALL_PROMPT_CHARS else self._large
        return await asyncio.get_running_loop().run_in_executor(lane, functools.partial(fn, *args))


def prompt_chars(prompt) -> int:
    """Characters a prompt makes the tokenizer read (token ids count one each)."""
    if isinstance(prompt, str):
        return len(prompt)
    total = 0
    for item in prompt:
        if isinstance(item, dict):
            content = item.get('content')
            total += len(content) if isinstance(content, str) else sum(
                len(part.get('text', '')) for part in content or () if isinstance(part, dict))
        else:
            total += 1
    return total
