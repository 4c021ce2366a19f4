"""Incremental detokenization and stop strings, linear in the output length.

`IncrementalDetokenizer` turns one request's token ids, as they arrive, into text deltas:
- decoding is the `tokenizers` library's streaming decoder (`DecodeStream`): each token costs O(1) (the decoder
  keeps a small window), and a token that ends inside a UTF-8 character yields nothing until it is complete;
- stop strings are matched on the decoded text, across token boundaries (`StopStringMatcher`). Text that may be
  the start of a stop string is held back, never sent; once a stop string is complete the text before it is the
  last delta and `stopped` is set, and the caller ends the request there.

Invariant: the concatenation of all deltas equals the decoded text, cut before the first stop string (held text
is flushed by `final=True`, when the engine ended the request for another reason).
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

from .tokenizer import Tokenizer


class StopStringMatcher:
    """Finds the first stop string in a text stream, holding back any suffix that may begin one."""

    def __init__(self, stop_words: list[str] | None):
        self.stop_words = [w for w in stop_words or () if w]
        self.pending = ''  # text after the last emitted character: shorter than the longest stop string
        self.stopped = False

    def _held_len(self) -> int:
        held = 0
        for word in self.stop_words:
            for n in range(min(len(word) - 1, len(self.pending)), held, -1):
                if self.pending.endswith(word[:n]):
                    held = n
                    break
        return held

    def feed(self, text: str, final: bool = False) -> str:
        """The text that is now safe to emit."""
        if self.stopped:
            return ''
        if not self.stop_words:
            return text
        self.pending += text
        # an occurrence cannot start in emitted text (its start would have been held), so search `pending` only
        cuts = [i for i in (self.pending.find(w) for w in self.stop_words) if i >= 0]
        if cuts:
            out, self.pending, self.stopped = self.pending[:min(cuts)], '', True
            return out
        keep = 0 if final else self._held_len()
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out


class IncrementalDetokenizer:
    """Decodes one request's tokens as they arrive; `update` takes the new ids and returns the new text."""

    def __init__(self, tokenizer: Tokenizer, stop_words: list[str] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._backend is not None else None
        self._ids: list[int] = []  # only for tokenizers without a `tokenizers` backend
        self._text = ''
        self.stop = StopStringMatcher(stop_words)
        self.num_tokens = 0  # tokens consumed; when `stopped`, the token that completed the stop string is last

    @property
    def stopped(self) -> bool:
        return self.stop.stopped

    def _decode(self, token_id: int) -> str:
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ''
        self._ids.append(token_id)  # fallback (slow tokenizers): a full decode, quadratic but correct
        full = self.tokenizer.decode(self._ids).rstrip('\ufffd')
        delta, self._text = (full[len(self._text):], full) if full.startswith(self._text) else ('', self._text)
        return delta

    def update(self, new_token_ids: list[int], final: bool = False) -> str:
        """Text of `new_token_ids` that is safe to send; after a stop string, '' and the rest is not consumed."""
        out = []
        for token_id in new_token_ids:
            if self.stopped:
                break
            self.num_tokens += 1
            out.append(self.stop.feed(self._decode(token_id)))
        if final and not self.stopped:
            out.append(self.stop.feed('', final=True))
        return ''.join(out)
