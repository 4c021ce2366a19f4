"""Tokenizer and chat-template handling, on top of the checkpoint folder's own tokenizer files."""
from __future__ import annotations

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


class Tokenizer:

    def __init__(self, model_path: str, chat_template: str | None = None):
        self._tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)
        if chat_template is not None:
            self._tok.chat_template = load_chat_template(chat_template)

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


class IncrementalDetokenizer:
    """Decodes a growing id list and hands out only the new, complete text (no split UTF-8 characters)."""

    def __init__(self, tokenizer: Tokenizer, stop_words: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop_words = [w for w in stop_words or () if w]
        self.text = ''
        self.stopped = False

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """New text since the last call; after a stop word the rest is dropped."""
        if self.stopped:
            return ''
        full = self.tokenizer.decode(token_ids)
        if not final and full.endswith('\ufffd'):
            full = full.rstrip('\ufffd')
        for word in self.stop_words:
            cut = full.find(word)
            if cut >= 0:
                full, self.stopped = full[:cut], True
        if not full.startswith(self.text):
            return ''
        delta, self.text = full[len(self.text):], full
        return delta
