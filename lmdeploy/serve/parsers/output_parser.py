"""`ChatOutputParser`: one request's reply text -> reasoning, content and tool calls, streaming or at once.

Order: the reasoning splitter runs first (tool calls inside `<think>` are reasoning, not calls), then the tool-call
splitter on the content. Whitespace next to a tool call (the newlines around blocks) is dropped: trailing
whitespace of content is held until more content follows, and dropped when a call follows.
"""
from __future__ import annotations

from typing import NamedTuple

from .reasoning import REASONING_PARSERS, prompt_opens_thinking
from .tool_calls import TOOL_CALL_PARSERS, ToolCall, ToolCallSplitter


class ParsedDelta(NamedTuple):
    content: str
    reasoning: str
    tool_calls: list[ToolCall]


class ChatOutputParser:

    def __init__(self, reasoning_parser: str | None, tool_call_parser: str | None, tools: list[dict] | None,
                 prompt: str = ''):
        self.reasoning = (REASONING_PARSERS[reasoning_parser](prompt_opens_thinking(prompt))
                          if reasoning_parser else None)
        self.tools = (ToolCallSplitter(TOOL_CALL_PARSERS[tool_call_parser], tools)
                      if tool_call_parser and tools else None)
        self.held_space = ''  # trailing whitespace of the content so far, emitted once more content follows
        self.after_call = False

    @property
    def num_tool_calls(self) -> int:
        return self.tools.num_calls if self.tools is not None else 0

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning else ('', text)
        if self.tools is None:
            return ParsedDelta(content, reasoning, [])
        parts, calls = [], []
        for event in self.tools.feed(content, final):
            if isinstance(event, ToolCall):
                calls.append(event)
                self.held_space, self.after_call = '', True
                continue
            text = self.held_space + event
            if self.after_call:
                text = text.lstrip()
            body = text.rstrip()
            self.held_space = text[len(body):]
            if body:
                parts.append(body)
                self.after_call = False
        if final and not self.after_call:
            parts.append(self.held_space)
            self.held_space = ''
        return ParsedDelta(''.join(parts), reasoning, calls)
