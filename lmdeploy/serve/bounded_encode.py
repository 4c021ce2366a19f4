"""Tokenizing a prompt whose length is bounded: a prompt far over the limit is refused after counting about twice
the limit's worth of tokens, never after tokenizing all of it.

Long texts are counted piece by piece first. Pieces are cut just before a space that follows a non-space, which is
a pre-tokenization boundary of byte-level BPE tokenizers (Qwen, GPT-2 style), so the pieces' counts add up to the
whole text's count (up to normalizer effects at a cut). Counting stops as soon as the sum is beyond twice the
limit plus a margin; a text under that bound is then encoded whole, exactly, and the caller checks the exact
length (`Engine.validate_prompt`). The cost is bounded by the limit, not by the text.
"""
from __future__ import annotations

from collections.abc import Iterator

from .tokenizer import Tokenizer

PIECE_CHARS = 16_384  # texts up to this many characters are encoded at once (~15 ms)
_CUT_SEARCH = 1_024   # how far back from a piece's end a cut point is searched for
_MARGIN = 1_024


class PromptTooLong(ValueError):
    pass


def encode_within(tokenizer: Tokenizer, text: str, max_tokens: int, add_special_tokens: bool = True) -> list[int]:
    """`tokenizer.encode(text)`, or `PromptTooLong` once the text is known to have far more than `max_tokens`."""
    if len(text) > PIECE_CHARS:
        bound, counted = 2 * max_tokens + _MARGIN, 0
        for piece in _pieces(text):
            counted += len(tokenizer.encode(piece, add_special_tokens=False))
            if counted > bound:
                raise PromptTooLong(f'the prompt has more than {counted} tokens; session_len is {max_tokens + 1} '
                                    '(the prompt must leave room for at least one generated token)')
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _pieces(text: str) -> Iterator[str]:
    start = 0
    while start < len(text):
        end = min(start + PIECE_CHARS, len(text))
        if end < len(text):
            for cut in range(end, max(end - _CUT_SEARCH, start + 1), -1):
                if text[cut] == ' ' and not text[cut - 1].isspace():
                    end = cut
                    break
        yield text[start:end]
        start = end
