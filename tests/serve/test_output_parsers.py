"""Reply-text parsers: streamed in any split, they give exactly what the whole reply gives, and never raise."""
from __future__ import annotations

import json
import random

import pytest

from lmdeploy.serve.parsers import ChatOutputParser
from lmdeploy.serve.parsers.reasoning import prompt_opens_thinking

TOOLS = [{'type': 'function', 'function': {'name': 'f', 'parameters': {'properties': {
    'n': {'type': 'integer'}, 'x': {'type': 'number'}, 'ok': {'type': 'boolean'}, 's': {'type': 'string'},
    'o': {'type': 'object'}}}}}]
REPLIES = [
    ('qwen3', '<think>\na < b\n</think>\n\nSure.\n<tool_call>\n{"name": "f", "arguments": {"n": 1}}\n</tool_call>'),
    ('qwen3', 'plain <tool_ text with <think-ish> bits and a </tool_call> stray'),
    ('qwen3', '<tool_call>\n{"name": "f", "arguments": "{\\"n\\": 2}"}\n</tool_call>\n<tool_call>{"name": 5}'
              '</tool_call>'),
    ('qwen3_coder', '<tool_call>\n<function=f>\n<parameter=n>\n7\n</parameter>\n<parameter=x>\n2.5\n</parameter>\n'
                    '<parameter=ok>\ntrue\n</parameter>\n<parameter=s>\n 42 \n</parameter>\n<parameter=o>\n{"a": [1]}\n'
                    '</parameter>\n</function>\n</tool_call>'),
    ('qwen3_coder', '<tool_call>\n<function=f>\n<parameter=n>\nnot a number\n</parameter>\n</function>'),  # unclosed
    ('qwen3_coder', '<tool_call>\n<function=f>\ngarbage\n</function>\n</tool_call> tail'),
]


def _split(text: str, seed: int) -> list[str]:
    rng, pieces, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        pieces.append(text[i:i + n])
        i += n
    return pieces


def _run(parser_name: str, pieces: list[str], prompt: str = '') -> tuple[str, str, list]:
    parser = ChatOutputParser('qwen3', parser_name, TOOLS, prompt)
    outs = [parser.feed(p) for p in pieces] + [parser.feed('', final=True)]
    calls = [(c.name, json.loads(c.arguments)) for o in outs for c in o.tool_calls]
    return ''.join(o.reasoning for o in outs), ''.join(o.content for o in outs), calls


@pytest.mark.parametrize('parser_name,reply', REPLIES)
@pytest.mark.parametrize('seed', [0, 1, 2])
def test_streamed_parse_equals_whole_parse(parser_name, reply, seed):
    assert _run(parser_name, _split(reply, seed)) == _run(parser_name, [reply])


def test_parsed_fields_of_known_replies():
    assert _run('qwen3', [REPLIES[0][1]]) == ('\na < b\n', 'Sure.', [('f', {'n': 1})])
    assert _run('qwen3', [REPLIES[1][1]]) == ('', REPLIES[1][1], [])
    assert _run('qwen3', [REPLIES[2][1]]) == ('', '<tool_call>{"name": 5}</tool_call>', [('f', {'n': 2})])
    assert _run('qwen3_coder', [REPLIES[3][1]])[2] == [
        ('f', {'n': 7, 'x': 2.5, 'ok': True, 's': ' 42 ', 'o': {'a': [1]}})]
    # an unclosed block at the end of the reply still parses; a schema-breaking value stays text
    assert _run('qwen3_coder', [REPLIES[4][1]])[2] == [('f', {'n': 'not a number'})]
    assert _run('qwen3_coder', [REPLIES[5][1]])[1:] == (REPLIES[5][1], [])


def test_reasoning_opened_by_the_prompt():
    assert prompt_opens_thinking('<|im_start|>assistant\n<think>\n')
    assert not prompt_opens_thinking('<|im_start|>assistant\n<think>\n\n</think>\n\n')
    assert _run('qwen3', ['still thinking', '</think>', 'done'], prompt='<think>\n') == ('still thinking', 'done', [])
    # a reply cut off inside its reasoning is all reasoning
    assert _run('qwen3', ['<think>abc </thi'])[:2] == ('abc </thi', '')
