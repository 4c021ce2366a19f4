r"""Tool-call parsers for the Qwen formats, selected with `--tool-call-parser` (LMDeploy's and vLLM's names).

- `qwen3` / `hermes` / `qwen`: JSON in a block, `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`.
- `qwen3_coder` / `qwen3coder` / `qwen3_5`: Qwen3.5's XML,
  `<tool_call>\n<function=f>\n<parameter=k>\nvalue\n</parameter>\n</function>\n</tool_call>`; values are
  converted by the tool's JSON schema (`integer`, `number`, `boolean`, `object`, `array`, `null`), else strings.

`ToolCallSplitter.feed` streams content and calls in order: text outside blocks is content (a partial
`<tool_call>` tag at the end is held back), a block is emitted as one complete `ToolCall` when it closes. A
block that does not parse, or is still open when the reply ends and does not parse then, is content verbatim.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import NamedTuple

from .tags import partial_tag_len

CALL_OPEN, CALL_CLOSE = '<tool_call>', '</tool_call>'


class ToolCall(NamedTuple):
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str

    @classmethod
    def new(cls, name: str, arguments: dict) -> ToolCall:
        return cls(name, json.dumps(arguments, ensure_ascii=False), f'call_{uuid.uuid4().hex[:24]}')


def parse_json_call(body: str, tools: list[dict] | None = None) -> ToolCall | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get('name'), str) or not call['name']:
        return None
    arguments = call.get('arguments', call.get('parameters', {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall.new(call['name'], arguments) if isinstance(arguments, dict) else None


_FUNCTION = re.compile(r'<function=([^>\n]+)>(.*?)(?:</function>\s*$|$)', re.S)
_PARAMETER = re.compile(r'<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>', re.S)


def _schema_types(tools: list[dict] | None, name: str) -> dict[str, object]:
    for tool in tools or ():
        function = tool.get('function') or {}
        if function.get('name') == name:
            properties = (function.get('parameters') or {}).get('properties') or {}
            return {k: (v or {}).get('type') for k, v in properties.items() if isinstance(v, dict)}
    return {}


def _convert(value: str, kind) -> object:
    kinds = kind if isinstance(kind, list) else [kind]
    if 'string' in kinds or not any(k in kinds for k in ('integer', 'number', 'boolean', 'object', 'array', 'null')):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value  # the model broke the schema: keep its text rather than drop the argument


def parse_xml_call(body: str, tools: list[dict] | None = None) -> ToolCall | None:
    match = _FUNCTION.fullmatch(body.strip())
    if match is None:
        return None
    name, inner = match.group(1).strip(), match.group(2)
    types = _schema_types(tools, name)
    arguments = {key.strip(): _convert(value, types.get(key.strip())) for key, value in _PARAMETER.findall(inner)}
    if _PARAMETER.sub('', inner).strip():
        return None  # text that is not a parameter: not a call we understand
    return ToolCall.new(name, arguments)


class ToolCallSplitter:
    """Streaming split of content text into (content, tool calls)."""

    def __init__(self, parse_body, tools: list[dict] | None = None):
        self.parse_body = parse_body
        self.tools = tools
        self.in_call = False
        self.buffer = ''
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> list[str | ToolCall]:
        """Content strings and tool calls, in the order they appear."""
        self.buffer += text
        events: list[str | ToolCall] = []
        content = calls = events
        while True:
            if not self.in_call:
                start = self.buffer.find(CALL_OPEN)
                if start < 0:
                    keep = 0 if final else partial_tag_len(self.buffer, CALL_OPEN)
                    content.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self.buffer[:start])
                self.buffer, self.in_call = self.buffer[start + len(CALL_OPEN):], True
                continue
            end = self.buffer.find(CALL_CLOSE)
            if end < 0 and not final:
                break
            body = self.buffer if end < 0 else self.buffer[:end]
            call = self.parse_body(body.strip(), self.tools)
            if call is not None:
                calls.append(call)
            else:
                content.append(CALL_OPEN + body + ('' if end < 0 else CALL_CLOSE))
            self.buffer = '' if end < 0 else self.buffer[end + len(CALL_CLOSE):]
            self.in_call = False
            if end < 0:
                break
        self.num_calls += sum(isinstance(e, ToolCall) for e in events)
        return [e for e in events if e != '']


TOOL_CALL_PARSERS = {
    'qwen3': parse_json_call, 'hermes': parse_json_call, 'qwen': parse_json_call, 'qwen2d5': parse_json_call,
    'qwen3_coder': parse_xml_call, 'qwen3coder': parse_xml_call, 'qwen3_5': parse_xml_call,
}
