"""Parsers that split a model's raw reply text into OpenAI fields: `reasoning_content`, `content`, `tool_calls`.

They work on text deltas as they stream (`ChatOutputParser.feed`), hold back only text that may still turn out to
be a tag, and never raise on model output: anything they cannot parse is content.
"""
from .output_parser import ChatOutputParser, ParsedDelta
from .reasoning import REASONING_PARSERS, ReasoningSplitter
from .tool_calls import TOOL_CALL_PARSERS, ToolCall, ToolCallSplitter

__all__ = ['ChatOutputParser', 'ParsedDelta', 'REASONING_PARSERS', 'ReasoningSplitter', 'TOOL_CALL_PARSERS',
           'ToolCall', 'ToolCallSplitter']
