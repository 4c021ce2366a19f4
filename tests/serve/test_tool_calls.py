"""Tool calls and reasoning through the OpenAI server, checked with the official `openai` client.

The models are scripted (`scripted_model.py`): their weights make them emit a fixed reply with `<think>` and
`<tool_call>` blocks, so every field the server derives from the reply is known exactly.
"""
from __future__ import annotations

import json

import pytest
from chat_templates import QWEN3, QWEN3_5, QWEN3_5_PROMPT_ENDS, QWEN3_PROMPT_ENDS
from live_server import live_server
from scripted_model import save_scripted_model
from transformers import AutoTokenizer

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.openai.api_server import create_app

WEATHER_TOOL = {'type': 'function', 'function': {
    'name': 'get_weather', 'description': 'Weather forecast for a city',
    'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}, 'days': {'type': 'integer'}},
                   'required': ['city']}}}
ASK = [{'role': 'user', 'content': 'What is the weather in Paris?'}]

# Qwen3: the model opens <think> itself; JSON tool call.
QWEN3_SCRIPT = ['<think>', '\nThe user wants the weather', ' in Paris.\n', '</think>', '\n\nLet me check.\n',
                '<tool_call>', '\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n',
                '</tool_call>']
# Qwen3.5: the template opened <think>; XML tool call; two calls in a row.
QWEN3_5_SCRIPT = ['Weather needed for Paris.\n', '</think>', '\n\n<tool_call>\n<function=get_weather>\n',
                  '<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n',
                  '</tool_call>', '\n<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n',
                  '</function>\n</tool_call>']
THINKER_SCRIPT = ['Short thought.\n', '</think>', '\n\nThe answer is 42.']
MALFORMED_SCRIPT = ['<think>', 'Hmm.', '</think>', '\n\nCalling.', '<tool_call>', '\n{"name": "get_weather", ',
                    '"arguments": {"city": \n', '</tool_call>']


def reference_len(tok, messages, **kwargs) -> int:
    """Prompt length as transformers renders and encodes it."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return len(tok.encode(text, add_special_tokens=False))


def engine_config(block_size: int = 16) -> PytorchEngineConfig:
    return PytorchEngineConfig(device_type='cpu', block_size=block_size, max_batch_size=8, num_gpu_blocks=256,
                               enable_prefix_caching=True)


@pytest.fixture(scope='module')
def servers(tmp_path_factory):
    """name -> (Live, model path) for the three scripted models, each behind its own server."""
    specs = {'qwen3': (QWEN3_SCRIPT, QWEN3, QWEN3_PROMPT_ENDS, 'qwen3'),
             'qwen3_5': (QWEN3_5_SCRIPT, QWEN3_5, QWEN3_5_PROMPT_ENDS, 'qwen3_coder'),
             'malformed': (MALFORMED_SCRIPT, QWEN3, QWEN3_PROMPT_ENDS, 'qwen3'),
             'thinker': (THINKER_SCRIPT, QWEN3_5, QWEN3_5_PROMPT_ENDS, 'qwen3_coder')}
    engines, contexts, out = [], [], {}
    try:
        for name, (script, template, ends, tool_parser) in specs.items():
            path = save_scripted_model(str(tmp_path_factory.mktemp(name)), script, template, ends)
            # the thinker's turns are short: small blocks let the cache show where turn 2 diverges
            engine = AsyncEngine(path, engine_config(4 if name == 'thinker' else 16), model_name=name)
            engines.append(engine)
            ctx = live_server(create_app(engine, reasoning_parser='qwen3', tool_call_parser=tool_parser))
            contexts.append(ctx)
            out[name] = (ctx.__enter__(), path)
        yield out
    finally:
        for ctx in contexts:
            ctx.__exit__(None, None, None)
        for engine in engines:
            engine.close()


def _stream(client, **kwargs):
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls: dict[int, dict] = {}
    for d in deltas:
        for call in d.tool_calls or ():
            entry = calls.setdefault(call.index, {'id': '', 'name': '', 'arguments': ''})
            entry['id'] += call.id or ''
            entry['name'] += call.function.name or ''
            entry['arguments'] += call.function.arguments or ''
    reasoning = ''.join(getattr(d, 'reasoning_content', None) or '' for d in deltas)
    content = ''.join(d.content or '' for d in deltas)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


def test_qwen3_json_tool_call_arrives_in_tool_calls(servers):
    live, _ = servers['qwen3']
    r = live.client().chat.completions.create(model='qwen3', messages=ASK, tools=[WEATHER_TOOL], temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == 'tool_calls'
    assert choice.message.reasoning_content == '\nThe user wants the weather in Paris.\n'
    assert choice.message.content == 'Let me check.'
    (call,) = choice.message.tool_calls
    assert call.type == 'function' and call.id.startswith('call_')
    assert call.function.name == 'get_weather'
    assert json.loads(call.function.arguments) == {'city': 'Paris', 'days': 3}
    assert r.usage.completion_tokens == len(QWEN3_SCRIPT)


def test_qwen3_streaming_tool_call_and_reasoning_deltas_match_the_full_reply(servers):
    live, _ = servers['qwen3']
    reasoning, content, calls, finish = _stream(live.client(), model='qwen3', messages=ASK, tools=[WEATHER_TOOL],
                                                temperature=0)
    assert reasoning == '\nThe user wants the weather in Paris.\n'
    assert content == 'Let me check.'
    assert [(c['name'], json.loads(c['arguments'])) for c in calls] == [('get_weather', {'city': 'Paris', 'days': 3})]
    assert finish == ['tool_calls']


def test_qwen3_5_xml_tool_calls_convert_arguments_by_schema(servers):
    live, _ = servers['qwen3_5']
    r = live.client().chat.completions.create(model='qwen3_5', messages=ASK, tools=[WEATHER_TOOL], temperature=0)
    msg = r.choices[0].message
    assert msg.reasoning_content == 'Weather needed for Paris.\n'
    assert msg.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ('get_weather', {'city': 'Paris', 'days': 3}), ('get_weather', {'city': 'Lyon'})]
    assert len({c.id for c in msg.tool_calls}) == 2
    reasoning, content, calls, finish = _stream(live.client(), model='qwen3_5', messages=ASK, tools=[WEATHER_TOOL],
                                                temperature=0)
    assert (reasoning, content, finish) == ('Weather needed for Paris.\n', '', ['tool_calls'])
    assert [json.loads(c['arguments']) for c in calls] == [{'city': 'Paris', 'days': 3}, {'city': 'Lyon'}]


def test_without_tools_the_block_stays_content_and_reasoning_is_still_split(servers):
    live, _ = servers['qwen3']
    r = live.client().chat.completions.create(model='qwen3', messages=ASK, temperature=0)
    msg = r.choices[0].message
    assert msg.tool_calls is None and r.choices[0].finish_reason == 'stop'
    assert msg.reasoning_content == '\nThe user wants the weather in Paris.\n'
    assert msg.content == ''.join(QWEN3_SCRIPT[4:]).lstrip('\n')


def test_tool_choice_none_hides_tools_from_the_template(servers):
    live, path = servers['qwen3']
    with_tools = live.client().chat.completions.create(model='qwen3', messages=ASK, tools=[WEATHER_TOOL],
                                                       temperature=0, max_tokens=1)
    none = live.client().chat.completions.create(model='qwen3', messages=ASK, tools=[WEATHER_TOOL],
                                                 tool_choice='none', temperature=0)
    tok = AutoTokenizer.from_pretrained(path)
    assert with_tools.usage.prompt_tokens == reference_len(tok, ASK, tools=[WEATHER_TOOL])
    assert none.usage.prompt_tokens == reference_len(tok, ASK) < with_tools.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None


def test_malformed_tool_call_degrades_to_content(servers):
    live, _ = servers['malformed']
    r = live.client().chat.completions.create(model='malformed', messages=ASK, tools=[WEATHER_TOOL], temperature=0)
    msg = r.choices[0].message
    assert msg.tool_calls is None and r.choices[0].finish_reason == 'stop'
    assert msg.reasoning_content == 'Hmm.'
    assert msg.content == 'Calling.' + ''.join(MALFORMED_SCRIPT[4:])
    reasoning, content, calls, _ = _stream(live.client(), model='malformed', messages=ASK, tools=[WEATHER_TOOL],
                                           temperature=0)
    assert (reasoning, content, calls) == ('Hmm.', msg.content, [])


def test_history_tool_calls_and_tool_results_reach_the_template(servers):
    live, path = servers['qwen3']
    history = ASK + [
        {'role': 'assistant', 'content': None, 'tool_calls': [
            {'id': 'call_1', 'type': 'function',
             'function': {'name': 'get_weather', 'arguments': '{"city": "Paris", "days": 3}'}}]},
        {'role': 'tool', 'tool_call_id': 'call_1', 'content': '{"forecast": "sunny"}'},
    ]
    r = live.client().chat.completions.create(model='qwen3', messages=history, tools=[WEATHER_TOOL], temperature=0,
                                              max_tokens=1)
    # reference: transformers renders the same history, with arguments as a mapping as HF documents it
    reference = [dict(m) for m in history]
    reference[1] = {'role': 'assistant', 'content': '', 'tool_calls': [
        {'id': 'call_1', 'type': 'function', 'function': {'name': 'get_weather',
                                                          'arguments': {'city': 'Paris', 'days': 3}}}]}
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(reference, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    assert '<tool_response>\n{"forecast": "sunny"}\n</tool_response>' in text
    assert '"arguments": {"city": "Paris", "days": 3}}' in text
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


def test_chat_template_kwargs_reach_the_template(servers):
    live, path = servers['qwen3']
    tok = AutoTokenizer.from_pretrained(path)
    off = live.client().chat.completions.create(model='qwen3', messages=ASK, temperature=0,
                                                extra_body={'chat_template_kwargs': {'enable_thinking': False}})
    assert off.usage.prompt_tokens == reference_len(tok, ASK, enable_thinking=False) > reference_len(tok, ASK)
    # the prompt closed <think> already: the model's own <think> block now opens inside content
    assert off.choices[0].message.reasoning_content == '\nThe user wants the weather in Paris.\n'


def test_bad_tool_choice_and_template_kwargs_are_400s(servers):
    live, _ = servers['qwen3']
    import openai
    client = live.client()
    with pytest.raises(openai.BadRequestError, match='not in tools'):
        client.chat.completions.create(model='qwen3', messages=ASK, tools=[WEATHER_TOOL],
                                       tool_choice={'type': 'function', 'function': {'name': 'nope'}})
    with pytest.raises(openai.BadRequestError, match='may not set'):
        client.chat.completions.create(model='qwen3', messages=ASK,
                                       extra_body={'chat_template_kwargs': {'add_generation_prompt': False}})


@pytest.mark.parametrize('preserve', [True, False])
def test_preserve_thinking_makes_turn_two_extend_turn_one(servers, preserve):
    """Qwen3.5's template drops history reasoning unless `preserve_thinking`: only with it does turn 2's prompt
    start with turn 1's prompt + reply, so the prefix cache serves all of turn 1 (docs/serving.md)."""
    live, path = servers['thinker']
    client, tok = live.client(), AutoTokenizer.from_pretrained(path)
    kwargs = {'chat_template_kwargs': {'preserve_thinking': preserve}}
    first = client.chat.completions.create(model='thinker', messages=ASK, temperature=0, extra_body=kwargs)
    reply = first.choices[0].message
    assert (reply.reasoning_content, reply.content) == ('Short thought.\n', 'The answer is 42.')
    turn2 = ASK + [{'role': 'assistant', 'content': reply.content, 'reasoning_content': reply.reasoning_content},
                   {'role': 'user', 'content': 'And in Lyon?'}]
    second = client.chat.completions.create(model='thinker', messages=turn2, temperature=0, extra_body=kwargs)
    # the reference rendering (transformers) of both turns
    text1 = tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True, preserve_thinking=preserve)
    text2 = tok.apply_chat_template(turn2, tokenize=False, add_generation_prompt=True, preserve_thinking=preserve)
    raw_reply = ''.join(THINKER_SCRIPT)
    assert text2.startswith(text1 + raw_reply) is preserve
    cached = second.usage.prompt_tokens_details.cached_tokens
    turn1_tokens = first.usage.prompt_tokens + first.usage.completion_tokens - 1  # the last token has no KV yet
    if preserve:  # all of turn 1 (to the engine's 4-token blocks) is served from the cache
        assert cached >= turn1_tokens // 4 * 4 > first.usage.prompt_tokens
    else:  # turn 2 diverges where turn 1's reply began
        assert cached <= first.usage.prompt_tokens
