"""Tokenizer and chat-template handling, on top of the checkpoint folder's own tokenizer files."""
from __future__ import annotations

import functools
import os

import jinja2
from transformers import AutoTokenizer


def load_chat_template(template: str) -> str:
    """`--chat-template`: a file holding a Jinja template, or the template itself."""
    if os.path.isfile(template):
        with open(template, encoding='utf-8') as f:
            return f.read()
    if '{' not in template:
        raise ValueError(f'--chat-template {template!r} is neither a file nor a Jinja template')
    return template


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode table, which byte-level BPE vocabularies are written in."""
    printable = list(range(ord('!'), ord('~') + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _byte_decoder()


class Tokenizer:

    def __init__(self, model_path: str, chat_template: str | None = None):
        self._tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)
        if chat_template is not None:
            self._tok.chat_template = load_chat_template(chat_template)

    @property
    def hf_tokenizer(self):
        """The transformers tokenizer underneath."""
        return self._tok

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` behind a fast tokenizer (None for a slow one)."""
        return getattr(self._tok, 'backend_tokenizer', None)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a token may hold part of a UTF-8 character, which `decode` cannot show)."""
        token = self._tok.convert_ids_to_tokens(token_id)
        if token is None:
            return b''
        if token in self._added_tokens:
            return token.encode()
        if self._byte_level:
            return bytes(_BYTE_DECODER.get(ch, 0) for ch in token)
        if len(token) == 6 and token.startswith('<0x') and token.endswith('>'):  # sentencepiece byte fallback
            return bytes([int(token[3:5], 16)])
        return token.replace('\u2581', ' ').encode()

    @functools.cached_property
    def _added_tokens(self) -> frozenset[str]:
        return frozenset(str(t) for t in self._tok.get_added_vocab())

    @functools.cached_property
    def _byte_level(self) -> bool:
        backend = self.backend
        return backend is not None and 'ByteLevel' in repr(backend.decoder)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, 'chat_template', None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """Render `messages` (and `tools`, and template kwargs such as `enable_thinking`) with the model's template.

        A template that fails on the given messages (a `raise_exception` in it, or a type it cannot handle) is the
        request's fault: `ValueError`.
        """
        if not self.has_chat_template:
            return '\n'.join(str(m.get('content') or '') for m in messages)
        try:
            return self._tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **kwargs)
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f'the chat template cannot render these messages: {exc}') from exc

    def stop_sequences(self, stop_words: list[str] | None) -> tuple[tuple[int, ...], ...]:
        """Token-id sequences of the stop words (matched against the tail of generated ids)."""
        return tuple(tuple(self.encode(word, add_special_tokens=False)) for word in stop_words or () if word)
