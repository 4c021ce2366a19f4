"""Reasoning parsers: `<think>...</think>` (Qwen3, Qwen3.5, Qwen3-Next) into `reasoning_content`.

Whether the reply starts inside a reasoning block is decided by the rendered prompt: templates that open
`<think>\n` in the generation prompt (Qwen3.5, Qwen3 thinking models) make the model's first token reasoning; a
reply that itself starts with `<think>` is reasoning too. Otherwise the reply is content until a `<think>` opens.
"""
from __future__ import annotations

from .tags import partial_tag_len

THINK_OPEN, THINK_CLOSE = '<think>', '</think>'


def prompt_opens_thinking(prompt: str) -> bool:
    """True when the prompt ends inside an unclosed `<think>` block (ignoring trailing whitespace)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


class ReasoningSplitter:
    """Streaming split of reply text into (reasoning, content); `feed` returns the new part of each.

    States: `start` (the reply may still open with `<think>`), `reasoning`, `after` (just closed: leading newlines
    are dropped), `content`. Invariant: text is emitted at most once; held back only while it may begin a tag.
    """

    def __init__(self, in_reasoning: bool = False):
        self.state = 'reasoning' if in_reasoning else 'start'
        self.buffer = ''

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buffer += text
        reasoning, content = [], []
        while True:
            if self.state == 'start':
                head = self.buffer.lstrip()
                if head.startswith(THINK_OPEN):
                    self.buffer, self.state = head[len(THINK_OPEN):], 'reasoning'
                elif THINK_OPEN.startswith(head) and not final:
                    break  # '', '<', '<th', ...: may still open a block
                else:
                    self.state = 'content'
            elif self.state == 'reasoning':
                end = self.buffer.find(THINK_CLOSE)
                if end < 0:
                    keep = 0 if final else partial_tag_len(self.buffer, THINK_CLOSE)
                    reasoning.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                reasoning.append(self.buffer[:end])
                self.buffer, self.state = self.buffer[end + len(THINK_CLOSE):], 'after'
            elif self.state == 'after':
                self.buffer = self.buffer.lstrip('\n')
                if not self.buffer:
                    break
                self.state = 'content'
            else:
                content.append(self.buffer)
                self.buffer = ''
                break
        return ''.join(reasoning), ''.join(content)


# --reasoning-parser names (LMDeploy's and vLLM's): all Qwen thinking models use the same tags.
REASONING_PARSERS = {'qwen3': ReasoningSplitter, 'qwen-qwq': ReasoningSplitter, 'deepseek-r1': ReasoningSplitter}
